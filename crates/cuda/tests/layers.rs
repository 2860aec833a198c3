//! The crate's modules are layers (see the crate docs in src/lib.rs): a source scan of the
//! `crate::` paths each top-level module names finds no cycle, the bottom layers import nothing
//! above them, and only the execution layer (src/exec) tells a GPU from the emulator.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The code of a file without its comments (doc comments name other modules freely).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// Every top-level module of src/ (a file or a folder with mod.rs) with the files it is made of.
fn modules() -> BTreeMap<String, Vec<PathBuf>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(src()).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            let mut files = Vec::new();
            let mut stack = vec![p.clone()];
            while let Some(d) = stack.pop() {
                for f in std::fs::read_dir(&d).unwrap() {
                    let f = f.unwrap().path();
                    if f.is_dir() {
                        stack.push(f);
                    } else if f.extension().is_some_and(|x| x == "rs") {
                        files.push(f);
                    }
                }
            }
            out.insert(name, files);
        } else if p.extension().is_some_and(|x| x == "rs") && name != "lib" {
            out.insert(name, vec![p]);
        }
    }
    out
}

/// The names after each `crate::` in `code`: `crate::a::b` gives `a`, `crate::{a, b::c}` gives
/// `a` and `b`.
fn crate_paths(code: &str) -> Vec<String> {
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = code[i + "crate::".len()..].trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut item) = (0, String::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(ident(item.trim()));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            out.push(ident(item.trim()));
        } else {
            out.push(ident(rest));
        }
    }
    out.retain(|n| !n.is_empty() && n != "self");
    out
}

/// The module each name that lib.rs re-exports comes from (`pub use device::CudaBackend;`).
fn reexports() -> BTreeMap<String, String> {
    let lib = code(&src().join("lib.rs"));
    let mut out = BTreeMap::new();
    for stmt in lib.split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else { continue };
        let Some((module, names)) = rest.split_once("::") else { continue };
        let names = names.trim_start_matches('{').trim_end_matches('}');
        for n in names.split(',') {
            let n = n.rsplit("::").next().unwrap_or("").trim();
            let n = n.rsplit(" as ").next().unwrap_or(n).trim();
            if !n.is_empty() {
                out.insert(n.to_string(), module.trim().to_string());
            }
        }
    }
    out
}

/// module -> the other top-level modules it names.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules();
    let re = reexports();
    let mut g = BTreeMap::new();
    for (m, files) in &mods {
        let mut deps = BTreeSet::new();
        for f in files {
            for name in crate_paths(&code(f)) {
                let target = if mods.contains_key(&name) { Some(name) } else { re.get(&name).cloned() };
                if let Some(t) = target.filter(|t| t != m) {
                    deps.insert(t);
                }
            }
        }
        g.insert(m.clone(), deps);
    }
    g
}

/// A cycle of the graph, as the modules along it, if there is one.
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(n: &str, g: &BTreeMap<String, BTreeSet<String>>, path: &mut Vec<String>, done: &mut BTreeSet<String>) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut c = path[i..].to_vec();
            c.push(n.to_string());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(d, g, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys().find_map(|n| visit(n, g, &mut Vec::new(), &mut done))
}

#[test]
fn the_scan_sees_uses_and_cycles() {
    let uses = crate_paths(
        "use crate::device::{CudaBackend, Exec};\nuse crate::{consts, kernels::{self, Strided}};\nlet x = crate::emu::launch();",
    );
    assert_eq!(uses, ["device", "consts", "kernels", "emu"]);
    let g: BTreeMap<String, BTreeSet<String>> =
        [("a", "b"), ("b", "c"), ("c", "a")].iter().map(|(x, y)| (x.to_string(), BTreeSet::from([y.to_string()]))).collect();
    assert_eq!(find_cycle(&g).map(|c| c.len()), Some(4), "{g:?}");
    let re = reexports();
    assert_eq!(re.get("CudaBackend").map(String::as_str), Some("device"), "{re:?}");
}

#[test]
fn no_use_cycle_between_the_modules() {
    let g = graph();
    for m in ["device", "exec", "instrument", "launch", "kernels"] {
        assert!(g.contains_key(m), "module {m} not found by the scan: {g:?}");
    }
    assert!(g["kernels"].contains("device"), "the scan missed kernels -> device: {g:?}");
    if let Some(c) = find_cycle(&g) {
        panic!("a use cycle between the modules of crates/cuda/src: {}\n(every edge: {g:?})", c.join(" -> "));
    }
}

#[test]
fn the_bottom_layers_import_nothing_above_them() {
    let g = graph();
    assert!(g["instrument"].is_empty(), "instrument must import no other module of the crate: {:?}", g["instrument"]);
    let above = ["device", "exec", "kernels", "copy", "backend", "optim", "pinned", "alloc"];
    for m in ["launch", "pool", "storage", "gemm", "emu", "emu_stream", "instrument"] {
        let up: Vec<_> = g[m].iter().filter(|d| above.contains(&d.as_str())).collect();
        assert!(up.is_empty(), "{m} imports {up:?}, which are above it");
    }
    let exec_up: Vec<_> = g["exec"].iter().filter(|d| above.contains(&d.as_str())).collect();
    assert!(exec_up.is_empty(), "exec imports {exec_up:?}, which are above it");
}

#[test]
fn only_the_execution_layer_tells_a_gpu_from_the_emulator() {
    let kinds = ["Exec::", "CudaStream::Gpu", "CudaStream::Emu", "CudaEvent::Gpu", "CudaEvent::Emu"];
    for (m, files) in modules() {
        if m == "exec" {
            continue;
        }
        for f in files {
            let c = code(&f);
            for k in kinds {
                assert!(!c.contains(k), "{} matches on `{k}`: dispatch on the kind of device belongs in src/exec", f.display());
            }
        }
    }
}
