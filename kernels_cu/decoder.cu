// GPT-2 decoder ops: token + position embedding, LayerNorm, bias + residual (+ LayerNorm), the KV
// cache write, causal self-attention over the cache (the current position read from device
// memory), and a row gather.
// Reference: ftengine/backends/numpy_ops.py (embed_positions, layernorm, add_bias_residual,
// residual_layernorm, write_kv_cache, cached_attention, decode_attention, gather_rows).

// out (T, E) = wte[ids] + wpe[positions]. grid (T), VEC elements per access.
template <typename T, int VEC>
__global__ void embed_positions(T* __restrict__ out, const int* __restrict__ ids, const int* __restrict__ positions,
                                const T* __restrict__ wte, const T* __restrict__ wpe, int E) {
    const long t = blockIdx.x;
    const T* w = wte + (long)ids[t] * E;
    const T* p = wpe + (long)positions[t] * E;
    for (int c = threadIdx.x * VEC; c < E; c += blockDim.x * VEC) {
        float a[VEC], b[VEC];
        load_floats<T, VEC>(a, w + c);
        load_floats<T, VEC>(b, p + c);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) a[j] += b[j];
        store_floats<T, VEC>(out + t * E + c, a);
    }
}

// out (T, E) = LayerNorm(x); one block per row, the row in registers. `out` may alias `x`.
template <typename T, int VEC, int ITEMS>
__global__ void layernorm(T* out, const T* x, const T* __restrict__ gamma, const T* __restrict__ beta,
                          int H, float eps) {
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * H;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    const T* const terms[1] = {x + base};
    load_row_sum<T, VEC, ITEMS>(v, valid, terms, H);
    layernorm_row_store<T, VEC, ITEMS>(out + base, v, valid, gamma, beta, H, eps, scratch);
}

// out (T, E) = x + bias + residual. grid (T). `out` may alias `residual`.
template <typename T, int VEC>
__global__ void add_bias_residual(T* out, const T* __restrict__ x, const T* __restrict__ bias, const T* residual,
                                  int E) {
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

// hidden (T, E) += x + bias; normed = LayerNorm(hidden): a block's residual add fused with the
// next LayerNorm (pre-LN GPT-2). One block per row, the row in registers.
template <typename T, int VEC, int ITEMS>
__global__ void residual_layernorm(T* hidden, T* __restrict__ normed, const T* __restrict__ x,
                                   const T* __restrict__ bias, const T* __restrict__ gamma,
                                   const T* __restrict__ beta, int H, float eps) {
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * H;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    const T* const terms[3] = {x + base, bias, hidden + base};  // (x + bias) + hidden, as the reference
    load_row_sum<T, VEC, ITEMS>(v, valid, terms, H);
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k)
        if (valid[k]) {
            store_floats<T, VEC>(hidden + base + (threadIdx.x + k * blockDim.x) * VEC, v[k]);
            #pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][j] = to_float(from_float<T>(v[k][j]));  // the stored, rounded sum
        }
    layernorm_row_store<T, VEC, ITEMS>(normed + base, v, valid, gamma, beta, H, eps, scratch);
}

// Token t's key and value (+ bias) -> cache[seq_ids[t], head, positions[t], :], caches (B, heads, L, D).
// grid (T), each thread VEC elements of the 2E key|value columns.
template <typename T, int VEC>
__global__ void write_kv_cache(T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ qkv,
                               const T* __restrict__ bias, const int* __restrict__ seq_ids,
                               const int* __restrict__ positions, int heads, int D, int L) {
    const int E = heads * D;
    const long t = blockIdx.x;
    const long b = seq_ids[t], pos = positions[t];
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
// sequence (FasterTransformer's masked decoder attention, vectorised). One block per
// (token, head); a group of TPK threads (a power of two <= 32) takes one key at a time, each
// thread VEC elements of the head dimension (16-byte loads); each group has ATTN_UNROLL keys'
// loads in flight, so blockDim / TPK * ATTN_UNROLL keys are read at once.
// flags: ATTN_ROWS_ARE_TOKENS (token t is sequence t, seq_ids unused), ATTN_INDIRECT (key p of
// sequence b lives in cache row indir[b * L + p]: beams share their parents' cache rows),
// ATTN_WRITE_KV (first store token t's own key and value, + bias, at positions[t]: a decode step).
// Block ATTN_THREADS; dynamic shared memory: L floats of scores + (blockDim / TPK) * D floats of
// partial outputs.
#define ATTN_ROWS_ARE_TOKENS 1
#define ATTN_INDIRECT 2
#define ATTN_WRITE_KV 4
#define ATTN_THREADS 256
#define ATTN_UNROLL 4

template <typename T, int VEC>
__global__ void __launch_bounds__(ATTN_THREADS) cached_attention(
        T* __restrict__ ctx, const T* __restrict__ qkv, const T* __restrict__ bias, T* k_cache, T* v_cache,
        const int* __restrict__ seq_ids, const int* __restrict__ positions, const int* __restrict__ indir,
        int flags, int heads, int D, int L, int TPK, float scale) {
    extern __shared__ float sm[];
    __shared__ float scratch[32];
    const int E = heads * D;
    const long t = blockIdx.x;
    const int h = blockIdx.y;
    const long b = (flags & ATTN_ROWS_ARE_TOKENS) ? t : seq_ids[t];
    const int pos = positions[t], n = pos + 1;
    const long head_stride = (long)L * D;
    const T* row = qkv + t * 3 * E;
    if (flags & ATTN_WRITE_KV) {
        for (int c = threadIdx.x * VEC; c < 2 * D; c += blockDim.x * VEC) {
            const int which = c >= D, d = c - which * D;
            float a[VEC], bb[VEC];
            load_floats<T, VEC>(a, row + (1 + which) * E + h * D + d);
            load_floats<T, VEC>(bb, bias + (1 + which) * E + h * D + d);
            #pragma unroll
            for (int j = 0; j < VEC; ++j) a[j] += bb[j];
            store_floats<T, VEC>((which ? v_cache : k_cache) + (b * heads + h) * head_stride + (long)pos * D + d, a);
        }
        __syncthreads();  // the block's own cache writes are visible to it from here
    }
    const int slot = threadIdx.x % TPK, group = threadIdx.x / TPK, groups = blockDim.x / TPK;
    const int col = slot * VEC;
    const bool active = col < D;
    float q[VEC];
    #pragma unroll
    for (int j = 0; j < VEC; ++j) q[j] = 0.0f;
    if (active) {
        float bb[VEC];
        load_floats<T, VEC>(q, row + h * D + col);
        load_floats<T, VEC>(bb, bias + h * D + col);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) q[j] += bb[j];
    }
    const int* src = indir + b * L;
    float* scores = sm;
    float* partial = sm + L;
    float mx = -FT_INFINITY;
    for (int j0 = 0; j0 < n; j0 += groups * ATTN_UNROLL) {  // every lane runs every round (the shuffles)
        float k[ATTN_UNROLL][VEC];
        #pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int j = j0 + u * groups + group;
            if (j < n && active) {
                const long r = (flags & ATTN_INDIRECT) ? src[j] : b;
                load_floats<T, VEC>(k[u], k_cache + (r * heads + h) * head_stride + (long)j * D + col);
            } else {
                #pragma unroll
                for (int i = 0; i < VEC; ++i) k[u][i] = 0.0f;
            }
        }
        #pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int j = j0 + u * groups + group;
            float dot = 0.0f;
            #pragma unroll
            for (int i = 0; i < VEC; ++i) dot += q[i] * k[u][i];
            for (int off = TPK / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
            if (j < n) {
                dot *= scale;
                if (slot == 0) scores[j] = dot;
                mx = fmaxf(mx, dot);
            }
        }
    }
    mx = block_max(mx, scratch);  // synchronises: the scores are complete
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(scores[j] - mx);
        scores[j] = e;
        sum += e;
    }
    const float inv = 1.0f / block_sum(sum, scratch);
    float acc[VEC];
    #pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
    if (active)
        for (int j0 = group; j0 < n; j0 += groups * ATTN_UNROLL) {
            float v[ATTN_UNROLL][VEC], p[ATTN_UNROLL];
            #pragma unroll
            for (int u = 0; u < ATTN_UNROLL; ++u) {
                const int j = j0 + u * groups;
                p[u] = 0.0f;
                if (j < n) {
                    const long r = (flags & ATTN_INDIRECT) ? src[j] : b;
                    p[u] = scores[j];
                    load_floats<T, VEC>(v[u], v_cache + (r * heads + h) * head_stride + (long)j * D + col);
                } else {
                    #pragma unroll
                    for (int i = 0; i < VEC; ++i) v[u][i] = 0.0f;
                }
            }
            #pragma unroll
            for (int u = 0; u < ATTN_UNROLL; ++u) {
                #pragma unroll
                for (int i = 0; i < VEC; ++i) acc[i] += p[u] * v[u][i];
            }
        }
    if (active) {
        #pragma unroll
        for (int i = 0; i < VEC; ++i) partial[group * D + col + i] = acc[i];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float total = 0.0f;
        for (int g = 0; g < groups; ++g) total += partial[g * D + d];
        ctx[t * E + h * D + d] = from_float<T>(total * inv);
    }
}

// out (N, E) = x[rows]. grid (N).
template <typename T, int VEC>
__global__ void gather_rows(T* __restrict__ out, const T* __restrict__ x, const int* __restrict__ rows, int E) {
    const long src = (long)rows[blockIdx.x] * E, dst = (long)blockIdx.x * E;
    for (int c = threadIdx.x * VEC; c < E; c += blockDim.x * VEC)
        *reinterpret_cast<Pack<T, VEC>*>(out + dst + c) = *reinterpret_cast<const Pack<T, VEC>*>(x + src + c);
}
