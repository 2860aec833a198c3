//! Autoregressive generation: a per-layer key/value cache and temperature + top-p (nucleus)
//! sampling. Temperature 0 is greedy decoding.
//!
//! The model is reached only through [`CausalLm`] (its config, device and cached forward); the
//! cache is [`crate::kv_cache::KvCache`], which the model fills.
use crate::causal_lm::CausalLm;
pub use crate::kv_cache::KvCache;
use ferrolm_tensor::{no_grad, Device, Error, Result, Rng, Tensor};

/// Picks a token from one row of logits: greedy at temperature 0, else softmax(logits / T)
/// restricted to the smallest set of tokens whose probability reaches `top_p`.
pub fn sample(logits: &[f32], temperature: f64, top_p: f64, rng: &mut Rng) -> u32 {
    let argmax = || logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &x)| if x > m.1 { (i, x) } else { m }).0 as u32;
    if temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(u32, f64)> = logits.iter().enumerate().map(|(i, &x)| (i as u32, ((x as f64 - max) / temperature).exp())).collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    if !(total > 0.0 && total.is_finite()) {
        return argmax();
    }
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let (mut keep, mut acc) = (0, 0.0);
    for p in &probs {
        keep += 1;
        acc += p.1 / total;
        if acc >= top_p {
            break;
        }
    }
    let kept = &probs[..keep];
    let mass: f64 = kept.iter().map(|p| p.1).sum();
    let mut r = rng.uniform() * mass;
    for p in kept {
        r -= p.1;
        if r < 0.0 {
            return p.0;
        }
    }
    kept[keep - 1].0
}

/// Generates up to `max_new_tokens` tokens after `prompt_ids` and returns them (without the
/// prompt); stops after an `eos_token_id` of the config, or at max_position_embeddings.
pub fn generate(
    model: &dyn CausalLm,
    prompt_ids: &[u32],
    max_new_tokens: usize,
    temperature: f64,
    top_p: f64,
    rng: &mut Rng,
) -> Result<Vec<u32>> {
    generate_within(model, prompt_ids, max_new_tokens, temperature, top_p, usize::MAX, rng)
}

/// [`generate`], sampling only ids below `vocab_limit`: a model whose embedding is padded past
/// its tokenizer (`vocab_size` 32000 with a 4096-token tokenizer) has logits for rows no text
/// ever used, and an id from them could not be decoded.
pub fn generate_within(
    model: &dyn CausalLm,
    prompt_ids: &[u32],
    max_new_tokens: usize,
    temperature: f64,
    top_p: f64,
    vocab_limit: usize,
    rng: &mut Rng,
) -> Result<Vec<u32>> {
    let s = Sampling { temperature, top_p, vocab_limit };
    generate_until(model, prompt_ids, max_new_tokens, &s, &model.config().eos_token_id, rng)
}

/// How each token is drawn: temperature (0: greedy), nucleus `top_p`, and only ids below
/// `vocab_limit`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f64,
    pub top_p: f64,
    pub vocab_limit: usize,
}

/// Generates up to `max_new_tokens` tokens after `prompt_ids` and returns them (without the
/// prompt); stops after a token of `stop` (which is returned), or at max_position_embeddings.
pub fn generate_until(
    model: &dyn CausalLm,
    prompt_ids: &[u32],
    max_new_tokens: usize,
    s: &Sampling,
    stop: &[u32],
    rng: &mut Rng,
) -> Result<Vec<u32>> {
    let _g = no_grad();
    if s.vocab_limit == 0 {
        return Err(Error::new("generate", "the vocabulary limit is 0: no token can be sampled"));
    }
    if prompt_ids.is_empty() {
        return Err(Error::new("generate", "the prompt needs at least one token"));
    }
    let cfg = model.config();
    let room = cfg.max_position_embeddings.saturating_sub(prompt_ids.len());
    let ids_tensor = |ids: &[u32]| -> Result<Tensor> {
        let v: Vec<i32> = ids
            .iter()
            .map(|&i| i32::try_from(i).map_err(|_| Error::new("generate", format!("token id {i} too large"))))
            .collect::<Result<_>>()?;
        Tensor::from_vec(v, vec![1, ids.len()], Device::Cpu)?.to_device(model.device())
    };
    let mut cache = KvCache::new();
    let mut out = Vec::new();
    let mut next_input = prompt_ids.to_vec();
    while out.len() < max_new_tokens.min(room + 1) {
        let logits = model.forward_with_cache(&ids_tensor(&next_input)?, &mut cache)?; // (1, t, V)
        let t = logits.dim(1);
        let last = logits.narrow(1, t - 1, 1)?.to_vec_f32()?; // (V)
        let tok = sample(&last[..s.vocab_limit.min(last.len())], s.temperature, s.top_p, rng);
        out.push(tok);
        if stop.contains(&tok) || cache.len() >= cfg.max_position_embeddings {
            break;
        }
        next_input = vec![tok];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Llama;

    #[test]
    fn sampling() {
        let mut rng = Rng::new(0);
        let logits = [0.0, 3.0, 1.0, -2.0];
        assert_eq!(sample(&logits, 0.0, 1.0, &mut rng), 1);
        // A tiny nucleus keeps only the most likely token.
        for _ in 0..20 {
            assert_eq!(sample(&logits, 1.0, 0.01, &mut rng), 1);
        }
        let mut seen = [0; 4];
        for _ in 0..2000 {
            seen[sample(&logits, 1.0, 1.0, &mut rng) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 0), "{seen:?}");
    }

    #[test]
    fn generation_stays_within_the_limit() {
        let cfg = crate::LlamaConfig::from_json_str(
            r#"{"model_type":"llama","vocab_size":64,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":1,
                "num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":64}"#,
        )
        .unwrap();
        let model = Llama::new(cfg, ferrolm_tensor::DType::F32, Device::Cpu, &mut Rng::new(3)).unwrap();
        let mut rng = Rng::new(0);
        let free = generate(&model, &[1, 2], 40, 5.0, 1.0, &mut rng).unwrap();
        assert!(free.iter().any(|&t| t >= 10), "a hot sampler over 64 ids draws some >= 10: {free:?}");
        let limited = generate_within(&model, &[1, 2], 40, 5.0, 1.0, 10, &mut rng).unwrap();
        assert!(limited.iter().all(|&t| t < 10), "{limited:?}");
        assert!(generate_within(&model, &[1], 4, 1.0, 1.0, 0, &mut rng).is_err());
    }
}
