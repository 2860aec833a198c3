//! `LlamaConfig`: the Hugging Face `config.json` of a Llama-family decoder (`llama`,
//! `llamaLadder`, `qwen2`, `qwen3`, `mistral`: see [`Family`]), read strictly. Every field
//! that changes the maths is either understood or rejected (a checkpoint must never load into
//! a model that silently computes something else); keys that do not (dtype, use_cache,
//! transformers_version, ...) are ignored. Both rope spellings are accepted: the
//! `rope_parameters` dict transformers 5 writes, and the 4.x `rope_theta` + `rope_scaling`.
use ferrolm_tensor::{Error, Result};
use serde_json::{json, Map, Value};
use std::path::Path;

/// How rotary frequencies are derived from `rope_theta`.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// inv_freq[i] = 1 / theta^(2i / head_dim)
    Default,
    /// Llama 3.x: long wavelengths divided by `factor`, a smooth ramp between the two cut-offs.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: usize },
}

/// Which blocks are Ladder blocks (Ladder Residual, arXiv 2501.06589), as the paper's released
/// `LlamaLadderConfig` spells it: an int N (the last N layers) or a list of layer indices.
/// Kept in the form it was given, so a checkpoint is written back unchanged.
#[derive(Clone, Debug, PartialEq)]
pub enum LadderLayers {
    /// The last N layers.
    Last(usize),
    /// These layer indices.
    List(Vec<usize>),
}

impl LadderLayers {
    /// Per-layer flags for a model of `layers` blocks (already validated).
    pub fn mask(&self, layers: usize) -> Vec<bool> {
        match self {
            LadderLayers::Last(n) => (0..layers).map(|i| i + n.min(&layers) >= layers).collect(),
            LadderLayers::List(v) => (0..layers).map(|i| v.contains(&i)).collect(),
        }
    }

    /// The `--ladder-layers` flag: `all`, an int N (the last N layers), or a comma-separated
    /// list of layer indices (`0,2,5`; a single index is written `3,`).
    pub fn parse_flag(s: &str, layers: usize) -> Result<Self> {
        let bad = |m: String| Error::new("--ladder-layers", m);
        let s = s.trim();
        let v = if s == "all" {
            LadderLayers::Last(layers)
        } else if s.contains(',') {
            let idx = s
                .split(',')
                .filter(|p| !p.trim().is_empty())
                .map(|p| p.trim().parse::<usize>().map_err(|_| bad(format!("{p:?} is not a layer index (expected all, N or i,j,k)"))))
                .collect::<Result<Vec<_>>>()?;
            LadderLayers::List(idx)
        } else {
            LadderLayers::Last(s.parse().map_err(|_| bad(format!("{s:?} is not all, a layer count N or a list i,j,k")))?)
        };
        v.check(layers).map_err(bad)?;
        Ok(v)
    }

    fn check(&self, layers: usize) -> std::result::Result<(), String> {
        match self {
            LadderLayers::Last(n) if *n > layers => Err(format!("{n} Ladder layers requested but the model has {layers} layers")),
            LadderLayers::List(v) => {
                if let Some(i) = v.iter().find(|&&i| i >= layers) {
                    return Err(format!("layer index {i} is out of range (the model has layers 0..{layers})"));
                }
                let mut sorted = v.clone();
                sorted.sort_unstable();
                if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                    return Err(format!("layer index {} is listed twice", w[0]));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn to_json(&self) -> Value {
        match self {
            LadderLayers::Last(n) => json!(n),
            LadderLayers::List(v) => json!(v),
        }
    }
}

impl std::fmt::Display for LadderLayers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LadderLayers::Last(n) => write!(f, "the last {n}"),
            LadderLayers::List(v) => write!(f, "{v:?}"),
        }
    }
}

/// Which transformers model a config describes (its `model_type`). The family decides the block's
/// features ([`LlamaConfig::qkv_bias`], [`LlamaConfig::qk_norm`], ...) and what a save writes;
/// the decoder is one (`crate::llama`), not one per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `llama` (and `llamaLadder`): optional biases (`attention_bias`, `mlp_bias`).
    Llama,
    /// `qwen2` (Qwen2, Qwen2.5): bias on q, k and v (not o), always.
    Qwen2,
    /// `qwen3` (dense): RMSNorm of each head's q and k before RoPE; `attention_bias`.
    Qwen3,
    /// `mistral`: Llama's block (no bias); `sliding_window` on every layer.
    Mistral,
    /// `gemma3_text` (Gemma 3 text models): (1 + w) RMSNorms in a sandwich (four a block),
    /// GeGLU, QK-norm, embeddings scaled by sqrt(hidden), `query_pre_attn_scalar`, RoPE per
    /// layer type (see [`Gemma3Keys`]).
    Gemma3,
}

/// The keys of a `gemma3_text` config that Llama's lack (the block features they turn on are
/// [`LlamaConfig::norm_offset`], [`LlamaConfig::sandwich_norms`], [`LlamaConfig::geglu`],
/// [`LlamaConfig::embed_scale`], [`LlamaConfig::attn_scale`], [`LlamaConfig::layer_rope_theta`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Keys {
    /// The softmax scale is `query_pre_attn_scalar^-0.5` (not head_dim's).
    pub query_pre_attn_scalar: usize,
    /// RoPE theta of the `sliding_attention` layers (`rope_parameters.sliding_attention`, or
    /// 4.x's `rope_local_base_freq`); the `full_attention` layers use `rope_theta`.
    pub rope_local_theta: f64,
    /// `sliding_window` (null: none), applied to the `sliding_attention` layers as Mistral's
    /// (see [`LlamaConfig::layer_windows`]).
    pub sliding_window: Option<usize>,
    /// Per layer: a `sliding_attention` layer (else `full_attention`).
    pub sliding_layers: Vec<bool>,
}

/// The `model_type`s a config may have.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "llamaLadder", "qwen2", "qwen3", "mistral", "gemma3_text"];

impl Family {
    /// Every family, in the order of [`SUPPORTED_MODEL_TYPES`].
    pub const ALL: [Family; 5] = [Family::Llama, Family::Qwen2, Family::Qwen3, Family::Mistral, Family::Gemma3];

    /// The `model_type` transformers knows the family by.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
            Family::Gemma3 => "gemma3_text",
        }
    }

    /// The class transformers loads a checkpoint of the family into.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// The family's name in messages ("loaded a Qwen2 model ...").
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "Llama",
            Family::Qwen2 => "Qwen2",
            Family::Qwen3 => "Qwen3",
            Family::Mistral => "Mistral",
            Family::Gemma3 => "Gemma 3",
        }
    }

    /// `max_position_embeddings` when a config leaves it out (transformers' class default).
    fn default_max_positions(self) -> usize {
        match self {
            Family::Llama => 2048,
            Family::Qwen2 | Family::Qwen3 => 32768,
            Family::Mistral | Family::Gemma3 => 131072,
        }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    /// Empty when the config has `null`; several ids for chat models (`[128001, 128008, ...]`).
    pub eos_token_id: Vec<u32>,
    /// Std of the normal init (`initializer_range`, 0.02 by default).
    pub initializer_range: f64,
    /// `None`: a plain Llama (`model_type: "llama"`). `Some`: a `llamaLadder` checkpoint, even
    /// with no Ladder layer (`ladder_layers: 0` computes exactly the plain model).
    pub ladder_layers: Option<LadderLayers>,
    /// The model family (`model_type`); Llama unless the config says otherwise.
    pub family: Family,
    /// `attention_bias` (Llama, Qwen3): a bias on q, k, v and o. Qwen2's q/k/v bias is not this
    /// key: it is always there (see [`LlamaConfig::qkv_bias`]).
    pub attention_bias: bool,
    /// `mlp_bias` (Llama): a bias on gate, up and down.
    pub mlp_bias: bool,
    /// `gemma3_text`'s own keys; `None` for every other family.
    pub gemma: Option<Gemma3Keys>,
    /// Sliding-window attention (Qwen2/Qwen3, Mistral): the config's keys, kept for saving;
    /// [`LlamaConfig::layer_windows`] gives each layer's window.
    pub window: SlidingWindow,
}

fn err(source: &str, field: &str, msg: impl std::fmt::Display) -> Error {
    Error::new("LlamaConfig", format!("{source}: field `{field}`: {msg}"))
}

/// Typed access to the JSON object, with errors that name the file and the field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    src: &'a str,
}

impl Fields<'_> {
    /// The value, treating an explicit `null` as absent.
    fn get(&self, k: &str) -> Option<&Value> {
        self.obj.get(k).filter(|v| !v.is_null())
    }
    fn usize_opt(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => {
                v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| err(self.src, k, format!("expected a non-negative integer, got {v}")))
            }
        }
    }
    fn usize_req(&self, k: &str) -> Result<usize> {
        self.usize_opt(k)?.ok_or_else(|| err(self.src, k, "missing (required)"))
    }
    fn f64_opt(&self, k: &str) -> Result<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| err(self.src, k, format!("expected a number, got {v}"))),
        }
    }
    fn bool_opt(&self, k: &str) -> Result<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| err(self.src, k, format!("expected true/false, got {v}"))),
        }
    }
    fn str_list_opt(&self, k: &str) -> Result<Option<Vec<&str>>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Array(a)) => {
                a.iter()
                    .map(|v| v.as_str().ok_or_else(|| err(self.src, k, format!("expected a list of strings, got {v} in it"))))
                    .collect::<Result<Vec<_>>>()
            }
            .map(Some),
            Some(v) => Err(err(self.src, k, format!("expected a list of strings, got {v}"))),
        }
    }
    fn str_opt(&self, k: &str) -> Result<Option<&str>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| err(self.src, k, format!("expected a string, got {v}"))),
        }
    }
    fn token_ids(&self, k: &str) -> Result<Vec<u32>> {
        let bad = |v: &Value| err(self.src, k, format!("expected a token id, a list of ids or null, got {v}"));
        let one = |v: &Value| v.as_u64().filter(|&n| n <= u32::MAX as u64).map(|n| n as u32).ok_or_else(|| bad(v));
        match self.get(k) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
}

/// Parses a rope dict (`rope_parameters`, or 4.x `rope_scaling`); `theta` comes from the dict
/// when it has one (`rope_parameters`), else from the caller (top-level `rope_theta`).
fn parse_rope(dict: &Map<String, Value>, src: &str, field: &str, theta: Option<f64>) -> Result<(f64, RopeScaling)> {
    let f = Fields { obj: dict, src };
    let fname = |k: &str| format!("{field}.{k}");
    let num = |k: &str| -> Result<Option<f64>> { f.f64_opt(k).map_err(|_| err(src, &fname(k), "expected a number")) };
    let theta = match num("rope_theta")? {
        Some(t) => t,
        None => theta.unwrap_or(10000.0),
    };
    if !positive(theta) {
        return Err(err(src, &fname("rope_theta"), format!("must be positive, got {theta}")));
    }
    // Very old files spell the key `type`.
    let kind = match f.get("rope_type").or_else(|| f.get("type")) {
        None => "default",
        Some(v) => v.as_str().ok_or_else(|| err(src, &fname("rope_type"), format!("expected a string, got {v}")))?,
    };
    match kind {
        "default" => {
            if let Some(pf) = num("partial_rotary_factor")? {
                if pf != 1.0 {
                    return Err(err(src, &fname("partial_rotary_factor"), format!("{pf} is not supported (only 1.0)")));
                }
            }
            Ok((theta, RopeScaling::Default))
        }
        "llama3" => {
            let need = |k: &str| -> Result<f64> { num(k)?.ok_or_else(|| err(src, &fname(k), "missing (required for rope_type llama3)")) };
            let factor = need("factor")?;
            let low = need("low_freq_factor")?;
            let high = need("high_freq_factor")?;
            let orig = f
                .usize_opt("original_max_position_embeddings")
                .map_err(|_| err(src, &fname("original_max_position_embeddings"), "expected a positive integer"))?
                .ok_or_else(|| err(src, &fname("original_max_position_embeddings"), "missing (required for rope_type llama3)"))?;
            if !positive(factor) || !positive(low) || high <= low || orig == 0 {
                return Err(err(src, field, format!("invalid llama3 scaling: factor {factor}, low_freq_factor {low}, high_freq_factor {high} (must exceed low), original_max_position_embeddings {orig}")));
            }
            Ok((
                theta,
                RopeScaling::Llama3 { factor, low_freq_factor: low, high_freq_factor: high, original_max_position_embeddings: orig },
            ))
        }
        other => Err(err(src, &fname("rope_type"), format!("rope type {other:?} is not supported (supported: default, llama3)"))),
    }
}

impl LlamaConfig {
    /// Reads a Hugging Face `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::new("LlamaConfig", format!("cannot read {}: {e}", path.display())))?;
        Self::parse(&text, &path.display().to_string())
    }

    pub fn from_json_str(text: &str) -> Result<Self> {
        Self::parse(text, "<config json>")
    }

    fn parse(text: &str, src: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| Error::new("LlamaConfig", format!("{src}: invalid JSON: {e}")))?;
        let Value::Object(obj) = &v else {
            return Err(Error::new("LlamaConfig", format!("{src}: expected a JSON object")));
        };
        let f = Fields { obj, src };

        // Fields that would change the maths: accept only what this implementation computes.
        // A Ladder model of another family says which in `ladder_source_model_type`.
        let source_type = match f.str_opt("model_type")? {
            Some("llamaLadder") => f.str_opt("ladder_source_model_type")?,
            _ if f.get("ladder_source_model_type").is_some() => {
                return Err(err(src, "ladder_source_model_type", "is only valid with \"model_type\": \"llamaLadder\""))
            }
            _ => None,
        };
        let (family, ladder_type) = match f.str_opt("model_type")? {
            None | Some("llama") => (Family::Llama, false),
            Some("llamaLadder") => match source_type {
                None | Some("llama") => (Family::Llama, true),
                Some(t) => match Family::ALL.iter().find(|fam| fam.model_type() == t) {
                    Some(&fam) => (fam, true),
                    None => {
                        let known = Family::ALL.map(|f| f.model_type()).join(", ");
                        return Err(err(
                            src,
                            "ladder_source_model_type",
                            format!("{t:?} is not a family a Ladder model can be made of (supported: {known})"),
                        ));
                    }
                },
            },
            Some("qwen2") => (Family::Qwen2, false),
            Some("qwen3") => (Family::Qwen3, false),
            Some("mistral") => (Family::Mistral, false),
            Some("gemma3_text") => (Family::Gemma3, false),
            Some(mt @ "gemma3") => {
                return Err(err(
                    src,
                    "model_type",
                    format!("{mt:?} is Gemma 3's multimodal model: only its text model (\"gemma3_text\", the 270M and 1B checkpoints) is supported (supported: {})", SUPPORTED_MODEL_TYPES.join(", ")),
                ))
            }
            Some(mt @ ("gemma2" | "gemma")) => {
                return Err(err(
                    src,
                    "model_type",
                    format!("{mt:?} (Gemma 1/2) is not supported yet (supported: {})", SUPPORTED_MODEL_TYPES.join(", ")),
                ))
            }
            Some(mt) => {
                return Err(err(src, "model_type", format!("{mt:?} is not supported (supported: {})", SUPPORTED_MODEL_TYPES.join(", "))))
            }
        };
        // Gemma's MLP reads `hidden_activation` only (its `hidden_act`, if any, is unused).
        let (acts, want): (&[&str], &str) = match family {
            Family::Gemma3 => (&["hidden_activation"], "gelu_pytorch_tanh"),
            _ => (&["hidden_act", "hidden_activation"], "silu"),
        };
        for &k in acts {
            if let Some(act) = f.str_opt(k)? {
                if act != want {
                    return Err(err(src, k, format!("activation {act:?} is not supported (only {want:?})")));
                }
            }
        }
        // Only the families whose transformers class reads a bias key get one from it (Qwen2's
        // q/k/v bias is unconditional; Mistral has none).
        let attention_bias = match family {
            Family::Llama | Family::Qwen3 | Family::Gemma3 => f.bool_opt("attention_bias")?.unwrap_or(false),
            Family::Qwen2 | Family::Mistral => false,
        };
        let mlp_bias = match family {
            Family::Llama => f.bool_opt("mlp_bias")?.unwrap_or(false),
            _ => false,
        };
        if let Some(tp) = f.usize_opt("pretraining_tp")? {
            if tp > 1 {
                return Err(err(src, "pretraining_tp", format!("{tp} is not supported (only 1)")));
            }
        }
        if let Some(p) = f.f64_opt("attention_dropout")? {
            if p != 0.0 {
                return Err(err(src, "attention_dropout", format!("{p} is not supported (only 0.0)")));
            }
        }

        let hidden_size = f.usize_req("hidden_size")?;
        let num_attention_heads = f.usize_req("num_attention_heads")?;
        let head_dim = match f.usize_opt("head_dim")? {
            Some(d) => d,
            None if family == Family::Gemma3 => 256, // Gemma3TextConfig's default
            None if family == Family::Qwen3 => 128,  // Qwen3Config's default, whatever hidden / heads
            None => {
                if num_attention_heads == 0 || hidden_size % num_attention_heads != 0 {
                    return Err(err(
                        src,
                        "head_dim",
                        format!("missing, and hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}"),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };

        let (rope_theta, rope_scaling) = match f.get("rope_parameters") {
            _ if family == Family::Gemma3 => gemma_rope(&f)?.0,
            Some(Value::Object(d)) => parse_rope(d, src, "rope_parameters", f.f64_opt("rope_theta")?)?,
            Some(other) => return Err(err(src, "rope_parameters", format!("expected an object, got {other}"))),
            None => {
                let theta = f.f64_opt("rope_theta")?;
                match f.get("rope_scaling") {
                    Some(Value::Object(d)) => parse_rope(d, src, "rope_scaling", theta)?,
                    Some(other) => return Err(err(src, "rope_scaling", format!("expected an object or null, got {other}"))),
                    None => parse_rope(&Map::new(), src, "rope_theta", theta)?,
                }
            }
        };

        // MistralConfig's defaults (bos 1, eos 2), Gemma3TextConfig's (bos 2, eos 1), when the
        // keys are absent (an explicit null is none).
        let mistral_default = |k: &str, id: u32| -> Result<Vec<u32>> {
            let id = match family {
                Family::Mistral => Some(id),
                Family::Gemma3 => Some(3 - id),
                _ => None,
            };
            match id {
                Some(id) if !obj.contains_key(k) => Ok(vec![id]),
                _ => f.token_ids(k),
            }
        };
        let bos = mistral_default("bos_token_id", 1)?;
        if bos.len() > 1 {
            return Err(err(src, "bos_token_id", "expected a single id"));
        }
        let num_hidden_layers = f.usize_req("num_hidden_layers")?;
        let max_position_embeddings = f.usize_opt("max_position_embeddings")?.unwrap_or(family.default_max_positions());
        let gemma = match family {
            Family::Gemma3 => Some(gemma_keys(&f, num_hidden_layers)?),
            _ => None,
        };
        // Gemma keeps its window among its own keys (see `Gemma3Keys`).
        let window = match family {
            Family::Gemma3 => SlidingWindow::default(),
            _ => parse_window(&f, family, num_hidden_layers)?,
        };
        let cfg = LlamaConfig {
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize_req("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: f.usize_opt("num_key_value_heads")?.unwrap_or(num_attention_heads),
            head_dim,
            rms_norm_eps: f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(family == Family::Gemma3),
            bos_token_id: bos.first().copied(),
            eos_token_id: mistral_default("eos_token_id", 2)?,
            initializer_range: f.f64_opt("initializer_range")?.unwrap_or(0.02),
            ladder_layers: parse_ladder_layers(&f, ladder_type)?,
            family,
            attention_bias,
            mlp_bias,
            gemma,
            window,
        };
        cfg.validate_in(src)?;
        Ok(cfg)
    }

    /// Checks sizes and divisibility; errors name the offending field.
    pub fn validate(&self) -> Result<()> {
        self.validate_in("LlamaConfig")
    }

    fn validate_in(&self, src: &str) -> Result<()> {
        for (k, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(err(src, k, "must be positive"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(err(
                src,
                "num_key_value_heads",
                format!(
                    "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(err(src, "head_dim", format!("{} must be even for rotary embeddings", self.head_dim)));
        }
        for (k, v) in [("rms_norm_eps", self.rms_norm_eps), ("rope_theta", self.rope_theta)] {
            if !positive(v) {
                return Err(err(src, k, format!("must be positive, got {v}")));
            }
        }
        if let RopeScaling::Llama3 { factor, low_freq_factor: lo, high_freq_factor: hi, original_max_position_embeddings: old } =
            self.rope_scaling
        {
            if !positive(factor) || !positive(lo) || hi <= lo || old == 0 {
                return Err(err(src, "rope_scaling", format!("invalid llama3 scaling: factor {factor}, low_freq_factor {lo}, high_freq_factor {hi}, original_max_position_embeddings {old}")));
            }
        }
        if !(self.initializer_range.is_finite() && self.initializer_range >= 0.0) {
            return Err(err(src, "initializer_range", format!("must be >= 0, got {}", self.initializer_range)));
        }
        if let Some(l) = &self.ladder_layers {
            l.check(self.num_hidden_layers).map_err(|m| err(src, "ladder_layers", m))?;
        }
        if let Some(g) = &self.gemma {
            if self.family != Family::Gemma3 || g.sliding_layers.len() != self.num_hidden_layers {
                return Err(err(src, "layer_types", format!("expected {} entries of a gemma3_text config", self.num_hidden_layers)));
            }
            if !positive(g.rope_local_theta) || g.query_pre_attn_scalar == 0 {
                return Err(err(src, "rope_local_base_freq", "and query_pre_attn_scalar must be positive"));
            }
        } else if self.family == Family::Gemma3 {
            return Err(err(src, "model_type", "a gemma3_text config needs its Gemma keys"));
        }
        if self.window.sliding_window == Some(0) {
            return Err(err(src, "sliding_window", "0 is not a window (it must hold at least the query's own position)"));
        }
        let n = self.window.sliding_layers.len();
        if n != 0 && n != self.num_hidden_layers {
            return Err(err(src, "layer_types", format!("has {n} entries, but num_hidden_layers is {}", self.num_hidden_layers)));
        }
        if vocab_exceeds_ids(self.vocab_size) {
            return Err(err(src, "vocab_size", format!("{} does not fit i32 token ids", self.vocab_size)));
        }
        if let Some(b) = self.bos_token_id.filter(|&b| b as usize >= self.vocab_size) {
            return Err(err(src, "bos_token_id", format!("{b} is outside the vocabulary of {}", self.vocab_size)));
        }
        self.check_sizes(src)
    }

    /// Sizes whose products overflow or that no machine could hold are refused before anything
    /// is allocated: the parameter count (at most [`MAX_PARAMETERS`]) and the rotary tables
    /// built per position (at most [`MAX_ROPE_TABLE`] entries). The error names the field that
    /// is furthest above what real models use, and shows the product.
    fn check_sizes(&self, src: &str) -> Result<()> {
        let f = |field: &'static str, value: usize| (field, value as u64);
        let rope = [f("max_position_embeddings", self.max_position_embeddings), f("head_dim", self.head_dim)];
        let rope_entries = (self.max_position_embeddings as u64).checked_mul(self.head_dim as u64);
        if rope_entries.is_none_or(|n| n > MAX_ROPE_TABLE) {
            return Err(too_big(src, "rotary tables", &rope, rope_entries, MAX_ROPE_TABLE));
        }
        let all = [
            f("vocab_size", self.vocab_size),
            f("hidden_size", self.hidden_size),
            f("intermediate_size", self.intermediate_size),
            f("num_hidden_layers", self.num_hidden_layers),
            f("num_attention_heads", self.num_attention_heads),
            f("num_key_value_heads", self.num_key_value_heads),
            f("head_dim", self.head_dim),
        ];
        if self.num_hidden_layers as u64 > MAX_LAYERS {
            let n = self.num_hidden_layers;
            return Err(err(src, "num_hidden_layers", format!("too large: {n} layers, more than the limit of {MAX_LAYERS}")));
        }
        let params = self.num_parameters();
        if params.is_none_or(|n| n > MAX_PARAMETERS) {
            return Err(too_big(src, "parameters", &all, params, MAX_PARAMETERS));
        }
        Ok(())
    }

    /// The `config.json` text transformers' `LlamaForCausalLM` loads (5.x `rope_parameters`;
    /// 4.x reads the same file through the top-level `rope_theta` / `rope_scaling` we add).
    /// `dtype` is the stored weight type ("float32", "bfloat16").
    pub fn to_json_value(&self, dtype: &str) -> Value {
        let mut rope = Map::new();
        let mut scaling = Value::Null;
        if let RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } = &self.rope_scaling {
            let d = json!({
                "factor": factor,
                "high_freq_factor": high_freq_factor,
                "low_freq_factor": low_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
                "rope_type": "llama3",
            });
            rope = d.as_object().cloned().unwrap_or_default();
            scaling = d;
        }
        rope.insert("rope_theta".into(), json!(self.rope_theta));
        rope.entry("rope_type").or_insert(json!("default"));
        let ids = |v: &[u32]| match v {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        };
        let mut v = json!({
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "dtype": dtype,
            "eos_token_id": ids(&self.eos_token_id),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mlp_bias": self.mlp_bias,
            "model_type": "llama",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "pretraining_tp": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": Value::Object(rope),
            "rope_scaling": scaling,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype,
            "use_cache": true,
            "vocab_size": self.vocab_size,
        });
        if let (Family::Qwen2 | Family::Qwen3 | Family::Mistral, Value::Object(o)) = (self.family, &mut v) {
            // The keys of the family's transformers config: no Llama-only ones, and the
            // sliding-window keys transformers reloads the same windows from.
            o.insert("model_type".into(), json!(self.family.model_type()));
            o.insert("architectures".into(), json!([self.family.architecture()]));
            for k in ["mlp_bias", "pretraining_tp"] {
                o.remove(k);
            }
            if self.family != Family::Qwen3 {
                o.remove("attention_bias");
            }
            let w = &self.window;
            o.insert("sliding_window".into(), json!(w.sliding_window));
            if self.family != Family::Mistral {
                let types: Vec<&str> = (0..self.num_hidden_layers)
                    .map(|i| if w.sliding_layers.get(i) == Some(&true) { "sliding_attention" } else { "full_attention" })
                    .collect();
                o.insert("use_sliding_window".into(), json!(w.use_sliding_window));
                o.insert("max_window_layers".into(), json!(w.max_window_layers.unwrap_or(28)));
                o.insert("layer_types".into(), json!(types));
            }
        }
        if let (Some(g), Value::Object(o)) = (&self.gemma, &mut v) {
            // Gemma3TextConfig's keys: both rope spellings (5.x per layer type, 4.x theta +
            // local base), the activation under its Gemma name, soft-capping off.
            o.insert("model_type".into(), json!(self.family.model_type()));
            o.insert("architectures".into(), json!([self.family.architecture()]));
            for k in ["mlp_bias", "pretraining_tp", "hidden_act"] {
                o.remove(k);
            }
            let full = o.get("rope_parameters").cloned().unwrap_or(Value::Null);
            o.insert(
                "rope_parameters".into(),
                json!({"full_attention": full, "sliding_attention": {"rope_theta": g.rope_local_theta, "rope_type": "default"}}),
            );
            o.insert("rope_local_base_freq".into(), json!(g.rope_local_theta));
            o.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            o.insert("query_pre_attn_scalar".into(), json!(g.query_pre_attn_scalar));
            o.insert("sliding_window".into(), json!(g.sliding_window));
            let types: Vec<&str> = g.sliding_layers.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
            o.insert("layer_types".into(), json!(types));
            o.insert("final_logit_softcapping".into(), Value::Null);
            o.insert("attn_logit_softcapping".into(), Value::Null);
            o.insert("use_bidirectional_attention".into(), json!(false));
        }
        if let (Some(l), Value::Object(o)) = (&self.ladder_layers, &mut v) {
            // The paper's released format: a Llama config plus these keys (auto_map points at
            // its HF modeling code, which a user may drop beside the weights).
            o.insert("model_type".into(), json!("llamaLadder"));
            o.insert("architectures".into(), json!(["LlamaLadderForCausalLM"]));
            if self.family == Family::Llama {
                o.insert(
                    "auto_map".into(),
                    json!({
                        "AutoConfig": "configuration_llama_ladder.LlamaLadderConfig",
                        "AutoModelForCausalLM": "modeling_llama_ladder.LlamaLadderForCausalLM"
                    }),
                );
            } else {
                // Another family's blocks under the Ladder schedule: its config keys stay, and
                // this key names the family. The paper's modelling code computes Llama blocks
                // only, so no auto_map points at it (transformers refuses the unknown
                // model_type rather than load the weights into the wrong blocks).
                o.insert("ladder_source_model_type".into(), json!(self.family.model_type()));
            }
            o.insert("ladder_layers".into(), l.to_json());
        }
        v
    }

    /// The `config.json` of this model (weights stored as `dtype`) written over `source`, the
    /// `config.json` object of the model it was trained from, whose weights are stored as
    /// `source_dtype`: every key of `source` is kept as it was (`pad_token_id`,
    /// `transformers_version`, keys ferrolm does not model, its spelling of what ferrolm does),
    /// and only the keys this model changes are written: those whose value here differs from
    /// what ferrolm writes for `source` itself (a Ladder conversion's `model_type`,
    /// `architectures`, `auto_map`, `ladder_layers`; `dtype` and `torch_dtype` when the stored
    /// dtype changes), and those ferrolm would no longer write are removed. A `source` that
    /// does not parse as a config is an error naming `origin`.
    pub fn to_json_over(&self, dtype: &str, source: &Map<String, Value>, source_dtype: &str, origin: &str) -> Result<Value> {
        let theirs = Self::parse(&Value::Object(source.clone()).to_string(), origin)?.to_json_value(source_dtype);
        let ours = self.to_json_value(dtype);
        let (Value::Object(theirs), Value::Object(ours)) = (theirs, ours) else {
            return Err(Error::new("LlamaConfig", format!("{origin}: expected a JSON object")));
        };
        let mut out = source.clone();
        for key in theirs.keys().chain(ours.keys()) {
            match (theirs.get(key), ours.get(key)) {
                (a, Some(b)) if a != Some(b) => {
                    out.insert(key.clone(), b.clone());
                }
                (Some(_), None) => {
                    out.remove(key);
                }
                _ => {}
            }
        }
        Ok(Value::Object(out))
    }

    /// Pretty JSON for `config.json` with f32 weights.
    pub fn to_json_string(&self) -> String {
        self.to_json_string_dtype("float32")
    }

    pub fn to_json_string_dtype(&self, dtype: &str) -> String {
        serde_json::to_string_pretty(&self.to_json_value(dtype)).expect("a JSON value serialises") + "\n"
    }

    /// Small ready-made shapes for experiments: see [`LlamaConfig::preset_names`].
    pub fn preset(name: &str) -> Result<Self> {
        let base = LlamaConfig {
            vocab_size: 4096,
            hidden_size: 128,
            intermediate_size: 384,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: 256,
            tie_word_embeddings: true,
            bos_token_id: None,
            eos_token_id: vec![],
            initializer_range: 0.02,
            ladder_layers: None,
            family: Family::Llama,
            attention_bias: false,
            mlp_bias: false,
            gemma: None,
            window: SlidingWindow::default(),
        };
        let cfg = match name {
            // A few minutes of pretraining on a 2-core CPU (~0.5M non-embedding parameters).
            "tiny" => base,
            // ~25M non-embedding parameters: a single GPU, or a long CPU run.
            "small" => LlamaConfig {
                vocab_size: 32000,
                hidden_size: 512,
                intermediate_size: 1408,
                num_hidden_layers: 8,
                num_attention_heads: 8,
                num_key_value_heads: 4,
                head_dim: 64,
                max_position_embeddings: 1024,
                ..base
            },
            _ => {
                return Err(Error::new("LlamaConfig", format!("unknown preset {name:?} (known: {})", Self::preset_names().join(", "))));
            }
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn preset_names() -> &'static [&'static str] {
        &["tiny", "small"]
    }

    /// The same config with another vocabulary size (e.g. the tokenizer's).
    pub fn with_vocab_size(mut self, vocab_size: usize) -> Self {
        self.vocab_size = vocab_size;
        self
    }

    /// A bias on the q, k and v projections: Qwen2 always, Llama and Qwen3 with `attention_bias`.
    pub fn qkv_bias(&self) -> bool {
        self.family == Family::Qwen2 || self.attention_bias
    }

    /// A bias on the o projection (`attention_bias`; never in Qwen2).
    pub fn o_bias(&self) -> bool {
        self.attention_bias
    }

    /// RMSNorm of each head's q and k over head_dim before RoPE (`q_norm`, `k_norm`: Qwen3,
    /// Gemma 3).
    pub fn qk_norm(&self) -> bool {
        matches!(self.family, Family::Qwen3 | Family::Gemma3)
    }

    /// What every RMSNorm adds to its weight: 0 (x · w), or 1 for Gemma's x · (1 + w).
    pub fn norm_offset(&self) -> f64 {
        if self.gemma.is_some() {
            1.0
        } else {
            0.0
        }
    }

    /// The sandwich (Gemma 3): each branch's output is normed before the residual add
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`); the MLP's input norm is
    /// then `pre_feedforward_layernorm`. Two more norms a block.
    pub fn sandwich_norms(&self) -> bool {
        self.gemma.is_some()
    }

    /// The MLP's GLU is gelu_tanh(gate) · up (Gemma 3's `gelu_pytorch_tanh`), not SwiGLU.
    pub fn geglu(&self) -> bool {
        self.gemma.is_some()
    }

    /// The factor embeddings are multiplied by (Gemma 3: sqrt(hidden_size)), before rounding
    /// to the activation dtype; `None` for none.
    pub fn embed_scale(&self) -> Option<f64> {
        self.gemma.as_ref().map(|_| (self.hidden_size as f64).sqrt())
    }

    /// The softmax scale: 1/sqrt(head_dim), or Gemma's `query_pre_attn_scalar^-0.5`.
    pub fn attn_scale(&self) -> f64 {
        let d = self.gemma.as_ref().map_or(self.head_dim, |g| g.query_pre_attn_scalar);
        1.0 / (d as f64).sqrt()
    }

    /// Layer `i`'s RoPE theta when it differs from `rope_theta` (Gemma's `sliding_attention`
    /// layers: the local base), else `None`.
    pub fn layer_rope_theta(&self, i: usize) -> Option<f64> {
        let g = self.gemma.as_ref()?;
        g.sliding_layers.get(i).copied().unwrap_or(false).then_some(g.rope_local_theta)
    }

    /// Each layer's sliding window (`None`: full causal attention), as transformers applies it:
    /// Mistral's `sliding_window` on every layer, Qwen2/Qwen3's and Gemma 3's on their
    /// `sliding_attention` layers (Gemma's mask is Mistral's, `create_sliding_window_causal_mask`:
    /// no off-by-one between them; its `use_bidirectional_attention`, which would change the
    /// window, is refused). A window of at least `max_position_embeddings` sees every earlier position of
    /// any sequence the model accepts: it is `None` here, so such a layer runs the full path.
    pub fn layer_windows(&self) -> Vec<Option<usize>> {
        let bites = self.window.sliding_window.filter(|&w| w < self.max_position_embeddings);
        (0..self.num_hidden_layers)
            .map(|i| match self.family {
                Family::Mistral => bites,
                Family::Qwen2 | Family::Qwen3 => bites.filter(|_| self.window.sliding_layers.get(i) == Some(&true)),
                Family::Gemma3 => {
                    let g = self.gemma.as_ref();
                    g.and_then(|g| g.sliding_window.filter(|&w| w < self.max_position_embeddings && g.sliding_layers.get(i) == Some(&true)))
                }
                Family::Llama => None,
            })
            .collect()
    }

    /// Number of query heads sharing one key/value head.
    pub fn gqa_group(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}

/// The sliding-window keys of a config, as transformers reads them (see
/// [`LlamaConfig::layer_windows`] for the window each layer gets).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SlidingWindow {
    /// `sliding_window`: the window (position i attends to j with i - window < j <= i). For
    /// Qwen2/Qwen3 the window transformers keeps: `None` unless `use_sliding_window` is true.
    pub sliding_window: Option<usize>,
    /// `use_sliding_window` (Qwen2/Qwen3).
    pub use_sliding_window: bool,
    /// `max_window_layers` (Qwen2/Qwen3), when the config has it: layers from this index on
    /// are `sliding_attention` when `layer_types` is absent.
    pub max_window_layers: Option<usize>,
    /// Qwen2/Qwen3's `layer_types`, resolved: `true` for a `sliding_attention` layer (empty for
    /// the other families, whose `layer_types`, if any, does not change the maths).
    pub sliding_layers: Vec<bool>,
}

/// The sliding-window keys, exactly as transformers 5.23 computes each layer's window.
/// Qwen2/Qwen3: `sliding_window` counts only with `use_sliding_window: true`; `layer_types`, or
/// when absent `sliding_attention` for layers `i >= max_window_layers` (28 by default) if there
/// is a window. Mistral: `sliding_window` (null: none) on every layer; a `layer_types` it may
/// carry is not read by `MistralForCausalLM`. Hostile values (a negative or zero window, a
/// `layer_types` list of the wrong length or with an unknown type, a `sliding_attention` layer
/// with no window, on which transformers fails) are refused by name.
fn parse_window(f: &Fields, family: Family, layers: usize) -> Result<SlidingWindow> {
    if family == Family::Llama {
        return Ok(SlidingWindow::default()); // not Llama keys: transformers ignores them
    }
    let src = f.src;
    // Absent: MistralConfig's and Qwen2/Qwen3Config's default, 4096 (Qwen's applies only with
    // use_sliding_window); an explicit null is no window.
    let window = match f.obj.get("sliding_window") {
        None => Some(4096),
        Some(_) => f.usize_opt("sliding_window")?,
    };
    if window == Some(0) {
        return Err(err(src, "sliding_window", "0 is not a window (it must hold at least the query's own position; null for none)"));
    }
    let types = f.str_list_opt("layer_types")?;
    if let Some(types) = &types {
        if types.len() != layers {
            return Err(err(src, "layer_types", format!("has {} entries, but num_hidden_layers is {layers}", types.len())));
        }
        if let Some((i, t)) = types.iter().enumerate().find(|(_, t)| !matches!(**t, "full_attention" | "sliding_attention")) {
            return Err(err(src, "layer_types", format!("layer {i} has unknown type {t:?} (known: full_attention, sliding_attention)")));
        }
    }
    if family == Family::Mistral {
        return Ok(SlidingWindow { sliding_window: window, ..SlidingWindow::default() });
    }
    let max_window_layers = f.usize_opt("max_window_layers")?;
    let use_sliding_window = f.bool_opt("use_sliding_window")?.unwrap_or(false);
    let sliding_window = window.filter(|_| use_sliding_window);
    let sliding_layers: Vec<bool> = match &types {
        Some(types) => types.iter().map(|t| *t == "sliding_attention").collect(),
        None => (0..layers).map(|i| sliding_window.is_some() && i >= max_window_layers.unwrap_or(28)).collect(),
    };
    if let (None, Some(i)) = (sliding_window, sliding_layers.iter().position(|&s| s)) {
        let why = match use_sliding_window {
            true => "sliding_window is null",
            false => "use_sliding_window is not true",
        };
        return Err(err(
            src,
            "layer_types",
            format!("layer {i} is \"sliding_attention\" but {why}: no window to apply (transformers fails on this config)"),
        ));
    }
    Ok(SlidingWindow { sliding_window, use_sliding_window, max_window_layers, sliding_layers })
}

/// Gemma 3's RoPE: `(theta, scaling)` of the `full_attention` layers and the theta of the
/// `sliding_attention` layers. 5.x writes `rope_parameters` as one dict per layer type; 4.x
/// `rope_theta` (+ `rope_scaling`, which applies to the full layers) and `rope_local_base_freq`.
/// Defaults are Gemma3TextConfig's (1e6 and 1e4). The local layers' RoPE must be the default.
fn gemma_rope(f: &Fields) -> Result<((f64, RopeScaling), f64)> {
    let src = f.src;
    let theta = Some(f.f64_opt("rope_theta")?.unwrap_or(1_000_000.0));
    let local = Some(f.f64_opt("rope_local_base_freq")?.unwrap_or(10_000.0));
    let (full, sliding) = match f.get("rope_parameters") {
        Some(Value::Object(d)) => {
            if let Some(k) = d.keys().find(|k| !matches!(k.as_str(), "full_attention" | "sliding_attention")) {
                return Err(err(
                    src,
                    &format!("rope_parameters.{k}"),
                    "unexpected: a gemma3_text config has one rope dict per layer type (full_attention, sliding_attention)",
                ));
            }
            let dict = |k: &str| -> Result<Map<String, Value>> {
                match d.get(k) {
                    None | Some(Value::Null) => Ok(Map::new()),
                    Some(Value::Object(m)) => Ok(m.clone()),
                    Some(v) => Err(err(src, &format!("rope_parameters.{k}"), format!("expected an object, got {v}"))),
                }
            };
            (
                parse_rope(&dict("full_attention")?, src, "rope_parameters.full_attention", theta)?,
                parse_rope(&dict("sliding_attention")?, src, "rope_parameters.sliding_attention", local)?,
            )
        }
        Some(other) => return Err(err(src, "rope_parameters", format!("expected an object, got {other}"))),
        None => {
            let full = match f.get("rope_scaling") {
                Some(Value::Object(d)) => parse_rope(d, src, "rope_scaling", theta)?,
                Some(other) => return Err(err(src, "rope_scaling", format!("expected an object or null, got {other}"))),
                None => parse_rope(&Map::new(), src, "rope_theta", theta)?,
            };
            (full, parse_rope(&Map::new(), src, "rope_local_base_freq", local)?)
        }
    };
    if sliding.1 != RopeScaling::Default {
        return Err(err(
            src,
            "rope_parameters.sliding_attention.rope_type",
            "only the default RoPE is supported for sliding_attention layers",
        ));
    }
    Ok((full, sliding.0))
}

/// The keys of a `gemma3_text` config beyond Llama's, each checked by name: `layer_types` (or
/// 4.x's `sliding_window_pattern`, every 6th layer full by default), `sliding_window`,
/// `query_pre_attn_scalar`, and the features Gemma 3 leaves off, refused when set
/// (`final_logit_softcapping`, `attn_logit_softcapping`, `use_bidirectional_attention`).
fn gemma_keys(f: &Fields, layers: usize) -> Result<Gemma3Keys> {
    let src = f.src;
    for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(v) = f.get(k) {
            return Err(err(src, k, format!("{v} is not supported (Gemma 3 has null: logit soft-capping is not computed)")));
        }
    }
    if f.bool_opt("use_bidirectional_attention")? == Some(true) {
        return Err(err(src, "use_bidirectional_attention", "true is not supported (only causal attention)"));
    }
    let query_pre_attn_scalar = f.usize_opt("query_pre_attn_scalar")?.unwrap_or(256);
    if query_pre_attn_scalar == 0 {
        return Err(err(src, "query_pre_attn_scalar", "must be positive"));
    }
    let sliding_window = match f.obj.get("sliding_window") {
        None => Some(4096), // Gemma3TextConfig's default
        Some(Value::Null) => None,
        Some(_) => f.usize_opt("sliding_window")?,
    };
    if sliding_window == Some(0) {
        return Err(err(src, "sliding_window", "must be positive (or null)"));
    }
    let sliding_layers = match f.str_list_opt("layer_types")? {
        Some(types) => {
            if types.len() != layers {
                return Err(err(src, "layer_types", format!("has {} entries, but num_hidden_layers is {layers}", types.len())));
            }
            types
                .iter()
                .enumerate()
                .map(|(i, t)| match *t {
                    "full_attention" => Ok(false),
                    "sliding_attention" => Ok(true),
                    other => Err(err(
                        src,
                        "layer_types",
                        format!("layer {i} has unknown type {other:?} (known: full_attention, sliding_attention)"),
                    )),
                })
                .collect::<Result<Vec<_>>>()?
        }
        None => {
            let every = f.usize_opt("sliding_window_pattern")?.unwrap_or(6);
            if every == 0 {
                return Err(err(src, "sliding_window_pattern", "must be positive"));
            }
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    // transformers fails on a sliding layer without a window, as for Qwen: refused, not guessed.
    if let (None, Some(i)) = (sliding_window, sliding_layers.iter().position(|&s| s)) {
        return Err(err(
            src,
            "sliding_window",
            format!("is null, but layer {i} is \"sliding_attention\": no window to apply (transformers fails on this config)"),
        ));
    }
    let ((_, _), rope_local_theta) = gemma_rope(f)?;
    Ok(Gemma3Keys { query_pre_attn_scalar, rope_local_theta, sliding_window, sliding_layers })
}

/// `ladder_layers`: an int, a list of ints, or null/absent (no Ladder layer). Only a
/// `llamaLadder` config may carry it.
fn parse_ladder_layers(f: &Fields, ladder_type: bool) -> Result<Option<LadderLayers>> {
    let v = f.get("ladder_layers");
    if !ladder_type {
        return match v {
            None => Ok(None),
            Some(_) => Err(err(f.src, "ladder_layers", "is only valid with \"model_type\": \"llamaLadder\"")),
        };
    }
    let bad = |v: &Value| err(f.src, "ladder_layers", format!("expected a non-negative layer count or a list of layer indices, got {v}"));
    Ok(Some(match v {
        None => LadderLayers::List(vec![]),
        Some(Value::Array(a)) => {
            LadderLayers::List(a.iter().map(|x| x.as_u64().map(|n| n as usize).ok_or_else(|| bad(x))).collect::<Result<_>>()?)
        }
        Some(n) => LadderLayers::Last(n.as_u64().ok_or_else(|| bad(n))? as usize),
    }))
}

/// Largest model a config may describe: 2^40 (1.1e12) parameters, above every Llama released
/// (405B) and far above what one machine holds; beyond it a config is a mistake or an attack.
pub const MAX_PARAMETERS: u64 = 1 << 40;

/// Layers one model may have. Per-layer structures are allocated before any weight is read, so
/// a config claiming billions of tiny layers must be refused by count, not by parameters.
pub const MAX_LAYERS: u64 = 1 << 16;

/// Largest rotary table (`max_position_embeddings * head_dim` entries; a cos and a sin table
/// are built, in f64 first): 2^28, a million positions at head_dim 256.
pub const MAX_ROPE_TABLE: u64 = 1 << 28;

/// What each size is in released Llama-family models, at most; the field furthest above it
/// is the one an oversized product is blamed on.
fn typical(field: &str) -> f64 {
    match field {
        "vocab_size" => 262_144.0,
        "hidden_size" => 16_384.0,
        "intermediate_size" => 65_536.0,
        "num_hidden_layers" => 128.0,
        "num_attention_heads" | "num_key_value_heads" => 128.0,
        "head_dim" => 256.0,
        "max_position_embeddings" => 1048576.0,
        _ => 1.0,
    }
}

/// The error for a product of `factors` that overflowed (`None`) or exceeded `limit`.
fn too_big(src: &str, what: &str, factors: &[(&'static str, u64)], product: Option<u64>, limit: u64) -> Error {
    let worst = factors.iter().max_by(|a, b| (a.1 as f64 / typical(a.0)).total_cmp(&(b.1 as f64 / typical(b.0)))).map_or("", |f| f.0);
    let sizes = factors.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ");
    let amount = match product {
        Some(n) => format!("{n} {what}, more than the limit of {limit}"),
        None => format!("{what} overflow 64-bit arithmetic"),
    };
    err(src, worst, format!("too large: {sizes} give {amount}"))
}

/// Finite and > 0 (false for NaN).
fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

fn vocab_exceeds_ids(v: usize) -> bool {
    v > i32::MAX as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_round_trip() {
        for name in LlamaConfig::preset_names() {
            let c = LlamaConfig::preset(name).unwrap();
            assert_eq!(LlamaConfig::from_json_str(&c.to_json_string()).unwrap(), c);
        }
        assert!(LlamaConfig::preset("huge").is_err());
    }

    #[test]
    fn eos_forms() {
        let base = r#"{"vocab_size":8,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2"#;
        let c = LlamaConfig::from_json_str(&format!("{base},\"eos_token_id\":[3,4]}}")).unwrap();
        assert_eq!(c.eos_token_id, vec![3, 4]);
        assert_eq!(c.head_dim, 4);
        assert_eq!(c.num_key_value_heads, 2);
        let c = LlamaConfig::from_json_str(&format!("{base},\"eos_token_id\":null}}")).unwrap();
        assert!(c.eos_token_id.is_empty());
        let c = LlamaConfig::from_json_str(&format!("{base},\"eos_token_id\":7}}")).unwrap();
        assert_eq!(c.eos_token_id, vec![7]);
        let e = LlamaConfig::from_json_str(&format!("{base},\"eos_token_id\":\"x\"}}")).unwrap_err();
        assert!(e.to_string().contains("eos_token_id"), "{e}");
    }

    /// A Ladder model of another family: `llamaLadder` with the family in
    /// `ladder_source_model_type` and its own keys; no `auto_map` (the paper's code computes Llama
    /// blocks); it reparses to the same config, and converting back restores the source's keys.
    /// The key is refused elsewhere, or naming no family.
    #[test]
    fn a_ladder_of_another_family_names_it() {
        let text = r#"{"model_type":"qwen2","architectures":["Qwen2ForCausalLM"],"vocab_size":8,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":2,
            "num_attention_heads":2,"use_sliding_window":true,"sliding_window":3,"max_window_layers":1,"torch_dtype":"float32"}"#;
        let Value::Object(source) = serde_json::from_str::<Value>(text).unwrap() else { panic!() };
        let cfg = LlamaConfig::from_json_str(text).unwrap();
        let mut ladder = cfg.clone();
        ladder.ladder_layers = Some(LadderLayers::Last(1));
        ladder.validate().unwrap();
        let v = ladder.to_json_over("float32", &source, "float32", "src").unwrap();
        assert_eq!(
            (&v["model_type"], &v["ladder_source_model_type"], &v["ladder_layers"]),
            (&json!("llamaLadder"), &json!("qwen2"), &json!(1))
        );
        assert!(v.get("auto_map").is_none(), "{v}");
        assert_eq!((&v["sliding_window"], &v["max_window_layers"]), (&json!(3), &json!(1)));
        let again = LlamaConfig::from_json_str(&v.to_string()).unwrap();
        assert_eq!((again.family, again.layer_windows()), (Family::Qwen2, vec![None, Some(3)]));
        assert_eq!(again, ladder);
        let Value::Object(lsrc) = v else { panic!() };
        let back = cfg.to_json_over("float32", &lsrc, "float32", "src").unwrap();
        assert_eq!(back, Value::Object(source));
        // A Llama's Ladder has no such key.
        let llama = LlamaConfig { ladder_layers: Some(LadderLayers::Last(1)), ..LlamaConfig::preset("tiny").unwrap() };
        assert!(llama.to_json_value("float32").get("ladder_source_model_type").is_none());
        let base = r#""vocab_size":8,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":2,"num_attention_heads":2"#;
        for (bad, why) in [
            (r#""model_type":"qwen2","ladder_source_model_type":"qwen2""#, "only valid with"),
            (r#""model_type":"llamaLadder","ladder_source_model_type":"phi3""#, "\"phi3\" is not a family"),
            (r#""model_type":"llamaLadder","ladder_source_model_type":"llamaLadder""#, "is not a family"),
        ] {
            let e = LlamaConfig::from_json_str(&format!("{{{base},{bad}}}")).unwrap_err().to_string();
            assert!(e.contains("ladder_source_model_type") && e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn written_over_a_source_keeps_its_keys_and_changes_only_ours() {
        // A 4.x-style source: torch_dtype only, rope_theta at the top, keys ferrolm does not model.
        let text = r#"{"model_type":"llama","vocab_size":8,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":2,
            "num_attention_heads":2,"bos_token_id":0,"eos_token_id":1,"pad_token_id":1,"rope_theta":500000.0,
            "torch_dtype":"bfloat16","transformers_version":"4.44.0","use_cache":false}"#;
        let Value::Object(source) = serde_json::from_str::<Value>(text).unwrap() else { panic!() };
        let cfg = LlamaConfig::from_json_str(text).unwrap();
        // The same model in the same dtype: the source, key for key.
        assert_eq!(cfg.to_json_over("bfloat16", &source, "bfloat16", "src").unwrap(), Value::Object(source.clone()));
        // Another stored dtype: both spellings say it, nothing else changes.
        let f32 = cfg.to_json_over("float32", &source, "bfloat16", "src").unwrap();
        let mut want = source.clone();
        want.insert("torch_dtype".into(), json!("float32"));
        want.insert("dtype".into(), json!("float32"));
        assert_eq!(f32, Value::Object(want));
        // A Ladder conversion adds its keys and rewrites the model type; pad_token_id stays.
        let mut ladder = cfg.clone();
        ladder.ladder_layers = Some(LadderLayers::Last(1));
        let v = ladder.to_json_over("bfloat16", &source, "bfloat16", "src").unwrap();
        assert_eq!(v["model_type"], json!("llamaLadder"));
        assert_eq!(v["ladder_layers"], json!(1));
        assert_eq!(v["architectures"], json!(["LlamaLadderForCausalLM"]));
        assert_eq!((&v["pad_token_id"], &v["use_cache"], &v["transformers_version"]), (&json!(1), &json!(false), &json!("4.44.0")));
        assert_eq!(LlamaConfig::from_json_str(&v.to_string()).unwrap(), ladder);
        // ...and converting back to a plain Llama removes them again.
        let Value::Object(lsrc) = v else { panic!() };
        let back = cfg.to_json_over("bfloat16", &lsrc, "bfloat16", "src").unwrap();
        assert!(back.get("ladder_layers").is_none() && back.get("auto_map").is_none(), "{back}");
        assert_eq!(back["model_type"], json!("llama"));
        let e = cfg.to_json_over("float32", &Map::new(), "float32", "src/config.json").unwrap_err();
        assert!(e.to_string().contains("src/config.json"), "{e}");
    }
}
