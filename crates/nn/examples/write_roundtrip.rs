//! Writes a random LLaMA checkpoint plus `roundtrip_ids.json` (ids, labels, and the loss
//! ferrolm computes from the checkpoint on disk) for `scripts/check_hf_roundtrip.py`:
//!
//!   cargo run -p ferrolm-nn --example write_roundtrip -- DIR [--tied] [--bf16] [--ladder-layers L]
//!   .venv/bin/python scripts/check_hf_roundtrip.py DIR
//!
//! Default: GQA (4 / 2 heads), untied head, llama3 rope. `--tied`: the "tiny" preset
//! shape with tied embeddings and plain rope. `--bf16`: weights stored as bf16.
//! `--ladder-layers`: a Ladder model (as `finetune_ladder`'s flag: N, i,j,k or all), which
//! transformers loads through the modelling code written beside it.
use clap::Parser;
use ferrolm_nn::{shift_labels, LadderLayers, Llama, LlamaConfig, RopeScaling};
use ferrolm_tensor::{DType, Device, Rng, Tensor};
use std::path::PathBuf;

/// Write a random LLaMA checkpoint and roundtrip_ids.json (token ids, labels and the loss ferrolm
/// computes from the checkpoint as stored) for scripts/check_hf_roundtrip.py, which checks that
/// transformers loads the checkpoint and gets the same loss.
#[derive(Parser)]
#[command(name = "write_roundtrip")]
struct Args {
    /// Output directory (created if needed)
    dir: PathBuf,
    /// The "tiny" preset shape with tied embeddings and plain rope [default: GQA 4/2 heads, untied, llama3 rope]
    #[arg(long)]
    tied: bool,
    /// Store the weights as bf16 [default: f32]
    #[arg(long)]
    bf16: bool,
    /// Make it a Ladder model: the last N layers, a list i,j,k, or all [default: a plain Llama]
    #[arg(long, value_name = "L")]
    ladder_layers: Option<String>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Args { dir, tied, bf16, ladder_layers } = Args::parse();

    let mut cfg = if tied {
        LlamaConfig { vocab_size: 320, initializer_range: 0.08, ..LlamaConfig::preset("tiny")? }
    } else {
        LlamaConfig {
            vocab_size: 200,
            hidden_size: 64,
            intermediate_size: 160,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16,
            },
            max_position_embeddings: 64,
            tie_word_embeddings: false,
            bos_token_id: Some(1),
            eos_token_id: vec![2, 3],
            initializer_range: 0.1,
            ladder_layers: None,
            family: ferrolm_nn::Family::Llama,
            attention_bias: false,
            mlp_bias: false,
            gemma: None,
            window: Default::default(),
        }
    };
    if let Some(l) = ladder_layers {
        cfg.ladder_layers = Some(LadderLayers::parse_flag(&l, cfg.num_hidden_layers)?);
    }
    let mut rng = Rng::new(1234);
    let model = Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut rng)?;
    // Norm weights away from 1 so a swapped or dropped norm would show in the loss.
    for (name, p) in model.parameters() {
        if name.ends_with("norm.weight") {
            p.assign(&Tensor::randn(p.dims().to_vec(), 0.2, DType::F32, Device::Cpu, &mut rng)?.add_scalar(1.0)?)?;
        }
    }
    if bf16 {
        model.save_pretrained_dtype(&dir, DType::BF16)?;
    } else {
        model.save_pretrained(&dir)?;
    }

    // The loss of the checkpoint as stored (bf16 rounding included), HF label convention.
    let stored = Llama::from_pretrained(&dir, DType::F32, Device::Cpu)?;
    let (b, t) = (3, 40);
    let ids: Vec<i32> = (0..b * t).map(|_| rng.below(cfg.vocab_size as u64) as i32).collect();
    let mut labels = ids.clone();
    labels[5] = -100;
    labels[t + 17] = -100;
    let inputs = Tensor::from_vec(ids.clone(), vec![b, t], Device::Cpu)?;
    let targets = Tensor::from_vec(shift_labels(&labels, t), vec![b, t], Device::Cpu)?;
    let loss = {
        let _g = ferrolm_tensor::no_grad();
        stored.loss(&inputs, &targets)?.item()?
    };
    let rows = |v: &[i32]| v.chunks(t).map(|r| r.to_vec()).collect::<Vec<_>>();
    let json = serde_json::json!({"input_ids": rows(&ids), "labels": rows(&labels), "loss": loss});
    ferrolm_nn::safetensors_io::write_atomic(&dir.join("roundtrip_ids.json"), json.to_string().as_bytes())?;
    println!("wrote {} ({} parameters, {}), ferrolm loss {loss:.8}", dir.display(), model.num_params(), if bf16 { "bf16" } else { "f32" });
    Ok(())
}
