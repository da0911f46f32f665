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

// Bias + activation on the float32 rows of a head after pooling (sentence-transformers Dense
// modules, classification heads): 0 identity, 1 tanh, 2 relu, 3 gelu (erf).
// Reference: ftengine/backends/numpy_ops.py dense. grid (rows), `out` may alias `x`.
template <typename T>
__global__ void add_bias_act(T* out, const T* x, const T* __restrict__ bias, int N, int act) {
    const long base = (long)blockIdx.x * N;
    for (int col = threadIdx.x; col < N; col += blockDim.x) {
        float v = to_float(x[base + col]) + to_float(bias[col]);
        if (act == 1) v = tanhf(v);
        else if (act == 2) v = fmaxf(v, 0.0f);
        else if (act == 3) v = gelu(v, 0);
        out[base + col] = from_float<T>(v);
    }
}
