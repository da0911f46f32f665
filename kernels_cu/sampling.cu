// Token choice on the GPU with HF `generate` semantics and order, each row's vocabulary split
// over several blocks: choose_prepare (repetition penalty, no-repeat n-grams, min-new-tokens
// (eos masked), temperature; greedy argmax), then for sampling the selects and the draw of
// sampling_levels.cu (a file of their own: a greedy run never compiles them). On sm_90+, sampling
// runs as one kernel instead (sampling_cluster.cu). A row with a non-finite logit gets token -1
// (the host reports it). append_tokens then records the choice and feeds it to the next step: the
// step counter, sequences and finished flags live in device memory, and so does the seed (two
// words, low then high), so that one captured step serves every seed. Beam search: beam.cu. The
// helpers these share, and the row state of the sliced choice: sampling.cuh.
// Reference: ftengine/decoding/processors.py choose, ftengine/decoding/philox.py.

// ---------------------------------------------------------------- token choice
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
