#!/usr/bin/env python3
"""Tokenizing throughput: ferrolm's prepare_data against Hugging Face `datasets` with the fast
tokenizer (`map(batched=True, num_proc=cores)`), on the same files and the same tokenizer.

    cargo build --release --example prepare_data
    /work/main/.venv/bin/pip install datasets pyarrow transformers
    /work/main/.venv/bin/python scripts/bench_prepare.py --mb 100 --reps 3

It writes a JSON Lines (and a Parquet) data set of about --mb MB built from the bundled corpus
(documents of a few KB, as web-text shards have), then times, --reps times each:
- ferrolm: `prepare_data --input FILE --tokenizer data/tokenizer.json --out DIR` (reading,
  tokenizing on every core, writing the shards and the manifest);
- Hugging Face: `load_dataset(format, data_files=FILE)` (reading into Arrow) and
  `ds.map(tokenize, batched=True, num_proc=cores)` with `PreTrainedTokenizerFast`, no cache;
  both times are reported, and their sum is the comparable figure (prepare_data also reads).
Tokens are counted on both sides (ferrolm's manifest; the map's output) and must agree: the same
ids, one <|eos|> per document. The median tokens/s of each side, and their ratio, are printed
as a Markdown row for docs/BENCHMARKS.md.
"""
import argparse
import json
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def make_dataset(path_jsonl, path_parquet, mb, seed=0):
    corpus = ROOT / "data" / "corpus"
    paras = []
    for f in sorted(corpus.glob("*.txt")):
        paras += [p for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = random.Random(seed)
    target = mb * 1_000_000
    size, docs = 0, []
    with open(path_jsonl, "w", encoding="utf-8") as out:
        i = 0
        while size < target:
            n = rng.randint(4, 40)
            start = rng.randrange(len(paras) - n)
            text = "\n\n".join(paras[start : start + n])
            line = json.dumps({"id": i, "text": text, "url": f"https://example.org/{i}"}, ensure_ascii=False)
            out.write(line + "\n")
            docs.append(text)
            size += len(line) + 1
            i += 1
    if path_parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path_parquet, compression="snappy", row_group_size=10_000)
    return len(docs)


def run_ferrolm(binary, data, out):
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run(
        [binary, "--input", str(data), "--tokenizer", str(ROOT / "data" / "tokenizer.json"), "--out", str(out), "--val-fraction", "0"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    dt = time.perf_counter() - t
    m = json.loads((out / "manifest.json").read_text())
    return dt, m["train_tokens"] + m["val_tokens"]


def run_hf(data, fmt, cores, cache):
    from datasets import load_dataset
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "data" / "tokenizer.json"))
    eos = tok.convert_tokens_to_ids("<|eos|>")

    def tokenize(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    shutil.rmtree(cache, ignore_errors=True)
    t = time.perf_counter()
    ds = load_dataset(fmt, data_files=str(data), split="train", cache_dir=str(cache))
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    out = ds.map(tokenize, batched=True, num_proc=cores, remove_columns=ds.column_names, load_from_cache_file=False)
    t_map = time.perf_counter() - t
    tokens = sum(len(x) for x in out["input_ids"])
    return t_load, t_map, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=100, help="size of the JSON Lines data set")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "examples" / "prepare_data"))
    ap.add_argument("--formats", default="json,parquet", help="json and/or parquet")
    a = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="ferrolm-bench-prepare-"))
    try:
        jsonl, parquet = work / "data.jsonl", work / "data.parquet"
        docs = make_dataset(jsonl, parquet if "parquet" in a.formats else None, a.mb)
        print(f"{docs} documents, {jsonl.stat().st_size / 1e6:.1f} MB of JSON Lines; {a.cores} cores", file=sys.stderr)
        for fmt in a.formats.split(","):
            data = jsonl if fmt == "json" else parquet
            fr, hf = [], []
            for rep in range(a.reps):
                dt, tokens = run_ferrolm(a.binary, data, work / "out")
                fr.append(tokens / dt)
                t_load, t_map, hf_tokens = run_hf(data, fmt, a.cores, work / "hf-cache")
                hf.append(hf_tokens / (t_load + t_map))
                print(
                    f"{fmt} rep {rep}: ferrolm {dt:.2f} s ({tokens / dt / 1e6:.3f} M tok/s); "
                    f"HF load {t_load:.2f} s + map {t_map:.2f} s ({hf_tokens / (t_load + t_map) / 1e6:.3f} M tok/s, "
                    f"map alone {hf_tokens / t_map / 1e6:.3f} M tok/s)",
                    file=sys.stderr,
                )
                if tokens != hf_tokens:
                    sys.exit(f"token counts differ: ferrolm {tokens}, Hugging Face {hf_tokens}")
            f, h = statistics.median(fr), statistics.median(hf)
            print(f"| {fmt} {jsonl.stat().st_size / 1e6:.0f} MB, {docs} docs | {tokens} | {f / 1e6:.3f} | {h / 1e6:.3f} | {f / h:.2f}x |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
