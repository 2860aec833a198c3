//! QLoRA's base: a model whose linear layers hold their weights 4-bit (NF4 or FP4, double
//! quantization: crates/ops/src/nf4) and apply them through `QuantOp` (crate::quant_linear),
//! which dequantizes each weight just before its GEMM. The linear layers are those of the
//! parameter spec (`LlamaConfig::linear_specs`: every layer LoRA may target, q/k/v/o and
//! gate/up/down); the embeddings, the norms, the biases and the LM head stay in the model's
//! dtype, as bitsandbytes and PEFT leave them by default.
//!
//! A quantized layer's `Linear::weight` is a placeholder: one element broadcast to (out, in)
//! (shapes, adapters and parameter counts read it; nothing reads its values), frozen, so the
//! 16-bit copy is never made: it has no gradient, no optimizer state, and is in no bucket.
//!
//! Two ways in: [`Llama::from_pretrained_quantized`] quantizes a bf16 / f16 / f32 checkpoint on
//! load, one tensor at a time from the memory-mapped files (`bnb4::quantize_dir`: the host
//! never holds the model in 16 bits), as bitsandbytes' `quantize_4bit` would; and
//! `Llama::from_pretrained` reads a checkpoint that transformers saved 4-bit
//! (`bnb4::read_bnb4_dir`) as such, with no flag. [`Llama::dequantize_base`] turns the base
//! back into dense weights (what `--merge-lora` folds the adapter into).
use crate::bnb4::{quantize_dir, read_bnb4_dir, Bnb4Checkpoint};
use crate::llama::Llama;
use crate::module::Dense;
use crate::quant_linear::{QuantLinear, QuantOp};
use crate::safetensors_io::{stored_to_f32, TensorMap};
use crate::LlamaConfig;
use ferrolm_ops::nf4::{Absmax, NestedAbsmax, OrigDtype, Quant4, QuantSpec, QuantType};
use ferrolm_tensor::{no_grad, DType, Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// Where a model's 4-bit weights came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantSource {
    /// Quantized on load from a float checkpoint (`--quantize-base`).
    OnLoad,
    /// Read from a checkpoint that transformers saved 4-bit.
    Checkpoint,
}

/// What a model's quantized base is.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantBase {
    pub quant_type: QuantType,
    pub double_quant: bool,
    pub source: QuantSource,
    /// How many linear weights are 4-bit, their elements, and the bytes they take (codes,
    /// absmax, nested statistics).
    pub weights: usize,
    pub params: usize,
    pub bytes: usize,
    /// The dtype the weights had before quantization (bitsandbytes' quant_state `dtype`): what
    /// a merged model is saved in.
    pub orig_dtype: OrigDtype,
}

impl QuantBase {
    /// Bits a quantized parameter takes (4.127 for NF4 with double quantization).
    pub fn bits_per_param(&self) -> f64 {
        8.0 * self.bytes as f64 / self.params.max(1) as f64
    }

    /// The log line: what is 4-bit, from where, and what stays in `dtype`.
    pub fn describe(&self, dtype: DType) -> String {
        let from = match self.source {
            QuantSource::OnLoad => format!("quantized on load from {} weights", self.orig_dtype.name()),
            QuantSource::Checkpoint => "read from a checkpoint saved 4-bit by transformers + bitsandbytes".to_string(),
        };
        format!(
            "QLoRA base: {} linear weights ({} parameters) in 4-bit {}{} ({:.1} MB, {:.3} bits a parameter), {from}; the embeddings, norms, biases and LM head stay in {dtype}",
            self.weights,
            self.params,
            self.quant_type.name(),
            if self.double_quant { " with double quantization" } else { "" },
            self.bytes as f64 / 1e6,
            self.bits_per_param(),
        )
    }
}

/// The names and shapes of the linear weights the spec of `cfg` has (every block's q/k/v/o and
/// gate/up/down): what a QLoRA base quantizes.
pub fn linear_weights(cfg: &LlamaConfig) -> BTreeMap<String, Vec<usize>> {
    (0..cfg.num_hidden_layers).flat_map(|l| cfg.linear_specs(l)).map(|s| (s.name, s.shape)).collect()
}

/// A frozen placeholder of `shape` that holds one element (a broadcast view): the weight a
/// quantized layer carries for its shape.
fn placeholder(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    let one = Tensor::zeros(vec![1; shape.len()], dtype, device)?;
    one.broadcast_as(shape.to_vec())
}

impl Llama {
    /// Loads the checkpoint directory `dir` with its linear weights 4-bit as `spec` says: a bf16
    /// / f16 / f32 checkpoint is quantized on load one tensor at a time (as bitsandbytes'
    /// `quantize_4bit` would); a checkpoint saved 4-bit is read as it is, when its quant type is
    /// `spec`'s (else an error naming both). The other tensors are converted to `dtype`.
    pub fn from_pretrained_quantized(dir: &Path, dtype: DType, device: Device, spec: QuantSpec) -> Result<Self> {
        if !dtype.is_float() {
            return Err(Error::new("Llama::from_pretrained", format!("{}: model dtype must be a float type, got {dtype}", dir.display())));
        }
        let cfg = LlamaConfig::from_file(dir.join("config.json"))?;
        if let Some(ck) = read_bnb4_dir(dir)? {
            if ck.config.quant_type != spec.quant_type {
                return Err(Error::new(
                    "Llama::from_pretrained",
                    format!(
                        "{}: the checkpoint is saved 4-bit as {} (quantization_config.bnb_4bit_quant_type), not {}: drop --quantize-base or give {}",
                        dir.display(),
                        ck.config.quant_type.name(),
                        spec.quant_type.name(),
                        ck.config.quant_type.name()
                    ),
                ));
            }
            return Self::from_quantized(cfg, ck, dtype, device, dir, QuantSource::Checkpoint);
        }
        let linears = linear_weights(&cfg);
        let ck = quantize_dir(dir, spec, &|name, shape| linears.get(name).is_some_and(|s| s == shape))?;
        Self::from_quantized(cfg, ck, dtype, device, dir, QuantSource::OnLoad)
    }

    /// The model `cfg` from a 4-bit checkpoint `ck` (read from `dir`, for errors): its 4-bit
    /// linear weights as `QuantOp`s over placeholders, the other tensors converted to `dtype`.
    /// A 4-bit tensor that is not a linear layer's weight of the spec is an error naming it.
    pub(crate) fn from_quantized(
        cfg: LlamaConfig,
        ck: Bnb4Checkpoint,
        dtype: DType,
        device: Device,
        dir: &Path,
        source: QuantSource,
    ) -> Result<Self> {
        let err = |msg: String| Error::new("Llama::from_pretrained", format!("{}: {msg}", dir.display()));
        let linears = linear_weights(&cfg);
        let mut tensors = TensorMap::new();
        for (name, t) in &ck.other {
            let v = stored_to_f32(&t.dtype, &t.data).map_err(|e| err(format!("tensor `{name}`: {e}")))?;
            tensors.insert(name.clone(), Tensor::from_vec(v, t.shape.clone(), device)?.to_dtype(dtype)?);
        }
        let (mut params, mut bytes, mut orig) = (0usize, 0usize, None);
        for (name, q) in &ck.quantized {
            let Some(shape) = linears.get(name) else {
                return Err(err(format!("tensor `{name}` is 4-bit, but it is not a linear layer's weight of this {} config", cfg.family)));
            };
            if &q.shape != shape {
                return Err(err(format!("tensor `{name}` has shape {:?} (its quant_state), but config.json implies {shape:?}", q.shape)));
            }
            tensors.insert(name.clone(), placeholder(shape, dtype, device)?);
            params += q.numel();
            bytes += q.stored_bytes();
            orig.get_or_insert(q.dtype);
        }
        let file = dir.join("model.safetensors");
        let mut m = Self::from_tensors(cfg, tensors, dtype, device, &file)?;
        let mut quantized = ck.quantized;
        m.visit_linears_mut(&mut |s, lin| {
            if let Some(q) = quantized.remove(&s.name) {
                lin.weight.set_requires_grad(false)?;
                lin.op = Arc::new(QuantOp(QuantLinear::new(&s.name, q, device)?));
            }
            Ok(())
        })?;
        m.quant = Some(QuantBase {
            quant_type: ck.config.quant_type,
            double_quant: ck.config.double_quant,
            source,
            weights: m.count_quantized(),
            params,
            bytes,
            orig_dtype: orig.unwrap_or(OrigDtype::F32),
        });
        Ok(m)
    }

    fn count_quantized(&self) -> usize {
        let mut n = 0;
        let _ = self.shallow_clone().visit_linears_mut(&mut |_, lin| {
            n += usize::from(lin.op.quantized().is_some());
            Ok(())
        });
        n
    }

    /// The 4-bit base, when the model has one.
    pub fn quant_base(&self) -> Option<&QuantBase> {
        self.quant.as_ref()
    }

    /// Replaces every 4-bit weight by its dequantization (its f32 values rounded once to the
    /// model's dtype), applied densely: the model then computes what it computed, with dense
    /// weights (frozen when the model has adapters). What `--merge-lora` folds an adapter into.
    pub fn dequantize_base(&mut self) -> Result<()> {
        let frozen = self.lora.is_some();
        let dtype = self.dtype();
        {
            let _g = no_grad();
            self.visit_linears_mut(&mut |_, lin| {
                let Some(q) = lin.op.quantized() else { return Ok(()) };
                let w = q.weight(DType::F32)?.to_dtype(dtype)?;
                w.set_requires_grad(!frozen)?;
                lin.weight = w;
                lin.op = Arc::new(Dense);
                Ok(())
            })?;
        }
        self.quant = None;
        Ok(())
    }
}

/// Whether the (out, in) weight `name` of `shape` cuts into `parts` pieces along `dim` (0: rows,
/// 1: columns) made of whole 4-bit blocks of `blocksize`: else an error naming the sizes (what
/// `--tp` is refused with before a QLoRA run starts, and what [`shard_quant`] checks).
pub fn check_shard(name: &str, shape: &[usize], dim: usize, parts: usize, bs: usize) -> Result<()> {
    let err = |msg: String| Error::new("qlora", format!("{name}: {msg}"));
    let (out, cin) = match shape[..] {
        [o, i] => (o, i),
        _ => return Err(err(format!("a linear weight is (out, in), got shape {shape:?}"))),
    };
    let full = if dim == 0 { out } else { cin };
    if parts == 0 || !full.is_multiple_of(parts) {
        return Err(err(format!("cannot split {full} {} in {parts} pieces", if dim == 0 { "rows" } else { "columns" })));
    }
    if dim == 0 {
        let rows = out / parts;
        let len = rows * cin;
        if !len.is_multiple_of(bs) {
            return Err(err(format!(
                "tensor parallelism over {parts} ranks splits its 4-bit blocks: a piece of {rows} rows x {cin} columns is {len} \
                 elements, not a multiple of the block of {bs} (use fewer ranks, or --tp 1)"
            )));
        }
    } else {
        let cols = cin / parts;
        if !cin.is_multiple_of(bs) || !cols.is_multiple_of(bs) {
            return Err(err(format!(
                "tensor parallelism over {parts} ranks splits its 4-bit blocks: its rows of {cin} columns split into pieces of \
                 {cols}, and both must be multiples of the block of {bs} (use fewer ranks, or --tp 1)"
            )));
        }
    }
    Ok(())
}

/// Piece `index` of `parts` of the 4-bit (out, in) weight `name` along `dim` (0: output rows,
/// a column-parallel layer's; 1: input columns, a row-parallel layer's): the same codes and
/// block scales, so the piece dequantizes to exactly the same values as that piece of the
/// whole. Quantization blocks never straddle a shard: a shape whose pieces would split a block
/// is refused, naming the sizes. A row piece keeps the nested (double-quantized) absmax when it
/// starts and ends on a nested block; otherwise the piece holds its blocks' absmax as the f32
/// values bitsandbytes dequantizes them to (exact; 4 bytes a block instead of 1).
pub fn shard_quant(name: &str, q: &Quant4, dim: usize, index: usize, parts: usize) -> Result<Quant4> {
    check_shard(name, &q.shape, dim, parts, q.blocksize)?;
    if index >= parts {
        return Err(Error::new("qlora", format!("{name}: no piece {index} of {parts}")));
    }
    let (out, cin, bs) = (q.shape[0], q.shape[1], q.blocksize);
    let absmax = q.absmax_f32();
    // Element ranges of the piece, in the flattened (row-major) weight.
    let ranges: Vec<(usize, usize)> = if dim == 0 {
        let len = out / parts * cin;
        vec![(index * len, (index + 1) * len)]
    } else {
        let cols = cin / parts;
        (0..out).map(|r| (r * cin + index * cols, r * cin + (index + 1) * cols)).collect()
    };
    let mut packed = Vec::new();
    let mut plain = Vec::new();
    for &(s, e) in &ranges {
        packed.extend_from_slice(&q.packed[s / 2..e / 2]);
        plain.extend_from_slice(&absmax[s / bs..e / bs]);
    }
    let shape = if dim == 0 { vec![out / parts, cin] } else { vec![out, cin / parts] };
    let absmax = match (&q.absmax, &ranges[..]) {
        (Absmax::Nested(n), [(s, e)])
            if (s / bs).is_multiple_of(n.blocksize) && ((e / bs).is_multiple_of(n.blocksize) || e / bs == q.blocks()) =>
        {
            let (b0, b1) = (s / bs, e / bs);
            Absmax::Nested(NestedAbsmax {
                codes: n.codes[b0..b1].to_vec(),
                absmax: n.absmax[b0 / n.blocksize..b1.div_ceil(n.blocksize)].to_vec(),
                blocksize: n.blocksize,
                offset: n.offset,
                map: n.map.clone(),
            })
        }
        _ => Absmax::Plain(plain),
    };
    let piece = Quant4 { quant_type: q.quant_type, shape, dtype: q.dtype, blocksize: bs, packed, absmax };
    piece.check(name)?;
    Ok(piece)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm_tensor::Rng;

    fn weight(out: usize, cin: usize) -> (Vec<f32>, Quant4) {
        let mut r = Rng::new(5);
        let w = Tensor::randn([out, cin], 0.05, DType::F32, Device::Cpu, &mut r).unwrap().to_vec_f32().unwrap();
        let q = Quant4::quantize("w", &w, &[out, cin], OrigDtype::F32, QuantSpec::QLORA).unwrap();
        (w, q)
    }

    /// Every piece dequantizes to exactly that piece of the whole weight's dequantization.
    #[test]
    fn a_shard_dequantizes_to_the_shard_of_the_dequantized_weight() {
        for (out, cin, parts) in [(512usize, 128usize, 2usize), (64, 256, 4), (96, 192, 3)] {
            let (_, q) = weight(out, cin);
            let whole = q.dequantize_f32();
            for dim in [0, 1] {
                for index in 0..parts {
                    let p = shard_quant("w", &q, dim, index, parts).unwrap();
                    let want: Vec<f32> = if dim == 0 {
                        whole[index * out / parts * cin..(index + 1) * out / parts * cin].to_vec()
                    } else {
                        (0..out).flat_map(|r| whole[r * cin + index * cin / parts..r * cin + (index + 1) * cin / parts].to_vec()).collect()
                    };
                    assert_eq!(p.dequantize_f32(), want, "{out}x{cin} dim {dim} piece {index} of {parts}");
                }
            }
        }
        // 512 rows x 128 in 2 pieces: 512 blocks each, two whole nested blocks: kept nested.
        let (_, q) = weight(512, 128);
        assert!(matches!(shard_quant("w", &q, 0, 1, 2).unwrap().absmax, Absmax::Nested(_)));
    }

    #[test]
    fn a_shard_that_splits_a_block_is_refused_naming_the_sizes() {
        let (_, q) = weight(64, 96);
        let e = shard_quant("model.layers.0.mlp.down_proj.weight", &q, 1, 0, 2).err().unwrap().to_string();
        assert!(e.contains("down_proj.weight") && e.contains("rows of 96 columns split into pieces of 48"), "{e}");
        let (_, q) = weight(6, 64);
        let e = shard_quant("w", &q, 0, 0, 4).err().unwrap().to_string();
        assert!(e.contains("cannot split 6 rows in 4 pieces"), "{e}");
        let (_, q) = weight(2, 32);
        let e = shard_quant("w", &q, 0, 0, 2).err().unwrap().to_string();
        assert!(e.contains("1 rows x 32 columns is 32 elements, not a multiple of the block of 64"), "{e}");
    }
}
