#!/usr/bin/env python3
"""Generate the 4-bit (NF4 / FP4, double quantization) fixtures with bitsandbytes on the CPU, for
checking ferrolm's format (crates/ops/src/nf4) and its reader of bitsandbytes checkpoints
(crates/nn/src/bnb4.rs) bit for bit. Writes under tests/fixtures/nf4/:

  format.json              the cases: name, shape, dtype, quant_type, blocksize, double_quant
  format.safetensors       per case `<case>.<part>`: input (the weight, f32 or bf16), packed
                           (uint8, as quantize_4bit returns it), absmax (uint8 codes when nested,
                           else f32), nested_absmax (f32), offset (f32, shape [1]), quant_map (the
                           16 levels), nested_quant_map (the dynamic map) and dequant
                           (dequantize_4bit's output, in the input's dtype)
  tiny_llama_4bit/         tests/fixtures/llama_gqa_untied (f32) loaded by transformers with
                           BitsAndBytesConfig(load_in_4bit, nf4, double quant) and written back by
                           save_pretrained: config.json with `quantization_config`, the linear
                           layers as `weight` (packed uint8), `weight.absmax`, `weight.quant_map`,
                           `weight.nested_absmax`, `weight.nested_quant_map` and
                           `weight.quant_state.bitsandbytes__nf4` (a JSON blob in uint8)
  tiny_llama_4bit_reference.safetensors
                           `dequant.<weight name>`: bitsandbytes' dequantize_4bit of each 4-bit
                           weight of the reloaded checkpoint; input_ids and labels (the base
                           fixture's), logits and loss of the 4-bit model on them (the f32 base
                           with every 4-bit weight replaced by its dequantization)

The cases cover a block of zeros, a constant block, an odd length (a partial last block and a
padded nibble), shapes whose size is not a multiple of 64 x 256 (several nested blocks, the last
partial), f32 and bf16 inputs, FP4, and NF4 without double quantization.

bitsandbytes quantizes on the CPU with torch ops (quantize_4bit's default kernel) and its C
library (the nested 8-bit codes, the dequantization); the offset is torch's f32 mean. Row lengths
are kept to multiples of 64, odd, or not multiples of 16: bitsandbytes 0.50's AVX-512
dequantization indexes blocks per row when a row is a multiple of 16 but not of 64 (its quantizer
and CUDA kernels use flat blocks, as ferrolm does).

Usage (environment: scripts/requirements-fixtures.txt, plus bitsandbytes==0.50.2):

    .venv/bin/python scripts/make_nf4_fixtures.py           # regenerate, then verify
    .venv/bin/python scripts/make_nf4_fixtures.py --check   # only verify the committed fixtures
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "nf4"
BASE = ROOT / "tests" / "fixtures" / "llama_gqa_untied"


def cases() -> list[dict]:
    """(name, shape, dtype, quant_type, blocksize, double_quant, the weight)."""
    g = torch.Generator().manual_seed(53)

    def normal(shape, std=0.02):
        return torch.randn(shape, generator=g) * std

    out = []

    def add(name, w, dtype, quant_type="nf4", double_quant=True, blocksize=64):
        out.append(dict(name=name, shape=list(w.shape), dtype=dtype, quant_type=quant_type, blocksize=blocksize,
                        double_quant=double_quant, w=w.to(getattr(torch, dtype))))

    # (64, 128): 128 blocks (one nested block); block 1 zeros, block 2 constant, an outlier.
    w = normal((64, 128))
    w.view(-1)[64:128] = 0.0
    w.view(-1)[128:192] = 0.037
    w[5, 7] = 0.4
    add("f32_zero_const", w, "float32")
    # (150, 130) bf16: 19500 values, 305 blocks (the last of 44), 2 nested blocks (the last of 49).
    w = normal((150, 130))
    w.view(-1)[640:704] = 0.0
    w.view(-1)[1280:1344] = -0.011
    add("bf16_two_nested", w, "bfloat16")
    # (7, 13): 91 values, an odd count (a padded nibble), a partial block.
    add("f32_odd", normal((7, 13), 1.0), "float32")
    # (1001,) bf16, 1-D and odd.
    add("bf16_odd_1d", normal((1001,), 0.5), "bfloat16")
    # (200, 192) bf16: 38400 values, 600 blocks, 3 nested blocks (the last of 88), scales spread wide.
    w = normal((200, 192)) * torch.linspace(0.1, 3.0, 200).unsqueeze(1)
    add("bf16_three_nested", w, "bfloat16")
    # FP4 with double quantization; NF4 without it.
    add("fp4_f32", normal((33, 64), 1.0), "float32", quant_type="fp4")
    add("nf4_plain_bf16", normal((30, 128)), "bfloat16", double_quant=False)
    return out


def quantize_case(c: dict) -> dict[str, torch.Tensor]:
    import bitsandbytes.functional as F

    q, st = F.quantize_4bit(c["w"], blocksize=c["blocksize"], quant_type=c["quant_type"],
                            compress_statistics=c["double_quant"])
    deq = F.dequantize_4bit(q, st)
    assert deq.dtype == c["w"].dtype and list(deq.shape) == c["shape"]
    t = {"input": c["w"], "packed": q.reshape(-1).contiguous(), "dequant": deq.contiguous(),
         "quant_map": st.code.float()}
    if st.nested:
        t.update(absmax=st.absmax, nested_absmax=st.state2.absmax, nested_quant_map=st.state2.code,
                 offset=st.offset.reshape(1).float())
    else:
        t["absmax"] = st.absmax.float()
    return {f"{c['name']}.{k}": v.contiguous() for k, v in t.items()}


def write_format() -> None:
    from safetensors.torch import save_file

    OUT.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = []
    for c in cases():
        tensors.update(quantize_case(c))
        meta.append({k: v for k, v in c.items() if k != "w"})
    save_file(tensors, OUT / "format.safetensors")
    (OUT / "format.json").write_text(json.dumps({"bitsandbytes": bnb_version(), "cases": meta}, indent=2) + "\n")


def bnb_version() -> str:
    import bitsandbytes

    return bitsandbytes.__version__


def load_4bit(path: Path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg, device_map="cpu", dtype=torch.float32)


def dequantize_flat(packed: torch.Tensor, state) -> torch.Tensor:
    """dequantize_4bit over the flattened weight, reshaped: the blocks bitsandbytes quantized and
    its CUDA kernel dequantizes. (On an AVX-512 CPU, bitsandbytes 0.50 indexes the absmax per row
    when a row is a multiple of 16 but not of the block size: down_proj's (64, 96).)"""
    import copy

    import bitsandbytes.functional as F

    flat = copy.copy(state)
    flat.shape = torch.Size([state.shape.numel()])
    return F.dequantize_4bit(packed, flat).reshape(state.shape).contiguous()


def reference(model) -> dict[str, torch.Tensor]:
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref = load_file(BASE / "reference.safetensors")
    out = {"input_ids": ref["input_ids"], "labels": ref["labels"]}
    for name, mod in model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            out[f"dequant.{name}.weight"] = dequantize_flat(mod.weight.data, mod.weight.quant_state)
    # bitsandbytes 0.50's CPU forward of Linear4bit refuses in_features that are not a multiple
    # of the block size (down_proj's 96): the 4-bit model's logits are the f32 base with each
    # linear weight replaced by its dequantization, which is what Linear4bit computes.
    base = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    with torch.no_grad():
        for name, mod in base.named_modules():
            if f"dequant.{name}.weight" in out:
                mod.weight.copy_(out[f"dequant.{name}.weight"])
        r = base(input_ids=ref["input_ids"], labels=ref["labels"])
    out["logits"] = r.logits.float().contiguous()
    out["loss"] = r.loss.float().reshape(())
    return out


def write_checkpoint() -> None:
    from safetensors.torch import save_file

    dst = OUT / "tiny_llama_4bit"
    if dst.exists():
        shutil.rmtree(dst)
    model = load_4bit(BASE)
    model.save_pretrained(dst)
    # Reload what was written: the reference is the saved checkpoint's, as a user would load it.
    model = reload_4bit(dst)
    save_file(reference(model), OUT / "tiny_llama_4bit_reference.safetensors")


def reload_4bit(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=torch.float32)


def check() -> None:
    from safetensors.torch import load_file

    meta = json.loads((OUT / "format.json").read_text())
    stored = load_file(OUT / "format.safetensors")
    fresh: dict[str, torch.Tensor] = {}
    for c in cases():
        fresh.update(quantize_case(c))
    assert sorted(fresh) == sorted(stored), "format.safetensors' tensors differ from the cases"
    for k, v in fresh.items():
        assert torch.equal(v, stored[k]), f"{k} differs"
    names = [c["name"] for c in meta["cases"]]
    # The fixtures hold what they claim: zeros, a constant block, partial blocks, several nested blocks.
    assert (stored["f32_zero_const.absmax"].numel() == 128 and stored["f32_zero_const.input"].view(-1)[64:128].abs().max() == 0)
    assert stored["bf16_two_nested.nested_absmax"].numel() == 2 and 19500 % 64 != 0
    assert stored["bf16_three_nested.nested_absmax"].numel() == 3
    assert stored["f32_odd.packed"].numel() == 46
    ref = load_file(OUT / "tiny_llama_4bit_reference.safetensors")
    model = reload_4bit(OUT / "tiny_llama_4bit")
    again = reference(model)
    for k, v in again.items():
        assert torch.equal(v, ref[k]), f"tiny_llama_4bit_reference: {k} differs"
    cfg = json.loads((OUT / "tiny_llama_4bit" / "config.json").read_text())
    assert cfg["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    print(f"ok: {len(names)} format cases, {sum(k.startswith('dequant.') for k in ref)} 4-bit weights, "
          f"loss {ref['loss'].item():.6f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only verify the committed fixtures (default: regenerate, then verify)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if not args.check:
        write_format()
        write_checkpoint()
    check()


if __name__ == "__main__":
    sys.exit(main())
