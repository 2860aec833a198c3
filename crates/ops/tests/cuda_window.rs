//! Sliding-window attention on the CUDA device (the GPU, else the CPU emulator) against the CPU
//! reference, outputs poisoned (FERROLM_CUDA_POISON=1, so an unwritten element fails): the flash
//! kernels (d64 and d128, 8- and 4-warp blocks, either head layout, GQA) and their `_seg` twins,
//! and the SIMT kernels, with windows inside a warp's 16 rows, across a few tiles, t - 1 and past
//! t; the tiles each pass skips, counted by the kernels against the count the window implies, and
//! the tiles visited growing with t, not t squared; equal bits run to run and from both block
//! sizes. Tolerances as in cuda.rs. With no CUDA device the tests print "skipped: no CUDA
//! device" and pass, unless FERROLM_REQUIRE_GPU=1 (or FERROLM_REQUIRE_EMU=1 without the
//! emulator), where they fail.
#[path = "../../cuda/tests/common/mod.rs"]
mod common;
use common::*;
use ferrolm_cuda::consts::{FLASH_BWD_TILE_D128, FLASH_BWD_TILE_D64, FLASH_FWD_TILE_D128, FLASH_FWD_TILE_D64};
use ferrolm_ops::attention::{self, count_skipped_tiles, with_flash_warps, SkippedTiles};
use ferrolm_ops::{causal_attention, causal_attention_window, segment_attention_window, AttnDims, Segments};
use ferrolm_tensor::{DType, Layout, Rng, Shape, Storage, Tensor};
use ferrolm_testing::segments::full_rows as segments;

/// Windowed attention against the CPU, forward and every gradient, with 8- and 4-warp flash
/// blocks: (dtype, hq, hkv, d, time-major inputs, t or packed rows, windows). bf16 at d 64 / 128
/// runs the flash kernels (kv tiles of 128 / 64 rows forward, 64 / 32 backward), the rest SIMT.
#[test]
fn window_attention_matches_the_cpu() {
    let Some(_) = gpu() else { return };
    let mut r = rng(51);
    let packed = vec![vec![1, 127, 64, 3, 1, 90, 14], vec![128, 172]];
    #[allow(clippy::type_complexity)]
    let cases: Vec<(DType, usize, usize, usize, bool, Result<usize, Vec<Vec<usize>>>, Vec<usize>)> = vec![
        (DType::BF16, 4, 2, 64, false, Ok(300), vec![5, 40, 200, 299, 300]),
        (DType::BF16, 2, 1, 128, true, Ok(300), vec![1, 17, 100]),
        (DType::BF16, 4, 2, 64, true, Err(packed.clone()), vec![3, 70]),
        (DType::BF16, 2, 2, 128, false, Err(packed), vec![20]),
        (DType::BF16, 2, 1, 32, false, Err(vec![vec![5, 1, 30], vec![36]]), vec![7]),
        (DType::F32, 4, 2, 64, false, Ok(45), vec![9]),
    ];
    for (dt, hq, hkv, d, time_major, rows, windows) in cases {
        let segs = rows.as_ref().err().map(|rows| segments(rows));
        let (b, t) = match &rows {
            Ok(t) => (2, *t),
            Err(rows) => (rows.len(), rows[0].iter().sum()),
        };
        let make = |h: usize, r: &mut Rng| if time_major { randn(&[b, t, h, d], dt, r) } else { randn(&[b, h, t, d], dt, r) };
        for w in windows {
            let ins = [make(hq, &mut r), make(hkv, &mut r), make(hkv, &mut r)];
            for warps in [8, 4] {
                let name = format!("window {w} {dt} hq{hq} hkv{hkv} d{d} t{t} time-major {time_major} {rows:?} {warps} warps");
                with_flash_warps(warps, || {
                    fwd_bwd(&name, dt, &ins, true, |x| {
                        let p = |t: &Tensor| if time_major { t.permute(&[0, 2, 1, 3]).unwrap() } else { t.clone() };
                        let (q, k, v) = (p(&x[0]), p(&x[1]), p(&x[2]));
                        let sc = 1.0 / (d as f64).sqrt();
                        match &segs {
                            None => causal_attention_window(&q, &k, &v, sc, Some(w)).unwrap(),
                            Some(s) => segment_attention_window(&q, &k, &v, sc, s, Some(w)).unwrap(),
                        }
                    })
                })
                .unwrap();
            }
        }
    }
}

/// A window of t or more is plain causal attention on the device too: the same bits, nothing
/// skipped.
#[test]
fn window_of_t_is_the_causal_kernels() {
    let Some(_) = gpu() else { return };
    let mut r = rng(52);
    let [q, k, v] = [4, 2, 2].map(|h| to_gpu(&randn(&[1, h, 150, 64], DType::BF16, &mut r)));
    let ((a, c), counted) = count_skipped_tiles(|| {
        let a = causal_attention_window(&q, &k, &v, 0.125, Some(150)).unwrap();
        (a, causal_attention(&q, &k, &v, 0.125).unwrap())
    });
    let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&c));
    assert_eq!(counted, SkippedTiles::default(), "full causal attention skips nothing");
}

/// (o, lse, dq, dk, dv) bits of one windowed forward and backward, head-major inputs.
fn window_bits(be: &ferrolm_cuda::CudaBackend, x: &[Storage; 4], dims: AttnDims, segs: Option<&Segments>, w: usize) -> Vec<Vec<u32>> {
    let AttnDims { b, hq, hkv, t, d } = dims;
    let (lq, lkv) = (Layout::contiguous(Shape(vec![b, hq, t, d])), Layout::contiguous(Shape(vec![b, hkv, t, d])));
    let scale = 1.0 / (d as f64).sqrt();
    let (o, lse) = attention::forward_window((&x[0], &lq), (&x[1], &lkv), (&x[2], &lkv), dims, scale, segs, Some(w)).unwrap();
    let llse = Layout::contiguous(Shape(vec![b, hq, t]));
    let views = [(&x[3], &lq), (&x[0], &lq), (&x[1], &lkv), (&x[2], &lkv), (&o, &lq), (&lse, &llse)];
    let (dq, dk, dv) = attention::backward_window(views, dims, scale, segs, Some(w)).unwrap();
    [o, lse, dq, dk, dv].iter().map(|s| bits(be, s)).collect()
}

fn tiles(d: usize) -> (usize, usize) {
    if d == 64 {
        (FLASH_FWD_TILE_D64, FLASH_BWD_TILE_D64)
    } else {
        (FLASH_FWD_TILE_D128, FLASH_BWD_TILE_D128)
    }
}

/// What a warp (16 rows from r0 of batch row `row`) can see with window w and segments (None:
/// the row is one sequence): the first key of its first row, and one past the last query that
/// sees its last row.
fn warp_bounds(segs: Option<&Segments>, row: usize, r0: usize, t: usize, w: usize) -> (usize, usize) {
    let last = (r0 + 15).min(t - 1);
    let (lo, hi) = match segs {
        None => (0, t),
        Some(s) => {
            let (lo, hi) = s.bounds();
            (lo[row * t + r0] as usize, hi[row * t + last] as usize)
        }
    };
    (lo.max((r0 + 1).saturating_sub(w)), hi.min(last + w))
}

/// The tiles each pass skips, as the window and segments imply them: per warp (16 rows; the
/// count does not depend on the block size) and query head, the forward's and dQ's kv tiles
/// wholly before its first row's first key, and the dK/dV query tiles wholly past the last query
/// that sees its last kv row.
fn expected_skips(segs: Option<&Segments>, dims: AttnDims, w: usize) -> SkippedTiles {
    let AttnDims { b, hq, t, d, .. } = dims;
    let (fwd_tile, bwd_tile) = tiles(d);
    let mut s = SkippedTiles::default();
    for row in 0..b {
        for r0 in (0..t).step_by(16) {
            let (first, end) = warp_bounds(segs, row, r0, t, w);
            s.fwd += (hq * (first / fwd_tile)) as u64;
            s.dq += (hq * (first / bwd_tile)) as u64;
            s.dkdv += (hq * (t.div_ceil(bwd_tile) - end.div_ceil(bwd_tile))) as u64;
        }
    }
    s
}

/// The tiles of the causal range (every tile a warp computes without a window or segments): per
/// warp and query head, kv tiles up to its diagonal (forward, dQ) and query tiles from its
/// diagonal on (dK/dV).
fn causal_tiles(dims: AttnDims) -> SkippedTiles {
    let AttnDims { b, hq, t, d, .. } = dims;
    let (fwd_tile, bwd_tile) = tiles(d);
    let mut s = SkippedTiles::default();
    for r0 in (0..t).step_by(16) {
        s.fwd += (b * hq * (r0 / fwd_tile + 1)) as u64;
        s.dq += (b * hq * (r0 / bwd_tile + 1)) as u64;
        s.dkdv += (b * hq * (t.div_ceil(bwd_tile) - r0 / bwd_tile)) as u64;
    }
    s
}

/// The windowed kernels give the same bits run to run (the second run on the emulator's reversed
/// thread schedule, where a race shows) and from 4- and 8-warp blocks, and each pass skips exactly
/// the tiles the window (and segments) imply, with either block size: windows inside a warp,
/// across tiles, with GQA and packed rows.
#[test]
fn window_kernels_are_deterministic_and_skip_what_lies_outside() {
    let Some(be) = gpu() else { return };
    let mut r = rng(53);
    #[allow(clippy::type_complexity)]
    let cases: Vec<(usize, usize, usize, usize, Option<Vec<Vec<usize>>>, usize)> = vec![
        (4, 2, 64, 300, None, 5),
        (4, 2, 64, 300, None, 150),
        (2, 1, 128, 200, None, 40),
        (2, 1, 64, 0, Some(vec![vec![7, 1, 156, 36], vec![200]]), 33),
    ];
    for (hq, hkv, d, t, rows, w) in cases {
        let segs = rows.as_ref().map(|rows| segments(rows));
        let (b, t) = rows.as_ref().map_or((1, t), |rows| (rows.len(), rows[0].iter().sum()));
        let dims = AttnDims { b, hq, hkv, t, d };
        let x = [hq, hkv, hkv, hq].map(|h| dev_rand(&be, b * h * t * d, DType::BF16, &mut r));
        let run = |warps: usize| with_flash_warps(warps, || count_skipped_tiles(|| window_bits(&be, &x, dims, segs.as_ref(), w))).unwrap();
        let name = format!("hq{hq} hkv{hkv} d{d} t{t} window {w} {rows:?}");
        let (n8, n4) = same_bits_in_every_schedule(&be, &name, run);
        let want = expected_skips(segs.as_ref(), dims, w);
        assert!(want.fwd > 0 && want.dkdv > 0 && want.dq > 0, "{name}: a window that skips nothing tests nothing");
        assert_eq!(n8, want, "{name}: tiles skipped by the 8-warp kernels");
        assert_eq!(n4, want, "{name}: tiles skipped by the 4-warp kernels");
    }
}

/// The work grows with the window, not the sequence: at a fixed window the tiles each pass
/// visits (the causal range less those skipped, as the kernels count them) grow linearly with t
/// and stay within the window's tiles per warp, while the causal range grows with t squared.
#[test]
fn window_work_grows_with_the_window_not_the_sequence() {
    let Some(be) = gpu() else { return };
    let mut r = rng(54);
    let (d, w) = (64, 32);
    let (fwd_tile, bwd_tile) = tiles(d);
    let mut visited = Vec::new();
    for t in [256, 1024] {
        let dims = AttnDims { b: 1, hq: 1, hkv: 1, t, d };
        let x = [1, 1, 1, 1].map(|_| dev_rand(&be, t * d, DType::BF16, &mut r));
        let (_, skipped) = count_skipped_tiles(|| window_bits(&be, &x, dims, None, w));
        let all = causal_tiles(dims);
        let v = [all.fwd - skipped.fwd, all.dq - skipped.dq, all.dkdv - skipped.dkdv];
        let warps = (t / 16) as u64;
        // A warp's rows see keys from r0 - w + 1 to r0 + 15: at most this many tiles.
        let most = |tile: usize| ((w + 15).div_ceil(tile) + 1) as u64;
        for (what, n, tile) in [("forward", v[0], fwd_tile), ("dQ", v[1], bwd_tile), ("dK/dV", v[2], bwd_tile)] {
            assert!(n <= warps * most(tile), "t {t}: the {what} visited {n} tiles, more than {} per warp", most(tile));
        }
        println!("t {t} window {w}: tiles visited (fwd, dq, dkdv) {v:?} of the causal {:?}", [all.fwd, all.dq, all.dkdv]);
        visited.push((v, [all.fwd, all.dq, all.dkdv]));
    }
    let ((small, causal_small), (large, causal_large)) = (visited[0], visited[1]);
    for i in 0..3 {
        assert!(large[i] <= 5 * small[i], "pass {i}: {} tiles at t 1024 against {} at t 256: not linear in t", large[i], small[i]);
        assert!(causal_large[i] >= 10 * causal_small[i], "pass {i}: the causal range should grow with t squared");
    }
}
