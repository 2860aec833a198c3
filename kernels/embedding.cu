// embedding.cu — token embedding lookup and its deterministic backward. Forward copies row
// ids[r] of w (vocab, d) into out (n, d). Backward scatters dy (n, d) into dw (vocab, d) with
// NO float atomics: block (vb, cb) owns vocab rows [vb*ROWS, (vb+1)*ROWS) and a slice of
// columns, streams the ids in token order through shared memory, and each thread adds the
// rows that hit its own vocab range into its own column, so every dw element is summed in
// token order exactly like the CPU reference (bit-identical in f32). Accumulation is into an
// f32 dw; the launcher casts to bf16 afterwards when needed.
#include "common.cuh"

template <typename T>
static __device__ void embedding_fwd_impl(const T* w, const int* ids, T* out, i64 n, i64 d) {
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const T* src = w + (i64)ids[r] * d;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) out[r * d + j] = src[j];
    }
}
extern "C" __global__ void embedding_fwd_f32(const float* w, const int* ids, float* out, i64 n, i64 d) { embedding_fwd_impl(w, ids, out, n, d); }
extern "C" __global__ void embedding_fwd_bf16(const bf16* w, const int* ids, bf16* out, i64 n, i64 d) { embedding_fwd_impl(w, ids, out, n, d); }

// grid: (ceil(vocab / EMB_ROWS), ceil(d / EMB_COLS)), block: EMB_COLS. dw must be zeroed.
template <typename T>
static __device__ void embedding_bwd_impl(const T* dy, const int* ids, float* dw, i64 n, i64 d, i64 vocab) {
    __shared__ int sid[EMB_CHUNK];
    i64 v0 = (i64)blockIdx.x * EMB_ROWS;
    i64 v1 = min(v0 + EMB_ROWS, vocab);
    i64 j = (i64)blockIdx.y * EMB_COLS + threadIdx.x;
    for (i64 c0 = 0; c0 < n; c0 += EMB_CHUNK) {
        int m = (int)min((i64)EMB_CHUNK, n - c0);
        __syncthreads();
        for (int k = threadIdx.x; k < m; k += blockDim.x) sid[k] = ids[c0 + k];
        __syncthreads();
        if (j >= d) continue;
        for (int k = 0; k < m; ++k) {
            i64 id = sid[k];
            if (id >= v0 && id < v1) dw[id * d + j] += to_f(dy[(c0 + k) * d + j]);
        }
    }
}
extern "C" __global__ void embedding_bwd_f32(const float* dy, const int* ids, float* dw, i64 n, i64 d, i64 vocab) { embedding_bwd_impl(dy, ids, dw, n, d, vocab); }
extern "C" __global__ void embedding_bwd_bf16(const bf16* dy, const int* ids, float* dw, i64 n, i64 d, i64 vocab) { embedding_bwd_impl(dy, ids, dw, n, d, vocab); }

// Any id outside [0, vocab) sets *bad = 1 (checked by the launcher before the lookup).
extern "C" __global__ void ids_check(const int* ids, i64 n, i64 vocab, int* bad) {
    FOR_EACH(i, n) if (ids[i] < 0 || ids[i] >= vocab) *bad = 1;
}
