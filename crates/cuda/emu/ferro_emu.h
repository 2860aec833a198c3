// ferro_emu.h — lets the unmodified kernels/*.cu compile as ordinary C++ and run on the CPU, so
// the whole CUDA backend (launch configurations, argument packing, indexing, masking, shared
// memory staging, warp shuffles, mma.sync fragment layouts, barriers) is exercised by tests on a
// machine with no GPU. It is a checker, not a fast path: every CUDA thread is a fiber, a block's
// fibers run on one OS thread, and the scheduler switches fibers only at __syncthreads and warp
// collectives, where it also detects what real hardware would hang on or leave undefined
// (divergent barriers, lanes of one warp in different collectives, mma with exited lanes).
//
// Included by kernels/common.cuh instead of <cuda_bf16.h> when FERRO_EMU is defined; the runtime
// (fibers, scheduler, the collectives) is runtime.cpp. Only what kernels/ uses is provided: a
// kernel that needs another intrinsic fails to compile here, which is the signal to add it.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

// ---- qualifiers ----------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__ __restrict
// One copy per OS thread: the fibers of a block share it; blocks run one after another per thread.
#define __shared__ static thread_local

struct ferro_dim3 {
    unsigned x, y, z;
};

namespace ferro_emu {
extern thread_local const ferro_dim3* t_thread_idx;
extern thread_local ferro_dim3 t_block_idx, t_block_dim, t_grid_dim;
void sync_block();
// Full-warp exchange of 32-bit words: lane L deposits `n` words and gets back the table of every
// lane's deposit (row = lane, `kStride` words a row; rows of exited lanes read as all-ones bits).
constexpr int kStride = 10;
enum Kind { K_SHFL = 1, K_MMA = 2, K_LDSM = 3 };
const unsigned* warp_exchange(const unsigned* mine, int n, Kind kind, unsigned mask);
unsigned lane_id();
unsigned char* dynamic_smem();
void mma_m16n8k16_bf16(float* c, const unsigned* a, const unsigned* b);
// ldmatrix.sync.aligned.m8n8.x{n}{.trans}.shared.b16: a warp collective; `row` is this lane's
// row address (lanes 8i..8i+7 give the rows of matrix i; only the first 8n lanes' are read).
void ldmatrix(unsigned* r, int n, bool trans, const void* row);
// cp.async.{ca,cg}.shared.global with zero fill past src_bytes, and its commit / wait groups.
// The copy is deferred: its destination reads as NaN bits from the issue until a wait_group
// that covers it, so a kernel that reads a tile before waiting (or without the barrier that
// makes other threads' copies visible) computes garbage here, as it would race on a GPU.
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();
void cp_async_wait(int pending);
// A vector access of `bytes` at p: fails the launch when p is not `bytes`-aligned, as the GPU
// would fault (x86 would not notice).
void check_aligned(const void* p, unsigned bytes, const char* what);
}  // namespace ferro_emu

#define threadIdx (*ferro_emu::t_thread_idx)
#define blockIdx (ferro_emu::t_block_idx)
#define blockDim (ferro_emu::t_block_dim)
#define gridDim (ferro_emu::t_grid_dim)
#define __syncthreads() ferro_emu::sync_block()

template <typename T>
static inline T ferro_shfl_xor(unsigned mask, T v, int lanemask) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    unsigned w;
    memcpy(&w, &v, 4);
    const unsigned* all = ferro_emu::warp_exchange(&w, 1, ferro_emu::K_SHFL, mask);
    unsigned r = all[((ferro_emu::lane_id() ^ (unsigned)lanemask) & 31u) * ferro_emu::kStride];
    T out;
    memcpy(&out, &r, 4);
    return out;
}
#define __shfl_xor_sync(mask, v, lanemask) ferro_shfl_xor((mask), (v), (lanemask))

// The CUDA bit casts between a float and its 32 bits.
static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}

template <typename T>
static inline T min(T a, T b) { return b < a ? b : a; }
template <typename T>
static inline T max(T a, T b) { return a < b ? b : a; }
