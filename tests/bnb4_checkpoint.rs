//! A checkpoint that transformers saved 4-bit with bitsandbytes (tests/fixtures/nf4/tiny_llama_4bit:
//! tests/fixtures/llama_gqa_untied loaded with `load_in_4bit`, NF4, double quantization, then
//! `save_pretrained`; scripts/make_nf4_fixtures.py) read by crates/nn/src/bnb4.rs: every 4-bit
//! weight dequantizes to exactly what bitsandbytes' `dequantize_4bit` gives, the other tensors
//! come back as stored, and a corrupt quant_state, an absmax of the wrong length and an unknown
//! quant type are refused with an error naming the tensor; the dequantized checkpoint in a Llama
//! gives transformers' loss, and quantizing the f32 base on load gives the saved tensors.
use ferrolm_nn::bnb4::{quant4_from_parts, read_bnb4_dir, RawTensor};
use ferrolm_nn::safetensors_io::visit_stored;
use ferrolm_ops::nf4::{Absmax, OrigDtype, QuantType};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn stored(path: &Path) -> BTreeMap<String, RawTensor> {
    let mut m = BTreeMap::new();
    visit_stored(path, &mut |s| {
        m.insert(s.name.to_string(), RawTensor { dtype: s.dtype.to_string(), shape: s.shape.to_vec(), data: s.data.to_vec() });
        Ok(())
    })
    .unwrap();
    m
}

const W: &str = "model.layers.0.mlp.down_proj.weight";

#[test]
fn a_transformers_4bit_checkpoint_dequantizes_to_what_bitsandbytes_gives() {
    let ck = read_bnb4_dir(&fixtures().join("nf4/tiny_llama_4bit")).unwrap().expect("a 4-bit checkpoint");
    assert_eq!(ck.config.quant_type, QuantType::Nf4);
    assert!(ck.config.double_quant);
    let reference = stored(&fixtures().join("nf4/tiny_llama_4bit_reference.safetensors"));
    let want: Vec<&str> = reference.keys().filter_map(|k| k.strip_prefix("dequant.")).collect();
    assert_eq!(want.len(), 14, "2 layers x 7 linear weights");
    assert_eq!(ck.quantized.keys().map(String::as_str).collect::<Vec<_>>(), want);
    for (name, q) in &ck.quantized {
        assert!(matches!(q.absmax, Absmax::Nested(_)), "{name}: double quantization");
        assert_eq!(q.dtype, OrigDtype::F32);
        let r = &reference[&format!("dequant.{name}")];
        assert_eq!(q.shape, r.shape, "{name}");
        let got: Vec<u8> = q.dequantize_f32().iter().flat_map(|v| v.to_le_bytes()).collect();
        assert!(got == r.data, "{name}: dequantized values differ from bitsandbytes'");
    }
    // The rest is as stored: embeddings, norms and the LM head stay floats.
    let other: Vec<&str> = ck.other.keys().map(String::as_str).collect();
    assert!(other.contains(&"model.embed_tokens.weight") && other.contains(&"lm_head.weight"), "{other:?}");
    assert!(other.iter().all(|k| !k.contains("absmax") && !k.contains("quant_")), "{other:?}");
    assert_eq!(other.len(), 2 + 2 * 2 + 1, "embeddings, head, 2 norms a layer, the final norm");
}

#[test]
fn an_ordinary_checkpoint_is_not_read_as_4bit() {
    assert!(read_bnb4_dir(&fixtures().join("llama_gqa_untied")).unwrap().is_none());
}

/// The stored tensors of the fixture's down_proj (its parts), changed by `edit`, read back.
fn read_edited(edit: impl FnOnce(&mut BTreeMap<String, RawTensor>)) -> String {
    let mut parts = stored(&fixtures().join("nf4/tiny_llama_4bit/model.safetensors"));
    assert!(quant4_from_parts(W, &parts).is_ok(), "the fixture's weight reads before the edit");
    edit(&mut parts);
    quant4_from_parts(W, &parts).expect_err("an edited weight must be refused").to_string()
}

#[test]
fn a_corrupt_quant_state_is_refused_naming_the_tensor() {
    let e = read_edited(|p| {
        let qs = p.get_mut(&format!("{W}.quant_state.bitsandbytes__nf4")).unwrap();
        qs.data[0] = b'[';
    });
    assert!(e.contains(&format!("{W}.quant_state.bitsandbytes__nf4")) && e.contains("corrupt quant_state"), "{e}");
    let e = read_edited(|p| {
        let qs = p.get_mut(&format!("{W}.quant_state.bitsandbytes__nf4")).unwrap();
        let text = String::from_utf8(qs.data.clone()).unwrap().replace("\"blocksize\"", "\"blocksiz_\"");
        qs.data = text.into_bytes();
    });
    assert!(e.contains("no `blocksize`") && e.contains(W), "{e}");
}

#[test]
fn an_absmax_of_the_wrong_length_is_refused_naming_the_tensor() {
    let e = read_edited(|p| {
        let a = p.get_mut(&format!("{W}.absmax")).unwrap();
        a.data.pop();
        a.shape[0] -= 1;
    });
    assert!(e.contains(&format!("{W}.absmax has 95 values")) && e.contains("96 blocks"), "{e}");
    let e = read_edited(|p| {
        let a = p.get_mut(&format!("{W}.nested_absmax")).unwrap();
        a.data.extend_from_slice(&1.0f32.to_le_bytes());
        a.shape[0] += 1;
    });
    assert!(e.contains(&format!("{W}.nested_absmax has 2 values")), "{e}");
}

#[test]
fn an_unknown_quant_type_is_refused_by_name() {
    let e = read_edited(|p| {
        let key = format!("{W}.quant_state.bitsandbytes__nf4");
        let mut qs = p.remove(&key).unwrap();
        qs.data = String::from_utf8(qs.data).unwrap().replace("\"nf4\"", "\"int4\"").into_bytes();
        p.insert(format!("{W}.quant_state.bitsandbytes__int4"), qs);
    });
    assert!(e.contains(&format!("{W}.quant_state.bitsandbytes__int4")) && e.contains("quant_type \"int4\" is not supported"), "{e}");
}

#[test]
fn quantization_configs_this_reader_does_not_load_are_refused_by_key() {
    use ferrolm_nn::bnb4::bnb4_config;
    let p = Path::new("m/config.json");
    let cfg = |q: serde_json::Value| bnb4_config(&serde_json::json!({ "quantization_config": q }), p);
    let e = cfg(serde_json::json!({"quant_method": "gptq"})).unwrap_err().to_string();
    assert!(e.contains("m/config.json: quantization_config.quant_method") && e.contains("\"gptq\" is not supported"), "{e}");
    let e = cfg(serde_json::json!({"quant_method": "bitsandbytes", "load_in_8bit": true})).unwrap_err().to_string();
    assert!(e.contains("quantization_config.load_in_8bit"), "{e}");
    let q = serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "int4"});
    let e = cfg(q).unwrap_err().to_string();
    assert!(e.contains("quantization_config.bnb_4bit_quant_type") && e.contains("quant_type \"int4\" is not supported"), "{e}");
    let q = serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "fp4"});
    assert_eq!(cfg(q).unwrap().unwrap().quant_type, QuantType::Fp4);
    assert!(bnb4_config(&serde_json::json!({}), p).unwrap().is_none());
}

/// From the f32 base transformers loaded 4-bit, quantizing on load gives exactly the tensors its
/// saved checkpoint holds: codes, absmax codes, nested scales, offset, code books, shape, dtype.
#[test]
fn quantizing_the_base_on_load_gives_the_checkpoint_bitsandbytes_saved() {
    use ferrolm_nn::bnb4::{is_base_linear, quantize_dir};
    use ferrolm_ops::nf4::QuantSpec;
    let ours = quantize_dir(&fixtures().join("llama_gqa_untied"), QuantSpec::QLORA, &is_base_linear).unwrap();
    let bnb = read_bnb4_dir(&fixtures().join("nf4/tiny_llama_4bit")).unwrap().unwrap();
    assert_eq!(ours.quantized.keys().collect::<Vec<_>>(), bnb.quantized.keys().collect::<Vec<_>>());
    for (name, q) in &ours.quantized {
        assert!(q == &bnb.quantized[name], "{name}: quantized on load differs from bitsandbytes' checkpoint");
    }
    assert_eq!(ours.other.keys().collect::<Vec<_>>(), bnb.other.keys().collect::<Vec<_>>());
}

/// The 4-bit checkpoint as a model: its dequantized weights in a Llama give the logits and the
/// loss that transformers computes with the same weights (rel 1e-5).
#[test]
fn the_4bit_checkpoint_as_a_model_gives_the_reference_loss() {
    use ferrolm_nn::{shift_labels, Llama, LlamaConfig};
    use ferrolm_tensor::{DType, Device, Tensor};
    let dir = fixtures().join("nf4/tiny_llama_4bit");
    let ck = read_bnb4_dir(&dir).unwrap().unwrap();
    let cfg = LlamaConfig::from_file(dir.join("config.json")).unwrap();
    let model = Llama::from_tensors(cfg, ck.dequantized(DType::F32, Device::Cpu).unwrap(), DType::F32, Device::Cpu, &dir).unwrap();
    let r = ferrolm_nn::safetensors_io::load_safetensors(
        &fixtures().join("nf4/tiny_llama_4bit_reference.safetensors"),
        DType::F32,
        Device::Cpu,
    )
    .unwrap();
    let ids = &r["input_ids"];
    let (b, t) = (ids.dim(0), ids.dim(1));
    let rel = |a: &Tensor, e: &Tensor| {
        let (a, e) = (a.to_vec_f32().unwrap(), e.to_vec_f32().unwrap());
        let num = a.iter().zip(&e).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        num / e.iter().fold(0.0f32, |m, v| m.max(v.abs()))
    };
    let logits = model.forward(ids).unwrap();
    assert!(rel(&logits, &r["logits"]) < 1e-5, "logits rel err {}", rel(&logits, &r["logits"]));
    let labels: Vec<i32> = r["labels"].to_vec().unwrap();
    let targets = Tensor::from_vec(shift_labels(&labels, t), vec![b, t], Device::Cpu).unwrap();
    let loss = model.loss(ids, &targets).unwrap();
    assert!(rel(&loss, &r["loss"]) < 1e-5, "loss {:?} against transformers' {:?}", loss.to_vec_f32(), r["loss"].to_vec_f32());
    // The 4-bit rounding shows: the base's own loss is another number.
    let base = base_loss();
    assert!((base - loss.to_vec_f32().unwrap()[0]).abs() > 1e-5, "the quantized model's loss equals the base's");
}

/// transformers' loss of the f32 base (tests/fixtures/llama_gqa_untied/reference.safetensors).
fn base_loss() -> f32 {
    use ferrolm_tensor::{DType, Device};
    let r =
        ferrolm_nn::safetensors_io::load_safetensors(&fixtures().join("llama_gqa_untied/reference.safetensors"), DType::F32, Device::Cpu)
            .unwrap();
    r["loss"].to_vec_f32().unwrap()[0]
}

/// Sizes from a quant_state that would divide by zero or overflow are errors, not panics.
#[test]
fn a_zero_blocksize_or_an_overflowing_shape_is_an_error() {
    for (from, to, want) in [
        ("\"blocksize\": 64", "\"blocksize\": 0", "blocksize 0 is not one of"),
        ("\"nested_blocksize\": 256", "\"nested_blocksize\": 0", "nested_blocksize is 0"),
        ("\"shape\": [64, 96]", "\"shape\": [4294967296, 4294967296]", "more elements than memory can hold"),
    ] {
        let e = read_edited(|p| {
            let qs = p.get_mut(&format!("{W}.quant_state.bitsandbytes__nf4")).unwrap();
            let text = String::from_utf8(qs.data.clone()).unwrap();
            assert!(text.contains(from), "{text}");
            qs.data = text.replace(from, to).into_bytes();
        });
        assert!(e.contains(want) && e.contains(W), "{e}");
    }
}
