//! `Backend` for CUDA: memory, casts and the primitive ops (element-wise, reductions, GEMM
//! through cuBLASLt, concatenation, strided copies) enqueued on the compute stream, each
//! returning fresh contiguous pooled storage; only `to_cpu` synchronises. Plus the hooks of the
//! fused optimizer kernels (optim.rs). The fused ops (RMSNorm, attention, ...) are not here:
//! each lives in its own module of crates/ops with its CPU reference.
use crate::consts;
use crate::device::CudaBackend;
use crate::gemm::{GemmOut, Operand};
use crate::kernels::{self, Strided};
use crate::launch::{aligned, DevPtr};
use crate::optim::{AdamPart, AdamWParams, NormPart};
use crate::storage::{cuda, CudaStorage};
use ferrolm_tensor::backend::{AdamWHyper, AdamWSlot, Backend, BinaryOp, ReduceOp, UnaryOp, View};
use ferrolm_tensor::{bail, bf16, CpuStorage, DType, Device, Layout, Result, Shape, Storage};
use std::any::Any;
use std::sync::Arc;

impl CudaBackend {
    /// Describes a (.., r, c) view as a GEMM operand with one batch stride, if it can be.
    fn operand(x: View, s: &CudaStorage, batch_dims: &[usize]) -> Option<Operand> {
        let l = x.1;
        let r = l.dims().len();
        let (rows, cols) = (l.dims()[r - 2], l.dims()[r - 1]);
        let (rs, cs) = (l.strides[r - 2], l.strides[r - 1]);
        let (trans, ld) = if (cs == 1 || cols == 1) && (rows == 1 || rs >= cols) {
            (false, rs.max(cols))
        } else if (rs == 1 || rows == 1) && (cols == 1 || cs >= rows) {
            (true, cs.max(rows))
        } else {
            return None;
        };
        // batch dims must collapse to a single stride (0 = broadcast)
        let mut bstride: Option<usize> = None;
        let mut expect_next: Option<usize> = None;
        for i in (0..batch_dims.len()).rev() {
            let (d, st) = (batch_dims[i], l.strides[i]);
            if d == 1 {
                continue;
            }
            match (bstride, expect_next) {
                (None, _) => {
                    bstride = Some(st);
                    expect_next = Some(st * d);
                }
                (Some(b0), Some(e)) => {
                    if b0 == 0 && st == 0 {
                        continue;
                    }
                    if st != e {
                        return None;
                    }
                    expect_next = Some(st * d);
                }
                _ => return None,
            }
        }
        Some(Operand {
            ptr: s.ptr_at(l.offset),
            avail: s.len.saturating_sub(l.offset),
            trans,
            ld: ld.max(1) as i64,
            batch_stride: bstride.unwrap_or(0) as i64,
        })
    }

    /// `x`, (batch..., rows, cols), as a GEMM operand: read in place where its strides allow
    /// (`operand`), else from a dense copy that `keep` holds until the GEMM is enqueued.
    fn operand_or_copy(
        &self,
        x: View,
        s: &CudaStorage,
        batch_dims: &[usize],
        (rows, cols): (usize, usize),
        keep: &mut Option<CudaStorage>,
    ) -> Result<Operand> {
        if let Some(o) = Self::operand(x, s, batch_dims) {
            return Ok(o);
        }
        let c = keep.insert(self.contiguous("matmul", x)?);
        Ok(Operand { ptr: c.buf.ptr, avail: c.len, trans: false, ld: cols as i64, batch_stride: (rows * cols) as i64 })
    }
}

impl CudaBackend {
    /// `out = a · b`, or with `accumulate` `out += a · b` (cuBLASLt's beta 1 with C = D, in
    /// place), for a (m, k) and b (k, n) of one dtype (f32 or bf16) in any layout a GEMM operand
    /// takes (a transposed view costs nothing), accumulated in f32 and rounded once into `out`,
    /// a dense (m, n) view of their dtype or f32 at any offset. `out` is written through its
    /// device pointer, so the caller needs only hold its storage (a read guard, as for every
    /// kernel output written by pointer). The fused ops use it for GEMMs into buffers they own:
    /// a chunk's rows of a larger output, an f32 gradient accumulated over chunks.
    pub fn gemm_into(&self, a: View, b: View, out: View, accumulate: bool) -> Result<()> {
        let op = "gemm_into";
        let (sa, sb, so) = (cuda(op, a.0)?, cuda(op, b.0)?, cuda(op, out.0)?);
        let (da, db) = (a.1.dims(), b.1.dims());
        if da.len() != 2 || db.len() != 2 || da[1] != db[0] || sa.dtype != sb.dtype {
            bail!(op, "expects (m, k) and (k, n) of one dtype, got {da:?} {} and {db:?} {}", sa.dtype, sb.dtype);
        }
        let (m, k, n) = (da[0], da[1], db[1]);
        if out.1.dims() != [m, n] || !out.1.is_contiguous() || !(so.dtype == sa.dtype || so.dtype == DType::F32) {
            bail!(op, "the output must be a dense ({m}, {n}) view of {} or f32, got {:?} {}", sa.dtype, out.1.dims(), so.dtype);
        }
        if k == 0 {
            bail!(op, "a product over an empty inner dimension ({m}, 0) x (0, {n})");
        }
        if m * n == 0 {
            return Ok(());
        }
        let mut keep = (None, None);
        let oa = self.operand_or_copy(a, sa, &[], (m, k), &mut keep.0)?;
        let ob = self.operand_or_copy(b, sb, &[], (k, n), &mut keep.1)?;
        let d = (so.ptr_at(out.1.offset), so.len.saturating_sub(out.1.offset));
        match self.gemm(sa.dtype, oa, ob, m, n, k, 1, GemmOut { d, dtype: so.dtype, acc: accumulate.then_some(d), alpha: 1.0 }) {
            Ok(()) => Ok(()),
            // cuBLASLt has no algorithm for this form here (nothing was enqueued): the product
            // into a buffer of its own, then added (or copied) into `out`.
            Err(e) if crate::gemm::refused_by_cublaslt(&e) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| eprintln!("warning: {e}; composing such GEMMs from a plain one and an add instead"));
                let p = self.alloc(m * n, so.dtype)?;
                self.gemm(sa.dtype, oa, ob, m, n, k, 1, GemmOut { d: (p.buf.ptr, p.len), dtype: so.dtype, acc: None, alpha: 1.0 })?;
                let dense = Layout::contiguous(Shape(vec![m, n]));
                let p: Storage = p.into();
                let sum = if accumulate { Some(self.binary(BinaryOp::Add, out, (&p, &dense))?) } else { None };
                let src = cuda(op, sum.as_ref().unwrap_or(&p))?;
                self.copy_elements(src, 0, so, out.1.offset, m * n)
            }
            Err(e) => Err(e),
        }
    }
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
    fn from_cpu(&self, s: &CpuStorage) -> Result<Storage> {
        let out = match s {
            CpuStorage::F32(v) => self.upload(v, DType::F32)?,
            CpuStorage::BF16(v) => self.upload(v, DType::BF16)?,
            CpuStorage::I32(v) => self.upload(v, DType::I32)?,
            CpuStorage::F64(_) => bail!("from_cpu", "f64 tensors are not supported on CUDA (cast to f32 or bf16 first)"),
        };
        Ok(out.into())
    }
    fn to_cpu(&self, x: View) -> Result<CpuStorage> {
        let s = cuda("to_cpu", x.0)?;
        let n = x.1.numel();
        let tmp;
        let (buf, off) = if x.1.is_contiguous() {
            (&s.buf, x.1.offset * s.dtype.size_in_bytes())
        } else {
            tmp = self.contiguous("to_cpu", x)?;
            (&tmp.buf, 0)
        };
        Ok(match s.dtype {
            DType::F32 => CpuStorage::F32(self.download::<f32>(buf, off, n)?),
            DType::BF16 => CpuStorage::BF16(self.download::<u16>(buf, off, n)?.into_iter().map(bf16::from_bits).collect()),
            DType::I32 => CpuStorage::I32(self.download::<i32>(buf, off, n)?),
            DType::F64 => bail!("to_cpu", "f64 is not supported on CUDA"),
        })
    }
    fn full(&self, n: usize, dtype: DType, v: f64) -> Result<Storage> {
        let out = self.alloc(n, dtype)?;
        let cfg = self.plan_elementwise(n, dtype.size_in_bytes(), true);
        let (y, len) = (out.ptr(), n as i64);
        // SAFETY: `out` holds n elements of the width each fill writes, from a 16-byte aligned
        // pool block (the fills store 16-byte vectors).
        unsafe {
            match dtype {
                DType::BF16 => kernels::fill_b16(self, cfg, y, len, ferrolm_tensor::bf16_from_f64(v).to_bits())?,
                DType::F32 => kernels::fill_b32(self, cfg, y, len, (v as f32).to_bits())?,
                DType::I32 => kernels::fill_b32(self, cfg, y, len, (v as i32) as u32)?,
                DType::F64 => unreachable!("alloc rejects f64"),
            }
        }
        Ok(out.into())
    }
    fn copy_strided(&self, x: View) -> Result<Storage> {
        Ok(self.contiguous("copy_strided", x)?.into())
    }
    fn cast(&self, x: View, dtype: DType) -> Result<Storage> {
        Ok(self.to_dtype(x, dtype)?.into())
    }
    fn unary(&self, op: UnaryOp, x: View) -> Result<Storage> {
        let s = cuda("unary", x.0)?;
        let (code, a, b) = match op {
            UnaryOp::Neg => (consts::U_NEG, 0.0, 0.0),
            UnaryOp::Exp => (consts::U_EXP, 0.0, 0.0),
            UnaryOp::Log => (consts::U_LOG, 0.0, 0.0),
            UnaryOp::Sqrt => (consts::U_SQRT, 0.0, 0.0),
            UnaryOp::Rsqrt => (consts::U_RSQRT, 0.0, 0.0),
            UnaryOp::Recip => (consts::U_RECIP, 0.0, 0.0),
            UnaryOp::Sqr => (consts::U_SQR, 0.0, 0.0),
            UnaryOp::Silu => (consts::U_SILU, 0.0, 0.0),
            UnaryOp::SiluGrad => (consts::U_SILU_GRAD, 0.0, 0.0),
            UnaryOp::Powf(p) => (consts::U_POWF, p as f32, 0.0),
            UnaryOp::Affine { mul, add } => (consts::U_AFFINE, mul as f32, add as f32),
        };
        let n = x.1.numel();
        let out = self.alloc(n, s.dtype)?;
        let lx = Strided::from_layout("unary", x.1)?;
        let src = s.at(lx.offset as usize);
        if lx.is_dense() && aligned(src) {
            let cfg = self.plan_elementwise(n, s.dtype.size_in_bytes(), true);
            // SAFETY: src addresses the view's n dense elements, 16-byte aligned (checked); `out`
            // holds n elements in an aligned pool block.
            unsafe { kernels::unary_contig(self, s.dtype, cfg, src, out.ptr(), n as i64, code, a, b)? };
            return Ok(out.into());
        }
        let cfg = self.plan_elementwise(n, s.dtype.size_in_bytes(), false);
        // SAFETY: lx addresses the view's n elements inside x's buffer; `out` holds n elements.
        unsafe { kernels::unary(self, s.dtype, cfg, s.ptr(), lx, out.ptr(), n as i64, code, a, b)? };
        Ok(out.into())
    }
    fn binary(&self, op: BinaryOp, a: View, b: View) -> Result<Storage> {
        let (sa, sb) = (cuda("binary", a.0)?, cuda("binary", b.0)?);
        let code = match op {
            BinaryOp::Add => consts::B_ADD,
            BinaryOp::Sub => consts::B_SUB,
            BinaryOp::Mul => consts::B_MUL,
            BinaryOp::Div => consts::B_DIV,
            BinaryOp::Eq => consts::B_EQ,
        };
        let n = a.1.numel();
        let out = self.alloc(n, sa.dtype)?;
        let (la, lb) = (Strided::from_layout("binary", a.1)?, Strided::from_layout("binary", b.1)?);
        let (pa, pb) = (sa.at(la.offset as usize), sb.at(lb.offset as usize));
        let vcfg = self.plan_elementwise(n, sa.dtype.size_in_bytes(), true);
        if la.is_dense() && lb.is_dense() && aligned(pa) && aligned(pb) {
            // SAFETY: pa and pb address n dense, 16-byte aligned elements of one dtype; `out`
            // holds n elements in an aligned pool block.
            unsafe { kernels::binary_contig(self, sa.dtype, vcfg, pa, pb, out.ptr(), n as i64, code)? };
            return Ok(out.into());
        }
        // One dense operand against a broadcast scalar or row vector.
        let bcast = |dense: &Strided, pd: DevPtr, other: &Strided| -> Option<i64> {
            let row = match other.rank {
                0 => Some(1),
                1 if other.stride[0] == 0 => Some(1),
                2 if other.stride[0] == 0 && other.stride[1] == 1 => Some(other.shape[1]),
                _ => None,
            };
            row.filter(|_| dense.is_dense() && aligned(pd))
        };
        let row = bcast(&la, pa, &lb).map(|c| (pa, pb, c, 0)).or_else(|| bcast(&lb, pb, &la).map(|c| (pb, pa, c, 1)));
        if let Some((dense, rowp, cols, row_first)) = row {
            // SAFETY: `dense` addresses n dense, aligned elements; `rowp` the `cols` elements of
            // the broadcast operand (a row repeated every `cols` elements, or a scalar); `out`
            // holds n elements in an aligned pool block.
            unsafe { kernels::binary_row(self, sa.dtype, vcfg, dense, rowp, out.ptr(), n as i64, cols, code, row_first)? };
            return Ok(out.into());
        }
        let cfg = self.plan_elementwise(n, sa.dtype.size_in_bytes(), false);
        // SAFETY: la and lb address the two views' n elements inside their buffers (the op layer
        // gives both one dtype); `out` holds n elements.
        unsafe { kernels::binary(self, sa.dtype, cfg, sa.ptr(), la, sb.ptr(), lb, out.ptr(), n as i64, code)? };
        Ok(out.into())
    }
    fn reduce(&self, op: ReduceOp, x: View, dims: &[usize]) -> Result<Storage> {
        let s = cuda("reduce", x.0)?;
        let l = x.1;
        let (mut kd, mut ks, mut rd, mut rs) = (vec![], vec![], vec![], vec![]);
        for i in 0..l.dims().len() {
            if dims.contains(&i) {
                rd.push(l.dims()[i]);
                rs.push(l.strides[i]);
            } else {
                kd.push(l.dims()[i]);
                ks.push(l.strides[i]);
            }
        }
        let (nout, nred): (usize, usize) = (kd.iter().product(), rd.iter().product());
        let kept = Strided::from_parts("reduce", &kd, &ks, l.offset, false)?;
        let red = Strided::from_parts("reduce", &rd, &rs, 0, false)?;
        let out = self.alloc(nout, s.dtype)?;
        if nout == 0 {
            return Ok(out.into());
        }
        let is_max = (op == ReduceOp::Max) as i32;
        let plan = self.plan_reduce(nout, nred, red.is_dense());
        let (splits, chunk) = (plan.splits as i32, plan.chunk as i64);
        // f64 partials, as pairs of f32 storage elements (the pool has no f64 dtype).
        let part = match plan.finish {
            Some(_) => Some(self.alloc(2 * nout * plan.splits, DType::F32)?),
            None => None,
        };
        let pp = part.as_ref().map_or(DevPtr::NULL, |p| p.ptr());
        let main = if plan.rows { kernels::reduce_rows } else { kernels::reduce_cols };
        // SAFETY: kept and red together address the view's nout * nred elements inside x's
        // buffer; `part` holds nout * splits doubles when there are several splits; `out` holds
        // nout elements.
        unsafe { main(self, s.dtype, plan.main, s.ptr(), kept, red, pp, out.ptr(), nout as i64, nred as i64, chunk, splits, is_max)? };
        if let Some(cfg) = plan.finish {
            // SAFETY: `part` holds the nout * splits partials written above; `out` nout elements.
            unsafe { kernels::reduce_finish(self, s.dtype, cfg, pp, out.ptr(), nout as i64, splits, (!plan.rows) as i32, is_max)? };
        }
        Ok(out.into())
    }
    fn matmul(&self, a: View, b: View) -> Result<Storage> {
        let (sa, sb) = (cuda("matmul", a.0)?, cuda("matmul", b.0)?);
        let r = a.1.dims().len();
        if r < 2 || b.1.dims().len() != r {
            bail!("matmul", "expected equal ranks >= 2, got {:?} and {:?}", a.1.dims(), b.1.dims());
        }
        let (m, k, n) = (a.1.dims()[r - 2], a.1.dims()[r - 1], b.1.dims()[r - 1]);
        let bdims = &a.1.dims()[..r - 2];
        let batch: usize = bdims.iter().product();
        let out = self.alloc(batch * m * n, sa.dtype)?;
        if m * n * batch == 0 {
            return Ok(out.into());
        }
        if k == 0 {
            return self.full(batch * m * n, sa.dtype, 0.0);
        }
        let mut keep = (None, None);
        let oa = self.operand_or_copy(a, sa, bdims, (m, k), &mut keep.0)?;
        let ob = self.operand_or_copy(b, sb, bdims, (k, n), &mut keep.1)?;
        self.gemm(sa.dtype, oa, ob, m, n, k, batch, GemmOut::plain(sa.dtype, (out.buf.ptr, out.len)))?;
        Ok(out.into())
    }
    fn matmul_into(&self, a: View, b: View, alpha: f64, acc: Option<View>, out: &mut Storage, ol: &Layout) -> Result<bool> {
        let (sa, sb, so) = (cuda("matmul", a.0)?, cuda("matmul", b.0)?, cuda("matmul", out)?);
        let dense = |l: &Layout, m: usize, n: usize| l.dims() == [m, n] && l.is_contiguous();
        if a.1.dims().len() != 2 || b.1.dims().len() != 2 || sa.dtype != sb.dtype {
            return Ok(false);
        }
        let (m, k, n) = (a.1.dims()[0], a.1.dims()[1], b.1.dims()[1]);
        let out_ok = so.dtype == sa.dtype || (so.dtype == DType::F32 && sa.dtype == DType::BF16);
        if b.1.dims()[0] != k || !dense(ol, m, n) || !out_ok || m * n == 0 || k == 0 {
            return Ok(false);
        }
        let acc = match acc {
            Some((st, l)) => {
                let c = cuda("matmul", st)?;
                if c.dtype != so.dtype || !dense(l, m, n) || c.buf.ptr == so.buf.ptr {
                    return Ok(false);
                }
                Some((c.ptr_at(l.offset), c.len.saturating_sub(l.offset)))
            }
            None => None,
        };
        let mut keep = (None, None);
        let oa = self.operand_or_copy(a, sa, &[], (m, k), &mut keep.0)?;
        let ob = self.operand_or_copy(b, sb, &[], (k, n), &mut keep.1)?;
        let d = (so.ptr_at(ol.offset), so.len.saturating_sub(ol.offset));
        match self.gemm(sa.dtype, oa, ob, m, n, k, 1, GemmOut { d, dtype: so.dtype, acc, alpha: alpha as f32 }) {
            Ok(()) => Ok(true),
            // cuBLASLt has no algorithm for this combination here, or refused the call (before
            // anything was enqueued): the caller composes it from a plain GEMM, an add and a cast.
            // Counted (`profile::gemm_fallbacks`, in profile.json): on a GPU it is a slowdown.
            Err(e) if crate::gemm::refused_by_cublaslt(&e) => {
                crate::instrument::profile::note_gemm_fallback();
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| eprintln!("warning: {e}; composing such GEMMs from a plain one, an add and a cast instead"));
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
    fn empty(&self, n: usize, dtype: DType) -> Result<Storage> {
        Ok(self.alloc(n, dtype)?.into())
    }
    fn cat(&self, parts: &[View], dim: usize) -> Result<Storage> {
        let first = parts.first().ok_or_else(|| ferrolm_tensor::Error::new("cat", "nothing to concatenate"))?;
        let dt = cuda("cat", first.0)?.dtype;
        let mut shape = first.1.dims().to_vec();
        shape[dim] = parts.iter().map(|p| p.1.dims()[dim]).sum();
        let total: usize = shape.iter().product();
        let out = self.alloc(total, dt)?;
        let strides = Shape(shape.clone()).contiguous_strides();
        let mut at = 0;
        for p in parts {
            let s = cuda("cat", p.0)?;
            if s.dtype != dt {
                bail!("cat", "dtype mismatch: {} and {}", dt, s.dtype);
            }
            let n = p.1.numel();
            let dst = Strided::from_parts("cat", p.1.dims(), &strides, at * strides[dim], false)?;
            self.strided_copy("cat", s, Strided::from_layout("cat", p.1)?, &out, dst, n)?;
            at += p.1.dims()[dim];
        }
        Ok(out.into())
    }
    fn assign(&self, dst: &mut Storage, dl: &Layout, src: View) -> Result<()> {
        let s = cuda("assign", src.0)?;
        let d = cuda("assign", dst)?;
        if s.dtype != d.dtype {
            bail!("assign", "dtype mismatch: destination {} source {}", d.dtype, s.dtype);
        }
        let dstl = Strided::from_layout("assign", dl)?;
        self.strided_copy("assign", s, Strided::from_layout("assign", src.1)?, d, dstl, dl.numel())
    }

    fn assign_cast(&self, dst: &mut Storage, dl: &Layout, src: View) -> Result<bool> {
        let d = cuda("assign", dst)?;
        if !dl.is_contiguous() || d.dtype == DType::I32 || cuda("assign", src.0)?.dtype == DType::I32 {
            return Ok(false);
        }
        self.cast_into(src, d, dl.offset)?;
        Ok(true)
    }

    fn adamw_step(&self, slots: &[AdamWSlot], h: AdamWHyper, grad_scale: f64) -> Result<bool> {
        let op = "adamw_step";
        // Each slot is a contiguous range (a segment of a bucket, at any offset).
        let n = |s: &AdamWSlot| s.param.1.numel();
        fn at(op: &str, x: View, n: usize) -> Result<Option<(u64, DType)>> {
            let c = cuda(op, x.0)?;
            let fits = x.1.is_contiguous() && x.1.numel() == n && x.1.offset.checked_add(n).is_some_and(|e| e <= c.len);
            Ok(fits.then(|| (c.ptr_at(x.1.offset), c.dtype)))
        }
        let mut parts = Vec::with_capacity(slots.len());
        for s in slots {
            let len = n(s);
            let (Some(p), Some(g), Some(m), Some(v)) = (at(op, s.param, len)?, at(op, s.grad, len)?, at(op, s.m, len)?, at(op, s.v, len)?)
            else {
                return Ok(false);
            };
            let (master, param_bf16) = match s.master {
                Some(ms) => match at(op, ms, len)? {
                    Some(ms) if p.1 == DType::BF16 => (ms, Some(p)),
                    _ => return Ok(false),
                },
                None if p.1 == DType::F32 => (p, None),
                None => return Ok(false),
            };
            parts.push(AdamPart { master, grad: g, m, v, param_bf16, n: len, weight_decay: s.weight_decay as f32 });
        }
        let step = u32::try_from(h.step).map_err(|_| ferrolm_tensor::Error::new(op, "step count overflows u32"))?;
        let p = AdamWParams { lr: h.lr as f32, beta1: h.beta1, beta2: h.beta2, eps: h.eps as f32, step };
        self.adamw_parts(&parts, p, None, grad_scale as f32)?;
        Ok(true)
    }
    fn global_norm(&self, xs: &[View]) -> Result<Option<f64>> {
        let mut gs = Vec::with_capacity(xs.len());
        for x in xs {
            let c = cuda("global_norm", x.0)?;
            if !(x.1.is_contiguous() && x.1.offset == 0 && c.len == x.1.numel()) {
                return Ok(None);
            }
            gs.push(c);
        }
        let out = self.grad_norm(&gs, 0.0)?;
        let v: Vec<f32> = self.download(&out.buf, 0, 1)?;
        Ok(Some(v[0] as f64))
    }
    fn sum_squares(&self, xs: &[View], weights: &[Option<View>], scale: f64) -> Result<Option<f64>> {
        let mut parts = Vec::with_capacity(xs.len());
        for (x, w) in xs.iter().zip(weights) {
            let weight = match w {
                Some(w) => Some((cuda("sum_squares", w.0)?, w.1.offset)),
                None => None,
            };
            parts.push(NormPart { grad: cuda("sum_squares", x.0)?, offset: x.1.offset, len: x.1.numel(), weight });
        }
        // sum((s x)^2 w) = s^2 sum(x^2 w): the scale is applied once, in f64.
        let (_, sq) = self.grad_norm_weighted(&parts, 0.0)?;
        Ok(Some(scale * scale * self.read_f64(&sq)?))
    }
}
