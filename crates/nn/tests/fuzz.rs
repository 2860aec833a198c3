//! Structured fuzzing of the model loaders: safetensors headers (`load_safetensors*`),
//! `config.json` (`LlamaConfig::from_json_str`) and whole checkpoint directories
//! (`Llama::from_pretrained`, single file or sharded). Valid files are mutated (the helpers are
//! ferrolm-data's, see crates/data/tests/fuzzing); every case must give `Ok` or an error, never
//! a panic, an abort or an allocation above the cap.
#[path = "../../data/tests/fuzzing/mod.rs"]
mod fuzzing;

use ferrolm_nn::config::{MAX_LAYERS, MAX_PARAMETERS, MAX_ROPE_TABLE};
use ferrolm_nn::safetensors_io::{load_float_safetensors, load_safetensors};
use ferrolm_nn::{Llama, LlamaConfig};
use ferrolm_tensor::{DType, Device, Rng};
use fuzzing::{apply_bytes, byte_edit, config, json_mutations, mutate_json, ByteEdit, JsonEdit};
use proptest::prelude::*;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;
use std::path::Path;
use std::sync::OnceLock;

#[global_allocator]
static ALLOC: fuzzing::CappedAlloc = fuzzing::CappedAlloc;

mod common;
use common::TempDir;

/// Splits a safetensors file into its header (as JSON) and payload.
fn split(bytes: &[u8]) -> (Value, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), bytes[8 + n..].to_vec())
}

/// Header edits (tree edits re-serialised with a correct length prefix), then byte edits of
/// the whole file (which also hit the length prefix).
fn mutate_file(bytes: &[u8], edits: &[JsonEdit], byte_edits: &[ByteEdit]) -> Vec<u8> {
    let (header, payload) = split(bytes);
    let h = mutate_json(&header, edits, &[]);
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(payload);
    byte_edits.iter().for_each(|e| apply_bytes(&mut out, e));
    out
}

fn dtype_of(i: u8) -> Dtype {
    [Dtype::F32, Dtype::BF16, Dtype::F16, Dtype::F64, Dtype::I32, Dtype::I64, Dtype::U8, Dtype::BOOL][i as usize % 8]
}

/// A valid safetensors file of up to 4 small tensors of mixed dtypes and ranks.
fn safetensors_file() -> impl Strategy<Value = Vec<u8>> {
    let tensor = (any::<u8>(), proptest::collection::vec(0usize..4, 0..4), any::<u8>());
    proptest::collection::vec(tensor, 0..4).prop_map(|ts| {
        let data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = ts
            .into_iter()
            .enumerate()
            .map(|(i, (d, shape, fill))| {
                let dt = dtype_of(d);
                let n: usize = shape.iter().product::<usize>() * dt.size();
                (format!("t{i}"), dt, shape, vec![fill; n])
            })
            .collect();
        let views: Vec<(&str, TensorView)> =
            data.iter().map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
        safetensors::serialize(views, &None).unwrap()
    })
}

/// Sometimes a shape for tensor `i` made of zeros, small and huge dims.
fn hostile_shape() -> impl Strategy<Value = Option<(usize, Vec<u64>)>> {
    let dim = prop_oneof![Just(0u64), 1u64..5, Just(1 << 32), Just(1 << 62), Just(u64::MAX), Just(i64::MAX as u64 + 1)];
    prop_oneof![Just(None), (any::<usize>(), proptest::collection::vec(dim, 0..5)).prop_map(Some)]
}

/// The file with tensor `i`'s shape (modulo the tensor count) replaced; offsets are kept.
fn with_shape(file: &[u8], i: usize, dims: Vec<u64>) -> Vec<u8> {
    let (mut header, payload) = split(file);
    let names: Vec<String> = header.as_object().unwrap().keys().filter(|k| *k != "__metadata__").cloned().collect();
    if names.is_empty() {
        return file.to_vec();
    }
    header[&names[i % names.len()]]["shape"] = serde_json::json!(dims);
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(payload);
    out
}

proptest! {
    #![proptest_config(config(3000))]

    /// safetensors headers: both loaders, on files mutated in the header and in the bytes.
    #[test]
    fn fuzz_safetensors(file in safetensors_file(), shape in hostile_shape(), (edits, bytes) in json_mutations()) {
        // A generated shape (zero dims beside huge ones) replaces one tensor's before the edits.
        let file = match shape {
            Some((i, dims)) => with_shape(&file, i, dims),
            None => file,
        };
        thread_local!(static DIR: TempDir = TempDir::new("st"));
        DIR.with(|dir| -> Result<(), TestCaseError> {
            let path = dir.0.join("x.safetensors");
            let mutated = mutate_file(&file, &edits, &bytes);
            fuzzing::rewrite(&path, &mutated);
            for r in [load_safetensors(&path, DType::F32, Device::Cpu), load_float_safetensors(&path, DType::BF16, Device::Cpu)] {
                match r {
                    // Every element loaded was read from the file (each takes 2 bytes or more).
                    Ok(m) => prop_assert!(m.values().map(|t| t.dims().iter().product::<usize>() * 2).sum::<usize>() <= mutated.len()),
                    Err(e) => prop_assert!(e.to_string().contains(&path.display().to_string()), "{}", e),
                }
            }
            Ok(())
        })?;
    }
}

/// config.json of a real-looking model (GQA, llama3 rope scaling, untied), to mutate.
fn base_config() -> Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_theta": 500000.0, "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": [2, 3],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 128},
        "attention_bias": false, "mlp_bias": false, "pretraining_tp": 1, "initializer_range": 0.02
    })
}

proptest! {
    #![proptest_config(config(5000))]

    /// config.json: whatever parses is valid, within the size limits, and round-trips.
    #[test]
    fn fuzz_config_json((edits, bytes) in json_mutations()) {
        let text = mutate_json(&base_config(), &edits, &bytes);
        let Ok(text) = String::from_utf8(text) else { return Ok(()) };
        if let Ok(c) = LlamaConfig::from_json_str(&text) {
            c.validate().unwrap();
            prop_assert!(c.num_parameters().is_some_and(|n| n <= MAX_PARAMETERS));
            prop_assert!(c.num_hidden_layers as u64 <= MAX_LAYERS);
            prop_assert!((c.max_position_embeddings as u64) * (c.head_dim as u64) <= MAX_ROPE_TABLE);
            // Round trip; floats within an ulp or two (serde_json's default float parsing is not
            // exactly round-trip).
            let r = LlamaConfig::from_json_str(&c.to_json_string()).unwrap();
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-15 * a.abs().max(b.abs());
            prop_assert!(close(r.initializer_range, c.initializer_range) && close(r.rms_norm_eps, c.rms_norm_eps));
            prop_assert!(close(r.rope_theta, c.rope_theta));
            let same_floats = LlamaConfig {
                initializer_range: c.initializer_range,
                rms_norm_eps: c.rms_norm_eps,
                rope_theta: c.rope_theta,
                rope_scaling: c.rope_scaling.clone(),
                ..r.clone()
            };
            prop_assert_eq!(same_floats, c);
        }
    }
}

/// The files of a tiny saved model, once.
fn checkpoint_files() -> &'static Vec<(String, Vec<u8>)> {
    static F: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    F.get_or_init(|| {
        let dir = TempDir::new("base");
        let cfg = LlamaConfig::from_json_str(
            r#"{"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16, "tie_word_embeddings": false}"#,
        )
        .unwrap();
        Llama::new(cfg, DType::F32, Device::Cpu, &mut Rng::new(3)).unwrap().save_pretrained(&dir.0).unwrap();
        ["config.json", "model.safetensors"].iter().map(|n| (n.to_string(), std::fs::read(dir.0.join(n)).unwrap())).collect()
    })
}

/// What happens to one file of the checkpoint.
#[derive(Clone, Debug)]
enum FileFate {
    Keep,
    Delete,
    Json(Vec<JsonEdit>),
    Bytes(Vec<ByteEdit>),
}

fn fate() -> impl Strategy<Value = FileFate> {
    prop_oneof![
        3 => Just(FileFate::Keep),
        1 => Just(FileFate::Delete),
        2 => proptest::collection::vec(fuzzing::json_edit(), 1..3).prop_map(FileFate::Json),
        2 => proptest::collection::vec(byte_edit(), 1..3).prop_map(FileFate::Bytes),
    ]
}

fn write_case(dir: &Path, sharded: bool, fates: &[FileFate]) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let mut files = checkpoint_files().clone();
    if sharded {
        // The same weights behind an index naming one shard.
        let (header, _) = split(&files[1].1);
        let map: serde_json::Map<String, Value> = header
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "__metadata__")
            .map(|k| (k.clone(), Value::from("model-00001-of-00001.safetensors")))
            .collect();
        files[1].0 = "model-00001-of-00001.safetensors".into();
        files.push(("model.safetensors.index.json".into(), serde_json::to_vec(&serde_json::json!({"weight_map": map})).unwrap()));
    }
    for ((name, bytes), fate) in files.iter().zip(fates.iter().cycle()) {
        let out = match fate {
            FileFate::Keep => bytes.clone(),
            FileFate::Delete => continue,
            FileFate::Json(e) if name.ends_with(".json") => mutate_json(&serde_json::from_slice(bytes).unwrap(), e, &[]),
            FileFate::Json(e) => mutate_file(bytes, e, &[]),
            FileFate::Bytes(e) => {
                let mut b = bytes.clone();
                e.iter().for_each(|e| apply_bytes(&mut b, e));
                b
            }
        };
        std::fs::write(dir.join(name), out).unwrap();
    }
}

proptest! {
    #![proptest_config(config(1000))]

    /// Checkpoint directories: files deleted, truncated, flipped or edited, single or sharded.
    #[test]
    fn fuzz_checkpoint_dir(sharded in any::<bool>(), fates in proptest::collection::vec(fate(), 3)) {
        thread_local!(static DIR: TempDir = TempDir::new("ckpt"));
        DIR.with(|dir| -> Result<(), TestCaseError> {
            let case = dir.0.join("case");
            write_case(&case, sharded, &fates);
            match Llama::from_pretrained(&case, DType::F32, Device::Cpu) {
                Ok(m) => {
                    let n: usize = m.parameters().iter().map(|(_, t)| t.dims().iter().product::<usize>()).sum();
                    prop_assert_eq!(Some(n as u64), m.config().num_parameters());
                }
                Err(e) => prop_assert!(e.to_string().contains(&case.display().to_string()), "{}", e),
            }
            Ok(())
        })?;
    }
}
