// Add bias + GELU, FasterTransformer's add_bias_act; `form` as gelu() in common.cuh.
// Reference: ftengine/backends/numpy_ops.py add_bias_gelu. `out` may alias `x`.
// grid (ceil(rows / GELU_ROWS)): a block takes GELU_ROWS rows, each thread VEC columns of each of
// them at a time, so that GELU_ROWS loads are in flight per thread (a memory-bound pass).
#define GELU_ROWS 4

template <typename T, int VEC>
__global__ void add_bias_gelu(T* out, const T* x,          // (rows, I)
                              const T* __restrict__ bias,  // (I,)
                              int I, int rows, int form) {
    wait_for_previous();
    const long row0 = (long)blockIdx.x * GELU_ROWS;
    const int n = min(GELU_ROWS, (int)(rows - row0));
    for (int col = threadIdx.x * VEC; col < I; col += blockDim.x * VEC) {
        float a[GELU_ROWS][VEC], b[VEC];
        #pragma unroll
        for (int r = 0; r < GELU_ROWS; ++r)
            if (r < n) load_floats<T, VEC>(a[r], x + (row0 + r) * I + col);
        load_floats<T, VEC>(b, bias + col);
        #pragma unroll
        for (int r = 0; r < GELU_ROWS; ++r) {
            if (r < n) {
                #pragma unroll
                for (int j = 0; j < VEC; ++j) a[r][j] = gelu(a[r][j] + b[j], form);
                store_floats<T, VEC>(out + (row0 + r) * I + col, a[r]);
            }
        }
    }
}

// GeGLU: out (T, I) = GELU(x[:, :I] + bias[:I]) * (x[:, I:] + bias[I:]), x (T, 2I).
// Reference: ftengine/backends/numpy_ops.py gated_gelu. grid (rows).
template <typename T, int VEC>
__global__ void gated_gelu(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ bias, int I, int form) {
    wait_for_previous();
    const T* in = x + (long)blockIdx.x * 2 * I;
    for (int col = threadIdx.x * VEC; col < I; col += blockDim.x * VEC) {
        float a[VEC], g[VEC], ba[VEC], bg[VEC];
        load_floats<T, VEC>(a, in + col);
        load_floats<T, VEC>(g, in + I + col);
        load_floats<T, VEC>(ba, bias + col);
        load_floats<T, VEC>(bg, bias + I + col);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) a[j] = gelu(a[j] + ba[j], form) * (g[j] + bg[j]);
        store_floats<T, VEC>(out + (long)blockIdx.x * I + col, a);
    }
}

// Bias + activation, a block a row: 0 identity, 1 tanh, 2 relu, 3 gelu (erf), 4 silu (swish); then,
// where `norm` is 1, LayerNorm(gamma, beta, eps) of the row. The float32 rows of a head after pooling
// (sentence-transformers Dense modules, classification heads; ModernBERT's norm), and the relu / silu
// feed-forward of the encoder-decoders. Reference: ftengine/backends/reference dense, add_bias_act.
// grid (rows, column chunks): a row's columns in gridDim.y equal chunks (one where `norm` is 1; many
// for a long row such as a decode step's logits, which one block a row left to a single SM).
// `out` may alias `x`.
template <typename T>
__global__ void add_bias_act(T* out, const T* x, const T* __restrict__ bias, int N, int act, int norm,
                             const float* __restrict__ gamma, const float* __restrict__ beta, float eps) {
    wait_then_launch_next();
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * N;
    const int span = (N + gridDim.y - 1) / gridDim.y, end = min(N, (int)blockIdx.y * span + span);
    float sum = 0.0f;
    for (int col = blockIdx.y * span + threadIdx.x; col < end; col += blockDim.x) {
        float v = to_float(x[base + col]) + to_float(bias[col]);
        if (act == 1) v = tanhf(v);
        else if (act == 2) v = fmaxf(v, 0.0f);
        else if (act == 3) v = gelu(v, 0);
        else if (act == 4) v = v / (1.0f + expf(-v));
        out[base + col] = from_float<T>(v);
        sum += v;
    }
    if (!norm) return;
    // each thread re-reads only the columns it wrote
    const float mean = block_sum(sum, scratch) / N;
    float sq = 0.0f;
    for (int col = threadIdx.x; col < N; col += blockDim.x) {
        const float d = to_float(out[base + col]) - mean;
        sq += d * d;
    }
    const float rstd = rsqrtf(block_sum(sq, scratch) / N + eps);
    for (int col = threadIdx.x; col < N; col += blockDim.x)
        out[base + col] = from_float<T>((to_float(out[base + col]) - mean) * rstd * gamma[col] + beta[col]);
}
