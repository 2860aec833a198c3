#!/usr/bin/env python3
"""Make tests/fixtures/source_files/: a tiny Mistral-like chat model as transformers saves it, for
tests/source_files.rs (issue 50, items 9 and 10): a fine-tune must keep its source's tokenizer
files, special tokens, config keys and weight dtype as they were.

  model/config.json            LlamaConfig as save_pretrained writes it, bos_token_id 0,
                               eos_token_id 1, pad_token_id 1 (a key ferrolm does not model)
  model/generation_config.json bos 0, eos 1, pad 1
  model/model.safetensors      bf16 weights (dtype "bfloat16")
  model/tokenizer.json         tests/fixtures/tokenizer_files/llama/source/tokenizer.json
                               (300 ids, <s> id 0, </s> id 1, post-processor "<s> $A")
  in_config/                   the tokenizer's own files with the chat template in
                               tokenizer_config.json (save_pretrained(save_jinja_files=False))
  in_jinja/                    the same with the template in chat_template.jinja
  V/expected.json              AutoTokenizer.from_pretrained(model + V).apply_chat_template of
                               CONVERSATIONS: the text with add_generation_prompt False and True,
                               and the ids of the first (tokenize=True)
  conversations.jsonl          CONVERSATIONS in the `messages` form (the test trains on them)

A source directory is model/ plus one of in_config/, in_jinja/. Rerunning gives the same files.

    /work/pyenv/bin/python scripts/make_source_files_fixtures.py
"""
import json
import pathlib
import shutil
import tempfile

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "source_files"
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer_files" / "llama" / "source" / "tokenizer.json"

# Mistral's [INST] shape, with a system turn folded into the first user turn.
TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] + '\\n\\n' %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first %}{{- '[INST] ' + system + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('roles are system, user, assistant') }}{%- endif %}"
    "{%- endfor %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Who's there?"}, {"role": "assistant", "content": "Nay, answer me: stand, and unfold yourself."}],
    [
        {"role": "system", "content": "You speak as a character of Hamlet."},
        {"role": "user", "content": "Long live the king!"},
        {"role": "assistant", "content": "Bernardo?"},
        {"role": "user", "content": "He."},
        {"role": "assistant", "content": "You come most carefully upon your hour."},
    ],
    [
        {"role": "user", "content": "What, has this thing appear'd again to-night?"},
        {"role": "assistant", "content": "I have seen nothing."},
        {"role": "user", "content": "Horatio says 'tis but our fantasy."},
        {"role": "assistant", "content": "Tush, tush, 'twill not appear."},
    ],
    [{"role": "user", "content": "Sit down awhile."}, {"role": "assistant", "content": "And let us once again assail your ears."}],
]


def write_json(path: pathlib.Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def model() -> None:
    torch.manual_seed(7)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        rms_norm_eps=1e-5,
    )
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        m.save_pretrained(tmp, safe_serialization=True)
        dst = OUT / "model"
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy(pathlib.Path(tmp) / name, dst / name)
    shutil.copy(TOKENIZER, OUT / "model" / "tokenizer.json")


def tokenizer(variant: str, jinja: bool) -> None:
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), bos_token="<s>", eos_token="</s>")
    tok.chat_template = TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp, save_jinja_files=jinja)
        dst = OUT / variant
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        for f in sorted(pathlib.Path(tmp).iterdir()):
            if f.name != "tokenizer.json":  # model/ holds it (the same bytes)
                shutil.copy(f, dst / f.name)
    assert (dst / "chat_template.jinja").is_file() == jinja, variant


def expected(variant: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for src in (OUT / "model", OUT / variant):
            for f in src.iterdir():
                if f.name != "expected.json":
                    shutil.copy(f, pathlib.Path(tmp) / f.name)
        tok = AutoTokenizer.from_pretrained(tmp)
        assert tok.bos_token == "<s>" and tok.bos_token_id == 0, (tok.bos_token, tok.bos_token_id)
        renders = [
            {
                "text": tok.apply_chat_template(c, tokenize=False),
                "prompt": tok.apply_chat_template(c[:-1], tokenize=False, add_generation_prompt=True),
            }
            for c in CONVERSATIONS
        ]
        assert all(r["text"].startswith("<s>[INST] ") for r in renders)
        ids = tok.apply_chat_template(CONVERSATIONS[0], tokenize=True, return_dict=True)["input_ids"]
    write_json(OUT / variant / "expected.json", {
        "transformers": __import__("transformers").__version__,
        "renders": renders,
        "ids_0": list(ids),
    })


def main() -> None:
    model()
    tokenizer("in_config", jinja=False)
    tokenizer("in_jinja", jinja=True)
    for variant in ("in_config", "in_jinja"):
        expected(variant)
    with open(OUT / "conversations.jsonl", "w") as f:
        for c in CONVERSATIONS:
            f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
