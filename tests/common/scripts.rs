//! Shared by the GPU scripts' tests (`first_contact_script.rs`, `gpu_perf_script.rs`,
//! `attention_counters_script.rs`): the checks of a command line that the scripts answer the
//! same way. (Each test binary uses what it needs of them.)
#![allow(dead_code)]
use std::path::Path;
use std::process::Output;

/// A scratch folder for `script`'s test `name`, removed if a previous run left it.
pub fn scratch(script: &str, name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferrolm-{script}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// `--help` succeeded, lists `items` (the script's parts or steps) as `1 first`, `2 second`, ...
/// in that order, names each of `mentions`, and wrote nothing to `out`.
pub fn assert_help(o: &Output, out: &Path, what: &str, items: &[&str], mentions: &[&str]) {
    assert!(o.status.success(), "--help failed: {}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    let mut at = 0;
    for (i, n) in items.iter().enumerate() {
        let needle = format!("{} {n}", i + 1);
        let pos = text[at..].find(&needle).unwrap_or_else(|| panic!("--help lacks {what} `{needle}` after the previous one:\n{text}"));
        at += pos + needle.len();
    }
    for m in mentions {
        assert!(text.contains(m), "--help does not mention {m}");
    }
    assert!(!out.exists(), "--help must not write anything");
}

/// The command lines each script refuses with exit 2: one string each, its arguments split at
/// single spaces (so `"--parts "` is --parts with an empty value). The error must name the flag
/// of the first argument (what precedes its `=`).
const REFUSED: [(&str, &[&str]); 3] = [
    ("gpu_first_contact.sh", &["--steps 0", "--steps 1,x", "--steps=10", "--steps", "--bogus"]),
    ("gpu_perf.sh", &["--parts 9", "--parts 1,x", "--parts ", "--parts=train,9", "--parts", "--bogus"]),
    (
        "gpu_attention_counters.sh",
        &["--shape 4,16,16", "--shape=4,3,2,2048", "--shape 4,16,0,2048", "--shape", "--bogus", "--rehearse", "--internal-shape 1"],
    ),
];

/// Each command line `script` must refuse (`REFUSED`) exits 2 with the flag it gets wrong named
/// on stderr, and `report` (the script's main output) is never written.
pub fn assert_refused(script: &str, run: impl Fn(&[&str]) -> Output, report: &Path) {
    let cases = REFUSED.iter().find(|c| c.0 == script).unwrap_or_else(|| panic!("no refusals listed for {script}")).1;
    for line in cases {
        let args: Vec<&str> = line.split(' ').collect();
        let flag = args[0].split('=').next().unwrap();
        let o = run(&args);
        assert_eq!(o.status.code(), Some(2), "{script} {args:?} should exit 2");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(flag), "{script} {args:?}: the error does not name {flag}: {err}");
    }
    assert!(!report.exists(), "a refused command line wrote {}", report.display());
}
