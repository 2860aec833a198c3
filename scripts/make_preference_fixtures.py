#!/usr/bin/env python3
"""Writes the preference tokenization fixtures with TRL's own code (the reference ferrolm matches).

For each preference record below (TRL's standard, conversational and implicit-prompt formats) it
runs TRL 1.x's `DPOTrainer._prepare_dataset` (prompt extraction, EOS appended to text
completions, tokenization, the prompt/completion split at the shorter common prefix, and the
`max_length` filter of prompts that fill it) on a one-row dataset, then TRL's
`DataCollatorForPreference` (the `max_length` truncation, `keep_start`), and records the prompt,
chosen and rejected ids the trainer would score, or that the pair is dropped.

The tokenizer is the chat fixtures' (data/tokenizer.json with the templates' special tokens added,
as scripts/chat_template_fixtures.py builds it; the Rust test builds the same one), with each
template's special tokens; the templates are the committed real ones of
crates/data/tests/fixtures/chat/templates/, ferrolm's bundled data/chat_template.jinja, and
`thinking`, written here: it renders the generation prompt with an empty think block that the
whole conversation does not have (as Qwen3 and Gemma 4 do), so the rendered prompt is not a
prefix of the whole. A standard prompt ending in a space is the other such case (the space
merges with the completion's first word).

Run from the repository root:  /work/pyenv/bin/python scripts/make_preference_fixtures.py
Needs trl 1.x (pip install trl), transformers, tokenizers, datasets.
Writes crates/data/tests/fixtures/preference/tokenization.json, and h4.parquet: preference rows
as HuggingFaceH4/ultrafeedback_binarized stores them (a `prompt` string beside `chosen` and
`rejected` whole conversations, list<struct<content, role>>, and columns no form reads), for the
Parquet path of the reader.
"""

import json
import os
import sys
from types import SimpleNamespace

import datasets
import trl
from datasets import Dataset
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast
from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chat_template_fixtures import ADDED_TOKENS, FIX as CHAT_FIX, TEMPLATES, build_tokenizer_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates/data/tests/fixtures/preference")

THINKING = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
# Standard records: the tokenizer's own BOS/EOS.
PLAIN_SPECIALS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}


def u(t):
    return {"role": "user", "content": t}


def a(t):
    return {"role": "assistant", "content": t}


def s(t):
    return {"role": "system", "content": t}


STANDARD = {
    "sky": {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    # The prompt's trailing space merges with the completion's first word: not a prefix.
    "space_boundary": {"prompt": "The sky is ", "chosen": "blue.", "rejected": "green, or so they say."},
    # A completion that already ends with EOS gets no second one.
    "eos_present": {"prompt": "Say hi.", "chosen": " Hi!<|eos|>", "rejected": " Go away."},
    "unicode": {"prompt": "Name a café drink ☕:", "chosen": " An espresso, with “crema”.", "rejected": " Tea?"},
}

CONVERSATIONAL = {
    "single": {"prompt": [u("What is the capital of France?")], "chosen": [a("Paris.")], "rejected": [a("Lyon, I think.")]},
    "system_multi": {
        "prompt": [s("You are terse."), u("2 + 2?"), a("4"), u("And 3 + 3?")],
        "chosen": [a("6")],
        "rejected": [a("Six, since three and three make six.")],
    },
}

IMPLICIT = {
    # UltraFeedback-binarized: two whole conversations sharing their start.
    "ultrafeedback": {
        "chosen": [u("What color is the sky?"), a("It is blue."), u("Why?"), a("Rayleigh scattering.")],
        "rejected": [u("What color is the sky?"), a("It is blue."), u("Why?"), a("It reflects the sea.")],
    },
}

IMPLICIT_TEXT = {
    # Anthropic HH: whole texts; the space before the difference goes to the completions.
    "hh": {
        "chosen": "\n\nHuman: What color is the sky?\n\nAssistant: It is blue.",
        "rejected": "\n\nHuman: What color is the sky?\n\nAssistant: It is green.",
    },
}


def tokenizer_for(specials, template):
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(TOKENIZER_JSON), **specials)
    if template is not None:
        tok.chat_template = template
    return tok


def trl_pair(tok, record, max_length):
    """What TRL's DPOTrainer scores for `record`: None when it drops it."""
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    trainer = SimpleNamespace(_tokenizer=tok)
    ds = DPOTrainer._prepare_dataset(trainer, Dataset.from_list([record]), tok, args, "train")
    if len(ds) == 0:
        return None
    row = ds[0]
    batch = DataCollatorForPreference(pad_token_id=0, max_length=max_length)(
        [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}]
    )
    seqs = []
    for i in range(2):
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i][:n].tolist()
        mask = batch["completion_mask"][i][:n].tolist()
        p = mask.index(1) if 1 in mask else n
        assert all(mask[p:]), mask
        seqs.append((ids[:p], ids[p:]))
    assert seqs[0][0] == seqs[1][0]
    return {"prompt": seqs[0][0], "chosen": seqs[0][1], "rejected": seqs[1][1]}


def case(name, template_name, record, max_length=None):
    if template_name is None:
        specials, source = PLAIN_SPECIALS, None
    else:
        specials, source = TEMPLATE_SPECIALS[template_name], TEMPLATE_SOURCES[template_name]
    tok = tokenizer_for(specials, source)
    got = trl_pair(tok, record, max_length)
    return {"name": name, "template": template_name, "max_length": max_length, "record": record, "expected": got}


def full_prompt_len(template_name, record):
    """The split prompt's length without truncation, to place the truncation cases."""
    specials = PLAIN_SPECIALS if template_name is None else TEMPLATE_SPECIALS[template_name]
    source = None if template_name is None else TEMPLATE_SOURCES[template_name]
    got = trl_pair(tokenizer_for(specials, source), record, None)
    return len(got["prompt"]), len(got["chosen"]), len(got["rejected"])


H4_ROWS = [
    {"prompt": "What color is the sky?", "prompt_id": "a1", **IMPLICIT["ultrafeedback"], "score_chosen": 8.0, "score_rejected": 3.5},
    {
        "prompt": "2 + 2?",
        "prompt_id": "b2",
        "chosen": [u("2 + 2?"), a("4")],
        "rejected": [u("2 + 2?"), a("5")],
        "score_chosen": 9.0,
        "score_rejected": 1.0,
    },
]


def write_parquet():
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
    schema = pa.schema([("prompt", pa.string()), ("prompt_id", pa.string()), ("chosen", msgs), ("rejected", msgs),
                        ("score_chosen", pa.float64()), ("score_rejected", pa.float64())])
    rows = [{**r, "chosen": [{"content": m["content"], "role": m["role"]} for m in r["chosen"]],
             "rejected": [{"content": m["content"], "role": m["role"]} for m in r["rejected"]]} for r in H4_ROWS]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), os.path.join(OUT, "h4.parquet"), compression="zstd")


def main():
    datasets.disable_progress_bars()
    global TOKENIZER_JSON, TEMPLATE_SOURCES, TEMPLATE_SPECIALS
    TOKENIZER_JSON = build_tokenizer_json()
    TEMPLATE_SOURCES, TEMPLATE_SPECIALS = {}, {}
    for name, (file, specials) in TEMPLATES.items():
        with open(os.path.join(CHAT_FIX, "templates", file)) as f:
            TEMPLATE_SOURCES[name] = f.read()
        TEMPLATE_SPECIALS[name] = specials
    TEMPLATE_SOURCES["thinking"] = THINKING
    TEMPLATE_SPECIALS["thinking"] = {"eos_token": "<|im_end|>"}

    cases = []
    for name, rec in STANDARD.items():
        cases.append(case(f"standard/{name}", None, rec))
    for tname in TEMPLATE_SOURCES:
        for name, rec in CONVERSATIONAL.items():
            cases.append(case(f"conversational/{name}/{tname}", tname, rec))
        for name, rec in IMPLICIT.items():
            cases.append(case(f"implicit/{name}/{tname}", tname, rec))
    for name, rec in IMPLICIT_TEXT.items():
        cases.append(case(f"implicit_text/{name}", None, rec))

    # Truncation: max_length cutting one completion, both, leaving one completion token, and
    # equal to the prompt's length (TRL drops the pair).
    for tname, rec in [("llama3.1_instruct", CONVERSATIONAL["system_multi"]), (None, STANDARD["space_boundary"])]:
        p, c, r = full_prompt_len(tname, rec)
        assert c != r, (c, r)
        for label, ml in [("cut_longer", p + min(c, r)), ("cut_both", p + min(c, r) - 1), ("one_token", p + 1),
                          ("prompt_fills", p), ("prompt_over", p - 1)]:
            cases.append(case(f"truncation/{label}/{tname or 'standard'}", tname, rec, ml))

    non_prefix = [c["name"] for c in cases if c["expected"] is not None and c["max_length"] is None
                  and len(c["expected"]["prompt"]) < full_rendered_prompt_len(c)]
    assert any(n.startswith("conversational/") and "thinking" in n for n in non_prefix), non_prefix
    assert "standard/space_boundary" in non_prefix, non_prefix

    doc = {
        "generated_by": "scripts/make_preference_fixtures.py",
        "trl_version": trl.__version__,
        "added_tokens": ADDED_TOKENS,
        "plain_special_tokens": PLAIN_SPECIALS,
        "templates": {n: {"source": TEMPLATE_SOURCES[n], "special_tokens": TEMPLATE_SPECIALS[n]} for n in TEMPLATE_SOURCES},
        "non_prefix_cases": non_prefix,
        "cases": cases,
    }
    os.makedirs(OUT, exist_ok=True)
    write_parquet()
    with open(os.path.join(OUT, "tokenization.json"), "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases ({sum(c['expected'] is None for c in cases)} dropped); not a prefix: {non_prefix}")


def full_rendered_prompt_len(c):
    """The length of the prompt tokenized alone (with the generation prompt), as TRL tokenizes it."""
    tname, rec = c["template"], c["record"]
    specials = PLAIN_SPECIALS if tname is None else TEMPLATE_SPECIALS[tname]
    tok = tokenizer_for(specials, None if tname is None else TEMPLATE_SOURCES[tname])
    from trl.data_utils import extract_prompt, is_conversational

    r = dict(rec) if "prompt" in rec else extract_prompt(rec)
    if is_conversational(r):
        return len(tok.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
    return len(tok(text=r["prompt"])["input_ids"])


if __name__ == "__main__":
    main()
