//! Checkpoints that transformers saved 4-bit with bitsandbytes (`load_in_4bit`, then
//! `save_pretrained`): `config.json` carries `quantization_config` (`quant_method:
//! "bitsandbytes"`, `bnb_4bit_quant_type`, `bnb_4bit_use_double_quant`), and every quantized
//! linear weight `W` is stored as
//!
//! | tensor | dtype | what |
//! |---|---|---|
//! | `W` | uint8, (ceil(n / 2), 1) | the packed codes |
//! | `W.absmax` | uint8 (double quant) or f32 | one per block |
//! | `W.quant_map` | f32 (16) | the code book |
//! | `W.nested_absmax` | f32 | one scale per 256 absmax codes (double quant) |
//! | `W.nested_quant_map` | f32 (256) | the dynamic map (double quant) |
//! | `W.quant_state.bitsandbytes__nf4` | uint8 | JSON: quant_type, blocksize, dtype, shape, nested_blocksize, nested_dtype, nested_offset |
//!
//! The other tensors (embeddings, norms, the LM head) are stored as floats. `read_bnb4_dir`
//! parses such a directory into `Quant4` weights (crates/ops/src/nf4) and the rest as stored;
//! every error names the tensor (and file) that is wrong. `quantize_dir` makes the same from a
//! bf16 / f32 checkpoint, one tensor at a time (the host never holds the model in 16 bits): from
//! the base bitsandbytes quantized, the same `Quant4` values its checkpoint stores.
use crate::safetensors_io::stored_to_f32;
use crate::safetensors_io::TensorMap;
use crate::safetensors_io::{model_weight_files, visit_stored};
use ferrolm_ops::nf4::{Absmax, NestedAbsmax, OrigDtype, Quant4, QuantSpec, QuantType};
use ferrolm_tensor::{DType, Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// A tensor as a safetensors file stores it (owned).
#[derive(Clone, Debug, PartialEq)]
pub struct RawTensor {
    /// safetensors' dtype name: `U8`, `F32`, `BF16`, ...
    pub dtype: String,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// `quantization_config` of a bitsandbytes 4-bit checkpoint, as far as loading needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Bnb4Config {
    pub quant_type: QuantType,
    pub double_quant: bool,
    /// `bnb_4bit_compute_dtype` (the dtype its GEMMs ran in), e.g. `"bfloat16"`.
    pub compute_dtype: Option<String>,
}

/// A 4-bit checkpoint: the quantized weights by name, and the other tensors as stored.
#[derive(Debug)]
pub struct Bnb4Checkpoint {
    pub config: Bnb4Config,
    pub quantized: BTreeMap<String, Quant4>,
    pub other: BTreeMap<String, RawTensor>,
}

fn err(what: impl std::fmt::Display, msg: impl std::fmt::Display) -> Error {
    Error::new("bnb4", format!("{what}: {msg}"))
}

/// The 4-bit `quantization_config` of a parsed `config.json` (at `path`, for errors): None when
/// there is none; an error for a quantization this reader does not load (8-bit, another
/// method, another storage dtype or an unknown quant type), naming the key.
pub fn bnb4_config(config: &serde_json::Value, path: &Path) -> Result<Option<Bnb4Config>> {
    let Some(q) = config.get("quantization_config") else { return Ok(None) };
    let at = |key: &str| format!("{}: quantization_config.{key}", path.display());
    let method = q.get("quant_method").and_then(|v| v.as_str()).unwrap_or("");
    if method != "bitsandbytes" {
        return Err(err(at("quant_method"), format!("{method:?} is not supported (only bitsandbytes 4-bit checkpoints load)")));
    }
    let flag = |key: &str| q.get(key).and_then(|v| v.as_bool()).unwrap_or(false);
    if flag("load_in_8bit") {
        return Err(err(at("load_in_8bit"), "8-bit bitsandbytes checkpoints are not supported (only load_in_4bit)"));
    }
    if !flag("load_in_4bit") {
        return Err(err(at("load_in_4bit"), "is not true: only 4-bit bitsandbytes checkpoints load"));
    }
    let qt = q.get("bnb_4bit_quant_type").and_then(|v| v.as_str()).unwrap_or("fp4");
    let quant_type = QuantType::parse(qt).map_err(|e| err(at("bnb_4bit_quant_type"), e.msg.clone()))?;
    if let Some(s) = q.get("bnb_4bit_quant_storage").and_then(|v| v.as_str()) {
        if s != "uint8" {
            return Err(err(at("bnb_4bit_quant_storage"), format!("{s:?} is not supported (uint8)")));
        }
    }
    Ok(Some(Bnb4Config {
        quant_type,
        double_quant: flag("bnb_4bit_use_double_quant"),
        compute_dtype: q.get("bnb_4bit_compute_dtype").and_then(|v| v.as_str()).map(str::to_string),
    }))
}

/// The part `suffix` of weight `name` (`name` itself for ""), of dtype `dtype`.
fn part<'a>(parts: &'a BTreeMap<String, RawTensor>, name: &str, suffix: &str, dtype: &str) -> Result<&'a RawTensor> {
    let full = if suffix.is_empty() { name.to_string() } else { format!("{name}.{suffix}") };
    let t = parts.get(&full).ok_or_else(|| err(&full, "missing (a bitsandbytes 4-bit weight stores it beside its quant_state)"))?;
    if t.dtype != dtype {
        return Err(err(&full, format!("stored as {}, expected {dtype}", t.dtype)));
    }
    Ok(t)
}

fn f32s(t: &RawTensor) -> Vec<f32> {
    t.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The quant_state tensor of weight `name`: (its full name, its quant type).
fn quant_state_of<'a>(parts: &'a BTreeMap<String, RawTensor>, name: &str) -> Result<(String, &'a RawTensor)> {
    let prefix = format!("{name}.quant_state.bitsandbytes__");
    let mut found = parts.range(prefix.clone()..).take_while(|(k, _)| k.starts_with(&prefix));
    match (found.next(), found.next()) {
        (Some((k, t)), None) => Ok((k.clone(), t)),
        (None, _) => Err(err(format!("{prefix}nf4"), "missing: the weight has no quant_state")),
        (Some((a, _)), Some((b, _))) => Err(err(name, format!("two quant states ({a}, {b})"))),
    }
}

/// Weight `name` of a bitsandbytes checkpoint from its stored tensors (`parts`: full tensor
/// names, `name` and `name.absmax` ...). Errors name the tensor: a quant_state that is not JSON
/// or lacks a field, an unknown quant type, an absmax or code tensor of the wrong length or
/// dtype, a code book that is not the quant type's.
pub fn quant4_from_parts(name: &str, parts: &BTreeMap<String, RawTensor>) -> Result<Quant4> {
    let (qs_name, qs) = quant_state_of(parts, name)?;
    let suffix = qs_name.rsplit("__").next().unwrap_or("");
    let quant_type = QuantType::parse(suffix).map_err(|e| err(&qs_name, e.msg.clone()))?;
    if qs.dtype != "U8" {
        return Err(err(&qs_name, format!("stored as {}, expected U8 (a JSON blob)", qs.dtype)));
    }
    let state: serde_json::Value = std::str::from_utf8(&qs.data)
        .map_err(|e| e.to_string())
        .and_then(|s| serde_json::from_str(s).map_err(|e| e.to_string()))
        .map_err(|e| err(&qs_name, format!("corrupt quant_state: not the JSON bitsandbytes writes ({e})")))?;
    let field = |key: &str| state.get(key).ok_or_else(|| err(&qs_name, format!("corrupt quant_state: no `{key}`")));
    let uint = |key: &str| -> Result<usize> {
        field(key)?.as_u64().map(|v| v as usize).ok_or_else(|| err(&qs_name, format!("corrupt quant_state: `{key}` is not a count")))
    };
    let text = |key: &str| -> Result<&str> {
        field(key)?.as_str().ok_or_else(|| err(&qs_name, format!("corrupt quant_state: `{key}` is not a string")))
    };
    let stated = text("quant_type")?;
    if stated != quant_type.name() {
        return Err(err(&qs_name, format!("quant_type {stated:?} in a quant state named for {}", quant_type.name())));
    }
    let shape: Vec<usize> = field("shape")?
        .as_array()
        .and_then(|a| a.iter().map(|v| v.as_u64().map(|v| v as usize)).collect())
        .ok_or_else(|| err(&qs_name, "corrupt quant_state: `shape` is not a list of sizes"))?;
    let dtype = OrigDtype::parse(text("dtype")?).map_err(|e| err(&qs_name, e.msg.clone()))?;
    let blocksize = uint("blocksize")?;
    let packed = part(parts, name, "", "U8")?;
    let nested = state.get("nested_offset").is_some();
    let absmax = if nested {
        if text("nested_dtype")? != "float32" {
            return Err(err(&qs_name, format!("nested_dtype {:?} is not supported (float32)", text("nested_dtype")?)));
        }
        let offset =
            field("nested_offset")?.as_f64().ok_or_else(|| err(&qs_name, "corrupt quant_state: `nested_offset` is not a number"))?;
        Absmax::Nested(NestedAbsmax {
            codes: part(parts, name, "absmax", "U8")?.data.clone(),
            absmax: f32s(part(parts, name, "nested_absmax", "F32")?),
            blocksize: uint("nested_blocksize")?,
            offset: offset as f32,
            map: f32s(part(parts, name, "nested_quant_map", "F32")?),
        })
    } else {
        Absmax::Plain(f32s(part(parts, name, "absmax", "F32")?))
    };
    let q = Quant4 { quant_type, shape, dtype, blocksize, packed: packed.data.clone(), absmax };
    q.check(name).map_err(|e| Error::new("bnb4", e.msg.clone()))?;
    q.check_quant_map(name, &f32s(part(parts, name, "quant_map", "F32")?)).map_err(|e| Error::new("bnb4", e.msg.clone()))?;
    Ok(q)
}

/// Reads a model directory saved 4-bit by transformers + bitsandbytes: None when its
/// `config.json` has no `quantization_config` (an ordinary checkpoint). Every tensor with a
/// quant state becomes a `Quant4`; the others are returned as stored.
pub fn read_bnb4_dir(dir: &Path) -> Result<Option<Bnb4Checkpoint>> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| err(cfg_path.display(), e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(cfg_path.display(), e))?;
    let Some(config) = bnb4_config(&json, &cfg_path)? else { return Ok(None) };
    let mut parts = BTreeMap::new();
    for file in model_weight_files(dir)? {
        visit_stored(&file, &mut |s| {
            let t = RawTensor { dtype: s.dtype.to_string(), shape: s.shape.to_vec(), data: s.data.to_vec() };
            parts.insert(s.name.to_string(), t);
            Ok(())
        })?;
    }
    let names: Vec<String> = parts.keys().filter_map(|k| k.split_once(".quant_state.").map(|(w, _)| w.to_string())).collect();
    let mut quantized = BTreeMap::new();
    for name in names {
        let q = quant4_from_parts(&name, &parts).map_err(|e| err(dir.display(), e.msg.clone()))?;
        quantized.insert(name, q);
    }
    let owned = |k: &str| quantized.keys().any(|w: &String| k == w || k.strip_prefix(w.as_str()).is_some_and(|rest| rest.starts_with('.')));
    let other = parts.into_iter().filter(|(k, _)| !owned(k)).collect();
    Ok(Some(Bnb4Checkpoint { config, quantized, other }))
}

/// The linear weights transformers' bitsandbytes integration quantizes in a Llama-family
/// checkpoint: every `model.layers.*_proj.weight` (attention and MLP projections). Embeddings,
/// norms and the LM head stay in their dtype, as bitsandbytes and PEFT leave them by default.
pub fn is_base_linear(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2 && name.starts_with("model.layers.") && name.ends_with("_proj.weight")
}

/// Quantizes the weights of a bf16 / f16 / f32 model directory that `select` picks (by name and
/// shape; `is_base_linear` for a Llama-family base) as bitsandbytes' `quantize_4bit` would with
/// `spec`, one tensor at a time from the memory-mapped files; the other tensors are returned as
/// stored. Errors name the file and tensor.
pub fn quantize_dir(dir: &Path, spec: QuantSpec, select: &dyn Fn(&str, &[usize]) -> bool) -> Result<Bnb4Checkpoint> {
    let mut quantized = BTreeMap::new();
    let mut other = BTreeMap::new();
    for file in model_weight_files(dir)? {
        visit_stored(&file, &mut |s| {
            if !select(s.name, s.shape) {
                let t = RawTensor { dtype: s.dtype.to_string(), shape: s.shape.to_vec(), data: s.data.to_vec() };
                other.insert(s.name.to_string(), t);
                return Ok(());
            }
            let at = format!("{}: tensor `{}`", file.display(), s.name);
            let dtype = match s.dtype {
                "F32" => OrigDtype::F32,
                "BF16" => OrigDtype::BF16,
                "F16" => OrigDtype::F16,
                d => return Err(err(&at, format!("stored as {d}; only F32, BF16 and F16 weights quantize"))),
            };
            let values = stored_to_f32(s.dtype, s.data).map_err(|e| err(&at, e))?;
            let q = Quant4::quantize(s.name, &values, s.shape, dtype, spec).map_err(|e| err(&at, e.msg))?;
            quantized.insert(s.name.to_string(), q);
            Ok(())
        })?;
    }
    let config = Bnb4Config { quant_type: spec.quant_type, double_quant: spec.double_quant, compute_dtype: None };
    Ok(Bnb4Checkpoint { config, quantized, other })
}

impl Bnb4Checkpoint {
    /// Every tensor as a `dtype` tensor on `device`: the 4-bit weights dequantized (their f32
    /// products, rounded once to `dtype`), the others converted from their stored dtype. What a
    /// frozen 4-bit base computes with, for a model built by `Llama::from_tensors`.
    pub fn dequantized(&self, dtype: DType, device: Device) -> Result<TensorMap> {
        let mut out = TensorMap::new();
        for (name, q) in &self.quantized {
            out.insert(name.clone(), Tensor::from_vec(q.dequantize_f32(), q.shape.clone(), device)?.to_dtype(dtype)?);
        }
        for (name, t) in &self.other {
            let v = stored_to_f32(&t.dtype, &t.data).map_err(|e| err(format!("tensor `{name}`"), e))?;
            out.insert(name.clone(), Tensor::from_vec(v, t.shape.clone(), device)?.to_dtype(dtype)?);
        }
        Ok(out)
    }
}
