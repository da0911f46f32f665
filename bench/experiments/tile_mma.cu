// An experiment (bench/experiments/tile_mma.py checks and times it; the package does not use it: it
// ran slower than cuBLASLt + the bias + GELU pass at every shape tried, figures there).
// Compiled after common.cuh.

// out (M, N) = x (M, K) @ W (N, K)^T for a few hundred rows of 16-bit x and W (a short batch's
// products), with the epilogue fused (as gemv: 1 + form: + bias, then GELU), on
// tensor cores: mma.sync m16n8k16 with x as A and W's rows as B's columns. A block owns a BM x BN
// tile of out; its WM x WN x KS warps a (BM / WM) x (BN / WN) tile each, the KS groups of them
// taking turns at the k16 steps of each K step (their sums added in shared memory at the end, in
// group order), so that a block of few tiles still has warps enough to hide the latency of its
// instructions. K goes by in steps of BK, STAGES of them in flight: cp.async copies each step's
// x rows and W rows (16-byte chunks; rows past M or N and chunks past K as zeros) into shared
// memory rows padded to BK + 8 elements (conflict-free ldmatrix), refilling the stage read the
// step before; each warp loads the next k16 step's fragments before the products of this one.
// The epilogue runs on the float sums, not on a stored and reloaded product.
// K a multiple of 8, N even; x, W 16-byte aligned (tile_mma.py's shapes are).
// grid (ceil(N / BN), ceil(M / BM)), block WM * WN * KS * 32, dynamic shared memory the larger of
// STAGES (BM + BN) (BK + 8) elements and the sums of KS - 1 groups (tile_mma.py shared_bytes).
// Reference: ftengine/backends/numpy_ops.py matmul, matmul_bias_gelu.

template <typename T, int BM, int BN, int WM, int WN, int KS, int BK, int STAGES>
__global__ void __launch_bounds__(WM * WN * KS * 32) tile_mma(T* __restrict__ out, const T* __restrict__ x,
                                                              const T* __restrict__ w, const T* __restrict__ bias,
                                                              int M, int N, int K, int epilogue) {
    constexpr int TILE_WARPS = WM * WN, THREADS = TILE_WARPS * KS * 32, LD = BK + 8, CHUNKS = BK / 8;
    constexpr int STAGE = (BM + BN) * LD, TM = BM / WM / 16, TN = BN / WN / 8;  // a warp's m16 and n8 tiles
    constexpr int KK = BK / 16 / KS, SUMS = TM * TN * 4;  // a group's k16 steps of a K step; a lane's sums
    static_assert(TN % 2 == 0 && KK * KS * 16 == BK && ((BM + BN) * CHUNKS) % THREADS == 0, "tile shape");
    extern __shared__ __align__(16) unsigned char tile_smem[];
    T* const tiles = reinterpret_cast<T*>(tile_smem);  // stage s: x rows (BM), then W rows (BN)
    wait_for_previous();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = warp / TILE_WARPS, tw = warp % TILE_WARPS;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN, steps = (K + BK - 1) / BK;
    const int wm0 = (tw / WN) * (BM / WM), wn0 = (tw % WN) * (BN / WN);

    auto load = [&](int stage, int step) {
        #pragma unroll
        for (int it = 0; it < (BM + BN) * CHUNKS / THREADS; ++it) {
            const int i = threadIdx.x + it * THREADS, r = i / CHUNKS, kc = (i % CHUNKS) * 8, k = step * BK + kc;
            const bool is_x = r < BM;
            const int row = is_x ? m0 + r : n0 + r - BM, rows = is_x ? M : N;
            const bool valid = row < rows && k < K;
            const T* src = (is_x ? x : w) + (long)min(row, rows - 1) * K + (valid ? k : 0);
            cp_async_16(smem_addr(tiles + stage * STAGE + r * LD + kc), src, valid);
        }
    };

    float acc[TM][TN][4];
    #pragma unroll
    for (int a = 0; a < TM; ++a) {
        #pragma unroll
        for (int b = 0; b < TN; ++b) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.0f;
        }
    }
    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load(s, s);
        cp_async_commit();
    }
    // ldmatrix: the matrix this lane addresses (lm) and its row (lr); x's four matrices are rows
    // 0-7 / 8-15 by k 0-7 / 8-15 (A's a0..a3), W's are two n8 tiles' k 0-7 / 8-15 (b0, b1 each)
    const int lm = lane >> 3, lr = lane & 7;
    const unsigned x_lane = smem_addr(tiles + (wm0 + (lm & 1) * 8 + lr) * LD + (lm >> 1) * 8 + group * KK * 16);
    const unsigned w_lane = smem_addr(tiles + (BM + wn0 + (lm >> 1) * 8 + lr) * LD + (lm & 1) * 8 + group * KK * 16);
    unsigned a[2][TM][4], b[2][TN / 2][4];
    auto fragments = [&](int f, unsigned stage, int kk) {
        #pragma unroll
        for (int t = 0; t < TM; ++t) ldmatrix_x4(a[f][t], x_lane + stage + (t * 16 * LD + kk * 16) * sizeof(T));
        #pragma unroll
        for (int t = 0; t < TN / 2; ++t) ldmatrix_x4(b[f][t], w_lane + stage + (t * 16 * LD + kk * 16) * sizeof(T));
    };
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // step's stage has arrived for every thread; the one read before is free
        if (step + STAGES - 1 < steps) load((step + STAGES - 1) % STAGES, step + STAGES - 1);
        cp_async_commit();
        const unsigned stage = (step % STAGES) * STAGE * sizeof(T);
        fragments(0, stage, 0);
        #pragma unroll
        for (int kk = 0; kk < KK; ++kk) {
            if (kk + 1 < KK) fragments((kk + 1) & 1, stage, kk + 1);
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int j = 0; j < TN; ++j) {
                    const unsigned(&bj)[4] = b[kk & 1][j / 2];
                    MmaOp<T>::run(acc[i][j], a[kk & 1][i], bj[(j & 1) * 2], bj[(j & 1) * 2 + 1]);
                }
            }
        }
    }
    cp_async_wait<0>();
    if (KS > 1) {  // groups 1.. leave their sums in the stages' memory; group 0 adds them in order
        float* const sums = reinterpret_cast<float*>(tile_smem);
        __syncthreads();
        if (group > 0) {
            #pragma unroll
            for (int i = 0; i < SUMS; ++i)
                sums[(((group - 1) * TILE_WARPS + tw) * SUMS + i) * 32 + lane] = acc[i / (TN * 4)][i / 4 % TN][i % 4];
        }
        __syncthreads();
        if (group > 0) return;
        #pragma unroll
        for (int q = 1; q < KS; ++q) {
            #pragma unroll
            for (int i = 0; i < SUMS; ++i)
                acc[i / (TN * 4)][i / 4 % TN][i % 4] += sums[(((q - 1) * TILE_WARPS + tw) * SUMS + i) * 32 + lane];
        }
    }
    const int g = lane >> 2, c = lane & 3;
    #pragma unroll
    for (int j = 0; j < TN; ++j) {
        const int col = n0 + wn0 + j * 8 + 2 * c;
        if (col >= N) continue;
        const float b0 = epilogue ? to_float(bias[col]) : 0.0f, b1 = epilogue ? to_float(bias[col + 1]) : 0.0f;
        #pragma unroll
        for (int i = 0; i < TM; ++i) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + wm0 + i * 16 + g + 8 * h;
                float v0 = acc[i][j][2 * h] + b0, v1 = acc[i][j][2 * h + 1] + b1;
                if (epilogue) {
                    v0 = gelu(v0, epilogue - 1);
                    v1 = gelu(v1, epilogue - 1);
                }
                if (row < M) *reinterpret_cast<unsigned*>(out + (long)row * N + col) = pack2<T>(v0, v1);
            }
        }
    }
}
