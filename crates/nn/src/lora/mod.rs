//! LoRA (Hu et al. 2021, arXiv 2106.09685) on any of a Llama's seven linear layers, as Hugging
//! Face PEFT computes it, so adapters move both ways (`peft`).
//!
//! A targeted layer keeps its weight W (out, in) frozen in the model's dtype (no gradient, no
//! optimizer state) and gains two f32 factors, A (R, in) and B (out, R), the only parameters
//! training sees (`Llama::visit_trainable_mut`: the engine, its buckets, ZeRO, offload and the
//! checkpoints hold nothing else). Its output is
//!
//! ```text
//! y = x W^T + s · dropout(x) A^T B^T,   s = alpha / R   (rsLoRA: alpha / sqrt(R))
//! ```
//!
//! initialised as PEFT does: A Kaiming-uniform (a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B zero,
//! so step 0 is the base model. The factors are cast to the activations' dtype where they are
//! used (bf16 on a GPU, as torch's autocast does), and their gradients come back in f32.
//!
//! What it costs, per adapted layer of N tokens (`project`): the base GEMM as before, minus its
//! weight gradient (the frozen W needs only dX = G W); u = x A^T, (N, R); y = base + s u B^T in
//! the up-projection GEMM, whose addend is the base output and whose alpha is s (no add or scale
//! kernel; PEFT adds in a kernel of its own), as one recorded op (`module::linear_adapted`) that
//! saves for backward only u and B (cast once) beside what the base GEMM saves. Backward:
//! dU = s G B, dB = s G^T u (in f32, into B's gradient slice), dA = dU^T x, dX += dU A (the
//! GEMM's addend). The frozen base's norms and biases get no gradient pass either.
//! Layers that read one input (q, k and v; gate and up) share their down-projection: one GEMM
//! against their A's stacked (R_q + R_k + R_v, in) reads x once instead of three times, and in
//! backward dA and dX's adapter term are one GEMM each over that x too. At R << in every adapter
//! GEMM is bound by reading x or writing y (N·in and N·out elements), not by its FLOPs, so the
//! shared read is what pays: an attention block's adapters read its (N, C) input 2 times instead
//! of 6, an MLP's 2 instead of 4 (docs/ARCHITECTURE.md counts the launches). The stack is
//! built by casting each f32 A into its rows (`stack_cast`), and each layer's u is a column view
//! of the shared product that the up-projection GEMM reads in place; `tests/gpu_launches.rs`
//! holds a LoRA step's launches to a record (docs/BENCHMARKS.md, "LoRA step launches").
//!
//! Tensor parallelism places the factors as Megatron places a weight's pieces (`LinearOp`'s
//! `adapter_*` hooks, supplied by `ferrolm_parallel::tp`): a column-parallel layer splits B by
//! output rows and replicates A, a row-parallel layer splits A by input columns and replicates
//! B, and a replicated factor's gradient is summed over the ranks.
//!
//! Dropout masks are a function of (seed, forward, adapter, element), drawn on the host: the
//! same on every tensor-parallel rank for a replicated input, each rank's columns of one mask
//! for a split one, and the same again when activation checkpointing recomputes a branch.
pub mod peft;

use crate::llama::Llama;
use crate::module::{Factor, Linear, ParamVisitor};
use ferrolm_tensor::{bail, is_grad_enabled, no_grad, DType, Device, Error, Result, Rng, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One of a Llama block's seven linear layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Proj {
    /// Every projection, in the order of a block's parameters.
    pub const ALL: [Proj; 7] = [Proj::Q, Proj::K, Proj::V, Proj::O, Proj::Gate, Proj::Up, Proj::Down];

    /// The `--lora-targets` name: q, k, v, o, gate, up, down.
    pub fn flag(self) -> &'static str {
        ["q", "k", "v", "o", "gate", "up", "down"][self as usize]
    }
    /// transformers' module name (PEFT's `target_modules`): q_proj, ..., down_proj.
    pub fn module(self) -> &'static str {
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"][self as usize]
    }
    /// The module's path inside a block: `self_attn.q_proj`, ..., `mlp.down_proj`.
    pub fn path(self) -> &'static str {
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
            [self as usize]
    }
    /// `--lora-targets`: `all-linear`, or a comma-separated list of q, k, v, o, gate, up, down
    /// (transformers' names q_proj, ... are accepted too). Sorted, without repeats.
    pub fn parse_list(s: &str) -> Result<Vec<Proj>> {
        let s = s.trim();
        if s == "all-linear" {
            return Ok(Proj::ALL.to_vec());
        }
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim) {
            if part == "all-linear" {
                // Not a layer but every layer: it takes no company.
                return Err(Error::new(
                    "--lora-targets",
                    format!("`all-linear` stands alone (it means all seven layers), not in a list: `{s}`"),
                ));
            }
            let p = Proj::ALL.into_iter().find(|p| part == p.flag() || part == p.module()).ok_or_else(|| {
                Error::new(
                    "--lora-targets",
                    format!("`{part}` is not a linear layer of a Llama block (known: q, k, v, o, gate, up, down, or all-linear)"),
                )
            })?;
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out.sort();
        Ok(out)
    }

    /// Whether this projection is the linear layer whose PEFT target name is `target`.
    pub fn is(self, target: Option<&str>) -> bool {
        target == Some(self.module())
    }
}

/// What adapters a model gets: PEFT's `LoraConfig` fields that ferrolm implements.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// R, the factors' inner dimension (PEFT's `r`).
    pub rank: usize,
    /// PEFT's `lora_alpha`; the flag's default is 2R.
    pub alpha: f64,
    /// PEFT's `lora_dropout`: the probability of zeroing an input element of the adapter.
    pub dropout: f64,
    /// The adapted projections, sorted.
    pub targets: Vec<Proj>,
    /// PEFT's `use_rslora`: scale alpha / sqrt(R) instead of alpha / R.
    pub rslora: bool,
    /// PEFT's `layers_to_transform`: the blocks that get adapters (None: all).
    pub layers: Option<Vec<usize>>,
}

impl LoraConfig {
    /// Rank R with alpha (None: 2R), dropout and targets, every block adapted.
    pub fn new(rank: usize, alpha: Option<f64>, dropout: f64, targets: Vec<Proj>, rslora: bool) -> Result<LoraConfig> {
        let c = LoraConfig { rank, alpha: alpha.unwrap_or(2.0 * rank as f64), dropout, targets, rslora, layers: None };
        c.check()?;
        Ok(c)
    }

    /// The adapter's output scale s: alpha / R, or alpha / sqrt(R) with rsLoRA.
    pub fn scale(&self) -> f64 {
        match self.rslora {
            true => self.alpha / (self.rank as f64).sqrt(),
            false => self.alpha / self.rank as f64,
        }
    }

    /// Rank at least 1, alpha finite, dropout in [0, 1), at least one target (errors name the flag).
    pub fn check(&self) -> Result<()> {
        if self.rank == 0 {
            bail!("--lora-rank", "must be at least 1, got 0");
        }
        if !self.alpha.is_finite() {
            bail!("--lora-alpha", "must be a finite number, got {}", self.alpha);
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("--lora-dropout", "must be in [0, 1), got {}", self.dropout);
        }
        if self.targets.is_empty() {
            bail!("--lora-targets", "names no layer");
        }
        Ok(())
    }

    /// Whether block `layer` carries adapters.
    pub fn adapts_layer(&self, layer: usize) -> bool {
        self.layers.as_ref().is_none_or(|l| l.contains(&layer))
    }
}

/// Counts the model's training forwards: with the seed, it picks each forward's dropout masks.
struct Clock {
    seed: u64,
    forwards: AtomicU64,
}

/// A model's LoRA settings and its dropout clock.
#[derive(Clone)]
pub(crate) struct LoraState {
    pub(crate) cfg: LoraConfig,
    clock: Arc<Clock>,
}

impl LoraState {
    /// A new forward pass begins: training forwards (gradients on) draw new dropout masks.
    pub(crate) fn tick(&self) {
        if is_grad_enabled() {
            self.clock.forwards.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Inverted dropout on an adapter's input (PEFT's `lora_dropout`), on while gradients are.
#[derive(Clone)]
pub struct Dropout {
    pub p: f64,
    clock: Arc<Clock>,
    /// The adapter's index in the model: its masks differ from every other adapter's.
    index: u64,
}

/// SplitMix64's finaliser: a counter-based generator (any element's draw without the others).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Dropout {
    fn active(&self) -> bool {
        self.p > 0.0 && is_grad_enabled()
    }

    /// x (..., d) with elements zeroed with probability p and the rest scaled by 1 / (1 - p);
    /// `columns` as `Adapter::columns`.
    fn apply(&self, x: &Tensor, columns: Option<(usize, usize)>) -> Result<Tensor> {
        if !self.active() {
            return Ok(x.clone());
        }
        let d = x.dim(x.rank() - 1);
        let rows = x.numel() / d.max(1);
        let (full, first) = columns.unwrap_or((d, 0));
        let key = mix(self.clock.seed ^ mix(self.clock.forwards.load(Ordering::Relaxed) ^ mix(self.index)));
        let keep = (1.0 / (1.0 - self.p)) as f32;
        let threshold = (self.p * (1u64 << 53) as f64) as u64;
        let mut mask = Vec::with_capacity(rows * d);
        for r in 0..rows {
            for c in 0..d {
                let draw = mix(key ^ (r * full + first + c) as u64) >> 11;
                mask.push(if draw < threshold { 0.0 } else { keep });
            }
        }
        let mask = Tensor::from_vec(mask, x.shape().clone(), Device::Cpu)?.to_dtype(x.dtype())?.to_device(x.device())?;
        x.mul(&mask)
    }
}

thread_local! {
    static ADAPTERS_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, every adapted layer runs as its frozen base alone (W x, no B A x) on this
/// thread: the reference model of preference tuning with LoRA is the base, computed by the same
/// weights with no copy (TRL's `disable_adapter()`). Restores the previous state when dropped.
/// Thread-local like `no_grad`: each tensor-parallel rank's thread takes its own.
#[must_use = "the adapters are on again when the guard is dropped"]
pub struct AdaptersOff {
    prev: bool,
}

/// Switches the adapters off until the guard is dropped (`AdaptersOff`).
pub fn adapters_off() -> AdaptersOff {
    AdaptersOff { prev: ADAPTERS_OFF.with(|c| c.replace(true)) }
}

impl Drop for AdaptersOff {
    fn drop(&mut self) {
        ADAPTERS_OFF.with(|c| c.set(self.prev));
    }
}

/// False while an `AdaptersOff` guard is alive on this thread.
pub fn adapters_enabled() -> bool {
    !ADAPTERS_OFF.with(|c| c.get())
}

/// One layer's adapter: the trained factors and how they apply.
#[derive(Clone)]
pub struct Adapter {
    /// (R, in), f32, trained.
    pub a: Tensor,
    /// (out, R), f32, trained.
    pub b: Tensor,
    /// s = alpha / R (or alpha / sqrt(R)).
    pub scale: f64,
    pub dropout: Option<Dropout>,
    /// (columns of the whole input, this rank's first column) when the input is split over
    /// tensor-parallel ranks (a row-parallel layer): each rank's dropout masks its columns of
    /// the one whole mask.
    pub columns: Option<(usize, usize)>,
}

impl Adapter {
    fn dropout_active(&self) -> bool {
        self.dropout.as_ref().is_some_and(Dropout::active)
    }
}

/// The internal name of an adapter factor: `model.layers.{l}.self_attn.q_proj.lora_A.weight`
/// (PEFT's file adds `base_model.model.` in front).
pub fn factor_name(layer: usize, p: Proj, f: Factor) -> String {
    let f = match f {
        Factor::A => "A",
        Factor::B => "B",
    };
    format!("model.layers.{layer}.{}.lora_{f}.weight", p.path())
}

/// W + s B A for the weight `w` (out, in) of any float dtype and its adapter's factors A (R, in)
/// and B (out, R): summed in f32 and returned in f32, for the caller to round once to W's dtype
/// (`Llama::merge_lora`, and `peft::merge_adapter_files` on the stored weights).
pub fn merged_weight(w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    let delta = b.matmul(a)?.mul_scalar(scale)?; // (out, in) f32
    w.to_dtype(DType::F32)?.add(&delta)
}

/// The outputs of `layers`, which all read x (and with `res`, res plus each). The adapted ones
/// without an active dropout share one down-projection GEMM when their ops agree on its input
/// (see the module comment); the rest are computed one by one.
pub(crate) fn project(x: &Tensor, layers: &[&Linear], res: Option<&Tensor>) -> Result<Vec<Tensor>> {
    let dt = x.dtype();
    let mut down: Vec<Option<Tensor>> = vec![None; layers.len()];
    let shared: Vec<usize> = (0..layers.len()).filter(|&i| layers[i].adapter.as_ref().is_some_and(|a| !a.dropout_active())).collect();
    if shared.len() > 1 {
        let op = &layers[shared[0]].op;
        let xs = op.adapter_input(x)?;
        let mut same = true;
        for &i in &shared[1..] {
            same &= layers[i].op.adapter_input(x)?.id() == xs.id();
        }
        if same {
            let ads: Vec<&Adapter> = shared.iter().filter_map(|&i| layers[i].adapter.as_ref()).collect();
            let parts: Vec<Tensor> = ads.iter().map(|a| a.a.clone()).collect();
            // (sum R, in) in x's dtype. Where the op applies A as it is (one device, a
            // row-parallel rank's columns), each factor is cast straight into its rows; where
            // every rank holds A whole (column-parallel), the stack is what `adapter_factor`
            // wraps, so its gradient is summed over the ranks once, in f32.
            let a = match op.adapter_factor(&parts[0], Factor::A)?.id() == parts[0].id() {
                true => stack_cast(&parts, dt)?,
                false => op.adapter_factor(&Tensor::cat(&parts, 0)?, Factor::A)?.to_dtype(dt)?,
            };
            let u = xs.linear(&a)?; // (..., sum R)
                                    // Each layer's u is its columns of u's (N, sum R) rows: a view the adapted op's
                                    // GEMMs read in place (a (..., R) view would be copied to be reshaped).
            let total = a.dim(0);
            let u = u.reshape([u.numel() / total, total])?;
            let mut at = 0;
            for (&i, ad) in shared.iter().zip(&ads) {
                let r = ad.a.dim(0);
                down[i] = Some(u.narrow(1, at, r)?);
                at += r;
            }
        }
    }
    layers
        .iter()
        .zip(down)
        .map(|(l, u)| {
            let Some(ad) = &l.adapter else {
                return match res {
                    Some(r) => l.op.forward_plus(x, &l.weight, r),
                    None => l.op.forward(x, &l.weight),
                };
            };
            let u = match u {
                Some(u) => u,
                None => {
                    let xs = l.op.adapter_input(x)?;
                    let xs = match &ad.dropout {
                        Some(d) => d.apply(&xs, ad.columns)?,
                        None => xs,
                    };
                    xs.linear(&l.op.adapter_factor(&ad.a, Factor::A)?.to_dtype(dt)?)?
                    // (..., R)
                }
            };
            let b = l.op.adapter_factor(&ad.b, Factor::B)?;
            l.op.forward_adapted(x, &l.weight, &u, &b, ad.scale, res)
        })
        .collect()
}

/// The factors `parts` ((R_i, in) each) stacked along their rows in `dtype`, a launch a part:
/// its cast is its copy into the stack (`Tensor::cat` then `to_dtype` took a copy a part and a
/// cast). Backward: each part's rows of the gradient land in the part's gradient destination (its
/// f32 bucket slice), cast by that one copy, or come back in the part's own dtype.
fn stack_cast(parts: &[Tensor], dtype: DType) -> Result<Tensor> {
    if let [one] = parts {
        return one.to_dtype(dtype);
    }
    let Some(first) = parts.first() else { bail!("lora", "no factors to stack") };
    let rows: Vec<usize> = parts.iter().map(|p| p.dim(0)).collect();
    let out = {
        let _g = no_grad();
        let out = Tensor::empty([rows.iter().sum::<usize>(), first.dim(1)], dtype, first.device())?;
        let mut at = 0;
        for (p, &r) in parts.iter().zip(&rows) {
            out.narrow(0, at, r)?.assign(p)?;
            at += r;
        }
        out
    };
    let (dtypes, need): (Vec<DType>, Vec<bool>) = parts.iter().map(|p| (p.dtype(), p.requires_grad())).unzip();
    let inputs: Vec<&Tensor> = parts.iter().collect();
    Ok(Tensor::from_op_ctx(
        out,
        "lora_stack_cast",
        &inputs,
        Box::new(move |g, ctx| {
            let mut at = 0;
            let mut grads = Vec::with_capacity(rows.len());
            for (i, &r) in rows.iter().enumerate() {
                let gi = g.narrow(0, at, r)?;
                at += r;
                grads.push(match need[i] {
                    true => Some(ctx.param_dest(i, |_| true)?.land_as(gi, Some(dtypes[i]))?),
                    false => None,
                });
            }
            Ok(grads)
        }),
    ))
}

impl Llama {
    /// Adds LoRA adapters as `cfg` says, initialised as PEFT does (A Kaiming-uniform from `rng`,
    /// B zero), and freezes every base weight. Before tensor parallelism and the engine attach.
    pub fn add_lora(&mut self, cfg: &LoraConfig, rng: &mut Rng) -> Result<()> {
        cfg.check()?;
        if self.lora.is_some() {
            bail!("add_lora", "the model has LoRA adapters already");
        }
        let layers = self.config().num_hidden_layers;
        if let Some(bad) = cfg.layers.as_ref().and_then(|l| l.iter().find(|&&i| i >= layers)) {
            bail!("add_lora", "layer {bad} does not exist: the model has {layers} layers");
        }
        self.visit_params_mut(&mut |_, t| {
            t.set_requires_grad(false)?;
            Ok(())
        })?;
        let clock = Arc::new(Clock { seed: rng.next_u64(), forwards: AtomicU64::new(0) });
        let device = self.device();
        // Matched by PEFT target name, block by block in the order of the layer's specs.
        self.visit_linears_mut(&mut |s, lin| {
            if !s.layer.is_some_and(|l| cfg.adapts_layer(l)) || !cfg.targets.iter().any(|p| p.is(s.lora_target)) {
                return Ok(());
            }
            let (out, inp) = (lin.weight.dim(0), lin.weight.dim(1));
            let bound = 1.0 / (inp as f64).sqrt();
            let a = Tensor::rand_uniform([cfg.rank, inp], -bound, bound, DType::F32, device, rng)?;
            let b = Tensor::zeros([out, cfg.rank], DType::F32, device)?;
            for t in [&a, &b] {
                t.set_requires_grad(true)?;
            }
            lin.adapter = Some(Adapter { a, b, scale: cfg.scale(), dropout: None, columns: None });
            Ok(())
        })?;
        self.lora = Some(LoraState { cfg: cfg.clone(), clock });
        self.set_lora_dropout(cfg.dropout)
    }

    /// The LoRA settings, when the model has adapters.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref().map(|l| &l.cfg)
    }

    /// Changes the adapters' dropout probability (it changes no weight: a continued adapter may
    /// train with another one).
    pub fn set_lora_dropout(&mut self, p: f64) -> Result<()> {
        let Some(state) = self.lora.as_mut() else { bail!("set_lora_dropout", "the model has no LoRA adapters") };
        let mut cfg = state.cfg.clone();
        cfg.dropout = p;
        cfg.check()?;
        let clock = state.clock.clone();
        state.cfg = cfg;
        // Each adapter's masks are its own: indexed by its layer's place among every block's
        // linear layers.
        let mut index = 0u64;
        self.visit_linears_mut(&mut |_, lin| {
            if let Some(ad) = lin.adapter.as_mut() {
                ad.dropout = (p > 0.0).then(|| Dropout { p, clock: clock.clone(), index });
            }
            index += 1;
            Ok(())
        })
    }

    /// Sets how many training forwards the dropout clock has counted (a resumed run continues
    /// the masks of the run it resumes: one forward per micro-batch).
    pub fn set_lora_forwards(&self, n: u64) {
        if let Some(l) = &self.lora {
            l.clock.forwards.store(n, Ordering::Relaxed);
        }
    }

    /// Calls `f` on every adapter factor (A then B, block by block, projections in order) with
    /// its name (`factor_name`) and full shape; `f` may replace the tensor (a shard, a view).
    pub fn visit_adapters_mut(&mut self, f: &mut ParamVisitor) -> Result<()> {
        self.visit_linears_mut(&mut |s, lin| {
            let Some(ad) = lin.adapter.as_mut() else { return Ok(()) };
            let r = ad.a.dim(0);
            f(&s.adapter(Factor::A, r).info(), &mut ad.a)?;
            f(&s.adapter(Factor::B, r).info(), &mut ad.b)
        })
    }

    /// Every adapter factor with its name, as this rank holds it.
    pub fn adapters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        let mut m = self.shallow_clone();
        m.visit_adapters_mut(&mut |p, t| {
            out.push((p.name.to_string(), t.clone()));
            Ok(())
        })
        .expect("collecting never fails");
        out
    }

    /// Folds every adapter into its weight, W + s B A (summed in f32, rounded once to W's
    /// dtype), and drops the adapters: the plain model, trainable again, whose outputs are the
    /// adapted ones. Under tensor parallelism each rank folds its own pieces (B's rows into a
    /// column-parallel weight's, A's columns into a row-parallel one's).
    pub fn merge_lora(&mut self) -> Result<()> {
        if self.lora.is_none() {
            bail!("merge_lora", "the model has no LoRA adapters");
        }
        {
            let _g = no_grad();
            self.visit_linears_mut(&mut |_, lin| {
                let Some(ad) = lin.adapter.take() else { return Ok(()) };
                let merged = merged_weight(&lin.weight, &ad.a, &ad.b, ad.scale)?;
                lin.weight.assign(&merged.to_dtype(lin.weight.dtype())?)
            })?;
        }
        self.lora = None;
        self.visit_params_mut(&mut |_, t| {
            t.set_requires_grad(true)?;
            Ok(())
        })
    }

    /// Whether projection `p` of block `layer` has an adapter.
    pub fn has_adapter(&self, layer: usize, p: Proj) -> bool {
        let mut found = false;
        let _ = self.shallow_clone().visit_linears_mut(&mut |s, lin| {
            found |= s.layer == Some(layer) && p.is(s.lora_target) && lin.adapter.is_some();
            Ok(())
        });
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `stack_cast` is `Tensor::cat` then `to_dtype`, bit for bit, forward and backward: the
    /// stacked values and each factor's gradient (its rows of the stack's, in the factor's f32),
    /// with a gradient destination (a bucket slice) for one part and none for the others.
    #[test]
    fn stack_cast_is_cat_then_cast_forward_and_backward() {
        let mut r = Rng::new(5);
        let parts: Vec<Tensor> =
            [2, 1, 3].iter().map(|&rows| Tensor::randn([rows, 4], 1.0, DType::F32, Device::Cpu, &mut r).unwrap()).collect();
        let cot = Tensor::randn([6, 4], 1.0, DType::BF16, Device::Cpu, &mut r).unwrap();
        let run = |fused: bool| {
            let ps: Vec<Tensor> = parts.iter().map(|p| p.detach()).collect();
            for p in &ps {
                p.set_requires_grad(true).unwrap();
            }
            let dest = Tensor::full([1, 4], f64::NAN, DType::F32, Device::Cpu).unwrap();
            let d = dest.clone();
            ps[1].set_grad_dest(Some(Arc::new(move || Ok(Some(d.clone())))));
            let s = match fused {
                true => stack_cast(&ps, DType::BF16).unwrap(),
                false => Tensor::cat(&ps, 0).unwrap().to_dtype(DType::BF16).unwrap(),
            };
            s.mul(&cot).unwrap().sum_all().unwrap().backward().unwrap();
            let grads: Vec<Vec<f32>> = ps.iter().map(|p| p.grad().expect("a gradient").to_vec_f32().unwrap()).collect();
            assert!(ps.iter().all(|p| p.grad().unwrap().dtype() == DType::F32), "the gradients come back in f32");
            (s.to_vec_f32().unwrap(), grads, dest.to_vec_f32().unwrap())
        };
        let (want, got) = (run(false), run(true));
        assert_eq!(got.0, want.0, "the stack");
        assert_eq!(got.1, want.1, "the factors' gradients");
        assert_eq!(got.2, got.1[1], "the middle factor's gradient landed in its destination");
    }
}
