// Embedding lookup (word + position + token type) fused with LayerNorm.
// Reference: ftengine/backends/numpy_ops.py embed_layernorm.
// One block per token, the summed row in registers (ITEMS vectors of VEC per thread).

template <typename T, int VEC, int ITEMS>
__global__ void embed_layernorm(T* __restrict__ out,              // (T, H)
                                const int* __restrict__ ids,        // (T,)
                                const int* __restrict__ types,      // (T,)
                                const int* __restrict__ positions,  // (T,)
                                const T* __restrict__ word_emb,     // (V, H)
                                const T* __restrict__ pos_emb,      // (P, H)
                                const T* __restrict__ type_emb,     // (TV, H)
                                const T* __restrict__ gamma,        // (H,)
                                const T* __restrict__ beta,         // (H,)
                                int H, float eps) {
    __shared__ float scratch[32];
    const long t = blockIdx.x;
    const T* w = word_emb + (long)ids[t] * H;
    const T* p = pos_emb + (long)positions[t] * H;
    const T* y = type_emb + (long)types[t] * H;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int col = (threadIdx.x + k * blockDim.x) * VEC;
        valid[k] = col < H;
        if (valid[k]) {
            float a[VEC], b[VEC], c[VEC];
            load_floats<T, VEC>(a, w + col);
            load_floats<T, VEC>(b, p + col);
            load_floats<T, VEC>(c, y + col);
            #pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][j] = a[j] + b[j] + c[j];
        }
    }
    layernorm_row_store<T, VEC, ITEMS>(out + t * H, v, valid, gamma, beta, H, eps, scratch);
}
