// Add bias + GELU, FasterTransformer's add_bias_act; `form` as gelu() in common.cuh.
// Reference: ftengine/backends/numpy_ops.py add_bias_gelu. `out` may alias `x`.
// grid (rows), each thread VEC consecutive columns at a time.

template <typename T, int VEC>
__global__ void add_bias_gelu(T* out, const T* x,          // (T, I)
                              const T* __restrict__ bias,  // (I,)
                              int I, int form) {
    const long base = (long)blockIdx.x * I;
    for (int col = threadIdx.x * VEC; col < I; col += blockDim.x * VEC) {
        float a[VEC], b[VEC];
        load_floats<T, VEC>(a, x + base + col);
        load_floats<T, VEC>(b, bias + col);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) a[j] = gelu(a[j] + b[j], form);
        store_floats<T, VEC>(out + base + col, a);
    }
}
