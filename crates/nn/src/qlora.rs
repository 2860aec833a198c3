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
use ferrolm_ops::nf4::{OrigDtype, QuantSpec, QuantType};
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
