// GPT-2 decoder ops: token + position embedding, LayerNorm, bias + residual (+ LayerNorm), the KV
// cache write, causal self-attention over the cache (the current position read from device
// memory), and a row gather.
// Reference: ftengine/backends/numpy_ops.py (embed_positions, layernorm, add_bias_residual,
// residual_layernorm, write_kv_cache, cached_attention, decode_attention, gather_rows).

// out (T, E) = wte[ids] + wpe[positions], without the position where ids[t] == unplaced (M2M100's
// pad; -1: none). grid (T), VEC elements per access.
template <typename T, int VEC>
__global__ void embed_positions(T* __restrict__ out, const int* __restrict__ ids, const int* __restrict__ positions,
                                const T* __restrict__ wte, const T* __restrict__ wpe, int E, int unplaced) {
    wait_then_launch_next();
    const long t = blockIdx.x;
    const int id = ids[t];
    const T* w = wte + (long)id * E;
    const T* p = wpe + (long)positions[t] * E;
    for (int c = threadIdx.x * VEC; c < E; c += blockDim.x * VEC) {
        float a[VEC], b[VEC];
        load_floats<T, VEC>(a, w + c);
        if (id != unplaced) {
            load_floats<T, VEC>(b, p + c);
            #pragma unroll
            for (int j = 0; j < VEC; ++j) a[j] += b[j];
        }
        store_floats<T, VEC>(out + t * E + c, a);
    }
}

// out (T, E) = LayerNorm(x) (rms: T5's RMS norm); one block per row, the row in registers. `out`
// may alias `x`.
template <typename T, int VEC, int ITEMS>
__global__ void layernorm(T* out, const T* x, const T* __restrict__ gamma, const T* __restrict__ beta,
                          int H, float eps, int rms) {
    wait_then_launch_next();
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * H;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    const T* const terms[1] = {x + base};
    load_row_sum<T, VEC, ITEMS>(v, valid, terms, H);
    layernorm_row_store<T, VEC, ITEMS>(out + base, v, valid, gamma, beta, H, eps, scratch, rms);
}

// out (T, E) = x + bias + residual. grid (T). `out` may alias `residual`.
template <typename T, int VEC>
__global__ void add_bias_residual(T* out, const T* __restrict__ x, const T* __restrict__ bias, const T* residual,
                                  int E) {
    wait_then_launch_next();
    const long base = (long)blockIdx.x * E;
    for (int c = threadIdx.x * VEC; c < E; c += blockDim.x * VEC) {
        float a[VEC], b[VEC], r[VEC];
        load_floats<T, VEC>(a, x + base + c);
        load_floats<T, VEC>(b, bias + c);
        load_floats<T, VEC>(r, residual + base + c);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) a[j] += b[j] + r[j];
        store_floats<T, VEC>(out + base + c, a);
    }
}

// hidden (T, E) += x + bias; normed = LayerNorm(hidden) (rms: T5's RMS norm): a block's residual
// add fused with the next LayerNorm (pre-LN GPT-2). One block per row, the row in registers. X float: x is SPLITS
// slices of float partial sums (SPLITS, T, E) of a split product (gemv.cu skinny_mma), added in
// slice order and rounded to T, as the product would have stored their sum.
template <typename T, typename X, int SPLITS, int VEC, int ITEMS>
__global__ void residual_layernorm(T* hidden, T* __restrict__ normed, const X* __restrict__ x,
                                   const T* __restrict__ bias, const T* __restrict__ gamma,
                                   const T* __restrict__ beta, int H, float eps, int rms) {
    wait_then_launch_next();
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * H;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    load_product_row<T, X, SPLITS, VEC, ITEMS>(v, valid, x, H, blockIdx.x, gridDim.x);
    const T* const terms[2] = {bias, hidden + base};  // (x + bias) + hidden, as the reference
    add_row_terms<T, VEC, ITEMS, 2>(v, valid, terms, H);
    store_row<T, VEC, ITEMS>(hidden + base, v, valid);
    round_row<T, VEC, ITEMS>(v, valid);  // the stored, rounded sum
    layernorm_row_store<T, VEC, ITEMS>(normed + base, v, valid, gamma, beta, H, eps, scratch, rms);
}

// Token t's key and value (+ bias) -> cache[seq_ids[t], head, positions[t], :], caches (B, heads, L, D);
// a token of sequence -1 (prefill padding) writes nothing.
// grid (T), each thread VEC elements of the 2E key|value columns.
template <typename T, int VEC>
__global__ void write_kv_cache(T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ qkv,
                               const T* __restrict__ bias, const int* __restrict__ seq_ids,
                               const int* __restrict__ positions, int heads, int D, int L) {
    wait_for_previous();  // not wait_then_launch_next: the prefill's fused attention comes next and
                          // runs slower scheduled early (H100, GPT-2 small 1 x 512: 0.58 -> 0.66 ms)
    const int E = heads * D;
    const long t = blockIdx.x;
    const long b = seq_ids[t], pos = positions[t];
    if (b < 0) return;  // a padding token: no cache row
    for (int c = threadIdx.x * VEC; c < 2 * E; c += blockDim.x * VEC) {
        const int which = c / E, within = c - which * E, head = within / D, d = within - head * D;
        float a[VEC], bb[VEC];
        load_floats<T, VEC>(a, qkv + t * 3 * E + E + c);
        load_floats<T, VEC>(bb, bias + E + c);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) a[j] += bb[j];
        T* cache = which == 0 ? k_cache : v_cache;
        store_floats<T, VEC>(cache + ((b * heads + head) * L + pos) * D + d, a);
    }
}

// ctx (T, E): token t's query (+ bias) attends to cache positions 0..positions[t] of its
// sequence (FasterTransformer's masked decoder attention, vectorised, in one pass). One block per
// (token, head); a group of TPK threads (a power of two <= 32) takes one key at a time, each
// thread VEC elements of the head dimension (16-byte loads), and keeps an online softmax (running
// max, sum and weighted values) over its keys, ATTN_UNROLL keys' K and V loads in flight at once;
// the groups' states are merged within each warp by shuffles, then over the warps.
// flags: ATTN_ROWS_ARE_TOKENS (token t is sequence t, seq_ids unused), ATTN_INDIRECT (key p of
// sequence b lives in cache row indir[b * L + p]: beams share their parents' cache rows),
// ATTN_WRITE_KV (a decode step: token t's own key and value, + bias, are stored at positions[t],
// and used from registers here, rounded as stored; no other token reads a position being written
// in the same step: beams read their parents' rows at earlier positions), ATTN_QUERIES_ONLY (qkv
// rows hold the E query columns alone, not Q, K, V: a cross-attention's queries; not with
// ATTN_WRITE_KV).
// rel_max_len > 0: each score gets rel_table[rel_buckets[key - position + rel_max_len - 1] * heads +
// head] added (T5's relative position bias; no other model passes one).
// Block ATTN_THREADS; dynamic shared memory: (blockDim / 32) * (D + 2) floats.
#define ATTN_ROWS_ARE_TOKENS 1
#define ATTN_INDIRECT 2
#define ATTN_WRITE_KV 4
#define ATTN_QUERIES_ONLY 8
#define ATTN_THREADS 256
#define ATTN_UNROLL 4

// One (token t, head h) of it, by the whole block; `sm` as the kernel's dynamic shared memory.
// CG: qkv read through the L2 only (other blocks of the running grid wrote it: decode_step).
template <typename T, int VEC, bool CG>
__device__ __forceinline__ void attend_cached(
        T* __restrict__ ctx, const T* __restrict__ qkv, const T* __restrict__ bias, T* k_cache, T* v_cache,
        const int* __restrict__ seq_ids, const int* __restrict__ positions, const int* __restrict__ indir,
        int flags, int heads, int D, int L, int TPK, float scale, const float* __restrict__ rel_table,
        const int* __restrict__ rel_buckets, int rel_max_len, long t, int h, float* sm) {
    const int E = heads * D;
    const long b = (flags & ATTN_ROWS_ARE_TOKENS) ? t : seq_ids[t];
    const int pos = positions[t], n = pos + 1;
    const bool own = flags & ATTN_WRITE_KV;
    const long head_stride = (long)L * D;
    const T* row = qkv + t * ((flags & ATTN_QUERIES_ONLY) ? 1 : 3) * E;
    const int slot = threadIdx.x % TPK, group = threadIdx.x / TPK, groups = blockDim.x / TPK;
    const int col = slot * VEC;
    const bool active = col < D;
    float q[VEC], k_own[VEC], v_own[VEC];
    #pragma unroll
    for (int i = 0; i < VEC; ++i) q[i] = k_own[i] = v_own[i] = 0.0f;
    if (active) {
        float bb[VEC];
        load_floats_from<CG, T, VEC>(q, row + h * D + col);
        load_floats<T, VEC>(bb, bias + h * D + col);
        #pragma unroll
        for (int i = 0; i < VEC; ++i) q[i] += bb[i];
        if (own) {  // this token's key and value, stored for later steps, used here as stored
            float kb[VEC], vb[VEC];
            load_floats_from<CG, T, VEC>(k_own, row + E + h * D + col);
            load_floats<T, VEC>(kb, bias + E + h * D + col);
            load_floats_from<CG, T, VEC>(v_own, row + 2 * E + h * D + col);
            load_floats<T, VEC>(vb, bias + 2 * E + h * D + col);
            #pragma unroll
            for (int i = 0; i < VEC; ++i) {
                k_own[i] = to_float(from_float<T>(k_own[i] + kb[i]));
                v_own[i] = to_float(from_float<T>(v_own[i] + vb[i]));
            }
            if (group == 0) {
                const long at = (b * heads + h) * head_stride + (long)pos * D + col;
                store_floats<T, VEC>(k_cache + at, k_own);
                store_floats<T, VEC>(v_cache + at, v_own);
            }
        }
    }
    const int* src = indir + b * L;
    float m = -FT_INFINITY, l = 0.0f, acc[VEC];
    #pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
    for (int j0 = 0; j0 < n; j0 += groups * ATTN_UNROLL) {  // every lane runs every round (the shuffles)
        float k[ATTN_UNROLL][VEC], v[ATTN_UNROLL][VEC];
        #pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int j = j0 + u * groups + group;
            #pragma unroll
            for (int i = 0; i < VEC; ++i) k[u][i] = v[u][i] = 0.0f;
            if (j < n && active) {
                if (own && j == pos) {
                    #pragma unroll
                    for (int i = 0; i < VEC; ++i) { k[u][i] = k_own[i]; v[u][i] = v_own[i]; }
                } else {
                    const long r = (flags & ATTN_INDIRECT) ? src[j] : b;
                    const long at = (r * heads + h) * head_stride + (long)j * D + col;
                    load_floats<T, VEC>(k[u], k_cache + at);
                    load_floats<T, VEC>(v[u], v_cache + at);
                }
            }
        }
        float score[ATTN_UNROLL], top = m;
        #pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            float dot = 0.0f;
            #pragma unroll
            for (int i = 0; i < VEC; ++i) dot += q[i] * k[u][i];
            for (int off = TPK / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
            const int j = j0 + u * groups + group;
            float rel = 0.0f;
            if (rel_max_len > 0 && j < n) rel = rel_table[rel_buckets[j - pos + rel_max_len - 1] * heads + h];
            score[u] = j < n ? dot * scale + rel : -FT_INFINITY;
            top = fmaxf(top, score[u]);
        }
        if (top > -FT_INFINITY) {  // the group has a key so far
            const float alpha = expf(m - top);
            l *= alpha;
            #pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] *= alpha;
            #pragma unroll
            for (int u = 0; u < ATTN_UNROLL; ++u) {
                const float p = expf(score[u] - top);
                l += p;
                #pragma unroll
                for (int i = 0; i < VEC; ++i) acc[i] += p * v[u][i];
            }
            m = top;
        }
    }
    // the groups of a warp (lanes slot, slot + TPK, ...) merged by shuffles, so the block's last
    // combine runs over its warps, not over every group
    for (int off = TPK; off < 32; off <<= 1) {
        const float m_other = __shfl_xor_sync(0xffffffffu, m, off), l_other = __shfl_xor_sync(0xffffffffu, l, off);
        const float top = fmaxf(m, m_other);
        const float mine = top > -FT_INFINITY ? expf(m - top) : 0.0f;  // 0 for a group without keys
        const float theirs = top > -FT_INFINITY ? expf(m_other - top) : 0.0f;
        l = l * mine + l_other * theirs;
        #pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = acc[i] * mine + __shfl_xor_sync(0xffffffffu, acc[i], off) * theirs;
        m = top;
    }
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* warp_max = sm;
    float* warp_total = sm + warps;
    float* warp_acc = sm + 2 * warps;  // (warps, D)
    if (group % (32 / TPK) == 0) {  // the warp's first group holds its merged state
        if (slot == 0) {
            warp_max[warp] = m;
            warp_total[warp] = l;
        }
        if (active) {
            #pragma unroll
            for (int i = 0; i < VEC; ++i) warp_acc[warp * D + col + i] = acc[i];
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float top = -FT_INFINITY;
        for (int w = 0; w < warps; ++w) top = fmaxf(top, warp_max[w]);
        float total = 0.0f, out = 0.0f;
        for (int w = 0; w < warps; ++w) {
            const float share = expf(warp_max[w] - top);  // 0 for a warp without keys
            total += share * warp_total[w];
            out += share * warp_acc[w * D + d];
        }
        ctx[t * E + h * D + d] = from_float<T>(out / total);
    }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(ATTN_THREADS) cached_attention(
        T* __restrict__ ctx, const T* __restrict__ qkv, const T* __restrict__ bias, T* k_cache, T* v_cache,
        const int* __restrict__ seq_ids, const int* __restrict__ positions, const int* __restrict__ indir,
        int flags, int heads, int D, int L, int TPK, float scale, const float* __restrict__ rel_table,
        const int* __restrict__ rel_buckets, int rel_max_len) {
    wait_then_launch_next();
    extern __shared__ float sm[];
    attend_cached<T, VEC, false>(ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, indir, flags, heads, D, L,
                                 TPK, scale, rel_table, rel_buckets, rel_max_len, blockIdx.x, blockIdx.y, sm);
}

// out (N, E) = x[rows]. grid (N).
template <typename T, int VEC>
__global__ void gather_rows(T* __restrict__ out, const T* __restrict__ x, const int* __restrict__ rows, int E) {
    wait_then_launch_next();
    const long src = (long)rows[blockIdx.x] * E, dst = (long)blockIdx.x * E;
    for (int c = threadIdx.x * VEC; c < E; c += blockDim.x * VEC)
        *reinterpret_cast<Pack<T, VEC>*>(out + dst + c) = *reinterpret_cast<const Pack<T, VEC>*>(x + src + c);
}
