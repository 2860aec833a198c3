#!/usr/bin/env python3
"""Writes data/prefs.jsonl, the bundled preference file of the README's DPO example, from
data/chat.jsonl: one pair per conversation, in TRL's conversational preference format.

- `prompt`: the conversation up to its last assistant message (system, user and earlier
  assistant turns);
- `chosen`: that last assistant message, the conversation's own reply;
- `rejected`: the last reply of another conversation, drawn with a fixed seed (never the
  conversation's own, never the same text).

A model fine-tuned on data/chat.jsonl has seen the chosen replies in their context; preference
tuning teaches it to rank its own context's reply above a reply out of context, which a held-out
`rewards/accuracies` well above one half shows. The first PAIRS conversations are used, so the
file stays no larger than data/chat.jsonl. The same input always gives the same file.

    python3 scripts/make_prefs_data.py            # writes data/prefs.jsonl
    python3 scripts/make_prefs_data.py --check    # fails if the committed file differs

Standard library only. CI reads the file and never runs this script.
"""
import json
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAT = ROOT / "data" / "chat.jsonl"
OUT = ROOT / "data" / "prefs.jsonl"
PAIRS = 420
SEED = 52


def main() -> int:
    conversations = [json.loads(line)["messages"] for line in CHAT.read_text(encoding="utf-8").splitlines() if line.strip()]
    conversations = [m for m in conversations if m and m[-1]["role"] == "assistant"][:PAIRS]
    replies = [m[-1]["content"] for m in conversations]
    rng = random.Random(SEED)
    lines = []
    for i, messages in enumerate(conversations):
        while True:
            j = rng.randrange(len(conversations))
            if j != i and replies[j] != replies[i]:
                break
        pair = {
            "prompt": messages[:-1],
            "chosen": [{"role": "assistant", "content": replies[i]}],
            "rejected": [{"role": "assistant", "content": replies[j]}],
        }
        lines.append(json.dumps(pair, ensure_ascii=False))
    text = "\n".join(lines) + "\n"
    if "--check" in sys.argv[1:]:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} differs from what this script writes", file=sys.stderr)
            return 1
        print(f"{OUT}: up to date ({len(lines)} pairs)")
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}: {len(lines)} pairs, {len(text.encode())} bytes (data/chat.jsonl: {CHAT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
