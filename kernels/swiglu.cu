// swiglu.cu — SwiGLU gate: y = silu(gate) * up, and its backward
// dgate = dy * up * s * (1 + g * (1 - s)) with s = sigmoid(g), dup = dy * silu(g).
// Pure element-wise over contiguous inputs; fp32 math, bf16 rounded once on store. Floor: 3n
// elements of T forward (read gate, up; write y), 5n backward. With `vec` (every pointer 16-byte
// aligned: the launcher checks) a thread moves 16-byte vectors (LDG.E.128), the tail one element
// at a time; the math per element is the same either way.
#include "common.cuh"

static __device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + expf(-v)); }
static __device__ __forceinline__ float swiglu_fwd_op(float g, float u) { return g * sigmoidf_(g) * u; }
static __device__ __forceinline__ void swiglu_bwd_op(float d, float g, float u, float& dg, float& du) {
    float s = sigmoidf_(g);
    dg = d * u * s * (1.0f + g * (1.0f - s));
    du = d * g * s;
}

template <typename T>
static __device__ void swiglu_fwd_impl(const T* g, const T* u, T* y, i64 n, int vec) {
    const int N = Vec<T>::N;
    i64 nv = vec ? n / N : 0;
    const vec16 *gv = reinterpret_cast<const vec16*>(g), *uv = reinterpret_cast<const vec16*>(u);
    vec16* yv = reinterpret_cast<vec16*>(y);
    FOR_EACH(i, nv) {
        float fg[N], fu[N];
        Vec<T>::load(ld16(gv + i), fg);
        Vec<T>::load(ld16(uv + i), fu);
#pragma unroll
        for (int k = 0; k < N; ++k) fg[k] = swiglu_fwd_op(fg[k], fu[k]);
        yv[i] = Vec<T>::store(fg);
    }
    FOR_TAIL(i, nv, N, n) y[i] = from_f<T>(swiglu_fwd_op(to_f(g[i]), to_f(u[i])));
}
template <typename T>
static __device__ void swiglu_bwd_impl(const T* dy, const T* g, const T* u, T* dg, T* du, i64 n, int vec) {
    const int N = Vec<T>::N;
    i64 nv = vec ? n / N : 0;
    const vec16 *dyv = reinterpret_cast<const vec16*>(dy), *gv = reinterpret_cast<const vec16*>(g), *uv = reinterpret_cast<const vec16*>(u);
    vec16 *dgv = reinterpret_cast<vec16*>(dg), *duv = reinterpret_cast<vec16*>(du);
    FOR_EACH(i, nv) {
        float fd[N], fg[N], fu[N], og[N], ou[N];
        Vec<T>::load(ld16(dyv + i), fd);
        Vec<T>::load(ld16(gv + i), fg);
        Vec<T>::load(ld16(uv + i), fu);
#pragma unroll
        for (int k = 0; k < N; ++k) swiglu_bwd_op(fd[k], fg[k], fu[k], og[k], ou[k]);
        dgv[i] = Vec<T>::store(og);
        duv[i] = Vec<T>::store(ou);
    }
    FOR_TAIL(i, nv, N, n) {
        float a, b;
        swiglu_bwd_op(to_f(dy[i]), to_f(g[i]), to_f(u[i]), a, b);
        dg[i] = from_f<T>(a);
        du[i] = from_f<T>(b);
    }
}
extern "C" __global__ void swiglu_fwd_f32(const float* g, const float* u, float* y, i64 n, int vec) { swiglu_fwd_impl(g, u, y, n, vec); }
extern "C" __global__ void swiglu_fwd_bf16(const bf16* g, const bf16* u, bf16* y, i64 n, int vec) { swiglu_fwd_impl(g, u, y, n, vec); }
extern "C" __global__ void swiglu_bwd_f32(const float* dy, const float* g, const float* u, float* dg, float* du, i64 n, int vec) {
    swiglu_bwd_impl(dy, g, u, dg, du, n, vec);
}
extern "C" __global__ void swiglu_bwd_bf16(const bf16* dy, const bf16* g, const bf16* u, bf16* dg, bf16* du, i64 n, int vec) {
    swiglu_bwd_impl(dy, g, u, dg, du, n, vec);
}
