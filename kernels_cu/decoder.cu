// GPT-2 decoder ops: token + position embedding, LayerNorm, bias + residual, the KV cache write,
// causal self-attention over the cache (FasterTransformer's masked decoder attention: one block
// per (token, head), the current position read from device memory), and a row gather.
// Reference: ftengine/backends/numpy_ops.py (embed_positions, layernorm, add_bias_residual,
// write_kv_cache, cached_attention, gather_rows).

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
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int col = (threadIdx.x + k * blockDim.x) * VEC;
        valid[k] = col < H;
        if (valid[k]) load_floats<T, VEC>(v[k], x + base + col);
    }
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

// ctx (T, E): token t's query (+ bias) attends to cache positions 0..positions[t] of its sequence.
// grid (T, heads), block 128; dynamic shared memory: (positions[t] + 1 <= L) floats of scores
// plus D floats of the query and 128 floats of partial outputs.
template <typename T>
__global__ void cached_attention(T* __restrict__ ctx, const T* __restrict__ qkv, const T* __restrict__ bias,
                                 const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                 const int* __restrict__ seq_ids, const int* __restrict__ positions,
                                 int heads, int D, int L, float scale) {
    extern __shared__ float sm[];
    __shared__ float scratch[32];
    const int E = heads * D;
    const long t = blockIdx.x;
    const int h = blockIdx.y;
    const long b = seq_ids[t];
    const int n = positions[t] + 1;                 // keys 0..positions[t]
    float* q = sm;                                  // (D,)
    float* partial = sm + D;                        // (blockDim.x,)
    float* scores = sm + D + blockDim.x;            // (n,)
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        q[d] = to_float(qkv[t * 3 * E + h * D + d]) + to_float(bias[h * D + d]);
    __syncthreads();
    const T* K = k_cache + (b * heads + h) * (long)L * D;
    const T* V = v_cache + (b * heads + h) * (long)L * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    float mx = -FT_INFINITY;
    for (int j = warp; j < n; j += warps) {         // a warp per key, lanes across the head dimension
        float dot = 0.0f;
        for (int d = lane; d < D; d += 32) dot += q[d] * to_float(K[(long)j * D + d]);
        dot = warp_sum(dot) * scale;
        if (lane == 0) scores[j] = dot;
        mx = fmaxf(mx, dot);
    }
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(scores[j] - mx);
        scores[j] = e;
        sum += e;
    }
    const float inv = 1.0f / block_sum(sum, scratch);  // block_sum synchronises: scores are complete
    const int groups = blockDim.x / D;              // blockDim.x >= D; threads past groups * D idle here
    const int d = threadIdx.x % D, g = threadIdx.x / D;
    float acc = 0.0f;
    if (g < groups)
        for (int j = g; j < n; j += groups) acc += scores[j] * to_float(V[(long)j * D + d]);
    partial[threadIdx.x] = acc;
    __syncthreads();
    if (g == 0) {
        for (int k = 1; k < groups; ++k) acc += partial[k * D + d];
        ctx[t * E + h * D + d] = from_float<T>(acc * inv);
    }
}

// out (N, E) = x[rows]. grid (N).
template <typename T, int VEC>
__global__ void gather_rows(T* __restrict__ out, const T* __restrict__ x, const int* __restrict__ rows, int E) {
    const long src = (long)rows[blockIdx.x] * E, dst = (long)blockIdx.x * E;
    for (int c = threadIdx.x * VEC; c < E; c += blockDim.x * VEC)
        *reinterpret_cast<Pack<T, VEC>*>(out + dst + c) = *reinterpret_cast<const Pack<T, VEC>*>(x + src + c);
}
