//! Optimizer-state offload with interleaved CPU/GPU updates (Deep Optimizer States, arXiv
//! 2410.21316), on the ZeRO engine's seam: each rank offloads its own optimizer shard (a single
//! device's shard is everything) and nothing else changes for the rest of the engine.
//!
//! - The fp32 master weights, m and v of the shard live in page-locked host memory, split into
//!   subgroups of at most `--offload-subgroup-size` elements. A subgroup never straddles a run
//!   of equal weight decay, so each is one slot of the fused update on either side.
//! - Gradients of CPU subgroups stream to the host from the gradient-ready hook (the ZeRO
//!   engine's sink, the moment a bucket's optimizer-range gradient is launched), on a copy
//!   stream; those of GPU subgroups never leave the GPU. With dp > 1 the gradient is a
//!   collective's result still in flight: on NCCL the copy stream waits on the collective's
//!   completion event and copies from its result buffer, so neither the host nor the compute
//!   stream waits for the collective (see `Offload::stream_grad`).
//! - Update phase, subgroups in order: subgroup `i` is updated on the GPU iff `dos::on_gpu(i, k)`
//!   (one in k; `k = None`: all on the CPU). A GPU subgroup's master/m/v are prefetched H2D as soon
//!   as the previous GPU subgroup is done, so the copy runs while the CPU updates the k − 1
//!   subgroups in between; it is updated by the device's fused AdamW kernel and its state goes back
//!   D2H asynchronously. CPU subgroups run `ferrolm_tensor::cpu_adam` (multi-threaded, vectorised)
//!   and send the new working parameters (bf16, or f32 for an f32 model) back H2D asynchronously.
//! - Every host buffer is a `PinnedBuffer`, which waits for its copies before any access, reuse
//!   or free, so the pipeline needs no other synchronisation.
//!
//! On `--device cpu` the same engine runs with host memory on both sides (the "copies" are
//! memcpys and the "GPU" update is the CPU kernel): it saves nothing there, and exists so that the
//! schedule and its composition with ZeRO over thread ranks can be tested without a GPU.
use crate::comm::InFlightResult;
use crate::dos::{self, DosEstimate, DosInputs};
use ferrolm_cuda::{CudaBackend, CudaEvent, CudaStorage, CudaStream, PinnedBuffer};
use ferrolm_nn::optim::adamw_update;
use ferrolm_tensor::backend::AdamWHyper;
use ferrolm_tensor::{bf16, no_grad, AdamWRange, DType, Device, Error, Result, Storage, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Gradient parts this process has copied to the host behind their collective's completion
/// event (without reading the pending result), over every `Offload`.
static COPIES_BEHIND_EVENTS: AtomicU64 = AtomicU64::new(0);

/// How many gradient parts (one per CPU subgroup and step) this process has streamed to the host
/// behind the completion event of the collective that produced them, still in flight: the copy
/// stream waited on the event, and neither the host nor the compute stream did. For tests and
/// reports.
pub fn grad_copies_behind_events() -> u64 {
    COPIES_BEHIND_EVENTS.load(Ordering::Relaxed)
}

/// `--offload-gpu-every`: one subgroup in `k` on the GPU, the performance model's `k`, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GpuEvery {
    #[default]
    Auto,
    Every(u64),
    /// All subgroups on the CPU (k = ∞, ZeRO-Offload).
    Never,
}

impl std::str::FromStr for GpuEvery {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(GpuEvery::Auto),
            "inf" | "never" => Ok(GpuEvery::Never),
            _ => match s.parse::<u64>() {
                Ok(k) if k >= 1 => Ok(GpuEvery::Every(k)),
                _ => Err(format!("`{s}`: expected k >= 1, `auto` (the performance model's k) or `inf` (every subgroup on the CPU)")),
            },
        }
    }
}

impl std::fmt::Display for GpuEvery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuEvery::Auto => write!(f, "auto"),
            GpuEvery::Every(k) => write!(f, "{k}"),
            GpuEvery::Never => write!(f, "inf"),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct OffloadConfig {
    /// Elements per subgroup (> 0).
    pub subgroup: usize,
    pub gpu_every: GpuEvery,
}

impl OffloadConfig {
    pub fn validate(&self) -> Result<()> {
        if self.subgroup == 0 {
            return Err(Error::new("--offload-subgroup-size", "must be at least 1 element"));
        }
        if self.gpu_every == GpuEvery::Every(0) {
            return Err(Error::new("--offload-gpu-every", "k must be at least 1"));
        }
        Ok(())
    }
}

/// What `auto` measured and chose (printed by the training tool).
#[derive(Clone, Debug)]
pub struct OffloadPlan {
    pub k: Option<u64>,
    pub subgroups: usize,
    /// Subgroups updated on the device (`subgroups / k`).
    pub device_subgroups: usize,
    pub elems: u64,
    /// The model's inputs and its estimate for `k` (measured on this machine when `auto`).
    pub inputs: Option<DosInputs>,
    pub estimate: Option<DosEstimate>,
}

/// Host memory: page-locked when the device is a CUDA backend, else plain (8-byte aligned).
enum HostMem {
    Pinned(PinnedBuffer),
    Plain(Vec<u64>, usize),
}

fn cast<T>(b: &[u8]) -> Result<&[T]> {
    // SAFETY: f32 and bf16 accept any bit pattern; alignment and length are checked.
    let (pre, mid, post) = unsafe { b.align_to::<T>() };
    if !pre.is_empty() || !post.is_empty() {
        return Err(Error::new("offload", "misaligned host buffer"));
    }
    Ok(mid)
}
fn cast_mut<T>(b: &mut [u8]) -> Result<&mut [T]> {
    // SAFETY: as in `cast`.
    let (pre, mid, post) = unsafe { b.align_to_mut::<T>() };
    if !pre.is_empty() || !post.is_empty() {
        return Err(Error::new("offload", "misaligned host buffer"));
    }
    Ok(mid)
}

impl HostMem {
    fn new(be: Option<&CudaBackend>, bytes: usize) -> Result<HostMem> {
        Ok(match be {
            Some(be) => HostMem::Pinned(be.alloc_pinned(bytes)?),
            None => HostMem::Plain(vec![0; bytes.div_ceil(8)], bytes),
        })
    }
    fn bytes(&mut self) -> Result<&[u8]> {
        match self {
            HostMem::Pinned(p) => p.as_slice(),
            HostMem::Plain(v, n) => Ok(&cast_u64(v)[..*n]),
        }
    }
    fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        match self {
            HostMem::Pinned(p) => p.as_mut_slice(),
            HostMem::Plain(v, n) => Ok(&mut cast_u64_mut(v)[..*n]),
        }
    }
    fn f32(&mut self) -> Result<&[f32]> {
        cast(self.bytes()?)
    }
    fn f32_mut(&mut self) -> Result<&mut [f32]> {
        cast_mut(self.bytes_mut()?)
    }
}

fn cast_u64(v: &[u64]) -> &[u8] {
    // SAFETY: the words' bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 8) }
}
fn cast_u64_mut(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: the words' bytes, under the unique borrow.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 8) }
}

fn cuda_storage(s: &Storage) -> Result<&CudaStorage> {
    match s {
        Storage::Device(d) => d.as_any().downcast_ref::<CudaStorage>().ok_or_else(|| Error::new("offload", "not CUDA storage")),
        Storage::Cpu(_) => Err(Error::new("offload", "expected device storage, got host storage")),
    }
}

/// Copies between device tensors and host memory: asynchronous pinned copies on a CUDA backend
/// (on a real GPU one side stream per direction, so that a GPU subgroup's state going back and
/// the next one's coming in use both directions of the link at once), tensor reads and writes on
/// the CPU device.
struct HostCopies {
    be: Option<Arc<CudaBackend>>,
    h2d_stream: Option<Arc<CudaStream>>,
    d2h_stream: Option<Arc<CudaStream>>,
}

impl HostCopies {
    fn new(device: Device) -> Result<HostCopies> {
        match device {
            Device::Cpu => Ok(HostCopies { be: None, h2d_stream: None, d2h_stream: None }),
            Device::Cuda(o) => {
                let be = CudaBackend::latest(o).ok_or_else(|| Error::new("offload", format!("no CUDA backend for {device}")))?;
                let (h2d_stream, d2h_stream) = (Some(be.new_stream()?), Some(be.new_stream()?));
                Ok(HostCopies { be: Some(be), h2d_stream, d2h_stream })
            }
        }
    }

    /// The completion event and result buffer of the collective whose result `t` is, while it is
    /// still in flight, when a copy can chain behind it: an NCCL result (f32, 1-D, viewed whole)
    /// on a CUDA backend. None otherwise (a ready tensor, a thread rank's result, a conversion).
    fn in_flight(&self, t: &Tensor) -> Option<(Arc<CudaEvent>, u64)> {
        if self.d2h_stream.is_none() || t.dtype() != DType::F32 || t.rank() != 1 {
            return None;
        }
        InFlightResult::device_of(t)
    }

    /// Whether `d2h` of `t` starts without anything waiting for `t`'s producer: `t` is ready (the
    /// copy stream waits for the compute stream's work so far, the host does not), or it is a
    /// collective's result that the copy chains behind (`in_flight`).
    fn starts_at_once(&self, t: &Tensor) -> bool {
        !t.is_pending() || self.in_flight(t).is_some()
    }

    /// Device -> host: `len` elements of the 1-D contiguous `t` from element `off` (all of `host`).
    /// The compute stream does not wait for the copy: `t` is kept alive until `host` is waited
    /// for, and every tensor sent this way (a reduced gradient, a GPU subgroup's state after its
    /// update) is never written again. A collective's result still in flight (`in_flight`) is
    /// not read: the copy stream waits on the collective's completion event and copies from its
    /// result buffer. Any other pending `t` is read first (which waits for it).
    fn d2h(&self, t: &Tensor, off: usize, host: &mut HostMem) -> Result<()> {
        let es = t.dtype().size_in_bytes();
        match (&self.be, host) {
            (Some(be), HostMem::Pinned(buf)) => {
                if let (Some((event, ptr)), Some(stream)) = (self.in_flight(t), &self.d2h_stream) {
                    // SAFETY: `ptr` is the collective's result buffer, `t.numel()` elements that
                    // live while the pending `t` does (kept until `buf` is waited for); only the
                    // collective writes them, before `event`, and a reduced gradient is never
                    // written again.
                    unsafe { be.copy_to_pinned_after_event(&event, ptr, t.numel() * es, off * es, buf, stream, Box::new(t.clone())) }?;
                    COPIES_BEHIND_EVENTS.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                contiguous(t)?;
                let keep = Box::new(t.clone());
                t.with_storage(|(s, l)| {
                    be.copy_to_pinned_detached(cuda_storage(s)?, (l.offset + off) * es, buf, self.d2h_stream.as_ref(), keep)
                })
            }
            (_, h) => {
                let len = h.bytes()?.len() / es;
                let part = t.narrow(0, off, len)?;
                match t.dtype() {
                    DType::F32 => h.f32_mut()?.copy_from_slice(&part.to_vec::<f32>()?),
                    DType::BF16 => cast_mut::<bf16>(h.bytes_mut()?)?.copy_from_slice(&part.to_vec::<bf16>()?),
                    d => return Err(Error::new("offload", format!("cannot offload {d:?} tensors"))),
                }
                Ok(())
            }
        }
    }

    /// Host -> device: all of `host` into the 1-D contiguous `t` from element `off`.
    fn h2d(&self, host: &mut HostMem, t: &Tensor, off: usize) -> Result<()> {
        let es = t.dtype().size_in_bytes();
        match (&self.be, host) {
            (Some(be), HostMem::Pinned(buf)) => {
                contiguous(t)?;
                t.with_storage(|(s, l)| be.copy_from_pinned_at(buf, cuda_storage(s)?, (l.offset + off) * es, self.h2d_stream.as_ref()))
            }
            (_, h) => {
                let len = h.bytes()?.len() / es;
                let src = match t.dtype() {
                    DType::F32 => Tensor::from_vec(h.f32()?.to_vec(), [len], t.device())?,
                    DType::BF16 => Tensor::from_vec(cast::<bf16>(h.bytes()?)?.to_vec(), [len], t.device())?,
                    d => return Err(Error::new("offload", format!("cannot offload {d:?} tensors"))),
                };
                t.narrow(0, off, len)?.assign(&src)
            }
        }
    }
}

fn contiguous(t: &Tensor) -> Result<()> {
    if t.rank() != 1 || !t.is_contiguous() {
        return Err(Error::new("offload", "device side of a copy must be a contiguous 1-D view"));
    }
    Ok(())
}

/// One subgroup: elements `lo .. lo + len` of bucket `bucket`'s optimizer range.
struct Subgroup {
    bucket: usize,
    lo: usize,
    len: usize,
    decay: bool,
    gpu: bool,
    master: HostMem,
    m: HostMem,
    v: HostMem,
    /// CPU subgroups: the fp32 gradient and (bf16 models) the new working parameters.
    grad: Option<HostMem>,
    param: Option<HostMem>,
    /// The gradient was streamed during backward (unscaled: the step applies 1/dp and clipping).
    streamed: bool,
}

/// A GPU subgroup's state on the device while it is updated.
struct DeviceSubgroup {
    master: Tensor,
    m: Tensor,
    v: Tensor,
}

/// The offloaded optimizer state of one rank's shard and its update schedule.
pub struct Offload {
    copies: HostCopies,
    subgroups: Vec<Subgroup>,
    /// Elements of each bucket's optimizer range.
    bucket_len: Vec<usize>,
    device: Device,
    param_dtype: DType,
    plan: OffloadPlan,
    /// Seconds of the last update phase spent in CPU AdamW (for the model's inputs).
    pub last_cpu_adam_s: f64,
    /// The newest gradient handed over and not yet streamed, one that could not start at once
    /// (see `stream_grad`).
    deferred: Option<(usize, Tensor)>,
}

/// Elements the measurements of `auto` use (large enough for steady bandwidth, small enough to be
/// quick).
const PROBE: usize = 1 << 22;

impl Offload {
    /// Moves an optimizer shard to host memory: per bucket, `params` (the device view of the
    /// optimizer range or its fp32 master, whose values seed the host master) and `runs` (start,
    /// len, decays) covering it; `param_dtype` is the working parameters' type. m and v start at
    /// zero.
    pub fn new(
        cfg: &OffloadConfig,
        params: &[Tensor],
        runs: &[Vec<(usize, usize, bool)>],
        wd_nonzero: bool,
        param_dtype: DType,
    ) -> Result<Offload> {
        cfg.validate()?;
        let _g = no_grad();
        let device = params.first().map_or(Device::Cpu, |p| p.device());
        let copies = HostCopies::new(device)?;
        let elems: usize = params.iter().map(|p| p.numel()).sum();
        let bucket_len: Vec<usize> = params.iter().map(|p| p.numel()).collect();
        let mut spans = Vec::new();
        for (b, rs) in runs.iter().enumerate() {
            for &(s, l, d) in rs {
                let mut at = s;
                while at < s + l {
                    let len = cfg.subgroup.min(s + l - at);
                    spans.push((b, at, len, d && wd_nonzero));
                    at += len;
                }
            }
        }
        let k = match cfg.gpu_every {
            GpuEvery::Every(k) => Some(k),
            GpuEvery::Never => None,
            GpuEvery::Auto => None, // resolved below, after the buffers exist
        };
        let mut off = Offload {
            copies,
            subgroups: Vec::with_capacity(spans.len()),
            bucket_len,
            device,
            param_dtype,
            plan: OffloadPlan { k, subgroups: spans.len(), device_subgroups: 0, elems: elems as u64, inputs: None, estimate: None },
            last_cpu_adam_s: 0.0,
            deferred: None,
        };
        if cfg.gpu_every == GpuEvery::Auto {
            let inputs = off.measure(elems as u64, cfg.subgroup as u64)?;
            let best = dos::choose_k(&inputs);
            off.plan.k = best.k;
            off.plan.inputs = Some(inputs);
            off.plan.estimate = Some(best);
        }
        let k = off.plan.k;
        let be = off.copies.be.clone();
        for (i, &(b, lo, len, decay)) in spans.iter().enumerate() {
            let gpu = dos::on_gpu(i as u64, k);
            let mut sg = Subgroup {
                bucket: b,
                lo,
                len,
                decay,
                gpu,
                master: HostMem::new(be.as_deref(), len * 4)?,
                m: HostMem::new(be.as_deref(), len * 4)?,
                v: HostMem::new(be.as_deref(), len * 4)?,
                grad: if gpu { None } else { Some(HostMem::new(be.as_deref(), len * 4)?) },
                param: if gpu || param_dtype == DType::F32 { None } else { Some(HostMem::new(be.as_deref(), len * 2)?) },
                streamed: false,
            };
            let master = params[b].narrow(0, lo, len)?.to_dtype(DType::F32)?.contiguous()?;
            sg.master.f32_mut()?.copy_from_slice(&master.to_vec::<f32>()?);
            off.subgroups.push(sg);
        }
        off.plan.device_subgroups = off.subgroups.iter().filter(|s| s.gpu).count();
        Ok(off)
    }

    pub fn plan(&self) -> &OffloadPlan {
        &self.plan
    }

    /// The model's inputs measured here: CPU AdamW on `PROBE` elements, pinned copies both ways
    /// and the device's fused AdamW (on the CPU device: the same CPU kernel and memcpy).
    fn measure(&self, elems: u64, subgroup: u64) -> Result<DosInputs> {
        let n = PROBE.min(elems.max(1) as usize).max(1 << 16);
        let cpu = cpu_adam_rate(n, 3)?;
        let dev = Tensor::zeros([n], DType::F32, self.device)?;
        let mut host = HostMem::new(self.copies.be.as_deref(), n * 4)?;
        let sync = |h: &mut HostMem| -> Result<()> {
            if let Some(be) = &self.copies.be {
                be.synchronize()?;
            }
            h.bytes().map(|_| ())
        };
        let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            f()?; // warm-up
            let t = Instant::now();
            for _ in 0..3 {
                f()?;
            }
            Ok(t.elapsed().as_secs_f64().max(1e-9) / 3.0)
        };
        let d2h = (n * 4) as f64
            / time(&mut || {
                self.copies.d2h(&dev, 0, &mut host)?;
                sync(&mut host)
            })?;
        let h2d = (n * 4) as f64
            / time(&mut || {
                self.copies.h2d(&mut host, &dev, 0)?;
                sync(&mut host)
            })?;
        let (p, g, m, v) = (
            Tensor::zeros([n], DType::F32, self.device)?,
            Tensor::zeros([n], DType::F32, self.device)?,
            Tensor::zeros([n], DType::F32, self.device)?,
            Tensor::zeros([n], DType::F32, self.device)?,
        );
        let h = AdamWHyper { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, step: 1 };
        let gpu = n as f64
            / time(&mut || {
                adamw_update(&[AdamWRange { param: &p, grad: &g, master: None, m: &m, v: &v, segments: &[(0, n, 0.0)] }], h)?;
                if let Some(be) = &self.copies.be {
                    be.synchronize()?;
                }
                Ok(())
            })?;
        Ok(DosInputs {
            elems,
            subgroup,
            cpu_adam_elems_per_s: cpu,
            gpu_adam_elems_per_s: gpu,
            h2d_bytes_per_s: h2d,
            d2h_bytes_per_s: d2h,
            param_bytes: self.param_dtype.size_in_bytes() as u64,
            grad_bytes: 4,
            backward_s: 0.0,
            interference: 0.0,
        })
    }

    /// Gradient-ready hook: bucket `bucket`'s optimizer-range gradient `g` (unscaled) has been
    /// launched, and may still be in flight (with dp > 1 it is the result of the bucket's
    /// collectives). Its CPU subgroups' parts start for the host now when nothing has to wait
    /// for that: a ready gradient (the copy stream waits for the compute stream), or an NCCL
    /// result in flight (the copy stream waits on the collective's completion event and copies
    /// from its result buffer; neither the host nor the compute stream waits).
    ///
    /// Any other gradient in flight cannot be chained: a thread rank's result arrives through
    /// the host, so reading it blocks the calling thread, and a converted result must be
    /// computed first. Reading it now would make backward wait for the collectives just
    /// launched, so it is held back by one bucket: its parts start when the next bucket's
    /// gradient is handed over (that bucket's backward ran meanwhile), or at `grads_complete`.
    pub fn stream_grad(&mut self, bucket: usize, g: &Tensor) -> Result<()> {
        if let Some((b, older)) = self.deferred.take() {
            self.send_grad(b, &older)?;
        }
        if self.copies.starts_at_once(g) {
            self.send_grad(bucket, g)
        } else {
            self.deferred = Some((bucket, g.clone()));
            Ok(())
        }
    }

    /// Every gradient of this step has been handed over (the end of the last micro-batch's
    /// backward): the deferred one starts for the host too.
    pub fn grads_complete(&mut self) -> Result<()> {
        match self.deferred.take() {
            Some((b, g)) => self.send_grad(b, &g),
            None => Ok(()),
        }
    }

    /// The bucket whose gradient is held back (not yet read), if one is.
    pub fn deferred_grad(&self) -> Option<usize> {
        self.deferred.as_ref().map(|(b, _)| *b)
    }

    fn send_grad(&mut self, bucket: usize, g: &Tensor) -> Result<()> {
        let _g = no_grad();
        let g32 = if g.dtype() == DType::F32 { g.clone() } else { g.to_dtype(DType::F32)? };
        for sg in self.subgroups.iter_mut().filter(|s| s.bucket == bucket && !s.gpu) {
            self.copies.d2h(&g32, sg.lo, sg.grad.as_mut().expect("CPU subgroups hold a gradient buffer"))?;
            sg.streamed = true;
        }
        Ok(())
    }

    /// (CPU subgroups whose gradient has been sent to the host this step, CPU subgroups).
    pub fn grads_streamed(&self) -> (usize, usize) {
        let cpu = self.subgroups.iter().filter(|s| !s.gpu);
        let (mut sent, mut all) = (0, 0);
        for s in cpu {
            sent += s.streamed as usize;
            all += 1;
        }
        (sent, all)
    }

    /// Forgets the gradients streamed this step (a skipped step).
    pub fn discard(&mut self) {
        self.deferred = None;
        for sg in &mut self.subgroups {
            sg.streamed = false;
        }
    }

    /// The update phase. Per bucket: `params` the device view of the optimizer range (updated),
    /// `grads` its summed gradient on the device as reduced (parameter dtype, not yet multiplied
    /// by `scale` = 1/dp); `clip` the clipping factor (1: none); `wd` AdamW's weight decay where
    /// it applies. Both paths apply scale, then clip, as `x * f32(factor) + 0` in f32, the ops the
    /// engine's own update uses, so that the result is the same bits.
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], scale: f64, clip: f64, wd: f64, h: AdamWHyper) -> Result<()> {
        self.grads_complete()?;
        let _g = no_grad();
        let n = self.subgroups.len();
        let next_gpu = |from: usize, sgs: &[Subgroup]| (from..n).find(|&j| sgs[j].gpu);
        let mut prefetched = match next_gpu(0, &self.subgroups) {
            Some(j) => Some((j, self.prefetch(j)?)),
            None => None,
        };
        let mut cpu_s = 0.0;
        for i in 0..n {
            if self.subgroups[i].gpu {
                let (j, st) = prefetched.take().expect("every GPU subgroup is prefetched");
                debug_assert_eq!(i, j);
                self.gpu_update(i, st, params, grads, scale, clip, wd, h)?;
                // The next GPU subgroup's state starts over while the CPU works on the ones
                // between (DOS's prefetch at the stride's first subgroup).
                if let Some(j) = next_gpu(i + 1, &self.subgroups) {
                    prefetched = Some((j, self.prefetch(j)?));
                }
            } else {
                let t = Instant::now();
                self.cpu_update(i, params, grads, scale, clip, wd, h)?;
                cpu_s += t.elapsed().as_secs_f64();
            }
        }
        self.last_cpu_adam_s = cpu_s;
        Ok(())
    }

    fn prefetch(&mut self, i: usize) -> Result<DeviceSubgroup> {
        let len = self.subgroups[i].len;
        let st = DeviceSubgroup {
            master: Tensor::zeros([len], DType::F32, self.device)?,
            m: Tensor::zeros([len], DType::F32, self.device)?,
            v: Tensor::zeros([len], DType::F32, self.device)?,
        };
        let sg = &mut self.subgroups[i];
        self.copies.h2d(&mut sg.master, &st.master, 0)?;
        self.copies.h2d(&mut sg.m, &st.m, 0)?;
        self.copies.h2d(&mut sg.v, &st.v, 0)?;
        Ok(st)
    }

    #[allow(clippy::too_many_arguments)]
    fn gpu_update(
        &mut self,
        i: usize,
        st: DeviceSubgroup,
        params: &[Tensor],
        grads: &[Tensor],
        scale: f64,
        clip: f64,
        wd: f64,
        h: AdamWHyper,
    ) -> Result<()> {
        let sg = &mut self.subgroups[i];
        let g = grads[sg.bucket].narrow(0, sg.lo, sg.len)?.to_dtype(DType::F32)?.mul_scalar(scale)?;
        let g = if clip != 1.0 { g.mul_scalar(clip)? } else { g };
        let pview = params[sg.bucket].narrow(0, sg.lo, sg.len)?;
        let weight_decay = if sg.decay { wd } else { 0.0 };
        let bf16_param = if self.param_dtype == DType::F32 { None } else { Some(pview.deep_copy()?) };
        let segments = [(0, sg.len, weight_decay)];
        let range = match &bf16_param {
            Some(p) => AdamWRange { param: p, grad: &g, master: Some(&st.master), m: &st.m, v: &st.v, segments: &segments },
            None => AdamWRange { param: &st.master, grad: &g, master: None, m: &st.m, v: &st.v, segments: &segments },
        };
        adamw_update(&[range], h)?;
        pview.assign(bf16_param.as_ref().unwrap_or(&st.master))?;
        self.copies.d2h(&st.master, 0, &mut sg.master)?;
        self.copies.d2h(&st.m, 0, &mut sg.m)?;
        self.copies.d2h(&st.v, 0, &mut sg.v)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn cpu_update(&mut self, i: usize, params: &[Tensor], grads: &[Tensor], scale: f64, clip: f64, wd: f64, h: AdamWHyper) -> Result<()> {
        let sg = &mut self.subgroups[i];
        let grad = sg.grad.as_mut().expect("CPU subgroups hold a gradient buffer");
        // The factors the device path applies (`mul_scalar` is x * f32(s) + 0 in f32), so that the
        // update is bit-identical to the one without offload.
        let mut factors = Vec::new();
        if scale != 1.0 {
            factors.push(scale as f32);
        }
        if !sg.streamed {
            let part = grads[sg.bucket].narrow(0, sg.lo, sg.len)?.to_dtype(DType::F32)?.contiguous()?;
            self.copies.d2h(&part, 0, grad)?;
        }
        sg.streamed = false;
        if clip != 1.0 {
            factors.push(clip as f32);
        }
        let g = grad.f32_mut()?;
        for f in factors {
            g.iter_mut().for_each(|x| *x = *x * f + 0.0);
        }
        let weight_decay = if sg.decay { wd } else { 0.0 };
        let (g, w, m, v) = (grad.f32()?, sg.master.f32_mut()?, sg.m.f32_mut()?, sg.v.f32_mut()?);
        let pview = &params[sg.bucket];
        match sg.param.as_mut() {
            Some(p) => {
                ferrolm_tensor::cpu_adam::adamw_step(w, m, v, g, Some(cast_mut::<bf16>(p.bytes_mut()?)?), &h, weight_decay)?;
                self.copies.h2d(p, pview, sg.lo)
            }
            None => {
                ferrolm_tensor::cpu_adam::adamw_step(w, m, v, g, None, &h, weight_decay)?;
                self.copies.h2d(&mut sg.master, pview, sg.lo)
            }
        }
    }

    /// Bucket `b`'s fp32 (master, m, v) as host tensors, for checkpoints (where the state lived
    /// does not show in them).
    pub fn state(&mut self, b: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let len = self.bucket_len[b];
        let (mut w, mut m, mut v) = (vec![0f32; len], vec![0f32; len], vec![0f32; len]);
        for sg in self.subgroups.iter_mut().filter(|s| s.bucket == b) {
            let r = sg.lo..sg.lo + sg.len;
            w[r.clone()].copy_from_slice(sg.master.f32()?);
            m[r.clone()].copy_from_slice(sg.m.f32()?);
            v[r].copy_from_slice(sg.v.f32()?);
        }
        Ok((Tensor::from_vec(w, [len], Device::Cpu)?, Tensor::from_vec(m, [len], Device::Cpu)?, Tensor::from_vec(v, [len], Device::Cpu)?))
    }

    /// Sets bucket `b`'s state from fp32 tensors of its optimizer range's length (a resume).
    pub fn load(&mut self, b: usize, master: &Tensor, m: &Tensor, v: &Tensor) -> Result<()> {
        let (w, m, v) = (master.to_vec_f32()?, m.to_vec_f32()?, v.to_vec_f32()?);
        if [w.len(), m.len(), v.len()].iter().any(|&l| l != self.bucket_len[b]) {
            return Err(Error::new("offload", format!("bucket {b}: state of the wrong length")));
        }
        for sg in self.subgroups.iter_mut().filter(|s| s.bucket == b) {
            let r = sg.lo..sg.lo + sg.len;
            sg.master.f32_mut()?.copy_from_slice(&w[r.clone()]);
            sg.m.f32_mut()?.copy_from_slice(&m[r.clone()]);
            sg.v.f32_mut()?.copy_from_slice(&v[r]);
        }
        Ok(())
    }

    /// Bytes of host memory the offloaded state holds.
    pub fn host_bytes(&self) -> usize {
        self.subgroups
            .iter()
            .map(|s| s.len * 12 + s.grad.as_ref().map_or(0, |_| s.len * 4) + s.param.as_ref().map_or(0, |_| s.len * 2))
            .sum()
    }
}

/// CPU AdamW throughput in elements per second on `n` elements (best of `reps`).
pub fn cpu_adam_rate(n: usize, reps: usize) -> Result<f64> {
    let (mut w, mut m, mut v, g) = (vec![0.1f32; n], vec![0f32; n], vec![0f32; n], vec![0.01f32; n]);
    let mut out = vec![bf16::ZERO; n];
    let h = AdamWHyper { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, step: 1 };
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) + 1 {
        let t = Instant::now();
        ferrolm_tensor::cpu_adam::adamw_step(&mut w, &mut m, &mut v, &g, Some(&mut out), &h, 0.01)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(n as f64 / best.max(1e-9))
}
