// A model's weights converted on the device as they are uploaded (runtime.py to_device): float32
// in, the storage type T out, rounded to nearest even (as NumPy's float16 cast and runtime.py's
// bf16 words), and laid out row-major: out (rows, cols) = in, or in^T where in is (cols, rows)
// (`transposed`: GPT-2's Conv1D weights). Elementwise over out, a grid-stride loop.
// Reference: ftengine/backends/cuda/runtime.py _bf16_words; NumPy's astype.
template <typename T>
__global__ void convert_rows(T* __restrict__ out, const float* __restrict__ in, long rows, long cols, int transposed) {
    wait_for_previous();
    const long n = rows * cols;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = from_float<T>(in[transposed ? (i % cols) * rows + i / cols : i]);
}
