//! What a kernel launcher needs beyond the generated typed launches (`crate::kernels`): device
//! pointers (`DevPtr`), launch shapes (`Launch`), strided view descriptors, and buffers from the
//! pool (outputs, zeroed scratch, contiguous copies, casts). The `Backend` impl (backend.rs), the
//! fused optimizer launchers (optim.rs) and the fused ops' launchers (crates/ops, one module per
//! op) are written with these.
use crate::consts;
use crate::device::{CudaBackend, Exec};
use crate::kernels::{self, Strided};
use crate::storage::{cuda, CudaStorage};
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, DType, Error, Layout, Result};
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

impl Strided {
    /// The descriptor of a view, with size-1 dims dropped and dims that are contiguous with each
    /// other merged.
    pub fn from_layout(op: &str, l: &Layout) -> Result<Strided> {
        Self::from_parts(op, l.dims(), &l.strides, l.offset, l.is_contiguous())
    }
    /// A dense run of `n` elements starting at element 0.
    pub fn dense(n: usize) -> Strided {
        let mut s = Strided { contiguous: 1, rank: 1, ..Default::default() };
        s.shape[0] = n as i64;
        s.stride[0] = 1;
        s
    }
    /// The descriptor of `dims` / `strides` at `offset`; `contiguous` says the view is dense,
    /// which gives rank 1, stride 1 (the kernels index that without a division).
    pub fn from_parts(op: &str, dims: &[usize], strides: &[usize], offset: usize, contiguous: bool) -> Result<Strided> {
        if contiguous {
            return Ok(Strided { offset: offset as i64, ..Self::dense(dims.iter().product()) });
        }
        let mut s = Strided { offset: offset as i64, ..Default::default() };
        let mut d: Vec<(i64, i64)> = Vec::new();
        for (&n, &st) in dims.iter().zip(strides) {
            if n == 1 {
                continue;
            }
            match d.last_mut() {
                Some(last) if last.1 == st as i64 * n as i64 => {
                    last.0 *= n as i64;
                    last.1 = st as i64;
                }
                _ => d.push((n as i64, st as i64)),
            }
        }
        if d.len() > consts::FERRO_MAX_RANK {
            bail!(op, "view of rank {} cannot be collapsed to rank {} for CUDA: make it contiguous first", d.len(), consts::FERRO_MAX_RANK);
        }
        s.rank = d.len() as i32;
        for (i, (n, st)) in d.into_iter().enumerate() {
            s.shape[i] = n;
            s.stride[i] = st;
        }
        if s.rank == 0 || (s.rank == 1 && s.stride[0] == 1) {
            s.contiguous = 1;
        }
        Ok(s)
    }
    /// True when the elements are a dense run from `offset`.
    pub fn is_dense(&self) -> bool {
        self.contiguous == 1
    }
    /// The same view in units of `k` elements, when its innermost dim is a dense run of a
    /// multiple of `k` and every other stride and the offset are multiples of `k` (so each unit
    /// is k adjacent elements, aligned like the base).
    pub(crate) fn widen(&self, k: i64) -> Option<Strided> {
        let r = self.rank as usize;
        if r == 0 || k <= 1 || self.stride[r - 1] != 1 || self.shape[r - 1] % k != 0 || self.offset % k != 0 {
            return None;
        }
        if (0..r - 1).any(|d| self.stride[d] % k != 0) {
            return None;
        }
        let mut v = *self;
        v.shape[r - 1] /= k;
        for d in 0..r - 1 {
            v.stride[d] /= k;
        }
        v.offset /= k;
        Some(v)
    }
    /// (batch, rows, cols, batch stride, col stride) when the view, in row-major order, is a
    /// (batched) transposed matrix: rows at stride 1, cols at a stride > 1 (`transpose_*`).
    fn transposed(&self) -> Option<(i64, i64, i64, i64, i64)> {
        let r = self.rank as usize;
        match r {
            2 if self.stride[0] == 1 => Some((1, self.shape[0], self.shape[1], 0, self.stride[1])),
            3 if self.stride[1] == 1 => Some((self.shape[0], self.shape[1], self.shape[2], self.stride[0], self.stride[2])),
            _ => None,
        }
    }
}

/// The launches of one reduction (`CudaBackend::plan_reduce`): the main kernel (`reduce_rows_*`
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

impl CudaBackend {
    /// The launch of a dense element-wise / cast / fill kernel over `n` elements: vectors of
    /// 16 bytes (`16 / elem_bytes` elements) when `vector`, one element per item otherwise.
    pub fn plan_elementwise(&self, n: usize, elem_bytes: usize, vector: bool) -> Launch {
        let items = if vector { n.div_ceil(16 / elem_bytes) } else { n };
        waves(items, consts::EW_BLOCK as u32, self.sm_count()).elems(n)
    }
    /// The launches of a reduction of `nout` outputs over `nred` elements each. `rows_contig`:
    /// the reduced elements of an output are a dense run (stride 1), read best by a block.
    pub fn plan_reduce(&self, nout: usize, nred: usize, rows_contig: bool) -> ReducePlan {
        let target = self.sm_count() as usize * consts::RED_WAVES;
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
            let finish = (chunks > 1).then(|| waves(nout, block, self.sm_count()).elems(nout * chunks));
            ReducePlan { rows, splits: chunks, chunk, main, finish }
        }
    }
    /// `n` zeroed elements of pooled device memory (scratch that kernels accumulate into).
    pub fn alloc_zeroed(&self, n: usize, dtype: DType) -> Result<CudaStorage> {
        let s = self.alloc(n, dtype)?;
        self.memset0(&s.buf, n * dtype.size_in_bytes())?;
        Ok(s)
    }
    /// Element `index` of an i32 storage, read back to the host (synchronises the stream): a
    /// kernel's flag or count.
    pub fn read_i32(&self, s: &CudaStorage, index: usize) -> Result<i32> {
        if s.dtype != DType::I32 {
            bail!("read_i32", "expected i32 storage, got {}", s.dtype);
        }
        Ok(self.download::<i32>(&s.buf, index * 4, 1)?[0])
    }
    /// Copies `n` elements from element `src_at` of `src` to element `dst_at` of `dst` (same
    /// dtype) with a device-to-device memcpy on the compute stream.
    pub fn copy_elements(&self, src: &CudaStorage, src_at: usize, dst: &CudaStorage, dst_at: usize, n: usize) -> Result<()> {
        let op = "copy";
        if src.dtype != dst.dtype || src_at + n > src.len || dst_at + n > dst.len {
            bail!(op, "cannot copy {n} {} elements from {src_at} of {} to {dst_at} of {} {}", src.dtype, src.len, dst.len, dst.dtype);
        }
        let bytes = n * src.dtype.size_in_bytes();
        if bytes == 0 {
            return Ok(());
        }
        let (s, d) = (src.ptr_at(src_at), dst.ptr_at(dst_at));
        let shape = crate::profile::LaunchShape { grid: (1, 1, 1), block: 0, elems: 0 };
        match &self.exec {
            Exec::Gpu(g) => {
                self.bind()?;
                let timer = self.profile_start()?;
                // SAFETY: both ranges lie inside their buffers (checked above), which stay alive
                // until the stream has run the copy (pool blocks are reused in stream order).
                unsafe { cudarc::driver::result::memcpy_dtod_async(d, s, bytes, g.stream.cu_stream()) }
                    .map_err(|e| Error::new(op, format!("{e:?}")))?;
                self.profile_end(timer, "memcpy_dtod", shape)
            }
            Exec::Emu(_) => {
                self.profile_end(None, "memcpy_dtod", shape)?;
                self.emu_enqueue(
                    op,
                    Box::new(move || {
                        // SAFETY: emulated device pointers are host addresses of live pool blocks; both
                        // ranges lie inside their buffers (checked above), alive in stream order.
                        unsafe { std::ptr::copy(s as usize as *const u8, d as usize as *mut u8, bytes) };
                        Ok(())
                    }),
                )
            }
        }
    }
    /// A dense copy of the view `x` (always a new buffer).
    pub fn contiguous(&self, op: &str, x: View) -> Result<CudaStorage> {
        let s = cuda(op, x.0)?;
        let n = x.1.numel();
        let out = self.alloc(n, s.dtype)?;
        self.strided_copy(op, s, Strided::from_layout(op, x.1)?, &out, Strided::dense(n), n)?;
        Ok(out)
    }
    /// `dst[view ld] = src[view ls]` over `n` elements: a memcpy when both are dense, the tiled
    /// transpose for a (batched) transposed source into a dense destination, else the strided
    /// copy kernel.
    pub(crate) fn strided_copy(&self, op: &str, src: &CudaStorage, ls: Strided, dst: &CudaStorage, ld: Strided, n: usize) -> Result<()> {
        let w = src.dtype.size_in_bytes();
        if w != 4 && w != 2 {
            bail!(op, "{} is not supported on CUDA", src.dtype);
        }
        if n == 0 {
            return Ok(());
        }
        if ls.is_dense() && ld.is_dense() {
            return self.copy_elements(src, ls.offset as usize, dst, ld.offset as usize, n);
        }
        if let (Some((b, r, c, sb, sc)), true) = (ls.transposed(), ld.is_dense()) {
            let even = [r, c, ls.offset, sb, sc, ld.offset].iter().all(|v| v % 2 == 0);
            if w == 2 && even && src.ptr().0.is_multiple_of(4) && dst.ptr().0.is_multiple_of(4) {
                let blocks = (b as usize) * (r as usize).div_ceil(64) * (c as usize).div_ceil(64);
                let cfg = Launch::new((blocks.clamp(1, 65535 * 16) as u32, 1, 1), 256).elems(n);
                // SAFETY: as below, with every pair (r, r + 1) and (c, c + 1) inside the views:
                // rows, cols, the offsets and strides are even and the bases 4-byte aligned.
                return unsafe {
                    kernels::transpose_pairs_b16(self, cfg, src.ptr(), dst.at(ld.offset as usize), b, r, c, ls.offset, sb, sc)
                };
            }
            let blocks = (b as usize) * (r as usize).div_ceil(consts::TP_TILE) * (c as usize).div_ceil(consts::TP_TILE);
            let cfg = Launch::new((blocks.clamp(1, 65535 * 16) as u32, 1, 1), (consts::TP_TILE * consts::TP_ROWS) as u32).elems(n);
            let t = if w == 4 { kernels::transpose_b32 } else { kernels::transpose_b16 };
            // SAFETY: the source view addresses (b, r, c) elements at off + b*sb + r + c*sc inside
            // src's buffer; dst holds b*r*c = n elements from ld.offset.
            return unsafe { t(self, cfg, src.ptr(), dst.at(ld.offset as usize), b, r, c, ls.offset, sb, sc) };
        }
        // Innermost runs of whole 16-byte vectors on both sides: copy 16 bytes an index.
        let k = 16 / w as i64;
        if let (Some(vs), Some(vd), true) = (ls.widen(k), ld.widen(k), aligned(src.ptr()) && aligned(dst.ptr())) {
            let nv = n / k as usize;
            let cfg = waves(nv, Launch::BLOCK, self.sm_count()).elems(n);
            // SAFETY: vs and vd address the same bytes as ls and ld, in 16-byte units (widen
            // divides every stride, the inner extent and the offset exactly), and both bases
            // are 16-byte aligned.
            return unsafe { kernels::strided_copy_b128(self, cfg, src.ptr(), vs, dst.ptr(), vd, nv as i64) };
        }
        let copy = if w == 4 { kernels::strided_copy_b32 } else { kernels::strided_copy_b16 };
        let cfg = waves(n, Launch::BLOCK, self.sm_count());
        // SAFETY: both descriptors address `n` elements inside their buffers (callers build them
        // from views of those buffers), of the element width the kernel copies.
        unsafe { copy(self, cfg, src.ptr(), ls, dst.ptr(), ld, n as i64) }
    }
    /// A dense copy of the view `x` converted to `dtype` (a plain copy when it already is).
    pub fn to_dtype(&self, x: View, dtype: DType) -> Result<CudaStorage> {
        let s = cuda("cast", x.0)?;
        if s.dtype == dtype {
            return self.contiguous("cast", x);
        }
        let out = self.alloc(x.1.numel(), dtype)?;
        self.cast_into(x, &out, 0)?;
        Ok(out)
    }
    /// Writes the view `x` converted to `dst`'s dtype densely into `dst` from element `at`: one
    /// launch (the vector kernel when both ends are dense and 16-byte aligned).
    pub fn cast_into(&self, x: View, dst: &CudaStorage, at: usize) -> Result<()> {
        let s = cuda("cast", x.0)?;
        let (n, dtype) = (x.1.numel(), dst.dtype);
        if at.checked_add(n).is_none_or(|e| e > dst.len) {
            bail!("cast", "{n} elements from {at} do not fit a destination of {}", dst.len);
        }
        let lx = Strided::from_layout("cast", x.1)?;
        let (src, out) = (s.at(lx.offset as usize), dst.at(at));
        if lx.is_dense() && aligned(src) && aligned(out) {
            type Cast = unsafe fn(&CudaBackend, Launch, DevPtr, DevPtr, i64) -> Result<()>;
            let dense: Option<Cast> = match (s.dtype, dtype) {
                (DType::F32, DType::BF16) => Some(kernels::cast_contig_f32_bf16),
                (DType::BF16, DType::F32) => Some(kernels::cast_contig_bf16_f32),
                _ => None,
            };
            if let Some(k) = dense {
                // Eight elements a vector step (two f32 vectors, one bf16 vector).
                let cfg = waves(n.div_ceil(8), consts::EW_BLOCK as u32, self.sm_count()).elems(n);
                // SAFETY: src addresses the view's n dense elements and `out` n elements of the
                // destination dtype (bounds checked above), both 16-byte aligned (checked).
                return unsafe { k(self, cfg, src, out, n as i64) };
            }
        }
        let convert = match (s.dtype, dtype) {
            (DType::F32, DType::BF16) => kernels::cast_f32_bf16,
            (DType::BF16, DType::F32) => kernels::cast_bf16_f32,
            (DType::F32, DType::I32) => kernels::cast_f32_i32,
            (DType::BF16, DType::I32) => kernels::cast_bf16_i32,
            (DType::I32, DType::BF16) => kernels::cast_i32_bf16,
            (DType::I32, DType::F32) => kernels::cast_i32_f32,
            (a, b) => bail!("cast", "cast {a} -> {b} is not supported on CUDA"),
        };
        // SAFETY: the descriptor addresses the view's n elements of the source dtype inside its
        // buffer; `out` has room for n elements of the destination dtype (checked above).
        unsafe { convert(self, waves(n, Launch::BLOCK, self.sm_count()), s.ptr(), lx, out, n as i64) }
    }
}
