#!/usr/bin/env python3
"""Writes the two small local tasks of this folder for EleutherAI's lm-evaluation-harness, from
the bundled corpus, so the harness runs offline on a ferrolm checkpoint (docs/EVALUATION.md):

- ferrolm_sonnet_lines.jsonl: multiple choice: a line of a sonnet, then its true next line
  among three next lines taken from other sonnets (accuracy; chance is 0.25);
- ferrolm_sonnets_ppl.jsonl: sonnets scored whole (loglikelihood_rolling: word and byte
  perplexity, bits per byte).

    python scripts/lm_eval/make_tasks.py
"""
import json
import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent
CORPUS = HERE.parent.parent / "data" / "corpus" / "sonnets.txt"


def sonnets():
    blocks = [b.strip("\n") for b in CORPUS.read_text(encoding="utf-8").split("\n\n")]
    # A sonnet is a block of 14 (sometimes 12 or 15) indented verse lines.
    return [[l.strip() for l in b.splitlines()] for b in blocks if len(b.splitlines()) >= 12]


def main():
    rng = random.Random(0)
    poems = sonnets()
    items = []
    for i in rng.sample(range(len(poems)), 40):
        lines = poems[i]
        k = rng.randrange(len(lines) - 1)
        others = [poems[j] for j in rng.sample(range(len(poems)), 4) if j != i][:3]
        choices = [lines[k + 1]] + [o[min(k + 1, len(o) - 1)] for o in others]
        rng.shuffle(choices)
        items.append({"context": lines[k], "choices": choices, "label": choices.index(lines[k + 1])})
    with open(HERE / "ferrolm_sonnet_lines.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(x) + "\n" for x in items)
    with open(HERE / "ferrolm_sonnets_ppl.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": "\n".join(p)}) + "\n" for p in poems[-20:])
    print(f"wrote {len(items)} multiple-choice items and 20 sonnets under {HERE}")


if __name__ == "__main__":
    main()
