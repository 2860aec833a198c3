// Generates, from the sources in ../../kernels (read by build/parse.rs, no compiler needed):
//   OUT_DIR/kernel_sources.rs  the one list of kernels/*.cu{,h} as (file name, text) that the
//                              NVRTC path, the facade and the tests share (`KERNEL_SOURCES`);
//   OUT_DIR/consts.rs          kernels/constants.cuh as Rust constants (`ferrolm_cuda::consts`);
//   OUT_DIR/kernels.rs         the `Kernel` index and one typed launcher per kernel, with its
//                              argument count and types checked by the Rust compiler
//                              (`ferrolm_cuda::kernels`, build/generate.rs);
//   OUT_DIR/kernel_count.rs    how many kernels there are (`KERNEL_COUNT`, below every layer,
//                              for the GPU's function table).
// Then builds the CUDA emulator (emu/): the kernels compiled as C++ for the CPU, plus a table of
// (name, argument-unpacking thunk) in `Kernel` order and the fiber runtime, into a static
// library, and sets `cfg(ferro_emu)` so `CudaBackend::emulated` exists. The `cc` crate drives
// the compiler and the archiver.
//
// The emulator needs a C++17 compiler ($CXX, else the platform's c++). With none, or with
// FERROLM_NO_EMU=1, it prints one warning and the crate builds without the emulator (the GPU
// path and the typed launchers are unaffected).
#[path = "build/generate.rs"]
mod generate;
#[path = "build/parse.rs"]
mod parse;

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ferro_emu)");
    println!("cargo:rerun-if-changed=emu");
    println!("cargo:rerun-if-changed=../../kernels");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build");
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-env-changed=FERROLM_NO_EMU");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let kdir = manifest.join("../../kernels");
    let files = read_sources(&kdir);
    write_sources(&kdir, &files, &out);
    // A kernel or constant that cannot be read is an error in kernels/: fail the build with it.
    let kernels = generate_launchers(&files, &out).unwrap_or_else(|e| panic!("reading kernels/ for the typed launchers: {e}"));
    if env::var("FERROLM_NO_EMU").is_ok_and(|v| v == "1") {
        return;
    }
    let edir = manifest.join("emu");
    let target = env::var("TARGET").unwrap_or_default();
    if !target.contains("linux") {
        println!("cargo:warning=the CUDA emulator is built on Linux only; CudaBackend::emulated is unavailable");
        return;
    }
    match build(&kdir, &edir, &out, &files, &kernels) {
        Ok(()) => println!("cargo:rustc-cfg=ferro_emu"),
        Err(Skip(e)) => println!("cargo:warning=CUDA emulator not built ({e}); CudaBackend::emulated is unavailable"),
        // A compiler is there but a kernel does not compile as C++: a real error in kernels/.
        Err(Fail(e)) => panic!("building the CUDA emulator failed: {e}"),
    }
}

/// kernels/*.cu and *.cuh as (file name, text), sorted by name.
fn read_sources(kdir: &Path) -> Vec<(String, String)> {
    let mut paths: Vec<PathBuf> = fs::read_dir(kdir)
        .unwrap_or_else(|e| panic!("{}: {e}", kdir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu" || x == "cuh"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let text = fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.file_name().unwrap().to_string_lossy().to_string(), text)
        })
        .collect()
}

fn write_sources(kdir: &Path, files: &[(String, String)], out: &Path) {
    // An expression, `include!`d as the value of ferrolm_cuda::KERNEL_SOURCES.
    let mut src = String::from("&[\n");
    for (name, _) in files {
        let path = kdir.join(name);
        let path = path.canonicalize().unwrap_or(path);
        writeln!(src, "    ({name:?}, include_str!({:?})),", path.display().to_string()).unwrap();
    }
    src.push_str("]\n");
    fs::write(out.join("kernel_sources.rs"), src).unwrap();
}

/// Writes consts.rs, kernels.rs and kernel_count.rs; returns the kernels in `Kernel` order (sources in name order,
/// kernels in source order), the order of the emulator's table too.
fn generate_launchers(files: &[(String, String)], out: &Path) -> Result<Vec<parse::Kernel>, String> {
    let (cname, ctext) = files.iter().find(|(n, _)| n == "constants.cuh").ok_or("kernels/constants.cuh is missing")?;
    let consts = parse::constants(cname, ctext)?;
    let cu: Vec<(String, String)> = files.iter().filter(|(n, _)| n.ends_with(".cu")).cloned().collect();
    let kernels = parse::kernels(&cu)?;
    if kernels.is_empty() {
        return Err("no kernels found in kernels/".into());
    }
    let structs = generate::struct_names(&kernels).iter().map(|n| parse::find_struct(files, n)).collect::<Result<Vec<_>, _>>()?;
    fs::write(out.join("consts.rs"), generate::consts(&consts)).map_err(|e| e.to_string())?;
    fs::write(out.join("kernels.rs"), generate::kernels(&kernels, &structs, &consts)?).map_err(|e| e.to_string())?;
    fs::write(out.join("kernel_count.rs"), kernels.len().to_string()).map_err(|e| e.to_string())?;
    Ok(kernels)
}

enum Why {
    Skip(String),
    Fail(String),
}
use Why::{Fail, Skip};

/// The flags of the emulator build. cc picks the compiler ($CXX, else the
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

fn build(kdir: &Path, edir: &Path, out: &Path, files: &[(String, String)], kernels: &[parse::Kernel]) -> Result<(), Why> {
    // cc names a compiler even when none is installed: probe it, so a machine without one
    // builds the crate without the emulator instead of failing.
    let probe = base(kdir, edir).try_get_compiler().map_err(|e| Skip(e.to_string()))?;
    let ok = probe.to_command().arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        return Err(Skip(format!("no C++ compiler ({} does not run): set CXX or install g++", probe.path().display())));
    }
    let mut tu = String::from("// Generated by crates/cuda/build.rs: every kernel and a table of launch thunks.\n#include <utility>\n");
    for (name, _) in files.iter().filter(|(n, _)| n.ends_with(".cu")) {
        writeln!(tu, "#include {:?}", kdir.join(name).display().to_string()).unwrap();
    }
    tu.push_str(&generate::emulator_table(kernels));
    let kernels_cpp = out.join("ferro_emu_kernels.cpp");
    fs::write(&kernels_cpp, tu).map_err(|e| Fail(e.to_string()))?;
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
        .map_err(|e| Fail(e.to_string()))
}
