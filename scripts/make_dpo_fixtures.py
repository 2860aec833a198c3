"""Fixtures for the preference losses against TRL (tests/dpo_trl.rs).

A tiny Llama policy and a reference (the policy with its weights perturbed), made with
transformers and saved under tests/fixtures/dpo/{policy,reference}; fixed pre-tokenized pairs
(prompt, chosen, rejected ids); and, for each loss type, what TRL's own DPOTrainer code computes:
its `_compute_loss` (the concatenated [chosen; rejected] forward through TRL's fused LM head, the
loss, the metrics) is called on a trainer whose state is set by hand (no dataset, no tokenizer:
the batch is the collator's, built here), then `loss.backward()` gives every policy gradient.

    /work/pyenv/bin/python scripts/make_dpo_fixtures.py
"""
import json
import os
import types
from collections import defaultdict

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM
from trl import DPOTrainer
from trl.trainer.utils import add_fused_lm_head

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "dpo")
BETA = 0.1
LOSS_TYPES = ["sigmoid", "hinge", "ipo", "sigmoid_norm", "sft"]
# A mix, as TRL's loss_type list with loss_weights.
MIXES = [(["sigmoid", "sft"], [1.0, 0.5])]

PAIRS = [
    {"prompt": [1, 5, 9, 3], "chosen": [7, 8, 2], "rejected": [11, 2]},
    {"prompt": [1, 4], "chosen": [20, 21, 22, 23, 2], "rejected": [30, 2]},
    {"prompt": [1, 12, 13, 14, 15, 16], "chosen": [2], "rejected": [17, 18, 19, 2]},
]


def model(seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    m = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
    return m


def batch():
    """DataCollatorForPreference's batch: [chosen; rejected], right-padded with 0."""
    seqs = [p["prompt"] + p["chosen"] for p in PAIRS] + [p["prompt"] + p["rejected"] for p in PAIRS]
    comp = [[0] * len(p["prompt"]) + [1] * len(p["chosen"]) for p in PAIRS] + [
        [0] * len(p["prompt"]) + [1] * len(p["rejected"]) for p in PAIRS
    ]
    L = max(map(len, seqs))
    pad = lambda v: v + [0] * (L - len(v))
    return {
        "input_ids": torch.tensor([pad(s) for s in seqs]),
        "attention_mask": torch.tensor([pad([1] * len(s)) for s in seqs]),
        "completion_mask": torch.tensor([pad(c) for c in comp]),
    }


def trainer(policy, reference, loss_types, weights):
    t = object.__new__(DPOTrainer)
    t.model = policy
    t.ref_model = reference
    t.accelerator = Accelerator(cpu=True)
    t.args = types.SimpleNamespace(gradient_checkpointing=False, gradient_checkpointing_kwargs=None)
    t.beta = BETA
    t.precompute_ref_logps = False
    t.loss_types = loss_types
    t.loss_weights = weights
    t.ld_alpha = None
    t.f_divergence_type = "reverse_kl"
    t.f_alpha_divergence_coef = 1.0
    t.use_weighting = False
    t.aux_loss_enabled = False
    t.router_aux_loss_coef = 0.0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._total_train_tokens = 0
    t._tp_size = 1
    return t


def main():
    os.makedirs(OUT, exist_ok=True)
    policy, reference = model(0), model(1)
    policy.save_pretrained(os.path.join(OUT, "policy"), safe_serialization=True)
    reference.save_pretrained(os.path.join(OUT, "reference"), safe_serialization=True)
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    add_fused_lm_head(policy, outputs=outputs)
    add_fused_lm_head(reference)
    policy.train()
    reference.eval()
    cases = {}
    for types_, weights in [([t], [1.0]) for t in LOSS_TYPES] + MIXES:
        policy.zero_grad(set_to_none=True)
        tr = trainer(policy, reference, types_, weights)
        loss = tr._compute_loss(policy, batch(), return_outputs=False)
        loss.backward()
        m = {k: v[-1] for k, v in tr._metrics["train"].items() if k.startswith(("rewards/", "logps/"))}
        # f32 values: nine significant digits keep every bit.
        grads = {n: [float(f"{x:.9g}") for x in p.grad.detach().flatten().tolist()] for n, p in policy.named_parameters() if p.grad is not None}
        name = ",".join(types_)
        cases[name] = {"loss_type": name, "loss_weights": weights, "loss": loss.item(), "metrics": m, "grads": grads}
        print(f"{name}: loss {loss.item():.6f} {m}")
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump({"beta": BETA, "pairs": PAIRS, "cases": cases, "trl": __import__("trl").__version__}, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
