#!/usr/bin/env python3
"""Generate LoRA adapter fixtures with Hugging Face PEFT, for checking ferrolm's LoRA against it.

Each fixture adds a PEFT LoRA adapter to one of the committed base fixtures (tests/fixtures/,
made by make_hf_fixtures.py and make_ladder_fixtures.py), with B set non-zero so the adapter
changes the model, and writes under tests/fixtures/NAME/:

  adapter_config.json         as PeftModel.save_pretrained writes it (base_model_name_or_path is
                              the base fixture's path relative to the repository; target_modules
                              sorted, PEFT writes them in a set's order)
  adapter_model.safetensors   as save_pretrained writes it: base_model.model.<module>.lora_A.weight
                              (R, in) and .lora_B.weight (out, R), f32
  reference.safetensors       input_ids, labels (the base fixture's), logits and loss with the
                              adapter, num_label_tokens, grad.<adapter tensor name> for every
                              adapter factor (the loss's gradient: one training step's), and
                              merged_logits (after merge_and_unload: W + s B A folded in)

The Ladder fixture runs make_ladder_fixtures.py's Ladder forward over the PEFT-wrapped modules.

Usage (environment: scripts/requirements-fixtures.txt):

    .venv/bin/python scripts/make_lora_fixtures.py            # regenerate all, then verify
    .venv/bin/python scripts/make_lora_fixtures.py --check    # only verify committed fixtures
    cargo run -p ferrolm-nn --example train_lora -- tests/fixtures/lora_trained
    .venv/bin/python scripts/make_lora_fixtures.py --trained
        # an adapter ferrolm trained (train_lora.rs): PEFT loads it, and its loss in PEFT on fresh
        # tokens goes to tests/fixtures/lora_trained/peft_eval.safetensors

Verification reloads each adapter with PeftModel.from_pretrained, recomputes everything (max
relative difference 1e-6), and checks that the adapter moves the logits by far more than that
and that the merged model's logits equal the adapted ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

import make_hf_fixtures as hf
import make_ladder_fixtures as ld

GENERATOR = "scripts/make_lora_fixtures.py"
FIXTURES_DIR = "tests/fixtures"

# name -> base fixture, LoraConfig kwargs, seed, std of B.
FIXTURES: dict[str, dict] = {
    # Every projection, alpha / R.
    "lora_llama": dict(
        base="llama_gqa_untied",
        lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        seed=11, b_std=0.1),
    # rsLoRA (alpha / sqrt(R)), three projections, block 1 only, on a tied model.
    "lora_rslora_tied": dict(
        base="llama_mha_tied",
        lora=dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[1]),
        seed=12, b_std=0.1),
    # A converted Ladder model; "all-linear" (PEFT saves the module paths it resolved).
    "lora_ladder": dict(
        base="ladder_int_gqa_untied",
        lora=dict(r=4, lora_alpha=16, target_modules="all-linear"),
        seed=13, b_std=0.1),
}


def base_forward(base: Path):
    """The logits/loss function of a base fixture: the Ladder order for a llamaLadder config."""
    cfg = json.loads((base / "config.json").read_text())
    if cfg.get("model_type") == "llamaLadder":
        return ld.ladder_forward(ld.ladder_indices(cfg.get("ladder_layers"), cfg["num_hidden_layers"]))
    return None


def load_base(base: Path):
    cfg = json.loads((base / "config.json").read_text())
    if cfg.get("model_type") == "llamaLadder":
        # The weights are a Llama's; the forward order is make_ladder_fixtures.py's.
        plain = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map", "ladder_layers")}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(plain, f)
        return hf.load(base, Path(f.name))
    return hf.load(base)


def logits_loss(model, forward, input_ids, labels):
    if forward is None:
        out = model(input_ids=input_ids, labels=labels, use_cache=False)
        return out.logits, out.loss
    return forward(model, input_ids, labels)


def adapter_grads(peft_model, forward, input_ids, labels):
    """Logits, loss and the gradient of every adapter factor (names without `.default`)."""
    peft_model.zero_grad(set_to_none=True)
    inner = peft_model.base_model.model
    logits, loss = logits_loss(inner, forward, input_ids, labels)
    loss.backward()
    grads = {}
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"no gradient for {name}"
            grads[name.replace(".default", "")] = p.grad.detach().clone()
    return logits.detach(), loss.detach(), grads


def generate(name: str, spec: dict, root: Path) -> None:
    d = root / name
    if d.exists():
        shutil.rmtree(d)
    base_dir = root / spec["base"]
    model = load_base(base_dir)
    ref = load_file(str(base_dir / "reference.safetensors"))
    input_ids, labels = ref["input_ids"], ref["labels"]
    torch.manual_seed(spec["seed"])
    cfg = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **spec["lora"])
    pm = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(spec["seed"] + 1000)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * spec["b_std"])
    pm.peft_config["default"].base_model_name_or_path = f"{FIXTURES_DIR}/{spec['base']}"
    pm.save_pretrained(d, safe_serialization=True)
    (d / "README.md").unlink(missing_ok=True)  # PEFT's model card template
    # PEFT writes target_modules from a set, in hash order: sorted, regeneration is byte-identical.
    conf_path = d / "adapter_config.json"
    conf = json.loads(conf_path.read_text())
    if isinstance(conf["target_modules"], list):
        conf["target_modules"] = sorted(conf["target_modules"])
    conf_path.write_text(json.dumps(conf, indent=2, sort_keys=True))
    forward = base_forward(base_dir)
    logits, loss, grads = adapter_grads(pm, forward, input_ids, labels)
    merged = pm.merge_and_unload()
    with torch.no_grad():
        merged_logits, _ = logits_loss(merged, forward, input_ids, labels)
    n = int((labels[:, 1:] != hf.IGNORE).sum())
    out = {
        "input_ids": input_ids.contiguous(),
        "labels": labels.contiguous(),
        "logits": logits.float().contiguous(),
        "loss": loss.float().reshape(()).contiguous(),
        "num_label_tokens": torch.tensor(n, dtype=torch.int64),
        "merged_logits": merged_logits.detach().float().contiguous(),
    }
    for k, v in grads.items():
        out[f"grad.{k}"] = v.float().contiguous()
    save_file(out, str(d / "reference.safetensors"), metadata={"generator": f"{GENERATOR} (see tests/fixtures/README.md)"})
    print(f"wrote {hf.rel(d)}: loss={loss.item():.6f}, {len(grads)} adapter factors")


def check(name: str, spec: dict, root: Path) -> None:
    d, base_dir = root / name, root / spec["base"]
    ref = load_file(str(d / "reference.safetensors"))
    input_ids, labels = ref["input_ids"], ref["labels"]
    forward = base_forward(base_dir)
    model = load_base(base_dir)
    with torch.no_grad():
        plain, _ = logits_loss(model, forward, input_ids, labels)
    pm = PeftModel.from_pretrained(model, d, is_trainable=True)
    logits, loss, grads = adapter_grads(pm, forward, input_ids, labels)
    worst = max(ld.rel_err(logits, ref["logits"]), ld.rel_err(loss, ref["loss"]))
    names = sorted(k[len("grad."):] for k in ref if k.startswith("grad."))
    assert names == sorted(grads), f"{name}: adapter factors differ: {names} vs {sorted(grads)}"
    for k in names:
        worst = max(worst, ld.rel_err(grads[k], ref[f"grad.{k}"]))
    merged = pm.merge_and_unload()
    with torch.no_grad():
        merged_logits, _ = logits_loss(merged, forward, input_ids, labels)
    worst = max(worst, ld.rel_err(merged_logits, ref["merged_logits"]))
    assert worst <= 1e-6, f"{name}: recomputed values differ by {worst:.2e}"
    assert ld.rel_err(ref["merged_logits"], ref["logits"]) <= 1e-5, f"{name}: merged logits differ from the adapted ones"
    effect = ld.rel_err(plain, ref["logits"])
    assert effect > 1e-2, f"{name}: the adapter moves the logits by only {effect:.2e}"
    print(f"ok {name}: max rel diff {worst:.2e}; the adapter moves the logits by {effect:.2e}")


TRAINED = "lora_trained"  # written by ferrolm: crates/nn/examples/train_lora.rs
TRAINED_BASE = "llama_gqa_untied"


def trained(root: Path, check: bool) -> None:
    """PEFT loads the adapter ferrolm trained, every factor as the file holds it, and scores fresh
    tokens with it: input_ids, loss (the adapted model's), base_loss (without the adapter)."""
    d, base_dir = root / TRAINED, root / TRAINED_BASE
    conf = json.loads((d / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == f"{FIXTURES_DIR}/{TRAINED_BASE}", conf["base_model_name_or_path"]
    model = load_base(base_dir)
    model.eval()
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    with torch.no_grad():
        base_loss = model(input_ids=ids, labels=ids).loss
    pm = PeftModel.from_pretrained(model, d)
    weights = load_file(str(d / "adapter_model.safetensors"))
    loaded = {n.replace(".default", ""): p for n, p in pm.named_parameters() if "lora_" in n}
    assert sorted(loaded) == sorted(weights), f"PEFT's factors {sorted(loaded)} vs the file's {sorted(weights)}"
    for k, v in weights.items():
        assert torch.equal(loaded[k].detach(), v), f"{k} is not what the file holds"
    with torch.no_grad():
        loss = pm(input_ids=ids, labels=ids).loss
    path = d / "peft_eval.safetensors"
    if check:
        ref = load_file(str(path))
        assert torch.equal(ref["input_ids"], ids) and ld.rel_err(loss, ref["loss"]) <= 1e-6, f"{TRAINED}: PEFT's loss moved"
    else:
        out = {"input_ids": ids, "loss": loss.float().reshape(()), "base_loss": base_loss.float().reshape(())}
        save_file(out, str(path), metadata={"generator": f"{GENERATOR} --trained (see tests/fixtures/README.md)"})
    print(f"ok {TRAINED}: PEFT loads all {len(weights)} factors; loss {loss.item():.6f} (base {base_loss.item():.6f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only verify the committed fixtures")
    ap.add_argument("--only", help="one fixture")
    ap.add_argument("--out", type=Path, default=hf.DEFAULT_OUT)
    ap.add_argument("--trained", action="store_true",
                    help=f"only {TRAINED} (ferrolm's adapter): check that PEFT loads it and record its loss")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    if not a.trained:
        names = [a.only] if a.only else list(FIXTURES)
        for n in names:
            if not a.check:
                generate(n, FIXTURES[n], a.out)
            check(n, FIXTURES[n], a.out)
    if a.trained or (a.check and not a.only):
        trained(a.out, a.check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
