#!/usr/bin/env python3
"""Sliding-window attention reference for crates/ops/tests/window.rs, made by transformers itself.

For small random q, k, v (float32, fixed seed) and several windows w, the attention output of
transformers' Mistral eager attention (`modeling_mistral.eager_attention_forward`, the one
Qwen2 shares) under the mask that `masking_utils.create_sliding_window_causal_mask` builds for a
`MistralConfig(sliding_window=w)`: query i sees key j when i - w < j <= i. Batch row 0 is one
sequence; row 1 packs three (its position_ids restart at 0, which transformers turns into a
packed-sequence mask), so the window must count inside each sequence. For one window the
gradients of sum(o * g) with respect to q, k, v come too (torch autograd).

Output: crates/ops/tests/fixtures/sliding_window.txt, one tensor a line,
`name dim.. : v v ..` (f32 as %.9g, row-major), after `#` comment lines. Byte-identical on rerun.
Run: /work/pyenv/bin/python scripts/make_window_fixture.py  (torch, transformers 5.x)
"""
import os

import torch
import transformers
from transformers import MistralConfig
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.mistral.modeling_mistral import eager_attention_forward

B, HQ, HKV, T, D = 2, 4, 2, 12, 8
WINDOWS = [1, 2, 5, T - 1, T, T + 8]
GRAD_WINDOW = 5
# position_ids: row 0 one sequence of T, row 1 sequences of 5, 1 and 6 tokens
POSITIONS = [list(range(T)), list(range(5)) + [0] + list(range(6))]
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "ops", "tests", "fixtures", "sliding_window.txt")


class Module(torch.nn.Module):
    """What eager_attention_forward reads from the attention module."""

    def __init__(self):
        super().__init__()
        self.num_key_value_groups = HQ // HKV
        self.train(False)


def attention(q, k, v, w):
    cfg = MistralConfig(sliding_window=w, num_attention_heads=HQ, num_key_value_heads=HKV, hidden_size=HQ * D, head_dim=D)
    cfg._attn_implementation = "eager"
    embeds = torch.zeros(B, T, HQ * D)
    mask = create_sliding_window_causal_mask(
        config=cfg,
        inputs_embeds=embeds,
        attention_mask=None,
        past_key_values=None,
        position_ids=torch.tensor(POSITIONS),
        allow_is_causal_skip=False,
    )
    o, _ = eager_attention_forward(Module(), q, k, v, mask, scaling=D**-0.5)
    return o.transpose(1, 2)  # eager returns (b, t, h, d): back to (b, h, t, d)


def line(name, x):
    x = x.detach().contiguous().to(torch.float32)
    return f"{name} {' '.join(map(str, x.shape))} : {' '.join('%.9g' % v for v in x.flatten().tolist())}\n"


def main():
    torch.manual_seed(51)
    q, k, v = torch.randn(B, HQ, T, D), torch.randn(B, HKV, T, D), torch.randn(B, HKV, T, D)
    g = torch.randn(B, HQ, T, D)
    out = [
        "# Sliding-window attention by transformers (scripts/make_window_fixture.py): Mistral eager attention\n",
        f"# under create_sliding_window_causal_mask; torch {torch.__version__}, transformers {transformers.__version__}.\n",
        f"# b {B} hq {HQ} hkv {HKV} t {T} d {D}, scale d^-0.5; positions: row 1 packs sequences of 5, 1, 6.\n",
        line("positions", torch.tensor(POSITIONS, dtype=torch.float32)),
        line("q", q),
        line("k", k),
        line("v", v),
        line("g", g),
    ]
    for w in WINDOWS:
        out.append(line(f"o_w{w}", attention(q, k, v, w)))
    qs, ks, vs = (x.clone().requires_grad_(True) for x in (q, k, v))
    (attention(qs, ks, vs, GRAD_WINDOW) * g).sum().backward()
    for name, x in (("dq", qs), ("dk", ks), ("dv", vs)):
        out.append(line(f"{name}_w{GRAD_WINDOW}", x.grad))
    with open(OUT, "w") as f:
        f.writelines(out)
    print(f"wrote {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
