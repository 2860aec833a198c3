// Writes OUT_DIR/kernel_sources.rs, the one list of kernels/*.cu{,h} as (file name, text) that
// the NVRTC path, the facade and the tests share (`ferrolm_cuda::KERNEL_SOURCES`). Then builds
// the CUDA emulator (emu/): the kernels in ../../kernels compiled as C++ for the CPU, plus
// the fiber runtime, into a static library, and sets `cfg(ferro_emu)` so `CudaBackend::emulated`
// exists. Steps: preprocess every kernel once with `__global__` turned into a marker to find the
// kernel names (macros such as ATTN_SIMT generate some), write one translation unit that includes
// the kernels and a table of (name, argument-unpacking thunk), compile it and runtime.cpp, archive.
//
// Needs a C++17 compiler ($CXX, else c++ / g++ / clang++). With none, or with FERROLM_NO_EMU=1, it
// prints one warning and the crate builds without the emulator (the GPU path is unaffected).
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ferro_emu)");
    println!("cargo:rerun-if-changed=emu");
    println!("cargo:rerun-if-changed=../../kernels");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-env-changed=FERROLM_NO_EMU");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let kdir = manifest.join("../../kernels");
    write_sources(&kdir, &out);
    if env::var("FERROLM_NO_EMU").is_ok_and(|v| v == "1") {
        return;
    }
    let edir = manifest.join("emu");
    let target = env::var("TARGET").unwrap_or_default();
    if !target.contains("linux") {
        println!("cargo:warning=the CUDA emulator is built on Linux only; CudaBackend::emulated is unavailable");
        return;
    }
    match build(&kdir, &edir, &out) {
        Ok(()) => {
            println!("cargo:rustc-link-search=native={}", out.display());
            println!("cargo:rustc-link-lib=static=ferro_emu");
            println!("cargo:rustc-cfg=ferro_emu");
        }
        Err(Skip(e)) => println!("cargo:warning=CUDA emulator not built ({e}); CudaBackend::emulated is unavailable"),
        // A compiler is there but a kernel does not compile as C++: a real error in kernels/.
        Err(Fail(e)) => panic!("building the CUDA emulator failed: {e}"),
    }
}

fn write_sources(kdir: &Path, out: &Path) {
    let mut files: Vec<PathBuf> = fs::read_dir(kdir)
        .unwrap_or_else(|e| panic!("{}: {e}", kdir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu" || x == "cuh"))
        .collect();
    files.sort();
    // An expression, `include!`d as the value of ferrolm_cuda::KERNEL_SOURCES.
    let mut src = String::from("&[\n");
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        let path = f.canonicalize().unwrap_or_else(|_| f.clone());
        writeln!(src, "    ({name:?}, include_str!({:?})),", path.display().to_string()).unwrap();
    }
    src.push_str("]\n");
    fs::write(out.join("kernel_sources.rs"), src).unwrap();
}

enum Why {
    Skip(String),
    Fail(String),
}
use Why::{Fail, Skip};

fn cxx() -> Result<String, String> {
    let mut cands: Vec<String> = env::var("CXX").ok().into_iter().collect();
    cands.extend(["c++", "g++", "clang++"].map(String::from));
    cands
        .into_iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
        .ok_or_else(|| "no C++ compiler: set CXX or install g++".to_string())
}

fn run(cmd: &mut Command) -> Result<Vec<u8>, String> {
    let o = cmd.output().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if !o.status.success() {
        return Err(format!("{cmd:?} failed:\n{}", String::from_utf8_lossy(&o.stderr)));
    }
    Ok(o.stdout)
}

/// Identifiers that follow `FERRO_KERNEL_MARK void` in the preprocessed kernels.
fn kernel_names(pre: &str) -> Vec<String> {
    let mut names = Vec::new();
    for part in pre.split("FERRO_KERNEL_MARK").skip(1) {
        let rest = part.trim_start();
        let Some(rest) = rest.strip_prefix("void") else { continue };
        let name: String = rest.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if !name.is_empty() && !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

fn build(kdir: &Path, edir: &Path, out: &Path) -> Result<(), Why> {
    let cxx = cxx().map_err(Skip)?;
    build_with(&cxx, kdir, edir, out).map_err(Fail)
}

fn build_with(cxx: &str, kdir: &Path, edir: &Path, out: &Path) -> Result<(), String> {
    let mut cu: Vec<PathBuf> = fs::read_dir(kdir)
        .map_err(|e| format!("{}: {e}", kdir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    cu.sort();
    let mut includes = String::new();
    for f in &cu {
        writeln!(includes, "#include {:?}", f.display().to_string()).unwrap();
    }
    let flags = ["-std=c++17", "-O2", "-fPIC", "-fno-exceptions", "-fno-rtti", "-fno-threadsafe-statics", "-fno-strict-aliasing", "-w"];
    let inc = |c: &mut Command| {
        c.arg("-DFERRO_EMU").arg("-I").arg(kdir).arg("-I").arg(edir);
    };

    let scan = out.join("ferro_emu_scan.cpp");
    fs::write(&scan, &includes).map_err(|e| e.to_string())?;
    let mut c = Command::new(cxx);
    c.args(["-std=c++17", "-E", "-P", "-DFERRO_EMU_SCAN"]);
    inc(&mut c);
    let pre = String::from_utf8_lossy(&run(c.arg(&scan))?).to_string();
    let names = kernel_names(&pre);
    if names.is_empty() {
        return Err("no kernels found in kernels/".into());
    }

    let mut tu = String::from("// Generated by crates/cuda/build.rs: every kernel and a table of launch thunks.\n#include <utility>\n");
    tu.push_str(&includes);
    tu.push_str(
        r#"
namespace {
template <typename F, F f> struct Thunk;
template <typename... A, void (*f)(A...)> struct Thunk<void (*)(A...), f> {
    template <std::size_t... I> static void call(void** a, std::index_sequence<I...>) { f(*static_cast<A*>(a[I])...); }
    static void run(void** a) { call(a, std::index_sequence_for<A...>{}); }
};
}  // namespace
struct FerroEmuKernel { const char* name; void (*run)(void**); };
extern "C" const FerroEmuKernel ferro_emu_kernels[] = {
"#,
    );
    for n in &names {
        writeln!(tu, "    {{\"{n}\", &Thunk<decltype(&{n}), &{n}>::run}},").unwrap();
    }
    writeln!(tu, "}};\nextern \"C\" const int ferro_emu_kernel_count = {};", names.len()).unwrap();
    let kernels_cpp = out.join("ferro_emu_kernels.cpp");
    fs::write(&kernels_cpp, tu).map_err(|e| e.to_string())?;

    // Compile both units in parallel.
    let objs = [out.join("ferro_emu_kernels.o"), out.join("ferro_emu_runtime.o")];
    let srcs = [kernels_cpp, edir.join("runtime.cpp")];
    let mut children = Vec::new();
    for (src, obj) in srcs.iter().zip(&objs) {
        let mut c = Command::new(cxx);
        c.args(flags).arg("-c");
        inc(&mut c);
        c.arg(src).arg("-o").arg(obj);
        let child = c.stderr(std::process::Stdio::piped()).spawn().map_err(|e| format!("cannot run {cxx}: {e}"))?;
        children.push((src.clone(), child));
    }
    for (src, child) in children {
        let o = child.wait_with_output().map_err(|e| e.to_string())?;
        if !o.status.success() {
            return Err(format!("compiling {} failed:\n{}", src.display(), String::from_utf8_lossy(&o.stderr)));
        }
    }
    let lib = out.join("libferro_emu.a");
    let _ = fs::remove_file(&lib);
    let ar = env::var("AR").unwrap_or_else(|_| "ar".into());
    run(Command::new(ar).arg("crs").arg(&lib).args(&objs))?;
    Ok(())
}
