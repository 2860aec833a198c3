// bf16.cuh — the few bf16 operations the kernels use, for compilers that have no <cuda_bf16.h>:
// NVRTC (before CUDA 13.3 it ships no CUDA headers, so `#include <cuda_bf16.h>` fails unless the
// toolkit's include directory is passed, which a GPU host without a toolkit does not have) and
// the CPU emulator (crates/cuda/emu). nvcc builds use the real header instead. Same names and
// semantics as cuda_bf16.h: storage types of 2 and 4 bytes, round-to-nearest-even conversions
// (one `cvt.rn` instruction on sm_80+, integer arithmetic elsewhere), NaN kept as a NaN.
#pragma once

struct __align__(2) __nv_bfloat16 {
    unsigned short __x;
};
struct __align__(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

static __device__ __forceinline__ float __bfloat162float(__nv_bfloat16 h) {
    return __uint_as_float((unsigned)h.__x << 16);
}
static __device__ __forceinline__ unsigned short ferro_f2bf_bits(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#else
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
#endif
}
static __device__ __forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f) {
    __nv_bfloat16 h;
    h.__x = ferro_f2bf_bits(f);
    return h;
}
static __device__ __forceinline__ __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    __nv_bfloat162 v;
    v.x = __float2bfloat16_rn(lo);
    v.y = __float2bfloat16_rn(hi);
    return v;
}
static __device__ __forceinline__ unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
