// Fused variable-length attention on Hopper's warpgroup tensor cores (wgmma: sm_90a only, compiled
// for that target alone after attention_varlen.cu, whose helpers it shares, and sm90.cuh;
// kernels.py ARCH_SPECIFIC). Reference: ftengine/backends/numpy_ops.py varlen_attention.
//
// varlen_attention_mma's plain case (the length and causal masks, no window, no relative bias) for
// a block of one warpgroup (64 query rows), both products on wgmma, in two kernels:
// - varlen_attention_wgmma (head dim D = 64 or 32): S = Q K^T with Q from registers (the staged
//   query fragments, read again for each key tile: see the loop) and a K tile from shared memory.
//   K/V tiles of VARLEN_WG_KN keys are copied by every thread with cp.async, two stages deep, in
//   wgmma's swizzled layout of their rows' width (128 bytes at D = 64, 64 at 32).
// - varlen_attention_wgmma_tma (D = 64, sequences of more than two key tiles: ops.py
//   VARLEN_WG_TMA_MIN_SEQ): one thread copies each K and V tile with the tensor memory accelerator
//   (qkv's tensor map, the 128-byte swizzle), both stages from the start, each stage's arrival on
//   an mbarrier; the queries + bias are staged in the same swizzle, and S = Q K^T takes both from
//   shared memory. Rows past the sequence arrive as the next sequence's (or zeros past qkv): their
//   weights are 0, and V's are zeroed before P V reads them, so that no value there (inf, NaN)
//   reaches this sequence. H100, fp16, head dim 64, against the first kernel (torch SDPA in
//   brackets), us, medians of 6 alternating rounds (2026-11-26): 64 x 512 tokens, 12 heads, 152.6
//   against 183.6 (148.1), 16 x 2,048 522.3 against 616.1 (518.8), 128 x 256 101.5 against 110.0
//   (88.7); 256 x 128 82.5 against 82.1, 32 x 128 13.2 against 12.3 and 1 x 128 4.0 against 3.8 (two
//   key tiles a block: the first kernel stays there); causal 4 x 1,024 28.2 against 32.5, 1 x 512 7.8
//   against 8.0. Taken apart (the same run): the tensor map's copies with the register-A S 163.9 at
//   64 x 512, 16 x 2,048 542.0; an mbarrier per stage for its readers instead of the block barrier
//   before each copy, slower (64 x 512 +2-6 us). Why: at 64 x 512 the first kernel executed 90.2 M
//   warp instructions against cuDNN's (torch SDPA's) 56.3 M for the same floating-point work (ncu,
//   2026-11-26); about 120 of its loop's 390 instructions a key tile (SASS) computed the copies'
//   and the query fragments' addresses.
// Both: the score accumulators come back in mma.sync's layout, and O += P V takes P from them as a
// register-A operand, V from its tile in shared memory (MN-major: rows of keys). H100: 1.06-1.18x
// the speed of the mma.sync P V it replaces on sequences of 512 tokens and more, the same at 128; a
// shared-memory P ran no faster (bench/experiments/attention_wgmma.py). The online softmax, the query
// staging and the stores are varlen_attention_mma's.
// grid (ceil(max_seqlen / 64), B * heads), 128 threads; dynamic shared memory: 2 x (K, V) x
// VARLEN_WG_KN x D elements, 64 x (D + 8) (the staged queries), 1024 (alignment); the second kernel
// also 16 bytes (its two mbarriers).

#define VARLEN_WG_KN 64

// wgmma's shared-memory matrix descriptor of a tile of ROW_BYTES-byte rows (128: 64 16-bit elements,
// 64: 32) in the swizzle mode of that width (TileLoader's layout), 1024-byte aligned: groups of 8 rows
// are 8 rows apart (the stride byte offset); the leading byte offset is unused by these layouts (a
// row is one swizzle atom wide).
template <int ROW_BYTES>
__device__ __forceinline__ unsigned long long swizzled_desc(unsigned addr) {
    static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "128- or 64-byte swizzle");
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16)
           | ((unsigned long long)(8 * ROW_BYTES >> 4) << 32) | (ROW_BYTES == 128 ? 1ull << 62 : 2ull << 62);
}

// sm90.cuh's fence_registers for the A fragments: pins every access of these registers on its side
// of this point (before wgmma.fence, the writes an asynchronous product must see: wgmma.fence orders
// only the register accesses before it, and the compiler could otherwise sink them past it).
template <int N>
__device__ __forceinline__ void fence_registers(unsigned (&d)[N][4]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i][0]), "+r"(d[i][1]), "+r"(d[i][2]), "+r"(d[i][3]) :: "memory");
}

// d (64 x 64, fp32: fragment i of a thread is m16n8 block i / 4's element i % 4, as mma.sync lays
// them out per warp of 16 rows) = (SCALE_D ? d : 0) + A (64 x 16, registers: each warp's 16 rows as
// an m16n8k16 A fragment) B (16 x 64 in shared memory: K-major, or with TRANS_B MN-major).
#define WGMMA_RS_M64N64K16(TYPE)                                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"                                                  \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                    \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "          \
                 "{%32, %33, %34, %35}, %37, p, 1, 1, %38;\n}\n"                                               \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),     \
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),   \
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),   \
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(SCALE_D), "l"(b), "n"(TRANS_B))

// The same with B 16 x 32 (d 64 x 32: 16 fragments, laid out alike).
#define WGMMA_RS_M64N32K16(TYPE)                                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %20, 0;\n"                                                  \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " "                                \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "                    \
                 "{%16, %17, %18, %19}, %21, p, 1, 1, %22;\n}\n"                                               \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),     \
                   "+f"(d[15])                                                                                  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(SCALE_D), "l"(b), "n"(TRANS_B))

// WgmmaRS<T, N>::run<SCALE_D, TRANS_B>(d, a, b): the m64nNk16 product above (N 64 or 32).
template <typename T, int N> struct WgmmaRS;
#define WGMMA_RS_STRUCT(T, N, MACRO, TYPE)                                                                      \
    template <> struct WgmmaRS<T, N> {                                                                         \
        template <int SCALE_D, int TRANS_B = 0>                                                                 \
        static __device__ __forceinline__ void run(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b) { \
            MACRO(TYPE);                                                                                        \
        }                                                                                                       \
    };
WGMMA_RS_STRUCT(__half, 64, WGMMA_RS_M64N64K16, "f16")
WGMMA_RS_STRUCT(__nv_bfloat16, 64, WGMMA_RS_M64N64K16, "bf16")
WGMMA_RS_STRUCT(__half, 32, WGMMA_RS_M64N32K16, "f16")
WGMMA_RS_STRUCT(__nv_bfloat16, 32, WGMMA_RS_M64N32K16, "bf16")

// WgmmaSS<T>::run<SCALE_D>(d, a, b): d (64 x 64, fp32, laid out as above) = (SCALE_D ? d : 0) +
// A (64 x 16) B (16 x 64), both K-major in shared memory (sm90.cuh WGMMA_SS_M64N64K16).
template <typename T> struct WgmmaSS;
#define WGMMA_SS_STRUCT(T, TYPE)                                                                                \
    template <> struct WgmmaSS<T> {                                                                            \
        template <int SCALE_D>                                                                                  \
        static __device__ __forceinline__ void run(float (&d)[32], unsigned long long a, unsigned long long b) { \
            WGMMA_SS_M64N64K16(TYPE, SCALE_D);                                                                  \
        }                                                                                                       \
    };
WGMMA_SS_STRUCT(__half, "f16")
WGMMA_SS_STRUCT(__nv_bfloat16, "bf16")

// The rest of a key tile once S (s) is in: the online softmax (keys n0 .., the masks where
// `masked`), then O += P V with P from the score registers (register-A wgmma) and V the MN-major
// tile at vs (rows of keys), a k16 step 16 of its rows.
template <typename T, int D, int KN>
__device__ __forceinline__ void softmax_then_pv(float (&s)[KN / 8][4], float (&o)[D / 8][4], float (&m)[2],
                                                float (&l)[2], const KeyRange& keys, int n0, int row_lo, bool masked,
                                                float scale_log2, unsigned vs) {
    constexpr int ROW_BYTES = D * sizeof(T);
    softmax_tile<false, KN, D>(s, o, m, l, keys, n0, row_lo, masked, scale_log2, scale_log2);
    unsigned pa[KN / 16][4];
    #pragma unroll
    for (int kk = 0; kk < KN / 16; ++kk) weight_fragment<T, KN>(pa[kk], s, kk);
    float (&o_flat)[D / 2] = reinterpret_cast<float (&)[D / 2]>(o);
    fence_registers(o_flat);
    fence_registers(pa);
    wgmma_fence();
    #pragma unroll
    for (int kk = 0; kk < KN / 16; ++kk)
        WgmmaRS<T, D>::template run<1, 1>(o_flat, pa[kk], swizzled_desc<ROW_BYTES>(vs + 16 * ROW_BYTES * kk));
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(o_flat);
}

// A warp's 16 query rows before their first key tile: outputs and scores 0, running maxima -inf,
// sums 0.
template <int D, int KN>
__device__ __forceinline__ void start_rows(float (&o)[D / 8][4], float (&s)[KN / 8][4], float (&m)[2], float (&l)[2]) {
    #pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    #pragma unroll
    for (int j = 0; j < KN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    m[0] = m[1] = -FT_INFINITY;
    l[0] = l[1] = 0.0f;
}

template <typename T, int D>
__global__ void __launch_bounds__(128) varlen_attention_wgmma(
        T* __restrict__ ctx,              // (T, H)
        const T* __restrict__ qkv,        // (T, 3H)
        const T* __restrict__ bias,       // (3H,)
        const int* __restrict__ cu_seqlens,  // (B + 1,)
        int batch, int heads, int n_tokens, float scale_log2, int causal, int window,
        const float* __restrict__ rel_table, const int* __restrict__ rel_buckets, int rel_max_len) {
    wait_for_previous();
    static_assert(D == 64 || D == 32, "head dim 64 or 32");
    constexpr int KN = VARLEN_WG_KN, BLOCK_M = 64, LDQ = D + 8, ROW_BYTES = D * sizeof(T);
    constexpr unsigned TILE_BYTES = KN * D * sizeof(T);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int bh = blockIdx.y, b = bh / heads, h = bh - b * heads;
    const int start = cu_seqlens[b], len = cu_seqlens[b + 1] - start, total = cu_seqlens[batch];
    zero_padding_rows(ctx, total, n_tokens, heads * D);
    const int q0 = blockIdx.x * BLOCK_M;
    if (q0 >= len) return;
    const int H = heads * D, row_stride = 3 * H;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int w0 = q0 + warp * 16;  // this warp's first query row
    const T* base = qkv + (long)start * row_stride;
    const T* k_head = base + H + h * D;
    const T* v_head = base + 2 * H + h * D;
    const KeyRange keys{len, causal, 0, 0, heads, h, rel_table, rel_buckets};
    const int n_tiles = ((causal ? min(len, q0 + BLOCK_M) : len) + KN - 1) / KN;
    const TileLoader<T, D, D, KN, 128, true> loader(row_stride);
    const unsigned raw = smem_addr(smem_raw), tiles = (raw + 1023u) & ~1023u;  // K 0 | V 0 | K 1 | V 1
    T* qs = reinterpret_cast<T*>(smem_raw + (tiles - raw) + 4 * TILE_BYTES);

    loader.load(tiles, k_head, 0, len, row_stride);
    loader.load(tiles + TILE_BYTES, v_head, 0, len, row_stride);
    cp_async_commit();
    stage_queries<T, D, LDQ, 128, BLOCK_M>(qs, base, bias, q0, len, row_stride, h);
    __syncthreads();

    float o[D / 8][4], s[KN / 8][4], m[2], l[2];
    start_rows<D, KN>(o, s, m, l);
    float (&s_flat)[KN / 2] = reinterpret_cast<float (&)[KN / 2]>(s);

    for (int it = 0; it < n_tiles; ++it) {
        const int n0 = it * KN;
        kv_pipeline_step<T>(loader, tiles, TILE_BYTES, it, n_tiles, n0 + KN, k_head, v_head, len, row_stride);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // this thread's copies, to wgmma
        __syncthreads();
        const unsigned ks = tiles + (it & 1) * 2 * TILE_BYTES, vs = ks + TILE_BYTES;

        // S = Q K^T: K-major K tile, a k16 step is 32 bytes along its rows. The query fragments are
        // read again for each tile: held in registers across the loop, ptxas (CUDA 13.0) gave their
        // registers to P once P V became a register-A wgmma too (bench/experiments/attention_wgmma.py).
        unsigned qa[D / 16][4];
        query_fragments<T, D, LDQ>(qa, qs, warp * 16, lane);
        fence_registers(qa);
        fence_registers(s_flat);
        wgmma_fence();
        WgmmaRS<T, KN>::template run<0>(s_flat, qa[0], swizzled_desc<ROW_BYTES>(ks));
        #pragma unroll
        for (int kk = 1; kk < D / 16; ++kk)
            WgmmaRS<T, KN>::template run<1>(s_flat, qa[kk], swizzled_desc<ROW_BYTES>(ks + 32 * kk));
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(s_flat);

        const bool masked = n0 + KN > len || (causal && n0 + KN - 1 > w0);  // rows of this warp that miss a key
        softmax_then_pv<T, D, KN>(s, o, m, l, keys, n0, w0 + (lane >> 2), masked, scale_log2, vs);
    }
    store_context<T, D>(ctx + h * D, o, l, bias + 2 * H + h * D, start, w0 + (lane >> 2), len, H);
}

// The K and V tiles of keys row0 .. row0 + VARLEN_WG_KN of a head (columns k_col, v_col of qkv's
// tensor map) into the stage at `stage` (K, then V), completing on `bar`. One thread.
__device__ __forceinline__ void load_kv_tiles(unsigned stage, const TmaMap* map, int k_col, int v_col, int row0,
                                              unsigned tile_bytes, unsigned bar) {
    mbar_expect_tx(bar, 2 * tile_bytes);
    tma_load(stage, map, k_col, row0, bar);
    tma_load(stage + tile_bytes, map, v_col, row0, bar);
}

template <typename T>
__global__ void __launch_bounds__(128) varlen_attention_wgmma_tma(
        T* __restrict__ ctx,              // (T, H)
        const T* __restrict__ qkv,        // (T, 3H)
        const T* __restrict__ bias,       // (3H,)
        const int* __restrict__ cu_seqlens,  // (B + 1,)
        int batch, int heads, int n_tokens, float scale_log2, int causal,
        const __grid_constant__ TmaMap qkv_map  // qkv's: boxes of VARLEN_WG_KN rows x 64 columns
        ) {
    wait_for_previous();
    constexpr int D = 64, KN = VARLEN_WG_KN, BLOCK_M = 64, ROW_BYTES = D * sizeof(T);
    constexpr unsigned TILE_BYTES = KN * D * sizeof(T);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (threadIdx.x == 0)
        asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<unsigned long long>(&qkv_map)) : "memory");
    const int bh = blockIdx.y, b = bh / heads, h = bh - b * heads;
    const int start = cu_seqlens[b], len = cu_seqlens[b + 1] - start, total = cu_seqlens[batch];
    zero_padding_rows(ctx, total, n_tokens, heads * D);
    const int q0 = blockIdx.x * BLOCK_M;
    if (q0 >= len) return;
    const int H = heads * D, k_col = H + h * D, v_col = 2 * H + h * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int w0 = q0 + warp * 16;  // this warp's first query row
    const KeyRange keys{len, causal, 0, 0, heads, h, nullptr, nullptr};
    const int n_tiles = ((causal ? min(len, q0 + BLOCK_M) : len) + KN - 1) / KN;
    // K 0 | V 0 | K 1 | V 1 | Q (1024-byte aligned: the swizzle's) | two mbarriers (stage s's copies landed)
    const unsigned raw = smem_addr(smem_raw), tiles = (raw + 1023u) & ~1023u;
    T* qs = reinterpret_cast<T*>(smem_raw + (tiles - raw) + 4 * TILE_BYTES);
    const unsigned q_tile = tiles + 4 * TILE_BYTES, full = q_tile + BLOCK_M * ROW_BYTES;

    if (threadIdx.x == 0) {  // both stages from the start
        mbar_init(full, 1);
        mbar_init(full + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        load_kv_tiles(tiles, &qkv_map, k_col, v_col, start, TILE_BYTES, full);
        if (n_tiles > 1)
            load_kv_tiles(tiles + 2 * TILE_BYTES, &qkv_map, k_col, v_col, start + KN, TILE_BYTES, full + 8);
    }
    // the queries + bias in the 128-byte swizzle, wgmma's K-major A operand, made visible to it
    stage_queries<T, D, D, 128, BLOCK_M, true>(qs, qkv + (long)start * 3 * H, bias, q0, len, 3 * H, h);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();

    float o[D / 8][4], s[KN / 8][4], m[2], l[2];
    start_rows<D, KN>(o, s, m, l);
    float (&s_flat)[KN / 2] = reinterpret_cast<float (&)[KN / 2]>(s);

    for (int it = 0; it < n_tiles; ++it) {
        const int n0 = it * KN;
        const unsigned ks = tiles + (it & 1) * 2 * TILE_BYTES, vs = ks + TILE_BYTES;
        if (it >= 1 && it + 1 < n_tiles) {
            __syncthreads();  // every warp is done with tile it - 1, whose stage the next copies overwrite
            if (threadIdx.x == 0)
                load_kv_tiles(tiles + ((it + 1) & 1) * 2 * TILE_BYTES, &qkv_map, k_col, v_col, start + n0 + KN,
                              TILE_BYTES, full + 8 * ((it + 1) & 1));
        }
        mbar_wait(full + 8 * (it & 1), (it >> 1) & 1);
        if (n0 + KN > len) {  // V's rows past the sequence to zeros (the last tile: no copy follows)
            for (int i = threadIdx.x; i < (n0 + KN - len) * ROW_BYTES / 16; i += 128)
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n"
                             :: "r"(vs + (len - n0) * ROW_BYTES + i * 16), "r"(0u) : "memory");
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
        }

        // S = Q K^T, both K-major in shared memory: a k16 step is 32 bytes along their rows
        fence_registers(s_flat);
        wgmma_fence();
        WgmmaSS<T>::template run<0>(s_flat, swizzled_desc<ROW_BYTES>(q_tile), swizzled_desc<ROW_BYTES>(ks));
        #pragma unroll
        for (int kk = 1; kk < D / 16; ++kk)
            WgmmaSS<T>::template run<1>(s_flat, swizzled_desc<ROW_BYTES>(q_tile + 32 * kk),
                                        swizzled_desc<ROW_BYTES>(ks + 32 * kk));
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(s_flat);

        const bool masked = n0 + KN > len || (causal && n0 + KN - 1 > w0);
        softmax_then_pv<T, D, KN>(s, o, m, l, keys, n0, w0 + (lane >> 2), masked, scale_log2, vs);
    }
    store_context<T, D>(ctx + h * D, o, l, bias + 2 * H + h * D, start, w0 + (lane >> 2), len, H);
}
