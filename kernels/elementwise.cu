// elementwise.cu — element-wise kernels over arbitrary strided views: unary ops (neg, exp,
// log, sqrt, rsqrt, recip, sqr, silu, silu-grad, powf, affine), binary ops (add, sub, mul,
// div, eq) whose operands are broadcast views (stride 0) of rank <= 6, fills, dtype casts and
// the raw strided copy that backs copy_strided / assign / cat. Inputs are read through a
// `Strided` descriptor, outputs are contiguous (or, for strided_copy, strided too); math is
// fp32 and bf16 results are rounded once. The op codes (constants.cuh) mirror `UnaryOp` / `BinaryOp` order.
// Dense operands take the `*_contig_*` kernels (16-byte vector accesses, a scalar tail); a 2-D
// or batched 2-D transposed copy takes `transpose_*` (tiles staged in shared memory). Floors
// below: bytes moved / ~4 TB/s (H100/H200 HBM3(e) at copy speed).
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

// Strided paths: 32-bit index math when the views fit (the common case), 64-bit otherwise.
template <typename T, typename I>
static __device__ __forceinline__ void unary_walk(const T* x, const Strided& lx, T* y, I n, int op, float a, float b) {
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x)
        y[i] = from_f<T>(unary_apply(op, to_f(x[strided_index_t<I>(lx, i)]), a, b));
}
template <typename T>
static __device__ void unary_impl(const T* x, Strided lx, T* y, i64 n, int op, float a, float b) {
    if (strided_fits32(lx, n)) unary_walk<T, unsigned>(x, lx, y, (unsigned)n, op, a, b);
    else unary_walk<T, i64>(x, lx, y, n, op, a, b);
}
template <typename T, typename I>
static __device__ __forceinline__ void binary_walk(const T* a, const Strided& la, const T* b, const Strided& lb, T* y, I n, int op) {
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x)
        y[i] = from_f<T>(binary_apply(op, to_f(a[strided_index_t<I>(la, i)]), to_f(b[strided_index_t<I>(lb, i)])));
}
template <typename T>
static __device__ void binary_impl(const T* a, Strided la, const T* b, Strided lb, T* y, i64 n, int op) {
    if (strided_fits32(la, n) && strided_fits32(lb, n)) binary_walk<T, unsigned>(a, la, b, lb, y, (unsigned)n, op);
    else binary_walk<T, i64>(a, la, b, lb, y, n, op);
}

// ---- dense fast paths: x, y (and a, b) 16-byte aligned, n elements each --------------------------

// Floor: 2n * sizeof(T) bytes (read x, write y). The op is a template parameter, so the loop
// holds no switch (`unary_contig_impl` dispatches once per launch).
template <int OP, typename T>
static __device__ void unary_contig_op(const T* x, T* y, i64 n, float a, float b) {
    const int N = Vec<T>::N;
    i64 nv = n / N;
    const vec16* xv = reinterpret_cast<const vec16*>(x);
    vec16* yv = reinterpret_cast<vec16*>(y);
    FOR_EACH(i, nv) {
        float f[N];
        Vec<T>::load(ld16(xv + (i)), f);
#pragma unroll
        for (int k = 0; k < N; ++k) f[k] = unary_apply(OP, f[k], a, b);
        yv[i] = Vec<T>::store(f);
    }
    FOR_TAIL(i, nv, N, n) y[i] = from_f<T>(unary_apply(OP, to_f(x[i]), a, b));
}
template <typename T>
static __device__ void unary_contig_impl(const T* x, T* y, i64 n, int op, float a, float b) {
    switch (op) {
        case U_NEG: unary_contig_op<U_NEG>(x, y, n, a, b); break;
        case U_EXP: unary_contig_op<U_EXP>(x, y, n, a, b); break;
        case U_LOG: unary_contig_op<U_LOG>(x, y, n, a, b); break;
        case U_SQRT: unary_contig_op<U_SQRT>(x, y, n, a, b); break;
        case U_RSQRT: unary_contig_op<U_RSQRT>(x, y, n, a, b); break;
        case U_RECIP: unary_contig_op<U_RECIP>(x, y, n, a, b); break;
        case U_SQR: unary_contig_op<U_SQR>(x, y, n, a, b); break;
        case U_SILU: unary_contig_op<U_SILU>(x, y, n, a, b); break;
        case U_SILU_GRAD: unary_contig_op<U_SILU_GRAD>(x, y, n, a, b); break;
        case U_POWF: unary_contig_op<U_POWF>(x, y, n, a, b); break;
        default: unary_contig_op<U_AFFINE>(x, y, n, a, b); break;
    }
}
// Floor: 3n * sizeof(T) bytes.
template <typename T>
static __device__ void binary_contig_impl(const T* a, const T* b, T* y, i64 n, int op) {
    const int N = Vec<T>::N;
    i64 nv = n / N;
    const vec16* av = reinterpret_cast<const vec16*>(a);
    const vec16* bv = reinterpret_cast<const vec16*>(b);
    vec16* yv = reinterpret_cast<vec16*>(y);
    FOR_EACH(i, nv) {
        float fa[N], fb[N];
        Vec<T>::load(ld16(av + (i)), fa);
        Vec<T>::load(ld16(bv + (i)), fb);
#pragma unroll
        for (int k = 0; k < N; ++k) fa[k] = binary_apply(op, fa[k], fb[k]);
        yv[i] = Vec<T>::store(fa);
    }
    FOR_TAIL(i, nv, N, n) y[i] = from_f<T>(binary_apply(op, to_f(a[i]), to_f(b[i])));
}
// y[i] = a[i] op row[i % cols] (or row[i % cols] op a[i] when row_first): a dense operand against
// a broadcast row vector (cols > 1) or scalar (cols == 1). Floor: 2n * sizeof(T) bytes (the row
// stays in cache).
template <typename T, typename I>
static __device__ __forceinline__ void binary_row_walk(const T* a, const T* row, T* y, I n, I cols, int op, int row_first) {
    const int N = Vec<T>::N;
    I nv = n / N;
    const vec16* av = reinterpret_cast<const vec16*>(a);
    vec16* yv = reinterpret_cast<vec16*>(y);
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < nv; i += (I)gridDim.x * blockDim.x) {
        float fa[N];
        Vec<T>::load(ld16(av + (i)), fa);
        I j = (i * N) % cols;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            float r = to_f(row[j]);
            fa[k] = row_first ? binary_apply(op, r, fa[k]) : binary_apply(op, fa[k], r);
            j = j + 1 == cols ? 0 : j + 1;
        }
        yv[i] = Vec<T>::store(fa);
    }
    for (I i = nv * N + (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
        float x = to_f(a[i]), r = to_f(row[i % cols]);
        y[i] = from_f<T>(row_first ? binary_apply(op, r, x) : binary_apply(op, x, r));
    }
}
template <typename T>
static __device__ void binary_row_impl(const T* a, const T* row, T* y, i64 n, i64 cols, int op, int row_first) {
    if (n < 0x7fffffffLL) binary_row_walk<T, unsigned>(a, row, y, (unsigned)n, (unsigned)cols, op, row_first);
    else binary_row_walk<T, i64>(a, row, y, n, cols, op, row_first);
}

extern "C" __global__ void unary_f32(const float* x, Strided lx, float* y, i64 n, int op, float a, float b) { unary_impl(x, lx, y, n, op, a, b); }
extern "C" __global__ void unary_bf16(const bf16* x, Strided lx, bf16* y, i64 n, int op, float a, float b) { unary_impl(x, lx, y, n, op, a, b); }
extern "C" __global__ void binary_f32(const float* a, Strided la, const float* b, Strided lb, float* y, i64 n, int op) { binary_impl(a, la, b, lb, y, n, op); }
extern "C" __global__ void binary_bf16(const bf16* a, Strided la, const bf16* b, Strided lb, bf16* y, i64 n, int op) { binary_impl(a, la, b, lb, y, n, op); }
extern "C" __global__ void unary_contig_f32(const float* x, float* y, i64 n, int op, float a, float b) { unary_contig_impl(x, y, n, op, a, b); }
extern "C" __global__ void unary_contig_bf16(const bf16* x, bf16* y, i64 n, int op, float a, float b) { unary_contig_impl(x, y, n, op, a, b); }
extern "C" __global__ void binary_contig_f32(const float* a, const float* b, float* y, i64 n, int op) { binary_contig_impl(a, b, y, n, op); }
extern "C" __global__ void binary_contig_bf16(const bf16* a, const bf16* b, bf16* y, i64 n, int op) { binary_contig_impl(a, b, y, n, op); }
extern "C" __global__ void binary_row_f32(const float* a, const float* row, float* y, i64 n, i64 cols, int op, int row_first) {
    binary_row_impl(a, row, y, n, cols, op, row_first);
}
extern "C" __global__ void binary_row_bf16(const bf16* a, const bf16* row, bf16* y, i64 n, i64 cols, int op, int row_first) {
    binary_row_impl(a, row, y, n, cols, op, row_first);
}

// ---- fills and raw copies (by element width, dtype-agnostic) -----------------------------------
// y 16-byte aligned (fresh pool storage). Floor: n * width bytes (writes only).
template <typename T>
static __device__ void fill_impl(T* y, i64 n, T v) {
    const int N = 16 / sizeof(T);
    unsigned word = sizeof(T) == 4 ? (unsigned)v : ((unsigned)v | ((unsigned)v << 16));
    vec16 w;
#pragma unroll
    for (int k = 0; k < 4; ++k) w.w[k] = word;
    i64 nv = n / N;
    vec16* yv = reinterpret_cast<vec16*>(y);
    FOR_EACH(i, nv) yv[i] = w;
    FOR_TAIL(i, nv, N, n) y[i] = v;
}
extern "C" __global__ void fill_b32(unsigned* y, i64 n, unsigned v) { fill_impl(y, n, v); }
extern "C" __global__ void fill_b16(unsigned short* y, i64 n, unsigned short v) { fill_impl(y, n, v); }

// dst[view ld] = src[view ls], both walked in row-major order of the same shape. Floor: 2n * width
// bytes, when the views are dense (the launcher then uses a device-to-device memcpy instead).
template <typename T>
static __device__ __forceinline__ T copy_load(const T* p) { return *p; }
static __device__ __forceinline__ vec16 copy_load(const vec16* p) { return ld16(p); }  // one LDG.E.128
template <typename T, typename I>
static __device__ __forceinline__ void copy_walk(const T* src, const Strided& ls, T* dst, const Strided& ld, I n) {
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x)
        dst[strided_index_t<I>(ld, i)] = copy_load(src + strided_index_t<I>(ls, i));
}
template <typename T>
static __device__ void strided_copy_impl(const T* src, Strided ls, T* dst, Strided ld, i64 n) {
    if (strided_fits32(ls, n) && strided_fits32(ld, n)) copy_walk<T, unsigned>(src, ls, dst, ld, (unsigned)n);
    else copy_walk<T, i64>(src, ls, dst, ld, n);
}
extern "C" __global__ void strided_copy_b32(const unsigned* src, Strided ls, unsigned* dst, Strided ld, i64 n) {
    strided_copy_impl(src, ls, dst, ld, n);
}
extern "C" __global__ void strided_copy_b16(const unsigned short* src, Strided ls, unsigned short* dst, Strided ld, i64 n) {
    strided_copy_impl(src, ls, dst, ld, n);
}
// The same walk in 16-byte units: views whose innermost dim is a dense run of whole, aligned
// 16-byte vectors (a head permute (b, t, h, d) -> (b, h, t, d) with d a multiple of 8 bf16), with
// shapes, strides and offsets counted in vectors by the launcher. Floor: 2n * 16 bytes.
extern "C" __global__ void strided_copy_b128(const vec16* src, Strided ls, vec16* dst, Strided ld, i64 n) {
    strided_copy_impl(src, ls, dst, ld, n);
}

// dst (batch, rows, cols) dense = src element (b, r, c) at off + b * sb + r + c * sc: the dense
// copy of a transposed (batched) matrix view. Each TP_TILE x TP_TILE tile is read along r and
// written along c through shared memory (rows padded by one element against bank conflicts), so
// both sides are coalesced. blockDim.x == TP_TILE * TP_ROWS. Floor: 2n * width bytes.
template <typename T>
static __device__ void transpose_impl(const T* src, T* dst, i64 batch, i64 rows, i64 cols, i64 off, i64 sb, i64 sc) {
    __shared__ T tile[TP_TILE][TP_TILE + 1];
    int tx = threadIdx.x % TP_TILE, ty = threadIdx.x / TP_TILE;
    i64 tr = (rows + TP_TILE - 1) / TP_TILE, tc = (cols + TP_TILE - 1) / TP_TILE;
    for (i64 t = blockIdx.x; t < batch * tr * tc; t += gridDim.x) {
        i64 b = t / (tr * tc), rem = t - b * (tr * tc);
        i64 r0 = (rem / tc) * TP_TILE, c0 = (rem % tc) * TP_TILE;
        const T* s = src + off + b * sb;
        T* d = dst + b * rows * cols;
#pragma unroll
        for (int k = ty; k < TP_TILE; k += TP_ROWS) {
            i64 r = r0 + tx, c = c0 + k;
            if (r < rows && c < cols) tile[k][tx] = s[r + c * sc];
        }
        __syncthreads();
#pragma unroll
        for (int k = ty; k < TP_TILE; k += TP_ROWS) {
            i64 r = r0 + k, c = c0 + tx;
            if (r < rows && c < cols) d[r * cols + c] = tile[tx][k];
        }
        __syncthreads();
    }
}
extern "C" __global__ void transpose_b32(const unsigned* src, unsigned* dst, i64 batch, i64 rows, i64 cols, i64 off, i64 sb, i64 sc) {
    transpose_impl(src, dst, batch, rows, cols, off, sb, sc);
}
extern "C" __global__ void transpose_b16(const unsigned short* src, unsigned short* dst, i64 batch, i64 rows, i64 cols, i64 off, i64 sb,
                                         i64 sc) {
    transpose_impl(src, dst, batch, rows, cols, off, sb, sc);
}

// The bf16 transpose in 4-byte pairs: a 64 x 64 tile, read as pairs (r, r + 1) along the
// source's contiguous r and written as pairs (c, c + 1) along the destination's contiguous c, so
// a warp moves 128 bytes per access on both sides (transpose_b16 moves 64). Element (b, r, c) is
// at off + b * sb + r + c * sc; rows, cols, off, sb and sc are even (the launcher checks), so
// every pair is aligned. blockDim.x == 256. Floor: 4n bytes.
extern "C" __global__ void transpose_pairs_b16(const unsigned* src, unsigned* dst, i64 batch, i64 rows, i64 cols, i64 off, i64 sb, i64 sc) {
    __shared__ unsigned tile[64][33];  // tile[c - c0][(r - r0) / 2]: the pair (r, r + 1) of column c
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    i64 tr = (rows + 63) / 64, tc = (cols + 63) / 64;
    for (i64 t = blockIdx.x; t < batch * tr * tc; t += gridDim.x) {
        i64 b = t / (tr * tc), rem = t - b * (tr * tc);
        i64 r0 = (rem / tc) * 64, c0 = (rem % tc) * 64;
        i64 base = (off + b * sb) / 2;
#pragma unroll
        for (int k = ty; k < 64; k += 8) {
            i64 r = r0 + 2 * tx, c = c0 + k;
            if (r < rows && c < cols) tile[k][tx] = src[base + (c * sc) / 2 + r / 2];
        }
        __syncthreads();
        unsigned* d = dst + (b * rows * cols) / 2;
#pragma unroll
        for (int k = ty; k < 64; k += 8) {
            i64 r = r0 + k, c = c0 + 2 * tx;
            if (r < rows && c < cols) {
                int sh = (k & 1) * 16;
                unsigned e0 = (tile[2 * tx][k >> 1] >> sh) & 0xffffu, e1 = (tile[2 * tx + 1][k >> 1] >> sh) & 0xffffu;
                d[(r * cols + c) / 2] = e0 | (e1 << 16);
            }
        }
        __syncthreads();
    }
}

// ---- casts (strided source, contiguous destination) ---------------------------------------------
template <typename TI, typename TO, typename I>
static __device__ __forceinline__ void cast_walk(const TI* x, const Strided& lx, TO* y, I n) {
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) y[i] = from_f<TO>(to_f(x[strided_index_t<I>(lx, i)]));
}
template <typename TI, typename TO>
static __device__ void cast_impl(const TI* x, Strided lx, TO* y, i64 n) {
    if (strided_fits32(lx, n)) cast_walk<TI, TO, unsigned>(x, lx, y, (unsigned)n);
    else cast_walk<TI, TO, i64>(x, lx, y, n);
}
#define CAST(name, TI, TO) \
    extern "C" __global__ void name(const TI* x, Strided lx, TO* y, i64 n) { cast_impl<TI, TO>(x, lx, y, n); }
CAST(cast_f32_bf16, float, bf16)
CAST(cast_bf16_f32, bf16, float)
CAST(cast_f32_i32, float, int)
CAST(cast_bf16_i32, bf16, int)
CAST(cast_i32_bf16, int, bf16)
// i32 -> f32 without the float round trip through to_f (exact for |x| < 2^24, as the CPU path).
extern "C" __global__ void cast_i32_f32(const int* x, Strided lx, float* y, i64 n) {
    FOR_EACH(i, n) y[i] = (float)x[strided_index_t<i64>(lx, i)];
}

// Dense f32 <-> bf16 casts, 8 elements per step (two 16-byte f32 vectors, one bf16 vector);
// x and y 16-byte aligned. Floor: 6n bytes.
template <typename X, typename Y>
static __device__ __forceinline__ void cast_contig_impl(const X* x, Y* y, i64 n) {
    constexpr int LX = 8 / Vec<X>::N, LY = 8 / Vec<Y>::N;  // vectors read and written per step
    i64 nv = n / 8;
    const vec16* xv = reinterpret_cast<const vec16*>(x);
    vec16* yv = reinterpret_cast<vec16*>(y);
    FOR_EACH(i, nv) {
        float f[8];
#pragma unroll
        for (int k = 0; k < LX; ++k) Vec<X>::load(ld16(xv + (LX * i + k)), f + k * Vec<X>::N);
#pragma unroll
        for (int k = 0; k < LY; ++k) yv[LY * i + k] = Vec<Y>::store(f + k * Vec<Y>::N);
    }
    FOR_TAIL(i, nv, 8, n) y[i] = from_f<Y>(to_f(x[i]));
}
extern "C" __global__ void cast_contig_f32_bf16(const float* x, bf16* y, i64 n) { cast_contig_impl(x, y, n); }
extern "C" __global__ void cast_contig_bf16_f32(const bf16* x, float* y, i64 n) { cast_contig_impl(x, y, n); }
