// Beam search (beam_logsumexp, beam_candidates, beam_select): log-softmax, the processors, and
// FasterTransformer's two-stage top-k (per beam over vocabulary slices, then per batch item over
// beams), then HF's finished-hypothesis bookkeeping, one block per batch item. The helpers it
// shares with the token choice kernels are sampling.cuh's.
// Reference: ftengine/decoding/beam.py reference_step.

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
// ties go to the lower flat index (HF's topk over beams x vocabulary). renormalize (HF's
// renormalize_logits: a log-softmax after the processors): the keys hold the processed score alone
// and renorm (R, slices, 2) the slice's max and sum of exp, which beam_select adds up per row.
__global__ void __launch_bounds__(256) beam_candidates(
        unsigned long long* __restrict__ keys,     // (R, slices, keep)
        const float* __restrict__ stats, const float* __restrict__ logits, const int* __restrict__ seq,
        const float* __restrict__ run_scores, const int* __restrict__ starts, const int* __restrict__ flags,
        const int* __restrict__ step_counter, const int* __restrict__ eos, int n_eos,
        const int* __restrict__ banned, const int* __restrict__ n_banned,
        int V, int L, int nb, int keep, int chunk, float penalty, int min_new, int ngram,
        float* __restrict__ renorm, int renormalize) {
    wait_then_launch_next();
    extern __shared__ float s[];
    __shared__ unsigned long long scratch[64];
    __shared__ float partial[32];
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
    for (int i = threadIdx.x; i < *n_banned; i += blockDim.x) {  // HF's bad_words_ids, after the log-softmax
        const int token = banned[i];
        if (token >= lo && token < hi) s[token - lo] = -FT_INFINITY;
    }
    __syncthreads();
    float base = run_scores[r];
    if (renormalize) {  // the processed slice's max and sum of exp(s - max), as beam_logsumexp's
        float m = -FT_INFINITY;
        for (int i = threadIdx.x; i < hi - lo; i += blockDim.x) m = fmaxf(m, s[i]);
        m = block_max(m, partial);
        float sum = 0.0f;
        if (m > -FT_INFINITY) {
            for (int i = threadIdx.x; i < hi - lo; i += blockDim.x) sum += expf(s[i] - m);
        }
        sum = block_sum(sum, partial);
        if (threadIdx.x == 0) {
            float* out = renorm + 2 * ((long)r * gridDim.y + blockIdx.y);
            out[0] = m;
            out[1] = sum;
        }
        base = 0.0f;  // beam_select adds the beam's score to the renormalised log-probability
    }
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
        const int* __restrict__ eos, int n_eos, const int* __restrict__ max_new, float length_penalty, int early,
        const float* __restrict__ renorm, int renormalize) {
    wait_then_launch_next();
    __shared__ unsigned long long scratch[64], best[BEAM_KEEP_MAX];
    __shared__ float row_max[BEAM_KEEP_MAX / 2], row_log_sum[BEAM_KEEP_MAX / 2], row_score[BEAM_KEEP_MAX / 2];
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
    if (renormalize) {
        if (threadIdx.x < nb) {
            row_logsumexp(renorm, r0 + threadIdx.x, slices, row_max[threadIdx.x], row_log_sum[threadIdx.x]);
            row_score[threadIdx.x] = run_scores[r0 + threadIdx.x];
        }
        __syncthreads();
    }
    // renormalize: each key's processed score x becomes HF's log_softmax(x) + the beam's score
    // (row j's keys are k[j * slices * keep ...]; a 0 key, past a short slice's last, stays 0)
    block_top_keys([&](int i) {
        const unsigned long long key = k[i];
        if (!renormalize || key == 0ull) return key;
        const int j = i / (slices * keep);
        const float x = from_order_key((unsigned)(key >> 32));
        const float total = ((x - row_max[j]) - row_log_sum[j]) + row_score[j];
        return ((unsigned long long)order_key(total) << 32) | (key & 0xffffffffull);
    }, nb * slices * keep, keep, scratch, best);
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
        const float worst = warp_reduce(fin_score, MinOp());
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
