// Fused variable-length attention over the padding-free token layout.
// Reference: ftengine/backends/numpy_ops.py varlen_attention.
//
// ctx (T, H) = softmax(Q K^T * scale + bias) V per (sequence, head), where query i sees key j if
// j < len, and j <= i when causal (a decoder's prefill), and |j - i| <= window when window > 0
// (ModernBERT's local layers); bias: MPNet's relative position bias
// rel_table[rel_buckets[j - i + rel_max_len - 1] * heads + head] when rel_max_len > 0 (no S x S
// bias tensor). Q, K, V are column blocks
// of the fused QKV GEMM output qkv (T, 3H) plus their bias, and sequence b owns tokens
// cu_seqlens[b] .. cu_seqlens[b+1]. The S x S scores never leave the chip: each block takes
// BLOCK_M queries of one (sequence, head), streams K/V tiles through shared memory and keeps a
// running max and sum per query row (online softmax).
//
// grid (ceil(max_seqlen / BLOCK_M), B * heads): the tensor-core kernel with 32 WARPS
// threads, BLOCK_M = 16 WARPS MT and 2 * 2 * KN * (D + 8) elements of dynamic shared memory; the
// fp32 one with 128 threads and BLOCK_M = 64. All blocks share zeroing the ctx rows past the last
// sequence (batch padding), so they hold no stale values.

#define VARLEN_BLOCK_M 64
#define LOG2E 1.4426950408889634f

// What a block of queries q0 .. q0 + 63 attends to: key tiles [first, end) and each score's mask/bias.
struct KeyRange {
    int len, causal, window, rel_max_len, heads, head;
    const float* rel_table;
    const int* rel_buckets;
    __device__ __forceinline__ int first_key(int q0) const { return window > 0 ? max(0, q0 - window) : 0; }
    __device__ __forceinline__ int end_key(int q0, int block_m) const {
        int end = len;
        if (causal) end = min(end, q0 + block_m);
        if (window > 0) end = min(end, q0 + block_m + window);
        return end;
    }
    // rows past the sequence (a block's tail) see nothing: their relative positions would index
    // past the bias table, and their outputs are never stored
    __device__ __forceinline__ bool visible(int key, int row) const {
        return key < len && row < len && (!causal || key <= row) && (window <= 0 || abs(key - row) <= window);
    }
    // the score in log2 units: qk * scale_log2 plus the relative bias
    __device__ __forceinline__ float score(float qk, float scale_log2, int key, int row) const {
        float s = qk * scale_log2;
        if (rel_max_len > 0) s += rel_table[rel_buckets[key - row + rel_max_len - 1] * heads + head] * LOG2E;
        return s;
    }
};

// This block's share of zeroing ctx rows `total` (cu_seqlens[batch]: past the last sequence, batch
// padding) .. n_tokens, so that they hold no stale values: the whole grid shares the rows, in
// 16-byte stores where they are whole 16-byte units. (An extra row of blocks that stored an element
// per thread at a time took 15 us after the attention itself: BERT-base 32 x 128, 320 padding rows.)
// The callers load `total` with their sequence's bounds, so that the three loads wait as one.
template <typename T>
__device__ __forceinline__ void zero_padding_rows(T* ctx, int total, int n_tokens, int H) {
    const long from = (long)total * H, to = (long)n_tokens * H;
    if (from >= to) return;
    const long threads = (long)gridDim.x * gridDim.y * blockDim.x;
    const long first = ((long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
    constexpr int V = 16 / sizeof(T);
    if (H % V == 0 && reinterpret_cast<unsigned long long>(ctx) % 16 == 0) {
        uint4* units = reinterpret_cast<uint4*>(ctx + from);
        for (long i = first; i < (to - from) / V; i += threads) units[i] = make_uint4(0u, 0u, 0u, 0u);
    } else {
        for (long i = from + first; i < to; i += threads) ctx[i] = from_float<T>(0.0f);
    }
}

// ---------------------------------------------------------------- tensor cores (half, bf16)

// common.cuh's ldmatrix_x4, each 8x8 matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// exp2 on the special-function unit, flushing denormals: ex2(-inf) = +0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Copies tiles of ROWS rows of one head's K or V columns into shared memory, THREADS threads
// sharing each tile: thread i copies 16-byte column i % (D / 8) of rows i / (D / 8) + k STEP, so
// only its first chunk's offsets are kept. Rows past the sequence are zeros. K's bias is left
// out: it adds q.b_k to every score of a query row, which the softmax cancels. V's bias is added
// to the output instead: each row's weights sum to 1.
// Tile rows are LD elements apart; SWIZZLE: rows of 128 bytes (D = 64 16-bit values) whose 16-byte
// chunk c sits at c ^ (row % 8), the layout wgmma's 128-byte swizzle mode reads, or of 64 bytes
// (D = 32) with chunk c at c ^ (row / 2 % 4), its 64-byte mode's (both repeat every 8 rows).
template <typename T, int D, int LD, int ROWS, int THREADS, bool SWIZZLE = false>
struct TileLoader {
    static constexpr int PER_ROW = D / 8, STEP = THREADS / PER_ROW, CHUNKS = ROWS / STEP;
    static constexpr int ROW_BYTES = D * sizeof(T);
    static_assert(THREADS % PER_ROW == 0 && ROWS % STEP == 0, "every thread copies as many chunks");
    static_assert(!SWIZZLE || (LD == D && (ROW_BYTES == 128 || ROW_BYTES == 64) && STEP % 8 == 0),
                  "swizzled rows: 128 or 64 bytes");
    int row, src, step;  // the first chunk's row in the tile, its element offset; STEP rows' offset
    unsigned dst;        // the first chunk's byte offset in the tile (the same chunk of row + k STEP)
    __device__ __forceinline__ TileLoader(int row_stride) {
        row = threadIdx.x / PER_ROW;
        const int chunk = threadIdx.x - row * PER_ROW;
        src = row * row_stride + chunk * 8;
        step = STEP * row_stride;
        const int swizzled = ROW_BYTES == 128 ? chunk ^ (row & 7) : chunk ^ ((row >> 1) & 3);
        dst = SWIZZLE ? row * ROW_BYTES + (swizzled << 4) : (row * LD + chunk * 8) * sizeof(T);
    }
    // rows row0 .. row0 + ROWS of `head` (the head's first column of row 0) into the tile at `tile`
    __device__ __forceinline__ void load(unsigned tile, const T* head, int row0, int len, int row_stride) const {
        const T* first = head + (long)row0 * row_stride + src;
        const int left = len - row0 - row;
        #pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
            const bool valid = k * STEP < left;
            cp_async_16(tile + dst + k * STEP * LD * sizeof(T), valid ? first + k * step : head, valid);
        }
    }
};

// Step `it` of the two-stage K/V tile pipeline (stage s at base + 2 s tile_bytes: its K tile, then its
// V tile): after a barrier (every warp is done with the stage the next copy overwrites), the copies
// of tile it + 1 (keys next_row ..) start, if there is one; returns once this thread's copies of
// tile it have landed (the caller's barrier then makes them every thread's).
template <typename T, typename Loader>
__device__ __forceinline__ void kv_pipeline_step(const Loader& loader, unsigned base, unsigned tile_bytes, int it,
                                                 int n_tiles, int next_row, const T* k_head, const T* v_head, int len,
                                                 int row_stride) {
    __syncthreads();
    if (it + 1 < n_tiles) {
        const unsigned next = base + ((it + 1) & 1) * 2 * tile_bytes;
        loader.load(next, k_head, next_row, len, row_stride);
        loader.load(next + tile_bytes, v_head, next_row, len, row_stride);
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
}

// Q + bias of queries q0 .. q0 + BLOCK_M of the head (rounded to T, as the unfused path stores
// it; rows past the sequence zeros) into qs, rows LD elements apart, by all THREADS threads of the
// block: each thread loads its 16-byte chunks of Q (column i % (D / 8) of rows i / (D / 8) + k STEP)
// and of the bias first, all in flight at once, then adds and stores them. SWIZZLE: rows of D = 64
// elements (LD = D) in the 128-byte swizzle, 16-byte chunk c of row r at c ^ (r % 8) (the layout
// wgmma reads a K-major operand in: attention_sm90.cu).
template <typename T, int D, int LD, int THREADS, int BLOCK_M, bool SWIZZLE = false>
__device__ __forceinline__ void stage_queries(T* qs, const T* base, const T* __restrict__ bias, int q0, int len,
                                              int row_stride, int h) {
    constexpr int PER_ROW = D / 8, STEP = THREADS / PER_ROW, N = BLOCK_M / STEP;
    static_assert(THREADS % PER_ROW == 0 && BLOCK_M % STEP == 0, "every thread stages as many chunks");
    static_assert(!SWIZZLE || (LD == D && D * sizeof(T) == 128), "swizzled rows: 128 bytes");
    const int row = threadIdx.x / PER_ROW, chunk = threadIdx.x - row * PER_ROW, col = chunk * 8;
    Pack<T, 8> q[N];
    #pragma unroll
    for (int k = 0; k < N; ++k) {
        if (q0 + row + k * STEP < len)
            q[k] = *reinterpret_cast<const Pack<T, 8>*>(base + (long)(q0 + row + k * STEP) * row_stride + h * D + col);
    }
    float b[8];
    load_floats<T, 8>(b, bias + h * D + col);
    #pragma unroll
    for (int k = 0; k < N; ++k) {
        const int r = row + k * STEP;
        float v[8];
        const bool valid = q0 + r < len;
        #pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = valid ? to_float(q[k].v[j]) + b[j] : 0.0f;
        store_floats<T, 8>(qs + r * LD + (SWIZZLE ? (chunk ^ (r & 7)) << 3 : col), v);
    }
}

// The A fragments (m16n8k16) of the 16 staged query rows from row r of qs, each k-chunk of D.
template <typename T, int D, int LD>
__device__ __forceinline__ void query_fragments(unsigned (&qa)[D / 16][4], const T* qs, int r, int lane) {
    const int lm = lane >> 3, lr = lane & 7;  // ldmatrix: the matrix this lane addresses, its row
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qa[kk], smem_addr(qs + (r + (lm & 1) * 8 + lr) * LD + kk * 16 + (lm >> 1) * 8));
}

// One key tile of the online softmax for 16 query rows held by a warp as m16n8 accumulator
// fragments (this thread's rows row_lo and row_lo + 8): scores s of keys n0 .. n0 + KN are masked
// where `masked` (GENERAL: scaled and biased first, KeyRange), the running max m and sum l and the
// output o are rescaled, and s becomes the unnormalised weights. `mul`: the scores' factor inside
// the exponent (GENERAL scores are already in log2 units).
template <bool GENERAL, int KN, int D>
__device__ __forceinline__ void softmax_tile(float (&s)[KN / 8][4], float (&o)[D / 8][4], float (&m)[2], float (&l)[2],
                                             const KeyRange& keys, int n0, int row_lo, bool masked, float mul,
                                             float scale_log2) {
    const int t4 = threadIdx.x & 3;
    if (masked) {
        #pragma unroll
        for (int j = 0; j < KN / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = n0 + j * 8 + t4 * 2 + (e & 1), row = row_lo + (e >> 1) * 8;
                if (GENERAL)
                    s[j][e] = keys.visible(key, row) ? keys.score(s[j][e], scale_log2, key, row) : -FT_INFINITY;
                else if (!(key < keys.len && (!keys.causal || key <= row)))
                    s[j][e] = -FT_INFINITY;
            }
        }
    }
    float mx[2] = {-FT_INFINITY, -FT_INFINITY};
    #pragma unroll
    for (int j = 0; j < KN / 8; ++j) {
        mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
    }
    float m_use[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(m[r], mx[r] * mul);
        // GENERAL: a row that has seen no key yet (a window starting past this tile) keeps
        // m = -inf: exponents are taken against 0 then, so every weight and alpha is 0, never
        // NaN. Otherwise key n0 <= q0 is visible to every row, so m_new is finite.
        m_use[r] = GENERAL && m_new == -FT_INFINITY ? 0.0f : m_new;
        const float alpha = fast_exp2(m[r] - m_use[r]);
        m[r] = m_new;
        l[r] *= alpha;
        #pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o[j][2 * r] *= alpha;
            o[j][2 * r + 1] *= alpha;
        }
    }
    #pragma unroll
    for (int j = 0; j < KN / 8; ++j) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[j][e] = fast_exp2(fmaf(s[j][e], mul, -m_use[e >> 1]));
            l[e >> 1] += s[j][e];
        }
    }
}

// The weights of keys 16 kk .. 16 kk + 15 (accumulator fragments s) as an m16n8k16 A fragment.
template <typename T, int KN>
__device__ __forceinline__ void weight_fragment(unsigned (&pa)[4], const float (&s)[KN / 8][4], int kk) {
    pa[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
    pa[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
    pa[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// ctx rows row_lo and row_lo + 8 (this thread's; those inside the sequence) = o / l + V's bias.
template <typename T, int D>
__device__ __forceinline__ void store_context(T* ctx, const float (&o)[D / 8][4], const float (&l)[2],
                                              const T* __restrict__ bias_v, int start, int row_lo, int len, int H) {
    const int t4 = threadIdx.x & 3;
    const T* bv = bias_v + t4 * 2;
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        const int row = row_lo + r * 8;
        if (row < len) {
            T* out = ctx + (long)(start + row) * H + t4 * 2;
            #pragma unroll
            for (int j = 0; j < D / 8; ++j)
                *reinterpret_cast<unsigned*>(out + j * 8) =
                    pack2<T>(o[j][r * 2] * inv + to_float(bv[j * 8]), o[j][r * 2 + 1] * inv + to_float(bv[j * 8 + 1]));
        }
    }
}

// Tensor-core path. Each of the WARPS warps owns MT tiles of 16 query rows (a block:
// 16 WARPS MT queries); every K/V fragment read from shared memory feeds MT products. K/V tiles
// of KN keys are copied asynchronously two stages deep (dynamic shared memory:
// 2 x (K, V) x KN x (D + 8) elements, which stage the block's queries first).
// GENERAL: the sliding window and the relative bias (KeyRange); without them the scores need
// only the length and causal masks, and are scaled inside the exponent's FMA.
// MIN_BLOCKS: __launch_bounds__' blocks per SM (0: no register limit asked).
template <typename T, int D, bool GENERAL, int WARPS, int MT, int KN, int MIN_BLOCKS>
__global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS) varlen_attention_mma(
        T* __restrict__ ctx,              // (T, H)
        const T* __restrict__ qkv,        // (T, 3H)
        const T* __restrict__ bias,       // (3H,)
        const int* __restrict__ cu_seqlens,  // (B + 1,)
        int batch, int heads, int n_tokens, float scale_log2, int causal, int window,
        const float* __restrict__ rel_table, const int* __restrict__ rel_buckets, int rel_max_len) {
    wait_for_previous();
    constexpr int LD = D + 8;  // padded smem rows: conflict-free ldmatrix
    constexpr int TILE = KN * LD;
    constexpr int BLOCK_M = 16 * WARPS * MT;
    static_assert(BLOCK_M <= 2 * KN, "the queries are staged in the two stage-1 tiles");
    static_assert(KN % 16 == 0 && D % 32 == 0, "tile shapes");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* smem = reinterpret_cast<T*>(smem_raw);   // K stage 0 | V stage 0 | K stage 1 | V stage 1
    const int bh = blockIdx.y, b = bh / heads, h = bh - b * heads;
    const int start = cu_seqlens[b], len = cu_seqlens[b + 1] - start, total = cu_seqlens[batch];
    zero_padding_rows(ctx, total, n_tokens, heads * D);
    const int q0 = blockIdx.x * BLOCK_M;
    if (q0 >= len) return;
    const int H = heads * D, row_stride = 3 * H;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int lm = lane >> 3, lr = lane & 7;  // ldmatrix: the matrix this lane addresses, its row
    const int w0 = q0 + warp * 16 * MT;       // this warp's first query row
    const T* base = qkv + (long)start * row_stride;
    const T* k_head = base + H + h * D;
    const T* v_head = base + 2 * H + h * D;
    const KeyRange keys{len, causal, window, rel_max_len, heads, h, rel_table, rel_buckets};
    // only the tiles holding a key some query of this block sees (causal, window)
    const int tile0 = GENERAL ? keys.first_key(q0) / KN : 0;
    const int kv_end = GENERAL ? keys.end_key(q0, BLOCK_M) : (causal ? min(len, q0 + BLOCK_M) : len);
    const int n_tiles = (kv_end + KN - 1) / KN - tile0;
    const TileLoader<T, D, LD, KN, 32 * WARPS> loader(row_stride);
    const unsigned smem_base = smem_addr(smem);
    constexpr unsigned TILE_BYTES = TILE * sizeof(T);
    // this lane's ldmatrix row addresses within a K tile and a V tile (bytes)
    const unsigned k_lane = (lr * LD + lm * 8) * sizeof(T);
    const unsigned v_lane = (((lm & 1) * 8 + lr) * LD + (lm >> 1) * 8) * sizeof(T);

    // K/V tile 0 in flight while Q + bias is staged through the stage-1 buffers and read into
    // A fragments.
    loader.load(smem_base, k_head, tile0 * KN, len, row_stride);
    loader.load(smem_base + TILE_BYTES, v_head, tile0 * KN, len, row_stride);
    cp_async_commit();
    T* qs = smem + 2 * TILE;
    stage_queries<T, D, LD, 32 * WARPS, BLOCK_M>(qs, base, bias, q0, len, row_stride, h);
    __syncthreads();
    unsigned qa[MT][D / 16][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) query_fragments<T, D, LD>(qa[mt], qs, w0 - q0 + mt * 16, lane);

    float o[MT][D / 8][4];
    float m[MT][2], l[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int j = 0; j < D / 8; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.0f;
        m[mt][0] = m[mt][1] = -FT_INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }
    // the scores' factor inside the exponent: GENERAL scores are already in log2 units
    const float mul = GENERAL ? 1.0f : scale_log2;

    for (int it = 0; it < n_tiles; ++it) {
        const int n0 = (tile0 + it) * KN;
        kv_pipeline_step<T>(loader, smem_base, TILE_BYTES, it, n_tiles, n0 + KN, k_head, v_head, len, row_stride);
        __syncthreads();
        const unsigned ks = smem_base + (it & 1) * 2 * TILE_BYTES + k_lane;
        const unsigned vs = smem_base + (it & 1) * 2 * TILE_BYTES + TILE_BYTES + v_lane;

        // S = Q K^T for this warp's MT x 16 rows x KN keys
        float s[MT][KN / 8][4];
        #pragma unroll
        for (int j = 0; j < KN / 8; ++j) {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk += 2) {
                unsigned kb[4];  // b0, b1 of k-chunk kk, then of kk + 1
                ldmatrix_x4(kb, ks + (j * 8 * LD + kk * 16) * sizeof(T));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    MmaOp<T>::run(s[mt][j], qa[mt][kk], kb[0], kb[1]);
                    MmaOp<T>::run(s[mt][j], qa[mt][kk + 1], kb[2], kb[3]);
                }
            }
        }
        // a tile of keys every row of this warp sees needs no mask
        const bool masked = GENERAL || n0 + KN > len || (causal && n0 + KN - 1 > w0);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            softmax_tile<GENERAL, KN, D>(s[mt], o[mt], m[mt], l[mt], keys, n0, w0 + mt * 16 + g, masked, mul,
                                         scale_log2);
        // O += P V, P re-used from the score accumulators as A fragments
        #pragma unroll
        for (int kk = 0; kk < KN / 16; ++kk) {
            unsigned pa[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) weight_fragment<T, KN>(pa[mt], s[mt], kk);
            #pragma unroll
            for (int j = 0; j < D / 8; j += 2) {
                unsigned vb[4];  // b0, b1 of dims j*8.., then of (j+1)*8..
                ldmatrix_x4_trans(vb, vs + (kk * 16 * LD + j * 8) * sizeof(T));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    MmaOp<T>::run(o[mt][j], pa[mt], vb[0], vb[1]);
                    MmaOp<T>::run(o[mt][j + 1], pa[mt], vb[2], vb[3]);
                }
            }
        }
    }
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        store_context<T, D>(ctx + h * D, o[mt], l[mt], bias + 2 * H + h * D, start, w0 + mt * 16 + g, len, H);
}

// ---------------------------------------------------------------- fp32 (SIMT)

// Two threads per query row, each owning D/2 of its dimensions; 32-key tiles in shared memory.
#define VARLEN_SIMT_N 32

template <int D>
__global__ void __launch_bounds__(128) varlen_attention_simt(
        float* __restrict__ ctx, const float* __restrict__ qkv, const float* __restrict__ bias,
        const int* __restrict__ cu_seqlens, int batch, int heads, int n_tokens, float scale_log2, int causal,
        int window, const float* __restrict__ rel_table, const int* __restrict__ rel_buckets, int rel_max_len) {
    wait_for_previous();
    constexpr int HALF = D / 2;
    __shared__ float Ks[VARLEN_SIMT_N][D];
    __shared__ float Vs[VARLEN_SIMT_N][D];
    const int bh = blockIdx.y, b = bh / heads, h = bh - b * heads;
    const int start = cu_seqlens[b], len = cu_seqlens[b + 1] - start, total = cu_seqlens[batch];
    zero_padding_rows(ctx, total, n_tokens, heads * D);
    const int q0 = blockIdx.x * VARLEN_BLOCK_M;
    if (q0 >= len) return;
    const int H = heads * D, row_stride = 3 * H;
    const int row = q0 + (threadIdx.x >> 1), part = threadIdx.x & 1;
    const float* base = qkv + (long)start * row_stride;
    float q[HALF], o[HALF];
    #pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const int c = part * HALF + i;
        q[i] = row < len ? base[(long)row * row_stride + h * D + c] + bias[h * D + c] : 0.0f;
        o[i] = 0.0f;
    }
    float m = -FT_INFINITY, l = 0.0f;
    const KeyRange keys{len, causal, window, rel_max_len, heads, h, rel_table, rel_buckets};
    const int kv_end = keys.end_key(q0, VARLEN_BLOCK_M);
    for (int n0 = keys.first_key(q0) / VARLEN_SIMT_N * VARLEN_SIMT_N; n0 < kv_end; n0 += VARLEN_SIMT_N) {
        __syncthreads();
        for (int i = threadIdx.x; i < VARLEN_SIMT_N * D; i += blockDim.x) {
            const int r = i / D, c = i - r * D;
            const bool in = n0 + r < len;
            Ks[r][c] = in ? base[(long)(n0 + r) * row_stride + H + h * D + c] + bias[H + h * D + c] : 0.0f;
            Vs[r][c] = in ? base[(long)(n0 + r) * row_stride + 2 * H + h * D + c] + bias[2 * H + h * D + c] : 0.0f;
        }
        __syncthreads();
        float s[VARLEN_SIMT_N];
        float mx = -FT_INFINITY;
        #pragma unroll
        for (int j = 0; j < VARLEN_SIMT_N; ++j) {
            float dot = 0.0f;
            #pragma unroll
            for (int i = 0; i < HALF; ++i) dot += q[i] * Ks[j][part * HALF + i];
            dot += __shfl_xor_sync(0xffffffffu, dot, 1);
            s[j] = keys.visible(n0 + j, row) ? keys.score(dot, scale_log2, n0 + j, row) : -FT_INFINITY;
            mx = fmaxf(mx, s[j]);
        }
        const float m_new = fmaxf(m, mx);
        const float m_use = m_new == -FT_INFINITY ? 0.0f : m_new;  // no key seen yet: weights 0, not NaN
        const float alpha = exp2f(m - m_use);
        m = m_new;
        l *= alpha;
        #pragma unroll
        for (int i = 0; i < HALF; ++i) o[i] *= alpha;
        #pragma unroll
        for (int j = 0; j < VARLEN_SIMT_N; ++j) {
            const float p = exp2f(s[j] - m_use);
            l += p;
            #pragma unroll
            for (int i = 0; i < HALF; ++i) o[i] += p * Vs[j][part * HALF + i];
        }
    }
    if (row < len) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float* out = ctx + (long)(start + row) * H + h * D + part * HALF;
        #pragma unroll
        for (int i = 0; i < HALF; ++i) out[i] = o[i] * inv;
    }
}
