//! A run's 4-bit base (QLoRA, docs/LORA.md "QLoRA"): loading a model directory with its linear
//! weights quantized on load or saved 4-bit, the layouts such a base runs under, and how it is
//! held (for the memory estimator). Below the CLI: the tools and `parallel::load_for_inference`
//! use it.
use crate::errors::flag_error;
use crate::{AnyResult, Llama};
use anyhow::Context;
use ferrolm_ops::nf4::{QuantSpec, QuantType};
use std::path::Path;

/// Loads the model directory `dir` for a run: with `quantize` (`--quantize-base`) its linear
/// weights quantized 4-bit on load, tensor by tensor (`Llama::from_pretrained_quantized`); a
/// checkpoint saved 4-bit by transformers loads as 4-bit with or without it. A 4-bit base is
/// reported (what is quantized, what stays in `dtype`).
pub fn load_model(dir: &Path, quantize: Option<QuantType>, dtype: crate::DType, device: crate::Device) -> AnyResult<Llama> {
    let model = match quantize {
        Some(q) => Llama::from_pretrained_quantized(dir, dtype, device, QuantSpec { quant_type: q, ..QuantSpec::QLORA }),
        None => Llama::from_pretrained(dir, dtype, device),
    }
    .with_context(|| format!("cannot load {}", dir.display()))?;
    if let Some(q) = model.quant_base() {
        tracing::info!("{}", q.describe(dtype));
    }
    Ok(model)
}

/// Refuses, before any work, a layout that a 4-bit base (`--quantize-base`, or `--model` saved
/// 4-bit) does not run under: ZeRO-3 (the frozen 4-bit weights are held whole on every rank),
/// and a `--tp` whose pieces would split a 4-bit block of some weight (naming it and the
/// sizes); and `--quantize-base` of another type than a `--model` saved 4-bit. A flag error
/// naming the flags.
pub fn check_quant_layout(quantize: Option<QuantType>, model: &Path, layout: &crate::parallel::Parallelism) -> AnyResult<()> {
    if quantize.is_some() {
        quant_spec(quantize, model)?; // --quantize-base of another type than a 4-bit --model's
    }
    // config.json is read only where the layout could conflict with a 4-bit base, and once.
    if (layout.spec.params <= 1 && layout.tp <= 1) || !(quantize.is_some() || is_4bit_checkpoint(model)?) {
        return Ok(());
    }
    if layout.spec.params > 1 {
        return Err(flag_error(format!(
            "ZeRO-3 (--zero 3 or --shard-params {}) over a 4-bit base (--quantize-base, or a --model saved 4-bit) is not \
             supported: the frozen 4-bit weights are held whole on every rank and only the adapters are sharded: use --zero 2 \
             or less",
            layout.spec.params
        )));
    }
    if layout.tp > 1 {
        let cfg = crate::nn::LlamaConfig::from_file(model.join("config.json"))?;
        let bs = QuantSpec::QLORA.blocksize;
        for s in (0..cfg.num_hidden_layers).flat_map(|l| cfg.linear_specs(l)) {
            if let Some(dim) = s.role.split_dim() {
                let parts = crate::nn::spec::parts(s.role, s.units, layout.tp);
                crate::nn::qlora::check_shard(&s.name, &s.shape, dim, parts, bs)
                    .map_err(|e| flag_error(format!("--tp {} over a 4-bit base: {}", layout.tp, e.msg)))?;
            }
        }
    }
    Ok(())
}

/// How the run holds its base 4-bit (None: in --dtype): `--quantize-base`'s type (blocks of 64,
/// double quantization, as it quantizes on load), or, for a model directory `dir` saved 4-bit,
/// its `quantization_config`'s type and double quantization (a checkpoint saved 4-bit loads as
/// such with or without the flag).
pub fn quant_spec(quantize: Option<QuantType>, dir: &Path) -> AnyResult<Option<QuantSpec>> {
    Ok(match (bnb4_config_of(dir)?, quantize) {
        // Found here, before any work, as the flag error it is (loading would refuse it later).
        (Some(c), Some(q)) if c.quant_type != q => {
            return Err(flag_error(format!(
                "--quantize-base {}: {} is saved 4-bit as {} (quantization_config.bnb_4bit_quant_type): drop --quantize-base \
                 or give {}",
                q.name(),
                dir.join("config.json").display(),
                c.quant_type.name(),
                c.quant_type.name()
            )))
        }
        (Some(c), _) => Some(QuantSpec { quant_type: c.quant_type, double_quant: c.double_quant, ..QuantSpec::QLORA }),
        (None, Some(q)) => Some(QuantSpec { quant_type: q, ..QuantSpec::QLORA }),
        (None, None) => None,
    })
}

/// Whether the model directory `dir` is a checkpoint saved 4-bit (`quantization_config` in its
/// config.json); errors name the file and key.
pub fn is_4bit_checkpoint(dir: &Path) -> AnyResult<bool> {
    Ok(bnb4_config_of(dir)?.is_some())
}

/// The 4-bit `quantization_config` of the model directory `dir`'s config.json, if any.
fn bnb4_config_of(dir: &Path) -> AnyResult<Option<crate::nn::bnb4::Bnb4Config>> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    Ok(crate::nn::bnb4::bnb4_config(&json, &path)?)
}
