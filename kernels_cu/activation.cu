// Add bias + GELU, FasterTransformer's add_bias_act. `form` 0: erf (BERT "gelu"),
// 1: tanh approximation ("gelu_new", "gelu_pytorch_tanh").
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
        for (int j = 0; j < VEC; ++j) {
            const float v = a[j] + b[j];
            if (form == 0) {
                a[j] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
            } else {
                const float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
                a[j] = 0.5f * v * (1.0f + tanhf(inner));
            }
        }
        store_floats<T, VEC>(out + base + col, a);
    }
}
