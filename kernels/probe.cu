// probe.cu — one-warp kernels that expose the machine primitives the tensor-core kernels are fed
// with (ldmatrix, cp.async), so crates/cuda/tests/feeding.rs can check them against the PTX ISA's
// layouts and group semantics: on the emulator (where they check its implementation, and through
// it every kernel built on them) and on a GPU (where the same test checks the emulator's model
// against the hardware). Never launched by the library.
#include "common.cuh"

// src: 32 rows of 8 bf16 (16 bytes each, as 4 words). Lane L gives ldmatrix the address of staged
// row rows[L]; out[4 L + i] = its register i (registers past .xN are left as they were).
template <int N, bool TRANS>
static __device__ void probe_ldsm(const bf16* staged, const int* rows, unsigned* out) {
    unsigned r[4];
    int lane = threadIdx.x & 31;
    ldsm<N, TRANS>(r, staged + rows[lane] * 8);
    for (int i = 0; i < N; ++i) out[4 * lane + i] = r[i];
}
// grid 1, block 32, dynamic smem 512 bytes. n: 1, 2 or 4; trans: 0 or 1.
extern "C" __global__ void probe_ldmatrix(const unsigned* src, const int* rows, unsigned* out, int n, int trans) {
    DYNAMIC_SMEM(smem);
    unsigned* s = reinterpret_cast<unsigned*>(smem);
    for (int i = threadIdx.x; i < 128; i += blockDim.x) s[i] = src[i];
    __syncthreads();
    const bf16* staged = reinterpret_cast<const bf16*>(smem);
    if (n == 1) trans ? probe_ldsm<1, true>(staged, rows, out) : probe_ldsm<1, false>(staged, rows, out);
    else if (n == 2) trans ? probe_ldsm<2, true>(staged, rows, out) : probe_ldsm<2, false>(staged, rows, out);
    else trans ? probe_ldsm<4, true>(staged, rows, out) : probe_ldsm<4, false>(staged, rows, out);
}

// grid 1, block 32, dynamic smem 3 * 32 * 16 bytes. Thread x copies with cp.async, in three
// commit groups: A = 16 bytes of a (chunk x) to smem chunk x; B = 16 bytes of b (chunk x), or 16
// zero bytes where x % 3 == 0, to chunk 32 + x; C = the 4-byte word x of c to word x of chunk
// 64 + x / 4. Then:
//   wait_group 2 -> A is complete: thread x writes (after a barrier) A's chunk 31 - x to out[x];
//   wait_group 0 -> all are: out[32 + x] = B's chunk 31 - x, outw[x] = C's word 31 - x.
// early = 1 instead reads A's chunk x before any wait (out[x]) and skips the rest: undefined on a
// GPU, NaN bits on the emulator, which is how a missing wait shows up there.
extern "C" __global__ void probe_cp_async(const unsigned* a, const unsigned* b, const unsigned* c, unsigned* out, unsigned* outw, int early) {
    DYNAMIC_SMEM(smem);
    unsigned* s = reinterpret_cast<unsigned*>(smem);
    int x = threadIdx.x;
    cp_async<16>(s + 4 * x, a + 4 * x, true);
    cp_async_commit();
    cp_async<16>(s + 128 + 4 * x, b + 4 * x, x % 3 != 0);
    cp_async_commit();
    cp_async<4>(s + 256 + x, c + x, true);
    cp_async_commit();
    if (early) {
        for (int k = 0; k < 4; ++k) out[4 * x + k] = s[4 * x + k];
        cp_async_wait<0>();
        return;
    }
    cp_async_wait<2>();
    __syncthreads();
    for (int k = 0; k < 4; ++k) out[4 * x + k] = s[4 * (31 - x) + k];
    cp_async_wait<0>();
    __syncthreads();
    for (int k = 0; k < 4; ++k) out[128 + 4 * x + k] = s[128 + 4 * (31 - x) + k];
    outw[x] = s[256 + 31 - x];
}
