//! The tiny Llama of the model tests and the families they run it in.
use ferrolm_nn::LlamaConfig;
use serde_json::{Map, Value};

/// The tiny Llama: vocabulary 64, hidden 32, MLP 48, 2 layers of 4 heads (as many key/value
/// heads unless a test sets `num_key_value_heads`), 64 positions, RMSNorm eps 1e-5, weights
/// drawn with std 0.1.
pub const TINY_LLAMA: &str = r#"{"vocab_size":64,"hidden_size":32,"intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,
    "max_position_embeddings":64,"rms_norm_eps":1e-5,"initializer_range":0.1}"#;

/// [`TINY_LLAMA`] with `extra`'s fields added or replacing its own: JSON object members written
/// after a comma, as `,"num_key_value_heads":2,"num_hidden_layers":3` (an empty `extra` is the
/// plain tiny Llama). Panics, naming `extra`, on a field list that is not JSON or a config the
/// model refuses.
pub fn tiny_llama(extra: &str) -> LlamaConfig {
    let obj = |text: &str| -> Map<String, Value> {
        match serde_json::from_str(text) {
            Ok(Value::Object(m)) => m,
            other => panic!("tiny_llama: {text:?} is not a JSON object ({other:?})"),
        }
    };
    let mut cfg = obj(TINY_LLAMA);
    let fields = extra.trim().trim_start_matches(',');
    cfg.extend(obj(&format!("{{{fields}}}")));
    let text = Value::Object(cfg).to_string();
    LlamaConfig::from_json_str(&text).unwrap_or_else(|e| panic!("tiny_llama({extra:?}): {e}"))
}

/// [`tiny_llama`] with `layers` layers, then `extra`.
pub fn tiny_llama_layers(layers: usize, extra: &str) -> LlamaConfig {
    tiny_llama(&format!(r#","num_hidden_layers":{layers}{extra}"#))
}

/// The configurations the tensor-parallel tests cover (3 layers): plain GQA (2 kv heads: fewer
/// than 4 ranks), Ladder on every layer with tied embeddings, mixed Ladder with a single kv head;
/// the block features the families' configs turn on: `qwen2`'s q/k/v bias with one kv head (a
/// column-parallel bias replicated over ranks, its gradient summed as the weight's), `qwen3`'s
/// QK-norm (replicated) with head_dim 16 != 32/4 and every attention bias (o's, row-parallel:
/// added once after the reduction), `llama`'s `attention_bias` and `mlp_bias`; `gemma3_text`'s
/// (1 + w) sandwich norms (replicated, full hidden), GeGLU, QK-norm, embedding scale,
/// query_pre_attn_scalar and a second RoPE theta.
pub fn tp_cases() -> Vec<(&'static str, LlamaConfig)> {
    let three = |extra: &str| tiny_llama_layers(3, extra);
    vec![
        ("llama-gqa", three(r#","num_key_value_heads":2"#)),
        ("qwen2-bias-mqa", three(r#","num_key_value_heads":1,"model_type":"qwen2","tie_word_embeddings":true"#)),
        ("qwen3-qknorm-bias", three(r#","num_key_value_heads":2,"model_type":"qwen3","head_dim":16,"attention_bias":true"#)),
        ("llama-biases", three(r#","num_key_value_heads":2,"attention_bias":true,"mlp_bias":true"#)),
        (
            "gemma3-sandwich",
            three(
                r#","num_key_value_heads":2,"model_type":"gemma3_text","head_dim":16,"query_pre_attn_scalar":12,"sliding_window":5,
                "layer_types":["sliding_attention","full_attention","sliding_attention"],"rope_theta":1e6,"rope_local_base_freq":100.0"#,
            ),
        ),
        ("ladder-all-tied", three(r#","num_key_value_heads":4,"tie_word_embeddings":true,"model_type":"llamaLadder","ladder_layers":3"#)),
        ("ladder-mixed-mqa", three(r#","num_key_value_heads":1,"model_type":"llamaLadder","ladder_layers":[0,2]"#)),
    ]
}

/// The configurations the LoRA tests cover (2 layers): GQA with 2 key/value heads (replicated
/// at --tp 4), and a Ladder model with one.
pub fn lora_cases() -> Vec<(&'static str, LlamaConfig)> {
    vec![
        ("llama-gqa", tiny_llama(r#","num_key_value_heads":2"#)),
        ("ladder-mqa", tiny_llama(r#","num_key_value_heads":1,"model_type":"llamaLadder","ladder_layers":1"#)),
    ]
}

/// The tiny Llama of the packing and data-parallel tests: 2 key/value heads and 32 positions,
/// then `extra`.
pub fn tiny_gqa32(extra: &str) -> LlamaConfig {
    tiny_llama(&format!(r#","num_key_value_heads":2,"max_position_embeddings":32{extra}"#))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_fields_add_to_and_replace_the_base() {
        let c = tiny_llama("");
        assert_eq!((c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_key_value_heads), (64, 32, 2, 4));
        assert_eq!((c.max_position_embeddings, c.rms_norm_eps), (64, 1e-5));
        let c = tiny_gqa32(r#","num_hidden_layers":3,"rms_norm_eps":1e-6"#);
        assert_eq!((c.num_hidden_layers, c.num_key_value_heads, c.max_position_embeddings, c.rms_norm_eps), (3, 2, 32, 1e-6));
    }

    #[test]
    fn the_case_lists_name_distinct_configs() {
        let tp = tp_cases();
        assert_eq!(tp.len(), 7);
        assert!(tp.iter().all(|(_, c)| c.num_hidden_layers == 3));
        assert!(lora_cases().iter().all(|(_, c)| c.num_hidden_layers == 2));
    }

    #[test]
    #[should_panic(expected = "is not a JSON object")]
    fn a_field_list_that_is_not_json_names_itself() {
        tiny_llama(r#","num_hidden_layers":"#);
    }
}
