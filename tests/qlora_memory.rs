//! QLoRA's memory on the CUDA emulator (a GPU when there is one): one bf16 training step of
//! LoRA over the 4-bit base peaks below the same step over the bf16 base by at least the base
//! weights' saving (their bf16 bytes less their 4-bit codes and scales), less the scratch a
//! 4-bit layer dequantizes into for its GEMM (one weight at a time). Peaks are the
//! `peak_tensor_mib` the trainer logs, as tests/memory_estimator.rs measures them.
mod common;
use common::*;
use ferrolm::nn::{Llama, LlamaConfig, LoraConfig, Proj};
use ferrolm::train::{TrainOptions, Trainer};
use ferrolm::{DType, Device};
use ferrolm_ops::nf4::QuantSpec;
use ferrolm_tensor::{live_bytes, reset_peak_bytes, Rng};
use std::path::Path;

const MIB: f64 = 1048576.0;

/// The measured peak of one LoRA step (rank 8, every projection) over the checkpoint `ck`
/// loaded in bf16, its linear weights 4-bit when `quant`; with the bytes the 4-bit weights take.
fn step_peak(d: &Data, ck: &Path, quant: bool, device: Device) -> (f64, usize) {
    let o = TrainOptions { steps: 1, batch_size: 1, seq_len: 32, eval_every: 0, save_every: 0, ..opts(1) };
    let out = d.dir.join(if quant { "qlora" } else { "lora" });
    let before = live_bytes();
    let mut model = if quant {
        Llama::from_pretrained_quantized(ck, DType::BF16, device, QuantSpec::QLORA).unwrap()
    } else {
        Llama::from_pretrained(ck, DType::BF16, device).unwrap()
    };
    let q_bytes = model.quant_base().map_or(0, |q| q.bytes);
    model.add_lora(&LoraConfig::new(8, None, 0.0, Proj::ALL.to_vec(), false).unwrap(), &mut Rng::new(2)).unwrap();
    let engine = ferrolm::parallel::attach(&mut model, None, &ferrolm::parallel::Parallelism::single(), Trainer::adamw_config(&o)).unwrap();
    let mut t = Trainer::with_engine(model, Box::new(engine), &d.train, &d.val, o, &out).unwrap();
    reset_peak_bytes();
    t.run().unwrap();
    drop(t);
    let logged = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let peak = logged
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get("peak_tensor_mib")?.as_f64())
        .fold(0.0, f64::max);
    assert!(peak > 0.0, "no peak_tensor_mib in metrics.jsonl:\n{logged}");
    (peak * MIB - before as f64, q_bytes)
}

#[test]
fn a_qlora_step_peaks_below_the_lora_step_by_the_base_weights_saving() {
    let Some(gpu) = cuda0_device() else { return };
    let d = data("qlora-mem");
    let cfg = LlamaConfig::preset("tiny").unwrap().with_vocab_size(d.vocab);
    let ck = d.dir.join("model");
    Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap().save_pretrained(&ck).unwrap();
    let (lora, _) = step_peak(&d, &ck, false, gpu);
    let (qlora, q_bytes) = step_peak(&d, &ck, true, gpu);
    let linears: Vec<usize> = ferrolm::nn::qlora::linear_weights(&cfg).values().map(|s| s.iter().product::<usize>()).collect::<Vec<_>>();
    let params: usize = linears.iter().sum();
    let saving = 2.0 * params as f64 - q_bytes as f64;
    let scratch = 2.0 * *linears.iter().max().unwrap() as f64; // one dequantized bf16 weight
    println!(
        "{gpu}: LoRA step peak {:.3} MiB, QLoRA {:.3} MiB: {:.3} MiB lower; the {params} base weights save {:.3} MiB \
         ({:.3} bits a parameter), the scratch holds {:.3} MiB",
        lora / MIB,
        qlora / MIB,
        (lora - qlora) / MIB,
        saving / MIB,
        8.0 * q_bytes as f64 / params as f64,
        scratch / MIB
    );
    assert!(
        lora - qlora >= saving - scratch,
        "QLoRA's peak {qlora} is not below LoRA's {lora} by the saving {saving} less the scratch {scratch}"
    );
    let _ = std::fs::remove_dir_all(&d.dir);
}
