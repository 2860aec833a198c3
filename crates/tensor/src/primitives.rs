//! Differentiable math ops. Each checks its inputs (naming the op in any error), runs the
//! backend, and records its derivative rule, written in terms of other ops.
use crate::backend::{BinaryOp, ReduceOp, UnaryOp};
use crate::{bail, DType, Device, Layout, Result, Shape, Storage, Tensor};

/// Ok when every tensor is on the device of the first; an error naming `op` otherwise.
pub fn same_device(op: &str, ts: &[&Tensor]) -> Result<()> {
    let d = ts[0].device();
    if let Some(t) = ts.iter().find(|t| t.device() != d) {
        bail!(op, "tensors on different devices: {} and {} (move them with to_device first)", d, t.device());
    }
    Ok(())
}

/// Ok when the tensors share one device and one float dtype; an error naming `op` otherwise.
pub fn same_float(op: &str, ts: &[&Tensor]) -> Result<()> {
    same_device(op, ts)?;
    let dt = ts[0].dtype();
    if !dt.is_float() {
        bail!(op, "expects float tensors, got {dt}");
    }
    if let Some(t) = ts.iter().find(|t| t.dtype() != dt) {
        bail!(op, "dtype mismatch: {} and {} (cast with to_dtype first)", dt, t.dtype());
    }
    Ok(())
}

fn new(st: Storage, shape: Shape) -> Tensor {
    Tensor::from_storage(st, Layout::contiguous(shape), None)
}

impl Tensor {
    // ---- element-wise ------------------------------------------------------------------------

    fn unary(&self, op: UnaryOp, name: &'static str) -> Result<Tensor> {
        same_float(name, &[self])?;
        let b = self.backend(name)?;
        let st = self.with_storage(|x| b.unary(op, x))?;
        Ok(new(st, self.shape().clone()))
    }

    pub fn neg(&self) -> Result<Tensor> {
        let out = self.unary(UnaryOp::Neg, "neg")?;
        Ok(Tensor::record(out, "neg", &[self], Box::new(|g| Ok(vec![Some(g.neg()?)]))))
    }
    pub fn exp(&self) -> Result<Tensor> {
        let out = self.unary(UnaryOp::Exp, "exp")?;
        let y = out.clone();
        Ok(Tensor::record(out, "exp", &[self], Box::new(move |g| Ok(vec![Some(g.mul(&y)?)]))))
    }
    pub fn log(&self) -> Result<Tensor> {
        let out = self.unary(UnaryOp::Log, "log")?;
        let x = self.clone();
        Ok(Tensor::record(out, "log", &[self], Box::new(move |g| Ok(vec![Some(g.div(&x)?)]))))
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        let out = self.unary(UnaryOp::Sqrt, "sqrt")?;
        let y = out.clone();
        Ok(Tensor::record(out, "sqrt", &[self], Box::new(move |g| Ok(vec![Some(g.div(&y)?.mul_scalar(0.5)?)]))))
    }
    pub fn rsqrt(&self) -> Result<Tensor> {
        let out = self.unary(UnaryOp::Rsqrt, "rsqrt")?;
        let x = self.clone();
        // d x^-1/2 = -1/2 x^-3/2
        Ok(Tensor::record(out, "rsqrt", &[self], Box::new(move |g| Ok(vec![Some(g.mul(&x.powf(-1.5)?)?.mul_scalar(-0.5)?)]))))
    }
    pub fn recip(&self) -> Result<Tensor> {
        let out = self.unary(UnaryOp::Recip, "recip")?;
        let y = out.clone();
        Ok(Tensor::record(out, "recip", &[self], Box::new(move |g| Ok(vec![Some(g.mul(&y.sqr()?)?.neg()?)]))))
    }
    pub fn sqr(&self) -> Result<Tensor> {
        let out = self.unary(UnaryOp::Sqr, "sqr")?;
        let x = self.clone();
        Ok(Tensor::record(out, "sqr", &[self], Box::new(move |g| Ok(vec![Some(g.mul(&x)?.mul_scalar(2.0)?)]))))
    }
    pub fn powf(&self, p: f64) -> Result<Tensor> {
        let out = self.unary(UnaryOp::Powf(p), "powf")?;
        let x = self.clone();
        Ok(Tensor::record(out, "powf", &[self], Box::new(move |g| Ok(vec![Some(g.mul(&x.powf(p - 1.0)?)?.mul_scalar(p)?)]))))
    }
    pub fn silu(&self) -> Result<Tensor> {
        let out = self.unary(UnaryOp::Silu, "silu")?;
        let x = self.clone();
        Ok(Tensor::record(out, "silu", &[self], Box::new(move |g| Ok(vec![Some(g.mul(&x.unary(UnaryOp::SiluGrad, "silu")?)?)]))))
    }
    /// x * mul + add
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        let out = self.unary(UnaryOp::Affine { mul, add }, "affine")?;
        Ok(Tensor::record(out, "affine", &[self], Box::new(move |g| Ok(vec![Some(g.mul_scalar(mul)?)]))))
    }
    pub fn mul_scalar(&self, s: f64) -> Result<Tensor> {
        self.affine(s, 0.0)
    }
    pub fn add_scalar(&self, s: f64) -> Result<Tensor> {
        self.affine(1.0, s)
    }

    fn binary(&self, rhs: &Tensor, op: BinaryOp, name: &'static str) -> Result<(Tensor, Shape)> {
        same_float(name, &[self, rhs])?;
        let shape = Shape::broadcast(name, self.shape(), rhs.shape())?;
        let la = self.layout().broadcast_to(name, &shape)?;
        let lb = rhs.layout().broadcast_to(name, &shape)?;
        let b = self.backend(name)?;
        let st = {
            let (ga, gb) = (self.0.storage.read()?, rhs.0.storage.read()?);
            b.binary(op, (&ga, &la), (&gb, &lb))?
        };
        Ok((new(st, shape.clone()), shape))
    }

    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        let (out, _) = self.binary(rhs, BinaryOp::Add, "add")?;
        let (sa, sb) = (self.shape().clone(), rhs.shape().clone());
        Ok(Tensor::record(out, "add", &[self, rhs], Box::new(move |g| Ok(vec![Some(g.sum_to(&sa)?), Some(g.sum_to(&sb)?)]))))
    }
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        let (out, _) = self.binary(rhs, BinaryOp::Sub, "sub")?;
        let (sa, sb) = (self.shape().clone(), rhs.shape().clone());
        Ok(Tensor::record(out, "sub", &[self, rhs], Box::new(move |g| Ok(vec![Some(g.sum_to(&sa)?), Some(g.neg()?.sum_to(&sb)?)]))))
    }
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        let (out, _) = self.binary(rhs, BinaryOp::Mul, "mul")?;
        let (a, b) = (self.clone(), rhs.clone());
        Ok(Tensor::record(
            out,
            "mul",
            &[self, rhs],
            Box::new(move |g| {
                let ga = if a.requires_grad() { Some(g.mul(&b)?.sum_to(a.shape())?) } else { None };
                let gb = if b.requires_grad() { Some(g.mul(&a)?.sum_to(b.shape())?) } else { None };
                Ok(vec![ga, gb])
            }),
        ))
    }
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        let (out, _) = self.binary(rhs, BinaryOp::Div, "div")?;
        let (a, b) = (self.clone(), rhs.clone());
        Ok(Tensor::record(
            out,
            "div",
            &[self, rhs],
            Box::new(move |g| {
                let ga = if a.requires_grad() { Some(g.div(&b)?.sum_to(a.shape())?) } else { None };
                // d(a/b)/db = -a / b^2
                let gb = if b.requires_grad() { Some(g.mul(&a)?.div(&b.sqr()?)?.neg()?.sum_to(b.shape())?) } else { None };
                Ok(vec![ga, gb])
            }),
        ))
    }
    /// 1.0 where equal, else 0.0 (no gradient).
    pub fn eq_mask(&self, rhs: &Tensor) -> Result<Tensor> {
        Ok(self.binary(rhs, BinaryOp::Eq, "eq")?.0)
    }

    // ---- reductions --------------------------------------------------------------------------

    fn check_dims(&self, op: &str, dims: &[usize]) -> Result<()> {
        if let Some(d) = dims.iter().find(|&&d| d >= self.rank()) {
            bail!(op, "dim {d} out of range for shape {:?}", self.shape());
        }
        if let Some((i, d)) = dims.iter().enumerate().find(|(i, d)| dims[..*i].contains(d)) {
            bail!(op, "dim {d} is repeated in {dims:?} (position {i})");
        }
        Ok(())
    }
    fn reduce(&self, op: ReduceOp, dims: &[usize], name: &'static str) -> Result<Tensor> {
        same_float(name, &[self])?;
        self.check_dims(name, dims)?;
        let b = self.backend(name)?;
        let st = self.with_storage(|x| b.reduce(op, x, dims))?;
        let shape: Vec<usize> = self.dims().iter().enumerate().map(|(i, &d)| if dims.contains(&i) { 1 } else { d }).collect();
        Ok(new(st, shape.into()))
    }
    fn drop_dims(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        if keepdim {
            return Ok(self.clone());
        }
        let s: Vec<usize> = self.dims().iter().enumerate().filter(|(i, _)| !dims.contains(i)).map(|(_, &d)| d).collect();
        self.reshape(s)
    }

    pub fn sum_keepdim(&self, dims: &[usize]) -> Result<Tensor> {
        let out = self.reduce(ReduceOp::Sum, dims, "sum")?;
        let shape = self.shape().clone();
        Ok(Tensor::record(out, "sum", &[self], Box::new(move |g| Ok(vec![Some(g.broadcast_as(shape.clone())?.contiguous()?)]))))
    }
    pub fn sum(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        self.sum_keepdim(dims)?.drop_dims(dims, keepdim)
    }
    pub fn mean(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        self.check_dims("mean", dims)?;
        let n: usize = dims.iter().map(|&d| self.dims()[d]).product();
        self.sum(dims, keepdim)?.mul_scalar(1.0 / n.max(1) as f64)
    }
    /// Max over `dims`; the gradient is split evenly between tied maxima.
    pub fn max(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        let out = self.reduce(ReduceOp::Max, dims, "max")?;
        let (x, m) = (self.clone(), out.clone());
        let dv = dims.to_vec();
        let out = Tensor::record(
            out,
            "max",
            &[self],
            Box::new(move |g| {
                let mask = x.eq_mask(&m.broadcast_as(x.shape().clone())?)?;
                let count = mask.sum_keepdim(&dv)?;
                Ok(vec![Some(mask.mul(&g.div(&count)?)?)])
            }),
        );
        out.drop_dims(dims, keepdim)
    }
    pub fn sum_all(&self) -> Result<Tensor> {
        let dims: Vec<usize> = (0..self.rank()).collect();
        self.sum(&dims, false)
    }
    pub fn mean_all(&self) -> Result<Tensor> {
        let dims: Vec<usize> = (0..self.rank()).collect();
        self.mean(&dims, false)
    }

    // ---- matmul ------------------------------------------------------------------------------

    /// (..., m, k) @ (..., k, n) with broadcast batch dims; a 1-D rhs or lhs is not promoted.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        same_float("matmul", &[self, rhs])?;
        let (ra, rb) = (self.rank(), rhs.rank());
        if ra < 2 || rb < 2 {
            bail!("matmul", "operands need at least 2 dims, got {:?} and {:?}", self.shape(), rhs.shape());
        }
        let (m, k) = (self.dims()[ra - 2], self.dims()[ra - 1]);
        let (k2, n) = (rhs.dims()[rb - 2], rhs.dims()[rb - 1]);
        if k != k2 {
            bail!("matmul", "inner dims differ: lhs {:?} rhs {:?}", self.shape(), rhs.shape());
        }
        let batch = Shape::broadcast("matmul", &Shape(self.dims()[..ra - 2].to_vec()), &Shape(rhs.dims()[..rb - 2].to_vec()))?;
        let mut sa = batch.0.clone();
        sa.extend([m, k]);
        let mut sb = batch.0.clone();
        sb.extend([k, n]);
        let la = self.layout().broadcast_to("matmul", &sa.into())?;
        let lb = rhs.layout().broadcast_to("matmul", &sb.into())?;
        let b = self.backend("matmul")?;
        let st = {
            let (ga, gb) = (self.0.storage.read()?, rhs.0.storage.read()?);
            b.matmul((&ga, &la), (&gb, &lb))?
        };
        let mut so = batch.0;
        so.extend([m, n]);
        let out = new(st, so.into());
        let (a, bt) = (self.clone(), rhs.clone());
        Ok(Tensor::record(
            out,
            "matmul",
            &[self, rhs],
            Box::new(move |g| {
                // An operand that is a transposed view of a dense matrix (a linear layer's `w.t()`)
                // gets its gradient computed the other way round, (B G^T)^T for A and (G^T A)^T
                // for B: the same sums, but its transpose back to the operand's own order is
                // dense, so no transposed copy of every weight gradient is made.
                let ga = match a.requires_grad() {
                    false => None,
                    true if transposed_unbroadcast(&a, g) => Some(bt.matmul(&g.t()?)?.t()?),
                    true => Some(g.matmul(&bt.t()?)?.sum_to(a.shape())?),
                };
                let gb = match bt.requires_grad() {
                    false => None,
                    true if transposed_unbroadcast(&bt, g) => Some(g.t()?.matmul(&a)?.t()?),
                    true => Some(a.t()?.matmul(g)?.sum_to(bt.shape())?),
                };
                Ok(vec![ga, gb])
            }),
        ))
    }

    /// `self · rhs (+ acc)` for 2-D operands (m, k) · (k, n), written into `dest` when given (a
    /// dense (m, n) tensor of self's dtype or f32, such as a parameter's slice of an f32
    /// gradient bucket) and returned; else into a new tensor of self's dtype. `acc` is (m, n) of
    /// the output's dtype. A device backend does it in one GEMM (the product accumulated in f32,
    /// the addend added and the result rounded once); elsewhere it is composed from `matmul`,
    /// `add` (in the order acc + product) and `assign`. Not recorded for autograd: backward
    /// rules use it (`linear`).
    pub fn matmul_into(&self, rhs: &Tensor, acc: Option<&Tensor>, dest: Option<&Tensor>) -> Result<Tensor> {
        self.matmul_into_scaled(rhs, 1.0, acc, dest)
    }

    /// `alpha · self · rhs (+ acc)`, as `matmul_into`: on a device the scale is the GEMM's own
    /// (cuBLASLt's alpha: no kernel of its own, and the product is rounded once); elsewhere the
    /// product is scaled after it is rounded to the output's dtype, then the addend added.
    pub fn matmul_into_scaled(&self, rhs: &Tensor, alpha: f64, acc: Option<&Tensor>, dest: Option<&Tensor>) -> Result<Tensor> {
        same_float("matmul_into", &[self, rhs])?;
        if !alpha.is_finite() {
            bail!("matmul_into", "the product's scale must be finite, got {alpha}");
        }
        if self.rank() != 2 || rhs.rank() != 2 || self.dim(1) != rhs.dim(0) {
            bail!("matmul_into", "expects (m, k) and (k, n), got {:?} and {:?}", self.shape(), rhs.shape());
        }
        let (m, n) = (self.dim(0), rhs.dim(1));
        let out_dtype = dest.map_or(self.dtype(), Tensor::dtype);
        if let Some(d) = dest {
            same_device("matmul_into", &[self, d])?;
            if d.dims() != [m, n] || !d.is_contiguous() || !(d.dtype() == self.dtype() || d.dtype() == DType::F32) {
                bail!(
                    "matmul_into",
                    "the destination must be a dense ({m}, {n}) tensor of {} or f32, got {:?} {}",
                    self.dtype(),
                    d.shape(),
                    d.dtype()
                );
            }
        }
        if let Some(a) = acc {
            same_device("matmul_into", &[self, a])?;
            if a.dims() != [m, n] || a.dtype() != out_dtype {
                bail!("matmul_into", "the addend must be ({m}, {n}) of {out_dtype}, got {:?} {}", a.shape(), a.dtype());
            }
        }
        let _g = crate::autograd::no_grad();
        let aliased = |t: &Tensor| [Some(self), Some(rhs), acc].into_iter().flatten().any(|x| x.shares_storage(t));
        if self.device() != Device::Cpu && acc.is_none_or(Tensor::is_contiguous) {
            let b = self.backend("matmul_into")?;
            let out = match dest {
                Some(d) if !aliased(d) => Some(d.clone()),
                Some(_) => None,
                None => Some(new(b.empty(m * n, out_dtype)?, Shape(vec![m, n]))),
            };
            if let Some(out) = out {
                let done = {
                    let (ga, gb) = (self.0.storage.read()?, rhs.0.storage.read()?);
                    let gc = acc.map(|a| a.0.storage.read()).transpose()?;
                    let c = gc.as_ref().zip(acc).map(|(g, a)| (&**g, a.layout()));
                    b.matmul_into((&ga, self.layout()), (&gb, rhs.layout()), alpha, c, &mut *out.0.storage.write()?, out.layout())?
                };
                if done {
                    return Ok(out);
                }
            }
        }
        let p = self.matmul(rhs)?.to_dtype(out_dtype)?;
        let p = if alpha == 1.0 { p } else { p.mul_scalar(alpha)? };
        let p = match acc {
            Some(a) => a.add(&p)?,
            None => p,
        };
        match dest {
            Some(d) => {
                d.assign(&p)?;
                Ok(d.clone())
            }
            None => Ok(p),
        }
    }

    /// y = x W^T over the last dim: x (..., in), w (out, in) -> (..., out), one GEMM over the
    /// (N, in) rows. Its backward asks the engine (`GradCtx`) for what lets it skip kernels:
    /// dX = G W is accumulated onto the gradient x has received so far (the GEMM's addend:
    /// the q, k and v projections read one x, so do gate and up), and dW = G^T X is written
    /// straight into w's gradient destination when it has one (its slice of an f32 bucket: no
    /// bf16 copy and no cast).
    pub fn linear(&self, w: &Tensor) -> Result<Tensor> {
        self.linear_impl(w, None)
    }

    /// res + x W^T (`linear` with the sum in its GEMM: res, of the output's shape and dtype, is
    /// the GEMM's addend, so a residual connection costs no kernel of its own). res gets the
    /// output's gradient as it is. Elsewhere than on a device it is composed as res + (x W^T),
    /// the order of `res.add(&x.linear(w))`.
    pub fn linear_plus(&self, w: &Tensor, res: &Tensor) -> Result<Tensor> {
        self.linear_impl(w, Some(res))
    }

    fn linear_impl(&self, w: &Tensor, res: Option<&Tensor>) -> Result<Tensor> {
        let name = if res.is_some() { "linear_plus" } else { "linear" };
        same_float(name, &[self, w])?;
        let r = self.rank();
        if w.rank() != 2 || r == 0 || self.dim(r - 1) != w.dim(1) {
            bail!(name, "expects x (..., in) and w (out, in), got {:?} and {:?}", self.shape(), w.shape());
        }
        let (cin, cout) = (w.dim(1), w.dim(0));
        let n: usize = self.dims()[..r - 1].iter().product();
        let mut out = self.dims()[..r - 1].to_vec();
        out.push(cout);
        if let Some(res) = res {
            same_float(name, &[self, res])?;
            if res.dims() != out.as_slice() {
                bail!(name, "the residual must have the output's shape {out:?}, got {:?}", res.shape());
            }
        }
        let (x2, y) = {
            let _g = crate::autograd::no_grad();
            let x2 = self.reshape([n, cin])?;
            let acc = res.map(|t| t.reshape([n, cout])).transpose()?;
            let y = x2.matmul_into(&w.t()?, acc.as_ref(), None)?.reshape(out)?;
            (x2, y)
        };
        let (wt, xshape) = (w.clone(), self.shape().clone());
        let (need_x, need_w, need_res) = (self.requires_grad(), w.requires_grad(), res.is_some_and(Tensor::requires_grad));
        let mut inputs = vec![self, w];
        inputs.extend(res);
        Ok(Tensor::record_node(
            y,
            name,
            &inputs,
            crate::autograd::Backward::Ctx(Box::new(move |g, ctx| {
                let g2 = g.reshape([n, cout])?;
                // dX += G W (x's gradient so far is the GEMM's addend); dW = G^T X, in place.
                let gx = match need_x {
                    true => Some(ctx.accumulate_into(0, |acc| {
                        let acc = acc.map(|a| a.reshape([n, cin])).transpose()?;
                        g2.matmul_into(&wt, acc.as_ref(), None)?.reshape(xshape.clone())
                    })?),
                    false => None,
                };
                let gw = match need_w {
                    true => Some(ctx.param_into(1, |dest| g2.t()?.matmul_into(&x2, None, dest))?),
                    false => None,
                };
                let mut grads = vec![gx, gw];
                if need_res {
                    grads.push(Some(g.clone()));
                }
                Ok(grads)
            })),
        ))
    }

    // ---- casts, devices -----------------------------------------------------------------------

    /// Converts the elements; the gradient is cast back to the input's dtype.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let b = self.backend("to_dtype")?;
        let out = new(self.with_storage(|x| b.cast(x, dtype))?, self.shape().clone());
        if !dtype.is_float() {
            return Ok(out);
        }
        let from = self.dtype();
        Ok(Tensor::record(out, "to_dtype", &[self], Box::new(move |g| Ok(vec![Some(g.to_dtype(from)?)]))))
    }

    /// Copies to another device (explicitly; ops never move data on their own).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        let host = self.to_cpu_storage()?;
        let st = crate::backend::get("to_device", device)?.from_cpu(&host)?;
        let out = new(st, self.shape().clone());
        let from = self.device();
        Ok(Tensor::record(out, "to_device", &[self], Box::new(move |g| Ok(vec![Some(g.to_device(from)?)]))))
    }
}

/// True when `x`, a matmul operand, is a transposed view of a dense matrix (its last two dims
/// swapped back are contiguous) with the batch dims of the product `g` (no broadcast to sum).
fn transposed_unbroadcast(x: &Tensor, g: &Tensor) -> bool {
    let r = x.rank();
    let mut swap: Vec<usize> = (0..r).collect();
    swap.swap(r - 2, r - 1);
    !x.is_contiguous() && r == g.rank() && x.dims()[..r - 2] == g.dims()[..r - 2] && x.layout().permuted(&swap).is_contiguous()
}
