// Unfused attention around the cuBLAS batched GEMMs (QK^T and PV):
// add QKV bias + split heads, masked softmax, merge heads.
// Reference: ftengine/backends/numpy_ops.py add_qkv_bias_split_heads, masked_softmax, merge_heads.

// qkv (B*S, 3H) + bias (3H,) -> q, k, v each (B*heads, S, D). grid (B*S tokens); each thread
// moves VEC consecutive elements (D % VEC == 0, so a vector never crosses a head).
template <typename T, int VEC>
__global__ void add_qkv_bias_split_heads(T* __restrict__ q, T* __restrict__ k, T* __restrict__ v,
                                         const T* __restrict__ qkv, const T* __restrict__ bias,
                                         int S, int heads, int D) {
    wait_for_previous();
    const int H = heads * D;
    const int t = blockIdx.x, b = t / S, s = t - b * S;
    const T* src = qkv + (long)t * 3 * H;
    for (int c = threadIdx.x * VEC; c < 3 * H; c += blockDim.x * VEC) {
        const int which = c / H, within = c - which * H;
        const int head = within / D, d = within - head * D;
        float a[VEC], bb[VEC];
        load_floats<T, VEC>(a, src + c);
        load_floats<T, VEC>(bb, bias + c);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) a[j] += bb[j];
        T* dst = which == 0 ? q : (which == 1 ? k : v);
        store_floats<T, VEC>(dst + (((long)b * heads + head) * S + s) * D + d, a);
    }
}

// ctx (B*heads, S, D) -> out (B*S, heads*D). grid (B*S tokens), VEC elements per access.
template <typename T, int VEC>
__global__ void merge_heads(T* __restrict__ out, const T* __restrict__ ctx, int S, int heads, int D) {
    wait_for_previous();
    const int H = heads * D;
    const int t = blockIdx.x, b = t / S, s = t - b * S;
    for (int c = threadIdx.x * VEC; c < H; c += blockDim.x * VEC) {
        const int head = c / D, d = c - head * D;
        *reinterpret_cast<Pack<T, VEC>*>(out + (long)t * H + c) =
            *reinterpret_cast<const Pack<T, VEC>*>(ctx + (((long)b * heads + head) * S + s) * D + d);
    }
}

// Softmax over rows of S scores, keys at or past the sequence's length masked.
// Warp per row: each lane holds PER_LANE scores in registers, read and written VEC at a time
// (VEC * sizeof(T) == 16 when the row length allows it). Rows: B*heads*S; row r belongs to
// sequence r / (heads * S) and is query r % S. Keys at or past the length, and with window > 0
// those farther than `window` from the query, get zero weight. A row with no key is zeros.
__device__ __forceinline__ bool key_visible(int key, int len, int query, int window) {
    return key < len && (window <= 0 || abs(key - query) <= window);
}

template <typename T, int PER_LANE, int VEC>
__global__ void masked_softmax_warp(T* out, const T* in, const int* __restrict__ lengths,
                                    long rows, int S, int heads, int window) {
    wait_for_previous();
    const int lane = threadIdx.x & 31;
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int len = min(lengths[row / ((long)heads * S)], S);
    const int query = (int)(row % S);
    const T* src = in + row * S;
    T* dst = out + row * S;
    float x[PER_LANE];
    float mx = -FT_INFINITY;
    #pragma unroll
    for (int c = 0; c < PER_LANE / VEC; ++c) {
        const int col = (c * 32 + lane) * VEC;
        Pack<T, VEC> p;
        if (col < S) p = *reinterpret_cast<const Pack<T, VEC>*>(src + col);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float val = key_visible(col + j, len, query, window) ? to_float(p.v[j]) : -FT_INFINITY;
            x[c * VEC + j] = val;
            mx = fmaxf(mx, val);
        }
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        x[i] = (x[i] == -FT_INFINITY) ? 0.0f : expf(x[i] - mx);
        sum += x[i];
    }
    sum = warp_sum(sum);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    #pragma unroll
    for (int c = 0; c < PER_LANE / VEC; ++c) {
        const int col = (c * 32 + lane) * VEC;
        if (col < S) {
            Pack<T, VEC> p;
            #pragma unroll
            for (int j = 0; j < VEC; ++j) p.v[j] = from_float<T>(x[c * VEC + j] * inv);
            *reinterpret_cast<Pack<T, VEC>*>(dst + col) = p;
        }
    }
}

// Block per row, for rows too long for registers: the row is staged in shared memory (S floats).
template <typename T>
__global__ void masked_softmax_block(T* out, const T* in, const int* __restrict__ lengths,
                                     long rows, int S, int heads, int window) {
    wait_for_previous();
    extern __shared__ float buf[];
    __shared__ float scratch[32];
    const long row = blockIdx.x;
    const int len = min(lengths[row / ((long)heads * S)], S);
    const int query = (int)(row % S);
    const T* src = in + row * S;
    T* dst = out + row * S;
    float mx = -FT_INFINITY;
    for (int i = threadIdx.x; i < S; i += blockDim.x) {
        const float val = key_visible(i, len, query, window) ? to_float(src[i]) : -FT_INFINITY;
        buf[i] = val;
        mx = fmaxf(mx, val);
    }
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < S; i += blockDim.x) {
        const float e = buf[i] == -FT_INFINITY ? 0.0f : expf(buf[i] - mx);
        buf[i] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int i = threadIdx.x; i < S; i += blockDim.x) dst[i] = from_float<T>(buf[i] * inv);
}

// MPNet's relative position bias, added to the scaled scores before the softmax:
// scores[n, q, k] += table[buckets[k - q + max_len - 1] * heads + n % heads].
// Reference: ftengine/backends/numpy_ops.py add_relative_bias. grid (B*heads*S rows).
template <typename T>
__global__ void add_relative_bias(T* scores,                      // (B*heads, S, S)
                                  const float* __restrict__ table,  // (buckets, heads)
                                  const int* __restrict__ buckets,  // (2*max_len - 1,)
                                  int S, int heads, int max_len) {
    wait_for_previous();
    const long row = blockIdx.x;                 // n * S + q
    const int q = (int)(row % S);
    const int h = (int)((row / S) % heads);
    T* out = scores + row * S;
    for (int k = threadIdx.x; k < S; k += blockDim.x)
        out[k] = from_float<T>(to_float(out[k]) + table[buckets[k - q + max_len - 1] * heads + h]);
}
