//! The kernel profile of a run (`FERROLM_PROFILE=1`, or `--profile` on the training tools): the
//! table `ferrolm_cuda::profile` collects, printed at the end of training and written as
//! `profile.json` in the run directory. Rank r > 0 of a multi-process run writes
//! `profile.rank<r>.json` beside it. A run on the CPU writes one too, with no kernels (its
//! `device` says "no CUDA launch") and the steps it counted.
//!
//! `profile.json`: `{"device", "timed" (false on the emulator: only counts mean anything),
//! "note", "sm_count", "steps", "launches", "launches_per_step" (median over the steps),
//! "step_launches" (per step), "step_ms" (device ms of each step's launches), "ms_per_step"
//! (their median; null when not timed), "total_ms", "kernels": [{"name", "launches", "total_ms",
//! "share" (0..1), "mean_us", "max_grid" [x, y, z], "max_block"}] (slowest first),
//! "small_grids": [{"name", "elems", "grid", "block"}] (launches over 2^20 elements on fewer
//! blocks than the device has SMs), "gemm_fallbacks" (fused GEMMs cuBLASLt refused, composed
//! from separate kernels instead; target 0)}`.
use anyhow::{Context, Result};
use ferrolm_cuda::profile::{self, ProfileReport};
use std::path::{Path, PathBuf};

/// Turns the profile on (the tools' `--profile`; `FERROLM_PROFILE=1` needs no call).
pub fn enable() {
    profile::enable(true);
}

/// The profile as `profile.json` holds it.
pub fn to_json(r: &ProfileReport) -> serde_json::Value {
    let kernels: Vec<serde_json::Value> = r
        .kernels
        .iter()
        .map(|k| {
            serde_json::json!({"name": k.name, "launches": k.launches, "total_ms": k.total_ms, "share": k.share,
                "mean_us": k.mean_us, "max_grid": [k.max_grid.0, k.max_grid.1, k.max_grid.2], "max_block": k.max_block})
        })
        .collect();
    let small: Vec<serde_json::Value> = r
        .small_grids
        .iter()
        .map(|g| serde_json::json!({"name": g.name, "elems": g.elems, "grid": [g.grid.0, g.grid.1, g.grid.2], "block": g.block}))
        .collect();
    let note = if r.timed {
        "device times from CUDA events around each launch"
    } else {
        "CUDA emulator: launches and grids are counted; times are meaningless and reported as 0"
    };
    serde_json::json!({
        "device": r.device, "timed": r.timed, "note": note, "sm_count": r.sm_count,
        "steps": r.step_launches.len(), "launches": r.launches(), "launches_per_step": r.launches_per_step(),
        "step_ms": r.step_ms, "ms_per_step": r.ms_per_step(),
        "step_launches": r.step_launches, "total_ms": r.total_ms(), "kernels": kernels, "small_grids": small,
        "gemm_fallbacks": r.gemm_fallbacks,
    })
}

/// Where this rank writes its profile in `out_dir`.
pub fn path(out_dir: &Path) -> PathBuf {
    match crate::logging::rank() {
        (0, _) => out_dir.join("profile.json"),
        (r, _) => out_dir.join(format!("profile.rank{r}.json")),
    }
}

/// Prints the table (rank 0) and writes the JSON (every rank, its own file): written to a
/// temporary file and renamed, so a reader never sees half of one.
pub fn finish(out_dir: &Path) -> Result<PathBuf> {
    let r = profile::report();
    if crate::logging::is_rank_zero() {
        print!("{}", r.table());
    }
    let dest = path(out_dir);
    std::fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let tmp = dest.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(&to_json(&r))? + "\n";
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &dest).with_context(|| format!("cannot write {}", dest.display()))?;
    crate::progress::report(&format!("kernel profile: {}", dest.display()));
    Ok(dest)
}
