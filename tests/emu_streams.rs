//! Training on the CUDA emulator's streams (crates/cuda/src/emu_stream.rs): race mode
//! (`FERROLM_EMU_RACE`: a random delay before every queued item of every stream) gives the same
//! bits as the ordered run, a removed compute -> copy event wait is caught by it, and the host
//! waits per training step stay at their stated bounds.
//!
//! These check the emulator: on a GPU, or without the emulator, they skip and say so. The
//! host-wait counts are process-wide, so the tests of this file take one lock.
mod common;
use common::{data, Data};
use ferrolm::cli::parallel::ParallelArgs;
use ferrolm::train::{TrainOptions, Trainer};
use ferrolm::{DType, Device, Llama};
use ferrolm_cuda::CudaBackend;
use ferrolm_parallel::offload::{grad_copies_behind_events, GpuEvery, Offload, OffloadConfig};
use ferrolm_parallel::store::{Store, StoreServer};
use ferrolm_parallel::{CommOptions, Communicator, NcclComm, ReduceOp, ThreadComm};
use ferrolm_tensor::backend::AdamWHyper;
use ferrolm_tensor::{Rng, Tensor};
use std::sync::{Arc, Mutex};
use std::time::Duration;

static SERIAL: Mutex<()> = Mutex::new(());

fn emulated() -> Option<Arc<CudaBackend>> {
    if !common::cuda0() {
        return None;
    }
    let be = CudaBackend::latest(0).expect("cuda:0 registered");
    if !be.is_emulated() {
        ferrolm_testing::gate::does_not_apply("cuda:0 is a GPU; these tests check the emulator's streams");
        return None;
    }
    Some(be)
}

fn opts(steps: usize) -> TrainOptions {
    TrainOptions { grad_accum: 2, grad_clip: 0.5, ..common::opts(steps) }
}

/// (losses, rank 0's parameters) after `steps` steps of the layout `p` on thread ranks sharing
/// the emulated cuda:0.
fn train(d: &Data, out: &str, p: &ParallelArgs, steps: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    let o = opts(steps);
    let cfg = common::config(d.vocab, 2);
    let mut runs = ThreadComm::run(p.world(), CommOptions::default(), |comm| {
        ferrolm::logging::set_thread_rank(Some((comm.rank(), comm.size())));
        let e = |e: anyhow::Error| ferrolm::Error::new("test", format!("{e:#}"));
        let mut model = Llama::new(cfg.clone(), DType::F32, Device::Cuda(0), &mut Rng::new(1))?;
        let engine = ferrolm::parallel::attach(&mut model, Some(comm), &p.layout().map_err(e)?, Trainer::adamw_config(&o)).map_err(e)?;
        let mut t = Trainer::with_engine(model, Box::new(engine), &d.train, &d.val, o.clone(), &d.dir.join(out)).map_err(e)?;
        t.run().map_err(e)?;
        let losses = t.history.iter().map(|h| h.1).collect();
        let params = t.model.parameters().iter().map(|(_, x)| x.to_vec_f64()).collect::<ferrolm::Result<_>>()?;
        ferrolm::logging::set_thread_rank(None);
        Ok((losses, params))
    })
    .unwrap();
    runs.swap_remove(0)
}

fn offload_k2() -> ParallelArgs {
    ParallelArgs {
        offload_optimizer: true,
        offload_subgroup_size: 700,
        offload_gpu_every: GpuEvery::Every(2),
        ..ParallelArgs { tp: 1, dp: 1, zero: Some(0), ..Default::default() }
    }
}

fn race(be: &CudaBackend, seed: Option<u64>, f: impl FnOnce()) {
    be.emulator_race(seed);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    be.emulator_race(None);
    if let Err(p) = r {
        std::panic::resume_unwind(p);
    }
}

/// Single device, offload k = 2 (compute, H2D and D2H streams), TP 2 and ZeRO-3 (thread ranks
/// sharing the device): five race seeds each, every one bitwise equal to the ordered run.
#[test]
fn race_mode_training_is_bitwise_equal_to_the_ordered_run() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(be) = emulated() else { return };
    let d = data("emu-race");
    let layouts = [
        ("single", ParallelArgs { tp: 1, dp: 1, zero: Some(0), ..Default::default() }),
        ("offload-k2", offload_k2()),
        ("tp2", ParallelArgs { tp: 2, dp: 1, ..Default::default() }),
        ("zero3", ParallelArgs { tp: 1, dp: 2, zero: Some(3), ..Default::default() }),
    ];
    for (name, p) in layouts {
        let base = train(&d, &format!("{name}-ordered"), &p, 2);
        assert!(base.0.iter().all(|l| l.is_finite()), "{name}: {:?}", base.0);
        for seed in 1..=5 {
            race(&be, Some(seed), || {
                let r = train(&d, &format!("{name}-race{seed}"), &p, 2);
                assert_eq!(r.0, base.0, "{name}, race seed {seed}: losses");
                assert!(r.1 == base.1, "{name}, race seed {seed}: parameters differ from the ordered run");
            });
        }
    }
    let _ = std::fs::remove_dir_all(&d.dir);
}

/// The mutation check: with the compute -> copy-stream event wait removed (the D2H copies of
/// the reduced gradients then start before backward has written them), race mode must change
/// the result; with the wait in place (the test above) it never does.
#[test]
fn race_mode_catches_a_removed_event_wait() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(be) = emulated() else { return };
    let d = data("emu-mutant");
    let p = offload_k2();
    let base = train(&d, "ordered", &p, 2);
    be.emulator_skip_copy_wait(true);
    let mut caught = Vec::new();
    for seed in 1..=3 {
        race(&be, Some(seed), || {
            let r = train(&d, &format!("mutant{seed}"), &p, 2);
            caught.push(r.0 != base.0 || r.1 != base.1);
        });
    }
    be.emulator_skip_copy_wait(false);
    let _ = std::fs::remove_dir_all(&d.dir);
    assert!(caught.iter().all(|&c| c), "race mode missed the removed wait for seeds {caught:?}");
}

/// Three buckets' gradients through an `Offload` of CPU subgroups (4 per bucket) and one update.
/// Each gradient comes from a chain of kernels on the compute stream; with `comm` it is then
/// all-reduced over a world-of-one NCCL communicator (the emulated NCCL, on its own stream) and
/// handed over still in flight, as the ZeRO engine hands over a dp > 1 gradient. `scale` varies
/// the values, so a copy that reads the result buffer early never finds the right bytes left
/// there by an earlier run. Returns the updated parameters and the parts copied behind events.
fn offload_update(comm: Option<&dyn Communicator>, scale: f32) -> (Vec<Vec<f32>>, u64) {
    let (dev, n) = (Device::Cuda(0), 2048);
    let params: Vec<Tensor> = (0..3)
        .map(|b| Tensor::from_vec((0..n).map(|i| (i % 17) as f32 * 0.01 + b as f32).collect::<Vec<f32>>(), [n], dev).unwrap())
        .collect();
    let runs = vec![vec![(0, n, true)]; 3];
    let cfg = OffloadConfig { subgroup: 512, gpu_every: GpuEvery::Never };
    let mut off = Offload::new(&cfg, &params, &runs, true, DType::F32).unwrap();
    let before = grad_copies_behind_events();
    let mut grads = Vec::new();
    for b in 0..3 {
        let v: Vec<f32> = (0..n).map(|i| ((i * 7 + b) % 29) as f32 * scale - 0.3).collect();
        let mut x = Tensor::from_vec(v, [n], dev).unwrap();
        for _ in 0..12 {
            x = x.mul_scalar(1.0009765625).unwrap();
        }
        let g = match comm {
            Some(c) => c.all_reduce_async(&x, ReduceOp::Sum).unwrap().tensor(),
            None => x,
        };
        off.stream_grad(b, &g).unwrap();
        assert_eq!(off.deferred_grad(), None, "bucket {b}: nothing is held back");
        assert_eq!(off.grads_streamed(), (4 * (b + 1), 12), "bucket {b}: its parts left at once");
        if comm.is_some() {
            assert!(g.is_pending(), "bucket {b}: the hook read the collective's result");
        }
        grads.push(g);
    }
    let h = AdamWHyper { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, step: 1 };
    off.step(&params, &grads, 1.0, 1.0, 0.01, h).unwrap();
    (params.iter().map(|p| p.to_vec::<f32>().unwrap()).collect(), grad_copies_behind_events() - before)
}

/// With dp > 1 on NCCL, offload streams a bucket's reduced gradient to the host while the
/// collective is still in flight: the copy stream waits on the collective's completion event and
/// copies from its result buffer, so the hook reads nothing (the result stays pending) and holds
/// nothing back. The update equals the one from the same gradients handed over ready, in race
/// mode too (five seeds); the mutation (the event wait removed, `emulator_skip_copy_wait`)
/// changes it under race mode.
#[test]
fn offload_copies_a_collectives_result_behind_its_event() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(be) = emulated() else { return };
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let store = Arc::new(Store::connect(&server.addr().to_string(), 0, 1, Duration::from_secs(30)).unwrap());
    let comm: Arc<dyn Communicator> = NcclComm::init(0, 1, store, be.clone(), CommOptions::default()).unwrap();
    let want = |scale| offload_update(None, scale);
    let (base, none) = want(0.01);
    assert_eq!(none, 0, "ready gradients are copied behind the compute stream, not an event");
    let (got, chained) = offload_update(Some(&*comm), 0.01);
    assert_eq!(chained, 12, "every CPU subgroup's part went behind its collective's event");
    assert!(got == base, "the update from gradients in flight differs from the one from ready gradients");
    for seed in 1..=5 {
        let scale = 0.01 + seed as f32 * 1e-3;
        let base = want(scale).0;
        race(&be, Some(seed), || assert!(offload_update(Some(&*comm), scale).0 == base, "race seed {seed}: the update differs"));
    }
    let mut caught = Vec::new();
    be.emulator_skip_copy_wait(true);
    for seed in 1..=3 {
        let scale = 0.02 + seed as f32 * 1e-3;
        let base = want(scale).0;
        race(&be, Some(seed), || caught.push(offload_update(Some(&*comm), scale).0 != base));
    }
    be.emulator_skip_copy_wait(false);
    assert!(caught.iter().all(|&c| c), "race mode missed the removed event wait for seeds {caught:?}");
}

/// Host waits per training step, counted by the emulator (`FERROLM_EMU_REPORT`'s numbers), for
/// each layout at its bound. Thread ranks move collective data through the host (ThreadComm
/// stages device tensors), so their bounds include those reads; the single-device step may make
/// only the waits that read the loss and the grad-norm scalar back.
#[test]
fn host_waits_per_step_stay_at_their_bounds() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(_be) = emulated() else { return };
    ferrolm_cuda::track_host_wait_sites(true);
    let d = data("emu-waits");
    let zero = |dp, z: u8| ParallelArgs { tp: 1, dp, zero: Some(z), ..Default::default() };
    let amsp = ParallelArgs { tp: 1, dp: 4, shard_params: Some(2), shard_grads: Some(2), shard_optim: Some(4), ..Default::default() };
    // (layout, its name, the bound on host waits per step per rank)
    let cases: [(ParallelArgs, &str, f64); 5] = [
        (zero(1, 0), "single device", BOUND_SINGLE),
        (ParallelArgs { tp: 2, dp: 1, ..Default::default() }, "TP 2", BOUND_TP2),
        (amsp, "ZeRO (2,2,4)", BOUND_ZERO_224),
        (zero(2, 3), "ZeRO-3", BOUND_ZERO3),
        (offload_k2(), "offload k = 2", BOUND_OFFLOAD_K2),
    ];
    let mut report = String::new();
    for (p, name, bound) in &cases {
        ferrolm_cuda::reset_host_waits();
        train(&d, &name.replace(' ', "_"), p, 2);
        let w = ferrolm_cuda::host_waits();
        report.push_str(&format!("{name}: {} per step (bound {bound})\n{}", w.per_step(), ferrolm_cuda::format_report(&w)));
        assert_eq!(w.steps, 2 * p.world() as u64, "{name}: steps counted");
        assert!(w.per_step() <= *bound, "{name}: {} host waits per step, bound {bound}\n{report}", w.per_step());
    }
    println!("{report}");
    let _ = std::fs::remove_dir_all(&d.dir);
}

// The bounds, per step and rank (2 micro-batches a step), as measured on 2026-11-23:
// - single device, 2: the loss read and the grad-norm scalar, once per step (src/train.rs,
//   crates/parallel/src/zero/mod.rs); none inside a micro-batch: ids and targets are uploaded with
//   their host copy (`ferrolm_ops::Tokens`) and checked and counted there;
// - TP 2, 30: those, plus ThreadComm's staging of every collective's input through the host
//   (crates/parallel/src/thread.rs, counted for the step that submitted it) and the scalar
//   all-reduces of the loss and the norm; the vocabulary-parallel embedding and loss read
//   nothing back (crates/parallel/src/tp.rs splits ids and targets on their host copy);
// - ZeRO (2,2,4), 36, ZeRO-3, 32: the single device's, ThreadComm's staging and the
//   scalar all-reduces. In (2,2,4) the last micro-batch's optimizer-range reduce-scatter reads
//   the gradient reduce-scatter's result in flight: its host copy comes straight from the
//   producer, with no device round trip and no host wait; ZeRO-3 (s_os = s_g) has no chained
//   collective;
// - offload k = 2, 657.5: per subgroup (219 of them) the pinned buffers' waits before each
//   copy and host access of the update (crates/parallel/src/offload.rs), about three a subgroup.
//   Measured again after the gradient flush stopped holding gradients back: unchanged, since
//   at dp = 1 the gradient handed over is ready and its copy never waited on the host (the
//   copy stream waits for the compute stream); the one host wait per streamed gradient is the
//   CPU update's read of its buffer. With dp > 1 on NCCL the flush waits on nothing either
//   (`offload_copies_a_collectives_result_behind_its_event`).
const BOUND_SINGLE: f64 = 2.0;
const BOUND_TP2: f64 = 30.0;
const BOUND_ZERO_224: f64 = 36.0;
const BOUND_ZERO3: f64 = 32.0;
const BOUND_OFFLOAD_K2: f64 = 657.5;
