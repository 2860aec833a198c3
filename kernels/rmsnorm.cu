// rmsnorm.cu — RMSNorm forward and backward. Forward (one warp per row): inv_rms = 1 /
// sqrt(mean(x^2) + eps) saved in f32, y = x * inv_rms * (off + w), where `off` is 0 (LLaMA) or
// 1 (Gemma's (1 + w), all in f32 and rounded once). With w' = off + w, backward: dx per row (one
// warp per row) = acc + r * (dy*w' - x * r^2 * mean(dy*w'*x)), where acc (optional) is the gradient x has
// from elsewhere (the residual stream's), added before the one rounding so the sum needs no
// kernel of its own; dw = sum over rows of dy * x * r, reduced
// deterministically in two passes: each block of the first pass owns a contiguous range of
// rows and writes a partial (nchunks, d) in row order, the second pass sums the partials in
// chunk order. No atomics anywhere. Many narrow rows (QK-norm: B*T*H rows of the head dim) give
// many chunks: the second pass then folds them in levels, `group` chunks a block row, so no
// thread sums more than a few dozen partials and no level leaves the work to one block.
#include "common.cuh"

// V elements of a row from p (V = 1, or a 16-byte vector of Vec<T>::N: LDG.E.128), and back.
template <typename T, int V>
static __device__ __forceinline__ void row_load(const T* p, float* f) {
    if constexpr (V == 1) f[0] = to_f(*p);
    else Vec<T>::load(ld16(reinterpret_cast<const vec16*>(p)), f);
}
template <typename T, int V>
static __device__ __forceinline__ void row_store(T* p, const float* f) {
    if constexpr (V == 1) *p = from_f<T>(f[0]);
    else *reinterpret_cast<vec16*>(p) = Vec<T>::store(f);
}
// A warp per row (blockDim.x / 32 rows a block, grid-stride), lane l taking elements
// [V l, V l + V) of every 32 V: rows of 768 to 8192 keep every lane busy, and the row's sums
// are warp reductions (no barrier). V = Vec<T>::N when d is whole vectors and every pointer is
// 16-byte aligned (the launcher's `vec`), else 1.
#define RMS_ROWS(r)                                                                                  \
    for (i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * (blockDim.x >> 5))
#define RMS_COLS(j) for (i64 j = (i64)(threadIdx.x & 31) * V; j < d; j += 32 * V)

// Floor: 2 rows * d elements of T (read x, write y; w stays in cache).
template <typename T, int V>
static __device__ void rmsnorm_fwd_impl(const T* x, const T* w, T* y, float* inv_rms, i64 rows, i64 d, float eps, float off) {
    RMS_ROWS(r) {
        const T* xr = x + r * d;
        float ss = 0.0f;
        RMS_COLS(j) {
            float f[V];
            row_load<T, V>(xr + j, f);
#pragma unroll
            for (int k = 0; k < V; ++k) ss += f[k] * f[k];
        }
        ss = warp_sum(ss);
        float rr = 1.0f / sqrtf(ss / (float)d + eps);
        if ((threadIdx.x & 31) == 0) inv_rms[r] = rr;
        RMS_COLS(j) {
            float f[V], fw[V];
            row_load<T, V>(xr + j, f);
            row_load<T, V>(w + j, fw);
#pragma unroll
            for (int k = 0; k < V; ++k) f[k] = f[k] * rr * (off + fw[k]);
            row_store<T, V>(y + r * d + j, f);
        }
    }
}
// dy, w and x at columns [j, j + V) of row r.
template <typename T, int V>
static __device__ __forceinline__ void bwd_load(const T* dy, const T* w, const T* x, i64 r, i64 d, i64 j, float* fd, float* fw, float* fx,
                                                float off) {
    row_load<T, V>(dy + r * d + j, fd);
    row_load<T, V>(w + j, fw);
#pragma unroll
    for (int k = 0; k < V; ++k) fw[k] += off;
    row_load<T, V>(x + r * d + j, fx);
}
// Floor: 3 rows * d elements of T (read dy, x; write dx), 4 with acc.
template <typename T, int V>
static __device__ void rmsnorm_bwd_dx_impl(const T* dy, const T* x, const T* w, const float* inv_rms, const T* acc, T* dx, i64 rows,
                                           i64 d, float off) {
    RMS_ROWS(r) {
        float rr = inv_rms[r];
        float gx = 0.0f;
        RMS_COLS(j) {
            float fd[V], fw[V], fx[V];
            bwd_load<T, V>(dy, w, x, r, d, j, fd, fw, fx, off);
#pragma unroll
            for (int k = 0; k < V; ++k) gx += fd[k] * fw[k] * fx[k];
        }
        gx = warp_sum(gx) / (float)d;
        RMS_COLS(j) {
            float fd[V], fw[V], fx[V];
            bwd_load<T, V>(dy, w, x, r, d, j, fd, fw, fx, off);
#pragma unroll
            for (int k = 0; k < V; ++k) fd[k] = rr * (fd[k] * fw[k] - fx[k] * rr * rr * gx);
            if (acc) {
                float fa[V];
                row_load<T, V>(acc + r * d + j, fa);
#pragma unroll
                for (int k = 0; k < V; ++k) fd[k] = fa[k] + fd[k];
            }
            row_store<T, V>(dx + r * d + j, fd);
        }
    }
}
// Floor: 2 rows * d elements of T (read dy, x), plus the partials (nchunks * d f32).
// grid: (nchunks, ceil(d / (V blockDim.x))); chunk c owns rows [c*rows_per_chunk, ...), a thread
// columns [V t, V t + V): 16-byte loads of dy and x where the launcher's `vec` allows (d whole
// vectors, pointers aligned), V f32 partials stored together; four rows' loads in flight. Each
// column sums its chunk's rows in row order.
template <typename T, int V>
static __device__ void rmsnorm_bwd_dw_partial_impl(const T* dy, const T* x, const float* inv_rms, float* partial, i64 rows, i64 d, i64 rows_per_chunk) {
    i64 j = ((i64)blockIdx.y * blockDim.x + threadIdx.x) * V;
    if (j >= d) return;
    i64 r0 = (i64)blockIdx.x * rows_per_chunk, r1 = min(r0 + rows_per_chunk, rows);
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.0f;
#pragma unroll 4
    for (i64 r = r0; r < r1; ++r) {
        float fd[V], fx[V];
        row_load<T, V>(dy + r * d + j, fd);
        row_load<T, V>(x + r * d + j, fx);
        float rr = inv_rms[r];
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += fd[k] * fx[k] * rr;
    }
    store_column_partials<V>(partial, d, j, acc);
}
#define RMSNORM_ROW_KERNELS(suffix, T)                                                                                                \
    extern "C" __global__ void rmsnorm_fwd_##suffix(const T* x, const T* w, T* y, float* r, i64 rows, i64 d, float eps, float off,      \
                                                    int vec) {                                                                        \
        if (vec) rmsnorm_fwd_impl<T, Vec<T>::N>(x, w, y, r, rows, d, eps, off);                                                       \
        else rmsnorm_fwd_impl<T, 1>(x, w, y, r, rows, d, eps, off);                                                                   \
    }                                                                                                                                 \
    extern "C" __global__ void rmsnorm_bwd_dx_##suffix(const T* dy, const T* x, const T* w, const float* r, const T* acc, T* dx,       \
                                                       i64 rows, i64 d, float off, int vec) {                                         \
        if (vec) rmsnorm_bwd_dx_impl<T, Vec<T>::N>(dy, x, w, r, acc, dx, rows, d, off);                                               \
        else rmsnorm_bwd_dx_impl<T, 1>(dy, x, w, r, acc, dx, rows, d, off);                                                           \
    }
RMSNORM_ROW_KERNELS(f32, float)
RMSNORM_ROW_KERNELS(bf16, bf16)
#define RMSNORM_DW_PARTIAL(suffix, T)                                                                                                 \
    extern "C" __global__ void rmsnorm_bwd_dw_partial_##suffix(const T* dy, const T* x, const float* r, float* p, i64 rows, i64 d, i64 rpc, \
                                                               int vec) {                                                             \
        if (vec) rmsnorm_bwd_dw_partial_impl<T, Vec<T>::N>(dy, x, r, p, rows, d, rpc);                                                \
        else rmsnorm_bwd_dw_partial_impl<T, 1>(dy, x, r, p, rows, d, rpc);                                                            \
    }
RMSNORM_DW_PARTIAL(f32, float)
RMSNORM_DW_PARTIAL(bf16, bf16)
extern "C" __global__ void rmsnorm_bwd_dw_finish_f32(const float* p, float* dw, i64 nchunks, i64 d, i64 group) {
    column_chunks_finish(p, dw, nchunks, d, group);
}
extern "C" __global__ void rmsnorm_bwd_dw_finish_bf16(const float* p, bf16* dw, i64 nchunks, i64 d, i64 group) {
    column_chunks_finish(p, dw, nchunks, d, group);
}
