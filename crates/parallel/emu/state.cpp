// A communicator's connections: the receiver threads and queues, sends, failure, abort and
// destroy, and the per-communicator order in which collectives run (api.cpp issues them,
// collectives.cpp runs them).
#include "internal.h"

#include "ferro_emu_stream.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <thread>

namespace femu {

State::State(uint64_t id_, int rank_, int nranks_, uint32_t local_ip_, std::vector<int> fds)
    : id(id_), rank(rank_), nranks(nranks_), local_ip(local_ip_), fds_(std::move(fds)), in_(nranks_) {
    for (int p = 0; p < nranks; ++p) send_mu_.emplace_back(new std::mutex);
}

State::~State() {
    for (int fd : fds_)
        if (fd >= 0) close(fd);
}

void State::start_receivers() {
    std::shared_ptr<State> self = shared_from_this();
    for (int p = 0; p < nranks; ++p) {
        if (p == rank) continue;
        try {
            std::thread([self, p] { self->receive_loop(p); }).detach();
        } catch (...) {
            std::lock_guard<std::mutex> g(mu_);
            in_[p] = Inbox{};
            in_[p].closed = true;
            in_[p].code = ncclSystemError;
            in_[p].why = "cannot start the receiver thread for rank " + std::to_string(p);
        }
    }
}

void State::receive_loop(int p) {
    const int fd = fds_[p];
    const std::string peer = "rank " + std::to_string(p);
    for (;;) {
        Msg m;
        std::string why;
        ncclResult_t code = ncclRemoteError;
        bool ok = read_full(fd, &m.h, sizeof m.h);
        int e = errno;
        if (ok && (m.h.magic != kMsgMagic || m.h.comm != id)) {
            ok = false;
            code = ncclInternalError;
            why = peer + " sent bytes that are not a message of this communicator (corrupted stream)";
        }
        if (ok && m.h.bytes > 0) {
            m.data.reset(new (std::nothrow) char[m.h.bytes]);
            if (!m.data) {
                ok = false;
                code = ncclSystemError;
                why = "out of memory for a " + std::to_string(m.h.bytes) + "-byte message from " + peer;
            } else {
                ok = read_full(fd, m.data.get(), m.h.bytes);
                e = errno;
            }
        }
        if (!ok) {
            if (why.empty()) {
                if (closing_ || aborted_)
                    why = "this rank closed the communicator";
                else if (e == 0)
                    why = peer + " closed its connection without a goodbye: its process exited or was killed";
                else
                    why = "the connection to " + peer + " failed: " + strerror(e) + " (its process exited or was killed?)";
            }
            std::lock_guard<std::mutex> g(mu_);
            if (!in_[p].closed) {
                in_[p].closed = true;
                in_[p].code = code;
                in_[p].why = why;
            }
            cv_.notify_all();
            return;
        }
        if (closing_) continue;  // destroyed here: drain until the peer closes, keep nothing
        std::lock_guard<std::mutex> g(mu_);
        Inbox& in = in_[p];
        if (m.h.type == kData) {
            in.data.push_back(std::move(m));
        } else if (m.h.type == kSplit) {
            in.boot.push_back(std::move(m));
        } else if (!in.closed) {
            in.closed = true;
            in.code = ncclRemoteError;
            if (m.h.type == kBye)
                in.why = peer + " destroyed the communicator (ncclCommDestroy)";
            else
                in.why = peer + " failed: " + std::string(m.data ? m.data.get() : "", m.h.bytes);
        }
        cv_.notify_all();
    }
}

ncclResult_t State::send(int p, const MsgHdr& h, const void* payload, std::string* why) {
    std::lock_guard<std::mutex> g(*send_mu_[p]);
    iovec iov[2] = {{(void*)&h, sizeof h}, {(void*)payload, (size_t)h.bytes}};
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = h.bytes ? 2 : 1;
    size_t left = sizeof h + h.bytes;
    while (left > 0) {
        if (aborted_) {
            *why = "the communicator was aborted (ncclCommAbort)";
            return ncclSystemError;
        }
        ssize_t w = sendmsg(fds_[p], &mh, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int e = errno;
            if (aborted_) {
                *why = "the communicator was aborted (ncclCommAbort)";
                return ncclSystemError;
            }
            {
                // The peer said why it went away (destroy, failure, abort): that beats EPIPE.
                std::lock_guard<std::mutex> lk(mu_);
                if (in_[p].closed) {
                    *why = in_[p].why;
                    return in_[p].code;
                }
            }
            bool gone = e == EPIPE || e == ECONNRESET;
            *why = "sending to rank " + std::to_string(p) + " failed: " + strerror(e) + (gone ? " (its process exited or was killed?)" : "");
            return gone ? ncclRemoteError : ncclSystemError;
        }
        left -= (size_t)w;
        for (size_t adv = (size_t)w; adv > 0;) {
            if (adv >= mh.msg_iov[0].iov_len) {
                adv -= mh.msg_iov[0].iov_len;
                ++mh.msg_iov;
                --mh.msg_iovlen;
            } else {
                mh.msg_iov[0].iov_base = (char*)mh.msg_iov[0].iov_base + adv;
                mh.msg_iov[0].iov_len -= adv;
                adv = 0;
            }
        }
    }
    return ncclSuccess;
}

ncclResult_t State::recv(int p, bool bootstrap, Msg* out, std::string* why) {
    double t = timeout_seconds();
    Clock::time_point deadline = deadline_after(t);
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
        if (aborted_) {
            *why = "the communicator was aborted (ncclCommAbort) while waiting for rank " + std::to_string(p);
            return ncclSystemError;
        }
        std::deque<Msg>& q = bootstrap ? in_[p].boot : in_[p].data;
        if (!q.empty()) {
            *out = std::move(q.front());
            q.pop_front();
            return ncclSuccess;
        }
        if (in_[p].closed) {
            *why = in_[p].why;
            return in_[p].code;
        }
        if (Clock::now() >= deadline) {
            *why = "waited " + std::to_string((int)t) + " s for rank " + std::to_string(p) + " (NCCL_EMU_TIMEOUT)";
            return ncclSystemError;
        }
        if (deadline == Clock::time_point::max())
            cv_.wait(lk);
        else
            cv_.wait_until(lk, deadline);
    }
}

void State::notify_peers(MsgType type, const std::string& text) {
    MsgHdr h{};
    h.magic = kMsgMagic;
    h.type = type;
    h.comm = id;
    h.op = h.root = -1;
    h.from = rank;
    h.bytes = text.size();
    for (int p = 0; p < nranks; ++p) {
        if (p == rank) continue;
        // Never wait here: a failing or aborting rank must not hang on a send that a stuck
        // collective holds, or on a peer that stopped reading. A notice the socket cannot take
        // whole at once is left out; that peer learns from the closed connection instead.
        std::unique_lock<std::mutex> g(*send_mu_[p], std::try_to_lock);
        if (!g.owns_lock()) continue;
        iovec iov[2] = {{&h, sizeof h}, {(void*)text.data(), text.size()}};
        msghdr mh{};
        mh.msg_iov = iov;
        mh.msg_iovlen = text.empty() ? 1 : 2;
        (void)sendmsg(fds_[p], &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
}

void State::fail(ncclResult_t code, const std::string& why) {
    int none = ncclSuccess;
    if (!async_.compare_exchange_strong(none, (int)code)) return;
    if (aborted_) return;  // the abort is the news; its victims need no report
    warn("comm %016llx rank %d of %d: %s", (unsigned long long)id, rank, nranks, why.c_str());
    notify_peers(kFail, "rank " + std::to_string(rank) + ": " + why);
}

void State::abort() {
    {
        std::lock_guard<std::mutex> g(mu_);
        if (aborted_.exchange(true)) return;
    }
    cv_.notify_all();
    notify_peers(kFail, "rank " + std::to_string(rank) + " aborted the communicator (ncclCommAbort)");
    // Makes blocked sends fail and the receivers return; the descriptors close with the state.
    for (int fd : fds_)
        if (fd >= 0) shutdown(fd, SHUT_RDWR);
    info("ncclCommAbort: comm %016llx rank %d of %d", (unsigned long long)id, rank, nranks);
}

void State::close_gracefully() {
    closing_ = true;
    notify_peers(kBye, "");
    for (int fd : fds_)
        if (fd >= 0) shutdown(fd, SHUT_WR);
    info("ncclCommDestroy: comm %016llx rank %d of %d", (unsigned long long)id, rank, nranks);
}

namespace {
struct Work {
    std::shared_ptr<State> st;
    Call call;
};

void run_work(void* arg) {
    std::unique_ptr<Work> w(static_cast<Work*>(arg));
    w->st->execute(w->call);
}
}  // namespace

ncclResult_t State::submit(Call c, cudaStream_t stream, const char* fn) {
    const ferro_emu_stream_ops* ops = nullptr;
    if (stream) {
        ops = *static_cast<const ferro_emu_stream_ops* const*>(stream);
        if (!ops || ops->magic != FERRO_EMU_STREAM_MAGIC || !ops->enqueue) {
            warn("%s: stream %p is not a stream of the emulated CUDA device (its first member must point at ferro_emu_stream_ops "
                 "with magic 0x%08x); pass NULL to run at call time",
                 fn, stream, FERRO_EMU_STREAM_MAGIC);
            return ncclInvalidArgument;
        }
    }
    std::unique_lock<std::mutex> g(issue_mu_);
    c.seq = issued_.fetch_add(1);
    if (!ops) {
        g.unlock();
        return execute(c);
    }
    Work* w = new Work{shared_from_this(), c};
    if (ops->enqueue(stream, &run_work, w) != 0) {
        issued_.fetch_sub(1);
        delete w;
        warn("%s: the stream refused the work (destroyed?)", fn);
        return ncclUnhandledCudaError;
    }
    return ncclSuccess;
}

ncclResult_t State::execute(const Call& c) {
    {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return executed_ == c.seq || aborted_; });
        if (aborted_) return ncclSystemError;
    }
    // A failed communicator runs nothing more: the buffers stay as they were, and the
    // asynchronous error (or the return code at call time) says why.
    ncclResult_t r = async_error();
    if (r == ncclSuccess) {
        std::string why;
        r = run_call(*this, c, &why);
        if (r != ncclSuccess) fail(r, describe(c.kind, c.count, c.dtype, c.op, c.root) + " #" + std::to_string(c.seq) + ": " + why);
    }
    {
        std::lock_guard<std::mutex> g(mu_);
        ++executed_;
    }
    cv_.notify_all();
    return r;
}

bool State::wait_idle(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lk(mu_);
    auto idle = [&] { return executed_ == issued_.load() || aborted_; };
    if (deadline == Clock::time_point::max()) {
        cv_.wait(lk, idle);
        return true;
    }
    return cv_.wait_until(lk, deadline, idle);
}

}  // namespace femu
