#!/usr/bin/env python3
"""Make tests/fixtures/tokenizer_files/: what transformers reads from the Hugging Face tokenizer
files ferrolm writes into a checkpoint (ferrolm::tokenizer_files), for tests/tokenizer_files.rs.

For each variant V, under tests/fixtures/tokenizer_files/V/:

  source/tokenizer.json   the training tokenizer:
                          ferrolm  ferrolm's own (train_tokenizer on the bundled corpus, 300 ids):
                                   ByteLevel + template "<|bos|> $A", <|eos|> ends documents
                          llama    the same vocabulary with Llama's names and template: "<s> $A",
                                   </s> ends documents
                          closed   a template that closes a document: "<s> $A </s>"
  checkpoint/             tokenizer.json, tokenizer_config.json, generation_config.json as
                          ferrolm writes them from the source (written by the Rust test with
                          FERROLM_WRITE_FIXTURES=1)
  expected.json           from transformers on checkpoint/: AutoTokenizer's ids of each prompt
                          with its default add_special_tokens=True, its bos/eos/pad ids, and
                          GenerationConfig's; a padded batch (padding=True) must work

Usage (from the repository root; /work/pyvenv or scripts/requirements-fixtures.txt):

    python scripts/make_tokenizer_fixtures.py

It runs `cargo run --example train_tokenizer` and `cargo test --test tokenizer_files` itself.
Rerunning gives the same files.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "tokenizer_files"
PROMPTS = [
    "Shall I compare thee to a summer's day?",
    "\n",
    " To be, or not to be: that is the question.",
    "O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father",
]


def run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)


def write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def renamed(tok: dict, names: dict[str, str], template: list[str]) -> dict:
    """`tok` with its special tokens renamed and a TemplateProcessing of `template` (single)."""
    t = copy.deepcopy(tok)
    for a in t["added_tokens"]:
        a["content"] = names.get(a["content"], a["content"])
    vocab = t["model"]["vocab"]
    for old, new in names.items():
        vocab[new] = vocab.pop(old)
    ids = {a["content"]: a["id"] for a in t["added_tokens"]}

    def piece(p: str, type_id: int):
        if p in ("$A", "$B"):
            return {"Sequence": {"id": p[1], "type_id": type_id}}
        return {"SpecialToken": {"id": p, "type_id": type_id}}

    single = [piece(p, 0) for p in template]
    pair = single + [piece(p.replace("$A", "$B"), 1) for p in template]
    specials = {p: {"id": p, "ids": [ids[p]], "tokens": [p]} for p in template if not p.startswith("$")}
    t["post_processor"] = {
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials},
        ],
    }
    return t


def sources() -> None:
    ferrolm = OUT / "ferrolm" / "source" / "tokenizer.json"
    ferrolm.parent.mkdir(parents=True, exist_ok=True)
    run(["cargo", "run", "--quiet", "--example", "train_tokenizer", "--", "--corpus", "data/corpus",
         "--vocab-size", "300", "--out", str(ferrolm)])
    tok = json.loads(ferrolm.read_text())
    llama = {"<|bos|>": "<s>", "<|eos|>": "</s>"}
    write_json(OUT / "llama" / "source" / "tokenizer.json", renamed(tok, llama, ["<s>", "$A"]))
    write_json(OUT / "closed" / "source" / "tokenizer.json", renamed(tok, llama, ["<s>", "$A", "</s>"]))


def expected(variant: str) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    ckpt = OUT / variant / "checkpoint"
    tok = AutoTokenizer.from_pretrained(ckpt)
    gen = GenerationConfig.from_pretrained(ckpt)
    input_ids = [tok(p)["input_ids"] for p in PROMPTS]
    batch = tok(PROMPTS, padding=True)
    lengths = [len(x) for x in input_ids]
    assert all(len(row) == max(lengths) for row in batch["input_ids"]), "padding=True pads every row"
    assert [sum(m) for m in batch["attention_mask"]] == lengths
    write_json(OUT / variant / "expected.json", {
        "transformers": __import__("transformers").__version__,
        "prompts": PROMPTS,
        "input_ids": input_ids,
        "tokenizer": {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id},
        "generation_config": {"bos_token_id": gen.bos_token_id, "eos_token_id": gen.eos_token_id,
                              "pad_token_id": gen.pad_token_id},
    })


def main() -> int:
    sources()
    run(["cargo", "test", "--quiet", "--test", "tokenizer_files", "transformers_reads_the_ids_ferrolm_feeds"],
        env={**os.environ, "FERROLM_WRITE_FIXTURES": "1"})
    for variant in ("ferrolm", "llama", "closed"):
        expected(variant)
    run(["cargo", "test", "--quiet", "--test", "tokenizer_files", "transformers_reads_the_ids_ferrolm_feeds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
