//! SLURM's compact notations: host lists (`SLURM_JOB_NODELIST=gpu[01-04,07]`) and tasks per node
//! (`SLURM_TASKS_PER_NODE=4(x2),3`), for starting a run with `srun` alone.

/// Expands a SLURM host list: comma-separated host expressions, each with any number of
/// bracketed range lists (`a[1-2],b3`, `n[001-003]-ib`, `rack[1-2]-n[01-02]`). A range keeps
/// the zero padding of its first number (`[08-10]` gives 08, 09, 10; `[8-10]` gives 8, 9, 10).
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    const MAX_HOSTS: usize = 1 << 20;
    let mut hosts = Vec::new();
    for expr in split_top_level(list)? {
        let expr = expr.trim();
        if expr.is_empty() {
            continue;
        }
        // Cartesian product over the bracket groups, left to right.
        let mut partial = vec![String::new()];
        let mut rest = expr;
        while !rest.is_empty() {
            let (text, group) = match rest.find('[') {
                Some(open) => {
                    let close = rest[open..].find(']').map(|c| open + c).ok_or_else(|| format!("unclosed '[' in {expr:?}"))?;
                    (&rest[..open], Some((&rest[open + 1..close], close)))
                }
                None => (rest, None),
            };
            if text.contains(']') {
                return Err(format!("unmatched ']' in {expr:?}"));
            }
            for p in &mut partial {
                p.push_str(text);
            }
            match group {
                None => rest = "",
                Some((ranges, close)) => {
                    let items = expand_ranges(ranges).map_err(|e| format!("{e} in {expr:?}"))?;
                    if partial.len().saturating_mul(items.len()) > MAX_HOSTS {
                        return Err(format!("{expr:?} expands to more than {MAX_HOSTS} hosts"));
                    }
                    partial = partial.iter().flat_map(|p| items.iter().map(move |i| format!("{p}{i}"))).collect();
                    rest = &rest[close + 1..];
                }
            }
        }
        hosts.extend(partial);
        if hosts.len() > MAX_HOSTS {
            return Err(format!("the host list expands to more than {MAX_HOSTS} hosts"));
        }
    }
    if hosts.is_empty() {
        return Err("the host list is empty".into());
    }
    Ok(hosts)
}

/// The first host of a SLURM host list (rank 0 runs there).
pub fn first_host(list: &str) -> Result<String, String> {
    // Expanding only the first expression keeps huge lists cheap.
    let first = split_top_level(list)?.into_iter().map(str::trim).find(|e| !e.is_empty()).ok_or("the host list is empty")?;
    Ok(expand_hostlist(first)?.swap_remove(0))
}

/// Splits on commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => {
                depth += 1;
                if depth > 1 {
                    return Err(format!("nested '[' in {list:?}"));
                }
            }
            ']' => {
                depth -= 1;
                if depth < 0 {
                    return Err(format!("unmatched ']' in {list:?}"));
                }
            }
            ',' if depth == 0 => {
                out.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("unclosed '[' in {list:?}"));
    }
    out.push(&list[start..]);
    Ok(out)
}

/// "01-04,07" -> 01 02 03 04 07.
fn expand_ranges(ranges: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for r in ranges.split(',') {
        let r = r.trim();
        let (lo, hi) = r.split_once('-').unwrap_or((r, r));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(format!("bad range {r:?} (expected N or N-M)"));
        }
        let (a, b): (u64, u64) =
            (lo.parse().map_err(|_| format!("bad number {lo:?}"))?, hi.parse().map_err(|_| format!("bad number {hi:?}"))?);
        if b < a {
            return Err(format!("range {r:?} runs backwards"));
        }
        if b - a >= 1 << 20 {
            return Err(format!("range {r:?} is too large"));
        }
        let width = lo.len();
        out.extend((a..=b).map(|v| format!("{v:0width$}")));
    }
    Ok(out)
}

/// Expands a tasks-per-node list: `4(x2),3` gives [4, 4, 3] (one entry per node).
pub fn expand_tasks_per_node(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let (n, reps) = match part.split_once('(') {
            Some((n, rep)) => {
                let rep = rep
                    .strip_suffix(')')
                    .and_then(|r| r.strip_prefix('x'))
                    .ok_or_else(|| format!("bad entry {part:?} (expected N or N(xM))"))?;
                (n, rep.trim().parse::<usize>().map_err(|_| format!("bad repeat count in {part:?}"))?)
            }
            None => (part, 1),
        };
        let n: usize = n.trim().parse().map_err(|_| format!("bad entry {part:?} (expected N or N(xM))"))?;
        if n == 0 || reps == 0 || reps > 1 << 20 {
            return Err(format!("bad entry {part:?}"));
        }
        out.extend(std::iter::repeat_n(n, reps));
    }
    Ok(out)
}
