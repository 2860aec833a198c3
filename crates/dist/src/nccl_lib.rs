//! Finding and opening NCCL. NCCL installs as `libnccl.so.2` (distribution packages, NVIDIA's
//! repositories, and pip's `nvidia-nccl-cu*` wheels under `site-packages/nvidia/nccl/lib`).
//! cudarc's dynamic loader only tries names such as `libnccl.so` and `libnccl.so.13`, and a
//! library opened under another name does not satisfy its lookup (glibc matches the requested
//! name against the loaded objects' names and sonames, and the soname is `libnccl.so.2`), so
//! preloading cannot help it. This module therefore opens NCCL itself and resolves the dozen
//! entry points NcclComm calls, with plain C signatures that do not depend on the NCCL version
//! cudarc was generated for. Nothing here runs until the first NcclComm is created.
//!
//! Search order: `FERROLM_NCCL_LIB` (a path), then `libnccl.so.2` and `libnccl.so` through the
//! dynamic loader (`LD_LIBRARY_PATH`, the ld.so cache, the system directories), then
//! `$NCCL_HOME/lib`, the CUDA toolkit's `lib64`, the distribution's library directories, and the
//! pip wheel directory under `$VIRTUAL_ENV`, `$CONDA_PREFIX`, `~/.local`, `/usr/local` and `/usr`.
use ferrolm_tensor::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;
use std::sync::OnceLock;

pub(crate) type RawComm = *mut c_void;
pub(crate) type RawStream = *mut c_void;
pub(crate) type NcclResult = c_int;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    pub internal: [u8; 128],
}

// ncclDataType_t and ncclRedOp_t values (stable since NCCL 2.10).
pub(crate) const NCCL_INT32: c_int = 2;
pub(crate) const NCCL_FLOAT32: c_int = 7;
pub(crate) const NCCL_FLOAT64: c_int = 8;
pub(crate) const NCCL_BFLOAT16: c_int = 9;
pub(crate) const NCCL_SUM: c_int = 0;
pub(crate) const NCCL_MAX: c_int = 2;
pub(crate) const NCCL_AVG: c_int = 4;
/// `ncclInProgress`: not an error (non-blocking communicators).
pub(crate) const NCCL_IN_PROGRESS: c_int = 7;

/// ncclCommSplit appeared in 2.18.
const MIN_VERSION: c_int = 21800;

pub(crate) struct NcclLib {
    pub path: String,
    pub version: c_int,
    pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    pub comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult,
    pub comm_split: unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut c_void) -> NcclResult,
    pub comm_abort: unsafe extern "C" fn(RawComm) -> NcclResult,
    pub comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    pub comm_get_async_error: unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    pub all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult,
    pub all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> NcclResult,
    pub reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult,
    pub broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult,
    /// Keeps the symbols above valid for the life of the process.
    _lib: libloading::Library,
}

impl NcclLib {
    /// `Ok` for ncclSuccess, else an error naming `op` with NCCL's own description.
    pub fn check(&self, op: &str, r: NcclResult) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let s = unsafe { CStr::from_ptr((self.get_error_string)(r)) }.to_string_lossy().into_owned();
        Err(Error::new(op.to_string(), format!("NCCL error {r}: {s} (set NCCL_DEBUG=WARN for NCCL's own report)")))
    }
}

/// Where to look, in order (see the module doc); `env` reads environment variables. Bare names
/// go through the dynamic loader's own search; paths are listed only when the file exists.
pub fn library_candidates(env: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    if let Some(p) = env("FERROLM_NCCL_LIB").filter(|p| !p.is_empty()) {
        out.push(p);
    }
    out.push("libnccl.so.2".into());
    out.push("libnccl.so".into());
    let mut dirs: Vec<String> = Vec::new();
    for var in ["NCCL_HOME", "NCCL_ROOT"] {
        if let Some(h) = env(var) {
            dirs.push(format!("{h}/lib"));
            dirs.push(format!("{h}/lib64"));
        }
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = env(var) {
            dirs.push(format!("{h}/lib64"));
            dirs.push(format!("{h}/lib"));
        }
    }
    dirs.extend(
        ["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/local/lib"]
            .map(String::from),
    );
    let mut prefixes: Vec<String> = ["VIRTUAL_ENV", "CONDA_PREFIX"].iter().filter_map(|v| env(v)).collect();
    if let Some(h) = env("HOME") {
        prefixes.push(format!("{h}/.local"));
    }
    prefixes.extend(["/usr/local", "/usr"].map(String::from));
    for p in prefixes {
        let Ok(rd) = std::fs::read_dir(format!("{p}/lib")) else { continue };
        let mut pys: Vec<String> = rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| n.starts_with("python3")).collect();
        pys.sort();
        for py in pys.iter().rev() {
            for site in ["site-packages", "dist-packages"] {
                dirs.push(format!("{p}/lib/{py}/{site}/nvidia/nccl/lib"));
            }
        }
    }
    for d in dirs {
        let f = format!("{d}/libnccl.so.2");
        if Path::new(&f).is_file() && !out.contains(&f) {
            out.push(f);
        }
    }
    out
}

fn open() -> std::result::Result<NcclLib, String> {
    let candidates = library_candidates(&|v| std::env::var(v).ok());
    let mut tried = Vec::new();
    for c in &candidates {
        // SAFETY: loading NCCL runs its (trusted) initialisers; nothing else is executed.
        match unsafe { libloading::Library::new(c) } {
            Ok(lib) => return resolve(lib, c),
            Err(e) => tried.push(format!("{c} ({e})")),
        }
    }
    Err(format!(
        "NCCL not found; tried {}. Install it (the distribution's libnccl2, or `pip install nvidia-nccl-cu13`) or set FERROLM_NCCL_LIB=/path/to/libnccl.so.2",
        tried.join(", ")
    ))
}

fn resolve(lib: libloading::Library, path: &str) -> std::result::Result<NcclLib, String> {
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is NCCL's, and the field's type is its C signature from nccl.h.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| format!("{path} has no {}: {e}", $name))?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = sym!("ncclGetVersion");
    let mut version = 0;
    // SAFETY: writes one int.
    if unsafe { get_version(&mut version) } != 0 || version < MIN_VERSION {
        return Err(format!("{path} is NCCL {version}; ferrolm needs 2.18 or newer (ncclCommSplit)"));
    }
    Ok(NcclLib {
        path: path.to_string(),
        version,
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank: sym!("ncclCommInitRank"),
        comm_split: sym!("ncclCommSplit"),
        comm_abort: sym!("ncclCommAbort"),
        comm_destroy: sym!("ncclCommDestroy"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        get_error_string: sym!("ncclGetErrorString"),
        all_reduce: sym!("ncclAllReduce"),
        all_gather: sym!("ncclAllGather"),
        reduce_scatter: sym!("ncclReduceScatter"),
        broadcast: sym!("ncclBroadcast"),
        _lib: lib,
    })
}

/// NCCL, opened once per process.
pub(crate) fn nccl() -> Result<&'static NcclLib> {
    static LIB: OnceLock<std::result::Result<NcclLib, String>> = OnceLock::new();
    LIB.get_or_init(open).as_ref().map_err(|e| Error::new("nccl", e.clone()))
}

/// Where NCCL was found and its version code (e.g. 22703 for 2.27.3), or why it was not.
pub fn nccl_version() -> Result<(String, i32)> {
    nccl().map(|l| (l.path.clone(), l.version))
}
