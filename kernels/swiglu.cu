// swiglu.cu — SwiGLU gate: y = silu(gate) * up, and its backward
// dgate = dy * up * s * (1 + g * (1 - s)) with s = sigmoid(g), dup = dy * silu(g).
// Pure element-wise over contiguous inputs; fp32 math, bf16 rounded once on store.
#include "common.cuh"

static __device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + expf(-v)); }

template <typename T>
static __device__ void swiglu_fwd_impl(const T* g, const T* u, T* y, i64 n) {
    FOR_EACH(i, n) { float gv = to_f(g[i]); y[i] = from_f<T>(gv * sigmoidf_(gv) * to_f(u[i])); }
}
template <typename T>
static __device__ void swiglu_bwd_impl(const T* dy, const T* g, const T* u, T* dg, T* du, i64 n) {
    FOR_EACH(i, n) {
        float gv = to_f(g[i]), uv = to_f(u[i]), d = to_f(dy[i]), s = sigmoidf_(gv);
        dg[i] = from_f<T>(d * uv * s * (1.0f + gv * (1.0f - s)));
        du[i] = from_f<T>(d * gv * s);
    }
}
extern "C" __global__ void swiglu_fwd_f32(const float* g, const float* u, float* y, i64 n) { swiglu_fwd_impl(g, u, y, n); }
extern "C" __global__ void swiglu_fwd_bf16(const bf16* g, const bf16* u, bf16* y, i64 n) { swiglu_fwd_impl(g, u, y, n); }
extern "C" __global__ void swiglu_bwd_f32(const float* dy, const float* g, const float* u, float* dg, float* du, i64 n) { swiglu_bwd_impl(dy, g, u, dg, du, n); }
extern "C" __global__ void swiglu_bwd_bf16(const bf16* dy, const bf16* g, const bf16* u, bf16* dg, bf16* du, i64 n) { swiglu_bwd_impl(dy, g, u, dg, du, n); }
