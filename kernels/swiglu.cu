// swiglu.cu — the gated MLP activations, y = act(gate) * up, and their backward
// dgate = dy * up * act'(gate), dup = dy * act(gate), for two activations (the `ACT` template
// argument, one pair of entry points each):
//   swiglu_* (LLaMA, Qwen, Mistral): act = silu, act'(g) = s * (1 + g * (1 - s)), s = sigmoid(g);
//   geglu_*  (Gemma 3's gelu_pytorch_tanh): act = gelu_tanh(g) = 0.5 g (1 + t),
//            t = tanh(k (g + 0.044715 g^3)), k = sqrt(2 / pi) (PyTorch's gelu(approximate="tanh")),
//            act'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 * 0.044715 g^2).
// Pure element-wise over contiguous inputs; fp32 math, bf16 rounded once on store. Floor: 3n
// elements of T forward (read gate, up; write y), 5n backward; FLOPs per element ~10 (silu) /
// ~15 (gelu_tanh) forward. With `vec` (every pointer 16-byte aligned: the launcher checks) a
// thread moves 16-byte vectors (LDG.E.128), the tail one element at a time; the math per element
// is the same either way.
#include "common.cuh"

enum GluAct { GLU_SILU = 0, GLU_GELU_TANH = 1 };

static __device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + expf(-v)); }
// act(g), and act'(g) when `d` is given.
template <int ACT>
static __device__ __forceinline__ float glu_act(float g, float* d) {
    if constexpr (ACT == GLU_SILU) {
        float s = sigmoidf_(g);
        if (d) *d = s * (1.0f + g * (1.0f - s));
        return g * s;
    } else {
        const float k = 0.7978845608028654f, c = 0.044715f;  // sqrt(2 / pi)
        float t = tanhf(k * (g + c * g * g * g));
        if (d) *d = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * k * (1.0f + 3.0f * c * g * g);
        return 0.5f * g * (1.0f + t);
    }
}
template <int ACT>
static __device__ __forceinline__ float glu_fwd_op(float g, float u) { return glu_act<ACT>(g, nullptr) * u; }
template <int ACT>
static __device__ __forceinline__ void glu_bwd_op(float dy, float g, float u, float& dg, float& du) {
    float da;
    float a = glu_act<ACT>(g, &da);
    dg = dy * u * da;
    du = dy * a;
}

template <int ACT, typename T>
static __device__ void glu_fwd_impl(const T* g, const T* u, T* y, i64 n, int vec) {
    const int N = Vec<T>::N;
    i64 nv = vec ? n / N : 0;
    const vec16 *gv = reinterpret_cast<const vec16*>(g), *uv = reinterpret_cast<const vec16*>(u);
    vec16* yv = reinterpret_cast<vec16*>(y);
    FOR_EACH(i, nv) {
        float fg[N], fu[N];
        Vec<T>::load(ld16(gv + i), fg);
        Vec<T>::load(ld16(uv + i), fu);
#pragma unroll
        for (int k = 0; k < N; ++k) fg[k] = glu_fwd_op<ACT>(fg[k], fu[k]);
        yv[i] = Vec<T>::store(fg);
    }
    FOR_TAIL(i, nv, N, n) y[i] = from_f<T>(glu_fwd_op<ACT>(to_f(g[i]), to_f(u[i])));
}
template <int ACT, typename T>
static __device__ void glu_bwd_impl(const T* dy, const T* g, const T* u, T* dg, T* du, i64 n, int vec) {
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
        for (int k = 0; k < N; ++k) glu_bwd_op<ACT>(fd[k], fg[k], fu[k], og[k], ou[k]);
        dgv[i] = Vec<T>::store(og);
        duv[i] = Vec<T>::store(ou);
    }
    FOR_TAIL(i, nv, N, n) {
        float a, b;
        glu_bwd_op<ACT>(to_f(dy[i]), to_f(g[i]), to_f(u[i]), a, b);
        dg[i] = from_f<T>(a);
        du[i] = from_f<T>(b);
    }
}
#define GLU_KERNELS(name, ACT, suffix, T)                                                                                 \
    extern "C" __global__ void name##_fwd_##suffix(const T* g, const T* u, T* y, i64 n, int vec) {                          \
        glu_fwd_impl<ACT>(g, u, y, n, vec);                                                                               \
    }                                                                                                                     \
    extern "C" __global__ void name##_bwd_##suffix(const T* dy, const T* g, const T* u, T* dg, T* du, i64 n, int vec) {     \
        glu_bwd_impl<ACT>(dy, g, u, dg, du, n, vec);                                                                      \
    }
GLU_KERNELS(swiglu, GLU_SILU, f32, float)
GLU_KERNELS(swiglu, GLU_SILU, bf16, bf16)
GLU_KERNELS(geglu, GLU_GELU_TANH, f32, float)
GLU_KERNELS(geglu, GLU_GELU_TANH, bf16, bf16)
