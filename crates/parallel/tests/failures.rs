//! A collective never hangs silently: a rank that never joins, returns early, errors or panics
//! makes the others fail promptly (or at the short timeout) with the rank, group, operation and
//! sequence number; ranks that disagree on a collective get an error naming both sides.
use ferrolm_parallel::{CommOptions, Communicator, ReduceOp, ThreadComm};
use ferrolm_tensor::{bail, DType, Device, Tensor};
use std::sync::Mutex;
use std::time::{Duration, Instant};

fn opts(secs: f64) -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs_f64(secs))
}

fn ones(n: usize) -> Tensor {
    Tensor::ones([n], DType::F32, Device::Cpu).unwrap()
}

/// Runs `f` on `n` ranks and returns each rank's (error message, seconds it took), the error
/// of `run` itself, and the total wall time.
fn run_failing(n: usize, o: CommOptions, f: impl Fn(&dyn Communicator) -> ferrolm_tensor::Result<()> + Sync) -> (Vec<String>, String, f64) {
    let msgs = Mutex::new(vec![String::new(); n]);
    let t0 = Instant::now();
    let e = ThreadComm::run(n, o, |c| {
        let r = f(c.as_ref());
        if let Err(e) = &r {
            msgs.lock().unwrap()[c.rank()] = e.to_string();
        }
        r
    })
    .unwrap_err()
    .to_string();
    (msgs.into_inner().unwrap(), e, t0.elapsed().as_secs_f64())
}

#[test]
fn a_rank_that_never_joins_times_out_with_the_full_context() {
    let (msgs, e, secs) = run_failing(2, opts(0.3), |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1200));
            return Ok(());
        }
        c.all_reduce(&ones(3), ReduceOp::Sum)?; // #0 completes only if rank 1 came
        Ok(())
    });
    let m = &msgs[0];
    for want in ["rank 0 of group world", "all_reduce(sum) #0", "timed out after 0.3 s", "waiting for rank 1 to join"] {
        assert!(m.contains(want), "missing {want:?} in {m:?}");
    }
    assert!(e.contains("rank 0 failed"), "{e}");
    assert!(secs < 1.5, "rank 1 sleeps 1.2 s, the failure was reported after {secs:.2} s");
}

#[test]
fn a_rank_that_returns_without_joining_fails_the_others_at_once() {
    let t0 = Instant::now();
    let (msgs, _, _) = run_failing(3, opts(60.0), |c| {
        if c.rank() == 2 {
            return Ok(());
        }
        c.barrier()?;
        Ok(())
    });
    for m in &msgs[..2] {
        assert!(m.contains("barrier #0") && m.contains("rank 2 exited without joining it"), "{m}");
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "failed only after {:?}", t0.elapsed());
}

#[test]
fn a_rank_error_fails_the_pending_collectives_of_the_others() {
    let t0 = Instant::now();
    let (msgs, e, _) = run_failing(3, opts(60.0), |c| {
        let w = c.all_reduce_async(&ones(4), ReduceOp::Sum)?; // #0: everyone joins
        w.wait()?;
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(100));
            bail!("train_step", "loss is NaN at step 7");
        }
        let w = c.all_gather_async(&ones(2))?; // #1: rank 1 never launches it
        w.wait()?;
        Ok(())
    });
    assert_eq!(e, "thread_comm: rank 1 failed: train_step: loss is NaN at step 7 (2 other rank(s) failed after it)");
    for r in [0, 2] {
        let m = &msgs[r];
        assert!(m.contains("all_gather #1") && m.contains("rank 1 exited: train_step: loss is NaN at step 7"), "rank {r}: {m}");
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_rank_panic_is_reported_with_its_rank_and_message() {
    let t0 = Instant::now();
    let (msgs, e, _) = run_failing(4, opts(60.0), |c| {
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(50));
            panic!("kaboom in rank two");
        }
        // A sub-group without rank 2 is unaffected in itself but sees the world's failure.
        let g = c.split((c.rank() == 3) as usize, 0);
        g?.barrier()?;
        Ok(())
    });
    assert!(e.contains("rank 2 failed: panicked: kaboom in rank two"), "{e}");
    for r in [0, 1, 3] {
        assert!(msgs[r].contains("rank 2 exited: panicked: kaboom in rank two"), "rank {r}: {}", msgs[r]);
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_failed_world_refuses_new_collectives_at_launch() {
    let (msgs, _, _) = run_failing(2, opts(60.0), |c| {
        if c.rank() == 1 {
            c.abort("out of memory");
            bail!("rank1", "gave up");
        }
        std::thread::sleep(Duration::from_millis(100));
        match c.all_reduce_async(&ones(1), ReduceOp::Sum) {
            Err(e) => Err(e),
            Ok(_) => Ok(()),
        }
    });
    assert!(msgs[0].contains("rank 1 exited: out of memory"), "{}", msgs[0]);
}

#[test]
fn ranks_that_disagree_get_an_error_naming_both_sides_and_later_collectives_work() {
    ThreadComm::run(2, opts(20.0), |c| {
        let r = c.rank();
        // Shapes.
        let e = c.all_reduce(&ones(3 + r), ReduceOp::Sum).unwrap_err().to_string();
        assert!(
            e.contains("rank 0 launched all_reduce(sum) of [3] f32") && e.contains("rank 1 launched all_reduce(sum) of [4] f32"),
            "{e}"
        );
        assert!(e.contains("#0"), "{e}");
        // Dtypes.
        let x = ones(2).to_dtype(if r == 0 { DType::F32 } else { DType::BF16 })?;
        let e = c.all_gather(&x).unwrap_err().to_string();
        assert!(e.contains("all_gather of [2] f32") && e.contains("all_gather of [2] bf16"), "{e}");
        // Reduce ops and kinds.
        let op = if r == 0 { ReduceOp::Sum } else { ReduceOp::Max };
        let e = c.all_reduce(&ones(2), op).unwrap_err().to_string();
        assert!(e.contains("all_reduce(sum)") && e.contains("all_reduce(max)"), "{e}");
        let e = if r == 0 { c.broadcast(&ones(2), 0) } else { c.reduce_scatter(&ones(2), ReduceOp::Sum) }.unwrap_err().to_string();
        assert!(e.contains("broadcast(root 0) of [2] f32") && e.contains("reduce_scatter(sum) of [2] f32"), "{e}");
        // The sequence numbers stayed aligned: the next collective is fine.
        assert_eq!(c.all_reduce(&ones(2), ReduceOp::Sum)?.to_vec::<f32>()?, [2.0, 2.0]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn bad_arguments_fail_locally_before_anything_is_sent() {
    ThreadComm::run(2, opts(20.0), |c| {
        let e = c.reduce_scatter_async(&ones(3), ReduceOp::Sum).err().expect("3 rows over 2 ranks").to_string();
        assert!(e.contains("not divisible by the group size 2"), "{e}");
        assert!(c.broadcast_async(&ones(3), 2).is_err());
        assert!(c.all_gather_async(&Tensor::scalar(1.0, DType::F32, Device::Cpu)?).is_err());
        // Nothing was launched, so the ranks are still in step.
        c.barrier()?;
        Ok(())
    })
    .unwrap();
}

/// A result that is never read does not block anything, and its slot is released.
#[test]
fn dropped_results_do_not_block_later_collectives() {
    ThreadComm::run(3, opts(20.0), |c| {
        for _ in 0..50 {
            drop(c.all_reduce_async(&ones(64), ReduceOp::Sum)?);
        }
        assert_eq!(c.all_reduce(&ones(1), ReduceOp::Sum)?.to_vec::<f32>()?, [3.0]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn the_timeout_comes_from_the_environment_when_set() {
    // The only test in this binary that touches the environment.
    std::env::set_var("FERROLM_COMM_TIMEOUT_S", "2.5");
    assert_eq!(CommOptions::from_env().unwrap().timeout, Duration::from_millis(2500));
    std::env::set_var("FERROLM_COMM_TIMEOUT_S", "soon");
    let e = CommOptions::from_env().unwrap_err().to_string();
    assert!(e.contains("FERROLM_COMM_TIMEOUT_S=\"soon\""), "{e}");
    std::env::remove_var("FERROLM_COMM_TIMEOUT_S");
    assert_eq!(CommOptions::from_env().unwrap().timeout, Duration::from_secs(600));
}
