// Device helpers of the token choice kernels (sampling.cu, sampling_levels.cu, sampling_cluster.cu)
// and of beam search (beam.cu), prepended to each of those sources (kernels.py FOLLOWS).

__device__ __forceinline__ float philox_uniform(unsigned step, unsigned seq, unsigned key0, unsigned key1) {
    unsigned c0 = step, c1 = seq, c2 = 0u, c3 = 0u;
    #pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { key0 += 0x9E3779B9u; key1 += 0xBB67AE85u; }
        const unsigned lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
        const unsigned lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
        const unsigned n0 = hi1 ^ c1 ^ key0, n2 = hi0 ^ c3 ^ key1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    }
    return (float)(c0 >> 8) * 5.9604644775390625e-08f;  // 2^-24
}

#define SWEEP_UNROLL 4

// f(i, src[i]) for every i < n, once each, spread over the block: 16-byte loads, SWEEP_UNROLL of
// them in flight per thread (a loop that waited for each load in turn would be bound by memory
// latency); the few elements before the first 16-byte boundary and after the last go one by one.
// Each thread visits its elements in a fixed order.
template <typename F>
__device__ __forceinline__ void sweep(const float* src, int n, F f) {
    const int head = min(n, (int)(((16u - ((unsigned)(size_t)src & 15u)) & 15u) >> 2));
    if ((int)threadIdx.x < head) f(threadIdx.x, src[threadIdx.x]);
    const float4* body = reinterpret_cast<const float4*>(src + head);
    const int n4 = (n - head) >> 2;
    for (int base = threadIdx.x; base < n4; base += SWEEP_UNROLL * blockDim.x) {
        float4 v[SWEEP_UNROLL];
        #pragma unroll
        for (int u = 0; u < SWEEP_UNROLL; ++u) {
            const int i = base + u * blockDim.x;
            v[u] = i < n4 ? body[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        #pragma unroll
        for (int u = 0; u < SWEEP_UNROLL; ++u) {
            const int i = head + 4 * (base + u * blockDim.x);
            if (base + u * (int)blockDim.x < n4) {
                f(i, v[u].x);
                f(i + 1, v[u].y);
                f(i + 2, v[u].z);
                f(i + 3, v[u].w);
            }
        }
    }
    const int tail = head + 4 * n4;
    if ((int)threadIdx.x < n - tail) f(tail + threadIdx.x, src[tail + threadIdx.x]);
}

// -inf for every token of s (tokens lo..hi-1) that would complete an n-gram already in
// seq[0..len) (HF NoRepeatNGramLogitsProcessor): for each i whose n-1 tokens equal the last n-1,
// seq[i + n - 1] is banned. Block-wide; the caller synchronises after it.
__device__ __forceinline__ void ban_repeated_ngrams(float* s, int lo, int hi, const int* seq, int len, int n) {
    for (int i = threadIdx.x; i + n <= len; i += blockDim.x) {
        bool match = true;
        for (int k = 0; k < n - 1 && match; ++k) match = seq[i + k] == seq[len - n + 1 + k];
        const int token = seq[i + n - 1];
        if (match && token >= lo && token < hi) s[token - lo] = -FT_INFINITY;
    }
}

// Inclusive prefix sums of v over the warp in lane order.
template <typename V>
__device__ __forceinline__ V warp_inclusive_scan(V v) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const V y = __shfl_up_sync(0xffffffffu, v, off);
        if (lane >= off) v += y;
    }
    return v;
}

// Exclusive prefix sums of v over the block in thread order; total gets the block's sum.
template <typename V>
__device__ __forceinline__ V block_exclusive_scan(V v, V* scratch, V& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const V incl = warp_inclusive_scan(v);
    V excl = __shfl_up_sync(0xffffffffu, incl, 1);
    excl = lane ? excl : V(0);
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) scratch[lane] = warp_inclusive_scan(lane < warps ? scratch[lane] : V(0));
    __syncthreads();
    total = scratch[warps - 1];
    const V out = (warp > 0 ? scratch[warp - 1] : V(0)) + excl;
    __syncthreads();
    return out;
}

// A token's mass exp(score - max) in fixed point (`scale` = 2^k with V * scale < 2^63, so that
// sums are exact, whatever their order, and fit).
__device__ __forceinline__ unsigned long long fixed_mass(float x, float mx, double scale) {
    return (unsigned long long)((double)expf(x - mx) * scale);
}

// ---------------------------------------------------------------- the sliced token choice's row state
// Grid (B, S) for every kernel: row b's vocabulary in S slices of `slice` tokens, a block each,
// so that a few rows still fill the GPU. Row b's state (`words` u64 words at state + b * words,
// zero between calls: the kernel that finishes a row clears what it used) holds CHOICE_BINS
// words (the selects' digit counts, then the draw's chunk sums) and 8 at CHOICE_BINS + CH_*.
// A kernel that needs all slices' results takes them in the row's last block to finish (a
// ticket counter, __threadfence).
#define CHOICE_THREADS 256
#define CHOICE_BINS 2048
#define CH_FLAGS 0   // bit 0: a non-finite logit
#define CH_MAX 1     // max over the scores of (order_key << 32) | ~index
#define CH_K 2       // top-k: the key prefix chosen so far, then the k-th largest key
#define CH_K_ABOVE 3
#define CH_Y 4       // top-p: the same for its cut-off key
#define CH_Y_ABOVE 5
#define CH_TOTAL 6   // top-p: the mass of the tokens top-k keeps (fixed point)
#define CH_TICKETS 7  // a row's state: CHOICE_BINS + 8 words

// Whether this block is the last of the row's S to get here (its writes before the call are
// then visible to it). Block-wide.
__device__ __forceinline__ bool last_of_row(unsigned long long* tickets, int S) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(tickets, 1ull) == (unsigned long long)(S - 1);
    __syncthreads();
    if (last) __threadfence();
    return last;
}
