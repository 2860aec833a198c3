//! Shared by the CUDA test binaries (this crate's, and crates/ops/tests/cuda.rs through a
//! `#[path]` module): the kernel sources for NVRTC (or a fatbin named by
//! FERROLM_KERNELS_FATBIN), helpers that compare and move values, and `gpu()`, which registers
//! the backend once: the real device when
//! there is one, else the CPU emulator (crates/cuda/emu: the same kernels/*.cu compiled as C++,
//! with fibers for CUDA threads), announced with "no CUDA device: running on the CUDA emulator".
//! Missing both, the tests skip through `ferrolm_testing::gate` (`Need::Device`): they say
//! "skipped: ..." on stderr, or fail under FERROLM_REQUIRE_EMU=1 (CI) or FERROLM_REQUIRE_GPU=1;
//! FERROLM_REQUIRE_GPU=1 also refuses the emulator in place of a GPU.
#![allow(dead_code)]
use ferrolm_cuda::{CudaBackend, CudaStorage, KernelImage};
use ferrolm_tensor::backend::{self, Backend};
use ferrolm_tensor::{CpuStorage, DType, Device, Layout, Rng, Shape, Storage, Tensor};
use ferrolm_testing::{gate, poison, Need};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The kernel sources NVRTC compiles (the crate's own list, generated from kernels/).
pub const SOURCES: &[(&str, &str)] = ferrolm_cuda::KERNEL_SOURCES;

pub const GPU: Device = Device::Cuda(0);

/// The registered backend, held for one test. Tests share the device (a read lock); a test that
/// measures the pool takes it alone (`gpu_exclusive`) so other tests' buffers do not count.
pub struct Gpu<G> {
    be: Arc<CudaBackend>,
    _guard: G,
}
impl<G> std::ops::Deref for Gpu<G> {
    type Target = CudaBackend;
    fn deref(&self) -> &CudaBackend {
        &self.be
    }
}
static DEVICE_LOCK: RwLock<()> = RwLock::new(());

/// Creates and registers the backend once; None (test passes) when there is no GPU and none
/// is required.
pub fn gpu() -> Option<Gpu<RwLockReadGuard<'static, ()>>> {
    let be = backend_once()?;
    Some(Gpu { be, _guard: DEVICE_LOCK.read().unwrap_or_else(|e| e.into_inner()) })
}
/// `gpu()` with no other test using the device meanwhile.
pub fn gpu_exclusive() -> Option<Gpu<RwLockWriteGuard<'static, ()>>> {
    let be = backend_once()?;
    Some(Gpu { be, _guard: DEVICE_LOCK.write().unwrap_or_else(|e| e.into_inner()) })
}

fn backend_once() -> Option<Arc<CudaBackend>> {
    // (whether a GPU is visible, the backend or why there is none)
    static INIT: OnceLock<(bool, Result<Arc<CudaBackend>, String>)> = OnceLock::new();
    let (gpu, b) = INIT.get_or_init(|| {
        poison::poison_new_device_memory();
        if !ferrolm_cuda::is_available() {
            if gate::demanded_by(Need::Gpus(1)).is_some() {
                return (false, Err("no CUDA device".into()));
            }
            let b = CudaBackend::emulated(0)
                .map_err(|e| format!("no CUDA device, and the CUDA emulator is unavailable (no C++ compiler at build time?): {e}"));
            if let Ok(b) = &b {
                backend::register(b.clone());
            }
            return (false, b);
        }
        // FERROLM_KERNELS_FATBIN=path tests a built fatbin instead of the NVRTC path.
        let image = match std::env::var("FERROLM_KERNELS_FATBIN") {
            Ok(p) => KernelImage::Fatbin(Box::leak(std::fs::read(p).expect("read fatbin").into_boxed_slice())),
            Err(_) => KernelImage::Sources(SOURCES),
        };
        let b = CudaBackend::new(0, image).expect("CUDA backend");
        backend::register(b.clone());
        (true, Ok(b))
    });
    if !gpu {
        gate::no_gpu_visible();
    }
    let b = gate::require(Need::Device, b.clone())?;
    if b.is_emulated() {
        println!("no CUDA device: running on the CUDA emulator");
    }
    Some(b)
}

// ---- comparing and moving values (shared by the CUDA tests of this crate and of crates/ops) ----

/// Runs `f` with f32 and then bf16, and one generator seeded with `seed`, when there is a device
/// (see `gpu`).
pub fn each_float_dtype(seed: u64, mut f: impl FnMut(DType, &mut Rng)) {
    let Some(_device) = gpu() else { return };
    let mut r = Rng::new(seed);
    for dt in [DType::F32, DType::BF16] {
        f(dt, &mut r);
    }
}
pub fn rng(seed: u64) -> Rng {
    Rng::new(seed)
}
pub fn randn(shape: &[usize], dt: DType, r: &mut Rng) -> Tensor {
    Tensor::randn(shape.to_vec(), 1.0, dt, Device::Cpu, r).unwrap()
}
/// The device-against-CPU tolerance of `dt` (`ferrolm_testing::tol::device_tol`).
pub fn tol(dt: DType, loose: bool) -> (f64, f64) {
    ferrolm_testing::tol::device_tol(dt, loose)
}
pub fn check(name: &str, cpu: &Tensor, gpu: &Tensor, dt: DType, loose: bool) {
    assert_eq!(cpu.dims(), gpu.dims(), "{name}: shape");
    let (a, b) = (cpu.to_vec_f64().unwrap(), gpu.to_cpu_storage().map(|_| gpu.to_vec_f64().unwrap()).unwrap());
    let (at, rt) = tol(dt, loose);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(y.is_finite() || !x.is_finite(), "{name}: element {i} is {y} (reference {x}): unwritten or overflow");
        assert!((x - y).abs() <= at + rt * x.abs(), "{name}: element {i}: gpu {y} vs cpu {x}");
    }
}
/// Runs `f` on CPU and GPU copies of `inputs`, back-propagates a random cotangent and compares
/// the output and every input gradient. Every float input must get a gradient on both sides (ids
/// and targets on neither): a missing one fails.
pub fn fwd_bwd(name: &str, dt: DType, inputs: &[Tensor], loose: bool, f: impl Fn(&[Tensor]) -> Tensor) {
    let mut r = rng(99);
    let run = |dev: Device, cot: Option<&Tensor>| {
        let xs: Vec<Tensor> = inputs
            .iter()
            .map(|x| {
                let t = x.to_device(dev).unwrap().detach();
                if t.dtype() != DType::I32 {
                    t.set_requires_grad(true).unwrap();
                }
                t
            })
            .collect();
        let y = f(&xs);
        (xs, y, cot.map(|c| c.to_device(dev).unwrap()))
    };
    let (cx, cy, _) = run(Device::Cpu, None);
    let cot = randn(cy.dims(), cy.dtype(), &mut r);
    let (gx, gy, gcot) = run(GPU, Some(&cot));
    check(name, &cy, &gy, dt, loose);
    cy.mul(&cot).unwrap().sum_all().unwrap().backward().unwrap();
    gy.mul(gcot.as_ref().unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    // A device op that returns no gradient, or one the CPU does not, fails here instead of
    // passing unchecked.
    for (i, (c, g)) in cx.iter().zip(&gx).enumerate() {
        let float = c.dtype() != DType::I32;
        match (c.grad(), g.grad()) {
            (Some(a), Some(b)) if float => check(&format!("{name}.grad[{i}]"), &a, &b, dt, true),
            (None, None) if !float => {}
            (a, b) => panic!(
                "{name}.grad[{i}] ({}): the CPU {} a gradient and the device {}",
                c.dtype(),
                if a.is_some() { "gave" } else { "gave no" },
                if b.is_some() { "gave one" } else { "gave none" }
            ),
        }
    }
}
pub fn to_gpu(t: &Tensor) -> Tensor {
    t.to_device(GPU).unwrap()
}

pub fn normals(n: usize, std: f64, r: &mut Rng) -> Vec<f64> {
    (0..n).map(|_| r.normal() * std).collect()
}
pub fn up_f32(be: &CudaBackend, v: &[f64]) -> Storage {
    be.from_cpu(&CpuStorage::F32(v.iter().map(|&x| x as f32).collect())).unwrap()
}
pub fn up_bf16(be: &CudaBackend, v: &[f64]) -> Storage {
    be.from_cpu(&CpuStorage::BF16(v.iter().map(|&x| ferrolm_tensor::bf16_from_f64(x)).collect())).unwrap()
}
pub fn cs(s: &Storage) -> &CudaStorage {
    match s {
        Storage::Device(d) => d.as_any().downcast_ref::<CudaStorage>().expect("CUDA storage"),
        Storage::Cpu(_) => panic!("expected device storage"),
    }
}
pub fn flat(n: usize) -> Layout {
    Layout::contiguous(Shape(vec![n]))
}
/// Host copy of a whole device storage as f64.
pub fn down(be: &CudaBackend, s: &Storage) -> Vec<f64> {
    let n = cs(s).len_elems();
    match be.to_cpu((s, &flat(n))).unwrap() {
        CpuStorage::F32(v) => v.into_iter().map(f64::from).collect(),
        CpuStorage::BF16(v) => v.into_iter().map(f64::from).collect(),
        CpuStorage::I32(v) => v.into_iter().map(f64::from).collect(),
        CpuStorage::F64(v) => v,
    }
}
/// Raw bits of a whole device storage (f32 as u32, bf16 as u16 widened).
pub fn bits(be: &CudaBackend, s: &Storage) -> Vec<u32> {
    let n = cs(s).len_elems();
    match be.to_cpu((s, &flat(n))).unwrap() {
        CpuStorage::F32(v) => v.into_iter().map(f32::to_bits).collect(),
        CpuStorage::BF16(v) => v.into_iter().map(|x| x.to_bits() as u32).collect(),
        CpuStorage::I32(v) => v.into_iter().map(|x| x as u32).collect(),
        CpuStorage::F64(_) => unreachable!(),
    }
}
pub trait LenElems {
    fn len_elems(&self) -> usize;
}
pub fn close(name: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{name}: element {i} is {g} (reference {w}): unwritten or overflow");
        assert!((g - w).abs() <= atol + rtol * w.abs(), "{name}: element {i}: gpu {g} vs host {w}");
    }
}
/// Rounds like the device would when it stores/reads bf16.
pub fn rbf(x: f64) -> f64 {
    f64::from(ferrolm_tensor::bf16_from_f64(x))
}

/// Runs `f` with the CUDA storages of `ts` (read locks held for the whole call). Each tensor
/// must be contiguous with offset 0 and own exactly its elements.
pub fn with_cuda<R>(ts: &[&Tensor], f: impl FnOnce(&[&CudaStorage]) -> R) -> R {
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
pub fn dense(t: &Tensor) -> Tensor {
    let ok = t.with_storage(|(s, l)| Ok(l.is_contiguous() && l.offset == 0 && cs(s).len_elems() == l.numel())).unwrap();
    if ok {
        t.clone()
    } else {
        t.affine(1.0, 0.0).unwrap()
    }
}

pub fn dev_rand(be: &CudaBackend, n: usize, dt: DType, r: &mut Rng) -> Storage {
    let v = normals(n, 1.0, r);
    if dt == DType::BF16 {
        up_bf16(be, &v)
    } else {
        up_f32(be, &v)
    }
}

impl LenElems for CudaStorage {
    fn len_elems(&self) -> usize {
        ferrolm_tensor::DeviceStorage::len(self)
    }
}

/// The flash attention kernels' determinism, on the device `be`: `run(warps)` gives the five
/// outputs (out, lse, dq, dk, dv) as bits and the tiles it skipped. With 8-warp blocks, again with
/// the emulator's block schedule reversed, and with 4-warp blocks (still reversed), every output
/// must be the same bits. Returns the tiles skipped with 8 and with 4 warps.
pub fn same_bits_in_every_schedule<S>(be: &CudaBackend, name: &str, run: impl Fn(usize) -> (Vec<Vec<u32>>, S)) -> (S, S) {
    let (eight, n8) = run(8);
    be.emulator_reverse_schedule(true);
    let (again, _) = run(8);
    let (four, n4) = run(4);
    be.emulator_reverse_schedule(false);
    for (i, what) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
        let bad = |o: &[Vec<u32>]| eight[i].iter().zip(&o[i]).filter(|(x, y)| x != y).count();
        assert_eq!(bad(&again), 0, "{name}: {what} differs between runs");
        assert_eq!(bad(&four), 0, "{name}: {what} differs between 8- and 4-warp blocks");
    }
    (n8, n4)
}
