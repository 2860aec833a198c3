// The C API of the emulated NCCL (nccl_api.h): argument checks, communicator handles, and the
// entry points, which hand the work to femu::State (state.cpp) and the bootstrap (net.cpp).
//
// Handles: ncclComm_t points at a small record holding the communicator's shared state. Abort and
// destroy release the state (its connections close once the last collective that uses it has
// returned) and leave the record behind, marked gone, so that a late call on the handle from
// another thread (a watchdog racing an abort) gets ncclInvalidUsage instead of touching freed
// memory; the record is a few dozen bytes per communicator.
#include "internal.h"

#include <string.h>

#include <climits>

struct ncclComm {
    std::atomic<uint32_t> magic;
    std::mutex mu;
    std::shared_ptr<femu::State> st;
};

namespace {
using femu::State;
using femu::warn;

constexpr uint32_t kLive = 0x4C495645u, kGone = 0x474F4E45u;

ncclResult_t get(ncclComm_t c, const char* fn, std::shared_ptr<State>* out) {
    if (!c) {
        warn("%s: the communicator is NULL", fn);
        return ncclInvalidArgument;
    }
    if (c->magic == kGone) {
        warn("%s: the communicator was already destroyed or aborted", fn);
        return ncclInvalidUsage;
    }
    if (c->magic != kLive) {
        warn("%s: %p is not a communicator of the emulated NCCL", fn, (void*)c);
        return ncclInvalidArgument;
    }
    std::lock_guard<std::mutex> g(c->mu);
    *out = c->st;
    if (!*out) {
        warn("%s: the communicator was already destroyed or aborted", fn);
        return ncclInvalidUsage;
    }
    return ncclSuccess;
}

ncclComm_t wrap(std::shared_ptr<State> st) {
    ncclComm* c = new ncclComm;
    c->magic = kLive;
    c->st = std::move(st);
    return c;
}

std::shared_ptr<State> take(ncclComm_t c) {
    if (!c || c->magic != kLive) return nullptr;
    std::lock_guard<std::mutex> g(c->mu);
    c->magic = kGone;
    return std::move(c->st);
}

ncclResult_t collective(const char* fn, femu::Call c, ncclComm_t comm, cudaStream_t stream) {
    if (c.dtype < 0 || c.dtype >= ncclNumTypes) {
        warn("%s: invalid datatype %d", fn, c.dtype);
        return ncclInvalidArgument;
    }
    if ((c.kind == femu::kAllReduce || c.kind == femu::kReduceScatter) && (c.op < 0 || c.op >= ncclNumOps)) {
        warn("%s: invalid reduction op %d", fn, c.op);
        return ncclInvalidArgument;
    }
    std::shared_ptr<State> st;
    if (ncclResult_t e = get(comm, fn, &st)) return e;
    if (c.kind == femu::kBroadcast && (c.root < 0 || c.root >= st->nranks)) {
        warn("%s: root %d is not a rank of this communicator of %d ranks", fn, c.root, st->nranks);
        return ncclInvalidArgument;
    }
    const size_t es = femu::dtype_size(c.dtype);
    if (c.count > SIZE_MAX / es / (size_t)st->nranks) {
        warn("%s: count %zu overflows the buffer size", fn, c.count);
        return ncclInvalidArgument;
    }
    const bool needs_send = c.kind != femu::kBroadcast || st->rank == c.root;
    if (c.count > 0 && (!c.recv || (needs_send && !c.send))) {
        warn("%s: %s is NULL with count %zu", fn, c.recv ? "sendbuff" : "recvbuff", c.count);
        return ncclInvalidArgument;
    }
    if (ncclResult_t e = st->async_error()) {
        warn("%s: the communicator is in an error state (%s); abort it", fn, ncclGetErrorString(e));
        return e;
    }
    return st->submit(c, stream, fn);
}
}  // namespace

extern "C" {

// Tells the loader (crates/parallel/src/nccl_lib.rs) that this is the emulated NCCL; real NCCL has no
// such symbol. The value is the version of the stream ABI (ferro_emu_stream.h) it speaks.
FERRO_NCCL_EXPORT extern const int ferro_nccl_emu_abi;
const int ferro_nccl_emu_abi = 1;

ncclResult_t ncclGetVersion(int* version) {
    if (!version) return ncclInvalidArgument;
    *version = FERRO_NCCL_EMU_VERSION;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
    if (!uniqueId) {
        warn("ncclGetUniqueId: uniqueId is NULL");
        return ncclInvalidArgument;
    }
    return femu::make_unique_id(uniqueId);
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
    if (!comm) {
        warn("ncclCommInitRank: comm is NULL");
        return ncclInvalidArgument;
    }
    *comm = nullptr;
    if (nranks < 1 || rank < 0 || rank >= nranks) {
        warn("ncclCommInitRank: rank %d is not in [0, nranks=%d)", rank, nranks);
        return ncclInvalidArgument;
    }
    std::shared_ptr<State> st;
    if (ncclResult_t e = femu::init_rank(commId, nranks, rank, &st)) return e;
    *comm = wrap(std::move(st));
    return ncclSuccess;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
    (void)config;  // blocking communicators with default settings
    if (!newcomm) {
        warn("ncclCommSplit: newcomm is NULL");
        return ncclInvalidArgument;
    }
    *newcomm = nullptr;
    if (color < NCCL_SPLIT_NOCOLOR) {
        warn("ncclCommSplit: color %d is negative (NCCL_SPLIT_NOCOLOR is -1)", color);
        return ncclInvalidArgument;
    }
    std::shared_ptr<State> st;
    if (ncclResult_t e = get(comm, "ncclCommSplit", &st)) return e;
    if (ncclResult_t e = st->async_error()) {
        warn("ncclCommSplit: the parent communicator is in an error state (%s)", ncclGetErrorString(e));
        return e;
    }
    std::shared_ptr<State> child;
    if (ncclResult_t e = femu::split(*st, color, key, &child)) return e;
    if (child) *newcomm = wrap(std::move(child));
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    if (std::shared_ptr<State> st = take(comm)) st->abort();
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    std::shared_ptr<State> st = take(comm);
    if (!st) {
        warn("ncclCommDestroy: the communicator was already destroyed or aborted");
        return ncclInvalidUsage;
    }
    // Like NCCL, finish the collectives already queued first; a collective that can never
    // complete is bounded by NCCL_EMU_TIMEOUT, and then the communicator is aborted.
    if (!st->wait_idle(femu::deadline_after(femu::timeout_seconds()))) {
        warn("ncclCommDestroy: collectives of comm %016llx rank %d did not complete within NCCL_EMU_TIMEOUT; aborting it",
             (unsigned long long)st->id, st->rank);
        st->abort();
        return ncclSystemError;
    }
    st->close_gracefully();
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
    if (!asyncError) return ncclInvalidArgument;
    std::shared_ptr<State> st;
    if (ncclResult_t e = get(comm, "ncclCommGetAsyncError", &st)) return e;
    *asyncError = st->async_error();
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
    std::shared_ptr<State> st;
    if (!count) return ncclInvalidArgument;
    if (ncclResult_t e = get(comm, "ncclCommCount", &st)) return e;
    *count = st->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
    std::shared_ptr<State> st;
    if (!rank) return ncclInvalidArgument;
    if (ncclResult_t e = get(comm, "ncclCommUserRank", &st)) return e;
    *rank = st->rank;
    return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
    switch (result) {
    case ncclSuccess:
        return "no error";
    case ncclUnhandledCudaError:
        return "unhandled cuda error (the emulated CUDA stream refused the work)";
    case ncclSystemError:
        return "unhandled system error (a socket, a timeout or an abort: see the NCCL WARN line)";
    case ncclInternalError:
        return "internal error - please report this issue (emulated NCCL)";
    case ncclInvalidArgument:
        return "invalid argument (see the NCCL WARN line)";
    case ncclInvalidUsage:
        return "invalid usage (see the NCCL WARN line)";
    case ncclRemoteError:
        return "remote process exited or there was a network error";
    case ncclInProgress:
        return "NCCL operation in progress";
    default:
        return "unknown result code";
    }
}

const char* ncclGetLastError(ncclComm_t comm) {
    (void)comm;
    static thread_local char buf[4096];
    std::string s = femu::last_warning();
    size_t n = s.size() < sizeof buf - 1 ? s.size() : sizeof buf - 1;
    memcpy(buf, s.data(), n);
    buf[n] = '\0';
    return buf;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
    femu::Call c{femu::kAllReduce, sendbuff, recvbuff, count, datatype, op, -1, 0};
    return collective("ncclAllReduce", c, comm, stream);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
    femu::Call c{femu::kBroadcast, sendbuff, recvbuff, count, datatype, -1, root, 0};
    return collective("ncclBroadcast", c, comm, stream);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
    femu::Call c{femu::kReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, -1, 0};
    return collective("ncclReduceScatter", c, comm, stream);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm,
                           cudaStream_t stream) {
    femu::Call c{femu::kAllGather, sendbuff, recvbuff, sendcount, datatype, -1, -1, 0};
    return collective("ncclAllGather", c, comm, stream);
}

}  // extern "C"
