// Token choice on the GPU, one block (1024 threads) per sequence, with HF `generate` semantics
// and order: repetition penalty, min-new-tokens (eos masked), then greedy argmax, or
// temperature, top-k, top-p and a seeded inverse-CDF draw (Philox4x32-10 uniform for
// (seed, sequence, step)). A row with a non-finite logit gets token -1 (the host reports it).
// Reference: ftengine/decoding/processors.py choose, ftengine/decoding/philox.py.

#define CHOOSE_THREADS 1024

__device__ __forceinline__ unsigned order_key(float f) {  // monotone float -> unsigned
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

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

// Probability masses are summed in double: the float32 rounding of a 50,000-term sum is as large
// as one token's probability and would move the draw (the NumPy reference sums in float64 too).
__device__ __forceinline__ double block_sum_double(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < (int)(blockDim.x >> 5)) ? scratch[lane] : 0.0;
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__global__ void __launch_bounds__(CHOOSE_THREADS) choose_tokens(
        int* __restrict__ out,                    // (B,)
        float* __restrict__ scores_all,           // (B, V) scratch
        const float* __restrict__ logits_all,     // (B, V)
        const unsigned char* __restrict__ seen_all,  // (B, V): tokens of the prompt and generated so far
        const int* __restrict__ eos, int n_eos,
        int V, int step, int min_new, int do_sample, float temperature, int top_k, float top_p,
        float penalty, unsigned seed_lo, unsigned seed_hi) {
    __shared__ float fscratch[32];
    __shared__ double dscratch[32];
    __shared__ int iscratch[32];
    __shared__ unsigned long long best;  // (order key << 32) | ~index: max picks the first largest
    const int b = blockIdx.x;
    const float* logits = logits_all + (long)b * V;
    const unsigned char* seen = seen_all + (long)b * V;
    float* s = scores_all + (long)b * V;

    int bad = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float x = logits[i];
        bad |= !isfinite(x);
        if (penalty != 1.0f && seen[i]) x = x < 0.0f ? x * penalty : x / penalty;
        s[i] = x;
    }
    if (__syncthreads_or(bad)) {
        if (threadIdx.x == 0) out[b] = -1;
        return;
    }
    if (step < min_new && threadIdx.x < n_eos) s[eos[threadIdx.x]] = -FT_INFINITY;
    __syncthreads();

    if (!do_sample) {
        if (threadIdx.x == 0) best = 0ull;
        __syncthreads();
        unsigned long long mine = 0ull;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const unsigned long long k = ((unsigned long long)order_key(s[i]) << 32) | (unsigned)(~i);
            mine = k > mine ? k : mine;
        }
        atomicMax(&best, mine);
        __syncthreads();
        if (threadIdx.x == 0) out[b] = (int)(~(unsigned)(best & 0xffffffffull));
        return;
    }

    if (temperature != 1.0f)
        for (int i = threadIdx.x; i < V; i += blockDim.x) s[i] = s[i] / temperature;
    __syncthreads();
    if (top_k > 0 && top_k < V) {
        // the k-th largest score's key, bit by bit from the top: the largest K with #(key >= K) >= k
        unsigned K = 0u;
        for (int bit = 31; bit >= 0; --bit) {
            const unsigned cand = K | (1u << bit);
            int count = 0;
            for (int i = threadIdx.x; i < V; i += blockDim.x) count += order_key(s[i]) >= cand;
            if (block_sum_int(count, iscratch) >= top_k) K = cand;
        }
        for (int i = threadIdx.x; i < V; i += blockDim.x)
            if (order_key(s[i]) < K) s[i] = -FT_INFINITY;
        __syncthreads();
    }
    float mx = -FT_INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, s[i]);
    mx = block_max(mx, fscratch);
    double total = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) total += (double)expf(s[i] - mx);
    total = block_sum_double(total, dscratch);
    if (top_p < 1.0f) {
        // keep a token iff the probability mass strictly above it is < top_p: the largest K0 with
        // mass(key > K0) >= top_p bounds the removed tokens (key <= K0)
        unsigned K0 = 0u;
        for (int bit = 31; bit >= 0; --bit) {
            const unsigned cand = K0 | (1u << bit);
            double mass = 0.0;
            for (int i = threadIdx.x; i < V; i += blockDim.x)
                if (order_key(s[i]) > cand) mass += (double)expf(s[i] - mx);
            if (block_sum_double(mass, dscratch) / total >= (double)top_p) K0 = cand;
        }
        for (int i = threadIdx.x; i < V; i += blockDim.x)
            if (order_key(s[i]) <= K0) s[i] = -FT_INFINITY;
        __syncthreads();
        total = 0.0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) total += (double)expf(s[i] - mx);
        total = block_sum_double(total, dscratch);
    }
    // inverse CDF in token order: each thread scans a contiguous chunk after a block scan of chunk sums
    const double target = (double)philox_uniform((unsigned)step, (unsigned)b, seed_lo, seed_hi) * total;
    const int chunk = (V + blockDim.x - 1) / blockDim.x;
    const int lo = min(V, threadIdx.x * chunk), hi = min(V, lo + chunk);
    double mine = 0.0;
    int last_nonzero = -1;
    for (int i = lo; i < hi; ++i) {
        const float p = expf(s[i] - mx);
        mine += (double)p;
        if (p > 0.0f) last_nonzero = i;
    }
    __shared__ double prefix[CHOOSE_THREADS];
    prefix[threadIdx.x] = mine;
    __syncthreads();
    for (int off = 1; off < blockDim.x; off <<= 1) {  // inclusive Hillis-Steele scan
        const double add = threadIdx.x >= off ? prefix[threadIdx.x - off] : 0.0;
        __syncthreads();
        prefix[threadIdx.x] += add;
        __syncthreads();
    }
    double cum = prefix[threadIdx.x] - mine;
    int found = V;
    for (int i = lo; i < hi; ++i) {
        cum += (double)expf(s[i] - mx);
        if (cum > target) { found = i; break; }
    }
    const int pick = -block_max_int(-found, iscratch);
    const int last = block_max_int(last_nonzero, iscratch);
    if (threadIdx.x == 0) out[b] = min(pick, last);
}

// seen (B, V): seen[rows[i], tokens[i]] = 1 for the n tokens just fed.
__global__ void mark_seen(unsigned char* __restrict__ seen, const int* __restrict__ tokens,
                          const int* __restrict__ rows, int n, int V) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        seen[(long)rows[i] * V + tokens[i]] = 1;
}
