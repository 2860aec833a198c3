// Builds the emulated NCCL (emu/: a CPU implementation of the NCCL C API over sockets) as a
// shared library, OUT_DIR/libnccl-emu.so, and sets `cfg(ferro_nccl_emu)` so that
// `nccl_lib::emulated` embeds it (include_bytes!) and opens it through the same loader as
// libnccl.so.2. It must be a shared library, not linked in: it exports NCCL's own symbol names,
// and it is reached through the function table that real NCCL fills too.
//
// The library links libstdc++ and libgcc statically and exports only the nccl* symbols, so the
// embedded copy loads on any Linux with the C library, wherever the binary is copied. Needs a
// C++17 compiler ($CXX, else the platform's c++). With none, or with FERROLM_NO_EMU=1, it prints
// one warning and the crate builds without it (`nccl_lib::emulated` then says why).
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCES: [&str; 4] = ["api.cpp", "state.cpp", "net.cpp", "collectives.cpp"];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ferro_nccl_emu)");
    println!("cargo:rerun-if-changed=emu");
    println!("cargo:rerun-if-changed=../cuda/emu/ferro_emu_stream.h");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-env-changed=FERROLM_NO_EMU");
    if env::var("FERROLM_NO_EMU").is_ok_and(|v| v == "1") {
        println!("cargo:warning=FERROLM_NO_EMU=1: the emulated NCCL is not built; nccl_lib::emulated is unavailable");
        return;
    }
    let target = env::var("TARGET").unwrap_or_default();
    if !target.contains("linux") {
        println!("cargo:warning=the emulated NCCL is built on Linux only; nccl_lib::emulated is unavailable");
        return;
    }
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    // cc finds the compiler as the CUDA emulator's build does ($CXX, the target's c++).
    let compiler = match cc::Build::new().cpp(true).cargo_warnings(false).try_get_compiler() {
        Ok(c) => c,
        Err(e) => {
            println!("cargo:warning=emulated NCCL not built (no C++ compiler: {e}); nccl_lib::emulated is unavailable");
            return;
        }
    };
    let cxx = compiler.path().to_path_buf();
    if !Command::new(&cxx).arg("--version").output().is_ok_and(|o| o.status.success()) {
        println!(
            "cargo:warning=emulated NCCL not built (no C++ compiler: {} does not run; set CXX or install g++); nccl_lib::emulated is unavailable",
            cxx.display()
        );
        return;
    }
    let lib = out.join("libnccl-emu.so");
    // A compiler that is there but fails on the sources is a real error in emu/.
    if let Err(e) = compile(&cxx, &manifest, &out, &lib) {
        panic!("building the emulated NCCL (crates/parallel/emu) failed: {e}");
    }
    let bytes = std::fs::read(&lib).unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    // Names the cache file the loader writes, so that two builds never share one.
    println!("cargo:rustc-env=FERRO_NCCL_EMU_HASH={:016x}", fnv1a(&bytes));
    println!("cargo:rustc-cfg=ferro_nccl_emu");
}

fn compile(cxx: &Path, manifest: &Path, out: &Path, lib: &Path) -> Result<(), String> {
    let emu = manifest.join("emu");
    let map = out.join("nccl-emu.map");
    std::fs::write(&map, "{\n  global: nccl*; ferro_nccl_emu_abi;\n  local: *;\n};\n").map_err(|e| e.to_string())?;
    let base = |static_runtime: bool| {
        let mut c = Command::new(cxx);
        c.args(["-std=c++17", "-O2", "-g0", "-fPIC", "-shared", "-pthread", "-w"])
            .args(["-fvisibility=hidden", "-fvisibility-inlines-hidden", "-fno-strict-aliasing"])
            .arg(format!("-I{}", manifest.join("../cuda/emu").display()))
            .arg(format!("-Wl,--version-script={}", map.display()))
            .args(["-Wl,-soname,libnccl-emu.so", "-Wl,-z,defs"]);
        if static_runtime {
            c.args(["-static-libstdc++", "-static-libgcc", "-Wl,--exclude-libs,ALL"]);
        }
        c.arg("-o").arg(lib);
        for s in SOURCES {
            c.arg(emu.join(s));
        }
        c
    };
    let run = |mut c: Command| -> Result<(), String> {
        let o = c.output().map_err(|e| format!("{}: {e}", cxx.display()))?;
        if o.status.success() {
            Ok(())
        } else {
            Err(format!("{:?} failed:\n{}", c, String::from_utf8_lossy(&o.stderr)))
        }
    };
    // Some toolchains (clang without libstdc++.a) cannot link the C++ runtime statically; the
    // library then needs libstdc++ where it runs, which every machine with the compiler has.
    run(base(true))
        .or_else(|_| run(base(false)).map(|()| println!("cargo:warning=no static libstdc++: the emulated NCCL links the shared one")))
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}
