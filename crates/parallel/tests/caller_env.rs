//! `FERROLM_THREADCOMM_CALLER_RESOLVE`, every form its help names. Its own test binary: the
//! variable is process-wide.
use ferrolm_parallel::thread::{caller_resolve_from_env, ENV_CALLER_RESOLVE};
use ferrolm_parallel::{CommOptions, ReduceOp, ThreadComm};
use ferrolm_tensor::{Device, Tensor};

#[test]
fn caller_resolve_variable_takes_1_or_0_and_names_a_bad_value() {
    assert_eq!(ENV_CALLER_RESOLVE, "FERROLM_THREADCOMM_CALLER_RESOLVE");
    std::env::remove_var(ENV_CALLER_RESOLVE);
    assert!(!caller_resolve_from_env().unwrap());
    for (v, on) in [("1", true), (" 1 ", true), ("0", false), ("", false)] {
        std::env::set_var(ENV_CALLER_RESOLVE, v);
        assert_eq!(caller_resolve_from_env().unwrap(), on, "{v:?}");
    }
    // On, through the variable or the option: a pending input that is not a whole collective
    // result (a view of one) is waited for where the collective is launched, and counted. Rank 1
    // joins the first all-reduce late, so rank 0's result is still in flight when it launches
    // the second; without caller resolution nothing is counted.
    assert_eq!(waits_of_a_pending_view(CommOptions::default()), 0, "{ENV_CALLER_RESOLVE} empty: off");
    assert!(waits_of_a_pending_view(CommOptions::default().with_caller_resolve(true)) >= 1, "CommOptions::with_caller_resolve");
    std::env::set_var(ENV_CALLER_RESOLVE, "1");
    assert!(waits_of_a_pending_view(CommOptions::default()) >= 1, "{ENV_CALLER_RESOLVE}=1");
    // A bad value is refused when a world is made, naming the variable and the value.
    std::env::set_var(ENV_CALLER_RESOLVE, "yes");
    let Err(e) = ThreadComm::world(2, CommOptions::default()) else { panic!("a bad value is refused") };
    let e = e.to_string();
    assert!(e.contains(ENV_CALLER_RESOLVE) && e.contains("\"yes\""), "{e}");
    std::env::remove_var(ENV_CALLER_RESOLVE);
}

/// Caller-side waits counted while two ranks all-reduce a view of a result still in flight.
fn waits_of_a_pending_view(options: CommOptions) -> u64 {
    let before = ThreadComm::caller_waits();
    let out = ThreadComm::run(2, options, |c| {
        if c.rank() == 1 {
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        let x = Tensor::from_vec(vec![1.0f32; 4], [4], Device::Cpu)?;
        let first = c.all_reduce_async(&x, ReduceOp::Sum)?.tensor();
        c.all_reduce(&first.narrow(0, 0, 2)?, ReduceOp::Sum)?.to_vec::<f32>()
    })
    .unwrap();
    assert_eq!(out, vec![vec![4.0; 2]; 2]);
    ThreadComm::caller_waits() - before
}
