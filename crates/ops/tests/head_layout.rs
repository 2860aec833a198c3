//! Attention and RoPE on heads split from a projection without a copy: a (b, t, heads, d) tensor
//! seen as (b, heads, t, d) through permute(0, 2, 1, 3) (`HeadLayout::TimeMajor`).
//!
//! - On the CUDA device (the GPU, else the CPU emulator) the tensor-core attention reads q, k, v
//!   and dO in that layout and writes o, dq, dk, dv in it: the same bits as the head-major run of
//!   the same values, within tolerance of the CPU reference (which copies to head-major), on
//!   poisoned outputs, and with no copy kernel launched in the forward or the backward (the
//!   built-in profile counts them; a mixed-layout control shows the count sees copies).
//! - RoPE keeps either layout, on both backends, bit for bit against the head-major result.
//! - An attention block built as `nn::llama` builds it launches no copy kernel, and under
//!   activation checkpointing gives the plain run's gradients to the bit.
//! - The storage-level API refuses what it cannot take, naming it. (Misaligned time-major views:
//!   `cuda.rs`, `flash_attention_misaligned_views`.)
#[path = "../../cuda/tests/common/mod.rs"]
mod common;
use common::*;
use ferrolm_cuda::profile;
use ferrolm_ops::{attention, causal_attention, rope, AttnDims, HeadLayout};
use ferrolm_tensor::autograd::backward_with;
use ferrolm_tensor::{DType, Device, Layout, Rng, Shape, Tensor};
use std::sync::Mutex;

/// The profile is one per process.
static PROFILE: Mutex<()> = Mutex::new(());

const TM: [usize; 4] = [0, 2, 1, 3];

/// Leaves (b, t, heads, d) on `dev` needing gradients, and their (b, heads, t, d) views.
fn split(xs: &[Tensor], dev: Device) -> (Vec<Tensor>, Vec<Tensor>) {
    let leaves: Vec<Tensor> = xs
        .iter()
        .map(|x| {
            let t = x.to_device(dev).unwrap().detach();
            t.set_requires_grad(true).unwrap();
            t
        })
        .collect();
    let views = leaves.iter().map(|l| l.permute(&TM).unwrap()).collect();
    (leaves, views)
}

/// Attention over time-major views of `xs` (q, k, v as (b, t, heads, d)) on `dev`, back from
/// `cot` (b, t, hq, d) as a time-major view, as a model's output projection hands it back:
/// (o as (b, t, hq, d), dq, dk, dv as (b, t, heads, d)), and the layout o came in.
fn time_major_run(xs: &[Tensor], cot: &Tensor, dev: Device, scale: f64) -> (Vec<Tensor>, Option<HeadLayout>) {
    let (leaves, views) = split(xs, dev);
    let y = causal_attention(&views[0], &views[1], &views[2], scale).unwrap();
    let layout = HeadLayout::common(&[y.layout()]);
    backward_with(&y, cot.to_device(dev).unwrap().permute(&TM).unwrap()).unwrap();
    let mut out = vec![y.permute(&TM).unwrap().contiguous().unwrap()];
    out.extend(leaves.iter().map(|l| l.grad().expect("a gradient")));
    (out, layout)
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.contiguous().unwrap().to_vec_f64().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// Launches of copy kernels (strided copies, transposes) in the profile.
fn copies(rep: &profile::ProfileReport) -> u64 {
    rep.kernels.iter().filter(|k| k.name.contains("copy") || k.name.contains("transpose")).map(|k| k.launches).sum()
}

#[test]
fn flash_attention_reads_and_writes_time_major_heads() {
    let Some(_) = gpu() else { return };
    let _g = PROFILE.lock().unwrap_or_else(|e| e.into_inner());
    let mut r = rng(31);
    // d 64 / 128, GQA groups of 1, 2 and 4, t off every tile size, batch > 1.
    for (b, hq, hkv, t, d) in [(2, 4, 2, 77, 64), (1, 8, 2, 130, 128), (2, 2, 2, 203, 128), (1, 4, 1, 300, 64)] {
        let name = format!("time-major attention b{b} hq{hq} hkv{hkv} t{t} d{d}");
        let xs = [hq, hkv, hkv].map(|h| randn(&[b, t, h, d], DType::BF16, &mut r));
        let cot = randn(&[b, t, hq, d], DType::BF16, &mut r);
        let scale = 1.0 / (d as f64).sqrt();
        let (cpu, cpu_layout) = time_major_run(&xs, &cot, Device::Cpu, scale);
        assert_eq!(cpu_layout, Some(HeadLayout::HeadMajor), "{name}: the CPU reference works head-major");
        profile::enable(true);
        profile::reset();
        let (dev, dev_layout) = time_major_run(&xs, &cot, GPU, scale);
        let rep = profile::report();
        profile::enable(false);
        assert_eq!(dev_layout, Some(HeadLayout::TimeMajor), "{name}: o should come out time-major on the device");
        assert_eq!(copies(&rep), 0, "{name}: copy kernels in the forward and backward: {:?}", rep.kernels);
        assert!(rep.kernels.iter().any(|k| k.name.starts_with("flash_bwd_dq")), "{name}: the tensor-core kernels did not run");
        for (i, what) in ["o", "dq", "dk", "dv"].iter().enumerate() {
            check(&format!("{name} {what}"), &cpu[i], &dev[i], DType::BF16, true);
        }
        // The head-major run of the same values on the device: the same bits.
        let hm: Vec<Tensor> = xs.iter().map(|x| x.permute(&TM).unwrap().contiguous().unwrap().to_device(GPU).unwrap()).collect();
        let leaves: Vec<Tensor> = hm.iter().map(|x| x.detach().set_requires_grad(true).cloned().unwrap()).collect();
        let y = causal_attention(&leaves[0], &leaves[1], &leaves[2], scale).unwrap();
        assert_eq!(HeadLayout::common(&[y.layout()]), Some(HeadLayout::HeadMajor), "{name}: head-major in, head-major out");
        backward_with(&y, cot.permute(&TM).unwrap().contiguous().unwrap().to_device(GPU).unwrap()).unwrap();
        let mut want = vec![y.permute(&TM).unwrap()];
        want.extend(leaves.iter().map(|l| l.grad().unwrap().permute(&TM).unwrap()));
        for (i, what) in ["o", "dq", "dk", "dv"].iter().enumerate() {
            assert_eq!(bits(&dev[i]), bits(&want[i]), "{name}: {what} differs from the head-major run");
        }
    }
}

/// The control for the count above: q head-major beside time-major k and v is one layout for
/// none of them, so the op copies (the count sees copies when there are some).
#[test]
fn mixed_head_layouts_are_copied_to_head_major() {
    let Some(_) = gpu() else { return };
    let _g = PROFILE.lock().unwrap_or_else(|e| e.into_inner());
    let mut r = rng(32);
    let (b, hq, hkv, t, d) = (1, 4, 2, 40, 64);
    let q = randn(&[b, hq, t, d], DType::BF16, &mut r);
    let kv = [hkv, hkv].map(|h| randn(&[b, t, h, d], DType::BF16, &mut r));
    let cpu = causal_attention(&q, &kv[0].permute(&TM).unwrap(), &kv[1].permute(&TM).unwrap(), 0.125).unwrap();
    profile::enable(true);
    profile::reset();
    let (qg, kg, vg) = (to_gpu(&q), to_gpu(&kv[0]).permute(&TM).unwrap(), to_gpu(&kv[1]).permute(&TM).unwrap());
    let y = causal_attention(&qg, &kg, &vg, 0.125).unwrap();
    let rep = profile::report();
    profile::enable(false);
    assert_eq!(HeadLayout::common(&[y.layout()]), Some(HeadLayout::HeadMajor));
    assert!(copies(&rep) >= 2, "k and v should have been copied to head-major: {:?}", rep.kernels);
    check("mixed-layout attention", &cpu, &y, DType::BF16, true);
}

#[test]
fn rope_keeps_the_time_major_layout() {
    // Its device copies would land in another test's profile count.
    let _g = PROFILE.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<Device> = std::iter::once(Device::Cpu).chain(gpu().map(|_| GPU)).collect();
    let mut r = Rng::new(33);
    for dt in [DType::F32, DType::BF16] {
        for (b, h, t, d) in [(1, 3, 5, 8), (2, 4, 17, 64)] {
            let x = randn(&[b, t, h, d], dt, &mut r);
            let (cos, sin) = (randn(&[t, d], dt, &mut r), randn(&[t, d], dt, &mut r));
            let cot = randn(&[b, t, h, d], dt, &mut r);
            for &dev in &devices {
                let name = format!("rope {dt} b{b} h{h} t{t} d{d} on {dev}");
                let (c, s) = (cos.to_device(dev).unwrap(), sin.to_device(dev).unwrap());
                let (leaves, views) = split(std::slice::from_ref(&x), dev);
                let y = rope(&views[0], &c, &s).unwrap();
                assert_eq!(HeadLayout::common(&[y.layout()]), Some(HeadLayout::TimeMajor), "{name}: y's layout");
                backward_with(&y, cot.to_device(dev).unwrap().permute(&TM).unwrap()).unwrap();
                // The same rotation of the head-major copy, and its backward.
                let hm = x.permute(&TM).unwrap().contiguous().unwrap().to_device(dev).unwrap().detach();
                hm.set_requires_grad(true).unwrap();
                let want = rope(&hm, &c, &s).unwrap();
                assert!(want.is_contiguous(), "{name}: head-major in, head-major out");
                backward_with(&want, cot.permute(&TM).unwrap().contiguous().unwrap().to_device(dev).unwrap()).unwrap();
                assert_eq!(bits(&y), bits(&want), "{name}: y differs from the head-major rotation");
                let (g, gw) = (leaves[0].grad().unwrap(), hm.grad().unwrap().permute(&TM).unwrap());
                assert_eq!(bits(&g), bits(&gw), "{name}: the gradient differs from the head-major one");
            }
        }
    }
}

#[test]
fn storage_level_attention_names_the_layouts_it_refuses() {
    let (b, hq, hkv, t, d) = (1, 2, 2, 5, 64);
    let dims = AttnDims { b, hq, hkv, t, d };
    let mut r = Rng::new(34);
    let x = randn(&[b, t, hq, d], DType::F32, &mut r);
    let tm = Layout { shape: Shape(vec![b, hq, t, d]), strides: vec![t * hq * d, d, hq * d, 1], offset: 0 };
    let hm = Layout::contiguous(Shape(vec![b, hq, t, d]));
    // Time-major views on the CPU: the reference takes head-major only.
    let err = x.with_storage(|(s, _)| attention::forward((s, &tm), (s, &tm), (s, &tm), dims, 0.1, None)).unwrap_err().to_string();
    assert!(err.contains("attention") && err.contains("time-major"), "{err}");
    // One head-major, two time-major: no one layout.
    let err = x.with_storage(|(s, _)| attention::forward((s, &hm), (s, &tm), (s, &tm), dims, 0.1, None)).unwrap_err().to_string();
    assert!(err.contains("q, k, v must be dense in one head layout"), "{err}");
    // A view dense in neither (every other row).
    let gaps = Layout { shape: Shape(vec![1, 1, 2, 4]), strides: vec![16, 16, 8, 1], offset: 0 };
    let one = Layout::contiguous(Shape(vec![2, 4]));
    let err = x.with_storage(|(s, _)| rope::apply((s, &gaps), (s, &one), (s, &one), None, false)).unwrap_err().to_string();
    assert!(err.contains("rope") && err.contains("dense"), "{err}");
}

/// An attention block as `nn::llama` builds it (projections split into heads by reshape and
/// permute, RoPE, attention, heads merged back), on the device in bf16 with head dim 64: under
/// activation checkpointing the gradients are bitwise those of the plain run (the recomputed
/// forward takes the same time-major path), and neither run launches a copy kernel.
#[test]
fn checkpointed_time_major_block_matches_the_plain_run() {
    let Some(_) = gpu() else { return };
    let _g = PROFILE.lock().unwrap_or_else(|e| e.into_inner());
    let (b, t, hq, hkv, hd) = (2, 70, 2, 1, 64);
    let c = hq * hd;
    let mut r = rng(36);
    let x0 = randn(&[b, t, c], DType::BF16, &mut r).to_device(GPU).unwrap();
    let ws: Vec<Tensor> = [(hq * hd, c), (hkv * hd, c), (hkv * hd, c), (c, hq * hd)]
        .iter()
        .map(|&(o, i)| randn(&[o, i], DType::BF16, &mut r).mul_scalar(0.1).unwrap().to_device(GPU).unwrap())
        .collect();
    let [cos, sin] = [[t, hd], [t, hd]].map(|s| randn(&s, DType::BF16, &mut r).to_device(GPU).unwrap());
    let cot = randn(&[b, t, c], DType::BF16, &mut r).to_device(GPU).unwrap();
    let block = move |x: &Tensor, w: &[Tensor], cos: &Tensor, sin: &Tensor| -> ferrolm_tensor::Result<Tensor> {
        // (b, t, in) -> (b t, in) (w (out, in))^T, as nn's `linear`.
        let linear = |x: &Tensor, w: &Tensor| x.reshape([b * t, w.dim(1)])?.matmul(&w.t()?);
        let heads = |w: &Tensor, n: usize| linear(x, w)?.reshape([b, t, n, hd])?.permute(&TM);
        let q = rope(&heads(&w[0], hq)?, cos, sin)?;
        let k = rope(&heads(&w[1], hkv)?, cos, sin)?;
        let y = causal_attention(&q, &k, &heads(&w[2], hkv)?, 0.125)?;
        x.add(&linear(&y.permute(&TM)?.reshape([b, t, c])?, &w[3])?.reshape([b, t, c])?)
    };
    let run = |ckpt: bool| {
        let x = x0.detach();
        x.set_requires_grad(true).unwrap();
        let w: Vec<Tensor> = ws.iter().map(|w| w.detach().set_requires_grad(true).cloned().unwrap()).collect();
        let h = if ckpt {
            let (w, cos, sin) = (w.clone(), cos.clone(), sin.clone());
            ferrolm_tensor::recompute(std::slice::from_ref(&x), move |xs| block(&xs[0], &w, &cos, &sin)).unwrap()
        } else {
            block(&x, &w, &cos, &sin).unwrap()
        };
        backward_with(&h, cot.clone()).unwrap();
        std::iter::once(&x).chain(&w).map(|p| bits(&p.grad().expect("a gradient"))).collect::<Vec<_>>()
    };
    profile::enable(true);
    profile::reset();
    let plain = run(false);
    let ckpt = run(true);
    let rep = profile::report();
    profile::enable(false);
    assert_eq!(copies(&rep), 0, "copy kernels in the block's forward, recompute or backward: {:?}", rep.kernels);
    assert!(rep.kernels.iter().any(|k| k.name.starts_with("flash_fwd") && k.launches >= 3), "the forward ran, and again under recompute");
    for (i, (a, c)) in plain.iter().zip(&ckpt).enumerate() {
        assert!(a.iter().any(|&v| v != 0), "gradient {i} is all zero");
        assert_eq!(a, c, "gradient {i} differs between the plain and the checkpointed run");
    }
}
