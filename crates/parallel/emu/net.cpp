// Sockets, logging, and the bootstrap of the emulated NCCL: the unique id, the root that ranks
// meet at, the mesh of a communicator, and ncclCommSplit's exchange.
//
// The unique id holds the root's address and a random magic. ncclGetUniqueId opens the root's
// listener and starts a thread that collects one hello (rank, nranks, the rank's own listener)
// from every rank, then sends every rank the table of listeners, or an error naming what went
// wrong (ranks that never came within NCCL_EMU_TIMEOUT, disagreeing nranks, a rank twice).
// Nothing assumes the ranks share a parent process: only the 128 bytes travel between them.
#include "internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <thread>

namespace femu {

namespace {
std::mutex g_log_mu;
std::string* g_last_warning = new std::string;  // never freed: usable during process exit

void vlog(const char* level, const char* fmt, va_list ap) {
    char msg[4096];
    vsnprintf(msg, sizeof msg, fmt, ap);
    char host[256] = "?";
    gethostname(host, sizeof host - 1);
    std::lock_guard<std::mutex> g(g_log_mu);
    fprintf(stderr, "%s:%d:%ld [emu] NCCL %s %s\n", host, (int)getpid(), (long)syscall(SYS_gettid), level, msg);
    fflush(stderr);
    if (level[0] == 'W') *g_last_warning = msg;
}
}  // namespace

void warn(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog("WARN", fmt, ap);
    va_end(ap);
}

void info(const char* fmt, ...) {
    const char* d = getenv("NCCL_DEBUG");
    if (!d || (strcasecmp(d, "INFO") != 0 && strcasecmp(d, "TRACE") != 0)) return;
    va_list ap;
    va_start(ap, fmt);
    vlog("INFO", fmt, ap);
    va_end(ap);
}

std::string last_warning() {
    std::lock_guard<std::mutex> g(g_log_mu);
    return *g_last_warning;
}

double timeout_seconds() {
    const char* s = getenv("NCCL_EMU_TIMEOUT");
    if (!s || !*s) return 900.0;
    char* end = nullptr;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || !(v >= 0)) {
        static std::atomic<bool> once{false};
        if (!once.exchange(true)) warn("NCCL_EMU_TIMEOUT=%s is not a number of seconds; using 900", s);
        return 900.0;
    }
    return v;
}

Clock::time_point deadline_after(double seconds) {
    if (seconds <= 0) return Clock::time_point::max();
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

static int ms_until(Clock::time_point deadline) {
    if (deadline == Clock::time_point::max()) return 1000;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return (int)std::max<long long>(0, std::min<long long>(left, 1000));
}

std::string to_string(const Addr& a) {
    char ip[INET_ADDRSTRLEN] = "?";
    in_addr ia;
    ia.s_addr = a.ip;
    inet_ntop(AF_INET, &ia, ip, sizeof ip);
    return std::string(ip) + ":" + std::to_string(ntohs(a.port));
}

int listen_socket(uint32_t ip, Addr* bound, std::string* err) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        *err = std::string("socket: ") + strerror(errno);
        return -1;
    }
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = ip;
    sa.sin_port = 0;
    socklen_t len = sizeof sa;
    if (bind(fd, (sockaddr*)&sa, sizeof sa) != 0 || listen(fd, SOMAXCONN) != 0 || getsockname(fd, (sockaddr*)&sa, &len) != 0) {
        *err = std::string("cannot listen on ") + to_string(Addr{ip, 0, 0}) + ": " + strerror(errno);
        close(fd);
        return -1;
    }
    *bound = Addr{ip, sa.sin_port, 0};
    return fd;
}

int connect_socket(const Addr& to, Clock::time_point deadline, std::string* err) {
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            *err = std::string("socket: ") + strerror(errno);
            return -1;
        }
        sockaddr_in sa{};
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = to.ip;
        sa.sin_port = to.port;
        if (connect(fd, (sockaddr*)&sa, sizeof sa) == 0) {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            return fd;
        }
        int e = errno;
        close(fd);
        bool retry = e == ECONNREFUSED || e == ETIMEDOUT || e == EAGAIN || e == EINTR || e == ENETUNREACH || e == EHOSTUNREACH;
        if (!retry || Clock::now() >= deadline) {
            *err = "cannot connect to " + to_string(to) + ": " + strerror(e);
            return -1;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
}

int accept_by(int lfd, Clock::time_point deadline) {
    for (;;) {
        pollfd p{lfd, POLLIN, 0};
        int r = poll(&p, 1, ms_until(deadline));
        if (r > 0) {
            int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
            if (fd >= 0) {
                int one = 1;
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                return fd;
            }
            if (errno != EINTR && errno != ECONNABORTED && errno != EAGAIN) return -1;
        } else if (r < 0 && errno != EINTR) {
            return -1;
        }
        if (Clock::now() >= deadline) return -1;
    }
}

bool write_full(int fd, const void* p, size_t n) {
    const char* c = (const char*)p;
    while (n > 0) {
        ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        c += w;
        n -= (size_t)w;
    }
    return true;
}

// One recv into the n bytes at c, advancing both past what arrived (nothing on EINTR). False on
// an error, or on the peer's close with errno 0.
static bool recv_some(int fd, char*& c, size_t& n) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) return true;
    if (r == 0) errno = 0;
    if (r <= 0) return false;
    c += r;
    n -= (size_t)r;
    return true;
}

bool read_full(int fd, void* p, size_t n) {
    char* c = (char*)p;
    while (n > 0)
        if (!recv_some(fd, c, n)) return false;
    return true;
}

bool read_full_by(int fd, void* p, size_t n, Clock::time_point deadline) {
    char* c = (char*)p;
    while (n > 0) {
        pollfd q{fd, POLLIN, 0};
        int r = poll(&q, 1, ms_until(deadline));
        if (r < 0 && errno != EINTR) return false;
        if (r > 0) {
            if (!recv_some(fd, c, n)) return false;
        } else if (Clock::now() >= deadline) {
            errno = ETIMEDOUT;
            return false;
        }
    }
    return true;
}

uint64_t random_u64() {
    uint64_t v = 0;
    FILE* f = fopen("/dev/urandom", "rb");
    if (f) {
        if (fread(&v, sizeof v, 1, f) != 1) v = 0;
        fclose(f);
    }
    if (v == 0) v = (uint64_t)Clock::now().time_since_epoch().count() ^ ((uint64_t)getpid() << 32);
    return v;
}

uint64_t mix(uint64_t a, uint64_t b) {
    // splitmix64 of the pair: distinct inputs give distinct-looking ids.
    uint64_t z = a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// ---------------------------------------------------------------------------------------------
// The unique id and the bootstrap root.

namespace {
constexpr char kIdTag[8] = {'F', 'E', 'R', 'R', 'O', 'E', 'M', 'U'};
constexpr uint32_t kIdVersion = 1;

struct IdBlob {
    char tag[8];
    uint32_t version;
    Addr root;
    uint64_t magic;
};
static_assert(sizeof(IdBlob) <= NCCL_UNIQUE_ID_BYTES, "the id fits ncclUniqueId");

struct Hello {  // rank -> root
    uint64_t magic;
    int32_t rank, nranks;
    Addr listener;
};
struct Reply {  // root -> rank: ncclSuccess and nranks Addrs, or an error code and its text
    int32_t code;
    uint32_t len;
};
struct PeerHello {  // the first bytes on a mesh connection
    uint64_t comm;
    int32_t rank, nranks;
};

void reply_error(int fd, ncclResult_t code, const std::string& text) {
    Reply r{code, (uint32_t)text.size()};
    if (write_full(fd, &r, sizeof r)) write_full(fd, text.data(), text.size());
}

// The roots running in this process, by magic. A rank in the root's own process waits for its
// root to finish answering before ncclCommInitRank returns: otherwise that process could exit
// (say, after an error) while the root still owes the other ranks their answer.
struct RootDone {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
};
std::mutex g_roots_mu;
std::map<uint64_t, std::shared_ptr<RootDone>>* g_roots = new std::map<uint64_t, std::shared_ptr<RootDone>>;

void wait_for_local_root(uint64_t magic) {
    std::shared_ptr<RootDone> d;
    {
        std::lock_guard<std::mutex> g(g_roots_mu);
        auto it = g_roots->find(magic);
        if (it == g_roots->end()) return;
        d = it->second;
    }
    std::unique_lock<std::mutex> lk(d->mu);
    d->cv.wait_for(lk, std::chrono::seconds(10), [&] { return d->done; });
}

void root_main(int lfd, uint64_t magic, double timeout, std::shared_ptr<RootDone> finished) {
    Clock::time_point deadline = deadline_after(timeout);
    int n = -1, joined = 0;
    std::vector<int> fds;
    std::vector<Addr> table;
    std::string error;
    ncclResult_t code = ncclSystemError;
    while (n < 0 || joined < n) {
        int c = accept_by(lfd, deadline);
        if (c < 0) {
            if (Clock::now() < deadline) continue;
            std::string missing;
            for (int r = 0; r < n; ++r)
                if (fds[r] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
            error = "bootstrap: only " + std::to_string(joined) + " of " + (n < 0 ? std::string("?") : std::to_string(n)) +
                    " ranks called ncclCommInitRank within " + std::to_string((int)timeout) + " s (NCCL_EMU_TIMEOUT); missing ranks: " +
                    (missing.empty() ? "?" : missing);
            break;
        }
        Hello h;
        if (!read_full_by(c, &h, sizeof h, Clock::now() + std::chrono::seconds(10)) || h.magic != magic) {
            close(c);  // a stray connection, or a rank of another job: not ours
            continue;
        }
        if (h.nranks < 1) {
            close(c);
            continue;
        }
        if (n < 0) {
            n = h.nranks;
            fds.assign(n, -1);
            table.assign(n, Addr{0, 0, 0});
        }
        if (h.nranks != n || h.rank < 0 || h.rank >= n || fds[h.rank] >= 0) {
            code = ncclInvalidUsage;
            if (h.nranks != n)
                error = "bootstrap: rank " + std::to_string(h.rank) + " called ncclCommInitRank with nranks=" + std::to_string(h.nranks) +
                        ", an earlier rank with nranks=" + std::to_string(n);
            else
                error = "bootstrap: two processes called ncclCommInitRank as rank " + std::to_string(h.rank) + " of " + std::to_string(n);
            reply_error(c, code, error);
            close(c);
            break;
        }
        fds[h.rank] = c;
        table[h.rank] = h.listener;
        ++joined;
    }
    close(lfd);
    if (!error.empty()) warn("%s", error.c_str());
    for (int r = 0; r < n; ++r) {
        if (fds[r] < 0) continue;
        if (error.empty()) {
            Reply ok{ncclSuccess, (uint32_t)(n * sizeof(Addr))};
            if (write_full(fds[r], &ok, sizeof ok)) write_full(fds[r], table.data(), n * sizeof(Addr));
        } else {
            reply_error(fds[r], code, error);
        }
        close(fds[r]);
    }
    {
        std::lock_guard<std::mutex> g(g_roots_mu);
        g_roots->erase(magic);
    }
    std::lock_guard<std::mutex> g(finished->mu);
    finished->done = true;
    finished->cv.notify_all();
}
}  // namespace

ncclResult_t make_unique_id(ncclUniqueId* id) {
    uint32_t ip = htonl(INADDR_LOOPBACK);
    const char* host = getenv("NCCL_EMU_HOST");
    if (host && *host) {
        in_addr ia;
        if (inet_pton(AF_INET, host, &ia) != 1) {
            warn("NCCL_EMU_HOST=%s is not an IPv4 address (the address other ranks reach this process at)", host);
            return ncclInvalidArgument;
        }
        ip = ia.s_addr;
    }
    Addr root;
    std::string err;
    int lfd = listen_socket(ip, &root, &err);
    if (lfd < 0) {
        warn("ncclGetUniqueId: %s", err.c_str());
        return ncclSystemError;
    }
    IdBlob b;
    memcpy(b.tag, kIdTag, sizeof b.tag);
    b.version = kIdVersion;
    b.root = root;
    b.magic = random_u64();
    auto finished = std::make_shared<RootDone>();
    {
        std::lock_guard<std::mutex> g(g_roots_mu);
        (*g_roots)[b.magic] = finished;
    }
    try {
        std::thread(root_main, lfd, b.magic, timeout_seconds(), finished).detach();
    } catch (...) {
        std::lock_guard<std::mutex> g(g_roots_mu);
        g_roots->erase(b.magic);
        close(lfd);
        warn("ncclGetUniqueId: cannot start the bootstrap thread");
        return ncclSystemError;
    }
    memset(id->internal, 0, sizeof id->internal);
    memcpy(id->internal, &b, sizeof b);
    info("ncclGetUniqueId: bootstrap root listening on %s", to_string(root).c_str());
    return ncclSuccess;
}

ncclResult_t build_mesh(uint64_t comm, int rank, int n, int lfd, const std::vector<Addr>& addrs, Clock::time_point deadline,
                        std::vector<int>* fds, std::string* why) {
    fds->assign(n, -1);
    auto fail = [&](const std::string& w) {
        for (int& fd : *fds)
            if (fd >= 0) close(fd);
        fds->assign(n, -1);
        *why = w;
        return ncclSystemError;
    };
    // Lower ranks are already listening (they listened before the table was sent), so these
    // connects complete in the listeners' backlog while the lower ranks are still connecting.
    for (int p = 0; p < rank; ++p) {
        std::string err;
        int fd = connect_socket(addrs[p], deadline, &err);
        if (fd < 0) return fail("connecting to rank " + std::to_string(p) + ": " + err);
        PeerHello h{comm, rank, n};
        (*fds)[p] = fd;
        if (!write_full(fd, &h, sizeof h)) return fail("greeting rank " + std::to_string(p) + ": " + strerror(errno));
    }
    for (int need = n - 1 - rank; need > 0;) {
        int c = accept_by(lfd, deadline);
        if (c < 0) {
            std::string missing;
            for (int p = rank + 1; p < n; ++p)
                if ((*fds)[p] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
            return fail("ranks " + missing + " did not connect within NCCL_EMU_TIMEOUT");
        }
        PeerHello h;
        if (!read_full_by(c, &h, sizeof h, Clock::now() + std::chrono::seconds(10)) || h.comm != comm || h.nranks != n ||
            h.rank <= rank || h.rank >= n || (*fds)[h.rank] >= 0) {
            close(c);  // not a member of this communicator
            continue;
        }
        (*fds)[h.rank] = c;
        --need;
    }
    return ncclSuccess;
}

ncclResult_t init_rank(const ncclUniqueId& id, int nranks, int rank, std::shared_ptr<State>* out) {
    IdBlob b;
    memcpy(&b, id.internal, sizeof b);
    if (memcmp(b.tag, kIdTag, sizeof b.tag) != 0 || b.version != kIdVersion) {
        warn("ncclCommInitRank: the unique id was not made by this library's ncclGetUniqueId (an id of real NCCL, or "
             "garbage?)");
        return ncclInvalidArgument;
    }
    double timeout = timeout_seconds();
    Clock::time_point deadline = deadline_after(timeout);
    std::string err;
    int rfd = connect_socket(b.root, deadline, &err);
    if (rfd < 0) {
        warn("ncclCommInitRank rank %d: cannot reach the bootstrap root (the process that called ncclGetUniqueId): %s", rank,
             err.c_str());
        return ncclSystemError;
    }
    // Listen where this process reaches the root from: the interface its peers can reach too.
    sockaddr_in local{};
    socklen_t len = sizeof local;
    getsockname(rfd, (sockaddr*)&local, &len);
    Addr me;
    int lfd = listen_socket(local.sin_addr.s_addr, &me, &err);
    if (lfd < 0) {
        close(rfd);
        warn("ncclCommInitRank rank %d: %s", rank, err.c_str());
        return ncclSystemError;
    }
    Hello h{b.magic, rank, nranks, me};
    Reply r{};
    // The root answers when everyone has joined or at its own deadline: wait a little longer.
    Clock::time_point answer_by = timeout > 0 ? deadline + std::chrono::seconds(5) : deadline;
    if (!write_full(rfd, &h, sizeof h) || !read_full_by(rfd, &r, sizeof r, answer_by)) {
        int e = errno;
        close(rfd);
        close(lfd);
        warn("ncclCommInitRank rank %d of %d: no answer from the bootstrap root at %s (%s)", rank, nranks, to_string(b.root).c_str(),
             e == ETIMEDOUT ? "timed out: see NCCL_EMU_TIMEOUT" : e ? strerror(e) : "it closed the connection: did its process exit?");
        return ncclSystemError;
    }
    std::vector<char> body(r.len);
    bool got = read_full_by(rfd, body.data(), body.size(), answer_by);
    close(rfd);
    wait_for_local_root(b.magic);
    if (!got || r.code != ncclSuccess || r.len != nranks * sizeof(Addr)) {
        close(lfd);
        std::string text = got && r.code != ncclSuccess ? std::string(body.begin(), body.end()) : "malformed answer from the root";
        warn("ncclCommInitRank rank %d of %d: %s", rank, nranks, text.c_str());
        return r.code != ncclSuccess ? (ncclResult_t)r.code : ncclInternalError;
    }
    std::vector<Addr> table(nranks);
    memcpy(table.data(), body.data(), body.size());
    uint64_t comm = mix(b.magic, 0x776F726C64ull);
    std::vector<int> fds;
    std::string why;
    ncclResult_t res = build_mesh(comm, rank, nranks, lfd, table, deadline, &fds, &why);
    close(lfd);
    if (res != ncclSuccess) {
        warn("ncclCommInitRank rank %d of %d: %s", rank, nranks, why.c_str());
        return res;
    }
    *out = std::make_shared<State>(comm, rank, nranks, local.sin_addr.s_addr, std::move(fds));
    (*out)->start_receivers();
    info("ncclCommInitRank: comm %016llx rank %d of %d connected", (unsigned long long)comm, rank, nranks);
    return ncclSuccess;
}

// ---------------------------------------------------------------------------------------------
// ncclCommSplit: an all-gather of (color, key, new listener) over the parent's bootstrap queues,
// then a mesh among the ranks of each color, ordered by (key, parent rank) as NCCL orders them.

namespace {
struct SplitRecord {
    int32_t color, key;
    Addr listener;
};
}  // namespace

ncclResult_t split(State& parent, int color, int key, std::shared_ptr<State>* out) {
    std::lock_guard<std::mutex> g(parent.split_mu);
    uint64_t k = parent.splits++;
    Clock::time_point deadline = deadline_after(timeout_seconds());
    std::string why;
    auto fail = [&](ncclResult_t code, int lfd) {
        if (lfd >= 0) close(lfd);
        warn("ncclCommSplit #%llu of comm %016llx rank %d of %d (color %d, key %d): %s", (unsigned long long)k,
             (unsigned long long)parent.id, parent.rank, parent.nranks, color, key, why.c_str());
        return code;
    };
    int lfd = -1;
    Addr me{parent.local_ip, 0, 0};
    if (color != NCCL_SPLIT_NOCOLOR) {
        lfd = listen_socket(parent.local_ip, &me, &why);
        if (lfd < 0) return fail(ncclSystemError, -1);
    }
    std::vector<SplitRecord> all(parent.nranks);
    all[parent.rank] = SplitRecord{color, key, me};
    MsgHdr h{};
    h.magic = kMsgMagic;
    h.type = kSplit;
    h.comm = parent.id;
    h.seq = k;
    h.op = h.root = -1;
    h.from = parent.rank;
    h.bytes = sizeof(SplitRecord);
    for (int p = 0; p < parent.nranks; ++p) {
        if (p == parent.rank) continue;
        if (ncclResult_t e = parent.send(p, h, &all[parent.rank], &why)) return fail(e, lfd);
    }
    for (int p = 0; p < parent.nranks; ++p) {
        if (p == parent.rank) continue;
        Msg m;
        if (ncclResult_t e = parent.recv(p, true, &m, &why)) return fail(e, lfd);
        if (m.h.seq != k || m.h.bytes != sizeof(SplitRecord) || m.h.comm != parent.id) {
            why = "rank " + std::to_string(p) + " sent split #" + std::to_string(m.h.seq) + " while this rank is in split #" +
                  std::to_string(k) + " (protocol error)";
            return fail(ncclInternalError, lfd);
        }
        memcpy(&all[p], m.data.get(), sizeof(SplitRecord));
    }
    *out = nullptr;
    if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
    std::vector<std::pair<int, int>> members;  // (key, parent rank)
    for (int p = 0; p < parent.nranks; ++p)
        if (all[p].color == color) members.emplace_back(all[p].key, p);
    std::sort(members.begin(), members.end());
    int n = (int)members.size(), rank = -1;
    std::vector<Addr> addrs(n);
    for (int i = 0; i < n; ++i) {
        addrs[i] = all[members[i].second].listener;
        if (members[i].second == parent.rank) rank = i;
    }
    uint64_t id = mix(mix(parent.id, k + 1), (uint64_t)(uint32_t)color);
    std::vector<int> fds;
    if (ncclResult_t e = build_mesh(id, rank, n, lfd, addrs, deadline, &fds, &why)) return fail(e, lfd);
    close(lfd);
    *out = std::make_shared<State>(id, rank, n, parent.local_ip, std::move(fds));
    (*out)->start_receivers();
    info("ncclCommSplit: comm %016llx rank %d of %d -> comm %016llx rank %d of %d (color %d, key %d)", (unsigned long long)parent.id,
         parent.rank, parent.nranks, (unsigned long long)id, rank, n, color, key);
    return ncclSuccess;
}

}  // namespace femu
