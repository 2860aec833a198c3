#!/usr/bin/env python3
"""CPU training throughput, ferrolm against PyTorch eager, on the same shapes in one run.

ferrolm: `target/release/examples/bench_train_cpu` (built here unless --no-build), the trainer's
step (loss, backward, clip 1.0, AdamW) through the single-device engine. PyTorch: transformers'
LlamaForCausalLM (attn_implementation="sdpa") with torch.optim.AdamW, the same configuration,
batch and sequence length, clip_grad_norm_(1.0). Both: random token ids, median step time over
--steps timed steps after one warm-up step; tokens/s = batch * seq / median.

Shapes: tiny (the preset, batch 16 x 128), cpu-small (hidden 256, 4 layers, 8/4 heads, ffn
688, vocabulary 4096, batch 8 x 256) and 124m (12 layers, hidden 768, 12 heads, ffn 2048,
vocabulary 32000, batch 2 x 512; one timed step). All f32 unless --dtype bf16, where ferrolm
trains in bf16 with f32 master weights and PyTorch runs under torch.autocast("cpu", bf16).
--gemm adds GEMM on the model's shapes in --dtype: Tensor::matmul against torch.mm.

The Python environment (optional; nothing in CI needs it):
    python3 -m venv /path/venv && /path/venv/bin/pip install torch transformers numpy
    /path/venv/bin/python scripts/bench_cpu_vs_torch.py [--shapes tiny,cpu-small,124m] [--gemm]
Thread count: both sides use every core unless --threads N (RAYON_NUM_THREADS and
torch.set_num_threads).

--rounds N alternates the two sides N times per shape (ferrolm first in odd rounds, PyTorch first
in even ones) and reports the median of each side and the median of the per-round ratios: on a
shared or virtual machine whose speed drifts from minute to minute, a ratio of runs taken seconds
apart is steadier than one of runs taken minutes apart.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {
    # name: (vocab, hidden, ffn, layers, heads, kv heads, batch, seq, default timed steps)
    "tiny": (4096, 128, 384, 4, 4, 2, 16, 128, 10),
    "cpu-small": (4096, 256, 688, 4, 8, 4, 8, 256, 6),
    "124m": (32000, 768, 2048, 12, 12, 12, 2, 512, 1),
}


def torch_train(name, steps, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, hidden, ffn, layers, heads, kv, batch, seq, _ = SHAPES[name]
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=seq,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    times = []
    for s in range(1 + steps):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if s >= 1:
            times.append(time.perf_counter() - t0)
    times.sort()
    return batch * seq / times[len(times) // 2]


def ferrolm(args, extra):
    env = dict(os.environ)
    if args.threads:
        env["RAYON_NUM_THREADS"] = str(args.threads)
    exe = os.path.join(ROOT, "target", args.profile, "examples", "bench_train_cpu")
    out = subprocess.run([exe] + extra, env=env, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def torch_gemm(m, k, n, ta, dtype):
    import torch

    torch.manual_seed(0)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = (torch.randn(k, m).t() if ta else torch.randn(m, k)).to(dt)
    b = torch.randn(k, n).to(dt)
    torch.mm(a, b)
    ts = []
    start = time.perf_counter()
    while len(ts) < 5 or (time.perf_counter() - start < 0.5 and len(ts) < 100):
        t0 = time.perf_counter()
        torch.mm(a, b)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return 2.0 * m * k * n / ts[len(ts) // 2] / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="tiny,cpu-small,124m")
    p.add_argument("--steps", type=int, default=0, help="timed steps per shape (default: per shape, 124m: 1)")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--threads", type=int, default=0, help="threads on both sides (default: every core)")
    p.add_argument("--gemm", action="store_true", help="also GEMM on the model's shapes, in --dtype")
    p.add_argument("--rounds", type=int, default=1, help="alternate the two sides this many times per shape; report medians")
    p.add_argument("--no-build", action="store_true", help="use the built example as it is")
    p.add_argument("--profile", default="release", help="cargo profile of the example (profiling: release with symbols)")
    args = p.parse_args()
    if args.rounds < 1:
        sys.exit("--rounds: must be at least 1")
    try:
        import torch
    except ImportError:
        sys.exit("PyTorch is not installed in this Python: see the docstring for the environment")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.no_build:
        subprocess.run(["cargo", "build", "--profile", args.profile, "--example", "bench_train_cpu"], cwd=ROOT, check=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; dtype {args.dtype}")
    names = list(filter(None, args.shapes.split(",")))
    for name in names:
        if name not in SHAPES:
            sys.exit(f"--shapes: unknown shape {name!r} (known: {', '.join(SHAPES)})")
    if args.rounds == 1:
        print("| shape | ferrolm tokens/s | PyTorch eager tokens/s | ratio |")
        print("|---|---:|---:|---:|")
    else:
        print(f"| shape | ferrolm tokens/s (median of {args.rounds}) | PyTorch eager tokens/s (median) | ratio (median) | ratio per round |")
        print("|---|---:|---:|---:|---|")
    median = lambda v: sorted(v)[len(v) // 2] if len(v) % 2 else sum(sorted(v)[len(v) // 2 - 1 : len(v) // 2 + 1]) / 2
    for name in names:
        steps = args.steps or SHAPES[name][-1]
        fs, ts = [], []
        for r in range(args.rounds):
            run_f = lambda: fs.append(ferrolm(args, ["--shape", name, "--steps", str(steps), "--dtype", args.dtype])[0]["tokens_per_s"])
            run_t = lambda: ts.append(torch_train(name, steps, args.dtype))
            for run in (run_f, run_t) if r % 2 == 0 else (run_t, run_f):
                run()
        ratios = [f / t for f, t in zip(fs, ts)]
        if args.rounds == 1:
            print(f"| {name} | {fs[0]:,.0f} | {ts[0]:,.0f} | {ratios[0]:.2f} |", flush=True)
        else:
            each = ", ".join(f"{x:.2f}" for x in ratios)
            print(f"| {name} | {median(fs):,.0f} | {median(ts):,.0f} | {median(ratios):.2f} | {each} |", flush=True)
    if args.gemm:
        print(f"\n| GEMM {args.dtype} (m x k x n) | ferrolm GFLOP/s | torch.mm GFLOP/s | ratio |")
        print("|---|---:|---:|---:|")
        for r in ferrolm(args, ["--gemm", "--dtype", args.dtype]):
            t = torch_gemm(r["m"], r["k"], r["n"], r["transposed_lhs"], args.dtype)
            print(f"| {r['m']} x {r['k']} x {r['n']} ({r['what']}) | {r['gflops']:.1f} | {t:.1f} | {r['gflops'] / t:.2f} |", flush=True)


if __name__ == "__main__":
    main()
