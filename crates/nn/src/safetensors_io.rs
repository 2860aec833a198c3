//! safetensors files as name -> `Tensor` maps: memory-mapped reads (one file, or the shards of a
//! `model.safetensors.index.json`) with dtype conversion, and atomic writes (temp file, fsync,
//! rename), so a crash mid-save never leaves a truncated checkpoint under the real name.
use ferrolm_tensor::{bf16, CpuStorage, DType, Device, Error, Result, Shape, Tensor};
use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

pub type TensorMap = BTreeMap<String, Tensor>;

fn io_err(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::new("checkpoint", format!("{}: {what}: {e}", path.display()))
}

/// Writes to `<path>.tmp.<pid>` through `write`, fsyncs, then renames over `path`.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = path.file_name().ok_or_else(|| io_err(path, "write", "not a file path"))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(".tmp.{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let res = write(&tmp).and_then(|()| {
        std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| io_err(&tmp, "fsync", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_err(path, "rename into place", e))
    });
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Atomically replaces `path` with `bytes`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| {
        let mut f = std::fs::File::create(tmp).map_err(|e| io_err(tmp, "create", e))?;
        f.write_all(bytes).map_err(|e| io_err(tmp, "write", e))
    })
}

/// Decodes little-endian elements of `src` into the storage of `dtype` (floats convert, integer
/// tensors become i32).
fn decode(data: &[u8], src: StDtype, dtype: DType) -> std::result::Result<CpuStorage, String> {
    fn le<const N: usize, T>(d: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        d.chunks_exact(N).map(|c| f(c.try_into().expect("chunk of N bytes"))).collect()
    }
    let as_f32 = |d: &[u8]| -> Option<Vec<f32>> {
        Some(match src {
            StDtype::F32 => le(d, f32::from_le_bytes),
            StDtype::BF16 => le(d, |b| bf16::from_le_bytes(b).to_f32()),
            StDtype::F16 => le(d, |b| half::f16::from_le_bytes(b).to_f32()),
            StDtype::F64 => le(d, |b| f64::from_le_bytes(b) as f32),
            _ => return None,
        })
    };
    let int = |d: &[u8]| -> std::result::Result<Vec<i32>, String> {
        let wide: Vec<i64> = match src {
            StDtype::I64 => le(d, i64::from_le_bytes),
            StDtype::I32 => le(d, |b| i32::from_le_bytes(b) as i64),
            _ => return Err(format!("unsupported dtype {src:?}")),
        };
        wide.into_iter().map(|v| i32::try_from(v).map_err(|_| format!("integer {v} does not fit i32"))).collect()
    };
    let float_src = matches!(src, StDtype::F32 | StDtype::BF16 | StDtype::F16 | StDtype::F64);
    if !float_src {
        return int(data).map(CpuStorage::I32);
    }
    Ok(match dtype {
        DType::F64 if src == StDtype::F64 => CpuStorage::F64(le(data, f64::from_le_bytes)),
        DType::F64 => CpuStorage::F64(as_f32(data).expect("float").into_iter().map(f64::from).collect()),
        DType::F32 => CpuStorage::F32(as_f32(data).expect("float")),
        DType::BF16 if src == StDtype::BF16 => CpuStorage::BF16(le(data, bf16::from_le_bytes)),
        DType::BF16 => CpuStorage::BF16(as_f32(data).expect("float").into_iter().map(bf16::from_f32).collect()),
        DType::I32 => return Err(format!("float tensor ({src:?}) cannot load as i32")),
    })
}

/// The dtypes a model weight may be stored as.
fn is_float(d: StDtype) -> bool {
    matches!(d, StDtype::F32 | StDtype::BF16 | StDtype::F16 | StDtype::F64)
}

/// A shape whose strides are computable: the product of its non-zero dims fits `isize` (the
/// safetensors crate checks the element count, which is 0 as soon as one dim is, while
/// row-major strides multiply the dims after each one).
fn check_shape(shape: &[usize]) -> std::result::Result<(), String> {
    let fits = shape.iter().filter(|&&d| d != 0).try_fold(1usize, |acc, &d| acc.checked_mul(d).filter(|&p| p <= isize::MAX as usize));
    match fits {
        Some(_) => Ok(()),
        None => Err(format!("shape {shape:?} is too large to address")),
    }
}

/// Reads every tensor of one safetensors file. Float tensors become `dtype`; integer tensors
/// (token ids in reference files) become i32. `keep` filters names before any decoding.
pub fn load_safetensors_filtered(path: &Path, dtype: DType, device: Device, keep: &dyn Fn(&str) -> bool) -> Result<TensorMap> {
    load_filtered(path, dtype, device, keep, false)
}

/// As [`load_safetensors_filtered`], for model weights and optimizer state: a tensor stored
/// as an integer (or any non-float) dtype is an error naming the file and the tensor.
pub fn load_float_safetensors_filtered(path: &Path, dtype: DType, device: Device, keep: &dyn Fn(&str) -> bool) -> Result<TensorMap> {
    load_filtered(path, dtype, device, keep, true)
}

fn load_filtered(path: &Path, dtype: DType, device: Device, keep: &dyn Fn(&str) -> bool, floats_only: bool) -> Result<TensorMap> {
    let file = std::fs::File::open(path).map_err(|e| io_err(path, "cannot open", e))?;
    // SAFETY: memmap2 requires that the file is not modified or truncated while mapped.
    // ferrolm never writes a checkpoint file in place (write_atomic: temp file + rename, which
    // leaves a mapped inode untouched); a truncation by another process is outside what we can
    // check (it raises SIGBUS, as for any mapped file). Every read below is a bounds-checked
    // slice of the mapping, whose offsets the safetensors crate validated against its length.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err(path, "cannot memory-map", e))?;
    let st = SafeTensors::deserialize(&mmap).map_err(|e| io_err(path, "not a valid safetensors file", format!("{e:?}")))?;
    let mut out = TensorMap::new();
    for (name, view) in st.tensors() {
        if !keep(&name) {
            continue;
        }
        let what = format!("tensor `{name}`");
        if floats_only && !is_float(view.dtype()) {
            return Err(io_err(
                path,
                &what,
                format!("stored as {:?}, but a model weight must be a float type (F32, BF16, F16 or F64)", view.dtype()),
            ));
        }
        check_shape(view.shape()).map_err(|e| io_err(path, &what, e))?;
        let storage = decode(view.data(), view.dtype(), dtype).map_err(|e| io_err(path, &what, e))?;
        let t = Tensor::from_cpu_storage(storage, Shape::from(view.shape().to_vec()), device).map_err(|e| io_err(path, &what, e))?;
        out.insert(name, t);
    }
    Ok(out)
}

pub fn load_safetensors(path: &Path, dtype: DType, device: Device) -> Result<TensorMap> {
    load_safetensors_filtered(path, dtype, device, &|_| true)
}

/// Every tensor of one safetensors file, which must all be floats (model weights, optimizer
/// state); see [`load_float_safetensors_filtered`].
pub fn load_float_safetensors(path: &Path, dtype: DType, device: Device) -> Result<TensorMap> {
    load_float_safetensors_filtered(path, dtype, device, &|_| true)
}

/// The `weight_map` of a sharded checkpoint's index: tensor name -> shard file name.
pub fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, "cannot read", e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| io_err(path, "invalid JSON", e))?;
    let map =
        v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| io_err(path, "field `weight_map`", "missing or not an object"))?;
    map.iter()
        .map(|(k, v)| {
            let shard = v.as_str().ok_or_else(|| io_err(path, &format!("weight_map[`{k}`]"), "not a file name"))?;
            let plain = matches!(Path::new(shard).components().collect::<Vec<_>>()[..], [std::path::Component::Normal(_)]);
            if !plain || shard.contains('\\') {
                return Err(io_err(path, &format!("weight_map[`{k}`]"), format!("shard {shard:?} is not a plain file name")));
            }
            Ok((k.clone(), shard.to_string()))
        })
        .collect()
}

/// The dtype the weights of a Hugging Face model directory are stored in, as `config.json` spells
/// it (`"float32"`, `"bfloat16"`, `"float16"`, `"float64"`): read from the safetensors headers of
/// `model.safetensors`, or of the shards `model.safetensors.index.json` names. `None` when the
/// float tensors do not share one dtype or there are none.
pub fn stored_float_dtype(dir: &Path) -> Result<Option<&'static str>> {
    let single = dir.join("model.safetensors");
    let files: Vec<PathBuf> = if single.is_file() {
        vec![single]
    } else {
        let index = dir.join("model.safetensors.index.json");
        let mut shards: Vec<String> = read_index(&index)?.into_values().collect();
        shards.sort();
        shards.dedup();
        shards.into_iter().map(|s| dir.join(s)).collect()
    };
    let mut found: Option<StDtype> = None;
    for path in files {
        let file = std::fs::File::open(&path).map_err(|e| io_err(&path, "cannot open", e))?;
        // SAFETY: as in `load_filtered`: only the header is read, through bounds-checked slices.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err(&path, "cannot memory-map", e))?;
        let (_, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| io_err(&path, "not a valid safetensors file", format!("{e:?}")))?;
        for info in meta.tensors().values().filter(|i| is_float(i.dtype)) {
            match found {
                Some(d) if d != info.dtype => return Ok(None),
                _ => found = Some(info.dtype),
            }
        }
    }
    Ok(found.map(|d| match d {
        StDtype::BF16 => "bfloat16",
        StDtype::F16 => "float16",
        StDtype::F64 => "float64",
        _ => "float32",
    }))
}

/// The weights of a Hugging Face model directory: `model.safetensors`, or the shards named by
/// `model.safetensors.index.json` (every tensor must be in the shard the index names). Weights
/// must be stored as floats; `dtype` must be a float type.
pub fn load_model_dir(dir: &Path, dtype: DType, device: Device) -> Result<TensorMap> {
    if !dtype.is_float() {
        return Err(Error::new("checkpoint", format!("{}: model weights cannot load as {dtype}", dir.display())));
    }
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if single.is_file() {
        return load_float_safetensors(&single, dtype, device);
    }
    if !index.is_file() {
        return Err(Error::new(
            "checkpoint",
            format!("{}: neither model.safetensors nor model.safetensors.index.json found", dir.display()),
        ));
    }
    let map = read_index(&index)?;
    let mut by_shard: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (name, shard) in &map {
        by_shard.entry(shard).or_default().push(name);
    }
    let mut out = TensorMap::new();
    for (shard, names) in by_shard {
        let path = dir.join(shard);
        let got = load_float_safetensors_filtered(&path, dtype, device, &|n| names.binary_search(&n).is_ok())?;
        if let Some(missing) = names.iter().find(|n| !got.contains_key(**n)) {
            return Err(io_err(&path, &format!("tensor `{missing}`"), format!("listed in {} but not in this shard", index.display())));
        }
        out.extend(got);
    }
    Ok(out)
}

fn st_dtype(d: DType) -> Result<StDtype> {
    Ok(match d {
        DType::F32 => StDtype::F32,
        DType::BF16 => StDtype::BF16,
        DType::F64 => StDtype::F64,
        DType::I32 => StDtype::I32,
    })
}

fn to_le_bytes(t: &Tensor) -> Result<Vec<u8>> {
    Ok(match t.to_cpu_storage()? {
        CpuStorage::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuStorage::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuStorage::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuStorage::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    })
}

/// Writes `tensors` to `path` atomically, float tensors stored as `dtype` (None: as they are),
/// with the metadata `{"format": "pt"}` that transformers expects.
pub fn save_safetensors(path: &Path, tensors: &[(String, Tensor)], dtype: Option<DType>) -> Result<()> {
    let _g = ferrolm_tensor::no_grad();
    let mut bufs: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let t = match dtype {
            Some(d) if t.dtype().is_float() => t.to_dtype(d)?,
            _ => t.clone(),
        };
        bufs.push((name.clone(), st_dtype(t.dtype())?, t.dims().to_vec(), to_le_bytes(&t)?));
    }
    let views = bufs
        .iter()
        .map(|(n, d, s, b)| {
            Ok((n.as_str(), TensorView::new(*d, s.clone(), b).map_err(|e| io_err(path, &format!("tensor `{n}`"), format!("{e:?}")))?))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    write_atomic_with(path, |tmp| {
        safetensors::serialize_to_file(views, &meta, tmp).map_err(|e| io_err(tmp, "write safetensors", format!("{e:?}")))
    })
}

/// `dir/name`, creating `dir` when needed.
pub fn prepare_dir(dir: &Path, name: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, "cannot create directory", e))?;
    Ok(dir.join(name))
}

/// The weight files of a Hugging Face model directory: `model.safetensors`, or the distinct
/// shards `model.safetensors.index.json` names (sorted). The error names the directory.
pub fn model_weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(Error::new(
            "checkpoint",
            format!("{}: neither model.safetensors nor model.safetensors.index.json found", dir.display()),
        ));
    }
    let mut shards: Vec<String> = read_index(&index)?.into_values().collect();
    shards.sort();
    shards.dedup();
    Ok(shards.into_iter().map(|s| dir.join(s)).collect())
}

/// A tensor as a safetensors file stores it: its dtype (safetensors' name: `F32`, `BF16`, ...),
/// shape and little-endian bytes.
pub struct Stored<'a> {
    pub name: &'a str,
    pub dtype: &'a str,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let file = std::fs::File::open(path).map_err(|e| io_err(path, "cannot open", e))?;
    // SAFETY: as in `load_filtered`: ferrolm never writes a file it maps in place, and every
    // read is a slice the safetensors crate checked against the mapping's length.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err(path, "cannot memory-map", e))
}

/// Calls `f` on every tensor of the safetensors file `path` as stored (no conversion), in the
/// order of their names.
pub fn visit_stored(path: &Path, f: &mut dyn FnMut(&Stored) -> Result<()>) -> Result<()> {
    let mmap = map_file(path)?;
    let st = SafeTensors::deserialize(&mmap).map_err(|e| io_err(path, "not a valid safetensors file", format!("{e:?}")))?;
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, view) in &tensors {
        let dtype = format!("{:?}", view.dtype());
        f(&Stored { name, dtype: &dtype, shape: view.shape(), data: view.data() })?;
    }
    Ok(())
}

/// Writes `dst` (atomically) as a copy of the safetensors file `src` (the same tensors, names,
/// dtypes, shapes and `__metadata__`) whose tensor bytes are what `replace` returns for them
/// (None: as stored). A replacement must hold the stored dtype and shape.
pub fn rewrite_stored(src: &Path, dst: &Path, replace: &mut dyn FnMut(&Stored) -> Result<Option<Vec<u8>>>) -> Result<()> {
    let mmap = map_file(src)?;
    let (_, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| io_err(src, "not a valid safetensors file", format!("{e:?}")))?;
    let st = SafeTensors::deserialize(&mmap).map_err(|e| io_err(src, "not a valid safetensors file", format!("{e:?}")))?;
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut new: Vec<Option<Vec<u8>>> = Vec::with_capacity(tensors.len());
    for (name, view) in &tensors {
        let dtype = format!("{:?}", view.dtype());
        let r = replace(&Stored { name, dtype: &dtype, shape: view.shape(), data: view.data() })?;
        if let Some(bytes) = &r {
            if bytes.len() != view.data().len() {
                return Err(io_err(dst, &format!("tensor `{name}`"), format!("{} bytes replace {}", bytes.len(), view.data().len())));
            }
        }
        new.push(r);
    }
    let views = tensors
        .iter()
        .zip(&new)
        .map(|((name, view), r)| {
            let data = r.as_deref().unwrap_or(view.data());
            let v = TensorView::new(view.dtype(), view.shape().to_vec(), data)
                .map_err(|e| io_err(dst, &format!("tensor `{name}`"), format!("{e:?}")))?;
            Ok((name.as_str(), v))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = meta.metadata().clone();
    write_atomic_with(dst, |tmp| {
        safetensors::serialize_to_file(views, &meta, tmp).map_err(|e| io_err(tmp, "write safetensors", format!("{e:?}")))
    })
}

/// Stored float bytes of dtype `dtype` (`F32`, `BF16`, `F16`) as f32 values (exact).
pub fn stored_to_f32(dtype: &str, data: &[u8]) -> std::result::Result<Vec<f32>, String> {
    let src = match dtype {
        "F32" => StDtype::F32,
        "BF16" => StDtype::BF16,
        "F16" => StDtype::F16,
        other => return Err(format!("stored as {other}; only F32, BF16 and F16 weights are read here")),
    };
    match decode(data, src, DType::F32)? {
        CpuStorage::F32(v) => Ok(v),
        _ => Err("not decoded as f32".into()),
    }
}

/// f32 values as stored bytes of dtype `dtype` (`F32`, `BF16`, `F16`), each rounded once to
/// the nearest value of that dtype.
pub fn f32_to_stored(dtype: &str, v: &[f32]) -> std::result::Result<Vec<u8>, String> {
    Ok(match dtype {
        "F32" => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        "BF16" => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
        "F16" => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        other => return Err(format!("cannot store as {other}; only F32, BF16 and F16 weights are written here")),
    })
}
