// Token choice on the GPU with HF `generate` semantics and order, each row's vocabulary split
// over several blocks: choose_prepare (repetition penalty, no-repeat n-grams, min-new-tokens
// (eos masked), temperature; greedy argmax), then for sampling choose_level three times for
// top-k's threshold and three times for top-p's (radix selects over all slices), and
// choose_draw (a seeded inverse-CDF draw, Philox4x32-10 uniform for (seed, sequence, step)). On
// sm_90+, sampling runs as one kernel instead, choose_sample: a thread-block cluster per row.
// A row with a non-finite logit gets token -1 (the host reports it). append_tokens then records
// the choice and feeds it to the next step: the step counter, sequences and finished flags live
// in device memory, and so does the seed (two words, low then high), so that one captured step
// serves every seed.
// Beam search (beam_logsumexp, beam_candidates, beam_select): log-softmax, the processors, and
// FasterTransformer's two-stage top-k (per beam over vocabulary slices, then per batch item over
// beams), then HF's finished-hypothesis bookkeeping, one block per batch item.
// Reference: ftengine/decoding/processors.py choose, ftengine/decoding/philox.py,
// ftengine/decoding/beam.py reference_step.

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

// ---------------------------------------------------------------- token choice
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

// choose_prepare: HF's processors in HF's order over one slice (repetition penalty, no-repeat
// n-grams, eos masked before min_new_tokens, then the temperature when sampling), the slice's
// largest (key, first index) into CH_MAX, non-finite logits into CH_FLAGS. Greedy ends here:
// the row's last block writes the argmax (-1 for a non-finite row) and clears the row.
// Sampling writes the processed scores to `scores`.
__global__ void __launch_bounds__(CHOICE_THREADS) choose_prepare(
        int* __restrict__ out,                    // (B,)
        float* __restrict__ scores_all,           // (B, V) scratch
        const float* __restrict__ logits_all,     // (B, V)
        const unsigned char* __restrict__ seen_all,  // (B, V): tokens of the prompt and generated so far
        const int* __restrict__ eos, int n_eos,
        const int* __restrict__ step_counter,     // (1,): tokens chosen so far
        const int* __restrict__ seq_all,          // (B, L): prompt + generated tokens (no-repeat n-grams)
        const int* __restrict__ lengths,          // (B,)
        int L, int ngram, int V, int slice, int min_new, int do_sample, float temperature, float penalty,
        unsigned long long* __restrict__ state, int words) {
    wait_then_launch_next();
    __shared__ unsigned long long uscratch[32];
    const int b = blockIdx.x, lo = blockIdx.y * slice, n = max(0, min(V, lo + slice) - lo);
    const float* logits = logits_all + (long)b * V + lo;
    const unsigned char* seen = seen_all + (long)b * V + lo;
    float* s = scores_all + (long)b * V + lo;
    unsigned long long* row = state + (long)b * words + CHOICE_BINS;
    const bool mask_eos = *step_counter < min_new;
    int bad = 0;
    unsigned long long mine = 0ull;  // (order key << 32) | ~index
    auto consider = [&](int i, float x) {
        const unsigned long long k = ((unsigned long long)order_key(x) << 32) | (unsigned)(~(lo + i));
        mine = k > mine ? k : mine;
    };
    auto penalised = [&](int i, float x) {
        bad |= !isfinite(x);
        return penalty != 1.0f && seen[i] ? (x < 0.0f ? x * penalty : x / penalty) : x;
    };
    if (!do_sample && ngram == 0) {  // one pass: the processors inline
        sweep(logits, n, [&](int i, float x) {
            x = penalised(i, x);
            if (mask_eos)
                for (int e = 0; e < n_eos; ++e) x = lo + i == eos[e] ? -FT_INFINITY : x;
            consider(i, x);
        });
    } else {
        sweep(logits, n, [&](int i, float x) { s[i] = penalised(i, x); });
        __syncthreads();
        if (ngram > 0) {
            ban_repeated_ngrams(s, lo, lo + n, seq_all + (long)b * L, lengths[b], ngram);
            __syncthreads();
        }
        if (mask_eos && threadIdx.x < n_eos && eos[threadIdx.x] >= lo && eos[threadIdx.x] < lo + n)
            s[eos[threadIdx.x] - lo] = -FT_INFINITY;
        __syncthreads();
        sweep(s, n, [&](int i, float x) {
            if (do_sample && temperature != 1.0f) s[i] = x = x / temperature;
            consider(i, x);
        });
    }
    bad = __syncthreads_or(bad);
    mine = block_reduce(mine, uscratch, 0ull, MaxOp());
    if (threadIdx.x == 0) {
        if (bad) atomicOr(row + CH_FLAGS, 1ull);
        atomicMax(row + CH_MAX, mine);
    }
    if (do_sample || !last_of_row(row + CH_TICKETS, gridDim.y)) return;
    if (threadIdx.x == 0) {
        out[b] = (__ldcg(row + CH_FLAGS) & 1ull) ? -1 : (int)(~(unsigned)(__ldcg(row + CH_MAX) & 0xffffffffull));
        row[CH_FLAGS] = row[CH_MAX] = row[CH_TICKETS] = 0ull;
    }
}

// A token's mass exp(score - max) in fixed point (`scale` = 2^k with V * scale < 2^63, so that
// sums are exact, whatever their order, and fit).
__device__ __forceinline__ unsigned long long fixed_mass(float x, float mx, double scale) {
    return (unsigned long long)((double)expf(x - mx) * scale);
}

// One level of a radix select from the top over the row's keys order_key(score): `level` 0, 1,
// 2 take bits 31..21, 20..10, 9..0. Each block counts, per digit, the tokens of its slice whose
// key matches the prefix chosen so far (mode 0, top-k) or their mass among the tokens top-k keeps
// (mode 1, top-p); the row's last block adds the slices' counts (integers: the same sum in any
// order) and extends the prefix by the largest digit at which the count from the top reaches
// the goal: k tokens, or top_p of the total mass. After level 2 the prefix is the k-th largest
// key (CH_K), or the largest key Y with mass(key >= Y) >= top_p * total (CH_Y).
__global__ void __launch_bounds__(CHOICE_THREADS) choose_level(
        const float* __restrict__ scores_all, unsigned long long* __restrict__ state, int words, int V, int slice,
        int level, int mode, int k, float top_p, double scale) {
    wait_then_launch_next();
    __shared__ unsigned long long h[CHOICE_BINS], scan[32], found_above;
    __shared__ unsigned found_key;
    const int b = blockIdx.x, lo = blockIdx.y * slice, n = max(0, min(V, lo + slice) - lo);
    unsigned long long* hist = state + (long)b * words;
    unsigned long long* row = hist + CHOICE_BINS;
    if (__ldcg(row + CH_FLAGS) & 1ull) return;  // a non-finite row: the draw reports it
    const int bits = level < 2 ? 11 : 10, shift = level == 0 ? 21 : (level == 1 ? 10 : 0), bins = 1 << bits;
    const unsigned high = level == 0 ? 0u : ~0u << (shift + bits);
    const unsigned prefix = level == 0 ? 0u : (unsigned)__ldcg(row + (mode ? CH_Y : CH_K));
    const unsigned floor_key = mode ? (unsigned)__ldcg(row + CH_K) : 0u;  // top-k's threshold (0: none)
    const float mx = from_order_key((unsigned)(__ldcg(row + CH_MAX) >> 32));
    for (int i = threadIdx.x; i < bins; i += blockDim.x) h[i] = 0ull;
    __syncthreads();
    // counts in 32-bit shared atomics (the first 2048 words of h, spread to 64 bits after), masses
    // in 64-bit ones
    unsigned* counts = reinterpret_cast<unsigned*>(h);
    sweep(scores_all + (long)b * V + lo, n, [&](int, float x) {
        const unsigned key = order_key(x);
        if ((key & high) == prefix && key >= floor_key) {
            const unsigned digit = (key >> shift) & (bins - 1);
            if (mode) atomicAdd(&h[digit], fixed_mass(x, mx, scale));
            else atomicAdd(&counts[digit], 1u);
        }
    });
    if (!mode) {
        __syncthreads();
        unsigned mine[CHOICE_BINS / CHOICE_THREADS];
        #pragma unroll
        for (int j = 0; j < CHOICE_BINS / CHOICE_THREADS; ++j) mine[j] = counts[threadIdx.x + j * CHOICE_THREADS];
        __syncthreads();
        #pragma unroll
        for (int j = 0; j < CHOICE_BINS / CHOICE_THREADS; ++j) h[threadIdx.x + j * CHOICE_THREADS] = mine[j];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < bins; i += blockDim.x)
        if (h[i]) atomicAdd(hist + i, h[i]);
    if (!last_of_row(row + CH_TICKETS, gridDim.y)) return;
    // the row's counts: all loads first (a store between two would wait for the first load)
    unsigned long long all = 0ull, got[CHOICE_BINS / CHOICE_THREADS];
    #pragma unroll
    for (int j = 0; j < CHOICE_BINS / CHOICE_THREADS; ++j) {
        const int i = threadIdx.x + j * CHOICE_THREADS;
        got[j] = i < bins ? __ldcg(hist + i) : 0ull;
    }
    #pragma unroll
    for (int j = 0; j < CHOICE_BINS / CHOICE_THREADS; ++j) {
        const int i = threadIdx.x + j * CHOICE_THREADS;
        if (i < bins) {
            h[i] = got[j];
            hist[i] = 0ull;
            all += got[j];
        }
    }
    __syncthreads();
    unsigned long long total = 0ull;  // top-p: the mass top-k keeps, counted at level 0
    if (mode) total = level == 0 ? block_reduce(all, scan, 0ull, SumOp()) : __ldcg(row + CH_TOTAL);
    if (mode && level == 0 && threadIdx.x == 0) row[CH_TOTAL] = total;
    const unsigned long long above = level == 0 ? 0ull : __ldcg(row + (mode ? CH_Y_ABOVE : CH_K_ABOVE));
    auto reached = [&](unsigned long long c) {
        return mode ? (double)c / (double)total >= (double)top_p : c >= (unsigned long long)k;
    };
    // thread t sums the digits of rank t * per .. from the top; a block scan gives what lies above
    const int per = (bins + blockDim.x - 1) / blockDim.x, first = threadIdx.x * per;
    unsigned long long mine = 0ull, sum;
    for (int q = first; q < min(bins, first + per); ++q) mine += h[bins - 1 - q];
    unsigned long long run = above + block_exclusive_scan(mine, scan, sum);
    if (!reached(run) && reached(run + mine)) {  // one thread: the goal is reached in its digits
        for (int q = first; q < min(bins, first + per); ++q) {
            const int d = bins - 1 - q;
            if (reached(run + h[d])) {
                found_key = prefix | ((unsigned)d << shift);
                found_above = run;
                break;
            }
            run += h[d];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        row[mode ? CH_Y : CH_K] = found_key;
        row[mode ? CH_Y_ABOVE : CH_K_ABOVE] = found_above;
        row[CH_TICKETS] = 0ull;
    }
}

// The seeded draw: the tokens kept (key >= the top-k and top-p thresholds) with mass
// exp(score - max) (float, summed in double), the first token in token order whose cumulative
// mass exceeds u * total (Philox4x32-10 uniform u for (seed, sequence, step)). Each warp sums
// chunks of `chunk` tokens (a multiple of 32 dividing `slice`) into the row's histogram words
// (free now); the row's last block scans the chunk sums (block scan in chunk order), finds the
// chunk where the target falls and scans its tokens (one warp), writes the token (-1 for a
// non-finite row) and clears the row. A target past the total by rounding takes the last token
// of nonzero mass.
#define DRAW_UNROLL 8
#define DRAW_PER (CHOICE_BINS / CHOICE_THREADS)

__global__ void __launch_bounds__(CHOICE_THREADS) choose_draw(
        int* __restrict__ out, const float* __restrict__ scores_all, unsigned long long* __restrict__ state,
        int words, int V, int slice, int chunk, const int* __restrict__ step_counter,
        const unsigned* __restrict__ seed) {
    wait_then_launch_next();
    __shared__ double dscratch[32], cum[CHOICE_THREADS], base;
    __shared__ int iscratch[32], found, last_chunk;
    const int b = blockIdx.x, lo = blockIdx.y * slice, n = max(0, min(V, lo + slice) - lo);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    unsigned long long* sums = state + (long)b * words;
    unsigned long long* row = sums + CHOICE_BINS;
    const bool bad = __ldcg(row + CH_FLAGS) & 1ull;
    const float* s = scores_all + (long)b * V;
    const unsigned keep = max((unsigned)__ldcg(row + CH_K), (unsigned)__ldcg(row + CH_Y));
    const float mx = from_order_key((unsigned)(__ldcg(row + CH_MAX) >> 32));
    auto mass = [&](int i) { return i < V && order_key(s[i]) >= keep ? expf(s[i] - mx) : 0.0f; };
    if (!bad) {
        // DRAW_UNROLL chunks per warp at a time: their loads in flight together
        const int chunks = (n + chunk - 1) / chunk;
        for (int c = warp * DRAW_UNROLL; c < chunks; c += warps * DRAW_UNROLL) {
            double sum[DRAW_UNROLL];
            #pragma unroll
            for (int u = 0; u < DRAW_UNROLL; ++u) sum[u] = 0.0;
            for (int i = lane; i < chunk; i += 32) {
                float p[DRAW_UNROLL];
                #pragma unroll
                for (int u = 0; u < DRAW_UNROLL; ++u) p[u] = c + u < chunks ? mass(lo + (c + u) * chunk + i) : 0.0f;
                #pragma unroll
                for (int u = 0; u < DRAW_UNROLL; ++u) sum[u] += (double)p[u];
            }
            #pragma unroll
            for (int u = 0; u < DRAW_UNROLL; ++u) {
                const double total = warp_reduce(sum[u], SumOp());
                if (lane == 0 && c + u < chunks) sums[lo / chunk + c + u] = __double_as_longlong(total);
            }
        }
    }
    if (!last_of_row(row + CH_TICKETS, gridDim.y)) return;
    // thread t takes chunks c0 = t * DRAW_PER .. (at most CHOICE_BINS of them), held in registers
    const int total_chunks = (V + chunk - 1) / chunk, c0 = threadIdx.x * DRAW_PER;
    double v[DRAW_PER];
    #pragma unroll
    for (int j = 0; j < DRAW_PER; ++j)
        v[j] = !bad && c0 + j < total_chunks ? __longlong_as_double((long long)__ldcg(sums + c0 + j)) : 0.0;
    if (!bad) {
        double mine = 0.0;
        int last = -1;
        #pragma unroll
        for (int j = 0; j < DRAW_PER; ++j) {
            mine += v[j];
            if (v[j] > 0.0) last = c0 + j;
        }
        double total;
        cum[threadIdx.x] = block_exclusive_scan(mine, dscratch, total);
        last = block_max_int(last, iscratch);
        if (threadIdx.x == 0) {
            found = -1;
            last_chunk = last;
        }
        __syncthreads();
        const double target = (double)philox_uniform((unsigned)*step_counter, (unsigned)b, seed[0], seed[1]) * total;
        const double next = threadIdx.x + 1 < blockDim.x ? cum[threadIdx.x + 1] : total;
        if (cum[threadIdx.x] <= target && target < next) {  // one thread: the target falls in its chunks
            double run = cum[threadIdx.x];
            #pragma unroll
            for (int j = 0; j < DRAW_PER; ++j) {
                if (run + v[j] > target || c0 + j == last) {  // the crossing (the row's last chunk of mass
                    found = c0 + j;                           // if rounding hides it)
                    base = target - run;
                    break;
                }
                run += v[j];
            }
        }
        __syncthreads();
        if (warp == 0) {  // the chunk's tokens in order: lane l takes per_lane of them from l * per_lane
            const int c = found >= 0 ? found : last_chunk;
            const double goal = found >= 0 ? base : FT_INFINITY;
            const int per_lane = chunk / 32, first = c * chunk + lane * per_lane;
            double run = 0.0;
            for (int i = 0; i < per_lane; ++i) run += (double)mass(first + i);
            double before = warp_inclusive_scan(run) - run;
            int pick = V, last_token = -1;
            for (int i = 0; i < per_lane; ++i) {
                const float p = mass(first + i);
                before += (double)p;
                if (pick == V && before > goal) pick = first + i;
                if (p > 0.0f) last_token = first + i;
            }
            // the first crossing; none (a rounding gap, or past the total): the chunk's last token of mass
            pick = -warp_reduce(-pick, MaxOp());
            last_token = warp_reduce(last_token, MaxOp());
            if (lane == 0) out[b] = pick == V ? last_token : pick;
        }
    } else if (threadIdx.x == 0) {
        out[b] = -1;
    }
    #pragma unroll
    for (int j = 0; j < DRAW_PER; ++j)
        if (c0 + j < total_chunks) sums[c0 + j] = 0ull;
    if (threadIdx.x == 0)
        for (int w = CH_FLAGS; w <= CH_TICKETS; ++w) row[w] = 0ull;
}

// ---------------------------------------------------------------- token choice in one kernel (sm_90)
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

// seen (B, V): seen[rows[i], tokens[i]] = 1 for the n tokens just fed (row -1: padding, skipped).
__global__ void mark_seen(unsigned char* __restrict__ seen, const int* __restrict__ tokens,
                          const int* __restrict__ rows, int n, int V) {
    wait_then_launch_next();
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
    wait_then_launch_next();
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

__global__ void increment(int* counter) {
    wait_then_launch_next();
    *counter += 1;
}

// ---------------------------------------------------------------- beam search
// Rows r = b * nb + j (batch item b, beam j). flags (B, 3): improvable, done, non-finite logits.
#define BEAM_KEEP_MAX 64
#define BEAM_NEG (-1.0e9f)  // HF's "impossible" score, added in float32

// The largest of the warp's 64-bit keys, in every lane: the high words' max, then the low words'
// max among the lanes that hold it (two redux.sync, sm_80+).
__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long v) {
    const unsigned hi = __reduce_max_sync(~0u, (unsigned)(v >> 32));
    const unsigned lo = __reduce_max_sync(~0u, (unsigned)(v >> 32) == hi ? (unsigned)v : 0u);
    return ((unsigned long long)hi << 32) | lo;
}

// Block-wide: the largest of the threads' keys, in every thread, past one barrier: the warps' maxima
// of call `round` go to half round % 2 of scratch (2 x 32 keys), which no warp writes again before
// every warp has passed the next call's barrier, so after reading this one's.
__device__ __forceinline__ unsigned long long block_max_key(unsigned long long v, unsigned long long* scratch,
                                                            int round) {
    unsigned long long* half = scratch + 32 * (round & 1);
    v = warp_max_key(v);
    if ((threadIdx.x & 31) == 0) half[threadIdx.x >> 5] = v;
    __syncthreads();
    return warp_max_key((threadIdx.x & 31) < (blockDim.x >> 5) ? half[threadIdx.x & 31] : 0ull);
}

// The two largest of this thread's keys key_at(i) (i = threadIdx.x, + blockDim.x, ... below n) that
// are below `below` (0: none).
template <typename KeyAt>
__device__ __forceinline__ void share_top2(KeyAt key_at, int n, unsigned long long below, unsigned long long& first,
                                           unsigned long long& second) {
    first = second = 0ull;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const unsigned long long k = key_at(i);
        if (k >= below) continue;
        if (k > first) {
            second = first;
            first = k;
        } else if (k > second) {
            second = k;
        }
    }
}

// Block-wide: the `keep` largest of the distinct keys key_at(0..n), largest first, into out[0..keep)
// (0 past the last key; thread 0 writes). Each thread holds the best two of its share not yet taken;
// a round takes the block's largest, and the thread it came from moves its second up, looking
// through its share again only when it holds no second (so, with keep much smaller than the block,
// hardly ever). It replaced a sweep of every share and a block reduction a round, and with it
// beam_select's bookkeeping moved from one thread to a warp (H100, GPT-2 small, 4 beams, us, two
// alternating runs): beam_candidates at 4 rows 11.2-11.3 -> 7.1-7.2, at 32 rows 20.2-20.4 -> 12.9-13.0;
// beam_select 15.0-15.1 -> 7.5-7.6 (8 prompts 15.1-15.3 -> 8.0); the step graph at batch 1 0.356-0.357
// -> 0.346 ms, batch 8 0.456-0.457 -> 0.425-0.427. (Each warp's own `keep` best by rounds of redux.sync
// first, then warp 0's best of theirs, was slower: a round's rescan by the winning lane sat on every
// warp's critical path; 32 rows 20.3 -> 27.0.)
template <typename KeyAt>
__device__ __forceinline__ void block_top_keys(KeyAt key_at, int n, int keep, unsigned long long* scratch,
                                               unsigned long long* out) {
    unsigned long long first, second;
    share_top2(key_at, n, ~0ull, first, second);
    bool known = true;  // whether `second` is the best below `first`
    for (int c = 0; c < keep; ++c) {
        const unsigned long long top = block_max_key(first, scratch, c);
        if (threadIdx.x == 0) out[c] = top;
        if (top == 0ull || first != top) continue;
        if (known) {
            first = second;
            known = false;
        } else {
            share_top2(key_at, n, top, first, second);
            known = true;
        }
    }
}

// Warp-wide: out[0..count) = the indices of the `count` largest of v[0..n), larger first, ties to the
// lower index (a stable sort's order): entry i goes to out[its rank]. No NaN in v.
__device__ __forceinline__ void rank_top(int* out, const float* v, int n, int count) {
    for (int i = threadIdx.x & 31; i < n; i += 32) {
        int rank = 0;
        for (int m = 0; m < n; ++m) rank += v[m] > v[i] || (v[m] == v[i] && m < i);
        if (rank < count) out[rank] = i;
    }
}

// stats (R, slices, 2) = the max of each `chunk`-token vocabulary slice of row r's logits and the
// sum of exp(x - that max) over the slice (beam_candidates adds them up: row_logsumexp); a
// non-finite logit flags its item. grid (R, slices), block 256.
__global__ void __launch_bounds__(256) beam_logsumexp(float* __restrict__ stats, int* __restrict__ flags,
                                                      const float* __restrict__ logits, int V, int nb, int chunk) {
    wait_then_launch_next();
    __shared__ float scratch[32];
    const int r = blockIdx.x, lo = blockIdx.y * chunk, n = min(V, lo + chunk) - lo;
    const float* x = logits + (long)r * V + lo;
    float mx = -FT_INFINITY;
    int bad = 0;
    sweep(x, n, [&](int, float v) {
        bad |= !isfinite(v);
        mx = fmaxf(mx, v);
    });
    mx = block_max(mx, scratch);
    bad = __syncthreads_or(bad);
    float sum = 0.0f;
    sweep(x, n, [&](int, float v) { sum += expf(v - mx); });
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        float* out = stats + 2 * ((long)r * gridDim.y + blockIdx.y);
        out[0] = mx;
        out[1] = sum;
        if (bad) flags[3 * (r / nb) + 2] = 1;
    }
}

// Row r's max and log(sum(exp(x - max))) from beam_logsumexp's `slices` partial sums, in slice order.
__device__ __forceinline__ void row_logsumexp(const float* __restrict__ stats, int r, int slices, float& mx,
                                              float& log_sum) {
    const float* row = stats + 2L * r * slices;
    mx = -FT_INFINITY;
    for (int i = 0; i < slices; ++i) mx = fmaxf(mx, row[2 * i]);
    float sum = 0.0f;
    for (int i = 0; i < slices; ++i) {
        if (row[2 * i] > -FT_INFINITY) sum += row[2 * i + 1] * expf(row[2 * i] - mx);  // none from a slice of -inf
    }
    log_sum = logf(sum);
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
    wait_then_launch_next();
    extern __shared__ float s[];
    __shared__ unsigned long long scratch[64];
    const int r = blockIdx.x, b = r / nb, j = r - b * nb;
    if (flags[3 * b + 1] || flags[3 * b + 2]) return;
    const int step = *step_counter, cur = starts[b] + step;
    const int lo = blockIdx.y * chunk, hi = min(V, lo + chunk);
    const float* x = logits + (long)r * V;
    float mx, log_sum;
    row_logsumexp(stats, r, gridDim.y, mx, log_sum);
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
    const unsigned flat = (unsigned)(j * V + lo);
    block_top_keys([&](int i) { return ((unsigned long long)order_key(s[i] + base) << 32) | (unsigned)~(flat + i); },
                   hi - lo, keep, scratch, keys + ((long)r * gridDim.y + blockIdx.y) * keep);
}

// Stage 2 and the bookkeeping, one block (256 threads) per batch item, HF semantics: the best
// `keep` candidates; the best nb that did not stop continue (their sequences, scores and cache
// indirection gathered from the parents); candidates among the top nb that stopped (eos or max
// length) enter the finished set scored sum(log p) / generated_length ** length_penalty; the
// item is done when no running beam can beat the worst finished one (early_stopping 0 false,
// 1 true, 2 never), or every candidate stopped. A done item is left as it is. The bookkeeping runs
// on warp 0, a candidate (then a slot of the finished set) a lane.
// scratch: (B, 3 nb, L) ints, the gathered rows before they are written back.
__global__ void __launch_bounds__(256) beam_select(
        const unsigned long long* __restrict__ keys, int slices, int V, int L, int nb, int keep,
        int* seq, int* fin_seq, int* indir, int* __restrict__ scratch_all,
        float* __restrict__ run_scores, float* __restrict__ fin_scores, int* __restrict__ fin_len,
        int* __restrict__ fin_flag, int* __restrict__ flags, const int* __restrict__ starts,
        int* __restrict__ next_ids, int* __restrict__ next_pos, const int* __restrict__ step_counter,
        const int* __restrict__ eos, int n_eos, const int* __restrict__ max_new, float length_penalty, int early) {
    wait_then_launch_next();
    __shared__ unsigned long long scratch[64], best[BEAM_KEEP_MAX];
    __shared__ float c_score[BEAM_KEEP_MAX], cont[BEAM_KEEP_MAX], pool[BEAM_KEEP_MAX + BEAM_KEEP_MAX / 2];
    __shared__ int c_parent[BEAM_KEEP_MAX], c_token[BEAM_KEEP_MAX], c_hit[BEAM_KEEP_MAX];
    __shared__ int run_src[BEAM_KEEP_MAX / 2], fin_src[BEAM_KEEP_MAX / 2];
    const int b = blockIdx.x;
    int* fl = flags + 3 * b;
    if (fl[1]) return;
    if (fl[2]) {  // non-finite logits: the host reports it
        if (threadIdx.x == 0) fl[1] = 1;
        return;
    }
    const int step = *step_counter, start = starts[b], cur = start + step, max_length = start + *max_new;
    const long r0 = (long)b * nb;
    const unsigned long long* k = keys + r0 * slices * keep;
    block_top_keys([&](int i) { return k[i]; }, nb * slices * keep, keep, scratch, best);
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        __syncwarp();  // best[] complete
        bool hit_all = true;
        for (int c = lane; c < keep; c += 32) {
            const unsigned long long key = best[c];
            const unsigned flat = ~(unsigned)(key & 0xffffffffull);
            const float score = from_order_key((unsigned)(key >> 32));
            const int token = flat % V;
            bool hit = cur + 1 >= max_length;
            for (int e = 0; e < n_eos; ++e) hit |= token == eos[e];
            c_score[c] = score;
            c_parent[c] = flat / V;
            c_token[c] = token;
            c_hit[c] = hit;
            cont[c] = hit ? score + BEAM_NEG : score;
            hit_all &= hit;
        }
        const bool all_hit = __all_sync(~0u, hit_all);
        const bool all_finished = __all_sync(~0u, lane >= nb || fin_flag[r0 + lane] != 0);
        const bool improvable = fl[0] != 0;
        const float denom = (float)pow((double)(cur + 1 - start), (double)length_penalty);
        if (lane < nb) pool[lane] = fin_scores[r0 + lane];
        for (int c = lane; c < keep; c += 32) {
            float sc = c_score[c] / denom;
            if (all_finished && early == 1) sc += BEAM_NEG;
            if (!improvable) sc += BEAM_NEG;
            if (!(c_hit[c] && c < nb)) sc += BEAM_NEG;
            pool[nb + c] = sc;
        }
        __syncwarp();
        rank_top(run_src, cont, keep, nb);
        rank_top(fin_src, pool, nb + keep, nb);
        __syncwarp();
        // slot `lane` of the merged finished set and the running score (every lane reads the old
        // set before any writes it)
        float fin_score = FT_INFINITY, run_score = 0.0f;
        int len = 0, flag = 1;
        if (lane < nb) {
            const int m = fin_src[lane];
            fin_score = pool[m];
            len = m < nb ? fin_len[r0 + m] : cur + 1 - start;
            flag = m < nb ? fin_flag[r0 + m] : (c_hit[m - nb] && m - nb < nb);
            run_score = cont[run_src[lane]];
        }
        float worst = fin_score;
        for (int o = 16; o > 0; o >>= 1) worst = fminf(worst, __shfl_xor_sync(~0u, worst, o));
        const bool new_all_finished = __all_sync(~0u, flag != 0);
        __syncwarp();
        if (lane < nb) {
            fin_scores[r0 + lane] = fin_score;
            fin_len[r0 + lane] = len;
            fin_flag[r0 + lane] = flag;
            run_scores[r0 + lane] = run_score;
        }
        const int best_length = (early == 2 && length_penalty > 0.0f) ? max_length - start : cur + 1 - start;
        const float best_possible = cont[run_src[0]] / (float)pow((double)best_length, (double)length_penalty);
        const bool beatable = __any_sync(~0u, lane < nb && best_possible > (flag ? worst : BEAM_NEG));
        if (lane == 0) {
            const bool still = improvable && beatable;
            fl[0] = still;
            fl[1] = !still || (new_all_finished && early == 1) || all_hit;
        }
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
