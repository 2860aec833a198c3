#!/usr/bin/env python3
"""Writes data/chat.jsonl, the bundled chat file of the README's fine-tuning example and the
end-to-end tests, from the bundled corpus: short exchanges of the plays' dialogue as
conversations in the `messages` form. A speech is a user turn and the next speaker's answer the
assistant's; a conversation is one to three such turns of one scene, and every third one opens
with a system message naming the play. Speeches are kept short (at most 120 characters, one to
three lines joined by spaces), so a model of a million parameters learns within a minute where
an answer ends. The same input always gives the same file (no randomness beyond a fixed seed).

    python3 scripts/make_chat_data.py            # writes data/chat.jsonl
    python3 scripts/make_chat_data.py --check    # fails if the committed file differs

Standard library only. The file is about 150 KB; CI reads it and never runs this script.
"""
import json
import pathlib
import random
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "corpus"
OUT = ROOT / "data" / "chat.jsonl"

# A speaker line: "Hor." or "FIRST WITCH." alone on its line.
SPEAKER = re.compile(r"^([A-Z][A-Za-z]*\.?(?: [A-Z][A-Za-z]*\.?)*)\.$")
MAX_CHARS = 120
CONVERSATIONS = 600


def title(path: pathlib.Path) -> str:
    return path.read_text(encoding="utf-8").strip().splitlines()[0].strip().title()


def speeches(text: str):
    """(speaker, speech) in order; None between scenes (a line starting "Scene" or "ACT")."""
    speaker, lines = None, []
    for raw in text.splitlines():
        line = raw.strip()
        if re.match(r"^(SCENE|Scene|ACT|Act)\b", line):
            if speaker and lines:
                yield speaker, " ".join(lines)
            yield None
            speaker, lines = None, []
            continue
        m = SPEAKER.match(line)
        if m and len(line) < 30:
            if speaker and lines:
                yield speaker, " ".join(lines)
            speaker, lines = m.group(1), []
        elif line and speaker and not line.startswith("["):
            lines.append(line)
        elif not line and speaker and lines:
            yield speaker, " ".join(lines)
            speaker, lines = None, []


def exchanges(path: pathlib.Path):
    """Runs of consecutive short speeches by alternating speakers within a scene."""
    run = []
    for s in speeches(path.read_text(encoding="utf-8")):
        if s is None or len(s[1]) > MAX_CHARS or (run and run[-1][0] == s[0]):
            if len(run) >= 2:
                yield run
            run = [] if s is None or len(s[1]) > MAX_CHARS else [s]
            continue
        run.append(s)
    if len(run) >= 2:
        yield run


def main() -> int:
    rng = random.Random(20261128)
    pool = []
    for path in sorted(CORPUS.glob("*.txt")):
        if path.stem == "sonnets":
            continue
        play = title(path)
        for run in exchanges(path):
            # Cut a long run into conversations of 1 to 3 user/assistant turns.
            i = 0
            while len(run) - i >= 2:
                turns = min(rng.randint(1, 3), (len(run) - i) // 2)
                pool.append((play, run[i : i + 2 * turns]))
                i += 2 * turns
    rng.shuffle(pool)
    lines = []
    for n, (play, run) in enumerate(pool[:CONVERSATIONS]):
        messages = []
        if n % 3 == 0:
            messages.append({"role": "system", "content": f"You speak as a character of {play}."})
        for k, (_, speech) in enumerate(run):
            messages.append({"role": "user" if k % 2 == 0 else "assistant", "content": speech})
        lines.append(json.dumps({"messages": messages}, ensure_ascii=False))
    text = "\n".join(lines) + "\n"
    if "--check" in sys.argv[1:]:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} differs from what this script writes", file=sys.stderr)
            return 1
        print(f"{OUT}: up to date ({len(lines)} conversations)")
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}: {len(lines)} conversations of {len(pool)} exchanges, {len(text.encode())} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
