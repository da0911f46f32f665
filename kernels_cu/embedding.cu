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
    wait_for_previous();
    __shared__ float scratch[32];
    const long t = blockIdx.x;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    const T* const terms[3] = {word_emb + (long)ids[t] * H, pos_emb + (long)positions[t] * H,
                               type_emb + (long)types[t] * H};
    load_row_sum<T, VEC, ITEMS>(v, valid, terms, H);
    layernorm_row_store<T, VEC, ITEMS>(out + t * H, v, valid, gamma, beta, H, eps, scratch);
}
