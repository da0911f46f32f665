// Sampling's selects and draw over a row's vocabulary split over several blocks, after
// sampling.cu choose_prepare: choose_level three times for top-k's threshold and three times for
// top-p's (radix selects over all slices), then choose_draw (a seeded inverse-CDF draw,
// Philox4x32-10 uniform for (seed, sequence, step)). Where sampling_cluster.cu cannot run them
// (before sm_90, or a row too long for a cluster's shared memory); compiled at their first launch.
// Grid (B, S), the row state: sampling.cuh.
// Reference: ftengine/decoding/processors.py choose, ftengine/decoding/philox.py.

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
