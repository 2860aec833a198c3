// optim.cu — fused multi-tensor AdamW and the deterministic global gradient norm.
// Both walk many tensors in one launch through a host-built block map: block b processes
// elements [map[b].start, map[b].start + CHUNK) of tensor map[b].tensor. AdamW keeps fp32
// master weights and moments, reads f32 or bf16 grads times a host scale (the step's 1/dp and
// clip factor) and an optional device-side one (e.g. the clip factor from grad_norm_finish, so
// clipping needs no host sync), and writes the
// bf16 compute copy of the weights. Update (matches ferrolm-nn's AdamW):
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   w -= lr * ( (m / bc1) / (sqrt(v / bc2) + eps) + wd * w )
// The norm is two-stage: per-block partial sums of squares (f64), then one block sums the
// partials in f64 in a fixed order — the same bits every run, no atomics.
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
struct GradTensor { const void* grad; const float* weight; i64 n; int grad_bf16; int pad; };

static __device__ __forceinline__ float load_grad(const void* g, int is_bf16, i64 i) {
    return is_bf16 ? __bfloat162float(((const bf16*)g)[i]) : ((const float*)g)[i];
}

extern "C" __global__ void adamw_multi(const AdamTensor* tensors, const BlockMap* map, float lr, float b1, float b2,
                                       float eps, float inv_bc1, float inv_bc2, const float* grad_scale, float host_scale) {
    BlockMap bm = map[blockIdx.x];
    AdamTensor t = tensors[bm.tensor];
    float gs = grad_scale ? host_scale * grad_scale[0] : host_scale;
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

// Per-block partial of sum(g^2 * w) over OPT_CHUNK elements of one tensor: each thread
// folds its 16 elements in f32 (two 16-byte loads when aligned), the block sums the threads in
// f64 through a fixed tree, and the partial is stored in f64. Every gradient is read once, in its
// own dtype; `weight` (f32, the element's weight in the norm) may be null (weight 1).
// Floor: the bytes of the gradients (+ the weights) once: 124M bf16 grads = 248 MB, ~62 us at 4 TB/s.
// A 16-byte read-only load through the global space (the table's pointers are generic, so a
// plain load would be a generic LD): one LDG.E.128 on the GPU.
static __device__ __forceinline__ vec16 ld16_ro(const void* p) {
#ifdef FERRO_EMU
    return *reinterpret_cast<const vec16*>(p);
#else
    uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    vec16 v;
    v.w[0] = u.x, v.w[1] = u.y, v.w[2] = u.z, v.w[3] = u.w;
    return v;
#endif
}
static __device__ __forceinline__ float sq_weighted(float g, const float* w, i64 i) {
    return w ? g * g * w[i] : g * g;
}
extern "C" __global__ void grad_norm_partial(const GradTensor* tensors, const BlockMap* map, double* partial) {
    __shared__ double scratch[256];
    BlockMap bm = map[blockIdx.x];
    GradTensor t = tensors[bm.tensor];
    i64 end = min(bm.start + (i64)OPT_CHUNK, t.n);
    float acc = 0.0f;
    const int per = OPT_CHUNK / 256;  // elements per thread when blockDim.x == 256
    bool vec = blockDim.x == 256 && end - bm.start == OPT_CHUNK && (((unsigned long long)t.grad) & 15) == 0;
    if (vec && t.grad_bf16) {
        // Thread k reads elements [start + 8 (k + 256 j), +8) for j < per / 8: 16-byte loads.
        for (int j = 0; j < per / 8; ++j) {
            i64 i0 = bm.start + 8 * ((i64)threadIdx.x + 256 * j);
            float e[8];
            Vec<bf16>::load(ld16_ro((const bf16*)t.grad + i0), e);
            for (int q = 0; q < 8; ++q) acc += sq_weighted(e[q], t.weight, i0 + q);
        }
    } else if (vec) {
        for (int j = 0; j < per / 4; ++j) {
            i64 i0 = bm.start + 4 * ((i64)threadIdx.x + 256 * j);
            float e[4];
            Vec<float>::load(ld16_ro((const float*)t.grad + i0), e);
            for (int q = 0; q < 4; ++q) acc += sq_weighted(e[q], t.weight, i0 + q);
        }
    } else {
        for (i64 i = bm.start + threadIdx.x; i < end; i += blockDim.x) acc += sq_weighted(load_grad(t.grad, t.grad_bf16, i), t.weight, i);
    }
    double s = block_sum_f64((double)acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
// One block over the partials (one per OPT_CHUNK elements: 30k for 124M parameters), in a fixed
// order: out[0] = sqrt(sum), out[1] = clip factor min(1, max_norm / (norm + 1e-6)) (1 when
// max_norm <= 0); `sq` (may be null) gets the sum itself in f64.
extern "C" __global__ void grad_norm_finish(const double* partial, i64 nblocks, float max_norm, float* out, double* sq) {
    __shared__ double scratch[1024];
    double acc = 0.0;
    for (i64 i = threadIdx.x; i < nblocks; i += blockDim.x) acc += partial[i];
    acc = block_sum_f64(acc, scratch);
    if (threadIdx.x == 0) {
        float norm = (float)sqrt(acc);
        out[0] = norm;
        out[1] = max_norm > 0.0f ? fminf(1.0f, max_norm / (norm + 1e-6f)) : 1.0f;
        if (sq) *sq = acc;
    }
}
