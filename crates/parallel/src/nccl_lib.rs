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
//!
//! **The emulated NCCL** ([`emulated`]): a CPU implementation of the same C API (crates/parallel/emu,
//! built by build.rs as a shared library and embedded in every binary), for multi-process runs
//! on the emulated CUDA device, where device pointers are host addresses. Its bytes are written
//! once to a cache file named by their hash (`$XDG_CACHE_HOME/ferrolm`, `~/.cache/ferrolm`, else
//! the temporary directory) and opened through [`open_path`], exactly as `libnccl.so.2` is, into
//! the same [`NcclLib`] table. [`for_device`] picks: the emulated NCCL for the emulated device,
//! the real one for a GPU (a multi-process run exists only for worlds of more than one process).
//! Its semantics and its environment (`NCCL_EMU_TIMEOUT`, `NCCL_EMU_HOST`) are described in
//! crates/parallel/emu/README.md; the stream ABI it enqueues on is
//! crates/cuda/emu/ferro_emu_stream.h.
use ferrolm_tensor::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// `ncclComm_t`.
pub type RawComm = *mut c_void;
/// `cudaStream_t`: on the emulated device a pointer to a struct whose first member points at
/// `ferro_emu_stream_ops` (crates/cuda/emu/ferro_emu_stream.h), or NULL (run at call time).
pub type RawStream = *mut c_void;
/// `ncclResult_t`.
pub type NcclResult = c_int;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [u8; 128],
}

// ncclDataType_t and ncclRedOp_t values (stable since NCCL 2.10).
pub const NCCL_INT8: c_int = 0;
pub const NCCL_UINT8: c_int = 1;
pub const NCCL_INT32: c_int = 2;
pub const NCCL_UINT32: c_int = 3;
pub const NCCL_INT64: c_int = 4;
pub const NCCL_UINT64: c_int = 5;
pub const NCCL_FLOAT16: c_int = 6;
pub const NCCL_FLOAT32: c_int = 7;
pub const NCCL_FLOAT64: c_int = 8;
pub const NCCL_BFLOAT16: c_int = 9;
pub const NCCL_SUM: c_int = 0;
pub const NCCL_PROD: c_int = 1;
pub const NCCL_MAX: c_int = 2;
pub const NCCL_MIN: c_int = 3;
pub const NCCL_AVG: c_int = 4;
/// `ncclCommSplit`'s color for ranks that join no new communicator (they get NULL).
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;

// ncclResult_t values.
pub const NCCL_SUCCESS: c_int = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: c_int = 1;
pub const NCCL_SYSTEM_ERROR: c_int = 2;
pub const NCCL_INTERNAL_ERROR: c_int = 3;
pub const NCCL_INVALID_ARGUMENT: c_int = 4;
pub const NCCL_INVALID_USAGE: c_int = 5;
pub const NCCL_REMOTE_ERROR: c_int = 6;
/// `ncclInProgress`: not an error (non-blocking communicators).
pub const NCCL_IN_PROGRESS: c_int = 7;

/// ncclCommSplit appeared in 2.18.
const MIN_VERSION: c_int = 21800;

/// Declares [`NcclLib`] with one field per NCCL entry point, each named once with its C symbol
/// and its C signature from nccl.h, and `resolve_entry_points`, which looks every one of them up.
macro_rules! nccl_entry_points {
    ($($vis:vis $field:ident = $name:literal: $sig:ty;)*) => {
        /// NCCL's entry points, resolved from one library (real or emulated). The function
        /// pointers are NCCL's C functions: calling them is `unsafe`, with NCCL's contracts
        /// (buffers of the sizes the counts imply, on the communicator's device; one thread at a
        /// time per communicator, except `comm_get_async_error` and `comm_abort`).
        pub struct NcclLib {
            /// The file it was opened from.
            pub path: String,
            /// NCCL's version code (e.g. 22703 for 2.27.3).
            pub version: c_int,
            /// The emulated NCCL (crates/parallel/emu), whose "device" buffers are host memory.
            pub emulated: bool,
            $($vis $field: $sig,)*
            /// Keeps the symbols above valid for the life of the process.
            _lib: libloading::Library,
        }

        fn resolve_entry_points(lib: libloading::Library, path: &str, version: c_int, emulated: bool) -> std::result::Result<NcclLib, String> {
            Ok(NcclLib {
                path: path.to_string(),
                version,
                emulated,
                // SAFETY: each symbol is NCCL's, and its field's type is its C signature.
                $($field: unsafe { symbol(&lib, path, concat!($name, "\0")) }?,)*
                _lib: lib,
            })
        }
    };
}

nccl_entry_points! {
    pub get_unique_id = "ncclGetUniqueId": unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
    pub comm_init_rank = "ncclCommInitRank": unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult;
    pub comm_split = "ncclCommSplit": unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut c_void) -> NcclResult;
    pub comm_abort = "ncclCommAbort": unsafe extern "C" fn(RawComm) -> NcclResult;
    pub comm_destroy = "ncclCommDestroy": unsafe extern "C" fn(RawComm) -> NcclResult;
    pub comm_get_async_error = "ncclCommGetAsyncError": unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
    pub comm_count = "ncclCommCount": unsafe extern "C" fn(RawComm, *mut c_int) -> NcclResult;
    pub comm_user_rank = "ncclCommUserRank": unsafe extern "C" fn(RawComm, *mut c_int) -> NcclResult;
    get_error_string = "ncclGetErrorString": unsafe extern "C" fn(NcclResult) -> *const c_char;
    pub all_reduce = "ncclAllReduce": unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
    pub all_gather = "ncclAllGather": unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> NcclResult;
    pub reduce_scatter = "ncclReduceScatter": unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
    pub broadcast = "ncclBroadcast": unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
}

/// The symbol `name` (NUL-terminated) of `lib`, or an error naming it and the file.
///
/// # Safety
/// `T` must be the symbol's C type.
unsafe fn symbol<T: Copy>(lib: &libloading::Library, path: &str, name: &str) -> std::result::Result<T, String> {
    let shown = name.trim_end_matches('\0');
    // SAFETY: the caller's contract.
    unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|e| format!("{path} has no {shown}: {e}"))
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

    /// NCCL's description of a result code (`ncclGetErrorString`).
    pub fn error_string(&self, r: NcclResult) -> String {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        unsafe { CStr::from_ptr((self.get_error_string)(r)) }.to_string_lossy().into_owned()
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
            Ok(lib) => match resolve(lib, c) {
                // Real GPUs always use real NCCL: the emulator would take device pointers for
                // host addresses.
                Ok(l) if l.emulated => tried.push(format!("{c} (the emulated NCCL, which runs only on the emulated CUDA device)")),
                r => return r,
            },
            Err(e) => tried.push(format!("{c} ({e})")),
        }
    }
    Err(format!(
        "NCCL not found; tried {}. Install it (the distribution's libnccl2, or `pip install nvidia-nccl-cu13`) or set FERROLM_NCCL_LIB=/path/to/libnccl.so.2",
        tried.join(", ")
    ))
}

/// Opens the NCCL library at `path` (a file, or a name for the dynamic loader) and resolves its
/// entry points, as the search for `libnccl.so.2` does; an error names what is missing or too
/// old. [`emulated`] opens its file through here.
pub fn open_path(path: &str) -> Result<NcclLib> {
    // SAFETY: loading NCCL runs its (trusted) initialisers; nothing else is executed.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| Error::new("nccl", format!("cannot open {path}: {e}")))?;
    resolve(lib, path).map_err(|e| Error::new("nccl", e))
}

fn resolve(lib: libloading::Library, path: &str) -> std::result::Result<NcclLib, String> {
    // SAFETY: the symbol is NCCL's, and this is its C signature from nccl.h.
    let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = unsafe { symbol(&lib, path, "ncclGetVersion\0") }?;
    let mut version = 0;
    // SAFETY: writes one int.
    if unsafe { get_version(&mut version) } != 0 || version < MIN_VERSION {
        return Err(format!("{path} is NCCL {version}; ferrolm needs 2.18 or newer (ncclCommSplit)"));
    }
    // SAFETY: only looks the symbol up; the emulated NCCL exports this marker, real NCCL does not.
    let emulated = unsafe { lib.get::<*const c_int>(b"ferro_nccl_emu_abi\0") }.is_ok();
    resolve_entry_points(lib, path, version, emulated)
}

/// The real NCCL, opened once per process (never the emulated one).
pub(crate) fn nccl() -> Result<&'static NcclLib> {
    static LIB: OnceLock<std::result::Result<NcclLib, String>> = OnceLock::new();
    LIB.get_or_init(open).as_ref().map_err(|e| Error::new("nccl", e.clone()))
}

/// Where NCCL was found and its version code (e.g. 22703 for 2.27.3), or why it was not.
pub fn nccl_version() -> Result<(String, i32)> {
    nccl().map(|l| (l.path.clone(), l.version))
}

/// Whether build.rs compiled the emulated NCCL into this build (it needs a C++17 compiler).
pub const EMULATED_AVAILABLE: bool = cfg!(ferro_nccl_emu);

/// The NCCL for a communicator on a CUDA device: the emulated NCCL when the device is the CUDA
/// emulator (`FERROLM_CUDA_EMULATOR=1`: `CudaBackend::is_emulated`), else the real
/// `libnccl.so.2`. A world of one process needs neither (`ferrolm_parallel::init` makes no NcclComm then).
pub fn for_device(emulated: bool) -> Result<&'static NcclLib> {
    if emulated {
        self::emulated()
    } else {
        nccl()
    }
}

/// The emulated NCCL, opened once per process (see the module doc): its embedded bytes are
/// written to the first cache directory that takes them and can map them (a directory mounted
/// noexec takes the file but cannot map it), atomically (a temporary file renamed into place,
/// so concurrent processes never see a partial one), and reused while the contents match.
pub fn emulated() -> Result<&'static NcclLib> {
    static LIB: OnceLock<std::result::Result<NcclLib, String>> = OnceLock::new();
    LIB.get_or_init(open_emulated).as_ref().map_err(|e| Error::new("nccl", e.clone()))
}

#[cfg(ferro_nccl_emu)]
fn open_emulated() -> std::result::Result<NcclLib, String> {
    const BYTES: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libnccl-emu.so"));
    let name = format!("libnccl-emu-{}.so", env!("FERRO_NCCL_EMU_HASH"));
    let mut tried = Vec::new();
    for dir in emulated_cache_dirs(&|v| std::env::var(v).ok()) {
        match write_once(&dir, &name, BYTES) {
            Ok(p) => match open_path(&p.to_string_lossy()) {
                Ok(lib) if lib.emulated => return Ok(lib),
                Ok(_) => tried.push(format!("{} (not the emulated NCCL)", p.display())),
                Err(e) => tried.push(format!("{} ({})", p.display(), e.msg)),
            },
            Err(e) => tried.push(format!("{} ({e})", dir.display())),
        }
    }
    Err(format!("cannot write and open the emulated NCCL; tried {}. Set XDG_CACHE_HOME to a writable directory", tried.join(", ")))
}

#[cfg(not(ferro_nccl_emu))]
fn open_emulated() -> std::result::Result<NcclLib, String> {
    Err("the emulated NCCL was not built (no C++17 compiler at build time, or FERROLM_NO_EMU=1): install g++ or set CXX, and rebuild"
        .into())
}

/// Where the emulated NCCL's file may go, in order.
pub fn emulated_cache_dirs(env: &dyn Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(x) = env("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        dirs.push(PathBuf::from(x).join("ferrolm"));
    }
    if let Some(h) = env("HOME").filter(|h| !h.is_empty()) {
        dirs.push(PathBuf::from(h).join(".cache/ferrolm"));
    }
    dirs.push(std::env::temp_dir().join("ferrolm-cache"));
    dirs
}

#[cfg(ferro_nccl_emu)]
fn write_once(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<PathBuf> {
    let path = dir.join(name);
    if std::fs::read(&path).is_ok_and(|b| b == bytes) {
        return Ok(path);
    }
    std::fs::create_dir_all(dir)?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(".{name}.{}.{nanos}.tmp", std::process::id()));
    let r = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &path));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r.map(|()| path)
}
