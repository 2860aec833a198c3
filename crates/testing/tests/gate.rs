//! The gate as a test binary meets it: this binary runs itself as a child whose one test finds
//! its need missing, and reads the child's exit status and stderr. A missing need skips, saying
//! `skipped: <why>` on stderr, except where the environment demands it: then the test fails,
//! naming the variable.
use ferrolm_testing::gate::{self, Need, REQUIRE_EMU, REQUIRE_GPU};
use std::process::Command;

/// Set only in the child: which need it finds missing.
const CHILD: &str = "FERROLM_TESTING_GATE_CHILD";

/// The child's test (returns at once in a plain run, where `CHILD` is unset).
#[test]
fn child_finds_its_need_missing() {
    let Ok(need) = std::env::var(CHILD) else { return };
    let need = match need.as_str() {
        "device" => Need::Device,
        "emulator" => Need::Emulator,
        "gpu" => Need::Gpus(1),
        "not-here" => {
            gate::does_not_apply("the check is not for this device");
            return;
        }
        other => panic!("unknown need {other}"),
    };
    assert!(gate::require(need, Err::<(), _>("the test device is missing")).is_none());
}

/// (whether the child passed, its stderr) with `need` missing under exactly the variables `env`.
fn child(need: &str, env: &[(&str, &str)]) -> (bool, String) {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["child_finds_its_need_missing", "--exact", "--nocapture", "--test-threads=1"]);
    c.env(CHILD, need).env_remove(REQUIRE_EMU).env_remove(REQUIRE_GPU);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn a_missing_device_skips_on_stderr_unless_the_environment_demands_it() {
    let (ok, err) = child("device", &[]);
    assert!(ok && err.contains("skipped: the test device is missing"), "nothing demanded: a skip on stderr\n{err}");
    let (ok, err) = child("device", &[(REQUIRE_EMU, "1")]);
    assert!(!ok && err.contains("FERROLM_REQUIRE_EMU=1 but the test device is missing"), "CI fails it\n{err}");
    let (ok, err) = child("device", &[(REQUIRE_GPU, "1")]);
    assert!(!ok && err.contains("FERROLM_REQUIRE_GPU=1 but the test device is missing"), "the GPU runner fails it\n{err}");
    let (ok, err) = child("device", &[(REQUIRE_EMU, "0")]);
    assert!(ok && err.contains("skipped:"), "only 1 demands\n{err}");
}

#[test]
fn the_emulator_is_demanded_by_ci_and_one_gpu_by_the_gpu_runner() {
    let (ok, err) = child("emulator", &[(REQUIRE_EMU, "1")]);
    assert!(!ok && err.contains("FERROLM_REQUIRE_EMU=1 but"), "{err}");
    let (ok, err) = child("emulator", &[(REQUIRE_GPU, "1")]);
    assert!(ok && err.contains("skipped:"), "the GPU runner does not demand the emulator\n{err}");
    let (ok, err) = child("gpu", &[(REQUIRE_EMU, "1")]);
    assert!(ok && err.contains("skipped:"), "CI has no GPU to demand\n{err}");
    let (ok, err) = child("gpu", &[(REQUIRE_GPU, "1")]);
    assert!(!ok && err.contains("FERROLM_REQUIRE_GPU=1 but"), "{err}");
}

#[test]
fn a_check_that_does_not_apply_skips_whatever_is_demanded() {
    for env in [&[][..], &[(REQUIRE_EMU, "1"), (REQUIRE_GPU, "1")][..]] {
        let (ok, err) = child("not-here", env);
        assert!(ok && err.contains("skipped: the check is not for this device"), "{env:?}\n{err}");
    }
}
