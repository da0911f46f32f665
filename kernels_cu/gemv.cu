// out (M, N) = x (M, K) @ W (N, K)^T for a few rows (M <= GEMV_ROWS: a decode step's tokens),
// where a GEMM is a read of the weights: one block per COLS output columns, its GEMV_WARPS
// warps splitting K, lanes with 16-byte loads (VEC elements); every row of x (small, cached)
// against the same weight loads; float accumulation, warp sums, then a sum over the warps.
// Optional epilogue (gemv_epilogue): + bias (OutT's type), then GELU, ReLU, SiLU or nothing. A
// block's first threads load its columns' bias as it starts, beside the weights, and stage it in
// shared memory with the sums: not loaded after them, one memory latency less in a block's short
// life (column_bias).
// OutT may be float while T is 16-bit (the LM head's logits).
// grid (ceil(N / COLS)), block GEMV_WARPS * 32 (at least GEMV_ROWS * COLS threads).
// Reference: ftengine/backends/numpy_ops.py matmul, matmul_bias_gelu, matmul_bias_act.

#define GEMV_ROWS 4
#define GEMV_WARPS 4

// The products' epilogue (gemm.py GEMV_EPILOGUES): 0 none; 1 + a GELU form (gelu() in common.cuh):
// + bias, then GELU; 3: + bias; 4: + bias, then ReLU; 5: + bias, then SiLU (as add_bias_act).
// bias: the block's staged bias, n a column of the block.
__device__ __forceinline__ float gemv_epilogue(float v, const float* __restrict__ bias, int n, int epilogue) {
    if (epilogue == 0) return v;
    v += bias[n];
    if (epilogue <= 2) return gelu(v, epilogue - 1);
    if (epilogue == 4) return fmaxf(v, 0.0f);
    if (epilogue == 5) return v / (1.0f + expf(-v));
    return v;
}

// Thread i < COLUMNS: the bias of the block's column n0 + i (0 past N and where the epilogue adds
// none), loaded as the block starts; it stores it in the block's staged bias before the
// __syncthreads that precedes the epilogue (blocks of COLUMNS threads or more).
template <typename B, int COLUMNS>
__device__ __forceinline__ float column_bias(const B* __restrict__ bias, int n0, int N, int epilogue) {
    const int n = n0 + threadIdx.x;
    return epilogue != 0 && threadIdx.x < COLUMNS && n < N ? to_float(bias[n]) : 0.0f;
}

// The end of a gemv block over columns n0 .. n0 + COLS - 1: each warp's sums (acc) meet in shared
// memory (partial), and the block's first M * COLS threads add them in warp order and store them
// through the epilogue, with the block's staged bias (own_bias: column_bias's).
template <typename OutT, int COLS>
__device__ __forceinline__ void gemv_store(OutT* __restrict__ out, const float (&acc)[GEMV_ROWS][COLS],
                                           float (&partial)[GEMV_WARPS][GEMV_ROWS * COLS], float (&staged)[COLS],
                                           float own_bias, int M, int N, int n0, int epilogue) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    #pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        if (r < M) {  // uniform: the whole warp shuffles
            #pragma unroll
            for (int c = 0; c < COLS; ++c) {
                const float v = warp_sum(acc[r][c]);
                if (lane == 0) partial[warp][r * COLS + c] = v;
            }
        }
    }
    if (threadIdx.x < COLS) staged[threadIdx.x] = own_bias;
    __syncthreads();
    const int r = threadIdx.x / COLS, n = n0 + threadIdx.x % COLS;
    if (r < M && n < N) {
        float v = 0.0f;
        #pragma unroll
        for (int i = 0; i < GEMV_WARPS; ++i) v += partial[i][threadIdx.x];
        out[(long)r * N + n] = from_float<OutT>(gemv_epilogue(v, staged, n - n0, epilogue));
    }
}

template <typename T, typename OutT, int VEC, int COLS>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv(OutT* __restrict__ out, const T* __restrict__ x,
                                                        const T* __restrict__ w, const OutT* __restrict__ bias,
                                                        int M, int N, int K, int epilogue) {
    wait_then_launch_next();
    __shared__ float partial[GEMV_WARPS][GEMV_ROWS * COLS];
    __shared__ float staged[COLS];
    const int n0 = blockIdx.x * COLS;
    const float own_bias = column_bias<OutT, COLS>(bias, n0, N, epilogue);
    float acc[GEMV_ROWS][COLS] = {};
    #pragma unroll 2
    for (int k = threadIdx.x * VEC; k < K; k += blockDim.x * VEC) {
        float wv[COLS][VEC];
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
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
                for (int c = 0; c < COLS; ++c) {
                    #pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[r][c] += xv[i] * wv[c][i];
                }
            }
        }
    }
    gemv_store<OutT, COLS>(out, acc, partial, staged, own_bias, M, N, n0, epilogue);
}



// out (M, N) = x (M, K) @ W (N, K)^T for a few rows of 16-bit x and W (SKINNY_ROWS at most: a
// batch's decode step) and many output columns (an LM head: ops.py chooses), where the product is
// a long read of the weights, on tensor cores: mma.sync m16n8k16 takes 16 weight rows as A and 8
// rows of x as B (x row-major is B column-major), so D is a 16 x 8 tile of out^T. A block owns
// 16 TILES output columns; its WARPS warps take K's 32-wide chunks in turn, UNROLL chunks' loads in
// flight. Per chunk, lane (g = lane / 4, c = lane % 4) loads 16 bytes of weight rows g and g + 8 of
// each tile and of x rows g, g + 8, ...: k 8c .. 8c + 7. Two k16 steps take them as their fragments'
// k pairs {2c, 2c + 1} and {2c + 8, 2c + 9}: one order of k for both operands (the dot product does
// not care), so a fragment is one 16-byte load instead of four 4-byte ones. The warps' sums meet
// in shared memory in fragment order and are added in warp order (the same result every run);
// epilogue as gemv. A grid of S > 1 rows splits K into S slices (whole chunks): block row y sums
// slice y alone into out + y * M * N (OutT float, no epilogue), partial sums that the kernel
// reading the product adds up (decoder.cu residual_layernorm): more blocks for a narrow product.
// K a multiple of 32; x, W 16-byte aligned (ops.py checks).
// grid (ceil(N / (16 * TILES)), S), block WARPS * 32.
// Reference: ftengine/backends/numpy_ops.py matmul, matmul_bias_gelu, matmul_bias_act.

#define SKINNY_ROWS 32

__device__ __forceinline__ uint4 load_streaming(const void* p) {  // read once: no L1 allocation
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <typename T, typename OutT, int TILES, int WARPS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32) skinny_mma(OutT* __restrict__ out, const T* __restrict__ x,
                                                         const T* __restrict__ w, const OutT* __restrict__ bias,
                                                         int M, int N, int K, int epilogue) {
    wait_then_launch_next();
    constexpr int XT = SKINNY_ROWS / 8, VALUES = TILES * XT * 4;  // 8-row tiles of x; sums per lane
    __shared__ float partial[WARPS][VALUES][32];
    __shared__ float staged[16 * TILES];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int n0 = blockIdx.x * 16 * TILES, x_tiles = (M + 7) >> 3, chunks = K >> 5;
    const float own_bias = column_bias<OutT, 16 * TILES>(bias, n0, N, epilogue);
    const int begin = (int)((long)chunks * blockIdx.y / gridDim.y);
    const int end = (int)((long)chunks * (blockIdx.y + 1) / gridDim.y);
    out += (long)blockIdx.y * M * N;
    const T* wp[TILES][2];
    bool w_in[TILES][2];
    #pragma unroll
    for (int t = 0; t < TILES; ++t) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n = n0 + 16 * t + 8 * h + g;
            w_in[t][h] = n < N;
            wp[t][h] = w + (long)min(n, N - 1) * K + 8 * c;
        }
    }
    const T* xp[XT];
    bool x_in[XT];
    #pragma unroll
    for (int j = 0; j < XT; ++j) {
        const int m = 8 * j + g;
        x_in[j] = m < M;  // (then j < x_tiles too)
        xp[j] = x + (long)min(m, M - 1) * K + 8 * c;
    }
    float acc[TILES][XT][4];
    #pragma unroll
    for (int t = 0; t < TILES; ++t) {
        #pragma unroll
        for (int j = 0; j < XT; ++j) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc[t][j][i] = 0.0f;
        }
    }
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int first = begin + warp; first < end; first += UNROLL * WARPS) {
        uint4 wv[UNROLL][TILES][2], xv[UNROLL][XT];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int chunk = first + u * WARPS;
            const long k = (long)chunk * 32;
            #pragma unroll
            for (int t = 0; t < TILES; ++t) {
                #pragma unroll
                for (int h = 0; h < 2; ++h)
                    wv[u][t][h] = chunk < end && w_in[t][h] ? load_streaming(wp[t][h] + k) : zero;
            }
            #pragma unroll
            for (int j = 0; j < XT; ++j)
                xv[u][j] = chunk < end && x_in[j] ? __ldg(reinterpret_cast<const uint4*>(xp[j] + k)) : zero;
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            #pragma unroll
            for (int t = 0; t < TILES; ++t) {
                const unsigned a0[4] = {wv[u][t][0].x, wv[u][t][1].x, wv[u][t][0].y, wv[u][t][1].y};
                const unsigned a1[4] = {wv[u][t][0].z, wv[u][t][1].z, wv[u][t][0].w, wv[u][t][1].w};
                #pragma unroll
                for (int j = 0; j < XT; ++j) {
                    if (j < x_tiles) {  // uniform
                        MmaOp<T>::run(acc[t][j], a0, xv[u][j].x, xv[u][j].y);
                        MmaOp<T>::run(acc[t][j], a1, xv[u][j].z, xv[u][j].w);
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int t = 0; t < TILES; ++t) {
        #pragma unroll
        for (int j = 0; j < XT; ++j) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) partial[warp][(t * XT + j) * 4 + i][lane] = acc[t][j][i];
        }
    }
    if (threadIdx.x < 16 * TILES) staged[threadIdx.x] = own_bias;
    __syncthreads();
    for (int i = threadIdx.x; i < VALUES * 32; i += WARPS * 32) {
        // sum i: lane l's D element e of tile (t, j): output column g (+ 8 for e >= 2), x row 2c + (e & 1)
        const int v = i >> 5, l = i & 31, t = v / (XT * 4), j = (v >> 2) % XT, e = v & 3;
        const int n = n0 + 16 * t + (l >> 2) + 8 * (e >> 1), m = 8 * j + 2 * (l & 3) + (e & 1);
        if (m >= M || n >= N) continue;
        float sum = partial[0][v][l];
        #pragma unroll
        for (int k = 1; k < WARPS; ++k) sum += partial[k][v][l];
        out[(long)m * N + n] = from_float<OutT>(gemv_epilogue(sum, staged, n - n0, epilogue));
    }
}
