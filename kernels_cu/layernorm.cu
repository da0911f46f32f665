// Add bias + residual + LayerNorm, FasterTransformer's add_bias_input_layernorm.
// Reference: ftengine/backends/numpy_ops.py add_bias_residual_layernorm.
// One block per row, the row in registers (ITEMS vectors of VEC per thread, see common.cuh).
// `out` may alias `residual`: the whole row is read before any of it is written.

template <typename T, int VEC, int ITEMS>
__global__ void add_bias_residual_layernorm(T* out,                         // (T, H)
                                            const T* __restrict__ x,        // (T, H)
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
    const T* const terms[3] = {x + base, bias, residual + base};
    load_row_sum<T, VEC, ITEMS>(v, valid, terms, H);
    layernorm_row_store<T, VEC, ITEMS>(out + base, v, valid, gamma, beta, H, eps, scratch);
}
