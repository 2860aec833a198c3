#!/usr/bin/env python3
"""Check that a checkpoint written by ferrolm loads in Hugging Face transformers and gives the
same loss that ferrolm reported.

usage:
  check_hf_roundtrip.py DIR                      ids + loss from DIR/roundtrip_ids.json
  check_hf_roundtrip.py DIR --ids 5 17 3 9 ...   one sequence of token ids (repeatable)
  check_hf_roundtrip.py DIR --ids-file F.json    {"input_ids": [[...], ...], "loss": x}
  check_hf_roundtrip.py DIR --text FILE          tokenise FILE with DIR/tokenizer.json
  options: --loss X (ferrolm's loss, overrides the file's), --rtol R (default 1e-4),
           --require-loss (fail if there is no ferrolm loss to compare with)

DIR holds config.json and model.safetensors (or model.safetensors.index.json + shards), and is
loaded with AutoModelForCausalLM.from_pretrained(DIR, dtype=float32) (torch_dtype= on old
transformers): the class of its model_type (llama, qwen2, qwen3, mistral, gemma3_text); a Ladder
checkpoint (model_type llamaLadder) with trust_remote_code=True, through the modelling files
ferrolm writes beside it. Missing or unexpected tensor names are an error (HF would otherwise silently
initialise them randomly).

DIR/roundtrip_ids.json (written by ferrolm):
  {"input_ids": [[int, ...], ...], "loss": float, "labels": [[int, ...], ...] (optional)}
Rows may have different lengths. Without "labels", labels = input_ids.

Loss convention (same as HF LlamaForCausalLM and tests/fixtures/README.md): position t's logits
predict labels[t+1]; positions whose label is -100 are ignored; the loss is the mean token
cross-entropy over all counted positions of all rows (token-weighted, not a mean of row means),
computed in float64 from float32 logits.

Exit status: 0 if |hf - ferrolm| / max(|ferrolm|, 1e-12) <= rtol (or no ferrolm loss given and
--require-loss not set), 1 if the losses differ, 2 on usage / loading errors.

Environment: see scripts/requirements-fixtures.txt, e.g.
  .venv/bin/python scripts/check_hf_roundtrip.py runs/export
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

USAGE_EXIT = 2
IGNORE = -100


def fail(msg: str) -> "NoReturn":  # noqa: F821
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(USAGE_EXIT)


def load_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        fail(f"cannot read {path}: {e}")
    if not isinstance(data, dict) or "input_ids" not in data:
        fail(f"{path}: expected an object with \"input_ids\": [[...], ...]")
    return data


def as_rows(x, what: str) -> list[list[int]]:
    if isinstance(x, list) and x and all(isinstance(v, int) for v in x):
        x = [x]  # a single flat sequence
    if (not isinstance(x, list) or not x or
            not all(isinstance(r, list) and all(isinstance(v, int) for v in r) for r in x)):
        fail(f"{what}: expected a non-empty list of lists of ints")
    return x


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="check_hf_roundtrip.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("DIR holds"):],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("dir", type=Path, metavar="DIR", help="checkpoint directory written by ferrolm")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--ids", type=int, nargs="+", action="append", metavar="ID",
                     help="token ids of one sequence; repeat --ids for more rows")
    src.add_argument("--ids-file", type=Path, metavar="FILE",
                     help="JSON like roundtrip_ids.json (default: DIR/roundtrip_ids.json)")
    src.add_argument("--text", type=Path, metavar="FILE",
                     help="text file, tokenised with DIR/tokenizer.json (one row)")
    ap.add_argument("--loss", type=float, help="loss reported by ferrolm (overrides the file's)")
    ap.add_argument("--rtol", type=float, default=1e-4, help="max relative difference (default 1e-4)")
    ap.add_argument("--require-loss", action="store_true",
                    help="exit 2 if no ferrolm loss is available to compare with")
    args = ap.parse_args()

    d: Path = args.dir
    if not (d / "config.json").is_file():
        fail(f"{d}/config.json not found")
    if not any((d / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")):
        fail(f"{d} has neither model.safetensors nor model.safetensors.index.json")

    ref_loss = None
    labels = None
    if args.ids:
        rows = args.ids
    elif args.text:
        tok_path = d / "tokenizer.json"
        if not tok_path.is_file():
            fail(f"--text needs {tok_path} (or pass --ids)")
        from tokenizers import Tokenizer
        rows = [Tokenizer.from_file(str(tok_path)).encode(args.text.read_text(), add_special_tokens=False).ids]
    else:
        path = args.ids_file or (d / "roundtrip_ids.json")
        if not path.is_file():
            fail(f"{path} not found; give --ids, --ids-file or --text")
        data = load_json(path)
        rows = as_rows(data["input_ids"], f"{path}: input_ids")
        if data.get("labels") is not None:
            labels = as_rows(data["labels"], f"{path}: labels")
            if [len(r) for r in labels] != [len(r) for r in rows]:
                fail(f"{path}: labels and input_ids have different shapes")
        if data.get("loss") is not None:
            ref_loss = float(data["loss"])
    if args.loss is not None:
        ref_loss = args.loss
    if labels is None:
        labels = rows
    if any(len(r) < 2 for r in rows):
        fail("every sequence needs at least 2 tokens")

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    kw = dict(output_loading_info=True, attn_implementation="eager")
    # The family's class by model_type (llama, qwen2, qwen3, mistral, gemma3_text); a Ladder
    # checkpoint (llamaLadder) carries its modelling code beside the weights
    # (configuration_llama_ladder.py, modeling_llama_ladder.py), which auto_map names.
    if json.loads((d / "config.json").read_text()).get("model_type") == "llamaLadder":
        kw["trust_remote_code"] = True
    cls = AutoModelForCausalLM
    try:
        try:
            model, info = cls.from_pretrained(d, dtype=torch.float32, **kw)
        except TypeError:  # transformers < 4.56
            model, info = cls.from_pretrained(d, torch_dtype=torch.float32, **kw)
    except Exception as e:  # noqa: BLE001
        fail(f"transformers could not load {d}: {type(e).__name__}: {e}")
    bad = {k: v for k, v in info.items() if v}
    if bad:
        fail(f"loading {d}: {bad}")
    model.eval()
    vocab = model.config.vocab_size
    if any(not 0 <= v < vocab for r in rows for v in r):
        fail(f"token id out of range [0, {vocab})")

    total, count = 0.0, 0
    with torch.no_grad():
        for ids, lab in zip(rows, labels):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            tgt = torch.tensor(lab[1:])
            total += F.cross_entropy(logits[:-1].double(), tgt, ignore_index=IGNORE,
                                     reduction="sum").item()
            count += int((tgt != IGNORE).sum())
    if count == 0:
        fail("no counted label positions")
    hf_loss = total / count

    print(f"checkpoint:    {d}")
    print(f"sequences:     {len(rows)} (lengths {sorted(set(len(r) for r in rows))}), "
          f"{count} predicted tokens")
    print(f"hf loss:       {hf_loss:.8f}")
    if ref_loss is None:
        print("ferrolm loss:  (none given; nothing compared)")
        return USAGE_EXIT if args.require_loss else 0
    rel = abs(hf_loss - ref_loss) / max(abs(ref_loss), 1e-12)
    print(f"ferrolm loss:  {ref_loss:.8f}")
    print(f"relative diff: {rel:.3e} (rtol {args.rtol:g})")
    if rel > args.rtol:
        print("MISMATCH", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
