// Token choice in one kernel on sm_90+ (sampling.cu's multi-kernel choice, with the same
// results, for sampling rows): the helpers it shares with sampling.cu are sampling.cuh's.
// Reference: ftengine/decoding/processors.py choose, ftengine/decoding/philox.py.

// choose_sample: a sampling row's whole choice by a thread-block cluster of S blocks (grid (B, S),
// cluster (1, S, 1), SAMPLE_THREADS each), block r holding slice r's processed scores in shared
// memory: the processors (as choose_prepare), the row max, top-k's and top-p's radix selects (as
// choose_level: the same digits, counts and fixed-point masses, so the same thresholds), and the
// draw (as choose_draw: kept masses exp(score - max) summed in double in token order, the first
// token whose cumulative mass exceeds u * total, the row's last token of mass past the total).
// The logits are read once and nothing goes through global memory: the blocks exchange their
// histograms and sums through distributed shared memory between cluster barriers. S is a power of
// two <= 8, so each block adds one range of every level's digits over the cluster.
// Dynamic shared memory: hist (SAMPLE_HIST_WORDS u32: this block's digit counts, or its masses in
// three pieces; then the draw's prefix sums), summed (SAMPLE_BINS / S u64: its range of the
// cluster's digits), the slice's scores (`slice` floats, at most SAMPLE_SLICE_MAX), then a select's
// candidates (SAMPLE_CANDIDATES floats). FEW: a select may end in sample_few (ops.choose_tokens
// instantiates it for rows with top-k).
#define SAMPLE_THREADS 256
#define SAMPLE_BINS 2048
#define SAMPLE_HIST_WORDS (3 * SAMPLE_BINS)
#define SAMPLE_SLICE_MAX 65536
#define SAMPLE_CANDIDATES 2048
#define SAMPLE_CLUSTER_MAX 8

__device__ __forceinline__ void cluster_sync() {  // with release / acquire of shared memory
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#endif
}

// p (in this block's shared memory) as block `rank` of the cluster holds it
template <typename T>
__device__ __forceinline__ T* cluster_peer(T* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned long long q;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(q) : "l"(p), "r"(rank));
    return reinterpret_cast<T*>(q);
#else
    return p;
#endif
}

// Block-wide: this block's (a, b) (thread 0's) into its slots, then every block's into all_a[q],
// all_b[q] for the cluster's S blocks q; the slots are read by the peers after the barrier.
template <typename A, typename B>
__device__ __forceinline__ void cluster_share(A a, B b, A* slot_a, B* slot_b, A* all_a, B* all_b, int S) {
    if (threadIdx.x == 0) {
        *slot_a = a;
        *slot_b = b;
    }
    __syncthreads();
    cluster_sync();
    if ((int)threadIdx.x < S) {
        all_a[threadIdx.x] = *cluster_peer(slot_a, threadIdx.x);
        all_b[threadIdx.x] = *cluster_peer(slot_b, threadIdx.x);
    }
    __syncthreads();
}

struct SampleShared {
    unsigned* hist;                   // SAMPLE_HIST_WORDS
    unsigned long long* summed;
    unsigned long long* range_total;  // this block's range sum (read by the peers)
};

// top-p's goal, choose_level's test (double)c / (double)total >= top_p, as a threshold on (double)c:
// the least double d with d / total >= top_p (monotone in d, so the test holds iff (double)c >= d),
// found from top_p * total by a few steps of an ulp; +infinity where the test never holds (total 0).
__device__ __forceinline__ double mass_goal(unsigned long long total, float top_p) {
    const double t = (double)total, p = (double)top_p;
    if (!(1.0 >= p) || total == 0ull) return FT_INFINITY;
    auto holds = [&](double d) { return d / t >= p; };
    auto step = [](double d, long long by) { return __longlong_as_double(__double_as_longlong(d) + by); };
    double d = fmax(p * t, 0.0);
    while (d > 0.0 && holds(step(d, -1))) d = step(d, -1);
    while (!holds(d)) d = step(d, 1);
    return d;
}

// The slice's scores whose key has level 0's digits `prefix` (bits 31..21) and is >= floor_key,
// for levels 1 and 2 to look at instead of the whole slice: warp w's (of its tokens w * 32 + lane
// + j * blockDim.x) at cand + w * cap, their count in counts[w]. Block-wide; true where some warp
// has more than cap (its list is then incomplete: the levels look at the slice).
__device__ __forceinline__ bool sample_candidates(const float* sc, int n, unsigned prefix, unsigned floor_key,
                                                  float* cand, int cap, int* counts) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* out = cand + warp * cap;
    int count = 0;
    for (int i0 = warp * 32 + lane; i0 - lane < n; i0 += SWEEP_UNROLL * blockDim.x) {  // warp-uniform
        float x[SWEEP_UNROLL];
        #pragma unroll
        for (int u = 0; u < SWEEP_UNROLL; ++u) x[u] = i0 + u * (int)blockDim.x < n ? sc[i0 + u * blockDim.x] : 0.0f;
        #pragma unroll
        for (int u = 0; u < SWEEP_UNROLL; ++u) {
            const unsigned key = order_key(x[u]);
            const bool take = i0 + u * (int)blockDim.x < n && (key & 0xffe00000u) == prefix && key >= floor_key;
            const unsigned taken = __ballot_sync(~0u, take);
            const int at = count + __popc(taken & ((1u << lane) - 1u));
            if (take && at < cap) out[at] = x[u];
            count += __popc(taken);
        }
    }
    if (lane == 0) counts[warp] = count;
    return __syncthreads_or(count > cap);
}

// One level of the radix select (choose_level's digits and goal) over the cluster: each block
// counts its slice's tokens whose key matches `prefix` (mode 0) or their fixed-point mass among
// keys >= floor_key (mode 1: 32-bit shared atomics that return nothing, so none waits, on a mass's
// bits 0-15, 16-31 and 32-63 (64-bit shared atomics loop on a compare-and-swap): a slice of at
// most SAMPLE_SLICE_MAX tokens sums none of them past 32 bits); block r adds digit range r of the S
// histograms; every block then finds the same digit from the ranges' totals and the range that
// holds it. each(f) calls f(score) for the tokens the level looks at (level 0: the slice; then its
// candidates). Updates prefix, above (what lies above it) and weight (what its digit holds: a
// count or a mass); level 0 of mode 1 sets goal. Counting a warp's lanes of one digit with one add
// (__match_any_sync, its first lane adding the lanes' count) measured slower (H100, 2026-11-26,
// choose_tokens alone, us: top-k 40 at batch 32 25.7 -> 38.5, at batch 1 18.6 -> 24.1): the match
// costs more than the shared atomics it saves, even on logits whose level-0 digits crowd into a few
// dozen bins.
// Whether what a select counts from the top, c, reaches its goal: k tokens (mode 0, top-k), or the
// fixed-point mass goal (mode 1, top-p).
__device__ __forceinline__ bool select_reached(unsigned long long c, int mode, double goal, int k) {
    return mode ? (double)c >= goal : c >= (unsigned long long)k;
}

template <typename Each>
__device__ __forceinline__ void sample_level(Each each, int S, int rank, int level, int mode, int k, float top_p,
                                             unsigned floor_key, float mx, double scale, const SampleShared& sh,
                                             unsigned& prefix, unsigned long long& above, double& goal,
                                             unsigned long long& weight) {
    __shared__ unsigned long long scan[32], ranges[SAMPLE_CLUSTER_MAX], found_above, found_weight;
    __shared__ unsigned found_key;
    const int bits = level < 2 ? 11 : 10, shift = level == 0 ? 21 : (level == 1 ? 10 : 0), bins = 1 << bits;
    const unsigned high = level == 0 ? 0u : ~0u << (shift + bits);
    unsigned* words = sh.hist;  // counts, or masses' bits 0-15, then 16-31 and 32-63 SAMPLE_BINS apart
    const int pieces = mode ? 3 : 1;
    for (int i = threadIdx.x; i < bins; i += blockDim.x)
        for (int p = 0; p < pieces; ++p) words[p * SAMPLE_BINS + i] = 0u;
    __syncthreads();
    each([&](float x) {
        const unsigned key = order_key(x);
        if ((key & high) != prefix || key < floor_key) return;
        const unsigned digit = (key >> shift) & (bins - 1);
        if (mode) {
            const unsigned long long m = fixed_mass(x, mx, scale);
            atomicAdd(&words[digit], (unsigned)m & 0xffffu);
            atomicAdd(&words[SAMPLE_BINS + digit], (unsigned)m >> 16);
            if (m >> 32) atomicAdd(&words[2 * SAMPLE_BINS + digit], (unsigned)(m >> 32));
        } else {
            atomicAdd(&words[digit], 1u);
        }
    });
    __syncthreads();
    cluster_sync();  // every block's histogram is complete
    const int range = bins / S, first = rank * range;
    unsigned long long mine = 0ull;
    for (int j = threadIdx.x; j < range; j += blockDim.x) {
        unsigned w[3][SAMPLE_CLUSTER_MAX];
        #pragma unroll
        for (int q = 0; q < SAMPLE_CLUSTER_MAX; ++q) {  // all loads in flight together
            const unsigned* peer = q < S ? cluster_peer(words, q) + first + j : nullptr;
            #pragma unroll
            for (int p = 0; p < 3; ++p) w[p][q] = peer && p < pieces ? peer[p * SAMPLE_BINS] : 0u;
        }
        unsigned long long v = 0ull;
        #pragma unroll
        for (int q = 0; q < SAMPLE_CLUSTER_MAX; ++q)
            v += w[0][q] + ((unsigned long long)w[1][q] << 16) + ((unsigned long long)w[2][q] << 32);
        sh.summed[j] = v;
        mine += v;
    }
    mine = block_reduce(mine, scan, 0ull, SumOp());
    if (threadIdx.x == 0) *sh.range_total = mine;
    __syncthreads();
    cluster_sync();  // every range's sums are complete
    if (threadIdx.x < S) ranges[threadIdx.x] = *cluster_peer(sh.range_total, threadIdx.x);
    __syncthreads();
    if (level == 0 && mode) {
        unsigned long long total = 0ull;
        for (int q = 0; q < S; ++q) total += ranges[q];
        goal = mass_goal(total, top_p);
    }
    auto reached = [&](unsigned long long c) { return select_reached(c, mode, goal, k); };
    // the range where the count from the top reaches the goal (the same in every block)
    unsigned long long run = above;
    int owner = 0;
    for (int q = S - 1; q >= 0; --q) {
        if (reached(run + ranges[q])) {
            owner = q;
            break;
        }
        run += ranges[q];
    }
    // its digits from the top: thread t takes ranks t * per .. of them
    const unsigned long long* digits = cluster_peer(sh.summed, owner);
    const int per = (range + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * per;
    unsigned long long v[SAMPLE_BINS / SAMPLE_THREADS], part = 0ull, sum;
    #pragma unroll
    for (int j = 0; j < SAMPLE_BINS / SAMPLE_THREADS; ++j) {
        v[j] = j < per && lo + j < range ? digits[range - 1 - (lo + j)] : 0ull;
        part += v[j];
    }
    run += block_exclusive_scan(part, scan, sum);
    if (!reached(run) && reached(run + part)) {  // one thread: the goal is reached in its digits
        #pragma unroll
        for (int j = 0; j < SAMPLE_BINS / SAMPLE_THREADS; ++j) {
            if (j < per && reached(run + v[j])) {
                found_key = prefix | ((unsigned)(owner * range + range - 1 - (lo + j)) << shift);
                found_above = run;
                found_weight = v[j];
                break;
            }
            run += v[j];
        }
    }
    __syncthreads();
    prefix = found_key;
    above = found_above;
    weight = found_weight;
}

// A select's levels 1 and 2 at once, where the caller knows the cluster's candidates
// (sample_candidates' lists: the keys of level 0's digit, at or above floor_key) are at most
// SAMPLE_FEW: every block copies all of them, through distributed shared memory, and finds the key
// the two levels would, the largest v with reached(above + what the candidates >= v weigh) (a
// count, mode 0; their fixed-point masses, mode 1: the integers the levels add up, so the same
// key). Block-wide, the same in every block. Returns what the keys >= the key found weigh (mode 0:
// how many tokens the select keeps); 0, with prefix unchanged, where no key reaches the goal.
#define SAMPLE_FEW 256
// hist: this block's histogram words, which no peer reads once a level has returned (the copies'
// keys and weights go there).
template <typename Reached>
__device__ __forceinline__ unsigned long long sample_few(const float* cand, int cap, const int* cand_count, int S,
                                                         unsigned long long above, Reached reached, int mode,
                                                         float mx, double scale, unsigned* hist, unsigned& prefix) {
    constexpr int W = SAMPLE_THREADS / 32;
    static_assert(SAMPLE_FEW <= SAMPLE_THREADS && SAMPLE_FEW <= SAMPLE_CANDIDATES / W
                  && 3 * SAMPLE_FEW <= SAMPLE_HIST_WORDS, "a candidate a thread; lists that hold them all");
    __shared__ int counts[SAMPLE_CLUSTER_MAX * W], total;
    __shared__ unsigned found;
    __shared__ unsigned long long found_from;
    unsigned* keys = hist;
    unsigned long long* weights = reinterpret_cast<unsigned long long*>(hist + SAMPLE_FEW);
    cluster_sync();  // every block's lists are complete
    if ((int)threadIdx.x < S * W) counts[threadIdx.x] = *cluster_peer(cand_count + threadIdx.x % W, threadIdx.x / W);
    if (threadIdx.x == 0) found_from = 0ull;
    __syncthreads();
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int i = 0; i < S * W; ++i) sum += counts[i];
        total = sum;
    }
    __syncthreads();
    if ((int)threadIdx.x < total) {  // thread t copies candidate t: one remote load each, all in flight at once
        int list = 0, at = threadIdx.x;
        while (at >= counts[list]) at -= counts[list++];
        const float x = cluster_peer(cand + (list % W) * cap, list / W)[at];
        keys[threadIdx.x] = order_key(x);
        weights[threadIdx.x] = mode ? fixed_mass(x, mx, scale) : 1ull;
    }
    __syncthreads();
    if ((int)threadIdx.x < total) {
        const unsigned mine = keys[threadIdx.x];
        unsigned long long over = 0ull, from = 0ull;  // what the keys > mine, >= mine weigh
        for (int i = 0; i < total; ++i) {
            over += keys[i] > mine ? weights[i] : 0ull;
            from += keys[i] >= mine ? weights[i] : 0ull;
        }
        if (!reached(above + over) && reached(above + from)) {  // one key: every such thread writes the same
            found = mine;
            found_from = above + from;
        }
    }
    __syncthreads();
    if (found_from) prefix = found;
    return found_from;
}

template <bool FEW>
__global__ void __launch_bounds__(SAMPLE_THREADS) choose_sample(
        int* __restrict__ out,                    // (B,)
        const float* __restrict__ logits_all,     // (B, V)
        const unsigned char* __restrict__ seen_all,  // (B, V)
        const int* __restrict__ eos, int n_eos,
        const int* __restrict__ step_counter,
        const int* __restrict__ seq_all,          // (B, L)
        const int* __restrict__ lengths,          // (B,)
        int L, int ngram, int V, int slice, int min_new, float temperature, float penalty, int k, float top_p,
        double scale, const unsigned* __restrict__ seed) {
    wait_then_launch_next();
    extern __shared__ unsigned long long smem[];
    __shared__ unsigned long long range_total;
    __shared__ unsigned keys[32], block_top, row_keys[SAMPLE_CLUSTER_MAX];
    __shared__ double dscan[32], block_mass, masses[SAMPLE_CLUSTER_MAX];
    __shared__ int iscan[32], block_last, lasts[SAMPLE_CLUSTER_MAX], block_bad, bads[SAMPLE_CLUSTER_MAX];
    __shared__ int cand_count[SAMPLE_THREADS / 32];
    const int b = blockIdx.x, rank = blockIdx.y, S = gridDim.y;
    const SampleShared sh{reinterpret_cast<unsigned*>(smem), smem + SAMPLE_HIST_WORDS / 2, &range_total};
    float* sc = reinterpret_cast<float*>(smem + SAMPLE_HIST_WORDS / 2 + SAMPLE_BINS / S);
    const int lo = rank * slice, n = max(0, min(V, lo + slice) - lo);
    const unsigned char* seen = seen_all + (long)b * V + lo;
    const int step = *step_counter;
    // the processors, in choose_prepare's order and arithmetic
    int bad = 0;
    sweep(logits_all + (long)b * V + lo, n, [&](int i, float x) {
        bad |= !isfinite(x);
        sc[i] = penalty != 1.0f && seen[i] ? (x < 0.0f ? x * penalty : x / penalty) : x;
    });
    __syncthreads();
    if (ngram > 0) {
        ban_repeated_ngrams(sc, lo, lo + n, seq_all + (long)b * L, lengths[b], ngram);
        __syncthreads();
    }
    if (step < min_new && threadIdx.x < n_eos && eos[threadIdx.x] >= lo && eos[threadIdx.x] < lo + n)
        sc[eos[threadIdx.x] - lo] = -FT_INFINITY;
    __syncthreads();
    unsigned top = 0u;
    sweep(sc, n, [&](int i, float x) {
        if (temperature != 1.0f) sc[i] = x = x / temperature;
        top = max(top, order_key(x));
    });
    bad = __syncthreads_or(bad);
    top = block_reduce(top, keys, 0u, MaxOp());
    cluster_share(top, bad, &block_top, &block_bad, row_keys, bads, S);
    unsigned row_top = 0u;
    bad = 0;
    for (int q = 0; q < S; ++q) {
        row_top = max(row_top, row_keys[q]);
        bad |= bads[q];
    }
    if (bad) {  // a non-finite row: reported, never sampled
        if (rank == 0 && threadIdx.x == 0) out[b] = -1;
        cluster_sync();  // no block leaves while a peer may read its shared memory
        return;
    }
    const float mx = from_order_key(row_top);
    // a select: level 0 over the slice, then its candidates (each warp's own) at levels 1 and 2
    float* cand = sc + slice;
    const int cap = SAMPLE_CANDIDATES / (SAMPLE_THREADS / 32);
    auto slice_each = [&](auto f) { sweep(sc, n, [&](int, float x) { f(x); }); };
    auto cand_each = [&](auto f) {
        const float* mine = cand + (threadIdx.x >> 5) * cap;
        for (int j = threadIdx.x & 31; j < cand_count[threadIdx.x >> 5]; j += 32) f(mine[j]);
    };
    // a select; bound: at most how many tokens are at or above floor_key. Returns (mode 0) how many
    // tokens are at or above the key found
    auto select = [&](int mode, unsigned floor_key, unsigned long long bound, unsigned& prefix) {
        unsigned long long above = 0ull, weight = 0ull;
        double goal = 0.0;
        sample_level(slice_each, S, rank, 0, mode, k, top_p, floor_key, mx, scale, sh, prefix, above, goal, weight);
        const bool spilled = sample_candidates(sc, n, prefix, floor_key, cand, cap, cand_count);
        auto reached = [&](unsigned long long c) { return select_reached(c, mode, goal, k); };
        if constexpr (FEW) {
            if ((mode ? bound : weight) <= SAMPLE_FEW) {  // few candidates (mode 0: level 0's digit's count)
                const unsigned long long kept = sample_few(cand, cap, cand_count, S, above, reached, mode, mx, scale,
                                                           sh.hist, prefix);
                if (kept) return kept;
            }
        }
        auto rest_each = [&](auto f) { spilled ? slice_each(f) : cand_each(f); };
        for (int level = 1; level < 3; ++level)
            sample_level(rest_each, S, rank, level, mode, k, top_p, floor_key, mx, scale, sh, prefix, above, goal,
                         weight);
        return above + weight;
    };
    unsigned kth = 0u, cut = 0u;
    unsigned long long kept = ~0ull;
    // top-k up to 64 from each block's k largest (order_key << 32 | ~token) keys by beam search's
    // block_top_keys, then the cluster's k-th largest of the S x k by rank, measured slower than this
    // select (H100, 2026-11-26, choose_tokens alone, us, two alternating runs): top-k 40 at batch 1
    // 19.5-19.7 -> 36.6-36.7, at batch 32 25.6-26.0 -> 47.8-47.9; top-k 64 at batch 32 31.8-32.1 ->
    // 72.3: k rounds of a block-wide max, and the rank loop over S x k keys, cost more than the digits.
    if (0 < k && k < V) kept = select(0, 0u, ~0ull, kth);
    if (top_p < 1.0f) select(1, kth, kept, cut);
    // the draw: thread t sums the masses of tokens t * per .. (in order)
    const unsigned keep = max(kth, cut);
    auto mass = [&](int i) { return order_key(sc[i]) >= keep ? expf(sc[i] - mx) : 0.0f; };
    const int per = (n + blockDim.x - 1) / blockDim.x, t0 = threadIdx.x * per, t1 = min(n, t0 + per);
    double mine = 0.0;
    int last = -1;
    #pragma unroll 8
    for (int i = t0; i < t1; ++i) {
        const float p = mass(i);
        mine += (double)p;
        if (p > 0.0f) last = lo + i;
    }
    double block_total;
    double* cum = reinterpret_cast<double*>(sh.hist);  // free: the peers read hist before the last barrier
    cum[threadIdx.x] = block_exclusive_scan(mine, dscan, block_total);
    last = block_max_int(last, iscan);
    cluster_share(block_total, last, &block_mass, &block_last, masses, lasts, S);
    double start[SAMPLE_CLUSTER_MAX + 1];
    start[0] = 0.0;
    int row_last = -1;
    for (int q = 0; q < S; ++q) {
        start[q + 1] = start[q] + masses[q];
        row_last = max(row_last, lasts[q]);
    }
    const double target = (double)philox_uniform((unsigned)step, (unsigned)b, seed[0], seed[1]) * start[S];
    int owner = -1;
    for (int q = 0; q < S; ++q)
        if (start[q] <= target && target < start[q + 1]) owner = q;
    if (owner < 0) {  // past the total by rounding: the row's last token of mass
        if (rank == 0 && threadIdx.x == 0) out[b] = row_last;
    } else if (rank == owner) {
        // the first thread whose [from, to) holds the target (the bounds are sums of one scan
        // whose rounding need not be monotone: the first one decides)
        const double from = start[rank] + cum[threadIdx.x];
        const double to = threadIdx.x + 1 < blockDim.x ? start[rank] + cum[threadIdx.x + 1] : start[rank + 1];
        const bool holds = from <= target && target < to;
        const int first = -block_max_int(holds ? -(int)threadIdx.x : -(int)blockDim.x, iscan);
        if ((int)threadIdx.x == first) {
            double run = from;
            int pick = -1, mine_last = -1;
            for (int i = t0; i < t1 && pick < 0; ++i) {
                const float p = mass(i);
                run += (double)p;
                if (run > target) pick = lo + i;
                if (p > 0.0f) mine_last = lo + i;
            }
            out[b] = pick >= 0 ? pick : (mine_last >= 0 ? mine_last : row_last);
        } else if (first == (int)blockDim.x && threadIdx.x == 0) {  // none (the bounds cover the block's
            // interval, so never): the row's last token of mass
            out[b] = row_last;
        }
    }
    cluster_sync();  // no block leaves while a peer may read its shared memory
}
