// rmsnorm.cu — RMSNorm forward and backward. Forward (one block per row): inv_rms = 1 /
// sqrt(mean(x^2) + eps) saved in f32, y = x * inv_rms * w. Backward: dx per row (one block per
// row) = r * (dy*w - x * r^2 * mean(dy*w*x)); dw = sum over rows of dy * x * r, reduced
// deterministically in two passes: each block of the first pass owns a contiguous range of
// rows and writes a partial (nchunks, d) in row order, the second pass sums the partials in
// chunk order. No atomics anywhere.
#include "common.cuh"

template <typename T>
static __device__ void rmsnorm_fwd_impl(const T* x, const T* w, T* y, float* inv_rms, i64 rows, i64 d, float eps) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * d;
        float ss = 0.0f;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) { float v = to_f(xr[j]); ss += v * v; }
        ss = block_sum(ss, scratch);
        float rr = 1.0f / sqrtf(ss / (float)d + eps);
        if (threadIdx.x == 0) inv_rms[r] = rr;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) y[r * d + j] = from_f<T>(to_f(xr[j]) * rr * to_f(w[j]));
    }
}
template <typename T>
static __device__ void rmsnorm_bwd_dx_impl(const T* dy, const T* x, const T* w, const float* inv_rms, T* dx, i64 rows, i64 d) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float rr = inv_rms[r];
        float gx = 0.0f;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) gx += to_f(dy[r * d + j]) * to_f(w[j]) * to_f(x[r * d + j]);
        gx = block_sum(gx, scratch) / (float)d;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            float xv = to_f(x[r * d + j]);
            dx[r * d + j] = from_f<T>(rr * (to_f(dy[r * d + j]) * to_f(w[j]) - xv * rr * rr * gx));
        }
    }
}
// grid: (nchunks, ceil(d / blockDim.x)); chunk c owns rows [c*rows_per_chunk, ...).
template <typename T>
static __device__ void rmsnorm_bwd_dw_partial_impl(const T* dy, const T* x, const float* inv_rms, float* partial, i64 rows, i64 d, i64 rows_per_chunk) {
    i64 j = (i64)blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= d) return;
    i64 r0 = (i64)blockIdx.x * rows_per_chunk, r1 = min(r0 + rows_per_chunk, rows);
    float acc = 0.0f;
    for (i64 r = r0; r < r1; ++r) acc += to_f(dy[r * d + j]) * to_f(x[r * d + j]) * inv_rms[r];
    partial[(i64)blockIdx.x * d + j] = acc;
}
template <typename T>
static __device__ void rmsnorm_bwd_dw_finish_impl(const float* partial, T* dw, i64 nchunks, i64 d) {
    FOR_EACH(j, d) {
        float acc = 0.0f;
        for (i64 c = 0; c < nchunks; ++c) acc += partial[c * d + j];
        dw[j] = from_f<T>(acc);
    }
}
extern "C" __global__ void rmsnorm_fwd_f32(const float* x, const float* w, float* y, float* r, i64 rows, i64 d, float eps) { rmsnorm_fwd_impl(x, w, y, r, rows, d, eps); }
extern "C" __global__ void rmsnorm_fwd_bf16(const bf16* x, const bf16* w, bf16* y, float* r, i64 rows, i64 d, float eps) { rmsnorm_fwd_impl(x, w, y, r, rows, d, eps); }
extern "C" __global__ void rmsnorm_bwd_dx_f32(const float* dy, const float* x, const float* w, const float* r, float* dx, i64 rows, i64 d) { rmsnorm_bwd_dx_impl(dy, x, w, r, dx, rows, d); }
extern "C" __global__ void rmsnorm_bwd_dx_bf16(const bf16* dy, const bf16* x, const bf16* w, const float* r, bf16* dx, i64 rows, i64 d) { rmsnorm_bwd_dx_impl(dy, x, w, r, dx, rows, d); }
extern "C" __global__ void rmsnorm_bwd_dw_partial_f32(const float* dy, const float* x, const float* r, float* p, i64 rows, i64 d, i64 rpc) { rmsnorm_bwd_dw_partial_impl(dy, x, r, p, rows, d, rpc); }
extern "C" __global__ void rmsnorm_bwd_dw_partial_bf16(const bf16* dy, const bf16* x, const float* r, float* p, i64 rows, i64 d, i64 rpc) { rmsnorm_bwd_dw_partial_impl(dy, x, r, p, rows, d, rpc); }
extern "C" __global__ void rmsnorm_bwd_dw_finish_f32(const float* p, float* dw, i64 nchunks, i64 d) { rmsnorm_bwd_dw_finish_impl(p, dw, nchunks, d); }
extern "C" __global__ void rmsnorm_bwd_dw_finish_bf16(const float* p, bf16* dw, i64 nchunks, i64 d) { rmsnorm_bwd_dw_finish_impl(p, dw, nchunks, d); }
