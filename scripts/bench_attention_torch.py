#!/usr/bin/env python3
"""PyTorch SDPA (flash backend) causal attention fwd+bwd on the shapes of examples/bench_cuda.rs.

bf16, is_causal=True, forced to SDPBackend.FLASH_ATTENTION; CUDA-event timing after warm-up,
median of repeated steps, random inputs (never zeros). Row keys match the Rust bench's
(b{B}_hq{HQ}_hkv{HKV}_t{T}_d{D}) so the two tables join.

    python3 scripts/bench_attention_torch.py [--reps 20] [--ours $OUT/bench_cuda.json|bench_cuda.md]

With --ours, adds our forward and forward+backward times, our TFLOP/s, and the ratios
torch_ms / ours_ms beside them (targets: fwd+bwd >= 0.9 at every shape, >= 1.0 at d 128 with
t >= 2048; forward alone >= 1.0); where bench_cuda.json also timed the 4-warp flash kernels
(attention_w4_*), their ratios too. Writes $OUT/bench_attention_torch.md and .json when OUT is set.
FLOPs: causal forward 2 B Hq T^2 D (half of the full 4 B Hq T^2 D), backward 2.5x that.
"""
import argparse
import json
import os
import re
import statistics
import sys

SHAPES = [(4, 16, 16, 1024, 128), (4, 16, 16, 2048, 128), (4, 16, 16, 4096, 128),
          (8, 32, 32, 2048, 64), (4, 32, 8, 2048, 128), (8, 32, 8, 2048, 64),
          (4, 16, 16, 8192, 128), (8, 32, 8, 1024, 64)]  # the last: the 1B model's attention


def key(b, hq, hkv, t, d):
    return f"b{b}_hq{hq}_hkv{hkv}_t{t}_d{d}"


def load_ours(path, which="attention_fwd_bwd_ms"):
    """{key: ms} from bench_cuda.json (`which`: attention_fwd_bwd_ms or attention_fwd_ms) or
    bench_cuda.md (its attention table: | key | fwd ms | bwd ms | fwd+bwd ms | ...)."""
    text = open(path).read()
    if path.endswith(".json"):
        j = json.loads(text)
        return {k: float(v) for k, v in j.get(which, j).items() if isinstance(v, (int, float))}
    out = {}
    col = 1 if which == "attention_fwd_ms" else 3
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"b\d+_hq\d+_hkv\d+_t\d+_d\d+", cells[0]):
            out[cells[0]] = float(cells[col])
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
    ours_fwd = load_ours(a.ours, "attention_fwd_ms") if a.ours else {}
    # The 4-warp kernels' times (bench_cuda.json only; an older file has none: no columns then).
    shape_keys = lambda d: {k: v for k, v in d.items() if re.fullmatch(r"b\d+_hq\d+_hkv\d+_t\d+_d\d+", k)}
    w4 = shape_keys(load_ours(a.ours, "attention_w4_fwd_bwd_ms")) if a.ours and a.ours.endswith(".json") else {}
    w4_fwd = shape_keys(load_ours(a.ours, "attention_w4_fwd_ms")) if w4 else {}
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
        f_fwd = 2.0 * b * hq * t * t * d  # causal fwd 2BHT^2D, bwd 2.5x
        row = dict(key=k_, d=d, t=t, fwd_ms=f_ms, fwd_bwd_ms=fb_ms, fwd_tflops=f_fwd / (f_ms * 1e-3) / 1e12,
                   tflops=3.5 * f_fwd / (fb_ms * 1e-3) / 1e12, note=note, ours_ms=ours.get(k_), ours_fwd_ms=ours_fwd.get(k_))
        if row["ours_ms"]:
            row["ours_tflops"] = 3.5 * f_fwd / (row["ours_ms"] * 1e-3) / 1e12
            row["ratio"] = fb_ms / row["ours_ms"]
        if row["ours_fwd_ms"]:
            row["ours_fwd_tflops"] = f_fwd / (row["ours_fwd_ms"] * 1e-3) / 1e12
            row["fwd_ratio"] = f_ms / row["ours_fwd_ms"]
        if w4.get(k_) and w4_fwd.get(k_):  # the 4-warp flash kernels (a tuning comparison)
            row["w4_fwd_bwd_ms"], row["w4_fwd_ms"] = w4[k_], w4_fwd[k_]
            row["w4_ratio"], row["w4_fwd_ratio"] = fb_ms / w4[k_], f_ms / w4_fwd[k_]
        rows.append(row)
        del q, k, v, do
        torch.cuda.empty_cache()

    lines = [f"# PyTorch {torch.__version__} SDPA flash, bf16 causal, fwd+bwd\n", f"device: {name}  ", f"reps: {a.reps} (median)\n"]
    hdr = "| key | torch fwd ms | TFLOP/s | torch fwd+bwd ms | TFLOP/s | backend |"
    sep = "|---|---:|---:|---:|---:|---|"
    if ours:
        hdr += " ours fwd ms | TFLOP/s | fwd torch/ours | ours fwd+bwd ms | TFLOP/s | fwd+bwd torch/ours |"
        sep += "---:|---:|---:|---:|---:|---:|"
    if w4:
        hdr += " 4 warps: fwd torch/ours | fwd+bwd torch/ours |"
        sep += "---:|---:|"
    lines += [hdr, sep]
    for r in rows:
        s = f"| {r['key']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.1f} | {r['fwd_bwd_ms']:.3f} | {r['tflops']:.1f} | {r['note']} |"
        if ours:
            f = r["ours_fwd_ms"]
            s += f" {f:.3f} | {r['ours_fwd_tflops']:.1f} | {r['fwd_ratio']:.2f} |" if f else " - | - | - |"
            o = r["ours_ms"]
            s += f" {o:.3f} | {r['ours_tflops']:.1f} | {r['ratio']:.2f} |" if o else " - | - | - |"
        if w4:
            s += f" {r['w4_fwd_ratio']:.2f} | {r['w4_ratio']:.2f} |" if r.get("w4_ratio") else " - | - |"
        lines.append(s)
    if ours:
        ratios = [r["ratio"] for r in rows if r.get("ratio")]
        if ratios:
            lines.append(f"\nfwd+bwd torch/ours: min {min(ratios):.2f}, median {statistics.median(ratios):.2f} "
                         "(target >= 0.9 everywhere, >= 1.0 at d 128, t >= 2048)")
        fr = [r["fwd_ratio"] for r in rows if r.get("fwd_ratio")]
        if fr:
            lines.append(f"fwd torch/ours: min {min(fr):.2f}, median {statistics.median(fr):.2f} (target >= 1.0)")
        r4 = [(r["w4_ratio"], r["w4_fwd_ratio"]) for r in rows if r.get("w4_ratio")]
        if r4:
            lines.append(f"4-warp blocks: fwd+bwd torch/ours min {min(x[0] for x in r4):.2f}, fwd min {min(x[1] for x in r4):.2f} "
                         "(the default is 8 warps; FERROLM_FLASH_WARPS=4 selects these)")
    md = "\n".join(lines) + "\n"
    print(md)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "bench_attention_torch.md"), "w").write(md)
        json.dump({"device": name, "torch": torch.__version__, "rows": rows}, open(os.path.join(out, "bench_attention_torch.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
