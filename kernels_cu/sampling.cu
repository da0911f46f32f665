// Token choice on the GPU with HF `generate` semantics and order.
// choose_tokens, one block (1024 threads) per sequence: repetition penalty, no-repeat n-grams,
// min-new-tokens (eos masked), then greedy argmax, or temperature, top-k, top-p and a seeded
// inverse-CDF draw (Philox4x32-10 uniform for (seed, sequence, step)). A row with a non-finite
// logit gets token -1 (the host reports it). append_tokens then records the choice and feeds it
// to the next step: the step counter, sequences and finished flags live in device memory.
// Beam search (beam_logsumexp, beam_candidates, beam_select): log-softmax, the processors, and
// FasterTransformer's two-stage top-k (per beam over vocabulary slices, then per batch item over
// beams), then HF's finished-hypothesis bookkeeping, one block per batch item.
// Reference: ftengine/decoding/processors.py choose, ftengine/decoding/philox.py,
// ftengine/decoding/beam.py reference_step.

#define CHOOSE_THREADS 1024

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

// Top-k's threshold: the k-th largest key (order_key) of the scores. A radix select from the
// top, 11, 11 and 10 bits at a time: counts per digit of the keys matching the bits chosen so far,
// in shared memory (each warp adds its lanes of equal digit with one atomic: exact counts,
// little contention), then a block scan from the largest digit to the one holding the k-th key.
// Block-wide; hist holds 2048 counts, scan 32.
#define RADIX_BINS 2048

__device__ unsigned kth_largest_key(const float* s, int V, int k, unsigned long long* hist, unsigned long long* scan,
                                    unsigned* found_key, unsigned long long* found_above) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    unsigned prefix = 0u;
    unsigned long long above = 0ull;  // count of the keys above the prefix's range
    for (int level = 0; level < 3; ++level) {
        const int bits = level < 2 ? 11 : 10, shift = level == 0 ? 21 : (level == 1 ? 10 : 0);
        const unsigned high = level == 0 ? 0u : ~0u << (shift + bits);
        const int bins = 1 << bits;
        for (int i = threadIdx.x; i < bins; i += blockDim.x) hist[i] = 0ull;
        __syncthreads();
        for (int base = threadIdx.x - lane; base < V; base += SWEEP_UNROLL * blockDim.x) {  // warp-uniform
            float x[SWEEP_UNROLL];
            #pragma unroll
            for (int u = 0; u < SWEEP_UNROLL; ++u) {
                const int i = base + lane + u * blockDim.x;
                x[u] = i < V ? s[i] : 0.0f;
            }
            #pragma unroll
            for (int u = 0; u < SWEEP_UNROLL; ++u) {
                const unsigned key = order_key(x[u]);
                const bool in = base + lane + u * (int)blockDim.x < V && (key & high) == prefix;
                const unsigned want = __ballot_sync(0xffffffffu, in);
                if (in) {
                    const unsigned digit = (key >> shift) & (bins - 1);
                    const unsigned peers = __match_any_sync(want, digit);
                    if (lane == __ffs(peers) - 1) atomicAdd(&hist[digit], (unsigned long long)__popc(peers));
                }
            }
        }
        __syncthreads();
        // thread t sums the digits of rank t * per .. from the top; a block scan gives what lies above
        const int per = (bins + blockDim.x - 1) / blockDim.x, first = threadIdx.x * per;
        unsigned long long mine = 0ull;
        for (int q = first; q < min(bins, first + per); ++q) mine += hist[bins - 1 - q];
        unsigned long long incl = mine;
        #pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const unsigned long long y = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += y;
        }
        if (lane == 31) scan[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            unsigned long long w = lane < warps ? scan[lane] : 0ull;
            #pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const unsigned long long y = __shfl_up_sync(0xffffffffu, w, off);
                if (lane >= off) w += y;
            }
            scan[lane] = w;
        }
        __syncthreads();
        auto reached = [&](unsigned long long count) { return count >= (unsigned long long)k; };
        unsigned long long run = above + (warp > 0 ? scan[warp - 1] : 0ull) + incl - mine;
        if (!reached(run) && reached(run + mine)) {  // one thread: the goal is reached in its digits
            for (int q = first; q < min(bins, first + per); ++q) {
                const int d = bins - 1 - q;
                if (reached(run + hist[d])) {
                    *found_key = prefix | ((unsigned)d << shift);
                    *found_above = run;
                    break;
                }
                run += hist[d];
            }
        }
        __syncthreads();
        prefix = *found_key;
        above = *found_above;
    }
    return prefix;
}

// HF's top-p cut-off: the largest key threshold Y with mass(order_key(score) >= Y) / total >=
// top_p, the mass of a score being exp(score - mx), summed in double. Four bits at a time from
// the top: each thread's mass per digit among the keys matching the bits chosen so far, summed
// over the block in a fixed order (the same inputs give the same Y every run), then the largest
// digit whose mass from the top reaches the goal. (Per-digit atomics, as kth_largest_key uses,
// would make double sums depend on timing.) Block-wide; sums (32 x 16), bins (16), key and
// weight are shared scratch.
__device__ unsigned top_p_threshold(const float* s, int V, float mx, float top_p, double total,
                                    double (*sums)[16], double* bins, unsigned* key, double* weight) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned prefix = 0u;
    double above = 0.0;  // mass of the keys above the prefix's range
    for (int shift = 28; shift >= 0; shift -= 4) {
        const unsigned high = shift == 28 ? 0u : ~0u << (shift + 4);
        double acc[16];
        #pragma unroll
        for (int d = 0; d < 16; ++d) acc[d] = 0.0;
        sweep(s, V, [&](int, float x) {
            const unsigned k = order_key(x);
            if ((k & high) == prefix) acc[(k >> shift) & 15] += (double)expf(x - mx);
        });
        #pragma unroll
        for (int d = 0; d < 16; ++d) {
            const double v = warp_reduce(acc[d], SumOp());
            if (lane == 0) sums[warp][d] = v;
        }
        __syncthreads();
        if (threadIdx.x < 16) {
            double t = 0.0;
            for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += sums[w][threadIdx.x];
            bins[threadIdx.x] = t;
        }
        __syncthreads();
        if (threadIdx.x == 0) {  // digit 0 always reaches the goal: the bits chosen so far do
            double run = above;
            int d = 15;
            for (; d > 0 && (run + bins[d]) / total < (double)top_p; --d) run += bins[d];
            *key = prefix | ((unsigned)d << shift);
            *weight = run;
        }
        __syncthreads();
        prefix = *key;
        above = *weight;
    }
    return prefix;
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

__global__ void __launch_bounds__(CHOOSE_THREADS) choose_tokens(
        int* __restrict__ out,                    // (B,)
        float* __restrict__ scores_all,           // (B, V) scratch
        const float* __restrict__ logits_all,     // (B, V)
        const unsigned char* __restrict__ seen_all,  // (B, V): tokens of the prompt and generated so far
        const int* __restrict__ eos, int n_eos,
        const int* __restrict__ step_counter,     // (1,): tokens chosen so far
        const int* __restrict__ seq_all,          // (B, L): prompt + generated tokens (no-repeat n-grams)
        const int* __restrict__ lengths,          // (B,)
        int L, int ngram,
        int V, int min_new, int do_sample, float temperature, int top_k, float top_p,
        float penalty, unsigned seed_lo, unsigned seed_hi) {
    __shared__ float fscratch[32];
    __shared__ double dscratch[32];
    __shared__ int iscratch[32];
    __shared__ unsigned long long uscratch[32];
    __shared__ unsigned long long hist[RADIX_BINS], shared_count;
    __shared__ double dsums[CHOOSE_THREADS / 32][16], dbins[16], shared_mass;
    __shared__ unsigned shared_key;
    const int b = blockIdx.x;
    const float* logits = logits_all + (long)b * V;
    const unsigned char* seen = seen_all + (long)b * V;
    float* s = scores_all + (long)b * V;

    const int step = *step_counter;
    int bad = 0;
    if (!do_sample && ngram == 0) {  // greedy in one pass: the processors inline, then the first largest
        const bool mask_eos = step < min_new;
        unsigned long long mine = 0ull;  // (order key << 32) | ~index
        sweep(logits, V, [&](int i, float x) {
            bad |= !isfinite(x);
            if (penalty != 1.0f && seen[i]) x = x < 0.0f ? x * penalty : x / penalty;
            if (mask_eos)
                for (int e = 0; e < n_eos; ++e) x = i == eos[e] ? -FT_INFINITY : x;
            const unsigned long long k = ((unsigned long long)order_key(x) << 32) | (unsigned)(~i);
            mine = k > mine ? k : mine;
        });
        bad = __syncthreads_or(bad);
        mine = block_reduce(mine, uscratch, 0ull, MaxOp());
        if (threadIdx.x == 0) out[b] = bad ? -1 : (int)(~(unsigned)(mine & 0xffffffffull));
        return;
    }
    sweep(logits, V, [&](int i, float x) {
        bad |= !isfinite(x);
        if (penalty != 1.0f && seen[i]) x = x < 0.0f ? x * penalty : x / penalty;
        s[i] = x;
    });
    if (__syncthreads_or(bad)) {
        if (threadIdx.x == 0) out[b] = -1;
        return;
    }
    if (ngram > 0) {
        ban_repeated_ngrams(s, 0, V, seq_all + (long)b * L, lengths[b], ngram);
        __syncthreads();
    }
    if (step < min_new && threadIdx.x < n_eos) s[eos[threadIdx.x]] = -FT_INFINITY;
    __syncthreads();

    if (!do_sample) {  // greedy with n-gram bans: the first of the largest scores
        unsigned long long mine = 0ull;
        sweep(s, V, [&](int i, float x) {
            const unsigned long long k = ((unsigned long long)order_key(x) << 32) | (unsigned)(~i);
            mine = k > mine ? k : mine;
        });
        mine = block_reduce(mine, uscratch, 0ull, MaxOp());
        if (threadIdx.x == 0) out[b] = (int)(~(unsigned)(mine & 0xffffffffull));
        return;
    }

    if (temperature != 1.0f) sweep(s, V, [&](int i, float x) { s[i] = x / temperature; });
    __syncthreads();
    if (top_k > 0 && top_k < V) {  // the k-th largest score's key: #(key >= K) >= k
        const unsigned K = kth_largest_key(s, V, top_k, hist, uscratch, &shared_key, &shared_count);
        sweep(s, V, [&](int i, float x) { if (order_key(x) < K) s[i] = -FT_INFINITY; });
        __syncthreads();
    }
    float mx = -FT_INFINITY;
    sweep(s, V, [&](int, float x) { mx = fmaxf(mx, x); });
    mx = block_max(mx, fscratch);
    double total = 0.0;
    sweep(s, V, [&](int, float x) { total += (double)expf(x - mx); });
    total = block_reduce(total, dscratch, 0.0, SumOp());
    if (top_p < 1.0f) {
        // keep a token iff the probability mass strictly above it is < top_p: the largest Y with
        // mass(key >= Y) >= top_p bounds the removed tokens (key < Y)
        const unsigned Y = top_p_threshold(s, V, mx, top_p, total, dsums, dbins, &shared_key, &shared_mass);
        sweep(s, V, [&](int i, float x) { if (order_key(x) < Y) s[i] = -FT_INFINITY; });
        __syncthreads();
        total = 0.0;
        sweep(s, V, [&](int, float x) { total += (double)expf(x - mx); });
        total = block_reduce(total, dscratch, 0.0, SumOp());
    }
    // inverse CDF in token order: each thread scans a contiguous chunk after a block scan of chunk sums
    const double target = (double)philox_uniform((unsigned)step, (unsigned)b, seed_lo, seed_hi) * total;
    const int chunk = (V + blockDim.x - 1) / blockDim.x;
    const int lo = min(V, threadIdx.x * chunk), hi = min(V, lo + chunk);
    double mine = 0.0;
    int last_nonzero = -1;
    for (int base = lo; base < hi; base += SWEEP_UNROLL) {  // loads of a stretch in flight together
        float v[SWEEP_UNROLL];
        #pragma unroll
        for (int u = 0; u < SWEEP_UNROLL; ++u) v[u] = base + u < hi ? s[base + u] : -FT_INFINITY;
        #pragma unroll
        for (int u = 0; u < SWEEP_UNROLL; ++u) {
            const float p = expf(v[u] - mx);
            mine += (double)p;
            if (p > 0.0f) last_nonzero = base + u;
        }
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
    for (int base = lo; base < hi && found == V; base += SWEEP_UNROLL) {
        float v[SWEEP_UNROLL];
        #pragma unroll
        for (int u = 0; u < SWEEP_UNROLL; ++u) v[u] = base + u < hi ? s[base + u] : -FT_INFINITY;
        #pragma unroll
        for (int u = 0; u < SWEEP_UNROLL; ++u) {
            if (found == V && base + u < hi) {
                cum += (double)expf(v[u] - mx);
                if (cum > target) found = base + u;
            }
        }
    }
    const int pick = -block_max_int(-found, iscratch);
    const int last = block_max_int(last_nonzero, iscratch);
    if (threadIdx.x == 0) out[b] = min(pick, last);
}

// seen (B, V): seen[rows[i], tokens[i]] = 1 for the n tokens just fed (row -1: padding, skipped).
__global__ void mark_seen(unsigned char* __restrict__ seen, const int* __restrict__ tokens,
                          const int* __restrict__ rows, int n, int V) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        if (rows[i] >= 0) seen[(long)rows[i] * V + tokens[i]] = 1;  // row -1: a padding token
}

// After choose_tokens, one block: history[step, b] = chosen[b] (-2 for a row finished earlier);
// a live row appends its token to seq, feeds it to the next step (ids, positions), marks it
// seen, and finishes on an eos id or on -1 (non-finite logits). Then step += 1.
__global__ void append_tokens(int* __restrict__ history,      // (steps, B)
                              int* __restrict__ seq,          // (B, L)
                              int* __restrict__ lengths,      // (B,)
                              int* __restrict__ next_ids,     // (B,)
                              int* __restrict__ next_pos,     // (B,)
                              int* __restrict__ finished,     // (B,)
                              unsigned char* __restrict__ seen,  // (B, V)
                              int* __restrict__ step_counter, const int* __restrict__ chosen,
                              const int* __restrict__ eos, int n_eos, int B, int L, int V) {
    const int step = *step_counter;
    for (int b = threadIdx.x; b < B; b += blockDim.x) {
        if (finished[b]) {
            history[(long)step * B + b] = -2;
            continue;
        }
        const int token = chosen[b];
        history[(long)step * B + b] = token;
        if (token < 0) {
            finished[b] = 1;
            continue;
        }
        const int n = lengths[b];
        seq[(long)b * L + n] = token;
        next_ids[b] = token;
        next_pos[b] = n;
        lengths[b] = n + 1;
        seen[(long)b * V + token] = 1;
        bool end = false;
        for (int e = 0; e < n_eos; ++e) end |= token == eos[e];
        if (end) finished[b] = 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) *step_counter = step + 1;
}

__global__ void increment(int* counter) { *counter += 1; }

// ---------------------------------------------------------------- beam search
// Rows r = b * nb + j (batch item b, beam j). flags (B, 3): improvable, done, non-finite logits.
#define BEAM_KEEP_MAX 64
#define BEAM_NEG (-1.0e9f)  // HF's "impossible" score, added in float32

// stats (R, 2) = row max and log(sum(exp(x - max))) of the logits; a non-finite logit flags its item.
__global__ void __launch_bounds__(1024) beam_logsumexp(float* __restrict__ stats, int* __restrict__ flags,
                                                       const float* __restrict__ logits, int V, int nb) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const float* x = logits + (long)r * V;
    float mx = -FT_INFINITY;
    int bad = 0;
    sweep(x, V, [&](int, float v) {
        bad |= !isfinite(v);
        mx = fmaxf(mx, v);
    });
    mx = block_max(mx, scratch);
    bad = __syncthreads_or(bad);
    float sum = 0.0f;
    sweep(x, V, [&](int, float v) { sum += expf(v - mx); });
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        stats[2 * r] = mx;
        stats[2 * r + 1] = logf(sum);
        if (bad) flags[3 * (r / nb) + 2] = 1;
    }
}

// Stage 1, grid (R, slices), block 256: the log-probabilities of one vocabulary slice of row r
// (dynamic shared memory: `chunk` floats), the processors in HF's order, + the beam's score; the
// slice's `keep` best as keys (order_key(score) << 32) | ~(j * V + token): larger is better,
// ties go to the lower flat index (HF's topk over beams x vocabulary).
__global__ void __launch_bounds__(256) beam_candidates(
        unsigned long long* __restrict__ keys,     // (R, slices, keep)
        const float* __restrict__ stats, const float* __restrict__ logits, const int* __restrict__ seq,
        const float* __restrict__ run_scores, const int* __restrict__ starts, const int* __restrict__ flags,
        const int* __restrict__ step_counter, const int* __restrict__ eos, int n_eos,
        int V, int L, int nb, int keep, int chunk, float penalty, int min_new, int ngram) {
    extern __shared__ float s[];
    __shared__ unsigned long long scratch[32];
    const int r = blockIdx.x, b = r / nb, j = r - b * nb;
    if (flags[3 * b + 1] || flags[3 * b + 2]) return;
    const int step = *step_counter, cur = starts[b] + step;
    const int lo = blockIdx.y * chunk, hi = min(V, lo + chunk);
    const float* x = logits + (long)r * V;
    const float mx = stats[2 * r], log_sum = stats[2 * r + 1];
    sweep(x + lo, hi - lo, [&](int i, float v) { s[i] = (v - mx) - log_sum; });
    __syncthreads();
    const int* row = seq + (long)r * L;
    if (penalty != 1.0f) {  // tokens of the hypothesis (prompt included); repeats write the same value
        for (int p = threadIdx.x; p < cur; p += blockDim.x) {
            const int token = row[p];
            if (token >= lo && token < hi) {
                const float v = (x[token] - mx) - log_sum;
                s[token - lo] = v < 0.0f ? v * penalty : v / penalty;
            }
        }
        __syncthreads();
    }
    if (ngram > 0) {
        ban_repeated_ngrams(s, lo, hi, row, cur, ngram);
        __syncthreads();
    }
    if (step < min_new && threadIdx.x < n_eos && eos[threadIdx.x] >= lo && eos[threadIdx.x] < hi)
        s[eos[threadIdx.x] - lo] = -FT_INFINITY;
    __syncthreads();
    const float base = run_scores[r];
    unsigned long long* out = keys + ((long)r * gridDim.y + blockIdx.y) * keep;
    unsigned long long prev = ~0ull;
    for (int k = 0; k < keep; ++k) {  // the k-th best: the largest key below the (k-1)-th
        unsigned long long best = 0ull;
        for (int i = threadIdx.x; i < hi - lo; i += blockDim.x) {
            const unsigned long long key = ((unsigned long long)order_key(s[i] + base) << 32)
                                           | (unsigned)~(unsigned)(j * V + lo + i);
            if (key < prev && key > best) best = key;
        }
        best = block_reduce(best, scratch, 0ull, MaxOp());
        if (threadIdx.x == 0) out[k] = best;
        prev = best;
    }
}

// The top `count` of n values, larger first, ties to the lower index (a stable sort's order).
// n <= BEAM_KEEP_MAX * 3 / 2; one thread.
__device__ __forceinline__ void top_indices(int* out, const float* v, int n, int count) {
    bool taken[BEAM_KEEP_MAX + BEAM_KEEP_MAX / 2];
    for (int i = 0; i < n; ++i) taken[i] = false;
    for (int c = 0; c < count; ++c) {
        int best = -1;
        for (int i = 0; i < n; ++i)
            if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
        taken[best] = true;
        out[c] = best;
    }
}

// Stage 2 and the bookkeeping, one block (256 threads) per batch item, HF semantics: the best
// `keep` candidates; the best nb that did not stop continue (their sequences, scores and cache
// indirection gathered from the parents); candidates among the top nb that stopped (eos or max
// length) enter the finished set scored sum(log p) / generated_length ** length_penalty; the
// item is done when no running beam can beat the worst finished one (early_stopping 0 false,
// 1 true, 2 never), or every candidate stopped. A done item is left as it is.
// scratch: (B, 3 nb, L) ints, the gathered rows before they are written back.
__global__ void __launch_bounds__(256) beam_select(
        const unsigned long long* __restrict__ keys, int slices, int V, int L, int nb, int keep,
        int* seq, int* fin_seq, int* indir, int* __restrict__ scratch_all,
        float* __restrict__ run_scores, float* __restrict__ fin_scores, int* __restrict__ fin_len,
        int* __restrict__ fin_flag, int* __restrict__ flags, const int* __restrict__ starts,
        int* __restrict__ next_ids, int* __restrict__ next_pos, const int* __restrict__ step_counter,
        const int* __restrict__ eos, int n_eos, int max_new, float length_penalty, int early) {
    __shared__ unsigned long long scratch[32];
    __shared__ float c_score[BEAM_KEEP_MAX], pool[BEAM_KEEP_MAX + BEAM_KEEP_MAX / 2];
    __shared__ int c_parent[BEAM_KEEP_MAX], c_token[BEAM_KEEP_MAX], c_hit[BEAM_KEEP_MAX];
    __shared__ int run_src[BEAM_KEEP_MAX / 2], fin_src[BEAM_KEEP_MAX / 2];
    const int b = blockIdx.x;
    int* fl = flags + 3 * b;
    if (fl[1]) return;
    if (fl[2]) {  // non-finite logits: the host reports it
        if (threadIdx.x == 0) fl[1] = 1;
        return;
    }
    const int step = *step_counter, start = starts[b], cur = start + step, max_length = start + max_new;
    const long r0 = (long)b * nb;
    const unsigned long long* k = keys + r0 * slices * keep;
    const int n = nb * slices * keep;
    unsigned long long prev = ~0ull;
    for (int c = 0; c < keep; ++c) {
        unsigned long long best = 0ull;
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            if (k[i] < prev && k[i] > best) best = k[i];
        best = block_reduce(best, scratch, 0ull, MaxOp());
        if (threadIdx.x == 0) {
            const unsigned flat = ~(unsigned)(best & 0xffffffffull);
            c_score[c] = from_order_key((unsigned)(best >> 32));
            c_parent[c] = flat / V;
            c_token[c] = flat % V;
        }
        prev = best;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float cont[BEAM_KEEP_MAX];
        bool all_hit = true, all_finished = true;
        for (int c = 0; c < keep; ++c) {
            bool hit = cur + 1 >= max_length;
            for (int e = 0; e < n_eos; ++e) hit |= c_token[c] == eos[e];
            c_hit[c] = hit;
            all_hit &= hit;
            cont[c] = hit ? c_score[c] + BEAM_NEG : c_score[c];
        }
        top_indices(run_src, cont, keep, nb);
        for (int j = 0; j < nb; ++j) all_finished &= fin_flag[r0 + j] != 0;
        const bool improvable = fl[0] != 0;
        const float denom = (float)pow((double)(cur + 1 - start), (double)length_penalty);
        for (int j = 0; j < nb; ++j) pool[j] = fin_scores[r0 + j];
        for (int c = 0; c < keep; ++c) {
            float sc = c_score[c] / denom;
            if (all_finished && early == 1) sc += BEAM_NEG;
            if (!improvable) sc += BEAM_NEG;
            if (!(c_hit[c] && c < nb)) sc += BEAM_NEG;
            pool[nb + c] = sc;
        }
        top_indices(fin_src, pool, nb + keep, nb);
        int new_len[BEAM_KEEP_MAX / 2], new_flag[BEAM_KEEP_MAX / 2];
        for (int j = 0; j < nb; ++j) {
            const int m = fin_src[j];
            new_len[j] = m < nb ? fin_len[r0 + m] : cur + 1 - start;
            new_flag[j] = m < nb ? fin_flag[r0 + m] : (c_hit[m - nb] && m - nb < nb);
        }
        float worst = pool[fin_src[0]];
        bool new_all_finished = true;
        for (int j = 0; j < nb; ++j) {
            fin_scores[r0 + j] = pool[fin_src[j]];
            worst = fminf(worst, pool[fin_src[j]]);
            fin_len[r0 + j] = new_len[j];
            fin_flag[r0 + j] = new_flag[j];
            new_all_finished &= new_flag[j] != 0;
            run_scores[r0 + j] = cont[run_src[j]];
        }
        const int best_length = (early == 2 && length_penalty > 0.0f) ? max_length - start : cur + 1 - start;
        const float best_possible = cont[run_src[0]] / (float)pow((double)best_length, (double)length_penalty);
        bool beatable = false;
        for (int j = 0; j < nb; ++j) beatable |= best_possible > (new_flag[j] ? worst : BEAM_NEG);
        const bool still = improvable && beatable;
        fl[0] = still;
        fl[1] = !still || (new_all_finished && early == 1) || all_hit;
    }
    __syncthreads();
    // running rows from their parents (+ the new token), finished rows from the merge, cache
    // indirection from the parents (the new position in the row's own cache), via scratch
    int* sc = scratch_all + (long)b * 3 * nb * L;
    const int width = cur + 1;
    for (int i = threadIdx.x; i < nb * width; i += blockDim.x) {
        const int j = i / width, p = i - j * width;
        const int c = run_src[j], parent = c_parent[c];
        sc[j * L + p] = p < cur ? seq[(r0 + parent) * L + p] : c_token[c];
        sc[(2 * nb + j) * L + p] = p < cur ? indir[(r0 + parent) * L + p] : (int)(r0 + j);
        const int m = fin_src[j];
        int v;
        if (m < nb) v = fin_seq[(r0 + m) * L + p];
        else v = p < cur ? seq[(r0 + c_parent[m - nb]) * L + p] : c_token[m - nb];
        sc[(nb + j) * L + p] = v;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nb * width; i += blockDim.x) {
        const int j = i / width, p = i - j * width;
        seq[(r0 + j) * L + p] = sc[j * L + p];
        fin_seq[(r0 + j) * L + p] = sc[(nb + j) * L + p];
        indir[(r0 + j) * L + p] = sc[(2 * nb + j) * L + p];
    }
    if (threadIdx.x < nb) {
        next_ids[r0 + threadIdx.x] = c_token[run_src[threadIdx.x]];
        next_pos[r0 + threadIdx.x] = cur;
    }
}
