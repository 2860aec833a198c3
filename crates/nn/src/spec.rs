//! One parameter spec: every parameter of the decoder described once, from the config alone
//! (no weights needed), with its Hugging Face name, full shape, kind, tensor-parallel role and,
//! for the linear layers LoRA may adapt, its PEFT target name.
//!
//! Everything that needs to know a model's parameters reads this and nothing else: the model's
//! visitor (names and shapes, in transformers' `named_parameters()` order), tensor parallelism's
//! sharding (`ferrolm_parallel::tp`, from [`TpRole`]), LoRA's targets and adapter placement
//! (`crate::lora`, from [`ParamSpec::lora_target`] and the base weight's role), PEFT's names,
//! the flat buckets (`crate::buckets`, from [`bucket_of`]) and the planner's parameter and FLOP
//! counts ([`ParamSpec::local_numel`]). No family name appears below this file: a family is a
//! set of [`BlockFeatures`] (`LlamaConfig::block_features`).
use crate::config::LlamaConfig;
use crate::module::{Factor, ParamInfo, ParamKind};

/// Where a parameter lives under Megatron-style tensor parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TpRole {
    /// Output features (dim 0) split over the ranks: q/k/v, gate and up, and their biases (a
    /// column-parallel layer's bias is split with its weight's rows).
    Column,
    /// Input features (dim 1) split over the ranks: o and down. Their output is a partial sum
    /// reduced over the group; their bias is [`TpRole::Replicated`], added once after it.
    Row,
    /// Vocabulary rows (dim 0) split over the ranks: the embedding and the LM head.
    Vocab,
    /// Every rank holds the whole tensor: norms (QK-norm acts on head_dim, never split) and a
    /// row-parallel layer's bias.
    Replicated,
}

impl TpRole {
    /// The dimension that is split (None: replicated).
    pub fn split_dim(self) -> Option<usize> {
        match self {
            TpRole::Column | TpRole::Vocab => Some(0),
            TpRole::Row => Some(1),
            TpRole::Replicated => None,
        }
    }
}

/// One parameter, as the model describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// Fully qualified transformers name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// The full (unsharded) shape the config implies.
    pub shape: Vec<usize>,
    pub kind: ParamKind,
    pub role: TpRole,
    /// How many indivisible pieces the split dimension holds: the attention heads for q, k, v
    /// and o (GQA's key/value heads when there are fewer than ranks: each is then held whole
    /// by several ranks), else the dimension's size. 1 for a replicated parameter.
    pub units: usize,
    /// The block it belongs to (None: the embedding, the final norm, the head).
    pub layer: Option<usize>,
    /// The PEFT target name (`target_modules` entry: `q_proj`, ...) of a linear layer's weight
    /// that LoRA may adapt; None for every other parameter.
    pub lora_target: Option<&'static str>,
}

/// The features that set a block's parameters beyond Llama's (the default is Llama's block).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockFeatures {
    /// A bias on q, k and v (column-parallel, split with their rows).
    pub qkv_bias: bool,
    /// A bias on o (replicated: added after the reduction).
    pub o_bias: bool,
    /// A bias on gate and up (column-parallel) and down (replicated).
    pub mlp_bias: bool,
    /// RMSNorm weights [head_dim] on q and k (replicated).
    pub qk_norm: bool,
    /// Two more full-hidden norms a block, the sandwich's post-branch norms (replicated); the
    /// MLP's input norm is then named `pre_feedforward_layernorm`.
    pub sandwich_norms: bool,
}

/// The sizes that set the parameters' shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The LM head is the embedding (no `lm_head.weight`).
    pub tied: bool,
}

impl ParamSpec {
    fn new(name: String, shape: Vec<usize>, kind: ParamKind, role: TpRole, units: usize, layer: Option<usize>) -> ParamSpec {
        ParamSpec { name, shape, kind, role, units, layer, lora_target: None }
    }

    /// What the model's visitor hands out for this parameter.
    pub fn info(&self) -> ParamInfo<'_> {
        ParamInfo { name: &self.name, shape: &self.shape, kind: self.kind, role: self.role, units: self.units }
    }

    /// The module the parameter belongs to: its name without `.weight` / `.bias`.
    pub fn module(&self) -> &str {
        self.name.rsplit_once('.').map_or(&self.name, |(m, _)| m)
    }

    /// Elements of the whole tensor (None: past u64).
    pub fn numel(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64))
    }

    /// Number of distinct pieces `tp` ranks hold (1: replicated).
    pub fn parts(&self, tp: usize) -> usize {
        parts(self.role, self.units, tp)
    }

    /// Elements one of `tp` ranks holds (a piece held by several ranks counts on each).
    pub fn local_numel(&self, tp: usize) -> u64 {
        let n: u64 = self.shape.iter().map(|&d| d as u64).product();
        n / self.parts(tp) as u64
    }

    /// The spec of one factor of a LoRA adapter of `rank` on this linear weight (out, in): A
    /// (R, in) is split as a row-parallel base splits its input, B (out, R) as a column-parallel
    /// base splits its output; the other factor is whole on every rank (torchtitan's
    /// `models/common/lora.py` derives the placements the same way).
    pub fn adapter(&self, factor: Factor, rank: usize) -> ParamSpec {
        let (out, inp) = (self.shape[0], self.shape[1]);
        let (letter, shape, split) = match factor {
            Factor::A => ("A", vec![rank, inp], self.role == TpRole::Row),
            Factor::B => ("B", vec![out, rank], self.role == TpRole::Column),
        };
        let (role, units) = if split { (self.role, self.units) } else { (TpRole::Replicated, 1) };
        ParamSpec::new(format!("{}.lora_{letter}.weight", self.module()), shape, ParamKind::Matrix, role, units, self.layer)
    }
}

/// Pieces of a parameter of `role` whose split dimension holds `units` pieces, over `tp` ranks.
pub fn parts(role: TpRole, units: usize, tp: usize) -> usize {
    match role.split_dim() {
        None => 1,
        Some(_) => units.min(tp.max(1)).max(1),
    }
}

/// The flat-buffer bucket a parameter belongs to (`crate::buckets`): `layers.N` for block N's
/// parameters (its LoRA factors too), `embed` for the embedding, `head` for the rest.
pub fn bucket_of(name: &str) -> String {
    if let Some(i) = name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()) {
        return format!("layers.{i}");
    }
    match name.starts_with("model.embed_tokens") {
        true => "embed".into(),
        false => "head".into(),
    }
}

/// The embedding's spec.
pub fn embedding_spec(d: &Dims) -> ParamSpec {
    ParamSpec::new("model.embed_tokens.weight".into(), vec![d.vocab, d.hidden], ParamKind::Embedding, TpRole::Vocab, d.vocab, None)
}

/// Block `l`'s parameters in transformers' module order: each linear layer's weight then its
/// bias (nn.Linear's order), q/k/v/o, the q/k norms after the projections (Qwen3's attention
/// module order), gate/up/down, then the block's norms.
pub fn layer_specs(l: usize, d: &Dims, f: &BlockFeatures) -> Vec<ParamSpec> {
    use ParamKind::{Bias, Matrix, Norm};
    use TpRole::{Column, Replicated, Row};
    let (h, i) = (d.hidden, d.intermediate);
    // Saturating: a hostile config's sizes give a count past any limit (`num_parameters`), not
    // a wrapped one.
    let (q, kv) = (d.heads.saturating_mul(d.head_dim), d.kv_heads.saturating_mul(d.head_dim));
    let name = |m: &str, p: &str| format!("model.layers.{l}.{m}.{p}");
    let mut out = Vec::new();
    // (module, PEFT target, out, in, role, units, bias)
    let attn = [
        ("self_attn.q_proj", "q_proj", q, h, Column, d.heads, f.qkv_bias),
        ("self_attn.k_proj", "k_proj", kv, h, Column, d.kv_heads, f.qkv_bias),
        ("self_attn.v_proj", "v_proj", kv, h, Column, d.kv_heads, f.qkv_bias),
        ("self_attn.o_proj", "o_proj", h, q, Row, d.heads, f.o_bias),
    ];
    let mlp = [
        ("mlp.gate_proj", "gate_proj", i, h, Column, i, f.mlp_bias),
        ("mlp.up_proj", "up_proj", i, h, Column, i, f.mlp_bias),
        ("mlp.down_proj", "down_proj", h, i, Row, i, f.mlp_bias),
    ];
    let linears = |list: &[(&str, &'static str, usize, usize, TpRole, usize, bool)], out: &mut Vec<ParamSpec>| {
        for &(m, target, o, inp, role, units, bias) in list {
            let mut w = ParamSpec::new(name(m, "weight"), vec![o, inp], Matrix, role, units, Some(l));
            w.lora_target = Some(target);
            out.push(w);
            if bias {
                // A column-parallel bias is split with the weight's rows; a row-parallel one is
                // whole on every rank and added once, after the reduction.
                let (role, units) = if role == Column { (Column, units) } else { (Replicated, 1) };
                out.push(ParamSpec::new(name(m, "bias"), vec![o], Bias, role, units, Some(l)));
            }
        }
    };
    linears(&attn, &mut out);
    let norm = |m: &str, n: usize| ParamSpec::new(name(m, "weight"), vec![n], Norm, Replicated, 1, Some(l));
    if f.qk_norm {
        out.push(norm("self_attn.q_norm", d.head_dim));
        out.push(norm("self_attn.k_norm", d.head_dim));
    }
    linears(&mlp, &mut out);
    out.push(norm("input_layernorm", h));
    out.push(norm("post_attention_layernorm", h));
    if f.sandwich_norms {
        out.push(norm("pre_feedforward_layernorm", h));
        out.push(norm("post_feedforward_layernorm", h));
    }
    out
}

/// The parameters after the blocks: the final norm and, untied, the LM head.
pub fn head_specs(d: &Dims) -> Vec<ParamSpec> {
    let mut out = vec![ParamSpec::new("model.norm.weight".into(), vec![d.hidden], ParamKind::Norm, TpRole::Replicated, 1, None)];
    if !d.tied {
        // Decayed, as every projection.
        out.push(ParamSpec::new("lm_head.weight".into(), vec![d.vocab, d.hidden], ParamKind::Matrix, TpRole::Vocab, d.vocab, None));
    }
    out
}

/// Every parameter of a model, in transformers' `named_parameters()` order (a tied head
/// appears once, as the embedding).
pub fn model_specs(d: &Dims, f: &BlockFeatures) -> Vec<ParamSpec> {
    let mut out = vec![embedding_spec(d)];
    for l in 0..d.layers {
        out.extend(layer_specs(l, d, f));
    }
    out.extend(head_specs(d));
    out
}

impl LlamaConfig {
    /// The sizes that set the parameters' shapes.
    pub fn dims(&self) -> Dims {
        Dims {
            vocab: self.vocab_size,
            hidden: self.hidden_size,
            intermediate: self.intermediate_size,
            layers: self.num_hidden_layers,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            tied: self.tie_word_embeddings,
        }
    }

    /// The block features that add parameters, as the family and its keys turn them on.
    pub fn block_features(&self) -> BlockFeatures {
        BlockFeatures {
            qkv_bias: self.qkv_bias(),
            o_bias: self.o_bias(),
            mlp_bias: self.mlp_bias,
            qk_norm: self.qk_norm(),
            sandwich_norms: self.sandwich_norms(),
        }
    }

    /// Parameters of the model (embedding, every block, final norm and the head unless tied),
    /// summed over its specs in checked arithmetic: `None` when the count overflows u64.
    pub fn num_parameters(&self) -> Option<u64> {
        let (d, f) = (self.dims(), self.block_features());
        let sum = |specs: &[ParamSpec]| specs.iter().try_fold(0u64, |n, s| n.checked_add(s.numel()?));
        let layers = sum(&layer_specs(0, &d, &f))?.checked_mul(d.layers as u64)?;
        sum(&[embedding_spec(&d)])?.checked_add(layers)?.checked_add(sum(&head_specs(&d))?)
    }

    /// Every parameter of the model this config describes, in transformers' order.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        model_specs(&self.dims(), &self.block_features())
    }

    /// Block `l`'s parameters.
    pub fn layer_specs(&self, l: usize) -> Vec<ParamSpec> {
        layer_specs(l, &self.dims(), &self.block_features())
    }

    /// The weights of block `l`'s linear layers that LoRA may adapt, in order (q, k, v, o,
    /// gate, up, down): the one place their (out, in) shapes come from.
    pub fn linear_specs(&self, l: usize) -> Vec<ParamSpec> {
        self.layer_specs(l).into_iter().filter(|s| s.lora_target.is_some()).collect()
    }

    /// The (out, in) of each adaptable linear layer of a block, by PEFT target name.
    pub fn linear_shapes(&self) -> Vec<(&'static str, (usize, usize))> {
        self.linear_specs(0).iter().filter_map(|s| Some((s.lora_target?, (s.shape[0], s.shape[1])))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> LlamaConfig {
        let base = r#""vocab_size":64,"hidden_size":32,"intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2"#;
        LlamaConfig::from_json_str(&format!("{{{base},{extra}}}")).unwrap()
    }

    fn find<'a>(s: &'a [ParamSpec], name: &str) -> &'a ParamSpec {
        s.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("no {name} in {:?}", s.iter().map(|p| &p.name).collect::<Vec<_>>()))
    }

    #[test]
    fn llama_block_roles_and_peft_names() {
        let s = cfg(r#""model_type":"llama","tie_word_embeddings":false"#).param_specs();
        let role = |n: &str| find(&s, n).role;
        assert_eq!(role("model.embed_tokens.weight"), TpRole::Vocab);
        assert_eq!(role("lm_head.weight"), TpRole::Vocab);
        assert_eq!(role("model.layers.1.self_attn.q_proj.weight"), TpRole::Column);
        assert_eq!(role("model.layers.1.self_attn.o_proj.weight"), TpRole::Row);
        assert_eq!(role("model.layers.0.mlp.down_proj.weight"), TpRole::Row);
        assert_eq!(role("model.layers.0.mlp.up_proj.weight"), TpRole::Column);
        assert_eq!(role("model.layers.0.input_layernorm.weight"), TpRole::Replicated);
        assert_eq!(role("model.norm.weight"), TpRole::Replicated);
        assert!(!s.iter().any(|p| p.kind == ParamKind::Bias), "a Llama has no bias");
        let targets: Vec<_> = s.iter().filter(|p| p.layer == Some(0)).filter_map(|p| p.lora_target).collect();
        assert_eq!(targets, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]);
        assert_eq!(find(&s, "model.layers.0.self_attn.k_proj.weight").units, 2, "key/value heads");
        assert!(find(&s, "lm_head.weight").lora_target.is_none(), "the head is not adapted");
        // Shapes and count: 2 blocks of 11 tensors, the embedding, the final norm, the head.
        assert_eq!(s.len(), 2 * 9 + 3);
        assert_eq!(find(&s, "model.layers.0.self_attn.k_proj.weight").shape, [16, 32]);
    }

    #[test]
    fn a_column_bias_is_column_and_a_row_bias_replicated() {
        let s = cfg(r#""model_type":"qwen2","tie_word_embeddings":true"#).param_specs();
        for p in ["q_proj", "k_proj", "v_proj"] {
            let b = find(&s, &format!("model.layers.0.self_attn.{p}.bias"));
            assert_eq!((b.role, b.kind, b.lora_target), (TpRole::Column, ParamKind::Bias, None), "{p}");
        }
        assert_eq!(find(&s, "model.layers.0.self_attn.k_proj.bias").units, 2);
        assert!(!s.iter().any(|p| p.name.ends_with("o_proj.bias")), "Qwen2 has no o bias");
        let s = cfg(r#""model_type":"llama","attention_bias":true,"mlp_bias":true"#).param_specs();
        assert_eq!(find(&s, "model.layers.0.self_attn.o_proj.bias").role, TpRole::Replicated);
        assert_eq!(find(&s, "model.layers.0.mlp.down_proj.bias").role, TpRole::Replicated);
        assert_eq!(find(&s, "model.layers.0.mlp.gate_proj.bias").role, TpRole::Column);
        // A bias follows its weight (nn.Linear's order).
        let i = s.iter().position(|p| p.name == "model.layers.0.self_attn.q_proj.weight").unwrap();
        assert_eq!(s[i + 1].name, "model.layers.0.self_attn.q_proj.bias");
    }

    #[test]
    fn tied_embeddings_appear_once() {
        let gemma = r#""model_type":"gemma3_text","head_dim":16,"layer_types":["sliding_attention","full_attention"]"#;
        for ty in [r#""model_type":"qwen2""#, r#""model_type":"llama""#, gemma] {
            let s = cfg(&format!(r#"{ty},"tie_word_embeddings":true"#)).param_specs();
            assert!(!s.iter().any(|p| p.name == "lm_head.weight"), "{ty}");
            assert_eq!(s.iter().filter(|p| p.role == TpRole::Vocab).count(), 1, "{ty}");
        }
    }

    #[test]
    fn qwen3_qk_norm_is_replicated_over_head_dim() {
        let s = cfg(r#""model_type":"qwen3","head_dim":16"#).param_specs();
        for n in ["q_norm", "k_norm"] {
            let p = find(&s, &format!("model.layers.1.self_attn.{n}.weight"));
            assert_eq!((p.role, p.kind, p.shape.clone()), (TpRole::Replicated, ParamKind::Norm, vec![16]), "{n}");
        }
        assert_eq!(find(&s, "model.layers.1.self_attn.q_proj.weight").shape, [64, 32], "explicit head_dim");
        assert_eq!(find(&s, "model.layers.1.self_attn.o_proj.weight").shape, [32, 64]);
    }

    #[test]
    fn gemma3_has_four_norms_a_block() {
        let c =
            cfg(r#""model_type":"gemma3_text","head_dim":16,"sliding_window":512,"layer_types":["sliding_attention","full_attention"]"#);
        let s = c.layer_specs(0);
        let norms: Vec<_> = s.iter().filter(|p| p.kind == ParamKind::Norm && p.shape == [32]).map(|p| p.module()).collect();
        assert_eq!(
            norms,
            [
                "model.layers.0.input_layernorm",
                "model.layers.0.post_attention_layernorm",
                "model.layers.0.pre_feedforward_layernorm",
                "model.layers.0.post_feedforward_layernorm"
            ]
        );
        assert!(s.iter().filter(|p| p.kind == ParamKind::Norm).all(|p| p.role == TpRole::Replicated));
        assert_eq!(s.iter().filter(|p| p.name.ends_with("_norm.weight") && p.shape == [16]).count(), 2, "QK-norm");
    }

    #[test]
    fn adapters_split_as_their_base() {
        let c = cfg(r#""model_type":"llama""#);
        let l = c.linear_specs(0);
        let (q, k, o) = (&l[0], &l[1], &l[3]);
        let a = |s: &ParamSpec, f| s.adapter(f, 4);
        assert_eq!(a(q, Factor::B).role, TpRole::Column);
        assert_eq!(a(q, Factor::A).role, TpRole::Replicated);
        assert_eq!((a(k, Factor::B).role, a(k, Factor::B).units), (TpRole::Column, 2), "B of k splits by kv heads");
        assert_eq!(a(o, Factor::A).role, TpRole::Row);
        assert_eq!(a(o, Factor::B).role, TpRole::Replicated);
        assert_eq!(a(o, Factor::A).name, "model.layers.0.self_attn.o_proj.lora_A.weight");
        assert_eq!((a(o, Factor::A).shape.clone(), a(o, Factor::B).shape.clone()), (vec![4, 32], vec![32, 4]));
        assert_eq!(c.linear_shapes()[4], ("gate_proj", (48, 32)));
    }

    #[test]
    fn local_counts_follow_the_roles() {
        let s = cfg(r#""model_type":"qwen2","num_key_value_heads":1"#).param_specs();
        let k = find(&s, "model.layers.0.self_attn.k_proj.weight");
        assert_eq!(k.local_numel(2), 8 * 32, "one kv head held whole by both ranks");
        assert_eq!(find(&s, "model.layers.0.self_attn.q_proj.weight").local_numel(2), 32 * 32 / 2);
        assert_eq!(find(&s, "model.layers.0.input_layernorm.weight").local_numel(4), 32);
        assert_eq!(bucket_of("model.layers.1.mlp.up_proj.lora_A.weight"), "layers.1");
        assert_eq!(bucket_of("model.embed_tokens.weight"), "embed");
        assert_eq!(bucket_of("lm_head.weight"), "head");
    }
}
