//! Which data-parallel ranks share each of the engine's groups, derived once: the engine splits
//! its communicators along it, the planner (`ferrolm::planner`) prices rank 0's groups with it, and tests check it.
//!
//! Within a block of s_os consecutive data-parallel ranks, rank `r` (its index in the block)
//! holds parameter range `a = r mod s_p` and sub-index `b = r div s_p`; its optimizer range
//! `j = a · (s_os/s_p) + b` lies inside parameter range `a`. Each group is ordered so that its
//! k-th rank holds range k of what the group shards.
use super::ShardSpec;
// Re-exported: the engine names it through this module (`super::groups::Comm`).
pub use crate::comm::Comm;
use ferrolm_tensor::Result;
use std::sync::Arc;

/// The engine's data-parallel groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroGroup {
    /// P (s_p ranks, same block and b): all-gathers a parameter bucket before use (s_p > 1).
    Params,
    /// The block (s_os ranks), ordered by j: holds every optimizer range once.
    Block,
    /// OS sub-group (s_os/s_p ranks, same block and a): narrows a gradient range to the optimizer
    /// range, and gathers the updated optimizer ranges back into the parameter range.
    OptimSub,
    /// OS replicas (dp/s_os ranks, same j): sum the optimizer-range gradient across blocks.
    OptimReplicas,
}

/// Where one data-parallel rank sits in a spec's layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardPosition {
    /// Block of s_os consecutive data-parallel ranks.
    pub block: usize,
    /// a: the parameter range (of s_p) this rank holds.
    pub param_range: usize,
    /// b: its index among the ranks of its block that hold the same parameter range.
    pub sub_index: usize,
    /// j = a · (s_os/s_p) + b: the optimizer range (of s_os) this rank holds.
    pub optim_range: usize,
}

impl ShardPosition {
    pub fn of(dp_rank: usize, spec: ShardSpec) -> ShardPosition {
        let (sp, so) = (spec.params, spec.optim);
        let (block, r) = (dp_rank / so, dp_rank % so);
        let (a, b) = (r % sp, r / sp);
        ShardPosition { block, param_range: a, sub_index: b, optim_range: a * (so / sp) + b }
    }

    /// (color, key) of `group` for this rank: the ranks with this color form the group, in key
    /// order (the arguments of `Communicator::split`).
    pub fn split(&self, group: ZeroGroup, spec: ShardSpec) -> (usize, usize) {
        let k = spec.optim / spec.params;
        match group {
            ZeroGroup::Params => (self.block * k + self.sub_index, self.param_range),
            ZeroGroup::Block => (self.block, self.optim_range),
            ZeroGroup::OptimSub => (self.block * spec.params + self.param_range, self.sub_index),
            ZeroGroup::OptimReplicas => (self.optim_range, self.block),
        }
    }
}

/// The data-parallel ranks of `group` that contain `dp_rank`, in group order (from `split`, so
/// always what the engine builds).
pub fn members(group: ZeroGroup, spec: ShardSpec, dp: usize, dp_rank: usize) -> Vec<usize> {
    let color = ShardPosition::of(dp_rank, spec).split(group, spec).0;
    let mut m: Vec<(usize, usize)> = (0..dp)
        .filter_map(|r| {
            let (c, k) = ShardPosition::of(r, spec).split(group, spec);
            (c == color).then_some((k, r))
        })
        .collect();
    m.sort();
    m.into_iter().map(|(_, r)| r).collect()
}

/// One rank's communicators for its groups: one communicator per distinct group. A group of one
/// rank gets no communicator of the backend (a solo thread communicator: every collective a
/// copy), a group that is the whole dp group in its order is the dp communicator itself, and
/// groups with the same members in the same order share one (the gradient group G is P when
/// s_g = s_p and the block when s_g = s_os; MiCS's P is its block).
pub(crate) struct ShardGroups {
    pub pos: ShardPosition,
    pub params: Comm,
    pub grads: Comm,
    pub optim_sub: Comm,
    pub optim_replicas: Comm,
    pub block: Comm,
}

impl ShardGroups {
    /// Splits `dp` (collective over it: every data-parallel rank calls this with the same spec;
    /// which groups are split depends on the spec alone, so every rank splits the same ones).
    pub fn new(dp: &Comm, spec: ShardSpec) -> Result<ShardGroups> {
        let (n, me) = (dp.size(), dp.rank());
        let pos = ShardPosition::of(me, spec);
        let mut made: Vec<(Vec<usize>, Comm)> = vec![((0..n).collect(), dp.clone())];
        let mut comm = |g: ZeroGroup, name: &str| -> Result<Comm> {
            let m = members(g, spec, n, me);
            if let Some((_, c)) = made.iter().find(|(x, _)| *x == m) {
                return Ok(c.clone());
            }
            // Not `comm::sub_group`: a group of all dp ranks in another order (the block group of
            // some specs) is a split of its own, not `dp`.
            let c = if m.len() == 1 {
                crate::ThreadComm::solo(crate::CommOptions::default())
            } else {
                let (color, key) = pos.split(g, spec);
                dp.split_named(color, key, name)?
            };
            made.push((m, c.clone()));
            Ok(c)
        };
        let params = comm(ZeroGroup::Params, "zero_p")?;
        let optim_sub = comm(ZeroGroup::OptimSub, "zero_os")?;
        let block = comm(ZeroGroup::Block, "zero_block")?;
        let grads = if spec.grads == spec.params { params.clone() } else { block.clone() };
        let optim_replicas = comm(ZeroGroup::OptimReplicas, "zero_rep")?;
        Ok(ShardGroups { pos, params, grads, optim_sub, optim_replicas, block })
    }

    /// The distinct communicators (for traffic accounting; the dp communicator when a group is
    /// the whole dp group).
    pub fn all(&self) -> Vec<Comm> {
        let mut out: Vec<Comm> = Vec::new();
        for c in [&self.params, &self.grads, &self.optim_sub, &self.optim_replicas, &self.block] {
            if !out.iter().any(|x| Arc::ptr_eq(x, c)) {
                out.push(c.clone());
            }
        }
        out
    }
}

/// The communicators of more than one rank that world rank 0 of a `tp` × `dp` run holds, one
/// per distinct group as the mesh, tensor parallelism and the engine create them: the world,
/// the tp and dp groups when they are neither one rank nor the world, the group of ranks that
/// share a replicated key/value head (1 < `kv_heads` < tp), and the engine's groups under `spec`
/// that are neither one rank nor an earlier group. The planner's memory estimate counts NCCL's
/// buffers per communicator with it (crates/parallel/tests/communicators.rs holds it to the splits).
pub fn communicators(tp: usize, dp: usize, spec: ShardSpec, kv_heads: usize) -> usize {
    let (tp, dp) = (tp.max(1), dp.max(1));
    let mut groups: Vec<Vec<usize>> = vec![(0..tp * dp).collect(), (0..tp).collect(), (0..dp).map(|d| d * tp).collect()];
    if kv_heads > 1 && kv_heads < tp {
        groups.push((0..tp / kv_heads).collect());
    }
    for g in [ZeroGroup::Params, ZeroGroup::OptimSub, ZeroGroup::Block, ZeroGroup::OptimReplicas] {
        groups.push(members(g, spec, dp, 0).into_iter().map(|d| d * tp).collect());
    }
    let mut distinct: Vec<Vec<usize>> = groups.into_iter().filter(|g| g.len() > 1).collect();
    distinct.sort();
    distinct.dedup();
    distinct.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout of the module comment, for (s_p, s_g, s_os) = (2, 2, 4) over 8 ranks.
    #[test]
    fn groups_of_a_two_block_layout() {
        let s = ShardSpec { params: 2, grads: 2, optim: 4 };
        // Rank 5: block 1, r = 1 -> a = 1, b = 0, j = 2.
        let p = ShardPosition::of(5, s);
        assert_eq!((p.block, p.param_range, p.sub_index, p.optim_range), (1, 1, 0, 2));
        assert_eq!(members(ZeroGroup::Params, s, 8, 5), vec![4, 5]);
        assert_eq!(members(ZeroGroup::OptimSub, s, 8, 5), vec![5, 7]);
        assert_eq!(members(ZeroGroup::Block, s, 8, 5), vec![4, 6, 5, 7], "ordered by j");
        assert_eq!(members(ZeroGroup::OptimReplicas, s, 8, 5), vec![1, 5]);
        // Every optimizer range j lies inside parameter range a: j / (s_os/s_p) = a.
        for r in 0..8 {
            let p = ShardPosition::of(r, s);
            assert_eq!(p.optim_range / 2, p.param_range);
        }
    }

    /// The block and replica groups of MiCS (s, s, s) are s consecutive ranks and the ranks of
    /// one index across blocks.
    #[test]
    fn mics_blocks_and_replicas() {
        let s = ShardSpec::mics(2);
        assert_eq!(members(ZeroGroup::Block, s, 6, 3), vec![2, 3]);
        assert_eq!(members(ZeroGroup::Params, s, 6, 3), vec![2, 3]);
        assert_eq!(members(ZeroGroup::OptimReplicas, s, 6, 3), vec![1, 3, 5]);
        assert_eq!(members(ZeroGroup::OptimSub, s, 6, 3), vec![3]);
    }
}
