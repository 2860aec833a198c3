//! AdamW with decoupled weight decay over flat ranges, and global-norm gradient clipping.
//!
//! [`adamw_update`] is the one entry point that updates parameters: a flat range of a
//! parameter buffer with its fp32 state (master weights for low-precision parameters, m, v), in
//! runs of equal weight decay. It runs the fused kernel of the range's device (the CPU's
//! `cpu_adam`, CUDA's multi-tensor kernel) when every capability is there, checked before any
//! state is touched, and else the op-based reference below, which any backend runs. The training
//! engine (`ferrolm_parallel::zero`) updates its shard's buckets through it; [`AdamW`] holds
//! per-parameter state for code that trains loose tensors (tests, benchmarks).
//!
//! Update (the kernels' arithmetic, term for term): m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//! w -= lr ((m / bc1) / (sqrt(v / bc2) + eps) + wd w), with bc = 1 - beta^step from the f64 betas.
pub use ferrolm_tensor::backend::AdamWHyper;
use ferrolm_tensor::{bail, fused_adamw, fused_global_norm, no_grad, AdamWRange, DType, Result, Tensor};

use crate::module::ParamKind;

#[derive(Clone, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Applied to the parameters whose [`ParamKind`] decays (matrices; not norms or embeddings).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

impl AdamWConfig {
    /// The hyper-parameters of update number `step` (1-based) at learning rate `lr`.
    pub fn hyper(&self, lr: f64, step: u64) -> AdamWHyper {
        AdamWHyper { lr, beta1: self.beta1, beta2: self.beta2, eps: self.eps, step }
    }
    /// The weight decay of a parameter of this kind.
    pub fn decay_of(&self, kind: ParamKind) -> f64 {
        if kind.weight_decay() {
            self.weight_decay
        } else {
            0.0
        }
    }
}

/// Which implementation an update ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdatePath {
    /// The device's fused kernel.
    Fused,
    /// The op-based reference.
    Reference,
}

/// One AdamW update of `ranges` (see [`AdamWRange`]): fused when the device can, else the
/// reference. Lengths, segments and dtypes are checked first; a malformed range is an error and
/// nothing is updated.
pub fn adamw_update(ranges: &[AdamWRange], h: AdamWHyper) -> Result<UpdatePath> {
    for r in ranges {
        let n = r.param.numel();
        for (what, t) in [("grad", Some(r.grad)), ("m", Some(r.m)), ("v", Some(r.v)), ("master", r.master)] {
            if let Some(t) = t {
                if t.numel() != n || !t.dtype().is_float() {
                    bail!("adamw_update", "{what} has {} {} elements, the parameter range {n}", t.numel(), t.dtype());
                }
            }
        }
        if let Some(&(s, l, _)) = r.segments.iter().find(|&&(s, l, _)| s.checked_add(l).is_none_or(|e| e > n)) {
            bail!("adamw_update", "segment {s}..{} is outside a range of {n} elements", s.saturating_add(l));
        }
    }
    if fused_adamw(ranges, h)? {
        return Ok(UpdatePath::Fused);
    }
    for r in ranges {
        reference(r, h)?;
    }
    Ok(UpdatePath::Reference)
}

/// The update written with engine ops (any backend, any float dtype), segment by segment.
fn reference(r: &AdamWRange, h: AdamWHyper) -> Result<()> {
    let _g = no_grad();
    let (bc1, bc2) = (1.0 - h.beta1.powi(h.step as i32), 1.0 - h.beta2.powi(h.step as i32));
    let flat = |t: &Tensor| t.reshape([t.numel()]);
    let (param, grad, m_all, v_all) = (flat(r.param)?, flat(r.grad)?, flat(r.m)?, flat(r.v)?);
    let master = r.master.map(flat).transpose()?;
    for &(s, l, wd) in r.segments {
        let part = |t: &Tensor| t.narrow(0, s, l);
        let (m0, v0) = (part(&m_all)?, part(&v_all)?);
        let g = part(&grad)?.to_dtype(m0.dtype())?;
        let m = m0.mul_scalar(h.beta1)?.add(&g.mul_scalar(1.0 - h.beta1)?)?;
        let v = v0.mul_scalar(h.beta2)?.add(&g.sqr()?.mul_scalar(1.0 - h.beta2)?)?;
        let w = part(master.as_ref().unwrap_or(&param))?;
        let denom = v.mul_scalar(1.0 / bc2)?.sqrt()?.add_scalar(h.eps)?;
        let mut upd = m.mul_scalar(1.0 / bc1)?.div(&denom)?;
        if wd != 0.0 {
            upd = upd.add(&w.to_dtype(m0.dtype())?.mul_scalar(wd)?)?;
        }
        let w_new = w.to_dtype(m0.dtype())?.sub(&upd.mul_scalar(h.lr)?)?;
        m0.assign(&m)?;
        v0.assign(&v)?;
        if master.is_some() {
            w.assign(&w_new)?;
        }
        part(&param)?.assign(&w_new)?; // rounds to the parameter's dtype
    }
    Ok(())
}

struct Slot {
    name: String,
    param: Tensor,
    /// fp32 copy when the parameter itself is lower precision.
    master: Option<Tensor>,
    m: Tensor,
    v: Tensor,
    weight_decay: f64,
}

/// AdamW state per parameter tensor, each updated as one flat range through [`adamw_update`].
pub struct AdamW {
    pub cfg: AdamWConfig,
    slots: Vec<Slot>,
    /// Optimizer steps taken (bias correction uses it).
    pub step: u64,
    /// The path the last `step` ran.
    pub last_path: Option<UpdatePath>,
    /// Use the device's fused kernel when it has one; false forces the op-based reference (a
    /// reference for tests of the kernels).
    pub allow_fused: bool,
}

impl AdamW {
    /// State for `params` (name, tensor, kind); weight decay comes from each kind.
    pub fn new(params: &[(String, Tensor, ParamKind)], cfg: AdamWConfig) -> Result<AdamW> {
        let _g = no_grad();
        let mut slots = Vec::with_capacity(params.len());
        for (name, p, kind) in params {
            if !p.dtype().is_float() {
                bail!("AdamW", "parameter {name} is {}, not a float tensor", p.dtype());
            }
            if !p.is_contiguous() {
                bail!("AdamW", "parameter {name} is not contiguous");
            }
            let master =
                if p.dtype() == DType::F32 || p.dtype() == DType::F64 { None } else { Some(p.to_dtype(DType::F32)?.contiguous()?) };
            let sd = if p.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
            slots.push(Slot {
                name: name.clone(),
                param: p.clone(),
                master,
                m: Tensor::zeros(p.shape().clone(), sd, p.device())?,
                v: Tensor::zeros(p.shape().clone(), sd, p.device())?,
                weight_decay: cfg.decay_of(*kind),
            });
        }
        Ok(AdamW { cfg, slots, step: 0, last_path: None, allow_fused: true })
    }

    /// One update with learning rate `lr` from the parameters' accumulated `.grad()`s.
    /// Parameters without a gradient are skipped.
    pub fn step(&mut self, lr: f64) -> Result<()> {
        let _g = no_grad();
        self.step += 1;
        let flat = |t: &Tensor| t.reshape([t.numel()]);
        // (param, master, grad as a dense f32 range, m, v, segments) of every slot with a gradient.
        let mut views = Vec::new();
        for s in &self.slots {
            let Some(g) = s.param.grad() else { continue };
            let g = g.to_dtype(s.m.dtype())?.contiguous()?;
            let seg = [(0, s.param.numel(), s.weight_decay)];
            views.push((flat(&s.param)?, s.master.as_ref().map(flat).transpose()?, flat(&g)?, flat(&s.m)?, flat(&s.v)?, seg));
        }
        let ranges: Vec<AdamWRange> =
            views.iter().map(|(p, w, g, m, v, seg)| AdamWRange { param: p, master: w.as_ref(), grad: g, m, v, segments: seg }).collect();
        let h = self.cfg.hyper(lr, self.step);
        self.last_path = Some(if self.allow_fused {
            adamw_update(&ranges, h)?
        } else {
            ranges.iter().try_for_each(|r| reference(r, h))?;
            UpdatePath::Reference
        });
        Ok(())
    }

    pub fn zero_grad(&self) {
        for s in &self.slots {
            s.param.zero_grad();
        }
    }

    /// Named optimizer state (`exp_avg.<p>`, `exp_avg_sq.<p>`, `master.<p>`) for checkpoints.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for s in &self.slots {
            out.push((format!("exp_avg.{}", s.name), s.m.clone()));
            out.push((format!("exp_avg_sq.{}", s.name), s.v.clone()));
            if let Some(m) = &s.master {
                out.push((format!("master.{}", s.name), m.clone()));
            }
        }
        out
    }
}

/// Global L2 norm of all gradients, summed in f64; scales them down to `max_norm` when it is
/// exceeded (`max_norm <= 0` disables clipping). Returns the norm before clipping.
pub fn clip_grad_norm(params: &[(String, Tensor)], max_norm: f64) -> Result<f64> {
    let _g = no_grad();
    let grads: Vec<Tensor> = params.iter().filter_map(|(_, p)| p.grad()).collect();
    let norm = match fused_global_norm(&grads.iter().collect::<Vec<_>>())? {
        Some(n) => n,
        None => {
            // A device without a fused norm: per tensor on the device (reductions accumulate in
            // f64 there too), added on the host.
            let mut sq = 0.0;
            for g in &grads {
                sq += g.to_dtype(DType::F32)?.sqr()?.sum_all()?.item()?;
            }
            sq.sqrt()
        }
    };
    if max_norm > 0.0 && norm > max_norm {
        let s = max_norm / (norm + 1e-6);
        for (_, p) in params {
            if let Some(g) = p.grad() {
                p.set_grad(Some(g.mul_scalar(s)?));
            }
        }
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm_tensor::Device;

    fn param(v: Vec<f64>, shape: [usize; 2]) -> (String, Tensor, ParamKind) {
        let p = Tensor::from_vec(v, shape, Device::Cpu).unwrap();
        p.set_requires_grad(true).unwrap();
        ("w".to_string(), p, ParamKind::Matrix)
    }

    /// One AdamW step against the closed form, written out by hand.
    #[test]
    fn adamw_matches_reference() {
        let params = vec![param(vec![1.0f64, -2.0, 0.5, 3.0], [2, 2])];
        let p = params[0].1.clone();
        let cfg = AdamWConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let mut opt = AdamW::new(&params, cfg.clone()).unwrap();
        let g = [0.1, -0.2, 0.3, -0.4];
        let mut want = vec![1.0, -2.0, 0.5, 3.0];
        let (mut m, mut v) = (vec![0.0; 4], vec![0.0; 4]);
        for step in 1..=3 {
            p.set_grad(Some(Tensor::from_vec(g.to_vec(), [2, 2], Device::Cpu).unwrap()));
            opt.step(0.01).unwrap();
            assert_eq!(opt.last_path, Some(UpdatePath::Reference), "f64 has no fused kernel");
            for i in 0..4 {
                m[i] = 0.9 * m[i] + 0.1 * g[i];
                v[i] = 0.99 * v[i] + 0.01 * g[i] * g[i];
                let mh = m[i] / (1.0 - 0.9f64.powi(step));
                let vh = v[i] / (1.0 - 0.99f64.powi(step));
                want[i] -= 0.01 * (mh / (vh.sqrt() + 1e-8) + 0.1 * want[i]);
            }
        }
        let got = p.to_vec::<f64>().unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-12, "{got:?} vs {want:?}");
        }
    }

    /// The CPU's fused kernel (f32, and bf16 with an f32 master) against the op-based reference,
    /// over a flat range cut into segments of different weight decay: the same arithmetic in
    /// another order of roundings, so within 1e-6 relative.
    #[test]
    fn cpu_fused_adamw_matches_the_reference() {
        for dt in [DType::F32, DType::BF16] {
            let mut r = ferrolm_tensor::Rng::new(4);
            let n = 2100;
            let mk = |r: &mut ferrolm_tensor::Rng| {
                let p = Tensor::randn([n], 0.3, dt, Device::Cpu, r).unwrap();
                let w = (dt == DType::BF16).then(|| p.to_dtype(DType::F32).unwrap());
                (p, w, Tensor::zeros([n], DType::F32, Device::Cpu).unwrap(), Tensor::zeros([n], DType::F32, Device::Cpu).unwrap())
            };
            let (a, b) = (mk(&mut r), mk(&mut ferrolm_tensor::Rng::new(4)));
            let segs = [(0, 700, 0.1), (700, 600, 0.0), (1300, 800, 0.1)];
            for step in 1..=3 {
                let g = Tensor::randn([n], 1.0, DType::F32, Device::Cpu, &mut r).unwrap();
                let h = AdamWConfig::default().hyper(1e-2, step);
                let ra = AdamWRange { param: &a.0, master: a.1.as_ref(), grad: &g, m: &a.2, v: &a.3, segments: &segs };
                assert_eq!(adamw_update(&[ra], h).unwrap(), UpdatePath::Fused);
                let rb = AdamWRange { param: &b.0, master: b.1.as_ref(), grad: &g, m: &b.2, v: &b.3, segments: &segs };
                reference(&rb, h).unwrap();
            }
            let pairs = [("param", &a.0, &b.0), ("m", &a.2, &b.2), ("v", &a.3, &b.3)];
            for (name, x, y) in pairs.into_iter().chain(a.1.as_ref().zip(b.1.as_ref()).map(|(x, y)| ("master", x, y))) {
                let (x, y) = (x.to_vec_f64().unwrap(), y.to_vec_f64().unwrap());
                let scale = y.iter().map(|v| v.abs()).fold(1e-12, f64::max);
                let d = x.iter().zip(&y).map(|(u, w)| (u - w).abs()).fold(0.0, f64::max);
                let tol = if dt == DType::BF16 && name == "param" { 1e-2 } else { 1e-6 };
                assert!(d <= tol * scale, "{dt} {name}: max diff {d} (scale {scale})");
            }
        }
    }

    /// A range whose state is shorter than its parameter is refused before anything changes.
    #[test]
    fn malformed_ranges_are_refused_untouched() {
        let p = Tensor::from_vec(vec![1.0f32; 8], [8], Device::Cpu).unwrap();
        let (g, m) = (Tensor::ones([8], DType::F32, Device::Cpu).unwrap(), Tensor::zeros([8], DType::F32, Device::Cpu).unwrap());
        let short = Tensor::zeros([4], DType::F32, Device::Cpu).unwrap();
        let h = AdamWConfig::default().hyper(1e-2, 1);
        let r = AdamWRange { param: &p, master: None, grad: &g, m: &m, v: &short, segments: &[(0, 8, 0.0)] };
        assert!(adamw_update(&[r], h).unwrap_err().to_string().contains("v has 4"));
        let v = Tensor::zeros([8], DType::F32, Device::Cpu).unwrap();
        let r = AdamWRange { param: &p, master: None, grad: &g, m: &m, v: &v, segments: &[(4, 8, 0.0)] };
        assert!(adamw_update(&[r], h).unwrap_err().to_string().contains("outside"));
        assert_eq!(p.to_vec::<f32>().unwrap(), vec![1.0; 8]);
        assert_eq!(m.to_vec::<f32>().unwrap(), vec![0.0; 8]);
    }

    #[test]
    fn clipping_scales_to_max_norm() {
        let p = Tensor::from_vec(vec![0.0f32; 2], [2], Device::Cpu).unwrap();
        p.set_requires_grad(true).unwrap();
        p.set_grad(Some(Tensor::from_vec(vec![3.0f32, 4.0], [2], Device::Cpu).unwrap()));
        let params = vec![("b".to_string(), p.clone())];
        let n = clip_grad_norm(&params, 1.0).unwrap();
        assert!((n - 5.0).abs() < 1e-6);
        let g = p.grad().unwrap().to_vec::<f32>().unwrap();
        assert!((g[0] - 0.6).abs() < 1e-5 && (g[1] - 0.8).abs() < 1e-5, "{g:?}");
    }

    #[test]
    fn decay_comes_from_the_kind() {
        let c = AdamWConfig::default();
        assert_eq!(c.decay_of(ParamKind::Matrix), 0.1);
        assert_eq!(c.decay_of(ParamKind::Embedding), 0.0);
        assert_eq!(c.decay_of(ParamKind::Norm), 0.0);
    }
}
