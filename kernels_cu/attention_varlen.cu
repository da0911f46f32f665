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
// grid (ceil(max_seqlen / BLOCK_M), B * heads + 1): the tensor-core kernel with 32 WARPS
// threads, BLOCK_M = 16 WARPS MT and 2 * 2 * KN * (D + 8) elements of dynamic shared memory; the
// fp32 one with 128 threads and BLOCK_M = 64. The last row of blocks zeroes the ctx rows past the
// last sequence (batch padding), so they hold no stale values.

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

// Blocks of the extra grid row: zero ctx rows cu_seqlens[batch] .. n_tokens. True if this block did.
template <typename T>
__device__ __forceinline__ bool zero_padding_rows(T* ctx, const int* cu_seqlens, int batch, int heads,
                                                  int n_tokens, int H) {
    if ((int)blockIdx.y != batch * heads) return false;
    const long from = (long)cu_seqlens[batch] * H, to = (long)n_tokens * H;
    for (long i = from + (long)blockIdx.x * blockDim.x + threadIdx.x; i < to; i += (long)gridDim.x * blockDim.x)
        ctx[i] = from_float<T>(0.0f);
    return true;
}

// ---------------------------------------------------------------- tensor cores (half, bf16)

// Two floats rounded to one 32-bit register of T pairs (lo in the low half): one cvt instruction.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 b16 matrices from shared memory (a 32-bit shared window address); lane l gives a
// row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// exp2 on the special-function unit, flushing denormals: ex2(-inf) = +0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// 16 bytes global -> shared (a 32-bit shared window address) without passing through
// registers; zeros when `valid` is false.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// Copies tiles of ROWS rows of one head's K or V columns into shared memory, THREADS threads
// sharing each tile: thread i copies 16-byte column i % (D / 8) of rows i / (D / 8) + k STEP, so
// only its first chunk's offsets are kept. Rows past the sequence are zeros. K's bias is left
// out: it adds q.b_k to every score of a query row, which the softmax cancels. V's bias is added
// to the output instead: each row's weights sum to 1.
template <typename T, int D, int LD, int ROWS, int THREADS>
struct TileLoader {
    static constexpr int PER_ROW = D / 8, STEP = THREADS / PER_ROW, CHUNKS = ROWS / STEP;
    static_assert(THREADS % PER_ROW == 0 && ROWS % STEP == 0, "every thread copies as many chunks");
    int row, src, step;  // the first chunk's row in the tile, its element offset; STEP rows' offset
    unsigned dst;        // the first chunk's byte offset in the tile
    __device__ __forceinline__ TileLoader(int row_stride) {
        row = threadIdx.x / PER_ROW;
        const int c = (threadIdx.x - row * PER_ROW) * 8;
        src = row * row_stride + c;
        step = STEP * row_stride;
        dst = (row * LD + c) * sizeof(T);
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
    if (zero_padding_rows(ctx, cu_seqlens, batch, heads, n_tokens, heads * D)) return;
    const int bh = blockIdx.y, b = bh / heads, h = bh - b * heads;
    const int start = cu_seqlens[b], len = cu_seqlens[b + 1] - start;
    const int q0 = blockIdx.x * BLOCK_M;
    if (q0 >= len) return;
    const int H = heads * D, row_stride = 3 * H;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
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

    // K/V tile 0 in flight while Q + bias (rounded to T, as the unfused path stores it) is
    // staged through the stage-1 buffers and read into A fragments.
    loader.load(smem_base, k_head, tile0 * KN, len, row_stride);
    loader.load(smem_base + TILE_BYTES, v_head, tile0 * KN, len, row_stride);
    cp_async_commit();
    T* qs = smem + 2 * TILE;
    for (int i = threadIdx.x; i < BLOCK_M * (D / 8); i += blockDim.x) {
        const int r = i / (D / 8), c = (i - r * (D / 8)) * 8;
        float v[8], bb[8];
        if (q0 + r < len) {
            load_floats<T, 8>(v, base + (long)(q0 + r) * row_stride + h * D + c);
            load_floats<T, 8>(bb, bias + h * D + c);
            #pragma unroll
            for (int j = 0; j < 8; ++j) v[j] += bb[j];
        } else {
            #pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = 0.0f;
        }
        store_floats<T, 8>(qs + r * LD + c, v);
    }
    __syncthreads();
    unsigned qa[MT][D / 16][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            ldmatrix_x4(qa[mt][kk],
                        smem_addr(qs + (w0 - q0 + mt * 16 + (lm & 1) * 8 + lr) * LD + kk * 16 + (lm >> 1) * 8));

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
        __syncthreads();  // every warp is done with the stage the next copy overwrites (and with qs)
        if (it + 1 < n_tiles) {
            const unsigned next = smem_base + ((it + 1) & 1) * 2 * TILE_BYTES;
            loader.load(next, k_head, n0 + KN, len, row_stride);
            loader.load(next + TILE_BYTES, v_head, n0 + KN, len, row_stride);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
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
        // mask the keys a row does not see (GENERAL: scale and add the relative bias first), row
        // maxima over the 4 threads of a row; a tile of keys every row of this warp sees needs no mask
        const bool masked = GENERAL || n0 + KN > len || (causal && n0 + KN - 1 > w0);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int row_lo = w0 + mt * 16 + g;  // this thread's rows: row_lo (e < 2), row_lo + 8
            if (masked) {
                #pragma unroll
                for (int j = 0; j < KN / 8; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = n0 + j * 8 + t4 * 2 + (e & 1), row = row_lo + (e >> 1) * 8;
                        if (GENERAL)
                            s[mt][j][e] = keys.visible(key, row) ? keys.score(s[mt][j][e], scale_log2, key, row)
                                                                 : -FT_INFINITY;
                        else if (!(key < len && (!causal || key <= row)))
                            s[mt][j][e] = -FT_INFINITY;
                    }
                }
            }
            float mx[2] = {-FT_INFINITY, -FT_INFINITY};
            #pragma unroll
            for (int j = 0; j < KN / 8; ++j) {
                mx[0] = fmaxf(mx[0], fmaxf(s[mt][j][0], s[mt][j][1]));
                mx[1] = fmaxf(mx[1], fmaxf(s[mt][j][2], s[mt][j][3]));
            }
            float m_use[2];
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_new = fmaxf(m[mt][r], mx[r] * mul);
                // GENERAL: a row that has seen no key yet (a window starting past this tile) keeps
                // m = -inf: exponents are taken against 0 then, so every weight and alpha is 0, never
                // NaN. Otherwise key n0 <= q0 is visible to every row, so m_new is finite.
                m_use[r] = GENERAL && m_new == -FT_INFINITY ? 0.0f : m_new;
                const float alpha = fast_exp2(m[mt][r] - m_use[r]);
                m[mt][r] = m_new;
                l[mt][r] *= alpha;
                #pragma unroll
                for (int j = 0; j < D / 8; ++j) {
                    o[mt][j][2 * r] *= alpha;
                    o[mt][j][2 * r + 1] *= alpha;
                }
            }
            #pragma unroll
            for (int j = 0; j < KN / 8; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[mt][j][e] = fast_exp2(fmaf(s[mt][j][e], mul, -m_use[e >> 1]));
                    l[mt][e >> 1] += s[mt][j][e];
                }
            }
        }
        // O += P V, P re-used from the score accumulators as A fragments
        #pragma unroll
        for (int kk = 0; kk < KN / 16; ++kk) {
            unsigned pa[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
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
    const T* bv = bias + 2 * H + h * D + t4 * 2;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = l[mt][r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            const int row = w0 + mt * 16 + g + r * 8;
            if (row < len) {
                T* out = ctx + (long)(start + row) * H + h * D + t4 * 2;
                #pragma unroll
                for (int j = 0; j < D / 8; ++j)
                    *reinterpret_cast<unsigned*>(out + j * 8) =
                        pack2<T>(o[mt][j][r * 2] * inv + to_float(bv[j * 8]), o[mt][j][r * 2 + 1] * inv + to_float(bv[j * 8 + 1]));
            }
        }
    }
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
    if (zero_padding_rows(ctx, cu_seqlens, batch, heads, n_tokens, heads * D)) return;
    const int bh = blockIdx.y, b = bh / heads, h = bh - b * heads;
    const int start = cu_seqlens[b], len = cu_seqlens[b + 1] - start;
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
