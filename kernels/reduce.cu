// reduce.cu — sum / max over an arbitrary set of dimensions. The launcher splits the input
// view into two strided descriptors: `kept` (the output's dims, with the input's strides) and
// `red` (the reduced dims). One block owns one output element and walks its `nred` inputs
// in a fixed thread-strided order, then combines through a fixed tree: results are
// deterministic run to run. Sums accumulate in f64 (maxima in f32) whatever the storage dtype.
#include "common.cuh"

template <typename T>
static __device__ void reduce_impl(const T* x, Strided kept, Strided red, T* y, i64 nout, i64 nred, int is_max) {
    __shared__ float scratch[32];
    __shared__ double scratch64[1024];
    for (i64 o = blockIdx.x; o < nout; o += gridDim.x) {
        i64 base = strided_index(kept, o);  // includes the view offset
        if (is_max) {
            float acc = -INFINITY;
            for (i64 r = threadIdx.x; r < nred; r += blockDim.x) acc = fmaxf(acc, to_f(x[base + strided_index(red, r)]));
            acc = block_max(acc, scratch);
            if (threadIdx.x == 0) y[o] = from_f<T>(acc);
        } else {
            // Each thread walks nred / blockDim elements: a long fold, so it runs in f64.
            double acc = 0.0;
            for (i64 r = threadIdx.x; r < nred; r += blockDim.x) acc += (double)to_f(x[base + strided_index(red, r)]);
            acc = block_sum_f64(acc, scratch64);
            if (threadIdx.x == 0) y[o] = from_f<T>((float)acc);
        }
    }
}
// `red.offset` must be 0 (the view offset lives in `kept`).
extern "C" __global__ void reduce_f32(const float* x, Strided kept, Strided red, float* y, i64 nout, i64 nred, int is_max) {
    reduce_impl(x, kept, red, y, nout, nred, is_max);
}
extern "C" __global__ void reduce_bf16(const bf16* x, Strided kept, Strided red, bf16* y, i64 nout, i64 nred, int is_max) {
    reduce_impl(x, kept, red, y, nout, nred, is_max);
}
