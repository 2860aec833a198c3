//! The fused ops on the CUDA device (the GPU, else the CPU emulator) against their CPU
//! reference on fresh random inputs, bitwise run-to-run determinism of the backward kernels
//! that reduce (attention, embedding), the fused cross-entropy launcher, and the memory pool's
//! steady state over whole training steps. New device buffers are poisoned with NaN
//! (FERROLM_CUDA_POISON=1), so an unwritten output element fails; every element is compared.
//! Tolerances: f32 |d| <= 1e-4 + 1e-4 |ref| (1e-3 for attention sums and gradients), bf16
//! |d| <= 2e-2 + 2e-2 |ref| (the CPU widens bf16 to f32 and rounds once; the GPU rounds
//! intermediates such as P in attention to bf16). Every float input must get a gradient on both
//! sides: a missing one fails. On the emulator the second run of each
//! determinism check schedules every block's threads in reverse order, so a data race fails it.
//! With no CUDA device the tests print "skipped: no CUDA device" and pass, unless
//! FERROLM_REQUIRE_GPU=1 (or FERROLM_REQUIRE_EMU=1 without the emulator), where they fail.
#[path = "../../cuda/tests/common/mod.rs"]
mod common;
use common::*;
use ferrolm_cuda::{AdamWParams, AdamWTensor};
use ferrolm_ops::{
    attention, bias, bias_add, causal_attention, cross_entropy, embedding, geglu, linear_bias, rms_norm, rms_norm_offset, rmsnorm, rope,
    softcap, softmax_last, swiglu, AttnDims,
};
use ferrolm_tensor::backend::Backend;
use ferrolm_tensor::{CpuStorage, DType, Device, Layout, Rng, Shape, Storage, Tensor};
use ferrolm_testing::poison;

#[test]
fn fused_norm_rope_swiglu_softmax() {
    each_float_dtype(3, |dt, r| {
        for (n, d) in [(1, 8), (37, 96), (130, 1000)] {
            let x = randn(&[n, d], dt, r);
            let w = randn(&[d], dt, r);
            fwd_bwd("rmsnorm", dt, &[x.clone(), w], true, |t| rms_norm(&t[0], &t[1], 1e-5).unwrap());
            fwd_bwd("softmax", dt, std::slice::from_ref(&x), true, |t| softmax_last(&t[0]).unwrap());
            let u = randn(&[n, d], dt, r);
            fwd_bwd("swiglu", dt, &[x, u], true, |t| swiglu(&t[0], &t[1]).unwrap());
        }
        for (b, h, t, d) in [(1, 1, 1, 2), (2, 3, 17, 64), (1, 2, 33, 128)] {
            let x = randn(&[b, h, t, d], dt, r);
            let cos = randn(&[t, d], dt, r);
            let sin = randn(&[t, d], dt, r);
            fwd_bwd("rope", dt, &[x], true, |v| {
                rope(&v[0], &cos.to_device(v[0].device()).unwrap(), &sin.to_device(v[0].device()).unwrap()).unwrap()
            });
        }
    });
}

/// RMSNorm's backward on what autograd offers: in a residual block x + rms_norm(x, w), the
/// residual's gradient reaches x first and the dx kernel adds it (no add kernel); w's gradient
/// goes to an f32 destination written by the last dw pass (no cast). Against the CPU, which
/// composes the same sums, for vector and scalar rows.
#[test]
fn rmsnorm_backward_adds_the_residual_and_writes_dw_in_place() {
    each_float_dtype(8, |dt, r| {
        for (n, d) in [(5, 13), (37, 96), (3, 200)] {
            let (x, w) = (randn(&[n, d], dt, r), randn(&[d], dt, r));
            fwd_bwd(&format!("residual rmsnorm {dt} ({n}, {d})"), dt, &[x, w], true, |t| {
                poison::grad_dest(&t[1]);
                t[0].add(&rms_norm(&t[0], &t[1], 1e-5).unwrap()).unwrap()
            });
            // On the device the weight's gradient is the destination itself, in f32.
            let (x, w) = (to_gpu(&randn(&[n, d], dt, r)), to_gpu(&randn(&[d], dt, r)));
            for t in [&x, &w] {
                t.set_requires_grad(true).unwrap();
            }
            let dest = poison::grad_dest(&w);
            x.add(&rms_norm(&x, &w, 1e-5).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(w.grad().is_some_and(|g| g.same_view(&dest)), "{dt} ({n}, {d}): dw was not written into its destination");
            assert!(dest.to_vec_f64().unwrap().iter().all(|v| v.is_finite()), "{dt} ({n}, {d}): dw left unwritten");
        }
    });
}

/// A frozen weight (LoRA's and QLoRA's base norms and biases, a reference model's) takes no
/// gradient, so its backward makes none: RMSNorm's (plain and (1 + w), the residual's gradient
/// added into dx as when the weight trains) is the dx kernel alone, the bias's launches nothing;
/// dx equals the CPU's (poisoned outputs), and neither side gives the weight a gradient.
#[test]
fn frozen_norm_and_bias_weights_get_no_gradient_pass() {
    let Some(_be) = gpu_exclusive() else { return };
    let mut r = rng(31);
    for dt in [DType::F32, DType::BF16] {
        for (n, d) in [(5, 13), (37, 96), (3, 200)] {
            let (x, w, cot) = (randn(&[n, d], dt, &mut r), randn(&[d], dt, &mut r), randn(&[n, d], dt, &mut r));
            for (what, op) in [("rmsnorm", 0), ("rmsnorm (1 + w)", 1), ("bias_add", 2)] {
                let run = |dev: Device| {
                    let (x, w) = (x.to_device(dev).unwrap().detach(), w.to_device(dev).unwrap().detach());
                    x.set_requires_grad(true).unwrap();
                    let y = match op {
                        2 => bias_add(&x, &w).unwrap(),
                        _ => x.add(&rms_norm_offset(&x, &w, 1e-5, op as f64).unwrap()).unwrap(),
                    };
                    y.mul(&cot.to_device(dev).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
                    assert!(w.grad().is_none(), "{what} {dt} ({n}, {d}) on {dev}: the frozen weight got a gradient");
                    x.grad().expect("x's gradient")
                };
                let cpu = run(Device::Cpu);
                ferrolm_cuda::profile::enable(true);
                ferrolm_cuda::profile::reset();
                let dev = run(GPU);
                let rep = ferrolm_cuda::profile::report();
                ferrolm_cuda::profile::enable(false);
                check(&format!("{what} {dt} ({n}, {d}) dx"), &cpu, &dev, dt, true);
                let launched = |p: &str| rep.kernels.iter().filter(|k| k.name.starts_with(p)).map(|k| k.launches).sum::<u64>();
                assert_eq!(
                    launched("rmsnorm_bwd_dw") + launched("bias_bwd"),
                    0,
                    "{what} {dt}: a weight-gradient pass ran: {:?}",
                    rep.kernels
                );
                if op < 2 {
                    assert_eq!(launched("rmsnorm_bwd_dx"), 1, "{what} {dt}: {:?}", rep.kernels);
                }
            }
        }
    }
}

/// The fused ops' kernels move 16-byte vectors where the sizes and addresses allow, else one
/// element at a time: each path against the CPU. Rows of whole vectors with a tail past the last
/// vector, odd widths (the scalar row and pair kernels), and inputs at an offset of one element
/// (dense but not 16-byte aligned).
#[test]
fn fused_ops_on_vector_scalar_and_misaligned_paths() {
    // A dense view of x at an offset of one element (cat in front, then narrow).
    fn shifted(x: &Tensor) -> Tensor {
        let flat = x.reshape(vec![x.numel()]).unwrap();
        let pad = Tensor::zeros([1], x.dtype(), x.device()).unwrap();
        Tensor::cat(&[pad, flat], 0).unwrap().narrow(0, 1, x.numel()).unwrap().reshape(x.shape().clone()).unwrap()
    }
    each_float_dtype(7, |dt, r| {
        for (n, d) in [(5, 13), (9, 40), (3, 200)] {
            let (x, u, w) = (randn(&[n, d], dt, r), randn(&[n, d], dt, r), randn(&[d], dt, r));
            for shift in [false, true] {
                let s = |t: &Tensor| if shift { shifted(t) } else { t.clone() };
                let name = |op: &str| format!("{op} {dt} ({n}, {d}) shifted {shift}");
                fwd_bwd(&name("swiglu"), dt, &[x.clone(), u.clone()], true, |t| swiglu(&s(&t[0]), &s(&t[1])).unwrap());
                fwd_bwd(&name("rmsnorm"), dt, &[x.clone(), w.clone()], true, |t| rms_norm(&s(&t[0]), &t[1], 1e-5).unwrap());
            }
        }
        for (b, h, t, d) in [(1, 2, 5, 12), (2, 2, 3, 48)] {
            let x = randn(&[b, h, t, d], dt, r);
            let (cos, sin) = (randn(&[t, d], dt, r), randn(&[t, d], dt, r));
            for shift in [false, true] {
                fwd_bwd(&format!("rope {dt} ({b}, {h}, {t}, {d}) shifted {shift}"), dt, std::slice::from_ref(&x), true, |v| {
                    let x = if shift { shifted(&v[0]) } else { v[0].clone() };
                    rope(&x, &cos.to_device(v[0].device()).unwrap(), &sin.to_device(v[0].device()).unwrap()).unwrap()
                });
            }
        }
    });
}

/// The model families' ops (issue 51) against the CPU with poisoned outputs, f32 and bf16: GeGLU
/// (gelu_tanh), RMSNorm with (1 + w), logit softcapping and the linear bias, on rows of whole
/// 16-byte vectors with a tail, odd widths (the scalar paths) and inputs at an offset of one
/// element (dense but not 16-byte aligned).
#[test]
fn model_family_ops_on_vector_scalar_and_misaligned_paths() {
    fn shifted(x: &Tensor) -> Tensor {
        let flat = x.reshape(vec![x.numel()]).unwrap();
        let pad = Tensor::zeros([1], x.dtype(), x.device()).unwrap();
        Tensor::cat(&[pad, flat], 0).unwrap().narrow(0, 1, x.numel()).unwrap().reshape(x.shape().clone()).unwrap()
    }
    each_float_dtype(21, |dt, r| {
        for (n, d) in [(1, 8), (5, 13), (9, 40), (37, 96), (3, 200), (130, 1000)] {
            let (x, u, w) = (randn(&[n, d], dt, r), randn(&[n, d], dt, r), randn(&[d], dt, r));
            let big = x.mul_scalar(40.0).unwrap(); // past the cap, and the tanh's saturation
            for shift in [false, true] {
                let s = |t: &Tensor| if shift { shifted(t) } else { t.clone() };
                let name = |op: &str| format!("{op} {dt} ({n}, {d}) shifted {shift}");
                fwd_bwd(&name("geglu"), dt, &[big.mul_scalar(0.1).unwrap(), u.clone()], true, |t| geglu(&s(&t[0]), &s(&t[1])).unwrap());
                fwd_bwd(&name("rmsnorm (1 + w)"), dt, &[x.clone(), w.clone()], true, |t| {
                    rms_norm_offset(&s(&t[0]), &t[1], 1e-6, 1.0).unwrap()
                });
                fwd_bwd(&name("softcap"), dt, std::slice::from_ref(&big), true, |t| softcap(&s(&t[0]), 30.0).unwrap());
                fwd_bwd(&name("bias_add"), dt, &[x.clone(), w.clone()], true, |t| bias_add(&s(&t[0]), &t[1]).unwrap());
            }
            let wl = randn(&[7, d], dt, r);
            let b = randn(&[7], dt, r);
            fwd_bwd(&format!("linear_bias {dt} ({n}, {d})"), dt, &[x, wl, b], true, |t| linear_bias(&t[0], &t[1], &t[2]).unwrap());
        }
    });
}

/// QK-norm (Qwen3, Gemma 3): RMSNorm over the head dim of (B, T, H, D) projections and of their
/// (B, H, T, D) view, weight [D], plain and with (1 + w); D = 64, 128, 256 and odd sizes.
#[test]
fn qk_norm_over_heads() {
    each_float_dtype(22, |dt, r| {
        for (b, t, h, d) in [(2, 5, 3, 64), (1, 7, 2, 128), (1, 3, 2, 256), (2, 3, 2, 40), (1, 3, 3, 33), (1, 2, 5, 7)] {
            let (x, w) = (randn(&[b, t, h, d], dt, r), randn(&[d], dt, r));
            for offset in [0.0, 1.0] {
                let name = format!("qk-norm {dt} ({b}, {t}, {h}, {d}) offset {offset}");
                fwd_bwd(&name, dt, &[x.clone(), w.clone()], true, |v| rms_norm_offset(&v[0], &v[1], 1e-6, offset).unwrap());
                fwd_bwd(&format!("{name} (b, h, t, d) view"), dt, &[x.clone(), w.clone()], true, |v| {
                    rms_norm_offset(&v[0].permute(&[0, 2, 1, 3]).unwrap(), &v[1], 1e-6, offset).unwrap()
                });
            }
        }
    });
}

/// The column reductions over many short rows (QK-norm's dw over B·T·H rows of the head dim, a
/// narrow k/v bias's db over every token): every launch but the last summing pass covers the
/// SMs, the partials are folded in levels (a folding pass of several blocks before the last), so
/// no reduction leaves the whole tensor to one block; the results equal the CPU's and repeat
/// bit for bit under the emulator's reversed thread schedule. Every kernel of the new ops over
/// 2^19 elements runs on at least as many blocks as the device has SMs.
#[test]
fn column_reductions_fold_over_many_rows() {
    let Some(be) = gpu_exclusive() else { return };
    let mut r = rng(23);
    let (rows, d) = (8192, 64);
    for dt in [DType::F32, DType::BF16] {
        let x = dev_rand(&be, rows * d, dt, &mut r);
        let dy = dev_rand(&be, rows * d, dt, &mut r);
        let w = dev_rand(&be, d, dt, &mut r);
        let u = dev_rand(&be, rows * d, dt, &mut r);
        let (lx, lw) = (Layout::contiguous(Shape(vec![rows, d])), flat(d));
        ferrolm_cuda::profile::enable(true);
        ferrolm_cuda::profile::reset();
        let run = || {
            let (y, inv) = rmsnorm::forward((&x, &lx), (&w, &lw), 1e-6, 1.0).unwrap();
            let (dx, dw) = rmsnorm::backward((&dy, &lx), (&x, &lx), (&w, &lw), (&inv, &flat(rows)), 1.0).unwrap();
            let db = bias::backward((&dy, &lx), d).unwrap();
            let yb = bias::forward((&x, &lx), (&w, &lw)).unwrap();
            let g = ferrolm_ops::swiglu::forward((&x, &lx), (&u, &lx), ferrolm_ops::Glu::GeluTanh).unwrap();
            let gb = ferrolm_ops::swiglu::backward((&dy, &lx), (&x, &lx), (&u, &lx), ferrolm_ops::Glu::GeluTanh).unwrap();
            let sc = softcap::forward((&x, &lx), 3.0).unwrap();
            let scb = softcap::backward((&dy, &lx), (&sc, &lx), 3.0).unwrap();
            [y, dx, dw, db, yb, g, gb.0, gb.1, sc, scb].iter().map(|s| bits(&be, s)).collect::<Vec<_>>()
        };
        let (a, c) = second_reversed(&be, run, run);
        let rep = ferrolm_cuda::profile::report();
        ferrolm_cuda::profile::enable(false);
        let names = ["y", "dx", "dw", "db", "bias y", "geglu y", "geglu dgate", "geglu dup", "softcap y", "softcap dx"];
        assert_eq!(a.len(), names.len());
        for (i, what) in names.iter().enumerate() {
            assert_eq!(a[i], c[i], "{dt} ({rows}, {d}): {what} differs between runs");
        }
        let blocks = |g: (u32, u32, u32)| g.0 as u64 * g.1 as u64 * g.2 as u64;
        for prefix in ["rmsnorm_", "bias_", "geglu_", "softcap_"] {
            let ks: Vec<_> = rep.kernels.iter().filter(|k| k.name.starts_with(prefix)).collect();
            assert!(!ks.is_empty(), "{dt}: no {prefix} kernel ran: {:?}", rep.kernels);
            for k in ks.iter().filter(|k| !k.name.contains("finish")) {
                assert!(blocks(k.max_grid) >= rep.sm_count as u64, "{dt}: {} ran on at most {:?} blocks", k.name, k.max_grid);
            }
        }
        for fin in ["rmsnorm_bwd_dw_finish", "bias_bwd_finish"] {
            let ks: Vec<_> = rep.kernels.iter().filter(|k| k.name.starts_with(fin)).collect();
            let launches: u64 = ks.iter().map(|k| k.launches).sum();
            // Two runs, each a folding pass (f32) and the last pass.
            assert!(launches >= 4, "{dt}: {fin} launched {launches} times over {rows} rows: the partials were not folded");
            let widest = ks.iter().map(|k| blocks(k.max_grid)).max().unwrap_or(0);
            assert!(widest >= 8, "{dt}: {fin}'s widest launch had {widest} blocks: one block summed the partials");
        }
        // Against the CPU reference on the same values.
        let host = |s: &Storage, dims: &[usize]| Tensor::from_vec(down(&be, s), dims.to_vec(), Device::Cpu).unwrap().to_dtype(dt).unwrap();
        let (xc, wc, dyc) = (host(&x, &[rows, d]), host(&w, &[d]), host(&dy, &[rows, d]));
        let (xc, wc) = (xc.detach().set_requires_grad(true).cloned().unwrap(), wc.detach().set_requires_grad(true).cloned().unwrap());
        let y = rms_norm_offset(&xc, &wc, 1e-6, 1.0).unwrap();
        y.mul(&dyc).unwrap().sum_all().unwrap().backward().unwrap();
        let val = |v: &[u32]| -> Vec<f64> {
            v.iter().map(|&b| if dt == DType::BF16 { f32::from_bits(b << 16) as f64 } else { f32::from_bits(b) as f64 }).collect()
        };
        let dev = |v: &[u32], dims: &[usize]| Tensor::from_vec(val(v), dims.to_vec(), Device::Cpu).unwrap();
        check(&format!("{dt} folded dw"), &wc.grad().unwrap(), &dev(&a[2], &[d]), dt, true);
        check(&format!("{dt} folded db"), &dyc.sum(&[0], false).unwrap(), &dev(&a[3], &[d]), dt, true);
    }
}

#[test]
fn embedding_fwd_bwd_deterministic() {
    each_float_dtype(4, |dt, r| {
        for (vocab, d, n) in [(5, 3, 7), (300, 65, 1500), (1000, 128, 64)] {
            let w = randn(&[vocab, d], dt, r);
            let ids: Vec<i32> = (0..n).map(|i| ((i * 7919 + 13) % vocab) as i32).collect();
            let ids = Tensor::from_vec(ids, vec![n], Device::Cpu).unwrap();
            fwd_bwd("embedding", dt, &[ids, w], false, |t| embedding(&t[0], &t[1]).unwrap());
        }
    });
}

#[test]
fn cross_entropy_with_ignore() {
    each_float_dtype(5, |dt, r| {
        for (n, v) in [(1, 2), (9, 1001), (64, 32000)] {
            let x = randn(&[n, v], dt, r);
            let t: Vec<i32> = (0..n).map(|i| if i % 4 == 3 { -100 } else { ((i * 131) % v) as i32 }).collect();
            let t = Tensor::from_vec(t, vec![n], Device::Cpu).unwrap();
            fwd_bwd("cross_entropy", dt, &[x, t], true, |a| cross_entropy(&a[0], &a[1], -100).unwrap());
        }
    });
}

#[test]
fn flash_attention_fwd_bwd_gqa() {
    let Some(_) = gpu() else { return };
    let mut r = rng(6);
    // (dtype, b, hq, hkv, t, d): bf16 d64/d128 take the tensor-core path, the rest SIMT. The
    // flash shapes cover one row, t below / across / past the 128-row blocks and their kv tiles
    // (128 and 64 rows at d 64 / 128 forward, 64 and 32 backward), never a multiple of them,
    // GQA groups of 2 and 4, and batch > 1.
    let cases = [
        (DType::BF16, 1, 2, 2, 1, 64),
        (DType::BF16, 2, 4, 2, 77, 64),
        (DType::BF16, 1, 8, 2, 130, 128),
        (DType::BF16, 2, 4, 1, 300, 64),
        (DType::BF16, 2, 2, 2, 203, 128),
        (DType::BF16, 1, 2, 1, 19, 32),
        (DType::F32, 2, 4, 1, 45, 64),
        (DType::F32, 1, 2, 2, 17, 40),
    ];
    for (dt, b, hq, hkv, t, d) in cases {
        let q = randn(&[b, hq, t, d], dt, &mut r);
        let k = randn(&[b, hkv, t, d], dt, &mut r);
        let v = randn(&[b, hkv, t, d], dt, &mut r);
        let scale = 1.0 / (d as f64).sqrt();
        fwd_bwd(&format!("attention {dt} b{b} hq{hq} hkv{hkv} t{t} d{d}"), dt, &[q, k, v], true, |x| {
            causal_attention(&x[0], &x[1], &x[2], scale).unwrap()
        });
    }
}

// ---- fused cross-entropy --------------------------------------------------------------------

#[test]
fn fused_cross_entropy_matches_cpu_backend() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(13);
    for dt in [DType::F32, DType::BF16] {
        for (n, v) in [(1usize, 2usize), (9, 1001), (64, 32000), (130, 4099)] {
            let x = Tensor::randn(vec![n, v], 2.0, dt, Device::Cpu, &mut r).unwrap();
            let t: Vec<i32> = (0..n).map(|i| if i % 4 == 3 { -100 } else { r.below(v as u64) as i32 }).collect();
            let tt = Tensor::from_vec(t.clone(), vec![n], Device::Cpu).unwrap();
            // CPU reference: loss and dlogits through the CPU backend's cross_entropy + backward
            let xc = x.detach();
            xc.set_requires_grad(true).unwrap();
            let loss = cross_entropy(&xc, &tt, -100).unwrap();
            loss.backward().unwrap();
            let (lref, gref) = (loss.item().unwrap(), xc.grad().unwrap().to_vec_f64().unwrap());
            // host f64 lse of the (dtype-rounded) logits
            let xv = x.to_vec_f64().unwrap();
            let lse_ref: Vec<f64> = xv
                .chunks(v)
                .map(|row| {
                    let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    mx + row.iter().map(|&z| (z - mx).exp()).sum::<f64>().ln()
                })
                .collect();
            let xg = x.to_device(GPU).unwrap();
            let tg = tt.to_device(GPU).unwrap();
            let grad_mult = 0.75f32;
            let (l, lse, dx) = xg
                .with_storage(|(xs, xl)| {
                    tg.with_storage(|(ts, _)| cross_entropy::forward_backward_cuda(&be, (xs, xl), ts, -100, grad_mult))
                })
                .unwrap();
            let (l, lse, dx) = (Storage::Device(Box::new(l)), Storage::Device(Box::new(lse)), Storage::Device(Box::new(dx)));
            let (at, rt) = if dt == DType::BF16 { (2e-2, 2e-2) } else { (1e-5, 1e-4) };
            let name = format!("ce_fused {dt} ({n}, {v})");
            close(&format!("{name} loss"), &down(&be, &l), &[lref], 1e-5, 1e-4);
            close(&format!("{name} lse"), &down(&be, &lse), &lse_ref, 1e-4, 1e-5);
            let want: Vec<f64> = gref.iter().map(|g| g * grad_mult as f64).collect();
            close(&format!("{name} dlogits"), &down(&be, &dx), &want, at * 1e-2 + 1e-7, rt);
            // ignored rows get exactly zero gradient
            let d = down(&be, &dx);
            for (i, &ti) in t.iter().enumerate() {
                if ti == -100 {
                    assert!(d[i * v..(i + 1) * v].iter().all(|&z| z == 0.0), "{name}: ignored row {i} has a nonzero gradient");
                }
            }
        }
    }
}

// ---- determinism -------------------------------------------------------------------------------

/// The flash kernels copy 16-byte chunks: views whose data starts off a 16-byte boundary (here
/// an offset of 3 elements) give the same bits as the aligned tensors, in either head layout (a
/// time-major view is copied in its own layout).
#[test]
fn flash_attention_misaligned_views() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(16);
    let (b, hq, hkv, t, d) = (2, 4, 2, 70, 64);
    let dims = AttnDims { b, hq, hkv, t, d };
    let vals: Vec<Vec<f64>> = [hq, hkv, hkv, hq].iter().map(|&h| normals(b * h * t * d + 3, 1.0, &mut r)).collect();
    let big: Vec<Storage> = vals.iter().map(|v| up_bf16(&be, v)).collect();
    let small: Vec<Storage> = vals.iter().map(|v| up_bf16(&be, &v[3..])).collect();
    let scale = 0.125;
    for time_major in [false, true] {
        // (b, h, t, d) views: head-major, or over (b, t, h, d) memory.
        let view = |h: usize, offset: usize| {
            let strides = if time_major { vec![t * h * d, d, h * d, 1] } else { vec![h * t * d, t * d, d, 1] };
            Layout { shape: Shape(vec![b, h, t, d]), strides, offset }
        };
        let run = |x: &[Storage], off: usize| {
            let (lq, lkv) = (view(hq, off), view(hkv, off));
            let (o, lse) = attention::forward((&x[0], &lq), (&x[1], &lkv), (&x[2], &lkv), dims, scale, None).unwrap();
            let (lo, llse) = (view(hq, 0), Layout::contiguous(Shape(vec![b, hq, t])));
            let (dq, dk, dv) = attention::backward(
                [(&x[3], &lq), (&x[0], &lq), (&x[1], &lkv), (&x[2], &lkv), (&o, &lo), (&lse, &llse)],
                dims,
                scale,
                None,
            )
            .unwrap();
            [o, lse, dq, dk, dv].iter().map(|s| bits(&be, s)).collect::<Vec<_>>()
        };
        let (want, got) = (run(&small, 0), run(&big, 3));
        for (i, what) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
            assert_eq!(got[i], want[i], "attention on views at offset 3 (time-major {time_major}): {what} differs from the aligned run");
        }
    }
}

/// `first()`, then `second()` under the emulator's reversed thread schedule, where a data race
/// shows as a difference between the two (on a GPU the schedule is the hardware's).
fn second_reversed<T>(be: &ferrolm_cuda::CudaBackend, first: impl FnOnce() -> T, second: impl FnOnce() -> T) -> (T, T) {
    let a = first();
    be.emulator_reverse_schedule(true);
    let b = second();
    be.emulator_reverse_schedule(false);
    (a, b)
}

/// The bits of o, lse, dq, dk and dv of one forward and backward on contiguous device inputs.
fn attention_bits(be: &ferrolm_cuda::CudaBackend, [q, k, v, dout]: [&Storage; 4], dims: AttnDims, scale: f64) -> Vec<Vec<u32>> {
    let AttnDims { b, hq, hkv, t, d } = dims;
    let (lq, lkv) = (Layout::contiguous(Shape(vec![b, hq, t, d])), Layout::contiguous(Shape(vec![b, hkv, t, d])));
    let (o, lse) = attention::forward((q, &lq), (k, &lkv), (v, &lkv), dims, scale, None).unwrap();
    let llse = Layout::contiguous(Shape(vec![b, hq, t]));
    let (dq, dk, dv) =
        attention::backward([(dout, &lq), (q, &lq), (k, &lkv), (v, &lkv), (&o, &lq), (&lse, &llse)], dims, scale, None).unwrap();
    [o, lse, dq, dk, dv].iter().map(|s| bits(be, s)).collect()
}

#[test]
fn attention_backward_is_bitwise_deterministic() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(14);
    // tensor-core paths (bf16 d64/d128, GQA) and the SIMT path
    for (dt, b, hq, hkv, t, d) in [
        (DType::BF16, 2, 8, 2, 333, 128),
        (DType::BF16, 1, 4, 4, 1024, 64),
        (DType::BF16, 2, 4, 1, 77, 128),
        (DType::F32, 1, 4, 2, 129, 64),
    ] {
        let dims = AttnDims { b, hq, hkv, t, d };
        let q = dev_rand(&be, b * hq * t * d, dt, &mut r);
        let k = dev_rand(&be, b * hkv * t * d, dt, &mut r);
        let v = dev_rand(&be, b * hkv * t * d, dt, &mut r);
        let dout = dev_rand(&be, b * hq * t * d, dt, &mut r);
        let scale = 1.0 / (d as f64).sqrt();
        let run = || attention_bits(&be, [&q, &k, &v, &dout], dims, scale);
        let (a, c) = second_reversed(&be, run, run);
        for (i, what) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
            let bad = a[i].iter().zip(&c[i]).filter(|(x, y)| x != y).count();
            assert_eq!(bad, 0, "attention {dt} b{b} hq{hq} hkv{hkv} t{t} d{d}: {what} differs between runs in {bad} elements");
            // lse is f32 whatever the dtype of q, k, v
            let is_bf16 = dt == DType::BF16 && *what != "lse";
            let fin = a[i].iter().all(|&x| if is_bf16 { f32::from_bits(x << 16).is_finite() } else { f32::from_bits(x).is_finite() });
            assert!(fin, "attention {dt} {what}: non-finite (unwritten) elements");
        }
    }
}

/// The `_w4` flash kernels (4 warps, 64-row blocks) give the 8-warp kernels' results to the bit:
/// a warp's rows see the same tiles in the same order whatever the block size. The second run
/// uses the emulator's reversed thread schedule, so it also looks for races in the smaller blocks.
#[test]
fn flash_attention_four_warp_blocks_match_eight() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(17);
    for (b, hq, hkv, t, d) in [(1, 2, 2, 1, 64), (2, 4, 2, 203, 64), (1, 2, 2, 77, 128), (1, 4, 1, 300, 128)] {
        let dims = AttnDims { b, hq, hkv, t, d };
        let [q, k, v, dout] = [hq, hkv, hkv, hq].map(|h| dev_rand(&be, b * h * t * d, DType::BF16, &mut r));
        let scale = 1.0 / (d as f64).sqrt();
        let run = || attention_bits(&be, [&q, &k, &v, &dout], dims, scale);
        // The launches themselves (the built-in profile counts them): each block size ran its own
        // kernels, on blocks of 32 threads a warp and one block per 16 rows a warp.
        ferrolm_cuda::profile::enable(true);
        ferrolm_cuda::profile::reset();
        let (eight, four) =
            second_reversed(&be, || attention::with_flash_warps(8, run).unwrap(), || attention::with_flash_warps(4, run).unwrap());
        let rep = ferrolm_cuda::profile::report();
        ferrolm_cuda::profile::enable(false);
        for (suffix, warps) in [("", 8u32), ("_w4", 4)] {
            for pass in ["fwd", "bwd_dkdv", "bwd_dq"] {
                let name = format!("flash_{pass}_bf16_d{d}{suffix}");
                let k = rep.kernels.iter().find(|k| k.name == name).unwrap_or_else(|| panic!("{name} was not launched: {:?}", rep.kernels));
                let heads = if pass == "bwd_dkdv" { hkv } else { hq };
                assert_eq!(k.max_block, 32 * warps, "{name}: threads per block");
                // (Other tests may launch the 8-warp kernels meanwhile, at larger shapes; only
                // this test launches the 4-warp ones.)
                if warps == 4 {
                    assert_eq!(k.max_grid, (t.div_ceil(64) as u32, heads as u32, b as u32), "{name}: grid");
                }
            }
        }
        for (i, what) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
            let bad = eight[i].iter().zip(&four[i]).filter(|(x, y)| x != y).count();
            assert_eq!(bad, 0, "b{b} hq{hq} hkv{hkv} t{t} d{d}: {what} of the 4-warp kernels differs in {bad} elements");
        }
    }
}

#[test]
fn embedding_backward_is_bitwise_deterministic() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(15);
    for dt in [DType::F32, DType::BF16] {
        // few rows, many repeats: a non-deterministic scatter-add would show here
        for (vocab, d, n) in [(50usize, 64usize, 5000usize), (7, 129, 20_000), (32000, 128, 4096)] {
            let ids: Vec<i32> = (0..n).map(|_| r.below(vocab as u64) as i32).collect();
            let ids = be.from_cpu(&CpuStorage::I32(ids)).unwrap();
            let dy = dev_rand(&be, n * d, dt, &mut r);
            let (ly, li) = (Layout::contiguous(Shape(vec![n, d])), flat(n));
            let run = || bits(&be, &embedding::backward((&dy, &ly), (&ids, &li), vocab).unwrap());
            let (a, b) = second_reversed(&be, run, run);
            let bad = a.iter().zip(&b).filter(|(x, y)| x != y).count();
            assert_eq!(bad, 0, "embedding backward {dt} V{vocab} d{d} n{n}: {bad} elements differ between runs");
        }
    }
}

/// The sorted backward (ids with a host copy) against the CPU reference, bit for bit (both sum
/// each id's rows in token order in f32 and round once), on poisoned outputs: repeated ids,
/// absent ids (zero rows), one id everywhere, n and d not multiples of anything, d a multiple of
/// the 16-byte vector width (vector path) and not (scalar path), dy at an odd offset (unaligned:
/// scalar path), and no ids at all. A second run with reversed thread schedules must repeat it.
#[test]
fn embedding_sorted_backward_matches_the_cpu_bitwise() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(16);
    for dt in [DType::F32, DType::BF16] {
        // (vocab, d, n, how ids are drawn, dy's element offset)
        let cases: [(usize, usize, usize, &str, usize); 9] = [
            (50, 64, 5000, "uniform", 0),
            (7, 129, 2001, "uniform", 0),
            (1000, 136, 37, "uniform", 0), // most rows absent
            (300, 40, 999, "one", 0),      // one id everywhere
            (300, 40, 999, "skewed", 3),   // unaligned dy
            (64, 8, 513, "half", 0),       // only even ids
            (5, 3, 7, "uniform", 1),
            (33, 1024, 130, "uniform", 0), // several column tiles
            (9, 16, 0, "uniform", 0),      // no ids: all zero
        ];
        for (vocab, d, n, how, off) in cases {
            let ids: Vec<i32> = (0..n)
                .map(|_| match how {
                    "one" => (vocab / 2) as i32,
                    "skewed" => {
                        if r.below(4) == 0 {
                            r.below(vocab as u64) as i32
                        } else {
                            1
                        }
                    }
                    "half" => (2 * r.below(vocab as u64 / 2)) as i32,
                    _ => r.below(vocab as u64) as i32,
                })
                .collect();
            let dy = dev_rand(&be, off + n * d, dt, &mut r);
            let ly = Layout { offset: off, ..Layout::contiguous(Shape(vec![n, d])) };
            let host_dy = be.to_cpu((&dy, &flat(off + n * d))).unwrap();
            let want = embedding::backward_sorted((&Storage::Cpu(host_dy), &ly), &ids, vocab).unwrap();
            let want: Vec<u32> = match want {
                Storage::Cpu(CpuStorage::F32(v)) => v.into_iter().map(f32::to_bits).collect(),
                Storage::Cpu(CpuStorage::BF16(v)) => v.into_iter().map(|x| x.to_bits() as u32).collect(),
                _ => unreachable!(),
            };
            let run = || bits(&be, &embedding::backward_sorted((&dy, &ly), &ids, vocab).unwrap());
            let (a, b) = second_reversed(&be, run, run);
            let case = format!("embedding sorted backward {dt} V{vocab} d{d} n{n} {how} offset {off}");
            assert_eq!(a.len(), vocab * d, "{case}: size");
            let bad = a.iter().zip(&want).filter(|(x, y)| x != y).count();
            assert_eq!(bad, 0, "{case}: {bad} elements differ from the CPU reference");
            assert_eq!(a, b, "{case}: differs between runs");
        }
        // Ids are checked: one outside the vocabulary is an error, not a read out of bounds.
        let dy = dev_rand(&be, 2 * 4, dt, &mut r);
        let e = embedding::backward_sorted((&dy, &Layout::contiguous(Shape(vec![2, 4]))), &[0, 9], 9).unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");
    }
}

// ---- memory pool steady state --------------------------------------------------------------------

/// Vocabulary, H heads of width HD (model width DM), MLP width; a batch of B sequences of T tokens.
const V: usize = 512;
const H: usize = 2;
const HD: usize = 64;
const DM: usize = H * HD;
const FF: usize = 256;
const BATCH: [usize; 2] = [2, 96];

struct Model {
    emb: Tensor,
    norm: Tensor,
    wqkv: Tensor,
    wgu: Tensor,
    wdown: Tensor,
    wout: Tensor,
}

impl Model {
    fn params(&self) -> Vec<&Tensor> {
        vec![&self.emb, &self.norm, &self.wqkv, &self.wgu, &self.wdown, &self.wout]
    }
    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Tensor {
        let [b, t] = BATCH;
        let x = embedding(ids, &self.emb).unwrap(); // (B*T, DM)
        let h = rms_norm(&x, &self.norm, 1e-5).unwrap();
        let qkv = h.matmul(&self.wqkv).unwrap().reshape(vec![b, t, 3, H, HD]).unwrap();
        let pick = |i: usize| {
            qkv.narrow(2, i, 1).unwrap().reshape(vec![b, t, H, HD]).unwrap().permute(&[0, 2, 1, 3]).unwrap().contiguous().unwrap()
        };
        let a = causal_attention(&pick(0), &pick(1), &pick(2), 1.0 / (HD as f64).sqrt()).unwrap();
        let a = a.permute(&[0, 2, 1, 3]).unwrap().contiguous().unwrap().reshape(vec![b * t, DM]).unwrap();
        let x = x.add(&a).unwrap();
        let gu = x.matmul(&self.wgu).unwrap();
        let (g, u) = (gu.narrow(1, 0, FF).unwrap(), gu.narrow(1, FF, FF).unwrap());
        let x = x.add(&swiglu(&g, &u).unwrap().matmul(&self.wdown).unwrap()).unwrap();
        let logits = x.matmul(&self.wout).unwrap();
        cross_entropy(&logits, targets, -100).unwrap()
    }
}

#[test]
fn pool_makes_no_device_allocation_after_warm_up() {
    let Some(be) = gpu_exclusive() else { return };
    let mut r = Rng::new(16);
    let p = |shape: Vec<usize>, std: f64, r: &mut Rng| {
        let t = Tensor::randn(shape, std, DType::BF16, GPU, r).unwrap();
        t.set_requires_grad(true).unwrap();
        t
    };
    let m = Model {
        emb: p(vec![V, DM], 1.0, &mut r),
        norm: Tensor::ones(vec![DM], DType::BF16, GPU).unwrap().affine(1.0, 0.0).unwrap().detach(),
        wqkv: p(vec![DM, 3 * DM], 0.05, &mut r),
        wgu: p(vec![DM, 2 * FF], 0.05, &mut r),
        wdown: p(vec![FF, DM], 0.05, &mut r),
        wout: p(vec![DM, V], 0.05, &mut r),
    };
    m.norm.set_requires_grad(true).unwrap();
    // fp32 master weights and moments
    let state: Vec<(Storage, Storage, Storage)> = m
        .params()
        .iter()
        .map(|t| {
            let n = t.numel();
            (up_f32(&be, &t.to_vec_f64().unwrap()), up_f32(&be, &vec![0.0; n]), up_f32(&be, &vec![0.0; n]))
        })
        .collect();
    let n = BATCH[0] * BATCH[1];
    let ids: Vec<i32> = (0..n).map(|_| r.below(V as u64) as i32).collect();
    let ids = Tensor::from_vec(ids, vec![n], GPU).unwrap();
    let tg: Vec<i32> = (0..n).map(|i| if i % 11 == 5 { -100 } else { r.below(V as u64) as i32 }).collect();
    let targets = Tensor::from_vec(tg, vec![n], GPU).unwrap();
    let mut losses = Vec::new();
    let step = |k: u32| {
        let loss = m.loss(&ids, &targets);
        loss.backward().unwrap();
        let grads: Vec<Tensor> = m.params().iter().map(|t| dense(&t.grad().expect("grad"))).collect();
        let mut all: Vec<&Tensor> = grads.iter().collect();
        all.extend(m.params());
        with_cuda(&all, |s| {
            let np = grads.len();
            let norm = be.grad_norm(&s[..np], 1.0).unwrap();
            let ts: Vec<AdamWTensor> = (0..np)
                .map(|i| AdamWTensor {
                    master: cs(&state[i].0),
                    grad: s[i],
                    m: cs(&state[i].1),
                    v: cs(&state[i].2),
                    param_bf16: Some(s[np + i]),
                    weight_decay: 0.1,
                })
                .collect();
            be.adamw_multi_scaled(&ts, AdamWParams { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, step: k }, Some((&norm, 1))).unwrap();
        });
        drop(grads);
        for t in m.params() {
            t.zero_grad();
        }
        loss.item().unwrap() // synchronises
    };
    losses.push(step(1));
    losses.push(step(2)); // second warm-up: the moments / grads exist from here on
    be.synchronize().unwrap();
    let (allocs0, (cur0, _, cached0)) = (be.device_allocations(), be.memory_stats());
    for k in 3..=8 {
        losses.push(step(k));
    }
    be.synchronize().unwrap();
    let (allocs1, (cur1, _, cached1)) = (be.device_allocations(), be.memory_stats());
    assert!(losses.iter().all(|l| l.is_finite()), "losses {losses:?}");
    assert!(losses.last().unwrap() < &losses[0], "training did not reduce the loss: {losses:?}");
    assert_eq!(allocs1, allocs0, "steady-state steps made {} new device allocations", allocs1 - allocs0);
    assert_eq!(cur1 + cached1, cur0 + cached0, "pool footprint changed: {} -> {} bytes", cur0 + cached0, cur1 + cached1);
}

/// Ids and targets uploaded with their host copy (`Tokens::upload`) are checked and counted on
/// the host: the embedding and the cross-entropy, forward and backward, make no host wait on
/// the device and give the bits of the device-checked path, which makes three (the id check,
/// the target check and the count). Bad ids and targets fail with the host check's messages.
/// Waits are counted inside a `StepScope` on this thread only (other tests make none there).
#[test]
fn uploaded_tokens_are_checked_on_the_host_without_a_host_wait() {
    use ferrolm_cuda::{host_waits, StepScope};
    use ferrolm_ops::{cross_entropy_tokens, embedding_tokens, Tokens};
    let Some(_g) = gpu() else { return };
    let mut r = rng(5);
    let (n, v, d) = (37usize, 50usize, 16usize);
    let ids: Vec<i32> = (0..n).map(|i| (i * 7 % v) as i32).collect();
    let tg: Vec<i32> = (0..n).map(|i| if i % 5 == 0 { -100 } else { (i * 3 % v) as i32 }).collect();
    let (w0, head) = (to_gpu(&randn(&[v, d], DType::F32, &mut r)), to_gpu(&randn(&[v, d], DType::F32, &mut r)));
    // (host waits made, loss, the embedding's gradient)
    let run = |ids: Tokens, tg: Tokens| {
        let w = w0.detach();
        w.set_requires_grad(true).unwrap();
        let before = host_waits().in_steps;
        let loss = {
            let _step = StepScope::begin();
            let x = embedding_tokens(&ids, &w).unwrap();
            let loss = cross_entropy_tokens(&x.matmul(&head.t().unwrap()).unwrap(), &tg, -100).unwrap();
            loss.backward().unwrap();
            loss
        };
        let waits = host_waits().in_steps - before;
        (waits, loss.to_vec::<f32>().unwrap(), w.grad().unwrap().to_vec::<f32>().unwrap())
    };
    let up = |v: &[i32]| Tokens::upload(v.to_vec(), [v.len()], GPU).unwrap();
    let dev = |v: &[i32]| Tokens::device(&to_gpu(&Tensor::from_vec(v.to_vec(), [v.len()], Device::Cpu).unwrap()));
    let host = run(up(&ids), up(&tg));
    let device = run(dev(&ids), dev(&tg));
    assert_eq!((host.0, device.0), (0, 3), "host waits: host-checked, device-checked");
    assert_eq!(host.1, device.1, "loss");
    assert_eq!(host.2, device.2, "embedding gradient");
    let w = w0.detach();
    let err = |e: ferrolm_tensor::Error| e.to_string();
    let before = host_waits().in_steps;
    let _step = StepScope::begin();
    let e = err(embedding_tokens(&up(&[0, v as i32]), &w).unwrap_err());
    assert!(e.contains("embedding") && e.contains(&format!("token id {v} out of range for a vocabulary of {v}")), "{e}");
    let logits = to_gpu(&randn(&[3, v], DType::F32, &mut r));
    let e = err(cross_entropy_tokens(&logits, &up(&[0, -1, 1]), -100).unwrap_err());
    assert!(e.contains("cross_entropy") && e.contains("target -1 out of range"), "{e}");
    assert_eq!(host_waits().in_steps - before, 0, "the host checks read nothing back");
}
