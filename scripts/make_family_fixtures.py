#!/usr/bin/env python3
"""Generate tiny random Qwen2, Qwen3 and Mistral fixtures for checking ferrolm against
`transformers`, one per family, each covering what the family changes from Llama
(docs/MODELS.md). Same files and conventions as scripts/make_hf_fixtures.py (see
tests/fixtures/README.md): config.json, generation_config.json, model.safetensors (f32) and
reference.safetensors (input_ids, labels, logits, loss, num_label_tokens, grad.<name> for
every entry of model.named_parameters()).

  qwen2_bias_tied       Qwen2: bias on q/k/v (not o), tied embeddings, use_sliding_window false
  qwen3_qknorm_untied   Qwen3: q_norm/k_norm, head_dim 16 != hidden/heads 8, untied
  mistral_headdim       Mistral: head_dim 16 != hidden/heads 8, sliding_window null
  gemma3_mixed_tied     Gemma 3 text: (1 + w) sandwich norms, GeGLU, QK-norm, sqrt(hidden)
                        embedding scale, query_pre_attn_scalar 12 != head_dim 16 != hidden/heads 8,
                        layer_types sliding/sliding/full with RoPE thetas 100 and 1e6, sliding_window
                        4 < seq 12 on the two sliding layers, tied, pad_token_id null
  qwen2_window          Qwen2: use_sliding_window true, sliding_window 4 < seq 12, 2 layers with
                        max_window_layers 1 (layer 0 full, layer 1 sliding_attention), tied
  mistral_window        Mistral: sliding_window 5 < seq 12 on every layer
  qwen3_bias_bf16       Qwen3: attention_bias true (a bias on q, k, v and o), QK-norm, tied, its
                        weights stored in bf16 (`dtype: bfloat16`); the reference is transformers'
                        f32 compute on those weights (AutoModelForCausalLM.from_pretrained(dtype=
                        torch.float32) upcasts them)
  llama_bias_untied     Llama: attention_bias and mlp_bias true (biases on o_proj and on gate, up
                        and down, beside q/k/v), untied

The windowed fixtures (qwen2_window, mistral_window, gemma3_mixed_tied) also hold
generation.json: transformers' greedy `generate` (its own KV cache, `DynamicCache`, whose sliding
layers keep only the last window - 1 keys) for a prompt, with more new tokens than the window, and the smallest top-1 / top-2 logit gap on the way (a
gap well above f32 noise makes token-for-token equality a fair test).

Setup as for make_hf_fixtures.py (torch 2.15.0, transformers 5.23.0). Usage:

    python scripts/make_family_fixtures.py             # regenerate all, then verify
    python scripts/make_family_fixtures.py --check     # only verify the committed fixtures
    python scripts/make_family_fixtures.py --roundtrip DIR --fixture NAME
        # DIR, a checkpoint ferrolm saved from fixture NAME (crates/nn/tests/hf_parity.rs writes
        # one per family when FERROLM_ROUNDTRIP_OUT is set): transformers must load it as the
        # same family (AutoModelForCausalLM gives the fixture's class, no missing or unexpected
        # tensor) and give the fixture's loss and logits.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_hf_fixtures as hf  # noqa: E402  (shared conventions: inputs, loss, reference file)

DEFAULT_OUT = hf.DEFAULT_OUT
ROPE = dict(rope_type="default", rope_theta=10000.0)


def base(vocab, hidden, ffn, layers, heads, kv, eps, tied, **extra) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                rms_norm_eps=eps, tie_word_embeddings=tied, rope_parameters=dict(ROPE), **extra)


FIXTURES: dict[str, dict] = {
    "qwen2_bias_tied": dict(
        classes=(Qwen2Config, Qwen2ForCausalLM),
        config=base(64, 32, 64, 2, 4, 2, 1e-6, True, use_sliding_window=False, sliding_window=4096,
                    max_window_layers=1),
        batch=2, seq=12, seed=21, std=0.05,
    ),
    "qwen3_qknorm_untied": dict(
        classes=(Qwen3Config, Qwen3ForCausalLM),
        config=base(64, 32, 64, 2, 4, 2, 1e-6, False, head_dim=16, attention_bias=False,
                    use_sliding_window=False),
        batch=2, seq=12, seed=22, std=0.05,
    ),
    "mistral_headdim": dict(
        classes=(MistralConfig, MistralForCausalLM),
        config=base(64, 32, 64, 2, 4, 2, 1e-5, False, head_dim=16, sliding_window=None),
        batch=2, seq=12, seed=23, std=0.05,
    ),
    "gemma3_mixed_tied": dict(
        classes=(Gemma3TextConfig, Gemma3ForCausalLM),
        config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=12,
                    hidden_activation="gelu_pytorch_tanh", sliding_window=4,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                                         sliding_attention=dict(rope_type="default", rope_theta=100.0)),
                    final_logit_softcapping=None, attn_logit_softcapping=None, pad_token_id=None),
        batch=2, seq=12, seed=24, std=0.05, generate=dict(prompt=[25, 10, 28, 18, 40], new=12),
    ),
    "qwen2_window": dict(
        classes=(Qwen2Config, Qwen2ForCausalLM),
        config=base(64, 32, 48, 2, 4, 2, 1e-6, True, use_sliding_window=True, sliding_window=4,
                    max_window_layers=1),
        batch=2, seq=12, seed=24, std=0.3, generate=dict(prompt=[25, 10, 28, 18, 40], new=12),
    ),
    "mistral_window": dict(
        classes=(MistralConfig, MistralForCausalLM),
        config=base(64, 32, 48, 2, 4, 2, 1e-5, False, sliding_window=5),
        batch=2, seq=12, seed=25, std=0.3, generate=dict(prompt=[25, 10, 28, 18, 40], new=12),
    ),
    "qwen3_bias_bf16": dict(
        classes=(Qwen3Config, Qwen3ForCausalLM),
        config=base(64, 32, 64, 2, 4, 2, 1e-6, True, head_dim=16, attention_bias=True,
                    use_sliding_window=False),
        batch=2, seq=12, seed=26, std=0.05, bf16=True,
    ),
    "llama_bias_untied": dict(
        classes=(LlamaConfig, LlamaForCausalLM),
        config=base(64, 32, 64, 2, 4, 2, 1e-5, False, attention_bias=True, mlp_bias=True),
        batch=2, seq=12, seed=27, std=0.05,
    ),
}


def greedy(model, prompt: list[int], new: int) -> tuple[list[int], float]:
    """transformers' greedy generation with its KV cache (no early stop at eos), and the
    smallest top-1 / top-2 logit gap over the generated steps."""
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             use_cache=True, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0)
    model.train()
    gap = min((s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores)
    return out.sequences[0, len(prompt):].tolist(), gap


def build_model(spec: dict):
    cfg_cls, model_cls = spec["classes"]
    torch.manual_seed(spec["seed"])
    cfg = cfg_cls(**spec["config"], attention_dropout=0.0, attn_implementation="eager",
                  bos_token_id=1, eos_token_id=2)
    model = model_cls(cfg).to(torch.float32)
    # Linear/embedding weights and biases ~ N(0, std) (biases non-zero so that they matter);
    # norm weights (the q/k norms too) ~ 1 + N(0, 0.2).
    g = torch.Generator().manual_seed(spec["seed"] * 1000 + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(spec["std"] * torch.randn(p.shape, generator=g))
            if spec.get("bf16"):
                p.copy_(p.to(torch.bfloat16).to(torch.float32))  # the values bf16 stores
    model.train()
    return model


def generate(name: str, spec: dict, out_root: Path) -> None:
    d = out_root / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    model = build_model(spec)
    input_ids, labels = hf.make_inputs(spec, model.config.vocab_size)
    logits, loss, grads = hf.forward_backward(model, input_ids, labels)
    if spec.get("bf16"):
        # Stored in bf16 (exactly the f32 values the reference was computed with).
        model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
        model.to(torch.float32)
    else:
        model.save_pretrained(d, safe_serialization=True)
    hf.save_reference(d / "reference.safetensors", input_ids, labels, logits, loss, grads,
                      "scripts/make_family_fixtures.py")
    if "generate" in spec:
        g = spec["generate"]
        tokens, gap = greedy(model, g["prompt"], g["new"])
        (d / "generation.json").write_text(json.dumps(dict(prompt=g["prompt"], tokens=tokens,
                                                           min_top2_gap=round(gap, 4))) + "\n")
        print(f"  greedy {g['prompt']} -> {tokens} (min top-2 gap {gap:.4f})")
    print(f"wrote {hf.rel(d)}: loss={loss.item():.6f} params={len(grads)}")


def load_auto(d: Path):
    model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True,
                                                       attn_implementation="eager")
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"loading {d}: {bad}"
    model.train()
    return model


def check(name: str, spec: dict, out_root: Path) -> None:
    d = out_root / name
    ref = load_file(str(d / "reference.safetensors"))
    model = load_auto(d)
    assert type(model) is spec["classes"][1], f"{name}: loaded as {type(model).__name__}"
    logits, loss, grads = hf.forward_backward(model, ref["input_ids"], ref["labels"])
    hf.close(logits, ref["logits"], f"{name} logits")
    hf.close(loss, ref["loss"], f"{name} loss", rtol=1e-5)
    names = {k[len("grad."):] for k in ref if k.startswith("grad.")}
    assert names == set(grads), f"{name} grad names differ: {names ^ set(grads)}"
    for k in grads:
        hf.close(grads[k], ref[f"grad.{k}"], f"{name} grad.{k}", rtol=1e-3, atol=1e-7)
        assert ref[f"grad.{k}"].abs().max() > 0, f"{name} grad.{k} is all zero"
    if "generate" in spec:
        want = json.loads((d / "generation.json").read_text())
        tokens, _ = greedy(model, want["prompt"], len(want["tokens"]))
        assert tokens == want["tokens"], f"{name} greedy tokens {tokens} != {want['tokens']}"
        # The window bites: the same model without it generates or scores differently.
        assert len(want["tokens"]) + len(want["prompt"]) > model.config.sliding_window
    print(f"ok {name}: loss={ref['loss'].item():.6f} params={len(grads)} ({type(model).__name__})")


def check_roundtrip(d: Path, name: str, out_root: Path) -> None:
    """A checkpoint ferrolm saved from fixture `name`: the same family, loss and logits."""
    spec = FIXTURES[name]
    cfg = AutoConfig.from_pretrained(d)
    want = spec["classes"][0]
    assert type(cfg) is want, f"{d}: config loads as {type(cfg).__name__}, not {want.__name__}"
    model = load_auto(d)
    assert type(model) is spec["classes"][1], f"{d}: loaded as {type(model).__name__}"
    ref = load_file(str(out_root / name / "reference.safetensors"))
    logits, loss, _ = hf.forward_backward(model, ref["input_ids"], ref["labels"])
    hf.close(logits, ref["logits"], f"{d} logits")
    hf.close(loss, ref["loss"], f"{d} loss", rtol=1e-5)
    print(f"ok {d}: {type(model).__name__}, loss {loss.item():.6f} == fixture {name}'s "
          f"{ref['loss'].item():.6f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root (default tests/fixtures)")
    ap.add_argument("--only", action="append", choices=sorted(FIXTURES), help="restrict to fixture(s)")
    ap.add_argument("--check", action="store_true", help="only verify existing fixtures")
    ap.add_argument("--roundtrip", type=Path, help="verify a checkpoint ferrolm saved (with --fixture)")
    ap.add_argument("--fixture", choices=sorted(FIXTURES), help="the fixture --roundtrip was saved from")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if args.roundtrip:
        if not args.fixture:
            ap.error("--roundtrip needs --fixture NAME")
        check_roundtrip(args.roundtrip, args.fixture, args.out)
        return 0
    names = args.only or list(FIXTURES)
    if not args.check:
        for name in names:
            generate(name, FIXTURES[name], args.out)
    for name in names:
        check(name, FIXTURES[name], args.out)
    total = sum(f.stat().st_size for n in FIXTURES for f in (args.out / n).rglob("*") if f.is_file())
    print(f"total size of the family fixtures in {args.out}: {total} bytes ({total / 1024:.1f} KiB)")
    # Eight fixtures of about 160-330 KB: the same 2 MB budget as make_hf_fixtures.py's.
    if total >= 2 * 1024 * 1024:
        print("error: family fixtures exceed 2 MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
