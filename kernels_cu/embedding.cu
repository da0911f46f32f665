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
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    const T* const terms[3] = {word_emb + (long)ids[t] * H, pos_emb + (long)positions[t] * H,
                               type_emb + (long)types[t] * H};
    load_row_sum<T, VEC, ITEMS>(v, valid, terms, H);
    layernorm_row_store<T, VEC, ITEMS>(out + t * H, v, valid, gamma, beta, H, eps, scratch);
}

// Padding-free layout: sequence b owns tokens cu_seqlens[b] .. cu_seqlens[b+1].
// grid (B), block 256: block b sums lengths[0..b) for its offset, writes cu_seqlens[b] and the
// positions 0..len-1 of its tokens; the last block also writes cu_seqlens[B] and position 0
// for the tokens past the last sequence (batch padding), so every gather stays in range.
// Reference: ftengine/backends/numpy_ops.py build_offsets.
__global__ void build_offsets(int* __restrict__ cu_seqlens,     // (B + 1,)
                              int* __restrict__ positions,      // (T,)
                              const int* __restrict__ lengths,  // (B,)
                              int B, int T) {
    __shared__ int scratch[32];
    const int b = blockIdx.x;
    int partial = 0;
    for (int i = threadIdx.x; i < b; i += blockDim.x) partial += lengths[i];
    const int offset = block_sum_int(partial, scratch);
    const int len = lengths[b];
    if (threadIdx.x == 0) {
        cu_seqlens[b] = offset;
        if (b == B - 1) cu_seqlens[B] = offset + len;
    }
    for (int i = threadIdx.x; i < len; i += blockDim.x) positions[offset + i] = i;
    if (b == B - 1)
        for (int i = offset + len + threadIdx.x; i < T; i += blockDim.x) positions[i] = 0;
}
