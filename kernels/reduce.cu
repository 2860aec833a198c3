// reduce.cu — sum / max over an arbitrary set of dimensions. The launcher splits the input
// view into two strided descriptors: `kept` (the output's dims, with the input's strides and
// the view offset) and `red` (the reduced dims, offset 0), and picks one of two layouts:
//   rows: a block owns (output o, split s) and walks split s of o's reduced range with its
//         threads side by side (coalesced when the reduced dims are the inner ones);
//   cols: a thread owns (output o, chunk c) and walks chunk c of o's reduced range alone
//         (coalesced when the kept dims are the inner ones: a sum over dim 0 of (R, C)).
// With one split / chunk the kernel writes the outputs; otherwise it writes per-block f64
// partials (maxima too: an f32 is exact in f64) and `reduce_finish_*` combines each output's
// partials in a fixed order. Every order is fixed by the launch shape, never by timing: results
// are bitwise deterministic run to run. Sums accumulate in f64 whatever the storage dtype.
// Floors: n * sizeof(T) bytes read (the partials are a few KB).
#include "common.cuh"

template <typename T>
static __device__ __forceinline__ float red_load(const T* x, i64 base, const Strided& red, i64 r) {
    return to_f(x[base + strided_index(red, r)]);
}

// The two reductions as accumulators: the max in f32 (exact), the sum in f64.
struct MaxAcc {
    float v = -INFINITY;
    __device__ __forceinline__ void add(float x) { v = fmaxf(v, x); }
};
struct SumAcc {
    double v = 0.0;
    __device__ __forceinline__ void add(float x) { v += (double)x; }
};

// A thread's share of a row's range [lo, hi), its elements blockDim.x apart: from [vlo, vhi) in
// 16-byte vectors (dense and aligned; empty otherwise), then the head and the tail one each.
template <typename Acc, typename T>
static __device__ __forceinline__ Acc row_share(const T* x, i64 base, const Strided& red, i64 lo, i64 hi, i64 vlo, i64 vhi) {
    Acc acc;
    constexpr int N = Vec<T>::N;
    if (vlo < vhi) {
        const vec16* v = reinterpret_cast<const vec16*>(x + base + vlo);
        for (i64 j = threadIdx.x; j < (vhi - vlo) / N; j += blockDim.x) {
            float f[N];
            Vec<T>::load(ld16(v + j), f);
#pragma unroll
            for (int k = 0; k < N; ++k) acc.add(f[k]);
        }
        for (i64 i = lo + threadIdx.x; i < vlo; i += blockDim.x) acc.add(to_f(x[base + i]));
        for (i64 i = vhi + threadIdx.x; i < hi; i += blockDim.x) acc.add(to_f(x[base + i]));
    } else {
#pragma unroll 4
        for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) acc.add(red_load(x, base, red, i));
    }
    return acc;
}

// A thread's whole range [lo, hi) of one output, in order (the cols layout).
template <typename Acc, typename T>
static __device__ __forceinline__ Acc col_share(const T* x, i64 base, const Strided& red, i64 lo, i64 hi) {
    Acc acc;
#pragma unroll 4
    for (i64 i = lo; i < hi; ++i) acc.add(red_load(x, base, red, i));
    return acc;
}

template <typename T>
static __device__ void reduce_rows_impl(const T* x, Strided kept, Strided red, double* part, T* y, i64 nout, i64 nred, i64 chunk,
                                        int splits, int is_max) {
    __shared__ float scratch[32];
    __shared__ double scratch64[1024];
    for (i64 blk = blockIdx.x; blk < nout * splits; blk += gridDim.x) {
        i64 o = blk / splits;
        int s = (int)(blk - o * splits);
        i64 base = strided_index(kept, o);
        i64 lo = (i64)s * chunk, hi = min(nred, lo + chunk);
        double r;
        // A dense reduced range (the inner dims of a row-major view) is read directly, in 16-byte
        // vectors from the first aligned element: thread k takes vectors k, k + blockDim, ...
        // then the unaligned head and the tail one element each. A fixed order either way.
        const bool dense = red.rank == 1 && red.stride[0] == 1;
        constexpr int N = Vec<T>::N;
        i64 vlo = hi, vhi = hi;
        if (dense) {
            const T* p = x + base;
            i64 skew = (i64)((16 - ((unsigned long long)(p + lo) & 15)) & 15) / (i64)sizeof(T);
            if (((unsigned long long)(p + lo) & (sizeof(T) - 1)) == 0 && lo + skew <= hi) {
                vlo = lo + skew;
                vhi = vlo + (hi - vlo) / N * N;
            }
        }
        if (is_max) r = (double)block_max(row_share<MaxAcc>(x, base, red, lo, hi, vlo, vhi).v, scratch);
        else r = block_sum_f64(row_share<SumAcc>(x, base, red, lo, hi, vlo, vhi).v, scratch64);
        if (threadIdx.x == 0) {
            if (splits == 1) y[o] = from_f<T>((float)r);
            else part[o * splits + s] = r;
        }
    }
}

template <typename T>
static __device__ void reduce_cols_impl(const T* x, Strided kept, Strided red, double* part, T* y, i64 nout, i64 nred, i64 chunk,
                                        int chunks, int is_max) {
    i64 tiles = (nout + blockDim.x - 1) / blockDim.x;
    for (i64 blk = blockIdx.x; blk < tiles * chunks; blk += gridDim.x) {
        i64 c = blk / tiles;
        i64 o = (blk - c * tiles) * blockDim.x + threadIdx.x;
        if (o >= nout) continue;
        i64 base = strided_index(kept, o);
        i64 lo = c * chunk, hi = min(nred, lo + chunk);
        double r = is_max ? (double)col_share<MaxAcc>(x, base, red, lo, hi).v : col_share<SumAcc>(x, base, red, lo, hi).v;
        if (chunks == 1) y[o] = from_f<T>((float)r);
        else part[c * nout + o] = r;
    }
}

// Output o of the rows layout from part[o * splits + s], s = 0..splits: a block per output, a
// fixed tree. Of the cols layout (part[s * nout + o]): a thread per output, in order of s.
template <typename T>
static __device__ void reduce_finish_impl(const double* part, T* y, i64 nout, int splits, int cols, int is_max) {
    __shared__ double scratch64[1024];
    if (cols) {
        FOR_EACH(o, nout) {
            double acc = is_max ? -INFINITY : 0.0;
            for (int s = 0; s < splits; ++s) acc = is_max ? fmax(acc, part[(i64)s * nout + o]) : acc + part[(i64)s * nout + o];
            y[o] = from_f<T>((float)acc);
        }
        return;
    }
    for (i64 o = blockIdx.x; o < nout; o += gridDim.x) {
        double acc = is_max ? -INFINITY : 0.0;
        for (int s = threadIdx.x; s < splits; s += blockDim.x) acc = is_max ? fmax(acc, part[o * splits + s]) : acc + part[o * splits + s];
        if (is_max) {
            __syncthreads();
            scratch64[threadIdx.x] = acc;
            __syncthreads();
            for (int n = blockDim.x; n > 1;) {
                int half = (n + 1) >> 1;
                if ((int)threadIdx.x < n - half) scratch64[threadIdx.x] = fmax(scratch64[threadIdx.x], scratch64[threadIdx.x + half]);
                __syncthreads();
                n = half;
            }
            acc = scratch64[0];
            __syncthreads();
        } else {
            acc = block_sum_f64(acc, scratch64);
        }
        if (threadIdx.x == 0) y[o] = from_f<T>((float)acc);
    }
}

// `red.offset` must be 0 (the view offset lives in `kept`). `parts`: the splits (rows) or chunks
// (cols) each output is cut into; `part` holds nout * parts doubles (unused, may be null, when
// parts == 1).
#define REDUCE_KERNEL(name, impl, T)                                                                                              \
    extern "C" __global__ void name(const T* x, Strided kept, Strided red, double* part, T* y, i64 nout, i64 nred, i64 chunk, \
                                    int parts, int is_max) {                                                                  \
        impl(x, kept, red, part, y, nout, nred, chunk, parts, is_max);                                                        \
    }
REDUCE_KERNEL(reduce_rows_f32, reduce_rows_impl, float)
REDUCE_KERNEL(reduce_rows_bf16, reduce_rows_impl, bf16)
REDUCE_KERNEL(reduce_cols_f32, reduce_cols_impl, float)
REDUCE_KERNEL(reduce_cols_bf16, reduce_cols_impl, bf16)
extern "C" __global__ void reduce_finish_f32(const double* part, float* y, i64 nout, int splits, int cols, int is_max) {
    reduce_finish_impl(part, y, nout, splits, cols, is_max);
}
extern "C" __global__ void reduce_finish_bf16(const double* part, bf16* y, i64 nout, int splits, int cols, int is_max) {
    reduce_finish_impl(part, y, nout, splits, cols, is_max);
}
