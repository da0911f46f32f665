// out (M, N) = x (M, K) @ W (N, K)^T for a few rows (M <= GEMV_ROWS: a decode step's tokens),
// where a GEMM is a read of the weights: one block per GEMV_COLS output columns, its GEMV_WARPS
// warps splitting K, lanes with 16-byte loads (VEC elements); every row of x (small, cached)
// against the same weight loads; float accumulation, warp sums, then a sum over the warps.
// Optional epilogue (`epilogue` 1 + form): + bias, then GELU (form as gelu() in common.cuh).
// OutT may be float while T is 16-bit (the LM head's logits).
// grid (ceil(N / GEMV_COLS)), block GEMV_WARPS * 32.
// Reference: ftengine/backends/numpy_ops.py matmul, matmul_bias_gelu.

#define GEMV_ROWS 4
#define GEMV_COLS 2
#define GEMV_WARPS 4

template <typename T, typename OutT, int VEC>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv(OutT* __restrict__ out, const T* __restrict__ x,
                                                        const T* __restrict__ w, const T* __restrict__ bias,
                                                        int M, int N, int K, int epilogue) {
    wait_for_previous();
    __shared__ float partial[GEMV_WARPS][GEMV_ROWS * GEMV_COLS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = blockIdx.x * GEMV_COLS;
    float acc[GEMV_ROWS][GEMV_COLS];
    #pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        #pragma unroll
        for (int c = 0; c < GEMV_COLS; ++c) acc[r][c] = 0.0f;
    }
    #pragma unroll 2
    for (int k = threadIdx.x * VEC; k < K; k += blockDim.x * VEC) {
        float wv[GEMV_COLS][VEC];
        #pragma unroll
        for (int c = 0; c < GEMV_COLS; ++c) {
            if (n0 + c < N) {
                load_floats<T, VEC>(wv[c], w + (long)(n0 + c) * K + k);
            } else {
                #pragma unroll
                for (int i = 0; i < VEC; ++i) wv[c][i] = 0.0f;
            }
        }
        #pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            if (r < M) {
                float xv[VEC];
                load_floats<T, VEC>(xv, x + (long)r * K + k);
                #pragma unroll
                for (int c = 0; c < GEMV_COLS; ++c) {
                    #pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[r][c] += xv[i] * wv[c][i];
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        if (r < M) {  // uniform: the whole warp shuffles
            #pragma unroll
            for (int c = 0; c < GEMV_COLS; ++c) {
                const float v = warp_sum(acc[r][c]);
                if (lane == 0) partial[warp][r * GEMV_COLS + c] = v;
            }
        }
    }
    __syncthreads();
    const int r = threadIdx.x / GEMV_COLS, n = n0 + threadIdx.x % GEMV_COLS;
    if (r < M && n < N) {
        float v = 0.0f;
        #pragma unroll
        for (int i = 0; i < GEMV_WARPS; ++i) v += partial[i][threadIdx.x];
        out[(long)r * N + n] = from_float<OutT>(epilogue ? gelu(v + to_float(bias[n]), epilogue - 1) : v);
    }
}
