#!/usr/bin/env python3
"""Attention FLOPs a packed row skips (issue 42; docs/BENCHMARKS.md, "Attention over packed rows").

A row of T tokens holds segments of lengths l_1..l_n (sum T, trailing padding its own segment).
Causal attention over the whole row computes T (T + 1) / 2 (query, key) pairs per query head;
attention kept inside the segments computes sum_i l_i (l_i + 1) / 2. Each pair is 4 D FLOPs
forward (q.k and p.v) and 2.5x that backward, so the fraction skipped is
1 - sum_i l_i (l_i + 1) / (T (T + 1)) for forward and backward alike.

The CUDA kernels skip whole tiles: per warp of 16 query rows, the forward (and dQ) computes the kv
tiles of BC rows from the tile holding its first row's segment start to its diagonal; dK/dV, per
warp of 16 kv rows, the query tiles of BQ rows from the tile holding its diagonal to the tile
holding its last row's segment end. This script counts those tiles for the row and reports the
pairs they cover against the dense causal kernels' tiles, for head dims 64 and 128
(kernels/constants.cuh: BC 128 / 64 forward, BQ = BC 64 / 32 backward).

Lengths are drawn from a log-normal (sigma 1, a long tail) with mean T / 4, each clipped to
[1, T], rows filled in order (a length that does not fit ends the row; the rest is padding), as
the issue's benchmark describes. Run: python3 scripts/packed_attention_flops.py
"""
import math
import random

WARP = 16


def rows(t, n_rows, seed=42):
    r = random.Random(seed)
    mu = math.log(t / 4) - 0.5  # log-normal mean exp(mu + sigma^2 / 2) = t / 4
    out = []
    for _ in range(n_rows):
        lens, used = [], 0
        while True:
            l = max(1, min(t, round(r.lognormvariate(mu, 1.0))))
            if used + l > t:
                break
            lens.append(l)
            used += l
        out.append((lens, t - used))  # the padding is its own segment
    return out


def bounds(lens):
    lo, hi, s = [], [], 0
    for l in lens:
        lo += [s] * l
        hi += [s + l] * l
        s += l
    return lo, hi


def fwd_tiles(t, lo, bc, seg):
    """kv tiles (of bc rows) the forward / dQ computes, summed over warps of 16 query rows."""
    n = 0
    for r0 in range(0, t, WARP):
        last = min(r0 + WARP - 1, t - 1)
        first = lo[r0] // bc if seg else 0
        n += last // bc - first + 1
    return n


def dkdv_tiles(t, hi, bq, seg):
    """query tiles (of bq rows) dK/dV computes, summed over warps of 16 kv rows."""
    n = 0
    for r0 in range(0, t, WARP):
        end = hi[min(r0 + WARP - 1, t - 1)] if seg else t
        n += math.ceil(end / bq) - r0 // bq
    return n


def main():
    t, n_rows = 2048, 64
    packed = rows(t, n_rows)
    convs = [l for lens, _ in packed for l in lens]
    rs = [lens + ([pad] if pad else []) for lens, pad in packed]
    dense = n_rows * t * (t + 1) / 2
    inside = sum(l * (l + 1) / 2 for lens in rs for l in lens)
    print(f"T = {t}, {n_rows} rows, {len(convs)} conversations of mean length {sum(convs) / len(convs):.0f}, then padding")
    print(f"pairs: dense causal {dense:.4g}, inside segments {inside:.4g}: {1 - inside / dense:.1%} skipped (exact)")
    print()
    print("| head dim | pass | tile rows | tiles, dense causal | tiles, packed | packed / dense | pairs computed / needed, dense | packed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for d, bc, bq in [(64, 128, 64), (128, 64, 32)]:
        for name, tile, f in [("forward", bc, "fwd"), ("dQ", bq, "fwd"), ("dK/dV", bq, "dkdv")]:
            dn = pk = 0
            for lens in rs:
                lo, hi = bounds(lens)
                if f == "fwd":
                    dn += fwd_tiles(t, lo, tile, False)
                    pk += fwd_tiles(t, lo, tile, True)
                else:
                    dn += dkdv_tiles(t, hi, tile, False)
                    pk += dkdv_tiles(t, hi, tile, True)
            print(f"| {d} | {name} | {tile} | {dn} | {pk} | {pk / dn:.1%} | {dn * WARP * tile / dense:.2f} | {pk * WARP * tile / inside:.2f} |")


if __name__ == "__main__":
    main()
