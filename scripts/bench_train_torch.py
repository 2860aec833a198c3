#!/usr/bin/env python3
"""PyTorch training speed of a Llama, the reference for pretrain_llama's tokens/s, MFU and peak memory.

transformers' LlamaForCausalLM with SDPA attention, fp32 weights under bf16 autocast, AdamW
(fused on CUDA), eager and torch.compile. Random token batches (never zeros); warm-up steps first,
then the median of timed steps (after torch.cuda.synchronize). torch.compile compiles during the
warm-up steps, so the timed steps exclude it; `compile_s` reports it separately: the warm-up's
wall time less that many median steps (for eager, the same difference: allocator and cuBLAS
warm-up). MFU counts the same FLOPs per token
as pretrain_llama: 6 * parameters + 12 * layers * seq_len * heads * head_dim, over
FERROLM_PEAK_TFLOPS (default 989, H100 SXM bf16 dense).

    python3 scripts/bench_train_torch.py --shape 350m [--mode both] [--json out.json]
    python3 scripts/bench_train_torch.py --device cpu --shape tiny --steps 3   (a rehearsal)

--shape takes a preset (tiny, 124m, 350m, 1b) or a Hugging Face config.json; one JSON object per
mode goes to stdout (and, with --json, to that file as a list).
"""
import argparse
import json
import os
import sys

from torch_timing import time_steps

# Hidden, intermediate, layers, heads: GPT-2-small-, -medium- and 1B-class Llama shapes.
SHAPES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
    "124m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12),
    "350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32),
}


def config_dict(shape, vocab):
    if shape in SHAPES:
        d = dict(SHAPES[shape])
        d.update(vocab_size=vocab, num_key_value_heads=d["num_attention_heads"], max_position_embeddings=4096,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
        return d
    try:
        with open(shape) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"--shape {shape!r}: neither a preset ({', '.join(SHAPES)}) nor a readable config.json: {e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="124m", help="tiny, 124m, 350m, 1b, or a config.json path")
    ap.add_argument("--vocab", type=int, default=32000, help="vocab size for a preset shape")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mode", choices=["eager", "compile", "both"], default="both")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (cpu: a rehearsal, not a benchmark)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile's backend (inductor, the benchmark; eager: a quick rehearsal of the path)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    for flag in ("batch_size", "seq_len", "steps"):
        if getattr(a, flag) < 1:
            sys.exit(f"--{flag.replace('_', '-')} must be >= 1")
    if a.mode != "eager" and a.warmup < 1:
        sys.exit("--warmup must be >= 1 with torch.compile: it compiles in the first step, which must not be timed")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        sys.exit(1 if os.environ.get("FERROLM_REQUIRE_GPU") == "1" else 0)
    dev = torch.device(a.device)
    cfg = LlamaConfig(**config_dict(a.shape, a.vocab))
    cfg._attn_implementation = "sdpa"
    peak = float(os.environ.get("FERROLM_PEAK_TFLOPS", "989")) * 1e12
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    results = []
    for mode in (["eager", "compile"] if a.mode == "both" else [a.mode]):
        torch.manual_seed(1337)
        with dev:  # initialized on the device: a 1B model's CPU init costs a short GPU lease seconds
            model = LlamaForCausalLM(cfg).to(dev)
        n_params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=dev.type == "cuda")
        fwd = torch.compile(model, backend=a.compile_backend) if mode == "compile" else model

        def step():
            x = torch.randint(1, cfg.vocab_size, (a.batch_size, a.seq_len + 1), device=dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = fwd(input_ids=x[:, :-1], labels=x[:, 1:].contiguous()).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        dt, warmup_s, loss = time_steps(step, dev, a.warmup, a.steps)
        tok_s = a.batch_size * a.seq_len / dt
        per_token = 6.0 * n_params + 12.0 * cfg.num_hidden_layers * a.seq_len * cfg.num_attention_heads * head_dim
        r = {
            "framework": "pytorch", "mode": mode, "shape": a.shape, "params": n_params,
            "batch_size": a.batch_size, "seq_len": a.seq_len, "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "step_s_median": dt, "tokens_per_s": tok_s,
            "warmup_steps": a.warmup, "warmup_s": warmup_s, "compile_s": max(0.0, warmup_s - a.warmup * dt),
            "compile_backend": a.compile_backend if mode == "compile" else None,
            "mfu": per_token * tok_s / peak if dev.type == "cuda" else None,
            "peak_mib": torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None,
            "final_loss": loss.item(),
        }
        print(json.dumps(r), flush=True)
        results.append(r)
        del model, opt, fwd
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
