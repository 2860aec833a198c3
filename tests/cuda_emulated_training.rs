//! The training loop on the CUDA backend against the CPU: `cuda:0` is the GPU when one is visible,
//! else the CPU emulator of the CUDA backend (FERROLM_CUDA_EMULATOR=1: the real launchers and
//! kernels/*.cu, run on the CPU). A few optimizer steps there must repeat the CPU run's losses: f32 to 1e-4
//! relative (summation orders differ), bf16 to 3e-2 (the GPU rounds intermediates to bf16, e.g.
//! P in flash attention). The bf16 model has head dim 64, so the tensor-core attention kernels
//! run inside real training. Checkpoints written from the device must load back on the CPU.
//! New device memory is poisoned with NaN (FERROLM_CUDA_POISON=1, set before the device starts):
//! the engine's gradient buckets are not zeroed before use, so an element nothing wrote fails.
//! Packed rows on the device (flash `_seg` kernels, `rope_pos`) give the loss and gradients of
//! their conversations run one by one there, as closely as the bf16 kernels follow the CPU.
mod common;
use ferrolm::data::{list_shards, prepare_text_dir, Tokenizer};
use ferrolm::nn::{LlamaConfig, Packing};
use ferrolm::ops::Tokens;
use ferrolm::train::{TrainOptions, Trainer};
use ferrolm::{DType, Device, Llama};
use ferrolm_tensor::Rng;
use std::path::Path;

fn opts(steps: usize) -> TrainOptions {
    TrainOptions {
        steps,
        batch_size: 2,
        seq_len: 32,
        grad_accum: 2,
        lr: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 1,
        weight_decay: 0.1,
        grad_clip: 1.0,
        eval_every: steps,
        eval_batches: 2,
        save_every: 0,
        log_every: 100,
        seed: 7,
    }
}

fn model(vocab: usize, hidden: usize, heads: usize, kv: usize, dtype: DType, device: Device) -> Llama {
    let cfg = LlamaConfig::from_json_str(&format!(
        r#"{{"model_type":"llama","vocab_size":{vocab},"hidden_size":{hidden},"intermediate_size":{},"num_hidden_layers":2,
            "num_attention_heads":{heads},"num_key_value_heads":{kv},"max_position_embeddings":64,"tie_word_embeddings":true}}"#,
        2 * hidden
    ))
    .unwrap();
    Llama::new(cfg, dtype, device, &mut Rng::new(1)).unwrap()
}

fn run(tmp: &Path, name: &str, m: Llama, steps: usize) -> (Vec<f64>, Vec<f64>, Trainer) {
    let train = list_shards(tmp.join("shards"), "train").unwrap();
    let val = list_shards(tmp.join("shards"), "val").unwrap();
    let mut t = Trainer::new(m, &train, &val, opts(steps), &tmp.join(name)).unwrap();
    t.run().unwrap();
    let losses = t.history.iter().map(|h| h.1).collect();
    let val = t.val_history.iter().map(|h| h.1).collect();
    (losses, val, t)
}

/// `cuda:0` with new memory poisoned (every test of this file starts the device through here).
fn poisoned_device() -> Option<Device> {
    ferrolm_testing::poison::poison_new_device_memory();
    common::cuda0_device()
}

fn close(what: &str, cpu: &[f64], gpu: &[f64], rtol: f64) {
    assert_eq!(cpu.len(), gpu.len(), "{what}: lengths");
    for (a, b) in cpu.iter().zip(gpu) {
        assert!(b.is_finite() && (a - b).abs() <= rtol * a.abs(), "{what}: cpu {cpu:?} vs cuda:0 {gpu:?}");
    }
}

#[test]
fn training_on_the_emulated_cuda_backend_matches_the_cpu() {
    let Some(gpu) = poisoned_device() else { return };
    let tmp = std::env::temp_dir().join(format!("ferrolm-emu-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let tok = Tokenizer::from_file(common::tokenizer_path()).unwrap();
    prepare_text_dir(common::data_path("corpus/sonnets.txt"), &tok, tmp.join("shards"), 0.1, 1 << 20).unwrap();
    let v = tok.vocab_size();

    // f32, GQA 4:2, head dim 8 (SIMT attention)
    let (cl, cv, _) = run(&tmp, "cpu32", model(v, 32, 4, 2, DType::F32, Device::Cpu), 3);
    let (gl, gv, t) = run(&tmp, "gpu32", model(v, 32, 4, 2, DType::F32, gpu), 3);
    close("f32 train loss", &cl, &gl, 1e-4);
    close("f32 val loss", &cv, &gv, 1e-4);
    assert!(gl.last() < gl.first(), "loss did not fall on cuda:0: {gl:?}");
    // the checkpoint written from the device loads on the CPU and gives the same loss
    let ck = t.save_checkpoint().unwrap();
    let back = Llama::from_pretrained(&ck, DType::F32, Device::Cpu).unwrap();
    let ids = ferrolm::Tensor::from_vec((0..32).map(|i| (i * 37 % v) as i32).collect::<Vec<_>>(), vec![1, 32], Device::Cpu).unwrap();
    let tg = ferrolm::Tensor::from_vec((0..32).map(|i| (i * 53 % v) as i32).collect::<Vec<_>>(), vec![1, 32], Device::Cpu).unwrap();
    let on_cpu = back.loss(&ids, &tg).unwrap().item().unwrap();
    let on_gpu = t.model.loss(&ids.to_device(gpu).unwrap(), &tg.to_device(gpu).unwrap()).unwrap().item().unwrap();
    assert!((on_cpu - on_gpu).abs() <= 1e-4 * on_cpu.abs(), "checkpoint loss on CPU {on_cpu} vs on device {on_gpu}");

    // bf16, GQA 2:1, head dim 64: flash attention forward/backward on the tensor-core path
    let (cl, _, _) = run(&tmp, "cpu16", model(v, 128, 2, 1, DType::BF16, Device::Cpu), 2);
    let (gl, _, _) = run(&tmp, "gpu16", model(v, 128, 2, 1, DType::BF16, gpu), 2);
    close("bf16 train loss", &cl, &gl, 3e-2);
    let _ = std::fs::remove_dir_all(&tmp);
}

/// nn::AdamW on the CUDA device (fused multi-tensor kernel, fused grad norm) against the
/// op-based update on the CPU: f32 and bf16 parameters (fp32 master), decayed and not.
#[test]
fn fused_adamw_and_grad_norm_match_the_op_based_cpu_update() {
    use ferrolm::nn::module::ParamKind;
    use ferrolm::nn::optim::{clip_grad_norm, AdamW, AdamWConfig, UpdatePath};
    use ferrolm::Tensor;
    let Some(gpu) = poisoned_device() else { return };
    for dt in [DType::F32, DType::BF16] {
        let mut r = Rng::new(3);
        let shapes: [(&str, Vec<usize>); 3] =
            [("layers.0.w", vec![67, 129]), ("norm.weight", vec![129]), ("embed_tokens.weight", vec![5000, 3])];
        let init: Vec<Tensor> = shapes.iter().map(|(_, s)| Tensor::randn(s.clone(), 0.5, dt, Device::Cpu, &mut r).unwrap()).collect();
        let mk = |dev: Device| -> Vec<(String, Tensor)> {
            shapes
                .iter()
                .zip(&init)
                .map(|((n, _), t)| {
                    let p = t.to_device(dev).unwrap().detach();
                    p.set_requires_grad(true).unwrap();
                    (n.to_string(), p)
                })
                .collect()
        };
        let (pc, pg) = (mk(Device::Cpu), mk(gpu));
        let cfg = AdamWConfig::default();
        // Decay groups from each tensor's kind: the matrix decays, the norm and embedding do not.
        let kinds = [ParamKind::Matrix, ParamKind::Norm, ParamKind::Embedding];
        let with_kinds = |ps: &[(String, Tensor)]| -> Vec<(String, Tensor, ParamKind)> {
            ps.iter().zip(kinds).map(|((n, t), k)| (n.clone(), t.clone(), k)).collect()
        };
        let (mut oc, mut og) = (AdamW::new(&with_kinds(&pc), cfg.clone()).unwrap(), AdamW::new(&with_kinds(&pg), cfg).unwrap());
        oc.allow_fused = false; // the op-based update as the reference
        for step in 0..3 {
            let grads: Vec<Tensor> = shapes.iter().map(|(_, s)| Tensor::randn(s.clone(), 1.0, dt, Device::Cpu, &mut r).unwrap()).collect();
            for ((_, c), ((_, g), x)) in pc.iter().zip(pg.iter().zip(&grads)) {
                c.set_grad(Some(x.clone()));
                g.set_grad(Some(x.to_device(gpu).unwrap()));
            }
            let (nc, ng) = (clip_grad_norm(&pc, 1.0).unwrap(), clip_grad_norm(&pg, 1.0).unwrap());
            assert!((nc - ng).abs() <= 1e-5 * nc, "{dt} step {step}: grad norm cpu {nc} vs device {ng}");
            oc.step(1e-2).unwrap();
            og.step(1e-2).unwrap();
            assert_eq!(
                (og.last_path, oc.last_path),
                (Some(UpdatePath::Fused), Some(UpdatePath::Reference)),
                "{dt}: the device step must run the fused kernel, the CPU the ops"
            );
        }
        let tol = ferrolm_testing::tol::rel_tol(dt); // bf16 1e-2, f32 1e-5
        for ((n, a), (_, b)) in oc.state_tensors().iter().zip(og.state_tensors().iter()).chain(pc.iter().zip(pg.iter())) {
            let (x, y) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
            for (i, (u, w)) in x.iter().zip(&y).enumerate() {
                assert!(w.is_finite() && (u - w).abs() <= tol * (1e-3 + u.abs()), "{dt} {n}[{i}]: cpu {u} vs device {w}");
            }
        }
    }
}

/// The engine's gradient buckets on the device are allocated unzeroed: every parameter's slice
/// is written by its gradient (a linear layer's weight by its dW GEMM, in place, in f32; the rest
/// by the sink), and a parameter that gets no gradient is zeroed at the flush. With poisoned
/// memory, one step's gradient norm must be exactly the norm of the gradients that exist, and
/// the parameter without one must not move.
#[test]
fn device_gradient_buckets_are_written_whole() {
    use ferrolm::nn::optim::AdamWConfig;
    use ferrolm::Tensor;
    use ferrolm_parallel::zero::{Placement, ShardSpec, Zero};
    use ferrolm_parallel::{CommOptions, DeviceMesh, ThreadComm, TrainEngine};
    let Some(gpu) = poisoned_device() else { return };
    let outs = ThreadComm::run(1, CommOptions::default(), |comm| -> ferrolm::Result<(f64, f64, bool)> {
        let mut m = model(96, 30, 3, 1, DType::BF16, gpu); // width 30: buckets with padding
        let mesh = DeviceMesh::new(comm, 1, 1, 1)?;
        let cfg = AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() };
        let mut z = Zero::new(&mut m, mesh, ShardSpec::zero(0, 1)?, None, cfg, Placement::Device)?;
        let params = m.parameters();
        let (skip, lin) = ("model.layers.1.post_attention_layernorm.weight", "model.layers.0.self_attn.q_proj.weight");
        assert!(
            params.iter().any(|(n, _)| n == skip) && params.iter().any(|(n, _)| n == lin),
            "{:?}",
            params.iter().map(|p| &p.0).collect::<Vec<_>>()
        );
        let mut r = Rng::new(5);
        let cs: Vec<Tensor> = params
            .iter()
            .map(|(_, p)| Tensor::randn(p.dims().to_vec(), 1.0, DType::BF16, Device::Cpu, &mut r))
            .collect::<ferrolm::Result<_>>()?;
        let x = Tensor::randn([6, 30], 1.0, DType::BF16, Device::Cpu, &mut r)?;
        let cot = Tensor::randn([6, 30], 1.0, DType::BF16, Device::Cpu, &mut r)?;
        // The reference: c_p for every parameter summed as sum(p * c_p), cot^T x for the one
        // read through a linear layer, nothing for the skipped one; in f64 from the same values.
        let mut want = 0.0f64;
        for ((n, _), c) in params.iter().zip(&cs) {
            if n != skip && n != lin {
                want += c.to_vec_f64()?.iter().map(|v| v * v).sum::<f64>();
            }
        }
        let gl = cot.to_dtype(DType::F64)?.t()?.matmul(&x.to_dtype(DType::F64)?)?;
        want += gl.to_vec_f64()?.iter().map(|v| v * v).sum::<f64>();
        let skipped = params.iter().find(|(n, _)| n == skip).map(|(_, p)| p.clone()).expect("found above");
        let before = skipped.to_vec_f64()?;
        let (xd, cd) = (x.to_device(gpu)?, cot.to_device(gpu)?);
        let csd: Vec<Tensor> = cs.iter().map(|c| c.to_device(gpu)).collect::<ferrolm::Result<_>>()?;
        z.micro_batch(true, &mut || {
            let mut loss = Tensor::zeros([], DType::F32, gpu)?;
            for ((n, p), c) in params.iter().zip(&csd) {
                let part = match n.as_str() {
                    n if n == skip => continue,
                    n if n == lin => xd.linear(p)?.mul(&cd)?,
                    _ => p.mul(c)?,
                };
                loss = loss.add(&part.to_dtype(DType::F32)?.sum_all()?)?;
            }
            Ok(loss)
        })?;
        let report = z.step(1e-3, 0.0, 0.0)?;
        let after = skipped.to_vec_f64()?;
        Ok((report.grad_norm, want.sqrt(), before == after && after.iter().all(|v| v.is_finite())))
    })
    .unwrap();
    let (got, want, still) = outs[0];
    assert!((got - want).abs() <= 1e-4 * want, "grad norm {got} vs {want}: an unwritten bucket element was read");
    assert!(still, "the parameter without a gradient moved (or became NaN)");
}

/// A packed batch on the device: rows of 20 tokens holding conversations of 7, 1 and 9 tokens,
/// 12 and 5, 4 and 16 (padding at the ends of rows, never trained), through a bf16 model of head
/// dim 64 (the flash kernels' `_seg` twins, RoPE at per-token positions). Its loss, times its
/// trained tokens, and its gradients equal those of the conversations run one by one on the
/// device, within the bf16 tolerance of the kernels against the CPU (f32 sums of bf16
/// gradients taken in another order).
#[test]
fn packed_rows_on_the_device_equal_their_conversations_one_by_one() {
    let Some(gpu) = poisoned_device() else { return };
    let m = model(64, 128, 2, 1, DType::BF16, gpu);
    let mut r = Rng::new(21);
    let convs: Vec<(Vec<i32>, Vec<i32>)> = [7, 1, 9, 12, 5, 4, 16]
        .iter()
        .map(|&len| {
            let ids = (0..len).map(|_| r.below(64) as i32).collect();
            (ids, (0..len).map(|i| if i + 1 == len || r.below(3) == 0 { -100 } else { r.below(64) as i32 }).collect())
        })
        .collect();
    let (t, rows) = (20usize, [vec![0, 1, 2], vec![3, 4], vec![5, 6]]);
    let (mut ids, mut tg, mut pos, mut cu) = (vec![], vec![], vec![], vec![]);
    for row in &rows {
        let mut c = vec![0u32];
        for &i in row {
            ids.extend(&convs[i].0);
            tg.extend(&convs[i].1);
            pos.extend(0..convs[i].0.len() as u32);
            c.push(c.last().unwrap() + convs[i].0.len() as u32);
        }
        let pad = t - *c.last().unwrap() as usize;
        ids.extend(std::iter::repeat_n(0, pad));
        tg.extend(std::iter::repeat_n(-100, pad));
        pos.extend(0..pad as u32);
        if pad > 0 {
            c.push(t as u32);
        }
        cu.push(c);
    }
    let trained = |t: &[i32]| t.iter().filter(|&&x| x != -100).count() as f64;
    let grads = |m: &Llama| -> Vec<(String, Vec<f64>)> {
        m.parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap().to_vec_f64().unwrap())).collect()
    };
    let packing = Packing::new(t, &pos, cu, gpu).unwrap();
    let (up_ids, up_tg) = (Tokens::upload(ids, vec![3, t], gpu).unwrap(), Tokens::upload(tg.clone(), vec![3, t], gpu).unwrap());
    let loss = m.loss_packed(&up_ids, &up_tg, &packing).unwrap().mul_scalar(trained(&tg)).unwrap();
    let sum = loss.item().unwrap();
    loss.backward().unwrap();
    let packed = grads(&m);
    for (_, p) in m.parameters() {
        p.zero_grad();
    }
    let mut want = 0.0;
    for (ids, tg) in &convs {
        let n = ids.len();
        let l = m.loss(Tokens::upload(ids.clone(), vec![1, n], gpu).unwrap(), Tokens::upload(tg.clone(), vec![1, n], gpu).unwrap());
        let l = l.unwrap().mul_scalar(trained(tg)).unwrap();
        want += l.item().unwrap();
        l.backward().unwrap();
    }
    assert!((sum - want).abs() <= 2e-2 * want.abs(), "packed loss sum {sum} vs {want} one by one");
    for ((n, g), (_, w)) in packed.iter().zip(grads(&m)) {
        let scale = w.iter().fold(0f64, |a, x| a.max(x.abs()));
        let d = g.iter().zip(&w).fold(0f64, |a, (x, y)| a.max((x - y).abs()));
        assert!(g.iter().all(|x| x.is_finite()) && d <= 2e-2 * scale, "gradient of {n}: max |d| {d} over a scale of {scale}");
    }
}

/// Sliding-window models on the device (flash kernels with a window, packed `_seg` ones): the
/// windowed fixtures (tests/fixtures/qwen2_window: layer 0 full, layer 1 window 4;
/// mistral_window: window 5; gemma3_mixed_tied: window 4 on layers 0 and 1; 12 positions) in f32 give the CPU's loss and every gradient, plain
/// and with the rows packed into two conversations each, and the cached generation past the
/// window gives the CPU's tokens.
#[test]
fn windowed_models_on_the_device_match_the_cpu() {
    let Some(gpu) = poisoned_device() else { return };
    for name in ["qwen2_window", "mistral_window", "gemma3_mixed_tied"] {
        let dir = common::root().join("tests/fixtures").join(name);
        let run = |device: Device, packed: bool| -> (f64, Vec<(String, Vec<f64>)>) {
            let m = Llama::from_pretrained(&dir, DType::F32, device).unwrap();
            let (b, t) = (2usize, 12usize);
            let ids: Vec<i32> = (0..b * t).map(|i| (i * 37 % 61) as i32 + 1).collect();
            let tg: Vec<i32> = (0..b * t).map(|i| if i % 12 == 11 { -100 } else { (i * 53 % 63) as i32 }).collect();
            let (up_ids, up_tg) = (Tokens::upload(ids, vec![b, t], device).unwrap(), Tokens::upload(tg, vec![b, t], device).unwrap());
            let loss = match packed {
                false => m.loss(up_ids, up_tg).unwrap(),
                true => {
                    let pos: Vec<u32> = (0..b).flat_map(|_| (0..7u32).chain(0..5)).collect();
                    let packing = Packing::new(t, &pos, vec![vec![0, 7, 12]; b], device).unwrap();
                    m.loss_packed(&up_ids, &up_tg, &packing).unwrap()
                }
            };
            let l = loss.item().unwrap();
            loss.backward().unwrap();
            (l, m.parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap().to_vec_f64().unwrap())).collect())
        };
        for packed in [false, true] {
            let ((lc, gc), (lg, gg)) = (run(Device::Cpu, packed), run(gpu, packed));
            assert!((lc - lg).abs() <= 1e-5 * lc.abs(), "{name} packed {packed}: loss cpu {lc} vs cuda:0 {lg}");
            for ((n, c), (_, g)) in gc.iter().zip(&gg) {
                let scale = c.iter().fold(0f64, |a, x| a.max(x.abs()));
                let d = c.iter().zip(g).fold(0f64, |a, (x, y)| a.max((x - y).abs()));
                assert!(
                    g.iter().all(|x| x.is_finite()) && d <= 1e-4 * scale,
                    "{name} packed {packed}: gradient of {n}: max |d| {d} over {scale}"
                );
            }
        }
        let prompt = [25u32, 10, 28, 18, 40];
        let gen = |device| {
            let m = Llama::from_pretrained(&dir, DType::F32, device).unwrap();
            ferrolm::nn::generate(&m, &prompt, 12, 0.0, 1.0, &mut Rng::new(0)).unwrap()
        };
        assert_eq!(gen(gpu), gen(Device::Cpu), "{name}: greedy tokens on cuda:0");
    }
}

/// Every family fixture (scripts/make_family_fixtures.py) on `cuda:0` (the emulator with
/// poisoned memory where there is no GPU) against transformers' references in f32: logits, the
/// loss and every gradient within rel 1e-5 (max |ours - hf| / max |hf| per tensor), the bound
/// of the CPU's `hf_parity`. Prints the measured errors.
#[test]
fn family_fixtures_on_the_device_match_transformers() {
    use ferrolm_nn::safetensors_io::load_safetensors;
    let Some(gpu) = poisoned_device() else { return };
    let rel = |a: &[f64], b: &[f64]| {
        let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
        assert!(a.iter().all(|x| x.is_finite()), "a non-finite value (an unwritten element?)");
        a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
    };
    for name in [
        "qwen2_bias_tied",
        "qwen3_qknorm_untied",
        "qwen3_bias_bf16",
        "mistral_headdim",
        "gemma3_mixed_tied",
        "qwen2_window",
        "mistral_window",
        "llama_bias_untied",
    ] {
        let dir = common::root().join("tests/fixtures").join(name);
        let r = load_safetensors(&dir.join("reference.safetensors"), DType::F32, Device::Cpu).unwrap();
        let m = Llama::from_pretrained(&dir, DType::F32, gpu).unwrap();
        let (b, t) = (r["input_ids"].dim(0), r["input_ids"].dim(1));
        let ids: Vec<i32> = r["input_ids"].to_vec().unwrap();
        let labels: Vec<i32> = r["labels"].to_vec().unwrap();
        let up = |v: Vec<i32>| Tokens::upload(v, vec![b, t], gpu).unwrap();
        let e_logits = rel(&m.forward(up(ids.clone())).unwrap().to_vec_f64().unwrap(), &r["logits"].to_vec_f64().unwrap());
        let loss = m.loss(up(ids), up(ferrolm::nn::shift_labels(&labels, t))).unwrap();
        let e_loss = rel(&loss.to_vec_f64().unwrap(), &r["loss"].to_vec_f64().unwrap());
        loss.backward().unwrap();
        let (mut e_grad, mut worst) = (0f64, String::new());
        for (n, p) in m.parameters() {
            let e = rel(&p.grad().unwrap().to_vec_f64().unwrap(), &r[&format!("grad.{n}")].to_vec_f64().unwrap());
            if e > e_grad {
                (e_grad, worst) = (e, n);
            }
        }
        println!("{name} on {gpu}: rel err logits {e_logits:.2e}, loss {e_loss:.2e}, grads max {e_grad:.2e} ({worst})");
        assert!(
            e_logits < 1e-5 && e_loss < 1e-5 && e_grad < 1e-5,
            "{name}: logits {e_logits:e}, loss {e_loss:e}, grad {e_grad:e} at {worst}"
        );
    }
}
