//! Device buffers behind `ferrolm_tensor::DeviceStorage`.
use crate::pool::DevBuf;
use ferrolm_tensor::{bail, DType, Device, DeviceStorage, Result, Storage};
use std::any::Any;

#[derive(Debug)]
pub struct CudaStorage {
    pub(crate) buf: DevBuf,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
    pub(crate) ordinal: usize,
}

impl CudaStorage {
    /// Raw device address of element 0.
    pub fn device_ptr(&self) -> u64 {
        self.buf.ptr
    }
    /// Device address of element `offset`.
    pub fn ptr_at(&self, offset: usize) -> u64 {
        self.buf.ptr + (offset * self.dtype.size_in_bytes()) as u64
    }
}

impl DeviceStorage for CudaStorage {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

pub(crate) fn cuda<'a>(op: &str, s: &'a Storage) -> Result<&'a CudaStorage> {
    match s {
        Storage::Device(d) => match d.as_any().downcast_ref::<CudaStorage>() {
            Some(c) => Ok(c),
            None => bail!(op, "storage on {} is not CUDA storage", d.device()),
        },
        Storage::Cpu(_) => bail!(op, "CUDA backend got CPU storage"),
    }
}

impl From<CudaStorage> for Storage {
    fn from(s: CudaStorage) -> Storage {
        Storage::Device(Box::new(s))
    }
}
