// Rotary position embeddings (ModernBERT) on the fused QKV rows, in place, with the QKV bias
// added first, so that attention then reads Q, K, V without a bias. Query and key of every
// head, halves x1 | x2 of D/2: x1 <- x1 cos - x2 sin, x2 <- x2 cos + x1 sin (HF's rotate_half),
// cos / sin = cos_t / sin_t row positions[t] (float32 tables, (P, D/2)).
// Reference: ftengine/backends/numpy_ops.py rotary_qkv. grid (T), each thread whole pairs.

template <typename T>
__global__ void rotary_qkv(T* qkv,                                // (T, 3H)
                           const T* __restrict__ bias,            // (3H,)
                           const int* __restrict__ positions,     // (T,)
                           const float* __restrict__ cos_t,       // (P, D/2)
                           const float* __restrict__ sin_t,       // (P, D/2)
                           int heads, int D) {
    wait_for_previous();
    const int H = heads * D, half = D / 2, pairs = heads * half;
    T* row = qkv + (long)blockIdx.x * 3 * H;
    const float* c = cos_t + (long)positions[blockIdx.x] * half;
    const float* s = sin_t + (long)positions[blockIdx.x] * half;
    for (int i = threadIdx.x; i < 2 * pairs; i += blockDim.x) {
        const int which = i / pairs, r = i - which * pairs;   // which: 0 query, 1 key
        const int h = r / half, j = r - h * half;
        const int c1 = which * H + h * D + j, c2 = c1 + half;
        const float x1 = to_float(row[c1]) + to_float(bias[c1]);
        const float x2 = to_float(row[c2]) + to_float(bias[c2]);
        row[c1] = from_float<T>(x1 * c[j] - x2 * s[j]);
        row[c2] = from_float<T>(x2 * c[j] + x1 * s[j]);
    }
    for (int i = threadIdx.x; i < H; i += blockDim.x)
        row[2 * H + i] = from_float<T>(to_float(row[2 * H + i]) + to_float(bias[2 * H + i]));
}
