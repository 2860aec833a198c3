// rope.cu — rotary position embedding, Hugging Face `rotate_half` convention, on x (b, h, t, d)
// with cos/sin tables (t, d). x is dense in either head layout (constants.cuh): `inner` is the
// number of rows between a head's consecutive positions, 1 (HEAD_MAJOR) or h (TIME_MAJOR), and y
// is written in x's layout. Forward: y = x*cos + rotate_half(x)*sin, rotate_half(x) =
// cat(-x2, x1). `inverse` applies the transposed rotation, which is the backward. One thread
// per (row, pair j < d/2): it reads x[j], x[j + d/2] and writes both outputs.
#include "common.cuh"

template <typename T>
static __device__ void rope_impl(const T* x, const T* cos_, const T* sin_, T* y, i64 rows, i64 t, i64 d, i64 inner, int inverse) {
    i64 h = d / 2;
    FOR_EACH(i, rows * h) {
        i64 row = i / h, j = i % h, p = (row / inner) % t;
        const T* xr = x + row * d;
        const T* c = cos_ + p * d;
        const T* s = sin_ + p * d;
        float x1 = to_f(xr[j]), x2 = to_f(xr[j + h]);
        float y1, y2;
        if (inverse) {
            y1 = x1 * to_f(c[j]) + x2 * to_f(s[j + h]);
            y2 = x2 * to_f(c[j + h]) - x1 * to_f(s[j]);
        } else {
            y1 = x1 * to_f(c[j]) - x2 * to_f(s[j]);
            y2 = x2 * to_f(c[j + h]) + x1 * to_f(s[j + h]);
        }
        y[row * d + j] = from_f<T>(y1);
        y[row * d + j + h] = from_f<T>(y2);
    }
}
extern "C" __global__ void rope_f32(const float* x, const float* c, const float* s, float* y, i64 rows, i64 t, i64 d, i64 inner, int inverse) { rope_impl(x, c, s, y, rows, t, d, inner, inverse); }
extern "C" __global__ void rope_bf16(const bf16* x, const bf16* c, const bf16* s, bf16* y, i64 rows, i64 t, i64 d, i64 inner, int inverse) { rope_impl(x, c, s, y, rows, t, d, inner, inverse); }
