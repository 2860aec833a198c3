//! `DeviceMesh`: the world split into the tensor-parallel and data-parallel groups.
//!
//! World ranks are laid out dp-major: `rank = dp_index · tp + tp_index`, so the `tp` ranks of
//! one model replica are consecutive and stay inside a node (`ranks_per_node` must be a
//! multiple of `tp`). The dp group of a rank holds the ranks with its `tp_index`; the sharded
//! engine cuts it further into its own groups (`zero::groups`).
//!
//! One communicator per distinct group (each costs NCCL its connections and buffers): a group
//! of one rank gets a solo thread communicator (every collective a copy, nothing of the
//! backend), and a group that is the whole world in world order is the world communicator.
use crate::comm::Communicator;
use crate::cost::GroupSpan;
use ferrolm_tensor::{bail, Result};
use std::sync::Arc;

pub struct DeviceMesh {
    world: Arc<dyn Communicator>,
    tp: usize,
    dp: usize,
    ranks_per_node: usize,
    tp_group: Arc<dyn Communicator>,
    dp_group: Arc<dyn Communicator>,
}

impl DeviceMesh {
    /// Splits `world` into tp and dp groups. Collective: every world rank must call it.
    pub fn new(world: Arc<dyn Communicator>, tp: usize, dp: usize, ranks_per_node: usize) -> Result<DeviceMesh> {
        if tp == 0 || dp == 0 || ranks_per_node == 0 {
            bail!("mesh", "tp ({tp}), dp ({dp}) and ranks_per_node ({ranks_per_node}) must be at least 1");
        }
        if tp * dp != world.size() {
            bail!("mesh", "tp {tp} x dp {dp} = {} ranks, but the world has {}", tp * dp, world.size());
        }
        if !ranks_per_node.is_multiple_of(tp) {
            bail!("mesh", "tp {tp} does not divide the {ranks_per_node} ranks per node: a tensor-parallel group must stay inside a node");
        }
        let r = world.rank();
        let (dp_index, tp_index) = (r / tp, r % tp);
        // The decisions depend on tp and dp alone, so every rank splits the same groups; a group
        // of the whole world is ordered by world rank (key == world rank).
        let tp_group = crate::comm::sub_group(&world, tp, dp_index, tp_index, "tp")?;
        let dp_group = crate::comm::sub_group(&world, dp, tp_index, dp_index, "dp")?;
        Ok(DeviceMesh { world, tp, dp, ranks_per_node, tp_group, dp_group })
    }

    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }
    pub fn tp(&self) -> usize {
        self.tp
    }
    pub fn dp(&self) -> usize {
        self.dp
    }
    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }
    pub fn tp_rank(&self) -> usize {
        self.world.rank() % self.tp
    }
    pub fn dp_rank(&self) -> usize {
        self.world.rank() / self.tp
    }
    pub fn tp_group(&self) -> &Arc<dyn Communicator> {
        &self.tp_group
    }
    pub fn dp_group(&self) -> &Arc<dyn Communicator> {
        &self.dp_group
    }

    /// How a block of `s` consecutive dp ranks lies on the nodes: inside one node when `s` fits in a
    /// node's dp ranks, else across whole nodes. A block that would straddle a node boundary
    /// only partly is an error.
    pub fn dp_span(&self, s: usize) -> Result<GroupSpan> {
        dp_span(self.tp, self.dp, self.ranks_per_node, s)
    }
}

/// `DeviceMesh::dp_span` without a mesh (what a planner needs before any rank exists): every
/// block of `s` consecutive dp ranks (world ranks `(b·s + i)·tp + tp_index`) must lie inside one
/// node or consist of whole nodes.
pub fn dp_span(tp: usize, dp: usize, ranks_per_node: usize, s: usize) -> Result<GroupSpan> {
    if tp == 0 || ranks_per_node == 0 || !ranks_per_node.is_multiple_of(tp) {
        bail!("mesh", "tp {tp} must divide the {ranks_per_node} ranks per node");
    }
    if s == 0 || !dp.is_multiple_of(s) {
        bail!("mesh", "a dp sub-group size must divide dp = {dp}, got {s}");
    }
    let per_node = ranks_per_node / tp; // dp ranks on one node
    let mut span = None;
    for b in 0..dp / s {
        let ranks: Vec<usize> = (0..s).map(|i| (b * s + i) * tp).collect();
        let g = GroupSpan::of(&ranks, ranks_per_node);
        let ok = g.nodes == 1 || (g.per_node == per_node && g.nodes * per_node == s);
        if !ok {
            bail!(
                "mesh",
                "a dp sub-group of {s} ranks straddles a node boundary ({per_node} dp ranks per node with tp {tp} and {ranks_per_node} ranks per node): \
                 use a size that divides {per_node} or a multiple of it"
            );
        }
        if span.is_some_and(|sp| sp != g) {
            bail!("mesh", "dp sub-groups of {s} ranks lie unevenly on the nodes");
        }
        span = Some(g);
    }
    Ok(span.expect("dp >= s >= 1"))
}
