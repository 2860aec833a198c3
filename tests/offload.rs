//! Optimizer-state offload (`--offload-optimizer`, crates/parallel/src/offload.rs): training with the
//! state in host memory, updated one subgroup in k on the device, follows training without it;
//! composed with ZeRO over thread ranks, and across a resume, it is exact.
//!
//! On the CUDA backend's emulator (`cuda:0` without a GPU; FERROLM_REQUIRE_EMU=1 makes its absence
//! a failure) the device subgroups run the backend's fused AdamW kernel and the host ones
//! `cpu_adam`. Both compute the same f32 formula term for term; only the compiled order of the
//! few operations (FMA contraction, sqrt/division) may differ, by an ulp or two per step, so the
//! two updates are held to a rounding-error bound derived in `cpu_and_device_adamw_agree_to_1e_6`
//! (a GPU contracts into FMAs), on the emulator also to 1e-6 relative (about 16 ulp), and a few
//! steps' losses to 1e-5.
//! On `--device cpu` every "device" update is the same CPU kernel on the same gradients, so there
//! the comparison is bit for bit.
mod common;
use ferrolm::cli::parallel::ParallelArgs;
use ferrolm::data::{list_shards, prepare_text_dir, Tokenizer};
use ferrolm::nn::LlamaConfig;
use ferrolm::train::{TrainOptions, Trainer};
use ferrolm::{DType, Device, Llama, Tensor};
use ferrolm_parallel::offload::GpuEvery;
use ferrolm_parallel::{CommOptions, ThreadComm};
use ferrolm_tensor::backend::AdamWHyper;
use ferrolm_tensor::{AdamWRange, Rng};
use std::path::{Path, PathBuf};

/// A fresh directory with the sonnets' shards: (dir, vocab size).
fn setup(name: &str) -> (PathBuf, usize) {
    let dir = std::env::temp_dir().join(format!("ferrolm-offload-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let tok = Tokenizer::from_file(common::tokenizer_path()).unwrap();
    prepare_text_dir(common::data_path("corpus/sonnets.txt"), &tok, dir.join("shards"), 0.1, 1 << 20).unwrap();
    (dir, tok.vocab_size())
}

fn opts(steps: usize, save_every: usize) -> TrainOptions {
    TrainOptions {
        steps,
        batch_size: 2,
        seq_len: 16,
        grad_accum: 2,
        lr: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 1,
        weight_decay: 0.1,
        grad_clip: 0.5, // small enough to clip: the clipping factor reaches both update paths
        eval_every: 0,
        eval_batches: 1,
        save_every,
        log_every: 100,
        seed: 7,
    }
}

fn par(dp: usize, zero: u8, offload: Option<(usize, GpuEvery)>) -> ParallelArgs {
    let mut p = ParallelArgs { tp: 1, dp, zero: Some(zero), ..Default::default() };
    if let Some((s, k)) = offload {
        p.offload_optimizer = true;
        p.offload_subgroup_size = s;
        p.offload_gpu_every = k;
    }
    p
}

struct Run {
    losses: Vec<f64>,
    /// This rank's optimizer shards and parameters at the end (rank 0), as f64.
    state: Vec<(String, Vec<f64>)>,
}

/// Trains `steps` steps on `p.dp` thread ranks (one rank: the single-device run with the sharded
/// engine), optionally resuming from `resume` first.
fn train(dir: &Path, vocab: usize, out: &str, device: Device, p: &ParallelArgs, o: TrainOptions, resume: Option<&Path>) -> Run {
    train_as(DType::F32, dir, vocab, out, device, p, o, resume, None)
}

#[allow(clippy::too_many_arguments)]
fn train_as(
    dtype: DType,
    dir: &Path,
    vocab: usize,
    out: &str,
    device: Device,
    p: &ParallelArgs,
    o: TrainOptions,
    resume: Option<&Path>,
    race: Option<u64>,
) -> Run {
    let train = list_shards(dir.join("shards"), "train").unwrap();
    let val = list_shards(dir.join("shards"), "val").unwrap();
    let cfg = LlamaConfig::from_json_str(&format!(
        r#"{{"model_type":"llama","vocab_size":{vocab},"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":64,"tie_word_embeddings":true}}"#
    ))
    .unwrap();
    let mut out_runs = ThreadComm::run(p.world(), CommOptions::default(), |comm| {
        ferrolm::logging::set_thread_rank(Some((comm.rank(), comm.size())));
        if let Some(seed) = race {
            let be = ferrolm_cuda::CudaBackend::latest(0).expect("cuda:0 registered");
            assert!(be.is_emulated(), "race mode needs the emulator");
            be.emulator_race(Some(seed));
        }
        let e = |e: anyhow::Error| ferrolm::Error::new("test", format!("{e:#}"));
        let mut model = Llama::new(cfg.clone(), dtype, device, &mut Rng::new(1))?;
        let zero = ferrolm::parallel::attach(&mut model, Some(comm), &p.layout().map_err(e)?, Trainer::adamw_config(&o)).map_err(e)?;
        assert_eq!(zero.offloaded(), p.offload_optimizer);
        if p.offload_optimizer {
            // Built offloaded: no optimizer state was ever allocated on the device.
            assert_eq!(zero.state_bytes().2, 0, "optimizer bytes on the device with offload");
        }
        if let Some(plan) = zero.offload_plan() {
            // Each k really splits the subgroups between the two paths as asked.
            let want = match p.offload_gpu_every {
                GpuEvery::Every(k) => Some(k),
                GpuEvery::Never => None,
                // auto: the model's choice on the rates measured at start-up.
                GpuEvery::Auto => {
                    let inputs = plan.inputs.as_ref().expect("auto measures the model's inputs");
                    assert!(inputs.cpu_adam_elems_per_s > 0.0 && inputs.h2d_bytes_per_s > 0.0 && inputs.gpu_adam_elems_per_s > 0.0);
                    assert_eq!(inputs.elems, plan.elems);
                    ferrolm_parallel::dos::choose_k(inputs).k
                }
            };
            assert_eq!(plan.k, want);
            let on_dev = plan.device_subgroups;
            match want {
                Some(k) => assert_eq!(on_dev, plan.subgroups / k as usize, "device subgroups for k = {k}"),
                None => assert_eq!(on_dev, 0),
            }
            assert!(plan.subgroups > 8, "too few subgroups ({}) to test the interleaving", plan.subgroups);
        }
        let mut t = Trainer::with_engine(model, Box::new(zero), &train, &val, o.clone(), &dir.join(out)).map_err(e)?;
        if let Some(r) = resume {
            t.resume(r).map_err(e)?;
        }
        t.run().map_err(e)?;
        let losses = t.history.iter().map(|h| h.1).collect();
        // run() saved its last step.
        let ck = dir.join(out).join(format!("checkpoints/step-{:06}", o.steps));
        let mut state: Vec<(String, Vec<f64>)> = Vec::new();
        for (n, x) in ferrolm_parallel::zero::ckpt::load_full(&ck)?.1 {
            state.push((n, x.to_vec_f64()?));
        }
        for (n, x) in t.model.parameters() {
            state.push((n, x.to_vec_f64()?));
        }
        ferrolm::logging::set_thread_rank(None);
        if let (Some(_), Some(be)) = (race, ferrolm_cuda::CudaBackend::latest(0)) {
            be.emulator_race(None);
        }
        Ok(Run { losses, state })
    })
    .unwrap();
    out_runs.swap_remove(0)
}

fn assert_close(what: &str, a: &Run, b: &Run, rtol: f64) {
    assert_eq!(a.losses.len(), b.losses.len(), "{what}: step counts");
    for (x, y) in a.losses.iter().zip(&b.losses) {
        assert!(y.is_finite() && (x - y).abs() <= rtol * x.abs(), "{what}: losses {:?} vs {:?}", a.losses, b.losses);
    }
    assert_eq!(a.state.len(), b.state.len(), "{what}: state tensors");
    for ((n, x), (m, y)) in a.state.iter().zip(&b.state) {
        assert_eq!(n, m);
        let scale = x.iter().fold(0f64, |s, v| s.max(v.abs())).max(1e-12);
        for (i, (u, w)) in x.iter().zip(y).enumerate() {
            assert!((u - w).abs() <= 10.0 * rtol * scale, "{what}: {n}[{i}] {u} vs {w}");
        }
    }
}

fn assert_exact(what: &str, a: &Run, b: &Run) {
    assert_eq!(a.losses, b.losses, "{what}: losses");
    assert_eq!(a.state, b.state, "{what}: optimizer state and weights");
}

#[test]
fn offload_on_the_cuda_device_follows_training_without_it_for_every_k() {
    if !common::cuda0() {
        return;
    }
    let (dir, vocab) = setup("emu");
    let gpu = Device::Cuda(0);
    let base = train(&dir, vocab, "base", gpu, &par(1, 0, None), opts(2, 0), None);
    // Subgroups of 700 elements: dozens of them, many shorter runs (norms), both paths in use.
    let mut all = Vec::new();
    for k in [GpuEvery::Every(1), GpuEvery::Every(2), GpuEvery::Every(4), GpuEvery::Never] {
        let r = train(&dir, vocab, &format!("k{k}"), gpu, &par(1, 0, Some((700, k))), opts(2, 0), None);
        assert_close(&format!("offload k = {k} vs none"), &base, &r, 1e-5);
        all.push(r);
    }
    // The same k = 2 run in the emulator's race mode (a random delay before every item on every
    // stream: the copy streams' D2H and H2D copies complete late and out of step with compute):
    // a host read that does not wait, or a source released before its copy ran, changes the bits.
    if ferrolm_cuda::CudaBackend::latest(0).is_some_and(|b| b.is_emulated()) {
        let p2 = par(1, 0, Some((700, GpuEvery::Every(2))));
        for seed in [1, 2] {
            let late = train_as(DType::F32, &dir, vocab, &format!("k2-race{seed}"), gpu, &p2, opts(2, 0), None, Some(seed));
            assert_exact(&format!("k = 2 in race mode (seed {seed})"), &all[1], &late);
        }
    }
    assert!(all.iter().all(|r| r.losses.iter().all(|l| l.is_finite())));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The device's fused AdamW kernel and `cpu_adam` on the same f32 state agree to 1e-6 relative
/// over several steps (see the module comment for why this bound), with and without decay.
#[test]
fn cpu_and_device_adamw_agree_to_1e_6() {
    let Some(gpu) = common::cuda0_device() else { return };
    let emulated = ferrolm_cuda::CudaBackend::latest(0).is_some_and(|b| b.is_emulated());
    let n = 5003;
    let mut r = Rng::new(9);
    let rnd = |r: &mut Rng, s: f64| -> Vec<f32> { (0..n).map(|_| (r.normal() * s) as f32).collect() };
    // The error bound. Both sides evaluate the same f32 formula with correctly rounded +, *, /,
    // sqrt; they differ only in which roundings a compiler drops (an FMA contracts b1*m + t into
    // one rounding: on the GPU, m = fma(b1, m, (1-b1)*g)). Each rounding errs by at most
    // U |result|, U = 2^-24, so each side is within U (sum of the magnitudes of the rounded
    // terms) of the exact value from its inputs, and the two differ by at most twice that.
    // Allowing 2 ulps per rounded term and side (4U), per step, for x = b x' + (1-b) y:
    //   D_t = b D_{t-1} + 4U (b |x'| + k (1-b) |y| + |x|),  k = 1 for m (y = g), 2 for v (g*g);
    // q = (m c1) / (sqrt(v c2) + eps), s = sqrt(v c2): five roundings, and the inherited errors
    //   D_q = c1 D_m / (s + eps) + |q| (c2 D_v / (2 s)) / (s + eps) + 10U |q|;
    // w' = w - lr (q + wd w): D_w_t = D_w_{t-1} (1 + lr wd) + lr D_q + 4U (|w| + lr |q + wd w| + |w'|).
    // The magnitudes are the CPU's (the two sides differ far below them).
    const U: f64 = 1.0 / (1u64 << 24) as f64;
    for wd in [0.0, 0.1] {
        let (mut w, mut m, mut v) = (rnd(&mut r, 0.5), vec![0f32; n], vec![0f32; n]);
        let (mut bw, mut bm, mut bv) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
        let dev = |x: &[f32]| Tensor::from_vec(x.to_vec(), [n], gpu).unwrap();
        let (dw, dm, dv) = (dev(&w), dev(&m), dev(&v));
        for step in 1..=4 {
            let g = rnd(&mut r, 1.0);
            let h = AdamWHyper { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, step };
            let (w0, m0, v0) = (w.clone(), m.clone(), v.clone());
            ferrolm_tensor::cpu_adam::adamw_step(&mut w, &mut m, &mut v, &g, None, &h, wd).unwrap();
            let (b1, b2, lr) = (h.beta1, h.beta2, h.lr);
            let (c1, c2) = (1.0 / (1.0 - b1.powi(step as i32)), 1.0 / (1.0 - b2.powi(step as i32)));
            for i in 0..n {
                let (gi, mi, vi, wi) = (g[i] as f64, m[i] as f64, v[i] as f64, w0[i] as f64);
                bm[i] = b1 * bm[i] + 4.0 * U * (b1 * (m0[i] as f64).abs() + (1.0 - b1) * gi.abs() + mi.abs());
                bv[i] = b2 * bv[i] + 4.0 * U * (b2 * v0[i] as f64 + 2.0 * (1.0 - b2) * gi * gi + vi);
                let s = (vi * c2).sqrt();
                let q = mi * c1 / (s + h.eps);
                let ds = if s > 0.0 { c2 * bv[i] / (2.0 * s) } else { (c2 * bv[i]).sqrt() };
                let dq = c1 * bm[i] / (s + h.eps) + q.abs() * ds / (s + h.eps) + 10.0 * U * q.abs();
                let upd = q + wd * wi;
                bw[i] = bw[i] * (1.0 + lr * wd) + lr * dq + 4.0 * U * (wi.abs() + lr * upd.abs() + (w[i] as f64).abs());
            }
            let dg = dev(&g);
            let range = AdamWRange { param: &dw, grad: &dg, master: None, m: &dm, v: &dv, segments: &[(0, n, wd)] };
            assert!(ferrolm_tensor::fused_adamw(&[range], h).unwrap(), "the device must run its fused kernel");
            for (what, host, d, bound) in [("w", &w, &dw, &bw), ("m", &m, &dm, &bm), ("v", &v, &dv, &bv)] {
                let d = d.to_vec::<f32>().unwrap();
                for i in 0..n {
                    let (a, b) = (host[i] as f64, d[i] as f64);
                    let at = format!("wd {wd} step {step} {what}[{i}]: cpu {a} vs device {b}");
                    assert!((a - b).abs() <= bound[i], "{at}: beyond the rounding bound {:e}", bound[i]);
                    if emulated {
                        // The emulator (no FMA contraction) is held tighter: 1e-6 relative. A
                        // weight passing near zero is measured against the update's scale, lr.
                        let scale = if what == "w" { a.abs().max(h.lr) } else { a.abs().max(1e-30) };
                        assert!((a - b).abs() <= 1e-6 * scale, "{at}: beyond 1e-6 relative on the emulator");
                    }
                }
            }
        }
    }
}

#[test]
fn offload_composed_with_zero_on_two_thread_ranks_equals_no_offload() {
    let (dir, vocab) = setup("zero");
    let base = train(&dir, vocab, "base", Device::Cpu, &par(2, 1, None), opts(3, 0), None);
    for k in [GpuEvery::Every(2), GpuEvery::Never] {
        let off = train(&dir, vocab, &format!("k{k}"), Device::Cpu, &par(2, 1, Some((500, k))), opts(3, 0), None);
        assert_exact(&format!("ZeRO-1 dp 2 with offload k = {k}"), &base, &off);
    }
    // ZeRO-3: parameters sharded too; the offloaded range is a slice of this rank's parameter shard.
    let base3 = train(&dir, vocab, "base3", Device::Cpu, &par(2, 3, None), opts(3, 0), None);
    let off3 = train(&dir, vocab, "off3", Device::Cpu, &par(2, 3, Some((500, GpuEvery::Every(2)))), opts(3, 0), None);
    assert_exact("ZeRO-3 dp 2 with offload k = 2", &base3, &off3);
    // bf16 weights: the host keeps the fp32 master and sends bf16 copies back.
    let base = train_as(DType::BF16, &dir, vocab, "base16", Device::Cpu, &par(2, 1, None), opts(3, 0), None, None);
    let off = train_as(DType::BF16, &dir, vocab, "off16", Device::Cpu, &par(2, 1, Some((500, GpuEvery::Every(2)))), opts(3, 0), None, None);
    assert_exact("bf16 ZeRO-1 dp 2 with offload k = 2", &base, &off);
    assert!(off.state.iter().any(|(n, _)| n.starts_with("master.")), "a bf16 run's checkpoint holds the fp32 master");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_mid_run_with_offload_is_exact_and_the_checkpoint_does_not_show_it() {
    let (dir, vocab) = setup("resume");
    let off = par(1, 0, Some((600, GpuEvery::Every(3))));
    let full = train(&dir, vocab, "full", Device::Cpu, &off, opts(4, 2), None);
    let ck = dir.join("full/checkpoints/step-000002");
    assert!(ck.is_dir(), "no checkpoint at step 2 in {}", dir.join("full/checkpoints").display());
    let resumed = train(&dir, vocab, "resumed", Device::Cpu, &off, opts(4, 0), Some(&ck));
    assert_eq!(resumed.losses.len(), 4, "the resumed run's history holds the first two steps and its own two");
    assert_eq!(full.losses, resumed.losses, "losses after the resume");
    assert_eq!(full.state, resumed.state, "state after the resume");
    // The same run without offload writes the same checkpoint, and resumes from the offloaded one.
    let plain = train(&dir, vocab, "plain", Device::Cpu, &par(1, 0, None), opts(4, 2), None);
    assert_exact("no offload vs offload", &full, &plain);
    let a = std::fs::read(ck.join("shards/tp0-dp0.safetensors")).unwrap();
    let b = std::fs::read(dir.join("plain/checkpoints/step-000002/shards/tp0-dp0.safetensors")).unwrap();
    assert!(a == b, "the offloaded run's optimizer shards differ from the plain run's");
    let cross = train(&dir, vocab, "cross", Device::Cpu, &par(1, 0, None), opts(4, 0), Some(&ck));
    assert_eq!(full.losses, cross.losses, "resuming the offloaded checkpoint without offload");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn offload_flags_are_validated() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        p: ParallelArgs,
    }
    let ok = Cli::try_parse_from(["t", "--offload-optimizer", "--offload-subgroup-size", "1000", "--offload-gpu-every", "4"]).unwrap();
    assert_eq!(
        ok.p.layout().unwrap().offload.unwrap(),
        ferrolm_parallel::offload::OffloadConfig { subgroup: 1000, gpu_every: GpuEvery::Every(4) }
    );
    let auto = Cli::try_parse_from(["t", "--offload-optimizer"]).unwrap();
    assert_eq!(auto.p.layout().unwrap().offload.unwrap().gpu_every, GpuEvery::Auto);
    assert_eq!(
        Cli::try_parse_from(["t", "--offload-optimizer", "--offload-gpu-every", "inf"]).unwrap().p.offload_gpu_every,
        GpuEvery::Never
    );
    assert!(Cli::try_parse_from(["t"]).unwrap().p.layout().unwrap().offload.is_none());
    for bad in [
        vec!["--offload-optimizer", "--offload-subgroup-size", "0"],
        vec!["--offload-optimizer", "--offload-gpu-every", "0"],
        vec!["--offload-optimizer", "--offload-gpu-every", "often"],
        vec!["--offload-gpu-every", "2"], // without --offload-optimizer
    ] {
        let err = Cli::try_parse_from(std::iter::once("t").chain(bad.iter().copied())).err();
        let msg = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("offload"), "{bad:?} must be refused naming the flag, got `{msg}`");
    }
}

#[test]
fn auto_takes_k_from_the_model_on_measured_rates_and_trains() {
    let (dir, vocab) = setup("auto");
    let base = train(&dir, vocab, "base", Device::Cpu, &par(1, 0, None), opts(2, 0), None);
    let auto = train(&dir, vocab, "auto", Device::Cpu, &par(1, 0, Some((400, GpuEvery::Auto))), opts(2, 0), None);
    assert_exact("offload with k = auto vs none", &base, &auto);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The training tool itself: `--offload-optimizer` on one device runs the sharded engine as a
/// single rank and follows the plain run's losses exactly (both on the CPU device).
#[test]
fn the_pretrain_tool_with_offload_follows_the_plain_run() {
    let (dir, vocab) = setup("cli");
    let cfg = dir.join("config.json");
    let c = LlamaConfig::from_json_str(&format!(
        r#"{{"model_type":"llama","vocab_size":{vocab},"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":64,"tie_word_embeddings":false}}"#
    ))
    .unwrap();
    std::fs::write(&cfg, c.to_json_string()).unwrap();
    let run = |out: &str, extra: &[&str]| -> Vec<f64> {
        let outp = dir.join(out);
        let (d, c, o) = (dir.join("shards"), cfg.clone(), outp.clone());
        let base = ["pretrain_llama", "--device=cpu", "--data", d.to_str().unwrap(), "--config", c.to_str().unwrap()];
        let rest = ["--out", o.to_str().unwrap(), "--seq-len=16", "--eval-every=0", "--steps=4", "--lr=3e-3"];
        let a: ferrolm::cli::pretrain::PretrainArgs =
            ferrolm::cli::parse_from(base.iter().chain(&rest).copied().chain(extra.iter().copied())).unwrap();
        ferrolm::cli::pretrain::run(a).unwrap();
        std::fs::read_to_string(outp.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get("loss")?.as_f64())
            .collect()
    };
    let plain = run("plain", &[]);
    let off = run("off", &["--offload-optimizer", "--offload-subgroup-size=300", "--offload-gpu-every=2"]);
    assert_eq!(plain.len(), 4);
    assert_eq!(plain, off, "losses with --offload-optimizer");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The gradients of CPU subgroups leave for the host from the gradient sinks during the last
/// micro-batch's backward pass, not in the step: right after that micro-batch (before `step`)
/// every one has been sent, after an earlier micro-batch none, and `step` consumes them. (Every
/// parameter gets a gradient here, so no bucket is left for the end of the micro-batch to flush.)
#[test]
fn gradients_stream_to_the_host_from_the_sinks_during_backward() {
    use ferrolm::nn::optim::AdamWConfig;
    use ferrolm_parallel::offload::OffloadConfig;
    use ferrolm_parallel::zero::{Placement, ShardSpec, Zero};
    use ferrolm_parallel::{DeviceMesh, TrainEngine};
    let cfg = LlamaConfig::from_json_str(
        r#"{"model_type":"llama","vocab_size":64,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":64,"tie_word_embeddings":true}"#,
    )
    .unwrap();
    ThreadComm::run(1, CommOptions::default(), |comm| {
        let mut model = Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut Rng::new(1))?;
        let mesh = DeviceMesh::new(comm, 1, 1, 1)?;
        let off = OffloadConfig { subgroup: 256, gpu_every: GpuEvery::Every(3) };
        let mut z = Zero::new(&mut model, mesh, ShardSpec::zero(0, 1)?, None, AdamWConfig::default(), Placement::Offload(&off))?;
        let plan = z.offload_plan().expect("offloaded");
        let cpu = plan.subgroups - plan.device_subgroups;
        let ids = Tensor::from_vec((0..32i32).map(|i| i * 7 % 64).collect::<Vec<_>>(), [2, 16], Device::Cpu)?;
        let tg = Tensor::from_vec((0..32i32).map(|i| i * 5 % 64).collect::<Vec<_>>(), [2, 16], Device::Cpu)?;
        for last in [false, true] {
            z.micro_batch(last, &mut || model.loss(&ids, &tg))?;
            let want = if last { cpu } else { 0 };
            assert_eq!(z.offload_grads_streamed(), Some((want, cpu)), "after backward (last micro-batch: {last})");
        }
        z.step(1e-3, 1.0, 0.0)?;
        assert_eq!(z.offload_grads_streamed(), Some((0, cpu)), "the step consumed the streamed gradients");
        Ok(())
    })
    .unwrap();
}

/// With dp > 1 a bucket's gradient reaches the gradient-ready hook still in flight (the result of
/// its collectives). One that cannot be chained behind its collective's event (here a pending
/// host tensor, as a thread rank's result is) would make backward wait for the collectives it
/// just launched if read there: the offload reads it only once the next bucket's gradient is
/// handed over (that bucket's backward ran meanwhile), and the last one when backward is over.
/// A ready gradient leaves at once. (An NCCL result in flight leaves at once too, behind its
/// collective's event: tests/emu_streams.rs.)
#[test]
fn a_gradient_in_flight_is_read_only_after_the_next_bucket_is_handed_over() {
    use ferrolm_parallel::offload::{Offload, OffloadConfig};
    use ferrolm_tensor::{CpuStorage, Storage};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let n = 64;
    let params: Vec<Tensor> = (0..3).map(|b| Tensor::from_vec(vec![b as f32; n], [n], Device::Cpu).unwrap()).collect();
    let runs = vec![vec![(0, n, true)]; 3];
    let cfg = OffloadConfig { subgroup: 32, gpu_every: GpuEvery::Never };
    let mut off = Offload::new(&cfg, &params, &runs, true, DType::F32).unwrap();
    let read: Vec<Arc<AtomicBool>> = (0..3).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let grads: Vec<Tensor> = (0..3)
        .map(|b| {
            let flag = read[b].clone();
            let fill: ferrolm_tensor::Fill = Box::new(move |s| {
                flag.store(true, Ordering::SeqCst);
                *s = Storage::Cpu(CpuStorage::F32(vec![b as f32 + 1.0; n]));
                Ok(())
            });
            Tensor::pending(Storage::Cpu(CpuStorage::zeros(n, DType::F32)), [n], fill).unwrap()
        })
        .collect();
    let was_read = |b: usize| read[b].load(Ordering::SeqCst);
    for (b, g) in grads.iter().enumerate() {
        off.stream_grad(b, g).unwrap();
        assert!(!was_read(b), "bucket {b}'s gradient was read by its own hook");
        assert_eq!(off.deferred_grad(), Some(b));
        if b > 0 {
            assert!(was_read(b - 1), "bucket {}'s gradient was not streamed after bucket {b}'s hook", b - 1);
        }
        // Two subgroups per bucket, all on the CPU.
        assert_eq!(off.grads_streamed(), (2 * b, 6), "after bucket {b}'s hook");
    }
    off.grads_complete().unwrap();
    assert!(was_read(2));
    assert_eq!(off.deferred_grad(), None);
    assert_eq!(off.grads_streamed(), (6, 6), "every gradient streamed once backward is over");
    off.discard();
    // Ready gradients: nothing to wait for, nothing held back; a pending one after them is.
    for b in 0..2 {
        off.stream_grad(b, &Tensor::from_vec(vec![1.0f32; n], [n], Device::Cpu).unwrap()).unwrap();
        assert_eq!((off.deferred_grad(), off.grads_streamed()), (None, (2 * (b + 1), 6)), "ready bucket {b}");
    }
    let pending = |b: usize| {
        let fill: ferrolm_tensor::Fill = Box::new(move |s| {
            *s = Storage::Cpu(CpuStorage::F32(vec![b as f32; n]));
            Ok(())
        });
        Tensor::pending(Storage::Cpu(CpuStorage::zeros(n, DType::F32)), [n], fill).unwrap()
    };
    let g2 = pending(2);
    off.stream_grad(2, &g2).unwrap();
    assert!(g2.is_pending(), "the hook read a pending gradient it cannot chain");
    assert_eq!((off.deferred_grad(), off.grads_streamed()), (Some(2), (4, 6)));
}
