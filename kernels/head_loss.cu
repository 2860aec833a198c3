// head_loss.cu — the row kernels of the fused, chunked LM head + cross-entropy
// (crates/ops/src/head_loss.rs) beyond those it shares with cross_entropy.cu (ce_fwd, ce_fused on
// one device), and the sum of its row losses. The logits of a chunk of rows come from a GEMM into
// a buffer that the gradient overwrites in place, so no kernel here allocates or keeps a row.
// Rows are read and written in 16-byte vectors (ce_row.cuh).
//
// Under tensor parallelism a rank holds the logits of its vocabulary rows [start, start + v),
// and the chunk is read twice, as on one device: hl_row_stats reads it once for each row's local
// max, the sum of exp(x - local max) over the local columns (one online pass) and the target
// logit (0 when another rank holds it); the ranks all-reduce the max; hl_rescale brings each
// local sum to the global max (s * exp(local max - global max)); the ranks all-reduce the sums
// with the target logits; hl_grad turns the statistics into the row loss and writes
// dlogits = (exp(x - lse) - onehot) * scale over the local columns in place, 0 for ignored rows.
// Every reduction is a block tree in a fixed order (deterministic).
//
// The loss: hl_loss_partial sums the batch's row losses in f64 over a fixed partition (HL_LOSS_ROWS
// rows a block, whatever the device), hl_finish sums those partials in index order and scales
// the sum: the same bits run to run, and on any device for the same row losses.
#include "ce_row.cuh"

// Per row of the chunk: ml[r] and mx[r] = the local max (mx is all-reduced, ml kept), st[r] = the
// sum of exp(x - ml[r]) over the local columns, st[n + r] = the target logit if local, else 0.
template <typename T>
static __device__ void hl_row_stats_impl(const T* x, const int* targets, float* mx, float* ml, float* st, i64 n, i64 v, i64 start,
                                         int ignore) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const T* xr = x + r * v;
        float m, s;
        row_max_sumexp(xr, v, scratch, m, s);
        if (threadIdx.x == 0) {
            i64 t = (i64)targets[r] - start;
            mx[r] = m;
            ml[r] = m;
            st[r] = s;
            st[n + r] = (targets[r] != ignore && t >= 0 && t < v) ? to_f(xr[t]) : 0.0f;
        }
    }
}
extern "C" __global__ void hl_row_stats_f32(const float* x, const int* t, float* mx, float* ml, float* st, i64 n, i64 v, i64 start, int ignore) {
    hl_row_stats_impl(x, t, mx, ml, st, n, v, start, ignore);
}
extern "C" __global__ void hl_row_stats_bf16(const bf16* x, const int* t, float* mx, float* ml, float* st, i64 n, i64 v, i64 start, int ignore) {
    hl_row_stats_impl(x, t, mx, ml, st, n, v, start, ignore);
}

// s[r] *= exp(ml[r] - mg[r]): a local sum of exponentials (about the local max ml) about the max
// over every rank mg instead, so the ranks' sums add up.
extern "C" __global__ void hl_rescale(const float* ml, const float* mg, float* s, i64 n) {
    FOR_EACH(r, n) s[r] *= expf(ml[r] - mg[r]);
}

// From the reduced statistics (mx, the sum of exponentials s_tgt[r] and the target logit
// s_tgt[n + r]): the row loss lse - target (0 for an ignored row) and, in place over x when
// `grad` is set, dlogits = (exp(x - lse) - onehot) * scale[r * sstride] (0 for an ignored row):
// one factor for every row (sstride 0) or one per row (sstride 1).
template <typename T>
static __device__ void hl_grad_impl(T* x, const int* targets, const float* mx, const float* s_tgt, float* row_loss, i64 n, i64 v,
                                    i64 start, int ignore, const float* scale, i64 sstride, int grad) {
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        bool counted = targets[r] != ignore;
        float sc = scale[r * sstride];
        float lse = mx[r] + logf(s_tgt[r]);
        if (threadIdx.x == 0) row_loss[r] = counted ? lse - s_tgt[n + r] : 0.0f;
        if (!grad) continue;
        T* xr = x + r * v;
        i64 t = (i64)targets[r] - start;
        row_map(xr, xr, v, [&](i64 j, float e) { return counted ? (expf(e - lse) - (j == t ? 1.0f : 0.0f)) * sc : 0.0f; });
    }
}
extern "C" __global__ void hl_grad_f32(float* x, const int* t, const float* mx, const float* st, float* rl, i64 n, i64 v, i64 start, int ignore, const float* sc, i64 ss, int grad) { hl_grad_impl(x, t, mx, st, rl, n, v, start, ignore, sc, ss, grad); }
extern "C" __global__ void hl_grad_bf16(bf16* x, const int* t, const float* mx, const float* st, float* rl, i64 n, i64 v, i64 start, int ignore, const float* sc, i64 ss, int grad) { hl_grad_impl(x, t, mx, st, rl, n, v, start, ignore, sc, ss, grad); }

// part[b] = the f64 sum of row_loss[b HL_LOSS_ROWS, (b + 1) HL_LOSS_ROWS) (blockDim.x HL_LOSS_BLOCK).
extern "C" __global__ void hl_loss_partial(const float* row_loss, i64 n, double* part) {
    __shared__ double scratch[HL_LOSS_BLOCK];
    i64 nb = (n + HL_LOSS_ROWS - 1) / HL_LOSS_ROWS;
    for (i64 b = blockIdx.x; b < nb; b += gridDim.x) {
        i64 lo = b * HL_LOSS_ROWS, hi = min(n, lo + HL_LOSS_ROWS);
        double s = 0.0;
        for (i64 r = lo + threadIdx.x; r < hi; r += blockDim.x) s += row_loss[r];
        s = block_sum_f64(s, scratch);
        if (threadIdx.x == 0) part[b] = s;
    }
}

// One block (blockDim.x HL_LOSS_BLOCK): loss[0] = scale * the sum of the nb partials, in f64.
extern "C" __global__ void hl_finish(const double* part, i64 nb, float scale, float* loss) {
    __shared__ double scratch[HL_LOSS_BLOCK];
    double s = 0.0;
    for (i64 b = threadIdx.x; b < nb; b += blockDim.x) s += part[b];
    s = block_sum_f64(s, scratch);
    if (threadIdx.x == 0) loss[0] = (float)(s * (double)scale);
}
