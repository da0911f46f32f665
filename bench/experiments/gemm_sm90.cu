// Experiments (bench/experiments/gemm_tiles.py checks and times them; the package uses neither, figures
// there), compiled after common.cuh and kernels_cu/gemm_sm90.cu, whose helpers they share: the
// non-persistent form of matmul_wgmma (slower than cuBLASLt + the bias + GELU pass), and below it a
// ping-pong form (no faster than matmul_wgmma).
// out (M, N) = epilogue(x (M, K) @ w (N, K)^T), epilogue 0: none; 1 + form: + bias (N,), then
// GELU in gelu()'s form (common.cuh): 1 erf, 2 tanh (as gemv.cu numbers them).
// Reference: ftengine/backends/numpy_ops.py matmul / matmul_bias_gelu.
//
// A block computes a GEMM_BM x 128 NI tile of out, over K in GEMM_BK steps. One producer warp
// copies each step's x tile (GEMM_BM x GEMM_BK) and w tile (128 NI x GEMM_BK) into shared memory
// with TMA (128-byte swizzle), STAGES steps ahead, each stage's arrival counted on its `full`
// mbarrier. Two consumer warpgroups, 64 rows of the tile each, run wgmma m64n128k16 on the stage
// (fp32 accumulators in registers), then mark it `empty` once those products are done, so that the
// producer may refill it. Rows past M, columns past N and K past the last full step arrive as zeros
// (TMA's out-of-bounds fill); stores are masked. The epilogue adds the bias and applies GELU to the
// fp32 accumulators and rounds once to T.
// grid (ceil(N / (128 NI)), ceil(M / GEMM_BM)), GEMM_THREADS threads: warps 0-7 consume, warp 8
// produces; dynamic shared memory STAGES (GEMM_BM + 128 NI) GEMM_BK elements + 1024 (alignment).

// The epilogue of J x 8 columns from col0 of a thread's accumulator fragments (layout as
// WGMMA_M64N128K16's, J = 16 per 128 columns), rows row0 and row0 + 8: + the tile's bias (sbias:
// float, in shared memory, from col0) and GELU (epilogue > 0) by bias_gelu_fragments, rounded once to
// T; rows past M and columns past N are not stored (N is even).
template <typename T, int J>
__device__ __forceinline__ void store_fragments(T* __restrict__ out, const float* sbias, float* acc, int row0,
                                                int col0, int M, int N, int epilogue) {
    bias_gelu_fragments<J>(acc, sbias, epilogue);
    #pragma unroll
    for (int j = 0; j < J; ++j) {
        const int col = col0 + j * 8 + (threadIdx.x & 3) * 2;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h;
            const float* v = acc + 4 * j + 2 * h;
            if (row < M && col < N) *reinterpret_cast<unsigned*>(out + (long)row * N + col) = pack2<T>(v[0], v[1]);
        }
    }
}

template <typename T, int NI, int STAGES, int MIN_BLOCKS>
__global__ void __launch_bounds__(GEMM_THREADS, MIN_BLOCKS) gemm_wgmma(
        T* __restrict__ out,                   // (M, N)
        const T* __restrict__ bias,            // (N,), read when epilogue > 0
        const __grid_constant__ TmaMap x_map,  // x (M, K): box GEMM_BK x GEMM_BM
        const __grid_constant__ TmaMap w_map,  // w (N, K): box GEMM_BK x 128 NI
        int M, int N, int K, int epilogue) {
    wait_for_previous();
    constexpr int BN = 128 * NI;
    constexpr unsigned A_BYTES = GEMM_BM * GEMM_BK * sizeof(T), STAGE_BYTES = (GEMM_BM + BN) * GEMM_BK * sizeof(T);
    static_assert(GEMM_BK * sizeof(T) == 128, "a tile row is one 128-byte swizzle row");
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES];  // full[STAGES] | empty[STAGES]
    extern __shared__ unsigned char smem_raw[];
    const unsigned tiles = (smem_addr(smem_raw) + 1023u) & ~1023u;  // stage s: x tile | w tile
    const unsigned full = smem_addr(barriers), empty = full + 8 * STAGES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int k_steps = (K + GEMM_BK - 1) / GEMM_BK;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * GEMM_BM;
    if (threadIdx.x == 0) init_stage_barriers<STAGES>(full, empty);
    __syncthreads();

    if (warp == 8) {  // the producer
        if (lane == 0)
            produce_tile<STAGES, A_BYTES, STAGE_BYTES>(0, k_steps, m0, n0, tiles, full, empty, &x_map, &w_map);
        return;
    }

    __shared__ float sbias[BN];
    stage_bias(sbias, bias, n0, BN, N, epilogue, threadIdx.x, 256);
    const int wg = warp >> 2;  // the consumer warpgroup: tile rows 64 wg ..
    float acc[NI][64];
    #pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
        #pragma unroll
        for (int i = 0; i < 64; ++i) acc[ni][i] = 0.0f;
        fence_registers(acc[ni]);
    }
    for (int kt = 0; kt < k_steps; ++kt) {
        const int s = kt % STAGES;
        mbar_wait(full + 8 * s, (kt / STAGES) & 1);
        const unsigned a = tiles + s * STAGE_BYTES + wg * 64 * 128, b = tiles + s * STAGE_BYTES + A_BYTES;
        wgmma_fence();
        #pragma unroll
        for (int k = 0; k < GEMM_BK / 16; ++k) {
            #pragma unroll
            for (int ni = 0; ni < NI; ++ni)
                Wgmma<T, 128>::run(acc[ni], wgmma_desc(a + 32 * k), wgmma_desc(b + ni * 128 * 128 + 32 * k));
        }
        wgmma_commit();
        wgmma_wait<1>();  // the previous step's products are done: its stage may be refilled
        if (kt > 0 && lane == 0) mbar_arrive(empty + 8 * ((kt - 1) % STAGES));
    }
    wgmma_wait<0>();
    #pragma unroll
    for (int ni = 0; ni < NI; ++ni) fence_registers(acc[ni]);

    consumers_sync(1, 256);  // sbias is complete
    const int row0 = m0 + wg * 64 + (warp & 3) * 16 + (lane >> 2);
    #pragma unroll
    for (int ni = 0; ni < NI; ++ni)
        store_fragments<T, 16>(out, sbias + ni * 128, acc[ni], row0, n0 + ni * 128, M, N, epilogue);
}

// Ping-pong (an experiment: gemm_tiles.py candidates ("pp", STAGES)): the persistent matmul_wgmma
// with each consumer warpgroup on a GEMM_BM x PP_BN tile of its own (two m64n128k16 accumulators,
// rows 0-63 and 64-127), so that one warpgroup's epilogue (bias + GELU, its results through shared
// memory and TMA stores) runs while the other's products keep the tensor cores busy. The block's
// tiles (blockIdx.x, then every gridDim.x-th) alternate between the warpgroups: local tile j goes to
// warpgroup j % 2. The producer fills one ring for both in tile order; a warpgroup starts tile j's
// main loop only once the other has issued tile j - 1's (its `done` mbarrier), so the ring is
// consumed in order and each full-barrier wait is at most one phase ahead of the barrier.
// grid (min(SMs, tiles)), GEMM_THREADS threads: warps 0-7 consume, warp 8 produces; dynamic shared
// memory STAGES (GEMM_BM + PP_BN) GEMM_BK + 2 GEMM_BM PP_BN elements + 1024 (alignment).
#define PP_BN 128

template <typename T, int STAGES, int EPILOGUE>
__global__ void __launch_bounds__(GEMM_THREADS, 1) gemm_wgmma_pingpong(
        const T* __restrict__ bias,              // (N,), read when EPILOGUE > 0
        const __grid_constant__ TmaMap x_map,    // x (M, K): box GEMM_BK x GEMM_BM
        const __grid_constant__ TmaMap w_map,    // w (N, K): box GEMM_BK x PP_BN
        const __grid_constant__ TmaMap out_map,  // out (M, N): box 64 x 64
        int M, int N, int K) {
    wait_for_previous();
    constexpr int BN = PP_BN;
    constexpr unsigned A_BYTES = GEMM_BM * GEMM_BK * sizeof(T), STAGE_BYTES = (GEMM_BM + BN) * GEMM_BK * sizeof(T);
    constexpr unsigned HALF_BYTES = 64 * BN * sizeof(T);  // 64 rows of the tile, in smem and in results
    static_assert(GEMM_BK * sizeof(T) == 128, "a tile row is one 128-byte swizzle row");
    // full[STAGES] | empty[STAGES] | done[2]: warpgroup w has issued the main loop of its latest tile
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES + 2];
    __shared__ float sbias[2][2][BN];  // per consumer warpgroup, per tile parity
    extern __shared__ unsigned char smem_raw[];
    const unsigned tiles = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned full = smem_addr(barriers), empty = full + 8 * STAGES, done = empty + 8 * STAGES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int k_steps = (K + GEMM_BK - 1) / GEMM_BK;
    const int n_tiles = (N + BN - 1) / BN, work = n_tiles * ((M + GEMM_BM - 1) / GEMM_BM);
    if (threadIdx.x == 0) {
        mbar_init(done, 4);
        mbar_init(done + 8, 4);
        init_stage_barriers<STAGES>(full, empty, 4);  // each stage is consumed by one warpgroup's 4 warps
    }
    __syncthreads();

    if (warp == 8) {  // the producer
        if (lane == 0)
            produce_tiles<STAGES, A_BYTES, STAGE_BYTES, BN>(work, n_tiles, k_steps, tiles, full, empty, &x_map, &w_map);
        __syncwarp();
        return;
    }
    const int wg = warp >> 2;
    const bool issuer = (threadIdx.x & 127) == 0;  // the thread of the warpgroup that issues its stores
    const unsigned buf = tiles + STAGES * STAGE_BYTES + wg * 2 * HALF_BYTES;
    float acc[2][64];
    int local = 0;
    for (int j = wg; blockIdx.x + j * gridDim.x < work; j += 2, ++local) {
        const int w = blockIdx.x + j * gridDim.x;
        const int m0 = w / n_tiles * GEMM_BM, n0 = w % n_tiles * BN;
        float* bias_tile = sbias[wg][local & 1];
        stage_bias(bias_tile, bias, n0, BN, N, EPILOGUE, threadIdx.x & 127, 128);
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            #pragma unroll
            for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
            fence_registers(acc[h]);
        }
        if (j > 0) mbar_wait(done + 8 * (1 - wg), ((j - 1) / 2) & 1);  // tile j - 1's main loop is issued
        int it = j * k_steps;
        for (int kt = 0; kt < k_steps; ++kt, ++it) {
            const int s = it % STAGES;
            mbar_wait(full + 8 * s, (it / STAGES) & 1);
            const unsigned a = tiles + s * STAGE_BYTES, b = a + A_BYTES;
            wgmma_fence();
            #pragma unroll
            for (int k = 0; k < GEMM_BK / 16; ++k) {
                Wgmma<T, 128>::run(acc[0], wgmma_desc(a + 32 * k), wgmma_desc(b + 32 * k));
                Wgmma<T, 128>::run(acc[1], wgmma_desc(a + 64 * 128 + 32 * k), wgmma_desc(b + 32 * k));
            }
            wgmma_commit();
            wgmma_wait<1>();  // the previous step's products are done: its stage may be refilled
            if (kt > 0 && lane == 0) mbar_arrive(empty + 8 * ((it - 1) % STAGES));
        }
        if (lane == 0) mbar_arrive(done + 8 * wg);  // the other warpgroup may start its next main loop
        wgmma_wait<0>();
        fence_registers(acc[0]);
        fence_registers(acc[1]);
        if (lane == 0) mbar_arrive(empty + 8 * ((it - 1) % STAGES));
        // the previous tile's stores have read this warpgroup's buffer (the issuer's bulk groups)
        if (issuer) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        consumers_sync(1 + wg, 128);  // this tile's bias is staged
        const int row = (warp & 3) * 16 + (lane >> 2);
        unsigned char* own = smem_raw + (buf - smem_addr(smem_raw));
        stage_fragments<T, 16>(own, bias_tile, acc[0], row, EPILOGUE);
        stage_fragments<T, 16>(own + HALF_BYTES, bias_tile, acc[1], row, EPILOGUE);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, to TMA
        consumers_sync(1 + wg, 128);
        if (issuer) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                #pragma unroll
                for (int c = 0; c < BN / 64; ++c)
                    tma_store(&out_map, buf + h * HALF_BYTES + c * 8192, n0 + 64 * c, m0 + 64 * h);
            }
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
    }
    if (issuer) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the last stores, before the block ends
}
