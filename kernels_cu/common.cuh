// Shared device code, prepended to every kernel source by ftengine/backends/cuda/kernels.py
// (not #included, so that CuPy's compile cache key sees it).
// Kernels are templated on the storage type T (float, __half, __nv_bfloat16) and compute in float.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC has no <math.h>: spell infinity out.
#define FT_INFINITY __int_as_float(0x7f800000)
#ifndef INT_MIN
#define INT_MIN (-2147483647 - 1)
#endif

// Programmatic dependent launch (sm_90+): a kernel captured into a graph may be scheduled while
// the kernel before it on the stream is still running (ops.py _launch), so every kernel begins
// here, waiting until that kernel has finished and its writes are visible, before it touches
// memory. A no-op for a kernel launched the plain way, and before sm_90.
__device__ __forceinline__ void wait_for_previous() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// wait_for_previous, then lets the kernel after this one be scheduled (it waits at its own start
// in turn), so that its launch overlaps this kernel's work; at most two kernels are resident.
// Used where it measured faster on the H100: by the kernels of decoder.cu
// (but write_kv_cache), gemv.cu and sampling.cu (GPT-2 small's batch-1 decode step 274 -> 267 us),
// not by the encoder files' (with them too, the all-MiniLM-L6-v2 shape's 256 x 128 pass took 5%
// longer: 2.53 -> 2.67 ms). Loads issued before the wait did not overlap the kernel before: the
// gemv's weights loaded ahead of it into registers made the step 20 us slower, prefetched into the
// L2, 9 us. Nor did the encoder files' kernels gain by it at small batches (H100, 2026-11-26,
// GPU-only passes replayed, ms, two alternating rounds, as now -> every kernel letting the next be
// scheduled after its wait, or late: gemm_sm90.cu's blocks as they start their last tile, the
// attention kernels before their stores, the others after the wait): BERT-base 1 x 128 0.364 /
// 0.365 -> 0.372 / 0.367, 0.366 / 0.367; 32 x 128 1.634 / 1.637 -> 1.610 / 1.631, 1.570 / 1.621;
// 256 x 128 12.11 / 12.14 -> 12.24 / 12.14, 12.18 / 12.27; all-MiniLM-L6-v2 32 x 128 0.348 / 0.351
// -> 0.354 / 0.350, 0.351 / 0.351; GPT-2 small prefill 32 x 128 1.805 / 1.805 -> 2.061 / 1.800,
// 1.801 / 1.788: within the runs' spread.
__device__ __forceinline__ void wait_then_launch_next() {
    wait_for_previous();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Whether two types are one (NVRTC has no <type_traits>).
template <typename A, typename B> struct SameType { static constexpr bool value = false; };
template <typename A> struct SameType<A, A> { static constexpr bool value = true; };

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Reductions over a warp and over a block, for any value type with an associative operator.
struct SumOp {
    template <typename V> __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};
struct MaxOp {  // floats: fmaxf (a NaN operand loses); integers: the larger
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
    template <typename V> __device__ __forceinline__ V operator()(V a, V b) const { return a > b ? a : b; }
};
struct MinOp {  // floats: fminf (a NaN operand loses)
    __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); }
};

template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Over a block whose size is a multiple of 32 (at most 1024); every thread gets the result.
// `scratch` holds 32 values in shared memory; `identity` fills the lanes past the last warp.
template <typename V, typename Op>
__device__ __forceinline__ V block_reduce(V v, V* scratch, V identity, Op op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < (int)(blockDim.x >> 5)) ? scratch[lane] : identity;
    return warp_reduce(v, op);
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp()); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, MaxOp()); }
__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce(v, scratch, 0.0f, SumOp()); }
__device__ __forceinline__ int block_sum_int(int v, int* scratch) { return block_reduce(v, scratch, 0, SumOp()); }
__device__ __forceinline__ int block_max_int(int v, int* scratch) { return block_reduce(v, scratch, INT_MIN, MaxOp()); }
__device__ __forceinline__ float block_max(float v, float* scratch) {
    return block_reduce(v, scratch, -FT_INFINITY, MaxOp());
}

// Monotone float -> unsigned: a < b (floats, no NaN) iff order_key(a) < order_key(b).
__device__ __forceinline__ unsigned order_key(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float from_order_key(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// GELU, `form` 0: erf (BERT "gelu"), 1: tanh approximation ("gelu_new", "gelu_pytorch_tanh").
// The erf form: GELU(v) = v Phi(v), Phi(v) = 1 - t for v >= 0 and t below, t = erfc(|v| / sqrt(2)) / 2
// = 2^q(y) for y = min(|v|, 4.25 sqrt(2)), q a degree-7 polynomial fitted to log2(erfc(y / sqrt(2)) / 2)
// (bench/experiments/gelu_fit.py: erfc within 1e-5 relative up to the clamp, GELU within 7e-7 absolute and
// 1e-5 relative wherever |GELU| > 1e-6; past the clamp t < 1.1e-9, so |GELU| < 7e-9 below -6.01 and
// 1 - t is 1 in float32 above +6.01); then GELU(v) = max(v, 0) + v w, w = t with the sign bit set where
// v's is clear (-t for v >= 0): one fused multiply-add. One MUFU operation (ex2) and 8 float32 ones
// a value: the bias + GELU epilogue of gemm_sm90.cu's product is bound by its instructions. Degree 9
// up to 5.5 sqrt(2) before (the shorter range takes two coefficients fewer for the same bounds; H100,
// 2026-11-26, fused products, us, three alternating rounds: BERT-base's 32,768 x 3,072 x 768
// 284.5-285.5 -> 277.5-277.9, replayed for 2 s at the 700 W limit 322.6-323.7 -> 315.6-315.8; 4,096
// rows 37.8-38.6 -> 37.1-37.6; all-MiniLM-L6-v2's 32,768 x 1,536 x 384 99.1-99.2 -> 94.3-94.6;
// BERT-base's 256 x 128 pass end to end 12.06-12.11 -> 11.92-12.10 ms, within the runs' spread).
// With q in |v| / sqrt(2), erfc's half and the select apart (13; H100, 2026-11-26, fused products,
// us): BERT-base's 32,768 x 3,072 x 768 292.2 -> 287.5, all-MiniLM-L6-v2's 32,768 x 1,536 x 384
// 102.0 -> 99.0 (the product alone 236.5 and 71.9). The Abramowitz & Stegun 7.1.26 form before that
// (numpy_ops._gelu_block's) took two MUFU operations, a reciprocal and ex2 (298 -> 291 us on the
// first product, 2026-11-25).
__device__ __forceinline__ float gelu(float v, int form) {
    if (form == 0) {
        const float y = fminf(fabsf(v), 6.0104074f);
        float q = fmaf(y, -1.8343341e-06f, 6.1589060e-05f);
        q = fmaf(q, y, -9.3045412e-04f);
        q = fmaf(q, y, 8.5076159e-03f);
        q = fmaf(q, y, -5.3959496e-02f);
        q = fmaf(q, y, -4.5846501e-01f);
        q = fmaf(q, y, -1.1512507e+00f);
        q = fmaf(q, y, -9.9999535e-01f);
        float t;  // erfc(|v| / sqrt(2)) / 2
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(q));
        const float w = __uint_as_float(__float_as_uint(t) | (~__float_as_uint(v) & 0x80000000u));
        return fmaf(v, w, fmaxf(v, 0.0f));
    }
    const float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
    return 0.5f * v * (1.0f + tanhf(inner));
}

// VEC consecutive elements of T, moved as one 16-byte (or smaller) access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };

template <typename T, int VEC>
__device__ __forceinline__ void load_floats(float* dst, const T* src) {
    const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(src);
    #pragma unroll
    for (int j = 0; j < VEC; ++j) dst[j] = to_float(p.v[j]);
}

// As load_floats (16 bytes), through the L2 only (ld.global.cg): for data that other blocks of the
// running grid wrote since this block may have cached the same addresses in its SM's L1.
template <typename T, int VEC>
__device__ __forceinline__ void load_floats_cg(float* dst, const T* src) {
    static_assert(sizeof(Pack<T, VEC>) == 16, "load_floats_cg moves 16 bytes");
    Pack<T, VEC> p;
    *reinterpret_cast<uint4*>(&p) = __ldcg(reinterpret_cast<const uint4*>(src));
    #pragma unroll
    for (int j = 0; j < VEC; ++j) dst[j] = to_float(p.v[j]);
}

template <bool CG, typename T, int VEC>
__device__ __forceinline__ void load_floats_from(float* dst, const T* src) {
    if constexpr (CG) {
        load_floats_cg<T, VEC>(dst, src);
    } else {
        load_floats<T, VEC>(dst, src);
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_floats(T* dst, const float* src) {
    Pack<T, VEC> p;
    #pragma unroll
    for (int j = 0; j < VEC; ++j) p.v[j] = from_float<T>(src[j]);
    *reinterpret_cast<Pack<T, VEC>*>(dst) = p;
}

// The threads that hold a row in the row kernels: RowThreads<0>, a whole block (row blockIdx.x);
// RowThreads<WARPS>, one warp of a block of WARPS warps (row blockIdx.x * WARPS + its warp): no
// block-wide barrier, more rows in flight for short rows. lane(): the thread's index among the row's
// lanes() threads; sum(): a float summed over them (scratch: 32 floats of shared memory, for a block).
template <int WARPS> struct RowThreads {
    static __device__ __forceinline__ int row() { return blockIdx.x * WARPS + (threadIdx.x >> 5); }
    static __device__ __forceinline__ int lane() { return threadIdx.x & 31; }
    static __device__ __forceinline__ int lanes() { return 32; }
    static __device__ __forceinline__ float sum(float v, float*) { return warp_sum(v); }
};
template <> struct RowThreads<0> {
    static __device__ __forceinline__ int row() { return blockIdx.x; }
    static __device__ __forceinline__ int lane() { return threadIdx.x; }
    static __device__ __forceinline__ int lanes() { return blockDim.x; }
    static __device__ __forceinline__ float sum(float v, float* scratch) { return block_sum(v, scratch); }
};
using BlockRow = RowThreads<0>;

// A row into registers, laid out as layernorm_row_store expects: thread vector k is columns
// (R::lane() + k * R::lanes()) * VEC ..., holding the elementwise sum of the N terms (row
// pointers) there; valid[k] says whether it is inside the row of H columns.
template <typename T, int VEC, int ITEMS, int N, typename R = BlockRow>
__device__ __forceinline__ void load_row_sum(float (&v)[ITEMS][VEC], bool (&valid)[ITEMS], const T* const (&terms)[N],
                                             int H) {
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int col = (R::lane() + k * R::lanes()) * VEC;
        valid[k] = col < H;
        if (valid[k]) {
            load_floats<T, VEC>(v[k], terms[0] + col);
            #pragma unroll
            for (int n = 1; n < N; ++n) {
                float a[VEC];
                load_floats<T, VEC>(a, terms[n] + col);
                #pragma unroll
                for (int j = 0; j < VEC; ++j) v[k][j] += a[j];
            }
        }
    }
}

// LayerNorm of one row held in registers, in place: each thread owns up to ITEMS vectors of VEC
// values (vector k of the thread is columns (R::lane() + k * R::lanes()) * VEC ...). Two-pass
// mean / variance in float; `valid[k]` says whether the thread's vector k is inside the row.
// rms: T5's RMS norm instead (no mean taken out; the caller passes a zero beta).
// gamma and beta are loaded after the reductions: loaded before them, to arrive meanwhile, the
// kernels were no faster at 1-128 rows and slower from 4,096 (H100 fp16, 2026-11-26, us: 768 columns
// at 4,096 / 32,768 rows 5.24 / 51.21 -> 5.78 / 54.24, a warp a row at 384 columns 3.24 -> 3.98).
template <typename T, int VEC, int ITEMS, typename R = BlockRow>
__device__ __forceinline__ void layernorm_row(float (&v)[ITEMS][VEC], const bool (&valid)[ITEMS],
                                              const T* __restrict__ gamma, const T* __restrict__ beta,
                                              int H, float eps, float* scratch, bool rms = false) {
    float sum = 0.0f;
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k)
        if (valid[k]) {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) sum += v[k][j];
        }
    const float mean = rms ? 0.0f : R::sum(sum, scratch) / H;
    float sq = 0.0f;
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k)
        if (valid[k]) {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) { const float d = v[k][j] - mean; sq += d * d; }
        }
    const float rstd = rsqrtf(R::sum(sq, scratch) / H + eps);
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k)
        if (valid[k]) {
            const int col = (R::lane() + k * R::lanes()) * VEC;
            float g[VEC], b[VEC];
            load_floats<T, VEC>(g, gamma + col);
            load_floats<T, VEC>(b, beta + col);
            #pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][j] = (v[k][j] - mean) * rstd * g[j] + b[j];
        }
}

// v += w, rows held in registers (layout as load_row_sum's).
template <int VEC, int ITEMS>
__device__ __forceinline__ void add_rows(float (&v)[ITEMS][VEC], const float (&w)[ITEMS][VEC],
                                         const bool (&valid)[ITEMS]) {
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k)
        if (valid[k]) {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][j] += w[k][j];
        }
}

// A row held in registers rounded to T's precision, as storing it and reading it back would.
template <typename T, int VEC, int ITEMS>
__device__ __forceinline__ void round_row(float (&v)[ITEMS][VEC], const bool (&valid)[ITEMS]) {
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k)
        if (valid[k]) {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][j] = to_float(from_float<T>(v[k][j]));
        }
}

// Row `row` of a product into registers (layout as load_row_sum's): x (rows, H) of T, or (X float) a
// product split over K, its SPLITS partial sums (SPLITS, rows, H) added up in slice order and
// rounded to T, as the product would have stored their sum.
template <typename T, typename X, int SPLITS, int VEC, int ITEMS, typename R = BlockRow>
__device__ __forceinline__ void load_product_row(float (&v)[ITEMS][VEC], bool (&valid)[ITEMS], const X* x, int H,
                                                 int row, int rows) {
    const long base = (long)row * H;
    const X* parts[SPLITS];
    #pragma unroll
    for (int s = 0; s < SPLITS; ++s) parts[s] = x + (s * (long)rows) * H + base;
    load_row_sum<X, VEC, ITEMS, SPLITS, R>(v, valid, parts, H);
    if constexpr (!SameType<X, T>::value) round_row<T, VEC, ITEMS>(v, valid);
}

// v += each of the N rows `terms` in turn (float sums in the order a reference adds them).
template <typename T, int VEC, int ITEMS, int N, typename R = BlockRow>
__device__ __forceinline__ void add_row_terms(float (&v)[ITEMS][VEC], bool (&valid)[ITEMS], const T* const (&terms)[N],
                                              int H) {
    float w[ITEMS][VEC];
    #pragma unroll
    for (int n = 0; n < N; ++n) {
        const T* const term[1] = {terms[n]};
        load_row_sum<T, VEC, ITEMS, 1, R>(w, valid, term, H);
        add_rows<VEC, ITEMS>(v, w, valid);
    }
}

// A row held in registers (layout as load_row_sum's) stored to `out`.
template <typename T, int VEC, int ITEMS, typename R = BlockRow>
__device__ __forceinline__ void store_row(T* out, const float (&v)[ITEMS][VEC], const bool (&valid)[ITEMS]) {
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k)
        if (valid[k]) store_floats<T, VEC>(out + (R::lane() + k * R::lanes()) * VEC, v[k]);
}

template <typename T, int VEC, int ITEMS, typename R = BlockRow>
__device__ __forceinline__ void layernorm_row_store(T* out, float (&v)[ITEMS][VEC], const bool (&valid)[ITEMS],
                                                    const T* __restrict__ gamma, const T* __restrict__ beta,
                                                    int H, float eps, float* scratch, bool rms = false) {
    layernorm_row<T, VEC, ITEMS, R>(v, valid, gamma, beta, H, eps, scratch, rms);
    store_row<T, VEC, ITEMS, R>(out, v, valid);
}

// Two floats rounded to one 32-bit register of T pairs (lo in the low half): one cvt instruction.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// A shared-memory pointer as the 32-bit shared window address that ldmatrix, cp.async, mbarrier
// and the tensor memory accelerator take.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
}

// Asynchronous copies (sm_80+): 16 bytes global -> shared (a 32-bit shared window address)
// without passing through registers, zeros when `valid` is false; groups of them committed and
// waited for (all but the N most recent groups complete).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// Four 8x8 b16 matrices from shared memory (a 32-bit shared window address); lane l gives a
// row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Tensor cores (half, bf16): D (16 x 8, float) += A (16 x 16, row-major) B (16 x 8, column-major),
// mma.sync m16n8k16; fragments as the PTX ISA lays them out (lane l: group l / 4, pair l % 4).
template <typename T> struct MmaOp;
template <> struct MmaOp<__half> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct MmaOp<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
