// Sentence pooling over a padded batch, and L2 normalisation.
// Reference: ftengine/backends/numpy_ops.py pool, l2_normalize.
// Pooled vectors are float32 whatever the hidden states' type: they leave the GPU as float32,
// and rounding them to 16 bits would only add error.

// mode: 0 cls, 1 max, 2 mean, 3 mean_sqrt_len, 4 lasttoken.
// grid (B, ceil(H / blockDim.x)); writes out[b, offset + h] for one mode.
template <typename T>
__global__ void pool(float* __restrict__ out,          // (B, out_stride)
                     const T* __restrict__ hidden,     // (B*S, H)
                     const int* __restrict__ lengths,  // (B,)
                     int S, int H, int out_stride, int offset, int mode) {
    const int b = blockIdx.x;
    const int h = blockIdx.y * blockDim.x + threadIdx.x;
    if (h >= H) return;
    const int len = lengths[b];
    const T* x = hidden + (long)b * S * H + h;
    float r;
    if (mode == 0) {
        r = to_float(x[0]);
    } else if (mode == 4) {
        r = to_float(x[(long)max(len - 1, 0) * H]);
    } else if (mode == 1) {
        r = -FT_INFINITY;
        for (int s = 0; s < len; ++s) r = fmaxf(r, to_float(x[(long)s * H]));
    } else {
        float sum = 0.0f;
        for (int s = 0; s < len; ++s) sum += to_float(x[(long)s * H]);
        const float count = (float)max(len, 1);
        r = (mode == 2) ? sum / count : sum / sqrtf(count);
    }
    out[(long)b * out_stride + offset + h] = r;
}

// One block per row: out = x / max(||x||, 1e-12). `out` may alias `x`.
template <typename T>
__global__ void l2_normalize(T* out, const T* x, int D) {
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
                            int H, int out_stride, int offset, int mode) {
    const int b = blockIdx.x;
    const int h = blockIdx.y * blockDim.x + threadIdx.x;
    if (h >= H) return;
    const int start = cu_seqlens[b], len = cu_seqlens[b + 1] - start;
    const T* x = hidden + (long)start * H + h;
    float r = 0.0f;
    if (len > 0) {
        if (mode == 0) {
            r = to_float(x[0]);
        } else if (mode == 4) {
            r = to_float(x[(long)(len - 1) * H]);
        } else if (mode == 1) {
            r = -FT_INFINITY;
            for (int s = 0; s < len; ++s) r = fmaxf(r, to_float(x[(long)s * H]));
        } else {
            float sum = 0.0f;
            for (int s = 0; s < len; ++s) sum += to_float(x[(long)s * H]);
            r = (mode == 2) ? sum / len : sum / sqrtf((float)len);
        }
    }
    out[(long)b * out_stride + offset + h] = r;
}
