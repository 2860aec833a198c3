//! A run directory on disk: `checkpoints/step-NNNNNN/`, `checkpoints/latest`, `metrics.jsonl`,
//! `loss.png`. What is in it, which checkpoint to resume, what may be written over, and how old
//! checkpoints are pruned. Nothing here deletes a file without saying so in the log.
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

pub const METRICS: &str = "metrics.jsonl";
pub const LOSS_PNG: &str = "loss.png";
pub const CHECKPOINTS: &str = "checkpoints";
pub const LATEST: &str = "latest";
/// Written last into a checkpoint: a directory holding it (and the files before it) is complete.
pub const TRAINER_STATE: &str = "trainer_state.json";

/// `step-NNNNNN` for `step`.
pub fn checkpoint_name(step: usize) -> String {
    format!("step-{step:06}")
}

/// The step of a `step-NNNNNN` directory name.
pub fn parse_checkpoint_name(name: &str) -> Option<usize> {
    name.strip_prefix("step-").filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())).and_then(|d| d.parse().ok())
}

/// The files a checkpoint directory lacks (empty: complete). `trainer_state.json` is written
/// last and the directory is renamed into place whole, so this only fails on directories that
/// were damaged or copied partially by hand.
pub fn missing_files(dir: &Path) -> Vec<&'static str> {
    let mut missing = Vec::new();
    if !dir.join("config.json").is_file() {
        missing.push("config.json");
    }
    if !dir.join("model.safetensors").is_file() && !dir.join("model.safetensors.index.json").is_file() {
        missing.push("model.safetensors");
    }
    // The optimizer state: one device's file, or the shards of a parallel run.
    if !dir.join("optimizer.safetensors").is_file() && !ferrolm_dist::zero::ckpt::is_sharded(dir) {
        missing.push("optimizer.safetensors");
    }
    if !dir.join(TRAINER_STATE).is_file() {
        missing.push(TRAINER_STATE);
    }
    missing
}

pub fn is_complete(dir: &Path) -> bool {
    dir.is_dir() && missing_files(dir).is_empty()
}

/// Every `step-NNNNNN` directory under `root` (complete or not), sorted by step.
pub fn list_checkpoints(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("cannot list checkpoints in {}", root.display())),
    };
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list checkpoints in {}", root.display()))?;
        if let Some(step) = entry.file_name().to_str().and_then(parse_checkpoint_name) {
            if entry.path().is_dir() {
                out.push((step, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// fsyncs a directory, so the renames and removals inside it survive a power cut.
pub fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|f| f.sync_all()).with_context(|| format!("cannot fsync directory {}", dir.display()))
}

/// The checkpoint to resume from `path`: a checkpoint directory, or a run directory (or its
/// `checkpoints/`) whose `latest` is followed. When `latest` names a missing or incomplete
/// checkpoint, the newest complete one is used instead, with a warning.
pub fn resolve_checkpoint(path: &Path) -> Result<PathBuf> {
    if path.join(TRAINER_STATE).is_file() {
        let missing = missing_files(path);
        if !missing.is_empty() {
            bail!("{}: incomplete checkpoint (missing {})", path.display(), missing.join(", "));
        }
        return Ok(path.to_path_buf());
    }
    for root in [path.join(CHECKPOINTS), path.to_path_buf()] {
        let latest = root.join(LATEST);
        let named = std::fs::read_to_string(&latest).ok().map(|s| s.trim().to_string());
        if let Some(name) = &named {
            let d = root.join(name);
            if is_complete(&d) {
                return Ok(d);
            }
        }
        let newest = list_checkpoints(&root)?.into_iter().rev().find(|(_, d)| is_complete(d));
        match (named, newest) {
            (Some(name), Some((_, d))) => {
                tracing::warn!(
                    "{} names {name}, which is missing or incomplete; using the newest complete checkpoint {}",
                    latest.display(),
                    d.display()
                );
                return Ok(d);
            }
            (None, Some((_, d))) => {
                tracing::warn!("{} has no `latest` file; using the newest complete checkpoint {}", root.display(), d.display());
                return Ok(d);
            }
            (Some(name), None) => {
                bail!("{}: `latest` names {name}, which is missing or incomplete, and no complete checkpoint is left", root.display())
            }
            (None, None) => {}
        }
    }
    bail!("{}: no checkpoint found (expected trainer_state.json, or checkpoints/latest in a run directory)", path.display())
}

/// The run directory a checkpoint lives in (`RUN/checkpoints/step-N` -> `RUN`), if it has that layout.
pub fn run_dir_of(checkpoint: &Path) -> Option<PathBuf> {
    let parent = checkpoint.parent()?;
    (parent.file_name()? == CHECKPOINTS).then(|| parent.parent().map(Path::to_path_buf)).flatten()
}

/// What a new or resumed run would write over in `out`, as sentences; empty when nothing.
/// `resumed`: the run directory and step of the checkpoint being resumed.
pub fn conflicts(out: &Path, resumed: Option<(Option<&Path>, usize)>) -> Result<Vec<String>> {
    let mut found = Vec::new();
    let ckpts = list_checkpoints(&out.join(CHECKPOINTS))?;
    let metrics = out.join(METRICS);
    match resumed {
        None => {
            if !ckpts.is_empty() {
                let names: Vec<String> = ckpts.iter().map(|(s, _)| checkpoint_name(*s)).collect();
                found.push(format!("{} checkpoint(s) ({})", ckpts.len(), abbreviate(&names)));
            }
            if metrics.is_file() {
                found.push(METRICS.to_string());
            }
        }
        Some((source, step)) => {
            let newer: Vec<String> = ckpts.iter().filter(|(s, _)| *s > step).map(|(s, _)| checkpoint_name(*s)).collect();
            if !newer.is_empty() {
                found.push(format!("checkpoint(s) newer than the resumed step {step} ({})", abbreviate(&newer)));
            }
            let same_run = source.is_some_and(|s| same_dir(s, out));
            if !same_run && (metrics.is_file() || ckpts.iter().any(|(s, _)| *s <= step)) {
                found.push(format!("another run's files ({METRICS} or checkpoints)"));
            }
        }
    }
    Ok(found)
}

/// Refuses to write into `out` when it already holds a run that would be overwritten or
/// appended to, unless `overwrite`. Called by the tools before any work, and by the trainer
/// before its first write.
pub fn check_out_dir(out: &Path, resumed: Option<(Option<&Path>, usize)>, overwrite: bool) -> Result<()> {
    let found = conflicts(out, resumed)?;
    if found.is_empty() || overwrite {
        return Ok(());
    }
    let hint = if resumed.is_some() {
        "choose another --out, or pass --overwrite to replace them"
    } else {
        "continue it with --resume, choose another --out, or pass --overwrite to delete it first"
    };
    bail!("{} already holds a run: {}; {hint}", out.display(), found.join(", "))
}

/// With `--overwrite`: removes what [`conflicts`] reported, naming each removal in the log.
pub fn clear_for_new_run(out: &Path, resumed_step: Option<usize>) -> Result<()> {
    let root = out.join(CHECKPOINTS);
    let mut ckpts = Vec::new();
    for (step, dir) in list_checkpoints(&root)? {
        if resumed_step.is_none_or(|r| step > r) {
            std::fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
            ckpts.push(checkpoint_name(step));
        }
    }
    let mut files = Vec::new();
    if resumed_step.is_none() {
        for f in [root.join(LATEST), out.join(METRICS), out.join(LOSS_PNG)] {
            if f.is_file() {
                std::fs::remove_file(&f).with_context(|| format!("cannot remove {}", f.display()))?;
                files.push(f.strip_prefix(out).unwrap_or(&f).display().to_string());
            }
        }
    }
    if !ckpts.is_empty() || !files.is_empty() {
        if root.is_dir() {
            sync_dir(&root)?;
        }
        let mut what = Vec::new();
        if !ckpts.is_empty() {
            what.push(format!("{} checkpoint(s) ({})", ckpts.len(), abbreviate(&ckpts)));
        }
        what.extend(files);
        tracing::warn!("--overwrite: removed {} from {}", what.join(", "), out.display());
    }
    Ok(())
}

/// Deletes the oldest complete checkpoints so that `keep` remain, never the one `latest` names
/// (the newest complete one). Returns the removed directories.
pub fn prune(root: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    if keep == 0 {
        return Ok(Vec::new());
    }
    let latest = std::fs::read_to_string(root.join(LATEST)).ok().map(|s| s.trim().to_string());
    let complete: Vec<(usize, PathBuf)> = list_checkpoints(root)?.into_iter().filter(|(_, d)| is_complete(d)).collect();
    let mut removed = Vec::new();
    let excess = complete.len().saturating_sub(keep);
    for (step, dir) in complete.into_iter().take(excess) {
        if latest.as_deref() == Some(checkpoint_name(step).as_str()) {
            continue;
        }
        std::fs::remove_dir_all(&dir).with_context(|| format!("cannot remove old checkpoint {}", dir.display()))?;
        removed.push(dir);
    }
    if !removed.is_empty() {
        sync_dir(root)?;
    }
    Ok(removed)
}

/// One line of `metrics.jsonl` that belongs to the history of a run.
#[derive(Clone, Debug)]
pub struct MetricsLine {
    pub step: usize,
    pub loss: Option<f64>,
    pub val_loss: Option<f64>,
    pub raw: String,
}

/// The lines of `run/metrics.jsonl` up to and including `step`, and how many later lines there
/// were (written after the checkpoint that is being resumed). Unreadable lines are skipped
/// with a warning: a curve is not worth failing a resume for.
pub fn read_metrics(run: &Path, step: usize) -> Result<(Vec<MetricsLine>, usize)> {
    let path = run.join(METRICS);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let (mut kept, mut later) = (Vec::new(), 0);
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!("{}:{}: skipping an unreadable line ({e})", path.display(), i + 1);
                continue;
            }
        };
        let Some(s) = v.get("step").and_then(|s| s.as_u64()) else { continue };
        if s as usize > step {
            later += 1;
            continue;
        }
        let num = |k: &str| v.get(k).and_then(|x| x.as_f64());
        kept.push(MetricsLine { step: s as usize, loss: num("loss"), val_loss: num("val_loss"), raw: line.to_string() });
    }
    Ok((kept, later))
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

fn abbreviate(names: &[String]) -> String {
    match names.len() {
        0..=4 => names.join(", "),
        n => format!("{}, {}, … {}", names[0], names[1], names[n - 1]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_names_round_trip_and_reject_lookalikes() {
        assert_eq!(parse_checkpoint_name(&checkpoint_name(42)), Some(42));
        assert_eq!(parse_checkpoint_name("step-"), None);
        assert_eq!(parse_checkpoint_name(".step-000004.tmp"), None);
        assert_eq!(parse_checkpoint_name("step-12a"), None);
    }
}
