// Add bias + residual + LayerNorm, FasterTransformer's add_bias_input_layernorm, after a product x of
// T (X = T, SPLITS 1) or a product split over K (X float: SPLITS partial sums, see load_product_row).
// Reference: ftengine/backends/numpy_ops.py add_bias_residual_layernorm, matmul_bias_residual_layernorm.
// The row in registers (ITEMS vectors of VEC per thread, see common.cuh), held by a block (WARPS 0:
// grid (rows)) or by one warp of a block of WARPS warps (grid (ceil(rows / WARPS)): ops.py takes it
// for short rows, figures there). `out` may alias `residual`: the whole row is read before any of it
// is written.

template <typename T, typename X, int SPLITS, int VEC, int ITEMS, int WARPS = 0>
__global__ void add_bias_residual_layernorm(T* out,                         // (rows, H)
                                            const X* __restrict__ x,        // (rows, H), or (SPLITS, rows, H) float
                                            const T* __restrict__ bias,     // (H,)
                                            const T* residual,              // (rows, H)
                                            const T* __restrict__ gamma,    // (H,)
                                            const T* __restrict__ beta,     // (H,)
                                            int rows, int H, float eps) {
    wait_for_previous();
    using R = RowThreads<WARPS>;
    __shared__ float scratch[32];
    const int row = R::row();
    if (row >= rows) return;  // (a whole warp of the last block)
    const long base = (long)row * H;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    load_product_row<T, X, SPLITS, VEC, ITEMS, R>(v, valid, x, H, row, rows);
    const T* const terms[2] = {bias, residual + base};  // (x + bias) + residual
    add_row_terms<T, VEC, ITEMS, 2, R>(v, valid, terms, H);
    layernorm_row_store<T, VEC, ITEMS, R>(out + base, v, valid, gamma, beta, H, eps, scratch);
}
