//! `Backend` for CUDA: every op enqueues kernels from kernels/ (or cuBLASLt) on the compute
//! stream and returns fresh contiguous pooled storage. Only `to_cpu`, `embedding` and
//! `cross_entropy` synchronise (a host value is returned or ids are validated).
use crate::device::{Args, CudaBackend};
use crate::gemm::Operand;
use crate::launch::{grid1, kname, rows_grid, sfx, Strided};
use crate::launch::{AdamWParams, AdamWTensor};
use crate::storage::{cuda, CudaStorage};
use ferrolm_tensor::backend::{AdamWHyper, AdamWSlot, AttnDims, Backend, BinaryOp, ReduceOp, Sl, UnaryOp};
use ferrolm_tensor::{bail, bf16, CpuStorage, DType, Device, Layout, Result, Shape, Storage};

const B: u32 = 256;

fn rows(l: &Layout) -> (usize, usize) {
    let d = *l.dims().last().unwrap_or(&1);
    (l.numel().checked_div(d).unwrap_or(0), d)
}

impl CudaBackend {
    fn ptr(&self, op: &str, x: Sl) -> Result<u64> {
        Ok(cuda(op, x.0)?.ptr_at(x.1.offset))
    }
    fn strided_copy(&self, op: &str, src: &CudaStorage, ls: Strided, dst: u64, ld: Strided, n: usize) -> Result<()> {
        let k = match src.dtype.size_in_bytes() {
            4 => "strided_copy_b32",
            2 => "strided_copy_b16",
            _ => bail!(op, "{} is not supported on CUDA", src.dtype),
        };
        self.launch(k, grid1(n, B), B, 0, Args::new().push(src.buf.ptr).push(ls).push(dst).push(ld).push(n as i64))
    }
    /// Contiguous copy (always a new buffer).
    fn contiguous(&self, op: &str, x: Sl) -> Result<CudaStorage> {
        let s = cuda(op, x.0)?;
        let n = x.1.numel();
        let out = self.alloc(n, s.dtype)?;
        self.strided_copy(op, s, Strided::from_layout(op, x.1)?, out.buf.ptr, Strided::from_parts(op, &[], &[], 0, true)?, n)?;
        Ok(out)
    }
    fn check_bad_flag(&self, op: &str, flag: &CudaStorage, msg: &str) -> Result<()> {
        let v: Vec<i32> = self.download(&flag.buf, 0, 1)?;
        if v[0] != 0 {
            bail!(op, "{msg}");
        }
        Ok(())
    }
    /// An f32 copy of a contiguous view when it is bf16 (statistics / scales).
    fn f32_ptr(&self, op: &str, x: Sl) -> Result<(u64, Option<CudaStorage>)> {
        let s = cuda(op, x.0)?;
        if s.dtype == DType::F32 {
            return Ok((s.ptr_at(x.1.offset), None));
        }
        let c = self.cast_impl(x, DType::F32)?;
        Ok((c.buf.ptr, Some(c)))
    }
    fn cast_impl(&self, x: Sl, dtype: DType) -> Result<CudaStorage> {
        let s = cuda("cast", x.0)?;
        let n = x.1.numel();
        if s.dtype == dtype {
            return self.contiguous("cast", x);
        }
        let name = match (s.dtype, dtype) {
            (DType::F32, DType::BF16) => "cast_f32_bf16",
            (DType::BF16, DType::F32) => "cast_bf16_f32",
            (DType::F32, DType::I32) => "cast_f32_i32",
            (DType::BF16, DType::I32) => "cast_bf16_i32",
            (DType::I32, DType::BF16) => "cast_i32_bf16",
            (DType::I32, DType::F32) => "cast_i32_f32",
            (a, b) => bail!("cast", "cast {a} -> {b} is not supported on CUDA"),
        };
        let out = self.alloc(n, dtype)?;
        self.launch(
            name,
            grid1(n, B),
            B,
            0,
            Args::new().push(s.buf.ptr).push(Strided::from_layout("cast", x.1)?).push(out.buf.ptr).push(n as i64),
        )?;
        Ok(out)
    }
    /// Describes a (.., r, c) view as a GEMM operand with one batch stride, if it can be.
    fn operand(x: Sl, s: &CudaStorage, batch_dims: &[usize]) -> Option<Operand> {
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
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }
    fn from_cpu(&self, s: &CpuStorage) -> Result<Storage> {
        let out = match s {
            CpuStorage::F32(v) => self.upload(v, DType::F32)?,
            CpuStorage::BF16(v) => self.upload(v, DType::BF16)?,
            CpuStorage::I32(v) => self.upload(v, DType::I32)?,
            CpuStorage::F64(_) => bail!("from_cpu", "f64 tensors are not supported on CUDA (cast to f32 or bf16 first)"),
        };
        Ok(self.wrap(out))
    }
    fn to_cpu(&self, x: Sl) -> Result<CpuStorage> {
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
        match dtype {
            DType::BF16 => self.launch(
                "fill_b16",
                grid1(n, B),
                B,
                0,
                Args::new().push(out.buf.ptr).push(n as i64).push(ferrolm_tensor::bf16_from_f64(v).to_bits()),
            )?,
            DType::F32 => {
                self.launch("fill_b32", grid1(n, B), B, 0, Args::new().push(out.buf.ptr).push(n as i64).push((v as f32).to_bits()))?
            }
            DType::I32 => {
                self.launch("fill_b32", grid1(n, B), B, 0, Args::new().push(out.buf.ptr).push(n as i64).push((v as i32) as u32))?
            }
            DType::F64 => unreachable!("alloc rejects f64"),
        }
        Ok(self.wrap(out))
    }
    fn copy_strided(&self, x: Sl) -> Result<Storage> {
        Ok(self.wrap(self.contiguous("copy_strided", x)?))
    }
    fn cast(&self, x: Sl, dtype: DType) -> Result<Storage> {
        Ok(self.wrap(self.cast_impl(x, dtype)?))
    }
    fn unary(&self, op: UnaryOp, x: Sl) -> Result<Storage> {
        let s = cuda("unary", x.0)?;
        let (code, a, b) = match op {
            UnaryOp::Neg => (0, 0.0, 0.0),
            UnaryOp::Exp => (1, 0.0, 0.0),
            UnaryOp::Log => (2, 0.0, 0.0),
            UnaryOp::Sqrt => (3, 0.0, 0.0),
            UnaryOp::Rsqrt => (4, 0.0, 0.0),
            UnaryOp::Recip => (5, 0.0, 0.0),
            UnaryOp::Sqr => (6, 0.0, 0.0),
            UnaryOp::Silu => (7, 0.0, 0.0),
            UnaryOp::SiluGrad => (8, 0.0, 0.0),
            UnaryOp::Powf(p) => (9, p as f32, 0.0),
            UnaryOp::Affine { mul, add } => (10, mul as f32, add as f32),
        };
        let n = x.1.numel();
        let out = self.alloc(n, s.dtype)?;
        self.launch(
            kname("unary", sfx("unary", s.dtype)?),
            grid1(n, B),
            B,
            0,
            Args::new()
                .push(s.buf.ptr)
                .push(Strided::from_layout("unary", x.1)?)
                .push(out.buf.ptr)
                .push(n as i64)
                .push(code)
                .push(a)
                .push(b),
        )?;
        Ok(self.wrap(out))
    }
    fn binary(&self, op: BinaryOp, a: Sl, b: Sl) -> Result<Storage> {
        let (sa, sb) = (cuda("binary", a.0)?, cuda("binary", b.0)?);
        let code: i32 = match op {
            BinaryOp::Add => 0,
            BinaryOp::Sub => 1,
            BinaryOp::Mul => 2,
            BinaryOp::Div => 3,
            BinaryOp::Eq => 4,
        };
        let n = a.1.numel();
        let out = self.alloc(n, sa.dtype)?;
        self.launch(
            kname("binary", sfx("binary", sa.dtype)?),
            grid1(n, B),
            B,
            0,
            Args::new()
                .push(sa.buf.ptr)
                .push(Strided::from_layout("binary", a.1)?)
                .push(sb.buf.ptr)
                .push(Strided::from_layout("binary", b.1)?)
                .push(out.buf.ptr)
                .push(n as i64)
                .push(code),
        )?;
        Ok(self.wrap(out))
    }
    fn reduce(&self, op: ReduceOp, x: Sl, dims: &[usize]) -> Result<Storage> {
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
        self.launch(
            kname("reduce", sfx("reduce", s.dtype)?),
            (nout.clamp(1, 1 << 20) as u32, 1, 1),
            B,
            0,
            Args::new()
                .push(s.buf.ptr)
                .push(kept)
                .push(red)
                .push(out.buf.ptr)
                .push(nout as i64)
                .push(nred as i64)
                .push((op == ReduceOp::Max) as i32),
        )?;
        Ok(self.wrap(out))
    }
    fn matmul(&self, a: Sl, b: Sl) -> Result<Storage> {
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
            return Ok(self.wrap(out));
        }
        if k == 0 {
            return self.full(batch * m * n, sa.dtype, 0.0);
        }
        let (ta, tb);
        let oa = match Self::operand(a, sa, bdims) {
            Some(o) => o,
            None => {
                ta = self.contiguous("matmul", a)?;
                Operand { ptr: ta.buf.ptr, avail: ta.len, trans: false, ld: k as i64, batch_stride: (m * k) as i64 }
            }
        };
        let ob = match Self::operand(b, sb, bdims) {
            Some(o) => o,
            None => {
                tb = self.contiguous("matmul", b)?;
                Operand { ptr: tb.buf.ptr, avail: tb.len, trans: false, ld: n as i64, batch_stride: (k * n) as i64 }
            }
        };
        self.gemm(sa.dtype, oa, ob, m, n, k, batch, (out.buf.ptr, out.len))?;
        Ok(self.wrap(out))
    }
    fn cat(&self, parts: &[Sl], dim: usize) -> Result<Storage> {
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
            self.strided_copy("cat", s, Strided::from_layout("cat", p.1)?, out.buf.ptr, dst, n)?;
            at += p.1.dims()[dim];
        }
        Ok(self.wrap(out))
    }
    fn assign(&self, dst: &mut Storage, dl: &Layout, src: Sl) -> Result<()> {
        let s = cuda("assign", src.0)?;
        let d = cuda("assign", dst)?;
        if s.dtype != d.dtype {
            bail!("assign", "dtype mismatch: destination {} source {}", d.dtype, s.dtype);
        }
        let dstl = Strided::from_layout("assign", dl)?;
        self.strided_copy("assign", s, Strided::from_layout("assign", src.1)?, d.buf.ptr, dstl, dl.numel())
    }

    fn embedding(&self, w: Sl, ids: Sl) -> Result<Storage> {
        let sw = cuda("embedding", w.0)?;
        let (vocab, d) = (w.1.dims()[0], w.1.dims()[1]);
        let ids_c = self.contiguous("embedding", ids)?;
        let n = ids_c.len;
        let bad = self.alloc(1, DType::I32)?;
        self.memset0(&bad.buf, 4)?;
        self.launch("ids_check", grid1(n, B), B, 0, Args::new().push(ids_c.buf.ptr).push(n as i64).push(vocab as i64).push(bad.buf.ptr))?;
        self.check_bad_flag("embedding", &bad, &format!("a token id is out of range for a vocabulary of {vocab}"))?;
        let out = self.alloc(n * d, sw.dtype)?;
        self.launch(
            kname("embedding_fwd", sfx("embedding", sw.dtype)?),
            rows_grid(n),
            128,
            0,
            Args::new().push(sw.ptr_at(w.1.offset)).push(ids_c.buf.ptr).push(out.buf.ptr).push(n as i64).push(d as i64),
        )?;
        Ok(self.wrap(out))
    }
    fn embedding_backward(&self, dy: Sl, ids: Sl, vocab: usize) -> Result<Storage> {
        let s = cuda("embedding_backward", dy.0)?;
        let d = *dy.1.dims().last().unwrap_or(&1);
        let ids_c = self.contiguous("embedding_backward", ids)?;
        let n = ids_c.len;
        let acc = self.alloc(vocab * d, DType::F32)?;
        self.memset0(&acc.buf, vocab * d * 4)?;
        let grid = (vocab.div_ceil(64).max(1) as u32, d.div_ceil(128).max(1) as u32, 1);
        self.launch(
            kname("embedding_bwd", sfx("embedding_backward", s.dtype)?),
            grid,
            128,
            0,
            Args::new().push(s.ptr_at(dy.1.offset)).push(ids_c.buf.ptr).push(acc.buf.ptr).push(n as i64).push(d as i64).push(vocab as i64),
        )?;
        if s.dtype == DType::F32 {
            return Ok(self.wrap(acc));
        }
        let l = Layout::contiguous(Shape(vec![vocab * d]));
        let accs = self.wrap(acc);
        self.cast((&accs, &l), s.dtype)
    }
    fn softmax_last(&self, x: Sl) -> Result<Storage> {
        let s = cuda("softmax", x.0)?;
        let (n, d) = rows(x.1);
        let out = self.alloc(n * d, s.dtype)?;
        self.launch(
            kname("softmax_fwd", sfx("softmax", s.dtype)?),
            rows_grid(n),
            B,
            0,
            Args::new().push(s.ptr_at(x.1.offset)).push(out.buf.ptr).push(n as i64).push(d as i64),
        )?;
        Ok(self.wrap(out))
    }
    fn softmax_last_backward(&self, y: Sl, dy: Sl) -> Result<Storage> {
        let s = cuda("softmax_backward", y.0)?;
        let (n, d) = rows(y.1);
        let out = self.alloc(n * d, s.dtype)?;
        self.launch(
            kname("softmax_bwd", sfx("softmax_backward", s.dtype)?),
            rows_grid(n),
            B,
            0,
            Args::new().push(s.ptr_at(y.1.offset)).push(self.ptr("softmax_backward", dy)?).push(out.buf.ptr).push(n as i64).push(d as i64),
        )?;
        Ok(self.wrap(out))
    }
    fn rmsnorm(&self, x: Sl, w: Sl, eps: f64) -> Result<(Storage, Storage)> {
        let s = cuda("rmsnorm", x.0)?;
        let (n, d) = rows(x.1);
        let y = self.alloc(n * d, s.dtype)?;
        let r = self.alloc(n, DType::F32)?;
        self.launch(
            kname("rmsnorm_fwd", sfx("rmsnorm", s.dtype)?),
            rows_grid(n),
            B,
            0,
            Args::new()
                .push(s.ptr_at(x.1.offset))
                .push(self.ptr("rmsnorm", w)?)
                .push(y.buf.ptr)
                .push(r.buf.ptr)
                .push(n as i64)
                .push(d as i64)
                .push(eps as f32),
        )?;
        Ok((self.wrap(y), self.wrap(r)))
    }
    fn rmsnorm_backward(&self, dy: Sl, x: Sl, w: Sl, inv_rms: Sl) -> Result<(Storage, Storage)> {
        let op = "rmsnorm_backward";
        let s = cuda(op, x.0)?;
        let sf = sfx(op, s.dtype)?;
        let (n, d) = rows(x.1);
        let (rp, _keep) = self.f32_ptr(op, inv_rms)?;
        let (pdy, px, pw) = (self.ptr(op, dy)?, s.ptr_at(x.1.offset), self.ptr(op, w)?);
        let dx = self.alloc(n * d, s.dtype)?;
        self.launch(
            kname("rmsnorm_bwd_dx", sf),
            rows_grid(n),
            B,
            0,
            Args::new().push(pdy).push(px).push(pw).push(rp).push(dx.buf.ptr).push(n as i64).push(d as i64),
        )?;
        let rpc = 64usize;
        let nchunks = n.div_ceil(rpc).max(1);
        let partial = self.alloc(nchunks * d, DType::F32)?;
        if n == 0 {
            self.memset0(&partial.buf, nchunks * d * 4)?;
        }
        self.launch(
            kname("rmsnorm_bwd_dw_partial", sf),
            (nchunks as u32, d.div_ceil(B as usize).max(1) as u32, 1),
            B,
            0,
            Args::new().push(pdy).push(px).push(rp).push(partial.buf.ptr).push(n as i64).push(d as i64).push(rpc as i64),
        )?;
        let dw = self.alloc(d, s.dtype)?;
        self.launch(
            kname("rmsnorm_bwd_dw_finish", sf),
            grid1(d, B),
            B,
            0,
            Args::new().push(partial.buf.ptr).push(dw.buf.ptr).push(nchunks as i64).push(d as i64),
        )?;
        Ok((self.wrap(dx), self.wrap(dw)))
    }
    fn rope(&self, x: Sl, cos: Sl, sin: Sl, inverse: bool) -> Result<Storage> {
        let s = cuda("rope", x.0)?;
        let dims = x.1.dims();
        let (t, d) = (dims[2], dims[3]);
        let n = x.1.numel();
        let nrows = n.checked_div(d).unwrap_or(0);
        let out = self.alloc(n, s.dtype)?;
        self.launch(
            kname("rope", sfx("rope", s.dtype)?),
            grid1(nrows * d / 2, B),
            B,
            0,
            Args::new()
                .push(s.ptr_at(x.1.offset))
                .push(self.ptr("rope", cos)?)
                .push(self.ptr("rope", sin)?)
                .push(out.buf.ptr)
                .push(nrows as i64)
                .push(t as i64)
                .push(d as i64)
                .push(inverse as i32),
        )?;
        Ok(self.wrap(out))
    }
    fn swiglu(&self, gate: Sl, up: Sl) -> Result<Storage> {
        let s = cuda("swiglu", gate.0)?;
        let n = gate.1.numel();
        let out = self.alloc(n, s.dtype)?;
        self.launch(
            kname("swiglu_fwd", sfx("swiglu", s.dtype)?),
            grid1(n, B),
            B,
            0,
            Args::new().push(s.ptr_at(gate.1.offset)).push(self.ptr("swiglu", up)?).push(out.buf.ptr).push(n as i64),
        )?;
        Ok(self.wrap(out))
    }
    fn swiglu_backward(&self, dy: Sl, gate: Sl, up: Sl) -> Result<(Storage, Storage)> {
        let op = "swiglu_backward";
        let s = cuda(op, gate.0)?;
        let n = gate.1.numel();
        let (dg, du) = (self.alloc(n, s.dtype)?, self.alloc(n, s.dtype)?);
        self.launch(
            kname("swiglu_bwd", sfx(op, s.dtype)?),
            grid1(n, B),
            B,
            0,
            Args::new()
                .push(self.ptr(op, dy)?)
                .push(s.ptr_at(gate.1.offset))
                .push(self.ptr(op, up)?)
                .push(dg.buf.ptr)
                .push(du.buf.ptr)
                .push(n as i64),
        )?;
        Ok((self.wrap(dg), self.wrap(du)))
    }
    fn attention(&self, q: Sl, k: Sl, v: Sl, a: AttnDims, scale: f64) -> Result<(Storage, Storage)> {
        let op = "attention";
        let s = cuda(op, q.0)?;
        let sf = sfx(op, s.dtype)?;
        check_attn(op, a)?;
        let o = self.alloc(a.b * a.hq * a.t * a.d, s.dtype)?;
        let lse = self.alloc(a.b * a.hq * a.t, DType::F32)?;
        let (pq, pk, pv) = (s.ptr_at(q.1.offset), self.ptr(op, k)?, self.ptr(op, v)?);
        let (hq, hkv, t) = (a.hq as i32, a.hkv as i32, a.t as i32);
        if s.dtype == DType::BF16 && (a.d == 64 || a.d == 128) {
            let name = if a.d == 64 { "flash_fwd_bf16_d64" } else { "flash_fwd_bf16_d128" };
            let smem = (2 * 64 * (a.d + 8) * 2) as u32;
            self.launch(
                name,
                (a.t.div_ceil(64) as u32, a.hq as u32, a.b as u32),
                128,
                smem,
                Args::new().push(pq).push(pk).push(pv).push(o.buf.ptr).push(lse.buf.ptr).push(hq).push(hkv).push(t).push(scale as f32),
            )?;
        } else {
            let rows = a.b * a.hq * a.t;
            self.launch(
                kname("attn_fwd_simt", sf),
                grid1(rows * 32, 128),
                128,
                0,
                Args::new()
                    .push(pq)
                    .push(pk)
                    .push(pv)
                    .push(o.buf.ptr)
                    .push(lse.buf.ptr)
                    .push(a.b as i32)
                    .push(hq)
                    .push(hkv)
                    .push(t)
                    .push(a.d as i32)
                    .push(scale as f32),
            )?;
        }
        Ok((self.wrap(o), self.wrap(lse)))
    }
    fn attention_backward(
        &self,
        dout: Sl,
        q: Sl,
        k: Sl,
        v: Sl,
        out: Sl,
        lse: Sl,
        a: AttnDims,
        scale: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let op = "attention_backward";
        let s = cuda(op, q.0)?;
        let sf = sfx(op, s.dtype)?;
        check_attn(op, a)?;
        let (pdo, pq, pk, pv, po) = (self.ptr(op, dout)?, s.ptr_at(q.1.offset), self.ptr(op, k)?, self.ptr(op, v)?, self.ptr(op, out)?);
        let (pl, _keep) = self.f32_ptr(op, lse)?;
        let rows = a.b * a.hq * a.t;
        let dvec = self.alloc(rows, DType::F32)?;
        self.launch(
            kname("attn_bwd_dot", sf),
            grid1(rows * 32, 256),
            256,
            0,
            Args::new().push(pdo).push(po).push(dvec.buf.ptr).push(rows as i64).push(a.d as i32),
        )?;
        let dq = self.alloc(rows * a.d, s.dtype)?;
        let dk = self.alloc(a.b * a.hkv * a.t * a.d, s.dtype)?;
        let dv = self.alloc(a.b * a.hkv * a.t * a.d, s.dtype)?;
        let (hq, hkv, t, sc) = (a.hq as i32, a.hkv as i32, a.t as i32, scale as f32);
        if s.dtype == DType::BF16 && (a.d == 64 || a.d == 128) {
            let d128 = a.d == 128;
            let st = a.d + 8;
            let smem_kv = ((2 * 64 + 2 * 32) * st * 2 + 2 * 32 * 4) as u32;
            self.launch(
                if d128 { "flash_bwd_dkdv_bf16_d128" } else { "flash_bwd_dkdv_bf16_d64" },
                (a.t.div_ceil(64) as u32, a.hkv as u32, a.b as u32),
                128,
                smem_kv,
                Args::new()
                    .push(pq)
                    .push(pk)
                    .push(pv)
                    .push(pdo)
                    .push(pl)
                    .push(dvec.buf.ptr)
                    .push(dk.buf.ptr)
                    .push(dv.buf.ptr)
                    .push(hq)
                    .push(hkv)
                    .push(t)
                    .push(sc),
            )?;
            let smem_q = (2 * 32 * st * 2) as u32;
            self.launch(
                if d128 { "flash_bwd_dq_bf16_d128" } else { "flash_bwd_dq_bf16_d64" },
                (a.t.div_ceil(64) as u32, a.hq as u32, a.b as u32),
                128,
                smem_q,
                Args::new()
                    .push(pq)
                    .push(pk)
                    .push(pv)
                    .push(pdo)
                    .push(pl)
                    .push(dvec.buf.ptr)
                    .push(dq.buf.ptr)
                    .push(hq)
                    .push(hkv)
                    .push(t)
                    .push(sc),
            )?;
        } else {
            let kvrows = a.b * a.hkv * a.t;
            self.launch(
                kname("attn_bwd_dkdv_simt", sf),
                grid1(kvrows * 32, 128),
                128,
                0,
                Args::new()
                    .push(pq)
                    .push(pk)
                    .push(pv)
                    .push(pdo)
                    .push(pl)
                    .push(dvec.buf.ptr)
                    .push(dk.buf.ptr)
                    .push(dv.buf.ptr)
                    .push(a.b as i32)
                    .push(hq)
                    .push(hkv)
                    .push(t)
                    .push(a.d as i32)
                    .push(sc),
            )?;
            self.launch(
                kname("attn_bwd_dq_simt", sf),
                grid1(rows * 32, 128),
                128,
                0,
                Args::new()
                    .push(pq)
                    .push(pk)
                    .push(pv)
                    .push(pdo)
                    .push(pl)
                    .push(dvec.buf.ptr)
                    .push(dq.buf.ptr)
                    .push(a.b as i32)
                    .push(hq)
                    .push(hkv)
                    .push(t)
                    .push(a.d as i32)
                    .push(sc),
            )?;
        }
        Ok((self.wrap(dq), self.wrap(dk), self.wrap(dv)))
    }
    fn cross_entropy(&self, logits: Sl, targets: Sl, ignore_index: i32) -> Result<(Storage, Storage, usize)> {
        let op = "cross_entropy";
        let s = cuda(op, logits.0)?;
        let (n, v) = rows(logits.1);
        let t = self.contiguous(op, targets)?;
        let bad = self.alloc(1, DType::I32)?;
        self.memset0(&bad.buf, 4)?;
        self.launch(
            "targets_check",
            grid1(n, B),
            B,
            0,
            Args::new().push(t.buf.ptr).push(n as i64).push(v as i64).push(ignore_index).push(bad.buf.ptr),
        )?;
        let lse = self.alloc(n, DType::F32)?;
        let rl = self.alloc(n, DType::F32)?;
        self.launch(
            kname("ce_fwd", sfx(op, s.dtype)?),
            rows_grid(n),
            B,
            0,
            Args::new()
                .push(s.ptr_at(logits.1.offset))
                .push(t.buf.ptr)
                .push(lse.buf.ptr)
                .push(rl.buf.ptr)
                .push(n as i64)
                .push(v as i64)
                .push(ignore_index),
        )?;
        let loss = self.alloc(1, DType::F32)?;
        let count = self.alloc(1, DType::I32)?;
        self.launch(
            "ce_finish",
            (1, 1, 1),
            1024,
            0,
            Args::new()
                .push(rl.buf.ptr)
                .push(t.buf.ptr)
                .push(n as i64)
                .push(ignore_index)
                .push(1.0f32)
                .push(loss.buf.ptr)
                .push(count.buf.ptr)
                .push(0u64),
        )?;
        self.check_bad_flag(op, &bad, &format!("a target is out of range for {v} classes (ignore_index is {ignore_index})"))?;
        let c: Vec<i32> = self.download(&count.buf, 0, 1)?;
        Ok((self.wrap(loss), self.wrap(lse), c[0] as usize))
    }
    fn cross_entropy_backward(&self, logits: Sl, targets: Sl, lse: Sl, ignore_index: i32, scale: Sl) -> Result<Storage> {
        let op = "cross_entropy_backward";
        let s = cuda(op, logits.0)?;
        let (n, v) = rows(logits.1);
        let t = self.contiguous(op, targets)?;
        let (pl, _k1) = self.f32_ptr(op, lse)?;
        let (ps, _k2) = self.f32_ptr(op, scale)?;
        let out = self.alloc(n * v, s.dtype)?;
        self.launch(
            kname("ce_bwd", sfx(op, s.dtype)?),
            rows_grid(n),
            B,
            0,
            Args::new()
                .push(s.ptr_at(logits.1.offset))
                .push(t.buf.ptr)
                .push(pl)
                .push(ps)
                .push(out.buf.ptr)
                .push(n as i64)
                .push(v as i64)
                .push(ignore_index),
        )?;
        Ok(self.wrap(out))
    }
    fn adamw_step(&self, slots: &[AdamWSlot], h: AdamWHyper) -> Result<bool> {
        let op = "adamw_step";
        // The launcher addresses whole buffers: every view must start at 0 and cover its storage.
        fn whole<'a>(op: &str, x: Sl<'a>) -> Result<Option<&'a CudaStorage>> {
            let c = cuda(op, x.0)?;
            Ok((x.1.is_contiguous() && x.1.offset == 0 && c.len == x.1.numel()).then_some(c))
        }
        let whole = |x| whole(op, x);
        let mut ts = Vec::with_capacity(slots.len());
        for s in slots {
            let (Some(p), Some(g), Some(m), Some(v)) = (whole(s.param)?, whole(s.grad)?, whole(s.m)?, whole(s.v)?) else {
                return Ok(false);
            };
            let (master, param_bf16) = match s.master {
                Some(ms) => match whole(ms)? {
                    Some(ms) if p.dtype == DType::BF16 => (ms, Some(p)),
                    _ => return Ok(false),
                },
                None if p.dtype == DType::F32 => (p, None),
                None => return Ok(false),
            };
            ts.push(AdamWTensor { master, grad: g, m, v, param_bf16, weight_decay: s.weight_decay as f32 });
        }
        let step = u32::try_from(h.step).map_err(|_| ferrolm_tensor::Error::new(op, "step count overflows u32"))?;
        let p = AdamWParams { lr: h.lr as f32, beta1: h.beta1, beta2: h.beta2, eps: h.eps as f32, step };
        self.adamw_multi(&ts, p, None)?;
        Ok(true)
    }
    fn global_norm(&self, xs: &[Sl]) -> Result<Option<f64>> {
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
}

fn check_attn(op: &str, a: AttnDims) -> Result<()> {
    if a.hkv == 0 || !a.hq.is_multiple_of(a.hkv) {
        bail!(op, "query heads ({}) must be a multiple of kv heads ({})", a.hq, a.hkv);
    }
    if a.d > 256 {
        bail!(op, "head dim {} > 256 is not supported on CUDA", a.d);
    }
    if a.t > i32::MAX as usize {
        bail!(op, "sequence too long");
    }
    Ok(())
}
