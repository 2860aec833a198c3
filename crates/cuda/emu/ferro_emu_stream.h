/* The stream ABI of the CUDA emulator: how a library that is not part of the emulator (the
 * emulated NCCL, crates/parallel/emu) puts work on an emulated CUDA stream, so that its work runs in
 * that stream's order, as a real library's kernels do on a GPU.
 *
 * A cudaStream_t of the emulated device points at a struct whose first member is
 * `const ferro_emu_stream_ops*`; `ops->magic` is FERRO_EMU_STREAM_MAGIC. A NULL stream has no
 * queue: a library runs the work at call time, in the order of the calls.
 *
 * Contract of `enqueue(stream, fn, arg)`:
 *   - fn(arg) runs later on the stream's worker thread (never on the caller's, never inside
 *     enqueue), after everything queued on `stream` before it, and before anything queued after;
 *   - it returns 0 when the item was queued, non-zero when the stream is gone (then fn is never
 *     called and the caller still owns arg);
 *   - every item that was queued is called exactly once, also when the stream is destroyed with
 *     work pending (destroying drains the queue, as cudaStreamDestroy lets queued work finish):
 *     the emulated NCCL frees `arg` in fn, and its later collectives on the same communicator
 *     wait for this one's turn;
 *   - fn may block for a long time (a collective waiting for its peers); only this stream waits.
 *   - enqueue is callable from any thread.
 */
#ifndef FERRO_EMU_STREAM_H
#define FERRO_EMU_STREAM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FERRO_EMU_STREAM_MAGIC 0xFE57A300u

typedef struct ferro_emu_stream_ops {
    uint32_t magic; /* FERRO_EMU_STREAM_MAGIC */
    /* Enqueue fn(arg) behind everything already queued on `stream`; fn runs later on the
       stream's worker thread (not the caller's). Returns 0, or non-zero if the stream is gone. */
    int (*enqueue)(void* stream, void (*fn)(void* arg), void* arg);
} ferro_emu_stream_ops;

#ifdef __cplusplus
}
#endif

#endif /* FERRO_EMU_STREAM_H */
