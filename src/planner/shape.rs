//! The model as the planner sees it: the shapes that set parameter count, memory and FLOPs, the
//! presets of the planning tools, and the per-bucket parameter counts the engine shards.
use ferrolm_nn::spec::{self, Dims, ParamSpec};
use ferrolm_tensor::{Error, Result};

/// Elements one of `tp` ranks holds of `specs`.
fn local(specs: &[ParamSpec], tp: usize) -> u64 {
    specs.iter().map(|s| s.local_numel(tp)).sum()
}

/// The shapes that set parameter count, memory and FLOPs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    pub name: String,
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub tied: bool,
    /// The block's optional parameters (biases, per-head norms), as the config's features say.
    pub extras: BlockExtras,
    /// Each layer's sliding window (`LlamaConfig::layer_windows`; `None`: full causal
    /// attention). Empty: every layer full. Sets the attention FLOPs only.
    pub windows: Vec<Option<usize>>,
}

/// A block's parameters beyond Llama's, from the config's features (not its family): the
/// model's own spec (`ferrolm_nn::spec`) says where tensor parallelism puts each.
pub type BlockExtras = ferrolm_nn::spec::BlockFeatures;

impl ModelShape {
    /// LLaMA shapes: `7b`, `13b`, `30b` (LLaMA-1's 32.5B) and `70b` (Llama 2, GQA); and the
    /// GPT-3 shapes NeMo's launcher trains, `gpt3-5b` (24 x 4096, 32 heads) and `gpt3-175b`
    /// (96 x 12288, 96 heads), vocabulary 51200, tied embeddings, their 4h GeLU MLP (8h² weights)
    /// written as the SwiGLU width with the same weights (3·h·i = 8h², i = 8h/3).
    pub fn preset(name: &str) -> Result<ModelShape> {
        let (layers, hidden, inter, heads, kv, vocab) = match name {
            "7b" => (32, 4096, 11008, 32, 32, 32000),
            "13b" => (40, 5120, 13824, 40, 40, 32000),
            "30b" => (60, 6656, 17920, 52, 52, 32000),
            "70b" => (80, 8192, 28672, 64, 8, 32000),
            "gpt3-5b" => (24, 4096, 10944, 32, 32, 51200),
            "gpt3-175b" => (96, 12288, 32768, 96, 96, 51200),
            other => {
                return Err(Error::new(
                    "--model",
                    format!("unknown preset {other:?} (known: 7b, 13b, 30b, 70b, gpt3-5b, gpt3-175b, or a config.json)"),
                ))
            }
        };
        Ok(ModelShape {
            name: name.into(),
            layers,
            hidden,
            intermediate: inter,
            heads,
            kv_heads: kv,
            head_dim: hidden / heads,
            vocab,
            tied: name.starts_with("gpt3"),
            extras: BlockExtras::default(),
            windows: vec![],
        })
    }

    pub fn from_config(c: &ferrolm_nn::LlamaConfig, name: &str) -> ModelShape {
        ModelShape {
            name: name.into(),
            layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            vocab: c.vocab_size,
            tied: c.tie_word_embeddings,
            extras: c.block_features(),
            windows: c.layer_windows(),
        }
    }

    /// The sizes the parameter spec reads.
    pub fn dims(&self) -> Dims {
        Dims {
            vocab: self.vocab,
            hidden: self.hidden,
            intermediate: self.intermediate,
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            tied: self.tied,
        }
    }

    /// Parameters of one transformer layer held by one of `tp` tensor-parallel ranks (a key/
    /// value head shared by several ranks is held by each), from the spec's roles.
    pub fn layer_params(&self, tp: usize) -> u64 {
        local(&spec::layer_specs(0, &self.dims(), &self.extras), tp)
    }

    /// Parameters held by one of `tp` ranks, per bucket (embedding, each layer, head).
    pub fn bucket_params(&self, tp: usize) -> Vec<u64> {
        let d = self.dims();
        let mut out = vec![local(&[spec::embedding_spec(&d)], tp)];
        out.extend(std::iter::repeat_n(self.layer_params(tp), self.layers));
        out.push(local(&spec::head_specs(&d), tp));
        out
    }

    /// Elements of the largest single parameter one of `tp` ranks holds (the embedding or the
    /// head in most shapes, an MLP projection where the intermediate size beats the vocabulary).
    pub fn largest_param(&self, tp: usize) -> u64 {
        let d = self.dims();
        let mut specs = spec::layer_specs(0, &d, &self.extras);
        specs.push(spec::embedding_spec(&d));
        specs.extend(spec::head_specs(&d));
        specs.iter().map(|s| s.local_numel(tp.max(1))).max().unwrap_or(0)
    }

    /// Parameters of the whole model.
    pub fn params(&self) -> u64 {
        self.bucket_params(1).iter().sum()
    }

    /// Training FLOPs per token: 6 per parameter (forward and backward) plus attention
    /// (PaLM's 12 L T d count) for sequences of `seq`. A layer with a sliding window w < seq
    /// scores each query against at most w keys, not all earlier ones (the kernels skip the
    /// tiles outside the window): its term is PaLM's scaled by the keys a query sees on
    /// average, sum_i min(i + 1, w) / seq, over the causal average (seq + 1) / 2, so it
    /// grows as seq * w rather than seq^2 / 2.
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let full = 12.0 * (seq * self.heads * self.head_dim) as f64;
        let attention: f64 = (0..self.layers).map(|l| full * window_share(self.windows.get(l).copied().flatten(), seq)).sum();
        6.0 * self.params() as f64 + attention
    }
}

/// The attention work of a layer with sliding window `window` on sequences of `t` tokens, as a
/// share of full causal attention's: the keys each query sees, sum_i min(i + 1, w), over
/// sum_i (i + 1). 1 with no window or a window of at least `t`.
pub fn window_share(window: Option<usize>, t: usize) -> f64 {
    match window {
        Some(w) if w < t && t > 0 => {
            let (w, t) = (w as f64, t as f64);
            // Queries 0..w see i + 1 keys, the other t - w see w.
            let seen = w * (w + 1.0) / 2.0 + (t - w) * w;
            seen / (t * (t + 1.0) / 2.0)
        }
        _ => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm_nn::{Llama, LlamaConfig};
    use ferrolm_tensor::{DType, Device, Rng};

    /// Attention FLOPs follow each layer's window: a `sliding_window` that covers the sequence
    /// costs a Llama's; with window w < t a layer's attention term is sum_i min(i + 1, w) / sum_i
    /// (i + 1) of the full one (~2w / t for w << t), and the parameter term is unchanged.
    #[test]
    fn attention_flops_count_the_window() {
        let base = r#""vocab_size":64,"hidden_size":32,"intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,"#;
        let shape = |extra: &str| ModelShape::from_config(&LlamaConfig::from_json_str(&format!("{{{base}{extra}}}")).unwrap(), "t");
        let llama = shape(r#""model_type":"llama""#);
        let (t, w) = (4096usize, 128usize);
        let full_term = 12.0 * (t * 32) as f64; // one layer's PaLM term: 12 T heads·head_dim
        assert_eq!(shape(r#""model_type":"mistral","sliding_window":null"#).flops_per_token(t), llama.flops_per_token(t));
        let mistral = shape(r#""model_type":"mistral","sliding_window":128"#);
        let share = (w * (w + 1) / 2 + (t - w) * w) as f64 / (t * (t + 1) / 2) as f64;
        let want = llama.flops_per_token(t) - 2.0 * full_term * (1.0 - share);
        assert!((mistral.flops_per_token(t) - want).abs() <= 1e-9 * want, "{} vs {want}", mistral.flops_per_token(t));
        assert!((share - 2.0 * w as f64 / t as f64).abs() < 0.05 * share, "~ t·w, not t²/2: {share}");
        // Mixed `layer_types`: only the sliding layer is cheaper; a window at least the sequence is full.
        let gemma = |window: usize| {
            shape(&format!(
                r#""model_type":"gemma3_text","head_dim":8,"max_position_embeddings":8192,"sliding_window":{window},"layer_types":["sliding_attention","full_attention"]"#
            ))
        };
        let g = gemma(w);
        let params = 6.0 * g.params() as f64;
        assert!((g.flops_per_token(t) - params - full_term * (1.0 + share)).abs() <= 1e-9 * params);
        assert_eq!(gemma(t).flops_per_token(t), params + 2.0 * full_term);
        assert_eq!(window_share(Some(1), 1), 1.0);
        assert_eq!(window_share(None, 10), 1.0);
    }

    /// The planner's count equals the model's tensors for every family's features (q/k/v
    /// bias, o and MLP biases, QK-norm with an explicit head_dim), and the config's formula.
    #[test]
    fn parameter_count_equals_the_model_for_each_family() {
        let base = r#""vocab_size":64,"hidden_size":32,"intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2"#;
        for extra in [
            r#""model_type":"llama""#,
            r#""model_type":"llama","attention_bias":true,"mlp_bias":true"#,
            r#""model_type":"qwen2","tie_word_embeddings":true"#,
            r#""model_type":"qwen3","head_dim":16,"attention_bias":true"#,
            r#""model_type":"mistral","head_dim":16"#,
            r#""model_type":"gemma3_text","head_dim":16,"sliding_window":512,"layer_types":["sliding_attention","full_attention"]"#,
        ] {
            let c = LlamaConfig::from_json_str(&format!("{{{base},{extra}}}")).unwrap();
            let n = Llama::new(c.clone(), DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap().num_params() as u64;
            assert_eq!(ModelShape::from_config(&c, "t").params(), n, "{extra}");
            assert_eq!(crate::planner::memory::param_count(&c), Some(n), "{extra}");
            // What one of two tensor-parallel ranks holds: the split half, the replicated whole.
            let shape = ModelShape::from_config(&c, "t");
            let (h, d, i) = (32u64, c.head_dim as u64, 48u64);
            let replicated = 2 * h
                + if c.o_bias() { h } else { 0 }
                + if c.mlp_bias { h } else { 0 }
                + if c.qk_norm() { 2 * d } else { 0 }
                + if c.sandwich_norms() { 2 * h } else { 0 };
            let split = (shape.layer_params(1) - replicated) / 2;
            assert_eq!(shape.layer_params(2), split + replicated, "{extra}");
            assert!(!c.mlp_bias || shape.layer_params(1) > 3 * h * i, "{extra}");
        }
    }
}
