#!/usr/bin/env python3
"""PyTorch's training trajectory for `pretrain_llama`: the committed fixtures in
tests/fixtures/trajectory/ that tests/trajectory.rs holds ferrolm's runs against.

For each case it trains transformers' `LlamaForCausalLM` with `torch.optim.AdamW` exactly as
`pretrain_llama` trains the same config, and writes the per-step losses and gradient norms and the
final weights' norms. Everything a run depends on is reproduced here from its definition, not
taken from ferrolm at run time:

- initial weights: ferrolm's `Rng` (SplitMix64, Box-Muller normals in f64, rounded to f32) drawn
  parameter by parameter in `Llama::visit_params_mut` order, matrices N(0, initializer_range),
  RMSNorm gains 1;
- batches: the token shards `prepare_data` makes of data/corpus/sonnets.txt (10% validation,
  2^20 tokens per shard: the tests' `common::shards`), cut into windows of seq_len + 1 at stride
  seq_len and visited in the loader's seeded Fisher-Yates order (crates/data/src/loader.rs);
- the schedule: linear warmup over min(steps / 10 + 1, 25) steps, cosine to lr / 10;
- decay groups: matrices (projections and an untied lm_head) decay 0.1, embeddings and norms 0;
- AdamW betas (0.9, 0.95), eps 1e-8; clipping at global norm 1.0 (torch's clip_grad_norm_);
- gradient accumulation: each micro-batch's mean loss divided by the number of micro-batches.

The shards are the one input made by ferrolm (`prepare_data`), because tokenizing is not what this
compares; the fixture records a fingerprint of the windows so a change of tokenizer or loader is
reported as such, not as a numerical drift.

Usage (from the repository root, with the fixtures venv of scripts/requirements-fixtures.txt):
    .venv/bin/python scripts/make_trajectory_fixtures.py            # writes the fixtures
    .venv/bin/python scripts/make_trajectory_fixtures.py --check    # compares with the committed ones
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "trajectory")
MASK = (1 << 64) - 1

# The cases. `config` is written as the run's config.json; `run` are pretrain_llama's flags.
CASES = {
    # Tied embeddings, GQA 4/2, two micro-batches per step.
    "tied_gqa_accum2": {
        "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "tie_word_embeddings": True, "initializer_range": 0.02},
        "run": {"steps": 60, "batch_size": 4, "seq_len": 32, "grad_accum": 2, "lr": 3e-3, "seed": 11},
    },
    # Untied, MQA-like GQA 4/1, three micro-batches per step, a higher rate: clipping is active.
    "untied_gqa_accum3": {
        "config": {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "tie_word_embeddings": False, "initializer_range": 0.05},
        "run": {"steps": 80, "batch_size": 2, "seq_len": 48, "grad_accum": 3, "lr": 6e-3, "seed": 5},
    },
}
WEIGHT_DECAY, GRAD_CLIP, BETAS, EPS = 0.1, 1.0, (0.9, 0.95), 1e-8


class Rng:
    """ferrolm_tensor::Rng."""

    def __init__(self, seed):
        self.state = (seed ^ 0x9E3779B97F4A7C15) & MASK

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def uniform(self):
        return (self.next_u64() >> 11) / float(1 << 53)

    def normal(self):
        u1 = 1.0 - self.uniform()
        u2 = self.uniform()
        return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def param_specs(c):
    """(name, shape, kind) in Llama::visit_params_mut order."""
    h, v, i = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    d = h // c["num_attention_heads"]
    qd, kvd = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h), "embedding")]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out += [
            (p + "self_attn.q_proj.weight", (qd, h), "matrix"),
            (p + "self_attn.k_proj.weight", (kvd, h), "matrix"),
            (p + "self_attn.v_proj.weight", (kvd, h), "matrix"),
            (p + "self_attn.o_proj.weight", (h, qd), "matrix"),
            (p + "mlp.gate_proj.weight", (i, h), "matrix"),
            (p + "mlp.up_proj.weight", (i, h), "matrix"),
            (p + "mlp.down_proj.weight", (h, i), "matrix"),
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
    out.append(("model.norm.weight", (h,), "norm"))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h), "matrix"))
    return out


def init_weights(c, seed):
    rng, std, out = Rng(seed), c["initializer_range"], {}
    for name, shape, kind in param_specs(c):
        n = int(np.prod(shape))
        if kind == "norm":
            vals = np.ones(n, dtype=np.float64)
        else:
            vals = np.array([rng.normal() * std for _ in range(n)], dtype=np.float64)
        out[name] = (torch.from_numpy(vals.astype(np.float32).reshape(shape)), kind)
    return out


def read_shard(path):
    with open(path, "rb") as f:
        head = f.read(32)
        magic, version, width, count = head[:8], *struct.unpack("<IIQ", head[8:24])
        assert magic == b"FRLMTOK\0" and version == 1, f"{path}: not a token shard"
        dt = {2: np.uint16, 4: np.uint32}[width]
        toks = np.frombuffer(f.read(count * width), dtype=dt).astype(np.int64)
        assert len(toks) == count, f"{path}: truncated"
        return toks


class Loader:
    """ferrolm_data::DataLoader (one rank)."""

    def __init__(self, shards, batch, seq, seed):
        self.shards, self.batch, self.seq, self.seed = shards, batch, seq, seed
        self.first = [0]
        for s in shards:
            n = (len(s) - 1) // seq if len(s) > seq else 0
            self.first.append(self.first[-1] + n)
        self.n = self.first[-1]
        self.epoch, self.cursor = 0, 0
        self.shuffle()

    def shuffle(self):
        state = (self.seed ^ ((self.epoch * 0xD1B54A32D192ED03) & MASK)) & MASK

        def next_u64():
            nonlocal state
            state = (state + 0x9E3779B97F4A7C15) & MASK
            z = state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
            return z ^ (z >> 31)

        next_u64()
        order = list(range(self.n))
        for i in range(self.n - 1, 0, -1):
            j = (next_u64() * (i + 1)) >> 64
            order[i], order[j] = order[j], order[i]
        self.order = order

    def window(self, w):
        s = max(k for k in range(len(self.shards)) if self.first[k] <= w)
        start = (w - self.first[s]) * self.seq
        return self.shards[s][start:start + self.seq + 1]

    def next_batch(self):
        rows = []
        for _ in range(self.batch):
            if self.cursor == self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self.shuffle()
            self.cursor += 1
            rows.append(self.window(self.order[self.cursor - 1]))
        w = np.stack(rows)
        return torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())


def lr_at(step, max_lr, steps):
    """ferrolm_nn::schedule::CosineSchedule with pretrain_llama's derived settings."""
    warmup, min_lr = min(steps // 10 + 1, 25), max_lr / 10.0
    if step < warmup:
        return max_lr * (step + 1) / warmup
    t = min((step - warmup) / max(steps - warmup, 1), 1.0)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * t))


def fingerprint(shards):
    """Windows count and a checksum of the token stream (catches a changed tokenizer or shard)."""
    h = 0
    for s in shards:
        for k in range(0, len(s), 4096):
            chunk = s[k:k + 4096]
            h = (h * 1000003 + int((chunk * (np.arange(len(chunk)) % 97 + 1)).sum())) % (1 << 61)
    return h


def prepare_shards(tmp):
    out = os.path.join(tmp, "shards")
    cmd = ["cargo", "run", "--release", "--quiet", "--example", "prepare_data", "--", "--input",
           os.path.join(ROOT, "data", "corpus", "sonnets.txt"), "--tokenizer", os.path.join(ROOT, "data", "tokenizer.json"),
           "--out", out, "--val-fraction", "0.1", "--shard-tokens", str(1 << 20), "--log-level", "warn"]
    subprocess.run(cmd, cwd=ROOT, check=True)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    train = [read_shard(os.path.join(out, n)) for n in manifest["train_shards"]]
    return train, manifest


def run_case(name, case, train, vocab):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = dict(case["config"])
    cfg.update({"vocab_size": vocab, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
                "model_type": "llama"})
    run = case["run"]
    hf = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    hf._attn_implementation = "eager"
    model = LlamaForCausalLM(hf).float()
    model.train()
    weights = init_weights(cfg, run["seed"])
    state = {n: t for n, (t, _) in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(m == "lm_head.weight" for m in missing) and cfg["tie_word_embeddings"] == bool(missing), missing
    params = dict(model.named_parameters())
    decay = [params[n] for n, (_, k) in weights.items() if k == "matrix"]
    no_decay = [params[n] for n, (_, k) in weights.items() if k != "matrix"]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=run["lr"], betas=BETAS, eps=EPS, foreach=False)
    loader = Loader(train, run["batch_size"], run["seq_len"], run["seed"])
    ordered = [params[n] for n in weights]
    losses, norms, lrs = [], [], []
    for step in range(run["steps"]):
        lr = lr_at(step, run["lr"], run["steps"])
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(run["grad_accum"]):
            x, y = loader.next_batch()
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            total += loss.item()
            (loss / run["grad_accum"]).backward()
        # The exact global norm (f64), then torch's clipping rule with it.
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in ordered))
        torch.nn.utils.clip_grad_norm_(ordered, GRAD_CLIP)
        opt.step()
        losses.append(total / run["grad_accum"])
        norms.append(norm)
        lrs.append(lr)
    final = {n: float(params[n].detach().double().norm()) for n in weights}
    clipped = sum(n > GRAD_CLIP for n in norms)
    print(f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {clipped}/{len(norms)} steps clipped")
    return {
        "config": cfg,
        "run": run,
        "optimizer": {"weight_decay": WEIGHT_DECAY, "grad_clip": GRAD_CLIP, "betas": list(BETAS), "eps": EPS},
        "losses": losses,
        "grad_norms": norms,
        "lrs": lrs,
        "final_weight_norms": final,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed fixtures instead of writing them")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        train, manifest = prepare_shards(tmp)
    data = {"train_tokens": manifest["train_tokens"], "checksum": fingerprint(train)}
    os.makedirs(OUT, exist_ok=True)
    bad = 0
    for name, case in CASES.items():
        fx = run_case(name, case, train, manifest["vocab_size"])
        fx["data"] = data
        fx["versions"] = {"torch": torch.__version__.split("+")[0], "transformers": __import__("transformers").__version__}
        path = os.path.join(OUT, f"{name}.json")
        text = json.dumps(fx, indent=1, sort_keys=True) + "\n"
        if args.check:
            old = json.load(open(path))
            worst = max(abs(a - b) / abs(b) for a, b in zip(fx["losses"], old["losses"]))
            print(f"{name}: max relative loss difference to the committed fixture {worst:.2e}")
            bad += worst > 1e-6
        else:
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote {path}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
