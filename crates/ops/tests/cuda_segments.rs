//! Packed rows on the CUDA device (the GPU, else the CPU emulator) against the CPU reference,
//! with outputs poisoned (FERROLM_CUDA_POISON=1, so an unwritten element fails): attention
//! inside segments on the flash kernels' `_seg` twins (d64 and d128, 8- and 4-warp blocks,
//! either head layout, GQA) and on the SIMT kernels, over segment layouts with one segment,
//! many short ones, boundaries off the tiles and length-1 segments; the tiles skipped, counted by
//! the kernels against the count the layout implies; bitwise determinism of the backward and
//! equal bits from both block sizes; RoPE at per-token positions (`rope_pos_*`). Tolerances as
//! in cuda.rs. With no CUDA device the tests print "skipped: no CUDA device" and pass, unless
//! FERROLM_REQUIRE_GPU=1 (or FERROLM_REQUIRE_EMU=1 without the emulator), where they fail.
#[path = "../../cuda/tests/common/mod.rs"]
mod common;
use common::*;
use ferrolm_cuda::consts::{FLASH_BWD_TILE_D128, FLASH_BWD_TILE_D64, FLASH_FWD_TILE_D128, FLASH_FWD_TILE_D64};
use ferrolm_ops::attention::{self, count_skipped_tiles, with_flash_warps, SkippedTiles};
use ferrolm_ops::{causal_attention, rope_at, segment_attention, AttnDims, Segments, Tokens};
use ferrolm_tensor::{DType, Device, Layout, Rng, Shape, Storage, Tensor};
use ferrolm_testing::segments::full_rows as segments;

/// Rows of t = 300 tokens (several 128- and 64-row blocks, kv tiles of 128, 64 and 32 rows):
/// one segment beside many; short segments with a length-1 one; boundaries on no tile edge and
/// one on a tile edge (128).
fn long_rows() -> Vec<Vec<usize>> {
    vec![vec![300], vec![1, 127, 64, 3, 1, 90, 14], vec![128, 172]]
}

/// Segment attention against the CPU, forward and every gradient: (dtype, hq, hkv, d, time-major
/// inputs, rows). bf16 at d 64 / 128 runs the flash `_seg` kernels, the rest SIMT.
#[test]
fn segment_attention_matches_the_cpu() {
    let Some(_) = gpu() else { return };
    let mut r = rng(42);
    let short = vec![vec![5, 1, 7, 2, 9, 3, 1, 1, 11, 4, 33], vec![77], vec![20, 57]];
    let cases = [
        (DType::BF16, 4, 2, 64, false, long_rows()),
        (DType::BF16, 2, 1, 128, true, long_rows()),
        (DType::BF16, 4, 4, 64, true, short.clone()),
        (DType::BF16, 2, 2, 128, false, short.clone()),
        (DType::BF16, 2, 1, 32, false, short.clone()),
        (DType::F32, 4, 2, 64, false, short),
    ];
    for (dt, hq, hkv, d, time_major, rows) in cases {
        let (b, t) = (rows.len(), rows[0].iter().sum::<usize>());
        let segs = segments(&rows);
        let make = |h: usize, r: &mut Rng| if time_major { randn(&[b, t, h, d], dt, r) } else { randn(&[b, h, t, d], dt, r) };
        let ins = [make(hq, &mut r), make(hkv, &mut r), make(hkv, &mut r)];
        let name = format!("segment attention {dt} hq{hq} hkv{hkv} d{d} time-major {time_major} {rows:?}");
        // (The 4-warp kernels give these bits too: segment_kernels_are_deterministic_...)
        fwd_bwd(&name, dt, &ins, true, |x| {
            let p = |t: &Tensor| if time_major { t.permute(&[0, 2, 1, 3]).unwrap() } else { t.clone() };
            segment_attention(&p(&x[0]), &p(&x[1]), &p(&x[2]), 1.0 / (d as f64).sqrt(), &segs).unwrap()
        });
    }
}

/// Rows that are one segment each run the plain causal kernels: the same bits.
#[test]
fn whole_rows_take_the_causal_kernels() {
    let Some(_) = gpu() else { return };
    let mut r = rng(43);
    let [q, k, v] = [4, 2, 2].map(|h| to_gpu(&randn(&[2, h, 70, 64], DType::BF16, &mut r)));
    let ((a, c), counted) = count_skipped_tiles(|| {
        let a = segment_attention(&q, &k, &v, 0.125, &Segments::whole(2, 70).unwrap()).unwrap();
        (a, causal_attention(&q, &k, &v, 0.125).unwrap())
    });
    let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&c));
    assert_eq!(counted, SkippedTiles::default(), "the plain kernels count nothing");
}

/// (o, lse, dq, dk, dv) bits of one forward and backward with segments, head-major inputs.
fn seg_bits(be: &ferrolm_cuda::CudaBackend, x: &[Storage; 4], dims: AttnDims, segs: &Segments) -> Vec<Vec<u32>> {
    let AttnDims { b, hq, hkv, t, d } = dims;
    let (lq, lkv) = (Layout::contiguous(Shape(vec![b, hq, t, d])), Layout::contiguous(Shape(vec![b, hkv, t, d])));
    let scale = 1.0 / (d as f64).sqrt();
    let (o, lse) = attention::forward((&x[0], &lq), (&x[1], &lkv), (&x[2], &lkv), dims, scale, Some(segs)).unwrap();
    let llse = Layout::contiguous(Shape(vec![b, hq, t]));
    let views = [(&x[3], &lq), (&x[0], &lq), (&x[1], &lkv), (&x[2], &lkv), (&o, &lq), (&lse, &llse)];
    let (dq, dk, dv) = attention::backward(views, dims, scale, Some(segs)).unwrap();
    [o, lse, dq, dk, dv].iter().map(|s| bits(be, s)).collect()
}

/// The tiles each pass skipped for segments, as the layout implies them: per warp (16 rows;
/// the count does not depend on the block size), the forward's and dQ's kv tiles wholly before
/// the segment start of the warp's first row, and for each query head of its group the dK/dV
/// query tiles wholly past the segment end of the warp's last kv row.
fn expected_skips(segs: &Segments, dims: AttnDims) -> SkippedTiles {
    let AttnDims { b, hq, hkv, t, d } = dims;
    let (fwd_tile, bwd_tile) = if d == 64 { (FLASH_FWD_TILE_D64, FLASH_BWD_TILE_D64) } else { (FLASH_FWD_TILE_D128, FLASH_BWD_TILE_D128) };
    let (lo, hi) = segs.bounds();
    let mut s = SkippedTiles::default();
    for row in 0..b {
        for r0 in (0..t).step_by(16) {
            let first = lo[row * t + r0] as usize;
            s.fwd += (hq * (first / fwd_tile)) as u64;
            s.dq += (hq * (first / bwd_tile)) as u64;
            let end = hi[row * t + (r0 + 15).min(t - 1)] as usize;
            s.dkdv += (hq / hkv * hkv * (t.div_ceil(bwd_tile) - end.div_ceil(bwd_tile))) as u64;
        }
    }
    s
}

/// The `_seg` kernels' backward gives the same bits run to run (the second run on the
/// emulator's reversed thread schedule, where a race shows) and from 4- and 8-warp blocks; each
/// pass skips exactly the tiles the layout implies, with either block size.
#[test]
fn segment_kernels_are_deterministic_and_skip_what_lies_outside() {
    let Some(be) = gpu() else { return };
    let mut r = rng(44);
    for (hq, hkv, d, rows) in [(4, 2, 64, long_rows()), (2, 1, 128, vec![vec![7, 1, 56, 7], vec![71]])] {
        let (b, t) = (rows.len(), rows[0].iter().sum::<usize>());
        let dims = AttnDims { b, hq, hkv, t, d };
        let segs = segments(&rows);
        let x = [hq, hkv, hkv, hq].map(|h| dev_rand(&be, b * h * t * d, DType::BF16, &mut r));
        let run = |w: usize| with_flash_warps(w, || count_skipped_tiles(|| seg_bits(&be, &x, dims, &segs))).unwrap();
        let name = format!("hq{hq} hkv{hkv} d{d} {rows:?}");
        let (n8, n4) = same_bits_in_every_schedule(&be, &name, run);
        let want = expected_skips(&segs, dims);
        assert!(want.fwd > 0 && want.dkdv > 0 && want.dq > 0, "{name}: a layout that skips nothing tests nothing");
        assert_eq!(n8, want, "{name}: tiles skipped by the 8-warp kernels");
        assert_eq!(n4, want, "{name}: tiles skipped by the 4-warp kernels");
    }
}

/// Positions restarting at 0 in each segment of each row (`lens` per row, summing to t).
fn positions(rows: &[Vec<usize>]) -> Vec<i32> {
    rows.iter().flat_map(|r| r.iter().flat_map(|&l| 0..l as i32)).collect()
}

/// `rope_pos_*` in both head layouts, on its 16-byte vector path (d / 2 whole vectors) and one
/// element at a time (d = 12), forward and backward, with tables longer than any position.
#[test]
fn rope_at_positions_matches_the_cpu() {
    each_float_dtype(41, |dt, r: &mut Rng| {
        for (h, d, rows) in [(3, 64, vec![vec![5, 1, 11], vec![17]]), (2, 12, vec![vec![2, 2, 3], vec![1, 6]])] {
            let (b, t) = (rows.len(), rows[0].iter().sum::<usize>());
            let pos = positions(&rows);
            let (cos, sin) = (randn(&[24, d], dt, r), randn(&[24, d], dt, r));
            for time_major in [false, true] {
                let x = if time_major { randn(&[b, t, h, d], dt, r) } else { randn(&[b, h, t, d], dt, r) };
                let name = format!("rope_at {dt} h{h} d{d} time-major {time_major}");
                fwd_bwd(&name, dt, &[x], true, |v| {
                    let dev = v[0].device();
                    let x = if time_major { v[0].permute(&[0, 2, 1, 3]).unwrap() } else { v[0].clone() };
                    let p = Tokens::upload(pos.clone(), vec![b, t], dev).unwrap();
                    rope_at(&x, &cos.to_device(dev).unwrap(), &sin.to_device(dev).unwrap(), &p).unwrap()
                });
            }
        }
    });
}

/// Out-of-range positions are refused on the host copy before any launch.
#[test]
fn rope_at_refuses_positions_past_the_tables() {
    let Some(_) = gpu() else { return };
    let x = to_gpu(&Tensor::zeros([1, 1, 3, 4], DType::F32, Device::Cpu).unwrap());
    let c = to_gpu(&Tensor::zeros([2, 4], DType::F32, Device::Cpu).unwrap());
    let p = Tokens::upload(vec![0, 1, 2], vec![1, 3], GPU).unwrap();
    let e = rope_at(&x, &c, &c, &p).unwrap_err().to_string();
    assert!(e.contains("position 2 is outside the tables' 2 positions"), "{e}");
}
