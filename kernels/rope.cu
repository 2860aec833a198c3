// rope.cu — rotary position embedding, Hugging Face `rotate_half` convention, on x (b, h, t, d)
// with cos/sin tables (t, d). x is dense in either head layout (constants.cuh): `inner` is the
// number of rows between a head's consecutive positions, 1 (HEAD_MAJOR) or h (TIME_MAJOR), and y
// is written in x's layout. Forward: y = x*cos + rotate_half(x)*sin, rotate_half(x) =
// cat(-x2, x1). `inverse` applies the transposed rotation, which is the backward. One thread
// per (row, pair j < d/2), or per N pairs in 16-byte vectors: it reads x[j], x[j + d/2] and
// writes both outputs.
#include "common.cuh"

// rope_pos_*: the position of each row is read from pos (b, t) i32 (packed rows, whose positions
// restart in every segment) and indexes tables of any length; rope_* take a row's time index.
// The two are one template, so rope_* compile to what they were before.

// (y1, y2) from (x1, x2) = (x[j], x[j + d/2]) with c1, c2 = cos[j], cos[j + d/2], s1, s2 likewise.
static __device__ __forceinline__ void rope_pair(float x1, float x2, float c1, float c2, float s1, float s2, int inverse, float& y1, float& y2) {
    if (inverse) {
        y1 = x1 * c1 + x2 * s2;
        y2 = x2 * c2 - x1 * s1;
    } else {
        y1 = x1 * c1 - x2 * s1;
        y2 = x2 * c2 + x1 * s2;
    }
}
// Floor: 2n elements of T (read x, write y; the (t, d) tables stay in cache). With `vec` (d/2 a
// multiple of the vector's N elements and every pointer 16-byte aligned: the launcher checks) a
// thread takes N pairs, 16-byte vectors of x, cos and sin at j and j + d/2 (LDG.E.128).
// The table row of x's row `row`: its time index, or with POS the position pos gives its token
// (b, i), where row is ((b heads + head) t + i) head-major (inner 1) or ((b t + i) heads + head)
// time-major (inner = heads).
template <bool POS>
static __device__ __forceinline__ i64 rope_position(i64 row, i64 t, i64 inner, const int* pos, i64 heads) {
    if (!POS) return (row / inner) % t;
    i64 token = inner == 1 ? (row / (heads * t)) * t + row % t : row / inner;
    return pos[token];
}
template <typename T, bool POS>
static __device__ void rope_impl(const T* x, const T* cos_, const T* sin_, T* y, i64 rows, i64 t, i64 d, i64 inner, int inverse, int vec,
                                 const int* pos, i64 heads) {
    i64 h = d / 2;
    if (vec) {
        const int N = Vec<T>::N;
        i64 hv = h / N;
        FOR_EACH(i, rows * hv) {
            i64 row = i / hv, jv = i % hv, p = rope_position<POS>(row, t, inner, pos, heads);
            const vec16* xr = reinterpret_cast<const vec16*>(x + row * d) + jv;
            const vec16* c = reinterpret_cast<const vec16*>(cos_ + p * d) + jv;
            const vec16* s = reinterpret_cast<const vec16*>(sin_ + p * d) + jv;
            float x1[N], x2[N], c1[N], c2[N], s1[N], s2[N];
            Vec<T>::load(ld16(xr), x1);
            Vec<T>::load(ld16(xr + hv), x2);
            Vec<T>::load(ld16(c), c1);
            Vec<T>::load(ld16(c + hv), c2);
            Vec<T>::load(ld16(s), s1);
            Vec<T>::load(ld16(s + hv), s2);
#pragma unroll
            for (int k = 0; k < N; ++k) rope_pair(x1[k], x2[k], c1[k], c2[k], s1[k], s2[k], inverse, x1[k], x2[k]);
            vec16* yr = reinterpret_cast<vec16*>(y + row * d) + jv;
            yr[0] = Vec<T>::store(x1);
            yr[hv] = Vec<T>::store(x2);
        }
        return;
    }
    FOR_EACH(i, rows * h) {
        i64 row = i / h, j = i % h, p = rope_position<POS>(row, t, inner, pos, heads);
        const T* xr = x + row * d;
        const T* c = cos_ + p * d;
        const T* s = sin_ + p * d;
        float y1, y2;
        rope_pair(to_f(xr[j]), to_f(xr[j + h]), to_f(c[j]), to_f(c[j + h]), to_f(s[j]), to_f(s[j + h]), inverse, y1, y2);
        y[row * d + j] = from_f<T>(y1);
        y[row * d + j + h] = from_f<T>(y2);
    }
}
extern "C" __global__ void rope_f32(const float* x, const float* c, const float* s, float* y, i64 rows, i64 t, i64 d, i64 inner, int inverse, int vec) {
    rope_impl<float, false>(x, c, s, y, rows, t, d, inner, inverse, vec, nullptr, 0);
}
extern "C" __global__ void rope_bf16(const bf16* x, const bf16* c, const bf16* s, bf16* y, i64 rows, i64 t, i64 d, i64 inner, int inverse, int vec) {
    rope_impl<bf16, false>(x, c, s, y, rows, t, d, inner, inverse, vec, nullptr, 0);
}
extern "C" __global__ void rope_pos_f32(const float* x, const float* c, const float* s, const int* pos, float* y, i64 rows, i64 t, i64 d, i64 inner,
                                        i64 heads, int inverse, int vec) {
    rope_impl<float, true>(x, c, s, y, rows, t, d, inner, inverse, vec, pos, heads);
}
extern "C" __global__ void rope_pos_bf16(const bf16* x, const bf16* c, const bf16* s, const int* pos, bf16* y, i64 rows, i64 t, i64 d, i64 inner,
                                         i64 heads, int inverse, int vec) {
    rope_impl<bf16, true>(x, c, s, y, rows, t, d, inner, inverse, vec, pos, heads);
}
