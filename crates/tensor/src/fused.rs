//! The fused ops the models need, each with its own backward kernel rather than a chain of
//! small ops: embedding, RMSNorm, RoPE, SwiGLU, causal GQA attention, cross-entropy.
use crate::backend::AttnDims;
use crate::ops::{same_device, same_float};
use crate::{bail, DType, Layout, Result, Shape, Storage, Tensor};

fn new(st: Storage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(st, Layout::contiguous(shape.into()), None)
}

/// Runs `f` with the storages and layouts of `ts` (read locks held for the call).
fn with2<R>(a: &Tensor, b: &Tensor, f: impl FnOnce(crate::backend::Sl, crate::backend::Sl) -> Result<R>) -> Result<R> {
    let (ga, gb) = (a.0.storage.read()?, b.0.storage.read()?);
    f((&ga, a.layout()), (&gb, b.layout()))
}

impl Tensor {
    /// Rows of `weight` (vocab, d) picked by i32 `ids` of any shape -> (ids.., d). The
    /// backward scatter-adds rows in token order (deterministic).
    pub fn embedding(ids: &Tensor, weight: &Tensor) -> Result<Tensor> {
        same_device("embedding", &[ids, weight])?;
        if ids.dtype() != DType::I32 {
            bail!("embedding", "ids must be i32, got {}", ids.dtype());
        }
        if weight.rank() != 2 || !weight.dtype().is_float() {
            bail!("embedding", "weight must be a float (vocab, dim) matrix, got {:?} {}", weight.shape(), weight.dtype());
        }
        let w = weight.contiguous()?;
        let b = w.backend("embedding")?;
        let st = with2(&w, ids, |w, i| b.embedding(w, i))?;
        let mut shape = ids.dims().to_vec();
        shape.push(w.dims()[1]);
        let out = new(st, shape);
        let (ids, vocab) = (ids.clone(), w.dims()[0]);
        Ok(Tensor::record(
            out,
            "embedding",
            &[weight],
            Box::new(move |g| {
                let g = g.contiguous()?;
                let b = g.backend("embedding")?;
                let st = with2(&g, &ids, |g, i| b.embedding_backward(g, i, vocab))?;
                Ok(vec![Some(new(st, [vocab, g.dims()[g.rank() - 1]]))])
            }),
        ))
    }

    /// RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight. Saves the inverse RMS.
    pub fn rms_norm(&self, weight: &Tensor, eps: f64) -> Result<Tensor> {
        same_float("rms_norm", &[self, weight])?;
        let d = *self.dims().last().unwrap_or(&0);
        if weight.dims() != [d] {
            bail!("rms_norm", "weight shape {:?} does not match the last dim of {:?}", weight.shape(), self.shape());
        }
        let (x, w) = (self.contiguous()?, weight.contiguous()?);
        let b = x.backend("rms_norm")?;
        let (y, r) = with2(&x, &w, |x, w| b.rmsnorm(x, w, eps))?;
        let out = new(y, self.shape().clone());
        let r = new(r, [x.numel() / d.max(1)]);
        Ok(Tensor::record(
            out,
            "rms_norm",
            &[self, weight],
            Box::new(move |g| {
                let g = g.contiguous()?;
                let b = g.backend("rms_norm")?;
                let (dx, dw) = {
                    let (gg, gx, gw, gr) = (g.0.storage.read()?, x.0.storage.read()?, w.0.storage.read()?, r.0.storage.read()?);
                    b.rmsnorm_backward((&gg, g.layout()), (&gx, x.layout()), (&gw, w.layout()), (&gr, r.layout()))?
                };
                Ok(vec![Some(new(dx, x.shape().clone())), Some(new(dw, [d]))])
            }),
        ))
    }

    /// Rotary embedding in Hugging Face's rotate_half convention on x (b, h, t, d) with
    /// precomputed cos/sin of shape (t, d) (constants: no gradient flows into them).
    pub fn rope(&self, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        same_float("rope", &[self, cos, sin])?;
        if self.rank() != 4 || !self.dims()[3].is_multiple_of(2) {
            bail!("rope", "x must be (batch, heads, seq, head_dim) with an even head_dim, got {:?}", self.shape());
        }
        let (t, d) = (self.dims()[2], self.dims()[3]);
        if cos.dims() != [t, d] || sin.dims() != [t, d] {
            bail!("rope", "cos/sin must be ({t}, {d}) for x {:?}, got {:?} and {:?}", self.shape(), cos.shape(), sin.shape());
        }
        let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
        let out = rope_apply(&self.contiguous()?, &cos, &sin, false)?;
        Ok(Tensor::record(out, "rope", &[self], Box::new(move |g| Ok(vec![Some(rope_apply(&g.contiguous()?, &cos, &sin, true)?)]))))
    }

    /// silu(gate) * up, element-wise.
    pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_float("swiglu", &[gate, up])?;
        if gate.shape() != up.shape() {
            bail!("swiglu", "gate {:?} and up {:?} differ in shape", gate.shape(), up.shape());
        }
        let (g, u) = (gate.contiguous()?, up.contiguous()?);
        let b = g.backend("swiglu")?;
        let out = new(with2(&g, &u, |g, u| b.swiglu(g, u))?, g.shape().clone());
        Ok(Tensor::record(
            out,
            "swiglu",
            &[gate, up],
            Box::new(move |dy| {
                let dy = dy.contiguous()?;
                let b = dy.backend("swiglu")?;
                let (dg, du) = {
                    let (a, x, y) = (dy.0.storage.read()?, g.0.storage.read()?, u.0.storage.read()?);
                    b.swiglu_backward((&a, dy.layout()), (&x, g.layout()), (&y, u.layout()))?
                };
                Ok(vec![Some(new(dg, g.shape().clone())), Some(new(du, g.shape().clone()))])
            }),
        ))
    }

    /// Causal scaled-dot-product attention. q: (b, hq, t, d); k, v: (b, hkv, t, d) with hq a
    /// multiple of hkv (grouped-query attention, K/V heads are shared, never copied).
    pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        same_float("attention", &[q, k, v])?;
        if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
            bail!("attention", "q, k, v must be (batch, heads, seq, head_dim), got {:?} {:?} {:?}", q.shape(), k.shape(), v.shape());
        }
        let (qd, kd) = (q.dims(), k.dims());
        if k.shape() != v.shape() || qd[0] != kd[0] || qd[2] != kd[2] || qd[3] != kd[3] || kd[1] == 0 || qd[1] % kd[1] != 0 {
            bail!(
                "attention",
                "incompatible q {:?}, k {:?}, v {:?}: k and v must match and q heads must be a multiple of kv heads",
                q.shape(),
                k.shape(),
                v.shape()
            );
        }
        let dims = AttnDims { b: qd[0], hq: qd[1], hkv: kd[1], t: qd[2], d: qd[3] };
        let (qc, kc, vc) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let b = qc.backend("attention")?;
        let (o, lse) = {
            let (gq, gk, gv) = (qc.0.storage.read()?, kc.0.storage.read()?, vc.0.storage.read()?);
            b.attention((&gq, qc.layout()), (&gk, kc.layout()), (&gv, vc.layout()), dims, scale)?
        };
        let out = new(o, q.shape().clone());
        let lse = new(lse, [dims.b, dims.hq, dims.t]);
        let o = out.clone();
        Ok(Tensor::record(
            out,
            "attention",
            &[q, k, v],
            Box::new(move |g| {
                let g = g.contiguous()?;
                let b = g.backend("attention")?;
                let (dq, dk, dv) = {
                    let s: Vec<_> = [&g, &qc, &kc, &vc, &o, &lse].iter().map(|t| t.0.storage.read()).collect::<Result<_>>()?;
                    b.attention_backward(
                        (&s[0], g.layout()),
                        (&s[1], qc.layout()),
                        (&s[2], kc.layout()),
                        (&s[3], vc.layout()),
                        (&s[4], o.layout()),
                        (&s[5], lse.layout()),
                        dims,
                        scale,
                    )?
                };
                Ok(vec![Some(new(dq, qc.shape().clone())), Some(new(dk, kc.shape().clone())), Some(new(dv, vc.shape().clone()))])
            }),
        ))
    }

    /// Mean cross-entropy of logits (n, v) against i32 targets (n), skipping `ignore_index`.
    /// The loss is f32 for f32/bf16 logits (f64 for f64); the softmax is never stored.
    pub fn cross_entropy(logits: &Tensor, targets: &Tensor, ignore_index: i32) -> Result<Tensor> {
        same_device("cross_entropy", &[logits, targets])?;
        if logits.rank() != 2 || !logits.dtype().is_float() {
            bail!("cross_entropy", "logits must be a float (rows, classes) matrix, got {:?} {}", logits.shape(), logits.dtype());
        }
        if targets.dtype() != DType::I32 || targets.dims() != [logits.dims()[0]] {
            bail!("cross_entropy", "targets must be i32 of shape [{}], got {:?} {}", logits.dims()[0], targets.shape(), targets.dtype());
        }
        let x = logits.contiguous()?;
        let b = x.backend("cross_entropy")?;
        let (loss, lse, count) = with2(&x, targets, |x, t| b.cross_entropy(x, t, ignore_index))?;
        let out = new(loss, ());
        let lse = new(lse, [x.dims()[0]]);
        let t = targets.clone();
        Ok(Tensor::record(
            out,
            "cross_entropy",
            &[logits],
            Box::new(move |g| {
                let scale = g.mul_scalar(1.0 / count.max(1) as f64)?;
                let b = x.backend("cross_entropy")?;
                let st = {
                    let s: Vec<_> = [&x, &t, &lse, &scale].iter().map(|t| t.0.storage.read()).collect::<Result<_>>()?;
                    b.cross_entropy_backward(
                        (&s[0], x.layout()),
                        (&s[1], t.layout()),
                        (&s[2], lse.layout()),
                        ignore_index,
                        (&s[3], scale.layout()),
                    )?
                };
                Ok(vec![Some(new(st, x.shape().clone()))])
            }),
        ))
    }
}

fn rope_apply(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
    let b = x.backend("rope")?;
    let st = {
        let (gx, gc, gs) = (x.0.storage.read()?, cos.0.storage.read()?, sin.0.storage.read()?);
        b.rope((&gx, x.layout()), (&gc, cos.layout()), (&gs, sin.layout()), inverse)?
    };
    Ok(new(st, x.shape().clone()))
}
