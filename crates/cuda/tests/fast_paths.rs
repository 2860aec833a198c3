//! The bandwidth paths of the CUDA backend against the CPU reference, on fresh random inputs
//! with poisoned (NaN) outputs: dense 16-byte vector kernels (sizes that are not a multiple of
//! the vector width, offsets that are not 16-byte aligned, which fall back), broadcast scalar and
//! row operands, dense casts, fills, memcpy copies and cat, tiled transposes of odd shapes, and
//! the multi-block reductions (row splits and column chunks with a finishing pass), which must
//! also be bitwise deterministic with every block's threads scheduled in reverse. Plus the launch
//! geometry rule: a launch over more than 1M elements has at least one block per SM.
use ferrolm_cuda::{CudaBackend, ReducePlan};
use ferrolm_tensor::{DType, Device, Tensor};

mod common;
use common::*;

const SIZES: [usize; 6] = [1, 7, 8, 13, 1000, 4099];

#[test]
fn dense_unary_binary_and_casts() {
    each_float_dtype(11, |dt, r| {
        for n in SIZES {
            let x = randn(&[n + 1], dt, r);
            let y = randn(&[n + 1], dt, r);
            let (g, gy) = (to_gpu(&x), to_gpu(&y));
            // offset 0 (aligned: vector path) and offset 1 (unaligned: the strided fallback)
            for off in [0, 1] {
                let (a, b) = (x.narrow(0, off, n).unwrap(), y.narrow(0, off, n).unwrap());
                let (ga, gb) = (g.narrow(0, off, n).unwrap(), gy.narrow(0, off, n).unwrap());
                check("neg", &a.neg().unwrap(), &ga.neg().unwrap(), dt, false);
                check("exp", &a.exp().unwrap(), &ga.exp().unwrap(), dt, false);
                check("affine", &a.affine(-3.0, 0.25).unwrap(), &ga.affine(-3.0, 0.25).unwrap(), dt, false);
                check("add", &a.add(&b).unwrap(), &ga.add(&gb).unwrap(), dt, false);
                check("sub", &a.sub(&b).unwrap(), &ga.sub(&gb).unwrap(), dt, false);
                check("mul", &a.mul(&b).unwrap(), &ga.mul(&gb).unwrap(), dt, false);
                let other = if dt == DType::F32 { DType::BF16 } else { DType::F32 };
                check("cast", &a.to_dtype(other).unwrap(), &ga.to_dtype(other).unwrap(), dt, false);
                check("cast_i32", &a.to_dtype(DType::I32).unwrap(), &ga.to_dtype(DType::I32).unwrap(), dt, false);
            }
        }
    });
}

#[test]
fn broadcast_scalar_and_row() {
    each_float_dtype(12, |dt, r| {
        for (rows, cols) in [(1, 1), (3, 5), (7, 8), (5, 13), (33, 129), (2, 3)] {
            let x = randn(&[rows, cols], dt, r);
            let row = randn(&[cols], dt, r);
            let s = randn(&[1], dt, r);
            let (g, grow, gs) = (to_gpu(&x), to_gpu(&row), to_gpu(&s));
            check("add_row", &x.add(&row).unwrap(), &g.add(&grow).unwrap(), dt, false);
            check("row_sub", &row.sub(&x).unwrap(), &grow.sub(&g).unwrap(), dt, false);
            check(
                "row_div",
                &row.div(&x.sqr().unwrap().add_scalar(1.0).unwrap()).unwrap(),
                &grow.div(&g.sqr().unwrap().add_scalar(1.0).unwrap()).unwrap(),
                dt,
                false,
            );
            check("mul_scalar", &x.mul(&s).unwrap(), &g.mul(&gs).unwrap(), dt, false);
            check("scalar_sub", &s.sub(&x).unwrap(), &gs.sub(&g).unwrap(), dt, false);
            // a column vector broadcast over columns takes the strided kernel
            let col = randn(&[rows, 1], dt, r);
            check("sub_col", &x.sub(&col).unwrap(), &g.sub(&to_gpu(&col)).unwrap(), dt, false);
        }
    });
}

#[test]
fn fills_copies_cat_and_transposes() {
    each_float_dtype(13, |dt, r| {
        for n in SIZES {
            let c = Tensor::full(vec![n], -1.5, dt, Device::Cpu).unwrap();
            check("full", &c, &Tensor::full(vec![n], -1.5, dt, GPU).unwrap(), dt, false);
        }
        // even shapes take the bf16 pair kernel (transpose_pairs_b16), odd ones the element tiles
        for (a, b, k) in [(1, 1, 3), (3, 4, 5), (37, 45, 2), (64, 96, 1), (33, 70, 3), (130, 66, 2), (66, 200, 3)] {
            let x = randn(&[k, a, b], dt, r);
            let g = to_gpu(&x);
            // (batched) transposes: the tiled kernel
            check(
                "transpose",
                &x.transpose(1, 2).unwrap().contiguous().unwrap(),
                &g.transpose(1, 2).unwrap().contiguous().unwrap(),
                dt,
                false,
            );
            let x2 = x.narrow(0, 0, 1).unwrap().reshape(vec![a, b]).unwrap();
            let g2 = to_gpu(&x2);
            check("t", &x2.t().unwrap().contiguous().unwrap(), &g2.t().unwrap().contiguous().unwrap(), dt, false);
            // a transposed view with an offset
            check(
                "t_off",
                &x.narrow(0, k - 1, 1).unwrap().transpose(1, 2).unwrap().contiguous().unwrap(),
                &g.narrow(0, k - 1, 1).unwrap().transpose(1, 2).unwrap().contiguous().unwrap(),
                dt,
                false,
            );
            // other permutations: the strided copy
            check(
                "permute",
                &x.permute(&[2, 0, 1]).unwrap().contiguous().unwrap(),
                &g.permute(&[2, 0, 1]).unwrap().contiguous().unwrap(),
                dt,
                false,
            );
            // cat on dim 0 (dense: memcpy) and on the last dim (strided destination)
            let y = randn(&[k, a, b], dt, r);
            let gy = to_gpu(&y);
            for d in [0, 2] {
                check(
                    "cat",
                    &Tensor::cat(&[x.clone(), y.clone()], d).unwrap(),
                    &Tensor::cat(&[g.clone(), gy.clone()], d).unwrap(),
                    dt,
                    false,
                );
            }
            // cast of a transposed view (strided cast kernel)
            let other = if dt == DType::F32 { DType::BF16 } else { DType::F32 };
            check(
                "cast_t",
                &x.transpose(1, 2).unwrap().to_dtype(other).unwrap(),
                &g.transpose(1, 2).unwrap().to_dtype(other).unwrap(),
                dt,
                false,
            );
        }
    });
}

/// (shape, dims) of reductions that reach the multi-block paths at emulator sizes.
fn reductions() -> Vec<(Vec<usize>, Vec<usize>)> {
    vec![
        (vec![300_001], vec![0]),     // full sum: one row split over many blocks
        (vec![3, 50_003], vec![1]),   // few long rows
        (vec![2_000, 70], vec![0]),   // column sum: coalesced columns, chunks of rows
        (vec![1_500, 300], vec![0]),  // column sum over two column tiles
        (vec![4, 3_001, 5], vec![1]), // a middle dim, few outputs
        (vec![257, 40], vec![1]),     // short rows: thread per output
        (vec![64, 129], vec![0, 1]),  // all dims
        (vec![20, 3], vec![1]),       // tiny
    ]
}

#[test]
fn multi_block_reductions_match_cpu() {
    each_float_dtype(14, |dt, r| {
        for (shape, dims) in reductions() {
            let x = randn(&shape, dt, r);
            let g = to_gpu(&x);
            check("sum", &x.sum_keepdim(&dims).unwrap(), &g.sum_keepdim(&dims).unwrap(), dt, true);
            check("max", &x.max(&dims, true).unwrap(), &g.max(&dims, true).unwrap(), dt, false);
            // transposed input: the reduced dim is no longer the inner one
            if shape.len() == 2 {
                let (xt, gt) = (x.t().unwrap(), g.t().unwrap());
                let d: Vec<usize> = dims.iter().map(|&d| 1 - d).collect();
                check("sum_t", &xt.sum_keepdim(&d).unwrap(), &gt.sum_keepdim(&d).unwrap(), dt, true);
                check("max_t", &xt.max(&d, true).unwrap(), &gt.max(&d, true).unwrap(), dt, false);
            }
        }
    });
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64().unwrap().into_iter().map(f64::to_bits).collect()
}

#[test]
fn reductions_are_bitwise_deterministic() {
    let Some(be) = gpu() else { return };
    let mut r = rng(15);
    for (shape, dims) in reductions().into_iter().take(4) {
        let g = to_gpu(&randn(&shape, DType::F32, &mut r));
        let a = (bits(&g.sum_keepdim(&dims).unwrap()), bits(&g.max(&dims, true).unwrap()));
        be.emulator_reverse_schedule(true); // on the emulator this also checks for races
        let b = (bits(&g.sum_keepdim(&dims).unwrap()), bits(&g.max(&dims, true).unwrap()));
        be.emulator_reverse_schedule(false);
        assert_eq!(a, b, "{shape:?} over {dims:?}: results differ between runs");
    }
}

fn blocks(p: &ReducePlan) -> u32 {
    p.main.grid.0
}

#[test]
fn launch_geometry_fills_the_device() {
    let Some(be) = gpu() else { return };
    let sm = be.sm_count();
    if be.is_emulated() {
        assert_eq!(sm, 132);
    }
    let be: &CudaBackend = &be;
    for n in [2usize << 20, 16 << 20, 24_600_000] {
        for (w, v) in [(4, true), (2, true), (4, false), (2, false)] {
            let l = be.plan_elementwise(n, w, v);
            assert!(l.grid.0 >= sm, "element-wise n={n} width {w} vector {v}: {} blocks < {sm} SMs", l.grid.0);
        }
        // full sum, column sums, row sums of every aspect ratio, strided or not
        for nout in [1, 2, 7, 31, 32, 100, 1024, 4096, 50_000, n / 64, n / 2, n] {
            let nred = n / nout;
            for rows_contig in [true, false] {
                let p = be.plan_reduce(nout, nred, rows_contig);
                assert!(blocks(&p) >= sm, "reduce {nout} x {nred} (rows {rows_contig}): {} blocks < {sm} SMs", blocks(&p));
                if p.rows {
                    assert!(nout > 1 || p.splits > 1, "a whole tensor on one block: {p:?}");
                }
                assert!(p.splits * p.chunk >= nred && (p.splits - 1) * p.chunk < nred.max(1), "{p:?} does not cover {nred}");
                assert_eq!(p.finish.is_some(), p.splits > 1);
            }
        }
    }
}

/// Head permutes (b, t, h, d) -> (b, h, t, d) and back, as attention's split/merge makes them:
/// with d a multiple of the 16-byte vector (8 bf16, 4 f32) the copy runs in 16-byte units
/// (`strided_copy_b128`); d = 6 and an odd view offset take the element kernel. Every element
/// must land exactly where the CPU puts it.
#[test]
fn head_permutes_copy_in_vectors_and_elements() {
    each_float_dtype(14, |dt, r| {
        for (b, t, h, d) in [(2, 5, 3, 8), (1, 7, 4, 16), (2, 3, 2, 64), (2, 5, 3, 6), (1, 9, 2, 12)] {
            let x = randn(&[b, t, h, d], dt, r);
            let g = to_gpu(&x);
            // The device result `got` holds the CPU's `want` element for element.
            let same = |got: &Tensor, want: &Tensor, what: &str| {
                let got = got.to_device(Device::Cpu).unwrap().to_vec_f64().unwrap();
                assert_eq!(got, want.to_vec_f64().unwrap(), "{what} {:?} {dt}", (b, t, h, d));
            };
            let heads_first = |x: &Tensor| x.permute(&[0, 2, 1, 3]).unwrap().contiguous().unwrap();
            let got = heads_first(&g);
            same(&got, &heads_first(&x), "split");
            same(&heads_first(&got), &x, "merge");
            // a view one element in: no longer whole vectors
            let flat = randn(&[b * t * h * d + 1], dt, r);
            let gflat = to_gpu(&flat);
            let v = |f: &Tensor| heads_first(&f.narrow(0, 1, b * t * h * d).unwrap().reshape([b, t, h, d]).unwrap());
            same(&v(&gflat), &v(&flat), "offset");
        }
    });
}

/// Every unary op on the dense path (the op is a template parameter there), aligned and not.
#[test]
fn every_unary_op_on_the_dense_path() {
    each_float_dtype(15, |dt, r| {
        for n in [13usize, 4099] {
            let x = randn(&[n + 1], dt, r);
            let g = to_gpu(&x);
            for off in [0, 1] {
                let (a, ga) = (x.narrow(0, off, n).unwrap(), g.narrow(0, off, n).unwrap());
                let (p, gp) = (a.sqr().unwrap().add_scalar(0.5).unwrap(), ga.sqr().unwrap().add_scalar(0.5).unwrap());
                check("silu", &a.silu().unwrap(), &ga.silu().unwrap(), dt, false);
                check("sqr", &a.sqr().unwrap(), &ga.sqr().unwrap(), dt, false);
                check("log", &p.log().unwrap(), &gp.log().unwrap(), dt, false);
                check("sqrt", &p.sqrt().unwrap(), &gp.sqrt().unwrap(), dt, false);
                check("rsqrt", &p.rsqrt().unwrap(), &gp.rsqrt().unwrap(), dt, false);
                check("recip", &p.recip().unwrap(), &gp.recip().unwrap(), dt, false);
                check("powf", &p.powf(1.5).unwrap(), &gp.powf(1.5).unwrap(), dt, false);
            }
        }
    });
}

/// Sums and maxima over dense rows whose start is not 16-byte aligned (the vector loop starts
/// after a scalar head) and whose length is not a multiple of the vector.
#[test]
fn dense_row_reductions_from_unaligned_starts() {
    each_float_dtype(16, |dt, r| {
        for (rows, cols, off) in [(3usize, 1001usize, 1usize), (2, 70_001, 3), (1, 300_007, 5), (4, 4096, 0)] {
            let flat = randn(&[rows * cols + off], dt, r);
            let g = to_gpu(&flat);
            let v = |f: &Tensor| f.narrow(0, off, rows * cols).unwrap().reshape([rows, cols]).unwrap();
            check("row sum", &v(&flat).sum(&[1], false).unwrap(), &v(&g).sum(&[1], false).unwrap(), dt, true);
            check("row max", &v(&flat).max(&[1], false).unwrap(), &v(&g).max(&[1], false).unwrap(), dt, false);
            check("full sum", &v(&flat).sum_all().unwrap(), &v(&g).sum_all().unwrap(), dt, true);
        }
    });
}
