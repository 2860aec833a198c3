#!/usr/bin/env python3
"""PyTorch fine-tuning speed of a Llama, the reference for finetune's and dpo's tokens/s and peak memory.

Plain torch and transformers only (no peft, trl or bitsandbytes needed, except for --mode qlora):
transformers' LlamaForCausalLM with SDPA attention on the same config.json as ours, random token
batches (never zeros), warm-up steps first, then the median of timed steps (after
torch.cuda.synchronize). One mode a process, so a failed mode never takes the others with it:

  full   every weight trained: fp32 weights under bf16 autocast, AdamW (fused on CUDA), as
         bench_train_torch.py's eager step
  lora   the base frozen in bf16 (no gradient, no optimizer state), rank-R adapters A (R x in) and
         B (out x R) in fp32 on q, k, v, o, gate, up and down (finetune's default targets),
         output scaled by alpha / R (alpha 2R, finetune's default), A drawn as PEFT draws it
         (Kaiming uniform), B zero; AdamW on the adapters only
  qlora  lora with the base's seven projections held 4-bit nf4 by bitsandbytes (Linear4bit,
         blocks of 64, double quantization, bf16 compute); needs `import bitsandbytes`, else the
         run prints {"skipped": ...} and exits 3
  dpo    DPO (sigmoid loss, beta 0.1) with lora's policy; the reference is the same base with the
         adapters off, under no_grad. --batch-size pairs a step, each pair a chosen and a rejected
         sequence of --seq-len tokens sharing a --prompt-len prompt, forwarded together (2 x batch
         rows, as TRL concatenates them); the log-probabilities sum over completion tokens.
         Tokens a step: 2 x batch x seq_len

    python3 scripts/bench_finetune_torch.py --config config.json --mode lora [--json out.json]
    python3 scripts/bench_finetune_torch.py --device cpu --mode dpo --batch-size 1 --seq-len 16   (a rehearsal)

--config takes a Hugging Face config.json (default: a tiny 2-layer Llama); one JSON object goes
to stdout (and, with --json, to that file): tokens_per_s, step_s_median, peak_mib (CUDA's
max_memory_allocated; null on the CPU), params and trainable parameters.
"""
import argparse
import json
import math
import os
import sys

from torch_timing import time_steps

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=4096, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=False)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SKIPPED = 3


def emit(r, path):
    print(json.dumps(r), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(r, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a Hugging Face config.json [default: a tiny 2-layer Llama]")
    ap.add_argument("--mode", choices=["full", "lora", "qlora", "dpo"], default="lora")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences a step (dpo: pairs a step) [default: 8]")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens a sequence [default: 1024]")
    ap.add_argument("--prompt-len", type=int, default=32, help="dpo: prompt tokens of each sequence [default: 32]")
    ap.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank R [default: 16]")
    ap.add_argument("--beta", type=float, default=0.1, help="dpo: beta [default: 0.1]")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported) [default: 10]")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first [default: 3]")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (cpu: a rehearsal, not a benchmark) [default: cuda]")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    for flag in ("batch_size", "seq_len", "steps", "lora_rank"):
        if getattr(a, flag) < 1:
            sys.exit(f"--{flag.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        sys.exit("--warmup must be >= 0")
    if a.mode == "dpo" and not 1 <= a.prompt_len < a.seq_len:
        sys.exit(f"--prompt-len {a.prompt_len} must be at least 1 and below --seq-len {a.seq_len}")

    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        sys.exit(1 if os.environ.get("FERROLM_REQUIRE_GPU") == "1" else 0)
    bnb = None
    if a.mode == "qlora":
        try:
            import bitsandbytes as bnb
        except Exception as e:  # noqa: BLE001 - any import failure means the same: no QLoRA here
            emit({"framework": "pytorch", "mode": a.mode, "skipped": f"bitsandbytes does not import: {e}"}, a.json)
            sys.exit(SKIPPED)
    dev = torch.device(a.device)
    if a.config:
        try:
            with open(a.config) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"--config {a.config!r}: not a readable config.json: {e}")
    else:
        d = dict(TINY)
    cfg = LlamaConfig(**d)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1337)
    with dev:  # initialized on the device: a 1B model's CPU init costs a short GPU lease seconds
        model = LlamaForCausalLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())

    class LoRA(torch.nn.Module):
        """A frozen linear layer (bf16, or bitsandbytes' 4-bit) plus scale * B(A(x)) in fp32."""

        def __init__(self, base, r):
            super().__init__()
            self.base = base
            self.enabled = True
            fin, fout = base.in_features, base.out_features
            self.a = torch.nn.Parameter(torch.empty(r, fin, device=dev))
            self.b = torch.nn.Parameter(torch.zeros(fout, r, device=dev))
            torch.nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))
            self.scale = (2.0 * r) / r  # alpha (2R, the default) over R

        def forward(self, x):
            y = self.base(x)
            if not self.enabled:
                return y
            return y + (x.to(self.a.dtype) @ self.a.t() @ self.b.t() * self.scale).to(y.dtype)

    adapters = []
    if a.mode in ("lora", "qlora", "dpo"):
        model.to(torch.bfloat16)
        model.requires_grad_(False)
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name in TARGETS:
                    lin = getattr(parent, name, None)
                    if lin is None:
                        continue
                    if bnb is not None:
                        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.bfloat16,
                                              compress_statistics=True, quant_type="nf4")
                        q.weight = bnb.nn.Params4bit(lin.weight.data.cpu(), requires_grad=False, compress_statistics=True,
                                                     quant_type="nf4", blocksize=64)
                        lin = q.to(dev)
                    m = LoRA(lin, a.lora_rank)
                    setattr(parent, name, m)
                    adapters.append(m)
        params = [p for m in adapters for p in (m.a, m.b)]
    else:
        params = list(model.parameters())
    trainable = sum(p.numel() for p in params)
    # The projections whose base weight is held 4-bit (bitsandbytes packs nf4 into uint8).
    four_bit = sum(1 for m in adapters if m.base.weight.dtype == torch.uint8)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0 if adapters else 0.1, fused=dev.type == "cuda")

    def batch(rows):
        return torch.randint(1, cfg.vocab_size, (rows, a.seq_len + 1), device=dev)

    def lm_step():
        x = batch(a.batch_size)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=x[:, :-1], labels=x[:, 1:].contiguous()).loss
        return loss

    def seq_logps(logits, ids, mask):
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return (lp * mask[:, 1:]).sum(-1)

    def set_adapters(on):
        for m in adapters:
            m.enabled = on

    def dpo_step():
        # Chosen rows, then rejected rows, each pair's two sharing the prompt.
        x = batch(2 * a.batch_size)[:, :-1].contiguous()
        x[a.batch_size:, : a.prompt_len] = x[: a.batch_size, : a.prompt_len]
        mask = torch.zeros_like(x, dtype=torch.float32)
        mask[:, a.prompt_len:] = 1.0
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
            set_adapters(False)
            ref = seq_logps(model(input_ids=x).logits, x, mask)
            set_adapters(True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            pol = seq_logps(model(input_ids=x).logits, x, mask)
        n = a.batch_size
        margin = (pol[:n] - ref[:n]) - (pol[n:] - ref[n:])
        return -F.logsigmoid(a.beta * margin).mean()

    def step():
        loss = dpo_step() if a.mode == "dpo" else lm_step()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    dt, _, loss = time_steps(step, dev, a.warmup, a.steps)
    tokens = (2 if a.mode == "dpo" else 1) * a.batch_size * a.seq_len
    emit({
        "framework": "pytorch", "mode": a.mode, "params": n_params, "trainable_params": trainable,
        "lora_rank": a.lora_rank if adapters else None, "batch_size": a.batch_size, "seq_len": a.seq_len,
        "tokens_per_step": tokens, "base_4bit_layers": four_bit, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "step_s_median": dt, "tokens_per_s": tokens / dt,
        "peak_mib": torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None,
        "final_loss": loss.item(),
    }, a.json)


if __name__ == "__main__":
    main()
