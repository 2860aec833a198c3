//! Raw element buffers. CPU storage is a plain `Vec`; device backends keep their own buffers
//! behind `DeviceStorage` so this crate never depends on CUDA.
use crate::{DType, Device};
use half::bf16;
use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Clone, Debug, PartialEq)]
pub enum CpuStorage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F64(Vec<f64>),
    I32(Vec<i32>),
}

impl CpuStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::I32(_) => DType::I32,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::I32(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn zeros(n: usize, dtype: DType) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::F64 => CpuStorage::F64(vec![0.0; n]),
            DType::I32 => CpuStorage::I32(vec![0; n]),
        }
    }
    pub fn full(n: usize, dtype: DType, v: f64) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![v as f32; n]),
            DType::BF16 => CpuStorage::BF16(vec![crate::bf16_from_f64(v); n]),
            DType::F64 => CpuStorage::F64(vec![v; n]),
            DType::I32 => CpuStorage::I32(vec![v as i32; n]),
        }
    }
}

/// A buffer owned by a device backend (e.g. CUDA memory from a stream-ordered pool).
pub trait DeviceStorage: Send + Sync + fmt::Debug + Any {
    fn dtype(&self) -> DType;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn device(&self) -> Device;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    Device(Box<dyn DeviceStorage>),
}

impl Storage {
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            Storage::Device(s) => s.dtype(),
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.len(),
            Storage::Device(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Device(s) => s.device(),
        }
    }
}

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static PEAK_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Bytes held by all live tensor storages of this process (every device together).
/// Activation-checkpointing tests and memory logs read it.
pub fn live_bytes() -> usize {
    LIVE_BYTES.load(Ordering::Relaxed)
}
/// Highest `live_bytes()` seen since the last `reset_peak_bytes()`.
pub fn peak_bytes() -> usize {
    PEAK_BYTES.load(Ordering::Relaxed)
}
pub fn reset_peak_bytes() {
    PEAK_BYTES.store(live_bytes(), Ordering::Relaxed);
}

/// Host working memory an op holds outside any tensor storage (a CPU kernel's scratch vectors),
/// counted in `live_bytes` and `peak_bytes` while this lives, so that measured peaks see it.
#[derive(Debug)]
pub struct CountedBytes(usize);

impl CountedBytes {
    pub fn new(bytes: usize) -> Self {
        account_add(bytes);
        CountedBytes(bytes)
    }
    /// The bytes of `n` elements of `dtype`.
    pub fn elems(n: usize, dtype: crate::DType) -> Self {
        Self::new(n * dtype.size_in_bytes())
    }
}

impl Drop for CountedBytes {
    fn drop(&mut self) {
        LIVE_BYTES.fetch_sub(self.0, Ordering::Relaxed);
    }
}

/// Fills a pending storage in place once the work that produces it (a collective in flight)
/// completes. It runs at most once, on the first read of the storage.
pub type Fill = Box<dyn FnOnce(&mut Storage) -> crate::Result<()> + Send>;

/// Produces a released storage's bytes again when it is next read (for example by
/// all-gathering a sharded parameter bucket), unless a prefetch got there first.
pub trait Refill: Send + Sync {
    fn refill(&self) -> crate::Result<Storage>;
}

enum State {
    Ready,
    /// Bytes in flight; `fill` completes them.
    Pending(Fill),
    /// The fill failed: every later read reports the same error.
    Failed(crate::Error),
    /// The bytes were dropped to save memory; `refill` brings them back on the next read.
    Released(std::sync::Arc<dyn Refill>),
}

/// Storage plus its byte accounting; shared (without copying) by every view of it.
///
/// A cell may be *pending*: its bytes are being produced elsewhere (a collective on a
/// communication thread or stream). The first read waits for them, so a value is waited on
/// exactly where it is first used, and code that only passes the tensor along never waits.
/// A cell may also be *released*: its bytes dropped (a ZeRO-3 parameter bucket between
/// uses) and produced again on the next read. Live-byte accounting follows both.
pub struct StorageCell {
    pub(crate) inner: std::sync::RwLock<Storage>,
    state: std::sync::Mutex<State>,
    /// Any state but `Ready`: the fast path of every read checks only this.
    not_ready: std::sync::atomic::AtomicBool,
    /// The pending fill is local work (a deferred computation), not a wait on another party.
    local: std::sync::atomic::AtomicBool,
    /// What produces a pending fill's bytes, for consumers that can chain behind it without
    /// waiting (a collective reading another collective's result on its communication stream).
    producer: std::sync::OnceLock<std::sync::Arc<dyn std::any::Any + Send + Sync>>,
    len: usize,
    dtype: crate::DType,
    bytes: usize,
}

impl fmt::Debug for StorageCell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StorageCell({} bytes{})", self.bytes, if self.is_ready() { "" } else { ", not ready" })
    }
}

fn account_add(bytes: usize) {
    let now = LIVE_BYTES.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK_BYTES.fetch_max(now, Ordering::Relaxed);
}

impl StorageCell {
    pub fn new(s: Storage) -> Self {
        let (len, dtype) = (s.len(), s.dtype());
        let bytes = len * dtype.size_in_bytes();
        account_add(bytes);
        StorageCell {
            inner: std::sync::RwLock::new(s),
            state: std::sync::Mutex::new(State::Ready),
            not_ready: std::sync::atomic::AtomicBool::new(false),
            local: std::sync::atomic::AtomicBool::new(false),
            producer: std::sync::OnceLock::new(),
            len,
            dtype,
            bytes,
        }
    }

    /// A cell over `s` (already sized for the result) that `fill` completes on first read.
    pub fn pending(s: Storage, fill: Fill) -> Self {
        Self::pending_from(s, fill, None)
    }

    /// A pending cell as `pending`, naming what produces its bytes when `producer` is given (see
    /// `pending_producer`).
    pub fn pending_from(s: Storage, fill: Fill, producer: Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>) -> Self {
        let c = Self::new(s);
        *c.lock_state() = State::Pending(fill);
        c.not_ready.store(true, Ordering::Release);
        if let Some(p) = producer {
            let _ = c.producer.set(p);
        }
        c
    }

    /// What produces the bytes, while a fill made by `pending_from` is still outstanding.
    pub fn pending_producer(&self) -> Option<std::sync::Arc<dyn std::any::Any + Send + Sync>> {
        if self.is_pending() {
            self.producer.get().cloned()
        } else {
            None
        }
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A pending cell whose fill is local work (a deferred computation, see
    /// `Tensor::deferred`): resolving it makes progress instead of waiting on communication.
    pub fn local_pending(s: Storage, fill: Fill) -> Self {
        let c = Self::pending(s, fill);
        c.local.store(true, Ordering::Release);
        c
    }

    /// The cell promises `n` elements (its placeholder may hold none): the size its fill must
    /// produce, and what it accounts for.
    pub(crate) fn promising(mut self, n: usize) -> Self {
        let bytes = n * self.dtype.size_in_bytes();
        LIVE_BYTES.fetch_sub(self.bytes, Ordering::Relaxed);
        account_add(bytes);
        self.len = n;
        self.bytes = bytes;
        self
    }

    /// True while a local (deferred-computation) fill is outstanding.
    pub fn is_local_pending(&self) -> bool {
        self.local.load(Ordering::Acquire) && self.is_pending()
    }

    /// True while a fill is in flight (a collective's result, a deferred computation, or a
    /// prefetch of released bytes): a read waits for it. False for ready, failed and released
    /// storage.
    pub fn is_pending(&self) -> bool {
        !self.is_ready() && matches!(*self.lock_state(), State::Pending(_))
    }

    /// True when the bytes are there to read without waiting (no fill in flight, not failed,
    /// not released). Lock-free: the hot path of every read.
    pub fn is_ready(&self) -> bool {
        !self.not_ready.load(Ordering::Acquire)
    }

    /// True while the bytes are released (see `release`).
    pub fn is_released(&self) -> bool {
        !self.is_ready() && matches!(*self.lock_state(), State::Released(_))
    }

    fn check_shape(&self, s: &Storage) -> crate::Result<()> {
        if s.len() != self.len || s.dtype() != self.dtype {
            return Err(crate::Error::new(
                "storage",
                format!("a fill produced {} {} elements where {} {} were promised", s.len(), s.dtype(), self.len, self.dtype),
            ));
        }
        Ok(())
    }

    /// Waits for a pending fill, or refills released bytes (no-op when ready).
    pub fn resolve(&self) -> crate::Result<()> {
        if self.is_ready() {
            return Ok(());
        }
        let mut st = self.lock_state();
        let res = match std::mem::replace(&mut *st, State::Ready) {
            State::Ready => return Ok(()),
            State::Failed(e) => Err(e),
            State::Pending(fill) => {
                let mut s = self.inner.write().unwrap_or_else(|e| e.into_inner());
                fill(&mut s).and_then(|()| self.check_shape(&s))
            }
            State::Released(r) => match r.refill() {
                Ok(new) => self.check_shape(&new).map(|()| {
                    *self.inner.write().unwrap_or_else(|e| e.into_inner()) = new;
                    account_add(self.bytes);
                }),
                Err(e) => {
                    // Still released: a later read may try again.
                    *st = State::Released(r);
                    return Err(e);
                }
            },
        };
        match res {
            Ok(()) => {
                self.not_ready.store(false, Ordering::Release);
                Ok(())
            }
            Err(e) => {
                *st = State::Failed(e.clone());
                Err(e)
            }
        }
    }

    /// Drops the bytes (after waiting for any fill in flight); the next read calls `refill`
    /// unless `prefetch` brings them back first.
    pub fn release(&self, refill: std::sync::Arc<dyn Refill>) -> crate::Result<()> {
        self.resolve()?;
        let mut st = self.lock_state();
        *self.inner.write().unwrap_or_else(|e| e.into_inner()) = Storage::Cpu(CpuStorage::zeros(0, self.dtype));
        LIVE_BYTES.fetch_sub(self.bytes, Ordering::Relaxed);
        *st = State::Released(refill);
        self.not_ready.store(true, Ordering::Release);
        Ok(())
    }

    /// As `release`, unless the bytes are in use right now (a read or write guard is held, or
    /// a fill is in flight): then nothing happens and it returns false.
    pub fn try_release(&self, refill: std::sync::Arc<dyn Refill>) -> crate::Result<bool> {
        let mut st = self.lock_state();
        if !matches!(*st, State::Ready) {
            return Ok(false);
        }
        let Ok(mut inner) = self.inner.try_write() else { return Ok(false) };
        *inner = Storage::Cpu(CpuStorage::zeros(0, self.dtype));
        LIVE_BYTES.fetch_sub(self.bytes, Ordering::Relaxed);
        *st = State::Released(refill);
        self.not_ready.store(true, Ordering::Release);
        Ok(true)
    }

    /// Starts bringing released bytes back: `fill` produces them (replacing the placeholder
    /// storage it is given) at the next read. A no-op returning false when the cell is not
    /// released. The bytes count as live from now on.
    pub fn prefetch(&self, fill: Fill) -> crate::Result<bool> {
        let mut st = self.lock_state();
        if !matches!(*st, State::Released(_)) {
            return Ok(false);
        }
        account_add(self.bytes);
        *st = State::Pending(fill);
        Ok(true)
    }

    /// Read access, after waiting for a pending fill. Readiness is checked again under the
    /// guard: a `try_release` between `resolve` and the guard (it needs the write lock, so it
    /// cannot come after) would otherwise hand out its empty placeholder.
    pub fn read(&self) -> crate::Result<std::sync::RwLockReadGuard<'_, Storage>> {
        self.ready_guard(|| self.inner.read().unwrap_or_else(|e| e.into_inner()))
    }
    /// Write access, after waiting for a pending fill (readiness checked under the guard, as
    /// in `read`).
    pub fn write(&self) -> crate::Result<std::sync::RwLockWriteGuard<'_, Storage>> {
        self.ready_guard(|| self.inner.write().unwrap_or_else(|e| e.into_inner()))
    }
    fn ready_guard<G>(&self, guard: impl Fn() -> G) -> crate::Result<G> {
        loop {
            self.resolve()?;
            let g = guard();
            if self.is_ready() {
                return Ok(g);
            }
        }
    }
    /// Bytes this cell accounts for when its bytes are present (known without waiting).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Elements the cell holds when present (known without waiting).
    pub(crate) fn numel(&self) -> usize {
        self.len
    }
}

impl Drop for StorageCell {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if !matches!(st, State::Released(_)) {
            LIVE_BYTES.fetch_sub(self.bytes, Ordering::Relaxed);
        }
    }
}
