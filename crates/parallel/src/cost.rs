//! The communication cost model, as pure functions: how many bytes a rank sends and how many
//! seconds a collective takes on a link. `SimLink` delays collectives by exactly these numbers
//! and `CommStats` counts bytes with them, so a planner that uses this module predicts what the
//! simulated link measures.
//!
//! Conventions:
//! - `total` is the size in bytes of the *full* tensor: the input of all_reduce and broadcast,
//!   the output of all_gather, the input of reduce_scatter.
//! - Flat ring over `n` ranks, bytes each rank sends: all_reduce `2(n-1)/n · total`
//!   (reduce-scatter then all-gather), all_gather and reduce_scatter `(n-1)/n · total`,
//!   broadcast `total` for every rank but the last of the chain (the rank just before the root
//!   in ring order), which sends nothing. A group of one sends nothing and costs nothing.
//! - A link is `alpha` (seconds of latency per ring step) plus bytes over `bandwidth` (bytes per
//!   second per rank): the alpha-beta ring model, in which a ring of `p` ranks takes `p - 1`
//!   steps per pass (AMSP's `t_rs = (p-1)(alpha + v/(p w))`), so latency grows with the group,
//!   which is what makes sharding over a whole large cluster slow. A collective inside one node
//!   costs `passes·(k-1)·alpha_intra + ring_bytes / bw_intra` (all_reduce two passes, the others
//!   one); broadcast charges `total` (the pipelined chain moves every byte over every link once).
//! - A group spanning `m > 1` nodes with at most `k` of its ranks on one node runs the
//!   hierarchical algorithm (each rank has its own inter-node bandwidth, as with one NIC per GPU):
//!   - all_reduce: intra reduce-scatter, inter all_reduce of the `total/k` shard, intra
//!     all-gather: `2·[(k-1)·alpha_i + (k-1)/k·total/bw_i] + 2(m-1)·alpha_e + 2(m-1)/m·(total/k)/bw_e`;
//!   - all_gather / reduce_scatter: one intra and one inter stage:
//!     `[(k-1)·alpha_i + (k-1)/k·total/bw_i] + (m-1)·alpha_e + (m-1)/m·(total/k)/bw_e`;
//!   - broadcast: root to one rank per node, then inside each node:
//!     `(m-1)·alpha_e + total/bw_e + [(k-1)·alpha_i + total/bw_i]`;
//!
//!   the bracketed intra terms vanish when `k = 1`. The hierarchical algorithm sends exactly the
//!   flat ring's bytes per rank (`(k-1)/k + (m-1)/(mk) = (n-1)/n`), split as `hier_bytes` says.

/// The collectives the model prices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
}

/// Bytes one rank sends in a flat ring of `n` ranks (for broadcast: a rank that forwards).
pub fn ring_bytes(kind: Kind, n: usize, total: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    match kind {
        Kind::AllReduce => 2.0 * (n - 1.0) / n * total,
        Kind::AllGather | Kind::ReduceScatter => (n - 1.0) / n * total,
        Kind::Broadcast => total,
    }
}

/// Bytes rank `rank` of `n` sends; `root` matters only for broadcast, whose chain runs
/// root, root+1, ... and whose last rank (root - 1 mod n) forwards nothing.
pub fn bytes_sent(kind: Kind, n: usize, rank: usize, root: usize, total: f64) -> f64 {
    if kind == Kind::Broadcast && n > 1 && (rank + n - root % n) % n == n - 1 {
        return 0.0;
    }
    ring_bytes(kind, n, total)
}

/// One level of interconnect.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Seconds of fixed latency per collective.
    pub alpha_s: f64,
    /// Bytes per second that one rank can send.
    pub bytes_per_s: f64,
}

impl Link {
    pub fn new(alpha_s: f64, bytes_per_s: f64) -> Self {
        Link { alpha_s, bytes_per_s }
    }
    /// `alpha + bytes / bandwidth`.
    pub fn seconds(&self, bytes: f64) -> f64 {
        self.alpha_s + bytes / self.bytes_per_s
    }
}

/// A two-level machine: `ranks_per_node` ranks (world ranks `i·rpn .. (i+1)·rpn`) share a node
/// and talk over `intra`; nodes talk over `inter`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    pub intra: Link,
    pub inter: Link,
    pub ranks_per_node: usize,
}

impl LinkModel {
    /// One link for everything (every group is inside one "node").
    pub fn flat(link: Link) -> Self {
        LinkModel { intra: link, inter: link, ranks_per_node: usize::MAX }
    }
    pub fn two_level(intra: Link, inter: Link, ranks_per_node: usize) -> Self {
        LinkModel { intra, inter, ranks_per_node: ranks_per_node.max(1) }
    }
}

/// How a group lies on the nodes: `nodes` nodes, at most `per_node` of its ranks on any one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSpan {
    pub per_node: usize,
    pub nodes: usize,
}

impl GroupSpan {
    /// The span of the group whose members are `world_ranks`.
    pub fn of(world_ranks: &[usize], ranks_per_node: usize) -> GroupSpan {
        let rpn = ranks_per_node.max(1);
        let mut counts = std::collections::BTreeMap::<usize, usize>::new();
        for &r in world_ranks {
            *counts.entry(r / rpn).or_default() += 1;
        }
        GroupSpan { per_node: counts.values().copied().max().unwrap_or(0), nodes: counts.len() }
    }
    /// Inside one node.
    pub fn intra(n: usize) -> GroupSpan {
        GroupSpan { per_node: n, nodes: 1 }
    }
}

/// (intra-node, inter-node) bytes one rank sends under the hierarchical algorithm (broadcast:
/// a forwarding rank).
pub fn hier_bytes(kind: Kind, span: GroupSpan, total: f64) -> (f64, f64) {
    let (k, m) = (span.per_node.max(1), span.nodes.max(1));
    if m == 1 {
        return (ring_bytes(kind, k, total), 0.0);
    }
    let shard = total / k as f64;
    match kind {
        Kind::AllReduce | Kind::AllGather | Kind::ReduceScatter => (ring_bytes(kind, k, total), ring_bytes(kind, m, shard)),
        Kind::Broadcast => (if k > 1 { total } else { 0.0 }, total),
    }
}

/// Seconds one collective over a group of shape `span` takes on `model` (formulas above).
pub fn seconds(kind: Kind, span: GroupSpan, total: f64, model: &LinkModel) -> f64 {
    let (k, m) = (span.per_node.max(1), span.nodes.max(1));
    if k * m <= 1 {
        return 0.0;
    }
    // Latency steps per stage: passes x (ranks in the ring - 1).
    let passes = if kind == Kind::AllReduce { 2.0 } else { 1.0 };
    let stage = |link: &Link, ranks: usize, bytes: f64| passes * (ranks as f64 - 1.0) * link.alpha_s + bytes / link.bytes_per_s;
    if m == 1 {
        return stage(&model.intra, k, ring_bytes(kind, k, total));
    }
    let (intra_b, inter_b) = hier_bytes(kind, span, total);
    let intra = if k > 1 { stage(&model.intra, k, intra_b) } else { 0.0 };
    intra + stage(&model.inter, m, inter_b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hierarchical_bytes_equal_the_flat_ring() {
        for (k, m) in [(1, 4), (4, 1), (2, 3), (8, 2)] {
            let n = k * m;
            for kind in [Kind::AllReduce, Kind::AllGather, Kind::ReduceScatter] {
                let (a, b) = hier_bytes(kind, GroupSpan { per_node: k, nodes: m }, 1e6);
                assert!((a + b - ring_bytes(kind, n, 1e6)).abs() < 1e-6, "{kind:?} k={k} m={m}");
            }
        }
    }

    #[test]
    fn seconds_follow_the_documented_formulas() {
        let intra = Link::new(1e-5, 1e11);
        let inter = Link::new(1e-4, 1e10);
        let model = LinkModel::two_level(intra, inter, 4);
        let b = 8e6;
        // One node of 4: two passes of 3 steps' latency + 2(n-1)/n B / bw.
        let t = seconds(Kind::AllReduce, GroupSpan::intra(4), b, &model);
        assert!((t - (6.0 * 1e-5 + 1.5 * b / 1e11)).abs() < 1e-12);
        // Two nodes of four: 2(3 alpha_i + 3/4 B/bw_i) + 2 alpha_e + 2(1/2)(B/4)/bw_e.
        let t = seconds(Kind::AllReduce, GroupSpan { per_node: 4, nodes: 2 }, b, &model);
        let want = 2.0 * (3.0 * 1e-5 + 0.75 * b / 1e11) + 2.0 * 1e-4 + (b / 4.0) / 1e10;
        assert!((t - want).abs() < 1e-12, "{t} vs {want}");
        // One rank per node: inter only, 3 steps.
        let t = seconds(Kind::AllGather, GroupSpan { per_node: 1, nodes: 4 }, b, &model);
        assert!((t - (3.0 * 1e-4 + 0.75 * b / 1e10)).abs() < 1e-12);
        // Latency grows with the ring: 64 ranks in one node pay 63 steps.
        let t = seconds(Kind::AllGather, GroupSpan::intra(64), 0.0, &model);
        assert!((t - 63.0 * 1e-5).abs() < 1e-12);
        // A group of one is free.
        assert_eq!(seconds(Kind::Broadcast, GroupSpan::intra(1), b, &model), 0.0);
    }

    #[test]
    fn broadcast_chain_ends_before_the_root() {
        let sent: Vec<f64> = (0..4).map(|r| bytes_sent(Kind::Broadcast, 4, r, 2, 10.0)).collect();
        assert_eq!(sent, [10.0, 0.0, 10.0, 10.0]);
    }

    #[test]
    fn span_counts_nodes_and_the_fullest_node() {
        assert_eq!(GroupSpan::of(&[0, 1, 2, 3], 4), GroupSpan { per_node: 4, nodes: 1 });
        assert_eq!(GroupSpan::of(&[1, 5, 9], 4), GroupSpan { per_node: 1, nodes: 3 });
        assert_eq!(GroupSpan::of(&[2, 3, 4], 4), GroupSpan { per_node: 2, nodes: 2 });
    }
}
