// L2 prefetches on a branch of a captured graph, beside the launches that read what they fetch
// (runtime.py prefetch_l2, prefetch_kv): every runner's graphs launch them on sm_90+, so they are a
// module of their own, compiled for every runner (families.py prepare_kernels).

// Asks the L2 to fetch four arrays (the weights of the kernels about to run) ahead of their
// readers: launched on a branch of a captured graph beside them (runtime.py prefetch_l2), each lane
// issues bulk prefetches of PREFETCH_CHUNK bytes (sm_90+; elsewhere nothing). Arrays 16-byte
// aligned, sizes whole 16-byte units (runtime.py checks, rounds down). grid (4), block 32.

#define PREFETCH_CHUNK 65536

__global__ void prefetch_l2(const char* a0, long n0, const char* a1, long n1, const char* a2, long n2,
                            const char* a3, long n3) {
    wait_for_previous();  // launched the plain way (a no-op), as every kernel starts
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const char* const arrays[4] = {a0, a1, a2, a3};
    const long sizes[4] = {n0, n1, n2, n3};
    const char* a = arrays[blockIdx.x];
    const long n = sizes[blockIdx.x];
    for (long off = (long)threadIdx.x * PREFETCH_CHUNK; off < n; off += (long)blockDim.x * PREFETCH_CHUNK) {
        const unsigned bytes = (unsigned)min((long)PREFETCH_CHUNK, n - off);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(a + off), "r"(bytes) : "memory");
    }
#endif
}

// Asks the L2 to fetch the cached keys and values a decode step's attention reads next: positions
// 0 .. positions[r] - 1 of row r's every head, from caches (rows, heads, L, row_bytes) whose
// position rows are whole 16-byte units (runtime.py checks); nothing where all rows' come to more than
// max_bytes (they would not stay in the L2 until read). Launched on a branch of a captured graph
// (runtime.py prefetch_kv); sm_90+, elsewhere nothing. grid (rows), block 32.
__global__ void prefetch_kv(const char* k_cache, const char* v_cache, const int* positions, int rows, int heads,
                            int L, int row_bytes, long max_bytes) {
    wait_for_previous();  // launched the plain way (a no-op), as every kernel starts
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    auto before = [&](int r) { return min(max(positions[r], 0), L); };  // row r's positions cached before it
    long cached = 0;
    for (int r = threadIdx.x; r < rows; r += 32) cached += before(r);
    cached = warp_reduce(cached, SumOp());
    if (cached * row_bytes * heads * 2 > max_bytes) return;
    const long bytes = (long)before(blockIdx.x) * row_bytes;
    for (int i = threadIdx.x; i < 2 * heads; i += 32) {
        const char* head = (i & 1 ? v_cache : k_cache) + ((long)blockIdx.x * heads + (i >> 1)) * L * row_bytes;
        for (long off = 0; off < bytes; off += PREFETCH_CHUNK) {
            const unsigned n = (unsigned)min((long)PREFETCH_CHUNK, bytes - off);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(head + off), "r"(n) : "memory");
        }
    }
#endif
}
