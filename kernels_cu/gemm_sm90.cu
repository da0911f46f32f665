// Matrix products with the bias + GELU epilogue fused, on Hopper's warpgroup tensor cores (wgmma,
// fed and drained by the tensor memory accelerator; sm_90a only: kernels.py ARCH_SPECIFIC):
// out (M, N) = GELU(x (M, K) @ w (N, K)^T + bias (N,)), EPILOGUE 1: the erf form, 2: the tanh form
// (gelu() in common.cuh), 0: the plain product (the last two for bench/experiments/gemm_tiles.py).
// Reference: ftengine/backends/numpy_ops.py matmul_bias_gelu. ops.py matmul_bias_gelu takes it for
// the erf form where it beat cuBLASLt + the bias + GELU pass (figures in bench/experiments/gemm_tiles.py).
//
// Persistent: gridDim.x blocks (at most one per SM) take the GEMM_BM x BN tiles of out in turn
// (tile blockIdx.x, then every gridDim.x-th; the tiles of a row band one after another, so that the
// blocks at work share their x rows and the weights in the L2). BN (64, 128 or 256) is a template
// parameter: ops.py takes 256 for large products and the narrower tiles where 256 would leave most
// SMs idle (kernels.WGMMA_TILES). One producer warp copies each K step's x tile (GEMM_BM x GEMM_BK)
// and w tile (BN x GEMM_BK) into a ring of STAGES stages in shared memory with TMA (128-byte
// swizzle), each stage's arrival counted on its `full` mbarrier, running on across tiles' ends. Two
// consumer warpgroups, 64 rows of the tile each, run wgmma m64nBNk16 on the stage (fp32
// accumulators in registers) and mark it `empty` once those products are done, so that the
// producer may refill it. Rows past M, columns past N and K past the last full step arrive as zeros
// (TMA's out-of-bounds fill). The epilogue (the bias from shared memory, staged per tile by each
// warpgroup, double-buffered) writes each warpgroup's 64 x BN results into a buffer of its own in
// shared memory, which one of its threads copies out with TMA stores (rows and columns past out's
// are not written); they run on while the warpgroup takes its next tile, which rewrites the buffer
// once they have read it. For at most 64 rows (a short batch) x's box holds 64 rows, both consumer
// warpgroups multiply them on alternate K steps, and warpgroup 1's sums reach warpgroup 0's through
// shared memory before its epilogue. EPILOGUE is a template parameter so that the kernel holds one GELU
// form's unrolled code: with both it outgrew the instruction cache.
// matmul_wgmma_ln (at the end of this file) is the same product with bias + residual + LayerNorm in
// its epilogue, over thread-block clusters that span each row.
// grid (min(SMs, tiles)), GEMM_THREADS threads: warps 0-7 consume, warp 8 produces; dynamic shared
// memory STAGES (GEMM_BM + BN) GEMM_BK + 2 x 64 x BN elements + 1024 (alignment); x, w and out in
// rows of 16-byte multiples, 16-byte aligned (TMA's tensor maps, built by ops.py).

#define GEMM_BM 128
#define GEMM_BK 64
#define GEMM_THREADS 288

// wgmma's shared-memory matrix descriptor of a K-major tile as TMA writes it with the 128-byte
// swizzle: rows of GEMM_BK 16-bit elements (128 bytes), groups of 8 rows 1024 bytes apart (stride
// byte offset), the tile 1024-byte aligned; the leading byte offset is unused by this layout.
// A k16 step within the row is the start address plus 32 bytes.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32)
           | (1ull << 62);
}

// d (64 x 256, fp32, the warpgroup's accumulator fragments) += A (64 x 16) B (16 x 256), A and B
// K-major in shared memory (descriptors). Fragment i of thread t (warp w of the warpgroup, lane l):
// row 16 w + l / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4) + i % 2.
#define WGMMA_M64N256K16(TYPE)                                                                                         \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                         \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"                                     \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                              \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                    \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                    \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                    \
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                    \
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                    \
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "        \
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "   \
                 "%128, %129, p, 1, 1, 0, 0;\n}\n"                                                                     \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),                 \
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),             \
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),          \
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),          \
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),          \
                   "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),          \
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),          \
                   "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),          \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),          \
                   "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),          \
                   "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),          \
                   "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),          \
                   "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),          \
                   "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),          \
                   "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),     \
                   "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),   \
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]),   \
                   "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),   \
                   "+f"(d[126]), "+f"(d[127])                                                                          \
                 : "l"(a), "l"(b), "r"(1))

// The same with 64 x 192, 64 x 128 and 64 x 64 accumulators, fragments laid out alike.
#define WGMMA_M64N192K16(TYPE)                                                                                         \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32." TYPE "." TYPE " {"                                     \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                              \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                    \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                    \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                    \
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                    \
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "                   \
                 "%96, %97, p, 1, 1, 0, 0;\n}\n"                                                                       \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),                 \
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),             \
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),          \
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),          \
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),          \
                   "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),          \
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),          \
                   "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),          \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),          \
                   "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),          \
                   "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),          \
                   "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),          \
                   "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),          \
                   "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])                                     \
                 : "l"(a), "l"(b), "r"(1))

#define WGMMA_M64N128K16(TYPE)                                                                                        \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                        \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "                                     \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                          \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                  \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                  \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                 \
                 "%64, %65, p, 1, 1, 0, 0;\n}\n"                                                                     \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),     \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),           \
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),         \
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),         \
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),         \
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),         \
                   "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),         \
                   "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),         \
                   "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])          \
                 : "l"(a), "l"(b), "r"(1))

#define WGMMA_M64N64K16(TYPE) WGMMA_SS_M64N64K16(TYPE, 1)  // sm90.cuh

// Wgmma<T, BN>::run(d, a, b): the m64nBNk16 product (BN 64, 128, 192 or 256), d's BN / 2 fragments.
template <typename T, int BN> struct Wgmma;
#define WGMMA_STRUCT(BN, MACRO)                                                                                        \
    template <> struct Wgmma<__half, BN> {                                                                             \
        static __device__ __forceinline__ void run(float (&d)[BN / 2], unsigned long long a, unsigned long long b) { \
            MACRO("f16");                                                                                              \
        }                                                                                                              \
    };                                                                                                                 \
    template <> struct Wgmma<__nv_bfloat16, BN> {                                                                      \
        static __device__ __forceinline__ void run(float (&d)[BN / 2], unsigned long long a, unsigned long long b) { \
            MACRO("bf16");                                                                                             \
        }                                                                                                              \
    };
WGMMA_STRUCT(64, WGMMA_M64N64K16)
WGMMA_STRUCT(128, WGMMA_M64N128K16)
WGMMA_STRUCT(192, WGMMA_M64N192K16)
WGMMA_STRUCT(256, WGMMA_M64N256K16)

// Stage s's barriers: full[s] (the producer's arrival + the copies' bytes) and empty[s] (one
// arrival per consumer warp of a stage: `consumers`); by thread 0, after any other barrier of the
// block is initialised (the fence covers them too) and before the block's first barrier.
template <int STAGES>
__device__ __forceinline__ void init_stage_barriers(unsigned full, unsigned empty, unsigned consumers = 8) {
    for (int s = 0; s < STAGES; ++s) {
        mbar_init(full + 8 * s, 1);
        mbar_init(empty + 8 * s, consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// The producer's copies of one tile's k_steps (x rows m0.., w rows n0..) into the ring of STAGES
// stages, from ring step `it` on (each stage refilled once its consumers marked it empty); a stage's
// copies bring `bytes` (STAGE_BYTES, less where x's box has fewer rows than the stage holds).
// Returns the ring step after the tile's last.
template <int STAGES, unsigned A_BYTES, unsigned STAGE_BYTES>
__device__ __forceinline__ int produce_tile(int it, int k_steps, int m0, int n0, unsigned tiles, unsigned full,
                                            unsigned empty, const TmaMap* x_map, const TmaMap* w_map,
                                            unsigned bytes = STAGE_BYTES) {
    for (int kt = 0; kt < k_steps; ++kt, ++it) {
        const int s = it % STAGES;
        if (it >= STAGES) mbar_wait(empty + 8 * s, (it / STAGES - 1) & 1);
        const unsigned a = tiles + s * STAGE_BYTES, bar = full + 8 * s;
        mbar_expect_tx(bar, bytes);
        tma_load(a, x_map, kt * GEMM_BK, m0, bar);
        tma_load(a + A_BYTES, w_map, kt * GEMM_BK, n0, bar);
    }
    return it;
}

// The producer of a persistent kernel: produce_tile for each of the block's BM x BN tiles of out
// (M = rows x BM, N = n_tiles x BN: tile blockIdx.x, then every gridDim.x-th, a row band's tiles one
// after another), in one ring.
template <int STAGES, unsigned A_BYTES, unsigned STAGE_BYTES, int BN>
__device__ __forceinline__ void produce_tiles(int work, int n_tiles, int k_steps, unsigned tiles, unsigned full,
                                              unsigned empty, const TmaMap* x_map, const TmaMap* w_map,
                                              unsigned bytes = STAGE_BYTES) {
    int it = 0;
    for (int w = blockIdx.x; w < work; w += gridDim.x)
        it = produce_tile<STAGES, A_BYTES, STAGE_BYTES>(it, k_steps, w / n_tiles * GEMM_BM, w % n_tiles * BN, tiles,
                                                        full, empty, x_map, w_map, bytes);
}

// acc = GELU(acc + bias) (epilogue > 0; else + bias) on J x 8 columns of a thread's accumulator
// fragments (layout as WGMMA_M64N256K16's), the tile's bias in shared memory (sbias: float), in place
// and with no store among them, so that the GELUs of several fragments overlap (a bias load or a
// branch per fragment serialised them).
template <int J>
__device__ __forceinline__ void bias_gelu_fragments(float* acc, const float* sbias, int epilogue) {
    #pragma unroll
    for (int j = 0; j < J; ++j) {
        const int c = j * 8 + (threadIdx.x & 3) * 2;
        const float b0 = sbias[c], b1 = sbias[c + 1];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v0 = acc[4 * j + 2 * h] + b0, v1 = acc[4 * j + 2 * h + 1] + b1;
            if (epilogue) {
                v0 = gelu(v0, epilogue - 1);
                v1 = gelu(v1, epilogue - 1);
            }
            acc[4 * j + 2 * h] = v0;
            acc[4 * j + 2 * h + 1] = v1;
        }
    }
}

// Where a thread's pair of T of fragment j in row r (of the warpgroup's 64) sits in a result buffer:
// the 64 rows as boxes of 64 columns (8 KB each, rows of 128 bytes in TMA's 128-byte swizzle: row
// r's 16-byte chunk c at c ^ (r % 8)), as tma_store copies them out and tma_load brings them in.
__device__ __forceinline__ unsigned char* fragment_at(unsigned char* buf, int j, int r) {
    return buf + (j / 8) * 8192 + r * 128 + (((j % 8) ^ (r & 7)) << 4) + 4 * (threadIdx.x & 3);
}

// The epilogue of J x 8 columns of a thread's accumulator fragments (layout as WGMMA_M64N256K16's),
// rows row and row + 8 of the warpgroup's 64: + the tile's bias (sbias: float, in shared memory) and
// GELU (epilogue > 0), rounded once to T, written into the result buffer `buf` (fragment_at) for
// tma_store to copy out. A warp's 32-bit writes of one fragment fall in 32 distinct banks.
template <typename T, int J>
__device__ __forceinline__ void stage_fragments(unsigned char* __restrict__ buf, const float* sbias, float* acc,
                                                int row, int epilogue) {
    // bias + GELU on the accumulators first, then the stores (plain C++ stores: asm volatile ones
    // kept the compiler from overlapping the fragments' work)
    bias_gelu_fragments<J>(acc, sbias, epilogue);
    #pragma unroll
    for (int j = 0; j < J; ++j) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            *reinterpret_cast<unsigned*>(fragment_at(buf, j, row + 8 * h)) =
                pack2<T>(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        }
    }
}

// The box of `map` at (inner c0, outer c1) from shared memory at `src` (TMA; rows and columns past
// the tensor are not written), in this thread's current bulk group.
__device__ __forceinline__ void tma_store(const TmaMap* map, unsigned src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(src) : "memory");
}

// sbias[c] = bias[col0 + c] as float for c < count (0 past N or without an epilogue), by the
// `threads` threads of a warpgroup or two (t: 0 .. threads - 1).
template <typename T>
__device__ __forceinline__ void stage_bias(float* sbias, const T* __restrict__ bias, int col0, int count, int N,
                                           int epilogue, int t, int threads) {
    for (int c = t; c < count; c += threads) sbias[c] = epilogue && col0 + c < N ? to_float(bias[col0 + c]) : 0.0f;
}

// A barrier of `threads` consumer threads (named barrier `id` > 0): the producer warp is not in it.
__device__ __forceinline__ void consumers_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

struct NoStepWork {
    __device__ __forceinline__ void operator()(int) const {}
};

// A consumer warpgroup's products of one tile: acc = its x rows (the stage's rows 64 wg .., or with
// split_k all 64 on its own K steps) @ the stage's w rows^T over k_steps K steps of the ring from
// ring step `it` on; returns the ring step after the tile's last. step_work(kt) runs after each K
// step's products are issued, while they run.
template <typename T, int STAGES, int BN, typename StepWork = NoStepWork>
__device__ __forceinline__ int consume_tile(float (&acc)[BN / 2], int it, int k_steps, unsigned tiles, unsigned full,
                                            unsigned empty, int wg, bool split_k, StepWork step_work = {}) {
    constexpr unsigned A_BYTES = GEMM_BM * GEMM_BK * sizeof(T), STAGE_BYTES = (GEMM_BM + BN) * GEMM_BK * sizeof(T);
    #pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    fence_registers(acc);
    for (int kt = 0; kt < k_steps; ++kt, ++it) {
        if (split_k && (kt & 1) != wg) continue;
        const int s = it % STAGES;
        mbar_wait(full + 8 * s, (it / STAGES) & 1);
        const unsigned a = tiles + s * STAGE_BYTES + (split_k ? 0 : wg * 64 * 128);
        const unsigned b = tiles + s * STAGE_BYTES + A_BYTES;
        wgmma_fence();
        #pragma unroll
        for (int k = 0; k < GEMM_BK / 16; ++k) Wgmma<T, BN>::run(acc, wgmma_desc(a + 32 * k), wgmma_desc(b + 32 * k));
        wgmma_commit();
        step_work(kt);
        // this step's products done, its stage is released at once. Keeping them in flight into the
        // next step (releasing each stage after the next step's issue, so after its copies had
        // arrived) left the producer one copy fewer in flight: 3-7% slower (H100, 2026-11-25); with
        // 192-column tiles and four stages, no faster (bench/experiments/gemm_tiles.py).
        wgmma_wait<0>();
        if ((threadIdx.x & 31) == 0) mbar_arrive(empty + 8 * s);
    }
    fence_registers(acc);
    return it;
}

template <typename T, int STAGES, int EPILOGUE, int BN>
__global__ void __launch_bounds__(GEMM_THREADS, 1) matmul_wgmma(
        const T* __restrict__ bias,              // (N,), read when EPILOGUE > 0
        const __grid_constant__ TmaMap x_map,    // x (M, K): box GEMM_BK x GEMM_BM (x 64 where M <= 64)
        const __grid_constant__ TmaMap w_map,    // w (N, K): box GEMM_BK x BN
        const __grid_constant__ TmaMap out_map,  // out (M, N): box 64 x 64
        int M, int N, int K) {
    wait_for_previous();
    constexpr unsigned A_BYTES = GEMM_BM * GEMM_BK * sizeof(T), STAGE_BYTES = (GEMM_BM + BN) * GEMM_BK * sizeof(T);
    static_assert(GEMM_BK * sizeof(T) == 128, "a tile row is one 128-byte swizzle row");
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES];  // full[STAGES] | empty[STAGES]
    __shared__ float sbias[2][2][BN];  // per consumer warpgroup, per tile parity
    extern __shared__ unsigned char smem_raw[];
    // stage s: x tile | w tile; after the stages, the consumer warpgroups' result buffers (64 x BN each)
    const unsigned tiles = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned full = smem_addr(barriers), empty = full + 8 * STAGES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int k_steps = (K + GEMM_BK - 1) / GEMM_BK;
    const int n_tiles = (N + BN - 1) / BN, work = n_tiles * ((M + GEMM_BM - 1) / GEMM_BM);
    // at most 64 rows (a short batch): x's box holds 64 rows (the stage's first half), both consumer
    // warpgroups multiply them, K steps split between them (even steps warpgroup 0, odd ones 1), a
    // stage released by its own warpgroup's 4 warps
    const bool split_k = M <= 64;
    if (threadIdx.x == 0) init_stage_barriers<STAGES>(full, empty, split_k ? 4 : 8);
    __syncthreads();

    if (warp == 8) {  // the producer
        if (lane == 0)
            produce_tiles<STAGES, A_BYTES, STAGE_BYTES, BN>(work, n_tiles, k_steps, tiles, full, empty, &x_map, &w_map,
                                                            split_k ? STAGE_BYTES - A_BYTES / 2 : STAGE_BYTES);
        __syncwarp();
        return;
    }
    const int wg = warp >> 2;
    const bool issuer = (threadIdx.x & 127) == 0;  // the thread of the warpgroup that issues its stores
    const unsigned buf = tiles + STAGES * STAGE_BYTES + wg * (64 * BN * sizeof(T));
    float acc[BN / 2];
    int it = 0, local = 0;
    for (int w = blockIdx.x; w < work; w += gridDim.x, ++local) {
        const int m0 = w / n_tiles * GEMM_BM, n0 = w % n_tiles * BN;
        float* bias_tile = sbias[wg][local & 1];
        stage_bias(bias_tile, bias, n0, BN, N, EPILOGUE, threadIdx.x & 127, 128);
        it = consume_tile<T, STAGES, BN>(acc, it, k_steps, tiles, full, empty, wg, split_k);
        // the previous tile's stores have read this warpgroup's buffer (the issuer's bulk groups)
        if (issuer) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        if (split_k) {  // warpgroup 1's sums, as fp32 in both result buffers (as many bytes), added to 0's
            float* partial = reinterpret_cast<float*>(smem_raw + (tiles + STAGES * STAGE_BYTES - smem_addr(smem_raw)));
            const int t = threadIdx.x & 127;
            consumers_sync(3, 256);
            if (wg == 1) {
                #pragma unroll
                for (int i = 0; i < BN / 2; ++i) partial[i * 128 + t] = acc[i];
            }
            consumers_sync(3, 256);
            if (wg == 1) continue;  // its rows (64 on) lie past M
            #pragma unroll
            for (int i = 0; i < BN / 2; ++i) acc[i] += partial[i * 128 + t];
        }
        // this tile's bias is staged; the other bias buffer's readers are done (and with split_k, every
        // read of the partial sums, before stage_fragments overwrites them)
        consumers_sync(1 + wg, 128);
        stage_fragments<T, BN / 8>(smem_raw + (buf - smem_addr(smem_raw)), bias_tile, acc, (warp & 3) * 16 + (lane >> 2),
                               EPILOGUE);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, to TMA
        consumers_sync(1 + wg, 128);
        if (issuer) {
            #pragma unroll
            for (int c = 0; c < BN / 64; ++c) tma_store(&out_map, buf + c * 8192, n0 + 64 * c, m0 + 64 * wg);
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
    }
    if (issuer) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the last stores, before the block ends
}

// ------------------------------------------------------------------ the product + residual + LayerNorm

// Thread-block clusters (sm_90): this block's rank in its cluster, the cluster's blocks, and a shared
// memory address of this block as the same address in block `rank`'s shared memory.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cluster_blocks() {
    unsigned n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
    return n;
}
__device__ __forceinline__ unsigned cluster_map(unsigned addr, unsigned rank) {
    unsigned out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
    return out;
}
// Every thread of every block of the cluster: the writes before it, visible to all after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// (a, b) into shared memory of a block of the cluster (`dst`, from cluster_map), counted as 8 bytes
// on that block's mbarrier `bar` (also from cluster_map).
__device__ __forceinline__ void store_remote(unsigned dst, float a, float b, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n"
                 :: "r"(dst), "f"(a), "f"(b), "r"(bar) : "memory");
}

// pack2's inverse (common.cuh): the two T of a 32-bit register as floats, lo from the low half.
template <typename T>
__device__ __forceinline__ void unpack2(unsigned v, float& lo, float& hi) {
    const T* p = reinterpret_cast<const T*>(&v);
    lo = to_float(p[0]);
    hi = to_float(p[1]);
}

#define LN_CLUSTER_MAX 2  // kernels.py LN_CLUSTER_MAX

// out (M, N) = LayerNorm(x (M, K) @ w (N, K)^T + bias + residual) (gamma, beta; over each row's N
// columns): BERT's attention output and FFN down-projection with the add_bias_residual_layernorm
// that follows them (layernorm.cu), fused. Reference: ftengine/backends/numpy_ops.py
// add_bias_residual_layernorm of the product (here not rounded to T before the sums).
//
// Thread-block clusters of R = ceil(N / BN) <= LN_CLUSTER_MAX blocks along N: block rank r owns
// columns r BN .. of every row band it takes (row bands cluster, cluster + clusters, ...: the
// persistent tile order of matmul_wgmma, gridDim.x a multiple of R, so that its tiles are those
// columns). The ring and the products are matmul_wgmma's. Per tile, each consumer warpgroup (64
// rows): the residual's 64 x BN box arrives by TMA in its result buffer while its products run; then
// v = acc + bias + residual in float, and per row the mean and the sum of squared deviations of
// this block's columns (the 4 threads holding a row, then shuffles), sent as a pair to the same
// slot of every block of the cluster (st.async, completing on their mbarrier of this warpgroup and
// tile parity); each block combines the R pairs (Chan et al.'s update: no cancellation),
// normalises its columns in registers and stores them through the buffer with TMA. Statistics
// slots and barriers alternate by tile parity: a block sends tile i + 2's pairs only after every
// block has sent tile i + 1's, which each sends after reading tile i's.
// out may alias residual: a tile's residual is read before the same block writes its output.
// grid (a multiple of R, at most SMs), cluster (R), GEMM_THREADS threads; dynamic shared memory as
// matmul_wgmma's; M > 64 (no split_k path); x, w, residual and out as matmul_wgmma's x, w and out.
template <typename T, int STAGES, int BN>
__global__ void __launch_bounds__(GEMM_THREADS, 1) matmul_wgmma_ln(
        const T* __restrict__ bias, const T* __restrict__ gamma, const T* __restrict__ beta,  // (N,) each
        const __grid_constant__ TmaMap x_map,    // x (M, K): box GEMM_BK x GEMM_BM
        const __grid_constant__ TmaMap w_map,    // w (N, K): box GEMM_BK x BN
        const __grid_constant__ TmaMap out_map,  // out (M, N): box 64 x 64
        const __grid_constant__ TmaMap res_map,  // residual (M, N): box 64 x 64
        int M, int N, int K, float eps) {
    wait_for_previous();
    constexpr unsigned A_BYTES = GEMM_BM * GEMM_BK * sizeof(T), STAGE_BYTES = (GEMM_BM + BN) * GEMM_BK * sizeof(T);
    static_assert(GEMM_BK * sizeof(T) == 128, "a tile row is one 128-byte swizzle row");
    // full[STAGES] | empty[STAGES] | residual[2 warpgroups] | statistics[2 warpgroups][2 tile parities]
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES + 6];
    __shared__ float params[3][BN];  // bias, gamma, beta of the block's columns (0 past N): every tile's
    __shared__ float2 stats[2][2][LN_CLUSTER_MAX][64];  // [parity][warpgroup][rank][row]: (mean, M2)
    extern __shared__ unsigned char smem_raw[];
    const unsigned tiles = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned full = smem_addr(barriers), empty = full + 8 * STAGES, res_bar = empty + 8 * STAGES,
                   stat_bar = res_bar + 16;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ranks = cluster_blocks(), rank = cluster_rank();
    const int k_steps = (K + GEMM_BK - 1) / GEMM_BK;
    const int work = ranks * ((M + GEMM_BM - 1) / GEMM_BM);
    const int col0 = rank * BN, cols = min(BN, N - col0);
    for (int c = threadIdx.x; c < BN; c += blockDim.x) {
        const bool in = col0 + c < N;
        params[0][c] = in ? to_float(bias[col0 + c]) : 0.0f;
        params[1][c] = in ? to_float(gamma[col0 + c]) : 0.0f;
        params[2][c] = in ? to_float(beta[col0 + c]) : 0.0f;
    }
    if (threadIdx.x == 0) {
        for (int i = 0; i < 6; ++i) mbar_init(res_bar + 8 * i, 1);
        init_stage_barriers<STAGES>(full, empty);
    }
    cluster_sync();  // every block's barriers initialised before any block's statistics reach them

    if (warp == 8) {  // the producer
        if (lane == 0)
            produce_tiles<STAGES, A_BYTES, STAGE_BYTES, BN>(work, ranks, k_steps, tiles, full, empty, &x_map, &w_map);
        __syncwarp();
        return;
    }
    const int wg = warp >> 2, t = threadIdx.x & 127;
    const bool issuer = t == 0;
    unsigned char* buf = smem_raw + (tiles + STAGES * STAGE_BYTES + wg * (64 * BN * sizeof(T)) - smem_addr(smem_raw));
    const unsigned buf_addr = smem_addr(buf);
    const int row = (warp & 3) * 16 + (lane >> 2);  // the thread's rows of the warpgroup's 64: row, row + 8
    float acc[BN / 2];
    int it = 0, local = 0;
    for (int w = blockIdx.x; w < work; w += gridDim.x, ++local) {
        const int m0 = w / ranks * GEMM_BM + 64 * wg, parity = local & 1;
        // the residual's box, once the last tile's stores have read the buffer: copied from the second K
        // step on (waiting for those reads at the tile's start held the warpgroup's first products back)
        const int load_step = min(1, k_steps - 1);
        it = consume_tile<T, STAGES, BN>(acc, it, k_steps, tiles, full, empty, wg, false, [&](int kt) {
            if (issuer && kt == load_step) {
                asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                mbar_expect_tx(res_bar + 8 * wg, (BN / 64) * 8192);
                #pragma unroll
                for (int c = 0; c < BN / 64; ++c)
                    tma_load(buf_addr + c * 8192, &res_map, col0 + 64 * c, m0, res_bar + 8 * wg);
            }
        });
        mbar_wait(res_bar + 8 * wg, parity);
        float mean[2] = {0.0f, 0.0f}, m2[2] = {0.0f, 0.0f};
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j) {  // v = acc + bias + residual (0 past N: w's rows and the box read as 0)
            const int c = j * 8 + (t & 3) * 2;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                float r0, r1;
                unpack2<T>(*reinterpret_cast<const unsigned*>(fragment_at(buf, j, row + 8 * h)), r0, r1);
                acc[4 * j + 2 * h] += params[0][c] + r0;
                acc[4 * j + 2 * h + 1] += params[0][c + 1] + r1;
                mean[h] += acc[4 * j + 2 * h] + acc[4 * j + 2 * h + 1];
            }
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            mean[h] += __shfl_xor_sync(0xffffffffu, mean[h], 1);
            mean[h] += __shfl_xor_sync(0xffffffffu, mean[h], 2);
            mean[h] /= cols;
        }
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int c = j * 8 + (t & 3) * 2;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float d0 = acc[4 * j + 2 * h] - mean[h], d1 = acc[4 * j + 2 * h + 1] - mean[h];
                m2[h] += (c < cols ? d0 * d0 : 0.0f) + (c + 1 < cols ? d1 * d1 : 0.0f);
            }
        }
        const unsigned bar = stat_bar + 8 * (2 * wg + parity);
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            m2[h] += __shfl_xor_sync(0xffffffffu, m2[h], 1);
            m2[h] += __shfl_xor_sync(0xffffffffu, m2[h], 2);
            if ((t & 3) == 0) {
                const unsigned slot = smem_addr(&stats[parity][wg][rank][row + 8 * h]);
                for (int r = 0; r < ranks; ++r) store_remote(cluster_map(slot, r), mean[h], m2[h], cluster_map(bar, r));
            }
        }
        if (issuer) mbar_expect_tx(bar, ranks * 64 * 8);
        mbar_wait<true>(bar, (local >> 1) & 1);
        float rstd[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {  // the cluster's pairs, in rank order
            float n = 0.0f, mu = 0.0f, s = 0.0f;
            for (int r = 0; r < ranks; ++r) {
                const float2 p = stats[parity][wg][r][row + 8 * h];
                const float nr = (float)min(BN, N - r * BN), total = n + nr, d = p.x - mu;
                mu += d * (nr / total);
                s += p.y + d * d * (n * nr / total);
                n = total;
            }
            mean[h] = mu;
            rstd[h] = rsqrtf(s / n + eps);
        }
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int c = j * 8 + (t & 3) * 2;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float v0 = (acc[4 * j + 2 * h] - mean[h]) * rstd[h] * params[1][c] + params[2][c];
                const float v1 = (acc[4 * j + 2 * h + 1] - mean[h]) * rstd[h] * params[1][c + 1] + params[2][c + 1];
                *reinterpret_cast<unsigned*>(fragment_at(buf, j, row + 8 * h)) = pack2<T>(v0, v1);
            }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, to TMA
        consumers_sync(1 + wg, 128);
        if (issuer) {
            #pragma unroll
            for (int c = 0; c < BN / 64; ++c) tma_store(&out_map, buf_addr + c * 8192, col0 + 64 * c, m0);
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
    }
    if (issuer) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the last stores, before the block ends
}
