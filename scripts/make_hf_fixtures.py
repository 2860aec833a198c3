#!/usr/bin/env python3
"""Generate tiny random Hugging Face Llama fixtures for checking ferrolm against `transformers`.

For every fixture NAME this writes, under tests/fixtures/NAME/:

  config.json             exactly as `LlamaForCausalLM.save_pretrained` writes it
  generation_config.json  also written by save_pretrained (kept as-is; ferrolm may ignore it)
  model.safetensors       f32 weights with transformers' tensor names, as save_pretrained
                          writes them (tied models have no `lm_head.weight`)
  reference.safetensors   input_ids, labels, logits, loss, num_label_tokens and
                          grad.<param name> for every entry of model.named_parameters()

and, from the generated configs, legacy-style (transformers 4.x: `rope_theta` + `rope_scaling`)
variants under tests/fixtures/config_variants/. See tests/fixtures/README.md for the conventions.

Setup (the exact environment used to produce the committed fixtures; CPU is enough):

    python3 -m venv .venv
    .venv/bin/pip install -r scripts/requirements-fixtures.txt
    # = torch==2.15.0 transformers==5.23.0 safetensors==0.8.0 numpy==2.4.6
    # (PyPI has no CPU-only Linux torch wheel; the default wheel pulls ~5 GB of nvidia-*
    #  packages, which are harmless on a machine without a GPU.)

Usage:

    .venv/bin/python scripts/make_hf_fixtures.py            # regenerate all, then verify
    .venv/bin/python scripts/make_hf_fixtures.py --check    # only verify committed fixtures
    .venv/bin/python scripts/make_hf_fixtures.py --only llama3_rope

Verification reloads each fixture with `LlamaForCausalLM.from_pretrained`, recomputes logits,
loss (both via transformers and by hand with the documented label shift) and all gradients from
the saved files, and checks that the legacy config variants load to the same model.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures"
IGNORE = -100

# Sizes keep these fixtures under 2 MB (about 1.6 MB).
# Each fixture: LlamaConfig kwargs + batch/seq/seed/init std.
# Rope settings are passed in the current (transformers >= 5) style `rope_parameters`.
DEFAULT_ROPE = dict(rope_type="default", rope_theta=10000.0)


def llama_config(vocab, hidden, ffn, layers, heads, kv, eps, tied, rope=None, **extra) -> dict:
    """LlamaConfig kwargs of a fixture (rope in the transformers >= 5 `rope_parameters` style)."""
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, **extra,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=64, rms_norm_eps=eps, tie_word_embeddings=tied,
        rope_parameters=rope or DEFAULT_ROPE,
    )


FIXTURES: dict[str, dict] = {
    "llama_gqa_untied": dict(
        config=llama_config(96, 64, 96, 2, 4, 2, 1e-5, False),
        batch=2, seq=16, seed=1, std=0.02,
    ),
    "llama_mha_tied": dict(
        config=llama_config(96, 32, 96, 2, 4, 4, 1e-6, True),
        batch=2, seq=12, seed=2, std=0.02,
    ),
    # head_dim 32 and original_max_position_embeddings 32 make the three llama3 regimes all
    # occur: wavelengths 2*pi*theta^(2i/32) = 6.3 (< 32/4: kept), 14.3 (smoothed), 32.5.. (/8).
    "llama3_rope": dict(
        config=llama_config(96, 64, 64, 2, 2, 1, 1e-5, False, rope=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32,
        )),
        batch=2, seq=32, seed=3, std=0.1,
    ),
    "llama_headdim": dict(
        config=llama_config(64, 32, 64, 2, 4, 2, 1e-5, False, head_dim=16),
        batch=2, seq=8, seed=4, std=0.05,
    ),
}

# Legacy (transformers 4.x style) config variants: variant file name -> (source fixture,
# drop "head_dim"). Older checkpoints (e.g. Llama 2) have no head_dim key at all: the loader
# must then use hidden_size / num_attention_heads (16 for llama_gqa_untied).
LEGACY_VARIANTS = {
    "llama3_rope.legacy.json": ("llama3_rope", False),
    "llama_gqa_untied.legacy.json": ("llama_gqa_untied", True),
}


def build_model(spec: dict) -> LlamaForCausalLM:
    torch.manual_seed(spec["seed"])
    cfg = LlamaConfig(
        **spec["config"], attention_dropout=0.0, attn_implementation="eager",
        bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    # Re-initialise deterministically: linear/embedding ~ N(0, std); RMSNorm weights
    # ~ 1 + N(0, 0.2) so that norm-weight gradients are non-trivial.
    g = torch.Generator().manual_seed(spec["seed"] * 1000 + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(spec["std"] * torch.randn(p.shape, generator=g))
    model.train()
    return model


def make_inputs(spec: dict, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec["seed"] * 1000 + 11)
    b, t = spec["batch"], spec["seq"]
    input_ids = torch.randint(0, vocab, (b, t), generator=g, dtype=torch.int64)
    labels = input_ids.clone()
    # A few ignored positions: row 0 at t=1 and t=T-1 (the last label), row 1 at t=T//2 and
    # t=0 (labels[:, 0] is never used by the shifted loss anyway).
    labels[0, 1] = IGNORE
    labels[0, t - 1] = IGNORE
    labels[1, t // 2] = IGNORE
    labels[1, 0] = IGNORE
    return input_ids, labels


def manual_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The convention, spelled out: logits[:, :-1] predict labels[:, 1:]; mean over non -100."""
    lg = logits[:, :-1, :].reshape(-1, logits.shape[-1]).double()
    lb = labels[:, 1:].reshape(-1)
    n = int((lb != IGNORE).sum())
    return F.cross_entropy(lg, lb, ignore_index=IGNORE, reduction="sum") / n, n


def forward_backward(model: LlamaForCausalLM, input_ids, labels, forward=None):
    """Logits, loss and every parameter gradient. `forward(model, input_ids, labels) -> (logits,
    loss)` replaces the model's own forward (make_ladder_fixtures.py runs the Ladder order)."""
    model.zero_grad(set_to_none=True)
    if forward is None:
        out = model(input_ids=input_ids, labels=labels, use_cache=False)
        logits, loss = out.logits, out.loss
    else:
        logits, loss = forward(model, input_ids, labels)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        grads[name] = p.grad.detach().to(torch.float32).clone()
    return logits.detach().to(torch.float32), loss.detach().to(torch.float32), grads


def rel(p: Path) -> Path:
    """p relative to the repository when it is inside it (for messages)."""
    try:
        return p.resolve().relative_to(REPO)
    except ValueError:
        return p


def save_reference(path: Path, input_ids, labels, logits, loss, grads, generator: str) -> None:
    n = int((labels[:, 1:] != IGNORE).sum())
    ref = {
        "input_ids": input_ids.contiguous(),
        "labels": labels.contiguous(),
        "logits": logits.contiguous(),
        "loss": loss.reshape(()).contiguous(),  # 0-dim scalar, shape ()
        "num_label_tokens": torch.tensor(n, dtype=torch.int64),
    }
    for k, v in grads.items():
        ref[f"grad.{k}"] = v.contiguous()
    # One metadata key only: safetensors serialises metadata in hash order, and a single key
    # keeps regeneration byte-identical. Conventions are in tests/fixtures/README.md.
    save_file(ref, str(path), metadata={"generator": f"{generator} (see tests/fixtures/README.md)"})


def generate(name: str, spec: dict, out_root: Path) -> None:
    d = out_root / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    model = build_model(spec)
    input_ids, labels = make_inputs(spec, model.config.vocab_size)
    logits, loss, grads = forward_backward(model, input_ids, labels)
    model.save_pretrained(d, safe_serialization=True)
    save_reference(d / "reference.safetensors", input_ids, labels, logits, loss, grads,
                   "scripts/make_hf_fixtures.py")
    print(f"wrote {rel(d)}: loss={loss.item():.6f} params={len(grads)}")


def legacy_config(cfg: dict, drop_head_dim: bool) -> dict:
    """Convert a transformers-5 config.json dict to the transformers-4.x layout."""
    old = {}
    for k, v in cfg.items():
        if k == "rope_parameters":
            rp = dict(v)
            old["rope_theta"] = rp.pop("rope_theta")
            if rp.get("rope_type", "default") == "default" and len(rp) <= 1:
                old["rope_scaling"] = None
            else:
                old["rope_scaling"] = dict(sorted(rp.items()))
        elif k == "dtype":
            old["torch_dtype"] = v
        elif k == "head_dim" and drop_head_dim:
            assert v == cfg["hidden_size"] // cfg["num_attention_heads"]
        elif k == "transformers_version":
            old[k] = "4.46.0"
        else:
            old[k] = v
    return dict(sorted(old.items()))


def write_variants(out_root: Path) -> None:
    vd = out_root / "config_variants"
    vd.mkdir(parents=True, exist_ok=True)
    for fname, (src, drop_head_dim) in LEGACY_VARIANTS.items():
        cfg = json.loads((out_root / src / "config.json").read_text())
        (vd / fname).write_text(json.dumps(legacy_config(cfg, drop_head_dim), indent=2) + "\n")
        print(f"wrote {rel(vd / fname)} (equivalent to {src}/config.json)")


def close(a: torch.Tensor, b: torch.Tensor, what: str, rtol=1e-4, atol=1e-6) -> float:
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = b.double().abs().max().item() if b.numel() else 0.0
    if not torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol + rtol * scale * 1e-2):
        raise AssertionError(f"{what}: max abs err {err:.3e} (scale {scale:.3e})")
    return err


def load(d: Path, config_path: Path | None = None) -> LlamaForCausalLM:
    kw = dict(attn_implementation="eager")
    if config_path is not None:
        kw["config"] = LlamaConfig.from_dict(
            json.loads(config_path.read_text()), attn_implementation="eager")
    try:
        model, info = LlamaForCausalLM.from_pretrained(
            d, dtype=torch.float32, output_loading_info=True, **kw)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model, info = LlamaForCausalLM.from_pretrained(
            d, torch_dtype=torch.float32, output_loading_info=True, **kw)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"loading {d}: {bad}"
    model.train()
    return model


def check(name: str, out_root: Path, forward=None):
    """Recompute a fixture from its files (with `forward`, see forward_backward) and compare.
    Returns (model, reference tensors, recomputed logits, loss, grads) for stricter checks."""
    d = out_root / name
    ref = load_file(str(d / "reference.safetensors"))
    model = load(d)
    assert model.config.attention_dropout == 0.0
    logits, loss, grads = forward_backward(model, ref["input_ids"], ref["labels"], forward)
    assert ref["loss"].shape == () and ref["loss"].dtype == torch.float32
    assert ref["input_ids"].dtype == torch.int64 and ref["labels"].dtype == torch.int64
    e_logits = close(logits, ref["logits"], f"{name} logits")
    e_loss = close(loss, ref["loss"], f"{name} loss", rtol=1e-5)
    m_loss, n = manual_loss(ref["logits"], ref["labels"])
    assert n == int(ref["num_label_tokens"])
    close(m_loss.float(), ref["loss"], f"{name} manual shifted loss", rtol=1e-5)
    names = {k[len("grad."):] for k in ref if k.startswith("grad.")}
    assert names == set(grads), f"{name} grad names differ: {names ^ set(grads)}"
    e_grad = max(close(grads[k], ref[f"grad.{k}"], f"{name} grad.{k}", rtol=1e-3, atol=1e-7)
                 for k in grads)
    for k in grads:
        assert ref[f"grad.{k}"].abs().max() > 0, f"{name} grad.{k} is all zero"
    weights = load_file(str(d / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in weights.values())
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in weights and "lm_head.weight" not in names
    print(f"ok {name}: loss={ref['loss'].item():.6f} (manual {m_loss.item():.6f}, n={n}) "
          f"max|d logits|={e_logits:.1e} |d loss|={e_loss:.1e} max|d grad|={e_grad:.1e}")
    return model, ref, logits, loss, grads


def check_variants(out_root: Path) -> None:
    for fname, (src, _) in LEGACY_VARIANTS.items():
        p = out_root / "config_variants" / fname
        new = LlamaConfig.from_pretrained(out_root / src)
        old = LlamaConfig.from_dict(json.loads(p.read_text()))
        assert old.rope_parameters == new.rope_parameters, (old.rope_parameters, new.rope_parameters)
        assert old.head_dim == new.head_dim, (old.head_dim, new.head_dim)
        ref = load_file(str(out_root / src / "reference.safetensors"))
        model = load(out_root / src, config_path=p)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ref["input_ids"], use_cache=False).logits
        close(logits, ref["logits"], f"{fname} logits")
        print(f"ok config_variants/{fname}: rope_parameters {old.rope_parameters} == {src}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root (default tests/fixtures)")
    ap.add_argument("--only", action="append", choices=sorted(FIXTURES), help="restrict to fixture(s)")
    ap.add_argument("--check", action="store_true", help="only verify existing fixtures")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    names = args.only or list(FIXTURES)
    if not args.check:
        for name in names:
            generate(name, FIXTURES[name], args.out)
        write_variants(args.out)
    for name in names:
        check(name, args.out)
    check_variants(args.out)
    # Only the files this script owns: other generators (make_ladder_fixtures.py) keep their own budget.
    dirs = [args.out / n for n in FIXTURES] + [args.out / "config_variants"]
    total = sum(f.stat().st_size for d in dirs for f in d.rglob("*") if f.is_file())
    print(f"total size of the Llama fixtures in {args.out}: {total} bytes ({total / 1024:.1f} KiB)")
    if total >= 2 * 1024 * 1024:
        print("error: Llama fixtures exceed 2 MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
