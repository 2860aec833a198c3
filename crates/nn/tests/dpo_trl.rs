//! The preference losses against TRL's own DPOTrainer code (scripts/make_dpo_fixtures.py): a
//! tiny Llama policy and reference, fixed pre-tokenized pairs, and for each loss type (`sigmoid`,
//! `hinge`, `ipo`, `sigmoid_norm`, `sft`, and a weighted mix) TRL's loss, its metrics and every
//! policy gradient. Ours: the pairs packed into rows with per-sequence attention
//! (`pack_pairs`), per-sequence log-probs from the chunked per-row head (`pair_logprobs`), the
//! reference under no_grad, `preference_loss`. Matched to rel 1e-5 in f32.
#[allow(dead_code)] // the scratch directory helper is for the other tests
mod common;
use common::fixtures;
use ferrolm_data::preference::PreferencePair;
use ferrolm_nn::lora::{adapters_off, LoraConfig, Proj};
use ferrolm_nn::objective::preference::{preference_loss, Normalizer, PreferenceConfig, ReferenceLogProbs};
use ferrolm_nn::objective::{pack_pairs, pair_logprobs, PackedPairs};
use ferrolm_nn::Llama;
use ferrolm_ops::LossChunks;
use ferrolm_tensor::{no_grad, DType, Device, Rng};
use serde_json::Value;

fn load(name: &str) -> Llama {
    let mut m = Llama::from_pretrained(&fixtures().join("dpo").join(name), DType::F32, Device::Cpu).unwrap();
    m.visit_params_mut(&mut |_, t| t.set_requires_grad(true).map(|_| ())).unwrap();
    m
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("dpo/expected.json")).unwrap()).unwrap()
}

fn pairs(e: &Value) -> Vec<PreferencePair> {
    let ids = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    e["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| PreferencePair { prompt: ids(&p["prompt"]), chosen: ids(&p["chosen"]), rejected: ids(&p["rejected"]) })
        .collect()
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    d / b.iter().map(|y| y.abs()).fold(0.0, f64::max).max(1e-30)
}

/// Rows of 16 tokens (several sequences a row, one row's tail padded) in chunks of 5 tokens.
fn batch(e: &Value) -> PackedPairs {
    pack_pairs(&pairs(e), 16, 0).unwrap()
}

#[test]
fn every_loss_type_matches_trls_loss_metrics_and_gradients() {
    let e = expected();
    let b = batch(&e);
    assert!(b.rows > 1 && b.cu_seqlens.iter().any(|c| c.len() > 3), "several sequences share a row: {:?}", b.cu_seqlens);
    let mut reference = load("reference");
    reference.loss_chunks = LossChunks::Tokens(5);
    let r = {
        let _g = no_grad();
        ReferenceLogProbs::of(&pair_logprobs(&reference, &b).unwrap()).unwrap()
    };
    let beta = e["beta"].as_f64().unwrap();
    for (name, case) in e["cases"].as_object().unwrap() {
        let weights: Vec<String> = case["loss_weights"].as_array().unwrap().iter().map(|w| w.as_f64().unwrap().to_string()).collect();
        let cfg = PreferenceConfig::parse(beta, name, Some(&weights.join(","))).unwrap();
        let mut policy = load("policy");
        policy.loss_chunks = LossChunks::Tokens(5);
        let p = pair_logprobs(&policy, &b).unwrap();
        let (loss, m) = preference_loss(&cfg, &p, &r, Normalizer::default()).unwrap();
        loss.backward().unwrap();
        let want = case["loss"].as_f64().unwrap();
        let got = loss.item().unwrap();
        assert!(rel(&[got], &[want]) <= 1e-5, "{name}: loss {got} vs TRL's {want}");
        for (k, v) in m.means() {
            let want = case["metrics"][k].as_f64().unwrap();
            assert!((v - want).abs() <= 1e-5 * want.abs().max(1.0), "{name}: {k} {v} vs TRL's {want}");
        }
        let grads = case["grads"].as_object().unwrap();
        let mut seen = 0;
        policy
            .visit_params_mut(&mut |info, t| {
                let want: Vec<f64> = grads[info.name].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
                let got = t.grad().map_or_else(|| vec![0.0; t.numel()], |g| g.to_vec_f64().unwrap());
                let err = rel(&got, &want);
                assert!(err <= 1e-5, "{name}: the gradient of {} is off by {err:e} (relative)", info.name);
                seen += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, grads.len(), "{name}: every gradient compared");
    }
}

/// The loss is the same whatever the packing and the chunks (one pair a row, the whole row a
/// chunk): sequences do not see each other.
#[test]
fn the_packing_and_chunks_do_not_change_the_log_probs() {
    let e = expected();
    let mut policy = load("policy");
    let _g = no_grad();
    policy.loss_chunks = LossChunks::Tokens(5);
    let a = pair_logprobs(&policy, &batch(&e)).unwrap();
    policy.loss_chunks = LossChunks::Auto;
    let b = pair_logprobs(&policy, &pack_pairs(&pairs(&e), 64, 3).unwrap()).unwrap();
    assert!(rel(&a.chosen.to_vec_f64().unwrap(), &b.chosen.to_vec_f64().unwrap()) <= 1e-6);
    assert!(rel(&a.rejected.to_vec_f64().unwrap(), &b.rejected.to_vec_f64().unwrap()) <= 1e-6);
    assert_eq!(a.chosen_tokens, vec![3, 5, 1]);
    assert_eq!(a.rejected_tokens, vec![2, 2, 4]);
}

/// With LoRA adapters (B not zero, so they change the outputs), `adapters_off` gives the base's
/// log-probs exactly, with no copy of the weights; the guard restores them when dropped.
#[test]
fn adapters_off_runs_the_base() {
    let e = expected();
    let b = batch(&e);
    let _g = no_grad();
    let base = pair_logprobs(&load("policy"), &b).unwrap().chosen.to_vec_f64().unwrap();
    let mut m = load("policy");
    m.add_lora(&LoraConfig::new(2, None, 0.0, Proj::ALL.to_vec(), false).unwrap(), &mut Rng::new(3)).unwrap();
    let mut rng = Rng::new(4);
    m.visit_adapters_mut(&mut |_, t| {
        *t = ferrolm_tensor::Tensor::randn(t.dims().to_vec(), 0.5, t.dtype(), t.device(), &mut rng)?;
        Ok(())
    })
    .unwrap();
    let on = pair_logprobs(&m, &b).unwrap().chosen.to_vec_f64().unwrap();
    assert!(rel(&on, &base) > 1e-3, "the adapters change the log-probs");
    {
        let _off = adapters_off();
        assert_eq!(pair_logprobs(&m, &b).unwrap().chosen.to_vec_f64().unwrap(), base, "adapters off: the base exactly");
    }
    assert_eq!(pair_logprobs(&m, &b).unwrap().chosen.to_vec_f64().unwrap(), on, "back on after the guard");
}

#[test]
fn bad_pairs_and_flags_are_errors() {
    let p = |c: Vec<u32>| PreferencePair { prompt: vec![1, 2], chosen: c, rejected: vec![3] };
    let e = pack_pairs(&[p(vec![])], 8, 0).unwrap_err().to_string();
    assert!(e.contains("pair 0: the chosen completion is empty"), "{e}");
    let e = pack_pairs(&[p(vec![4; 10])], 8, 0).unwrap_err().to_string();
    assert!(e.contains("longer than a row of 8"), "{e}");
    let e = PreferenceConfig::parse(0.1, "sigmoid,dpo", None).unwrap_err().to_string();
    assert!(e.contains("--loss-type") && e.contains("\"dpo\""), "{e}");
    let e = PreferenceConfig::parse(0.1, "sigmoid,sft", Some("1")).unwrap_err().to_string();
    assert!(e.contains("--loss-weights") && e.contains("1 weights for 2"), "{e}");
    assert!(PreferenceConfig::parse(0.0, "sigmoid", None).is_err());
    assert_eq!(PreferenceConfig::parse(0.1, "ipo", None).unwrap().losses.len(), 1);
}
