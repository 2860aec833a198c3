#!/usr/bin/env python3
"""Generate the PyTorch reference of the model families' element-wise ops (issue 51) for
crates/ops/tests/torch_fixtures.rs, which compares ferrolm-ops against it without Python:

  geglu     y = gelu(gate, approximate="tanh") * up (Gemma 3's MLP, gelu_pytorch_tanh), with the
            gradients of gate and up for a cotangent dy
  gemma_rms transformers' own Gemma3RMSNorm (x / rms(x) * (1 + w), computed in f32 and cast at
            the end), with dx and dw
  softcap   cap * tanh(x / cap), cap 30 (Gemma's final_logit_softcapping), with dx
  linear    torch.nn.functional.linear(x, w, b) (Qwen2's q/k/v bias), with dx, dw and db

each in f32 and in bf16 (inputs rounded to bf16, the module and the op run in bf16 as a bf16
model runs them). Output: crates/ops/tests/fixtures/model_ops.txt, one tensor a line:

    <case>.<dtype>.<tensor> <dims, comma-separated> <values, as exact decimal f32/bf16 values>

Usage (environment: scripts/requirements-fixtures.txt):

    .venv/bin/python scripts/make_ops_fixtures.py            # regenerate
    .venv/bin/python scripts/make_ops_fixtures.py --check    # recompute, compare with the file
"""
import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/ops/tests/fixtures/model_ops.txt"


def leaf(t, dt):
    return t.to(dt).detach().requires_grad_(True)


def cases():
    g = torch.Generator().manual_seed(51)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

    base = {
        "geglu": (randn(4, 24, scale=2.0), randn(4, 24), randn(4, 24)),
        "gemma_rms": (randn(3, 2, 40), randn(40, scale=0.5), randn(3, 2, 40)),
        "softcap": (randn(5, 33, scale=25.0), randn(5, 33)),
        "linear": (randn(2, 3, 8), randn(6, 8), randn(6), randn(2, 3, 6)),
    }
    out = []
    for name, dt in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
        gate, up, dy = (leaf(t, dt) for t in base["geglu"])
        y = F.gelu(gate, approximate="tanh") * up
        y.backward(dy)
        out += [(f"geglu.{name}.{k}", v) for k, v in [("gate", gate), ("up", up), ("dy", dy), ("y", y), ("dgate", gate.grad), ("dup", up.grad)]]

        x, w, dy = base["gemma_rms"]
        norm = Gemma3RMSNorm(40, eps=1e-6).to(dt)
        with torch.no_grad():
            norm.weight.copy_(w.to(dt))
        x, dy = leaf(x, dt), dy.to(dt)
        y = norm(x)
        assert y.dtype == dt
        y.backward(dy)
        out += [(f"gemma_rms.{name}.{k}", v) for k, v in [("x", x), ("w", norm.weight), ("dy", dy), ("y", y), ("dx", x.grad), ("dw", norm.weight.grad)]]

        x, dy = (leaf(t, dt) for t in base["softcap"])
        cap = 30.0
        y = cap * torch.tanh(x / cap)
        y.backward(dy)
        out += [(f"softcap.{name}.{k}", v) for k, v in [("x", x), ("dy", dy), ("y", y), ("dx", x.grad)]]

        x, w, b, dy = (leaf(t, dt) for t in base["linear"])
        y = F.linear(x, w, b)
        y.backward(dy)
        out += [(f"linear.{name}.{k}", v) for k, v in [("x", x), ("w", w), ("b", b), ("dy", dy), ("y", y), ("dx", x.grad), ("dw", w.grad), ("db", b.grad)]]
    return out


def render(items):
    lines = []
    for key, t in items:
        t = t.detach().float().contiguous()
        dims = ",".join(str(d) for d in t.shape)
        vals = " ".join(repr(float(v)) for v in t.flatten().tolist())
        lines.append(f"{key} {dims} {vals}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="recompute and compare with the committed file instead of writing it")
    args = ap.parse_args()
    text = render(cases())
    if args.check:
        if OUT.read_text() != text:
            sys.exit(f"{OUT} differs from what torch {torch.__version__} computes: regenerate it")
        print(f"{OUT}: up to date")
        return
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text)} bytes)")


if __name__ == "__main__":
    main()
