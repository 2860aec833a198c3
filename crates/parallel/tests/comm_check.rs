//! `FERROLM_COMM_CHECK=1`: every collective carries its call site (bucket index, phase), and
//! ranks of a group that launch collectives from different sites fail with both sites named.
//! Every valid ShardSpec runs clean under the check (so no layout issues its buckets in a
//! different order on different ranks); a deliberate reorder is reported.
use ferrolm_nn::optim::AdamWConfig;
use ferrolm_nn::{shift_labels, Llama, LlamaConfig};
use ferrolm_parallel::comm::{call_site, ReduceOp, ENV_COMM_CHECK};
use ferrolm_parallel::zero::{Placement, ShardSpec, Zero};
use ferrolm_parallel::{CommOptions, DeviceMesh, ThreadComm, TrainEngine};
use ferrolm_tensor::{DType, Device, Rng, Tensor};

const DP: usize = 4;
const SEQ: usize = 8;

fn check_on() {
    // Every test of this binary wants the check on; none turns it off.
    std::env::set_var(ENV_COMM_CHECK, "1");
}

fn config() -> LlamaConfig {
    LlamaConfig::from_json_str(
        r#"{"vocab_size":64,"hidden_size":16,"intermediate_size":24,"num_hidden_layers":2,"num_attention_heads":2,
            "num_key_value_heads":1,"max_position_embeddings":16,"initializer_range":0.1,"tie_word_embeddings":true}"#,
    )
    .unwrap()
}

/// Two steps of two micro-batches with `spec` on DP thread ranks (two nodes of two).
fn train(spec: ShardSpec) -> ferrolm_tensor::Result<()> {
    ThreadComm::run(DP, CommOptions::default(), move |comm| {
        let mesh = DeviceMesh::new(comm, 1, DP, 2)?;
        let r = mesh.dp_rank();
        let mut m = Llama::new(config(), DType::F32, Device::Cpu, &mut Rng::new(1))?;
        let mut z = Zero::new(&mut m, mesh, spec, None, AdamWConfig::default(), Placement::Device)?;
        for s in 0..2 {
            for k in 0..2 {
                let mut rng = Rng::new((100 * s + 10 * k + r) as u64);
                let ids: Vec<i32> = (0..SEQ).map(|_| rng.below(64) as i32).collect();
                let x = Tensor::from_vec(ids.clone(), [1, SEQ], Device::Cpu)?;
                let y = Tensor::from_vec(shift_labels(&ids, SEQ), [1, SEQ], Device::Cpu)?;
                z.micro_batch(k == 1, &mut || m.loss(&x, &y))?;
            }
            z.step(1e-3, 1.0, 0.0)?;
        }
        Ok(())
    })
    .map(|_| ())
}

#[test]
fn every_valid_shard_spec_launches_the_same_collectives_from_the_same_sites() {
    check_on();
    let specs = ShardSpec::all_valid(DP, 2);
    assert!(specs.len() >= 5, "{specs:?}");
    for spec in specs {
        train(spec).unwrap_or_else(|e| panic!("{spec} under {ENV_COMM_CHECK}=1: {e}"));
    }
}

/// Two ranks all-reduce two same-shaped buckets in opposite orders: without the check the sums
/// would silently mix buckets; with it the collective fails naming both sites.
#[test]
fn buckets_issued_in_a_different_order_fail_with_the_site_named() {
    check_on();
    let err = ThreadComm::run(2, CommOptions::default(), |comm| {
        let order = if comm.rank() == 0 { [0, 1] } else { [1, 0] };
        for b in order {
            let _site = call_site(|| format!("bucket {b}, gradient reduce-scatter"));
            comm.all_reduce(&Tensor::from_vec(vec![1f32; 8], [8], Device::Cpu)?, ReduceOp::Sum)?;
        }
        Ok(())
    })
    .expect_err("a reordered bucket must fail under the check")
    .to_string();
    assert!(err.contains("disagree"), "{err}");
    assert!(err.contains("at bucket 0, gradient reduce-scatter") && err.contains("at bucket 1, gradient reduce-scatter"), "{err}");
}

/// One communicator per distinct group: no backend communicator of one rank, none that
/// duplicates the dp group, no two with the same ranks in the same order.
#[test]
fn one_communicator_per_distinct_group() {
    use ferrolm_parallel::zero::{members, ZeroGroup};
    use std::sync::Arc;
    for spec in ShardSpec::all_valid(DP, 2) {
        let out = ThreadComm::run(DP, CommOptions::default(), move |comm| {
            let mesh = DeviceMesh::new(comm, 1, DP, 2)?;
            let (dp, r) = (mesh.dp_group().clone(), mesh.dp_rank());
            let mut m = Llama::new(config(), DType::F32, Device::Cpu, &mut Rng::new(1))?;
            let z = Zero::new(&mut m, mesh, spec, None, AdamWConfig::default(), Placement::Device)?;
            let comms = z.comms();
            let mut seen: Vec<Vec<usize>> = Vec::new();
            for c in &comms {
                let ranks = c.world_ranks().to_vec();
                if c.size() == 1 {
                    assert!(!c.name().starts_with("zero_"), "{spec}: a split communicator of one rank ({})", c.name());
                    continue;
                }
                assert!(!seen.contains(&ranks), "{spec}: two communicators over {ranks:?}");
                if ranks == dp.world_ranks() {
                    assert!(Arc::ptr_eq(c, &dp), "{spec}: a duplicate of the dp group ({})", c.name());
                }
                seen.push(ranks);
            }
            // As many multi-rank communicators as distinct multi-rank groups.
            let mut groups: Vec<Vec<usize>> = [ZeroGroup::Params, ZeroGroup::OptimSub, ZeroGroup::Block, ZeroGroup::OptimReplicas]
                .iter()
                .map(|&g| members(g, spec, DP, r))
                .filter(|m| m.len() > 1)
                .collect();
            groups.sort();
            groups.dedup();
            assert_eq!(seen.len(), groups.len(), "{spec}: {seen:?} for {groups:?}");
            Ok(())
        });
        out.unwrap_or_else(|e| panic!("{spec}: {e}"));
    }
}
