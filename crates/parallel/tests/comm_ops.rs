//! The collective autograd ops against the single-process computation (f64, world sizes 2 and
//! 4): Megatron's f/g around a column- then row-parallel MLP, sequence parallelism's gather /
//! reduce-scatter pair along dim 0 and dim 1, and scatter. Forward values and every gradient
//! (each rank's shard compared with the matching block of the full gradient) agree to 1e-12;
//! results and gradients come back pending.
use ferrolm_parallel::comm_ops::{copy_to_group, gather_from_group, reduce_from_group, reduce_scatter, scatter_to_group};
use ferrolm_parallel::{CommOptions, ThreadComm};
use ferrolm_tensor::{DType, Device, Rng, Tensor};
use std::time::Duration;

fn opts() -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs(20))
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape.to_vec(), 1.0, DType::F64, Device::Cpu, &mut Rng::new(seed)).unwrap()
}

fn leaf(t: &Tensor) -> Tensor {
    let l = t.detach().contiguous().unwrap();
    l.set_requires_grad(true).unwrap();
    l
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{what}[{i}]: {a} vs {b}");
    }
}

/// Y = silu(X W1) W2, loss = sum(Y * C): the serial run and its gradients.
struct Mlp {
    x: Tensor,
    w1: Tensor,
    w2: Tensor,
    c: Tensor,
    y: Tensor,
}

fn serial_mlp(t: usize, d: usize, h: usize) -> Mlp {
    let (x, w1, w2) = (leaf(&randn(&[t, d], 1)), leaf(&randn(&[d, h], 2)), leaf(&randn(&[h, d], 3)));
    let c = randn(&[t, d], 4);
    let y = x.matmul(&w1).unwrap().silu().unwrap().matmul(&w2).unwrap();
    y.mul(&c).unwrap().sum_all().unwrap().backward().unwrap();
    Mlp { x, w1, w2, c, y: y.detach() }
}

impl Mlp {
    /// Rank r's weight shards as leaves, hb hidden units each: W1 by columns (column-parallel),
    /// W2 by rows (row-parallel).
    fn weight_shards(&self, r: usize, hb: usize) -> ferrolm_tensor::Result<(Tensor, Tensor)> {
        Ok((leaf(&self.w1.narrow(1, r * hb, hb)?), leaf(&self.w2.narrow(0, r * hb, hb)?)))
    }

    /// The shards' gradients are the matching blocks of the serial run's.
    fn check_weight_grads(&self, w1: &Tensor, w2: &Tensor, r: usize, hb: usize) -> ferrolm_tensor::Result<()> {
        assert_close(&w1.grad().unwrap(), &self.w1.grad().unwrap().narrow(1, r * hb, hb)?, "dW1 shard");
        assert_close(&w2.grad().unwrap(), &self.w2.grad().unwrap().narrow(0, r * hb, hb)?, "dW2 shard");
        Ok(())
    }
}

#[test]
fn f_and_g_around_a_tensor_parallel_mlp_match_the_serial_run() {
    for n in [2, 4] {
        let (t, d, h) = (5, 6, 8);
        let s = serial_mlp(t, d, h);
        ThreadComm::run(n, opts(), |comm| {
            let (r, hb) = (comm.rank(), h / n);
            let x = leaf(&s.x);
            let (w1, w2) = s.weight_shards(r, hb)?;
            let xc = copy_to_group(&x, &comm)?;
            let partial = xc.matmul(&w1)?.silu()?.matmul(&w2)?;
            let y = reduce_from_group(&partial, &comm)?;
            assert!(y.is_pending(), "g's forward result is the pending all-reduce");
            y.mul(&s.c)?.sum_all()?.backward()?;
            let gx = x.grad().unwrap();
            assert!(gx.is_pending(), "f's backward returns the pending all-reduce of the gradient");
            assert_close(&y, &s.y, "forward");
            assert_close(&gx, &s.x.grad().unwrap(), "dX");
            s.check_weight_grads(&w1, &w2, r, hb)
        })
        .unwrap();
    }
}

#[test]
fn sequence_parallel_gather_and_reduce_scatter_match_the_serial_run() {
    for n in [2, 4] {
        let (t, d, h) = (8, 3, 4 * n);
        let s = serial_mlp(t, d, h);
        ThreadComm::run(n, opts(), |comm| {
            let (r, tb, hb) = (comm.rank(), t / n, h / n);
            let x = leaf(&s.x.narrow(0, r * tb, tb)?); // this rank's sequence block
            let (w1, w2) = s.weight_shards(r, hb)?;
            let xg = gather_from_group(&x, &comm, 0)?;
            assert!(xg.is_pending());
            let partial = xg.matmul(&w1)?.silu()?.matmul(&w2)?;
            let y = reduce_scatter(&partial, &comm, 0)?;
            assert!(y.is_pending());
            let c = s.c.narrow(0, r * tb, tb)?;
            y.mul(&c)?.sum_all()?.backward()?;
            let gx = x.grad().unwrap();
            assert!(gx.is_pending(), "gather's backward is a pending reduce-scatter");
            assert_close(&y, &s.y.narrow(0, r * tb, tb)?, "forward rows");
            assert_close(&gx, &s.x.grad().unwrap().narrow(0, r * tb, tb)?, "dX rows");
            s.check_weight_grads(&w1, &w2, r, hb)
        })
        .unwrap();
    }
}

/// The same pair along dim 1 of a (batch, seq, d) activation: the transposes around the dim-0
/// collectives must put every block back in place.
#[test]
fn gather_and_reduce_scatter_along_dim_1() {
    for n in [2, 4] {
        let (b, t, d) = (3, 2 * n, 5);
        let x_full = leaf(&randn(&[b, t, d], 11));
        let w = leaf(&randn(&[b, t, d], 12));
        let c = randn(&[b, t / n, d], 13);
        // Serial: every rank contributes x * w * (r + 1) to the sum, rank r keeps seq block r.
        let total: f64 = (1..=n).map(|k| k as f64).sum();
        let y_full = x_full.mul(&w).unwrap().mul_scalar(total).unwrap();
        let loss: Vec<Tensor> = (0..n).map(|r| y_full.narrow(1, r * (t / n), t / n).unwrap().mul(&c).unwrap().sum_all().unwrap()).collect();
        let mut l = loss[0].clone();
        for x in &loss[1..] {
            l = l.add(x).unwrap();
        }
        l.backward().unwrap();
        ThreadComm::run(n, opts(), |comm| {
            let (r, tb) = (comm.rank(), t / n);
            let x = leaf(&x_full.narrow(1, r * tb, tb)?);
            let xg = gather_from_group(&x, &comm, 1)?;
            assert_eq!(xg.dims(), [b, t, d]);
            let partial = xg.mul(&w)?.mul_scalar((r + 1) as f64)?;
            let y = reduce_scatter(&partial, &comm, 1)?;
            assert_close(&y, &y_full.narrow(1, r * tb, tb)?, "forward");
            y.mul(&c)?.sum_all()?.backward()?;
            assert_close(&x.grad().unwrap(), &x_full.grad().unwrap().narrow(1, r * tb, tb)?, "dX");
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn scatter_keeps_the_rank_block_and_gathers_the_gradient() {
    let n = 4;
    let x_full = randn(&[3, 8], 21);
    let c = randn(&[3, 8], 22);
    ThreadComm::run(n, opts(), |comm| {
        let r = comm.rank();
        let x = leaf(&x_full);
        let xs = scatter_to_group(&x, &comm, 1)?;
        assert_close(&xs, &x_full.narrow(1, 2 * r, 2)?, "block");
        xs.mul(&c.narrow(1, 2 * r, 2)?)?.sum_all()?.backward()?;
        let g = x.grad().unwrap();
        assert!(g.is_pending(), "scatter's backward is a pending all-gather");
        // Each rank's loss touches its block only; the gathered gradient is all of C.
        assert_close(&g, &c, "dX");
        assert!(scatter_to_group(&randn(&[3, 6], 1), &comm, 1).is_err(), "6 columns over 4 ranks");
        Ok(())
    })
    .unwrap();
}
