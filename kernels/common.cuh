// common.cuh — shared device helpers for every ferrolm kernel: bf16 <-> f32 conversion (all
// arithmetic is done in fp32 and rounded once on store), the strided-layout descriptor that
// lets element-wise kernels read broadcast / permuted views without a copy, and deterministic
// warp / block reductions (fixed shuffle trees, so the same input always gives the same bits).
// It is included by every kernels/*.cu; build.rs compiles them as one translation unit (nvcc)
// or concatenates them for NVRTC, so everything here is `static` / `inline` and nothing here
// may include a host standard-library header (NVRTC has none).
#pragma once
#include "constants.cuh"  // shared with the Rust launchers (ferrolm_cuda::consts)
#if defined(FERRO_EMU)
#include "ferro_emu.h"  // CPU emulation for tests without a GPU (crates/cuda/emu)
#endif
// NVRTC has no <cuda_bf16.h> without the toolkit's include directory; nor has the emulator.
// (Included once, outside the branches: the NVRTC loader inlines local includes textually.)
#if defined(FERRO_EMU) || defined(FERRO_NVRTC)
#include "bf16.cuh"
#else
#include <cuda_bf16.h>
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC: no <math.h>
#endif

typedef __nv_bfloat16 bf16;
typedef long long i64;


// ---- conversions -----------------------------------------------------------------------------
static __device__ __forceinline__ float to_f(float x) { return x; }
static __device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float to_f(int x) { return (float)x; }
template <typename T> static __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ int from_f<int>(float x) { return (int)x; }  // truncation, as Rust `as i32`

// Two floats -> one 32-bit register of two bf16 (lo at the lower address), for mma fragments.
static __device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// ---- strided layouts -------------------------------------------------------------------------
// Element `idx` (row-major over `shape`) of a view lives at `offset + sum(idx[i] * stride[i])`.
// Passed by value as a kernel parameter; the Rust side mirrors it with #[repr(C)].
struct Strided {
    i64 shape[FERRO_MAX_RANK];
    i64 stride[FERRO_MAX_RANK];
    i64 offset;
    int rank;
    int contiguous;  // 1: element i is at offset + i (the launchers then also set rank 1, stride 1)
};

// The loops run over the compile-time FERRO_MAX_RANK with `if (d < rank)`, so every shape and
// stride is read at a constant index: nvcc keeps a by-value parameter in the constant bank
// instead of copying it to local memory (a runtime index into it costs LDL/STL per thread).
template <typename I>
static __device__ __forceinline__ I strided_index_t(const Strided& l, I i) {
    I off = (I)l.offset;
    if (l.rank == 1) return off + i * (I)l.stride[0];  // the common strided run: no division
#pragma unroll
    for (int d = FERRO_MAX_RANK - 1; d >= 0; --d) {
        if (d < l.rank) {
            I s = (I)l.shape[d];
            I q = i / s;
            off += (i - q * s) * (I)l.stride[d];
            i = q;
        }
    }
    return off;
}
static __device__ __forceinline__ i64 strided_index(const Strided& l, i64 i) {
    if (l.contiguous) return l.offset + i;
    return strided_index_t<i64>(l, i);
}
// True when every index of the view (offset + sum((shape - 1) * stride)) and `n` fit in 32 bits,
// so the kernel may walk it with unsigned 32-bit math (64-bit division is many instructions).
static __device__ __forceinline__ bool strided_fits32(const Strided& l, i64 n) {
    i64 hi = l.offset;
#pragma unroll
    for (int d = 0; d < FERRO_MAX_RANK; ++d)
        if (d < l.rank) hi += (l.shape[d] - 1) * l.stride[d];
    return n < 0x7fffffffLL && hi < 0x7fffffffLL;
}

// ---- 16-byte vectors (contiguous fast paths) ---------------------------------------------------
// One 16-byte access: 4 f32 or 8 bf16. Loads and stores of it compile to LDG.E.128 / STG.E.128
// when the address is 16-byte aligned, which the launchers check before choosing these paths.
struct __align__(16) vec16 {
    unsigned w[4];
};
// One 16-byte load (nvcc splits a struct copy into four 4-byte loads; uint4 is one LDG.E.128).
static __device__ __forceinline__ vec16 ld16(const vec16* p) {
#ifdef FERRO_EMU
    ferro_emu::check_aligned(p, 16, "16-byte load");
    return *p;
#else
    uint4 u = *reinterpret_cast<const uint4*>(p);
    vec16 v;
    v.w[0] = u.x, v.w[1] = u.y, v.w[2] = u.z, v.w[3] = u.w;
    return v;
#endif
}
// One 16-byte store (STG.E.128); the emulator checks the alignment as for loads.
static __device__ __forceinline__ void st16(vec16* p, const vec16& v) {
#ifdef FERRO_EMU
    ferro_emu::check_aligned(p, 16, "16-byte store");
#endif
    *p = v;
}
static __device__ __forceinline__ unsigned bf_bits(float f) { return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(f)); }
// A vector of T as N floats and back (bf16: element 2k is the low half of word k).
template <typename T> struct Vec;
template <> struct Vec<float> {
    enum { N = 4 };
    static __device__ __forceinline__ void load(const vec16& v, float* f) {
#pragma unroll
        for (int k = 0; k < 4; ++k) f[k] = __uint_as_float(v.w[k]);
    }
    static __device__ __forceinline__ vec16 store(const float* f) {
        vec16 v;
#pragma unroll
        for (int k = 0; k < 4; ++k) v.w[k] = __float_as_uint(f[k]);
        return v;
    }
};
template <> struct Vec<bf16> {
    enum { N = 8 };
    static __device__ __forceinline__ void load(const vec16& v, float* f) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            f[2 * k] = __uint_as_float(v.w[k] << 16);
            f[2 * k + 1] = __uint_as_float(v.w[k] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ vec16 store(const float* f) {
        vec16 v;
#pragma unroll
        for (int k = 0; k < 4; ++k) v.w[k] = bf_bits(f[2 * k]) | (bf_bits(f[2 * k + 1]) << 16);
        return v;
    }
};

// The block's dynamic shared memory (size set at launch), as `unsigned char* name`.
#ifdef FERRO_EMU
#define DYNAMIC_SMEM(name) unsigned char* name = ferro_emu::dynamic_smem()
#else
#define DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// ---- feeding the tensor cores (sm_80+): ldmatrix and cp.async -----------------------------------
// ldsm<N, TRANS>(r, row): ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16. A warp collective: each
// lane passes the shared-memory address of one 16-byte row (lanes 8i..8i+7: the rows of matrix i)
// and gets, in r[i], its two bf16 of matrix i in the mma fragment layout.
template <int N, bool TRANS>
static __device__ __forceinline__ void ldsm(unsigned* r, const void* row) {
#ifdef FERRO_EMU
    ferro_emu::ldmatrix(r, N, TRANS, row);
#else
    unsigned a = (unsigned)__cvta_generic_to_shared(row);
    if constexpr (N == 4 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else if constexpr (N == 4 && TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else if constexpr (N == 2 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    else if constexpr (N == 2 && TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    else if constexpr (N == 1 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
#endif
}
// cp_async<16>(dst, src, valid): 16 bytes global -> shared without a register round trip
// (cp.async.cg, L2 only), or 16 zero bytes when !valid (src is then not read but must be a
// mapped address). cp_async<4> is the 4-byte form (cp.async.ca: .cg takes only 16). Copies
// become visible to the issuing thread after a cp_async_wait that covers their group, and to
// other threads after a __syncthreads that follows it.
template <int BYTES>
static __device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
    static_assert(BYTES == 16 || BYTES == 4, "cp.async copies 4 or 16 bytes here");
    int n = valid ? BYTES : 0;
#ifdef FERRO_EMU
    ferro_emu::cp_async(dst, src, BYTES, n);
#else
    unsigned a = (unsigned)__cvta_generic_to_shared(dst);
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src), "r"(n));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(a), "l"(src), "r"(n));
#endif
}
// Closes the group of this thread's cp.async issued since the last commit.
static __device__ __forceinline__ void cp_async_commit() {
#ifdef FERRO_EMU
    ferro_emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
static __device__ __forceinline__ void cp_async_wait() {
#ifdef FERRO_EMU
    ferro_emu::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Grid-stride loop over n elements.
#define FOR_EACH(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)
// After a vector loop over nv vectors of N elements: the tail (elements nv N .. n) is done by the
// first threads of the grid, one element each.
#define FOR_TAIL(i, nv, N, n) for (i64 i = (nv) * (N) + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// ---- reductions (deterministic: fixed trees) --------------------------------------------------
static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide reductions; every thread gets the result. blockDim.x must be a multiple of 32
// (<= 1024). `scratch` is 32 floats of shared memory; safe to call repeatedly.
template <float (*warp_reduce)(float)>
static __device__ __forceinline__ float block_reduce(float v, float* scratch, float identity) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_reduce(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : identity;
    return warp_reduce(v);
}
static __device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce<warp_sum>(v, scratch, 0.0f); }

// Column sums of a (rows, d) gradient in two fixed-order passes (rmsnorm's dw, the bias's db):
// a partial pass leaves one f32 row per chunk of rows, then finish passes sum the chunks.
// A partial pass's thread stores its V column sums of chunk blockIdx.x together.
template <int V>
static __device__ __forceinline__ void store_column_partials(float* partial, i64 d, i64 j, const float* acc) {
    float* out = partial + (i64)blockIdx.x * d + j;
    if constexpr (V == 1) out[0] = acc[0];
    else {
#pragma unroll
        for (int k = 0; k < V; k += 4) *reinterpret_cast<vec16*>(out + k) = Vec<float>::store(acc + k);
    }
}
// grid: (ceil(nchunks / group), ceil(d / blockDim.x)); block row g sums chunks
// [g * group, (g + 1) * group) of each column in chunk order into row g of `out`: the last level
// (group >= nchunks, one block row) writes the gradient itself, an earlier one f32 partials of
// the next.
template <typename T>
static __device__ void column_chunks_finish(const float* partial, T* out, i64 nchunks, i64 d, i64 group) {
    i64 j = (i64)blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= d) return;
    i64 c0 = (i64)blockIdx.x * group, c1 = min(c0 + group, nchunks);
    float acc = 0.0f;
#pragma unroll 4
    for (i64 c = c0; c < c1; ++c) acc += partial[c * d + j];
    out[(i64)blockIdx.x * d + j] = from_f<T>(acc);
}
// Block-wide sum in f64 (every thread gets the result), for sums over many elements whose f32
// partials would lose digits (the gradient norm, a loss over millions of rows, counts past 2^24).
// A fixed tree through shared memory: deterministic. `scratch` is blockDim.x doubles of shared
// memory; safe to call repeatedly.
static __device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    __syncthreads();
    scratch[threadIdx.x] = v;
    __syncthreads();
    for (int n = blockDim.x; n > 1;) {
        int half = (n + 1) >> 1;
        if ((int)threadIdx.x < n - half) scratch[threadIdx.x] += scratch[threadIdx.x + half];
        __syncthreads();
        n = half;
    }
    double r = scratch[0];
    __syncthreads();
    return r;
}
static __device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce<warp_max>(v, scratch, -INFINITY); }
