// The emulated NCCL's internals, shared by net.cpp (sockets, bootstrap, the communicator's
// connections), collectives.cpp (the algorithms and reductions) and api.cpp (the C API).
//
// Shape: every communicator is a full mesh of TCP connections, one per pair of ranks, made for
// it alone (ncclCommInitRank from the unique id's bootstrap root, ncclCommSplit through the
// parent's connections), so communicators never share a byte stream. Each connection has a
// receiver thread that always drains it into in-memory queues; a rank's sends therefore never
// block on a peer that is itself sending, and every rank can send to every other at once.
// Every message carries a header with the communicator id and, for collectives, the sequence
// number and the call (kind, count, dtype, op, root), which the receiver compares with its own.
#ifndef FERRO_NCCL_EMU_INTERNAL_H
#define FERRO_NCCL_EMU_INTERNAL_H

#include "nccl_api.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace femu {

using Clock = std::chrono::steady_clock;

void warn(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void info(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// The text of the newest WARN line of this process (ncclGetLastError).
std::string last_warning();
// NCCL_EMU_TIMEOUT (seconds; default 900; 0 waits forever, as real NCCL does): the bound on any
// wait for another rank (bootstrap, connections, a collective's data).
double timeout_seconds();
Clock::time_point deadline_after(double seconds);

// An IPv4 endpoint, both fields in network byte order.
struct Addr {
    uint32_t ip;
    uint16_t port;
    uint16_t pad;
};
std::string to_string(const Addr& a);

// Sockets (all blocking, close-on-exec). Functions returning an fd return -1 with *err set.
int listen_socket(uint32_t ip, Addr* bound, std::string* err);
int connect_socket(const Addr& to, Clock::time_point deadline, std::string* err);
int accept_by(int lfd, Clock::time_point deadline);
bool write_full(int fd, const void* p, size_t n);
// false on EOF (errno 0) or an error (errno set).
bool read_full(int fd, void* p, size_t n);
bool read_full_by(int fd, void* p, size_t n, Clock::time_point deadline);
uint64_t random_u64();
uint64_t mix(uint64_t a, uint64_t b);

enum MsgType : uint32_t { kData = 1, kSplit = 2, kBye = 3, kFail = 4 };
enum Kind : uint32_t { kAllReduce = 1, kAllGather = 2, kReduceScatter = 3, kBroadcast = 4 };
constexpr uint32_t kMsgMagic = 0x4E43454Du;  // "MECN"

struct MsgHdr {
    uint32_t magic;
    uint32_t type;   // MsgType
    uint64_t comm;   // communicator id
    uint64_t seq;    // collective number (kData) or split number (kSplit)
    uint32_t kind;   // Kind (kData)
    uint32_t phase;  // round within the collective
    uint64_t count;  // the count argument as the caller passed it
    int32_t dtype;
    int32_t op;    // -1 where the collective has none
    int32_t root;  // -1 except for broadcast
    int32_t from;  // sender's rank in the communicator
    uint64_t bytes;  // payload that follows
};

struct Msg {
    MsgHdr h;
    std::unique_ptr<char[]> data;
};

// One collective call of this rank.
struct Call {
    Kind kind;
    const void* send;
    void* recv;
    size_t count;
    int dtype;
    int op;
    int root;
    uint64_t seq;
};
// "ncclAllReduce(count=8, ncclFloat32, ncclSum)" for a call or for a received header.
std::string describe(Kind kind, uint64_t count, int dtype, int op, int root);
size_t dtype_size(int dtype);

// A communicator's state. The C handle (api.cpp) holds a shared_ptr, as do the receiver threads
// and queued stream work, so a handle can be aborted while work that uses it is still running.
class State : public std::enable_shared_from_this<State> {
  public:
    State(uint64_t id, int rank, int nranks, uint32_t local_ip, std::vector<int> fds);
    ~State();
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    void start_receivers();

    const uint64_t id;
    const int rank, nranks;
    const uint32_t local_ip;  // the interface the mesh listens on (for splits)

    // Message passing: send blocks until the bytes are in the kernel (the peer always drains);
    // recv waits for the next message of `peer` on the data or bootstrap queue, up to
    // NCCL_EMU_TIMEOUT. Both return ncclSuccess or an error code with *why set.
    ncclResult_t send(int peer, const MsgHdr& h, const void* payload, std::string* why);
    ncclResult_t recv(int peer, bool bootstrap, Msg* out, std::string* why);

    // Records the communicator's first failure as its asynchronous error, prints it (NCCL WARN)
    // and tells the peers, so that ranks waiting on this one stop now instead of at a timeout.
    void fail(ncclResult_t code, const std::string& why);
    ncclResult_t async_error() const { return (ncclResult_t)async_.load(); }
    // Wakes every waiter and shuts the connections down (ncclCommAbort): waiting collectives
    // return at once with an error.
    void abort();
    // ncclCommDestroy: a goodbye to every peer, then the write side closes; the receivers drain
    // until the peers close theirs, so no byte a peer still reads is lost to a reset.
    void close_gracefully();

    // Collectives run in issue order on each communicator, whichever stream carries them.
    ncclResult_t submit(Call c, cudaStream_t stream, const char* fn);
    ncclResult_t execute(const Call& c);
    // Waits until every issued collective has run; false at the deadline.
    bool wait_idle(Clock::time_point deadline);

    std::mutex split_mu;  // one split at a time on a communicator
    uint64_t splits = 0;  // under split_mu

  private:
    void receive_loop(int peer);
    void notify_peers(MsgType type, const std::string& text);

    std::vector<int> fds_;
    std::vector<std::unique_ptr<std::mutex>> send_mu_;
    struct Inbox {
        std::deque<Msg> data, boot;
        bool closed = false;
        ncclResult_t code = ncclSuccess;
        std::string why;
    };
    std::mutex mu_;  // in_, executed_, aborted_ transitions
    std::condition_variable cv_;
    std::vector<Inbox> in_;
    std::atomic<int> async_{0};
    std::atomic<bool> aborted_{false};
    std::atomic<bool> closing_{false};
    std::mutex issue_mu_;
    std::atomic<uint64_t> issued_{0};
    uint64_t executed_ = 0;
};

// Bootstrap (net.cpp): the unique id names a root listener in the process that made it;
// ncclCommInitRank meets the other ranks there, then builds the mesh.
ncclResult_t make_unique_id(ncclUniqueId* id);
ncclResult_t init_rank(const ncclUniqueId& id, int nranks, int rank, std::shared_ptr<State>* out);
// Connects to every lower rank and accepts every higher one on `lfd`.
ncclResult_t build_mesh(uint64_t comm, int rank, int nranks, int lfd, const std::vector<Addr>& addrs,
                        Clock::time_point deadline, std::vector<int>* fds, std::string* why);
ncclResult_t split(State& parent, int color, int key, std::shared_ptr<State>* out);

// The collective algorithm (collectives.cpp), run when the call's turn has come.
ncclResult_t run_call(State& st, const Call& c, std::string* why);

}  // namespace femu

#endif
