// Hopper (sm_90a) helpers shared by gemm_sm90.cu and attention_sm90.cu, prepended to their sources
// after common.cuh (kernels.py ARCH_SPECIFIC): mbarriers, TMA copies, wgmma's fences and waits.

// A CUtensorMap (cuda.h): 128 opaque bytes, passed by value as a __grid_constant__ parameter.
struct alignas(64) TmaMap { unsigned long long v[16]; };

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// One arrival that also announces `bytes` to come from TMA copies completing on this barrier.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Until the barrier's phase of parity `parity` has completed; CLUSTER: also seeing the writes that
// other blocks of the cluster completed on it (acquire at cluster scope).
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        if constexpr (CLUSTER) {
            asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                         "selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        } else {
            asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                         "selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        }
    } while (!done);
}

// The box of `map` at (inner c0, outer c1) into shared memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load(unsigned dst, const TmaMap* map, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Keeps the compiler from moving accesses of the accumulators across the asynchronous products.
template <int R>
__device__ __forceinline__ void fence_registers(float (&d)[R]) {
    #pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// d (64 x 64, fp32; fragment i of thread t, warp w of the warpgroup, lane l: row 16 w + l / 4 + 8
// ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4) + i % 2) = (SCALE ? d : 0) + A (64 x 16) B (16 x 64),
// A and B K-major in shared memory (descriptors a, b); TYPE "f16" or "bf16".
#define WGMMA_SS_M64N64K16(TYPE, SCALE)                                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {"                                      \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                              \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                   \
                 "%32, %33, p, 1, 1, 0, 0;\n}\n"                                                                       \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),                 \
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),             \
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),          \
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),          \
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                  \
                 : "l"(a), "l"(b), "r"(SCALE))
