//! Packed rows on the CUDA device (the GPU, else the CPU emulator) against the CPU reference,
//! with outputs poisoned (FERROLM_CUDA_POISON=1, so an unwritten element fails): RoPE at
//! per-token positions (`rope_pos_*`). Tolerances as in cuda.rs. With no CUDA device the tests
//! print "skipped: no CUDA device" and pass, unless FERROLM_REQUIRE_GPU=1 (or
//! FERROLM_REQUIRE_EMU=1 without the emulator), where they fail.
#[path = "../../cuda/tests/common/mod.rs"]
mod common;
use common::*;
use ferrolm_ops::{rope_at, Tokens};
use ferrolm_tensor::{DType, Device, Rng, Tensor};

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
