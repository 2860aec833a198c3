//! The backend's copies and casts on the device, written once for both executions: dense and
//! strided copies, the tiled transpose, dtype casts, zeroed scratch and launch plans sized for
//! the device. Built from the typed launchers (`crate::kernels`) and the execution's
//! device-to-device copy.
use crate::consts;
use crate::device::CudaBackend;
use crate::kernels::{self, Strided};
use crate::launch::{aligned, elementwise, waves, DevPtr, Launch, ReducePlan};
use crate::storage::{cuda, CudaStorage};
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, DType, Result};

impl CudaBackend {
    /// The launch of a dense element-wise / cast / fill kernel over `n` elements: vectors of
    /// 16 bytes (`16 / elem_bytes` elements) when `vector`, one element per item otherwise.
    pub fn plan_elementwise(&self, n: usize, elem_bytes: usize, vector: bool) -> Launch {
        elementwise(self.sm_count(), n, elem_bytes, vector)
    }
    /// The launches of a reduction of `nout` outputs over `nred` elements each. `rows_contig`:
    /// the reduced elements of an output are a dense run (stride 1), read best by a block.
    pub fn plan_reduce(&self, nout: usize, nred: usize, rows_contig: bool) -> ReducePlan {
        ReducePlan::new(self.sm_count(), nout, nred, rows_contig)
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
        // SAFETY: both ranges lie inside their buffers (checked above), which stay alive until
        // the stream has run the copy (pool blocks are reused in stream order).
        unsafe { self.exec.copy_dtod(op, dst.ptr_at(dst_at), src.ptr_at(src_at), bytes) }
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
