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

/// Storage plus its byte accounting; shared (without copying) by every view of it.
#[derive(Debug)]
pub struct StorageCell {
    pub(crate) inner: std::sync::RwLock<Storage>,
    bytes: usize,
}

impl StorageCell {
    pub fn new(s: Storage) -> Self {
        let bytes = s.len() * s.dtype().size_in_bytes();
        let now = LIVE_BYTES.fetch_add(bytes, Ordering::Relaxed) + bytes;
        PEAK_BYTES.fetch_max(now, Ordering::Relaxed);
        StorageCell { inner: std::sync::RwLock::new(s), bytes }
    }
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, Storage> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }
    pub fn write(&self) -> std::sync::RwLockWriteGuard<'_, Storage> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for StorageCell {
    fn drop(&mut self) {
        LIVE_BYTES.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}
