//! LoRA under tensor parallelism and the ZeRO engine follows the single-device run, on thread
//! ranks: the adapted forward, the loss and every adapter factor's gradient (gathered; with and
//! without dropout), the frozen base weights without gradients, and training through the engine
//! (plain, `--tp 2`, `--dp 2 --zero 3` with `--tp 2`, offloaded optimizer state) with losses equal
//! to one device's and model states that are the adapters' alone, on the CPU and on the CUDA
//! backend's emulator.
use ferrolm_nn::lora::{LoraConfig, Proj};
use ferrolm_nn::optim::AdamWConfig;
use ferrolm_nn::{shift_labels, Llama, LlamaConfig};
use ferrolm_parallel::offload::{GpuEvery, OffloadConfig};
use ferrolm_parallel::tp::parallelize;
use ferrolm_parallel::zero::{Placement, ShardSpec, Zero};
use ferrolm_parallel::{CommOptions, Communicator, DeviceMesh, ThreadComm, TrainEngine};
use ferrolm_tensor::{no_grad, DType, Device, Rng, Tensor};
use ferrolm_testing::tiny::lora_cases as cases;
use ferrolm_testing::{max_rel, Need};
use std::sync::Arc;

/// Logits and gradients within this of their scale (f32 sums in another order).
const TOL: f64 = 2e-5;
const RANK: usize = 4;

/// The model with adapters on every projection, B set non-zero (as after some training) so
/// that every factor has a gradient; the same on every rank.
fn adapted(c: &LlamaConfig, dropout: f64) -> ferrolm_tensor::Result<Llama> {
    adapted_in(c, dropout, DType::F32, Device::Cpu)
}

fn adapted_in(c: &LlamaConfig, dropout: f64, dtype: DType, device: Device) -> ferrolm_tensor::Result<Llama> {
    let mut m = Llama::new(c.clone(), dtype, device, &mut Rng::new(1))?;
    m.add_lora(&LoraConfig::new(RANK, None, dropout, Proj::ALL.to_vec(), false)?, &mut Rng::new(2))?;
    let mut r = Rng::new(3);
    let _g = no_grad();
    m.visit_adapters_mut(&mut |p, t| match p.name.contains("lora_B") {
        true => t.assign(&Tensor::randn(t.dims().to_vec(), 0.2, DType::F32, device, &mut r)?),
        false => Ok(()),
    })?;
    Ok(m)
}

fn batch(c: &LlamaConfig, seed: u64, rows: usize) -> (Tensor, Tensor) {
    batch_on(c, seed, rows, Device::Cpu)
}

fn batch_on(c: &LlamaConfig, seed: u64, rows: usize, device: Device) -> (Tensor, Tensor) {
    let t = 8;
    let mut r = Rng::new(seed);
    let ids: Vec<i32> = (0..rows * t).map(|_| r.below(c.vocab_size as u64) as i32).collect();
    let tg = shift_labels(&ids, t);
    (Tensor::from_vec(ids, vec![rows, t], device).unwrap(), Tensor::from_vec(tg, vec![rows, t], device).unwrap())
}

struct Outcome {
    logits: Vec<f32>,
    loss: f64,
    grads: Vec<(String, Vec<f32>)>,
}

/// Logits (gradients off: no dropout), then one training forward and backward.
fn run(c: &LlamaConfig, dropout: f64, x: &Tensor, y: &Tensor, comm: Option<Arc<dyn Communicator>>) -> ferrolm_tensor::Result<Outcome> {
    let mut m = adapted(c, dropout)?;
    let layout = comm.as_ref().map(|c| parallelize(&mut m, c)).transpose()?;
    let logits = {
        let _g = no_grad();
        m.forward(x)?.to_vec::<f32>()?
    };
    let loss = m.loss(x, y)?;
    loss.backward()?;
    for (n, p) in m.parameters() {
        if p.requires_grad() || p.grad().is_some() {
            return Err(ferrolm_tensor::Error::new("test", format!("base weight {n} is not frozen")));
        }
    }
    let mut grads = Vec::new();
    for (n, p) in m.adapters() {
        let g = p.grad().ok_or_else(|| ferrolm_tensor::Error::new("test", format!("no gradient for {n}")))?;
        let g = match (&layout, &comm) {
            (Some(l), Some(c)) => l.gather(&n, &g, c)?,
            _ => g,
        };
        grads.push((n, g.to_vec::<f32>()?));
    }
    Ok(Outcome { logits, loss: loss.item()?, grads })
}

#[test]
fn tp_adapted_forward_and_adapter_gradients_equal_single_device() {
    for (name, c) in cases() {
        let (x, y) = batch(&c, 3, 2);
        // Dropout masks are one whole mask, split as the input is: the same draws on every layout.
        for dropout in [0.0, 0.25] {
            let want = run(&c, dropout, &x, &y, None).unwrap();
            assert!(want.grads.iter().all(|(_, g)| g.iter().any(|v| *v != 0.0)), "{name}: every factor learns");
            for tp in [2, 4] {
                let outs = ThreadComm::run(tp, CommOptions::default(), |comm| run(&c, dropout, &x, &y, Some(comm))).unwrap();
                for (rank, got) in outs.iter().enumerate() {
                    let el = max_rel(&got.logits, &want.logits);
                    assert!(el < TOL, "{name} dropout {dropout} tp {tp} rank {rank}: logits rel err {el}");
                    assert!(
                        (got.loss - want.loss).abs() < TOL * want.loss,
                        "{name} dropout {dropout} tp {tp}: loss {} vs {}",
                        got.loss,
                        want.loss
                    );
                    assert_eq!(got.grads.len(), want.grads.len());
                    for ((n, g), (_, w)) in got.grads.iter().zip(&want.grads) {
                        let e = max_rel(g, w);
                        assert!(e < TOL, "{name} dropout {dropout} tp {tp} rank {rank}: gradient of {n} rel err {e}");
                    }
                }
            }
        }
    }
}

const STEPS: usize = 6;
const ACCUM: usize = 2;
/// Rows of a micro-batch of the whole data-parallel group.
const ROWS: usize = 4;

struct Trained {
    losses: Vec<f64>,
    /// (params, grads, optim) bytes of model states the engine holds.
    bytes: (usize, usize, usize),
    /// The parameters the engine joins for a checkpoint (rank 0).
    saved: Option<Vec<String>>,
}

/// STEPS engine steps of ACCUM micro-batches on a tp x dp layout; returns rank-0-like results.
fn train(comm: Option<Arc<dyn Communicator>>, tp: usize, dp: usize, spec: ShardSpec, offload: bool) -> ferrolm_tensor::Result<Trained> {
    train_in(comm, tp, dp, spec, offload, DType::F32, Device::Cpu)
}

fn train_in(
    comm: Option<Arc<dyn Communicator>>,
    tp: usize,
    dp: usize,
    spec: ShardSpec,
    offload: bool,
    dtype: DType,
    device: Device,
) -> ferrolm_tensor::Result<Trained> {
    let c = &cases()[1].1;
    let mut m = adapted_in(c, 0.0, dtype, device)?;
    let opt = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
    let off = OffloadConfig { subgroup: 200, gpu_every: GpuEvery::Every(2) };
    let placement = if offload { Placement::Offload(&off) } else { Placement::Device };
    let (mut z, dp_rank) = match comm {
        None => (Zero::single(&mut m, opt, placement)?, 0),
        Some(comm) => {
            let mesh = DeviceMesh::new(comm, tp, dp, tp * dp)?;
            let layout = if tp > 1 { Some(parallelize(&mut m, mesh.tp_group())?) } else { None };
            let r = mesh.dp_rank();
            (Zero::new(&mut m, mesh, spec, layout, opt, placement)?, r)
        }
    };
    let per = ROWS / dp;
    let mut losses = Vec::new();
    for s in 0..STEPS {
        let mut sum = 0.0;
        for k in 0..ACCUM {
            let (x, y) = batch_on(c, 50 + ((s * ACCUM + k) % 3) as u64, ROWS, device);
            let (x, y) = (x.narrow(0, dp_rank * per, per)?, y.narrow(0, dp_rank * per, per)?);
            let mut l = 0.0;
            z.micro_batch(k + 1 == ACCUM, &mut || {
                let loss = m.loss(&x, &y)?;
                l = loss.item()?;
                loss.mul_scalar(1.0 / ACCUM as f64)
            })?;
            sum += l;
        }
        let r = z.step(3e-3, 0.5, sum / ACCUM as f64)?;
        losses.push(r.loss);
    }
    let bytes = z.state_bytes();
    let saved = z.full_params()?.map(|p| p.keys().cloned().collect());
    Ok(Trained { losses, bytes, saved })
}

/// (name, tp, dp, spec, offload) of the layouts held to one device.
fn layouts() -> [(&'static str, usize, usize, ShardSpec, bool); 4] {
    [
        ("--tp 2", 2, 1, ShardSpec::zero(0, 1).unwrap(), false),
        ("--dp 2 --zero 3", 1, 2, ShardSpec::zero(3, 2).unwrap(), false),
        ("--tp 2 --dp 2 --zero 3", 2, 2, ShardSpec::zero(3, 2).unwrap(), false),
        ("--offload-optimizer", 1, 1, ShardSpec::zero(0, 1).unwrap(), true),
    ]
}

#[test]
fn engine_trains_only_the_adapters_and_every_layout_follows_one_device() {
    let want = train(None, 1, 1, ShardSpec::zero(0, 1).unwrap(), false).unwrap();
    let c = &cases()[1].1;
    let adapters: usize = adapted(c, 0.0).unwrap().adapters().iter().map(|(_, t)| t.numel()).sum();
    assert!(want.losses.last() < want.losses.first(), "the adapters learn: {:?}", want.losses);
    // One device: f32 adapters, their gradients, and AdamW's m and v; nothing of the base.
    let (p, g, o) = want.bytes;
    assert!(p >= 4 * adapters && p < 4 * adapters + 4 * 64 * 8, "parameters {p} B for {adapters} adapter elements");
    assert_eq!((g, o), (p, 2 * p), "gradients and optimizer state follow the adapters");
    let names = want.saved.unwrap();
    assert!(!names.is_empty() && names.iter().all(|n| n.contains(".lora_")), "a checkpoint holds the adapters: {names:?}");

    for (name, tp, dp, spec, offload) in layouts() {
        let got = match tp * dp {
            1 => vec![train(None, 1, 1, spec, offload).unwrap()],
            w => ThreadComm::run(w, CommOptions::default(), |comm| train(Some(comm), tp, dp, spec, offload)).unwrap(),
        };
        for (rank, r) in got.iter().enumerate() {
            for (s, (a, b)) in r.losses.iter().zip(&want.losses).enumerate() {
                assert!((a - b).abs() <= 1e-5 * b.abs(), "{name} rank {rank} step {s}: loss {a} vs one device's {b}");
            }
        }
        assert_eq!(got[0].saved.as_ref(), Some(&names), "{name}: the checkpoint's parameters");
        if (tp, dp) == (1, 2) {
            // ZeRO-3 shards the adapters' states over the data-parallel ranks.
            assert!(got[0].bytes.2 < want.bytes.2 * 3 / 4, "{name}: optimizer bytes {} vs one device's {}", got[0].bytes.2, want.bytes.2);
        }
    }
}

/// A bf16 base (the GPU's dtype) trains its f32 adapters: the factors are cast where they are used
/// and their gradients and optimizer state stay f32; the losses follow the f32 run's.
#[test]
fn a_bf16_base_trains_f32_adapters() {
    let single = ShardSpec::zero(0, 1).unwrap();
    let f32_run = train_in(None, 1, 1, single, false, DType::F32, Device::Cpu).unwrap();
    let bf16_run = train_in(None, 1, 1, single, false, DType::BF16, Device::Cpu).unwrap();
    for (s, (a, b)) in bf16_run.losses.iter().zip(&f32_run.losses).enumerate() {
        assert!((a - b).abs() <= 2e-2 * b.abs(), "step {s}: bf16 loss {a} vs f32 {b}");
    }
    assert_eq!(bf16_run.bytes, f32_run.bytes, "f32 adapter states whatever the base's dtype");
    let m = adapted_in(&cases()[1].1, 0.0, DType::BF16, Device::Cpu).unwrap();
    assert!(m.adapters().iter().all(|(_, t)| t.dtype() == DType::F32));
    assert!(m.parameters().iter().all(|(_, t)| t.dtype() == DType::BF16 && !t.requires_grad()));
}

/// On the CUDA backend (its CPU emulator without a GPU; thread ranks stage collectives through
/// the host): one device's LoRA training follows the CPU's, and every layout follows one device.
#[test]
fn on_the_emulator_every_layout_follows_one_device() {
    let Some(be) = ferrolm_testing::gate::require(Need::Emulator, ferrolm_cuda::CudaBackend::emulated(0)) else { return };
    ferrolm_tensor::backend::register(be);
    let gpu = Device::Cuda(0);
    let single = ShardSpec::zero(0, 1).unwrap();
    let cpu = train(None, 1, 1, single, false).unwrap();
    let want = train_in(None, 1, 1, single, false, DType::F32, gpu).unwrap();
    // The device's kernels sum in another order than the CPU's: f32 to 1e-4 relative.
    for (s, (a, b)) in want.losses.iter().zip(&cpu.losses).enumerate() {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "step {s}: device loss {a} vs the CPU's {b}");
    }
    assert_eq!(want.bytes, cpu.bytes, "the device holds the adapters' states alone, as the CPU does");
    for (name, tp, dp, spec, offload) in layouts() {
        let got = match tp * dp {
            1 => vec![train_in(None, 1, 1, spec, offload, DType::F32, gpu).unwrap()],
            w => ThreadComm::run(w, CommOptions::default(), |comm| train_in(Some(comm), tp, dp, spec, offload, DType::F32, gpu)).unwrap(),
        };
        for (rank, r) in got.iter().enumerate() {
            for (s, (a, b)) in r.losses.iter().zip(&want.losses).enumerate() {
                assert!((a - b).abs() <= 1e-5 * b.abs(), "emulator {name} rank {rank} step {s}: loss {a} vs one device's {b}");
            }
        }
    }
}
