//! A run directory on disk: `metrics.jsonl`, `loss.png`, `checkpoints/`: what may be written over
//! when a run starts or resumes, and the metrics history a resumed run continues. Where
//! checkpoints go, which one `latest` names and resumes, and pruning are `crate::checkpoint`
//! (re-exported here under their old paths). Nothing here deletes a file without saying so in
//! the log.
use anyhow::{bail, Context, Result};
use std::path::Path;

pub const METRICS: &str = "metrics.jsonl";
pub const LOSS_PNG: &str = "loss.png";
pub use crate::checkpoint::{
    checkpoint_name, is_complete, list_checkpoints, missing_files, parse_checkpoint_name, prune, resolve_checkpoint, run_dir_of,
    CHECKPOINTS, LATEST, TRAINER_STATE,
};
/// fsyncs a directory, so the renames and removals inside it survive a power cut.
pub fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|f| f.sync_all()).with_context(|| format!("cannot fsync directory {}", dir.display()))
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
    // A file where the run directory (or a folder above it) would be: say so, not that its
    // `checkpoints/` cannot be listed.
    if let Some(file) = out.ancestors().filter(|p| !p.as_os_str().is_empty()).find(|p| p.exists()).filter(|p| !p.is_dir()) {
        let at = if file == out { String::new() } else { format!(": {} is a file", file.display()) };
        return Err(crate::errors::flag_error(format!(
            "--out {} is not a directory{at}; a run writes its checkpoints and {METRICS} in a directory: choose one (nothing \
             was written or deleted)",
            out.display()
        )));
    }
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

/// `path` as the filesystem sees it, whether it exists or not: absolute, every symlink of the
/// part that exists resolved, `.` and `..` taken out. Two paths name the same place when their
/// canonical forms are equal, and one lies inside another when its form starts with the other's.
pub fn canonical(path: &Path) -> std::path::PathBuf {
    use std::path::Component;
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut cur = std::path::PathBuf::new();
    for c in abs.components() {
        match c {
            Component::Prefix(_) | Component::RootDir => cur.push(c.as_os_str()),
            Component::CurDir => {}
            // `cur` is a resolved path (or lies below the part that exists): its parent is `..`.
            Component::ParentDir => {
                cur.pop();
            }
            Component::Normal(n) => {
                cur.push(n);
                if std::fs::symlink_metadata(&cur).is_ok() {
                    if let Ok(real) = cur.canonicalize() {
                        cur = real;
                    }
                }
            }
        }
    }
    cur
}

/// The part of `path` before its first component that holds a glob character (`--data
/// "dir/*.jsonl"`: `dir`), when `path` itself does not exist; else `path`.
fn before_glob(path: &Path) -> std::path::PathBuf {
    if path.exists() {
        return path.to_path_buf();
    }
    let mut out = std::path::PathBuf::new();
    for c in path.components() {
        if c.as_os_str().to_str().is_some_and(|s| s.contains(['*', '?', '['])) {
            break;
        }
        out.push(c.as_os_str());
    }
    if out.as_os_str().is_empty() {
        out.push(".");
    }
    out
}

/// Refuses an output directory `out` that is, or holds, one of a tool's inputs: `inputs` lists
/// each as (the flag it came from, its path), e.g. `[("--model", model), ("--data", data)]`. A
/// run writes its checkpoints into `out` and `--overwrite` deletes the old ones there, so an
/// input inside it would be lost (the model being fine-tuned, the adapter being continued, the
/// checkpoint being resumed from another run, the data). Paths are compared canonically
/// ([`canonical`]: relative paths, symlinks, an `out` that does not exist yet). A flag error
/// (exit code 2) naming both paths; every tool calls this before it writes or deletes anything.
pub fn check_inputs_outside(out: &Path, inputs: &[(&str, &Path)]) -> Result<()> {
    let out_c = canonical(out);
    for (flag, input) in inputs {
        // A glob: its fixed part, and every file it matches now (`runs/*/x.jsonl` may match a
        // file inside `out` whose fixed part `runs` is not).
        let mut paths = vec![before_glob(input)];
        if !input.exists() {
            paths.extend(input.to_str().and_then(|p| glob::glob(p).ok()).into_iter().flatten().flatten());
        }
        let Some(input_c) = paths.iter().map(|p| canonical(p)).find(|c| c.starts_with(&out_c)) else { continue };
        let how = if input_c == out_c { "is" } else { "holds" };
        let resolved = if input_c.as_path() == *input { String::new() } else { format!(" ({})", input_c.display()) };
        return Err(crate::errors::flag_error(format!(
            "--out {} {how} {flag} {}{resolved}: an output directory may not be or hold what the tool reads (a run writes \
             its checkpoints there and --overwrite deletes the old ones); choose an --out outside {} (nothing was written \
             or deleted)",
            out.display(),
            input.display(),
            input.display()
        )));
    }
    Ok(())
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

/// Warns when `--val-data` names the `--data` it validates (as the filesystem sees them): the
/// validation loss then scores the very examples the run trains on, which no held-out number is.
pub fn warn_val_is_data(data: &Path, val: &Path, what: &str) {
    if same_dir(data, val) {
        tracing::warn!(
            "--val-data {} is --data {}: the validation loss scores the {what} the run trains on, not held-out ones; give \
             other {what} as --val-data, or drop it to hold out --val-fraction of --data",
            val.display(),
            data.display()
        );
    }
}

/// Whether two paths name one directory or file (compared canonically when both exist).
pub fn same_dir(a: &Path, b: &Path) -> bool {
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
