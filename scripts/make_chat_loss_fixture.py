#!/usr/bin/env python3
"""Writes tests/fixtures/chat_loss/: a tiny Llama on the bundled tokenizer, a chat template with
`{% generation %}` blocks, a few conversations, and transformers' loss on them with labels -100
outside the assistant tokens, each conversation scored alone (no packing, no padding).
`eval --model DIR --chat FILE` must give the same loss (rel 1e-5 in f32) over the same number of
tokens (tests/chat_eval.rs).

How transformers scores a conversation here, exactly:
  enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True)
  labels = [id if in_assistant else -100 for id, in_assistant in zip(ids, mask)]
  out = model(input_ids, labels=labels)        # shifts internally: logits[t] predicts labels[t+1]
  sum_ce = out.loss * count, count = labels[1:] != -100
The file's loss is sum(sum_ce) / sum(count) over the conversations, in float64 from the float32
per-conversation means; `tokens` is sum(count).

Files (do not edit by hand; rerunning gives the same bytes):
  config.json, generation_config.json   as save_pretrained writes them
  model.safetensors                     bf16 (loads exactly into f32; keeps the file ~140 KB)
  tokenizer_config.json                 bos/eos, as save_pretrained writes them for
                                        data/tokenizer.json (which the test copies in)
  chat_template.jinja                   the chat template, where transformers 5 saves it
  chat.jsonl                            the conversations, in the `messages` form
  expected.json                         {"loss", "tokens", "per_conversation": [{"sum", "count"}]}

    /work/pyvenv/bin/python scripts/make_chat_loss_fixture.py
"""
import json
import pathlib
import shutil
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat_loss"
TOKENIZER = ROOT / "data" / "tokenizer.json"

# ChatML's shape on the bundled tokenizer's two special tokens, with the assistant's text and
# its end of turn inside {% generation %}: transformers' assistant mask covers exactly those.
TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- bos_token + 'assistant\\n' }}{% generation %}{{- message['content'] | trim + eos_token }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- bos_token + message['role'] + '\\n' + message['content'] | trim + eos_token + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- bos_token + 'assistant\\n' }}{%- endif %}"
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
        {"role": "user", "content": "Sit down awhile."},
        {"role": "assistant", "content": "Well, sit we down, And let us hear Bernardo speak of this."},
    ],
    [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "  Peace, break thee off; look where it comes again!  "},
        {"role": "assistant", "content": "In the same figure, like the king that's dead.\n"},
    ],
]


def main() -> None:
    torch.manual_seed(42)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(0.5 * torch.randn_like(p))  # logits spread well beyond uniform
            else:
                p.copy_(0.2 * torch.randn_like(p))
            # Rounded to bf16 once, so the stored bf16 file is exactly the model scored below.
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.eval()

    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), bos_token="<|bos|>", eos_token="<|eos|>")
    tok.chat_template = TEMPLATE

    per = []
    for messages in CONVERSATIONS:
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids = enc["input_ids"]
        labels = [i if m else -100 for i, m in zip(ids, enc["assistant_masks"])]
        count = sum(1 for l in labels[1:] if l != -100)
        with torch.no_grad():
            out = model(torch.tensor([ids]), labels=torch.tensor([labels]))
        per.append({"sum": float(out.loss) * count, "count": count, "ids": len(ids)})
    total = sum(p["count"] for p in per)
    loss = sum(p["sum"] for p in per) / total

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(OUT, safe_serialization=True)
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        for name in ["tokenizer_config.json", "chat_template.jinja"]:
            shutil.copy(pathlib.Path(d) / name, OUT / name)
    with open(OUT / "chat.jsonl", "w", encoding="utf-8") as f:
        for messages in CONVERSATIONS:
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    expected = {"loss": loss, "tokens": total, "per_conversation": per}
    (OUT / "expected.json").write_text(json.dumps(expected, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {OUT}: loss {loss:.6f} over {total} assistant tokens")


if __name__ == "__main__":
    main()
