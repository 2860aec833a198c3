//! What a kernel launch is made of, with no backend in it: device pointers (`DevPtr`), launch
//! shapes (`Launch`) and the geometry that sizes them for a device (`waves`, `ReducePlan`), the
//! type-erased kernel arguments the generated launchers pass (`Arg`), and the dtype errors of the
//! float kernels. The execution layer (`crate::exec`) runs what these describe; the typed
//! launchers (`crate::kernels`), the backend's copies and casts (`crate::copy`), the `Backend`
//! impl (backend.rs), the fused optimizer launchers (optim.rs) and the fused ops' launchers
//! (crates/ops, one module per op) are written with these.
use crate::consts;
use crate::storage::CudaStorage;
use ferrolm_tensor::{DType, Error, Result};
use std::ffi::c_void;

/// A device address passed to a kernel's pointer parameter. On the emulated device it is a host
/// address. Made from a storage (`CudaStorage::ptr`, `CudaStorage::at`), never from a number, so
/// a count cannot be passed where a kernel expects a pointer.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevPtr(pub(crate) u64);

impl DevPtr {
    /// The null pointer, for the optional pointer parameters the kernels test against 0.
    pub const NULL: DevPtr = DevPtr(0);
    /// The raw address.
    pub fn addr(self) -> u64 {
        self.0
    }
}

impl CudaStorage {
    /// Element 0 as a kernel argument.
    pub fn ptr(&self) -> DevPtr {
        DevPtr(self.buf.ptr)
    }
    /// Element `offset` as a kernel argument.
    pub fn at(&self, offset: usize) -> DevPtr {
        DevPtr(self.ptr_at(offset))
    }
}

/// Grid, block size and dynamic shared memory (bytes) of one kernel launch. A grid with a zero
/// dimension launches nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
    /// Elements the launch touches, as its launcher declares them (0: not said), for the
    /// profile's check that a large launch fills the device (`profile::BIG_LAUNCH_ELEMS`).
    pub elems: u64,
}

impl Launch {
    /// The block size of the element-wise and one-block-per-row launches (the kernels take any
    /// multiple of 32 up to 1024).
    pub const BLOCK: u32 = 256;
    /// `grid` blocks of `block` threads, no dynamic shared memory.
    pub fn new(grid: (u32, u32, u32), block: u32) -> Launch {
        Launch { grid, block, smem: 0, elems: 0 }
    }
    /// Enough blocks of `block` threads for a grid-stride loop over `n` elements (capped; the
    /// kernels loop over the rest).
    pub fn cover(n: usize, block: u32) -> Launch {
        let g = n.div_ceil(block as usize).clamp(1, 65535 * 16);
        Launch::new((g as u32, 1, 1), block).elems(n)
    }
    /// One block of `block` threads per row (grid-stride past 2^20 rows).
    pub fn per_row(rows: usize, block: u32) -> Launch {
        Launch::new((rows.clamp(1, 1 << 20) as u32, 1, 1), block)
    }
    /// A single block (the one-block reductions).
    pub fn single(block: u32) -> Launch {
        Launch::new((1, 1, 1), block)
    }
    /// The same launch with `bytes` of dynamic shared memory.
    pub fn smem(self, bytes: usize) -> Launch {
        Launch { smem: bytes as u32, ..self }
    }
    /// The same launch, declared to touch `n` elements (see `elems`).
    pub fn elems(self, n: usize) -> Launch {
        Launch { elems: n as u64, ..self }
    }
}

/// A kernel argument: the address and size of a value of the parameter's type (generated
/// launchers). The emulator copies the bytes, since its launch runs after the launcher returned.
#[derive(Clone, Copy)]
pub(crate) struct Arg {
    pub(crate) ptr: *mut c_void,
    pub(crate) size: usize,
}

pub(crate) fn arg<T: Copy>(v: &T) -> Arg {
    Arg { ptr: v as *const T as *mut c_void, size: std::mem::size_of::<T>() }
}

/// The error for a dtype the kernels have no variant of.
pub fn unsupported(op: &str, dt: DType) -> Error {
    Error::new(op, format!("{dt} is not supported by the CUDA kernels (use f32 or bf16)"))
}

/// Ok for the dtypes the float kernels take (f32, bf16).
pub fn check_kernel_dtype(op: &str, dt: DType) -> Result<()> {
    match dt {
        DType::F32 | DType::BF16 => Ok(()),
        d => Err(unsupported(op, d)),
    }
}

/// The launches of one reduction (`ReducePlan::new`, `CudaBackend::plan_reduce`): the main kernel (`reduce_rows_*`
/// when `rows`, else `reduce_cols_*`) over `splits` pieces of `chunk` reduced elements per
/// output, and with more than one split, `finish` (`reduce_finish_*`) over the partials.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReducePlan {
    pub rows: bool,
    pub splits: usize,
    pub chunk: usize,
    pub main: Launch,
    pub finish: Option<Launch>,
}

/// Blocks of a grid-stride launch of `items` work items, `block` threads each, capped at
/// `EW_WAVES` blocks per SM (the kernels loop over the rest).
pub(crate) fn waves(items: usize, block: u32, sm: u32) -> Launch {
    let cap = (sm as usize * consts::EW_WAVES).max(1);
    Launch::new((items.div_ceil(block as usize).clamp(1, cap) as u32, 1, 1), block).elems(items)
}

/// Whether `p` (a device address) is 16-byte aligned: the vector paths need it.
pub(crate) fn aligned(p: DevPtr) -> bool {
    p.0.is_multiple_of(16)
}

impl ReducePlan {
    /// The launches of a reduction of `nout` outputs over `nred` elements each on a device of
    /// `sm` SMs. `rows_contig`: the reduced elements of an output are a dense run (stride 1),
    /// read best by a block.
    pub fn new(sm: u32, nout: usize, nred: usize, rows_contig: bool) -> ReducePlan {
        let target = sm as usize * consts::RED_WAVES;
        let block = consts::RED_BLOCK as u32;
        let rows = (rows_contig && nred >= consts::RED_ROW_MIN) || nout < 32;
        if rows {
            let splits = target.div_ceil(nout.max(1)).min(nred.div_ceil(consts::RED_ROW_CHUNK)).max(1);
            // Whole 16-byte vectors per split, so every split of an aligned row reads aligned.
            let chunk = nred.div_ceil(splits).max(1).next_multiple_of(8);
            let splits = nred.div_ceil(chunk).max(1);
            let main = Launch::new(((nout * splits).clamp(1, 1 << 20) as u32, 1, 1), block).elems(nout * nred);
            let finish = (splits > 1).then(|| Launch::new((nout.clamp(1, 1 << 20) as u32, 1, 1), block).elems(nout * splits));
            ReducePlan { rows, splits, chunk, main, finish }
        } else {
            let tiles = nout.div_ceil(block as usize).max(1);
            let chunks = target.div_ceil(tiles).min(nred.div_ceil(consts::RED_COL_CHUNK)).max(1);
            let chunk = nred.div_ceil(chunks).max(1);
            let chunks = nred.div_ceil(chunk).max(1);
            let main = Launch::new(((tiles * chunks).clamp(1, 1 << 20) as u32, 1, 1), block).elems(nout * nred);
            let finish = (chunks > 1).then(|| waves(nout, block, sm).elems(nout * chunks));
            ReducePlan { rows, splits: chunks, chunk, main, finish }
        }
    }
}

/// The launch of a dense element-wise / cast / fill kernel over `n` elements on a device of
/// `sm` SMs: vectors of 16 bytes (`16 / elem_bytes` elements) when `vector`, one element per
/// item otherwise.
pub(crate) fn elementwise(sm: u32, n: usize, elem_bytes: usize, vector: bool) -> Launch {
    let items = if vector { n.div_ceil(16 / elem_bytes) } else { n };
    waves(items, consts::EW_BLOCK as u32, sm).elems(n)
}
