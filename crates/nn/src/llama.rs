//! LLaMA (Touvron et al. 2023) exactly as transformers' `LlamaForCausalLM` computes it:
//! token embedding, N pre-norm blocks of (RMSNorm -> GQA attention with RoPE -> residual,
//! RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm and the LM head (tied or not).
//! Weights use transformers' names and layout ([out, in]: y = x W^T), so checkpoints move both
//! ways. Shapes: B batch, T time, C hidden, H query heads, KV key/value heads, D head_dim,
//! I intermediate, V vocab. Parallelism is attached from outside; this file never sees it.
use crate::checkpoint::{self, TensorMap};
use crate::config::{LlamaConfig, RopeScaling};
use crate::generate::KvCache;
use ferrolm_tensor::{DType, Device, Error, Result, Rng, Tensor};
use std::path::Path;

/// Per-block hyper-parameters (Copy, so checkpoint closures capture them cheaply).
#[derive(Clone, Copy, Debug)]
struct Dims {
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    eps: f64,
}

/// One transformer block's parameters (each a shared handle: clones are cheap).
#[derive(Clone)]
struct Block {
    input_layernorm: Tensor,          // (C)
    q_proj: Tensor,                   // (H*D, C)
    k_proj: Tensor,                   // (KV*D, C)
    v_proj: Tensor,                   // (KV*D, C)
    o_proj: Tensor,                   // (C, H*D)
    post_attention_layernorm: Tensor, // (C)
    gate_proj: Tensor,                // (I, C)
    up_proj: Tensor,                  // (I, C)
    down_proj: Tensor,                // (C, I)
    dims: Dims,
}

pub struct Llama {
    cfg: LlamaConfig,
    embed_tokens: Tensor, // (V, C)
    blocks: Vec<Block>,
    norm: Tensor,            // (C)
    lm_head: Option<Tensor>, // (V, C); None when tied to embed_tokens
    rope_cos: Tensor,        // (max_position_embeddings, D)
    rope_sin: Tensor,        // (max_position_embeddings, D)
    checkpointing: bool,
    dtype: DType,
    device: Device,
}

/// y = x W^T over the last dim of x (..., in) with W (out, in).
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let d = x.dims();
    let (lead, cin) = (&d[..d.len() - 1], d[d.len() - 1]);
    let n: usize = lead.iter().product();
    let y = x.reshape([n, cin].to_vec())?.matmul(&w.t()?)?; // (N, out)
    let mut out = lead.to_vec();
    out.push(w.dim(0));
    y.reshape(out)
}

/// (B, T, heads*D) -> (B, heads, T, D)
fn split_heads(x: &Tensor, heads: usize, d: usize) -> Result<Tensor> {
    let (b, t) = (x.dim(0), x.dim(1));
    x.reshape(vec![b, t, heads, d])?.permute(&[0, 2, 1, 3])
}

/// (B, heads, T, D) -> (B, T, heads*D)
fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
    x.permute(&[0, 2, 1, 3])?.reshape(vec![b, t, h * d])
}

impl Block {
    /// q, k, v projections with rope applied: (B, H, T, D), (B, KV, T, D), (B, KV, T, D).
    fn qkv(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let Dims { n_head, n_kv_head, head_dim, .. } = self.dims;
        let q = split_heads(&linear(x, &self.q_proj)?, n_head, head_dim)?.rope(cos, sin)?;
        let k = split_heads(&linear(x, &self.k_proj)?, n_kv_head, head_dim)?.rope(cos, sin)?;
        let v = split_heads(&linear(x, &self.v_proj)?, n_kv_head, head_dim)?;
        Ok((q, k, v))
    }

    fn attention(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (q, k, v) = self.qkv(x, cos, sin)?;
        let scale = 1.0 / (self.dims.head_dim as f64).sqrt();
        let y = Tensor::causal_attention(&q, &k, &v, scale)?; // (B, H, T, D), GQA native
        linear(&merge_heads(&y)?, &self.o_proj) // (B, T, C)
    }

    fn mlp(&self, x: &Tensor) -> Result<Tensor> {
        let h = Tensor::swiglu(&linear(x, &self.gate_proj)?, &linear(x, &self.up_proj)?)?; // (B, T, I)
        linear(&h, &self.down_proj) // (B, T, C)
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let eps = self.dims.eps;
        let x = x.add(&self.attention(&x.rms_norm(&self.input_layernorm, eps)?, cos, sin)?)?;
        x.add(&self.mlp(&x.rms_norm(&self.post_attention_layernorm, eps)?)?)
    }

    /// Decoding step: attends over the cached keys/values plus the new ones (no autograd use).
    fn forward_cached(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, kv: &mut Option<(Tensor, Tensor)>, past: usize) -> Result<Tensor> {
        let eps = self.dims.eps;
        let (q, k, v) = self.qkv(&x.rms_norm(&self.input_layernorm, eps)?, cos, sin)?;
        let (k, v) = match kv.take() {
            Some((pk, pv)) => (Tensor::cat(&[pk, k], 2)?, Tensor::cat(&[pv, v], 2)?), // (B, KV, past+T, D)
            None => (k, v),
        };
        *kv = Some((k.clone(), v.clone()));
        let y = cached_attention(&q, &k, &v, past)?;
        let x = x.add(&linear(&merge_heads(&y)?, &self.o_proj)?)?;
        x.add(&self.mlp(&x.rms_norm(&self.post_attention_layernorm, eps)?)?)
    }
}

/// Attention of T new queries at positions past..past+T over S = past+T keys, with GQA done by
/// grouping query heads per key/value head (never copying K/V).
fn cached_attention(q: &Tensor, k: &Tensor, v: &Tensor, past: usize) -> Result<Tensor> {
    let (b, h, t, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let (kvh, s) = (k.dim(1), k.dim(2));
    let g = h / kvh;
    let q = q.contiguous()?.reshape(vec![b, kvh, g * t, d])?; // (B, KV, G*T, D)
    let scores = q.matmul(&k.t()?)?.mul_scalar(1.0 / (d as f64).sqrt())?; // (B, KV, G*T, S)
    let mask: Vec<f32> = (0..g * t).flat_map(|r| (0..s).map(move |j| if j <= past + r % t { 0.0 } else { -1e30 })).collect();
    let mask = Tensor::from_vec(mask, vec![g * t, s], Device::Cpu)?.to_dtype(q.dtype())?.to_device(q.device())?;
    let p = scores.add(&mask)?.softmax_last()?;
    p.matmul(v)?.reshape(vec![b, h, t, d]) // (B, H, T, D)
}

/// HF's inv_freq (rounded to f32 like HF's buffer), with llama3 wavelength smoothing.
fn inv_freq(cfg: &LlamaConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    (0..d / 2)
        .map(|i| {
            let f = 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64);
            let f = match cfg.rope_scaling {
                RopeScaling::Default => f,
                RopeScaling::Llama3 { factor, low_freq_factor: lo, high_freq_factor: hi, original_max_position_embeddings: old } => {
                    let old = old as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < old / hi {
                        f // high frequency: kept
                    } else if wavelen > old / lo {
                        f / factor // low frequency: scaled
                    } else {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                }
            };
            f as f32
        })
        .collect()
}

/// cos, sin tables (positions, D) with emb = cat(freqs, freqs); the angle pos * inv_freq is
/// rounded to f32 as HF's f32 matmul does, then cos/sin taken in f64.
fn rope_tables(cfg: &LlamaConfig, dtype: DType, device: Device) -> Result<(Tensor, Tensor)> {
    let (n, d) = (cfg.max_position_embeddings, cfg.head_dim);
    let inv = inv_freq(cfg);
    let (mut cos, mut sin) = (Vec::with_capacity(n * d), Vec::with_capacity(n * d));
    for pos in 0..n {
        for j in 0..d {
            let angle = (pos as f32 * inv[j % (d / 2)]) as f64;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let mk = |v: Vec<f64>| Tensor::from_vec(v, vec![n, d], Device::Cpu)?.to_dtype(dtype)?.to_device(device);
    Ok((mk(cos)?, mk(sin)?))
}

fn load_err(file: &Path, msg: impl std::fmt::Display) -> Error {
    Error::new("Llama::from_pretrained", format!("{}: {msg}", file.display()))
}

impl Llama {
    /// Fresh model with transformers' init: every matrix N(0, initializer_range), norms 1.
    pub fn new(cfg: LlamaConfig, dtype: DType, device: Device, rng: &mut Rng) -> Result<Self> {
        cfg.validate()?;
        let std = cfg.initializer_range;
        let mut tensors = TensorMap::new();
        for (name, shape) in Self::expected_shapes(&cfg) {
            let t = if name.ends_with("norm.weight") {
                Tensor::ones(shape, dtype, device)?
            } else {
                Tensor::randn(shape, std, dtype, device, rng)?
            };
            tensors.insert(name, t);
        }
        Self::from_tensors(cfg, tensors, dtype, device)
    }

    /// transformers' parameter names and shapes, in `named_parameters()` order.
    fn expected_shapes(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
        let (c, i, v, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim);
        let (hd, kvd) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, c])];
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            out.extend([
                (format!("{p}.self_attn.q_proj.weight"), vec![hd, c]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kvd, c]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kvd, c]),
                (format!("{p}.self_attn.o_proj.weight"), vec![c, hd]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, c]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, c]),
                (format!("{p}.mlp.down_proj.weight"), vec![c, i]),
                (format!("{p}.input_layernorm.weight"), vec![c]),
                (format!("{p}.post_attention_layernorm.weight"), vec![c]),
            ]);
        }
        out.push(("model.norm.weight".to_string(), vec![c]));
        if !cfg.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![v, c]));
        }
        out
    }

    /// Builds the model from a complete, shape-checked name -> tensor map.
    fn from_tensors(cfg: LlamaConfig, mut t: TensorMap, dtype: DType, device: Device) -> Result<Self> {
        let mut take = |n: &str| -> Tensor {
            let p = t.remove(n).expect("checked by the caller");
            p.set_requires_grad(true).expect("float leaf");
            p
        };
        let dims =
            Dims { n_head: cfg.num_attention_heads, n_kv_head: cfg.num_key_value_heads, head_dim: cfg.head_dim, eps: cfg.rms_norm_eps };
        let embed_tokens = take("model.embed_tokens.weight");
        let blocks = (0..cfg.num_hidden_layers)
            .map(|l| {
                let p = format!("model.layers.{l}");
                Block {
                    input_layernorm: take(&format!("{p}.input_layernorm.weight")),
                    q_proj: take(&format!("{p}.self_attn.q_proj.weight")),
                    k_proj: take(&format!("{p}.self_attn.k_proj.weight")),
                    v_proj: take(&format!("{p}.self_attn.v_proj.weight")),
                    o_proj: take(&format!("{p}.self_attn.o_proj.weight")),
                    post_attention_layernorm: take(&format!("{p}.post_attention_layernorm.weight")),
                    gate_proj: take(&format!("{p}.mlp.gate_proj.weight")),
                    up_proj: take(&format!("{p}.mlp.up_proj.weight")),
                    down_proj: take(&format!("{p}.mlp.down_proj.weight")),
                    dims,
                }
            })
            .collect();
        let norm = take("model.norm.weight");
        let lm_head = (!cfg.tie_word_embeddings).then(|| take("lm_head.weight"));
        let (rope_cos, rope_sin) = rope_tables(&cfg, dtype, device)?;
        Ok(Llama { cfg, embed_tokens, blocks, norm, lm_head, rope_cos, rope_sin, checkpointing: false, dtype, device })
    }

    /// Loads a transformers checkpoint directory: `config.json` plus `model.safetensors` (or a
    /// sharded `model.safetensors.index.json`); f32/bf16/f16 weights are converted to `dtype`.
    pub fn from_pretrained(dir: &Path, dtype: DType, device: Device) -> Result<Self> {
        if !dtype.is_float() {
            return Err(load_err(dir, format!("model dtype must be a float type, got {dtype}")));
        }
        let cfg = LlamaConfig::from_file(dir.join("config.json"))?;
        let single = dir.join("model.safetensors");
        let file = if single.is_file() { single } else { dir.join("model.safetensors.index.json") };
        let mut tensors = checkpoint::load_model_dir(dir, dtype, device)?;
        // Buffers some older exports include; they are recomputed, never learned.
        tensors.retain(|n, _| !n.ends_with("rotary_emb.inv_freq"));
        if cfg.tie_word_embeddings {
            tensors.remove("lm_head.weight"); // transformers ties it to the embedding too
        }
        let expected = Self::expected_shapes(&cfg);
        for (name, shape) in &expected {
            let t = tensors.get(name).ok_or_else(|| load_err(&file, format!("missing tensor `{name}` (expected shape {shape:?})")))?;
            if t.dims() != shape.as_slice() {
                return Err(load_err(&file, format!("tensor `{name}` has shape {:?}, but config.json implies {shape:?}", t.dims())));
            }
        }
        if let Some(name) = tensors.keys().find(|n| !expected.iter().any(|(e, _)| e == *n)) {
            return Err(load_err(&file, format!("unknown tensor `{name}` (not a LlamaForCausalLM parameter for this config)")));
        }
        Self::from_tensors(cfg, tensors, dtype, device)
    }

    /// Writes `config.json` and `model.safetensors` (f32) with transformers' names.
    pub fn save_pretrained(&self, dir: &Path) -> Result<()> {
        self.save_pretrained_dtype(dir, DType::F32)
    }

    /// As `save_pretrained`, storing weights as `dtype` (F32 or BF16). Files are written
    /// atomically (temp file, then rename).
    pub fn save_pretrained_dtype(&self, dir: &Path, dtype: DType) -> Result<()> {
        let hf = match dtype {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            other => return Err(Error::new("Llama::save_pretrained", format!("cannot save weights as {other}: use f32 or bf16"))),
        };
        let path = checkpoint::prepare_dir(dir, "model.safetensors")?;
        checkpoint::save_safetensors(&path, &self.parameters(), Some(dtype))?;
        checkpoint::write_atomic(&dir.join("config.json"), self.cfg.to_json_string_dtype(hf).as_bytes())
    }

    // ---- forward ---------------------------------------------------------------------------

    fn check_ids(&self, ids: &Tensor, past: usize) -> Result<(usize, usize)> {
        if ids.dtype() != DType::I32 || ids.rank() != 2 {
            return Err(Error::new("Llama::forward", format!("ids must be i32 (batch, seq), got {:?} {}", ids.shape(), ids.dtype())));
        }
        let (b, t) = (ids.dim(0), ids.dim(1));
        let max = self.cfg.max_position_embeddings;
        if t == 0 || past + t > max {
            return Err(Error::new(
                "Llama::forward",
                format!("sequence positions {past}..{} exceed max_position_embeddings {max} (or are empty)", past + t),
            ));
        }
        Ok((b, t))
    }

    /// Final norm and LM head: (B, T, C) -> (B, T, V).
    fn head(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.rms_norm(&self.norm, self.cfg.rms_norm_eps)?;
        linear(&x, self.lm_head.as_ref().unwrap_or(&self.embed_tokens))
    }

    /// Logits (B, T, V) for i32 token ids (B, T).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (_, t) = self.check_ids(ids, 0)?;
        let cos = self.rope_cos.narrow(0, 0, t)?; // (T, D)
        let sin = self.rope_sin.narrow(0, 0, t)?;
        let mut x = Tensor::embedding(ids, &self.embed_tokens)?; // (B, T, C)
        for blk in &self.blocks {
            x = if self.checkpointing {
                let (blk, cos, sin) = (blk.clone(), cos.clone(), sin.clone());
                ferrolm_tensor::checkpoint(&[x], move |xs| blk.forward(&xs[0], &cos, &sin))?
            } else {
                blk.forward(&x, &cos, &sin)?
            };
        }
        self.head(&x)
    }

    /// Mean cross-entropy (f32 scalar) of `forward(inputs)` against `targets` (B, T) i32, aligned
    /// so that position t predicts targets[t]; -100 is ignored.
    pub fn loss(&self, inputs: &Tensor, targets: &Tensor) -> Result<Tensor> {
        if targets.dims() != inputs.dims() || targets.dtype() != DType::I32 {
            return Err(Error::new(
                "Llama::loss",
                format!("targets must be i32 of the inputs' shape {:?}, got {:?} {}", inputs.shape(), targets.shape(), targets.dtype()),
            ));
        }
        let logits = self.forward(inputs)?; // (B, T, V)
        let (n, v) = (inputs.numel(), self.cfg.vocab_size);
        Tensor::cross_entropy(&logits.reshape(vec![n, v])?, &targets.reshape(vec![n])?, -100)
    }

    /// Logits (B, T, V) for ids that continue the sequences held in `cache` (generation).
    pub fn forward_with_cache(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let past = cache.len();
        let (b, t) = self.check_ids(ids, past)?;
        cache.prepare(self.blocks.len(), b)?;
        let cos = self.rope_cos.narrow(0, past, t)?; // (T, D)
        let sin = self.rope_sin.narrow(0, past, t)?;
        let mut x = Tensor::embedding(ids, &self.embed_tokens)?; // (B, T, C)
        for (blk, kv) in self.blocks.iter().zip(cache.layers_mut()) {
            x = blk.forward_cached(&x, &cos, &sin, kv, past)?;
        }
        cache.advance(t);
        self.head(&x)
    }

    // ---- parameters --------------------------------------------------------------------------

    /// Every parameter with transformers' name (tied models have no `lm_head.weight`).
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), self.embed_tokens.clone())];
        for (l, b) in self.blocks.iter().enumerate() {
            let p = format!("model.layers.{l}");
            out.extend([
                (format!("{p}.self_attn.q_proj.weight"), b.q_proj.clone()),
                (format!("{p}.self_attn.k_proj.weight"), b.k_proj.clone()),
                (format!("{p}.self_attn.v_proj.weight"), b.v_proj.clone()),
                (format!("{p}.self_attn.o_proj.weight"), b.o_proj.clone()),
                (format!("{p}.mlp.gate_proj.weight"), b.gate_proj.clone()),
                (format!("{p}.mlp.up_proj.weight"), b.up_proj.clone()),
                (format!("{p}.mlp.down_proj.weight"), b.down_proj.clone()),
                (format!("{p}.input_layernorm.weight"), b.input_layernorm.clone()),
                (format!("{p}.post_attention_layernorm.weight"), b.post_attention_layernorm.clone()),
            ]);
        }
        out.push(("model.norm.weight".to_string(), self.norm.clone()));
        if let Some(h) = &self.lm_head {
            out.push(("lm_head.weight".to_string(), h.clone()));
        }
        out
    }

    pub fn num_params(&self) -> usize {
        self.parameters().iter().map(|(_, t)| t.numel()).sum()
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> Device {
        self.device
    }

    /// Recompute each block's activations in backward instead of storing them.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.checkpointing = on;
    }
    pub fn activation_checkpointing(&self) -> bool {
        self.checkpointing
    }
}

/// HF's causal-LM label shift as aligned targets: row-wise `labels[1:]` followed by -100, so
/// that `Llama::loss(ids, shift_labels(labels))` equals transformers' loss for `labels`.
pub fn shift_labels(labels: &[i32], seq_len: usize) -> Vec<i32> {
    labels.chunks(seq_len.max(1)).flat_map(|row| row[1..].iter().copied().chain([-100])).collect()
}
