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

/// Fills a pending storage in place once the work that produces it (a collective in flight)
/// completes. It runs at most once, on the first read of the storage.
pub type Fill = Box<dyn FnOnce(&mut Storage) -> crate::Result<()> + Send>;

enum Pending {
    Fill(Fill),
    /// The fill failed: every later read reports the same error.
    Failed(crate::Error),
}

/// Storage plus its byte accounting; shared (without copying) by every view of it.
///
/// A cell may be *pending*: its bytes are being produced elsewhere (a collective on a
/// communication thread or stream). The first read waits for them, so a value is waited on
/// exactly where it is first used, and code that only passes the tensor along never waits.
pub struct StorageCell {
    pub(crate) inner: std::sync::RwLock<Storage>,
    pending: std::sync::Mutex<Option<Pending>>,
    has_pending: std::sync::atomic::AtomicBool,
    bytes: usize,
}

impl fmt::Debug for StorageCell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StorageCell({} bytes{})", self.bytes, if self.is_pending() { ", pending" } else { "" })
    }
}

impl StorageCell {
    pub fn new(s: Storage) -> Self {
        let bytes = s.len() * s.dtype().size_in_bytes();
        let now = LIVE_BYTES.fetch_add(bytes, Ordering::Relaxed) + bytes;
        PEAK_BYTES.fetch_max(now, Ordering::Relaxed);
        StorageCell {
            inner: std::sync::RwLock::new(s),
            pending: std::sync::Mutex::new(None),
            has_pending: std::sync::atomic::AtomicBool::new(false),
            bytes,
        }
    }

    /// A cell over `s` (already sized for the result) that `fill` completes on first read.
    pub fn pending(s: Storage, fill: Fill) -> Self {
        let c = Self::new(s);
        *c.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(Pending::Fill(fill));
        c.has_pending.store(true, Ordering::Release);
        c
    }

    /// True while the bytes are still being produced (or their production failed).
    pub fn is_pending(&self) -> bool {
        self.has_pending.load(Ordering::Acquire)
    }

    /// Waits for a pending fill (no-op when there is none).
    pub fn resolve(&self) -> crate::Result<()> {
        if !self.is_pending() {
            return Ok(());
        }
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        match p.take() {
            None => Ok(()),
            Some(Pending::Failed(e)) => {
                *p = Some(Pending::Failed(e.clone()));
                Err(e)
            }
            Some(Pending::Fill(fill)) => {
                let mut s = self.inner.write().unwrap_or_else(|e| e.into_inner());
                let (len, dtype) = (s.len(), s.dtype());
                let res = fill(&mut s).and_then(|()| {
                    if s.len() != len || s.dtype() != dtype {
                        return Err(crate::Error::new(
                            "pending",
                            format!("fill produced {} {} elements where {len} {dtype} were promised", s.len(), s.dtype()),
                        ));
                    }
                    Ok(())
                });
                match res {
                    Ok(()) => {
                        self.has_pending.store(false, Ordering::Release);
                        Ok(())
                    }
                    Err(e) => {
                        *p = Some(Pending::Failed(e.clone()));
                        Err(e)
                    }
                }
            }
        }
    }

    /// Read access, after waiting for a pending fill.
    pub fn read(&self) -> crate::Result<std::sync::RwLockReadGuard<'_, Storage>> {
        self.resolve()?;
        Ok(self.inner.read().unwrap_or_else(|e| e.into_inner()))
    }
    /// Write access, after waiting for a pending fill.
    pub fn write(&self) -> crate::Result<std::sync::RwLockWriteGuard<'_, Storage>> {
        self.resolve()?;
        Ok(self.inner.write().unwrap_or_else(|e| e.into_inner()))
    }
    /// Bytes this cell accounts for (known without waiting).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for StorageCell {
    fn drop(&mut self) {
        LIVE_BYTES.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}
