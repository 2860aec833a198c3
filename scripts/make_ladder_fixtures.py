#!/usr/bin/env python3
"""Generate tiny random Ladder Transformer fixtures for checking ferrolm against PyTorch.

The Ladder Transformer (Ladder Residual, arXiv 2501.06589) is a Llama whose chosen layers read
stale inputs so that each block's tensor-parallel all-reduce can overlap the next block's
compute. Its weights are exactly a Llama's; only the forward order differs. The authors' released
Hugging Face code (github.com/mayank31398/ladder-residual-inference,
hf_modeling_utils/modeling_llama_ladder.py) defines it; this script re-implements that forward on
top of transformers' own Llama modules (embedding, RMSNorm, attention, rotary embedding, causal
mask, MLP, head and loss), so everything but the order of the residual stream is transformers'.

The recurrence. State is a pair (h, p); initially h = p = token embeddings. Layer i computes

    standard layer (i not in ladder):  a = h + Attn_i(norm1_i(h));  m = a + MLP_i(norm2_i(a))
    Ladder layer   (i in ladder):      a = h + Attn_i(norm1_i(p));  m = a + MLP_i(norm2_i(h))

then h = m, p = a. After the last layer, logits = lm_head(norm(h)). config.json's
`ladder_layers` is an int N (the last N layers), a list of layer indices, or absent/null (none).

For every fixture NAME this writes, under tests/fixtures/NAME/, the same files as
make_hf_fixtures.py (whose functions it imports: model construction and re-initialisation,
inputs and label masking, reference file layout, verification):

  config.json             what LlamaConfig.save_pretrained writes, plus model_type "llamaLadder",
                          architectures, auto_map (as the released configs have) and ladder_layers
  generation_config.json  as save_pretrained writes it
  model.safetensors       as save_pretrained writes it (transformers' Llama tensor names)
  reference.safetensors   input_ids, labels, logits, loss, num_label_tokens, grad.<param name>

Usage (environment: scripts/requirements-fixtures.txt, see make_hf_fixtures.py):

    .venv/bin/python scripts/make_ladder_fixtures.py            # regenerate all, then verify
    .venv/bin/python scripts/make_ladder_fixtures.py --check    # only verify committed fixtures
    .venv/bin/python scripts/make_ladder_fixtures.py --only ladder_list_tied

Verification reloads each fixture, recomputes logits, loss and all gradients with the Ladder
forward (max relative difference <= 1e-6 required), checks config.json field by field against
what save_pretrained writes for the spec, checks that the Ladder forward with no Ladder layers is
transformers' LlamaForCausalLM exactly (logits, loss, gradients), and checks that every layer's
kind matters in every fixture (switching any one layer between standard and Ladder moves the
logits by far more than the parity tolerance), so a wrong layer kind cannot pass against them.
It also loads each fixture through `AutoModelForCausalLM.from_pretrained(trust_remote_code=True)`
with the modelling files ferrolm writes beside every Ladder checkpoint
(crates/nn/src/ladder_hf/*.py) and requires the same logits and loss, and a KV-cached greedy
generation equal to the uncached one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.masking_utils import create_causal_mask

import make_hf_fixtures as hf

GENERATOR = "scripts/make_ladder_fixtures.py"
# All Ladder fixtures together stay under this many bytes.
SIZE_BUDGET = 1_200_000
# --check: recomputed tensors must match the files to this relative error (max|d| / max|ref|).
RTOL = 1e-6
# Switching one layer's kind must move the logits by at least this much (relative), i.e. far
# above the 1e-4 the Rust parity tests allow.
MIN_KIND_EFFECT = 1e-2

# Keys added to what save_pretrained writes, as in the released configs
# (hf_modeling_utils/configs/*.json); ladder_layers comes from each spec, verbatim.
LADDER_CONFIG = {
    "model_type": "llamaLadder",
    "architectures": ["LlamaLadderForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_llama_ladder.LlamaLadderConfig",
        "AutoModelForCausalLM": "modeling_llama_ladder.LlamaLadderForCausalLM",
    },
}

# Each fixture: a make_hf_fixtures spec (LlamaConfig kwargs + batch/seq/seed/init std) plus
# ladder_layers exactly as config.json spells it. Seeds differ from the Llama fixtures'.
# init std 0.1 (not 0.02) keeps attention away from uniform and makes each block's output a
# sizeable fraction of the residual stream, so the order of the stream is visible in the logits.
FIXTURES: dict[str, dict] = {
    # int form: the last two of four layers; two standard layers feed the Ladder ones.
    "ladder_int_gqa_untied": dict(
        config=hf.llama_config(64, 32, 64, 4, 4, 2, 1e-5, False),
        ladder_layers=2, batch=2, seq=16, seed=21, std=0.1,
    ),
    # list form: layer 0 is Ladder (its p is still the embedding, so only its MLP input
    # differs), layer 1 is a standard layer between two Ladder ones.
    "ladder_list_tied": dict(
        config=hf.llama_config(64, 32, 64, 3, 4, 4, 1e-6, True),
        ladder_layers=[0, 2], batch=2, seq=12, seed=22, std=0.1,
    ),
    # every layer Ladder (the "Ladder Transformer" of the paper), given as the int 3.
    "ladder_all_mqa": dict(
        config=hf.llama_config(64, 32, 64, 3, 4, 1, 1e-5, False),
        ladder_layers=3, batch=2, seq=10, seed=23, std=0.1,
    ),
}


def ladder_indices(ladder_layers, num_layers: int) -> frozenset[int]:
    """The set of Ladder layer indices that config.json's `ladder_layers` denotes."""
    if ladder_layers is None:
        return frozenset()
    # bool is an int in Python; true/false in config.json is not a layer count.
    if isinstance(ladder_layers, int) and not isinstance(ladder_layers, bool):
        if not 0 <= ladder_layers <= num_layers:
            raise ValueError(f"ladder_layers {ladder_layers} is outside 0..={num_layers}")
        return frozenset(range(num_layers - ladder_layers, num_layers))
    if isinstance(ladder_layers, list):
        bad = [i for i in ladder_layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
        if bad or len(set(ladder_layers)) != len(ladder_layers):
            raise ValueError(f"ladder_layers {ladder_layers}: entries must be distinct layer indices < {num_layers}")
        return frozenset(ladder_layers)
    raise ValueError(f"ladder_layers must be an int, a list or null, not {ladder_layers!r}")


def ladder_logits(model: LlamaForCausalLM, input_ids: torch.Tensor, ladder: frozenset[int]) -> torch.Tensor:
    """LlamaModel.forward (transformers 5.23) with the residual stream in the Ladder order."""
    lm = model.model
    x = lm.embed_tokens(input_ids)
    position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    mask = create_causal_mask(
        config=lm.config, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=position_ids)
    rope = lm.rotary_emb(x, position_ids=position_ids)
    h = p = x
    for i, layer in enumerate(lm.layers):
        is_ladder = i in ladder
        attn_in = p if is_ladder else h
        attn, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(attn_in), attention_mask=mask, position_ids=position_ids,
            past_key_values=None, position_embeddings=rope)
        a = h + attn
        mlp_in = h if is_ladder else a
        m = a + layer.mlp(layer.post_attention_layernorm(mlp_in))
        h, p = m, a
    return model.lm_head(lm.norm(h))


def ladder_forward(ladder: frozenset[int]):
    """A make_hf_fixtures.forward_backward `forward`: Ladder logits and transformers' own loss."""
    def forward(model, input_ids, labels):
        logits = ladder_logits(model, input_ids, ladder)
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
        return logits, loss
    return forward


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (both in f64)."""
    scale = b.double().abs().max().item()
    return (a.double() - b.double()).abs().max().item() / (scale if scale > 0 else 1.0)


def ladder_config_json(llama_config: dict, ladder_layers) -> str:
    cfg = {**llama_config, **LADDER_CONFIG, "ladder_layers": ladder_layers}
    # Same layout as save_pretrained: sorted keys, indent 2, trailing newline.
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def expected_config_json(spec: dict) -> str:
    """What config.json must hold: save_pretrained's output for the spec plus the Ladder keys."""
    with tempfile.TemporaryDirectory() as tmp:
        hf.build_model(spec).save_pretrained(tmp, safe_serialization=True)
        llama = json.loads((Path(tmp) / "config.json").read_text())
    return ladder_config_json(llama, spec["ladder_layers"])


def generate(name: str, spec: dict, out_root: Path) -> None:
    d = out_root / name
    if d.exists():
        for f in sorted(d.iterdir()):
            f.unlink()
    d.mkdir(parents=True, exist_ok=True)
    model = hf.build_model(spec)
    ladder = ladder_indices(spec["ladder_layers"], model.config.num_hidden_layers)
    input_ids, labels = hf.make_inputs(spec, model.config.vocab_size)
    logits, loss, grads = hf.forward_backward(model, input_ids, labels, ladder_forward(ladder))
    model.save_pretrained(d, safe_serialization=True)
    llama = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(ladder_config_json(llama, spec["ladder_layers"]))
    hf.save_reference(d / "reference.safetensors", input_ids, labels, logits, loss, grads, GENERATOR)
    print(f"wrote {hf.rel(d)}: ladder layers {sorted(ladder)} loss={loss.item():.6f} params={len(grads)}")


def check_config(name: str, spec: dict, d: Path) -> frozenset[int]:
    text = (d / "config.json").read_text()
    cfg = json.loads(text)
    want = json.loads(expected_config_json(spec))
    for k in sorted(set(cfg) | set(want)):
        assert k in cfg and k in want and cfg[k] == want[k], f"{name} config.json {k}: {cfg.get(k)!r} != {want.get(k)!r}"
    # == treats 2 and 2.0 (and True and 1) alike: the spelling of ladder_layers is part of the fixture.
    assert type(cfg["ladder_layers"]) is type(spec["ladder_layers"]), f"{name}: ladder_layers spelled differently"
    assert text == expected_config_json(spec), f"{name} config.json layout differs from save_pretrained's"
    return ladder_indices(cfg["ladder_layers"], cfg["num_hidden_layers"])


def check_plain_llama(name: str, model: LlamaForCausalLM, ref: dict) -> float:
    """With no Ladder layers the forward must be transformers' LlamaForCausalLM, bit for bit."""
    ours = hf.forward_backward(model, ref["input_ids"], ref["labels"], ladder_forward(frozenset()))
    theirs = hf.forward_backward(model, ref["input_ids"], ref["labels"])
    err = max(rel_err(ours[0], theirs[0]), rel_err(ours[1], theirs[1]),
              *(rel_err(ours[2][k], theirs[2][k]) for k in theirs[2]))
    abs_logits = (ours[0] - theirs[0]).abs().max().item()
    assert abs_logits <= 1e-6 and err <= RTOL, f"{name}: empty-ladder forward != LlamaForCausalLM ({abs_logits:.1e})"
    return abs_logits


def check_kind_effects(name: str, model: LlamaForCausalLM, ref: dict, ladder: frozenset[int]) -> float:
    """Switching any single layer's kind must change the logits well beyond the parity tolerance."""
    weakest = float("inf")
    with torch.no_grad():
        for i in range(model.config.num_hidden_layers):
            logits = ladder_logits(model, ref["input_ids"], ladder ^ {i})
            effect = rel_err(logits, ref["logits"])
            assert effect > MIN_KIND_EFFECT, f"{name}: switching layer {i}'s kind moves logits only {effect:.1e}"
            weakest = min(weakest, effect)
    return weakest


# The modelling code ferrolm writes beside every Ladder checkpoint (crates/nn/src/ladder_hf.rs
# embeds these files), checked here against the same references.
REMOTE_CODE = hf.REPO / "crates" / "nn" / "src" / "ladder_hf"


def check_remote_code(name: str, d: Path, ref: dict) -> float:
    """The fixture with ferrolm's modelling files beside it loads through auto_map
    (trust_remote_code) and gives the reference logits and loss; its KV-cached greedy generation
    equals the uncached one. Returns the logits' relative error."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp) / name
        shutil.copytree(d, t)
        for f in sorted(REMOTE_CODE.glob("*.py")):
            shutil.copy(f, t / f.name)
        model = AutoModelForCausalLM.from_pretrained(t, trust_remote_code=True, dtype=torch.float32)
        assert type(model).__name__ == "LlamaLadderForCausalLM", f"{name}: auto_map loaded {type(model).__name__}"
        with torch.no_grad():
            out = model(input_ids=ref["input_ids"], labels=ref["labels"], use_cache=False)
            err = max(rel_err(out.logits, ref["logits"]), rel_err(out.loss, ref["loss"]))
            assert err <= RTOL, f"{name}: the remote modelling code's logits/loss differ by {err:.1e}"
            prompt = ref["input_ids"][:1, :4]
            cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
            plain = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
            assert torch.equal(cached, plain), f"{name}: cached generation {cached} != uncached {plain}"
    return err


def check(name: str, spec: dict, out_root: Path) -> None:
    d = out_root / name
    ladder = check_config(name, spec, d)
    # make_hf_fixtures.check: file layout, dtypes, loss convention, label count, tied head, and
    # logits/loss/gradients recomputed (with the Ladder forward) at its usual tolerances ...
    model, ref, logits, loss, grads = hf.check(name, out_root, ladder_forward(ladder))
    assert model.config.num_hidden_layers == spec["config"]["num_hidden_layers"]
    # ... and here at the stricter one this script promises.
    errs = {"logits": rel_err(logits, ref["logits"]), "loss": rel_err(loss, ref["loss"])}
    errs.update({f"grad.{k}": rel_err(g, ref[f"grad.{k}"]) for k, g in grads.items()})
    worst = max(errs, key=errs.get)
    assert errs[worst] <= RTOL, f"{name} {worst}: relative error {errs[worst]:.1e} > {RTOL}"
    plain = check_plain_llama(name, model, ref)
    weakest = check_kind_effects(name, model, ref, ladder)
    remote = check_remote_code(name, d, ref)
    print(f"ok {name}: ladder layers {sorted(ladder)} of {model.config.num_hidden_layers}, "
          f"max rel err {errs[worst]:.1e} ({worst}); remote code {remote:.1e}; empty ladder == LlamaForCausalLM "
          f"(max|d logits| {plain:.1e}); weakest single-layer kind switch moves logits {weakest:.2f} (rel)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=hf.DEFAULT_OUT, help="fixture root (default tests/fixtures)")
    ap.add_argument("--only", action="append", choices=sorted(FIXTURES), help="restrict to fixture(s)")
    ap.add_argument("--check", action="store_true", help="only verify existing fixtures")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for name, spec in FIXTURES.items():  # a typo in a spec must not produce a fixture
        ladder_indices(spec["ladder_layers"], spec["config"]["num_hidden_layers"])
    names = args.only or list(FIXTURES)
    if not args.check:
        for name in names:
            generate(name, FIXTURES[name], args.out)
    for name in names:
        check(name, FIXTURES[name], args.out)
    total = sum(f.stat().st_size for n in FIXTURES for f in (args.out / n).glob("*") if f.is_file())
    print(f"total size of the Ladder fixtures in {args.out}: {total} bytes ({total / 1024:.1f} KiB)")
    if total >= SIZE_BUDGET:
        print(f"error: Ladder fixtures exceed {SIZE_BUDGET} bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
