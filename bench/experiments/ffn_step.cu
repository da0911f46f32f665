// An experiment, not used by the package (bench/experiments/ffn_step.py compiles it after
// common.cuh, checks it and times it): a decode step's feed-forward, out (M, E) = relu(x W1^T + b1)
// W2^T for M <= 4 rows, as one kernel whose blocks copy their weight slices into shared memory with
// bulk copies (cp.async.bulk on an mbarrier, sm_90). It runs slower than the package's two products
// and residual + LayerNorm: see ffn_step.py for the figures.

__device__ __forceinline__ unsigned smem_at(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bar_init(unsigned bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(bar) : "memory");
}
// The one arrival, announcing `bytes` to come from bulk copies that complete on the barrier.
__device__ __forceinline__ void bar_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned bar) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar) : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// Every block of the grid (all resident) waits here for the others; arrivals: a count and a
// generation, both zero before the first launch (the barrier leaves the count so).
__device__ __forceinline__ void grid_sync(unsigned* arrivals) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned generation, old, now;
        asm volatile("ld.relaxed.gpu.u32 %0, [%1];\n" : "=r"(generation) : "l"(arrivals + 1) : "memory");
        asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(arrivals) : "memory");
        if (old == gridDim.x - 1) {
            asm volatile("st.relaxed.gpu.u32 [%0], 0;\n" :: "l"(arrivals) : "memory");
            asm volatile("red.release.gpu.add.u32 [%0], 1;\n" :: "l"(arrivals + 1) : "memory");
        } else {
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(now) : "l"(arrivals + 1) : "memory");
            } while (now == generation);
        }
    }
    __syncthreads();
}
__device__ __forceinline__ unsigned rank_in_cluster() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ float load_in_cluster(unsigned addr, unsigned rank) {
    unsigned at;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(at) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(at) : "memory");
    return v;
}
__device__ __forceinline__ void sync_cluster() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
    const __half2* ah = reinterpret_cast<const __half2*>(&a);
    const __half2* bh = reinterpret_cast<const __half2*>(&b);
    float s = 0.f;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 u = __half22float2(ah[i]), v = __half22float2(bh[i]);
        s += u.x * v.x + u.y * v.y;
    }
    return s;
}
__device__ __forceinline__ void stamp(unsigned long long* stamps, int on, int i) {
    if (on && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        stamps[blockIdx.x * 8 + i] = t;
    }
}

// A lane's KV 8-half vectors of each of the M rows of x (M, E), for relu_row.
template <int M, int KV>
__device__ __forceinline__ void load_rows(uint4 (&xr)[M][KV], const __half* x, int E) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int r = 0; r < M; ++r)
        #pragma unroll
        for (int j = 0; j < KV; ++j) xr[r][j] = *reinterpret_cast<const uint4*>(x + (long)r * E + (lane + 32 * j) * 8);
}
// h[r] = relu(w . x[r] + bias) for the rows load_rows gave and one weight row w (E halves, shared
// memory), summed over the warp: every lane gets them.
template <int M, int KV>
__device__ __forceinline__ void relu_row(float (&h)[M], const __half* w, const uint4 (&xr)[M][KV], float bias) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int r = 0; r < M; ++r) h[r] = 0.f;
    #pragma unroll
    for (int j = 0; j < KV; ++j) {
        const uint4 wv = *reinterpret_cast<const uint4*>(w + (lane + 32 * j) * 8);
        #pragma unroll
        for (int r = 0; r < M; ++r) h[r] += dot8(wv, xr[r][j]);
    }
    #pragma unroll
    for (int r = 0; r < M; ++r) h[r] = fmaxf(warp_sum(h[r]) + bias, 0.f);
}

#define FFN_WARPS 8
#define FFN_CHUNKS 8

// Rows r0 .. r1 of a (R, K) matrix into dst, in up to FFN_CHUNKS bulk copies of `per` rows, each
// completing on its barrier.
__device__ __forceinline__ void copy_rows(__half* dst, const __half* src, int r0, int r1, int K, int per,
                                          unsigned long long* bars) {
    for (int c = 0; c < FFN_CHUNKS; ++c) {
        const int a = r0 + c * per, z = min(r1, a + per);
        if (a >= z) break;
        const unsigned bytes = (unsigned)((z - a) * K * 2);
        bar_expect(smem_at(bars + c), bytes);
        bulk_copy(smem_at(dst + (long)(a - r0) * K), src + (long)a * K, bytes, smem_at(bars + c));
    }
}

// With a grid barrier. Block b of B (one an SM, all resident) copies rows f0..f1 of W1 (F, E) and
// e0..e1 of W2 (E, F); each warp takes rows of W1 with x (M, E) in registers (KV1 = E / 256 vectors
// a lane a row) and writes relu(. + b1) to `inter` (M, F); after the barrier each block reads
// `inter` into registers (K = F split over its threads, KV2 vectors each) for its rows of W2, the
// warps' sums added in shared memory. copy_only: the copies alone (the weights' streaming rate).
// Shared memory: ceil(F / B) E + ceil(E / B) F halves.
template <int M, int KV1, int KV2>
__global__ void __launch_bounds__(FFN_WARPS * 32, 1) ffn_barrier(__half* out, __half* inter, const __half* x,
        const __half* w1, const __half* b1, const __half* w2, const __half* b2, unsigned* arrivals, int E, int F,
        int copy_only, unsigned long long* stamps, int on) {
    stamp(stamps, on, 0);
    extern __shared__ __align__(128) unsigned char ffn_smem[];
    __shared__ __align__(8) unsigned long long bars[2 * FFN_CHUNKS];
    __shared__ float part[FFN_WARPS][16 * M];
    const int B = gridDim.x, b = blockIdx.x;
    const int f0 = (int)((long)F * b / B), f1 = (int)((long)F * (b + 1) / B);
    const int e0 = (int)((long)E * b / B), e1 = (int)((long)E * (b + 1) / B);
    const int fmax = (F + B - 1) / B, emax = (E + B - 1) / B;
    __half* w1s = reinterpret_cast<__half*>(ffn_smem);
    __half* w2s = w1s + (long)fmax * E;
    const int per1 = (fmax + FFN_CHUNKS - 1) / FFN_CHUNKS, per2 = (emax + FFN_CHUNKS - 1) / FFN_CHUNKS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint4 xr[M][KV1];
    load_rows<M, KV1>(xr, x, E);
    if (threadIdx.x == 0) {
        for (int c = 0; c < 2 * FFN_CHUNKS; ++c) bar_init(smem_at(bars + c));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        copy_rows(w1s, w1, f0, f1, E, per1, bars);
        copy_rows(w2s, w2, e0, e1, F, per2, bars + FFN_CHUNKS);
    }
    __syncthreads();
    stamp(stamps, on, 1);
    if (copy_only) {
        if (threadIdx.x < 2 * FFN_CHUNKS) {
            const int c = threadIdx.x % FFN_CHUNKS, first = threadIdx.x < FFN_CHUNKS;
            if (c * (first ? per1 : per2) < (first ? f1 - f0 : e1 - e0)) bar_wait(smem_at(bars + threadIdx.x));
        }
        __syncthreads();
        if (threadIdx.x == 0 && __half2float(w1s[0]) == 12345.0f) out[0] = w2s[0];  // keeps the copies
        return;
    }
    for (int f = f0 + warp; f < f1; f += FFN_WARPS) {
        bar_wait(smem_at(bars + (f - f0) / per1));
        float h[M];
        relu_row<M, KV1>(h, w1s + (long)(f - f0) * E, xr, __half2float(b1[f]));
        #pragma unroll
        for (int r = 0; r < M; ++r)
            if (lane == r) inter[(long)r * F + f] = __float2half(h[r]);
    }
    __syncthreads();
    stamp(stamps, on, 2);
    grid_sync(arrivals);
    stamp(stamps, on, 3);
    uint4 hr[M][KV2];
    #pragma unroll
    for (int r = 0; r < M; ++r)
        #pragma unroll
        for (int j = 0; j < KV2; ++j) {
            const int v = threadIdx.x + FFN_WARPS * 32 * j;
            if (v * 8 < F)
                asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(hr[r][j].x), "=r"(hr[r][j].y), "=r"(hr[r][j].z), "=r"(hr[r][j].w)
                             : "l"(inter + (long)r * F + v * 8));
            else
                hr[r][j] = make_uint4(0, 0, 0, 0);
        }
    stamp(stamps, on, 4);
    for (int e = e0; e < e1; ++e) {
        bar_wait(smem_at(bars + FFN_CHUNKS + (e - e0) / per2));
        const __half* w = w2s + (long)(e - e0) * F;
        float acc[M];
        #pragma unroll
        for (int r = 0; r < M; ++r) acc[r] = 0.f;
        #pragma unroll
        for (int j = 0; j < KV2; ++j) {
            const int v = threadIdx.x + FFN_WARPS * 32 * j;
            if (v * 8 < F) {
                const uint4 wv = *reinterpret_cast<const uint4*>(w + v * 8);
                #pragma unroll
                for (int r = 0; r < M; ++r) acc[r] += dot8(wv, hr[r][j]);
            }
        }
        #pragma unroll
        for (int r = 0; r < M; ++r) {
            const float v = warp_sum(acc[r]);
            if (lane == 0) part[warp][(e - e0) * M + r] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < (e1 - e0) * M) {
        float v = 0.f;
        #pragma unroll
        for (int w = 0; w < FFN_WARPS; ++w) v += part[w][threadIdx.x];
        const int e = e0 + threadIdx.x / M, r = threadIdx.x % M;
        out[(long)r * E + e] = __float2half(v + __half2float(b2[e]));
    }
    __syncthreads();
    stamp(stamps, on, 5);
}

// Without a grid barrier. Block b of B (clusters of RANKS) copies rows f0..f1 of W1 (F, E) and of
// W2^T (F, E) as it starts (before it waits for the kernel before it, when `early`: the weights do
// not depend on it), computes its activations h (M, f0..f1), then their share of the output, h
// W2^T[f0..f1] (M, E), into shared memory; the cluster adds its blocks' shares in rank order (block
// rank q the columns q E / RANKS ..) into partials (B / RANKS, M, E) float32, which the package's
// residual_layernorm adds up as a split product's. Shared memory: 2 ROWS E halves + M E floats.
template <int M, int KV, int ROWS, int RANKS>
__global__ void __launch_bounds__(FFN_WARPS * 32, 1) ffn_clusters(float* __restrict__ partials,
        const __half* __restrict__ x, const __half* __restrict__ w1, const __half* __restrict__ b1,
        const __half* __restrict__ w2t, int E, int F, int early, unsigned long long* stamps, int on) {
    extern __shared__ __align__(128) unsigned char ffn_smem[];
    __shared__ __align__(8) unsigned long long bars[2];
    __shared__ float hs[M][ROWS];
    const int B = gridDim.x, b = blockIdx.x;
    const int f0 = (int)((long)F * b / B), f1 = (int)((long)F * (b + 1) / B), rows = f1 - f0;
    __half* w1s = reinterpret_cast<__half*>(ffn_smem);
    __half* w2s = w1s + ROWS * E;
    float* share = reinterpret_cast<float*>(w2s + ROWS * E);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (!early) wait_then_launch_next();
    stamp(stamps, on, 0);
    if (threadIdx.x == 0) {
        bar_init(smem_at(bars));
        bar_init(smem_at(bars + 1));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        const unsigned bytes = (unsigned)(rows * E * 2);
        bar_expect(smem_at(bars), bytes);
        bulk_copy(smem_at(w1s), w1 + (long)f0 * E, bytes, smem_at(bars));
        bar_expect(smem_at(bars + 1), bytes);
        bulk_copy(smem_at(w2s), w2t + (long)f0 * E, bytes, smem_at(bars + 1));
    }
    if (early) wait_then_launch_next();
    stamp(stamps, on, 1);
    uint4 xr[M][KV];
    load_rows<M, KV>(xr, x, E);
    __syncthreads();  // the barriers initialised
    bar_wait(smem_at(bars));
    stamp(stamps, on, 2);
    for (int i = warp; i < rows; i += FFN_WARPS) {
        float h[M];
        relu_row<M, KV>(h, w1s + (long)i * E, xr, __half2float(b1[f0 + i]));
        #pragma unroll
        for (int r = 0; r < M; ++r)
            if (lane == 0) hs[r][i] = __half2float(__float2half(h[r]));  // rounded as stored
    }
    __syncthreads();
    bar_wait(smem_at(bars + 1));
    stamp(stamps, on, 3);
    if (threadIdx.x * 4 < E) {
        float acc[M][4];
        #pragma unroll
        for (int r = 0; r < M; ++r)
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc[r][i] = 0.f;
        for (int j = 0; j < rows; ++j) {
            const uint2 wv = *reinterpret_cast<const uint2*>(w2s + (long)j * E + threadIdx.x * 4);
            const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&wv.x));
            const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&wv.y));
            #pragma unroll
            for (int r = 0; r < M; ++r) {
                const float h = hs[r][j];
                acc[r][0] += h * lo.x;
                acc[r][1] += h * lo.y;
                acc[r][2] += h * hi.x;
                acc[r][3] += h * hi.y;
            }
        }
        #pragma unroll
        for (int r = 0; r < M; ++r)
            *reinterpret_cast<float4*>(share + r * E + threadIdx.x * 4) =
                make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    }
    sync_cluster();
    stamp(stamps, on, 4);
    const unsigned rank = rank_in_cluster();
    const int width = E / RANKS, cluster = b / RANKS;
    for (int i = threadIdx.x; i < M * width; i += FFN_WARPS * 32) {
        const int r = i / width, e = (int)rank * width + i % width;
        const unsigned at = smem_at(share + r * E + e);
        float s = 0.f;
        #pragma unroll
        for (int q = 0; q < RANKS; ++q) s += load_in_cluster(at, q);
        partials[((long)cluster * M + r) * E + e] = s;
    }
    sync_cluster();  // no block leaves while the others read its shared memory
    stamp(stamps, on, 5);
}
