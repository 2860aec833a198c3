//! Resume is exact: a run stopped at a checkpoint and resumed repeats the uninterrupted run's
//! losses bit for bit on the CPU (model, AdamW moments, data position, step all restored).
mod common;
use common::root;
use ferrolm::data::{list_shards, prepare_text_dir, Tokenizer};
use ferrolm::nn::LlamaConfig;
use ferrolm::train::{TrainOptions, Trainer};
use ferrolm::{DType, Device, Llama};
use ferrolm_tensor::Rng;

fn opts() -> TrainOptions {
    TrainOptions { steps: 6, grad_accum: 2, warmup_steps: 2, ..common::opts(6) }
}

fn model(vocab: usize) -> Llama {
    let cfg = LlamaConfig::from_json_str(&format!(
        r#"{{"model_type":"llama","vocab_size":{vocab},"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":64,"tie_word_embeddings":true}}"#
    ))
    .unwrap();
    Llama::new(cfg, DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap()
}

#[test]
fn resumed_run_repeats_losses_bitwise() {
    let tmp = std::env::temp_dir().join(format!("ferrolm-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let tok_path = root().join("data/tokenizer.json");
    let tok = Tokenizer::from_file(&tok_path).unwrap();
    prepare_text_dir(root().join("data/corpus/sonnets.txt"), &tok, tmp.join("shards"), 0.1, 1 << 20).unwrap();
    let train = list_shards(tmp.join("shards"), "train").unwrap();
    let val = list_shards(tmp.join("shards"), "val").unwrap();

    let mut full = Trainer::new(model(tok.vocab_size()), &train, &val, opts(), &tmp.join("full")).unwrap();
    full.run().unwrap();

    let mut first = Trainer::new(model(tok.vocab_size()), &train, &val, opts(), &tmp.join("split")).unwrap().with_tokenizer(&tok_path);
    for _ in 0..3 {
        first.train_step().unwrap();
    }
    let ckpt = first.save_checkpoint().unwrap();
    drop(first);

    // A fresh process would build the model from a different init: prove that it is overwritten.
    let mut fresh = model(tok.vocab_size());
    fresh = {
        let _g = ferrolm_tensor::no_grad();
        for (_, p) in fresh.parameters() {
            p.assign(&p.mul_scalar(0.5).unwrap()).unwrap();
        }
        fresh
    };
    let mut second = Trainer::new(fresh, &train, &val, opts(), &tmp.join("split")).unwrap();
    second.resume(&tmp.join("split")).unwrap();
    assert_eq!(second.step, 3);
    second.run().unwrap();
    // The first half never ran `run()`, so there is no metrics.jsonl to restore a history from.
    let got: Vec<f64> = second.history.iter().map(|h| h.1).collect();
    let want: Vec<f64> = full.history[3..].iter().map(|h| h.1).collect();
    assert_eq!(got.len(), 3);
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a.to_bits(), b.to_bits(), "resumed losses {got:?} differ from uninterrupted {want:?}");
    }
    // The final weights agree bit for bit as well.
    for ((n, a), (_, b)) in full.model.parameters().iter().zip(second.model.parameters()) {
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap(), "parameter {n} differs after resume");
    }
    assert!(ckpt.join("tokenizer.json").is_file() && ckpt.join("config.json").is_file());
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn resume_from_a_missing_checkpoint_is_an_error() {
    let tmp = std::env::temp_dir().join(format!("ferrolm-noresume-{}", std::process::id()));
    let err = ferrolm::train::resolve_checkpoint(&tmp).unwrap_err().to_string();
    assert!(err.contains("no checkpoint found"), "{err}");
}
