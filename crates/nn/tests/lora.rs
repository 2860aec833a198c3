//! LoRA against Hugging Face PEFT (tests/fixtures/lora_*, scripts/make_lora_fixtures.py): the
//! adapted logits and loss, every adapter factor's gradient, and the merged model's logits, in
//! f32 on the CPU with relative error max|ours - peft| / max|peft| < 1e-5 per tensor; a frozen
//! base; PEFT's initialisation; the adapter files both ways; and the errors a user sees for
//! adapters that do not fit.
use ferrolm_nn::lora::peft::{config_json, read_adapter, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use ferrolm_nn::lora::{factor_name, LoraConfig, Proj};
use ferrolm_nn::module::Factor;
use ferrolm_nn::safetensors_io::load_safetensors;
use ferrolm_nn::{shift_labels, Llama};
use ferrolm_tensor::{DType, Device, Rng, Tensor};
use std::path::Path;

mod common;
use common::{fixtures, rel_err, TempDir};

const TOL: f64 = 1e-5;

/// (base fixture, adapter fixture)
const FIXTURES: [(&str, &str); 3] =
    [("llama_gqa_untied", "lora_llama"), ("llama_mha_tied", "lora_rslora_tied"), ("ladder_int_gqa_untied", "lora_ladder")];

fn adapted(base: &str, adapter: &str) -> Llama {
    let mut m = Llama::from_pretrained(&fixtures().join(base), DType::F32, Device::Cpu).unwrap();
    m.load_adapter(&fixtures().join(adapter)).unwrap();
    m
}

#[test]
fn logits_loss_gradients_and_merge_equal_peft() {
    for (base, name) in FIXTURES {
        let mut model = adapted(base, name);
        let r = load_safetensors(&fixtures().join(name).join("reference.safetensors"), DType::F32, Device::Cpu).unwrap();
        let ids = &r["input_ids"];
        let (b, t) = (ids.dim(0), ids.dim(1));
        let e_logits = rel_err(&model.forward(ids).unwrap(), &r["logits"]);

        let labels: Vec<i32> = r["labels"].to_vec().unwrap();
        let targets = Tensor::from_vec(shift_labels(&labels, t), vec![b, t], Device::Cpu).unwrap();
        let loss = model.loss(ids, &targets).unwrap();
        let e_loss = rel_err(&loss, &r["loss"]);
        loss.backward().unwrap();

        // Only the adapters learn: PEFT's trainable parameters, no base weight has a gradient.
        let adapters = model.trainable_parameters();
        let n_ref = r.keys().filter(|k| k.starts_with("grad.")).count();
        assert_eq!(adapters.len(), n_ref, "{name}: adapter factors differ from PEFT's");
        for (n, p) in model.parameters() {
            assert!(!p.requires_grad() && p.grad().is_none(), "{name}: base weight {n} is not frozen");
        }
        let mut e_grad: f64 = 0.0;
        for (n, p, _) in &adapters {
            let reference = r.get(&format!("grad.base_model.model.{n}")).unwrap_or_else(|| panic!("{name}: no PEFT gradient for {n}"));
            e_grad = e_grad.max(rel_err(&p.grad().unwrap_or_else(|| panic!("{name}: no gradient for {n}")), reference));
        }

        model.merge_lora().unwrap();
        assert!(model.lora_config().is_none() && model.trainable_parameters().len() == model.parameters().len());
        let merged = model.forward(ids).unwrap();
        let e_merged = rel_err(&merged, &r["merged_logits"]);
        let e_merged_vs_adapted = rel_err(&merged, &r["logits"]);
        eprintln!("{name}: rel err logits {e_logits:.2e}, loss {e_loss:.2e}, grads max {e_grad:.2e}, merged {e_merged:.2e} ({e_merged_vs_adapted:.2e} from the adapted logits)");
        assert!(e_logits < TOL && e_loss < TOL && e_grad < TOL, "{name}: logits {e_logits}, loss {e_loss}, grads {e_grad}");
        assert!(e_merged < TOL && e_merged_vs_adapted < TOL, "{name}: merged {e_merged}, vs adapted {e_merged_vs_adapted}");
    }
}

#[test]
fn every_adapter_fixture_is_covered() {
    let mut names: Vec<String> = std::fs::read_dir(fixtures())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join(ADAPTER_CONFIG).is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut covered: Vec<&str> = FIXTURES.iter().map(|f| f.1).chain(["lora_trained"]).collect();
    covered.sort();
    assert_eq!(names, covered);
}

/// tests/fixtures/lora_trained: an adapter ferrolm trained and wrote (crates/nn/examples/
/// train_lora.rs), which PEFT loads (scripts/make_lora_fixtures.py --trained checks every factor)
/// and scores on fresh tokens: ferrolm's loss with it is PEFT's.
#[test]
fn an_adapter_ferrolm_trained_gives_peft_s_loss() {
    let (base, dir) = (fixtures().join("llama_gqa_untied"), fixtures().join("lora_trained"));
    let mut m = Llama::from_pretrained(&base, DType::F32, Device::Cpu).unwrap();
    let r = load_safetensors(&dir.join("peft_eval.safetensors"), DType::F32, Device::Cpu).unwrap();
    let ids = &r["input_ids"];
    let (b, t) = (ids.dim(0), ids.dim(1));
    let targets = Tensor::from_vec(shift_labels(&ids.to_vec::<i32>().unwrap(), t), vec![b, t], Device::Cpu).unwrap();
    let e_base = rel_err(&m.loss(ids, &targets).unwrap(), &r["base_loss"]);
    let cfg = m.load_adapter(&dir).unwrap();
    let written = std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).unwrap();
    assert_eq!(written, config_json(&cfg, "tests/fixtures/llama_gqa_untied"), "ferrolm's writer made adapter_config.json");
    let e = rel_err(&m.loss(ids, &targets).unwrap(), &r["loss"]);
    let moved = rel_err(&r["base_loss"], &r["loss"]);
    eprintln!("lora_trained: rel err loss {e:.2e} (base {e_base:.2e}); the adapter moves the loss by {moved:.2e}");
    assert!(e < TOL && e_base < TOL && moved > 100.0 * TOL, "loss {e}, base {e_base}, adapter effect {moved}");
}

#[test]
fn a_fresh_adapter_is_the_base_model_and_initialised_as_peft() {
    let dir = fixtures().join("llama_gqa_untied");
    let r = load_safetensors(&dir.join("reference.safetensors"), DType::F32, Device::Cpu).unwrap();
    let mut m = Llama::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
    let base_logits = m.forward(&r["input_ids"]).unwrap().to_vec_f64().unwrap();
    let cfg = LoraConfig::new(4, None, 0.0, Proj::ALL.to_vec(), false).unwrap();
    assert_eq!((cfg.alpha, cfg.scale()), (8.0, 2.0)); // alpha defaults to 2R
    m.add_lora(&cfg, &mut Rng::new(7)).unwrap();
    assert_eq!(m.forward(&r["input_ids"]).unwrap().to_vec_f64().unwrap(), base_logits, "B = 0: step 0 is the base model");
    let c = m.config().clone();
    let (kv, inter) = (c.num_key_value_heads * c.head_dim, c.intermediate_size);
    for (n, t, _) in m.trainable_parameters() {
        assert_eq!(t.dtype(), DType::F32);
        let v = t.to_vec_f64().unwrap();
        if n.contains("lora_B") {
            assert!(v.iter().all(|&x| x == 0.0), "{n}: B starts at zero");
        } else {
            // Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in)), and it fills the range.
            let bound = 1.0 / (t.dim(1) as f64).sqrt();
            let max = v.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            assert!(max <= bound && max > 0.8 * bound, "{n}: max |A| {max}, bound {bound}");
        }
    }
    let shape = |n: String| m.trainable_parameters().into_iter().find(|(k, ..)| *k == n).unwrap().1.dims().to_vec();
    assert_eq!(shape(factor_name(1, Proj::K, Factor::B)), [kv, 4]);
    assert_eq!(shape(factor_name(0, Proj::Down, Factor::A)), [4, inter]);
    // rsLoRA scales by alpha / sqrt(R).
    assert_eq!(LoraConfig::new(16, Some(8.0), 0.0, vec![Proj::Q], true).unwrap().scale(), 2.0);
}

#[test]
fn adapters_round_trip_through_peft_files() {
    let m = adapted("llama_mha_tied", "lora_rslora_tied");
    let tmp = TempDir::new("roundtrip");
    m.save_adapter(&tmp.0, "some/base").unwrap();
    let text = std::fs::read_to_string(tmp.0.join(ADAPTER_CONFIG)).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (k, want) in [
        ("peft_type", serde_json::json!("LORA")),
        ("r", serde_json::json!(8)),
        ("lora_alpha", serde_json::json!(4)),
        ("use_rslora", serde_json::json!(true)),
        ("bias", serde_json::json!("none")),
        ("task_type", serde_json::json!("CAUSAL_LM")),
        ("base_model_name_or_path", serde_json::json!("some/base")),
        ("target_modules", serde_json::json!(["q_proj", "v_proj", "down_proj"])),
        ("layers_to_transform", serde_json::json!([1])),
        ("lora_dropout", serde_json::json!(0.0)),
    ] {
        assert_eq!(v[k], want, "adapter_config.json field {k}");
    }
    let written = load_safetensors(&tmp.0.join(ADAPTER_WEIGHTS), DType::F32, Device::Cpu).unwrap();
    let original = load_safetensors(&fixtures().join("lora_rslora_tied").join(ADAPTER_WEIGHTS), DType::F32, Device::Cpu).unwrap();
    assert_eq!(written.keys().collect::<Vec<_>>(), original.keys().collect::<Vec<_>>(), "PEFT's tensor names");
    for (k, t) in &written {
        assert_eq!(t.to_vec_f64().unwrap(), original[k].to_vec_f64().unwrap(), "{k}");
    }
    let (cfg, _) = read_adapter(&tmp.0, m.config(), Device::Cpu).unwrap();
    assert_eq!(&cfg, m.lora_config().unwrap());
    assert_eq!(config_json(&cfg, "some/base"), text);
}

/// Writes an adapter for `base` with `edit` applied to its config, and the error reading it gives.
fn refusal(base: &str, adapter: &str, edit: impl Fn(&mut serde_json::Value)) -> String {
    let tmp = TempDir::new(&format!("bad-{}", edit_id()));
    let src = fixtures().join(adapter);
    std::fs::copy(src.join(ADAPTER_WEIGHTS), tmp.0.join(ADAPTER_WEIGHTS)).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join(ADAPTER_CONFIG)).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(tmp.0.join(ADAPTER_CONFIG), v.to_string()).unwrap();
    let mut m = Llama::from_pretrained(&fixtures().join(base), DType::F32, Device::Cpu).unwrap();
    let e = m.load_adapter(&tmp.0).expect_err("the adapter must be refused").to_string();
    assert!(m.lora_config().is_none(), "a refused adapter leaves the model alone");
    e
}

fn edit_id() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

#[test]
fn adapters_that_do_not_fit_are_refused_naming_the_field() {
    let set = |k: &'static str, x: serde_json::Value| move |v: &mut serde_json::Value| v[k] = x.clone();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(Edit, &[&str])> = vec![
        (Box::new(set("use_dora", true.into())), &["adapter_config.json", "`use_dora`", "DoRA"]),
        (Box::new(set("bias", "all".into())), &["adapter_config.json", "`bias`", "\"all\""]),
        (Box::new(set("modules_to_save", serde_json::json!(["lm_head"]))), &["`modules_to_save`"]),
        (Box::new(set("r", 0.into())), &["`r`", "positive"]),
        // An `r` that disagrees with the factors is the config's fault, not another base's.
        (Box::new(set("r", 7.into())), &["adapter_model.safetensors", "lora_A.weight", "adapter_config.json has `r` 7", "disagree"]),
        (Box::new(set("peft_type", "LOHA".into())), &["`peft_type`", "LOHA"]),
        (Box::new(set("rank_pattern", serde_json::json!({"q_proj": 8}))), &["`rank_pattern`"]),
        (Box::new(set("target_modules", serde_json::json!(["query", "value"]))), &["`target_modules`", "query, value", "another base"]),
        (Box::new(set("target_modules", serde_json::json!(["q_proj", "lm_head"]))), &["`target_modules`", "`lm_head`"]),
        (Box::new(set("target_modules", serde_json::json!(["q_proj"]))), &["adapter_model.safetensors", "unexpected tensor"]),
        (
            Box::new(set("target_modules", serde_json::json!(r"model\.layers\.0\.self_attn\.q_proj|model\.layers\.1\.mlp\.up_proj"))),
            &["different projections in different blocks"],
        ),
    ];
    for (edit, want) in cases {
        let e = refusal("llama_gqa_untied", "lora_llama", edit);
        for w in want {
            assert!(e.contains(w), "error {e:?} lacks {w:?}");
        }
    }
    // An adapter trained on another base: the shapes do not fit (hidden 64 vs 32).
    let e = refusal("llama_mha_tied", "lora_llama", |_| {});
    for w in ["adapter_model.safetensors", "lora_A.weight", "another base", "llama_gqa_untied"] {
        assert!(e.contains(w), "error {e:?} lacks {w:?}");
    }
    // A model directory with no adapter.
    let mut m = Llama::from_pretrained(&fixtures().join("llama_gqa_untied"), DType::F32, Device::Cpu).unwrap();
    let e = m.load_adapter(&fixtures().join("llama_gqa_untied")).unwrap_err().to_string();
    assert!(e.contains("no adapter_config.json") && e.contains("llama_gqa_untied"), "{e}");
}

#[test]
fn peft_target_forms_select_the_same_modules() {
    // PEFT's forms of one selection: names, full module paths (what "all-linear" saves), a
    // regular expression, an exclusion, and layers_to_transform.
    let base = Llama::from_pretrained(&fixtures().join("llama_gqa_untied"), DType::F32, Device::Cpu).unwrap();
    let read = |edit: &dyn Fn(&mut serde_json::Value)| {
        let tmp = TempDir::new(&format!("forms-{}", edit_id()));
        let src = fixtures().join("lora_llama");
        std::fs::copy(src.join(ADAPTER_WEIGHTS), tmp.0.join(ADAPTER_WEIGHTS)).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join(ADAPTER_CONFIG)).unwrap()).unwrap();
        edit(&mut v);
        std::fs::write(tmp.0.join(ADAPTER_CONFIG), v.to_string()).unwrap();
        read_adapter(&tmp.0, base.config(), Device::Cpu).map(|(c, t)| (c.targets, c.layers, t.len()))
    };
    let all = (Proj::ALL.to_vec(), None, 28);
    let paths: Vec<String> = (0..2).flat_map(|l| Proj::ALL.map(|p| format!("model.layers.{l}.{}", p.path()))).collect();
    assert_eq!(read(&|_| {}).unwrap(), all);
    assert_eq!(read(&|v| v["target_modules"] = serde_json::json!(paths)).unwrap(), all);
    assert_eq!(read(&|v| v["target_modules"] = serde_json::json!(r".*\.(self_attn|mlp)\.\w+_proj")).unwrap(), all);
    // Fewer modules than the file holds: its extra tensors are refused.
    let e = read(&|v| v["exclude_modules"] = serde_json::json!(["o_proj"])).unwrap_err().to_string();
    assert!(e.contains("unexpected tensor") && e.contains("o_proj"), "{e}");
    let e = read(&|v| v["layers_to_transform"] = serde_json::json!([1])).unwrap_err().to_string();
    assert!(e.contains("unexpected tensor") && e.contains("layers.0."), "{e}");
}

#[test]
fn a_ladder_adapter_keeps_the_llama_module_names_and_merges_into_a_ladder_checkpoint() {
    let mut m = adapted("ladder_int_gqa_untied", "lora_ladder");
    let r = load_safetensors(&fixtures().join("lora_ladder").join("reference.safetensors"), DType::F32, Device::Cpu).unwrap();
    let tmp = TempDir::new("ladder");
    m.merge_lora().unwrap();
    m.save_pretrained(&tmp.0).unwrap();
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tmp.0.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "llamaLadder");
    let again = Llama::from_pretrained(&tmp.0, DType::F32, Device::Cpu).unwrap();
    let e = rel_err(&again.forward(&r["input_ids"]).unwrap(), &r["merged_logits"]);
    assert!(e < TOL, "the merged Ladder checkpoint's logits: rel err {e}");
    assert!(load_safetensors(&fixtures().join("lora_ladder").join(ADAPTER_WEIGHTS), DType::F32, Device::Cpu)
        .unwrap()
        .keys()
        .all(|k| k.starts_with("base_model.model.model.layers.")));
}

#[test]
fn saving_needs_adapters_and_bad_settings_name_the_flag() {
    let m = Llama::from_pretrained(&fixtures().join("llama_gqa_untied"), DType::F32, Device::Cpu).unwrap();
    assert!(m.save_adapter(Path::new("/nonexistent"), "x").unwrap_err().to_string().contains("no LoRA adapters"));
    let e = LoraConfig::new(0, None, 0.0, vec![Proj::Q], false).unwrap_err().to_string();
    assert!(e.contains("--lora-rank"), "{e}");
    let e = LoraConfig::new(4, None, 1.0, vec![Proj::Q], false).unwrap_err().to_string();
    assert!(e.contains("--lora-dropout"), "{e}");
    let e = Proj::parse_list("q,qkv").unwrap_err().to_string();
    assert!(e.contains("--lora-targets") && e.contains("`qkv`"), "{e}");
    assert_eq!(Proj::parse_list("all-linear").unwrap(), Proj::ALL.to_vec());
    // `all-linear` in a list: not called an unknown layer beside a list of known ones naming it.
    let e = Proj::parse_list("all-linear,q").unwrap_err().to_string();
    assert!(e.contains("--lora-targets") && e.contains("`all-linear` stands alone") && !e.contains("is not a linear layer"), "{e}");
    assert_eq!(Proj::parse_list("v_proj, q ,v").unwrap(), vec![Proj::Q, Proj::V]);
}
