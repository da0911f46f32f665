// FP8 (e4m3) operands of the cuBLASLt products of dtype fp8 (run on sm_89+, where they are one
// cvt instruction per pair; cuda_fp8.h converts in software on older GPUs, which refuse fp8).
// A row of activations (or of a weight matrix) is stored as e4m3 bytes q with one float32 scale,
// value = q * scale, scale = amax(|row|) / 448 (e4m3's largest finite value; 1 for a zero row);
// values are converted round-to-nearest-even, saturating.
// Reference: ftengine/backends/numpy_ops.py quantize_rows, add_bias_residual_layernorm_quantize,
// add_bias_gelu_quantize. One block per row, the row in registers (as the LayerNorm kernels).
#include <cuda_fp8.h>

#define E4M3_MAX 448.0f

// Two floats -> two e4m3 bytes (lo in the low byte).
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

template <int VEC>
struct alignas(VEC) Bytes { unsigned char b[VEC]; };

// The row's scale (written to *scale by thread 0) and its e4m3 bytes, from a row held by the
// whole block in load_row_sum's layout.
template <int VEC, int ITEMS>
__device__ __forceinline__ void quantize_row_store(unsigned char* q, float* scale, const float (&v)[ITEMS][VEC],
                                                   const bool (&valid)[ITEMS], float* scratch) {
    float amax = 0.0f;
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k)
        if (valid[k]) {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(v[k][j]));
        }
    amax = block_reduce(amax, scratch, 0.0f, MaxOp());
    if (threadIdx.x == 0) *scale = amax > 0.0f ? amax / E4M3_MAX : 1.0f;
    const float inv = amax > 0.0f ? E4M3_MAX / amax : 1.0f;
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k)
        if (valid[k]) {
            Bytes<VEC> out;
            #pragma unroll
            for (int j = 0; j < VEC; j += 2) {
                const unsigned short pair = e4m3x2(v[k][j] * inv, j + 1 < VEC ? v[k][j + 1] * inv : 0.0f);
                out.b[j] = pair & 0xff;
                if (j + 1 < VEC) out.b[j + 1] = pair >> 8;
            }
            *reinterpret_cast<Bytes<VEC>*>(q + (threadIdx.x + k * blockDim.x) * VEC) = out;
        }
}

// q (rows, H) e4m3, scales (rows,) = the rows of x (rows, H): the embeddings' output, and the
// weights once at load (a row per output channel).
template <typename T, int VEC, int ITEMS>
__global__ void quantize_rows(unsigned char* __restrict__ q, float* __restrict__ scales, const T* __restrict__ x,
                              int H) {
    wait_for_previous();
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * H;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    const T* const terms[1] = {x + base};
    load_row_sum<T, VEC, ITEMS>(v, valid, terms, H);
    quantize_row_store<VEC, ITEMS>(q + base, scales + blockIdx.x, v, valid, scratch);
}

// add_bias_residual_layernorm (layernorm.cu) that also stores its output row as e4m3 + scale
// (quantised from the float values), for the product that reads it next.
template <typename T, int VEC, int ITEMS>
__global__ void add_bias_residual_layernorm_quantize(T* out, unsigned char* __restrict__ q,
                                                     float* __restrict__ scales, const T* __restrict__ x,
                                                     const T* __restrict__ bias, const T* residual,
                                                     const T* __restrict__ gamma, const T* __restrict__ beta,
                                                     int H, float eps) {
    wait_for_previous();
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * H;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    const T* const terms[3] = {x + base, bias, residual + base};
    load_row_sum<T, VEC, ITEMS>(v, valid, terms, H);
    layernorm_row<T, VEC, ITEMS>(v, valid, gamma, beta, H, eps, scratch);
    store_row<T, VEC, ITEMS>(out + base, v, valid);
    quantize_row_store<VEC, ITEMS>(q + base, scales + blockIdx.x, v, valid, scratch);
}

// q (rows, I) e4m3, scales (rows,) = GELU(x + bias) (`form` as gelu() in common.cuh): the FFN's
// activations, only as the next product's input.
template <typename T, int VEC, int ITEMS>
__global__ void add_bias_gelu_quantize(unsigned char* __restrict__ q, float* __restrict__ scales,
                                       const T* __restrict__ x, const T* __restrict__ bias, int I, int form) {
    wait_for_previous();
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * I;
    float v[ITEMS][VEC];
    bool valid[ITEMS];
    const T* const terms[2] = {x + base, bias};
    load_row_sum<T, VEC, ITEMS>(v, valid, terms, I);
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k)
        if (valid[k]) {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][j] = gelu(v[k][j], form);
        }
    quantize_row_store<VEC, ITEMS>(q + base, scales + blockIdx.x, v, valid, scratch);
}
