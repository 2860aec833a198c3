//! Tensor-parallel overlap benchmark: how much communication the standard Llama exposes and
//! how much of it the Ladder Transformer hides, in training and in inference, on CPU thread
//! ranks behind a simulated link.
//!
//!   cargo run --release --example bench_tp -- [--tp 2] [--layers 6] [--hidden 384] [--steps 4]
//!
//! For each mode (train: forward + backward + AdamW; infer: a no-grad forward of the batch) it
//! measures both models (a) with no link cost and (b) behind a simulated link whose bandwidth is
//! tuned so that the standard model's communication takes 40% of its no-link step. Exposed
//! communication = step time behind the link - step time without it. One JSON line per row:
//! model, tp, mode, link, step_s, exposed_comm_s; then the Ladder speedup and the share of the
//! standard model's exposed communication that Ladder hides (target: at least 70%).
use clap::Parser;
use ferrolm::cli::{env_help, flag_error, fraction, positive, LogArgs, Tool, ENV_COMMON};
use ferrolm::nn::optim::{AdamW, AdamWConfig};
use ferrolm::nn::{LadderLayers, Llama, LlamaConfig};
use ferrolm::{AnyResult, DType, Device, Tensor};
use ferrolm_parallel::cost::{Link, LinkModel};
use ferrolm_parallel::tp::parallelize;
use ferrolm_parallel::{CommOptions, CommStats, Communicator, SimLink, ThreadComm};
use ferrolm_tensor::{no_grad, Rng};
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "bench_tp",
    about = "Tensor-parallel overlap benchmark: exposed communication of Llama and Ladder on CPU thread ranks behind a simulated link",
    after_help = env_help(&[ENV_COMMON])
)]
struct Opts {
    /// Tensor-parallel ranks (threads)
    #[arg(long, default_value = "2", value_parser = positive)]
    tp: usize,
    /// Transformer layers
    #[arg(long, default_value = "8", value_parser = positive)]
    layers: usize,
    /// Hidden size (a multiple of 64 x tp; head_dim is 64, so hidden / 64 query heads)
    #[arg(long, default_value = "512", value_parser = positive)]
    hidden: usize,
    /// Key/value heads (GQA), a divisor of the query heads and a multiple of tp [default: the
    /// query heads, hidden / 64]
    #[arg(long, value_parser = positive)]
    kv_heads: Option<usize>,
    /// MLP width, a multiple of tp [default: hidden x 8/3 rounded down to a multiple of 64]
    #[arg(long, value_parser = positive)]
    intermediate: Option<usize>,
    /// Sequences per step
    #[arg(long, default_value = "4", value_parser = positive)]
    batch_size: usize,
    /// Tokens per sequence
    #[arg(long, default_value = "128", value_parser = positive)]
    seq_len: usize,
    /// Timed steps per row (after one warm-up step; the median is reported)
    #[arg(long, default_value = "5", value_parser = positive)]
    steps: usize,
    /// Rounds: every configuration is measured once per round, in turn, and its fastest round
    /// kept (other work on the machine only ever slows a round down)
    #[arg(long, default_value = "3", value_parser = positive)]
    rounds: usize,
    /// Share of the standard model's no-link step that the simulated link's communication takes
    #[arg(long, default_value = "0.4", value_parser = fraction)]
    comm_share: f64,
    /// Print the modelled 8-GPU figure (Llama-3-8B shape, TP 8 on one H100 NVLink node) and exit
    #[arg(long)]
    modelled_8gpu: bool,
    #[command(flatten)]
    log: LogArgs,
}

impl Tool for Opts {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

fn config(o: &Opts, ladder: bool) -> AnyResult<LlamaConfig> {
    let heads = o.hidden / 64;
    let mut c = LlamaConfig::preset("tiny")?;
    // 4096, or the next multiple of tp (the vocabulary is split across the ranks).
    c.vocab_size = 4096usize.div_ceil(o.tp) * o.tp;
    c.hidden_size = o.hidden;
    c.intermediate_size = o.intermediate.unwrap_or(o.hidden * 8 / 3 / 64 * 64);
    c.num_hidden_layers = o.layers;
    c.num_attention_heads = heads;
    c.num_key_value_heads = o.kv_heads.unwrap_or(heads);
    c.head_dim = 64;
    c.max_position_embeddings = o.seq_len.max(256);
    c.tie_word_embeddings = false;
    c.ladder_layers = ladder.then_some(LadderLayers::Last(o.layers));
    c.validate()?;
    Ok(c)
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Train,
    Infer,
}

/// Median step time (max over ranks) and rank 0's communication counters for one setting.
fn measure(o: &Opts, cfg: &LlamaConfig, mode: Mode, link: Option<Link>) -> AnyResult<(f64, CommStats)> {
    let (x, y) = {
        let mut r = Rng::new(7);
        let n = o.batch_size * o.seq_len;
        let ids: Vec<i32> = (0..n).map(|_| r.below(cfg.vocab_size as u64) as i32).collect();
        let tg: Vec<i32> = (0..n).map(|_| r.below(cfg.vocab_size as u64) as i32).collect();
        (Tensor::from_vec(ids, [o.batch_size, o.seq_len], Device::Cpu)?, Tensor::from_vec(tg, [o.batch_size, o.seq_len], Device::Cpu)?)
    };
    let out = ThreadComm::run(o.tp, CommOptions::default(), |comm| {
        let comm: Arc<dyn Communicator> = match link {
            Some(l) => SimLink::wrap(comm, LinkModel::flat(l)),
            None => comm,
        };
        let mut m = Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut Rng::new(1))?;
        parallelize(&mut m, &comm)?;
        let mut opt = AdamW::new(&m.named_parameters(), AdamWConfig::default())?;
        let mut times = Vec::new();
        let before = comm.stats();
        for step in 0..=o.steps {
            comm.barrier()?;
            let t0 = Instant::now();
            match mode {
                Mode::Train => {
                    let loss = m.loss(&x, &y)?;
                    loss.backward()?;
                    opt.step(1e-4)?;
                    opt.zero_grad();
                    loss.item()?;
                }
                Mode::Infer => {
                    let _g = no_grad();
                    m.forward(&x)?.sum_all()?.item()?;
                }
            }
            if step > 0 {
                times.push(t0.elapsed().as_secs_f64()); // step 0 warms up
            }
        }
        let total = comm.stats().since(&before);
        times.sort_by(f64::total_cmp);
        Ok((times[times.len() / 2], total))
    })?;
    let step = out.iter().map(|r| r.0).fold(0.0, f64::max);
    Ok((step, out[0].1))
}

fn main() {
    ferrolm::cli::main_with(run)
}

/// The modelled 8-GPU figure: Llama-3-8B's shape at TP 8 on one H100 SXM node. Compute per
/// GEMM is a roofline (989 TFLOP/s dense bf16 at 60% efficiency, 3.35 TB/s HBM3: NVIDIA's H100
/// SXM datasheet); an all-reduce costs what `cost::seconds` charges on NVLink 4 (900 GB/s
/// bidirectional per GPU; 360 GB/s per rank and direction, the bus bandwidth nccl-tests reach
/// on DGX H100; 2 us per ring step). Per branch the standard model exposes its forward
/// all-reduce and, in backward, what the deferred weight-gradient GEMM does not cover; the
/// Ladder model exposes only what the next branch's compute does not cover.
fn modelled_8gpu(o: &Opts) {
    use ferrolm_parallel::cost::{seconds, GroupSpan, Kind};
    let (h, inter, heads, kv, d, layers, vocab) = (4096.0, 14336.0, 32.0, 8.0, 128.0, 32usize, 128256.0);
    let tp = 8.0;
    let link = LinkModel::flat(Link::new(2e-6, 360e9));
    let (peak, eff, hbm) = (989e12, 0.6, 3.35e12);
    let gemm = |m: f64, k: f64, n: f64| (2.0 * m * k * n / (peak * eff)).max(2.0 * (m * k + k * n + m * n) / hbm);
    for (mode, tokens, ctx) in [("train", 4096.0, 4096.0), ("infer", 4096.0, 4096.0), ("decode", 64.0, 4096.0)] {
        let ar = seconds(Kind::AllReduce, GroupSpan::intra(8), tokens * h * 2.0, &link);
        // Forward compute of each branch on one GPU.
        let attn_core = if mode == "decode" {
            2.0 * 2.0 * tokens * ctx * heads * d / tp / (peak * eff)
        } else {
            2.0 * tokens * ctx * heads * d / tp / (peak * eff)
        };
        let attn = gemm(tokens, h, (heads + 2.0 * kv) * d / tp) + gemm(tokens, heads * d / tp, h) + attn_core;
        let mlp = gemm(tokens, h, 2.0 * inter / tp) + gemm(tokens, inter / tp, h);
        let head = gemm(tokens, h, vocab / tp);
        let fwd = layers as f64 * (attn + mlp) + head;
        let (mut std_exposed, mut lad_exposed) = (0.0f64, 0.0f64);
        // Forward: the standard model waits for every all-reduce; Ladder hides each behind
        // the next branch (the last one has none).
        std_exposed += 2.0 * layers as f64 * ar;
        for i in 0..2 * layers {
            let next = if i + 1 == 2 * layers {
                0.0
            } else if i % 2 == 0 {
                mlp
            } else {
                attn
            };
            lad_exposed += (ar - next).max(0.0);
        }
        let mut step = fwd;
        if mode == "train" {
            // Backward (2x forward): the input-gradient all-reduce of each branch behind its
            // deferred weight-gradient GEMMs (half the branch's backward) in both models, and in
            // Ladder behind the other branch's backward too.
            for (own, other) in [(attn, mlp), (mlp, attn)] {
                std_exposed += layers as f64 * (ar - own).max(0.0);
                lad_exposed += layers as f64 * (ar - own - 2.0 * other).max(0.0);
            }
            step = 3.0 * fwd;
        }
        for (model, exposed) in [("llama", std_exposed), ("ladder", lad_exposed)] {
            println!(
                "{}",
                serde_json::json!({"model": model, "tp": 8, "mode": mode, "link": "modelled: 8x H100 SXM NVLink 4 (2 us/step, 360 GB/s per rank)",
                    "step_s": step + exposed, "exposed_comm_s": exposed, "tokens": tokens})
            );
        }
        println!(
            "{mode} (modelled, {} tokens): compute {:.2} ms, llama exposes {:.2} ms, ladder {:.2} ms; Ladder {:.2}x faster",
            tokens,
            step * 1e3,
            std_exposed * 1e3,
            lad_exposed * 1e3,
            (step + std_exposed) / (step + lad_exposed)
        );
    }
    let _ = o;
}

fn run(o: Opts) -> AnyResult<()> {
    if o.modelled_8gpu {
        modelled_8gpu(&o);
        return Ok(());
    }
    if o.tp < 2 || !o.hidden.is_multiple_of(64 * o.tp) {
        anyhow::bail!("--tp must be >= 2 and --hidden a multiple of 64 x tp");
    }
    if let Some(kv) = o.kv_heads {
        if !(o.hidden / 64).is_multiple_of(kv) || !kv.is_multiple_of(o.tp) {
            return Err(flag_error(format!(
                "--kv-heads {kv} must divide the {} query heads (--hidden / 64) and be a multiple of --tp {}",
                o.hidden / 64,
                o.tp
            )));
        }
    }
    if let Some(i) = o.intermediate {
        if !i.is_multiple_of(o.tp) {
            return Err(flag_error(format!("--intermediate {i} must be a multiple of --tp {}", o.tp)));
        }
    }
    let (std_cfg, lad_cfg) = (config(&o, false)?, config(&o, true)?);
    eprintln!(
        "bench_tp: tp {}, {} layers, hidden {}, heads {}/{}, intermediate {}, vocab {}, batch {} x seq {}, {} timed steps per row, {} threads available",
        o.tp,
        o.layers,
        o.hidden,
        std_cfg.num_attention_heads,
        std_cfg.num_key_value_heads,
        std_cfg.intermediate_size,
        std_cfg.vocab_size,
        o.batch_size,
        o.seq_len,
        o.steps,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    let alpha = 20e-6;
    let mut summary = Vec::new();
    for (mode, name) in [(Mode::Train, "train"), (Mode::Infer, "infer")] {
        // Calibrate the link on the standard model without one.
        let (t0, stats) = measure(&o, &std_cfg, mode, None)?;
        let per_step = (o.steps + 1) as f64;
        // Latency steps of a ring of tp ranks: an all-reduce two passes, the others one.
        let steps = (2 * stats.all_reduce.calls + stats.all_gather.calls + stats.reduce_scatter.calls + stats.broadcast.calls) as f64
            * (o.tp - 1) as f64
            / per_step;
        let bytes = stats.total_bytes() / per_step;
        let budget = o.comm_share * t0 - steps * alpha;
        if budget <= 0.0 {
            anyhow::bail!("{name}: {steps} latency steps of {alpha} s exceed the communication budget");
        }
        let link = Link::new(alpha, bytes / budget);
        let link_desc =
            format!("alpha {:.0} us, {:.1} MB/s ({:.0}% of the standard step)", alpha * 1e6, link.bytes_per_s / 1e6, o.comm_share * 100.0);
        // (model, link) in turn, `rounds` times; the fastest round of each.
        let configs = [(&std_cfg, None), (&lad_cfg, None), (&std_cfg, Some(link)), (&lad_cfg, Some(link))];
        let mut best = [f64::INFINITY; 4];
        for _ in 0..o.rounds {
            for (i, (cfg, l)) in configs.iter().enumerate() {
                best[i] = best[i].min(measure(&o, cfg, mode, *l)?.0);
            }
        }
        let [t0_std, t0_lad, t1_std, t1_lad] = best;
        for (model, t, exposed, l) in [
            ("llama", t0_std, 0.0, "none".to_string()),
            ("ladder", t0_lad, 0.0, "none".to_string()),
            ("llama", t1_std, t1_std - t0_std, link_desc.clone()),
            ("ladder", t1_lad, t1_lad - t0_lad, link_desc.clone()),
        ] {
            println!(
                "{}",
                serde_json::json!({"model": model, "tp": o.tp, "mode": name, "link": l, "step_s": t, "exposed_comm_s": exposed})
            );
        }
        let comm_s = steps * alpha + bytes / link.bytes_per_s;
        let (e_std, e_lad) = (t1_std - t0_std, t1_lad - t0_lad);
        summary.push(format!(
            "{name}: link time {comm_s:.3} s/step; exposed llama {e_std:.3} s, ladder {e_lad:.3} s; Ladder hides {:.0}% of what llama exposes; speedup behind the link {:.2}x",
            100.0 * (1.0 - e_lad / e_std),
            t1_std / t1_lad
        ));
    }
    for s in summary {
        println!("{s}");
    }
    Ok(())
}
