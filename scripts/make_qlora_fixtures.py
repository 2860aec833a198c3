#!/usr/bin/env python3
"""Generate the QLoRA fixtures: a tiny Llama loaded 4-bit by transformers + bitsandbytes (NF4,
double quantization) with a PEFT LoRA adapter, its loss and the gradients of every A and B, run
on the CPU by bitsandbytes' own Linear4bit forward and backward. Checks ferrolm's QLoRA base
(crates/nn/src/qlora.rs) against the real stack. Writes under tests/fixtures/qlora/:

  base/                    the f32 base (config.json, model.safetensors): hidden 64,
                           intermediate 128, 4 heads over 2 key/value heads, 2 layers, vocab 96
  adapter/                 the PEFT adapter (rank 4, alpha 8, every linear layer, A and B both
                           random: init_lora_weights=False), as PEFT saves it
  base_4bit/               the 4-bit base as transformers saves it (quantization_config, the
                           packed weights and their quant states)
  reference.safetensors    input_ids, labels, loss (the 4-bit base with the adapter) and
                           `grad.<adapter tensor name>` for every A and B
  trained/                 an adapter ferrolm trained over the 4-bit base (written by
                           crates/nn/tests/qlora.rs with FERROLM_WRITE_FIXTURES=1), and
                           peft_reference.safetensors: the loss PEFT computes with it over the
                           4-bit base, on the same batch (written here when trained/ exists)

Shapes: every linear layer's in_features is a multiple of 64. bitsandbytes 0.50's CPU forward of
Linear4bit (its AVX-512 dequantization) indexes the absmax per row when a row's length is a
multiple of 16 but not of 64 (tests/fixtures/llama_gqa_untied's down_proj, 96 wide): it fails or
gives other values there, so this fixture avoids such rows (scripts/make_nf4_fixtures.py covers
them with a flat dequantization).

The model runs in training mode (see `run`): bitsandbytes' eval-mode CPU path repacks weights for
a bf16 GEMM, which is not the f32 dequantize-then-GEMM a QLoRA training step computes.

Usage (environment: scripts/requirements-fixtures.txt, plus bitsandbytes==0.50.2):

    .venv/bin/python scripts/make_qlora_fixtures.py           # regenerate, then verify
    .venv/bin/python scripts/make_qlora_fixtures.py --check   # only verify the committed fixtures
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "qlora"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_base() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.05)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # norms away from 1, so a wrong norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    dst = OUT / "base"
    if dst.exists():
        shutil.rmtree(dst)
    model.save_pretrained(dst)


def load_4bit(path: Path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=q, device_map="cpu", dtype=torch.float32)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that is not trained
    return ids, labels


def run(model, adapter: Path | None) -> dict[str, torch.Tensor]:
    """The loss of the 4-bit model with the adapter and every factor's gradient."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter is None:
        torch.manual_seed(2)
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
        pm = get_peft_model(model, cfg)
    else:
        pm = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    # Training mode, as a QLoRA run is: in eval mode bitsandbytes 0.50's CPU Linear4bit repacks
    # a weight whose input needs no gradient (layer 0's q/k/v, fed by the frozen embedding) for
    # its AVX-512 bf16 GEMM, in place, and computes those layers in bf16 (the loss then differs
    # by 1e-4 and the gradients by 1e-2 from the f32 dequantize-then-GEMM every other layer runs).
    pm.train()
    ids, labels = batch()
    out = pm(input_ids=ids, labels=labels)
    out.loss.backward()
    res = {"input_ids": ids.to(torch.int32), "labels": labels.to(torch.int32), "loss": out.loss.detach().float().reshape(())}
    for n, p in pm.named_parameters():
        if p.requires_grad:
            saved = n.replace(".default.weight", ".weight")
            res[f"grad.{saved}"] = p.grad.detach().float().contiguous()
    return res, pm


def write() -> None:
    write_base()
    model = load_4bit(OUT / "base")
    for d in ["base_4bit", "adapter"]:
        if (OUT / d).exists():
            shutil.rmtree(OUT / d)
    model.save_pretrained(OUT / "base_4bit")
    from safetensors.torch import save_file

    ref, pm = run(model, None)
    pm.save_pretrained(OUT / "adapter")
    (OUT / "adapter" / "README.md").unlink(missing_ok=True)  # PEFT's model card template
    save_file(ref, OUT / "reference.safetensors")


def write_trained_reference() -> None:
    """PEFT's loss with ferrolm's trained adapter (trained/) over the 4-bit base."""
    from safetensors.torch import save_file

    trained = OUT / "trained"
    if not (trained / "adapter_config.json").is_file():
        print(f"no {trained}: run FERROLM_WRITE_FIXTURES=1 cargo test -p ferrolm-nn --test qlora first")
        return
    res, _ = run(load_4bit(OUT / "base"), trained)
    save_file({"loss": res["loss"]}, trained / "peft_reference.safetensors")
    print(f"PEFT loss with ferrolm's trained adapter: {res['loss'].item():.6f}")


def check() -> None:
    """Reload the committed 4-bit base and adapter (as a user would) and recompute."""
    import json

    import bitsandbytes as bnb
    from safetensors.torch import load_file

    ref = load_file(OUT / "reference.safetensors")
    model = load_4bit(OUT / "base")
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 14
    again, _ = run(model, OUT / "adapter")
    for k, v in again.items():
        assert torch.allclose(v, ref[k], rtol=1e-6, atol=1e-8), f"{k} differs"
    cfg = json.loads((OUT / "base_4bit" / "config.json").read_text())
    assert cfg["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    n = sum(k.startswith("grad.") for k in ref)
    print(f"ok: loss {ref['loss'].item():.6f}, {n} adapter gradients")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only verify the committed fixtures (default: regenerate, then verify)")
    args = ap.parse_args()
    if not args.check:
        write()
        write_trained_reference()
    check()


if __name__ == "__main__":
    sys.exit(main())
