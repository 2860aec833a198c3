// ce_row.cuh — one row of logits walked by one block, for the cross-entropy kernels
// (cross_entropy.cu) and the fused head's (head_loss.cu): its (max, sum of exp(x - max)) in one
// online pass, and an element-wise map over it (the gradient, in place or into another buffer).
// Both read and write 16-byte vectors (LDG.E.128 / STG.E.128: 4 f32 or 8 bf16) from the row's
// first 16-byte boundary, and the unaligned head and the tail one element each, so any row length
// and offset works: a row of v bf16 starts aligned only when 8 divides v (32000 and 128256 do).
// Thread k takes vectors k, k + blockDim, ..., then its head and tail elements: a fixed order, so
// the same row gives the same bits every run.
#pragma once
#include "common.cuh"

// Elements [0, head) and [head + nv N, v) of a row go one at a time, [head, head + nv N) as nv
// vectors of N = Vec<T>::N. A row read from x and written to y takes vectors only where x and y
// are equally misaligned (in place, always), else is all head.
template <typename T>
struct RowSplit {
    i64 head, nv;
    __device__ __forceinline__ RowSplit(const T* x, const T* y, i64 v) {
        unsigned long long a = (unsigned long long)x;
        i64 skew = (i64)((16 - (a & 15)) & 15) / (i64)sizeof(T);
        head = ((a ^ (unsigned long long)y) & 15) != 0 || skew > v ? v : skew;
        nv = (v - head) / Vec<T>::N;
    }
    __device__ __forceinline__ i64 tail() const { return head + nv * Vec<T>::N; }
};

// A thread's running max m and sum s of exp(x - m) over the elements it has seen.
struct OnlineLse {
    float m = -INFINITY, s = 0.0f;
    __device__ __forceinline__ void add(float x) {
        if (x > m) {
            s = s * expf(m - x) + 1.0f;
            m = x;
        } else {
            s += expf(x - m);
        }
    }
    // N elements at once: one rescale of s when their max is a new one, then N exponentials.
    template <int N>
    __device__ __forceinline__ void add_vec(const float* f) {
        float vm = f[0];
#pragma unroll
        for (int k = 1; k < N; ++k) vm = fmaxf(vm, f[k]);
        if (vm > m) {
            s *= expf(m - vm);
            m = vm;
        }
#pragma unroll
        for (int k = 0; k < N; ++k) s += expf(f[k] - m);
    }
};

// The max of row xr (v elements) and the sum of exp(x - max) over it, to every thread of the
// block: each thread's online pair, then the block's max and its threads' sums rescaled to it
// (block trees, a fixed order). `scratch`: 32 floats of shared memory.
template <typename T>
static __device__ __forceinline__ void row_max_sumexp(const T* xr, i64 v, float* scratch, float& max, float& sum) {
    constexpr int N = Vec<T>::N;
    RowSplit<T> sp(xr, xr, v);
    OnlineLse a;
    const vec16* xv = reinterpret_cast<const vec16*>(xr + sp.head);
    for (i64 k = threadIdx.x; k < sp.nv; k += blockDim.x) {
        float f[N];
        Vec<T>::load(ld16(xv + k), f);
        a.add_vec<N>(f);
    }
    for (i64 j = threadIdx.x; j < sp.head; j += blockDim.x) a.add(to_f(xr[j]));
    for (i64 j = sp.tail() + threadIdx.x; j < v; j += blockDim.x) a.add(to_f(xr[j]));
    max = block_max(a.m, scratch);
    sum = block_sum(a.m == -INFINITY ? 0.0f : a.s * expf(a.m - max), scratch);
}

// log-sum-exp of row xr (length v), to every thread of the block.
template <typename T>
static __device__ __forceinline__ float row_lse(const T* xr, i64 v, float* scratch) {
    float m, s;
    row_max_sumexp(xr, v, scratch, m, s);
    return m + logf(s);
}

// yr[j] = g(j, xr[j]) over a row of v elements, computed in f32 and rounded once. yr may be xr:
// each element is read by the thread that writes it, before it writes it.
template <typename T, typename G>
static __device__ __forceinline__ void row_map(const T* xr, T* yr, i64 v, G g) {
    constexpr int N = Vec<T>::N;
    RowSplit<T> sp(xr, yr, v);
    const vec16* xv = reinterpret_cast<const vec16*>(xr + sp.head);
    vec16* yv = reinterpret_cast<vec16*>(yr + sp.head);
    for (i64 k = threadIdx.x; k < sp.nv; k += blockDim.x) {
        float f[N];
        Vec<T>::load(ld16(xv + k), f);
        i64 j0 = sp.head + k * N;
#pragma unroll
        for (int i = 0; i < N; ++i) f[i] = g(j0 + i, f[i]);
        st16(yv + k, Vec<T>::store(f));
    }
    for (i64 j = threadIdx.x; j < sp.head; j += blockDim.x) yr[j] = from_f<T>(g(j, to_f(xr[j])));
    for (i64 j = sp.tail() + threadIdx.x; j < v; j += blockDim.x) yr[j] = from_f<T>(g(j, to_f(xr[j])));
}
