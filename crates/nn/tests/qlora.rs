//! QLoRA against transformers + bitsandbytes + PEFT on the CPU (tests/fixtures/qlora,
//! scripts/make_qlora_fixtures.py): a tiny Llama whose linear layers bitsandbytes holds 4-bit
//! (NF4, double quantization) under a PEFT adapter. The loss and the gradient of every A and B
//! equal those bitsandbytes' Linear4bit and PEFT compute (rel 1e-4), whether ferrolm quantizes
//! the f32 base on load or reads the checkpoint transformers saved 4-bit; the base is frozen
//! and 4-bit; merging dequantizes; bad 4-bit checkpoints are refused naming the tensor.
use ferrolm_nn::bnb4::read_bnb4_dir;
use ferrolm_nn::qlora::QuantSource;
use ferrolm_nn::safetensors_io::load_safetensors;
use ferrolm_nn::{shift_labels, Llama};
use ferrolm_ops::nf4::{QuantSpec, QuantType};
use ferrolm_tensor::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

mod common;
use common::{fixtures, rel_err, TempDir};

const TOL: f64 = 1e-4;

fn qlora(name: &str) -> std::path::PathBuf {
    fixtures().join("qlora").join(name)
}

fn reference() -> BTreeMap<String, Tensor> {
    load_safetensors(&qlora("reference.safetensors"), DType::F32, Device::Cpu).unwrap().into_iter().collect()
}

/// The loss of `model` on the fixture's batch, with its backward run.
fn loss(model: &Llama, r: &BTreeMap<String, Tensor>) -> Tensor {
    let ids = &r["input_ids"];
    let (b, t) = (ids.dim(0), ids.dim(1));
    let labels: Vec<i32> = r["labels"].to_vec().unwrap();
    let targets = Tensor::from_vec(shift_labels(&labels, t), vec![b, t], Device::Cpu).unwrap();
    model.loss(ids, &targets).unwrap()
}

#[test]
fn qlora_loss_and_adapter_gradients_equal_bitsandbytes_and_peft() {
    let r = reference();
    let on_load = Llama::from_pretrained_quantized(&qlora("base"), DType::F32, Device::Cpu, QuantSpec::QLORA).unwrap();
    let saved = Llama::from_pretrained(&qlora("base_4bit"), DType::F32, Device::Cpu).unwrap();
    for (what, mut model, source) in [("quantized on load", on_load, QuantSource::OnLoad), ("saved 4-bit", saved, QuantSource::Checkpoint)]
    {
        let q = model.quant_base().cloned().unwrap_or_else(|| panic!("{what}: no 4-bit base"));
        assert_eq!((q.weights, q.quant_type, q.source), (14, QuantType::Nf4, source), "{what}");
        // 4 + 8/64 + 32/(64 x 256) = 4.127 on large weights; these 4096-element ones fill only a
        // quarter of a nested block of 256, so each nested scale costs more a parameter.
        assert!((4.127..4.15).contains(&q.bits_per_param()), "{what}: {} bits a parameter", q.bits_per_param());
        assert!(q.describe(DType::F32).contains("the embeddings, norms, biases and LM head stay in f32"), "{}", q.describe(DType::F32));
        model.load_adapter(&qlora("adapter")).unwrap();
        let l = loss(&model, &r);
        let e_loss = rel_err(&l, &r["loss"]);
        l.backward().unwrap();
        let adapters = model.trainable_parameters();
        assert_eq!(adapters.len(), 28, "{what}: only the adapters train");
        for (n, p) in model.parameters() {
            assert!(!p.requires_grad() && p.grad().is_none(), "{what}: base weight {n} is not frozen");
        }
        let mut e_grad: f64 = 0.0;
        for (n, p, _) in &adapters {
            let want = r.get(&format!("grad.base_model.model.{n}")).unwrap_or_else(|| panic!("no PEFT gradient for {n}"));
            e_grad = e_grad.max(rel_err(&p.grad().unwrap(), want));
        }
        eprintln!("{what}: rel err loss {e_loss:.2e}, gradients of A and B max {e_grad:.2e}");
        assert!(e_loss < TOL && e_grad < TOL, "{what}: loss {e_loss}, gradients {e_grad}");
    }
}

/// The 16-bit copies are never made: every quantized layer carries a one-element placeholder.
#[test]
fn the_quantized_layers_hold_no_dense_weight() {
    let model = Llama::from_pretrained_quantized(&qlora("base"), DType::F32, Device::Cpu, QuantSpec::QLORA).unwrap();
    for (n, p) in model.parameters() {
        let stored = p.layout().strides.iter().zip(p.dims()).all(|(s, _)| *s == 0);
        assert_eq!(stored, n.ends_with("_proj.weight"), "{n}: strides {:?}", p.layout().strides);
    }
}

/// transformers' checkpoint saved 4-bit (tests/fixtures/nf4/tiny_llama_4bit) loads with no flag
/// and gives its reference loss; quantizing its f32 base on load gives the very same model.
#[test]
fn a_4bit_checkpoint_loads_with_no_flag_and_equals_quantizing_on_load() {
    let r: BTreeMap<String, Tensor> =
        load_safetensors(&fixtures().join("nf4/tiny_llama_4bit_reference.safetensors"), DType::F32, Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    let saved = Llama::from_pretrained(&fixtures().join("nf4/tiny_llama_4bit"), DType::F32, Device::Cpu).unwrap();
    assert_eq!(saved.quant_base().map(|q| q.weights), Some(14));
    let l = loss(&saved, &r);
    assert!(rel_err(&l, &r["loss"]) < 1e-5, "loss {:?} against transformers' {:?}", l.to_vec_f32(), r["loss"].to_vec_f32());
    let on_load =
        Llama::from_pretrained_quantized(&fixtures().join("llama_gqa_untied"), DType::F32, Device::Cpu, QuantSpec::QLORA).unwrap();
    assert_eq!(loss(&on_load, &r).to_vec_f32().unwrap(), l.to_vec_f32().unwrap(), "the same 4-bit weights");
    // A saved checkpoint of another quant type than asked for is refused, naming both.
    let fp4 = QuantSpec { quant_type: QuantType::Fp4, ..QuantSpec::QLORA };
    let e = Llama::from_pretrained_quantized(&fixtures().join("nf4/tiny_llama_4bit"), DType::F32, Device::Cpu, fp4).err().unwrap();
    assert!(e.to_string().contains("saved 4-bit as nf4") && e.to_string().contains("not fp4"), "{e}");
}

/// Dequantizing the base changes no output; merging then folds the adapter in (PEFT's merge of
/// a 4-bit base before it requantizes).
#[test]
fn dequantizing_then_merging_keeps_the_adapted_outputs() {
    let r = reference();
    let mut m = Llama::from_pretrained(&qlora("base_4bit"), DType::F32, Device::Cpu).unwrap();
    m.load_adapter(&qlora("adapter")).unwrap();
    let adapted = m.forward(&r["input_ids"]).unwrap();
    m.dequantize_base().unwrap();
    assert!(m.quant_base().is_none());
    assert_eq!(m.forward(&r["input_ids"]).unwrap().to_vec_f32().unwrap(), adapted.to_vec_f32().unwrap());
    m.merge_lora().unwrap();
    let merged = m.forward(&r["input_ids"]).unwrap();
    assert!(rel_err(&merged, &adapted) < 1e-5, "merged {}", rel_err(&merged, &adapted));
    // A 4-bit model is not saved as if it were dense.
    let q = Llama::from_pretrained(&qlora("base_4bit"), DType::F32, Device::Cpu).unwrap();
    let tmp = TempDir::new("save4");
    let e = q.save_pretrained(&tmp.0).err().unwrap().to_string();
    assert!(e.contains("linear weights are 4-bit"), "{e}");
}

/// A copy of the 4-bit checkpoint with one stored tensor changed by `edit`; the load's error.
fn load_edited(tag: &str, edit: impl FnOnce(&mut BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>)) -> String {
    let src = qlora("base_4bit");
    let tmp = TempDir::new(tag);
    std::fs::copy(src.join("config.json"), tmp.0.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut parts: BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec()))).collect();
    edit(&mut parts);
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        parts.iter().map(|(n, (d, s, b))| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, &None, &tmp.0.join("model.safetensors")).unwrap();
    let e = Llama::from_pretrained(&tmp.0, DType::F32, Device::Cpu).err().expect("the edited checkpoint is refused");
    e.to_string()
}

const W: &str = "model.layers.1.mlp.down_proj.weight";

#[test]
fn a_bad_4bit_checkpoint_is_refused_naming_the_tensor() {
    let qs = format!("{W}.quant_state.bitsandbytes__nf4");
    let e = load_edited("corrupt", |p| {
        let t = p.get_mut(&qs).unwrap();
        t.2 = b"{not json".to_vec();
        t.1 = vec![t.2.len()];
    });
    assert!(e.contains(&qs) && e.contains("corrupt quant_state"), "{e}");
    let e = load_edited("absmax", |p| {
        let a = p.get_mut(&format!("{W}.absmax")).unwrap();
        a.2.pop();
        a.1 = vec![a.2.len()];
    });
    assert!(e.contains(W) && e.contains("absmax"), "{e}");
    let e = load_edited("qtype", |p| {
        let (d, s, b) = p.remove(&qs).unwrap();
        let text = String::from_utf8(b).unwrap().replace("\"nf4\"", "\"nf5\"");
        p.insert(format!("{W}.quant_state.bitsandbytes__nf5"), (d, vec![text.len()], text.into_bytes()));
        let _ = s;
    });
    assert!(e.contains("nf5") && e.contains(W), "{e}");
}

#[test]
fn the_fixture_is_what_bitsandbytes_saved() {
    let ck = read_bnb4_dir(Path::new(&qlora("base_4bit"))).unwrap().unwrap();
    assert_eq!(ck.quantized.len(), 14);
    assert!(read_bnb4_dir(&qlora("base")).unwrap().is_none());
}

/// Training over the 4-bit base: 12 AdamW steps of new adapters (rank 4, every projection) on
/// the fixture's batch lower its loss. The adapter they make is committed as
/// tests/fixtures/qlora/trained (FERROLM_WRITE_FIXTURES=1 rewrites it; otherwise this run's must
/// equal it), and PEFT, loading that adapter over the 4-bit base transformers made, computes
/// the loss ferrolm computes (trained/peft_reference.safetensors, written by
/// `scripts/make_qlora_fixtures.py`, which runs PEFT on it).
#[test]
fn a_qlora_adapter_trains_and_loads_in_peft_over_the_4bit_base_with_our_loss() {
    use ferrolm_nn::lora::{LoraConfig, Proj};
    use ferrolm_nn::optim::{AdamW, AdamWConfig};
    let r = reference();
    let mut m = Llama::from_pretrained(&qlora("base_4bit"), DType::F32, Device::Cpu).unwrap();
    m.add_lora(&LoraConfig::new(4, None, 0.0, Proj::ALL.to_vec(), false).unwrap(), &mut ferrolm_tensor::Rng::new(7)).unwrap();
    let mut opt = AdamW::new(&m.trainable_parameters(), AdamWConfig::default()).unwrap();
    let mut losses = Vec::new();
    for _ in 0..12 {
        opt.zero_grad();
        let l = loss(&m, &r);
        l.backward().unwrap();
        losses.push(l.to_vec_f32().unwrap()[0]);
        opt.step(1e-2).unwrap();
    }
    assert!(losses[11] < losses[0] - 0.05, "the loss did not drop: {losses:?}");
    let dir = qlora("trained");
    if std::env::var("FERROLM_WRITE_FIXTURES").is_ok_and(|v| v == "1") {
        m.save_adapter(&dir, "tests/fixtures/qlora/base_4bit").unwrap();
    }
    let committed: BTreeMap<String, Tensor> =
        load_safetensors(&dir.join("adapter_model.safetensors"), DType::F32, Device::Cpu).unwrap().into_iter().collect();
    let trained: BTreeMap<String, Tensor> = m.adapters().into_iter().collect();
    assert_eq!(committed.len(), trained.len());
    for (n, t) in &trained {
        let c = committed.get(&format!("base_model.model.{n}")).unwrap_or_else(|| panic!("{n} not in the committed adapter"));
        assert!(rel_err(t, c) < 1e-4, "{n}: this run's adapter is not the committed one ({})", rel_err(t, c));
    }
    // The committed adapter over the 4-bit base: our loss is PEFT's.
    let peft: BTreeMap<String, Tensor> =
        load_safetensors(&dir.join("peft_reference.safetensors"), DType::F32, Device::Cpu).unwrap().into_iter().collect();
    let mut q = Llama::from_pretrained(&qlora("base_4bit"), DType::F32, Device::Cpu).unwrap();
    q.load_adapter(&dir).unwrap();
    let ours = loss(&q, &r);
    assert!(rel_err(&ours, &peft["loss"]) < TOL, "ours {:?}, PEFT's {:?}", ours.to_vec_f32(), peft["loss"].to_vec_f32());
    assert!((peft["loss"].to_vec_f32().unwrap()[0] - r["loss"].to_vec_f32().unwrap()[0]).abs() > 1e-3, "PEFT scored another adapter");
}
