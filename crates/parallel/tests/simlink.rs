//! SimLink: a collective completes `steps · alpha + bytes / bandwidth` after the link is free
//! (the alpha-beta ring model: an all-reduce over 2 ranks takes 2 latency steps, an all-gather
//! one), one at a time per link, and compute done before the result is read hides the delay.
//!
//! Tolerance: a measured time is at least the modelled time (minus 1 ms of clock slack: the
//! delay is a sleep until a deadline, which never ends early) and at most 40 ms above it (thread
//! wake-ups on a loaded 2-core CI machine).
use ferrolm_parallel::cost::{self, GroupSpan, Kind, Link, LinkModel};
use ferrolm_parallel::{CommOptions, Communicator, ReduceOp, SimLink, ThreadComm};
use ferrolm_tensor::{DType, Device, Tensor};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLACK: f64 = 0.001;
const TOL: f64 = 0.040;

fn opts() -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs(20))
}

fn assert_about(measured: f64, want: f64, what: &str) {
    assert!(measured >= want - SLACK && measured <= want + TOL, "{what}: measured {measured:.4} s, model {want:.4} s");
}

/// 40 ms latency, 1 MB/s: an all-reduce of 10 000 f32 over 2 ranks sends 40 000 bytes per rank.
fn flat() -> LinkModel {
    LinkModel::flat(Link::new(0.040, 1e6))
}

/// Runs `body` on `n` thread ranks, each with its communicator wrapped in a SimLink of `model`
/// and a tensor of `len` f32 ones; returns the ranks' results in rank order.
fn on_links<T: Send>(
    n: usize,
    model: LinkModel,
    len: usize,
    body: impl Fn(Arc<SimLink>, Tensor) -> ferrolm_tensor::Result<T> + Sync,
) -> Vec<T> {
    ThreadComm::run(n, opts(), |c| body(SimLink::wrap(c, model), Tensor::ones([len], DType::F32, Device::Cpu)?)).unwrap()
}

#[test]
fn a_collective_completes_after_alpha_plus_bytes_over_bandwidth() {
    on_links(2, flat(), 10_000, |link, x| {
        let want = 2.0 * 0.040 + 40_000.0 / 1e6;
        assert_eq!(link.seconds(ferrolm_parallel::Collective::AllReduce(ReduceOp::Sum), 40_000), want);
        link.barrier()?;
        let t0 = Instant::now();
        let w = link.all_reduce_async(&x, ReduceOp::Sum)?;
        assert!(!w.is_done(), "done before the link time passed");
        let y = w.wait()?;
        assert_about(t0.elapsed().as_secs_f64(), want, "all_reduce");
        assert!(w.is_done());
        assert_eq!(y.to_vec::<f32>()?[0], 2.0);
        // all_gather of 10 000 f32 per rank: (n-1)/n of the 80 000-byte output.
        let t0 = Instant::now();
        link.all_gather(&x)?;
        assert_about(t0.elapsed().as_secs_f64(), 0.040 + 40_000.0 / 1e6, "all_gather");
        Ok(())
    });
}

#[test]
fn back_to_back_collectives_are_serialised_on_the_link() {
    // x: 20 000 bytes: 100 ms each
    on_links(2, flat(), 5_000, |link, x| {
        let each = 2.0 * 0.040 + 20_000.0 / 1e6;
        link.barrier()?;
        let t0 = Instant::now();
        let works: Vec<_> = (0..3).map(|_| link.all_reduce_async(&x, ReduceOp::Sum)).collect::<Result<_, _>>()?;
        works[0].wait()?;
        assert_about(t0.elapsed().as_secs_f64(), each, "first");
        assert!(!works[2].is_done(), "the third waits for the link");
        works[2].wait()?;
        assert_about(t0.elapsed().as_secs_f64(), 3.0 * each, "third");
        Ok(())
    });
}

#[test]
fn compute_before_the_read_hides_the_link_time() {
    // x: 120 ms on the link
    let exposed = on_links(2, flat(), 10_000, |link, x| {
        link.barrier()?;
        let w = link.all_reduce_async(&x, ReduceOp::Sum)?;
        std::thread::sleep(Duration::from_millis(170)); // "compute" longer than the link time
        let t = Instant::now();
        let y = w.tensor().add_scalar(1.0)?; // first read
        let hidden_wait = t.elapsed().as_secs_f64();
        assert_eq!(y.to_vec::<f32>()?[0], 3.0);
        // The same collective read at once exposes all of it.
        link.barrier()?;
        let t = Instant::now();
        link.all_reduce_async(&x, ReduceOp::Sum)?.tensor().add_scalar(1.0)?;
        Ok((hidden_wait, t.elapsed().as_secs_f64()))
    });
    for (hidden, full) in exposed {
        assert!(hidden < 0.005, "waited {hidden:.4} s after computing past the link time");
        assert_about(full, 0.120, "read at once");
    }
}

/// Two nodes of two ranks: the world group pays the hierarchical cost, a node-local split (a
/// SimLink too) the intra-node one.
#[test]
fn a_two_level_link_charges_the_hierarchical_cost() {
    let model = LinkModel::two_level(Link::new(0.005, 1e7), Link::new(0.030, 1e6), 2);
    on_links(4, model, 10_000, |link, x| {
        let b = 40_000.0;
        // 2 (5 ms + 1/2 B / 1e7) + 2 x 30 ms + 2 (1/2) (B/2) / 1e6 = 14 + 60 + 20 ms.
        let want = cost::seconds(Kind::AllReduce, GroupSpan { per_node: 2, nodes: 2 }, b, &model);
        assert!((want - 0.094).abs() < 1e-9, "{want}");
        link.barrier()?;
        let t0 = Instant::now();
        link.all_reduce(&x, ReduceOp::Sum)?;
        assert_about(t0.elapsed().as_secs_f64(), want, "world all_reduce over 2 nodes");

        let node = link.split(link.rank() / 2, 0)?;
        assert_eq!(node.world_ranks().len(), 2);
        node.barrier()?;
        let t0 = Instant::now();
        assert_eq!(node.all_reduce(&x, ReduceOp::Sum)?.to_vec::<f32>()?[0], 2.0);
        assert_about(t0.elapsed().as_secs_f64(), 2.0 * 0.005 + b / 1e7, "node-local all_reduce");
        Ok(())
    });
}

/// Data cannot move before the last rank posts: a rank that arrives early waits for its peer
/// and then for the whole link time (the link time is not hidden behind the wait).
#[test]
fn the_transfer_starts_when_every_rank_has_posted() {
    // x: 120 ms on the link
    let waits = on_links(2, flat(), 10_000, |link, x| {
        link.barrier()?;
        let t0 = Instant::now();
        if link.rank() == 1 {
            std::thread::sleep(Duration::from_millis(150)); // the late rank
        }
        link.all_reduce(&x, ReduceOp::Sum)?;
        Ok(t0.elapsed().as_secs_f64())
    });
    for w in waits {
        assert_about(w, 0.150 + 0.120, "early and late rank alike");
    }
}
