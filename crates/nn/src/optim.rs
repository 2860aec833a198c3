//! AdamW with decoupled weight decay, fp32 master weights for low-precision parameters, and
//! global-norm gradient clipping. The update is written with engine ops, so it runs on any
//! backend; a backend with fused kernels (CUDA: one multi-tensor AdamW launch, one two-stage
//! norm reduction) runs those instead, with the same state. The state is a list of named
//! tensors for checkpoints.
use ferrolm_tensor::backend::AdamWHyper;
use ferrolm_tensor::{bail, fused_adamw_step, fused_global_norm, no_grad, AdamWTensors, DType, Result, Tensor};

#[derive(Clone, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

/// Weight decay applies to matrices only by default: norms and embeddings are excluded.
pub fn default_decay(name: &str, t: &Tensor) -> bool {
    t.rank() >= 2 && !name.contains("embed_tokens") && !name.contains("norm")
}

struct Slot {
    name: String,
    param: Tensor,
    /// fp32 copy when the parameter itself is lower precision.
    master: Option<Tensor>,
    m: Tensor,
    v: Tensor,
    decay: bool,
}

pub struct AdamW {
    pub cfg: AdamWConfig,
    slots: Vec<Slot>,
    /// Optimizer steps taken (bias correction uses it).
    pub step: u64,
    /// Whether the last `step` ran the backend's fused kernel (false: the op-based update).
    pub last_step_fused: bool,
    /// Use the backend's fused kernel when it has one (the CPU's `cpu_adam` for f32, CUDA's
    /// multi-tensor kernel); false forces the op-based update (a reference for tests).
    pub allow_fused: bool,
}

impl AdamW {
    pub fn new(params: &[(String, Tensor)], cfg: AdamWConfig) -> Result<AdamW> {
        Self::with_decay(params, cfg, default_decay)
    }

    pub fn with_decay(params: &[(String, Tensor)], cfg: AdamWConfig, decay: impl Fn(&str, &Tensor) -> bool) -> Result<AdamW> {
        let _g = no_grad();
        let mut slots = Vec::with_capacity(params.len());
        for (name, p) in params {
            if !p.dtype().is_float() {
                bail!("AdamW", "parameter {name} is {}, not a float tensor", p.dtype());
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
                decay: decay(name, p),
            });
        }
        Ok(AdamW { cfg, slots, step: 0, last_step_fused: false, allow_fused: true })
    }

    /// One update with learning rate `lr` from the parameters' accumulated `.grad()`s.
    /// Parameters without a gradient are skipped.
    pub fn step(&mut self, lr: f64) -> Result<()> {
        let _g = no_grad();
        self.step += 1;
        let c = &self.cfg;
        {
            // The fused kernels want dense gradients; a linear weight's gradient arrives as the
            // transposed view of the backward GEMM's result.
            let grads: Vec<Option<Tensor>> = self
                .slots
                .iter()
                .map(|s| s.param.grad().map(|g| if g.is_contiguous() { Ok(g) } else { g.contiguous() }).transpose())
                .collect::<Result<_>>()?;
            let ts: Vec<AdamWTensors> = self
                .slots
                .iter()
                .zip(&grads)
                .filter_map(|(s, g)| {
                    let wd = if s.decay { c.weight_decay } else { 0.0 };
                    g.as_ref().map(|g| AdamWTensors {
                        param: &s.param,
                        grad: g,
                        master: s.master.as_ref(),
                        m: &s.m,
                        v: &s.v,
                        weight_decay: wd,
                    })
                })
                .collect();
            let h = AdamWHyper { lr, beta1: c.beta1, beta2: c.beta2, eps: c.eps, step: self.step };
            if self.allow_fused && fused_adamw_step(&ts, h)? {
                self.last_step_fused = true;
                return Ok(());
            }
        }
        self.last_step_fused = false;
        let bc1 = 1.0 - c.beta1.powi(self.step as i32);
        let bc2 = 1.0 - c.beta2.powi(self.step as i32);
        for s in &mut self.slots {
            let Some(g) = s.param.grad() else { continue };
            let g = g.to_dtype(s.m.dtype())?;
            let m = s.m.mul_scalar(c.beta1)?.add(&g.mul_scalar(1.0 - c.beta1)?)?;
            let v = s.v.mul_scalar(c.beta2)?.add(&g.sqr()?.mul_scalar(1.0 - c.beta2)?)?;
            let w = s.master.clone().unwrap_or_else(|| s.param.clone());
            // w <- w - lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)
            let denom = v.mul_scalar(1.0 / bc2)?.sqrt()?.add_scalar(c.eps)?;
            let mut upd = m.mul_scalar(1.0 / bc1)?.div(&denom)?;
            if s.decay && c.weight_decay != 0.0 {
                upd = upd.add(&w.mul_scalar(c.weight_decay)?)?;
            }
            let w_new = w.sub(&upd.mul_scalar(lr)?)?;
            s.m.assign(&m)?;
            s.v.assign(&v)?;
            match &s.master {
                Some(master) => {
                    master.assign(&w_new)?;
                    s.param.assign(&w_new)?; // rounds to the parameter's dtype
                }
                None => s.param.assign(&w_new)?,
            }
        }
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

    /// Restores state written by `state_tensors` (every tensor must be present).
    pub fn load_state(&mut self, step: u64, get: &dyn Fn(&str) -> Result<Tensor>) -> Result<()> {
        for s in &mut self.slots {
            s.m.assign(&get(&format!("exp_avg.{}", s.name))?)?;
            s.v.assign(&get(&format!("exp_avg_sq.{}", s.name))?)?;
            if let Some(m) = &s.master {
                m.assign(&get(&format!("master.{}", s.name))?)?;
            }
        }
        self.step = step;
        Ok(())
    }
}

/// Global L2 norm of all gradients (f64 on the host); scales them down to `max_norm` when it
/// is exceeded (`max_norm <= 0` disables clipping). Returns the norm before clipping.
pub fn clip_grad_norm(params: &[(String, Tensor)], max_norm: f64) -> Result<f64> {
    let _g = no_grad();
    let grads: Vec<Tensor> = params.iter().filter_map(|(_, p)| p.grad()).collect();
    let norm = match fused_global_norm(&grads.iter().collect::<Vec<_>>())? {
        Some(n) => n,
        None => {
            // Summed on the device, read back once: one host sync per step, not one per parameter.
            let mut sq: Option<Tensor> = None;
            for g in &grads {
                let s = g.to_dtype(DType::F32)?.sqr()?.sum_all()?;
                sq = Some(match sq {
                    Some(acc) => acc.add(&s)?,
                    None => s,
                });
            }
            match sq {
                Some(t) => t.item()?.sqrt(),
                None => 0.0,
            }
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

    /// One AdamW step against the closed form, written out by hand.
    #[test]
    fn adamw_matches_reference() {
        let p = Tensor::from_vec(vec![1.0f64, -2.0, 0.5, 3.0], [2, 2], Device::Cpu).unwrap();
        p.set_requires_grad(true).unwrap();
        let params = vec![("w".to_string(), p.clone())];
        let cfg = AdamWConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let mut opt = AdamW::new(&params, cfg.clone()).unwrap();
        let g = [0.1, -0.2, 0.3, -0.4];
        let mut want = vec![1.0, -2.0, 0.5, 3.0];
        let (mut m, mut v) = (vec![0.0; 4], vec![0.0; 4]);
        for step in 1..=3 {
            p.set_grad(Some(Tensor::from_vec(g.to_vec(), [2, 2], Device::Cpu).unwrap()));
            opt.step(0.01).unwrap();
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

    /// The CPU's fused kernel (f32, and bf16 with an f32 master) against the op-based update:
    /// the same arithmetic in another order of roundings, so within 1e-6 relative.
    #[test]
    fn cpu_fused_adamw_matches_the_ops() {
        for dt in [DType::F32, DType::BF16] {
            let mut r = ferrolm_tensor::Rng::new(4);
            let mk = |r: &mut ferrolm_tensor::Rng| {
                let p = Tensor::randn([300, 7], 0.3, dt, Device::Cpu, r).unwrap();
                p.set_requires_grad(true).unwrap();
                vec![("layers.0.w".to_string(), p)]
            };
            let (pa, pb) = (mk(&mut r), mk(&mut ferrolm_tensor::Rng::new(4)));
            let cfg = AdamWConfig::default();
            let (mut fa, mut ob) = (AdamW::new(&pa, cfg.clone()).unwrap(), AdamW::new(&pb, cfg).unwrap());
            ob.allow_fused = false;
            for _ in 0..3 {
                let g = Tensor::randn([300, 7], 1.0, DType::F32, Device::Cpu, &mut r).unwrap();
                pa[0].1.set_grad(Some(g.clone()));
                pb[0].1.set_grad(Some(g));
                fa.step(1e-2).unwrap();
                ob.step(1e-2).unwrap();
                assert!(fa.last_step_fused && !ob.last_step_fused);
            }
            for ((n, a), (_, b)) in fa.state_tensors().iter().zip(ob.state_tensors().iter()).chain(pa.iter().zip(pb.iter())) {
                let (x, y) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
                let scale = y.iter().map(|v| v.abs()).fold(1e-12, f64::max);
                let d = x.iter().zip(&y).map(|(u, w)| (u - w).abs()).fold(0.0, f64::max);
                let tol = if dt == DType::BF16 && n == "layers.0.w" { 1e-2 } else { 1e-6 };
                assert!(d <= tol * scale, "{dt} {n}: max diff {d} (scale {scale})");
            }
        }
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
    fn decay_excludes_norms_and_embeddings() {
        let m = Tensor::zeros([2, 2], DType::F32, Device::Cpu).unwrap();
        let v = Tensor::zeros([2], DType::F32, Device::Cpu).unwrap();
        assert!(default_decay("model.layers.0.mlp.up_proj.weight", &m));
        assert!(!default_decay("model.embed_tokens.weight", &m));
        assert!(!default_decay("model.norm.weight", &v));
    }
}
