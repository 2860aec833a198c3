// cross_entropy.cu — softmax cross-entropy over a large vocabulary, never materialising fp32
// probabilities for the whole (n, vocab) matrix. One block per row streams the row once, in
// 16-byte vectors (ce_row.cuh), with an online (max, sum-of-exp) per thread, merged through
// block trees -> lse (n) in f32 and a
// per-row loss (0 for ignored targets). A single-block finish kernel sums the row losses in a
// fixed order (deterministic mean). The backward recomputes softmax from the saved lse:
// dlogits = (exp(x - lse) - onehot) * scale for counted rows, 0 for ignored ones. The fused
// variant produces lse, row loss and dlogits in one launch (one read pass for the statistics,
// one read+write pass for the gradient), with the gradient scale read from device memory so
// the mean's 1/count never needs a host round trip.
#include "ce_row.cuh"  // row_lse, row_map: a row in 16-byte vectors

template <typename T>
static __device__ void ce_fwd_impl(const T* logits, const int* targets, float* lse, float* row_loss, i64 n, i64 v, int ignore) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const T* xr = logits + r * v;
        float l = row_lse(xr, v, scratch);
        if (threadIdx.x == 0) {
            int t = targets[r];
            lse[r] = l;
            row_loss[r] = (t == ignore) ? 0.0f : l - to_f(xr[t]);
        }
    }
}
extern "C" __global__ void ce_fwd_f32(const float* x, const int* t, float* lse, float* rl, i64 n, i64 v, int ignore) { ce_fwd_impl(x, t, lse, rl, n, v, ignore); }
extern "C" __global__ void ce_fwd_bf16(const bf16* x, const int* t, float* lse, float* rl, i64 n, i64 v, int ignore) { ce_fwd_impl(x, t, lse, rl, n, v, ignore); }

// One block (1024 threads): loss[0] = sum(row_loss) / count (0 when count == 0), count[0] =
// number of counted rows, scale_out[0] = mult / max(count, 1) (the mean's gradient scale).
extern "C" __global__ void ce_finish(const float* row_loss, const int* targets, i64 n, int ignore, float mult,
                                     float* loss, int* count, float* scale_out) {
    // Sums over every row of the batch (millions at large batches): f64, exact counts.
    __shared__ double scratch[1024];
    double s = 0.0, c = 0.0;
    for (i64 r = threadIdx.x; r < n; r += blockDim.x) {
        s += row_loss[r];
        c += targets[r] != ignore ? 1.0 : 0.0;
    }
    s = block_sum_f64(s, scratch);
    c = block_sum_f64(c, scratch);
    if (threadIdx.x == 0) {
        int ci = (int)c;
        loss[0] = ci == 0 ? 0.0f : (float)(s / c);
        count[0] = ci;
        if (scale_out) scale_out[0] = mult / (float)(ci > 0 ? ci : 1);
    }
}

template <typename T>
static __device__ void ce_bwd_impl(const T* logits, const int* targets, const float* lse, const float* scale, T* dlogits, i64 n, i64 v, int ignore) {
    float sc = scale[0];
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        int t = targets[r];
        float l = lse[r];
        row_map(logits + r * v, dlogits + r * v, v, [&](i64 j, float x) { return t == ignore ? 0.0f : (expf(x - l) - (j == t ? 1.0f : 0.0f)) * sc; });
    }
}
extern "C" __global__ void ce_bwd_f32(const float* x, const int* t, const float* lse, const float* sc, float* dx, i64 n, i64 v, int ignore) { ce_bwd_impl(x, t, lse, sc, dx, n, v, ignore); }
extern "C" __global__ void ce_bwd_bf16(const bf16* x, const int* t, const float* lse, const float* sc, bf16* dx, i64 n, i64 v, int ignore) { ce_bwd_impl(x, t, lse, sc, dx, n, v, ignore); }

// Fused forward + backward: lse, row loss and dlogits (may alias logits: each element is read
// before it is written by the same thread). Row r's gradient factor is scale[r * sstride]: a
// device scalar (sstride 0, e.g. from ce_count_scale) or one per row (sstride 1: the fused head's
// per-row upstream gradient).
template <typename T>
static __device__ void ce_fused_impl(const T* logits, const int* targets, const float* scale, i64 sstride, float* lse, float* row_loss, T* dlogits, i64 n, i64 v, int ignore) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        float sc = scale[r * sstride];
        const T* xr = logits + r * v;
        float l = row_lse(xr, v, scratch);
        int t = targets[r];
        float xt = (t == ignore) ? 0.0f : to_f(xr[t]);
        __syncthreads();  // everyone has read xr[t] before it may be overwritten in place
        if (threadIdx.x == 0) { lse[r] = l; row_loss[r] = (t == ignore) ? 0.0f : l - xt; }
        row_map(xr, dlogits + r * v, v, [&](i64 j, float x) { return t == ignore ? 0.0f : (expf(x - l) - (j == t ? 1.0f : 0.0f)) * sc; });
    }
}
extern "C" __global__ void ce_fused_f32(const float* x, const int* t, const float* sc, i64 ss, float* lse, float* rl, float* dx, i64 n, i64 v, int ignore) { ce_fused_impl(x, t, sc, ss, lse, rl, dx, n, v, ignore); }
extern "C" __global__ void ce_fused_bf16(const bf16* x, const int* t, const float* sc, i64 ss, float* lse, float* rl, bf16* dx, i64 n, i64 v, int ignore) { ce_fused_impl(x, t, sc, ss, lse, rl, dx, n, v, ignore); }

// One block: scale_out[0] = mult / max(count of non-ignored targets, 1).
extern "C" __global__ void ce_count_scale(const int* targets, i64 n, int ignore, float mult, float* scale_out) {
    __shared__ double scratch[1024];
    double c = 0.0;
    for (i64 r = threadIdx.x; r < n; r += blockDim.x) c += targets[r] != ignore ? 1.0 : 0.0;
    c = block_sum_f64(c, scratch);
    if (threadIdx.x == 0) scale_out[0] = (float)((double)mult / (c > 1.0 ? c : 1.0));
}
// Any counted target outside [0, v) sets *bad = 1.
extern "C" __global__ void targets_check(const int* t, i64 n, i64 v, int ignore, int* bad) {
    FOR_EACH(i, n) if (t[i] != ignore && (t[i] < 0 || t[i] >= v)) *bad = 1;
}
