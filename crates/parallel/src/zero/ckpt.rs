//! The engine's state I/O: sharded checkpoints of a tensor- and data-parallel run. Each rank
//! writes its own shards (no gather through rank 0), an index says how they fit together, and
//! the full model and optimizer state are rebuilt from them for a resume under any other layout
//! (another `--tp`, `--dp` or `ShardSpec`). The full parameters of a save's Hugging Face file
//! come from what the ranks hold ([`full_params`]), not from the shards read back. A child of
//! `zero`, it reads the engine's fields directly; the run's checkpoint policy (when, where,
//! `latest`, pruning, resume) is the facade's.
//!
//! Layout of `DIR/shards/`: `index.json` ([`ShardIndex`]) and `tp{t}-dp{d}.safetensors`, the
//! shards [`shard_tensors`] gives on tensor-parallel rank t, data-parallel rank d: each
//! parameter range once (`param.{bucket}`, ranks d < s_p) and each optimizer range once
//! (`exp_avg.{bucket}`, `exp_avg_sq.{bucket}`, `master.{bucket}`, ranks d < s_os).
use super::{ShardSpec, Zero};
use crate::tp::{Sharding, TpShardings};
use ferrolm_nn::safetensors_io::{load_float_safetensors, save_safetensors, TensorMap};
use ferrolm_tensor::{no_grad, DType, Device, Error, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const SHARDS_DIR: &str = "shards";
pub const INDEX: &str = "index.json";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SlotIndex {
    pub name: String,
    pub offset: usize,
    /// Shape on one tensor-parallel rank.
    pub shape: Vec<usize>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BucketIndex {
    pub name: String,
    pub padded: usize,
    pub slots: Vec<SlotIndex>,
}

/// How a parameter is split over the tensor-parallel ranks (`tp::Sharding` without the rank).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SplitIndex {
    pub dim: Option<usize>,
    pub parts: usize,
    pub replicas: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ShardIndex {
    pub format: String,
    pub tp: usize,
    pub dp: usize,
    pub spec: ShardSpec,
    /// Parameter dtype of the run ("f32", "bf16").
    pub dtype: String,
    /// Buckets on each tensor-parallel rank (the same layout on every rank).
    pub buckets: Vec<BucketIndex>,
    pub tp_layout: BTreeMap<String, SplitIndex>,
}

const FORMAT: &str = "ferrolm-sharded-v1";

fn shard_file(dir: &Path, t: usize, d: usize) -> PathBuf {
    dir.join(SHARDS_DIR).join(format!("tp{t}-dp{d}.safetensors"))
}

fn err(dir: &Path, m: impl std::fmt::Display) -> Error {
    Error::new("sharded checkpoint", format!("{}: {m}", dir.display()))
}

/// This rank's shards, per bucket `i`: `param.{i}` (the parameter range a of s_p) when it writes
/// parameters, and `exp_avg.{i}`, `exp_avg_sq.{i}` (`master.{i}`) (optimizer range j of s_os)
/// when it writes optimizer state. Where the state lived (device or offloaded) does not show.
pub fn shard_tensors(zero: &Zero) -> Result<Vec<(String, Tensor)>> {
    let (wp, wo) = writes(zero);
    let mut out = Vec::new();
    for (i, b) in zero.buckets.iter().enumerate() {
        if wp {
            out.push((format!("param.{i}"), b.param_range.clone()));
        }
        if wo {
            let (master, m, v) = zero.optim_state(i)?;
            out.push((format!("exp_avg.{i}"), m));
            out.push((format!("exp_avg_sq.{i}"), v));
            if let Some(w) = master {
                out.push((format!("master.{i}"), w));
            }
        }
    }
    Ok(out)
}

/// Whether this rank writes its parameter range in a sharded checkpoint (the first block's ranks
/// with b = 0 hold each range once) and its optimizer range (the first block).
fn writes(zero: &Zero) -> (bool, bool) {
    let first_block = zero.groups.pos.block == 0;
    (first_block && zero.groups.pos.sub_index == 0, first_block)
}

/// The full parameters, joined from what the ranks hold, as f32 tensors on the CPU of world rank
/// 0 (None on the other ranks): each bucket's parameter range all-gathered over its parameter
/// group (the bucket itself when s_p = 1), then each tensor-parallel split parameter's pieces
/// all-gathered over the tensor-parallel group and joined along its split dimension. Collective
/// over the world, in the same order on every rank (buckets, then slots); at most one bucket is
/// gathered at a time.
pub fn full_params(zero: &Zero) -> Result<Option<TensorMap>> {
    let _g = no_grad();
    let root = zero.mesh.world().rank() == 0;
    let mut out = TensorMap::new();
    for (i, b) in zero.buckets.iter().enumerate() {
        let flat = if zero.spec.params == 1 { b.param_range.clone() } else { zero.groups.params.all_gather(&b.param_range)? };
        for s in &zero.store.buckets[i].slots {
            let n = s.numel();
            let local = flat.narrow(0, s.offset, n)?;
            let split = zero.tp.as_ref().and_then(|l| l.params.get(&s.name)).filter(|_| zero.mesh.tp() > 1);
            let full = match split.and_then(|sh| sh.dim.map(|d| (d, sh))) {
                Some((dim, sh)) => {
                    // tp ranks' pieces in rank order; part p is on rank p * replicas
                    let all = zero.mesh.tp_group().all_gather(&local.contiguous()?)?;
                    let pieces: Vec<Tensor> =
                        (0..sh.parts).map(|p| all.narrow(0, p * sh.replicas * n, n)?.reshape(s.shape.clone())).collect::<Result<_>>()?;
                    Tensor::cat(&pieces, dim)?
                }
                None => local.reshape(s.shape.clone())?,
            };
            if root {
                out.insert(s.name.clone(), full.to_dtype(DType::F32)?.to_device(Device::Cpu)?);
            }
        }
    }
    Ok(root.then_some(out))
}

/// The parameter an element of one of this rank's shard tensors (`param.{i}`, `exp_avg.{i}`,
/// `exp_avg_sq.{i}`, `master.{i}` at `index`) belongs to, e.g. `exp_avg of
/// model.layers.0.mlp.up_proj.weight`; None for padding or an unknown name.
pub fn shard_element_owner(zero: &Zero, key: &str, index: usize) -> Option<String> {
    let (what, bucket) = key.rsplit_once('.')?;
    let b = zero.store.buckets.get(bucket.parse::<usize>().ok()?)?;
    let (n, pos, spec) = (b.padded, zero.groups.pos, zero.spec);
    let at = match what {
        "param" => pos.param_range * n / spec.params + index,
        _ => pos.optim_range * n / spec.optim + index,
    };
    let slot = b.slots.iter().find(|s| s.offset <= at && at < s.offset + s.numel())?;
    Some(if what == "param" { slot.name.clone() } else { format!("{what} of {}", slot.name) })
}

/// Writes this rank's shards of `zero` into `dir/shards/` (every rank calls it; world rank 0
/// also writes the index) and waits until every rank has written.
pub fn save_shards(dir: &Path, zero: &Zero) -> Result<()> {
    let (mesh, tp) = (&zero.mesh, zero.tp.as_ref());
    let sdir = dir.join(SHARDS_DIR);
    if mesh.world().rank() == 0 {
        std::fs::create_dir_all(&sdir).map_err(|e| err(&sdir, format!("cannot create: {e}")))?;
    }
    mesh.world().barrier()?;
    let tensors = shard_tensors(zero)?;
    let written =
        if tensors.is_empty() { Ok(()) } else { save_safetensors(&shard_file(dir, mesh.tp_rank(), mesh.dp_rank()), &tensors, None) };
    // Every rank learns whether every rank wrote its part before anyone goes on.
    let failed = crate::comm::all_reduce_scalar(mesh.world().as_ref(), if written.is_err() { 1.0 } else { 0.0 }, zero.device())?;
    written?;
    if failed > 0.0 {
        return Err(err(dir, format!("{failed} rank(s) could not write their shards")));
    }
    if mesh.world().rank() == 0 {
        let buckets = zero
            .store
            .buckets
            .iter()
            .map(|b| BucketIndex {
                name: b.name.clone(),
                padded: b.padded,
                slots: b.slots.iter().map(|s| SlotIndex { name: s.name.clone(), offset: s.offset, shape: s.shape.clone() }).collect(),
            })
            .collect();
        let tp_layout = match tp {
            Some(l) => l.params.iter().map(|(n, s)| (n.clone(), SplitIndex { dim: s.dim, parts: s.parts, replicas: s.replicas })).collect(),
            None => BTreeMap::new(),
        };
        let dtype = zero.dtype;
        let index = ShardIndex {
            format: FORMAT.into(),
            tp: mesh.tp(),
            dp: mesh.dp(),
            spec: zero.spec,
            dtype: dtype.to_string(),
            buckets,
            tp_layout,
        };
        let text = serde_json::to_string_pretty(&index).map_err(|e| err(dir, e))?;
        ferrolm_nn::safetensors_io::write_atomic(&sdir.join(INDEX), text.as_bytes())?;
    }
    mesh.world().barrier()
}

/// True when `dir` holds a sharded checkpoint.
pub fn is_sharded(dir: &Path) -> bool {
    dir.join(SHARDS_DIR).join(INDEX).is_file()
}

pub fn read_index(dir: &Path) -> Result<ShardIndex> {
    let p = dir.join(SHARDS_DIR).join(INDEX);
    let text = std::fs::read_to_string(&p).map_err(|e| err(&p, format!("cannot read: {e}")))?;
    let idx: ShardIndex = serde_json::from_str(&text).map_err(|e| err(&p, format!("not a shard index: {e}")))?;
    if idx.format != FORMAT {
        return Err(err(&p, format!("format {:?}, expected {FORMAT:?}", idx.format)));
    }
    if idx.tp == 0 || idx.dp == 0 {
        return Err(err(&p, "tp and dp must be positive"));
    }
    idx.spec.validate(idx.dp, idx.dp).or_else(|_| idx.spec.validate(idx.dp, 1))?;
    for b in &idx.buckets {
        if b.padded % (idx.dp * 8).max(1) != 0 {
            return Err(err(&p, format!("bucket {} of {} elements does not split over {} ranks", b.name, b.padded, idx.dp)));
        }
        for s in &b.slots {
            let n =
                s.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| err(&p, format!("{}: shape overflows", s.name)))?;
            if s.offset.checked_add(n).is_none_or(|e| e > b.padded) {
                return Err(err(&p, format!("{} lies outside its bucket", s.name)));
            }
        }
    }
    Ok(idx)
}

/// The full (unsharded) parameters and AdamW state (`exp_avg.<name>`, `exp_avg_sq.<name>`,
/// `master.<name>`) of a sharded checkpoint, as f32 tensors on the CPU.
pub fn load_full(dir: &Path) -> Result<(TensorMap, TensorMap)> {
    let idx = read_index(dir)?;
    let (sp, so) = (idx.spec.params, idx.spec.optim);
    let k = so / sp;
    let _g = no_grad();
    // Per tensor-parallel rank: name -> its local tensor.
    let mut local: Vec<TensorMap> = Vec::with_capacity(idx.tp);
    for t in 0..idx.tp {
        // Writers are dp ranks 0..s_os (parameters on 0..s_p <= s_os).
        let files: Vec<TensorMap> =
            (0..so).map(|d| load_float_safetensors(&shard_file(dir, t, d), DType::F32, Device::Cpu)).collect::<Result<_>>()?;
        let file = |d: usize| -> Result<&TensorMap> { Ok(&files[d]) };
        let mut named = TensorMap::new();
        for (i, b) in idx.buckets.iter().enumerate() {
            let get = |f: &TensorMap, key: &str, d: usize| -> Result<Tensor> {
                f.get(key).cloned().ok_or_else(|| err(&shard_file(dir, t, d), format!("missing tensor {key}")))
            };
            // Parameter ranges a = 0..s_p live on dp ranks a.
            let params: Vec<Tensor> = (0..sp).map(|a| get(file(a)?, &format!("param.{i}"), a)).collect::<Result<_>>()?;
            // Optimizer range j lives on dp rank b * s_p + a with a = j / k, b = j % k.
            let os = |key: &str| -> Result<Option<Tensor>> {
                let mut parts = Vec::with_capacity(so);
                for j in 0..so {
                    let d = (j % k) * sp + j / k;
                    match file(d)?.get(&format!("{key}.{i}")) {
                        Some(t) => parts.push(t.clone()),
                        None if key == "master" => return Ok(None),
                        None => return Err(err(&shard_file(dir, t, d), format!("missing tensor {key}.{i}"))),
                    }
                }
                Ok(Some(Tensor::cat(&parts, 0)?))
            };
            let flat = Tensor::cat(&params, 0)?;
            let (m, v, master) = (os("exp_avg")?.expect("required"), os("exp_avg_sq")?.expect("required"), os("master")?);
            for (what, full) in [("", Some(&flat)), ("exp_avg.", Some(&m)), ("exp_avg_sq.", Some(&v)), ("master.", master.as_ref())] {
                let Some(full) = full else { continue };
                if full.numel() != b.padded {
                    return Err(err(dir, format!("bucket {}: shards hold {} elements, the index says {}", b.name, full.numel(), b.padded)));
                }
                for s in &b.slots {
                    let n: usize = s.shape.iter().product();
                    named.insert(format!("{what}{}", s.name), full.narrow(0, s.offset, n)?.reshape(s.shape.clone())?.contiguous()?);
                }
            }
        }
        local.push(named);
    }
    // Join the tensor-parallel pieces.
    let mut params = TensorMap::new();
    let mut state = TensorMap::new();
    for key in local[0].keys() {
        let base =
            key.strip_prefix("exp_avg.").or_else(|| key.strip_prefix("exp_avg_sq.")).or_else(|| key.strip_prefix("master.")).unwrap_or(key);
        let full = match idx.tp_layout.get(base) {
            Some(SplitIndex { dim: Some(dim), parts, replicas }) if idx.tp > 1 => {
                let pieces: Vec<Tensor> = (0..*parts)
                    .map(|p| local[p * replicas].get(key).cloned().ok_or_else(|| err(dir, format!("missing {key}"))))
                    .collect::<Result<_>>()?;
                Tensor::cat(&pieces, *dim)?
            }
            _ => local[0][key].clone(),
        };
        if base == key.as_str() {
            params.insert(key.clone(), full);
        } else {
            state.insert(key.clone(), full);
        }
    }
    Ok((params, state))
}

/// This rank's tensor-parallel piece of a full tensor.
pub fn local_piece(full: &Tensor, name: &str, tp: Option<&TpShardings>) -> Result<Tensor> {
    match tp.and_then(|l| l.params.get(name)) {
        Some(s) => s.shard(full),
        None => Ok(full.clone()),
    }
}

/// Loads full parameters and optimizer state (from `load_full`, or a single-device
/// checkpoint's tensors) into this rank's engine, cut for its own layout: per bucket, the full
/// flat buffers of parameters and state are assembled from the named tensors (this rank's
/// tensor-parallel pieces), then each rank keeps its ranges. Padding stays zero. A missing
/// `master.<name>` is taken from the parameter.
pub fn load_into(zero: &mut Zero, params: &TensorMap, state: &TensorMap, step: u64) -> Result<()> {
    let _g = no_grad();
    let (device, dtype) = (zero.device(), zero.dtype);
    let tp = zero.tp.clone();
    let piece = |map: &TensorMap, key: &str, base: &str, dtype: DType| -> Result<Tensor> {
        let t = map.get(key).ok_or_else(|| Error::new("resume", format!("missing tensor {key}")))?;
        local_piece(t, base, tp.as_ref())?.to_dtype(dtype)?.to_device(device)
    };
    // (padded length, slots) of each bucket, copied: the buckets are the engine's being loaded.
    let buckets: Vec<(usize, Vec<ferrolm_nn::buckets::Slot>)> = zero.store.buckets.iter().map(|b| (b.padded, b.slots.clone())).collect();
    for (i, (n, slots)) in buckets.iter().enumerate() {
        let build = |dtype: DType, get: &dyn Fn(&str) -> Result<Tensor>| -> Result<Tensor> {
            let flat = Tensor::zeros([*n], dtype, device)?;
            for s in slots {
                flat.narrow(0, s.offset, s.numel())?.assign(&get(&s.name)?.reshape([s.numel()])?)?;
            }
            Ok(flat)
        };
        let p = build(dtype, &|name| piece(params, name, name, dtype))?;
        let m = build(DType::F32, &|name| piece(state, &format!("exp_avg.{name}"), name, DType::F32))?;
        let v = build(DType::F32, &|name| piece(state, &format!("exp_avg_sq.{name}"), name, DType::F32))?;
        let w = build(DType::F32, &|name| {
            piece(state, &format!("master.{name}"), name, DType::F32).or_else(|_| piece(params, name, name, DType::F32))
        })?;
        load_bucket(zero, i, &p, &w, &m, &v)?;
    }
    // Stale gathered buckets go; the step count is the checkpoint's.
    if let Some(g) = &zero.gather {
        g.release_all(false)?;
    }
    zero.step = step;
    Ok(())
}

/// Sets bucket `i`'s parameter range (from the full bucket) and optimizer state (f32 tensors of
/// the full bucket: master, m, v).
fn load_bucket(zero: &mut Zero, i: usize, params: &Tensor, master: &Tensor, m: &Tensor, v: &Tensor) -> Result<()> {
    let (sp, so, n) = (zero.spec.params, zero.spec.optim, zero.buckets[i].numel);
    let pos = zero.groups.pos;
    zero.buckets[i].param_range.assign(&params.narrow(0, pos.param_range * n / sp, n / sp)?)?;
    let r = |t: &Tensor| t.narrow(0, pos.optim_range * n / so, n / so)?.contiguous();
    zero.state().load(i, &r(master)?, &r(m)?, &r(v)?)
}

/// Splits a parameter of the given full shape the way `sharding` does (for tests and tools).
pub fn split_shape(full: &[usize], s: &Sharding) -> Vec<usize> {
    let mut out = full.to_vec();
    if let Some(d) = s.dim {
        out[d] /= s.parts;
    }
    out
}
