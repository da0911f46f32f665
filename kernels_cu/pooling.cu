// Sentence pooling over a padded batch, and L2 normalisation.
// Reference: ftengine/backends/numpy_ops.py pool, l2_normalize.
// Pooled vectors are float32 whatever the hidden states' type: they leave the GPU as float32,
// and rounding them to 16 bits would only add error.

// One column of one sequence's hidden states (`len` rows, stride H) pooled with `mode`:
// 0 cls, 1 max, 2 mean, 3 mean_sqrt_len, 4 lasttoken, 5 weightedmean (token s weighs s + 1),
// over tokens skip..len-1 (the first `skip`, a prompt's, left out: sentence-transformers'
// include_prompt=false); cls is token `skip` (token 0 if there is none). An empty sequence, or
// one with no token past the prompt, pools to 0 (cls aside).
template <typename T>
__device__ __forceinline__ float pool_column(const T* x, int len, int H, int mode, int skip) {
    if (len <= 0) return 0.0f;
    if (mode == 0) return to_float(x[(long)(len > skip ? skip : 0) * H]);
    if (len <= skip) return 0.0f;
    if (mode == 4) return to_float(x[(long)(len - 1) * H]);
    if (mode == 1) {
        float r = -FT_INFINITY;
        for (int s = skip; s < len; ++s) r = fmaxf(r, to_float(x[(long)s * H]));
        return r;
    }
    float sum = 0.0f;
    if (mode == 5) {
        for (int s = skip; s < len; ++s) sum += (float)(s + 1) * to_float(x[(long)s * H]);
        return sum / (0.5f * ((float)len * (float)(len + 1) - (float)skip * (float)(skip + 1)));
    }
    for (int s = skip; s < len; ++s) sum += to_float(x[(long)s * H]);
    const float n = (float)(len - skip);
    return mode == 2 ? sum / n : sum / sqrtf(n);
}

// Padded layout.
// grid (B, ceil(H / blockDim.x)); writes out[b, offset + h] for one mode.
template <typename T>
__global__ void pool(float* __restrict__ out,          // (B, out_stride)
                     const T* __restrict__ hidden,     // (B*S, H)
                     const int* __restrict__ lengths,  // (B,)
                     int S, int H, int out_stride, int offset, int mode, int skip) {
    wait_for_previous();
    const int b = blockIdx.x;
    const int h = blockIdx.y * blockDim.x + threadIdx.x;
    if (h >= H) return;
    out[(long)b * out_stride + offset + h] = pool_column(hidden + (long)b * S * H + h, lengths[b], H, mode, skip);
}

// One block per row: out = x / max(||x||, 1e-12). `out` may alias `x`.
template <typename T>
__global__ void l2_normalize(T* out, const T* x, int D) {
    wait_for_previous();
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * D;
    float sq = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = to_float(x[base + i]);
        sq += v * v;
    }
    const float inv = 1.0f / fmaxf(sqrtf(block_sum(sq, scratch)), 1e-12f);
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        out[base + i] = from_float<T>(to_float(x[base + i]) * inv);
}

// Pooling over the padding-free layout: sequence b is rows cu_seqlens[b] .. cu_seqlens[b+1]
// of hidden (T, H). Same modes and grid as `pool`. A sequence of length 0 (batch padding)
// pools to zeros.
template <typename T>
__global__ void pool_packed(float* __restrict__ out,             // (B, out_stride)
                            const T* __restrict__ hidden,        // (T, H)
                            const int* __restrict__ cu_seqlens,  // (B + 1,)
                            int H, int out_stride, int offset, int mode, int skip) {
    wait_for_previous();
    const int b = blockIdx.x;
    const int h = blockIdx.y * blockDim.x + threadIdx.x;
    if (h >= H) return;
    const int start = cu_seqlens[b];
    out[(long)b * out_stride + offset + h] = pool_column(hidden + (long)start * H + h, cu_seqlens[b + 1] - start, H,
                                                         mode, skip);
}
