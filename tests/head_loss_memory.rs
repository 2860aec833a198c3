//! The memory the fused, chunked LM head + loss saves, measured on `cuda:0` (the GPU, else the
//! CPU emulator, whose pool keeps the same books): one bf16 training step through the engine,
//! fused in chunks against unfused (`--loss-chunk-tokens 0`). The step's peak falls by at least
//! the whole logits' bytes less one chunk's, and no buffer the fused step allocates is as large
//! as the whole logits (the unfused one's are).
//!
//! At Llama-3.2-1B's shape (V 128256, hidden 2048, 32 heads over 8 KV heads, MLP 8192, tied, a
//! micro-batch of 8 x 2048 tokens) with one layer instead of 16, on the emulator the step runs
//! books-only (`emulator_books_only`): every kernel, GEMM and copy is checked, counted and
//! allocated for, none is run (its 100 TFLOPs would take hours on two cores), so the books are
//! the real step's and its gigabytes stay virtual. That the hook leaves the books unchanged is
//! itself measured: at a small shape with the same vocabulary the step is run for real and
//! books-only, and the two peaks and largest buffers must agree to the byte.
mod common;
use ferrolm::nn::optim::AdamWConfig;
use ferrolm::nn::LlamaConfig;
use ferrolm::ops::{LossChunks, Tokens};
use ferrolm::planner::memory::{estimate, MemParallelism};
use ferrolm::{DType, Llama};
use ferrolm_cuda::CudaBackend;
use ferrolm_parallel::zero::{Placement, Zero};
use ferrolm_parallel::TrainEngine;
use ferrolm_tensor::{live_bytes, peak_bytes, reset_peak_bytes};

const VOCAB: usize = 128_256;

/// The tests share `cuda:0`'s pool and its books-only switch: one at a time.
static DEVICE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn cuda0() -> Option<(std::sync::MutexGuard<'static, ()>, std::sync::Arc<CudaBackend>)> {
    common::cuda0_device()?;
    let guard = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    Some((guard, CudaBackend::latest(0).expect("cuda:0 started")))
}

/// A tied bf16 LLaMA at `hidden` (heads of 64, MLP 4x), `layers` deep, with V 128256.
struct Shape {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    layers: usize,
    batch: usize,
    seq: usize,
}

/// Llama-3.2-1B's shape, one layer of its sixteen, at 8 x 2048 tokens.
const LLAMA_3_2_1B: Shape = Shape { hidden: 2048, heads: 32, kv_heads: 8, layers: 1, batch: 8, seq: 2048 };
/// The same vocabulary at a shape the emulator computes in seconds.
const SMALL: Shape = Shape { hidden: 16, heads: 2, kv_heads: 2, layers: 1, batch: 2, seq: 64 };

impl Shape {
    fn tokens(&self) -> usize {
        self.batch * self.seq
    }
    fn config(&self) -> LlamaConfig {
        LlamaConfig::from_json_str(&format!(
            r#"{{"model_type":"llama","vocab_size":{VOCAB},"hidden_size":{},"intermediate_size":{},"num_hidden_layers":{},
                "num_attention_heads":{},"num_key_value_heads":{},"max_position_embeddings":{},"tie_word_embeddings":true}}"#,
            self.hidden,
            4 * self.hidden,
            self.layers,
            self.heads,
            self.kv_heads,
            self.seq
        ))
        .unwrap()
    }
}

/// What one step (micro-batch and update) books on a fresh model and engine.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Books {
    /// The pool's peak, counted from the step's start.
    peak: usize,
    /// The largest block the pool handed out in the step.
    largest: usize,
    /// The peak tensor bytes from before the model was built to the end of the last step (from
    /// the second on, the optimizer's state is held too): what the memory estimator predicts.
    run_peak: usize,
}

/// The `Books` of `steps` training steps, books-only when asked. The model is zeros
/// (`Llama::zeros`, no draws on the host): what the step allocates does not depend on the values.
fn step_memory(be: &CudaBackend, s: &Shape, chunks: LossChunks, books_only: bool, steps: usize) -> Books {
    let device = ferrolm::Device::Cuda(0);
    be.emulator_books_only(books_only);
    be.synchronize().unwrap();
    let before = live_bytes();
    reset_peak_bytes();
    let mut m = Llama::zeros(s.config(), DType::BF16, device).unwrap();
    m.loss_chunks = chunks;
    let mut z = Zero::single(&mut m, AdamWConfig::default(), Placement::Device).unwrap();
    let ids: Vec<i32> = (0..s.tokens()).map(|i| ((i * 7919) % VOCAB) as i32).collect();
    let targets: Vec<i32> = ids.iter().map(|&i| (i + 1) % VOCAB as i32).collect();
    let [x, y] = [ids, targets].map(|v| Tokens::upload(v, [s.batch, s.seq], device).unwrap());
    let mut step = || {
        z.micro_batch(true, &mut || m.loss(&x, &y)).unwrap();
        let r = z.step(1e-3, 1.0, 0.0).unwrap();
        assert!(r.loss.is_finite(), "the step ran");
        be.synchronize().unwrap();
    };
    let base = be.memory_stats().0;
    be.reset_peak_memory();
    step();
    let (peak, largest) = (be.memory_stats().1 - base, be.largest_allocation());
    for _ in 1..steps {
        step();
    }
    let run_peak = peak_bytes() - before;
    be.emulator_books_only(false);
    Books { peak, largest, run_peak }
}

/// The memory estimator (the "predicted peak" line, `plan`, `autoconfig`) at `s` in `chunks`,
/// without the CUDA workspace (no tensor holds it): never under the measured `run_peak`, and
/// at most 1.25 times it, as tests/memory_estimator.rs holds it at the presets.
fn assert_estimate_bounds(s: &Shape, chunks: LossChunks, b: Books) {
    let mut l = MemParallelism::single(false);
    l.loss_chunks = chunks;
    let m = estimate(&s.config(), DType::BF16, ferrolm::Device::Cuda(0), s.batch, s.seq, 1, &l).unwrap();
    let (predicted, measured) = (m.total() - m.workspace, b.run_peak as f64);
    println!(
        "{chunks:?}: estimate {:.1} MiB, measured {:.1} MiB, ratio {:.3}",
        predicted / 1048576.0,
        measured / 1048576.0,
        predicted / measured
    );
    assert!(
        (1.0..=1.25).contains(&(predicted / measured)),
        "{chunks:?}: the estimate {predicted} bytes is outside [1, 1.25] x the measured peak {measured}"
    );
}

/// The issue's assertions on the books of the fused step (`fused`, in chunks of `chunks`) and of
/// the unfused one (`plain`) at `s`.
fn assert_fused_saves_the_logits(s: &Shape, chunks: LossChunks, fused: Books, plain: Books, how: &str) {
    let ((fused_peak, fused_largest), (plain_peak, plain_largest)) = ((fused.peak, fused.largest), (plain.peak, plain.largest));
    let logits = s.tokens() * VOCAB * 2; // bf16
    let chunk_tokens = chunks.chunk_tokens(s.tokens(), VOCAB, 2).expect("a fused step");
    let chunk = chunk_tokens * VOCAB * 2;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "V {VOCAB}, {} x {} tokens, hidden {}, {} layer(s), bf16, tied, {how}: peak {:.1} MiB unfused, {:.1} MiB in chunks of \
         {chunk_tokens} (saved {:.1} MiB; whole logits {:.1} MiB, one chunk {:.1} MiB); largest buffer {:.1} / {:.1} MiB",
        s.batch,
        s.seq,
        s.hidden,
        s.layers,
        mib(plain_peak),
        mib(fused_peak),
        mib(plain_peak.saturating_sub(fused_peak)),
        mib(logits),
        mib(chunk),
        mib(plain_largest),
        mib(fused_largest)
    );
    assert!(
        plain_largest >= logits,
        "the unfused step holds the whole logits ({plain_largest} < {logits} bytes): the test measures nothing"
    );
    assert!(fused_largest < logits, "the fused step allocated {fused_largest} bytes at once, the whole logits are {logits}");
    assert!(
        plain_peak >= fused_peak + logits - chunk,
        "the peak fell by {} bytes, less than the whole logits less one chunk ({})",
        plain_peak as i64 - fused_peak as i64,
        logits - chunk
    );
}

/// At a shape small enough to compute (tokens / hidden is 8 as at the full shape, so the whole
/// logits outweigh the f32 weight gradient four to one; 16 chunks a micro-batch as the full
/// shape's automatic 1024 tokens make): the computed steps save the logits, and books-only
/// (on the emulator) books exactly what they do.
#[test]
fn the_chunked_head_saves_the_whole_logits_and_books_only_books_the_same() {
    let Some((_one_at_a_time, be)) = cuda0() else { return };
    let chunks = LossChunks::Tokens(8);
    let [fused, plain] = [chunks, LossChunks::Unfused].map(|c| step_memory(&be, &SMALL, c, false, 1));
    assert_fused_saves_the_logits(&SMALL, chunks, fused, plain, "computed");
    if !be.is_emulated() {
        println!("books-only is the emulator's: not compared on a GPU");
        return;
    }
    for (c, run) in [(chunks, fused), (LossChunks::Unfused, plain)] {
        assert_eq!(step_memory(&be, &SMALL, c, true, 1), run, "{c:?}: books-only (peak, largest) against the computed step's");
    }
}

/// The issue's shape: Llama-3.2-1B with one layer, 8 x 2048 tokens, the automatic chunk; books-
/// only on the emulator, computed on a GPU.
#[test]
fn the_chunked_head_saves_the_whole_logits_at_llama_3_2_1b() {
    let Some((_one_at_a_time, be)) = cuda0() else { return };
    let (s, how) = (&LLAMA_3_2_1B, if be.is_emulated() { "books-only" } else { "computed" });
    let [fused, plain] = [LossChunks::Auto, LossChunks::Unfused].map(|c| step_memory(&be, s, c, be.is_emulated(), 2));
    assert_fused_saves_the_logits(s, LossChunks::Auto, fused, plain, how);
    assert_estimate_bounds(s, LossChunks::Auto, fused);
    assert_estimate_bounds(s, LossChunks::Unfused, plain);
}

/// The per-row head (`head_logprobs`: per-sequence log-probs for the preference losses) keeps
/// the logits in chunks too, in its forward and in its backward (which walks the chunks again
/// with the per-row gradient): no buffer it allocates is as large as the whole logits, and its
/// peak stays under them (bf16, V 128256, 128 tokens in chunks of 8).
#[test]
fn the_per_row_head_never_holds_the_whole_logits() {
    use ferrolm::ops::{head_logprobs, HeadRowsOptions};
    let Some((_one_at_a_time, be)) = cuda0() else { return };
    let device = ferrolm::Device::Cuda(0);
    let (tokens, hidden) = (128, 16);
    let mut r = ferrolm_tensor::Rng::new(9);
    let x = ferrolm_tensor::Tensor::randn([tokens, hidden], 1.0, DType::BF16, device, &mut r).unwrap();
    let w = ferrolm_tensor::Tensor::randn([VOCAB, hidden], 0.3, DType::BF16, device, &mut r).unwrap();
    x.set_requires_grad(true).unwrap();
    w.set_requires_grad(true).unwrap();
    let t: Vec<i32> = (0..tokens).map(|i| if i % 3 == 0 { -100 } else { ((i * 7919) % VOCAB) as i32 }).collect();
    let tg = Tokens::upload(t, [tokens], device).unwrap();
    let g = ferrolm_tensor::Tensor::randn([tokens], 1.0, DType::F32, device, &mut r).unwrap();
    be.synchronize().unwrap();
    let base = be.memory_stats().0;
    be.reset_peak_memory();
    let lp = head_logprobs(&x, &w, &tg, &HeadRowsOptions { ignore_index: -100, chunk_tokens: 8 }).unwrap();
    lp.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    be.synchronize().unwrap();
    let (peak, largest) = (be.memory_stats().1 - base, be.largest_allocation());
    let logits = tokens * VOCAB * 2;
    println!("per-row head: peak {peak} bytes, largest buffer {largest}, whole logits {logits}");
    assert!(x.grad().is_some() && w.grad().is_some(), "the backward ran");
    assert!(largest < logits, "the per-row head allocated {largest} bytes at once, the whole logits are {logits}");
    assert!(peak < logits, "the per-row head's peak {peak} is not under the whole logits {logits}");
}
