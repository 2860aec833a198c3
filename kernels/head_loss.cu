// head_loss.cu — the row kernels of the fused, chunked LM head + cross-entropy
// (crates/ops/src/head_loss.rs) beyond those it shares with cross_entropy.cu (ce_fwd, ce_fused on
// one device). The logits of a chunk of rows come from a GEMM into a buffer that the gradient
// overwrites in place, so no kernel here allocates or keeps a row.
//
// Under tensor parallelism a rank holds the logits of its vocabulary rows [start, start + v):
// hl_row_max gives each row's local max and its target logit (0 when another rank holds it),
// the ranks all-reduce the max; hl_row_sumexp gives the sum of exp(x - max) over the local
// columns, the ranks all-reduce it (with the target logits); hl_grad turns the statistics into
// the row loss and writes dlogits = (exp(x - lse) - onehot) * scale over the local columns, 0 for
// ignored rows. Every reduction is a block tree in a fixed order (deterministic); hl_finish sums
// the row losses of the whole batch in f64 in one block and scales the sum.
#include "common.cuh"

template <typename T>
static __device__ void hl_row_max_impl(const T* x, const int* targets, float* mx, float* tgt, i64 n, i64 v, i64 start, int ignore) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const T* xr = x + r * v;
        float m = -INFINITY;
        for (i64 j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, to_f(xr[j]));
        m = block_max(m, scratch);
        if (threadIdx.x == 0) {
            i64 t = (i64)targets[r] - start;
            mx[r] = m;
            tgt[r] = (targets[r] != ignore && t >= 0 && t < v) ? to_f(xr[t]) : 0.0f;
        }
    }
}
extern "C" __global__ void hl_row_max_f32(const float* x, const int* t, float* mx, float* tgt, i64 n, i64 v, i64 start, int ignore) { hl_row_max_impl(x, t, mx, tgt, n, v, start, ignore); }
extern "C" __global__ void hl_row_max_bf16(const bf16* x, const int* t, float* mx, float* tgt, i64 n, i64 v, i64 start, int ignore) { hl_row_max_impl(x, t, mx, tgt, n, v, start, ignore); }

// s[r] = sum_j exp(x[r, j] - mx[r]) over the local columns (mx: the max over every rank).
template <typename T>
static __device__ void hl_row_sumexp_impl(const T* x, const float* mx, float* s, i64 n, i64 v) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const T* xr = x + r * v;
        float m = mx[r], acc = 0.0f;
        for (i64 j = threadIdx.x; j < v; j += blockDim.x) acc += expf(to_f(xr[j]) - m);
        acc = block_sum(acc, scratch);
        if (threadIdx.x == 0) s[r] = acc;
    }
}
extern "C" __global__ void hl_row_sumexp_f32(const float* x, const float* mx, float* s, i64 n, i64 v) { hl_row_sumexp_impl(x, mx, s, n, v); }
extern "C" __global__ void hl_row_sumexp_bf16(const bf16* x, const float* mx, float* s, i64 n, i64 v) { hl_row_sumexp_impl(x, mx, s, n, v); }

// From the reduced statistics (mx, the sum of exponentials s_tgt[r] and the target logit
// s_tgt[n + r]): the row loss lse - target (0 for an ignored row) and, in place over x when
// `grad` is set, dlogits = (exp(x - lse) - onehot) * scale (0 for an ignored row).
template <typename T>
static __device__ void hl_grad_impl(T* x, const int* targets, const float* mx, const float* s_tgt, float* row_loss, i64 n, i64 v,
                                    i64 start, int ignore, float scale, int grad) {
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        bool counted = targets[r] != ignore;
        float lse = mx[r] + logf(s_tgt[r]);
        if (threadIdx.x == 0) row_loss[r] = counted ? lse - s_tgt[n + r] : 0.0f;
        if (!grad) continue;
        T* xr = x + r * v;
        i64 t = (i64)targets[r] - start;
        for (i64 j = threadIdx.x; j < v; j += blockDim.x) {
            float g = counted ? (expf(to_f(xr[j]) - lse) - (j == t ? 1.0f : 0.0f)) * scale : 0.0f;
            xr[j] = from_f<T>(g);
        }
    }
}
extern "C" __global__ void hl_grad_f32(float* x, const int* t, const float* mx, const float* st, float* rl, i64 n, i64 v, i64 start, int ignore, float scale, int grad) { hl_grad_impl(x, t, mx, st, rl, n, v, start, ignore, scale, grad); }
extern "C" __global__ void hl_grad_bf16(bf16* x, const int* t, const float* mx, const float* st, float* rl, i64 n, i64 v, i64 start, int ignore, float scale, int grad) { hl_grad_impl(x, t, mx, st, rl, n, v, start, ignore, scale, grad); }

// One block (1024 threads): loss[0] = scale * sum(row_loss), summed in f64 in a fixed order
// (a batch holds up to millions of rows).
extern "C" __global__ void hl_finish(const float* row_loss, i64 n, float scale, float* loss) {
    __shared__ double scratch[1024];
    double s = 0.0;
    for (i64 r = threadIdx.x; r < n; r += blockDim.x) s += row_loss[r];
    s = block_sum_f64(s, scratch);
    if (threadIdx.x == 0) loss[0] = (float)(s * (double)scale);
}
