//! `scripts/gpu_repack.sh`: re-packs a staged `.gpu/` into a `.gpu.txz` that unpacks to the same
//! files, with a dictionary large enough to reuse what repeats from one staged binary to the
//! next (two copies of a 9 MiB incompressible file, over xz's default 8 MiB dictionary, pack into
//! about one), says what travels, and refuses a folder with nothing staged (exit 2). Without xz
//! on this machine the test says so and passes (`.ci/run` installs it, so CI always runs it).
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "common/scripts.rs"]
mod scripts;

fn repack(dir: &Path) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu_repack.sh");
    Command::new("bash").arg(script).arg(dir).output().expect("bash runs")
}

/// `n` bytes no compressor can shrink (xorshift64*), the same for the same seed.
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.max(1);
    (0..n.div_ceil(8))
        .flat_map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            s.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes()
        })
        .take(n)
        .collect()
}

#[test]
fn a_staged_folder_repacks_into_an_archive_that_reuses_what_repeats() {
    if Command::new("xz").arg("--version").output().is_err() {
        eprintln!("skipped: no xz on this machine (apt-get install xz-utils)");
        return;
    }
    let dir: PathBuf = scripts::scratch("gpu-repack", "pack");
    let bin = dir.join(".gpu/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let big = noise(9 << 20, 7);
    std::fs::write(bin.join("tool_a"), &big).unwrap();
    std::fs::write(bin.join("tool_b"), &big).unwrap();
    std::fs::write(bin.join("small"), b"a staged file\n").unwrap();
    let o = repack(&dir);
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "gpu_repack failed: {stdout}{stderr}");
    assert!(stdout.contains("gpu_repack: .gpu.txz") && stdout.contains("travels (limit 64 MiB)"), "{stdout}");
    let size = std::fs::metadata(dir.join(".gpu.txz")).unwrap().len();
    assert!(
        size < (big.len() as u64) * 11 / 10,
        "{size} bytes for two copies of {} incompressible bytes: the second was not reused",
        big.len()
    );
    // It unpacks as the GPU machine unpacks it, to the same files.
    let out = dir.join("unpacked");
    std::fs::create_dir_all(&out).unwrap();
    let t = Command::new("tar").arg("xJf").arg(dir.join(".gpu.txz")).current_dir(&out).output().expect("tar runs");
    assert!(t.status.success(), "tar xJf: {}", String::from_utf8_lossy(&t.stderr));
    for f in ["tool_a", "tool_b", "small"] {
        assert_eq!(std::fs::read(out.join(".gpu/bin").join(f)).unwrap(), std::fs::read(bin.join(f)).unwrap(), "{f} unpacked differs");
    }
    // No leftover temporary archive beside it.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".gpu.txz."))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_folder_with_nothing_staged_is_refused() {
    let dir = scripts::scratch("gpu-repack", "empty");
    std::fs::create_dir_all(&dir).unwrap();
    let o = repack(&dir);
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no .gpu/") && err.contains("stage"), "{err}");
    assert!(!dir.join(".gpu.txz").exists(), "an archive was written with nothing staged");
    let _ = std::fs::remove_dir_all(&dir);
}
