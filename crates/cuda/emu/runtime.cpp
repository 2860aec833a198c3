// runtime.cpp — the execution side of the CUDA emulator (see ferro_emu.h): one fiber per CUDA
// thread, blocks run one at a time on the calling OS thread, a round-robin scheduler that
// switches only at __syncthreads and warp collectives, and the semantics of those collectives.
// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 is computed from the fragment layout written in the
// PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type"), and ldmatrix from
// "Warp-level matrix load instruction: ldmatrix", independently of the helpers in kernels/ that
// address and pack the fragments, so a layout mistake there shows up as a wrong result here.
// cp.async copies are queued per thread and done at the cp.async.wait_group that covers them.
//
// Everything is per OS thread (thread_local), so launches from different test threads do not
// interact. No C++ runtime library is used (no exceptions, no new/delete, no std containers).
#include "ferro_emu.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__x86_64__)
extern "C" void ferro_emu_switch(void** save_sp, void* new_sp);
#endif

namespace ferro_emu {

thread_local const ferro_dim3* t_thread_idx;
thread_local ferro_dim3 t_block_idx, t_block_dim, t_grid_dim;

namespace {

constexpr int kMaxThreads = 1024;
constexpr size_t kStackBytes = 256 * 1024;
constexpr unsigned kMaxSmem = 227 * 1024;  // sm_90 opt-in maximum of dynamic shared memory

enum State { RUNNABLE, WAIT_BLOCK, WAIT_WARP, DONE, FAILED };

// One cp.async in flight: `group` is the index its commit group has (or will have) in the
// thread's sequence of cp.async.commit_group.
struct CpOp {
    unsigned char* dst;
    const unsigned char* src;
    unsigned bytes, src_bytes, group;
};
constexpr int kMaxCpAsync = 128;  // in flight per thread

struct Fiber {
#if defined(__x86_64__)
    void* sp;
#else
    ucontext_t ctx;
#endif
    ferro_dim3 tid;
    unsigned lane, warp;
    State state;
    unsigned wait_gen;
    unsigned cp_n, cp_committed;  // copies in flight; groups committed so far
    CpOp cp[kMaxCpAsync];
};

struct Warp {
    unsigned words[2][32 * kStride];  // double-buffered by generation parity
    unsigned gen;
    int arrived, alive;
    Kind kind;
    bool exited[32];
};

struct Block {
    Fiber fibers[kMaxThreads];
    Warp warps[kMaxThreads / 32];
    int n, alive, arrived;
    unsigned gen;
    bool failed;
    char error[512];
};

thread_local Block* t_blk;
thread_local Fiber* t_cur;
thread_local char* t_stacks[kMaxThreads];
thread_local unsigned char* t_smem;
thread_local unsigned t_smem_bytes;
thread_local void (*t_entry)(void**);
thread_local void** t_args;
// 0: threads of a block are visited 0, 1, ..., n-1 at every scheduling round; 1: n-1, ..., 0.
// A kernel without data races gives the same bits under both; tests compare the two.
thread_local int t_reverse;
pthread_key_t g_key;
pthread_once_t g_once = PTHREAD_ONCE_INIT;

// ---- context switching -----------------------------------------------------------------------
#if defined(__x86_64__)
// ferro_emu_switch(&save_sp, new_sp): saves the callee-saved registers, MXCSR and the x87 control
// word on the current stack, stores its pointer, and resumes the context whose stack is new_sp.
asm(R"(
.text
.p2align 4
.globl ferro_emu_switch
.type ferro_emu_switch,@function
ferro_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size ferro_emu_switch, .-ferro_emu_switch
)");
thread_local void* t_sched_sp;
#else
thread_local ucontext_t t_sched_ctx;
#endif

void to_scheduler(Fiber* f) {
#if defined(__x86_64__)
    ferro_emu_switch(&f->sp, t_sched_sp);
#else
    swapcontext(&f->ctx, &t_sched_ctx);
#endif
}
void to_fiber(Fiber* f) {
    t_cur = f;
    t_thread_idx = &f->tid;
#if defined(__x86_64__)
    ferro_emu_switch(&t_sched_sp, f->sp);
#else
    swapcontext(&t_sched_ctx, &f->ctx);
#endif
}

void fail(const char* fmt, ...) {
    Block* b = t_blk;
    if (!b->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->error, sizeof b->error, fmt, ap);
        va_end(ap);
        b->failed = true;
    }
    t_cur->state = FAILED;
    to_scheduler(t_cur);  // never resumed
    abort();
}

const char* kind_name(Kind k) { return k == K_MMA ? "mma.sync" : k == K_LDSM ? "ldmatrix" : "shfl.sync"; }

void complete_warp(Warp& w) {
    unsigned* buf = w.words[w.gen & 1];
    for (int l = 0; l < 32; ++l)
        if (w.exited[l]) memset(buf + l * kStride, 0xff, kStride * 4);
    w.arrived = 0;
    w.gen++;
}

void exit_fiber() {
    Fiber* f = t_cur;
    Block* b = t_blk;
    Warp& w = b->warps[f->warp];
    f->state = DONE;
    b->alive--;
    w.alive--;
    w.exited[f->lane] = true;
    if (w.arrived > 0 && w.arrived == w.alive) {
        if (w.kind != K_SHFL) {
            // The lanes still waiting are in an mma.sync / ldmatrix that can never have all 32 lanes.
            b->failed = true;
            snprintf(b->error, sizeof b->error, "block (%u,%u,%u) warp %u: %s with exited lanes", t_block_idx.x,
                     t_block_idx.y, t_block_idx.z, f->warp, kind_name(w.kind));
        }
        complete_warp(w);
    }
    if (b->arrived > 0 && b->arrived == b->alive) {
        b->arrived = 0;
        b->gen++;
    }
    to_scheduler(f);
    abort();
}

void fiber_main() {
    t_entry(t_args);
    exit_fiber();
}

void free_stacks(void* p) {
    char** stacks = (char**)p;
    for (int i = 0; i < kMaxThreads; ++i)
        if (stacks[i]) munmap(stacks[i], kStackBytes);
    free(stacks);
}
void make_key() { pthread_key_create(&g_key, free_stacks); }

bool init_fiber(Fiber* f, int i, char* err, size_t errlen) {
    if (!t_stacks[i]) {
        void* s = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (s == MAP_FAILED) {
            snprintf(err, errlen, "cannot map a %zu-byte fiber stack", kStackBytes);
            return false;
        }
        t_stacks[i] = (char*)s;
        // Unmap this thread's stacks when it ends (a copy of the table: thread_local storage may
        // already be gone when the key destructor runs).
        pthread_once(&g_once, make_key);
        char** copy = (char**)pthread_getspecific(g_key);
        if (!copy) {
            copy = (char**)calloc(kMaxThreads, sizeof(char*));
            pthread_setspecific(g_key, copy);
        }
        if (copy) copy[i] = (char*)s;
    }
#if defined(__x86_64__)
    // Initial frame for ferro_emu_switch: [mxcsr|fcw][r15 r14 r13 r12 rbx rbp][ret = fiber_main].
    // The return slot is 16-byte aligned, so fiber_main starts with rsp = 8 (mod 16), as after a call.
    uintptr_t top = ((uintptr_t)t_stacks[i] + kStackBytes) & ~(uintptr_t)15;
    void** sp = (void**)(top - 64);  // ret slot at top - 64 (aligned); one spare slot above it
    sp[0] = (void*)&fiber_main;
    for (int r = 1; r <= 6; ++r) sp[-r] = nullptr;
    unsigned ctl[2];
    asm volatile("stmxcsr %0" : "=m"(ctl[0]));
    asm volatile("fnstcw %0" : "=m"(ctl[1]));
    ctl[1] &= 0xffff;
    memcpy(&sp[-7], ctl, 8);
    f->sp = (void*)&sp[-7];
#else
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = t_stacks[i];
    f->ctx.uc_stack.ss_size = kStackBytes;
    f->ctx.uc_link = nullptr;
    makecontext(&f->ctx, (void (*)())fiber_main, 0);
#endif
    return true;
}

// Runs one block to completion; false (with the reason in err) on a deadlock or a misuse.
bool run_block(Block* b, int nthreads, char* err, size_t errlen) {
    b->n = nthreads;
    b->alive = nthreads;
    b->arrived = 0;
    b->gen = 0;
    b->failed = false;
    b->error[0] = 0;
    int nwarps = (nthreads + 31) / 32;
    for (int w = 0; w < nwarps; ++w) {
        Warp& wp = b->warps[w];
        wp.gen = 0;
        wp.arrived = 0;
        int lanes = nthreads - w * 32 < 32 ? nthreads - w * 32 : 32;
        wp.alive = lanes;
        for (int l = 0; l < 32; ++l) wp.exited[l] = l >= lanes;
    }
    for (int i = 0; i < nthreads; ++i) {
        Fiber* f = &b->fibers[i];
        f->tid = ferro_dim3{(unsigned)i, 0, 0};
        f->lane = i & 31;
        f->warp = i >> 5;
        f->state = RUNNABLE;
        f->cp_n = 0;
        f->cp_committed = 0;
        if (!init_fiber(f, i, err, errlen)) return false;
    }
    if (t_smem_bytes) memset(t_smem, 0xff, t_smem_bytes);  // shared memory starts as NaN bits
    while (b->alive > 0 && !b->failed) {
        bool ran = false;
        for (int j = 0; j < nthreads && !b->failed; ++j) {
            Fiber* f = &b->fibers[t_reverse ? nthreads - 1 - j : j];
            if (f->state == DONE || f->state == FAILED) continue;
            if (f->state == WAIT_BLOCK && b->gen == f->wait_gen) continue;
            if (f->state == WAIT_WARP && b->warps[f->warp].gen == f->wait_gen) continue;
            f->state = RUNNABLE;
            ran = true;
            to_fiber(f);
        }
        if (!ran && !b->failed) {
            int at_block = 0, at_warp = 0;
            for (int i = 0; i < nthreads; ++i) {
                at_block += b->fibers[i].state == WAIT_BLOCK;
                at_warp += b->fibers[i].state == WAIT_WARP;
            }
            snprintf(b->error, sizeof b->error,
                     "block (%u,%u,%u): deadlock: %d thread(s) wait in __syncthreads and %d in a warp collective "
                     "(a barrier not reached by every live thread)",
                     t_block_idx.x, t_block_idx.y, t_block_idx.z, at_block, at_warp);
            b->failed = true;
        }
    }
    if (b->failed) {
        snprintf(err, errlen, "%s", b->error);
        return false;
    }
    return true;
}

}  // namespace

// ---- device-side API ---------------------------------------------------------------------------
void sync_block() {
    Block* b = t_blk;
    Fiber* f = t_cur;
    unsigned g = b->gen;
    if (++b->arrived == b->alive) {
        b->arrived = 0;
        b->gen++;
        return;
    }
    f->state = WAIT_BLOCK;
    f->wait_gen = g;
    to_scheduler(f);  // resumed only once the barrier has released (never after a failure)
}

unsigned lane_id() { return t_cur->lane; }

const unsigned* warp_exchange(const unsigned* mine, int n, Kind kind, unsigned mask) {
    Block* b = t_blk;
    Fiber* f = t_cur;
    Warp& w = b->warps[f->warp];
    if (mask != 0xffffffffu) fail("warp %u lane %u: only full-warp masks are emulated (got %#x)", f->warp, f->lane, mask);
    unsigned g = w.gen;
    if (w.arrived == 0) {
        w.kind = kind;
    } else if (w.kind != kind) {
        fail("block (%u,%u,%u) warp %u: lanes reached different warp collectives (%s and %s)", t_block_idx.x,
             t_block_idx.y, t_block_idx.z, f->warp, kind_name(w.kind), kind_name(kind));
    }
    unsigned* buf = w.words[g & 1];
    memcpy(buf + f->lane * kStride, mine, (size_t)n * 4);
    if (++w.arrived == w.alive) {
        if (kind != K_SHFL && w.alive < 32)
            fail("block (%u,%u,%u) warp %u: %s with only %d live lanes", t_block_idx.x, t_block_idx.y, t_block_idx.z,
                 f->warp, kind_name(kind), w.alive);
        complete_warp(w);
    } else {
        f->state = WAIT_WARP;
        f->wait_gen = g;
        to_scheduler(f);  // resumed only once every live lane has arrived
    }
    return buf;
}

unsigned char* dynamic_smem() { return t_smem; }

static inline float bf16_bits_to_f(unsigned h) {
    unsigned u = (h & 0xffffu) << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

// D = A (16x16, row) * B (16x8, col) + C, fp32 accumulate. Fragment ownership (PTX ISA):
//   A element (r, k): lane 4*(r%8) + (k%8)/2, register (r/8) + 2*(k/8), half k%2
//   B element (k, n): lane 4*n + (k%8)/2,     register k/8,             half k%2
//   C element (r, n): lane 4*(r%8) + n/2,     register 2*(r/8) + n%2
// with the lower-indexed element of a register pair in its low 16 bits.
void mma_m16n8k16_bf16(float* c, const unsigned* a, const unsigned* b) {
    unsigned mine[10];
    memcpy(mine, a, 16);
    memcpy(mine + 4, b, 8);
    const unsigned* all = warp_exchange(mine, 6, K_MMA, 0xffffffffu);
    unsigned lane = t_cur->lane, g = lane >> 2, tq = lane & 3;
    for (int e = 0; e < 4; ++e) {
        unsigned r = g + 8 * (e >> 1), n = 2 * tq + (e & 1);
        float acc = 0.0f;
        for (unsigned k = 0; k < 16; ++k) {
            unsigned la = 4 * (r % 8) + (k % 8) / 2, ra = (r / 8) + 2 * (k / 8);
            unsigned lb = 4 * n + (k % 8) / 2, rb = k / 8;
            float av = bf16_bits_to_f(all[la * kStride + ra] >> (16 * (k % 2)));
            float bv = bf16_bits_to_f(all[lb * kStride + 4 + rb] >> (16 * (k % 2)));
            acc += av * bv;
        }
        c[e] += acc;
    }
}

// Fails unless [p, p + bytes) lies in the block's dynamic shared memory and p is `align`-aligned.
static void check_smem(const char* what, const void* p, unsigned bytes, unsigned align) {
    const unsigned char* c = (const unsigned char*)p;
    if (c < t_smem || c + bytes > t_smem + t_smem_bytes)
        fail("block (%u,%u,%u) thread %u: %s address %p is outside the block's %u bytes of dynamic shared memory",
             t_block_idx.x, t_block_idx.y, t_block_idx.z, t_cur->tid.x, what, p, t_smem_bytes);
    if ((uintptr_t)p % align)
        fail("block (%u,%u,%u) thread %u: %s address %p is not %u-byte aligned", t_block_idx.x, t_block_idx.y,
             t_block_idx.z, t_cur->tid.x, what, p, align);
}

// ldmatrix .m8n8 .b16: matrix i's row r is the 16 bytes at the address lane 8i + r gave. Without
// .trans, lane L gets row L/4, columns 2(L%4) and 2(L%4)+1 of each matrix (the lower column in the
// low half); with .trans, rows 2(L%4) and 2(L%4)+1 of column L/4 (the lower row in the low half).
void ldmatrix(unsigned* r, int n, bool trans, const void* row) {
    Fiber* f = t_cur;
    if (n != 1 && n != 2 && n != 4) fail("ldmatrix: .x%d (only .x1, .x2, .x4 exist)", n);
    if ((int)f->lane < 8 * n) check_smem("ldmatrix row", row, 16, 16);
    unsigned mine[3];
    uintptr_t p = (uintptr_t)row;
    mine[0] = (unsigned)p;
    mine[1] = (unsigned)((uint64_t)p >> 32);
    mine[2] = (unsigned)n | (trans ? 16u : 0u);
    const unsigned* all = warp_exchange(mine, 3, K_LDSM, 0xffffffffu);
    for (int l = 0; l < 32; ++l)
        if (all[l * kStride + 2] != mine[2]) fail("warp %u: lanes ran different ldmatrix shapes (.x / .trans)", f->warp);
    unsigned lane = f->lane;
    auto elem = [&](int m, unsigned rr, unsigned cc) -> unsigned {  // matrix m, row rr, column cc
        const unsigned* w = all + (8 * m + rr) * kStride;
        const unsigned char* base = (const unsigned char*)(uintptr_t)((uint64_t)w[0] | ((uint64_t)w[1] << 32));
        unsigned short h;
        memcpy(&h, base + 2 * cc, 2);
        return h;
    };
    for (int m = 0; m < n; ++m) {
        unsigned lo, hi;
        if (!trans) {
            lo = elem(m, lane / 4, 2 * (lane % 4));
            hi = elem(m, lane / 4, 2 * (lane % 4) + 1);
        } else {
            lo = elem(m, 2 * (lane % 4), lane / 4);
            hi = elem(m, 2 * (lane % 4) + 1, lane / 4);
        }
        r[m] = lo | (hi << 16);
    }
}

void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    Fiber* f = t_cur;
    if (bytes != 4 && bytes != 8 && bytes != 16) fail("cp.async of %d bytes (4, 8 or 16)", bytes);
    if (src_bytes < 0 || src_bytes > bytes) fail("cp.async src-size %d outside 0..=%d", src_bytes, bytes);
    check_smem("cp.async destination", dst, (unsigned)bytes, (unsigned)bytes);
    if ((uintptr_t)src % (unsigned)bytes) fail("cp.async source %p is not %d-byte aligned", src, bytes);
    if (f->cp_n == (unsigned)kMaxCpAsync) fail("thread %u: more than %d cp.async in flight", f->tid.x, kMaxCpAsync);
    f->cp[f->cp_n++] = CpOp{(unsigned char*)dst, (const unsigned char*)src, (unsigned)bytes, (unsigned)src_bytes, f->cp_committed};
    memset(dst, 0xff, (size_t)bytes);  // undefined until waited for
}

void cp_async_commit() { t_cur->cp_committed++; }

void check_aligned(const void* p, unsigned bytes, const char* what) {
    if ((uintptr_t)p % bytes) fail("%s at %p is not %u-byte aligned", what, p, bytes);
}

// Completes every copy of the committed groups but the newest `pending`, in issue order.
void cp_async_wait(int pending) {
    Fiber* f = t_cur;
    unsigned keep = 0;
    for (unsigned i = 0; i < f->cp_n; ++i) {
        CpOp& op = f->cp[i];
        if (op.group + (unsigned)pending < f->cp_committed) {
            memcpy(op.dst, op.src, op.src_bytes);
            memset(op.dst + op.src_bytes, 0, op.bytes - op.src_bytes);
        } else {
            f->cp[keep++] = op;
        }
    }
    f->cp_n = keep;
}

}  // namespace ferro_emu

using namespace ferro_emu;

// ---- host API (called from Rust) ---------------------------------------------------------------
// Scheduling order for launches from the calling thread (see t_reverse).
extern "C" void ferro_emu_set_reverse(int on) { t_reverse = on; }

// Runs kernel `entry` (a thunk that unpacks the driver-style argument array) over the grid.
// Returns 0, or 2 for a bad launch configuration, 3 for an execution error; err gets the reason.
extern "C" int ferro_emu_run(void (*entry)(void**), unsigned gx, unsigned gy, unsigned gz, unsigned block,
                             unsigned smem, void** args, char* err, size_t errlen) {
    if (block == 0 || block > kMaxThreads) {
        snprintf(err, errlen, "block of %u threads (1..=%d)", block, kMaxThreads);
        return 2;
    }
    if (gx == 0 || gy == 0 || gz == 0 || gx > 0x7fffffffu || gy > 65535 || gz > 65535) {
        snprintf(err, errlen, "grid (%u,%u,%u) out of range", gx, gy, gz);
        return 2;
    }
    if (smem > kMaxSmem) {
        snprintf(err, errlen, "%u bytes of dynamic shared memory (at most %u)", smem, kMaxSmem);
        return 2;
    }
    Block* b = (Block*)malloc(sizeof(Block));
    unsigned char* sm = smem ? (unsigned char*)aligned_alloc(128, (smem + 127) / 128 * 128) : nullptr;
    if (!b || (smem && !sm)) {
        free(b);
        free(sm);
        snprintf(err, errlen, "out of host memory");
        return 3;
    }
    Block* saved_blk = t_blk;  // launches do not nest, but keep the thread state clean anyway
    t_blk = b;
    t_smem = sm;
    t_smem_bytes = smem;
    t_entry = entry;
    t_args = args;
    t_grid_dim = ferro_dim3{gx, gy, gz};
    t_block_dim = ferro_dim3{block, 1, 1};
    int rc = 0;
    for (unsigned z = 0; z < gz && rc == 0; ++z)
        for (unsigned y = 0; y < gy && rc == 0; ++y)
            for (unsigned x = 0; x < gx && rc == 0; ++x) {
                t_block_idx = ferro_dim3{x, y, z};
                if (!run_block(b, (int)block, err, errlen)) rc = 3;
            }
    t_blk = saved_blk;
    t_smem = nullptr;
    t_smem_bytes = 0;
    free(sm);
    free(b);
    return rc;
}
