//! The primitives that feed the tensor cores, through the one-warp probes of kernels/probe.cu:
//! `ldmatrix` (.x1 / .x2 / .x4, with and without .trans) against the fragment layout the PTX ISA
//! states, recomputed here independently of the emulator, on fresh random data and row addresses
//! in a random order; and `cp.async` with commit / wait groups (16-byte copies with zero fill, and
//! 4-byte copies). On the emulator this checks its implementation of both (through which every
//! flash-attention kernel runs in CI); on a GPU the same assertions check the emulator's model
//! against the hardware. On the emulator only, a read before the wait must see NaN bits: that is
//! how a kernel that forgets a cp.async wait fails its tests without a GPU.
use ferrolm_cuda::{kernels, CudaBackend, Launch};
use ferrolm_tensor::backend::Backend;
use ferrolm_tensor::{CpuStorage, Rng, Storage};

mod common;
use common::*;

fn up_u32(be: &CudaBackend, v: &[u32]) -> Storage {
    be.from_cpu(&CpuStorage::I32(v.iter().map(|&x| x as i32).collect())).unwrap()
}
fn poison(be: &CudaBackend, n: usize) -> Storage {
    up_u32(be, &vec![ferrolm_testing::poison::SENTINEL; n])
}

/// The 16-bit element (row, col) of the 8x8 matrix `m` that ldmatrix reads when lane 8m + row
/// gives staged row rows[8m + row]; src holds 32 rows of 8 halves.
fn elem(src: &[u32], rows: &[i32], m: usize, row: usize, col: usize) -> u32 {
    let r = rows[8 * m + row] as usize;
    let word = src[4 * r + col / 2];
    if col.is_multiple_of(2) {
        word & 0xffff
    } else {
        word >> 16
    }
}

/// What lane `lane` must hold in register m (PTX ISA, "Warp-level matrix load instruction:
/// ldmatrix"): without .trans, row lane/4, columns 2(lane%4) and +1 of matrix m; with .trans, rows
/// 2(lane%4) and +1 of column lane/4. The lower-indexed element is in the low 16 bits.
fn expected(src: &[u32], rows: &[i32], m: usize, lane: usize, trans: bool) -> u32 {
    let (lo, hi) = if trans {
        (elem(src, rows, m, 2 * (lane % 4), lane / 4), elem(src, rows, m, 2 * (lane % 4) + 1, lane / 4))
    } else {
        (elem(src, rows, m, lane / 4, 2 * (lane % 4)), elem(src, rows, m, lane / 4, 2 * (lane % 4) + 1))
    };
    lo | (hi << 16)
}

#[test]
fn ldmatrix_matches_the_ptx_fragment_layout() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(31);
    for n in [1, 2, 4] {
        for trans in [false, true] {
            let src: Vec<u32> = (0..128).map(|_| r.below(1 << 32) as u32).collect();
            // the rows in a random order: lane L addresses staged row rows[L]
            let mut rows: Vec<i32> = (0..32).collect();
            for i in (1..32).rev() {
                rows.swap(i, r.below(i as u64 + 1) as usize);
            }
            let (s, rw) = (up_u32(&be, &src), be.from_cpu(&CpuStorage::I32(rows.clone())).unwrap());
            let out = poison(&be, 128);
            // SAFETY: src holds 128 words, rows 32 ints (each < 32), out 128 words; one warp with
            // the 512 bytes of shared memory the probe stages the rows in.
            unsafe {
                kernels::probe_ldmatrix(
                    &be,
                    Launch::new((1, 1, 1), 32).smem(512),
                    cs(&s).ptr(),
                    cs(&rw).ptr(),
                    cs(&out).ptr(),
                    n,
                    trans as i32,
                )
                .unwrap()
            };
            let got = bits(&be, &out);
            for lane in 0..32 {
                for m in 0..4 {
                    let g = got[4 * lane + m];
                    if m < n as usize {
                        let want = expected(&src, &rows, m, lane, trans);
                        assert_eq!(g, want, "ldmatrix .x{n} trans={trans}: lane {lane} register {m}: {g:#010x}, PTX layout {want:#010x}");
                    } else {
                        assert_eq!(g, ferrolm_testing::poison::SENTINEL, "ldmatrix .x{n}: lane {lane} wrote register {m}");
                    }
                }
            }
        }
    }
}

#[test]
fn cp_async_groups_complete_in_order_with_zero_fill() {
    let Some(be) = gpu() else { return };
    let mut r = Rng::new(32);
    let words = |r: &mut Rng, n: usize| -> Vec<u32> { (0..n).map(|_| r.below(1 << 32) as u32).collect() };
    let (a, b, c) = (words(&mut r, 128), words(&mut r, 128), words(&mut r, 32));
    let (sa, sb, sc) = (up_u32(&be, &a), up_u32(&be, &b), up_u32(&be, &c));
    let (out, outw) = (poison(&be, 256), poison(&be, 32));
    // SAFETY: a and b hold 128 words, c 32; out and outw hold at least 256 and 32 words; one
    // warp, 1536 bytes of shared memory (three regions of 32 16-byte chunks).
    let launch = |out: &Storage, early: i32| unsafe {
        let ptrs = [&sa, &sb, &sc, out, &outw].map(|s| cs(s).ptr());
        let cfg = Launch::new((1, 1, 1), 32).smem(3 * 32 * 16);
        kernels::probe_cp_async(&be, cfg, ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4], early).unwrap()
    };
    launch(&out, 0);
    let (got, gotw) = (bits(&be, &out), bits(&be, &outw));
    for x in 0..32 {
        let src = 31 - x; // thread x reads the chunk thread 31 - x copied
        for k in 0..4 {
            assert_eq!(got[4 * x + k], a[4 * src + k], "group A (waited with 2 groups pending), chunk {src} word {k}");
            let want_b = if src % 3 == 0 { 0 } else { b[4 * src + k] };
            assert_eq!(got[128 + 4 * x + k], want_b, "group B (zero fill where src-size is 0), chunk {src} word {k}");
        }
        assert_eq!(gotw[x], c[src], "group C (4-byte copies), word {src}");
    }
    if be.is_emulated() {
        let out = poison(&be, 256);
        launch(&out, 1);
        let got = bits(&be, &out);
        assert!(got[..128].iter().all(|&w| w == u32::MAX), "a read before cp.async.wait_group must see NaN bits on the emulator");
    }
}
