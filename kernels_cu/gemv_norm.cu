// gemv.cu's gemv (this file's source follows gemv.cu's: kernels.py FOLLOWS) whose x is the output
// of the residual + LayerNorm that the product before it left pending, at a decode step: every
// block computes x into shared memory while its first weights are in flight, one kernel where there
// were two (gemm.py norm_matmul). Warp r builds row r (M <= GEMV_WARPS): the product's row (X = T,
// SPLITS 1; or SPLITS float partial sums: load_product_row) + res_bias + the row of hidden, in the
// order decoder.cu residual_layernorm (POST 0: block 0 stores that sum to hidden_out, x = LayerNorm
// of it rounded, rms: T5's RMS norm) or layernorm.cu add_bias_residual_layernorm (POST 1: x =
// LayerNorm of it, which block 0 stores to hidden_out) adds it; hidden_out is not hidden, which the
// other blocks still read. Then gemv's sums over x and its epilogue.
// A block a group of COLS columns; gemm.py launches it only where that is one wave of at most
// NORM_BLOCKS_PER_SM blocks an SM, which its registers allow (_norm_fits: blocks that took two groups
// each measured slower).
// grid ceil(N / COLS), block GEMV_WARPS * 32, dynamic shared memory M * K elements of T; K a multiple
// of VEC, at most 32 * ITEMS * VEC.
// Reference: ftengine/backends/reference/gemm.py norm_matmul.

#define NORM_BLOCKS_PER_SM 4

// The weights of columns n0 .. n0 + COLS - 1 at k (zeros past N or K), as stored: 16 bytes each, not
// kept in the L1, which keeps the rows every block of the SM reads for its LayerNorm.
template <typename T, int VEC, int COLS>
__device__ __forceinline__ void load_columns(Pack<T, VEC> (&dst)[COLS], const T* __restrict__ w, int n0, int N, int K,
                                             int k) {
    static_assert(sizeof(Pack<T, VEC>) == 16, "load_columns moves 16 bytes a column");
    #pragma unroll
    for (int c = 0; c < COLS; ++c) {
        if (n0 + c < N && k < K) {
            *reinterpret_cast<uint4*>(&dst[c]) = load_streaming(w + (long)(n0 + c) * K + k);
        } else {
            #pragma unroll
            for (int i = 0; i < VEC; ++i) dst[c].v[i] = from_float<T>(0.0f);
        }
    }
}

template <typename T, typename X, int SPLITS, typename OutT, int VEC, int COLS, int ITEMS, int POST>
__global__ void __launch_bounds__(GEMV_WARPS * 32, NORM_BLOCKS_PER_SM) gemv_norm(
        OutT* __restrict__ out, const T* __restrict__ w, const OutT* __restrict__ bias, const X* __restrict__ parts,
        const T* __restrict__ res_bias, const T* __restrict__ hidden, T* __restrict__ hidden_out,
        const T* __restrict__ gamma, const T* __restrict__ beta, int M, int N, int K, int epilogue, float eps,
        int rms) {
    wait_then_launch_next();
    using R = RowThreads<GEMV_WARPS>;
    extern __shared__ __align__(16) unsigned char norm_rows[];
    T* xs = reinterpret_cast<T*>(norm_rows);
    __shared__ float partial[GEMV_WARPS][GEMV_ROWS * COLS];
    __shared__ float staged[COLS];
    const int warp = threadIdx.x >> 5;
    const int first = threadIdx.x * VEC, step = blockDim.x * VEC, n0 = blockIdx.x * COLS;
    Pack<T, VEC> next[COLS];
    load_columns<T, VEC, COLS>(next, w, n0, N, K, first);  // in flight through the LayerNorm
    const float own_bias = column_bias<OutT, COLS>(bias, n0, N, epilogue);
    if (warp < M) {
        float v[ITEMS][VEC];
        bool valid[ITEMS];
        load_product_row<T, X, SPLITS, VEC, ITEMS, R>(v, valid, parts, K, warp, M);
        const T* const terms[2] = {res_bias, hidden + (long)warp * K};  // (x + bias) + hidden, as the reference
        add_row_terms<T, VEC, ITEMS, 2, R>(v, valid, terms, K);
        if (!POST) {
            if (blockIdx.x == 0) store_row<T, VEC, ITEMS, R>(hidden_out + (long)warp * K, v, valid);
            round_row<T, VEC, ITEMS>(v, valid);
        }
        layernorm_row<T, VEC, ITEMS, R>(v, valid, gamma, beta, K, eps, nullptr, !POST && rms);
        store_row<T, VEC, ITEMS, R>(xs + warp * K, v, valid);
        if (POST && blockIdx.x == 0) store_row<T, VEC, ITEMS, R>(hidden_out + (long)warp * K, v, valid);
    }
    __syncthreads();
    float acc[GEMV_ROWS][COLS] = {};
    for (int k = first; k < K; k += step) {  // each weight load issued one step ahead
        Pack<T, VEC> cur[COLS];
        #pragma unroll
        for (int c = 0; c < COLS; ++c) cur[c] = next[c];
        if (k + step < K) load_columns<T, VEC, COLS>(next, w, n0, N, K, k + step);
        #pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            if (r < M) {
                float xv[VEC];
                load_floats<T, VEC>(xv, xs + r * K + k);
                #pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    #pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[r][c] += xv[i] * to_float(cur[c].v[i]);
                }
            }
        }
    }
    gemv_store<OutT, COLS>(out, acc, partial, staged, own_bias, M, N, n0, epilogue);
}
