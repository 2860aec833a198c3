// softmax.cu — softmax over the last dimension and its backward, one block per row.
// Forward: row max, sum of exp (fp32), y = exp(x - max) / sum. Backward: dx = y * (dy - <y, dy>).
// Both reductions are block trees, so results are deterministic.
#include "common.cuh"

template <typename T>
static __device__ void softmax_fwd_impl(const T* x, T* y, i64 rows, i64 d) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * d;
        float m = -INFINITY;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) m = fmaxf(m, to_f(xr[j]));
        m = block_max(m, scratch);
        float s = 0.0f;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) s += expf(to_f(xr[j]) - m);
        s = block_sum(s, scratch);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) y[r * d + j] = from_f<T>(expf(to_f(xr[j]) - m) / s);
    }
}
template <typename T>
static __device__ void softmax_bwd_impl(const T* y, const T* dy, T* dx, i64 rows, i64 d) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float dot = 0.0f;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) dot += to_f(y[r * d + j]) * to_f(dy[r * d + j]);
        dot = block_sum(dot, scratch);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            float p = to_f(y[r * d + j]);
            dx[r * d + j] = from_f<T>(p * (to_f(dy[r * d + j]) - dot));
        }
    }
}
extern "C" __global__ void softmax_fwd_f32(const float* x, float* y, i64 rows, i64 d) { softmax_fwd_impl(x, y, rows, d); }
extern "C" __global__ void softmax_fwd_bf16(const bf16* x, bf16* y, i64 rows, i64 d) { softmax_fwd_impl(x, y, rows, d); }
extern "C" __global__ void softmax_bwd_f32(const float* y, const float* dy, float* dx, i64 rows, i64 d) { softmax_bwd_impl(y, dy, dx, rows, d); }
extern "C" __global__ void softmax_bwd_bf16(const bf16* y, const bf16* dy, bf16* dx, i64 rows, i64 d) { softmax_bwd_impl(y, dy, dx, rows, d); }
