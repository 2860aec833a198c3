//! The memory the fused, chunked LM head + loss saves, measured on `cuda:0` (the GPU, else the
//! CPU emulator, whose pool keeps the same books) at the vocabulary of Llama 3.2 1B: one bf16
//! training step through the engine, fused in chunks against unfused (`--loss-chunk-tokens 0`).
//! The step's peak falls by at least the whole logits' bytes less one chunk's, and no buffer the
//! fused step allocates is as large as the whole logits (the unfused one's are).
//!
//! The shape is Llama-3.2-1B's head scaled down to what the emulator runs in seconds on two
//! cores: V = 128256 kept, tied; 128 tokens a micro-batch (2 x 64) instead of 8 x 2048, and
//! hidden 16 instead of 2048, so tokens / hidden stays 8 (the whole logits then outweigh the f32
//! weight gradient four to one, as at the full shape); 16 chunks a micro-batch (of 8 tokens) as
//! at the full shape's automatic 1024; one layer. The full shape's counts are in
//! docs/BENCHMARKS.md.
mod common;
use ferrolm::nn::optim::AdamWConfig;
use ferrolm::nn::LlamaConfig;
use ferrolm::ops::{LossChunks, Tokens};
use ferrolm::{DType, Llama};
use ferrolm_cuda::CudaBackend;
use ferrolm_parallel::zero::{Placement, Zero};
use ferrolm_parallel::TrainEngine;
use ferrolm_tensor::Rng;

const VOCAB: usize = 128_256;
const HIDDEN: usize = 16;
const BATCH: usize = 2;
const SEQ: usize = 64;
const CHUNK: usize = 8;

/// (peak bytes, largest allocation) of one training step (micro-batch and update) on a fresh
/// model and engine, counted from the step's start.
fn step_memory(be: &CudaBackend, chunks: LossChunks) -> (usize, usize) {
    let device = ferrolm::Device::Cuda(0);
    let cfg = LlamaConfig::from_json_str(&format!(
        r#"{{"model_type":"llama","vocab_size":{VOCAB},"hidden_size":{HIDDEN},"intermediate_size":{},"num_hidden_layers":1,
            "num_attention_heads":2,"num_key_value_heads":2,"max_position_embeddings":{SEQ},"tie_word_embeddings":true}}"#,
        2 * HIDDEN
    ))
    .unwrap();
    let mut m = Llama::new(cfg, DType::BF16, device, &mut Rng::new(1)).unwrap();
    m.loss_chunks = chunks;
    let mut z = Zero::single(&mut m, AdamWConfig::default(), Placement::Device).unwrap();
    let ids: Vec<i32> = (0..BATCH * SEQ).map(|i| ((i * 7919) % VOCAB) as i32).collect();
    let targets: Vec<i32> = ids.iter().map(|&i| (i + 1) % VOCAB as i32).collect();
    let (x, y) = (Tokens::upload(ids, [BATCH, SEQ], device).unwrap(), Tokens::upload(targets, [BATCH, SEQ], device).unwrap());
    be.synchronize().unwrap();
    let base = be.memory_stats().0;
    be.reset_peak_memory();
    z.micro_batch(true, &mut || m.loss(&x, &y)).unwrap();
    let r = z.step(1e-3, 1.0, 0.0).unwrap();
    assert!(r.loss.is_finite() || r.loss == 0.0, "the step ran");
    be.synchronize().unwrap();
    (be.memory_stats().1 - base, be.largest_allocation())
}

#[test]
fn the_chunked_head_saves_the_whole_logits_at_the_vocabulary_of_llama_3_2_1b() {
    let Some(_) = common::cuda0_device() else { return };
    let be = CudaBackend::latest(0).expect("cuda:0 started");
    let logits = BATCH * SEQ * VOCAB * 2; // bf16
    let chunk = CHUNK * VOCAB * 2;
    let (fused_peak, fused_largest) = step_memory(&be, LossChunks::Tokens(CHUNK));
    let (plain_peak, plain_largest) = step_memory(&be, LossChunks::Unfused);
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "V {VOCAB}, {BATCH} x {SEQ} tokens, hidden {HIDDEN}, bf16, tied: peak {:.1} MiB unfused, {:.1} MiB in chunks of {CHUNK} \
         (saved {:.1} MiB; whole logits {:.1} MiB, one chunk {:.1} MiB); largest buffer {:.1} / {:.1} MiB",
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
