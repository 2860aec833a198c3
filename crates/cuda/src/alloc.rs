//! Buffers for the crates above this one (crates/ops' launchers, crates/parallel's NCCL
//! communicator): pooled result buffers, and the CUDA buffer behind a tensor's storage. Collectives run on their
//! own stream (`new_stream`); the caller orders that stream with the compute stream by events
//! (`record_event`, `CudaStream::wait`) both before the collective reads a buffer and before a
//! buffer it wrote is read or dropped, since the pool recycles blocks in compute-stream order.
use crate::device::CudaBackend;
use crate::storage::CudaStorage;
use ferrolm_tensor::{DType, Result, Storage};

impl CudaBackend {
    /// `n` uninitialised elements of pooled device memory (NaN bits under FERROLM_CUDA_POISON):
    /// a kernel's output, or a result that a collective on another stream will write.
    pub fn alloc_storage(&self, n: usize, dtype: DType) -> Result<CudaStorage> {
        self.alloc(n, dtype)
    }
}

impl CudaStorage {
    /// The CUDA buffer inside a tensor's storage; an error naming `op` for any other storage.
    pub fn of<'a>(op: &str, s: &'a Storage) -> Result<&'a CudaStorage> {
        crate::storage::cuda(op, s)
    }
    /// The device this buffer lives on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}
