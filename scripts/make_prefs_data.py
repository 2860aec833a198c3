#!/usr/bin/env python3
"""Writes data/prefs.jsonl, the bundled preference file of the README's DPO example, and
data/prefs_val.jsonl, its held-out pairs, from data/chat.jsonl: one pair per conversation, in
TRL's conversational preference format.

- `prompt`: the conversation up to its last assistant message (system, user and earlier
  assistant turns);
- `chosen`: that last assistant message, the conversation's own reply;
- `rejected`: the last reply of another conversation, drawn with a fixed seed (never the
  conversation's own, never the same text).

Preference tuning on these pairs teaches a model to rank a conversation's own reply above one
out of context; a held-out `rewards/accuracies` above one half shows what carried to
conversations it was not tuned on (docs/PREFERENCE.md, "What the bundled pairs teach": at the
README's size, little). The first PAIRS conversations make data/prefs.jsonl, so the file stays no
larger than data/chat.jsonl.

data/prefs_val.jsonl is made the same way from the other conversations (PAIRS + 1 to the last,
less those whose reply is also a training reply), its rejected replies drawn only among them. A
split of data/prefs.jsonl itself would not be held out: its held-out pairs' rejected replies are
training pairs' chosen ones, which preference tuning has just raised in their own context, and a
held-out accuracy below one half is what such a split measured. The same input always gives the
same files.

    python3 scripts/make_prefs_data.py            # writes data/prefs.jsonl and data/prefs_val.jsonl
    python3 scripts/make_prefs_data.py --check    # fails if a committed file differs

Standard library only. CI reads the files and never runs this script.
"""
import json
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAT = ROOT / "data" / "chat.jsonl"
OUT = ROOT / "data" / "prefs.jsonl"
VAL_OUT = ROOT / "data" / "prefs_val.jsonl"
PAIRS = 420
SEED = 52
VAL_SEED = 53


def pairs(conversations, seed: int) -> str:
    """One pair per conversation, each rejected reply another of these conversations' reply."""
    replies = [m[-1]["content"] for m in conversations]
    rng = random.Random(seed)
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
    return "\n".join(lines) + "\n"


def main() -> int:
    conversations = [json.loads(line)["messages"] for line in CHAT.read_text(encoding="utf-8").splitlines() if line.strip()]
    conversations = [m for m in conversations if m and m[-1]["role"] == "assistant"]
    # The held-out conversations whose reply is also a training reply (a line the plays repeat)
    # are left out, so no held-out reply, chosen or rejected, was trained on in any context.
    trained = {m[-1]["content"] for m in conversations[:PAIRS]}
    held_out = [m for m in conversations[PAIRS:] if m[-1]["content"] not in trained]
    files = [(OUT, pairs(conversations[:PAIRS], SEED)), (VAL_OUT, pairs(held_out, VAL_SEED))]
    if "--check" in sys.argv[1:]:
        stale = [path for path, text in files if not path.exists() or path.read_text(encoding="utf-8") != text]
        for path in stale:
            print(f"{path} differs from what this script writes", file=sys.stderr)
        if stale:
            return 1
        for path, text in files:
            print(f"{path}: up to date ({text.count(chr(10))} pairs)")
        return 0
    for path, text in files:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}: {text.count(chr(10))} pairs, {len(text.encode())} bytes")
    print(f"(data/chat.jsonl: {CHAT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
