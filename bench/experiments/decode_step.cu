// An experiment, not used by the package (bench/experiments/decode_step.py compiles it after
// common.cuh and decoder.cu, checks it and times it): the whole GPT-2 decode step in one kernel.
// It computes what the layer-by-layer decode does (same errors against the NumPy reference) but
// runs slower on the H100: see decode_step.py for the figures.

// ------------------------------------------------------------------ the fused decode step
// A whole decode step of GPT-2 for M <= STEP_ROWS tokens (row m is sequence m, as
// decode_attention), from the token embedding to the LM head's float logits, in one persistent
// kernel of one block per SM, launched cooperatively (every block resident). Each block keeps the
// residual stream h (M, E) in its shared memory, computing the embedding, the residual adds and the
// LayerNorms of all M rows itself (the same float operations in every block, rounded to T where
// the layer-by-layer kernels store), so a product's input is in every block without a pass. The
// products are split by output columns: block b takes columns [b N / G, (b + 1) N / G) of each
// weight, a contiguous slice of the (N, K) matrix, read from a ring of `nbuf` shared-memory
// buffers that cp.async fills ahead of use: the weights of the next products stream in while
// this block computes, waits at a grid barrier or attends, so the step is bounded by the weights'
// read and the chain of barriers (five a layer: after the q/k/v product, the attention, the output
// projection, the fc product and the proj product), not by ~90 kernel launches. The LM head
// streams through the same ring in chunks of `lm_chunk` columns. Attention: (row, head) items
// over the blocks, attend_cached as decode_attention runs it.
// Data other blocks wrote in this launch (qkv, ctx, proj, inter) is read through the L2 only.
// table: per layer STEP_SLOTS pointers (ln1 gamma, beta, qkv weight, bias, attention output
// weight, bias, ln2 gamma, beta, fc weight, bias, proj weight, bias, K cache, V cache).
// barrier: a counter that only grows, by G a barrier (the launch's first value is a multiple of
// G times its barriers). Dynamic shared memory: h (STEP_ROWS E floats) at 0, x (the product's
// input rows, or attend_cached's scratch) at x_offset, the partial sums at red_offset, two layers'
// parameters (params_size elements each) at params_offset, the ring (nbuf <= STEP_PHASES slices
// of `slice` elements) at ring_offset: decode_step.py plan() lays it out.
// Reference: the layer-by-layer decode (models/gpt2.py _layers) and numpy_ops.
#define STEP_ROWS 4
#define STEP_THREADS 256
#define STEP_WARPS (STEP_THREADS / 32)
#define STEP_PHASES 4  // products a layer
#define STEP_BARRIERS 5  // grid barriers a layer
#define STEP_MAX_WIDTH 2048  // the widest residual stream (E)
#define STEP_STAGE_UNROLL 4
#define STEP_LN1_G 0
#define STEP_LN1_B 1
#define STEP_QKV_W 2
#define STEP_QKV_B 3
#define STEP_OUT_W 4
#define STEP_OUT_B 5
#define STEP_LN2_G 6
#define STEP_LN2_B 7
#define STEP_FC_W 8
#define STEP_FC_B 9
#define STEP_PROJ_W 10
#define STEP_PROJ_B 11
#define STEP_K_CACHE 12
#define STEP_V_CACHE 13
#define STEP_SLOTS 14

// Every block of the grid arrives, then leaves once all have (counter reaches target).
__device__ __forceinline__ void grid_barrier(unsigned long long* counter, unsigned long long target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1ull);
        unsigned long long seen;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(seen) : "l"(counter) : "memory");
        } while (seen < target);
    }
    __syncthreads();
}

// Waits until at most n (0..3) of this thread's most recent cp.async groups are pending.
__device__ __forceinline__ void cp_async_wait_pending(int n) {
    switch (n) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        default: cp_async_wait<3>(); break;
    }
}

// sm_90+: copies into the ring by the tensor memory accelerator (one thread issues a slice's bulk
// copy; an mbarrier a buffer counts its bytes), which keeps them out of the SM's load queue that
// the step's critical reads use; before sm_90, cp.async by every thread.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define STEP_BULK 1
#else
#define STEP_BULK 0
#endif

// The block's weight slices, product j of the step (STEP_PHASES a layer, then the LM head's
// chunks), in a ring of shared-memory buffers; with a layer's first product, that layer's small
// parameters into the other of two parameter buffers.
template <typename T>
struct StepRing {
    static constexpr int SV = 16 / sizeof(T);
    T* buffers;
    unsigned bars;  // STEP_BULK: nbuf mbarriers (shared window address), 8 bytes apart
    T* params;
    const unsigned long long* table;
    const T* lm_head;
    const T* lnf_gamma;
    const T* lnf_beta;
    int n_layer, E, I, V, slice, nbuf, lm_chunk, params_size, total, issued;
    // product j's slice: its first column, columns, K and first element
    int col0, cols, K;
    // this block's columns [lo, hi) of each kind of product (q/k/v, attention output, fc, proj, LM head)
    int lo[STEP_PHASES + 1], hi[STEP_PHASES + 1];

    __device__ void columns() {  // once: the divisions off the step's path
        const int G = gridDim.x, b = blockIdx.x;
        const int N[STEP_PHASES + 1] = {3 * E, E, I, E, V};
        #pragma unroll
        for (int k = 0; k <= STEP_PHASES; ++k) {
            lo[k] = (int)((long)b * N[k] / G);
            hi[k] = (int)((long)(b + 1) * N[k] / G);
        }
    }

    __device__ const T* locate(int j) {
        int c0, c1;
        const T* w;
        if (j < STEP_PHASES * n_layer) {
            const int kind = j & (STEP_PHASES - 1);
            K = kind == 3 ? I : E;
            const int slot = kind == 0 ? STEP_QKV_W : kind == 1 ? STEP_OUT_W : kind == 2 ? STEP_FC_W : STEP_PROJ_W;
            w = reinterpret_cast<const T*>(table[(j / STEP_PHASES) * STEP_SLOTS + slot]);
            c0 = kind == 0 ? lo[0] : kind == 1 ? lo[1] : kind == 2 ? lo[2] : lo[3];  // registers, not a local array
            c1 = kind == 0 ? hi[0] : kind == 1 ? hi[1] : kind == 2 ? hi[2] : hi[3];
        } else {
            K = E;
            w = lm_head;
            c0 = min(hi[STEP_PHASES], lo[STEP_PHASES] + (j - STEP_PHASES * n_layer) * lm_chunk);
            c1 = min(hi[STEP_PHASES], c0 + lm_chunk);
        }
        col0 = c0;
        cols = c1 - c0;
        return w + (long)c0 * K;
    }

    // ring buffer of product j (nbuf is 2 or 4)
    __device__ int slot_of(int j) const { return j & (nbuf - 1); }

    // STEP_BULK: bytes to the current buffer's mbarrier (count: only add them up, into `bytes`)
    unsigned bar, bytes;
    bool count;

    __device__ void copy(unsigned dst, const T* src, int elements) {
#if STEP_BULK
        const unsigned size = elements * sizeof(T);
        if (count) {
            bytes += size;
        } else if (size > 0) {
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                         :: "r"(dst), "l"(src), "r"(size), "r"(bar) : "memory");
        }
#else
        for (int i = threadIdx.x; i < elements / SV; i += blockDim.x) cp_async_16(dst + i * 16, src + (long)i * SV, true);
#endif
    }

    // Product j's slice (and its layer's parameters at the layer's first product).
    __device__ void copy_phase(int j) {
        if (j < STEP_PHASES * n_layer && j % STEP_PHASES == 0) copy_params(j / STEP_PHASES);
        const T* src = locate(j);
        copy(smem_addr(buffers + (long)slot_of(j) * slice), src, cols * K);
    }

    // Layer l's parameters: ln2 gamma, beta, the attention output's bias, proj's bias, the next
    // LayerNorm's gamma, beta (layer l + 1's first, or the final one), the q/k/v bias, and the fc
    // bias from the 8-aligned column below this block's first fc column (see fc_bias).
    __device__ void copy_params(int l) {
        const unsigned long long* P = table + l * STEP_SLOTS;
        const auto at = [&](int slot) { return reinterpret_cast<const T*>(P[slot]); };
        const bool last = l + 1 == n_layer;
        const T* parts[6] = {at(STEP_LN2_G), at(STEP_LN2_B), at(STEP_OUT_B), at(STEP_PROJ_B),
                             last ? lnf_gamma : reinterpret_cast<const T*>(P[STEP_SLOTS + STEP_LN1_G]),
                             last ? lnf_beta : reinterpret_cast<const T*>(P[STEP_SLOTS + STEP_LN1_B])};
        const unsigned dst = smem_addr(params + (long)(l % 2) * params_size);
        for (int k = 0; k < 6; ++k) copy(dst + k * E * sizeof(T), parts[k], E);
        copy(dst + 6 * E * sizeof(T), at(STEP_QKV_B), 3 * E);
        const int below = lo[2] / SV * SV;
        copy(dst + 9 * E * sizeof(T), at(STEP_FC_B) + below, (hi[2] - below + SV - 1) / SV * SV);
    }

    __device__ const T* layer_params(int l) const { return params + (long)(l % 2) * params_size; }
    // the fc bias of this block's first fc column
    __device__ const T* fc_bias(int l) const {
        return layer_params(l) + 9 * E + lo[2] % SV;
    }

    // Issues the copies of every product before j + nbuf (their buffers' earlier products are done).
    __device__ void top_up(int j) {
        const int upto = min(j + nbuf, total);
        for (; issued < upto; ++issued) {
#if STEP_BULK
            if (threadIdx.x == 0) {
                bar = bars + slot_of(issued) * 8;
                count = true;
                bytes = 0;
                copy_phase(issued);
                // the buffer's earlier reads (generic proxy) before the copy's writes (async proxy)
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
                count = false;
                copy_phase(issued);
            }
#else
            copy_phase(issued);
            cp_async_commit();
#endif
        }
    }

    // Product j's slice, once it is in shared memory (block-wide); sets col0, cols and K.
    __device__ const T* wait(int j) {
        top_up(j);
#if STEP_BULK
        const unsigned b = bars + slot_of(j) * 8, parity = (j >> (nbuf == 4 ? 2 : 1)) & 1;
        asm volatile("{\n .reg .pred done;\n WAIT_%=:\n"
                     " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                     " @!done bra WAIT_%=;\n}\n" :: "r"(b), "r"(parity) : "memory");
#else
        cp_async_wait_pending(issued - j - 1);
#endif
        __syncthreads();
        locate(j);
        return buffers + (long)slot_of(j) * slice;
    }
};

// Partial sums of x (M rows of K, shared memory) against w (cols rows of K, shared memory): warp
// units (column, part of K), a column split into `parts` where there are fewer columns than warps;
// red[(part * M + m) * cols + c]. Returns parts; the sums are visible to the block on return.
template <typename T>
__device__ int step_products(float* red, const T* w, int cols, int K, const T* x, int M) {
    constexpr int SV = 16 / sizeof(T);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int parts = cols > 0 && cols < STEP_WARPS ? STEP_WARPS / cols : 1;
    const int vectors = K / SV, units = cols * parts;
    for (int u0 = warp; u0 < units; u0 += 2 * STEP_WARPS) {  // two units a warp at once
        const T* row[2];
        int first[2], count[2];
        float acc[2][STEP_ROWS];
        #pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int u = u0 + q * STEP_WARPS, c = u / parts, part = u % parts;
            first[q] = part * vectors / parts;
            count[q] = u < units ? (part + 1) * vectors / parts - first[q] : 0;
            row[q] = w + (long)c * K;
            #pragma unroll
            for (int m = 0; m < STEP_ROWS; ++m) acc[q][m] = 0.0f;
        }
        const int longest = max(count[0], count[1]);
        for (int i = lane; i < longest; i += 32) {
            #pragma unroll
            for (int q = 0; q < 2; ++q) {
                if (i < count[q]) {
                    const int v = first[q] + i;
                    float wv[SV];
                    load_floats<T, SV>(wv, row[q] + v * SV);
                    #pragma unroll
                    for (int m = 0; m < STEP_ROWS; ++m) {
                        if (m < M) {
                            float xv[SV];
                            load_floats<T, SV>(xv, x + m * K + v * SV);
                            #pragma unroll
                            for (int k = 0; k < SV; ++k) acc[q][m] = fmaf(wv[k], xv[k], acc[q][m]);
                        }
                    }
                }
            }
        }
        #pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int u = u0 + q * STEP_WARPS;
            #pragma unroll
            for (int m = 0; m < STEP_ROWS; ++m) {
                if (m < M && u < units) {  // uniform over the warp
                    const float v = warp_sum(acc[q][m]);
                    if (lane == 0) red[((u % parts) * M + m) * cols + u / parts] = v;
                }
            }
        }
    }
    __syncthreads();
    return parts;
}

__device__ __forceinline__ float step_sum(const float* red, int parts, int M, int cols, int m, int c) {
    float v = 0.0f;
    for (int p = 0; p < parts; ++p) v += red[(p * M + m) * cols + c];
    return v;
}

// Block-wide: out (M, N) columns [col0, col0 + cols) = the sums (+ bias[c], GELU when form >= 0).
template <typename T, typename OutT>
__device__ void step_store(OutT* out, int N, const float* red, int parts, int M, int col0, int cols,
                           const T* bias, int form) {
    for (int i = threadIdx.x; i < M * cols; i += blockDim.x) {
        const int m = i / cols, c = i - m * cols;
        float v = step_sum(red, parts, M, cols, m, c);
        if (form >= 0) v = gelu(v + to_float(bias[c]), form);
        out[(long)m * N + col0 + c] = from_float<OutT>(v);
    }
    __syncthreads();  // red is reused by the next product
}

// h (M, E) floats of T values in shared memory: h[m] = (add[m] + bias) + h[m] rounded to T (as
// residual_layernorm stores hidden) where add is given; x[m] = LayerNorm(h[m]) in T. STEP_WARPS / M
// warps a row (M <= STEP_ROWS), every thread of them a vector in turn; block-wide (every thread
// calls it); x is visible to the block on return.
template <typename T>
__device__ void step_residual_layernorm(float* h, T* x, const T* add, const T* bias, const T* gamma, const T* beta,
                                        int M, int E, float eps) {
    constexpr int SV = 16 / sizeof(T);
    constexpr int MOST = STEP_MAX_WIDTH / (2 * 32 * SV);  // vectors a thread, two warps a row at the least
    __shared__ float part[2][STEP_WARPS];
    const int per_row = STEP_WARPS / M, warp = threadIdx.x >> 5;
    const int m = warp / per_row, threads = per_row * 32, t = threadIdx.x - m * threads;
    const bool mine = m < M;
    float* row = h + m * E;
    float sum = 0.0f;
    if (mine) {
        Pack<T, SV> a[MOST];
        if (add != nullptr) {  // every load in flight at once
            #pragma unroll
            for (int k = 0; k < MOST; ++k) {
                const int c = (t + threads * k) * SV;
                if (c < E) *reinterpret_cast<uint4*>(&a[k]) = __ldcg(reinterpret_cast<const uint4*>(add + (long)m * E + c));
            }
        }
        #pragma unroll
        for (int k = 0; k < MOST; ++k) {
            const int c = (t + threads * k) * SV;
            if (c < E) {
                if (add != nullptr) {
                    float b[SV];
                    load_floats<T, SV>(b, bias + c);
                    #pragma unroll
                    for (int j = 0; j < SV; ++j) row[c + j] = to_float(from_float<T>((to_float(a[k].v[j]) + b[j]) + row[c + j]));
                }
                #pragma unroll
                for (int j = 0; j < SV; ++j) sum += row[c + j];
            }
        }
    }
    sum = warp_sum(sum);
    if ((threadIdx.x & 31) == 0) part[0][warp] = sum;
    __syncthreads();
    float mean = 0.0f, sq = 0.0f;
    if (mine) {
        for (int w = 0; w < per_row; ++w) mean += part[0][m * per_row + w];
        mean /= E;
        for (int c = t * SV; c < E; c += threads * SV) {
            #pragma unroll
            for (int j = 0; j < SV; ++j) {
                const float d = row[c + j] - mean;
                sq += d * d;
            }
        }
    }
    sq = warp_sum(sq);
    if ((threadIdx.x & 31) == 0) part[1][warp] = sq;
    __syncthreads();
    if (mine) {
        float var = 0.0f;
        for (int w = 0; w < per_row; ++w) var += part[1][m * per_row + w];
        const float rstd = rsqrtf(var / E + eps);
        for (int c = t * SV; c < E; c += threads * SV) {
            float g[SV], b[SV], out[SV];
            load_floats<T, SV>(g, gamma + c);
            load_floats<T, SV>(b, beta + c);
            #pragma unroll
            for (int j = 0; j < SV; ++j) out[j] = (row[c + j] - mean) * rstd * g[j] + b[j];
            store_floats<T, SV>(x + m * E + c, out);
        }
    }
    __syncthreads();
}

// x (elements of T) = src, read through the L2 only, STEP_STAGE_UNROLL loads a thread in flight;
// the caller synchronises.
template <typename T>
__device__ void step_stage(T* x, const T* src, int elements) {
    constexpr int SV = 16 / sizeof(T);
    const int n = elements / SV;
    for (int i0 = threadIdx.x; i0 < n; i0 += STEP_STAGE_UNROLL * blockDim.x) {
        uint4 v[STEP_STAGE_UNROLL];
        #pragma unroll
        for (int u = 0; u < STEP_STAGE_UNROLL; ++u) {
            const int i = i0 + u * blockDim.x;
            if (i < n) v[u] = __ldcg(reinterpret_cast<const uint4*>(src + (long)i * SV));
        }
        #pragma unroll
        for (int u = 0; u < STEP_STAGE_UNROLL; ++u) {
            const int i = i0 + u * blockDim.x;
            if (i < n) *reinterpret_cast<uint4*>(x + i * SV) = v[u];
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(STEP_THREADS, 1) decode_step(
        float* __restrict__ logits, T* qkv, T* ctx, T* proj, T* inter, unsigned long long* barrier,
        const unsigned long long* __restrict__ table, const T* __restrict__ wte, const T* __restrict__ wpe,
        const T* __restrict__ lnf_gamma, const T* __restrict__ lnf_beta, const T* __restrict__ lm_head,
        const int* __restrict__ ids, const int* __restrict__ positions, const int* __restrict__ indir, int flags,
        int M, int n_layer, int heads, int E, int I, int V, int L, int TPK, int slice, int nbuf, int lm_chunk,
        int x_offset, int red_offset, int params_offset, int params_size, int ring_offset, float eps, int gelu_form,
        float scale) {
    wait_for_previous();
    constexpr int SV = 16 / sizeof(T);
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ unsigned long long base;
    float* h = reinterpret_cast<float*>(smem);
    T* x = reinterpret_cast<T*>(smem + x_offset);
    float* red = reinterpret_cast<float*>(smem + red_offset);
    const int G = gridDim.x, D = E / heads;
    const int lm_chunks = (int)(((long)(V + G - 1) / G + lm_chunk - 1) / lm_chunk);
    __shared__ __align__(8) unsigned long long bars[STEP_PHASES];
    StepRing<T> ring{reinterpret_cast<T*>(smem + ring_offset), smem_addr(bars), reinterpret_cast<T*>(smem + params_offset),
                     table, lm_head, lnf_gamma, lnf_beta, n_layer, E, I, V, slice, nbuf, lm_chunk, params_size,
                     STEP_PHASES * n_layer + lm_chunks, 0, 0, 0, 0, 0, 0, false};
    if (threadIdx.x == 0) {
#if STEP_BULK
        for (int i = 0; i < nbuf; ++i)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(ring.bars + i * 8) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
        unsigned long long now;
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(now) : "l"(barrier) : "memory");
        base = now - now % ((unsigned long long)G * STEP_BARRIERS * n_layer);
    }
    ring.columns();
    __syncthreads();
    ring.top_up(0);
    unsigned long long passed = 0;
    const auto sync_grid = [&]() { grid_barrier(barrier, base + (unsigned long long)G * ++passed); };
    // product j of the step (x its input rows) into out (M, N), + bias and GELU where form >= 0
    const auto product = [&](int j, auto* out, int N, const T* bias, int form) {
        const T* w = ring.wait(j);
        const int parts = step_products<T>(red, w, ring.cols, ring.K, x, M);
        step_store<T>(out, N, red, parts, M, ring.col0, ring.cols, bias, form);
    };

    // the embedding, then layer 0's first LayerNorm
    for (int m = 0; m < M; ++m) {
        const T* w = wte + (long)ids[m] * E;
        const T* p = wpe + (long)positions[m] * E;
        for (int c = threadIdx.x * SV; c < E; c += blockDim.x * SV) {
            float a[SV], b[SV];
            load_floats<T, SV>(a, w + c);
            load_floats<T, SV>(b, p + c);
            #pragma unroll
            for (int j = 0; j < SV; ++j) h[m * E + c + j] = to_float(from_float<T>(a[j] + b[j]));
        }
    }
    __syncthreads();
    step_residual_layernorm<T>(h, x, nullptr, nullptr, reinterpret_cast<const T*>(table[STEP_LN1_G]),
                               reinterpret_cast<const T*>(table[STEP_LN1_B]), M, E, eps);
    for (int l = 0; l < n_layer; ++l) {
        const unsigned long long* P = table + l * STEP_SLOTS;
        const auto at = [&](int slot) { return reinterpret_cast<const T*>(P[slot]); };
        const int j = l * STEP_PHASES;
        // q, k, v (their bias is added by the attention, as decode_attention does); the ring's wait
        // for this product also brings this layer's parameters
        product(j, qkv, 3 * E, nullptr, -1);
        const T* prm = ring.layer_params(l);
        sync_grid();
        // attention over the cache, this token's key and value written to it
        for (int item = blockIdx.x; item < M * heads; item += G) {
            attend_cached<T, SV, true>(ctx, qkv, prm + 6 * E, const_cast<T*>(at(STEP_K_CACHE)),
                                       const_cast<T*>(at(STEP_V_CACHE)), positions, positions, indir, flags, heads,
                                       D, L, TPK, scale, nullptr, nullptr, 0, item / heads, item % heads,
                                       reinterpret_cast<float*>(x));
            __syncthreads();
        }
        ring.top_up(j + 1);
        sync_grid();
        // attention output projection
        step_stage<T>(x, ctx, M * E);
        product(j + 1, proj, E, nullptr, -1);
        sync_grid();
        // residual + LayerNorm, fc + bias + GELU
        step_residual_layernorm<T>(h, x, proj, prm + 2 * E, prm, prm + E, M, E, eps);
        product(j + 2, inter, I, ring.fc_bias(l), gelu_form);
        sync_grid();
        // proj
        step_stage<T>(x, inter, M * I);
        product(j + 3, proj, E, nullptr, -1);
        sync_grid();
        // residual + the next layer's first LayerNorm (after the last layer: the final one)
        step_residual_layernorm<T>(h, x, proj, prm + 3 * E, prm + 4 * E, prm + 5 * E, M, E, eps);
    }
    // the LM head, chunk by chunk
    for (int j = STEP_PHASES * n_layer; j < ring.total; ++j) product(j, logits, V, nullptr, -1);
}
