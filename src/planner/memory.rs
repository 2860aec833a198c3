//! The memory estimator. Will this run fit? Peak memory per rank of a training configuration,
//! predicted before anything is allocated: parameters, gradients and optimizer states under the
//! layout's `ShardSpec` and tensor parallelism, activations with or without checkpointing, the
//! engines' transient buffers and a device workspace (with NCCL's buffers per communicator on a
//! multi-process GPU run). [`memory`] is the model (the step-time model, `plan` and
//! `autoconfig` rank layouts with it); [`estimate`] and [`check_layout`] map a run's flags onto
//! it and refuse, with the numbers, a run that cannot fit (`pretrain_llama`'s memory check).
//!
//! Measured against the tensor peak of real training runs (tests/memory_estimator.rs holds it
//! between 1 and 1.25 times the measured peak across presets, layouts and checkpointing, on the
//! CPU and the CUDA emulator; docs/AUTOCONFIG.md has the table).
use super::cluster::NCCL_BYTES_PER_COMMUNICATOR;
use super::shape::ModelShape;
use super::step::Workload;
use crate::nn::LlamaConfig;
use anyhow::{bail, Result};
use ferrolm_ops::nf4::{QuantSpec, NESTED_BLOCKSIZE};
use ferrolm_ops::LossChunks;
use ferrolm_parallel::zero::{GradReduceDtype, ShardSpec};
use ferrolm_tensor::{DType, Device};

/// One rank's memory by part. Parameters, optimizer state and the workspace are held all the
/// time. On top of them the peak comes at one of two moments of a step, and [`Memory::total`]
/// takes the larger:
/// - when backward starts: the activations the forward saved, the head's loss transients and
///   the gradients held already (`backward_start`);
/// - when the gradients are complete, at the end of backward: every gradient (`grads`) and the
///   transients beside them (`buffers`: a layer's backward or recomputation, the largest
///   gradient formed whole, a bucket in flight, the step's squared gradient). Backward frees
///   each op's saved activations once it has run through the op (the autograd takes them out of
///   the graph), so on one device they are gone by then (`held_to_end` 0); in between, what the
///   activations release pays for the gradients formed, and neither moment is exceeded. Under
///   tensor parallelism the measured peaks (tests/memory_estimator.rs) still come with the
///   activations held at the end of backward, so there `held_to_end` counts them.
#[derive(Clone, Debug)]
pub struct Memory {
    /// This rank's parameter shard, plus the gathered buckets of ZeRO-3 (s_p > 1), plus a live
    /// preference reference's weights (`reference`).
    pub params: f64,
    /// Of `params`: the weights of a preference run's separate live reference model
    /// ([`ReferenceMode::Separate`]; 0 otherwise).
    pub reference: f64,
    /// Gradients when they are complete: the optimizer range's and the accumulator.
    pub grads: f64,
    pub optim: f64,
    /// What the forward saved for backward.
    pub activations: f64,
    /// When backward starts: the head's loss transients and the gradients held already (earlier
    /// micro-batches' accumulator, the head's gradient, a bucket in flight).
    pub backward_start: f64,
    /// Beside the complete gradients: the other transients of the end of backward and the step.
    pub buffers: f64,
    /// Activations still held when the gradients are complete (see the type's comment).
    pub held_to_end: f64,
    /// [`MARGIN`] of what is modelled rather than counted: the activations and the larger moment's
    /// transients (the many small tensors beside them: norms' statistics, attention's log-sum-exp,
    /// targets, a communicator's staging).
    pub margin: f64,
    /// A fixed reserve (CUDA context, cuBLAS workspace), plus NCCL's buffers on a multi-rank GPU
    /// run (`communicators` × `Cluster::comm_buffer_bytes`).
    pub workspace: f64,
}

impl Memory {
    /// The peak: what is always held plus the larger of the two moments.
    pub fn total(&self) -> f64 {
        self.params + self.optim + self.workspace + (self.activations + self.backward_start).max(self.gradients_complete()) + self.margin
    }

    /// What the end of backward adds to what is always held.
    pub fn gradients_complete(&self) -> f64 {
        self.grads + self.buffers + self.held_to_end
    }

    /// Model states alone (parameters, gradients, optimizer).
    pub fn states(&self) -> f64 {
        self.params + self.grads + self.optim
    }

    /// Whether the peak comes when backward starts (else when the gradients are complete).
    pub fn peaks_at_backward_start(&self) -> bool {
        self.activations + self.backward_start > self.gradients_complete()
    }
}

/// The share of the modelled parts (activations and transients) the estimate adds as [`Memory::margin`]:
/// without it, the closest measured peaks (tests/memory_estimator.rs) came within 3.5% of it.
pub const MARGIN: f64 = 0.08;

/// Activation bytes one rank's forward saves for backward for a micro-batch of `b` sequences of
/// `seq` tokens, as ferrolm's ops save them (measured with `ferrolm_tensor::peak_bytes` on the
/// CPU engine and the emulator, docs/AUTOCONFIG.md "Memory estimator"), per token: a layer keeps
/// about 10 hidden-sized tensors (norm inputs, residuals, q/k/v, the attention output; the
/// attention part split over `tp`) and 4 MLP-sized ones (gate, up, their SwiGLU and its input to
/// down_proj); a checkpointed layer keeps 2 hidden-sized (what its residual branches return);
/// the embedding output and final norm 2 more; and the loss's inputs: the logits (unfused on
/// one device), or the fused head's dX (see [`head_bytes`]).
pub fn activation_bytes(m: &ModelShape, w: &Workload) -> f64 {
    let (tokens, h, e) = ((w.micro_batch * w.seq) as f64, m.hidden as f64, w.elem_bytes as f64);
    let ck = w.checkpointed_layers.min(m.layers) as f64;
    let layers = (m.layers as f64 - ck) * layer_elems(m, w) + ck * 2.0 * h;
    tokens * e * (layers + 2.0 * h) + head_bytes(m, w, false, true).0
}

/// Elements per token a layer saves (see [`activation_bytes`]). The attention part scales with
/// the query width heads · head_dim (hidden for Llama's shapes; an explicit config head_dim
/// may make it wider). The family's block features save more (measured on the CPU,
/// tests/memory_estimator.rs, `each_family`): QK-norm keeps the q and k projections' outputs
/// (the norm's inputs) beside the normed heads RoPE reads, 2 (q + kv) of this rank's width; the
/// sandwich's two post-branch norms keep their inputs, 2 hidden (after the reduction: not split).
/// Biases and windows save nothing more.
fn layer_elems(m: &ModelShape, w: &Workload) -> f64 {
    let (h, tp) = (m.hidden as f64, w.tp.max(1) as f64);
    let d = m.head_dim as f64;
    let q = m.heads as f64 * d / tp;
    // A key/value head shared by several ranks is held by each.
    let kv = if m.kv_heads >= w.tp.max(1) { m.kv_heads as f64 * d / tp } else { d };
    let x = &m.extras;
    let qk_norm = if x.qk_norm { 2.0 * (q + kv) } else { 0.0 };
    let sandwich = if x.sandwich_norms { 2.0 * h } else { 0.0 };
    4.0 * h + 6.0 * q + 4.0 * m.intermediate as f64 / tp + qk_norm + sandwich
}

/// The largest transient of a layer's backward, beside the gradients formed so far: its own
/// gradients of activations (half a layer), or with checkpointing the layer recomputed with them
/// (1.1 layers).
pub fn layer_transient_bytes(m: &ModelShape, w: &Workload) -> f64 {
    let share = if w.checkpointed_layers.min(m.layers) > 0 { 1.1 } else { 0.5 };
    (w.micro_batch * w.seq) as f64 * w.elem_bytes as f64 * share * layer_elems(m, w)
}

/// Bytes of the output head and its loss for a micro-batch: (what the graph holds until the
/// loss is dropped, the transient beside it: of the head's forward when fused, of the start of
/// backward when not). `host`: the CPU backend (its fused loop works in vectors of its own);
/// `dw`: the head's weight is trained (not under LoRA: then no dW is made).
///
/// Fused in chunks (`ferrolm_ops::head_loss`, the default): the graph holds dX (a hidden-sized
/// row a token, made in the forward). The forward holds one chunk of logits (two under `--tp`
/// with several chunks: the next chunk's GEMM runs while this one's max is all-reduced) and where dW accumulates in
/// f32: in place in the head's f32 gradient bucket on a GPU (an f32 buffer of its own where the
/// bucket is not f32). The CPU's loop works in f32 vectors: the chunk's logits (and their bf16
/// copy for the GEMMs), dX's rows and dW, beside each chunk's dW product from the second chunk
/// on. The head's gradient bucket itself is lent in the forward (see [`memory`]).
///
/// Unfused (`--loss-chunk-tokens 0`): one device holds the logits in the compute dtype, and
/// backward starts with one more logits-sized buffer: their gradient (the CPU's fused loss forms
/// it in the forward; CUDA's loss in backward), or in its place the transposed copy the CPU's
/// head GEMM backward reads. The vocabulary-parallel loss of `--tp` is the fused op with one
/// chunk of every token (`head_loss_sharded`): charged as fused, with the rank's whole V/tp
/// logits as its chunk.
pub fn head_bytes(m: &ModelShape, w: &Workload, host: bool, dw: bool) -> (f64, f64) {
    let tokens = w.micro_batch * w.seq;
    let (t, e, ge, tp) = (tokens as f64, w.elem_bytes as f64, w.grad_bytes as f64, w.tp.max(1));
    let (local, h) = (m.vocab / tp, m.hidden as f64);
    let weight = if dw { (local as f64) * h } else { 0.0 };
    let chunk = match w.loss_chunks.chunk_tokens(tokens, local, w.elem_bytes) {
        None if tp > 1 => Some(tokens.max(1)),
        c => c,
    };
    match chunk {
        Some(chunk) => {
            let in_flight = if tp > 1 && chunk < tokens { 2.0 } else { 1.0 };
            let logits = in_flight * (chunk * local) as f64;
            let transient = if host {
                let work = e.max(4.0);
                let products = if chunk < tokens { 2.0 } else { 1.0 };
                logits * (work + if e < 4.0 { e } else { 0.0 }) + t * h * work + products * work * weight
            } else {
                logits * e + if ge < 4.0 { 4.0 * weight } else { 0.0 }
            };
            (t * h * e, transient)
        }
        None => (t * e * local as f64, t * e * local as f64),
    }
}

/// Device bytes one rank needs at its peak for `spec` with `micro_batches` micro-batches per
/// step, broken down (see [`Memory`] for what is held when). `workspace` is a fixed reserve (the
/// CUDA context and cuBLAS workspace on a GPU, 0 on the CPU, plus NCCL's buffers on a multi-rank
/// GPU run: `communicators` × `NCCL_BYTES_PER_COMMUNICATOR`) the caller passes.
///
/// Model states follow the engine's layout (one device is the spec (1, 1, 1)): each bucket's
/// parameter shard (`n / s_p`, plus up to `MAX_LIVE` = 3 gathered buckets when `s_p > 1`); per
/// optimizer element m and v (and a norm-weight mask under tensor parallelism) plus the master
/// below f32; gradients at `grad_bytes` per element: the optimizer range's (`n / s_os`) and, with
/// several micro-batches, the accumulator (`n / s_g`), allocated as backward reaches each bucket
/// and freed by the step. Transients: the head's loss ([`head_bytes`]) when backward
/// starts; later a layer's backward ([`layer_transient_bytes`]), one whole bucket in flight
/// towards the optimizer range when `s_os > 1`, the largest parameter's gradient formed whole
/// before it lands (see below), the step's squared gradient of one bucket. Where each peaks was
/// found with `ferrolm_tensor::peak_bytes` (docs/AUTOCONFIG.md, "Memory estimator").
///
/// With LoRA (`lora`) the engine holds only the adapters: f32 factors in one bucket per adapted
/// layer, sharded as above, with f32 gradients and m and v (no master); the base is frozen in the
/// compute dtype on every data-parallel rank (its tensor-parallel share only), with no gradient
/// and no optimizer state, and the head's and the embedding's weight gradients are never formed.
/// The forward saves more for backward: [`lora_activation_bytes`]. With a 4-bit base (QLoRA,
/// `LoraMem::quantized_base`) the frozen bytes are [`frozen_base_bytes`]'s: the blocks' linear
/// weights at [`quant_bits_per_param`] (4.127 bits for NF4 with double quantization) and one
/// dequantized weight in the compute dtype, the embedding, norms, biases and head in the compute
/// dtype; its forward saves what LoRA's does (`nn::QuantOp`'s adapted forward is one autograd
/// node, as `linear_adapted` is: it keeps x, u and B and dequantizes W again in the backward).
pub fn memory(m: &ModelShape, w: &Workload, spec: ShardSpec, micro_batches: usize, workspace: f64, lora: Option<&LoraMem>) -> Memory {
    memory_on(m, w, spec, micro_batches, workspace, lora, None, false)
}

/// [`memory`] on a GPU (`host` false) or on the CPU backend (see [`head_bytes`]), for a
/// preference run when `pref` is given (see [`PreferenceMem`]: `w.micro_batch` then counts the
/// packed rows, two sequences a pair).
#[allow(clippy::too_many_arguments)]
fn memory_on(
    m: &ModelShape,
    w: &Workload,
    spec: ShardSpec,
    micro_batches: usize,
    workspace: f64,
    lora: Option<&LoraMem>,
    pref: Option<&PreferenceMem>,
    host: bool,
) -> Memory {
    let e = w.elem_bytes as f64;
    // What the engine trains: its buckets, their element and gradient bytes, the frozen bytes.
    let (buckets, pe, ge, frozen, largest): (Vec<f64>, f64, f64, f64, f64) = match lora {
        None => (m.bucket_params(w.tp).iter().map(|&n| n as f64).collect(), e, w.grad_bytes as f64, 0.0, m.largest_param(w.tp) as f64),
        Some(l) => {
            let layer = lora_layer_params(m, w.tp, l);
            (vec![layer; l.layers.min(m.layers)], 4.0, 4.0, frozen_base_bytes(m, w, l.quantized_base), lora_largest_factor(m, w.tp, l))
        }
    };
    let local: f64 = buckets.iter().sum();
    let biggest = buckets.iter().copied().fold(0.0, f64::max);
    let master = if pe == 4.0 { 0.0 } else { 4.0 };
    let (sp, sg, so) = (spec.params as f64, spec.grads as f64, spec.optim as f64);
    let gathered = if spec.params > 1 { 3.0 * biggest * pe } else { 0.0 };
    // The last micro-batch hands each accumulated bucket over as backward reaches it: about three
    // quarters of the accumulator are live at the peak (a fit to the measured peaks).
    let accumulator = if micro_batches > 1 { 0.75 * local * ge / sg } else { 0.0 };
    let in_flight = if spec.optim > 1 { biggest * ge } else { 0.0 };
    // The largest parameter's gradient (the embedding or the head in most shapes) is formed whole
    // in the parameter dtype before it lands in its bucket, and gradients accumulated wider than
    // the parameters (f32 main gradients of bf16 ones) widen it to a copy of its own first. A
    // tied embedding's gradient has two parts: the head's, formed when backward starts and held
    // to its end, and the lookup's, beside it until they are summed. The fused head lends its
    // gradient bucket in the forward and writes the head's part there: a tied embedding's
    // lookup part (in the parameter dtype) is then widened to the bucket's and summed into a new
    // tensor before the sink copies it back; under `--tp` the vocabulary-parallel lookup's
    // backward holds up to one more of its size beside them (a fit to the measured peaks). The
    // head's transients come at the end of the forward, beside its bucket but before any bucket
    // is in flight.
    let widened = if ge > pe { ge } else { 0.0 };
    let fused = !matches!(w.loss_chunks, LossChunks::Unfused);
    let (formed, head_grad) = match lora {
        None if fused => {
            let tied = if w.tp > 1 { 2.0 * e } else { e } + widened + ge;
            (largest * if m.tied { tied } else { e + widened }, largest * ge)
        }
        None => (largest * if m.tied { (2.0 * e).max(e + widened) } else { e + widened }, largest * if m.tied { e } else { ge }),
        Some(_) => (largest * (pe + widened), 0.0),
    };
    let head = head_bytes(m, w, host, lora.is_none()).1;
    let step_sq = 4.0 * biggest / so;
    let activations = activation_bytes(m, w)
        + lora.map_or(0.0, |l| lora_activation_bytes(m, w, l))
        + if pref.is_some() { sequence_sum_bytes(w) } else { 0.0 };
    let reference = pref.map_or(0.0, |p| reference_bytes(m, w, p.reference));
    let backward_start = accumulator + head_grad + if fused { head.max(in_flight) } else { head + in_flight };
    let buffers = in_flight + layer_transient_bytes(m, w).max(formed).max(step_sq);
    Memory {
        params: local * pe / sp + gathered + frozen + reference,
        reference,
        grads: local * ge / so + accumulator,
        // m, v; the norm-weight mask only under tensor parallelism.
        optim: local * (8.0 + if w.tp > 1 { 4.0 } else { 0.0 } + master) / so,
        activations,
        backward_start,
        buffers,
        held_to_end: if w.tp > 1 { activations } else { 0.0 },
        margin: MARGIN * (activations + backward_start.max(buffers)),
        workspace,
    }
}

/// Environment variable: `1` skips the refusal (the prediction is still printed).
pub const ENV_SKIP_CHECK: &str = "FERROLM_SKIP_MEMORY_CHECK";
/// Environment variable: a GPU's memory in GiB (no device query exists yet; without it a GPU
/// run is not refused, only told its prediction).
pub const ENV_DEVICE_GIB: &str = "FERROLM_DEVICE_MEMORY_GIB";

/// Bytes kept on a GPU for the CUDA context, cuBLAS(Lt) workspace and allocator slack.
pub const CUDA_WORKSPACE_BYTES: f64 = 1024.0 * 1024.0 * 1024.0;

/// Parameters of a model with this config (its family's biases and norms included), or None
/// when the count overflows: the config's own formula, which equals the model's tensors.
pub fn param_count(c: &LlamaConfig) -> Option<u64> {
    c.num_parameters()
}

/// The batch of a run, as far as memory is concerned. For a preference run
/// ([`MemParallelism::preference`]) `batch_size` counts the pairs of a micro-batch and `seq_len`
/// is the length of a packed row (`--max-length`, else `--seq-len`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunShape {
    pub batch_size: usize,
    pub seq_len: usize,
    pub grad_accum: usize,
}

/// LoRA (`--lora-rank`), as far as memory is concerned: the base is frozen and only these
/// adapters are trained.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraMem {
    pub rank: usize,
    /// The adapted projections, in `nn::lora::Proj` order (q, k, v, o, gate, up, down).
    pub targets: [bool; 7],
    /// Blocks that carry adapters.
    pub layers: usize,
    /// `--lora-dropout` above 0: each adapter's input is masked in a copy of its own.
    pub dropout: bool,
    /// QLoRA (`--quantize-base nf4`: `QuantSpec::QLORA`): the blocks' frozen linear weights held
    /// 4-bit (see [`frozen_base_bytes`]); None (what `LoraMem::new`
    /// gives): the whole base in the compute dtype. The tools set it where they build the
    /// `LoraMem` (`cli::lora`'s `memory`, `train`'s single-device check) from the flag or the
    /// model's 4-bit base.
    pub quantized_base: Option<QuantSpec>,
}

impl LoraMem {
    /// The adapters `cfg` adds to a model of `layers` blocks.
    pub fn new(cfg: &crate::nn::LoraConfig, layers: usize) -> LoraMem {
        let mut targets = [false; 7];
        for p in &cfg.targets {
            targets[*p as usize] = true;
        }
        LoraMem {
            rank: cfg.rank,
            targets,
            layers: cfg.layers.as_ref().map_or(layers, Vec::len),
            dropout: cfg.dropout > 0.0,
            quantized_base: None,
        }
    }
}

/// Bits a parameter of a 4-bit weight costs, from the block sizes: the 4-bit code, plus its
/// block's absmax spread over the block's `blocksize` elements: 32 bits (f32) plain, or with
/// double quantization an 8-bit code plus the f32 scale of its 256-absmax nested block. For
/// QLoRA's NF4 (blocks of 64, nested blocks of 256):
///
///   4 + 8 / 64 + 32 / (64 · 256) = 4 + 0.125 + 0.001953125 = 4.126953125 ≈ 4.127 bits,
///
/// i.e. 0.515869140625 bytes a parameter, 25.8% of bf16's 2 (the nested offset, one f32 a
/// tensor, and the code books are per tensor: [`quant4_bytes`]).
pub fn quant_bits_per_param(q: QuantSpec) -> f64 {
    let bs = q.blocksize as f64;
    if q.double_quant {
        4.0 + 8.0 / bs + 32.0 / (bs * NESTED_BLOCKSIZE as f64)
    } else {
        4.0 + 32.0 / bs
    }
}

/// Device bytes of one 4-bit weight of `n` elements as `ferrolm_ops::nf4::DeviceQuant4` holds it:
/// the packed codes (ceil(n / 2) bytes) and the absmax codes (one byte a block), each padded to
/// 16 bytes for the kernel's 16-byte loads, the f32 nested scales (one per 256 blocks; plain: an
/// f32 absmax a block) and the 272 f32 levels of the two code books. For n a multiple of
/// 64 · 256 that is n · [`quant_bits_per_param`] / 8 plus the 1088 bytes of code books (the
/// host's `Quant4` holds the same within a few bytes: its nested map of 256 f32 and the offset).
pub fn quant4_bytes(n: u64, q: QuantSpec) -> f64 {
    let pad16 = |b: u64| b.div_ceil(16).max(1) * 16;
    let blocks = n.div_ceil(q.blocksize as u64);
    let absmax = if q.double_quant { pad16(blocks) + 4 * blocks.div_ceil(NESTED_BLOCKSIZE as u64).max(1) } else { 16 + 4 * blocks.max(1) };
    (pad16(n.div_ceil(2)) + absmax + 4 * QUANT4_TABLE_LEVELS) as f64
}

/// The levels a 4-bit weight's device copy carries: 16 of its codes, 256 of the nested map.
const QUANT4_TABLE_LEVELS: u64 = 16 + 256;

/// The weights a 4-bit base quantizes, on one of `tp` ranks (each shard quantized on its own):
/// every block's linear weights (q, k, v, o, gate, up, down), whether or not LoRA adapts them,
/// as bitsandbytes' `Linear4bit` replaces every `nn.Linear` but the head. Their biases, the
/// norms, the embedding and the head stay in the compute dtype.
pub fn quantized_weights(m: &ModelShape, tp: usize) -> Vec<u64> {
    let specs = crate::nn::spec::layer_specs(0, &m.dims(), &m.extras);
    specs.iter().filter(|s| s.lora_target.is_some()).map(|s| s.local_numel(tp.max(1))).collect()
}

/// The frozen base of a LoRA run on one of `w.tp` ranks, in bytes. In the compute dtype
/// (`quant` None) every parameter at `w.elem_bytes`. 4-bit (QLoRA): each block's linear
/// weights at [`quant4_bytes`] (4.127 bits a parameter), the rest (embedding, norms, biases,
/// head) in the compute dtype, plus the dequantize scratch: `nn::QuantLinear` dequantizes a
/// weight just before its GEMM and drops it right after, in the forward and again in the
/// backward (for dX = dY W; a checkpointed layer's recomputation the same), so one dequantized
/// weight is alive at a time, never a forward's and a backward's together: the largest, in the
/// compute dtype (on CUDA the pool keeps that block for the next layer's: it stays held). A
/// compute dtype other than f32 and bf16 dequantizes through f32 first (4 bytes more).
pub fn frozen_base_bytes(m: &ModelShape, w: &Workload, quant: Option<QuantSpec>) -> f64 {
    let e = w.elem_bytes as f64;
    let all: u64 = m.bucket_params(w.tp).iter().sum();
    let Some(q) = quant else { return all as f64 * e };
    let weights = quantized_weights(m, w.tp);
    let layers = m.layers as f64;
    let quantized: u64 = weights.iter().sum::<u64>() * m.layers as u64;
    let codes: f64 = layers * shard_quant_specs(m, w.tp, q).iter().zip(&weights).map(|(&s, &n)| quant4_bytes(n, s)).sum::<f64>();
    (all - quantized) as f64 * e + codes + dequant_scratch_bytes(m, w)
}

/// How each of [`quantized_weights`]' pieces is stored on one of `tp` ranks (same order): as
/// `q` on one device; under tensor parallelism as `nn::qlora::shard_quant` cuts it. A piece of
/// output rows (a column-parallel weight's) keeps the nested absmax of double quantization when
/// every piece starts and ends on a nested block (its blocks a multiple of 256); otherwise, and
/// always for a piece of input columns (a row-parallel weight's: o, down), the piece holds its
/// blocks' absmax in f32: 4.5 bits a parameter instead of 4.127 (the worst rank's, which the
/// estimate is for).
pub fn shard_quant_specs(m: &ModelShape, tp: usize, q: QuantSpec) -> Vec<QuantSpec> {
    let specs = crate::nn::spec::layer_specs(0, &m.dims(), &m.extras);
    let plain = QuantSpec { double_quant: false, ..q };
    specs
        .iter()
        .filter(|s| s.lora_target.is_some())
        .map(|s| match s.role.split_dim() {
            _ if tp <= 1 || !q.double_quant => q,
            None => q,
            Some(0) if s.parts(tp) == 1 || (s.local_numel(tp) / q.blocksize as u64).is_multiple_of(NESTED_BLOCKSIZE as u64) => q,
            Some(_) => plain,
        })
        .collect()
}

/// The dequantize scratch of a 4-bit base (see [`frozen_base_bytes`]): the largest quantized
/// weight on one of `w.tp` ranks, in the compute dtype.
pub fn dequant_scratch_bytes(m: &ModelShape, w: &Workload) -> f64 {
    let largest = quantized_weights(m, w.tp).into_iter().max().unwrap_or(0) as f64;
    let e = w.elem_bytes as f64;
    largest * if e == 2.0 || e == 4.0 { e } else { e + 4.0 }
}

/// (in, out) of each projection on one of `tp` ranks, `Proj` order: from the spec, a
/// column-parallel layer's output and a row-parallel layer's input split (a key/value head
/// shared by ranks held whole).
fn local_projections(m: &ModelShape, tp: usize) -> [(f64, f64); 7] {
    let specs = crate::nn::spec::layer_specs(0, &m.dims(), &m.extras);
    crate::nn::Proj::ALL.map(|p| {
        let Some(s) = specs.iter().find(|s| p.is(s.lora_target)) else { return (0.0, 0.0) };
        let (out, inp, n) = (s.shape[0] as f64, s.shape[1] as f64, s.parts(tp) as f64);
        match s.role {
            crate::nn::TpRole::Row => (inp / n, out),
            _ => (inp, out / n),
        }
    })
}

/// Adapter elements of one adapted block on one of `tp` ranks: A (R, in) and B (out, R) of each
/// target, split as their layer's weight (`ferrolm_parallel::tp`).
pub fn lora_layer_params(m: &ModelShape, tp: usize, l: &LoraMem) -> f64 {
    let r = l.rank as f64;
    local_projections(m, tp).iter().zip(l.targets).filter(|(_, on)| *on).map(|((i, o), _)| r * (i + o)).sum()
}

/// What LoRA's forward saves for backward beside the base's activations (`nn::lora::project`,
/// measured with `ferrolm_tensor::peak_bytes`), per adapted block: each adapter's
/// down-projection u (N, R) in the compute dtype; the factors as the GEMMs read them (the A's
/// of layers that share their input stacked in f32, and every factor's copy in a compute dtype
/// below f32), at most 4 + 2 bytes per adapter element; with dropout, each adapter's masked
/// input (N, in) and its mask.
pub fn lora_activation_bytes(m: &ModelShape, w: &Workload, l: &LoraMem) -> f64 {
    let (tokens, e, r) = ((w.micro_batch * w.seq) as f64, w.elem_bytes as f64, l.rank as f64);
    let on = || local_projections(m, w.tp).into_iter().zip(l.targets).filter(|(_, on)| *on).map(|(p, _)| p);
    let u = tokens * e * r * on().count() as f64;
    let factors = lora_layer_params(m, w.tp, l) * if e < 4.0 { 6.0 } else { 4.0 };
    let dropped = if l.dropout { 2.0 * tokens * e * on().map(|(i, _)| i).sum::<f64>() } else { 0.0 };
    (u + factors + dropped) * l.layers.min(m.layers) as f64
}

/// The largest adapter factor on one of `tp` ranks.
fn lora_largest_factor(m: &ModelShape, tp: usize, l: &LoraMem) -> f64 {
    let r = l.rank as f64;
    local_projections(m, tp).iter().zip(l.targets).filter(|(_, on)| *on).map(|((i, o), _)| r * i.max(*o)).fold(0.0, f64::max)
}

/// Where a preference (DPO) run's reference log-probs come from, as far as memory is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReferenceMode {
    /// A frozen model of its own, live while training (`--ref-model`, or the starting `--model`
    /// without LoRA; also `--ref-model` beside LoRA): its weights are held beside the policy's,
    /// in the compute dtype, this rank's tensor-parallel share on every data-parallel rank (it
    /// is not sharded by ZeRO). Its forward runs without gradients before the policy's, so only
    /// its weights outlast it.
    Separate,
    /// No reference weights: the log-probs precomputed before training (`--precompute-ref`), or
    /// LoRA's base run with the adapters off (LoRA without `--ref-model`).
    None,
}

/// A preference (DPO) run, as far as memory is concerned: a micro-batch of `batch_size` pairs
/// is packed (`ferrolm_nn::objective::pack_pairs`) as two sequences a pair (prompt + chosen,
/// prompt + rejected) into rows of `seq_len` tokens, at most one sequence a row: the estimate
/// charges `2 × batch_size` rows of activations and head. The head gives per-row log-probs
/// (`head_logprobs`, chunked as the cross-entropy's), summed per sequence by a (sequences,
/// tokens) 0/1 matrix ([`sequence_sum_bytes`]); the reference is charged as `reference` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PreferenceMem {
    pub reference: ReferenceMode,
}

impl PreferenceMem {
    /// Packed rows a micro-batch of `pairs` pairs holds at most: two sequences a pair.
    pub fn rows(pairs: usize) -> usize {
        pairs.saturating_mul(2)
    }
}

/// A live separate reference's weights on one rank: the model's parameters on one of `w.tp`
/// tensor-parallel ranks, in the compute dtype (nothing for [`ReferenceMode::None`]).
pub fn reference_bytes(m: &ModelShape, w: &Workload, mode: ReferenceMode) -> f64 {
    match mode {
        ReferenceMode::Separate => m.bucket_params(w.tp).iter().sum::<u64>() as f64 * w.elem_bytes as f64,
        ReferenceMode::None => 0.0,
    }
}

/// What the per-sequence sum of a preference micro-batch saves for backward
/// (`ferrolm_nn::objective::SequenceLogProbs`): the (sequences, tokens) 0/1 matrix that sums the
/// per-row log-probs, f32 (f64 for f64 models), and the log-probs themselves (tokens), for
/// `w.micro_batch` rows (= sequences, one a row at most) of `w.seq` tokens.
pub fn sequence_sum_bytes(w: &Workload) -> f64 {
    let (tokens, seqs) = ((w.micro_batch * w.seq) as f64, w.micro_batch as f64);
    (seqs + 1.0) * tokens * (w.elem_bytes as f64).max(4.0)
}

/// How a run is laid out over ranks, as far as memory is concerned.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemParallelism {
    pub tp: usize,
    pub dp: usize,
    pub spec: ShardSpec,
    /// Transformer layers whose activations are recomputed (the first ones; `usize::MAX`: all).
    pub checkpointed_layers: usize,
    /// Whether the ranks are threads of this process (their memory adds up in one RAM).
    pub thread_ranks: bool,
    /// `--offload-optimizer` with this subgroup size: the optimizer shard (master, m, v) lives
    /// in host memory; a device keeps two subgroups' state (12 B per element each: the one
    /// being updated and the next one's prefetch), as the autoconfig model counts it.
    pub offload_subgroup: Option<usize>,
    /// `--grad-reduce-dtype`: the dtype gradients are accumulated and reduced in.
    pub grad_reduce: GradReduceDtype,
    /// LoRA: the base frozen, these adapters trained (None: every weight trained).
    pub lora: Option<LoraMem>,
    /// `--loss-chunk-tokens`: the fused head's chunk of logits, or the whole logits unfused.
    pub loss_chunks: LossChunks,
    /// A preference (DPO) run: pairs packed two sequences a pair, and its reference (None: a
    /// token objective, pretraining or SFT).
    pub preference: Option<PreferenceMem>,
}

impl MemParallelism {
    /// One device, no sharding.
    pub fn single(checkpointing: bool) -> MemParallelism {
        MemParallelism {
            tp: 1,
            dp: 1,
            spec: ShardSpec { params: 1, grads: 1, optim: 1 },
            checkpointed_layers: if checkpointing { usize::MAX } else { 0 },
            thread_ranks: false,
            offload_subgroup: None,
            grad_reduce: GradReduceDtype::default(),
            lora: None,
            loss_chunks: LossChunks::Auto,
            preference: None,
        }
    }

    pub fn world(&self) -> usize {
        self.tp * self.dp
    }
}

/// Predicted peak bytes of one rank, broken down; None when the sizes overflow.
pub fn estimate(
    cfg: &LlamaConfig,
    dtype: DType,
    device: Device,
    batch: usize,
    seq: usize,
    grad_accum: usize,
    l: &MemParallelism,
) -> Option<Memory> {
    // A preference run's micro-batch of `batch` pairs packs into at most twice as many rows.
    let batch = if l.preference.is_some() { batch.checked_mul(2)? } else { batch };
    batch.checked_mul(seq)?.checked_mul(grad_accum)?;
    param_count(cfg)?;
    let shape = ModelShape::from_config(cfg, "run");
    let w = Workload {
        seq,
        micro_batch: batch,
        global_batch_tokens: (batch * seq * grad_accum).saturating_mul(l.dp),
        tp: l.tp.max(1),
        elem_bytes: dtype.size_in_bytes(),
        grad_bytes: l.grad_reduce.bytes(dtype.size_in_bytes()),
        checkpointed_layers: l.checkpointed_layers.min(cfg.num_hidden_layers),
        loss_chunks: l.loss_chunks,
    };
    let workspace = if device == Device::Cpu { 0.0 } else { CUDA_WORKSPACE_BYTES + nccl_buffer_bytes(cfg, l) };
    let mut m = memory_on(&shape, &w, l.spec, grad_accum, workspace, l.lora.as_ref(), l.preference.as_ref(), device == Device::Cpu);
    // Offloaded optimizer state leaves a device, not the host: on the CPU it stays counted.
    if let (Some(sub), false) = (l.offload_subgroup, device == Device::Cpu) {
        m.optim = m.optim.min(24.0 * sub as f64);
    }
    m.total().is_finite().then_some(m)
}

/// NCCL's buffers on each rank of a multi-process GPU run: one `NCCL_BYTES_PER_COMMUNICATOR`
/// per communicator (see `cluster::NCCL_BYTES_PER_COMMUNICATOR`); none for one rank or thread ranks (ThreadComm).
pub fn nccl_buffer_bytes(cfg: &LlamaConfig, l: &MemParallelism) -> f64 {
    if l.world() <= 1 || l.thread_ranks {
        return 0.0;
    }
    ferrolm_parallel::zero::groups::communicators(l.tp, l.dp, l.spec, cfg.num_key_value_heads) as f64 * NCCL_BYTES_PER_COMMUNICATOR
}

/// Bytes a single-device training step needs at its peak. None on overflow.
pub fn estimate_training_bytes(cfg: &LlamaConfig, dtype: DType, batch: usize, seq: usize, checkpointing: bool) -> Option<u64> {
    estimate(cfg, dtype, Device::Cpu, batch, seq, 1, &MemParallelism::single(checkpointing)).map(|m| m.total() as u64)
}

/// Memory the system can still give this process (`MemAvailable`), None where unknown.
pub fn available_host_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Bytes in GiB, or MiB below one GiB.
pub fn human(b: f64) -> String {
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

fn gib(b: f64) -> String {
    human(b)
}

/// One line: the prediction per rank, its moment and the parts held then (they add up to it).
pub fn describe(m: &Memory) -> String {
    let (moment, moving) = if m.peaks_at_backward_start() {
        ("when backward starts", format!("activations {}, head and gradients held {}", gib(m.activations), gib(m.backward_start)))
    } else {
        (
            "when the gradients are complete",
            match m.held_to_end {
                0.0 => format!("gradients {}, buffers {}", gib(m.grads), gib(m.buffers)),
                a => format!("activations {}, gradients {}, buffers {}", gib(a), gib(m.grads), gib(m.buffers)),
            },
        )
    };
    let reference = if m.reference > 0.0 { format!(" with the reference's {}", gib(m.reference)) } else { String::new() };
    format!(
        "{} per rank {moment} (parameters {}{reference}, optimizer {}, {moving}, margin {}, workspace {})",
        gib(m.total()),
        gib(m.params),
        gib(m.optim),
        gib(m.margin),
        gib(m.workspace)
    )
}

/// [`describe`], and for thread ranks (one process) what they need together: the number the
/// process's tensor peak (`peak_tensor_mib` in metrics.jsonl) is compared with.
pub fn describe_layout(m: &Memory, l: &MemParallelism) -> String {
    if l.thread_ranks && l.world() > 1 {
        format!("{}; {} for the {} thread ranks of this process", describe(m), gib(m.total() * l.world() as f64), l.world())
    } else {
        describe(m)
    }
}

/// Checks a run laid out by `l`: the batch sizes, the host batch buffers against the host's
/// available memory, and the predicted peak against the memory it will get: on the CPU the
/// host's available memory (thread ranks add up), on a GPU `FERROLM_DEVICE_MEMORY_GIB` when set.
/// `FERROLM_SKIP_MEMORY_CHECK=1` turns the refusal of the prediction into a warning. Returns
/// the prediction per rank.
pub fn check_layout(cfg: &LlamaConfig, dtype: DType, device: Device, o: &RunShape, l: &MemParallelism) -> Result<Memory> {
    let Some(tokens) = o.batch_size.checked_mul(o.seq_len) else {
        bail!("--batch-size {} × --seq-len {} overflows: lower --batch-size", o.batch_size, o.seq_len);
    };
    if tokens.checked_mul(o.grad_accum).is_none() {
        bail!("--batch-size {} × --seq-len {} × --grad-accum {} overflows: lower --grad-accum", o.batch_size, o.seq_len, o.grad_accum);
    }
    let avail = available_host_bytes();
    // Inputs and targets as i32 on the host, one batch at a time (a preference batch's pairs in
    // twice as many rows).
    let rows = if l.preference.is_some() { 2 } else { 1 };
    let host = (tokens as u64).checked_mul(8 * rows);
    if let (Some(avail), Some(need)) = (avail, host) {
        if need > avail {
            bail!(
                "--batch-size {} with --seq-len {}: the batch alone needs {} of host memory, {} are available: lower --batch-size",
                o.batch_size,
                o.seq_len,
                gib(need as f64),
                gib(avail as f64)
            );
        }
    }
    let Some(mem) = estimate(cfg, dtype, device, o.batch_size, o.seq_len, o.grad_accum, l).filter(|_| host.is_some()) else {
        bail!("--batch-size {} with --seq-len {}: the memory estimate overflows: lower --batch-size", o.batch_size, o.seq_len);
    };
    let skip = std::env::var(ENV_SKIP_CHECK).is_ok_and(|v| v == "1");
    let (need, cap, what) = if device == Device::Cpu {
        let ranks = if l.thread_ranks { l.world() as f64 } else { 1.0 };
        (mem.total() * ranks, avail.map(|a| a as f64), if ranks > 1.0 { "host memory for all thread ranks" } else { "host memory" })
    } else {
        let cap = std::env::var(ENV_DEVICE_GIB).ok().and_then(|v| v.parse::<f64>().ok()).map(|g| g * (1u64 << 30) as f64);
        (mem.total(), cap, "device memory per rank")
    };
    if let Some(cap) = cap {
        if need > cap {
            let msg = format!(
                "--batch-size {} with --seq-len {} needs about {} of {what} ({}) but {} are available: lower --batch-size \
                 (raise --grad-accum for the same tokens per step) or --seq-len, pass --activation-checkpointing, or shard more \
                 (--zero, --shard-*); {ENV_SKIP_CHECK}=1 runs it anyway",
                o.batch_size,
                o.seq_len,
                gib(need),
                describe(&mem),
                gib(cap)
            );
            if skip {
                tracing::warn!("{msg}");
            } else {
                bail!("{msg}");
            }
        }
    }
    Ok(mem)
}

/// A Llama 3 8B (hidden 4096, 32 layers, 8 key/value heads, vocabulary 128256, untied):
/// `lora_memory`'s model.
pub const LLAMA3_8B: &str = r#"{"model_type":"llama","vocab_size":128256,"hidden_size":4096,"intermediate_size":14336,
    "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"max_position_embeddings":8192,
    "rope_theta":500000.0,"tie_word_embeddings":false}"#;

/// A LLaMA shape: (layers, hidden, intermediate, heads, key/value heads).
pub type LlamaShape = (usize, usize, usize, usize, usize);

/// Published QLoRA memory figures, theirs, not this estimator's: (model, LLaMA shape as
/// (layers, hidden, intermediate, heads, key/value heads), figure, source).
pub const PUBLISHED_QLORA: [(&str, LlamaShape, &str, &str); 5] = [
    ("LLaMA 7B", (32, 4096, 11008, 32, 32), "6 GB", "LLaMA-Factory README, Hardware Requirement (their estimate)"),
    ("LLaMA 13B", (40, 5120, 13824, 40, 40), "12 GB", "LLaMA-Factory README, Hardware Requirement (their estimate)"),
    ("LLaMA 30B", (60, 6656, 17920, 52, 52), "24 GB", "LLaMA-Factory README, Hardware Requirement (their estimate)"),
    ("LLaMA 65B", (80, 8192, 22016, 64, 64), "one 48 GB GPU", "QLoRA paper (Dettmers et al. 2023, arXiv:2305.14314)"),
    ("Llama 2 70B", (80, 8192, 28672, 64, 8), "48 GB", "LLaMA-Factory README, Hardware Requirement (their estimate)"),
];

/// The lines `examples/lora_memory.rs` prints (docs/LORA.md, "QLoRA"; docs/BENCHMARKS.md, "LoRA
/// memory"; tests/documented_numbers.rs checks the documents quote them): the estimate, in bf16
/// on one GPU with one sequence of `seq` tokens a micro-batch and LoRA of `rank` on all seven
/// projections, of a Llama 3 8B fine-tuned in full, with LoRA and with QLoRA (NF4 base), with
/// and without activation checkpointing; then QLoRA (checkpointed) at the published figures'
/// LLaMA shapes beside those figures.
pub fn lora_memory_tables(rank: usize, seq: usize) -> Result<Vec<String>> {
    use crate::nn::{LoraConfig, Proj};
    let lora = LoraConfig::new(rank, None, 0.0, Proj::ALL.to_vec(), false)?;
    let run = |cfg: &LlamaConfig, quantized: Option<Option<QuantSpec>>, checkpointing: bool| -> Result<Memory> {
        let lora = quantized.map(|q| LoraMem { quantized_base: q, ..LoraMem::new(&lora, cfg.num_hidden_layers) });
        let l = MemParallelism { lora, ..MemParallelism::single(checkpointing) };
        estimate(cfg, DType::BF16, Device::Cuda(0), 1, seq, 1, &l).ok_or_else(|| anyhow::anyhow!("--seq-len {seq}: the estimate overflows"))
    };
    let cfg = LlamaConfig::from_json_str(LLAMA3_8B)?;
    let mut out = vec![
        format!(
            "Llama 3 8B, bf16, one GPU, 1 x {seq} tokens; LoRA rank {rank} on q,k,v,o,gate,up,down; QLoRA: the blocks' linear weights in NF4 ({:.3} bits)",
            quant_bits_per_param(QuantSpec::QLORA)
        ),
        format!("| {:<30} | {:>10} | {:>10} | {:>10} | {:>11} | {:>10} |", "run", "parameters", "gradients", "optimizer", "activations", "peak"),
        format!("|{:-<32}|{:-<12}|{:-<12}|{:-<12}|{:-<13}|{:-<12}|", "", "", "", "", "", ""),
    ];
    for checkpointing in [false, true] {
        for (name, quantized) in [("full fine-tuning", None), ("LoRA", Some(None)), ("QLoRA", Some(Some(QuantSpec::QLORA)))] {
            let m = run(&cfg, quantized, checkpointing)?;
            let name = format!("{name}{}", if checkpointing { ", checkpointed" } else { "" });
            out.push(format!(
                "| {name:<30} | {:>10} | {:>10} | {:>10} | {:>11} | {:>10} |",
                human(m.params),
                human(m.grads),
                human(m.optim),
                human(m.activations),
                human(m.total())
            ));
        }
    }
    out.push(String::new());
    out.push(format!("QLoRA rank {rank}, checkpointed, 1 x {seq} tokens, at the published figures' shapes (vocabulary 32000):"));
    out.push(format!("| {:<11} | {:>13} | {:<60} | {:>20} |", "model", "published", "source (their figure)", "this estimator"));
    out.push(format!("|{:-<13}|{:-<15}|{:-<62}|{:-<22}|", "", "", "", ""));
    for (model, (layers, hidden, inter, heads, kv), figure, source) in PUBLISHED_QLORA {
        let cfg = LlamaConfig::from_json_str(&format!(
            r#"{{"model_type":"llama","vocab_size":32000,"hidden_size":{hidden},"intermediate_size":{inter},"num_hidden_layers":{layers},"num_attention_heads":{heads},"num_key_value_heads":{kv}}}"#
        ))?;
        let peak = run(&cfg, Some(Some(QuantSpec::QLORA)), true)?.total();
        let ours = format!("{} ({:.1} GB)", human(peak), peak / 1e9);
        out.push(format!("| {model:<11} | {figure:>13} | {source:<60} | {ours:>20} |"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm_ops::nf4::{OrigDtype, Quant4, QuantType};

    const QLORA: QuantSpec = QuantSpec::QLORA;

    /// The 4.127 bits of QLoRA's NF4 from its block sizes: 4-bit codes, an 8-bit absmax code a
    /// block of 64, an f32 scale a nested block of 256 absmax values.
    #[test]
    fn nf4_with_double_quantization_costs_4_127_bits_a_parameter() {
        assert_eq!((QLORA.blocksize, NESTED_BLOCKSIZE), (64, 256));
        let bits = quant_bits_per_param(QLORA);
        assert_eq!(bits, 4.0 + 8.0 / 64.0 + 32.0 / (64.0 * 256.0));
        assert_eq!(bits, 4.126953125);
        assert_eq!(format!("{bits:.3}"), "4.127");
        // Without double quantization an f32 absmax a block: 4.5 bits.
        assert_eq!(quant_bits_per_param(QuantSpec { double_quant: false, ..QLORA }), 4.5);
        // FP4 is stored the same way.
        assert_eq!(quant_bits_per_param(QuantSpec { quant_type: QuantType::Fp4, ..QLORA }), bits);
        // A weight whose size is a multiple of 64 x 256 costs exactly that, plus the code books.
        for n in [64 * 256, 3 * 64 * 256, 4096 * 4096] {
            assert_eq!(quant4_bytes(n, QLORA) - 1088.0, n as f64 * bits / 8.0, "n = {n}");
        }
    }

    /// The count against the format itself: what `Quant4` stores (codes, absmax codes, nested
    /// scales, offset) plus the code books the device copy carries and its 16-byte padding.
    #[test]
    fn quant4_bytes_are_what_the_quantizer_stores() {
        for n in [1usize, 63, 64, 65, 1000, 64 * 256, 64 * 256 + 1, 70_001] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
            for spec in [QLORA, QuantSpec { double_quant: false, ..QLORA }] {
                let q = Quant4::quantize("w", &x, &[n], OrigDtype::F32, spec).unwrap();
                let stored = q.stored_bytes() as f64 - if spec.double_quant { 4.0 } else { 0.0 }; // the offset is an argument
                let counted = quant4_bytes(n as u64, spec);
                let extra = counted - stored - 1088.0;
                assert!((0.0..=32.0).contains(&extra), "n {n} {spec:?}: counted {counted}, stored {stored}");
            }
        }
    }

    fn llama3_8b() -> ModelShape {
        let c = LlamaConfig::from_json_str(
            r#"{"model_type":"llama","vocab_size":128256,"hidden_size":4096,"intermediate_size":14336,
            "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"tie_word_embeddings":false}"#,
        )
        .unwrap();
        ModelShape::from_config(&c, "8b")
    }

    fn workload(tp: usize, elem_bytes: usize) -> Workload {
        Workload {
            seq: 2048,
            micro_batch: 1,
            global_batch_tokens: 2048,
            tp,
            elem_bytes,
            grad_bytes: 4,
            checkpointed_layers: usize::MAX,
            loss_chunks: LossChunks::Auto,
        }
    }

    /// A known shape, counted by hand: Llama 3 8B in bf16. Per block q and o 4096², k and v
    /// 1024 x 4096, gate, up and down 14336 x 4096 (all multiples of 64 x 256: 4.127 bits each
    /// plus 1088 bytes of code books); the embedding and the head (128256 x 4096) and the norms
    /// in bf16; the scratch is one down_proj in bf16.
    #[test]
    fn a_4bit_base_is_charged_its_bits_its_scratch_and_the_rest_in_the_compute_dtype() {
        let m = llama3_8b();
        let w = workload(1, 2);
        let linear = [4096 * 4096, 1024 * 4096, 1024 * 4096, 4096 * 4096, 14336 * 4096, 14336 * 4096, 14336 * 4096u64];
        assert_eq!(quantized_weights(&m, 1), linear);
        let per_block: u64 = linear.iter().sum();
        let kept = 2 * 128256 * 4096 + 4096 * (2 * 32 + 1); // embedding, head, norms
        assert_eq!(m.params(), 32 * per_block + kept);
        let codes = 32.0 * (per_block as f64 * 4.126953125 / 8.0 + 7.0 * 1088.0);
        let scratch = 14336.0 * 4096.0 * 2.0;
        assert_eq!(dequant_scratch_bytes(&m, &w), scratch);
        let want = kept as f64 * 2.0 + codes + scratch;
        assert_eq!(frozen_base_bytes(&m, &w, Some(QLORA)), want);
        assert_eq!(frozen_base_bytes(&m, &w, None), m.params() as f64 * 2.0);
        // 14.96 GiB of bf16 base becomes 5.42 GiB: 3.35 GiB of codes, 1.96 GiB of embedding
        // and head, 112 MiB of scratch.
        let gib = |b: f64| b / (1u64 << 30) as f64;
        assert!((gib(want) - 5.42).abs() < 0.005, "{}", gib(want));
        assert!((gib(codes) - 3.35).abs() < 0.005 && (gib(kept as f64 * 2.0) - 1.96).abs() < 0.005);
        // In f32 the kept parameters and the scratch double, the codes do not.
        let w32 = workload(1, 4);
        assert_eq!(frozen_base_bytes(&m, &w32, Some(QLORA)), kept as f64 * 4.0 + codes + 2.0 * scratch);
    }

    /// Under tensor parallelism each shard is quantized on its own: a rank holds half of the
    /// split weights' codes (the key/value heads whole where fewer than the ranks). Pieces of
    /// output rows (q, k, v, gate, up) keep the nested absmax (their blocks a multiple of 256 at
    /// this shape); pieces of input columns (o, down) hold an f32 absmax a block, 4.5 bits, as
    /// `nn::qlora::shard_quant` cuts them.
    #[test]
    fn tensor_parallel_ranks_hold_their_shards_codes() {
        let m = llama3_8b();
        let halves: Vec<u64> = quantized_weights(&m, 1).iter().map(|n| n / 2).collect();
        assert_eq!(quantized_weights(&m, 2), halves);
        let plain = QuantSpec { double_quant: false, ..QLORA };
        assert_eq!(shard_quant_specs(&m, 1, QLORA), [QLORA; 7]);
        assert_eq!(shard_quant_specs(&m, 2, QLORA), [QLORA, QLORA, QLORA, plain, QLORA, QLORA, plain]);
        let w = workload(2, 2);
        let local: u64 = m.bucket_params(2).iter().sum();
        let quantized: u64 = halves.iter().sum::<u64>() * 32;
        let spec = |i: usize| if i == 3 || i == 6 { plain } else { QLORA };
        let codes: f64 = 32.0 * halves.iter().enumerate().map(|(i, &n)| quant4_bytes(n, spec(i))).sum::<f64>();
        assert_eq!(frozen_base_bytes(&m, &w, Some(QLORA)), (local - quantized) as f64 * 2.0 + codes + 14336.0 * 2048.0 * 2.0);
        // o's and down's pieces at 4.5 bits (plus their 16 bytes of padding and the code books).
        let o = quant4_bytes(halves[3], plain) - 1088.0 - 16.0;
        assert_eq!(o, halves[3] as f64 * 4.5 / 8.0);
    }

    /// QLoRA against LoRA through the whole estimate, with and without activation checkpointing:
    /// only the parameters' term changes, by the quantized weights' bf16 bytes less their codes
    /// and the scratch; gradients, optimizer state, activations (`nn::QuantOp`'s adapted forward
    /// is one autograd node that saves what dense LoRA's does) and the transients are the
    /// adapters' and the same.
    #[test]
    fn qlora_saves_the_base_and_nothing_else_changes() {
        let m = llama3_8b();
        for checkpointed_layers in [usize::MAX, 16, 0] {
            let w = Workload { checkpointed_layers, ..workload(1, 2) };
            let lora = LoraMem { rank: 16, targets: [true; 7], layers: 32, dropout: false, quantized_base: None };
            let qlora = LoraMem { quantized_base: Some(QLORA), ..lora };
            let spec = ShardSpec { params: 1, grads: 1, optim: 1 };
            let (a, b) = (memory(&m, &w, spec, 1, 0.0, Some(&lora)), memory(&m, &w, spec, 1, 0.0, Some(&qlora)));
            let n: u64 = quantized_weights(&m, 1).iter().sum::<u64>() * 32;
            let saved = a.params - b.params;
            let want = n as f64 * 2.0
                - 32.0 * quantized_weights(&m, 1).iter().map(|&k| quant4_bytes(k, QLORA)).sum::<f64>()
                - dequant_scratch_bytes(&m, &w);
            assert_eq!(saved, want);
            assert!(saved > 0.73 * n as f64 * 2.0, "NF4 saves about three quarters of the linear weights' bf16: {saved}");
            assert_eq!(
                (a.grads, a.optim, a.activations, a.buffers, a.backward_start),
                (b.grads, b.optim, b.activations, b.buffers, b.backward_start),
                "checkpointed layers {checkpointed_layers}"
            );
            assert_eq!(a.total() - b.total(), saved);
        }
    }
}
