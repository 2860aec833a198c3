// softcap.cu — logit softcapping (Gemma 2/3's final_logit_softcapping, attn_logit_softcapping):
// y = cap * tanh(x / cap), and its backward from the saved output (as PyTorch's tanh saves its
// result): dx = dy * (1 - (y / cap)^2). Pure element-wise over contiguous inputs; fp32 math, bf16
// rounded once on store. Floor: 2n elements of T forward (read x, write y), 3n backward (read dy,
// y; write dx); FLOPs per element ~20 forward (a tanh), 4 backward. With `vec` (every pointer
// 16-byte aligned: the launcher checks) a thread moves 16-byte vectors (LDG.E.128), the tail one
// element at a time.
#include "common.cuh"

template <typename T>
static __device__ void softcap_fwd_impl(const T* x, T* y, i64 n, float cap, int vec) {
    const int N = Vec<T>::N;
    i64 nv = vec ? n / N : 0;
    const vec16* xv = reinterpret_cast<const vec16*>(x);
    vec16* yv = reinterpret_cast<vec16*>(y);
    float inv = 1.0f / cap;
    FOR_EACH(i, nv) {
        float f[N];
        Vec<T>::load(ld16(xv + i), f);
#pragma unroll
        for (int k = 0; k < N; ++k) f[k] = cap * tanhf(f[k] * inv);
        yv[i] = Vec<T>::store(f);
    }
    FOR_TAIL(i, nv, N, n) y[i] = from_f<T>(cap * tanhf(to_f(x[i]) * inv));
}
template <typename T>
static __device__ void softcap_bwd_impl(const T* dy, const T* y, T* dx, i64 n, float cap, int vec) {
    const int N = Vec<T>::N;
    i64 nv = vec ? n / N : 0;
    const vec16 *dyv = reinterpret_cast<const vec16*>(dy), *yv = reinterpret_cast<const vec16*>(y);
    vec16* dxv = reinterpret_cast<vec16*>(dx);
    float inv = 1.0f / cap;
    FOR_EACH(i, nv) {
        float fd[N], fy[N];
        Vec<T>::load(ld16(dyv + i), fd);
        Vec<T>::load(ld16(yv + i), fy);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            float t = fy[k] * inv;
            fd[k] = fd[k] * (1.0f - t * t);
        }
        dxv[i] = Vec<T>::store(fd);
    }
    FOR_TAIL(i, nv, N, n) {
        float t = to_f(y[i]) * inv;
        dx[i] = from_f<T>(to_f(dy[i]) * (1.0f - t * t));
    }
}
#define SOFTCAP_KERNELS(suffix, T)                                                                                        \
    extern "C" __global__ void softcap_fwd_##suffix(const T* x, T* y, i64 n, float cap, int vec) {                          \
        softcap_fwd_impl(x, y, n, cap, vec);                                                                              \
    }                                                                                                                     \
    extern "C" __global__ void softcap_bwd_##suffix(const T* dy, const T* y, T* dx, i64 n, float cap, int vec) {            \
        softcap_bwd_impl(dy, y, dx, n, cap, vec);                                                                         \
    }
SOFTCAP_KERNELS(f32, float)
SOFTCAP_KERNELS(bf16, bf16)
