// elementwise.cu — element-wise kernels over arbitrary strided views: unary ops (neg, exp,
// log, sqrt, rsqrt, recip, sqr, silu, silu-grad, powf, affine), binary ops (add, sub, mul,
// div, eq) whose operands are broadcast views (stride 0) of rank <= 6, fills, dtype casts and
// the raw strided copy that backs copy_strided / assign / cat. Inputs are read through a
// `Strided` descriptor, outputs are contiguous (or, for strided_copy, strided too); math is
// fp32 and bf16 results are rounded once. The op codes (constants.cuh) mirror `UnaryOp` / `BinaryOp` order.
#include "common.cuh"

static __device__ __forceinline__ float unary_apply(int op, float v, float a, float b) {
    switch (op) {
        case U_NEG: return -v;
        case U_EXP: return expf(v);
        case U_LOG: return logf(v);
        case U_SQRT: return sqrtf(v);
        case U_RSQRT: return 1.0f / sqrtf(v);
        case U_RECIP: return 1.0f / v;
        case U_SQR: return v * v;
        case U_SILU: return v / (1.0f + expf(-v));
        case U_SILU_GRAD: { float s = 1.0f / (1.0f + expf(-v)); return s * (1.0f + v * (1.0f - s)); }
        case U_POWF: return powf(v, a);
        default: return v * a + b;  // U_AFFINE
    }
}
static __device__ __forceinline__ float binary_apply(int op, float x, float y) {
    switch (op) {
        case B_ADD: return x + y;
        case B_SUB: return x - y;
        case B_MUL: return x * y;
        case B_DIV: return x / y;
        default: return x == y ? 1.0f : 0.0f;
    }
}

template <typename T>
static __device__ void unary_impl(const T* x, Strided lx, T* y, i64 n, int op, float a, float b) {
    FOR_EACH(i, n) y[i] = from_f<T>(unary_apply(op, to_f(x[strided_index(lx, i)]), a, b));
}
template <typename T>
static __device__ void binary_impl(const T* a, Strided la, const T* b, Strided lb, T* y, i64 n, int op) {
    FOR_EACH(i, n) y[i] = from_f<T>(binary_apply(op, to_f(a[strided_index(la, i)]), to_f(b[strided_index(lb, i)])));
}

extern "C" __global__ void unary_f32(const float* x, Strided lx, float* y, i64 n, int op, float a, float b) { unary_impl(x, lx, y, n, op, a, b); }
extern "C" __global__ void unary_bf16(const bf16* x, Strided lx, bf16* y, i64 n, int op, float a, float b) { unary_impl(x, lx, y, n, op, a, b); }
extern "C" __global__ void binary_f32(const float* a, Strided la, const float* b, Strided lb, float* y, i64 n, int op) { binary_impl(a, la, b, lb, y, n, op); }
extern "C" __global__ void binary_bf16(const bf16* a, Strided la, const bf16* b, Strided lb, bf16* y, i64 n, int op) { binary_impl(a, la, b, lb, y, n, op); }

// ---- fills and raw copies (by element width, dtype-agnostic) -----------------------------------
extern "C" __global__ void fill_b32(unsigned* y, i64 n, unsigned v) { FOR_EACH(i, n) y[i] = v; }
extern "C" __global__ void fill_b16(unsigned short* y, i64 n, unsigned short v) { FOR_EACH(i, n) y[i] = v; }

// dst[view ld] = src[view ls], both walked in row-major order of the same shape.
extern "C" __global__ void strided_copy_b32(const unsigned* src, Strided ls, unsigned* dst, Strided ld, i64 n) {
    FOR_EACH(i, n) dst[strided_index(ld, i)] = src[strided_index(ls, i)];
}
extern "C" __global__ void strided_copy_b16(const unsigned short* src, Strided ls, unsigned short* dst, Strided ld, i64 n) {
    FOR_EACH(i, n) dst[strided_index(ld, i)] = src[strided_index(ls, i)];
}

// ---- casts (strided source, contiguous destination) ---------------------------------------------
#define CAST(name, TI, TO) \
    extern "C" __global__ void name(const TI* x, Strided lx, TO* y, i64 n) { FOR_EACH(i, n) y[i] = from_f<TO>(to_f(x[strided_index(lx, i)])); }
CAST(cast_f32_bf16, float, bf16)
CAST(cast_bf16_f32, bf16, float)
CAST(cast_f32_i32, float, int)
CAST(cast_bf16_i32, bf16, int)
CAST(cast_i32_bf16, int, bf16)
// i32 -> f32 without the float round trip through to_f (exact for |x| < 2^24, as the CPU path).
extern "C" __global__ void cast_i32_f32(const int* x, Strided lx, float* y, i64 n) { FOR_EACH(i, n) y[i] = (float)x[strided_index(lx, i)]; }
