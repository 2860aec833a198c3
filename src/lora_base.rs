//! The identity of a LoRA adapter's base model, recorded beside the adapter so that the adapter
//! is never continued or applied on another base unnoticed.
//!
//! A LoRA run writes [`BASE_RECORD`] (`ferrolm_base.json`) into every checkpoint beside PEFT's
//! `adapter_config.json` (which PEFT's `LoraConfig` reads strictly, so ferrolm adds nothing
//! there; PEFT ignores other files in the directory). The record holds:
//!
//! - `base_model_name_or_path`: where the base was (absolute), for the messages;
//! - `config`: the base's `config.json` as ferrolm reads it, without the keys that do not change
//!   the model's function (`dtype`, `torch_dtype`, `initializer_range`, `bos_token_id`,
//!   `eos_token_id`, `use_cache`, `architectures`, `auto_map`);
//! - `weights_xxh3_128`: XXH3-128 over every stored weight tensor, in name order, each as
//!   (name, dtype, shape, bytes as the safetensors files store them). It is the identity of the
//!   *files*: the same whether the model is then run on the CPU or CUDA, in f32 or bf16, and
//!   whether it is one file or shards; a bf16 copy of an f32 base is another base.
//! - `tensors`, `weight_bytes`: what was hashed.
//!
//! Every byte is hashed (no sampling): XXH3 runs at several GB/s, so the cost is reading the
//! files once (an 8B bf16 base is 16 GB: seconds from the page cache, longer from disk); the log
//! says how long it took. Two bases are the same when both the config and the weights hash agree.
use crate::AnyResult;
use anyhow::Context;
use ferrolm_nn::LlamaConfig;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// The record's file name, beside `adapter_config.json`.
pub const BASE_RECORD: &str = "ferrolm_base.json";

/// The config keys that do not change what the model computes (left out of the identity).
const NOT_IDENTITY: [&str; 8] =
    ["dtype", "torch_dtype", "initializer_range", "bos_token_id", "eos_token_id", "use_cache", "architectures", "auto_map"];

/// A base model's identity (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BaseIdentity {
    pub base_model_name_or_path: String,
    pub config: Value,
    pub weights_xxh3_128: String,
    pub tensors: usize,
    pub weight_bytes: u64,
}

impl BaseIdentity {
    /// The identity of the model directory `dir` (its `config.json` and weight files).
    pub fn of_dir(dir: &Path) -> AnyResult<BaseIdentity> {
        let cfg = LlamaConfig::from_file(dir.join("config.json"))?;
        BaseIdentity::compute(dir, &cfg, dir)
    }

    /// The identity of a base at `path` whose config is `cfg` and whose weights are those of the
    /// model directory `weights` (a Ladder conversion's base: the converted config over the
    /// Llama's files).
    pub fn compute(path: &Path, cfg: &LlamaConfig, weights: &Path) -> AnyResult<BaseIdentity> {
        let start = std::time::Instant::now();
        let mut digests: Vec<(String, u128)> = Vec::new();
        let mut bytes = 0u64;
        for file in ferrolm_nn::safetensors_io::model_weight_files(weights)? {
            ferrolm_nn::safetensors_io::visit_stored(&file, &mut |t| {
                let mut h = twox_hash::xxhash3_128::Hasher::new();
                h.write(t.dtype.as_bytes());
                h.write(&[0]);
                for d in t.shape {
                    h.write(&(*d as u64).to_le_bytes());
                }
                h.write(t.data);
                bytes += t.data.len() as u64;
                digests.push((t.name.to_string(), h.finish_128()));
                Ok(())
            })
            .with_context(|| format!("cannot hash the base's weights {}", file.display()))?;
        }
        digests.sort();
        let mut h = twox_hash::xxhash3_128::Hasher::new();
        for (name, d) in &digests {
            h.write(name.as_bytes());
            h.write(&[0]);
            h.write(&d.to_le_bytes());
        }
        let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let id = BaseIdentity {
            base_model_name_or_path: abs.display().to_string(),
            config: canonical_config(cfg),
            weights_xxh3_128: format!("{:032x}", h.finish_128()),
            tensors: digests.len(),
            weight_bytes: bytes,
        };
        tracing::info!(
            "base identity of {}: {} tensors, {:.1} MB hashed in {:.2} s (xxh3-128 {})",
            abs.display(),
            id.tensors,
            bytes as f64 / 1e6,
            start.elapsed().as_secs_f64(),
            id.weights_xxh3_128
        );
        Ok(id)
    }

    /// The record in the adapter directory `dir`, or None when it has none (an adapter made by
    /// PEFT or by a ferrolm that did not record its base).
    pub fn read(dir: &Path) -> AnyResult<Option<BaseIdentity>> {
        let path = dir.join(BASE_RECORD);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let id = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a base record of ferrolm (the base the adapter was trained on, checked before it is used): restore \
                 it, or delete it to use the adapter without that check",
                path.display()
            )
        })?;
        Ok(Some(id))
    }

    /// Writes the record into `dir` (atomically).
    pub fn write(&self, dir: &Path) -> AnyResult<()> {
        let mut text = serde_json::to_string_pretty(self)?;
        text.push('\n');
        ferrolm_nn::safetensors_io::write_atomic(&dir.join(BASE_RECORD), text.as_bytes())?;
        Ok(())
    }

    /// How `other` differs from this recorded base, one phrase a difference (empty: the same
    /// base): the config fields, then the weights.
    pub fn differences(&self, other: &BaseIdentity) -> Vec<String> {
        let mut out = Vec::new();
        let (a, b) = (self.config.as_object(), other.config.as_object());
        let keys: std::collections::BTreeSet<&String> = a.into_iter().chain(b).flat_map(|o| o.keys()).collect();
        for k in keys {
            let va = a.and_then(|o| o.get(k)).unwrap_or(&Value::Null);
            let vb = b.and_then(|o| o.get(k)).unwrap_or(&Value::Null);
            if va != vb {
                out.push(format!("config {k}: recorded {va}, this base {vb}"));
            }
        }
        if self.weights_xxh3_128 != other.weights_xxh3_128 {
            out.push(format!(
                "weights: recorded xxh3-128 {} ({} tensors, {} bytes), this base {} ({} tensors, {} bytes)",
                self.weights_xxh3_128, self.tensors, self.weight_bytes, other.weights_xxh3_128, other.tensors, other.weight_bytes
            ));
        }
        out
    }
}

/// `cfg` as JSON without the keys that are not the model's function ([`NOT_IDENTITY`]).
fn canonical_config(cfg: &LlamaConfig) -> Value {
    let mut v = cfg.to_json_value("float32");
    if let Value::Object(o) = &mut v {
        for k in NOT_IDENTITY {
            o.remove(k);
        }
    }
    v
}

/// What the adapter in `adapter` says about the base `current` (computed only when the adapter
/// has a record; named `given`, as the user gave it): None when it has no record (an info line
/// says it is not checked) or the record is this base, else a sentence naming both bases and
/// how they differ.
pub fn mismatch(adapter: &Path, given: &str, current: impl FnOnce() -> AnyResult<BaseIdentity>) -> AnyResult<Option<String>> {
    let Some(recorded) = BaseIdentity::read(adapter)? else {
        tracing::info!(
            "{} has no {BASE_RECORD} (an adapter made by PEFT or an older ferrolm): its base is not checked against {given}",
            adapter.display()
        );
        return Ok(None);
    };
    let diffs = recorded.differences(&current()?);
    if diffs.is_empty() {
        tracing::info!("the adapter {} was trained on this base ({given})", adapter.display());
        return Ok(None);
    }
    Ok(Some(format!(
        "the adapter {} was trained on the base {} (recorded in its {BASE_RECORD}), not on {given}, another model ({})",
        adapter.display(),
        recorded.base_model_name_or_path,
        diffs.join("; ")
    )))
}
