#!/usr/bin/env python3
"""PyTorch SDPA (flash backend) causal attention fwd+bwd on the shapes of examples/bench_cuda.rs.

bf16, is_causal=True, forced to SDPBackend.FLASH_ATTENTION; CUDA-event timing after warm-up,
median of repeated steps, random inputs (never zeros). Row keys match the Rust bench's
(b{B}_hq{HQ}_hkv{HKV}_t{T}_d{D}) so the two tables join.

    python3 scripts/bench_attention_torch.py [--reps 20] [--ours $OUT/bench_cuda.json|bench_cuda.md]

With --ours, adds ours_ms and the ratio torch_ms / ours_ms (target >= 0.8). Writes
$OUT/bench_attention_torch.md and .json when OUT is set.
"""
import argparse
import json
import os
import re
import statistics
import sys

SHAPES = [(4, 16, 16, 1024, 128), (4, 16, 16, 2048, 128), (4, 16, 16, 4096, 128),
          (8, 32, 32, 2048, 64), (4, 32, 8, 2048, 128), (8, 32, 8, 2048, 64)]


def key(b, hq, hkv, t, d):
    return f"b{b}_hq{hq}_hkv{hkv}_t{t}_d{d}"


def load_ours(path):
    """{key: fwd+bwd ms} from bench_cuda.json (attention_fwd_bwd_ms) or bench_cuda.md."""
    text = open(path).read()
    if path.endswith(".json"):
        j = json.loads(text)
        return {k: float(v) for k, v in j.get("attention_fwd_bwd_ms", j).items() if isinstance(v, (int, float))}
    out = {}
    # attention table rows: | key | fwd ms | bwd ms | fwd+bwd ms | ...
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"b\d+_hq\d+_hkv\d+_t\d+_d\d+", cells[0]):
            out[cells[0]] = float(cells[3])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ours", help="bench_cuda.json or bench_cuda.md from the Rust bench")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        sys.exit(1 if os.environ.get("FERROLM_REQUIRE_GPU") == "1" else 0)
    ours = load_ours(a.ours) if a.ours else {}
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    torch.manual_seed(0)
    rows = []
    for (b, hq, hkv, t, d) in SHAPES:
        k_ = key(b, hq, hkv, t, d)
        q = torch.randn(b, hq, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hkv, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, hkv, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(b, hq, t, d, device=dev, dtype=torch.bfloat16)
        note = "flash"

        def attn(q, k, v):
            if hq == hkv:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def attn_repeat(q, k, v):  # fallback when flash rejects enable_gqa: expand K/V heads
            r = hq // hkv
            return F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True)

        fn = attn
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            try:
                attn(q, k, v).backward(do)
            except RuntimeError as e:
                if hq == hkv:
                    raise
                print(f"{k_}: flash with enable_gqa failed ({str(e).splitlines()[0]}); timing repeat_interleave K/V", file=sys.stderr)
                fn, note = attn_repeat, "flash+repeat_kv"

            def time(f):
                for _ in range(a.warmup):
                    f()
                torch.cuda.synchronize()
                ts = []
                for _ in range(a.reps):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    f()
                    e.record()
                    e.synchronize()
                    ts.append(s.elapsed_time(e))
                return statistics.median(ts)

            def fwd():
                with torch.no_grad():
                    fn(q, k, v)

            def fwd_bwd():
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(do)

            f_ms = time(fwd)
            fb_ms = time(fwd_bwd)
        flops = 3.5 * 2.0 * b * hq * t * t * d  # causal fwd 2BHT^2D, bwd 2.5x
        rows.append(dict(key=k_, fwd_ms=f_ms, fwd_bwd_ms=fb_ms, tflops=flops / (fb_ms * 1e-3) / 1e12, note=note,
                         ours_ms=ours.get(k_)))
        del q, k, v, do
        torch.cuda.empty_cache()

    lines = [f"# PyTorch {torch.__version__} SDPA flash, bf16 causal, fwd+bwd\n", f"device: {name}  ", f"reps: {a.reps} (median)\n"]
    hdr = "| key | torch fwd ms | torch fwd+bwd ms | torch TFLOP/s | backend |"
    sep = "|---|---:|---:|---:|---|"
    if ours:
        hdr += " ours fwd+bwd ms | torch/ours |"
        sep += "---:|---:|"
    lines += [hdr, sep]
    for r in rows:
        s = f"| {r['key']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['tflops']:.1f} | {r['note']} |"
        if ours:
            o = r["ours_ms"]
            s += f" {o:.3f} | {r['fwd_bwd_ms'] / o:.2f} |" if o else " - | - |"
        lines.append(s)
    if ours:
        ratios = [r["fwd_bwd_ms"] / r["ours_ms"] for r in rows if r["ours_ms"]]
        if ratios:
            lines.append(f"\nratio torch/ours: min {min(ratios):.2f}, median {statistics.median(ratios):.2f} (target >= 0.8)")
    md = "\n".join(lines) + "\n"
    print(md)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "bench_attention_torch.md"), "w").write(md)
        json.dump({"device": name, "torch": torch.__version__, "rows": rows}, open(os.path.join(out, "bench_attention_torch.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
