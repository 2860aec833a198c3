//! The one "run on the device or skip" gate of the test binaries.
//!
//! A test that needs a device asks for it with [`require`] (or, having found it missing, calls
//! [`skip`]). Where it is there, the test runs. Where it is missing, the test passes after saying
//! `skipped: <why>` on stderr — unless the environment demands it:
//!
//! | the test needs | fails instead of skipping under |
//! | --- | --- |
//! | [`Need::Device`]: a GPU, or the CUDA emulator where there is none | `FERROLM_REQUIRE_EMU=1` (CI) or `FERROLM_REQUIRE_GPU=1` |
//! | [`Need::Emulator`]: the emulator itself (its streams and hooks, the emulated NCCL) | `FERROLM_REQUIRE_EMU=1` |
//! | [`Need::Gpus`]`(n)`: `n` real GPUs | `FERROLM_REQUIRE_GPU=1`, when `n` is 1 (the GPU runner has one GPU) |
//!
//! Where no GPU is visible, a test that would let the emulator stand in calls [`no_gpu_visible`]
//! first: under `FERROLM_REQUIRE_GPU=1` the emulator does not stand in for a demanded GPU. A test
//! that cannot apply to the device that is there (an emulator-only check on a GPU) calls
//! [`does_not_apply`]: it says so and passes under any environment.
use std::fmt::Display;

/// `FERROLM_REQUIRE_EMU`: `1` makes a missing emulator (or device) a failure (CI sets it).
pub const REQUIRE_EMU: &str = "FERROLM_REQUIRE_EMU";
/// `FERROLM_REQUIRE_GPU`: `1` makes a missing GPU a failure (the GPU runner sets it).
pub const REQUIRE_GPU: &str = "FERROLM_REQUIRE_GPU";

/// What a test needs to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// A CUDA device: the GPU, or the CUDA emulator where there is none.
    Device,
    /// The CUDA emulator (or the emulated NCCL) itself, whatever device is visible.
    Emulator,
    /// This many real GPUs.
    Gpus(usize),
}

/// The variable that demands `need` in the environment `env` (`None`: a missing `need` skips).
/// `env` reads a variable; [`demanded_by`] passes the process's.
pub fn demanded_in(need: Need, env: impl Fn(&str) -> Option<String>) -> Option<&'static str> {
    let is_1 = |var: &str| env(var).is_some_and(|v| v == "1");
    let vars: &[&'static str] = match need {
        Need::Device => &[REQUIRE_EMU, REQUIRE_GPU],
        Need::Emulator => &[REQUIRE_EMU],
        Need::Gpus(1) => &[REQUIRE_GPU],
        Need::Gpus(_) => &[],
    };
    vars.iter().copied().find(|v| is_1(v))
}

/// The variable of this process's environment that demands `need`, if any.
pub fn demanded_by(need: Need) -> Option<&'static str> {
    demanded_in(need, |v| std::env::var(v).ok())
}

/// `found`'s value where the test's `need` is met; else `None` after [`skip`] (which fails the
/// test where the environment demands `need`). `Err(why)` says what is missing.
#[track_caller]
pub fn require<T, E: Display>(need: Need, found: Result<T, E>) -> Option<T> {
    match found {
        Ok(v) => Some(v),
        Err(why) => {
            skip(need, why);
            None
        }
    }
}

/// The test's `need` is missing for the reason `why`: panics naming the variable that demands
/// it, or says `skipped: <why>` on stderr (the test then returns and passes).
#[track_caller]
pub fn skip(need: Need, why: impl Display) {
    if let Some(var) = demanded_by(need) {
        panic!("{var}=1 but {why}");
    }
    eprintln!("skipped: {why}");
}

/// The test checks something the device that is here does not have (an emulator-only check on a
/// GPU): says `skipped: <why>` on stderr and never fails, whatever the environment demands —
/// nothing is missing, so nothing is demanded.
pub fn does_not_apply(why: impl Display) {
    eprintln!("skipped: {why}");
}

/// Where no GPU is visible, before the emulator stands in: fails under `FERROLM_REQUIRE_GPU=1`.
#[track_caller]
pub fn no_gpu_visible() {
    if demanded_by(Need::Gpus(1)).is_some() {
        panic!("{REQUIRE_GPU}=1 but no CUDA device is visible");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(set: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |var| set.iter().find(|(k, _)| *k == var).map(|(_, v)| v.to_string())
    }

    #[test]
    fn nothing_set_skips_every_need() {
        for need in [Need::Device, Need::Emulator, Need::Gpus(1), Need::Gpus(2)] {
            assert_eq!(demanded_in(need, env(&[])), None, "{need:?}");
            assert_eq!(demanded_in(need, env(&[(REQUIRE_EMU, "0"), (REQUIRE_GPU, "")])), None, "{need:?}");
        }
    }

    #[test]
    fn require_emu_fails_a_missing_device_or_emulator_but_not_a_missing_gpu() {
        let ci = env(&[(REQUIRE_EMU, "1")]);
        assert_eq!(demanded_in(Need::Device, &ci), Some(REQUIRE_EMU));
        assert_eq!(demanded_in(Need::Emulator, &ci), Some(REQUIRE_EMU));
        assert_eq!(demanded_in(Need::Gpus(1), &ci), None);
    }

    #[test]
    fn require_gpu_fails_a_missing_device_or_one_gpu_but_not_the_emulator_or_several_gpus() {
        let runner = env(&[(REQUIRE_GPU, "1")]);
        assert_eq!(demanded_in(Need::Device, &runner), Some(REQUIRE_GPU));
        assert_eq!(demanded_in(Need::Gpus(1), &runner), Some(REQUIRE_GPU));
        assert_eq!(demanded_in(Need::Gpus(2), &runner), None);
        assert_eq!(demanded_in(Need::Emulator, &runner), None);
    }

    #[test]
    fn a_met_need_runs_whatever_the_environment() {
        assert_eq!(require(Need::Device, Ok::<_, String>(7)), Some(7));
    }

    #[test]
    fn a_missing_need_under_no_demand_is_none() {
        // Skipped only when this process's environment demands nothing (as in a plain run).
        if demanded_by(Need::Gpus(2)).is_none() {
            assert_eq!(require(Need::Gpus(2), Err::<u8, _>("two GPUs are not visible")), None);
        }
    }
}
