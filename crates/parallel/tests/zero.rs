//! Flexible ZeRO (AMSP) on thread ranks: every valid ShardSpec follows plain data parallelism,
//! which follows the single-device run with the same global batch; composes with tensor
//! parallelism; holds exactly the model-state bytes of the formula; sends exactly the bytes
//! of the traffic model.
use ferrolm_nn::optim::{clip_grad_norm, AdamW, AdamWConfig};
use ferrolm_nn::{shift_labels, Llama, LlamaConfig};
use ferrolm_parallel::cost::Kind;
use ferrolm_parallel::tp::parallelize;
use ferrolm_parallel::zero::{expected_gathers, traffic_bytes, Placement, ShardSpec, Zero};
use ferrolm_parallel::{CommOptions, CommStats, Communicator, DeviceMesh, ThreadComm, TrainEngine};
use ferrolm_tensor::{DType, Device, Rng, Tensor};
use ferrolm_testing::tiny_gqa32;
use std::sync::Arc;

const STEPS: usize = 10;
const ACCUM: usize = 2;
/// Rows per micro-batch of the whole data-parallel group.
const ROWS: usize = 4;
const SEQ: usize = 8;
const LR: f64 = 3e-3;
const CLIP: f64 = 0.5;

fn config(tied: bool) -> LlamaConfig {
    tiny_gqa32(&format!(r#","rms_norm_eps":1e-6,"tie_word_embeddings":{tied},"model_type":"llamaLadder","ladder_layers":1"#))
}

fn opt_cfg() -> AdamWConfig {
    AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() }
}

/// Micro-batch `i` of the whole group: ROWS rows of random ids (two batches in turn, so the
/// loss falls).
fn micro_batch(i: usize) -> (Vec<i32>, Vec<i32>) {
    let mut r = Rng::new(11 + (i % 4) as u64);
    let ids: Vec<i32> = (0..ROWS * SEQ).map(|_| r.below(64) as i32).collect();
    let tg = shift_labels(&ids, SEQ);
    (ids, tg)
}

fn rows(v: &[i32], from: usize, n: usize) -> Tensor {
    Tensor::from_vec(v[from * SEQ..(from + n) * SEQ].to_vec(), [n, SEQ], Device::Cpu).unwrap()
}

/// The single-device run on the whole batch.
fn single_device(tied: bool) -> Vec<f64> {
    single_device_of(config(tied))
}

/// A `qwen2` model (q/k/v bias, tied embeddings): the block's biases go through the same buckets.
fn qwen2() -> LlamaConfig {
    tiny_gqa32(r#","rms_norm_eps":1e-6,"tie_word_embeddings":true,"model_type":"qwen2""#)
}

fn single_device_of(c: LlamaConfig) -> Vec<f64> {
    let m = Llama::new(c, DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap();
    let params = m.parameters();
    let mut opt = AdamW::new(&m.named_parameters(), opt_cfg()).unwrap();
    let mut losses = Vec::new();
    for s in 0..STEPS {
        let mut sum = 0.0;
        for k in 0..ACCUM {
            let (x, y) = micro_batch(s * ACCUM + k);
            let loss = m.loss(&rows(&x, 0, ROWS), &rows(&y, 0, ROWS)).unwrap();
            sum += loss.item().unwrap();
            loss.mul_scalar(1.0 / ACCUM as f64).unwrap().backward().unwrap();
        }
        clip_grad_norm(&params, CLIP).unwrap();
        opt.step(LR).unwrap();
        opt.zero_grad();
        losses.push(sum / ACCUM as f64);
    }
    losses
}

struct RankOut {
    losses: Vec<f64>,
    /// (params, grads, optim) bytes held after the last backward, and the formula's total.
    bytes: (usize, usize, usize),
    padded: u64,
    traffic: f64,
    model_traffic: f64,
}

/// Micro-batch `i` (of ACCUM per step) on data-parallel rank `dp_rank`, which reads `per` rows of
/// the group's batch; returns its loss.
fn rank_micro_batch(z: &mut Zero, m: &Llama, i: usize, dp_rank: usize, per: usize) -> ferrolm_tensor::Result<f64> {
    let (x, y) = micro_batch(i);
    let (x, y) = (rows(&x, dp_rank * per, per), rows(&y, dp_rank * per, per));
    let mut loss = 0.0;
    z.micro_batch((i + 1).is_multiple_of(ACCUM), &mut || {
        let l = m.loss(&x, &y)?;
        loss = l.item()?;
        l.mul_scalar(1.0 / ACCUM as f64)
    })?;
    Ok(loss)
}

/// One rank of a dp x tp run with `spec`; returns its mean micro-batch losses per step.
fn rank(comm: Arc<dyn Communicator>, dp: usize, tp: usize, rpn: usize, spec: ShardSpec, tied: bool) -> ferrolm_tensor::Result<RankOut> {
    rank_of(config(tied), comm, dp, tp, rpn, spec)
}

fn rank_of(
    c: LlamaConfig,
    comm: Arc<dyn Communicator>,
    dp: usize,
    tp: usize,
    rpn: usize,
    spec: ShardSpec,
) -> ferrolm_tensor::Result<RankOut> {
    let tied = c.tie_word_embeddings;
    let mesh = DeviceMesh::new(comm, tp, dp, rpn)?;
    let dp_rank = mesh.dp_rank();
    let mut m = Llama::new(c, DType::F32, Device::Cpu, &mut Rng::new(1))?;
    let layout = if tp > 1 { Some(parallelize(&mut m, mesh.tp_group())?) } else { None };
    let mut z = Zero::new(&mut m, mesh, spec, layout, opt_cfg(), Placement::Device)?;
    let per = ROWS / dp;
    let mut losses = Vec::new();
    let mut bytes = (0, 0, 0);
    let (mut traffic, mut model_traffic) = (0.0, 0.0);
    for s in 0..STEPS {
        let before: Vec<CommStats> = z.comms().iter().map(|c| c.stats()).collect();
        let gathers0 = z.gathers();
        let mut sum = 0.0;
        for k in 0..ACCUM {
            sum += rank_micro_batch(&mut z, &m, s * ACCUM + k, dp_rank, per)?;
            if k + 1 < ACCUM {
                // Between micro-batches a rank holds exactly its gradient range (n / s_g).
                let held = z.grad_bytes_held();
                if held != z.state_bytes().1 {
                    return Err(ferrolm_tensor::Error::new(
                        "test",
                        format!("{spec}: {held} gradient bytes held, range is {}", z.state_bytes().1),
                    ));
                }
            }
        }
        if s == STEPS - 1 {
            bytes = z.state_bytes();
        }
        z.step(LR, CLIP, sum / ACCUM as f64)?;
        let sent: f64 = z.comms().iter().zip(&before).map(|(c, b)| c.stats().since(b).total_bytes()).sum();
        let gathers: Vec<usize> = z.gathers().iter().zip(&gathers0).map(|(a, b)| (a - b) / ACCUM).collect();
        assert_eq!(gathers, expected_gathers(spec.params, z.bucket_numel().len(), tied), "{spec}: parameter all-gathers per bucket");
        // The step's loss and norm all-reduce (two f64) runs on the world communicator, which is
        // one of the engine's groups when the dp group is the whole world (tp = 1).
        let world = z.mesh().world();
        let scalars = if z.comms().iter().any(|c| Arc::ptr_eq(c, world)) {
            ferrolm_parallel::cost::bytes_sent(Kind::AllReduce, world.size(), world.rank(), 0, 16.0)
        } else {
            0.0
        };
        traffic = sent;
        model_traffic = traffic_bytes(spec, dp, &z.bucket_numel(), &gathers, 4, ACCUM) + scalars;
        losses.push(sum / ACCUM as f64);
    }
    Ok(RankOut { losses, bytes, padded: z.bucket_numel().iter().sum::<usize>() as u64, traffic, model_traffic })
}

/// Mean over data-parallel ranks of each step's loss (ranks 0.. of tp index 0).
fn dp_mean(outs: &[RankOut], dp: usize, tp: usize) -> Vec<f64> {
    (0..STEPS).map(|s| (0..dp).map(|d| outs[d * tp].losses[s]).sum::<f64>() / dp as f64).collect()
}

fn close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * y.abs(), "{what}: step {s}: {x} vs {y}\n{a:?}\n{b:?}");
    }
}

#[test]
fn plain_data_parallel_equals_single_device() {
    let want = single_device(false);
    assert!(want[STEPS - 1] < want[0] - 0.2, "the run does not learn: {want:?}");
    let outs = ThreadComm::run(4, CommOptions::default(), |c| rank(c, 4, 1, 4, ShardSpec::zero(0, 4)?, false)).unwrap();
    close(&dp_mean(&outs, 4, 1), &want, 1e-5, "dp=4 vs single device");
}

#[test]
fn every_shard_spec_follows_plain_data_parallelism() {
    // dp = 4 in one node, and 2 nodes x 2 ranks; tied embeddings in the second.
    for (rpn, tied) in [(4, false), (2, true)] {
        let plain =
            dp_mean(&ThreadComm::run(4, CommOptions::default(), |c| rank(c, 4, 1, rpn, ShardSpec::zero(0, 4)?, tied)).unwrap(), 4, 1);
        let specs = ShardSpec::all_valid(4, rpn);
        assert!(specs.len() >= 6, "{specs:?}");
        for spec in specs {
            let outs = ThreadComm::run(4, CommOptions::default(), |c| rank(c, 4, 1, rpn, spec, tied)).unwrap();
            close(&dp_mean(&outs, 4, 1), &plain, 1e-5, &format!("{spec} ({rpn} ranks per node)"));
            for (r, o) in outs.iter().enumerate() {
                // Model-state bytes held equal the formula (f32: 4/s_p + 4/s_g + 8/s_os per padded element).
                let held = (o.bytes.0 + o.bytes.1 + o.bytes.2) as u64;
                assert_eq!(held, spec.state_bytes(o.padded, 4), "{spec} rank {r}: bytes held {:?}", o.bytes);
                // Bytes sent in the last step equal the traffic model.
                assert!((o.traffic - o.model_traffic).abs() < 0.5, "{spec} rank {r}: sent {} bytes, model {}", o.traffic, o.model_traffic);
            }
        }
    }
}

#[test]
fn zero_composes_with_tensor_parallelism() {
    let plain = dp_mean(&ThreadComm::run(2, CommOptions::default(), |c| rank(c, 2, 1, 2, ShardSpec::zero(0, 2)?, false)).unwrap(), 2, 1);
    for spec in [ShardSpec::zero(1, 2).unwrap(), ShardSpec::zero(3, 2).unwrap()] {
        let outs = ThreadComm::run(4, CommOptions::default(), |c| rank(c, 2, 2, 4, spec, false)).unwrap();
        close(&dp_mean(&outs, 2, 2), &plain, 1e-4, &format!("dp 2 x tp 2, {spec}"));
    }
}

/// A `qwen2` model under ZeRO-3 (dp 4) and ZeRO-3 with --tp 2 follows the single-device run.
#[test]
fn zero_with_a_qwen2_model_equals_single_device() {
    let want = single_device_of(qwen2());
    assert!(want[STEPS - 1] < want[0] - 0.2, "the run does not learn: {want:?}");
    let outs = ThreadComm::run(4, CommOptions::default(), |c| rank_of(qwen2(), c, 4, 1, 4, ShardSpec::zero(3, 4)?)).unwrap();
    close(&dp_mean(&outs, 4, 1), &want, 1e-5, "qwen2, zero 3 over dp 4");
    let outs = ThreadComm::run(4, CommOptions::default(), |c| rank_of(qwen2(), c, 2, 2, 4, ShardSpec::zero(3, 2)?)).unwrap();
    close(&dp_mean(&outs, 2, 2), &want, 1e-4, "qwen2, dp 2 x tp 2, zero 3");
}

#[test]
fn invalid_specs_say_why() {
    let cases = [
        (ShardSpec { params: 3, grads: 3, optim: 3 }, 4, 4, "does not divide"),
        (ShardSpec { params: 2, grads: 1, optim: 4 }, 4, 4, "params <= grads <= optim"),
        (ShardSpec { params: 1, grads: 2, optim: 4 }, 8, 8, "grads must equal params or optim"),
        (ShardSpec { params: 4, grads: 4, optim: 2 }, 4, 4, "params <= grads <= optim"),
        (ShardSpec { params: 2, grads: 2, optim: 4 }, 4, 3, "inside a node"),
    ];
    for (s, dp, dpn, want) in cases {
        let e = s.validate(dp, dpn).unwrap_err().to_string();
        assert!(e.contains(want), "{s}: {e}");
    }
    assert!(ShardSpec::zero(4, 8).unwrap_err().to_string().contains("--zero"));
    for st in 0..=3 {
        ShardSpec::zero(st, 8).unwrap().validate(8, 4).unwrap();
    }
}

// ---- sharded checkpoints ----------------------------------------------------------------------

/// Steps `from..to` of a dp x tp run with `spec` (the model built fresh, then loaded from
/// `resume` when given); saves its shards into `save` after the last step.
#[allow(clippy::too_many_arguments)]
fn run_span(
    comm: Arc<dyn Communicator>,
    dp: usize,
    tp: usize,
    spec: ShardSpec,
    from: usize,
    to: usize,
    resume: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
) -> ferrolm_tensor::Result<Vec<f64>> {
    use ferrolm_parallel::zero::ckpt;
    let mesh = DeviceMesh::new(comm, tp, dp, dp * tp)?;
    let dp_rank = mesh.dp_rank();
    let mut m = Llama::new(config(true), DType::F32, Device::Cpu, &mut Rng::new(if resume.is_some() { 99 } else { 1 }))?;
    let layout = if tp > 1 { Some(parallelize(&mut m, mesh.tp_group())?) } else { None };
    let mut z = Zero::new(&mut m, mesh, spec, layout, opt_cfg(), Placement::Device)?;
    if let Some(dir) = resume {
        let (params, state) = ckpt::load_full(dir)?;
        ckpt::load_into(&mut z, &params, &state, from as u64)?;
    }
    let per = ROWS / dp;
    let mut losses = Vec::new();
    for s in from..to {
        let mut sum = 0.0;
        for k in 0..ACCUM {
            sum += rank_micro_batch(&mut z, &m, s * ACCUM + k, dp_rank, per)?;
        }
        // The mean over data-parallel ranks, as the trainer logs it.
        losses.push(z.step(LR, CLIP, sum / ACCUM as f64)?.loss);
    }
    if let Some(dir) = save {
        ckpt::save_shards(dir, &z)?;
    }
    Ok(losses)
}

#[test]
fn sharded_checkpoints_resume_under_any_layout() {
    let dir = std::env::temp_dir().join(format!("ferrolm-zero-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = ShardSpec { params: 2, grads: 2, optim: 4 };
    let whole = ThreadComm::run(4, CommOptions::default(), |c| run_span(c, 4, 1, first, 0, STEPS, None, None)).unwrap()[0].clone();
    let half = STEPS / 2;
    ThreadComm::run(4, CommOptions::default(), |c| run_span(c, 4, 1, first, 0, half, None, Some(&dir))).unwrap();
    // Same layout: bit for bit.
    let same = ThreadComm::run(4, CommOptions::default(), |c| run_span(c, 4, 1, first, half, STEPS, Some(&dir), None)).unwrap()[0].clone();
    assert_eq!(same, whole[half..], "resumed under the same layout");
    // Another dp, another spec, and tensor parallelism: the same trajectory (f32 sums in
    // another order).
    for (dp, tp, spec) in
        [(2, 1, ShardSpec::zero(1, 2).unwrap()), (1, 1, ShardSpec::zero(0, 1).unwrap()), (2, 2, ShardSpec::zero(3, 2).unwrap())]
    {
        let got = ThreadComm::run(dp * tp, CommOptions::default(), |c| run_span(c, dp, tp, spec, half, STEPS, Some(&dir), None)).unwrap()
            [0]
        .clone();
        close(&got, &whole[half..], 1e-5, &format!("resumed as dp {dp} x tp {tp} {spec}"));
    }
    // And back: a tp 2 checkpoint resumes on one rank.
    let dir2 = dir.join("tp2");
    ThreadComm::run(4, CommOptions::default(), |c| run_span(c, 2, 2, ShardSpec::zero(2, 2).unwrap(), 0, half, None, Some(&dir2))).unwrap();
    let got =
        ThreadComm::run(1, CommOptions::default(), |c| run_span(c, 1, 1, ShardSpec::zero(0, 1).unwrap(), half, STEPS, Some(&dir2), None))
            .unwrap()[0]
            .clone();
    close(&got, &whole[half..], 1e-4, "a dp 2 x tp 2 checkpoint resumed on one rank");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn caller_resolution_waits_for_no_input_of_the_engine() {
    // Under caller resolution a thread rank waits for a pending collective input on the thread
    // that launches the collective, as NCCL does. The engine's chains (AMSP's last micro-batch:
    // gradient reduce-scatter, optimizer reduce-scatter, replica all-reduce) pass collective
    // results in flight, which are chained on the communication thread, and every other input
    // is ready: no wait at all, and the same losses bit for bit as the default mode. So the
    // exposed communication of `bench_zero` cannot differ between the modes but by noise.
    for spec in [ShardSpec { params: 2, grads: 2, optim: 4 }, ShardSpec::mics(2), ShardSpec::zero(3, 4).unwrap()] {
        let before = ThreadComm::caller_waits();
        let caller = ThreadComm::run(4, CommOptions::default().with_caller_resolve(true), |c| rank(c, 4, 1, 2, spec, false)).unwrap();
        assert_eq!(ThreadComm::caller_waits() - before, 0, "{spec}: the launching thread waited for an input");
        let default = ThreadComm::run(4, CommOptions::default(), |c| rank(c, 4, 1, 2, spec, false)).unwrap();
        for (a, b) in caller.iter().zip(&default) {
            assert_eq!(a.losses, b.losses, "{spec}");
        }
    }
    // That the count sees a wait where there is one: tests/caller_env.rs.
}

/// `full_params` joins the parameters from what the ranks hold (parameter all-gathers, then the
/// tensor-parallel pieces): on world rank 0 it equals, bit for bit, what the saved shards give
/// back (`load_full`), for ZeRO-3 alone, with tensor parallelism, and under AMSP's split layout;
/// the other ranks get None.
#[test]
fn full_params_join_what_the_ranks_hold() {
    use ferrolm_parallel::zero::ckpt;
    let base = std::env::temp_dir().join(format!("ferrolm-zero-full-{}", std::process::id()));
    for (dp, tp, spec) in [
        (4, 1, ShardSpec::zero(3, 4).unwrap()),
        (2, 2, ShardSpec::zero(3, 2).unwrap()),
        (4, 1, ShardSpec { params: 2, grads: 2, optim: 4 }),
    ] {
        let dir = base.join(format!("dp{dp}-tp{tp}-{}{}{}", spec.params, spec.grads, spec.optim));
        let _ = std::fs::remove_dir_all(&dir);
        let dir2 = dir.clone();
        let got = ThreadComm::run(dp * tp, CommOptions::default(), move |c| {
            let mesh = DeviceMesh::new(c, tp, dp, dp * tp)?;
            let (dp_rank, world_rank) = (mesh.dp_rank(), mesh.world().rank());
            let mut m = Llama::new(config(true), DType::F32, Device::Cpu, &mut Rng::new(1))?;
            let layout = if tp > 1 { Some(parallelize(&mut m, mesh.tp_group())?) } else { None };
            let mut z = Zero::new(&mut m, mesh, spec, layout, opt_cfg(), Placement::Device)?;
            for s in 0..2 {
                let mut sum = 0.0;
                for k in 0..ACCUM {
                    sum += rank_micro_batch(&mut z, &m, s * ACCUM + k, dp_rank, ROWS / dp)?;
                }
                z.step(LR, CLIP, sum / ACCUM as f64)?;
            }
            ckpt::save_shards(&dir2, &z)?;
            Ok((world_rank, z.full_params()?))
        })
        .unwrap();
        let (want, _) = ckpt::load_full(&dir).unwrap();
        let names: Vec<String> =
            Llama::new(config(true), DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap().parameters().into_iter().map(|(n, _)| n).collect();
        for (rank, full) in got {
            let what = format!("dp {dp} x tp {tp} {spec}, rank {rank}");
            let Some(full) = full else {
                assert_ne!(rank, 0, "{what}: world rank 0 got no parameters");
                continue;
            };
            assert_eq!(rank, 0, "{what}: only world rank 0 gets the parameters");
            let mut keys: Vec<&String> = full.keys().collect();
            keys.sort();
            let mut expected: Vec<&String> = names.iter().collect();
            expected.sort();
            assert_eq!(keys, expected, "{what}: not the model's parameters");
            for (name, t) in &full {
                assert_eq!(t.dims(), want[name].dims(), "{what}: {name} shape");
                assert_eq!(t.to_vec_f64().unwrap(), want[name].to_vec_f64().unwrap(), "{what}: {name} differs from the shards");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    let _ = std::fs::remove_dir_all(&base);
}
