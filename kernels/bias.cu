// bias.cu — a linear layer's bias (Qwen2's q/k/v projections): y = x + b with b (d) broadcast
// over the rows of x (rows, d), and the bias gradient db = sum over rows of dy (dx is dy itself:
// no kernel). db is reduced deterministically in two passes, as RMSNorm's dw: each block of the
// first pass owns a contiguous chunk of rows and a range of columns and writes the chunk's f32
// partial (nchunks, d) in row order; the second pass sums the partials in chunk order, in levels
// of `group` chunks a block row while there are many (narrow k/v biases over many tokens), so
// no thread sums more than a few dozen partials and no level gives the work to one block. No
// atomics.
// Floors: forward 2 rows * d elements of T (read x, write y; b stays in cache), 1 FLOP each;
// db: rows * d elements of T read, plus the partials (nchunks * d f32, a few percent).
#include "common.cuh"

// Elements of a row: 16-byte vectors (Vec<T>::N elements, LDG.E.128) when `vec` (d whole vectors
// and every pointer aligned: the launcher checks), else one at a time.
template <typename T>
static __device__ void bias_fwd_impl(const T* x, const T* b, T* y, i64 rows, i64 d, int vec) {
    const int N = Vec<T>::N;
    if (vec) {
        i64 dv = d / N, nv = rows * dv;
        const vec16 *xv = reinterpret_cast<const vec16*>(x), *bv = reinterpret_cast<const vec16*>(b);
        vec16* yv = reinterpret_cast<vec16*>(y);
        FOR_EACH(i, nv) {
            float fx[N], fb[N];
            Vec<T>::load(ld16(xv + i), fx);
            Vec<T>::load(ld16(bv + i % dv), fb);
#pragma unroll
            for (int k = 0; k < N; ++k) fx[k] += fb[k];
            yv[i] = Vec<T>::store(fx);
        }
    } else {
        FOR_EACH(i, rows * d) y[i] = from_f<T>(to_f(x[i]) + to_f(b[i % d]));
    }
}
// grid: (nchunks, ceil(d / (V blockDim.x))); chunk c owns rows [c * rows_per_chunk, ...), a
// thread columns [V t, V t + V) (16-byte loads of dy where `vec`), V f32 partials stored
// together; four rows' loads in flight. Each column sums its chunk's rows in row order.
template <typename T, int V>
static __device__ void bias_bwd_partial_impl(const T* dy, float* partial, i64 rows, i64 d, i64 rows_per_chunk) {
    i64 j = ((i64)blockIdx.y * blockDim.x + threadIdx.x) * V;
    if (j >= d) return;
    i64 r0 = (i64)blockIdx.x * rows_per_chunk, r1 = min(r0 + rows_per_chunk, rows);
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.0f;
#pragma unroll 4
    for (i64 r = r0; r < r1; ++r) {
        float f[V];
        if constexpr (V == 1) f[0] = to_f(dy[r * d + j]);
        else Vec<T>::load(ld16(reinterpret_cast<const vec16*>(dy + r * d + j)), f);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += f[k];
    }
    store_column_partials<V>(partial, d, j, acc);
}
#define BIAS_KERNELS(suffix, T)                                                                                           \
    extern "C" __global__ void bias_fwd_##suffix(const T* x, const T* b, T* y, i64 rows, i64 d, int vec) {                  \
        bias_fwd_impl(x, b, y, rows, d, vec);                                                                             \
    }                                                                                                                     \
    extern "C" __global__ void bias_bwd_partial_##suffix(const T* dy, float* p, i64 rows, i64 d, i64 rpc, int vec) {        \
        if (vec) bias_bwd_partial_impl<T, Vec<T>::N>(dy, p, rows, d, rpc);                                                \
        else bias_bwd_partial_impl<T, 1>(dy, p, rows, d, rpc);                                                            \
    }                                                                                                                     \
    extern "C" __global__ void bias_bwd_finish_##suffix(const float* p, T* out, i64 nchunks, i64 d, i64 group) {            \
        column_chunks_finish(p, out, nchunks, d, group);                                                                  \
    }
BIAS_KERNELS(f32, float)
BIAS_KERNELS(bf16, bf16)
