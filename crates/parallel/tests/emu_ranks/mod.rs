//! Shared by the emulated-NCCL tests: ranks as real processes, a test stream that implements the
//! emulator's stream ABI, and reference reductions.
//!
//! A test starts its ranks by re-running its own test binary (`Group::spawn`) with
//! `FERROLM_NCCL_EMU_TEST_ROLE=test:rank:nranks:dir`; in the child, `child(test, body)` runs the
//! rank's body and exits. The ranks share nothing but files in `dir`: rank 0 makes the unique id
//! and writes it there (as a launcher's store would carry it), the others read it.
#![allow(dead_code)]
use ferrolm_parallel::nccl_lib::{self, NcclLib, RawComm, RawStream, UniqueId};
use std::ffi::{c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::{mpsc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const ROLE: &str = "FERROLM_NCCL_EMU_TEST_ROLE";

/// The emulated NCCL, or None (the test passes, saying so) when it was not built and
/// FERROLM_REQUIRE_EMU is not 1.
pub fn emu() -> Option<&'static NcclLib> {
    ferrolm_testing::gate::require(ferrolm_testing::Need::Emulator, nccl_lib::emulated())
}

pub struct Rank {
    pub rank: usize,
    pub n: usize,
    pub dir: PathBuf,
    pub lib: &'static NcclLib,
}

/// In a child started by `Group::spawn` for `test`: runs `body` as that rank, then exits the
/// process (status 0; a panic fails the child's test run instead). Elsewhere returns at once.
pub fn child(test: &str, body: impl FnOnce(&Rank)) {
    let Ok(role) = std::env::var(ROLE) else { return };
    let parts: Vec<&str> = role.splitn(4, ':').collect();
    assert_eq!(parts.len(), 4, "{ROLE}={role}");
    if parts[0] != test {
        return;
    }
    let lib = nccl_lib::emulated().expect("the emulated NCCL");
    let r = Rank { rank: parts[1].parse().unwrap(), n: parts[2].parse().unwrap(), dir: PathBuf::from(parts[3]), lib };
    body(&r);
    std::process::exit(0);
}

/// A whole test: in a rank process of `test`, runs `body` and exits; in the test itself, starts
/// ranks 0..n and asserts that every one succeeds within `timeout` (passes at once when the
/// emulated NCCL is not built).
pub fn run_ranks(test: &str, n: usize, timeout: Duration, body: impl FnOnce(&Rank)) {
    child(test, body);
    let Some(g) = Group::spawn(test, n, &[]) else { return };
    g.finish(timeout).assert_ok();
}

fn write_atomic(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn wait_path(path: &Path, timeout: Duration) -> bool {
    let t = Instant::now();
    while !path.exists() {
        if t.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

impl Rank {
    /// Rank 0 makes the id (its process hosts the bootstrap root) and publishes it.
    pub fn unique_id(&self) -> UniqueId {
        let path = self.dir.join("id");
        let mut id = UniqueId { internal: [0; 128] };
        if self.rank == 0 {
            // SAFETY: writes the 128-byte id.
            let r = unsafe { (self.lib.get_unique_id)(&mut id) };
            assert_eq!(r, 0, "ncclGetUniqueId");
            write_atomic(&path, &id.internal);
        } else {
            assert!(wait_path(&path, Duration::from_secs(30)), "rank 0 never published the id");
            id.internal.copy_from_slice(&std::fs::read(&path).unwrap());
        }
        id
    }
    pub fn init(&self) -> Comm {
        let id = self.unique_id();
        Comm::try_init(self.lib, self.n, id, self.rank).unwrap_or_else(|e| panic!("ncclCommInitRank: {e}"))
    }
    /// Tells the other processes (and the test) that `name` happened.
    pub fn signal(&self, name: &str) {
        write_atomic(&self.dir.join(name), b"");
    }
    pub fn wait_for(&self, name: &str) {
        assert!(wait_path(&self.dir.join(name), Duration::from_secs(30)), "{name} never happened");
    }
}

/// One communicator handle. NCCL handles may be used from any thread (one call at a time, except
/// ncclCommGetAsyncError and ncclCommAbort).
pub struct Comm {
    pub lib: &'static NcclLib,
    pub raw: RawComm,
}
// SAFETY: see above; the tests never make overlapping calls other than those two.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    pub fn try_init(lib: &'static NcclLib, n: usize, id: UniqueId, rank: usize) -> Result<Comm, i32> {
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: every rank passes the same id and nranks and its own rank.
        let r = unsafe { (lib.comm_init_rank)(&mut raw, n as c_int, id, rank as c_int) };
        if r == 0 {
            Ok(Comm { lib, raw })
        } else {
            Err(r)
        }
    }
    pub fn split(&self, color: i32, key: i32) -> Option<Comm> {
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: collective over this communicator; NULL config.
        let r = unsafe { (self.lib.comm_split)(self.raw, color, key, &mut raw, std::ptr::null_mut()) };
        assert_eq!(r, 0, "ncclCommSplit(color {color}, key {key})");
        (!raw.is_null()).then_some(Comm { lib: self.lib, raw })
    }
    pub fn async_error(&self) -> i32 {
        let mut e = 0;
        // SAFETY: thread-safe; writes one int.
        let r = unsafe { (self.lib.comm_get_async_error)(self.raw, &mut e) };
        assert_eq!(r, 0, "ncclCommGetAsyncError");
        e
    }
    pub fn abort(&self) -> i32 {
        // SAFETY: callable from any thread; the handle is not used afterwards.
        unsafe { (self.lib.comm_abort)(self.raw) }
    }
    pub fn destroy(self) -> i32 {
        // SAFETY: no call on this communicator is running.
        unsafe { (self.lib.comm_destroy)(self.raw) }
    }
    pub fn size(&self) -> usize {
        let mut n = 0;
        // SAFETY: writes one int.
        assert_eq!(unsafe { (self.lib.comm_count)(self.raw, &mut n) }, 0);
        n as usize
    }
    pub fn rank(&self) -> usize {
        let mut r = 0;
        // SAFETY: writes one int.
        assert_eq!(unsafe { (self.lib.comm_user_rank)(self.raw, &mut r) }, 0);
        r as usize
    }
    // The collectives, on host memory (the emulated device's pointers are host addresses). The
    // callers pass buffers of the sizes the counts imply that outlive the stream's work.
    pub fn all_reduce(&self, send: *const c_void, recv: *mut c_void, count: usize, dt: Dt, op: i32, stream: RawStream) -> i32 {
        // SAFETY: see above.
        unsafe { (self.lib.all_reduce)(send, recv, count, dt.code(), op, self.raw, stream) }
    }
    pub fn all_gather(&self, send: *const c_void, recv: *mut c_void, count: usize, dt: Dt, stream: RawStream) -> i32 {
        // SAFETY: see above.
        unsafe { (self.lib.all_gather)(send, recv, count, dt.code(), self.raw, stream) }
    }
    pub fn reduce_scatter(&self, send: *const c_void, recv: *mut c_void, count: usize, dt: Dt, op: i32, stream: RawStream) -> i32 {
        // SAFETY: see above.
        unsafe { (self.lib.reduce_scatter)(send, recv, count, dt.code(), op, self.raw, stream) }
    }
    pub fn broadcast(&self, send: *const c_void, recv: *mut c_void, count: usize, dt: Dt, root: usize, stream: RawStream) -> i32 {
        // SAFETY: see above.
        unsafe { (self.lib.broadcast)(send, recv, count, dt.code(), root as c_int, self.raw, stream) }
    }
}

/// A byte buffer with 8-byte alignment (any element type may live in it).
pub struct Buf {
    words: Vec<u64>,
    pub len: usize,
}
// SAFETY: plain memory; the tests order their accesses by stream synchronisation.
unsafe impl Send for Buf {}
unsafe impl Sync for Buf {}

impl Buf {
    pub fn filled(len: usize, byte: u8) -> Buf {
        let mut b = Buf { words: vec![0; len.div_ceil(8).max(1)], len };
        b.bytes_mut().fill(byte);
        b
    }
    pub fn from_bytes(bytes: &[u8]) -> Buf {
        let mut b = Buf::filled(bytes.len(), 0);
        b.bytes_mut().copy_from_slice(bytes);
        b
    }
    pub fn ptr(&self) -> *mut c_void {
        self.words.as_ptr() as *mut c_void
    }
    /// The address `offset` bytes in.
    pub fn at(&self, offset: usize) -> *mut c_void {
        assert!(offset <= self.len);
        // SAFETY: inside the buffer (checked).
        unsafe { (self.words.as_ptr() as *mut u8).add(offset) as *mut c_void }
    }
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the words hold at least len bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }
    /// A copy read through the raw pointer (the library may have written it meanwhile).
    pub fn snapshot(&self) -> Vec<u8> {
        // SAFETY: the pointer is valid for len bytes; callers read after the writer finished or
        // while it provably has not started.
        unsafe { std::slice::from_raw_parts(self.ptr() as *const u8, self.len).to_vec() }
    }
}

// ---------------------------------------------------------------------------------------------
// A stream with the emulator's ABI (crates/cuda/emu/ferro_emu_stream.h): a worker thread runs
// queued items in order.

#[repr(C)]
struct StreamOps {
    magic: u32,
    enqueue: unsafe extern "C" fn(*mut c_void, unsafe extern "C" fn(*mut c_void), *mut c_void) -> c_int,
}
static OPS: StreamOps = StreamOps { magic: 0xFE57_A300, enqueue: enqueue_item };

struct SendPtr(*mut c_void);
// SAFETY: the argument belongs to the library's work item, which runs on the worker thread.
unsafe impl Send for SendPtr {}

enum Item {
    Foreign(unsafe extern "C" fn(*mut c_void), SendPtr),
    Local(Box<dyn FnOnce() + Send>),
}

#[repr(C)]
pub struct TestStream {
    ops: &'static StreamOps, // first member, as the ABI requires
    tx: Mutex<Option<mpsc::Sender<Item>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

unsafe extern "C" fn enqueue_item(stream: *mut c_void, f: unsafe extern "C" fn(*mut c_void), arg: *mut c_void) -> c_int {
    // SAFETY: the library passes back the pointer `raw()` gave it, to a live TestStream.
    let s = unsafe { &*(stream as *const TestStream) };
    match s.tx.lock().unwrap().as_ref() {
        Some(tx) if tx.send(Item::Foreign(f, SendPtr(arg))).is_ok() => 0,
        _ => 1,
    }
}

impl TestStream {
    pub fn new() -> Box<TestStream> {
        let (tx, rx) = mpsc::channel::<Item>();
        let worker = std::thread::spawn(move || {
            for item in rx {
                match item {
                    // SAFETY: the library's work function with its own argument, called once.
                    Item::Foreign(f, arg) => unsafe { f(arg.0) },
                    Item::Local(f) => f(),
                }
            }
        });
        Box::new(TestStream { ops: &OPS, tx: Mutex::new(Some(tx)), worker: Mutex::new(Some(worker)) })
    }
    pub fn raw(&self) -> RawStream {
        self as *const TestStream as RawStream
    }
    pub fn push(&self, f: impl FnOnce() + Send + 'static) {
        self.tx.lock().unwrap().as_ref().unwrap().send(Item::Local(Box::new(f))).unwrap();
    }
    pub fn synchronize(&self) {
        let (tx, rx) = mpsc::channel();
        self.push(move || tx.send(()).unwrap());
        rx.recv_timeout(Duration::from_secs(60)).expect("stream did not drain within 60 s");
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        // Drains: every queued item runs, as the ABI requires.
        drop(self.tx.lock().unwrap().take());
        if let Some(w) = self.worker.lock().unwrap().take() {
            let _ = w.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Processes.

pub struct Group {
    pub dir: PathBuf,
    children: Vec<(usize, Child)>,
}

pub struct Outcome {
    pub ranks: Vec<(usize, Option<ExitStatus>, String)>,
}

impl Group {
    /// Starts ranks 0..n of `test` (None: the emulated NCCL is not built, the test passes).
    pub fn spawn(test: &str, n: usize, env: &[(&str, &str)]) -> Option<Group> {
        Self::spawn_ranks(test, n, &(0..n).collect::<Vec<_>>(), env)
    }
    /// Starts only `ranks` of an n-rank world.
    pub fn spawn_ranks(test: &str, n: usize, ranks: &[usize], env: &[(&str, &str)]) -> Option<Group> {
        emu()?;
        let dir = std::env::temp_dir().join(format!("ferrolm-nccl-emu-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let exe = std::env::current_exe().unwrap();
        let mut children = Vec::new();
        for &r in ranks {
            let log = std::fs::File::create(dir.join(format!("rank{r}.log"))).unwrap();
            let child = Command::new(&exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(ROLE, format!("{test}:{r}:{n}:{}", dir.display()))
                .env("NCCL_EMU_TIMEOUT", "60")
                .envs(env.iter().copied())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap();
            children.push((r, child));
        }
        Some(Group { dir, children })
    }
    pub fn wait_file(&self, name: &str) {
        assert!(wait_path(&self.dir.join(name), Duration::from_secs(30)), "{name} never happened");
    }
    pub fn touch(&self, name: &str) {
        write_atomic(&self.dir.join(name), b"");
    }
    /// SIGKILL, as a crash or the OOM killer would.
    pub fn kill(&mut self, rank: usize) {
        let c = &mut self.children.iter_mut().find(|(r, _)| *r == rank).unwrap().1;
        c.kill().unwrap();
        c.wait().unwrap();
    }
    /// Waits for every child (killing any still running after `timeout`) and collects its log.
    pub fn finish(mut self, timeout: Duration) -> Outcome {
        let t = Instant::now();
        let mut ranks = Vec::new();
        for (r, c) in &mut self.children {
            let status = loop {
                if let Some(s) = c.try_wait().unwrap() {
                    break Some(s);
                }
                if t.elapsed() > timeout {
                    let _ = c.kill();
                    let _ = c.wait();
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let log = std::fs::read_to_string(self.dir.join(format!("rank{r}.log"))).unwrap_or_default();
            ranks.push((*r, status, log));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        Outcome { ranks }
    }
}

impl Outcome {
    pub fn assert_ok(&self) {
        for (r, s, log) in &self.ranks {
            assert!(s.is_some_and(|s| s.success()), "rank {r} ended with {s:?} (None: killed after the time limit); its output:\n{log}");
        }
    }
    pub fn log(&self, rank: usize) -> &str {
        &self.ranks.iter().find(|(r, _, _)| *r == rank).unwrap().2
    }
}

// ---------------------------------------------------------------------------------------------
// Data types and the reference reduction: ranks in order, f32 accumulation for f16/bf16/f32,
// f64 for f64, rounded once; integers wrap; NaN wins in max/min; avg = sum / n.

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Dt {
    I8,
    U8,
    I32,
    U32,
    I64,
    U64,
    F16,
    F32,
    F64,
    Bf16,
}
pub const ALL_DTYPES: [Dt; 10] = [Dt::I8, Dt::U8, Dt::I32, Dt::U32, Dt::I64, Dt::U64, Dt::F16, Dt::F32, Dt::F64, Dt::Bf16];
pub const ALL_OPS: [i32; 5] = [nccl_lib::NCCL_SUM, nccl_lib::NCCL_PROD, nccl_lib::NCCL_MAX, nccl_lib::NCCL_MIN, nccl_lib::NCCL_AVG];

impl Dt {
    pub fn code(self) -> i32 {
        use nccl_lib::*;
        match self {
            Dt::I8 => NCCL_INT8,
            Dt::U8 => NCCL_UINT8,
            Dt::I32 => NCCL_INT32,
            Dt::U32 => NCCL_UINT32,
            Dt::I64 => NCCL_INT64,
            Dt::U64 => NCCL_UINT64,
            Dt::F16 => NCCL_FLOAT16,
            Dt::F32 => NCCL_FLOAT32,
            Dt::F64 => NCCL_FLOAT64,
            Dt::Bf16 => NCCL_BFLOAT16,
        }
    }
    pub fn size(self) -> usize {
        match self {
            Dt::I8 | Dt::U8 => 1,
            Dt::F16 | Dt::Bf16 => 2,
            Dt::I32 | Dt::U32 | Dt::F32 => 4,
            Dt::I64 | Dt::U64 | Dt::F64 => 8,
        }
    }
    fn signed(self) -> bool {
        matches!(self, Dt::I8 | Dt::I32 | Dt::I64)
    }
    pub fn is_float(self) -> bool {
        matches!(self, Dt::F16 | Dt::F32 | Dt::F64 | Dt::Bf16)
    }
    /// One element from a number (floats rounded to the type; integers truncated and wrapped).
    pub fn encode(self, v: f64, out: &mut Vec<u8>) {
        match self {
            Dt::F16 => out.extend(half::f16::from_f64(v).to_bits().to_le_bytes()),
            Dt::Bf16 => out.extend(half::bf16::from_f64(v).to_bits().to_le_bytes()),
            Dt::F32 => out.extend((v as f32).to_le_bytes()),
            Dt::F64 => out.extend(v.to_le_bytes()),
            _ => out.extend(&(v as i64 as i128).to_le_bytes()[..self.size()]),
        }
    }
    fn int(self, b: &[u8]) -> i128 {
        let mut w = [0u8; 16];
        w[..b.len()].copy_from_slice(b);
        if self.signed() && b[b.len() - 1] & 0x80 != 0 {
            w[b.len()..].fill(0xFF);
        }
        i128::from_le_bytes(w)
    }
    fn wrap(self, x: i128) -> i128 {
        let bits = 8 * self.size() as u32;
        let m = x & ((1i128 << bits) - 1);
        if self.signed() && m >= 1i128 << (bits - 1) {
            m - (1i128 << bits)
        } else {
            m
        }
    }
    fn f32_of(self, b: &[u8]) -> f32 {
        match self {
            Dt::F16 => half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            Dt::Bf16 => half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            _ => f32::from_le_bytes(b.try_into().unwrap()),
        }
    }
}

fn nan_max<F: PartialOrd + Copy>(a: F, b: F, nan: F, max: bool) -> F {
    #[allow(clippy::eq_op)]
    if a != a || b != b {
        return nan;
    }
    if (max && b > a) || (!max && b < a) {
        b
    } else {
        a
    }
}

/// One element of a float reduction over `n` ranks: rank 0 op rank 1 op ... in the accumulator
/// type `F` (`value(q)` is rank q's element widened to it); a mean divides the sum by `count`
/// (`n` as `F`) once, at the end.
fn float_fold<F>(op: i32, n: usize, value: impl Fn(usize) -> F, nan: F, count: F) -> F
where
    F: PartialOrd + Copy + std::ops::Add<Output = F> + std::ops::Mul<Output = F> + std::ops::DivAssign,
{
    use nccl_lib::{NCCL_AVG, NCCL_MAX, NCCL_PROD, NCCL_SUM};
    let mut a = value(0);
    for q in 1..n {
        let b = value(q);
        a = match op {
            NCCL_SUM | NCCL_AVG => a + b,
            NCCL_PROD => a * b,
            _ => nan_max(a, b, nan, op == NCCL_MAX),
        };
    }
    if op == NCCL_AVG {
        a /= count;
    }
    a
}

/// The element-wise reduction of `parts` (one byte vector per rank, in rank order).
pub fn reduce_ref(dt: Dt, op: i32, parts: &[Vec<u8>]) -> Vec<u8> {
    use nccl_lib::{NCCL_AVG, NCCL_MIN, NCCL_PROD, NCCL_SUM};
    let (n, es) = (parts.len(), dt.size());
    let len = parts[0].len() / es;
    let mut out = Vec::with_capacity(parts[0].len());
    for i in 0..len {
        let el = |q: usize| &parts[q][i * es..(i + 1) * es];
        match dt {
            Dt::F64 => {
                let a = float_fold(op, n, |q| f64::from_le_bytes(el(q).try_into().unwrap()), f64::NAN, n as f64);
                out.extend(a.to_le_bytes());
            }
            Dt::F16 | Dt::F32 | Dt::Bf16 => {
                let a = float_fold(op, n, |q| dt.f32_of(el(q)), f32::NAN, n as f32);
                match dt {
                    Dt::F16 => out.extend(half::f16::from_f32(a).to_bits().to_le_bytes()),
                    Dt::Bf16 => out.extend(half::bf16::from_f32(a).to_bits().to_le_bytes()),
                    _ => out.extend(a.to_le_bytes()),
                }
            }
            _ => {
                let mut a = dt.int(el(0));
                for q in 1..n {
                    let b = dt.int(el(q));
                    a = dt.wrap(match op {
                        NCCL_SUM | NCCL_AVG => a + b,
                        NCCL_PROD => a.wrapping_mul(b),
                        NCCL_MIN => a.min(b),
                        _ => a.max(b),
                    });
                }
                if op == NCCL_AVG {
                    a = dt.wrap(a) / n as i128;
                }
                out.extend(&a.to_le_bytes()[..es]);
            }
        }
    }
    out
}

/// Rank `rank`'s `len` elements for a test (deterministic; `salt` varies them between calls).
/// Floats have fraction bits, so rounding shows; `tiny` scales f16/bf16 values into f16's
/// subnormal range.
pub fn values(dt: Dt, rank: usize, len: usize, salt: u64, tiny: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(len * dt.size());
    for i in 0..len {
        let mut h = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ salt;
        h ^= h >> 29;
        h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 32;
        let v = if dt.is_float() {
            let x = (h % 4001) as f64 / 512.0 - 3.9;
            if tiny {
                x * 2f64.powi(-19)
            } else {
                x
            }
        } else if dt.signed() {
            (h % 9) as f64 - 4.0
        } else {
            (h % 9) as f64
        };
        dt.encode(v, &mut out);
    }
    out
}
