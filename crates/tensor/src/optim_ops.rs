//! Entry points for the optional fused optimizer kernels of a backend (`Backend::adamw_step`,
//! `Backend::global_norm`): they take the storages of many tensors at once, so the read guards
//! are taken here, once per distinct storage (two views of one storage would otherwise lock it
//! twice on one thread).
use crate::backend::{self, AdamWHyper, AdamWSlot, View};
use crate::storage::StorageCell;
use crate::{bail, Device, Result, Storage, Tensor};
use std::sync::{Arc, RwLockReadGuard};

/// A flat range of one parameter buffer and its AdamW state: 1-D contiguous views of one length
/// `n` (offsets allowed). `param` is updated in place: f32, or bf16 rounded from the f32
/// `master`; `grad`, `m`, `v` are f32. `segments` (start, len, weight decay) are the elements to
/// update, in runs of equal weight decay (one `(0, n, wd)` for a whole parameter).
pub struct AdamWRange<'a> {
    pub param: &'a Tensor,
    pub master: Option<&'a Tensor>,
    pub grad: &'a Tensor,
    pub m: &'a Tensor,
    pub v: &'a Tensor,
    pub segments: &'a [(usize, usize, f64)],
}

impl AdamWRange<'_> {
    fn tensors(&self) -> impl Iterator<Item = &Tensor> + '_ {
        [self.param, self.grad, self.m, self.v].into_iter().chain(self.master)
    }
    /// Whether every view is 1-D contiguous of the parameter's length, the dtypes are the fused
    /// kernels' (see the struct), the segments lie inside, and no two views share a storage.
    fn fusable(&self, bf16_grad: bool) -> bool {
        use crate::DType::{BF16, F32};
        let n = self.param.numel();
        let flat = |t: &Tensor| t.rank() == 1 && t.is_contiguous() && t.numel() == n;
        let grad_ok = self.grad.dtype() == F32 || (bf16_grad && self.grad.dtype() == BF16);
        let types = grad_ok
            && [self.m, self.v].iter().all(|t| t.dtype() == F32)
            && match self.master {
                None => self.param.dtype() == F32,
                Some(w) => w.dtype() == F32 && self.param.dtype() == BF16,
            };
        let cells: Vec<*const StorageCell> = self.tensors().map(|t| Arc::as_ptr(&t.0.storage)).collect();
        let distinct = (1..cells.len()).all(|i| !cells[..i].contains(&cells[i]));
        types && distinct && self.tensors().all(flat) && self.segments.iter().all(|&(s, l, _)| s.checked_add(l).is_some_and(|e| e <= n))
    }
}

/// One AdamW update of `ranges` by a fused kernel: the CPU's `cpu_adam` (multi-threaded,
/// vectorised) or the device backend's multi-tensor kernel. Every capability is checked before
/// any state is touched: `Ok(false)` means nothing changed and the caller runs the op-based
/// reference (`ferrolm_nn::optim::adamw_update` does).
pub fn fused_adamw(ranges: &[AdamWRange], h: AdamWHyper) -> Result<bool> {
    fused_adamw_scaled(ranges, h, 1.0)
}

/// `fused_adamw` with every gradient multiplied by `grad_scale` first (the step's 1/dp and clip
/// factor), inside the kernel: on a device the gradients may be bf16, read as they are, so the
/// step needs no f32 copy of them. On the CPU only `grad_scale` 1 and f32 gradients are fused.
pub fn fused_adamw_scaled(ranges: &[AdamWRange], h: AdamWHyper, grad_scale: f64) -> Result<bool> {
    let all: Vec<&Tensor> = ranges.iter().flat_map(|r| r.tensors()).collect();
    let device = one_device("fused_adamw", &all)?;
    let on_cpu = device == Device::Cpu;
    if ranges.is_empty() || !ranges.iter().all(|r| r.fusable(!on_cpu)) || (on_cpu && grad_scale != 1.0) {
        return Ok(false);
    }
    if device == Device::Cpu {
        for r in ranges {
            cpu_adamw(r, h)?;
        }
        return Ok(true);
    }
    let b = backend::get("fused_adamw", device)?;
    // One slot per segment: the segment's part of each view.
    let layouts: Vec<Vec<Vec<crate::Layout>>> = ranges
        .iter()
        .map(|r| {
            r.segments
                .iter()
                .map(|&(s, l, _)| {
                    r.tensors().map(|t| crate::Layout { offset: t.layout().offset + s, ..crate::Layout::contiguous([l].into()) }).collect()
                })
                .collect()
        })
        .collect();
    with_views(&all, |v| {
        let mut slots = Vec::new();
        let mut at = 0;
        for (r, segs) in ranges.iter().zip(&layouts) {
            let k = 4 + r.master.is_some() as usize;
            for (seg, ls) in r.segments.iter().zip(segs) {
                let view = |i: usize| (v[at + i].0, &ls[i]);
                slots.push(AdamWSlot {
                    param: view(0),
                    grad: view(1),
                    m: view(2),
                    v: view(3),
                    master: r.master.map(|_| view(4)),
                    weight_decay: seg.2,
                });
            }
            at += k;
        }
        b.adamw_step(&slots, h, grad_scale)
    })
}

/// `fused_adamw` of one range on the CPU (checked `fusable`): `cpu_adam` per segment.
fn cpu_adamw(r: &AdamWRange, h: AdamWHyper) -> Result<()> {
    use crate::CpuStorage;
    let mismatch = || crate::Error::new("fused_adamw", "a storage does not match its dtype");
    let off = |t: &Tensor| t.layout().offset;
    let (og, om, ov, op) = (off(r.grad), off(r.m), off(r.v), off(r.param));
    let g = r.grad.0.storage.read()?;
    let (mut ms, mut vs, mut ps) = (r.m.0.storage.write()?, r.v.0.storage.write()?, r.param.0.storage.write()?);
    let mut ws = match r.master {
        Some(w) => Some((w.0.storage.write()?, off(w))),
        None => None,
    };
    let (Storage::Cpu(CpuStorage::F32(g)), Storage::Cpu(CpuStorage::F32(m)), Storage::Cpu(CpuStorage::F32(v))) = (&*g, &mut *ms, &mut *vs)
    else {
        return Err(mismatch());
    };
    for &(s, l, wd) in r.segments {
        let (g, m, v) = (&g[og + s..og + s + l], &mut m[om + s..om + s + l], &mut v[ov + s..ov + s + l]);
        match (&mut *ps, ws.as_mut()) {
            (Storage::Cpu(CpuStorage::F32(p)), None) => crate::cpu_adam::adamw_step(&mut p[op + s..op + s + l], m, v, g, None, &h, wd)?,
            (Storage::Cpu(CpuStorage::BF16(p)), Some((w, ow))) => {
                let Storage::Cpu(CpuStorage::F32(w)) = &mut **w else { return Err(mismatch()) };
                crate::cpu_adam::adamw_step(&mut w[*ow + s..*ow + s + l], m, v, g, Some(&mut p[op + s..op + s + l]), &h, wd)?
            }
            _ => return Err(mismatch()),
        }
    }
    Ok(())
}

fn dense(t: &Tensor) -> bool {
    let l = t.layout();
    l.is_contiguous() && l.offset == 0 && t.0.storage.bytes() == t.numel() * t.dtype().size_in_bytes()
}

/// Read guards over the storages of `ts`, one per distinct storage; `f` gets their views in
/// the order of `ts`.
pub(crate) fn with_views<R>(ts: &[&Tensor], f: impl FnOnce(&[View]) -> Result<R>) -> Result<R> {
    let mut cells: Vec<Arc<StorageCell>> = Vec::new();
    let idx: Vec<usize> = ts
        .iter()
        .map(|t| {
            let c = t.0.storage.clone();
            match cells.iter().position(|x| Arc::ptr_eq(x, &c)) {
                Some(i) => i,
                None => {
                    cells.push(c);
                    cells.len() - 1
                }
            }
        })
        .collect();
    let guards: Vec<RwLockReadGuard<'_, Storage>> = cells.iter().map(|c| c.read()).collect::<Result<_>>()?;
    let views: Vec<View> = ts.iter().zip(&idx).map(|(t, &i)| (&*guards[i], t.layout())).collect();
    f(&views)
}

fn one_device(op: &str, ts: &[&Tensor]) -> Result<Device> {
    let d = ts.first().map_or(Device::Cpu, |t| t.device());
    if let Some(t) = ts.iter().find(|t| t.device() != d) {
        bail!(op, "tensors on {d} and {}", t.device());
    }
    Ok(d)
}

/// sqrt(sum of squares) over every element of `xs`: on the CPU accumulated in f64 (any layout);
/// on a device by the backend's fused kernel when it has one and every tensor is dense (CUDA:
/// per-block partials summed in f64), `Ok(None)` otherwise.
pub fn fused_global_norm(xs: &[&Tensor]) -> Result<Option<f64>> {
    let device = one_device("fused_global_norm", xs)?;
    if device == Device::Cpu {
        return with_views(xs, |v| v.iter().map(|&x| crate::cpu::sum_squares(x)).sum::<Result<f64>>()).map(|s| Some(s.sqrt()));
    }
    if xs.is_empty() || !xs.iter().all(|t| dense(t)) {
        return Ok(None);
    }
    let b = backend::get("fused_global_norm", device)?;
    with_views(xs, |v| b.global_norm(v))
}

/// sum((scale x)^2 w) over every element of `xs`, w the matching element of `weights[i]` (f32,
/// `xs[i]`'s length) or 1: the gradient norm of a training step in one pass, by the device
/// backend's fused kernel (CUDA: every gradient read once in its dtype, f64 partials in a fixed
/// order, one read back). `Ok(None)` on the CPU, for views that are not contiguous, or where the
/// backend has no such kernel: the caller then composes it from ops.
pub fn fused_sum_squares(xs: &[&Tensor], weights: &[Option<&Tensor>], scale: f64) -> Result<Option<f64>> {
    if xs.len() != weights.len() {
        bail!("fused_sum_squares", "{} tensors but {} weights", xs.len(), weights.len());
    }
    let all: Vec<&Tensor> = xs.iter().copied().chain(weights.iter().flatten().copied()).collect();
    let device = one_device("fused_sum_squares", &all)?;
    let fits = |(x, w): (&&Tensor, &Option<&Tensor>)| {
        x.is_contiguous() && w.is_none_or(|w| w.is_contiguous() && w.dtype() == crate::DType::F32 && w.numel() == x.numel())
    };
    if device == Device::Cpu || xs.is_empty() || !xs.iter().zip(weights).all(fits) {
        return Ok(None);
    }
    let b = backend::get("fused_sum_squares", device)?;
    with_views(&all, |v| {
        let (xv, mut wv) = (&v[..xs.len()], v[xs.len()..].iter());
        let ws: Vec<Option<View>> = weights.iter().map(|w| w.and_then(|_| wv.next().copied())).collect();
        b.sum_squares(xv, &ws, scale)
    })
}
