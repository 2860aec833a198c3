//! Hostile `config.json`, safetensors files and checkpoint directories: each gives an error
//! naming the file and the field or tensor, never a panic, and nothing is allocated for sizes
//! that cannot fit.
use ferrolm_nn::config::{MAX_LAYERS, MAX_PARAMETERS, MAX_ROPE_TABLE};
use ferrolm_nn::safetensors_io::{load_float_safetensors, load_model_dir, load_safetensors, save_safetensors};
use ferrolm_nn::{Llama, LlamaConfig};
use ferrolm_tensor::{DType, Device, Rng, Tensor};
use serde_json::{json, Value};
use std::path::Path;

mod common;
use common::TempDir;

fn tiny() -> LlamaConfig {
    LlamaConfig::from_json_str(
        r#"{"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}"#,
    )
    .unwrap()
}

fn err_of<T>(r: ferrolm_tensor::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

fn config_with(edit: impl FnOnce(&mut Value)) -> String {
    let mut v = tiny().to_json_value("float32");
    edit(&mut v);
    v.to_string()
}

/// A saved tiny model: config.json + model.safetensors.
fn saved(dir: &Path) -> Llama {
    let model = Llama::new(tiny(), DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap();
    model.save_pretrained(dir).unwrap();
    model
}

/// A safetensors file from a raw header and payload (for layouts the writer refuses).
fn raw_safetensors(path: &Path, header: &Value, payload: &[u8]) {
    let h = header.to_string().into_bytes();
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend(h);
    b.extend(payload);
    std::fs::write(path, b).unwrap();
}

#[test]
fn huge_max_position_embeddings_is_refused_naming_the_field() {
    let e = err_of(LlamaConfig::from_json_str(&config_with(|v| v["max_position_embeddings"] = json!(1_000_000_000_000u64))));
    assert!(e.contains("`max_position_embeddings`") && e.contains("1000000000000"), "{e}");
    // Through from_file the error names the file too.
    let dir = TempDir::new("cfg-file");
    let p = dir.0.join("config.json");
    std::fs::write(&p, config_with(|v| v["max_position_embeddings"] = json!(1u64 << 40))).unwrap();
    let e = err_of(LlamaConfig::from_file(&p));
    assert!(e.contains(&p.display().to_string()) && e.contains("`max_position_embeddings`"), "{e}");
}

#[test]
fn huge_head_dim_is_refused_naming_the_field() {
    for d in [1u64 << 40, 1u64 << 62, u64::MAX - 1] {
        let e = err_of(LlamaConfig::from_json_str(&config_with(|v| v["head_dim"] = json!(d))));
        assert!(e.contains("`head_dim`"), "{d}: {e}");
    }
    // Within the rotary limit (one position), the projections still exceed the parameter limit.
    let e = err_of(LlamaConfig::from_json_str(&config_with(|v| {
        v["head_dim"] = json!(1 << 20);
        v["max_position_embeddings"] = json!(1);
        v["hidden_size"] = json!(1 << 20);
        v["num_attention_heads"] = json!(1 << 10);
    })));
    assert!(e.contains("parameters") && e.contains(&MAX_PARAMETERS.to_string()), "{e}");
}

/// Billions of tiny layers stay under the parameter limit but would allocate gigabytes of
/// per-layer structures before any weight is read (CI ran out of memory on this once).
#[test]
fn billions_of_tiny_layers_are_refused_by_count() {
    let e = err_of(LlamaConfig::from_json_str(&config_with(|v| v["num_hidden_layers"] = json!(1u64 << 31))));
    assert!(e.contains("`num_hidden_layers`") && e.contains(&MAX_LAYERS.to_string()), "{e}");
    LlamaConfig::from_json_str(&config_with(|v| v["num_hidden_layers"] = json!(MAX_LAYERS))).unwrap();
}

#[test]
fn vocab_times_hidden_overflow_is_refused() {
    let e = err_of(LlamaConfig::from_json_str(&config_with(|v| {
        v["vocab_size"] = json!(i32::MAX);
        v["hidden_size"] = json!(1u64 << 40);
        v["head_dim"] = json!(4);
    })));
    assert!(e.contains("`hidden_size`") && e.contains("vocab_size 2147483647"), "{e}");
    let e = err_of(LlamaConfig::from_json_str(&config_with(|v| {
        v["hidden_size"] = json!(u64::MAX / 2);
        v["head_dim"] = json!(4);
    })));
    assert!(e.contains("overflow"), "{e}");
    let e = err_of(LlamaConfig::from_json_str(&config_with(|v| v["num_hidden_layers"] = json!(1u64 << 50))));
    assert!(e.contains("`num_hidden_layers`"), "{e}");
    let e = err_of(LlamaConfig::from_json_str(&config_with(|v| v["intermediate_size"] = json!(1u64 << 45))));
    assert!(e.contains("`intermediate_size`"), "{e}");
    let e = err_of(LlamaConfig::from_json_str(&config_with(|v| v["bos_token_id"] = json!(16))));
    assert!(e.contains("`bos_token_id`"), "{e}");
}

#[test]
fn num_parameters_counts_what_the_model_holds() {
    for tied in [true, false] {
        let cfg = LlamaConfig { tie_word_embeddings: tied, ..LlamaConfig::preset("tiny").unwrap() };
        let model = Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut Rng::new(0)).unwrap();
        let held: usize = model.parameters().iter().map(|(_, t)| t.dims().iter().product::<usize>()).sum();
        assert_eq!(cfg.num_parameters(), Some(held as u64), "tied {tied}");
    }
    let huge = LlamaConfig { vocab_size: usize::MAX, ..tiny() };
    assert_eq!(huge.num_parameters(), None);
    // Real large configs stay loadable: Llama 3.1 405B's sizes.
    let big = config_with(|v| {
        for (k, x) in [
            ("vocab_size", 128256),
            ("hidden_size", 16384),
            ("intermediate_size", 53248),
            ("num_hidden_layers", 126),
            ("num_attention_heads", 128),
            ("num_key_value_heads", 8),
            ("head_dim", 128),
            ("max_position_embeddings", 131072),
        ] {
            v[k] = json!(x);
        }
    });
    let c = LlamaConfig::from_json_str(&big).unwrap();
    let n = c.num_parameters().unwrap();
    assert!((405e9..407e9).contains(&(n as f64)), "{n}");
    assert!((c.max_position_embeddings * c.head_dim) as u64 <= MAX_ROPE_TABLE);
}

#[test]
fn integer_weights_are_refused_naming_file_and_tensor() {
    let dir = TempDir::new("int-weight");
    let model = saved(&dir.0);
    let file = dir.0.join("model.safetensors");
    let mut tensors = model.parameters();
    let (name, t) = tensors[0].clone();
    let ids = Tensor::from_vec(vec![1i32; t.dims().iter().product()], t.dims().to_vec(), Device::Cpu).unwrap();
    tensors[0] = (name.clone(), ids);
    save_safetensors(&file, &tensors, None).unwrap();
    let e = err_of(Llama::from_pretrained(&dir.0, DType::F32, Device::Cpu));
    assert!(e.contains(&file.display().to_string()) && e.contains(&format!("`{name}`")) && e.contains("I32"), "{e}");
    let e = err_of(load_float_safetensors(&file, DType::F32, Device::Cpu));
    assert!(e.contains("float"), "{e}");
    // Reference files keep their integer tensors (token ids) through the permissive loader.
    assert_eq!(load_safetensors(&file, DType::F32, Device::Cpu).unwrap()[&name].dtype(), DType::I32);
    assert!(load_model_dir(&dir.0, DType::I32, Device::Cpu).is_err());
}

#[test]
fn hostile_safetensors_layouts_are_errors_naming_the_file() {
    let dir = TempDir::new("st-layout");
    let p = dir.0.join("x.safetensors");
    let f32s = |n: usize| vec![0u8; 4 * n];
    let cases: Vec<(Value, Vec<u8>)> = vec![
        // A zero dim hides an element count whose strides overflow.
        (json!({"t": {"dtype": "F32", "shape": [0, 1u64 << 32, 1u64 << 32], "data_offsets": [0, 0]}}), vec![]),
        (json!({"t": {"dtype": "F32", "shape": [1u64 << 62, 8], "data_offsets": [0, 16]}}), f32s(4)),
        (json!({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}), f32s(4)),
        (
            json!({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}),
            f32s(6),
        ),
        (json!({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}), f32s(4)),
        (json!({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}), vec![0; 4]),
        (json!({"t": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}), i64::MAX.to_le_bytes().to_vec()),
    ];
    for (header, payload) in cases {
        raw_safetensors(&p, &header, &payload);
        let e = err_of(load_safetensors(&p, DType::F32, Device::Cpu));
        assert!(e.contains(&p.display().to_string()), "{header}: {e}");
    }
    // A header length prefix far past the file.
    std::fs::write(&p, u64::MAX.to_le_bytes()).unwrap();
    assert!(err_of(load_safetensors(&p, DType::F32, Device::Cpu)).contains(&p.display().to_string()));
}

#[test]
fn damaged_checkpoint_directories_are_errors_naming_the_file() {
    let dir = TempDir::new("ckpt");
    saved(&dir.0);
    let model = dir.0.join("model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    // Truncated weights.
    std::fs::write(&model, &bytes[..bytes.len() - 7]).unwrap();
    let e = err_of(Llama::from_pretrained(&dir.0, DType::F32, Device::Cpu));
    assert!(e.contains(&model.display().to_string()), "{e}");
    // No weights at all.
    std::fs::remove_file(&model).unwrap();
    let e = err_of(Llama::from_pretrained(&dir.0, DType::F32, Device::Cpu));
    assert!(e.contains("model.safetensors"), "{e}");
    // A sharded index naming a missing shard, or a path outside the directory.
    std::fs::write(model.with_file_name("part-1.safetensors"), &bytes).unwrap();
    let index = dir.0.join("model.safetensors.index.json");
    for (shard, want) in
        [("part-2.safetensors", "part-2.safetensors"), ("../part-1.safetensors", "plain file name"), ("", "plain file name")]
    {
        std::fs::write(&index, json!({"weight_map": {"model.norm.weight": shard}}).to_string()).unwrap();
        let e = err_of(Llama::from_pretrained(&dir.0, DType::F32, Device::Cpu));
        assert!(e.contains(want), "{shard}: {e}");
    }
    // Missing / truncated config.json.
    let cfg = dir.0.join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, &text[..text.len() / 2]).unwrap();
    let e = err_of(Llama::from_pretrained(&dir.0, DType::F32, Device::Cpu));
    assert!(e.contains(&cfg.display().to_string()) && e.contains("invalid JSON"), "{e}");
    std::fs::remove_file(&cfg).unwrap();
    let e = err_of(Llama::from_pretrained(&dir.0, DType::F32, Device::Cpu));
    assert!(e.contains(&cfg.display().to_string()), "{e}");
}
