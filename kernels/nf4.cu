// nf4.cu — dequantization of a 4-bit (NF4 / FP4) weight with double-quantized absmax, as
// bitsandbytes defines it (crates/ops/src/nf4): out[i] = level[code_i] * absmax[i / bs], where
// the nested absmax is map[acode_b] * nested[b / nbs] + offset; both products and the sum are
// rounded in f32 one at a time (__fmul_rn / __fadd_rn: no FMA contraction, so the result is the
// CPU's bit for bit), and a bf16 output rounds the product once to nearest even.
//
// A thread owns a group of 32 elements: one 16-byte load of 32 codes (LDG.E.128), one absmax
// (a block holds at least 32 elements and starts at a multiple of 32, so a group never straddles
// two), and 32 outputs as 16-byte stores (4 for bf16, 8 for f32); the 272 levels (16 of the
// codes, 256 of the nested map) sit in shared memory. The launcher gives it ~8 blocks of 256
// threads per SM, grid-stride past that, so a weight of 4096 x 4096 (524,288 groups) fills 132
// SMs. Elements past the last whole group (n % 32) go one at a time.
//
// Floor: bytes moved per element = 0.5 (codes) + 1/64 (absmax code) + 4/16384 (nested scale) +
// 2 (bf16 out) = 2.516 B, or 4.516 B for f32 out; a 4096 x 4096 weight is 42.2 MB to bf16, at the
// copy bandwidth (4,227 GB/s, `cuMemcpyDtoD`, H200; docs/BENCHMARKS.md) 10.0 us. FLOPs (one or
// two a element) are noise. The write is 80% of the traffic: a GEMM that read the codes itself
// would save it, which this kernel leaves to a later fused dequantize-GEMM.
#include "common.cuh"

#ifdef FERRO_EMU
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
#endif

// The scale of block b: plain absmax, or the nested code through the map, times the nested
// block's scale, plus the offset.
static __device__ __forceinline__ float nf4_scale(const unsigned char* acodes, const float* absmax, const float* map, float offset,
                                                  i64 b, int nbs, int nested) {
    if (!nested) return absmax[b];
    return __fadd_rn(__fmul_rn(map[acodes[b]], absmax[b / nbs]), offset);
}

template <typename T>
static __device__ void nf4_dequant_impl(const unsigned char* packed, const unsigned char* acodes, const float* absmax,
                                        const float* tables, float offset, T* out, i64 n, int bs, int nbs, int nested, int vec) {
    // tables: the 16 levels, then the 256 levels of the nested map.
    __shared__ float lv[16 + 256];
    for (int k = threadIdx.x; k < 16 + 256; k += blockDim.x) lv[k] = tables[k];
    __syncthreads();
    const float* map = lv + 16;
    const int N = Vec<T>::N;
    i64 groups = vec ? n / 32 : 0;
    const vec16* pv = reinterpret_cast<const vec16*>(packed);
    vec16* ov = reinterpret_cast<vec16*>(out);
    FOR_EACH(g, groups) {
        float scale = nf4_scale(acodes, absmax, map, offset, g * 32 / bs, nbs, nested);
        vec16 q = ld16(pv + g);
#pragma unroll
        for (int s = 0; s < 32 / N; ++s) {
            float f[N];
#pragma unroll
            for (int k = 0; k < N; k += 2) {
                // Byte (s N + k) / 2 of the group: word >> 2, byte & 3; high nibble first.
                int byte = (s * N + k) / 2;
                unsigned b = (q.w[byte >> 2] >> (8 * (byte & 3))) & 0xffu;
                f[k] = __fmul_rn(lv[b >> 4], scale);
                f[k + 1] = __fmul_rn(lv[b & 15u], scale);
            }
            st16(ov + g * (32 / N) + s, Vec<T>::store(f));
        }
    }
    FOR_TAIL(i, groups, 32, n) {
        unsigned b = packed[i >> 1];
        unsigned c = (i & 1) ? (b & 15u) : (b >> 4);
        out[i] = from_f<T>(__fmul_rn(lv[c], nf4_scale(acodes, absmax, map, offset, i / bs, nbs, nested)));
    }
}

// packed: ceil(n / 2) bytes of codes; acodes: one 8-bit code per block (nested), else unused;
// absmax: the nested scales (one per nbs blocks) when nested, else one f32 per block; tables: 272
// f32; vec: packed and out 16-byte aligned (the launcher checks), else one element per thread.
#define NF4_KERNEL(suffix, T)                                                                                          \
    extern "C" __global__ void nf4_dequant_##suffix(const unsigned char* packed, const unsigned char* acodes,         \
                                                    const float* absmax, const float* tables, float offset, T* out, \
                                                    i64 n, int bs, int nbs, int nested, int vec) {                   \
        nf4_dequant_impl<T>(packed, acodes, absmax, tables, offset, out, n, bs, nbs, nested, vec);                     \
    }
NF4_KERNEL(f32, float)
NF4_KERNEL(bf16, bf16)
