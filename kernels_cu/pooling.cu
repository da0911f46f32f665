// Sentence pooling over a padded batch, and L2 normalisation.
// Reference: ftengine/backends/numpy_ops.py pool, l2_normalize.
// Pooled vectors are float32 whatever the hidden states' type: they leave the GPU as float32,
// and rounding them to 16 bits would only add error.

// Columns of one sequence's hidden states (`len` rows, stride H) pooled with `mode`:
// 0 cls, 1 max, 2 mean, 3 mean_sqrt_len, 4 lasttoken, 5 weightedmean (token s weighs s + 1),
// over tokens skip..len-1 (the first `skip`, a prompt's, left out: sentence-transformers'
// include_prompt=false); cls is token `skip` (token 0 if there is none). An empty sequence, or
// one with no token past the prompt, pools to 0 (cls aside).
// A block of W warps takes 32 columns (a lane each, x pointing at the lane's column of row 0;
// `live`: the column is within H); warp w takes rows skip + w, skip + w + W, ..., and warp 0 adds
// the warps' parts in warp order (the same sum whatever the timing) and returns the pooled value
// (other warps return 0). ops.py picks W (figures in kernels.py at POOL_WARPS).
template <int W, typename T>
__device__ __forceinline__ float pool_columns(const T* x, int len, int H, bool live, int mode, int skip) {
    __shared__ float part[W][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool rows = len > skip && mode != 0 && mode != 4;
    float r = mode == 1 ? -FT_INFINITY : 0.0f;
    if (live && rows) {
        #pragma unroll 4
        for (int s = skip + warp; s < len; s += W) {
            const float v = to_float(x[(long)s * H]);
            r = mode == 1 ? fmaxf(r, v) : r + (mode == 5 ? (float)(s + 1) * v : v);
        }
    }
    part[warp][lane] = r;
    __syncthreads();
    if (warp != 0 || !live || len <= 0) return 0.0f;
    if (mode == 0) return to_float(x[(long)(len > skip ? skip : 0) * H]);
    if (len <= skip) return 0.0f;
    if (mode == 4) return to_float(x[(long)(len - 1) * H]);
    float acc = part[0][lane];
    #pragma unroll
    for (int w = 1; w < W; ++w) acc = mode == 1 ? fmaxf(acc, part[w][lane]) : acc + part[w][lane];
    if (mode == 1) return acc;
    if (mode == 5) return acc / (0.5f * ((float)len * (float)(len + 1) - (float)skip * (float)(skip + 1)));
    const float n = (float)(len - skip);
    return mode == 2 ? acc / n : acc / sqrtf(n);
}

// Padded layout.
// grid (B, ceil(H / 32)), W warps a block; writes out[b, offset + h] for one mode.
template <typename T, int W>
__global__ void __launch_bounds__(W * 32) pool(
        float* __restrict__ out,          // (B, out_stride)
        const T* __restrict__ hidden,     // (B*S, H)
        const int* __restrict__ lengths,  // (B,)
        int S, int H, int out_stride, int offset, int mode, int skip) {
    wait_for_previous();
    const int b = blockIdx.x, h = blockIdx.y * 32 + (threadIdx.x & 31);
    const float v = pool_columns<W>(hidden + (long)b * S * H + h, lengths[b], H, h < H, mode, skip);
    if (threadIdx.x < 32 && h < H) out[(long)b * out_stride + offset + h] = v;
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
template <typename T, int W>
__global__ void __launch_bounds__(W * 32) pool_packed(
        float* __restrict__ out,             // (B, out_stride)
        const T* __restrict__ hidden,        // (T, H)
        const int* __restrict__ cu_seqlens,  // (B + 1,)
        int H, int out_stride, int offset, int mode, int skip) {
    wait_for_previous();
    const int b = blockIdx.x, h = blockIdx.y * 32 + (threadIdx.x & 31);
    const int start = cu_seqlens[b];
    const float v = pool_columns<W>(hidden + (long)start * H + h, cu_seqlens[b + 1] - start, H, h < H, mode, skip);
    if (threadIdx.x < 32 && h < H) out[(long)b * out_stride + offset + h] = v;
}
