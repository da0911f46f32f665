// Add bias + residual + LayerNorm, FasterTransformer's add_bias_input_layernorm, after a product x of
// T (X = T, SPLITS 1) or a product split over K (X float: SPLITS partial sums, see load_product_row).
// Reference: ftengine/backends/numpy_ops.py add_bias_residual_layernorm, matmul_bias_residual_layernorm.
// One block per row, the row in registers (ITEMS vectors of VEC per thread, see common.cuh).
// `out` may alias `residual`: the whole row is read before any of it is written.

template <typename T, typename X, int SPLITS, int VEC, int ITEMS>
__global__ void add_bias_residual_layernorm(T* out,                         // (T, H)
                                            const X* __restrict__ x,        // (T, H), or (SPLITS, T, H) float
                                            const T* __restrict__ bias,     // (H,)
                                            const T* residual,              // (T, H)
                                            const T* __restrict__ gamma,    // (H,)
                                            const T* __restrict__ beta,     // (H,)
                                            int H, float eps) {
    wait_for_previous();
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * H;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    load_product_row<T, X, SPLITS, VEC, ITEMS>(v, valid, x, H);
    const T* const terms[2] = {bias, residual + base};  // (x + bias) + residual
    add_row_terms<T, VEC, ITEMS, 2>(v, valid, terms, H);
    layernorm_row_store<T, VEC, ITEMS>(out + base, v, valid, gamma, beta, H, eps, scratch);
}
