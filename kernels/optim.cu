// optim.cu — fused multi-tensor AdamW and the deterministic global gradient norm.
// Both walk many tensors in one launch through a host-built block map: block b processes
// elements [map[b].start, map[b].start + CHUNK) of tensor map[b].tensor. AdamW keeps fp32
// master weights and moments, reads f32 or bf16 grads (times an optional device-side scale,
// e.g. the clip factor from grad_norm_finish, so clipping needs no host sync), and writes the
// bf16 compute copy of the weights. Update (matches ferrolm-nn's AdamW):
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   w -= lr * ( (m / bc1) / (sqrt(v / bc2) + eps) + wd * w )
// The norm is two-stage: per-block partial sums of squares, then one block sums the partials in
// f64, in block order — the same bits every run, no atomics.
#include "common.cuh"

struct BlockMap { int tensor; int pad; i64 start; };
struct AdamTensor {
    float* master;       // (n) fp32 weights, updated in place
    const void* grad;    // (n) f32 or bf16
    float* m;            // (n) fp32
    float* v;            // (n) fp32
    bf16* param_bf16;    // (n) bf16 copy written after the update, or null
    i64 n;
    int grad_bf16;
    float weight_decay;  // 0 for tensors that do not decay
};
struct GradTensor { const void* grad; i64 n; int grad_bf16; int pad; };

static __device__ __forceinline__ float load_grad(const void* g, int is_bf16, i64 i) {
    return is_bf16 ? __bfloat162float(((const bf16*)g)[i]) : ((const float*)g)[i];
}

extern "C" __global__ void adamw_multi(const AdamTensor* tensors, const BlockMap* map, float lr, float b1, float b2,
                                       float eps, float inv_bc1, float inv_bc2, const float* grad_scale) {
    BlockMap bm = map[blockIdx.x];
    AdamTensor t = tensors[bm.tensor];
    float gs = grad_scale ? grad_scale[0] : 1.0f;
    i64 end = min(bm.start + (i64)OPT_CHUNK, t.n);
    for (i64 i = bm.start + threadIdx.x; i < end; i += blockDim.x) {
        float g = load_grad(t.grad, t.grad_bf16, i) * gs;
        float m = b1 * t.m[i] + (1.0f - b1) * g;
        float v = b2 * t.v[i] + (1.0f - b2) * g * g;
        float w = t.master[i];
        float upd = (m * inv_bc1) / (sqrtf(v * inv_bc2) + eps) + t.weight_decay * w;
        w -= lr * upd;
        t.m[i] = m;
        t.v[i] = v;
        t.master[i] = w;
        if (t.param_bf16) t.param_bf16[i] = __float2bfloat16_rn(w);
    }
}

extern "C" __global__ void grad_norm_partial(const GradTensor* tensors, const BlockMap* map, float* partial) {
    __shared__ float scratch[32];
    BlockMap bm = map[blockIdx.x];
    GradTensor t = tensors[bm.tensor];
    i64 end = min(bm.start + (i64)OPT_CHUNK, t.n);
    float acc = 0.0f;
    for (i64 i = bm.start + threadIdx.x; i < end; i += blockDim.x) { float g = load_grad(t.grad, t.grad_bf16, i); acc += g * g; }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}
// One block: out[0] = sqrt(sum(partial)), out[1] = clip factor min(1, max_norm / (norm + 1e-6))
// (1 when max_norm <= 0).
extern "C" __global__ void grad_norm_finish(const float* partial, i64 nblocks, float max_norm, float* out) {
    // 10^8 elements make 24k partials: summed in f64 (an f32 fold was 1e-5 off at that size).
    __shared__ double scratch[1024];
    double acc = 0.0;
    for (i64 i = threadIdx.x; i < nblocks; i += blockDim.x) acc += partial[i];
    acc = block_sum_f64(acc, scratch);
    if (threadIdx.x == 0) {
        float norm = (float)sqrt(acc);
        out[0] = norm;
        out[1] = max_norm > 0.0f ? fminf(1.0f, max_norm / (norm + 1e-6f)) : 1.0f;
    }
}
