//! Entry points for the optional fused optimizer kernels of a backend (`Backend::adamw_step`,
//! `Backend::global_norm`): they take the storages of many tensors at once, so the read guards
//! are taken here, once per distinct storage (two views of one storage would otherwise lock it
//! twice on one thread).
use crate::backend::{self, AdamWHyper, AdamWSlot, Sl};
use crate::storage::StorageCell;
use crate::{bail, Device, Result, Storage, Tensor};
use std::sync::{Arc, RwLockReadGuard};

/// One parameter's tensors for `fused_adamw_step` (see `backend::AdamWSlot`).
pub struct AdamWTensors<'a> {
    pub param: &'a Tensor,
    pub grad: &'a Tensor,
    pub master: Option<&'a Tensor>,
    pub m: &'a Tensor,
    pub v: &'a Tensor,
    pub weight_decay: f64,
}

fn dense(t: &Tensor) -> bool {
    let l = t.layout();
    l.is_contiguous() && l.offset == 0 && t.0.storage.bytes() == t.numel() * t.dtype().size_in_bytes()
}

/// Read guards over the storages of `ts`, one per distinct storage; `f` gets their views in
/// the order of `ts`.
pub(crate) fn with_views<R>(ts: &[&Tensor], f: impl FnOnce(&[Sl]) -> Result<R>) -> Result<R> {
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
    let views: Vec<Sl> = ts.iter().zip(&idx).map(|(t, &i)| (&*guards[i], t.layout())).collect();
    f(&views)
}

fn one_device(op: &str, ts: &[&Tensor]) -> Result<Device> {
    let d = ts.first().map_or(Device::Cpu, |t| t.device());
    if let Some(t) = ts.iter().find(|t| t.device() != d) {
        bail!(op, "tensors on {d} and {}", t.device());
    }
    Ok(d)
}

/// The CPU's fused AdamW (`cpu_adam`): f32 state, f32 gradients, the parameter f32 (updated
/// in place) or bf16 with an f32 master. `Ok(false)` when a slot is not of that form.
fn cpu_adamw_step(slots: &[AdamWTensors], h: AdamWHyper) -> Result<bool> {
    use crate::CpuStorage;
    let f32_dense = |t: &Tensor| t.dtype() == crate::DType::F32 && dense(t);
    let ok = slots.iter().all(|s| {
        f32_dense(s.grad)
            && f32_dense(s.m)
            && f32_dense(s.v)
            && match s.master {
                None => f32_dense(s.param),
                Some(m) => f32_dense(m) && s.param.dtype() == crate::DType::BF16 && dense(s.param),
            }
    });
    // Aliased state is left to the op-based update. Checked for every slot before any is
    // updated: `Ok(false)` promises that nothing changed.
    let aliased = slots.iter().any(|s| {
        let distinct = [s.param, s.m, s.v, s.grad].iter().chain(s.master.iter()).map(|t| Arc::as_ptr(&t.0.storage)).collect::<Vec<_>>();
        (1..distinct.len()).any(|i| distinct[..i].contains(&distinct[i]))
    });
    if slots.is_empty() || !ok || aliased {
        return Ok(false);
    }
    let mismatch = || crate::Error::new("fused_adamw_step", "a storage does not match its dtype");
    for s in slots {
        // On the CPU an f32 tensor's storage is `CpuStorage::F32` (and bf16's `BF16`), so the
        // matches below cannot fail after the checks above.
        let g = s.grad.0.storage.read()?;
        let (mut m, mut v) = (s.m.0.storage.write()?, s.v.0.storage.write()?);
        let (Storage::Cpu(CpuStorage::F32(g)), Storage::Cpu(CpuStorage::F32(m)), Storage::Cpu(CpuStorage::F32(v))) =
            (&*g, &mut *m, &mut *v)
        else {
            return Err(mismatch());
        };
        match s.master {
            None => {
                let mut p = s.param.0.storage.write()?;
                let Storage::Cpu(CpuStorage::F32(p)) = &mut *p else { return Err(mismatch()) };
                crate::cpu_adam::adamw_step(p, m, v, g, None, &h, s.weight_decay)?;
            }
            Some(master) => {
                let (mut w, mut p) = (master.0.storage.write()?, s.param.0.storage.write()?);
                let (Storage::Cpu(CpuStorage::F32(w)), Storage::Cpu(CpuStorage::BF16(p))) = (&mut *w, &mut *p) else {
                    return Err(mismatch());
                };
                crate::cpu_adam::adamw_step(w, m, v, g, Some(p), &h, s.weight_decay)?;
            }
        }
    }
    Ok(true)
}

/// Runs the backend's fused AdamW over `slots` if it has one and every tensor is dense;
/// `Ok(false)` means nothing was changed and the caller must run the op-based update.
pub fn fused_adamw_step(slots: &[AdamWTensors], h: AdamWHyper) -> Result<bool> {
    let mut all: Vec<&Tensor> = Vec::with_capacity(slots.len() * 5);
    for s in slots {
        all.extend([s.param, s.grad, s.m, s.v]);
        all.extend(s.master);
    }
    let device = one_device("fused_adamw_step", &all)?;
    if device == Device::Cpu {
        return cpu_adamw_step(slots, h);
    }
    if all.is_empty() || !all.iter().all(|t| dense(t)) {
        return Ok(false);
    }
    let b = backend::get("fused_adamw_step", device)?;
    with_views(&all, |v| {
        let mut at = 0;
        let mut out = Vec::with_capacity(slots.len());
        for s in slots {
            let master = s.master.map(|_| v[at + 4]);
            out.push(AdamWSlot { param: v[at], grad: v[at + 1], m: v[at + 2], v: v[at + 3], master, weight_decay: s.weight_decay });
            at += 4 + s.master.is_some() as usize;
        }
        b.adamw_step(&out, h)
    })
}

/// sqrt(sum of squares) over every element of `xs` by the backend's fused kernel, if it has
/// one and every tensor is dense; `Ok(None)` otherwise.
pub fn fused_global_norm(xs: &[&Tensor]) -> Result<Option<f64>> {
    let device = one_device("fused_global_norm", xs)?;
    if xs.is_empty() || device == Device::Cpu || !xs.iter().all(|t| dense(t)) {
        return Ok(None);
    }
    let b = backend::get("fused_global_norm", device)?;
    with_views(xs, |v| b.global_norm(v))
}

/// One AdamW update over flat 1-D ranges on the CPU (`cpu_adam`): `param` (a contiguous view,
/// f32, or bf16 with the f32 `master`), dense f32 `grad`, `m`, `v` of the same length, and
/// `segments` (start, len, weight decay) covering the elements to update. `Ok(false)` when the
/// tensors are not of that form (the caller runs the op-based update).
pub fn fused_adamw_ranges(
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    master: Option<&Tensor>,
    segments: &[(usize, usize, f64)],
    h: AdamWHyper,
) -> Result<bool> {
    use crate::{CpuStorage, DType};
    let n = param.numel();
    let f32_dense = |t: &Tensor| t.device() == Device::Cpu && t.dtype() == DType::F32 && t.numel() == n && dense(t);
    let param_ok = param.device() == Device::Cpu
        && param.rank() == 1
        && param.is_contiguous()
        && match master {
            None => param.dtype() == DType::F32,
            Some(w) => param.dtype() == DType::BF16 && f32_dense(w),
        };
    if !(param_ok && f32_dense(grad) && f32_dense(m) && f32_dense(v)) || segments.iter().any(|&(s, l, _)| s + l > n) {
        return Ok(false);
    }
    let cells: Vec<*const crate::storage::StorageCell> =
        [param, grad, m, v].iter().chain(master.iter()).map(|t| Arc::as_ptr(&t.0.storage)).collect();
    if (1..cells.len()).any(|i| cells[..i].contains(&cells[i])) {
        return Ok(false);
    }
    let off = param.layout().offset;
    let g = grad.0.storage.read()?;
    let (mut ms, mut vs, mut ps) = (m.0.storage.write()?, v.0.storage.write()?, param.0.storage.write()?);
    let mut ws = match master {
        Some(w) => Some(w.0.storage.write()?),
        None => None,
    };
    let (Storage::Cpu(CpuStorage::F32(g)), Storage::Cpu(CpuStorage::F32(m)), Storage::Cpu(CpuStorage::F32(v))) = (&*g, &mut *ms, &mut *vs)
    else {
        return Ok(false);
    };
    for &(s, l, wd) in segments {
        let (g, m, v) = (&g[s..s + l], &mut m[s..s + l], &mut v[s..s + l]);
        match (&mut *ps, ws.as_deref_mut()) {
            (Storage::Cpu(CpuStorage::F32(p)), None) => crate::cpu_adam::adamw_step(&mut p[off + s..off + s + l], m, v, g, None, &h, wd)?,
            (Storage::Cpu(CpuStorage::BF16(p)), Some(Storage::Cpu(CpuStorage::F32(w)))) => {
                crate::cpu_adam::adamw_step(&mut w[s..s + l], m, v, g, Some(&mut p[off + s..off + s + l]), &h, wd)?
            }
            _ => return Ok(false),
        }
    }
    Ok(true)
}
