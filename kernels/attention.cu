// attention.cu — causal flash attention, forward and backward, with native GQA: query head h
// reads kv head h / (hq / hkv) in place, K/V are never copied per query head. Layouts:
// q, o, dq (b, hq, t, d); k, v, dk, dv (b, hkv, t, d); lse and the backward's D = rowsum(dO*O)
// (b, hq, t) in f32. Nothing of size t x t is ever materialised.
//
// bf16, head dim 64 / 128: tensor cores via mma.sync.m16n8k16 (bf16 in, fp32 accumulate) for
// every matrix product, FlashAttention-2 structure:
//   forward   block = 64 query rows (4 warps x 16), K/V tiles of 64 rows staged in shared
//             memory, online softmax in registers, P reused from the S accumulators as the A
//             operand of P·V; saves lse.
//   dK/dV     block = 64 kv rows of one kv head (4 warps x 16), loops over the group's query
//             heads and query tiles (32 rows) in a fixed order, accumulating dK, dV in
//             registers: deterministic, no atomics.
//   dQ        a separate pass: block = 64 query rows, loops over kv tiles (32 rows).
// f32 (any head dim <= 256) and bf16 with other head dims use the SIMT kernels at the end
// (one warp per row, same math, same determinism, slower).
#include "common.cuh"

// ---- mma.sync fragment helpers (m16n8k16, row.col) ------------------------------------------
// lane = 4*g + tq. A (16x16): a0 (g, 2tq..+1), a1 (g+8, 2tq..), a2 (g, 2tq+8..), a3 (g+8, 2tq+8..).
// B (16x8, k x n): b0 (k 2tq..+1, n g), b1 (k 2tq+8..+9, n g). C (16x8): c0,c1 (g, 2tq..+1),
// c2,c3 (g+8, 2tq..+1).
static __device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, const unsigned* b) {
#ifdef FERRO_EMU
    ferro_emu::mma_m16n8k16_bf16(c, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
static __device__ __forceinline__ unsigned ld_pair(const bf16* p) { return *reinterpret_cast<const unsigned*>(p); }
static __device__ __forceinline__ unsigned pack2(bf16 lo, bf16 hi) {
    return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
}
// A[r][k] = s[(r0 + r) * st + k0 + k]
static __device__ __forceinline__ void ld_a(unsigned* a, const bf16* s, int st, int r0, int k0, int g, int tq) {
    a[0] = ld_pair(s + (r0 + g) * st + k0 + 2 * tq);
    a[1] = ld_pair(s + (r0 + g + 8) * st + k0 + 2 * tq);
    a[2] = ld_pair(s + (r0 + g) * st + k0 + 2 * tq + 8);
    a[3] = ld_pair(s + (r0 + g + 8) * st + k0 + 2 * tq + 8);
}
// A fragment straight from global memory rows (row index >= t reads as zero).
static __device__ __forceinline__ void ld_a_global(unsigned* a, const bf16* base, int d, int r0, int t, int k0, int g, int tq) {
    int ra = r0 + g, rb = r0 + g + 8;
    a[0] = ra < t ? ld_pair(base + (i64)ra * d + k0 + 2 * tq) : 0u;
    a[1] = rb < t ? ld_pair(base + (i64)rb * d + k0 + 2 * tq) : 0u;
    a[2] = ra < t ? ld_pair(base + (i64)ra * d + k0 + 2 * tq + 8) : 0u;
    a[3] = rb < t ? ld_pair(base + (i64)rb * d + k0 + 2 * tq + 8) : 0u;
}
// B[k][n] = s[(n0 + n) * st + k0 + k]   (rows of s indexed by n, k contiguous: "K^T")
static __device__ __forceinline__ void ld_b_nk(unsigned* b, const bf16* s, int st, int n0, int k0, int g, int tq) {
    b[0] = ld_pair(s + (n0 + g) * st + k0 + 2 * tq);
    b[1] = ld_pair(s + (n0 + g) * st + k0 + 2 * tq + 8);
}
// B[k][n] = s[(k0 + k) * st + n0 + n]   (rows of s indexed by k: "V")
static __device__ __forceinline__ void ld_b_kn(unsigned* b, const bf16* s, int st, int k0, int n0, int g, int tq) {
    b[0] = pack2(s[(k0 + 2 * tq) * st + n0 + g], s[(k0 + 2 * tq + 1) * st + n0 + g]);
    b[1] = pack2(s[(k0 + 2 * tq + 8) * st + n0 + g], s[(k0 + 2 * tq + 9) * st + n0 + g]);
}
// C accumulators of two adjacent n-tiles -> the A fragment of the next product (k = those 16 cols).
static __device__ __forceinline__ void c_to_a(unsigned* a, const float* c0, const float* c1) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
}
// Stage rows [r0, r0 + rows) of a (t, D) matrix into shared memory (row stride ST), zero past t.
template <int D, int ST>
static __device__ __forceinline__ void stage_rows(bf16* s, const bf16* src, int r0, int rows, int t) {
    for (int idx = threadIdx.x; idx < rows * (D / 2); idx += blockDim.x) {
        int r = idx / (D / 2), c = (idx % (D / 2)) * 2;
        unsigned v = (r0 + r < t) ? ld_pair(src + (i64)(r0 + r) * D + c) : 0u;
        *reinterpret_cast<unsigned*>(s + r * ST + c) = v;
    }
}
static __device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
static __device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// ---- the prologue the tensor-core kernels share -----------------------------------------------
// A thread's place in a block of FLASH_THREADS: its warp (16 rows of the block each) and its
// fragment coordinates, group g = lane / 4 and thread-in-quad tq = lane % 4.
struct FlashLane {
    int warp, g, tq;
};
static __device__ __forceinline__ FlashLane flash_lane() {
    int lane = threadIdx.x & 31;
    return FlashLane{(int)(threadIdx.x >> 5), lane >> 2, lane & 3};
}
// The (t, D) rows of head `head` of batch `b` in a (b, heads, t, D) tensor.
template <int D, typename T>
static __device__ __forceinline__ T* head_rows(T* x, int b, int heads, int head, int t) {
    return x + (i64)(b * heads + head) * t * D;
}
// The (BC, ST) tiles of K and V at the start of a block's dynamic shared memory.
struct KvTiles {
    bf16 *sK, *sV;
};
template <int BC, int ST>
static __device__ __forceinline__ KvTiles kv_tiles(unsigned char* smem) {
    bf16* sK = reinterpret_cast<bf16*>(smem);
    return KvTiles{sK, sK + BC * ST};
}
// A block of FLASH_ROWS query rows of one query head (grid (ceil(t/64), hq, b)), as the forward
// and dQ see it: batch b, query head h, the kv head hk it reads, its first row q0, and the
// rows of its Q, K and V heads.
template <int D>
struct QueryBlock {
    int b, h, hk, q0;
    const bf16 *qh, *kh, *vh;
};
template <int D>
static __device__ __forceinline__ QueryBlock<D> query_block(const bf16* q, const bf16* k, const bf16* v, int hq, int hkv, int t) {
    int b = blockIdx.z, h = blockIdx.y, hk = h / (hq / hkv);
    return QueryBlock<D>{b, h, hk, (int)blockIdx.x * FLASH_ROWS, head_rows<D>(q, b, hq, h, t), head_rows<D>(k, b, hkv, hk, t),
                         head_rows<D>(v, b, hkv, hk, t)};
}
// acc += P X for this warp's 16 rows: P (16, BC) is in mma C fragments (s), reused as the A
// operand; X is a (BC, D) tile in shared memory with row stride ST.
template <int D, int ST, int BC>
static __device__ __forceinline__ void mma_c_by_tile(float (*acc)[4], float (*s)[4], const bf16* sX, int g, int tq) {
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
        unsigned a[4];
        c_to_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            unsigned bf[2];
            ld_b_kn(bf, sX, ST, kk * 16, n * 8, g, tq);
            mma_bf16(acc[n], a, bf);
        }
    }
}
// The two products a backward pass starts a tile with, for this warp's 16 rows against the N rows
// of two shared tiles (row stride ST): x = A0 B0^T and y = A1 B1^T over the head dim, from zero,
// where load_a(a, i, k) loads the A fragment of operand i (0 or 1) at column k.
template <int D, int ST, int N, typename LoadA>
static __device__ __forceinline__ void mma_two_products(float (*x)[4], float (*y)[4], const LoadA& load_a, const bf16* sB0,
                                                        const bf16* sB1, int g, int tq) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) x[j][e] = y[j][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned a[4], bf[2];
            load_a(a, 0, kk * 16);
            ld_b_nk(bf, sB0, ST, j * 8, kk * 16, g, tq);
            mma_bf16(x[j], a, bf);
            load_a(a, 1, kk * 16);
            ld_b_nk(bf, sB1, ST, j * 8, kk * 16, g, tq);
            mma_bf16(y[j], a, bf);
        }
    }
}
// Stages kv rows [k0, k0 + BC) of K and V into sK and sV, between barriers: every thread is done
// with the previous tile before it is overwritten, and this one is complete before it is read.
template <int D, int ST, int BC>
static __device__ __forceinline__ void stage_kv_tile(bf16* sK, bf16* sV, const bf16* kh, const bf16* vh, int k0, int t) {
    __syncthreads();
    stage_rows<D, ST>(sK, kh, k0, BC, t);
    stage_rows<D, ST>(sV, vh, k0, BC, t);
    __syncthreads();
}

// ---- forward (bf16, tensor cores) -------------------------------------------------------------
// grid (ceil(t/64), hq, b), block 128, dynamic smem 2 * 64 * (D + 8) * 2 bytes.
template <int D>
static __device__ void flash_fwd_impl(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, int hq, int hkv, int t, float scale) {
    constexpr int BR = FLASH_ROWS, BC = FLASH_FWD_TILE, ST = D + FLASH_PAD;
    DYNAMIC_SMEM(smem);
    auto [sK, sV] = kv_tiles<BC, ST>(smem);
    auto [warp, g, tq] = flash_lane();
    auto [b, h, hk, q0, qh, kh, vh] = query_block<D>(q, k, v, hq, hkv, t);
    unsigned qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ld_a_global(qf[kk], qh, D, q0 + warp * 16, t, kk * 16, g, tq);
    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
    int rows[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    int kv_end = min(t, q0 + BR);
    for (int k0 = 0; k0 < kv_end; k0 += BC) {
        stage_kv_tile<D, ST, BC>(sK, sV, kh, vh, k0, t);
        float s[BC / 8][4];
#pragma unroll
        for (int j = 0; j < BC / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned bf[2];
                ld_b_nk(bf, sK, ST, j * 8, kk * 16, g, tq);
                mma_bf16(s[j], qf[kk], bf);
            }
        }
        float mx[2] = {m_r[0], m_r[1]};
#pragma unroll
        for (int j = 0; j < BC / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int col = k0 + j * 8 + 2 * tq + (e & 1), row = rows[e >> 1];
                float val = (col > row || col >= t) ? -INFINITY : s[j][e] * scale;
                s[j][e] = val;
                mx[e >> 1] = fmaxf(mx[e >> 1], val);
            }
        float rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = quad_max(mx[r]);  // finite: column k0 <= every row of this block
            float alpha = expf(m_r[r] - mx[r]);
            l_r[r] *= alpha;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) { acc[n][2 * r] *= alpha; acc[n][2 * r + 1] *= alpha; }
            m_r[r] = mx[r];
        }
#pragma unroll
        for (int j = 0; j < BC / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) { float p = expf(s[j][e] - m_r[e >> 1]); s[j][e] = p; rs[e >> 1] += p; }
        l_r[0] += quad_sum(rs[0]);
        l_r[1] += quad_sum(rs[1]);
        mma_c_by_tile<D, ST, BC>(acc, s, sV, g, tq);  // O += P V
    }
    bf16* oh = head_rows<D>(o, b, hq, h, t);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= t) continue;
        float inv = 1.0f / l_r[r];
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<__nv_bfloat162*>(oh + (i64)rows[r] * D + n * 8 + 2 * tq) =
                __floats2bfloat162_rn(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
        if (tq == 0) lse[(i64)(b * hq + h) * t + rows[r]] = m_r[r] + logf(l_r[r]);
    }
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_fwd_bf16_d64(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, int hq, int hkv, int t, float scale) {
    flash_fwd_impl<64>(q, k, v, o, lse, hq, hkv, t, scale);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_fwd_bf16_d128(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, int hq, int hkv, int t, float scale) {
    flash_fwd_impl<128>(q, k, v, o, lse, hq, hkv, t, scale);
}

// ---- backward preprocessing: D = rowsum(dO * O), one warp per row ------------------------------
template <typename T>
static __device__ void attn_bwd_dot_impl(const T* dout, const T* out, float* dvec, i64 rows, int d) {
    i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float acc = 0.0f;
    for (int x = lane; x < d; x += 32) acc += to_f(dout[row * d + x]) * to_f(out[row * d + x]);
    acc = warp_sum(acc);
    if (lane == 0) dvec[row] = acc;
}
extern "C" __global__ void attn_bwd_dot_f32(const float* dout, const float* out, float* dvec, i64 rows, int d) { attn_bwd_dot_impl(dout, out, dvec, rows, d); }
extern "C" __global__ void attn_bwd_dot_bf16(const bf16* dout, const bf16* out, float* dvec, i64 rows, int d) { attn_bwd_dot_impl(dout, out, dvec, rows, d); }

// ---- backward dK, dV (bf16, tensor cores) -----------------------------------------------------
// grid (ceil(t/64), hkv, b), block 128, dynamic smem (2*64 + 2*32) * (D + 8) * 2 + 2 * 32 * 4.
template <int D>
static __device__ void flash_bwd_dkdv_impl(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                           const float* dvec, bf16* dk, bf16* dv, int hq, int hkv, int t, float scale) {
    constexpr int BC = FLASH_ROWS, BR = FLASH_BWD_TILE, ST = D + FLASH_PAD;
    DYNAMIC_SMEM(smem);
    auto [sK, sV] = kv_tiles<BC, ST>(smem);
    bf16* sQ = sV + BC * ST;                   // (BR, ST)
    bf16* sO = sQ + BR * ST;                   // (BR, ST) dO
    float* sL = reinterpret_cast<float*>(sO + BR * ST);  // (BR) lse
    float* sD = sL + BR;                                  // (BR) D
    int b = blockIdx.z, hk = blockIdx.y, group = hq / hkv;
    auto [warp, g, tq] = flash_lane();
    int k0 = blockIdx.x * BC;
    const bf16* kh = head_rows<D>(k, b, hkv, hk, t);
    const bf16* vh = head_rows<D>(v, b, hkv, hk, t);
    stage_rows<D, ST>(sK, kh, k0, BC, t);
    stage_rows<D, ST>(sV, vh, k0, BC, t);
    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.0f;
    int kvrow[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
    for (int gi = 0; gi < group; ++gi) {
        int h = hk * group + gi;
        const bf16* qh = head_rows<D>(q, b, hq, h, t);
        const bf16* oh = head_rows<D>(dout, b, hq, h, t);
        const float* lh = lse + (i64)(b * hq + h) * t;
        const float* dh = dvec + (i64)(b * hq + h) * t;
        for (int i0 = (k0 / BR) * BR; i0 < t; i0 += BR) {
            __syncthreads();
            stage_rows<D, ST>(sQ, qh, i0, BR, t);
            stage_rows<D, ST>(sO, oh, i0, BR, t);
            for (int r = threadIdx.x; r < BR; r += blockDim.x) {
                sL[r] = i0 + r < t ? lh[i0 + r] : 0.0f;
                sD[r] = i0 + r < t ? dh[i0 + r] : 0.0f;
            }
            __syncthreads();
            float p[BR / 8][4], ds[BR / 8][4];
            // S^T = K Q^T and dP^T = V dO^T
            auto kv_rows = [sK = sK, sV = sV, r0 = warp * 16, g = g, tq = tq](unsigned* a, int i, int k) { ld_a(a, i ? sV : sK, ST, r0, k, g, tq); };
            mma_two_products<D, ST, BR>(p, ds, kv_rows, sQ, sO, g, tq);
#pragma unroll
            for (int j = 0; j < BR / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int qc = j * 8 + 2 * tq + (e & 1), qrow = i0 + qc, kr = kvrow[e >> 1];
                    bool ok = qrow >= kr && qrow < t && kr < t;
                    float pv = ok ? expf(p[j][e] * scale - sL[qc]) : 0.0f;
                    p[j][e] = pv;
                    ds[j][e] = pv * (ds[j][e] - sD[qc]) * scale;
                }
            }
#pragma unroll
            for (int kk = 0; kk < BR / 16; ++kk) {
                unsigned ap[4], as[4];
                c_to_a(ap, p[2 * kk], p[2 * kk + 1]);
                c_to_a(as, ds[2 * kk], ds[2 * kk + 1]);
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    unsigned bf[2];
                    ld_b_kn(bf, sO, ST, kk * 16, n * 8, g, tq);
                    mma_bf16(dva[n], ap, bf);  // dV += P^T dO
                    ld_b_kn(bf, sQ, ST, kk * 16, n * 8, g, tq);
                    mma_bf16(dka[n], as, bf);  // dK += dS^T Q
                }
            }
        }
    }
    bf16* dkh = head_rows<D>(dk, b, hkv, hk, t);
    bf16* dvh = head_rows<D>(dv, b, hkv, hk, t);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (kvrow[r] >= t) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            i64 off = (i64)kvrow[r] * D + n * 8 + 2 * tq;
            *reinterpret_cast<__nv_bfloat162*>(dkh + off) = __floats2bfloat162_rn(dka[n][2 * r], dka[n][2 * r + 1]);
            *reinterpret_cast<__nv_bfloat162*>(dvh + off) = __floats2bfloat162_rn(dva[n][2 * r], dva[n][2 * r + 1]);
        }
    }
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_bwd_dkdv_bf16_d64(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                                                       const float* dvec, bf16* dk, bf16* dv, int hq, int hkv, int t, float scale) {
    flash_bwd_dkdv_impl<64>(q, k, v, dout, lse, dvec, dk, dv, hq, hkv, t, scale);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_bwd_dkdv_bf16_d128(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                                                        const float* dvec, bf16* dk, bf16* dv, int hq, int hkv, int t, float scale) {
    flash_bwd_dkdv_impl<128>(q, k, v, dout, lse, dvec, dk, dv, hq, hkv, t, scale);
}

// ---- backward dQ (bf16, tensor cores) ---------------------------------------------------------
// grid (ceil(t/64), hq, b), block 128, dynamic smem 2 * 32 * (D + 8) * 2.
template <int D>
static __device__ void flash_bwd_dq_impl(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                         const float* dvec, bf16* dq, int hq, int hkv, int t, float scale) {
    constexpr int BR = FLASH_ROWS, BC = FLASH_BWD_TILE, ST = D + FLASH_PAD;
    DYNAMIC_SMEM(smem);
    auto [sK, sV] = kv_tiles<BC, ST>(smem);
    auto [warp, g, tq] = flash_lane();
    auto [b, h, hk, q0, qh, kh, vh] = query_block<D>(q, k, v, hq, hkv, t);
    const bf16* oh = head_rows<D>(dout, b, hq, h, t);
    int rows[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float lr[2], dr[2];
    for (int r = 0; r < 2; ++r) {
        lr[r] = rows[r] < t ? lse[(i64)(b * hq + h) * t + rows[r]] : 0.0f;
        dr[r] = rows[r] < t ? dvec[(i64)(b * hq + h) * t + rows[r]] : 0.0f;
    }
    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    int kv_end = min(t, q0 + BR);
    for (int k0 = 0; k0 < kv_end; k0 += BC) {
        stage_kv_tile<D, ST, BC>(sK, sV, kh, vh, k0, t);
        float s[BC / 8][4], dp[BC / 8][4];
        // S = Q K^T and dP = dO V^T
        auto q_rows = [qh = qh, oh, r0 = q0 + warp * 16, t, g = g, tq = tq](unsigned* a, int i, int k) {
            ld_a_global(a, i ? oh : qh, D, r0, t, k, g, tq);
        };
        mma_two_products<D, ST, BC>(s, dp, q_rows, sK, sV, g, tq);
#pragma unroll
        for (int j = 0; j < BC / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int col = k0 + j * 8 + 2 * tq + (e & 1), row = rows[e >> 1];
                bool ok = col <= row && col < t && row < t;
                float pv = ok ? expf(s[j][e] * scale - lr[e >> 1]) : 0.0f;
                s[j][e] = pv * (dp[j][e] - dr[e >> 1]) * scale;  // dS
            }
        }
        mma_c_by_tile<D, ST, BC>(acc, s, sK, g, tq);  // dQ += dS K
    }
    bf16* dqh = head_rows<D>(dq, b, hq, h, t);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= t) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<__nv_bfloat162*>(dqh + (i64)rows[r] * D + n * 8 + 2 * tq) = __floats2bfloat162_rn(acc[n][2 * r], acc[n][2 * r + 1]);
    }
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_bwd_dq_bf16_d64(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                                                     const float* dvec, bf16* dq, int hq, int hkv, int t, float scale) {
    flash_bwd_dq_impl<64>(q, k, v, dout, lse, dvec, dq, hq, hkv, t, scale);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_bwd_dq_bf16_d128(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                                                      const float* dvec, bf16* dq, int hq, int hkv, int t, float scale) {
    flash_bwd_dq_impl<128>(q, k, v, dout, lse, dvec, dq, hq, hkv, t, scale);
}

// ---- SIMT kernels: f32 (and bf16 with head dims other than 64/128), d <= 256 ------------------
// One warp per row; lane x holds elements x, x+32, ... of the row. Same math, fixed order.
template <typename T>
static __device__ __forceinline__ float simt_dot(const float* a, const T* b, int d, int lane) {
    float acc = 0.0f;
#pragma unroll
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) { int x = lane + 32 * e; if (x < d) acc += a[e] * to_f(b[x]); }
    return warp_sum(acc);
}
template <typename T>
static __device__ __forceinline__ void simt_load(float* a, const T* src, int d, int lane) {
#pragma unroll
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) { int x = lane + 32 * e; a[e] = x < d ? to_f(src[x]) : 0.0f; }
}
// The row of a (rows, d) view that a warp of the SIMT kernels owns.
static __device__ __forceinline__ i64 simt_warp_row() { return ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
// Query row `row` of a (b, hq, t, d) tensor: its position i in the sequence and the (t, d) rows of
// the K and V heads it reads.
template <typename T>
struct SimtQueryRow {
    int i;
    const T *kh, *vh;
};
template <typename T>
static __device__ __forceinline__ SimtQueryRow<T> simt_query_row(i64 row, const T* k, const T* v, int hq, int hkv, int t, int d) {
    i64 bh = row / t;
    int i = (int)(row % t), h = (int)(bh % hq), b = (int)(bh / hq), hk = h / (hq / hkv);
    return SimtQueryRow<T>{i, k + (i64)(b * hkv + hk) * t * d, v + (i64)(b * hkv + hk) * t * d};
}
// warp per (b, h, i): rows = b*hq*t
template <typename T>
static __device__ void attn_fwd_simt_impl(const T* q, const T* k, const T* v, T* o, float* lse, int b_, int hq, int hkv, int t, int d, float scale) {
    i64 row = simt_warp_row();
    int lane = threadIdx.x & 31;
    if (row >= (i64)b_ * hq * t) return;
    auto [i, kh, vh] = simt_query_row(row, k, v, hq, hkv, t, d);
    float qi[ATTN_SIMT_PER_LANE], acc[ATTN_SIMT_PER_LANE];
    simt_load(qi, q + row * d, d, lane);
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) acc[e] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j = 0; j <= i; ++j) {
        float s = simt_dot(qi, kh + (i64)j * d, d, lane) * scale;
        float mn = fmaxf(m, s), alpha = expf(m - mn), p = expf(s - mn);
        l = l * alpha + p;
#pragma unroll
        for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) { int x = lane + 32 * e; if (x < d) acc[e] = acc[e] * alpha + p * to_f(vh[(i64)j * d + x]); }
        m = mn;
    }
#pragma unroll
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) { int x = lane + 32 * e; if (x < d) o[row * d + x] = from_f<T>(acc[e] / l); }
    if (lane == 0) lse[row] = m + logf(l);
}
// warp per (b, hkv, j): loops the group's query heads, then i >= j, in order.
template <typename T>
static __device__ void attn_bwd_dkdv_simt_impl(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* dvec,
                                               T* dk, T* dv, int b_, int hq, int hkv, int t, int d, float scale) {
    i64 row = simt_warp_row();
    int lane = threadIdx.x & 31;
    if (row >= (i64)b_ * hkv * t) return;
    i64 bk = row / t;
    int j = (int)(row % t), group = hq / hkv;
    float kj[ATTN_SIMT_PER_LANE], vj[ATTN_SIMT_PER_LANE], dka[ATTN_SIMT_PER_LANE], dva[ATTN_SIMT_PER_LANE];
    simt_load(kj, k + row * d, d, lane);
    simt_load(vj, v + row * d, d, lane);
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) dka[e] = dva[e] = 0.0f;
    for (int gi = 0; gi < group; ++gi) {
        i64 bh = bk * group + gi;  // query heads of one kv head are contiguous
        for (int i = j; i < t; ++i) {
            const T* qi = q + (bh * t + i) * d;
            const T* doi = dout + (bh * t + i) * d;
            float p = expf(simt_dot(kj, qi, d, lane) * scale - lse[bh * t + i]);
            float ds = p * (simt_dot(vj, doi, d, lane) - dvec[bh * t + i]) * scale;
#pragma unroll
            for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) {
                int x = lane + 32 * e;
                if (x < d) { dva[e] += p * to_f(doi[x]); dka[e] += ds * to_f(qi[x]); }
            }
        }
    }
#pragma unroll
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) { int x = lane + 32 * e; if (x < d) { dk[row * d + x] = from_f<T>(dka[e]); dv[row * d + x] = from_f<T>(dva[e]); } }
}
// warp per (b, h, i)
template <typename T>
static __device__ void attn_bwd_dq_simt_impl(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* dvec,
                                             T* dq, int b_, int hq, int hkv, int t, int d, float scale) {
    i64 row = simt_warp_row();
    int lane = threadIdx.x & 31;
    if (row >= (i64)b_ * hq * t) return;
    auto [i, kh, vh] = simt_query_row(row, k, v, hq, hkv, t, d);
    float qi[ATTN_SIMT_PER_LANE], doi[ATTN_SIMT_PER_LANE], acc[ATTN_SIMT_PER_LANE];
    simt_load(qi, q + row * d, d, lane);
    simt_load(doi, dout + row * d, d, lane);
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) acc[e] = 0.0f;
    float l = lse[row], dd = dvec[row];
    for (int j = 0; j <= i; ++j) {
        float p = expf(simt_dot(qi, kh + (i64)j * d, d, lane) * scale - l);
        float ds = p * (simt_dot(doi, vh + (i64)j * d, d, lane) - dd) * scale;
#pragma unroll
        for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) { int x = lane + 32 * e; if (x < d) acc[e] += ds * to_f(kh[(i64)j * d + x]); }
    }
#pragma unroll
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) { int x = lane + 32 * e; if (x < d) dq[row * d + x] = from_f<T>(acc[e]); }
}
#define ATTN_SIMT(suffix, T)                                                                                                         \
    extern "C" __global__ void attn_fwd_simt_##suffix(const T* q, const T* k, const T* v, T* o, float* lse, int b, int hq, int hkv, \
                                                      int t, int d, float scale) {                                                  \
        attn_fwd_simt_impl(q, k, v, o, lse, b, hq, hkv, t, d, scale);                                                                \
    }                                                                                                                                \
    extern "C" __global__ void attn_bwd_dkdv_simt_##suffix(const T* q, const T* k, const T* v, const T* dout, const float* lse,     \
                                                           const float* dvec, T* dk, T* dv, int b, int hq, int hkv, int t, int d,   \
                                                           float scale) {                                                           \
        attn_bwd_dkdv_simt_impl(q, k, v, dout, lse, dvec, dk, dv, b, hq, hkv, t, d, scale);                                          \
    }                                                                                                                                \
    extern "C" __global__ void attn_bwd_dq_simt_##suffix(const T* q, const T* k, const T* v, const T* dout, const float* lse,       \
                                                         const float* dvec, T* dq, int b, int hq, int hkv, int t, int d, float scale) { \
        attn_bwd_dq_simt_impl(q, k, v, dout, lse, dvec, dq, b, hq, hkv, t, d, scale);                                                \
    }
ATTN_SIMT(f32, float)
ATTN_SIMT(bf16, bf16)
