// Writes OUT_DIR/kernel_sources.rs, the one list of kernels/*.cu{,h} as (file name, text) that
// the NVRTC path, the facade and the tests share (`ferrolm_cuda::KERNEL_SOURCES`). Then builds
// the CUDA emulator (emu/): the kernels in ../../kernels compiled as C++ for the CPU, plus
// the fiber runtime, into a static library, and sets `cfg(ferro_emu)` so `CudaBackend::emulated`
// exists. Steps: preprocess every kernel once with `__global__` turned into a marker to find the
// kernel names (macros such as ATTN_SIMT generate some), write one translation unit that includes
// the kernels and a table of (name, argument-unpacking thunk), compile it and runtime.cpp into
// libferro_emu.a. The `cc` crate drives the compiler and the archiver.
//
// Needs a C++17 compiler ($CXX, else the platform's c++). With none, or with FERROLM_NO_EMU=1,
// it prints one warning and the crate builds without the emulator (the GPU path is unaffected).
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

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
        Ok(()) => println!("cargo:rustc-cfg=ferro_emu"),
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

/// The flags both the scan and the real compile use. cc picks the compiler ($CXX, else the
/// platform's c++), passes OUT_DIR-relative object paths and runs the archiver ($AR).
fn base(kdir: &Path, edir: &Path) -> cc::Build {
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++17")
        .opt_level(2)
        .debug(false)
        .pic(true)
        .warnings(false)
        .flag("-w")
        .define("FERRO_EMU", None)
        .include(kdir)
        .include(edir)
        // The runtime uses no C++ library (no exceptions, new/delete or containers), so the
        // binaries need no libstdc++.
        .cpp_link_stdlib(None)
        .cargo_warnings(false);
    b
}

fn build(kdir: &Path, edir: &Path, out: &Path) -> Result<(), Why> {
    // cc names a compiler even when none is installed: probe it, so a machine without one
    // builds the crate without the emulator instead of failing.
    let probe = base(kdir, edir).try_get_compiler().map_err(|e| Skip(e.to_string()))?;
    let ok = probe.to_command().arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        return Err(Skip(format!("no C++ compiler ({} does not run): set CXX or install g++", probe.path().display())));
    }
    build_with(kdir, edir, out).map_err(Fail)
}

fn build_with(kdir: &Path, edir: &Path, out: &Path) -> Result<(), String> {
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

    let scan = out.join("ferro_emu_scan.cpp");
    fs::write(&scan, &includes).map_err(|e| e.to_string())?;
    let pre = base(kdir, edir).file(&scan).flag("-P").define("FERRO_EMU_SCAN", None).try_expand().map_err(|e| e.to_string())?;
    let names = kernel_names(&String::from_utf8_lossy(&pre));
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

    // Compiles both units (in parallel: cc's `parallel` feature), archives them into
    // OUT_DIR/libferro_emu.a and prints the link-search / link-lib lines.
    base(kdir, edir)
        .flag("-fno-exceptions")
        .flag("-fno-rtti")
        .flag("-fno-threadsafe-statics")
        .flag("-fno-strict-aliasing")
        .file(&kernels_cpp)
        .file(edir.join("runtime.cpp"))
        .try_compile("ferro_emu")
        .map_err(|e| e.to_string())
}
