//! The launchers that have no `Backend` method (fused AdamW, global grad norm, fused
//! cross-entropy) against host references, bitwise run-to-run determinism of the backward
//! kernels that reduce (attention, embedding), and the memory pool's steady state. On the CPU
//! emulator the second run of each determinism check schedules every block's threads in reverse
//! order, so a data race (which makes the result depend on thread order) fails it too.
//! New device buffers are poisoned with NaN (FERROLM_CUDA_POISON=1) and outputs the test
//! allocates itself start as NaN, so an unwritten element fails.
//! With no CUDA device the tests print "skipped: no CUDA device" and pass, unless
//! FERROLM_REQUIRE_GPU=1, where they fail.
use ferrolm_cuda::{AdamWParams, AdamWTensor, CudaBackend, CudaStorage, KernelImage};
use ferrolm_tensor::backend::{AttnDims, Backend};
use ferrolm_tensor::{CpuStorage, DType, Device, Layout, Rng, Shape, Storage, Tensor};

mod common;
use common::{gpu, gpu_exclusive, GPU, SOURCES};

// ---- helpers ------------------------------------------------------------------------------

fn normals(n: usize, std: f64, r: &mut Rng) -> Vec<f64> {
    (0..n).map(|_| r.normal() * std).collect()
}
fn up_f32(be: &CudaBackend, v: &[f64]) -> Storage {
    be.from_cpu(&CpuStorage::F32(v.iter().map(|&x| x as f32).collect())).unwrap()
}
fn up_bf16(be: &CudaBackend, v: &[f64]) -> Storage {
    be.from_cpu(&CpuStorage::BF16(v.iter().map(|&x| ferrolm_tensor::bf16_from_f64(x)).collect())).unwrap()
}
fn cs(s: &Storage) -> &CudaStorage {
    match s {
        Storage::Device(d) => d.as_any().downcast_ref::<CudaStorage>().expect("CUDA storage"),
        Storage::Cpu(_) => panic!("expected device storage"),
    }
}
fn flat(n: usize) -> Layout {
    Layout::contiguous(Shape(vec![n]))
}
/// Host copy of a whole device storage as f64.
fn down(be: &CudaBackend, s: &Storage) -> Vec<f64> {
    let n = cs(s).len_elems();
    match be.to_cpu((s, &flat(n))).unwrap() {
        CpuStorage::F32(v) => v.into_iter().map(f64::from).collect(),
        CpuStorage::BF16(v) => v.into_iter().map(f64::from).collect(),
        CpuStorage::I32(v) => v.into_iter().map(f64::from).collect(),
        CpuStorage::F64(v) => v,
    }
}
/// Raw bits of a whole device storage (f32 as u32, bf16 as u16 widened).
fn bits(be: &CudaBackend, s: &Storage) -> Vec<u32> {
    let n = cs(s).len_elems();
    match be.to_cpu((s, &flat(n))).unwrap() {
        CpuStorage::F32(v) => v.into_iter().map(f32::to_bits).collect(),
        CpuStorage::BF16(v) => v.into_iter().map(|x| x.to_bits() as u32).collect(),
        CpuStorage::I32(v) => v.into_iter().map(|x| x as u32).collect(),
        CpuStorage::F64(_) => unreachable!(),
    }
}
trait LenElems {
    fn len_elems(&self) -> usize;
}
impl LenElems for CudaStorage {
    fn len_elems(&self) -> usize {
        ferrolm_tensor::DeviceStorage::len(self)
    }
}
fn close(name: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{name}: element {i} is {g} (reference {w}): unwritten or overflow");
        assert!((g - w).abs() <= atol + rtol * w.abs(), "{name}: element {i}: gpu {g} vs host {w}");
    }
}
/// Rounds like the device would when it stores/reads bf16.
fn rbf(x: f64) -> f64 {
    f64::from(ferrolm_tensor::bf16_from_f64(x))
}

/// Runs `f` with the CUDA storages of `ts` (read locks held for the whole call). Each tensor
/// must be contiguous with offset 0 and own exactly its elements.
fn with_cuda<R>(ts: &[&Tensor], f: impl FnOnce(&[&CudaStorage]) -> R) -> R {
    #[allow(clippy::type_complexity)] // a recursive borrow helper; a type alias would not make it clearer
    fn go<R>(ts: &[&Tensor], acc: &mut Vec<*const CudaStorage>, f: Box<dyn FnOnce(&[&CudaStorage]) -> R + '_>) -> R {
        match ts.split_first() {
            None => {
                // SAFETY: every pointer refers to storage whose read guard is held by an
                // enclosing `with_storage` frame for the duration of this call.
                let v: Vec<&CudaStorage> = acc.iter().map(|p| unsafe { &**p }).collect();
                f(&v)
            }
            Some((t, rest)) => t
                .with_storage(|(s, l)| {
                    let c = cs(s);
                    assert!(l.is_contiguous() && l.offset == 0 && c.len_elems() == l.numel(), "with_cuda needs a dense tensor");
                    acc.push(c as *const CudaStorage);
                    Ok(go(rest, acc, f))
                })
                .expect("storage readable"),
        }
    }
    go(ts, &mut Vec::new(), Box::new(f))
}
/// A dense copy (fresh storage) unless the tensor already is one.
fn dense(t: &Tensor) -> Tensor {
    let ok = t.with_storage(|(s, l)| Ok(l.is_contiguous() && l.offset == 0 && cs(s).len_elems() == l.numel())).unwrap();
    if ok {
        t.clone()
    } else {
        t.affine(1.0, 0.0).unwrap()
    }
}

// ---- AdamW and grad norm ------------------------------------------------------------------

/// Host f64 AdamW step (the update of ferrolm-nn's AdamW and kernels/optim.cu).
#[allow(clippy::too_many_arguments)]
fn adamw_host(w: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f64], gs: f64, p: AdamWParams, wd: f64) {
    let (b1, b2) = (p.beta1, p.beta2);
    let bc1 = 1.0 - b1.powi(p.step as i32);
    let bc2 = 1.0 - b2.powi(p.step as i32);
    for i in 0..w.len() {
        let gi = g[i] * gs;
        m[i] = b1 * m[i] + (1.0 - b1) * gi;
        v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
        let upd = (m[i] / bc1) / ((v[i] / bc2).sqrt() + p.eps as f64) + wd * w[i];
        w[i] -= p.lr as f64 * upd;
    }
}

#[test]
fn adamw_multi_matches_host_f64_with_clip() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(11);
    // odd sizes, across the 4096-element chunk boundary; (n, bf16 grad, bf16 param copy, wd)
    let specs = [
        (1usize, false, true, 0.1f32),
        (4097, true, true, 0.1),
        (12_345, true, true, 0.0),
        (333, false, false, 0.05),
        (8191, true, false, 0.1),
    ];
    let max_norm = 0.5f32; // the random grads have a far larger norm: the clip factor is < 1
    let mut host: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> = Vec::new();
    let mut dev: Vec<(Storage, Storage, Storage, Option<Storage>)> = Vec::new();
    for &(n, _, pb, _) in &specs {
        let w = normals(n, 0.5, &mut r);
        let m = normals(n, 0.01, &mut r);
        let v: Vec<f64> = normals(n, 1e-3, &mut r).into_iter().map(|x| x.abs() + 1e-6).collect();
        // f32 round trip so host and device start from the same values
        let (w, m, v): (Vec<f64>, Vec<f64>, Vec<f64>) = (
            w.iter().map(|&x| x as f32 as f64).collect(),
            m.iter().map(|&x| x as f32 as f64).collect(),
            v.iter().map(|&x| x as f32 as f64).collect(),
        );
        let pbf = pb.then(|| up_bf16(&be, &vec![f64::NAN; n])); // poisoned: must be written
        dev.push((up_f32(&be, &w), up_f32(&be, &m), up_f32(&be, &v), pbf));
        host.push((w, m, v));
    }
    for step in 1..=3u32 {
        let p = AdamWParams { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, step };
        // fresh grads every step; bf16 grads are rounded on the host the same way
        let mut grads_host = Vec::new();
        let mut grads_dev = Vec::new();
        for &(n, gb, _, _) in &specs {
            let g = normals(n, 1.0, &mut r);
            if gb {
                let g: Vec<f64> = g.iter().map(|&x| rbf(x)).collect();
                grads_dev.push(up_bf16(&be, &g));
                grads_host.push(g);
            } else {
                let g: Vec<f64> = g.iter().map(|&x| x as f32 as f64).collect();
                grads_dev.push(up_f32(&be, &g));
                grads_host.push(g);
            }
        }
        let gref: Vec<&CudaStorage> = grads_dev.iter().map(cs).collect();
        let norm_out = be.grad_norm(&gref, max_norm).unwrap();
        let norm_host = grads_host.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
        let clip_host = (max_norm as f64 / (norm_host + 1e-6)).min(1.0);
        let no = Storage::Device(Box::new(norm_out));
        let nv = down(&be, &no);
        close("grad_norm", &nv[..1], &[norm_host], 0.0, 1e-5);
        close("clip factor", &nv[1..], &[clip_host], 0.0, 1e-5);
        assert!(clip_host < 1.0, "test setup: the clip must be active");
        let tensors: Vec<AdamWTensor> = dev
            .iter()
            .zip(&grads_dev)
            .zip(&specs)
            .map(|((d, g), s)| AdamWTensor {
                master: cs(&d.0),
                grad: cs(g),
                m: cs(&d.1),
                v: cs(&d.2),
                param_bf16: d.3.as_ref().map(cs),
                weight_decay: s.3,
            })
            .collect();
        be.adamw_multi_scaled(&tensors, p, Some((cs(&no), 1))).unwrap();
        // the device applies its own f32 clip factor; use it so the comparison tests the update
        let gs = nv[1];
        for (i, ((h, g), s)) in host.iter_mut().zip(&grads_host).zip(&specs).enumerate() {
            adamw_host(&mut h.0, &mut h.1, &mut h.2, g, gs, p, s.3 as f64);
            let d = &dev[i];
            close(&format!("step {step} tensor {i} m"), &down(&be, &d.1), &h.1, 1e-9, 1e-5);
            close(&format!("step {step} tensor {i} v"), &down(&be, &d.2), &h.2, 1e-12, 1e-5);
            let w = down(&be, &d.0);
            close(&format!("step {step} tensor {i} master"), &w, &h.0, 1e-6, 1e-5);
            if let Some(pb) = &d.3 {
                let pbv = down(&be, pb);
                for (j, (a, b)) in pbv.iter().zip(&w).enumerate() {
                    assert_eq!(*a, rbf(*b), "step {step} tensor {i} bf16 param {j} is not round(master)");
                }
            }
        }
    }
    // no scale and max_norm <= 0: factor 1, plain AdamW
    let n = 777;
    let (w, g) = (normals(n, 1.0, &mut r), normals(n, 1.0, &mut r));
    let (w, g): (Vec<f64>, Vec<f64>) = (w.iter().map(|&x| x as f32 as f64).collect(), g.iter().map(|&x| x as f32 as f64).collect());
    let (dw, dg, dm, dv) = (up_f32(&be, &w), up_f32(&be, &g), up_f32(&be, &vec![0.0; n]), up_f32(&be, &vec![0.0; n]));
    let no = Storage::Device(Box::new(be.grad_norm(&[cs(&dg)], 0.0).unwrap()));
    assert_eq!(down(&be, &no)[1], 1.0, "clip factor with max_norm 0");
    let p = AdamWParams { lr: 3e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, step: 1 };
    be.adamw_multi(&[AdamWTensor { master: cs(&dw), grad: cs(&dg), m: cs(&dm), v: cs(&dv), param_bf16: None, weight_decay: 0.0 }], p, None)
        .unwrap();
    let (mut hw, mut hm, mut hv) = (w.clone(), vec![0.0; n], vec![0.0; n]);
    adamw_host(&mut hw, &mut hm, &mut hv, &g, 1.0, p, 0.0);
    close("adamw unscaled master", &down(&be, &dw), &hw, 1e-6, 1e-5);
}

#[test]
fn grad_norm_matches_host_f64_and_is_deterministic() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(12);
    for sizes in [vec![1usize], vec![0, 5, 4096, 4097], vec![100_003, 7, 65_537, 1 << 20]] {
        let mut host = Vec::new();
        let mut dev = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let g = normals(n, 0.3, &mut r);
            if i % 2 == 0 {
                let g: Vec<f64> = g.iter().map(|&x| rbf(x)).collect();
                dev.push(up_bf16(&be, &g));
                host.extend(g);
            } else {
                let g: Vec<f64> = g.iter().map(|&x| x as f32 as f64).collect();
                dev.push(up_f32(&be, &g));
                host.extend(g);
            }
        }
        let refs: Vec<&CudaStorage> = dev.iter().map(cs).collect();
        let norm = host.iter().map(|x| x * x).sum::<f64>().sqrt();
        let a = Storage::Device(Box::new(be.grad_norm(&refs, 1.0).unwrap()));
        be.emulator_reverse_schedule(true); // on the emulator the second run also checks for races
        let b = Storage::Device(Box::new(be.grad_norm(&refs, 1.0).unwrap()));
        be.emulator_reverse_schedule(false);
        let av = down(&be, &a);
        close(&format!("grad_norm {sizes:?}"), &av[..1], &[norm], 1e-6, 1e-5);
        close(&format!("clip {sizes:?}"), &av[1..], &[(1.0 / (norm + 1e-6)).min(1.0)], 1e-7, 1e-5);
        assert_eq!(bits(&be, &a), bits(&be, &b), "grad_norm is not bitwise reproducible for {sizes:?}");
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
            let loss = Tensor::cross_entropy(&xc, &tt, -100).unwrap();
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
            let (l, lse, dx) =
                xg.with_storage(|(xs, xl)| tg.with_storage(|(ts, _)| be.cross_entropy_fused(xs, xl, ts, -100, grad_mult))).unwrap();
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

fn dev_rand(be: &CudaBackend, n: usize, dt: DType, r: &mut Rng) -> Storage {
    let v = normals(n, 1.0, r);
    if dt == DType::BF16 {
        up_bf16(be, &v)
    } else {
        up_f32(be, &v)
    }
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
        let (lq, lkv) = (Layout::contiguous(Shape(vec![b, hq, t, d])), Layout::contiguous(Shape(vec![b, hkv, t, d])));
        let q = dev_rand(&be, b * hq * t * d, dt, &mut r);
        let k = dev_rand(&be, b * hkv * t * d, dt, &mut r);
        let v = dev_rand(&be, b * hkv * t * d, dt, &mut r);
        let dout = dev_rand(&be, b * hq * t * d, dt, &mut r);
        let scale = 1.0 / (d as f64).sqrt();
        let run = || {
            let (o, lse) = be.attention((&q, &lq), (&k, &lkv), (&v, &lkv), dims, scale).unwrap();
            let llse = Layout::contiguous(Shape(vec![b, hq, t]));
            let (dq, dk, dv) =
                be.attention_backward((&dout, &lq), (&q, &lq), (&k, &lkv), (&v, &lkv), (&o, &lq), (&lse, &llse), dims, scale).unwrap();
            [o, lse, dq, dk, dv].iter().map(|s| bits(&be, s)).collect::<Vec<_>>()
        };
        let a = run();
        be.emulator_reverse_schedule(true); // on the emulator the second run also checks for races
        let c = run();
        be.emulator_reverse_schedule(false);
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
            let a = bits(&be, &be.embedding_backward((&dy, &ly), (&ids, &li), vocab).unwrap());
            be.emulator_reverse_schedule(true); // on the emulator the second run also checks for races
            let b = bits(&be, &be.embedding_backward((&dy, &ly), (&ids, &li), vocab).unwrap());
            be.emulator_reverse_schedule(false);
            let bad = a.iter().zip(&b).filter(|(x, y)| x != y).count();
            assert_eq!(bad, 0, "embedding backward {dt} V{vocab} d{d} n{n}: {bad} elements differ between runs");
        }
    }
}

// ---- memory pool steady state --------------------------------------------------------------------

struct Model {
    emb: Tensor,
    norm: Tensor,
    wqkv: Tensor,
    wgu: Tensor,
    wdown: Tensor,
    wout: Tensor,
}
const V: usize = 512;
const DM: usize = 128;
const H: usize = 2;
const HD: usize = 64;
const FF: usize = 256;
const B: usize = 2;
const T: usize = 96;

impl Model {
    fn params(&self) -> Vec<&Tensor> {
        vec![&self.emb, &self.norm, &self.wqkv, &self.wgu, &self.wdown, &self.wout]
    }
    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Tensor {
        let x = Tensor::embedding(ids, &self.emb).unwrap(); // (B*T, DM)
        let h = x.rms_norm(&self.norm, 1e-5).unwrap();
        let qkv = h.matmul(&self.wqkv).unwrap().reshape(vec![B, T, 3, H, HD]).unwrap();
        let pick = |i: usize| {
            qkv.narrow(2, i, 1).unwrap().reshape(vec![B, T, H, HD]).unwrap().permute(&[0, 2, 1, 3]).unwrap().contiguous().unwrap()
        };
        let a = Tensor::causal_attention(&pick(0), &pick(1), &pick(2), 1.0 / (HD as f64).sqrt()).unwrap();
        let a = a.permute(&[0, 2, 1, 3]).unwrap().contiguous().unwrap().reshape(vec![B * T, DM]).unwrap();
        let x = x.add(&a).unwrap();
        let gu = x.matmul(&self.wgu).unwrap();
        let (g, u) = (gu.narrow(1, 0, FF).unwrap(), gu.narrow(1, FF, FF).unwrap());
        let x = x.add(&Tensor::swiglu(&g, &u).unwrap().matmul(&self.wdown).unwrap()).unwrap();
        let logits = x.matmul(&self.wout).unwrap();
        Tensor::cross_entropy(&logits, targets, -100).unwrap()
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
    let ids: Vec<i32> = (0..B * T).map(|_| r.below(V as u64) as i32).collect();
    let ids = Tensor::from_vec(ids, vec![B * T], GPU).unwrap();
    let tg: Vec<i32> = (0..B * T).map(|i| if i % 11 == 5 { -100 } else { r.below(V as u64) as i32 }).collect();
    let targets = Tensor::from_vec(tg, vec![B * T], GPU).unwrap();
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

#[test]
fn no_gpu_is_reported_without_panicking() {
    if ferrolm_cuda::device_count() == 0 {
        // the only backend that can exist without a GPU is the emulator (other tests register it)
        assert!(CudaBackend::latest(0).is_none_or(|b| b.is_emulated()));
        assert!(CudaBackend::new(0, KernelImage::Sources(SOURCES)).is_err());
    }
}

#[test]
fn pinned_host_buffers_round_trip() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(16);
    let n = 10_001;
    let v: Vec<f32> = (0..n).map(|_| r.normal() as f32).collect();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let dev = be.from_cpu(&CpuStorage::F32(v.clone())).unwrap();
    let mut streams = vec![None];
    if !be.is_emulated() {
        streams.push(Some(be.new_stream().unwrap())); // a side copy stream, ordered by events
    }
    for s in &streams {
        let mut hb = be.alloc_pinned(n * 4).unwrap();
        be.copy_to_pinned(cs(&dev), &mut hb, s.as_ref()).unwrap();
        assert_eq!(hb.as_slice().unwrap(), &bytes[..], "device -> pinned");
        // change it on the host, send it back into a fresh (NaN-poisoned) buffer
        for (i, b) in hb.as_mut_slice().unwrap().chunks_mut(4).enumerate() {
            b.copy_from_slice(&(i as f32).to_le_bytes());
        }
        let back = be.full(n, DType::F32, f64::NAN).unwrap();
        be.copy_from_pinned(&mut hb, cs(&back), s.as_ref()).unwrap();
        let got = down(&be, &back);
        assert!(got.iter().enumerate().all(|(i, &x)| x == i as f64), "pinned -> device");
    }
    let mut small = be.alloc_pinned(8).unwrap();
    assert!(be.copy_to_pinned(cs(&dev), &mut small, None).is_err(), "a size mismatch must be an error");
}
