//! Shape ops that return views of the same storage (reshape, permute, narrow, broadcast) and
//! the copying ones built on them (contiguous, cat, stack, split).
use crate::{bail, Layout, Result, Shape, Tensor};

impl Tensor {
    /// The same elements in `shape`: a view of the same storage when `self` is contiguous or
    /// `shape` is its own (a strided view stays as it is), else a contiguous copy.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.numel() {
            bail!("reshape", "cannot reshape {:?} ({} elements) to {:?} ({} elements)", self.shape(), self.numel(), shape, shape.numel());
        }
        if &shape == self.shape() {
            // Nothing to do, whatever the layout: a strided view stays one (no copy).
            return Ok(self.clone());
        }
        let src = if self.is_contiguous() { self.clone() } else { self.contiguous()? };
        let layout = Layout { strides: shape.contiguous_strides(), shape, offset: src.layout().offset };
        let in_shape = self.shape().clone();
        let out = src.view(layout, None);
        Ok(Tensor::record(out, "reshape", &[self], Box::new(move |g| Ok(vec![Some(g.reshape(in_shape.clone())?)]))))
    }

    /// Reshape with one dimension inferred from the others (like `-1`).
    pub fn flatten(&self, from: usize, to: usize) -> Result<Tensor> {
        if from > to || to >= self.rank() {
            bail!("flatten", "bad dims {from}..={to} for shape {:?}", self.shape());
        }
        let d = self.dims();
        let mut s: Vec<usize> = d[..from].to_vec();
        s.push(d[from..=to].iter().product());
        s.extend_from_slice(&d[to + 1..]);
        self.reshape(s)
    }

    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let r = self.rank();
        let mut seen = vec![false; r];
        if perm.len() != r || perm.iter().any(|&p| p >= r || std::mem::replace(&mut seen[p], true)) {
            bail!("permute", "{perm:?} is not a permutation of the {r} dims of {:?}", self.shape());
        }
        let layout = self.layout().permuted(perm);
        let mut inv = vec![0; r];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        let out = self.view(layout, None);
        Ok(Tensor::record(out, "permute", &[self], Box::new(move |g| Ok(vec![Some(g.permute(&inv)?)]))))
    }

    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        if a >= self.rank() || b >= self.rank() {
            bail!("transpose", "dims ({a}, {b}) out of range for shape {:?}", self.shape());
        }
        let mut p: Vec<usize> = (0..self.rank()).collect();
        p.swap(a, b);
        self.permute(&p)
    }

    /// Swaps the last two dims.
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            bail!("t", "needs at least 2 dims, got {:?}", self.shape());
        }
        self.transpose(self.rank() - 2, self.rank() - 1)
    }

    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        if dim >= self.rank() || start.checked_add(len).is_none_or(|e| e > self.dims()[dim]) {
            bail!("narrow", "range {start}..+{len} of dim {dim} is outside shape {:?}", self.shape());
        }
        let mut l = self.layout().clone();
        l.offset += start * l.strides[dim];
        l.shape.0[dim] = len;
        let full = self.dims()[dim];
        let out = self.view(l, None);
        Ok(Tensor::record(
            out,
            "narrow",
            &[self],
            Box::new(move |g| {
                // The gradient padded back to the full extent with zeros: one zero fill and one
                // copy into the range (not zero pieces and a concatenation of three).
                if len == full {
                    return Ok(vec![Some(g.clone())]);
                }
                let mut shape = g.dims().to_vec();
                shape[dim] = full;
                let padded = Tensor::zeros(shape, g.dtype(), g.device())?;
                padded.narrow(dim, start, len)?.assign(g)?;
                Ok(vec![Some(padded)])
            }),
        ))
    }

    /// Splits `dim` into pieces of the given sizes (views).
    pub fn split(&self, sizes: &[usize], dim: usize) -> Result<Vec<Tensor>> {
        if dim >= self.rank() || sizes.iter().sum::<usize>() != self.dims()[dim] {
            bail!("split", "sizes {sizes:?} do not add up to dim {dim} of {:?}", self.shape());
        }
        let mut at = 0;
        sizes
            .iter()
            .map(|&s| {
                at += s;
                self.narrow(dim, at - s, s)
            })
            .collect()
    }

    /// `n` equal pieces along `dim`.
    pub fn chunk(&self, n: usize, dim: usize) -> Result<Vec<Tensor>> {
        if n == 0 || dim >= self.rank() || !self.dims()[dim].is_multiple_of(n) {
            bail!("chunk", "dim {dim} of {:?} does not split into {n} equal chunks", self.shape());
        }
        self.split(&vec![self.dims()[dim] / n; n], dim)
    }

    pub fn unsqueeze(&self, dim: usize) -> Result<Tensor> {
        if dim > self.rank() {
            bail!("unsqueeze", "dim {dim} out of range for shape {:?}", self.shape());
        }
        let mut s = self.dims().to_vec();
        s.insert(dim, 1);
        self.reshape(s)
    }

    pub fn squeeze(&self, dim: usize) -> Result<Tensor> {
        if dim >= self.rank() || self.dims()[dim] != 1 {
            bail!("squeeze", "dim {dim} of {:?} is not of size 1", self.shape());
        }
        let mut s = self.dims().to_vec();
        s.remove(dim);
        self.reshape(s)
    }

    /// Broadcast view to `shape` (stride 0 on expanded dims); backward sums back.
    pub fn broadcast_as(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        let layout = self.layout().broadcast_to("broadcast_as", &shape)?;
        let in_shape = self.shape().clone();
        let out = self.view(layout, None);
        Ok(Tensor::record(out, "broadcast", &[self], Box::new(move |g| Ok(vec![Some(g.sum_to(&in_shape)?)]))))
    }

    /// Sums a broadcast gradient back down to `shape`.
    pub fn sum_to(&self, shape: &Shape) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let pad = self
            .rank()
            .checked_sub(shape.rank())
            .ok_or_else(|| crate::Error::new("sum_to", format!("{:?} has fewer dims than {:?}", self.shape(), shape)))?;
        let dims: Vec<usize> = (0..self.rank()).filter(|&i| i < pad || (shape.0[i - pad] == 1 && self.dims()[i] != 1)).collect();
        self.sum_keepdim(&dims)?.reshape(shape.clone())
    }

    /// A contiguous copy (or the tensor itself when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let b = self.backend("contiguous")?;
        let st = self.with_storage(|x| b.copy_strided(x))?;
        let out = Tensor::from_storage(st, Layout::contiguous(self.shape().clone()), None);
        Ok(Tensor::record(out, "contiguous", &[self], Box::new(|g| Ok(vec![Some(g.clone())]))))
    }

    pub fn cat(ts: &[Tensor], dim: usize) -> Result<Tensor> {
        let Some(first) = ts.first() else { bail!("cat", "needs at least one tensor") };
        for t in ts {
            if t.rank() != first.rank() || dim >= t.rank() {
                bail!("cat", "dim {dim} invalid for shapes {:?}", ts.iter().map(|t| t.shape().clone()).collect::<Vec<_>>());
            }
            if t.dtype() != first.dtype() || t.device() != first.device() {
                bail!("cat", "mixed dtypes/devices: {} on {} vs {} on {}", first.dtype(), first.device(), t.dtype(), t.device());
            }
            for d in 0..t.rank() {
                if d != dim && t.dims()[d] != first.dims()[d] {
                    bail!("cat", "shapes {:?} and {:?} differ outside dim {dim}", first.shape(), t.shape());
                }
            }
        }
        if ts.len() == 1 {
            return Ok(first.clone());
        }
        let b = first.backend("cat")?;
        let cs: Vec<Tensor> = ts.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
        let guards: Vec<_> = cs.iter().map(|t| t.0.storage.read()).collect::<Result<_>>()?;
        let parts: Vec<_> = guards.iter().zip(&cs).map(|(g, t)| (&**g, t.layout())).collect();
        let st = b.cat(&parts, dim)?;
        drop(guards);
        let mut shape = first.dims().to_vec();
        shape[dim] = ts.iter().map(|t| t.dims()[dim]).sum();
        let sizes: Vec<usize> = ts.iter().map(|t| t.dims()[dim]).collect();
        let out = Tensor::from_storage(st, Layout::contiguous(shape.into()), None);
        let refs: Vec<&Tensor> = ts.iter().collect();
        Ok(Tensor::record(out, "cat", &refs, Box::new(move |g| Ok(g.split(&sizes, dim)?.into_iter().map(Some).collect()))))
    }

    pub fn stack(ts: &[Tensor], dim: usize) -> Result<Tensor> {
        let us: Vec<Tensor> = ts.iter().map(|t| t.unsqueeze(dim)).collect::<Result<_>>()?;
        Tensor::cat(&us, dim)
    }
}
