//! One communicator per distinct group: the mesh, tensor parallelism and the sharded engine
//! together create (split) no communicator of one rank and none whose ranks another already
//! has, for several layouts on thread ranks. Each split is what NCCL pays a communicator
//! (connections and buffers) for, so the count per rank is asserted exactly.
use ferrolm_nn::optim::AdamWConfig;
use ferrolm_nn::{Llama, LlamaConfig};
use ferrolm_parallel::comm::{Collective, Completion};
use ferrolm_parallel::zero::{Placement, ShardSpec, Zero};
use ferrolm_parallel::{CommOptions, Communicator, DeviceMesh, ThreadComm};
use ferrolm_tensor::{DType, Device, Result, Rng, Tensor};
use std::sync::{Arc, Mutex};

/// Records the ranks of every communicator split from it (and from its splits).
struct Counting {
    inner: Arc<dyn Communicator>,
    made: Arc<Mutex<Vec<Vec<usize>>>>,
}

impl Communicator for Counting {
    ferrolm_parallel::forward_to_inner!();
    fn launch(&self, op: Collective, x: &Tensor) -> Result<Completion> {
        self.inner.launch(op, x)
    }
    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }
    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        let c = self.inner.split_named(color, key, name)?;
        self.made.lock().unwrap().push(c.world_ranks().to_vec());
        Ok(Arc::new(Counting { inner: c, made: self.made.clone() }))
    }
}

fn config() -> LlamaConfig {
    // One key/value head: with tp 2 both ranks hold it and sum its gradient over the tp group.
    LlamaConfig::from_json_str(
        r#"{"vocab_size":64,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":2,
            "num_key_value_heads":1,"max_position_embeddings":16,"initializer_range":0.1,"tie_word_embeddings":true}"#,
    )
    .unwrap()
}

/// The ranks of every communicator rank 0 split while the engine for (tp, dp, spec) was built
/// as `ferrolm::parallel::attach` builds it (mesh, tensor parallelism, sharded engine).
fn splits(tp: usize, dp: usize, spec: ShardSpec) -> Vec<Vec<usize>> {
    let mut out = ThreadComm::run(tp * dp, CommOptions::default(), move |world| {
        let made = Arc::new(Mutex::new(Vec::new()));
        let world: Arc<dyn Communicator> = Arc::new(Counting { inner: world, made: made.clone() });
        let mesh = DeviceMesh::new(world.clone(), tp, dp, tp * dp)?;
        let mut m = Llama::new(config(), DType::F32, Device::Cpu, &mut Rng::new(1))?;
        let layout = if tp > 1 { Some(ferrolm_parallel::tp::parallelize(&mut m, mesh.tp_group())?) } else { None };
        let z = Zero::new(&mut m, mesh, spec, layout, AdamWConfig::default(), Placement::Device)?;
        // Every communicator the engine holds is the world, a split one or a solo one.
        for c in z.comms() {
            let ranks = c.world_ranks().to_vec();
            assert!(c.size() == 1 || ranks == world.world_ranks() || made.lock().unwrap().contains(&ranks), "{ranks:?}");
        }
        let made = made.lock().unwrap().clone();
        Ok(made)
    })
    .unwrap();
    out.swap_remove(0)
}

#[test]
fn one_communicator_per_distinct_group_for_each_layout() {
    let spec = |p, g, o| ShardSpec { params: p, grads: g, optim: o };
    // (tp, dp, spec, the groups rank 0 must split, by world ranks)
    let cases: [(usize, usize, ShardSpec, Vec<Vec<usize>>); 5] = [
        // tp 1, dp 2: the dp group is the world, the tp group one rank: nothing to split.
        (1, 2, spec(1, 1, 1), vec![]),
        // tp 2, dp 1: the tp group is the world (the key/value head's replicas too).
        (2, 1, spec(1, 1, 1), vec![]),
        // tp 2, dp 2, ZeRO-2: a tp and a dp group; the engine's groups are the dp group or one rank.
        (2, 2, spec(1, 2, 2), vec![vec![0, 1], vec![0, 2]]),
        // tp 1, dp 4, (2,2,4): P {0, 1}, OS {0, 2} and the block: the dp group's ranks (the
        // world's) ordered by optimizer range, so a communicator of its own.
        (1, 4, spec(2, 2, 4), vec![vec![0, 1], vec![0, 2], vec![0, 2, 1, 3]]),
        // tp 2, dp 4, (2,2,4): tp, dp (world ranks 0, 2, 4, 6), then P, OS and the block in dp.
        (2, 4, spec(2, 2, 4), vec![vec![0, 1], vec![0, 2, 4, 6], vec![0, 2], vec![0, 4], vec![0, 4, 2, 6]]),
    ];
    for (tp, dp, s, want) in cases {
        let got = splits(tp, dp, s);
        assert!(got.iter().all(|r| r.len() > 1), "tp {tp} dp {dp} {s}: a split of one rank in {got:?}");
        let world: Vec<usize> = (0..tp * dp).collect();
        for (i, r) in got.iter().enumerate() {
            assert!(*r != world && !got[..i].contains(r), "tp {tp} dp {dp} {s}: {r:?} split twice (or the world again)");
        }
        assert_eq!(got, want, "tp {tp} dp {dp} {s}: communicators split on rank 0");
        // The memory estimator's count (NCCL buffers per communicator): these and the world.
        assert_eq!(ferrolm_parallel::zero::groups::communicators(tp, dp, s, 1), 1 + got.len(), "tp {tp} dp {dp} {s}");
    }
}
