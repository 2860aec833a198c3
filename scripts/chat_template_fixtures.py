#!/usr/bin/env python3
"""Renders the chat-template fidelity fixtures with transformers (the reference ferrolm matches).

For each committed real chat template (crates/data/tests/fixtures/chat/templates/, see SOURCES.md
there), ferrolm's bundled data/chat_template.jinja, and each conversation below, with
add_generation_prompt off and on, it records what `apply_chat_template` gives: the rendered text,
the token ids (rendered text tokenized without special tokens), and the assistant mask:
- templates with {% generation %} blocks: transformers' `return_assistant_tokens_mask`;
- the others: the rule of issue 42 written out here independently of the Rust code: the
  characters that rendering up to and including an assistant message adds beyond rendering up to
  the message before with add_generation_prompt=True (found in the whole rendering after the
  previous assistant message's when the shorter rendering is not a prefix of the whole); a token
  is an assistant token when its first character (its offset's start) is one of them. For an
  assistant message that opens the conversation, "up to the message before" is zero messages,
  rendered by the template itself (`opening_added`): BOS, a default system prompt and the role
  header are not trained. Where the template cannot render zero messages (most real ones read
  messages[0]), the message's characters are those after the longest common prefix of its
  rendering and the renderings of two lone probe assistant messages.
Masks are recorded for add_generation_prompt=False (what training renders).

The tokenizer is data/tokenizer.json with the templates' special tokens added as added tokens
(`added_tokens` below, ids after the vocabulary); the Rust test builds the same one.

It also writes records.parquet: chat records as Hugging Face datasets store them (a nested
`messages` column, list<struct<role, content>>, beside `prompt`/`completion` columns, null where a
row has another form), for the Parquet path of the chat reader.

Run from the repository root:  /work/pyvenv/bin/python scripts/chat_template_fixtures.py
Writes crates/data/tests/fixtures/chat/cases.json and records.parquet.
"""

import json
import os
import re

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "crates/data/tests/fixtures/chat")

ADDED_TOKENS = [
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "[INST]", "[/INST]",
]

# name -> (file, the special tokens its tokenizer_config.json names)
TEMPLATES = {
    "llama3.1_instruct": ("llama3.1_instruct.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2.5_instruct": ("qwen2.5_instruct.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "mistral_v0.3_instruct": ("mistral_v0.3_instruct.jinja", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "qwen2.5_training_trl": ("qwen2.5_training_trl.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    # ferrolm's bundled template (data/chat_template.jinja; the path is relative to templates/).
    "ferrolm_bundled": ("../../../../../../data/chat_template.jinja", {}),
}

CONVERSATIONS = {
    "single": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    "multi": [
        {"role": "user", "content": "Hello!  How are you?"},
        {"role": "assistant", "content": " I am fine, thanks.\n"},
        {"role": "user", "content": "Name a café drink ☕"},
        {"role": "assistant", "content": "An espresso: strong, with “crema”."},
    ],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"},
    ],
    # Content as a list of text parts: templates that print it print Python's repr of the list;
    # those that add it to a string fail (the case records the failure, and ferrolm must fail too).
    "parts": [
        {"role": "user", "content": [{"type": "text", "text": "Hi, it's me."}, {"type": "text", "text": " Again"}]},
        {"role": "assistant", "content": "Hello  "},
    ],
    # An assistant message first (ShareGPT data opening with a `gpt` turn): what comes before it
    # (BOS, a default system prompt, the role header) is not trained.
    "assistant_first": [
        {"role": "assistant", "content": "Hi! Ask me anything."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
    ],
    "system_assistant_first": [
        {"role": "system", "content": "You are terse."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "3 + 3?"},
        {"role": "assistant", "content": "6"},
    ],
}


def build_tokenizer_json():
    with open(os.path.join(ROOT, "data/tokenizer.json")) as f:
        tj = json.load(f)
    next_id = 1 + max(max(tj["model"]["vocab"].values()), max((t["id"] for t in tj["added_tokens"]), default=0))
    for tok in ADDED_TOKENS:
        tj["added_tokens"].append({"id": next_id, "content": tok, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True})
        next_id += 1
    return json.dumps(tj)


def added_chars(before, upto):
    """What `upto` adds beyond `before`: its rest after `before` when that is a prefix, else its
    rest after the longest tail of `before` found in it (first occurrence)."""
    if upto.startswith(before):
        return upto[len(before):]
    lo, hi = 0, len(before)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if before[len(before) - mid:] in upto:
            lo = mid
        else:
            hi = mid - 1
    assert lo > 0, (before, upto)
    tail = before[len(before) - lo:]
    return upto[upto.index(tail) + len(tail):]


def common_prefix_len(*texts):
    n = 0
    for chars in zip(*texts):
        if any(c != chars[0] for c in chars):
            break
        n += 1
    return n


# Two lone assistant messages that differ in their first character: where their renderings part
# is where an opening assistant message's own text starts.
PROBES = ("A", "B")


def opening_added(tok, template, specials, upto):
    """What an assistant message that opens the conversation adds: `upto` (its rendering) after
    the rendering of zero messages with add_generation_prompt=True, when the template renders
    that (transformers' apply_chat_template refuses an empty conversation; the template itself is
    asked) and it is a prefix of `upto`; otherwise after the longest common prefix of `upto` and
    the renderings of the lone probe messages."""
    try:
        rendered, _ = render_jinja_template([[]], chat_template=template, add_generation_prompt=True, **specials)
        before = rendered[0]
    except Exception:  # most real templates read messages[0]: Jinja2's UndefinedError
        before = None
    if before is not None and upto.startswith(before):
        return upto[len(before):]
    probes = [tok.apply_chat_template([{"role": "assistant", "content": p}], tokenize=False) for p in PROBES]
    return upto[common_prefix_len(upto, *probes):]


def prefix_rule_mask(tok, template, specials, msgs, full, offsets):
    def render(m, gen):
        return tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)

    spans, search_from = [], 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        upto = render(msgs[: i + 1], False)
        if i == 0:
            added = opening_added(tok, template, specials, upto)
        else:
            added = added_chars(render(msgs[:i], True), upto)
        if full.startswith(upto):
            span = (len(upto) - len(added), len(upto))
        else:
            at = full.index(added, search_from)
            span = (at, at + len(added))
        search_from = span[1]
        spans.append(span)
    return [int(any(s <= start < e for s, e in spans)) for start, _ in offsets]


def write_parquet():
    import pyarrow as pa
    import pyarrow.parquet as pq

    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    rows = [
        {"id": 0, "messages": CONVERSATIONS["single"], "prompt": None, "completion": None},
        {"id": 1, "messages": CONVERSATIONS["multi"], "prompt": None, "completion": None},
        {"id": 2, "messages": None, "prompt": "Say hi.", "completion": "Hi!"},
        {"id": 3, "messages": [{"role": "tool", "content": "42"}], "prompt": None, "completion": None},
        {"id": 4, "messages": CONVERSATIONS["system"], "prompt": None, "completion": None},
    ]
    schema = pa.schema([("id", pa.int64()), ("messages", pa.list_(msg)), ("prompt", pa.string()), ("completion", pa.string())])
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, os.path.join(FIX, "records.parquet"), row_group_size=2, compression="zstd")


# strftime_now under a fixed clock (transformers reads `datetime.now()` of its module).
CLOCK = (2024, 7, 26, 9, 5, 3)
CLOCK_TEMPLATE = "{{ strftime_now('%d %b %Y|%B %-d, %A %H:%M:%S|%y-%m-%dT%I%p %j') }}"


def clock_case():
    import datetime as real
    import transformers.utils.chat_template_utils as ctu

    class Fixed(real.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(*CLOCK)

    saved = ctu.datetime
    ctu.datetime = Fixed
    try:
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(build_tokenizer_json()))
        tok.chat_template = CLOCK_TEMPLATE
        text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    finally:
        ctu.datetime = saved
    return {"clock": list(CLOCK), "template": CLOCK_TEMPLATE, "text": text}


def main():
    try:
        write_parquet()
    except ImportError:
        print("pyarrow is not installed: records.parquet is left as it is")
    tokenizer_json = build_tokenizer_json()
    cases = []
    for name, (file, specials) in TEMPLATES.items():
        with open(os.path.join(FIX, "templates", file)) as f:
            template = f.read()
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), **specials)
        tok.chat_template = template
        has_generation = re.search(r"\{\%-?\s*generation\s*-?\%\}", template) is not None
        for conv_name, msgs in CONVERSATIONS.items():
            for gen in (False, True):
                try:
                    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                except Exception as e:  # jinja2's TypeError or TemplateError
                    cases.append({"template": name, "conversation": conv_name, "add_generation_prompt": gen, "error": str(e)})
                    continue
                out = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=True,
                                              return_assistant_tokens_mask=has_generation)
                ids = list(out["input_ids"])
                enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
                assert list(enc["input_ids"]) == ids
                case = {"template": name, "conversation": conv_name, "add_generation_prompt": gen, "text": text, "ids": ids}
                if not gen:
                    if has_generation:
                        case["assistant_mask"] = list(out["assistant_masks"])
                    else:
                        case["assistant_mask"] = prefix_rule_mask(tok, template, specials, msgs, text, enc["offset_mapping"])
                    assert any(case["assistant_mask"]), (name, conv_name)
                cases.append(case)
    doc = {
        "generated_by": "scripts/chat_template_fixtures.py",
        "added_tokens": ADDED_TOKENS,
        "templates": {n: {"file": f, "special_tokens": s} for n, (f, s) in TEMPLATES.items()},
        "conversations": CONVERSATIONS,
        "cases": cases,
        "strftime_now": clock_case(),
    }
    with open(os.path.join(FIX, "cases.json"), "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases")


if __name__ == "__main__":
    main()
