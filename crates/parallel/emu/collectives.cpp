// The collectives of the emulated NCCL and their reductions.
//
// Each collective is one or two rounds in which every rank sends exactly one message to every
// other rank (possibly with an empty payload) and receives exactly one from each. Every message
// carries the sender's call, so any pair of ranks that disagree on a collective finds out at its
// first round, whatever the collective (a broadcast's root hears from every non-root too).
//
// - all-reduce: a reduce-scatter (rank r reduces chunk r), then an all-gather of the reduced
//   chunks. Each chunk is reduced once, by its owner, so every rank gets the same bits.
// - reduce-scatter: rank r reduces block r from every rank's contribution.
// - all-gather: every rank sends its block to every other.
// - broadcast: the root sends its buffer to every other rank.
// Reductions visit the ranks in rank order, accumulate in f32 for f16/bf16/f32 and in f64 for
// f64 (rounded once to the element type), wrap for integers, and propagate NaN through max and
// min (as the thread-rank reference in crates/parallel/src/reduce.rs does); avg is the sum divided
// by the rank count.
#include "internal.h"

#include <string.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace femu {

namespace {
const size_t kSizes[ncclNumTypes] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
const char* const kTypeNames[ncclNumTypes] = {"ncclInt8",  "ncclUint8",   "ncclInt32",   "ncclUint32",  "ncclInt64",
                                              "ncclUint64", "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16"};
const char* const kOpNames[ncclNumOps] = {"ncclSum", "ncclProd", "ncclMax", "ncclMin", "ncclAvg"};

std::string type_name(int t) {
    return t >= 0 && t < ncclNumTypes ? kTypeNames[t] : "datatype " + std::to_string(t);
}
std::string op_name(int o) {
    return o >= 0 && o < ncclNumOps ? kOpNames[o] : "op " + std::to_string(o);
}
}  // namespace

size_t dtype_size(int dtype) {
    return dtype >= 0 && dtype < ncclNumTypes ? kSizes[dtype] : 0;
}

std::string describe(Kind kind, uint64_t count, int dtype, int op, int root) {
    std::string n = std::to_string(count), t = type_name(dtype);
    switch (kind) {
    case kAllReduce:
        return "ncclAllReduce(count=" + n + ", " + t + ", " + op_name(op) + ")";
    case kAllGather:
        return "ncclAllGather(sendcount=" + n + ", " + t + ")";
    case kReduceScatter:
        return "ncclReduceScatter(recvcount=" + n + ", " + t + ", " + op_name(op) + ")";
    case kBroadcast:
        return "ncclBroadcast(count=" + n + ", " + t + ", root=" + std::to_string(root) + ")";
    }
    return "collective kind " + std::to_string((int)kind);
}

// ---------------------------------------------------------------------------------------------
// Element types: storage type S, accumulator Acc, load (widen) and store (round once).

namespace {
struct Bf16 {
    uint16_t bits;
};
struct Half {
    uint16_t bits;
};

float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

float bf16_to_f32(uint16_t h) {
    return bits_to_f32((uint32_t)h << 16);
}
uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);  // quiet NaN, sign kept
    u += 0x7FFFu + ((u >> 16) & 1u);                                               // round to nearest even
    return (uint16_t)(u >> 16);
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in f32
        float v = std::ldexp((float)man, -24);
        return sign ? -v : v;
    }
    if (exp == 0x1F) return bits_to_f32(sign | 0x7F800000u | (man << 13));
    return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t f32_to_f16(float f) {
    uint32_t u = f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t exp = (u >> 23) & 0xFFu, man = u & 0x7FFFFFu;
    if (exp == 0xFF) return (uint16_t)(sign | 0x7C00u | (man ? 0x0200u | (man >> 13) : 0u));  // inf, quiet NaN
    int e = (int)exp - 127 + 15;                                                           // biased f16 exponent
    if (e >= 0x1F) return (uint16_t)(sign | 0x7C00u);                                      // overflow: inf
    if (e <= 0) {
        // Subnormal (or zero): shift the full significand right, rounding to nearest even.
        if (e < -10) return sign;  // below half the smallest subnormal
        uint32_t full = man | 0x800000u;
        int shift = 14 - e;  // 14..24
        uint32_t q = full >> shift, rest = full & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (q & 1u))) ++q;
        return (uint16_t)(sign | q);  // a carry into the exponent field is the right answer
    }
    uint32_t q = ((uint32_t)e << 10) | (man >> 13), rest = man & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (q & 1u))) ++q;  // a carry may reach inf: right too
    return (uint16_t)(sign | q);
}

// How an element type reduces: the accumulator it widens to, whether it is a float (NaN wins,
// no wrap-around), and the conversions. Integers (wrapping like NCCL's integer kernels), f32 and
// f64 accumulate as themselves; bf16 and f16 (16 bits) widen to f32.
template <class S>
struct Elem {
    using Acc = S;
    static constexpr bool kFloat = std::is_floating_point_v<S>;
    static Acc load(S x) { return x; }
    static S store(Acc a) { return a; }
};
template <class S, float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
struct HalfWidth {
    using Acc = float;
    static constexpr bool kFloat = true;
    static Acc load(S x) { return Widen(x.bits); }
    static S store(Acc a) { return S{Narrow(a)}; }
};
template <>
struct Elem<Bf16> : HalfWidth<Bf16, bf16_to_f32, f32_to_bf16> {};
template <>
struct Elem<Half> : HalfWidth<Half, f16_to_f32, f32_to_f16> {};

template <class A, bool F, int OP>
A combine(A a, A b) {
    if constexpr (OP == ncclSum || OP == ncclAvg || OP == ncclProd) {
        if constexpr (F) {
            return OP == ncclProd ? a * b : a + b;
        } else {
            using U = std::make_unsigned_t<A>;
            return OP == ncclProd ? (A)(U)((U)a * (U)b) : (A)(U)((U)a + (U)b);
        }
    } else {
        if constexpr (F) {
            if (a != a || b != b) return std::numeric_limits<A>::quiet_NaN();  // NaN wins
        }
        return OP == ncclMax ? (b > a ? b : a) : (b < a ? b : a);
    }
}

template <class A, int OP>
A finish(A a, int n) {
    if constexpr (OP == ncclAvg) return a / (A)n;
    return a;
}

// out[i] = parts[0][i] op parts[1][i] op ... in rank order. `out` may be one of the parts
// (in place): each block is read completely before it is written.
template <class S, int OP>
void reduce_typed(const void* const* parts, int n, size_t len, void* out) {
    using E = Elem<S>;
    using A = typename E::Acc;
    constexpr size_t kBlock = 1024;
    A acc[kBlock];
    for (size_t b = 0; b < len; b += kBlock) {
        size_t m = std::min(kBlock, len - b);
        const S* p0 = static_cast<const S*>(parts[0]) + b;
        for (size_t i = 0; i < m; ++i) acc[i] = E::load(p0[i]);
        for (int q = 1; q < n; ++q) {
            const S* pq = static_cast<const S*>(parts[q]) + b;
            for (size_t i = 0; i < m; ++i) acc[i] = combine<A, E::kFloat, OP>(acc[i], E::load(pq[i]));
        }
        S* o = static_cast<S*>(out) + b;
        for (size_t i = 0; i < m; ++i) o[i] = E::store(finish<A, OP>(acc[i], n));
    }
}

using ReduceFn = void (*)(const void* const*, int, size_t, void*);

template <class S>
ReduceFn reduce_for_op(int op) {
    switch (op) {
    case ncclSum:
        return &reduce_typed<S, ncclSum>;
    case ncclProd:
        return &reduce_typed<S, ncclProd>;
    case ncclMax:
        return &reduce_typed<S, ncclMax>;
    case ncclMin:
        return &reduce_typed<S, ncclMin>;
    case ncclAvg:
        return &reduce_typed<S, ncclAvg>;
    }
    return nullptr;
}

ReduceFn reduce_fn(int dtype, int op) {
    switch (dtype) {
    case ncclInt8:
        return reduce_for_op<int8_t>(op);
    case ncclUint8:
        return reduce_for_op<uint8_t>(op);
    case ncclInt32:
        return reduce_for_op<int32_t>(op);
    case ncclUint32:
        return reduce_for_op<uint32_t>(op);
    case ncclInt64:
        return reduce_for_op<int64_t>(op);
    case ncclUint64:
        return reduce_for_op<uint64_t>(op);
    case ncclFloat16:
        return reduce_for_op<Half>(op);
    case ncclFloat32:
        return reduce_for_op<float>(op);
    case ncclFloat64:
        return reduce_for_op<double>(op);
    case ncclBfloat16:
        return reduce_for_op<Bf16>(op);
    }
    return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Rounds.

struct Part {
    const void* p;
    size_t bytes;
};

bool same_call(const MsgHdr& a, const MsgHdr& b) {
    return a.seq == b.seq && a.kind == b.kind && a.count == b.count && a.dtype == b.dtype && a.op == b.op && a.root == b.root;
}

// Sends out[p] to every peer p, then takes one message from every peer into in[p], checked
// against this rank's call; expect[p] is the payload size a matching call of rank p sends.
ncclResult_t round(State& st, const MsgHdr& mine, const std::vector<Part>& out, const std::vector<size_t>& expect, std::vector<Msg>* in,
                   std::string* why) {
    const int n = st.nranks, r = st.rank;
    MsgHdr h = mine;
    for (int k = 1; k < n; ++k) {  // staggered, so the ranks do not all start with rank 0
        int p = (r + k) % n;
        h.bytes = out[p].bytes;
        if (ncclResult_t e = st.send(p, h, out[p].p, why)) return e;
    }
    in->resize(n);
    for (int k = 1; k < n; ++k) {
        int p = (r + n - k) % n;
        Msg& m = (*in)[p];
        if (ncclResult_t e = st.recv(p, false, &m, why)) return e;
        if (!same_call(m.h, mine)) {
            *why = "ranks called different collectives: rank " + std::to_string(r) + " called #" + std::to_string(mine.seq) + " " +
                   describe((Kind)mine.kind, mine.count, mine.dtype, mine.op, mine.root) + ", rank " + std::to_string(p) + " called #" +
                   std::to_string(m.h.seq) + " " + describe((Kind)m.h.kind, m.h.count, m.h.dtype, m.h.op, m.h.root);
            return ncclInvalidUsage;
        }
        if (m.h.phase != mine.phase || m.h.bytes != expect[p] || m.h.from != p) {
            *why = "protocol error: rank " + std::to_string(p) + " sent round " + std::to_string(m.h.phase) + " with " +
                   std::to_string(m.h.bytes) + " bytes, expected round " + std::to_string(mine.phase) + " with " + std::to_string(expect[p]);
            return ncclInternalError;
        }
    }
    return ncclSuccess;
}

// The balanced split of `count` elements into n chunks: chunk q starts at off(q), has len(q).
struct Chunks {
    size_t base, rem;
    Chunks(size_t count, int n) : base(count / n), rem(count % n) {}
    size_t off(int q) const { return q * base + std::min<size_t>(q, rem); }
    size_t len(int q) const { return base + ((size_t)q < rem ? 1 : 0); }
};

const char* at(const void* p, size_t bytes) {
    return static_cast<const char*>(p) + bytes;
}
char* at(void* p, size_t bytes) {
    return static_cast<char*>(p) + bytes;
}
}  // namespace

ncclResult_t run_call(State& st, const Call& c, std::string* why) {
    const int n = st.nranks, r = st.rank;
    const size_t es = dtype_size(c.dtype);
    MsgHdr h{};
    h.magic = kMsgMagic;
    h.type = kData;
    h.comm = st.id;
    h.seq = c.seq;
    h.kind = c.kind;
    h.count = c.count;
    h.dtype = c.dtype;
    h.op = c.op;
    h.root = c.root;
    h.from = r;
    std::vector<Part> out(n, Part{nullptr, 0});
    std::vector<size_t> expect(n, 0);
    std::vector<Msg> in;
    std::vector<const void*> parts(n);
    switch (c.kind) {
    case kAllReduce: {
        Chunks ch(c.count, n);
        for (int p = 0; p < n; ++p) {
            out[p] = Part{at(c.send, ch.off(p) * es), ch.len(p) * es};
            expect[p] = ch.len(r) * es;
        }
        h.phase = 0;
        if (ncclResult_t e = round(st, h, out, expect, &in, why)) return e;
        for (int q = 0; q < n; ++q) parts[q] = q == r ? at(c.send, ch.off(r) * es) : (const void*)in[q].data.get();
        void* mine = at(c.recv, ch.off(r) * es);
        reduce_fn(c.dtype, c.op)(parts.data(), n, ch.len(r), mine);
        for (int p = 0; p < n; ++p) {
            out[p] = Part{mine, ch.len(r) * es};
            expect[p] = ch.len(p) * es;
        }
        h.phase = 1;
        if (ncclResult_t e = round(st, h, out, expect, &in, why)) return e;
        for (int q = 0; q < n; ++q)
            if (q != r && expect[q]) memcpy(at(c.recv, ch.off(q) * es), in[q].data.get(), expect[q]);
        return ncclSuccess;
    }
    case kReduceScatter: {
        const size_t block = c.count * es;
        for (int p = 0; p < n; ++p) {
            out[p] = Part{at(c.send, p * block), block};
            expect[p] = block;
        }
        if (ncclResult_t e = round(st, h, out, expect, &in, why)) return e;
        for (int q = 0; q < n; ++q) parts[q] = q == r ? at(c.send, r * block) : (const void*)in[q].data.get();
        reduce_fn(c.dtype, c.op)(parts.data(), n, c.count, c.recv);
        return ncclSuccess;
    }
    case kAllGather: {
        const size_t block = c.count * es;
        for (int p = 0; p < n; ++p) {
            out[p] = Part{c.send, block};
            expect[p] = block;
        }
        if (ncclResult_t e = round(st, h, out, expect, &in, why)) return e;
        if (block) memmove(at(c.recv, r * block), c.send, block);  // in place: the same address
        for (int q = 0; q < n; ++q)
            if (q != r && block) memcpy(at(c.recv, q * block), in[q].data.get(), block);
        return ncclSuccess;
    }
    case kBroadcast: {
        const size_t bytes = c.count * es;
        for (int p = 0; p < n; ++p) {
            out[p] = Part{c.send, r == c.root ? bytes : 0};
            expect[p] = p == c.root ? bytes : 0;
        }
        if (ncclResult_t e = round(st, h, out, expect, &in, why)) return e;
        if (!bytes) return ncclSuccess;
        if (r == c.root)
            memmove(c.recv, c.send, bytes);
        else
            memcpy(c.recv, in[c.root].data.get(), bytes);
        return ncclSuccess;
    }
    }
    *why = "unknown collective";
    return ncclInternalError;
}

}  // namespace femu
