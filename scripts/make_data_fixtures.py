#!/usr/bin/env python3
"""Writes the dataset fixtures of crates/data/tests/fixtures/ with the tools the datasets come
from: pyarrow for Parquet (snappy, zstd and gzip codecs, several row groups), Python's gzip and
the zstandard module for compressed JSON Lines. The same documents in every format, so the
tests can check that each gives the same token shards, and damaged copies for the error tests.

    /work/main/.venv/bin/pip install pyarrow zstandard
    /work/main/.venv/bin/python scripts/make_data_fixtures.py

The output is a few KB, committed; CI has no Python and only reads it.
"""
import gzip
import io
import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates" / "data" / "tests" / "fixtures"
CORPUS = ROOT / "data" / "corpus"

# Documents with what real datasets hold: plain prose, several scripts, characters JSON must
# escape (quotes, backslashes, tabs, U+2028), CRLF line ends, blank lines, an empty document.
sonnets = (CORPUS / "sonnets.txt").read_text(encoding="utf-8")
hamlet = (CORPUS / "hamlet.txt").read_text(encoding="utf-8")
DOCS = [
    sonnets[:700],
    "Café — naïve façade; Straße; 東京の夜; Ελληνικά; emoji 🎭🌹 and a combining e\u0301.",
    'He said "no" \\ then\ttabbed, a line\u2028separator, and {"json": [1, 2]} inside.',
    hamlet[2000:4200],
    "To be, or not to be: that is the question.\r\nWindows line ends\r\n",
    "First paragraph.\n\n\nAfter blank lines.\n   indented line\n",
    "",
    "Last document, short.",
]
ONE = hamlet[10000:13000]


def jsonl(docs, extra=True):
    lines = []
    for i, d in enumerate(docs):
        rec = {"id": i, "text": d}
        if extra:
            rec["meta"] = {"source": "fixture", "n": [i, i * 2], "ok": True, "none": None}
        lines.append(json.dumps(rec, ensure_ascii=(i % 2 == 0)))
    return ("\n".join(lines) + "\n").encode("utf-8")


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def gz(data):
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        f.write(data)
    return buf.getvalue()


def zst(data):
    return zstandard.ZstdCompressor(level=3).compress(data)


def parquet(path, docs, codec="snappy", row_group_size=3, text_type=pa.string()):
    table = pa.table(
        {
            "id": pa.array(range(len(docs)), pa.int64()),
            "text": pa.array(docs, text_type),
            "url": pa.array([f"https://example.org/{i}" for i in range(len(docs))], pa.string()),
        }
    )
    pq.write_table(table, path, compression=codec, row_group_size=row_group_size)


def main():
    # One document in every format.
    one = OUT / "one_doc"
    write(one / "doc.txt", ONE.encode("utf-8"))
    write(one / "doc.jsonl", jsonl([ONE]))
    write(one / "doc.jsonl.gz", gz(jsonl([ONE])))
    write(one / "doc.jsonl.zst", zst(jsonl([ONE])))
    one.mkdir(parents=True, exist_ok=True)
    parquet(one / "doc.parquet", [ONE])

    # Several documents in every format (text: one file per document).
    docs = OUT / "docs"
    for i, d in enumerate(DOCS):
        write(docs / "txt" / f"doc_{i}.txt", d.encode("utf-8"))
    write(docs / "docs.jsonl", jsonl(DOCS))
    write(docs / "docs.jsonl.gz", gz(jsonl(DOCS)))
    write(docs / "docs.jsonl.zst", zst(jsonl(DOCS)))
    parquet(docs / "docs.parquet", DOCS, "snappy")
    parquet(docs / "docs_zstd.parquet", DOCS, "zstd")
    parquet(docs / "docs_gzip.parquet", DOCS, "gzip")
    # Two members concatenated, as `cat a.gz b.gz` makes: still one valid gzip file.
    half = len(DOCS) // 2
    write(docs / "multi_member.jsonl.gz", gz(jsonl(DOCS[:half])) + gz(jsonl(DOCS[half:])))

    # Damaged inputs: one problem each, at a known line / row / byte.
    bad = OUT / "damaged"
    good = [json.dumps({"text": d}) for d in DOCS[:4]]
    lines = list(good)
    lines[2] = json.dumps({"body": DOCS[2], "id": 2})
    write(bad / "missing_field.jsonl", ("\n".join(lines) + "\n").encode())
    lines = list(good)
    lines[1] = json.dumps({"text": 42})
    write(bad / "wrong_type.jsonl", ("\n".join(lines) + "\n").encode())
    raw = [l.encode() for l in good]
    raw[1] = b'{"text": "broken \xff\xfe byte"}'
    write(bad / "bad_utf8.jsonl", b"\n".join(raw) + b"\n")
    write(bad / "bad_utf8.txt", "valid start ".encode() + b"\xc3\x28" + b" and more")
    full = gz(jsonl(DOCS))
    write(bad / "truncated.jsonl.gz", full[: len(full) * 2 // 3])
    full = zst(jsonl(DOCS))
    write(bad / "truncated.jsonl.zst", full[: len(full) * 2 // 3])
    parquet(bad / "corrupt_footer.parquet", DOCS)
    data = bytearray((bad / "corrupt_footer.parquet").read_bytes())
    # The footer is the Thrift metadata, its 4-byte length, then "PAR1": scramble the metadata.
    meta_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - meta_len
    for i in range(start, start + min(48, meta_len)):
        data[i] ^= 0x5A
    write(bad / "corrupt_footer.parquet", bytes(data))
    parquet(bad / "null_text.parquet", [DOCS[0], None, DOCS[3]])
    parquet(bad / "bad_utf8.parquet", [DOCS[0].encode(), b"bad \xff byte", DOCS[3].encode()], text_type=pa.binary())
    pq.write_table(pa.table({"text": pa.array([1, 2, 3], pa.int64())}), bad / "wrong_type.parquet")
    print(f"wrote fixtures under {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
