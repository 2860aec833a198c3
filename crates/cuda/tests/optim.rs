//! The fused optimizer launchers (multi-tensor AdamW, global grad norm) against host references,
//! the grad norm's bitwise run-to-run determinism (on the CPU emulator the second run schedules
//! every block's threads in reverse order, so a data race fails it too), and pinned host
//! buffers. New device buffers are poisoned with NaN (FERROLM_CUDA_POISON=1) and outputs the
//! test allocates itself start as NaN, so an unwritten element fails. (The fused ops' CUDA
//! tests, including the pool's steady state over training steps, are crates/ops/tests/cuda.rs.)
//! With no CUDA device the tests print "skipped: no CUDA device" and pass, unless
//! FERROLM_REQUIRE_GPU=1, where they fail.
use ferrolm_cuda::{AdamWParams, AdamWTensor, CudaBackend, CudaStorage, KernelImage};
use ferrolm_tensor::backend::Backend;
use ferrolm_tensor::{CpuStorage, DType, Rng, Storage};

mod common;
use common::*;

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

/// n normal gradients of standard deviation `std`, on the device in bf16 or f32, and on the host
/// as f64 rounded the same way.
fn random_grad(be: &CudaBackend, n: usize, std: f64, bf16: bool, r: &mut Rng) -> (Vec<f64>, Storage) {
    let round = |x: f64| if bf16 { rbf(x) } else { x as f32 as f64 };
    let g: Vec<f64> = normals(n, std, r).into_iter().map(round).collect();
    let dev = if bf16 { up_bf16(be, &g) } else { up_f32(be, &g) };
    (g, dev)
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
            let (g, gd) = random_grad(&be, n, 1.0, gb, &mut r);
            grads_dev.push(gd);
            grads_host.push(g);
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
            let (g, gd) = random_grad(&be, n, 0.3, i % 2 == 0, &mut r);
            dev.push(gd);
            host.extend(g);
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

// ---- determinism -------------------------------------------------------------------------------

// ---- memory pool steady state --------------------------------------------------------------------

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
    let streams = vec![None, Some(be.new_stream().unwrap())]; // and a side copy stream, ordered by events
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

/// The step's norm in one pass (`grad_norm_weighted`, the `sum_squares` hook): gradients that
/// are views at offsets inside larger buffers (16-byte aligned ones take the vector loads, the
/// others the scalar loop), f32 and bf16 in one launch, with and without per-element weights,
/// against a host f64 sum; bitwise the same when the emulator runs the threads in reverse.
#[test]
fn weighted_grad_norm_over_offset_views_matches_host_f64() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(13);
    // (buffer length, offset, length, bf16, weighted): offsets 0 and 8 are 16-byte aligned in
    // bf16, 4 in f32; 3 and 5 are not.
    let specs = [
        (20_000usize, 0usize, 20_000usize, true, false),
        (9000, 8, 8192, true, true),
        (5000, 3, 4096, true, true),
        (13_000, 4, 12_000, false, true),
        (8200, 5, 8190, false, false),
        (1, 0, 1, false, true),
    ];
    let (mut parts_host, mut bufs, mut wbufs) = (Vec::new(), Vec::new(), Vec::new());
    for &(len, off, n, bf16, weighted) in &specs {
        let (g, gd) = random_grad(&be, len, 0.3, bf16, &mut r);
        let w: Option<Vec<f64>> = weighted.then(|| (0..len).map(|i| [1.0, 0.5, 0.25][i % 3]).collect());
        parts_host.push((g[off..off + n].to_vec(), w.as_ref().map(|w| w[off..off + n].to_vec())));
        bufs.push(gd);
        wbufs.push(w.map(|w| up_f32(&be, &w)));
    }
    let want: f64 =
        parts_host.iter().flat_map(|(g, w)| g.iter().enumerate().map(move |(i, x)| x * x * w.as_ref().map_or(1.0, |w| w[i]))).sum();
    let parts: Vec<ferrolm_cuda::NormPart> = specs
        .iter()
        .zip(bufs.iter().zip(&wbufs))
        .map(|(&(_, off, n, _, _), (g, w))| ferrolm_cuda::NormPart {
            grad: cs(g),
            offset: off,
            len: n,
            weight: w.as_ref().map(|w| (cs(w), off)),
        })
        .collect();
    let (norm, sq) = be.grad_norm_weighted(&parts, 1.0).unwrap();
    let got = be.read_f64(&sq).unwrap();
    assert!((got - want).abs() <= 1e-6 * want, "weighted sum of squares {got} vs host {want}");
    let nv = down(&be, &Storage::Device(Box::new(norm)));
    close("weighted norm", &nv[..1], &[want.sqrt()], 1e-6, 1e-6);
    be.emulator_reverse_schedule(true);
    let again = be.read_f64(&be.grad_norm_weighted(&parts, 1.0).unwrap().1).unwrap();
    be.emulator_reverse_schedule(false);
    assert_eq!(got.to_bits(), again.to_bits(), "the weighted norm is not bitwise reproducible");
    // A weight shorter than its gradient is refused, naming the lengths.
    let short = up_f32(&be, &[1.0; 10]);
    let bad = [ferrolm_cuda::NormPart { grad: cs(&bufs[0]), offset: 0, len: 100, weight: Some((cs(&short), 0)) }];
    let e = be.grad_norm_weighted(&bad, 1.0).unwrap_err().to_string();
    assert!(e.contains("100 elements"), "{e}");
}
