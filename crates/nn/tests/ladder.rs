//! The Ladder Transformer (Ladder Residual): the config format of the paper's released
//! checkpoints, the standard model recovered bit for bit with no Ladder layer, every Ladder
//! layer's backward against f64 finite differences, KV-cache decoding, activation
//! checkpointing, and conversion of a Llama checkpoint. Parity against the PyTorch reference
//! on committed fixtures is in `hf_parity` (`parity_ladder_*`).
use ferrolm_nn::{shift_labels, KvCache, LadderLayers, Llama, LlamaConfig};
use ferrolm_ops::{causal_attention, rms_norm, rope, swiglu};
use ferrolm_tensor::{no_grad, DType, Device, Rng, Tensor};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

mod common;
use common::TempDir;

fn ids(v: usize, b: usize, t: usize, seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    Tensor::from_vec((0..b * t).map(|_| rng.below(v as u64) as i32).collect::<Vec<_>>(), vec![b, t], Device::Cpu).unwrap()
}

fn targets(ids: &Tensor) -> Tensor {
    let t = ids.dim(1);
    Tensor::from_vec(shift_labels(&ids.to_vec::<i32>().unwrap(), t), ids.dims().to_vec(), Device::Cpu).unwrap()
}

/// (logits, loss, every parameter's gradient by name).
#[allow(clippy::type_complexity)]
fn loss_and_grads(m: &Llama, x: &Tensor) -> (Vec<f32>, f64, Vec<(String, Vec<f32>)>) {
    for (_, p) in m.parameters() {
        p.zero_grad();
    }
    let logits = m.forward(x).unwrap().to_vec::<f32>().unwrap();
    let loss = m.loss(x, &targets(x)).unwrap();
    loss.backward().unwrap();
    let g = m.parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap().to_vec::<f32>().unwrap())).collect();
    (logits, loss.item().unwrap(), g)
}

const BASE: &str = r#"{"vocab_size":64,"hidden_size":32,"intermediate_size":48,"num_hidden_layers":4,
    "num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":64,"rms_norm_eps":1e-5"#;

fn cfg(extra: &str) -> LlamaConfig {
    LlamaConfig::from_json_str(&format!("{BASE}{extra}}}")).unwrap()
}

// ---- config format ------------------------------------------------------------------------

#[test]
fn ladder_layers_int_and_list_forms() {
    let c = cfg(r#","model_type":"llamaLadder","ladder_layers":2"#);
    assert_eq!(c.ladder_layers, Some(LadderLayers::Last(2)));
    assert_eq!(c.ladder_layers.as_ref().unwrap().mask(4), [false, false, true, true]);
    let c = cfg(r#","model_type":"llamaLadder","ladder_layers":[0,2]"#);
    assert_eq!(c.ladder_layers.as_ref().unwrap().mask(4), [true, false, true, false]);
    // The released config class treats a missing value as no Ladder layer.
    let c = cfg(r#","model_type":"llamaLadder""#);
    assert_eq!(c.ladder_layers.as_ref().unwrap().mask(4), [false; 4]);
    // Plain Llama: no ladder field at all.
    assert_eq!(cfg("").ladder_layers, None);
    // Written back in the form it was given, in the paper's format.
    for extra in [r#","model_type":"llamaLadder","ladder_layers":3"#, r#","model_type":"llamaLadder","ladder_layers":[1,3]"#] {
        let c = cfg(extra);
        let v: serde_json::Value = serde_json::from_str(&c.to_json_string()).unwrap();
        assert_eq!(v["model_type"], "llamaLadder");
        assert_eq!(v["architectures"][0], "LlamaLadderForCausalLM");
        assert_eq!(v["auto_map"]["AutoModelForCausalLM"], "modeling_llama_ladder.LlamaLadderForCausalLM");
        assert_eq!(LlamaConfig::from_json_str(&c.to_json_string()).unwrap(), c);
    }
    let v: serde_json::Value = serde_json::from_str(&cfg("").to_json_string()).unwrap();
    assert_eq!(v["model_type"], "llama");
    assert!(v.get("ladder_layers").is_none());
}

#[test]
fn bad_ladder_layers_name_the_file_and_field() {
    let tmp = TempDir::new("badcfg");
    let path = tmp.0.join("config.json");
    let cases = [
        (r#","model_type":"llamaLadder","ladder_layers":5"#, "5 Ladder layers"),
        (r#","model_type":"llamaLadder","ladder_layers":-1"#, "non-negative"),
        (r#","model_type":"llamaLadder","ladder_layers":[0,4]"#, "out of range"),
        (r#","model_type":"llamaLadder","ladder_layers":[1,1]"#, "twice"),
        (r#","model_type":"llamaLadder","ladder_layers":"last"#, "ladder_layers"),
        (r#","model_type":"llamaLadder","ladder_layers":[0.5]"#, "ladder_layers"),
        (r#","model_type":"llamaLadder","ladder_layers":2.5"#, "ladder_layers"),
        (r#","ladder_layers":2"#, "llamaLadder"),
    ];
    for (extra, want) in cases {
        std::fs::write(&path, format!("{BASE}{extra}}}").replace("\"last}", "\"last\"}")).unwrap();
        let e = LlamaConfig::from_file(&path).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("ladder_layers") && e.contains(want), "{extra}: {e}");
    }
}

#[test]
fn ladder_layers_flag() {
    assert_eq!(LadderLayers::parse_flag("all", 6).unwrap(), LadderLayers::Last(6));
    assert_eq!(LadderLayers::parse_flag("3", 6).unwrap(), LadderLayers::Last(3));
    assert_eq!(LadderLayers::parse_flag("0,2,5", 6).unwrap(), LadderLayers::List(vec![0, 2, 5]));
    assert_eq!(LadderLayers::parse_flag("4,", 6).unwrap(), LadderLayers::List(vec![4]));
    for bad in ["7", "0,6", "x", "1,1", "-1"] {
        let e = LadderLayers::parse_flag(bad, 6).unwrap_err().to_string();
        assert!(e.contains("--ladder-layers"), "{bad}: {e}");
    }
}

// ---- the schedule -----------------------------------------------------------------------------

/// `ladder_layers: 0` (and an empty list) compute the plain Llama bit for bit: logits, loss,
/// every gradient. All layers Ladder computes something else.
#[test]
fn no_ladder_layer_is_the_standard_model_bitwise() {
    for name in ["llama_gqa_untied", "llama_mha_tied", "llama3_rope"] {
        let dir = fixtures().join(name);
        let plain = Llama::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
        let x = ids(plain.config().vocab_size, 2, 11, 1);
        let want = loss_and_grads(&plain, &x);
        let n = plain.config().num_hidden_layers;
        for l in [LadderLayers::Last(0), LadderLayers::List(vec![])] {
            let mut m = Llama::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
            m.set_ladder_layers(Some(l)).unwrap();
            let got = loss_and_grads(&m, &x);
            assert_eq!(got.0, want.0, "{name}: logits differ");
            assert_eq!(got.1.to_bits(), want.1.to_bits(), "{name}: loss differs");
            assert_eq!(got.2, want.2, "{name}: gradients differ");
        }
        let mut all = Llama::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
        all.set_ladder_layers(Some(LadderLayers::Last(n))).unwrap();
        let got = loss_and_grads(&all, &x);
        let diff = got.0.iter().zip(&want.0).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff > 1e-4, "{name}: an all-Ladder model gave the plain model's logits (max diff {diff})");
    }
}

/// The recurrence written out by hand with plain tensor ops, independent of the model's
/// schedule code: h = p = embedding; a standard layer: a = h + attn(h), m = a + mlp(a); a
/// Ladder layer: a = h + attn(p), m = a + mlp(h); then h = m, p = a.
#[test]
fn schedule_matches_the_released_recurrence() {
    let c = cfg(r#","model_type":"llamaLadder","ladder_layers":[0,2,3]"#);
    let m = Llama::new(c.clone(), DType::F64, Device::Cpu, &mut Rng::new(3)).unwrap();
    let x = ids(c.vocab_size, 2, 9, 4);
    let _g = no_grad();
    let attn = |l: usize, h: &Tensor| -> Tensor {
        // One layer's attention branch alone: a one-layer standard model would add more, so run
        // the branch through the public modules.
        let a = &m.layers[l].self_attn;
        let hn = rms_norm(h, &a.input_layernorm, c.rms_norm_eps).unwrap();
        let (b, t) = (h.dim(0), h.dim(1));
        let d = c.head_dim;
        let sh = |y: Tensor| y.reshape(vec![b, t, y.dim(2) / d, d]).unwrap().permute(&[0, 2, 1, 3]).unwrap();
        let (cos, sin) = rope_tables(&c, t);
        let q = rope(&sh(a.q_proj.forward(&hn).unwrap()), &cos, &sin).unwrap();
        let k = rope(&sh(a.k_proj.forward(&hn).unwrap()), &cos, &sin).unwrap();
        let v = sh(a.v_proj.forward(&hn).unwrap());
        let y = causal_attention(&q, &k, &v, 1.0 / (d as f64).sqrt()).unwrap();
        a.o_proj.forward(&y.permute(&[0, 2, 1, 3]).unwrap().reshape(vec![b, t, c.num_attention_heads * d]).unwrap()).unwrap()
    };
    let mlp = |l: usize, h: &Tensor| -> Tensor {
        let p = &m.layers[l].mlp;
        let hn = rms_norm(h, &p.post_attention_layernorm, c.rms_norm_eps).unwrap();
        p.down_proj.forward(&swiglu(&p.gate_proj.forward(&hn).unwrap(), &p.up_proj.forward(&hn).unwrap()).unwrap()).unwrap()
    };
    let mut h = m.embed_tokens.forward(&x).unwrap();
    let mut p = h.clone();
    for l in 0..c.num_hidden_layers {
        let (a, mm) = if m.layers[l].ladder {
            let a = h.add(&attn(l, &p)).unwrap();
            let mm = a.add(&mlp(l, &h)).unwrap();
            (a, mm)
        } else {
            let a = h.add(&attn(l, &h)).unwrap();
            let mm = a.add(&mlp(l, &a)).unwrap();
            (a, mm)
        };
        h = mm;
        p = a;
    }
    let head = m.lm_head.as_ref().unwrap_or(&m.embed_tokens.weight);
    let logits = ferrolm_nn::module::linear(&rms_norm(&h, &m.norm, c.rms_norm_eps).unwrap(), head).unwrap();
    let got = m.forward(&x).unwrap();
    let (a, b) = (got.to_vec::<f64>().unwrap(), logits.to_vec::<f64>().unwrap());
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    assert!(diff < 1e-12, "schedule differs from the recurrence by {diff}");
}

/// HF rope tables in f64 for positions 0..t (the same formula as the model's).
fn rope_tables(c: &LlamaConfig, t: usize) -> (Tensor, Tensor) {
    let d = c.head_dim;
    let inv: Vec<f32> = (0..d / 2).map(|i| (1.0 / c.rope_theta.powf((2 * i) as f64 / d as f64)) as f32).collect();
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for pos in 0..t {
        for j in 0..d {
            let a = (pos as f32 * inv[j % (d / 2)]) as f64;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (Tensor::from_vec(cos, vec![t, d], Device::Cpu).unwrap(), Tensor::from_vec(sin, vec![t, d], Device::Cpu).unwrap())
}

/// Every parameter of every Ladder layer (and the embedding that feeds layer 0's stale
/// stream), against central differences in f64.
#[test]
fn ladder_layers_backward_matches_finite_differences() {
    let c = cfg(r#","model_type":"llamaLadder","ladder_layers":[0,2,3],"tie_word_embeddings":true"#);
    let m = Llama::new(LlamaConfig { initializer_range: 0.3, ..c.clone() }, DType::F64, Device::Cpu, &mut Rng::new(5)).unwrap();
    let x = ids(c.vocab_size, 2, 7, 6);
    let y = targets(&x);
    m.loss(&x, &y).unwrap().backward().unwrap();
    let ladder: Vec<usize> = (0..c.num_hidden_layers).filter(|&l| m.layers[l].ladder).collect();
    let mut rng = Rng::new(9);
    let mut checked = 0;
    for (name, p) in m.parameters() {
        let in_ladder = ladder.iter().any(|l| name.starts_with(&format!("model.layers.{l}.")));
        if !in_ladder && name != "model.embed_tokens.weight" {
            continue;
        }
        let g = p.grad().unwrap().to_vec::<f64>().unwrap();
        let n = p.numel();
        for _ in 0..4 {
            let i = rng.below(n as u64) as usize;
            let eps = 1e-5;
            let mut w = p.to_vec::<f64>().unwrap();
            let orig = w[i];
            let _g = no_grad();
            let mut at = |v: f64| {
                w[i] = v;
                p.assign(&Tensor::from_vec(w.clone(), p.dims().to_vec(), Device::Cpu).unwrap()).unwrap();
                m.loss(&x, &y).unwrap().item().unwrap()
            };
            let fd = (at(orig + eps) - at(orig - eps)) / (2.0 * eps);
            at(orig);
            let err = (fd - g[i]).abs() / (fd.abs() + g[i].abs()).max(1e-6);
            assert!(err < 1e-6, "{name}[{i}]: autograd {} vs finite difference {fd} (rel {err:.2e})", g[i]);
            checked += 1;
        }
    }
    assert!(checked >= 3 * 9 * 4, "only {checked} elements checked");
}

#[test]
fn kv_cache_matches_full_forward_for_ladder() {
    for extra in [r#","model_type":"llamaLadder","ladder_layers":4"#, r#","model_type":"llamaLadder","ladder_layers":[0,2]"#] {
        let c = cfg(extra);
        let m = Llama::new(LlamaConfig { initializer_range: 0.2, ..c.clone() }, DType::F32, Device::Cpu, &mut Rng::new(8)).unwrap();
        let _g = no_grad();
        let x = ids(c.vocab_size, 2, 12, 5);
        let full = m.forward(&x).unwrap().to_vec::<f32>().unwrap();
        let mut cache = KvCache::new();
        let mut parts = vec![m.forward_with_cache(&x.narrow(1, 0, 7).unwrap().contiguous().unwrap(), &mut cache).unwrap()];
        for t in 7..12 {
            parts.push(m.forward_with_cache(&x.narrow(1, t, 1).unwrap().contiguous().unwrap(), &mut cache).unwrap());
        }
        let cached = Tensor::cat(&parts, 1).unwrap().to_vec::<f32>().unwrap();
        let scale = full.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
        let diff = cached.iter().zip(&full).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff / scale < 1e-5, "{extra}: cached logits rel err {}", diff / scale);
    }
}

#[test]
fn activation_checkpointing_is_bitwise_for_ladder() {
    let c = cfg(r#","model_type":"llamaLadder","ladder_layers":[0,3]"#);
    let x = ids(c.vocab_size, 2, 10, 2);
    let run = |ckpt: bool| {
        let mut m = Llama::new(c.clone(), DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap();
        m.set_activation_checkpointing(ckpt);
        loss_and_grads(&m, &x)
    };
    let (a, b) = (run(false), run(true));
    assert_eq!(a.1.to_bits(), b.1.to_bits());
    assert_eq!(a.2, b.2, "checkpointed gradients differ");
}

/// A Llama checkpoint converted to Ladder saves in the paper's format with unchanged tensor
/// names, and loads back as the same Ladder model.
#[test]
fn converted_checkpoint_round_trips() {
    let mut m = Llama::from_pretrained(&fixtures().join("llama_gqa_untied"), DType::F32, Device::Cpu).unwrap();
    let names: Vec<String> = m.parameters().into_iter().map(|(n, _)| n).collect();
    m.set_ladder_layers(Some(LadderLayers::Last(1))).unwrap();
    let tmp = TempDir::new("convert");
    m.save_pretrained(&tmp.0).unwrap();
    let text = std::fs::read_to_string(tmp.0.join("config.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!((v["model_type"].as_str(), v["ladder_layers"].as_u64()), (Some("llamaLadder"), Some(1)));
    let again = Llama::from_pretrained(&tmp.0, DType::F32, Device::Cpu).unwrap();
    assert_eq!(again.parameters().into_iter().map(|(n, _)| n).collect::<Vec<_>>(), names);
    assert_eq!(again.layers.iter().map(|b| b.ladder).collect::<Vec<_>>(), [false, true]);
    let x = ids(m.config().vocab_size, 1, 9, 3);
    assert_eq!(m.forward(&x).unwrap().to_vec::<f32>().unwrap(), again.forward(&x).unwrap().to_vec::<f32>().unwrap());
    // An out-of-range conversion is refused and leaves the model as it was.
    assert!(m.set_ladder_layers(Some(LadderLayers::List(vec![2]))).is_err());
    assert_eq!(m.config().ladder_layers, Some(LadderLayers::Last(1)));
}

// ---- the flat parameter store ---------------------------------------------------------------

/// Moving the parameters into flat buffers changes no value and no gradient; the model's
/// parameters are views of the buffers (an update through the buffer is seen by the model).
#[test]
fn flat_store_is_transparent() {
    use ferrolm_nn::buckets::ParamBuckets;
    let c = cfg(r#","model_type":"llamaLadder","ladder_layers":2,"tie_word_embeddings":true"#);
    let x = ids(c.vocab_size, 2, 8, 3);
    let plain = Llama::new(c.clone(), DType::F32, Device::Cpu, &mut Rng::new(2)).unwrap();
    let want = loss_and_grads(&plain, &x);
    let mut m = Llama::new(c.clone(), DType::F32, Device::Cpu, &mut Rng::new(2)).unwrap();
    let store = ParamBuckets::from_model(&mut m, 64).unwrap();
    assert_eq!(
        store.buckets.iter().map(|b| b.name.as_str()).collect::<Vec<_>>(),
        ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    );
    assert!(store.buckets.iter().all(|b| b.padded % 64 == 0 && b.padded >= b.numel));
    assert_eq!(store.numel(), m.num_params());
    let got = loss_and_grads(&m, &x);
    assert_eq!(got.0, want.0);
    assert_eq!(got.2, want.2);
    // Writing the flat buffer moves the model.
    let (b, i) = store.find("model.norm.weight").unwrap();
    let _g = no_grad();
    store.buckets[b].view(i).unwrap().assign(&Tensor::full([c.hidden_size], 2.0, DType::F32, Device::Cpu).unwrap()).unwrap();
    let norm = m.parameters().into_iter().find(|(n, _)| n == "model.norm.weight").unwrap().1;
    assert!(norm.to_vec::<f32>().unwrap().iter().all(|&v| v == 2.0));
}
