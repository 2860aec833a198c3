// attention.cu — causal flash attention, forward and backward, with native GQA: query head h
// reads kv head h / (hq / hkv) in place, K/V are never copied per query head. Layouts:
// q, o, dq (b, hq, t, d); k, v, dk, dv (b, hkv, t, d); lse and the backward's D = rowsum(dO*O)
// (b, hq, t) in f32. Nothing of size t x t is ever materialised. The tensor-core kernels (and D's)
// take every (b, heads, t, d) tensor in either head layout (`layout`, constants.cuh): HEAD_MAJOR,
// or TIME_MAJOR, the projections' (b, t, heads, d), where a head's rows are heads * d apart.
//
// bf16, head dim 64 / 128: tensor cores via mma.sync.m16n8k16 (bf16 in, fp32 accumulate) for
// every matrix product, FlashAttention-2 structure, every block W warps x 16 rows (W = 8: 128 rows;
// the `_w4` kernels, W = 4: 64 rows), its tiles double-buffered with cp.async and its mma operands
// loaded with ldmatrix:
//   forward   block = 16 W query rows, Q in registers, K/V tiles of 128 (d64) / 64 (d128) rows,
//             online softmax in registers (exp2, log2(e) folded into the scale), P reused from
//             the S accumulators as the A operand of P·V; tiles above a warp's diagonal are
//             skipped; saves lse.
//   dK/dV     block = 16 W kv rows of one kv head, loops over the group's query heads and query
//             tiles (64 / 32 rows) in a fixed order, accumulating dK, dV in registers:
//             deterministic, no atomics.
//   dQ        a separate pass: block = 16 W query rows, loops over kv tiles (64 / 32 rows).
// f32 (any head dim <= 256) and bf16 with other head dims use the SIMT kernels at the end
// (one warp per row, same math, same determinism, slower).
//
// Packed rows (varlen): a batch row may hold several sequences (segments) one after another, and
// a query sees only the keys of its own segment. `seg` is then the per-token (2, b, t) i32 of
// crates/ops/src/segments.rs: the first position of each token's segment, then one past its
// last. The flash kernels take it in their `_seg` twins, the same templates with SEG = true
// (with SEG = false the segment bounds are compile-time constants, nothing is read).
//
// Sliding window (Mistral, Qwen2, Gemma 3): query i sees key j when i - w < j <= i, inside its
// segment (positions count from the segment start, which selects the same keys). A window is a
// segment start that moves with the row, so the `_seg` kernels take it as an argument, `window`
// (1..t; t: none), beside `seg`, which may be null (no segments: a window alone), and both go
// through one bound (SegBounds): a block starts its tile loop at the first tile its rows reach
// (segment start, i - w + 1), dK/dV stops at the last query that sees its rows (segment end,
// j + w - 1), a warp skips every tile wholly outside its rows' bounds and masks only the tiles a
// bound crosses: the tiles visited grow with w, not t. The plain kernels stay plain causal (their
// main loops compile as before); each warp of a `_seg` kernel writes the number of causal tiles it
// skipped to `skipped` (when not null: a test's count). The SIMT kernels take a nullable `seg`
// and the window and bound their loops by them.
#include "common.cuh"

// ---- mma.sync m16n8k16 (row.col, bf16 in, f32 accumulate) and its fragments --------------------
// lane = 4*g + tq. A (16x16): a0 (g, 2tq..+1), a1 (g+8, 2tq..), a2 (g, 2tq+8..), a3 (g+8, 2tq+8..).
// B (16x8, k x n): b0 (k 2tq..+1, n g), b1 (k 2tq+8..+9, n g). C (16x8): c0,c1 (g, 2tq..+1),
// c2,c3 (g+8, 2tq..+1). Every operand that lives in shared memory is loaded with one ldmatrix.x4
// (four 8x8 matrices; lane L gives the address of row L % 8 of matrix L / 8).
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
// A fragment: A[r][k] = s[(r0 + r) * st + k0 + k]. Matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15)
// in the order a0..a3: lane L addresses row L % 16, column 8 (L / 16).
static __device__ __forceinline__ void ldsm_a(unsigned* a, const bf16* s, int st, int r0, int k0, int lane) {
    ldsm<4, false>(a, s + (r0 + (lane & 15)) * st + k0 + 8 * (lane >> 4));
}
// B fragments of two n-tiles, B[k][n] = s[(n0 + n) * st + k0 + k] (a tile stored n-major: "K^T"):
// b[0..1] for columns n0..n0+7, b[2..3] for n0+8..n0+15. Matrix i holds rows n0 + 8 (i / 2) + 0..7
// and columns k0 + 8 (i % 2) + 0..7: lane L addresses row n0 + L % 8 + 8 (L / 16), column
// k0 + 8 ((L / 8) % 2).
static __device__ __forceinline__ void ldsm_b_nk(unsigned* b, const bf16* s, int st, int n0, int k0, int lane) {
    ldsm<4, false>(b, s + (n0 + (lane & 7) + 8 * (lane >> 4)) * st + k0 + 8 * ((lane >> 3) & 1));
}
// B fragments of two n-tiles, B[k][n] = s[(k0 + k) * st + n0 + n] (a tile stored k-major: "V"),
// through ldmatrix.trans: matrix i holds rows k0 + 8 (i % 2) + 0..7, columns n0 + 8 (i / 2) + 0..7.
static __device__ __forceinline__ void ldsm_b_kn(unsigned* b, const bf16* s, int st, int k0, int n0, int lane) {
    ldsm<4, true>(b, s + (k0 + (lane & 15)) * st + n0 + 8 * (lane >> 4));
}
// C accumulators of two adjacent n-tiles -> the A fragment of the next product (k = those 16 cols).
static __device__ __forceinline__ void c_to_a(unsigned* a, const float* c0, const float* c1) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
}
static __device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
static __device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
// acc (16 x 16 NP) += A B over K = 16 KK: at k-step kk, load_a(a, kk) gives the A fragment
// once, then for each pair of n-tiles np, load_b(b, kk, np) gives the B fragments of n-tiles
// 2 np (b[0..1]) and 2 np + 1 (b[2..3]).
template <int KK, int NP, typename LoadA, typename LoadB>
static __device__ __forceinline__ void mma_tiles(float (*acc)[4], const LoadA& load_a, const LoadB& load_b) {
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
        unsigned a[4];
        load_a(a, kk);
#pragma unroll
        for (int np = 0; np < NP; ++np) {
            unsigned bf[4];
            load_b(bf, kk, np);
            mma_bf16(acc[2 * np], a, bf);
            mma_bf16(acc[2 * np + 1], a, bf + 2);
        }
    }
}
// (16 x N) += A (16 x K) B, A from shared rows [r0, r0 + 16) (ldsm_a), B an n-major tile
// (ldsm_b_nk) of N rows: acc[j] is n-tile j. K and N multiples of 16.
template <int K, int N>
static __device__ __forceinline__ void mma_rows_by_nk(float (*acc)[4], const bf16* sA, int r0, const bf16* sB, int lane) {
    constexpr int ST = K + FLASH_PAD;
    mma_tiles<K / 16, N / 16>(
        acc, [&](unsigned* a, int kk) { ldsm_a(a, sA, ST, r0, kk * 16, lane); },
        [&](unsigned* b, int kk, int np) { ldsm_b_nk(b, sB, ST, np * 16, kk * 16, lane); });
}
// acc (16 x D) += P (16 x K) X, P in C fragments (p[j] is k-tile j of 8 columns), reused as the A
// operand; X a k-major (K, D) tile in shared memory (ldsm_b_kn).
template <int D, int K>
static __device__ __forceinline__ void mma_c_by_kn(float (*acc)[4], float (*p)[4], const bf16* sX, int lane) {
    constexpr int ST = D + FLASH_PAD;
    mma_tiles<K / 16, D / 16>(
        acc, [&](unsigned* a, int kk) { c_to_a(a, p[2 * kk], p[2 * kk + 1]); },
        [&](unsigned* b, int kk, int np) { ldsm_b_kn(b, sX, ST, kk * 16, np * 16, lane); });
}
template <int N>
static __device__ __forceinline__ void zero_acc(float (*acc)[4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}
// Issues cp.async for rows [r0, r0 + ROWS) of a (t, D) matrix whose rows are `rs` elements apart
// into shared rows of stride D + PAD, 16 bytes per copy, the block's NT threads striding over the
// chunks; rows past t are zero-filled (their source address is row 0's, which is not read). The
// caller commits the group.
template <int D, int ROWS, int NT>
static __device__ __forceinline__ void load_rows_async(bf16* s, const bf16* src, int r0, int t, int rs) {
    constexpr int CH = D / 8, ST = D + FLASH_PAD;
    static_assert((ROWS * CH) % NT == 0, "whole chunks per thread");
#pragma unroll
    for (int it = 0; it < ROWS * CH / NT; ++it) {
        int idx = it * NT + (int)threadIdx.x, r = idx / CH, c = (idx % CH) * 8;
        bool ok = r0 + r < t;
        cp_async<16>(s + r * ST + c, src + (ok ? (i64)(r0 + r) * rs + c : 0), ok);
    }
}
// Issues cp.async for n f32 values [r0, r0 + n) of a length-t vector (threads [base, base + n)),
// zero past t.
static __device__ __forceinline__ void load_vec_async(float* s, const float* src, int r0, int n, int t, int base) {
    int i = (int)threadIdx.x - base;
    if (i >= 0 && i < n) {
        bool ok = r0 + i < t;
        cp_async<4>(s + i, src + (ok ? r0 + i : 0), ok);
    }
}

// ---- the prologue the tensor-core kernels share -----------------------------------------------
// A thread's place in a block: its warp (16 rows of the block each), its lane, and
// its fragment coordinates, group g = lane / 4 and thread-in-quad tq = lane % 4.
struct FlashLane {
    int warp, lane, g, tq;
};
static __device__ __forceinline__ FlashLane flash_lane() {
    int lane = threadIdx.x & 31;
    return FlashLane{(int)(threadIdx.x >> 5), lane, lane >> 2, lane & 3};
}
// What a query of a batch row may see. SEG: its segment (`seg`, or the whole row where `seg` is
// null) and the sliding window `win` (1 <= win <= t; t: none), query i seeing key j when
// first(i) <= j <= i, end(j) one past the last query that sees key j; both are non-decreasing, so
// a range's first row has its smallest first() and its last row its largest end(). !SEG: plain
// causal, constants, nothing read.
template <bool SEG>
struct SegBounds {
    const int *lo, *hi;
    int t, win;
    __device__ __forceinline__ int first(int i) const { return SEG ? max(lo ? lo[i] : 0, i - win + 1) : 0; }
    __device__ __forceinline__ int end(int i) const { return SEG ? min(hi ? hi[i] : t, win >= t - i ? t : i + win) : t; }
};
// Batch b's bounds in `seg` (2, batches, t; or null), with the window `win`.
template <bool SEG>
static __device__ __forceinline__ SegBounds<SEG> seg_bounds(const int* seg, int b, int batches, int t, int win) {
    if (!SEG || !seg) return SegBounds<SEG>{nullptr, nullptr, t, win};
    return SegBounds<SEG>{seg + (i64)b * t, seg + ((i64)batches + b) * t, t, win};
}
// Where warp `warp` of this block writes its count of skipped tiles.
static __device__ __forceinline__ i64 warp_slot(int warp, int warps) {
    return (((i64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * warps + warp;
}
// The first of the t rows of head `head` of batch `b` in a (b, heads, t, D) tensor laid out as
// `layout`; `row_stride` is the distance between its rows (elements).
template <int D, typename T>
static __device__ __forceinline__ T* head_rows(T* x, int b, int heads, int head, int t, int layout) {
    return layout == TIME_MAJOR ? x + ((i64)b * t * heads + head) * D : x + (i64)(b * heads + head) * t * D;
}
static __device__ __forceinline__ int row_stride(int heads, int d, int layout) { return layout == TIME_MAJOR ? heads * d : d; }
// A block of BR query rows of one query head (grid (ceil(t / BR), hq, b)), as the forward
// and dQ see it: batch b, query head h, the kv head hk it reads, its first row q0, the rows of
// its Q, K and V heads and their strides (rsq for Q, O, dO, dQ; rskv for K, V). Blocks run the
// longest causal rows first (blockIdx.x 0 is the last rows), so the short ones fill the tail of the
// wave.
template <int D>
struct QueryBlock {
    int b, h, hk, q0, rsq, rskv;
    const bf16 *qh, *kh, *vh;
};
template <int D, int BR>
static __device__ __forceinline__ QueryBlock<D> query_block(const bf16* q, const bf16* k, const bf16* v, int hq, int hkv, int t, int layout) {
    int b = blockIdx.z, h = blockIdx.y, hk = h / (hq / hkv);
    int q0 = (int)(gridDim.x - 1 - blockIdx.x) * BR;
    return QueryBlock<D>{b, h, hk, q0, row_stride(hq, D, layout), row_stride(hkv, D, layout),
                         head_rows<D>(q, b, hq, h, t, layout), head_rows<D>(k, b, hkv, hk, t, layout), head_rows<D>(v, b, hkv, hk, t, layout)};
}
// K/V tiles of BC rows, double-buffered: stage i's K at base + 2 i BC ST, its V BC ST further.
template <int D, int BC>
static __device__ __forceinline__ const bf16* kv_stage(const bf16* base, int i) {
    return base + (i & 1) * 2 * BC * (D + FLASH_PAD);
}
template <int D, int BC, int NT>
static __device__ __forceinline__ void load_kv_async(bf16* base, int i, const bf16* kh, const bf16* vh, int k0, int t, int rs) {
    bf16* sK = base + (i & 1) * 2 * BC * (D + FLASH_PAD);
    load_rows_async<D, BC, NT>(sK, kh, k0, t, rs);
    load_rows_async<D, BC, NT>(sK + BC * (D + FLASH_PAD), vh, k0, t, rs);
}
// Writes this warp's two C rows (`rows`, skipped past t) of a (16, D) accumulator, times mul[r],
// into the (t, D) rows x (`rs` elements apart) as bf16.
template <int D>
static __device__ __forceinline__ void store_rows(bf16* x, float (*acc)[4], const int* rows, const float* mul, int t, int tq, int rs) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= t) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<unsigned*>(x + (i64)rows[r] * rs + n * 8 + 2 * tq) = pack_bf16(acc[n][2 * r] * mul[r], acc[n][2 * r + 1] * mul[r]);
    }
}
#define FLASH_LOG2E 1.4426950408889634f
// 2^x in one MUFU.EX2 (ex2.approx.ftz: relative error ~2^-22, subnormal results flushed to 0,
// 2^-inf = 0); exp2f adds a range check and two conditional multiplies around it. The softmax
// probabilities it makes are rounded to bf16 before every product.
static __device__ __forceinline__ float exp2_fast(float x) {
#ifdef FERRO_EMU
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#endif
}

// ---- forward (bf16, tensor cores) -------------------------------------------------------------
// grid (ceil(t / 16W), hq, b), block 32 W (W warps x 16 query rows), dynamic smem
// (16 W + 4 BC) (D + 8) * 2 bytes: the Q tile, then two stages of K and V tiles of BC rows.
// Q is loaded once (cp.async, then ldmatrix into registers, where it stays); the K/V tile of step
// j + 1 is in flight (cp.async) while step j computes S = Q K^T, the online softmax (exp2 with
// log2(e) folded into the scale) and O += P V, P taken from the S accumulators. A warp skips the
// tiles wholly above its rows' diagonal, and masks only the tiles that cross it (or the end).
// With SEG the block starts at the tile of its first row's first key (segment start, window start
// i - win + 1), and a warp also skips the tiles wholly before its first row's first key and masks
// those before its last row's: with a window the tiles visited grow with win, not t.
template <int D, int BC, int W, bool SEG>
static __device__ void flash_fwd_impl(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, const int* seg, int* skipped, int hq,
                                      int hkv, int t, float scale, int layout, int win) {
    constexpr int BR = FLASH_WARP_ROWS * W, NT = 32 * W, ST = D + FLASH_PAD;
    DYNAMIC_SMEM(smem);
    bf16* sQ = reinterpret_cast<bf16*>(smem);
    bf16* sKV = sQ + BR * ST;
    // Plain ints, not a structured binding: the closures below capture `lane` (C++17, NVRTC).
    const FlashLane fl = flash_lane();
    const int warp = fl.warp, lane = fl.lane, g = fl.g, tq = fl.tq;
    auto [b, h, hk, q0, rsq, rskv, qh, kh, vh] = query_block<D, BR>(q, k, v, hq, hkv, t, layout);
    const SegBounds<SEG> sb = seg_bounds<SEG>(seg, b, gridDim.z, t, win);
    int kv_end = min(t, q0 + BR), n_tiles = (kv_end + BC - 1) / BC;
    const int j0 = sb.first(q0) / BC;  // the first tile a row of the block sees (0 without SEG)
    load_rows_async<D, BR, NT>(sQ, qh, q0, t, rsq);
    cp_async_commit();
    load_kv_async<D, BC, NT>(sKV, j0, kh, vh, j0 * BC, t, rskv);
    cp_async_commit();
    cp_async_wait<1>();  // Q
    __syncthreads();
    int r0 = warp * 16, wr0 = q0 + r0;  // this warp's rows: wr0 .. wr0 + 15
    int rows[2] = {wr0 + g, wr0 + g + 8};
    // SEG: the segment starts of the warp's first and last rows and of this thread's two rows.
    int lo_w = 0, lo_wl = 0, lo[2] = {0, 0}, n_skip = 0;
    if (SEG && wr0 < t) {
        lo_w = sb.first(wr0), lo_wl = sb.first(min(wr0 + 15, t - 1));
        lo[0] = sb.first(min(rows[0], t - 1)), lo[1] = sb.first(min(rows[1], t - 1));
    }
    unsigned qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldsm_a(qf[kk], sQ, ST, r0, kk * 16, lane);
    float acc[D / 8][4];
    zero_acc<D / 8>(acc);
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
    const float sl2 = scale * FLASH_LOG2E;
    for (int j = j0; j < n_tiles; ++j) {
        int k0 = j * BC;
        if (j + 1 < n_tiles) load_kv_async<D, BC, NT>(sKV, j + 1, kh, vh, k0 + BC, t, rskv);
        cp_async_commit();
        cp_async_wait<1>();  // tile j
        __syncthreads();
        const bf16* sK = kv_stage<D, BC>(sKV, j);
        const bf16* sV = sK + BC * ST;
        bool live = k0 <= wr0 + 15 && wr0 < t;  // warp-uniform: the tile has a column some row may see
        if (SEG) {                              // ... inside the rows' segments
            bool before = k0 + BC <= lo_w;
            n_skip += live && before;
            live = live && !before;
        }
        if (live) {
            float s[BC / 8][4];
            zero_acc<BC / 8>(s);
            mma_tiles<D / 16, BC / 16>(  // S = Q K^T, Q from registers
                s, [&](unsigned* a, int kk) { a[0] = qf[kk][0], a[1] = qf[kk][1], a[2] = qf[kk][2], a[3] = qf[kk][3]; },
                [&](unsigned* b, int kk, int np) { ldsm_b_nk(b, sK, ST, np * 16, kk * 16, lane); });
            // crosses the diagonal or the end (or with SEG, a segment start)
            if (k0 + BC - 1 > wr0 || k0 + BC > t || (SEG && k0 < lo_wl)) {
#pragma unroll
                for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        int col = k0 + n * 8 + 2 * tq + (e & 1);
                        if (col > rows[e >> 1] || col >= t || (SEG && col < lo[e >> 1])) s[n][e] = -INFINITY;
                    }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = m_r[r];
#pragma unroll
                for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
                // Without SEG mx is finite: column 0 (tile 0, never skipped) is seen by every row.
                // With SEG a row whose segment or window starts past this tile has seen nothing yet (mx
                // -inf): 0 in its place makes every p and alpha 0 instead of NaN.
                mx = quad_max(mx);
                float mb = SEG && mx == -INFINITY ? 0.0f : mx;
                float alpha = exp2_fast((m_r[r] - mb) * sl2), ms = mb * sl2, rs = 0.0f;
                m_r[r] = mx;
#pragma unroll
                for (int n = 0; n < D / 8; ++n) { acc[n][2 * r] *= alpha; acc[n][2 * r + 1] *= alpha; }
#pragma unroll
                for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e) { float p = exp2_fast(fmaf(s[n][e], sl2, -ms)); s[n][e] = p; rs += p; }
                l_r[r] = l_r[r] * alpha + rs;  // this thread's columns; the quad is summed at the end
            }
            mma_c_by_kn<D, BC>(acc, s, sV, lane);  // O += P V
        }
        __syncthreads();  // every warp is done with stage j before step j + 1 refills it
    }
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_r[r] = quad_sum(l_r[r]);
        inv[r] = 1.0f / l_r[r];
        if (rows[r] < t && tq == 0) lse[(i64)(b * hq + h) * t + rows[r]] = m_r[r] * scale + logf(l_r[r]);
    }
    store_rows<D>(head_rows<D>(o, b, hq, h, t, layout), acc, rows, inv, t, tq, rsq);
    if (SEG && skipped && lane == 0) skipped[warp_slot(warp, W)] = wr0 < t ? j0 + n_skip : 0;  // + the tiles before j0
}
// ---- backward preprocessing: D = rowsum(dO * O), one warp per row ------------------------------
// Row r = (b, h, i) of D (b, heads, t); dO and O are (b, heads, t, d) in `layout`.
template <typename T>
static __device__ void attn_bwd_dot_impl(const T* dout, const T* out, float* dvec, i64 rows, int d, int t, int heads, int layout) {
    i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    i64 bh = row / t, src = layout == TIME_MAJOR ? ((bh / heads) * t + row % t) * heads + bh % heads : row;
    float acc = 0.0f;
    for (int x = lane; x < d; x += 32) acc += to_f(dout[src * d + x]) * to_f(out[src * d + x]);
    acc = warp_sum(acc);
    if (lane == 0) dvec[row] = acc;
}
extern "C" __global__ void attn_bwd_dot_f32(const float* dout, const float* out, float* dvec, i64 rows, int d, int t, int heads, int layout) {
    attn_bwd_dot_impl(dout, out, dvec, rows, d, t, heads, layout);
}
extern "C" __global__ void attn_bwd_dot_bf16(const bf16* dout, const bf16* out, float* dvec, i64 rows, int d, int t, int heads, int layout) {
    attn_bwd_dot_impl(dout, out, dvec, rows, d, t, heads, layout);
}

// ---- backward dK, dV (bf16, tensor cores) -----------------------------------------------------
// grid (ceil(t / 16W), hkv, b), block 32 W (W warps x 16 kv rows), dynamic smem
// (2 * 16 W + 4 BQ) (D + 8) * 2 + 4 BQ * 4 bytes: the block's K and V rows, then two stages of
// (Q, dO) tiles of BQ query rows and their (lse, D). The block walks the group's query heads in
// order and, in each, the query tiles from its diagonal on: one sequence of steps, the next
// step's tiles in flight (cp.async) while this one computes, per warp, S^T = K Q^T and
// dP^T = V dO^T (K, V rows as the A operand), P^T = exp2(S^T scale log2(e) - lse log2(e)),
// dS^T = P^T (dP^T - D) scale, then dV += P^T dO and dK += dS^T Q with P^T, dS^T taken from
// the accumulators. dK, dV stay in registers: deterministic, no atomics. With SEG the block stops
// at the last query that sees its last row (segment end, j + win - 1), and a warp skips the query
// tiles wholly past its last row's last query and masks those past its first row's.
template <int D, int BQ, int W, bool SEG>
static __device__ void flash_bwd_dkdv_impl(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                           const float* dvec, bf16* dk, bf16* dv, const int* seg, int* skipped, int hq, int hkv, int t,
                                           float scale, int layout, int win) {
    constexpr int BKV = FLASH_WARP_ROWS * W, NT = 32 * W, ST = D + FLASH_PAD;
    static_assert(2 * BQ <= NT, "a thread for each lse and D value of a query tile");
    DYNAMIC_SMEM(smem);
    bf16* sK = reinterpret_cast<bf16*>(smem);
    bf16* sV = sK + BKV * ST;
    bf16* sQO = sV + BKV * ST;                                  // stage i: Q, then dO (BQ rows each)
    float* sLD = reinterpret_cast<float*>(sQO + 4 * BQ * ST);  // stage i: lse, then D (BQ each)
    int b = blockIdx.z, hk = blockIdx.y, group = hq / hkv;
    auto [warp, lane, g, tq] = flash_lane();
    int k0 = blockIdx.x * BKV;  // the first blocks have the most query tiles: they start first
    const int rsq = row_stride(hq, D, layout), rskv = row_stride(hkv, D, layout);
    const bf16* kh = head_rows<D>(k, b, hkv, hk, t, layout);
    const bf16* vh = head_rows<D>(v, b, hkv, hk, t, layout);
    load_rows_async<D, BKV, NT>(sK, kh, k0, t, rskv);
    load_rows_async<D, BKV, NT>(sV, vh, k0, t, rskv);
    cp_async_commit();
    const SegBounds<SEG> sb = seg_bounds<SEG>(seg, b, gridDim.z, t, win);
    // The query rows the block's kv rows are seen by end at its last row's segment end (t without SEG).
    int i_first = (k0 / BQ) * BQ, per_head = (sb.end(min(k0 + BKV, t) - 1) - i_first + BQ - 1) / BQ, steps = group * per_head;
    // Step j: query head hk * group + j / per_head, query rows from i_first + (j % per_head) BQ.
    auto load_step = [&](int j) {
        int h = hk * group + j / per_head, i0 = i_first + (j % per_head) * BQ;
        bf16* sQ = sQO + (j & 1) * 2 * BQ * ST;
        float* sL = sLD + (j & 1) * 2 * BQ;
        load_rows_async<D, BQ, NT>(sQ, head_rows<D>(q, b, hq, h, t, layout), i0, t, rsq);
        load_rows_async<D, BQ, NT>(sQ + BQ * ST, head_rows<D>(dout, b, hq, h, t, layout), i0, t, rsq);
        load_vec_async(sL, lse + (i64)(b * hq + h) * t, i0, BQ, t, 0);
        load_vec_async(sL + BQ, dvec + (i64)(b * hq + h) * t, i0, BQ, t, BQ);
    };
    load_step(0);
    cp_async_commit();
    float dka[D / 8][4], dva[D / 8][4];
    zero_acc<D / 8>(dka);
    zero_acc<D / 8>(dva);
    int r0 = warp * 16, kr0 = k0 + r0;  // this warp's kv rows: kr0 .. kr0 + 15
    int kvrow[2] = {kr0 + g, kr0 + g + 8};
    // SEG: the segment ends of the warp's first and last kv rows and of this thread's two rows.
    int hi_w = t, hi_wl = t, hi[2] = {t, t}, n_skip = 0;
    if (SEG && kr0 < t) {
        hi_w = sb.end(kr0), hi_wl = sb.end(min(kr0 + 15, t - 1));
        hi[0] = sb.end(min(kvrow[0], t - 1)), hi[1] = sb.end(min(kvrow[1], t - 1));
    }
    const float sl2 = scale * FLASH_LOG2E;
    for (int j = 0; j < steps; ++j) {
        int i0 = i_first + (j % per_head) * BQ;
        if (j + 1 < steps) load_step(j + 1);
        cp_async_commit();
        cp_async_wait<1>();  // K, V and step j
        // lse -> lse log2(e) for the exp2 below, by the thread that copied it (its copy is done)
        float* sL = sLD + (j & 1) * 2 * BQ;
        if ((int)threadIdx.x < BQ) sL[threadIdx.x] *= FLASH_LOG2E;
        __syncthreads();
        const bf16* sQ = sQO + (j & 1) * 2 * BQ * ST;
        const bf16* sO = sQ + BQ * ST;
        const float* sD = sL + BQ;
        bool live = i0 + BQ - 1 >= kr0 && kr0 < t;  // warp-uniform: some query row of the tile sees a kv row
        if (SEG) {                                  // ... inside the rows' segments
            bool past = i0 >= hi_wl;
            n_skip += live && past;
            live = live && !past;
        }
        if (live) {
            float p[BQ / 8][4], ds[BQ / 8][4];
            zero_acc<BQ / 8>(p);
            zero_acc<BQ / 8>(ds);
            mma_rows_by_nk<D, BQ>(p, sK, r0, sQ, lane);   // S^T = K Q^T
            mma_rows_by_nk<D, BQ>(ds, sV, r0, sO, lane);  // dP^T = V dO^T
            bool mask = i0 < kr0 + 15 || i0 + BQ > t || kr0 + 15 >= t || (SEG && i0 + BQ > hi_w);
#pragma unroll
            for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int qc = n * 8 + 2 * tq + (e & 1), qrow = i0 + qc, kr = kvrow[e >> 1];
                    bool ok = !mask || (qrow >= kr && qrow < t && kr < t && (!SEG || qrow < hi[e >> 1]));
                    float pv = ok ? exp2_fast(fmaf(p[n][e], sl2, -sL[qc])) : 0.0f;
                    p[n][e] = pv;
                    ds[n][e] = pv * (ds[n][e] - sD[qc]) * scale;
                }
            mma_c_by_kn<D, BQ>(dva, p, sO, lane);   // dV += P^T dO
            mma_c_by_kn<D, BQ>(dka, ds, sQ, lane);  // dK += dS^T Q
        }
        __syncthreads();  // every warp is done with stage j before step j + 1 refills it
    }
    const float one[2] = {1.0f, 1.0f};
    store_rows<D>(head_rows<D>(dk, b, hkv, hk, t, layout), dka, kvrow, one, t, tq, rskv);
    store_rows<D>(head_rows<D>(dv, b, hkv, hk, t, layout), dva, kvrow, one, t, tq, rskv);
    // + the tiles of each query head past the block's last step
    if (SEG && skipped && lane == 0) skipped[warp_slot(warp, W)] = kr0 < t ? n_skip + group * ((t + BQ - 1) / BQ - i_first / BQ - per_head) : 0;
}
// ---- backward dQ (bf16, tensor cores) ---------------------------------------------------------
// grid (ceil(t / 16W), hq, b), block 32 W (W warps x 16 query rows), dynamic smem
// (2 * 16 W + 4 BC) (D + 8) * 2 bytes: the block's Q and dO rows, then two stages of K and V tiles
// of BC rows. Per kv tile (the next in flight): S = Q K^T, dP = dO V^T, dS = P (dP - D) scale
// with P = exp2(S scale log2(e) - lse log2(e)), dQ += dS K (K through ldmatrix.trans); the
// causal skipping and masking of the forward, with SEG its segment skipping and masking.
template <int D, int BC, int W, bool SEG>
static __device__ void flash_bwd_dq_impl(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                         const float* dvec, bf16* dq, const int* seg, int* skipped, int hq, int hkv, int t, float scale,
                                         int layout, int win) {
    constexpr int BR = FLASH_WARP_ROWS * W, NT = 32 * W, ST = D + FLASH_PAD;
    DYNAMIC_SMEM(smem);
    bf16* sQ = reinterpret_cast<bf16*>(smem);
    bf16* sO = sQ + BR * ST;
    bf16* sKV = sO + BR * ST;
    auto [warp, lane, g, tq] = flash_lane();
    auto [b, h, hk, q0, rsq, rskv, qh, kh, vh] = query_block<D, BR>(q, k, v, hq, hkv, t, layout);
    const SegBounds<SEG> sb = seg_bounds<SEG>(seg, b, gridDim.z, t, win);
    int kv_end = min(t, q0 + BR), n_tiles = (kv_end + BC - 1) / BC;
    const int j0 = sb.first(q0) / BC;
    load_rows_async<D, BR, NT>(sQ, qh, q0, t, rsq);
    load_rows_async<D, BR, NT>(sO, head_rows<D>(dout, b, hq, h, t, layout), q0, t, rsq);
    cp_async_commit();
    load_kv_async<D, BC, NT>(sKV, j0, kh, vh, j0 * BC, t, rskv);
    cp_async_commit();
    int r0 = warp * 16, wr0 = q0 + r0;
    int rows[2] = {wr0 + g, wr0 + g + 8};
    int lo_w = 0, lo_wl = 0, lo[2] = {0, 0}, n_skip = 0;  // as in the forward
    if (SEG && wr0 < t) {
        lo_w = sb.first(wr0), lo_wl = sb.first(min(wr0 + 15, t - 1));
        lo[0] = sb.first(min(rows[0], t - 1)), lo[1] = sb.first(min(rows[1], t - 1));
    }
    float l2[2], dr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l2[r] = rows[r] < t ? lse[(i64)(b * hq + h) * t + rows[r]] * FLASH_LOG2E : 0.0f;
        dr[r] = rows[r] < t ? dvec[(i64)(b * hq + h) * t + rows[r]] : 0.0f;
    }
    float acc[D / 8][4];
    zero_acc<D / 8>(acc);
    const float sl2 = scale * FLASH_LOG2E;
    for (int j = j0; j < n_tiles; ++j) {
        int k0 = j * BC;
        if (j + 1 < n_tiles) load_kv_async<D, BC, NT>(sKV, j + 1, kh, vh, k0 + BC, t, rskv);
        cp_async_commit();
        cp_async_wait<1>();  // Q, dO and tile j
        __syncthreads();
        const bf16* sK = kv_stage<D, BC>(sKV, j);
        const bf16* sV = sK + BC * ST;
        bool live = k0 <= wr0 + 15 && wr0 < t;
        if (SEG) {
            bool before = k0 + BC <= lo_w;
            n_skip += live && before;
            live = live && !before;
        }
        if (live) {
            float s[BC / 8][4], dp[BC / 8][4];
            zero_acc<BC / 8>(s);
            zero_acc<BC / 8>(dp);
            mma_rows_by_nk<D, BC>(s, sQ, r0, sK, lane);   // S = Q K^T
            mma_rows_by_nk<D, BC>(dp, sO, r0, sV, lane);  // dP = dO V^T
            bool mask = k0 + BC - 1 > wr0 || k0 + BC > t || (SEG && k0 < lo_wl);
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int col = k0 + n * 8 + 2 * tq + (e & 1), row = rows[e >> 1];
                    bool ok = !mask || (col <= row && col < t && (!SEG || col >= lo[e >> 1]));
                    float pv = ok ? exp2_fast(fmaf(s[n][e], sl2, -l2[e >> 1])) : 0.0f;
                    s[n][e] = pv * (dp[n][e] - dr[e >> 1]) * scale;  // dS
                }
            mma_c_by_kn<D, BC>(acc, s, sK, lane);  // dQ += dS K
        }
        __syncthreads();
    }
    const float one[2] = {1.0f, 1.0f};
    store_rows<D>(head_rows<D>(dq, b, hq, h, t, layout), acc, rows, one, t, tq, rsq);
    if (SEG && skipped && lane == 0) skipped[warp_slot(warp, W)] = wr0 < t ? j0 + n_skip : 0;
}
// The entry points: forward, dK/dV and dQ at head dim D with W warps, named by SUFFIX, and their
// `_seg` twins for packed rows and sliding windows (the same code with SEG; `seg` null: no
// segments; `window` 1..t, t: none). The plain kernels are plain causal attention.
#define FLASH_KERNELS(D, W, SUFFIX)                                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * W)                                                                               \
        flash_fwd_bf16_##SUFFIX(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, int hq, int hkv, int t, float scale, \
                                int layout) {                                                                                          \
        flash_fwd_impl<D, FLASH_FWD_TILE_D##D, W, false>(q, k, v, o, lse, nullptr, nullptr, hq, hkv, t, scale, layout, t);                \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * W)                                                                               \
        flash_bwd_dkdv_bf16_##SUFFIX(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,                  \
                                     const float* dvec, bf16* dk, bf16* dv, int hq, int hkv, int t, float scale, int layout) {         \
        flash_bwd_dkdv_impl<D, FLASH_BWD_TILE_D##D, W, false>(q, k, v, dout, lse, dvec, dk, dv, nullptr, nullptr, hq, hkv, t, scale,   \
                                                              layout, t);                                                         \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * W)                                                                               \
        flash_bwd_dq_bf16_##SUFFIX(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* dvec, \
                                   bf16* dq, int hq, int hkv, int t, float scale, int layout) {                                        \
        flash_bwd_dq_impl<D, FLASH_BWD_TILE_D##D, W, false>(q, k, v, dout, lse, dvec, dq, nullptr, nullptr, hq, hkv, t, scale,         \
                                                            layout, t);                                                           \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * W)                                                                               \
        flash_fwd_seg_bf16_##SUFFIX(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, const int* seg, int* skipped,    \
                                    int hq, int hkv, int t, float scale, int layout, int window) {                                     \
        flash_fwd_impl<D, FLASH_FWD_TILE_D##D, W, true>(q, k, v, o, lse, seg, skipped, hq, hkv, t, scale, layout, window);             \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * W)                                                                               \
        flash_bwd_dkdv_seg_bf16_##SUFFIX(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,              \
                                         const float* dvec, bf16* dk, bf16* dv, const int* seg, int* skipped, int hq, int hkv, int t,  \
                                         float scale, int layout, int window) {                                                        \
        flash_bwd_dkdv_impl<D, FLASH_BWD_TILE_D##D, W, true>(q, k, v, dout, lse, dvec, dk, dv, seg, skipped, hq, hkv, t, scale,        \
                                                             layout, window);                                                          \
    }                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * W)                                                                               \
        flash_bwd_dq_seg_bf16_##SUFFIX(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,                \
                                       const float* dvec, bf16* dq, const int* seg, int* skipped, int hq, int hkv, int t, float scale, \
                                       int layout, int window) {                                                                       \
        flash_bwd_dq_impl<D, FLASH_BWD_TILE_D##D, W, true>(q, k, v, dout, lse, dvec, dq, seg, skipped, hq, hkv, t, scale, layout,      \
                                                           window);                                                            \
    }
FLASH_KERNELS(64, FLASH_WARPS, d64)
FLASH_KERNELS(128, FLASH_WARPS, d128)
FLASH_KERNELS(64, FLASH_WARPS_SMALL, d64_w4)
FLASH_KERNELS(128, FLASH_WARPS_SMALL, d128_w4)

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
// Query row `row` (b, h, i) of a (b, hq, t, d) tensor: the first key it sees, 0 or with `seg` (null,
// or (2, b, t) as above) its segment's start, and no earlier than i - win + 1 (the window, 1..t).
static __device__ __forceinline__ int simt_first_key(const int* seg, i64 row, int hq, int t, int win) {
    return max(seg ? seg[(row / t / hq) * t + row % t] : 0, (int)(row % t) - win + 1);
}
// warp per (b, h, i): rows = b*hq*t
template <typename T>
static __device__ void attn_fwd_simt_impl(const T* q, const T* k, const T* v, T* o, float* lse, const int* seg, int b_, int hq, int hkv, int t,
                                          int d, float scale, int win) {
    i64 row = simt_warp_row();
    int lane = threadIdx.x & 31;
    if (row >= (i64)b_ * hq * t) return;
    auto [i, kh, vh] = simt_query_row(row, k, v, hq, hkv, t, d);
    float qi[ATTN_SIMT_PER_LANE], acc[ATTN_SIMT_PER_LANE];
    simt_load(qi, q + row * d, d, lane);
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) acc[e] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j = simt_first_key(seg, row, hq, t, win); j <= i; ++j) {
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
// warp per (b, hkv, j): loops the group's query heads, then i >= j (up to j's segment end and
// window end j + win - 1), in order.
template <typename T>
static __device__ void attn_bwd_dkdv_simt_impl(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* dvec,
                                               T* dk, T* dv, const int* seg, int b_, int hq, int hkv, int t, int d, float scale, int win) {
    i64 row = simt_warp_row();
    int lane = threadIdx.x & 31;
    if (row >= (i64)b_ * hkv * t) return;
    i64 bk = row / t;
    int j = (int)(row % t), group = hq / hkv;
    int i_end = seg ? seg[((i64)b_ + bk / hkv) * t + j] : t;  // one past the last query that sees key j
    if (win < t - j) i_end = min(i_end, j + win);
    float kj[ATTN_SIMT_PER_LANE], vj[ATTN_SIMT_PER_LANE], dka[ATTN_SIMT_PER_LANE], dva[ATTN_SIMT_PER_LANE];
    simt_load(kj, k + row * d, d, lane);
    simt_load(vj, v + row * d, d, lane);
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) dka[e] = dva[e] = 0.0f;
    for (int gi = 0; gi < group; ++gi) {
        i64 bh = bk * group + gi;  // query heads of one kv head are contiguous
        for (int i = j; i < i_end; ++i) {
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
                                             T* dq, const int* seg, int b_, int hq, int hkv, int t, int d, float scale, int win) {
    i64 row = simt_warp_row();
    int lane = threadIdx.x & 31;
    if (row >= (i64)b_ * hq * t) return;
    auto [i, kh, vh] = simt_query_row(row, k, v, hq, hkv, t, d);
    float qi[ATTN_SIMT_PER_LANE], doi[ATTN_SIMT_PER_LANE], acc[ATTN_SIMT_PER_LANE];
    simt_load(qi, q + row * d, d, lane);
    simt_load(doi, dout + row * d, d, lane);
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) acc[e] = 0.0f;
    float l = lse[row], dd = dvec[row];
    for (int j = simt_first_key(seg, row, hq, t, win); j <= i; ++j) {
        float p = expf(simt_dot(qi, kh + (i64)j * d, d, lane) * scale - l);
        float ds = p * (simt_dot(doi, vh + (i64)j * d, d, lane) - dd) * scale;
#pragma unroll
        for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) { int x = lane + 32 * e; if (x < d) acc[e] += ds * to_f(kh[(i64)j * d + x]); }
    }
#pragma unroll
    for (int e = 0; e < ATTN_SIMT_PER_LANE; ++e) { int x = lane + 32 * e; if (x < d) dq[row * d + x] = from_f<T>(acc[e]); }
}
#define ATTN_SIMT(suffix, T)                                                                                                         \
    extern "C" __global__ void attn_fwd_simt_##suffix(const T* q, const T* k, const T* v, T* o, float* lse, const int* seg, int b,    \
                                                      int hq, int hkv, int t, int d, float scale, int window) {                     \
        attn_fwd_simt_impl(q, k, v, o, lse, seg, b, hq, hkv, t, d, scale, window);                                                   \
    }                                                                                                                                \
    extern "C" __global__ void attn_bwd_dkdv_simt_##suffix(const T* q, const T* k, const T* v, const T* dout, const float* lse,     \
                                                           const float* dvec, T* dk, T* dv, const int* seg, int b, int hq, int hkv, \
                                                           int t, int d, float scale, int window) {                                 \
        attn_bwd_dkdv_simt_impl(q, k, v, dout, lse, dvec, dk, dv, seg, b, hq, hkv, t, d, scale, window);                             \
    }                                                                                                                                \
    extern "C" __global__ void attn_bwd_dq_simt_##suffix(const T* q, const T* k, const T* v, const T* dout, const float* lse,       \
                                                         const float* dvec, T* dq, const int* seg, int b, int hq, int hkv, int t,   \
                                                         int d, float scale, int window) {                                          \
        attn_bwd_dq_simt_impl(q, k, v, dout, lse, dvec, dq, seg, b, hq, hkv, t, d, scale, window);                                   \
    }
ATTN_SIMT(f32, float)
ATTN_SIMT(bf16, bf16)
