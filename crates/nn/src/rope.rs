//! Rotary position tables, computed on demand for the positions a call uses (a config may
//! allow a million positions; a run touches a few thousand) and cached.
use crate::config::{LlamaConfig, RopeScaling};
use ferrolm_tensor::{DType, Device, Result, Tensor};
use std::sync::Mutex;

/// HF's inv_freq (rounded to f32 like HF's buffer), with llama3 wavelength smoothing.
fn inv_freq(cfg: &LlamaConfig, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    let d = cfg.head_dim;
    (0..d / 2)
        .map(|i| {
            let f = 1.0 / theta.powf((2 * i) as f64 / d as f64);
            let f = match *scaling {
                RopeScaling::Default => f,
                RopeScaling::Llama3 { factor, low_freq_factor: lo, high_freq_factor: hi, original_max_position_embeddings: old } => {
                    let old = old as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < old / hi {
                        f // high frequency: kept
                    } else if wavelen > old / lo {
                        f / factor // low frequency: scaled
                    } else {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                }
            };
            f as f32
        })
        .collect()
}

/// cos/sin tables (positions, D) with emb = cat(freqs, freqs); the angle pos * inv_freq is
/// rounded to f32 as HF's f32 matmul does, then cos/sin are taken in f64. Each position's row
/// depends on that position alone, so a longer table has the same rows.
pub struct Rope {
    inv: Vec<f32>,
    max_positions: usize,
    dtype: DType,
    device: Device,
    cache: Mutex<Option<(Tensor, Tensor)>>, // (n, D) each
}

impl Rope {
    pub fn new(cfg: &LlamaConfig, dtype: DType, device: Device) -> Self {
        let inv = inv_freq(cfg, cfg.rope_theta, &cfg.rope_scaling);
        Rope { inv, max_positions: cfg.max_position_embeddings, dtype, device, cache: Mutex::new(None) }
    }

    /// The default (unscaled) RoPE of base `theta` for `cfg`'s head_dim: the tables of layers
    /// with their own theta (Gemma's `sliding_attention` layers).
    pub fn with_theta(cfg: &LlamaConfig, theta: f64, dtype: DType, device: Device) -> Self {
        let inv = inv_freq(cfg, theta, &RopeScaling::Default);
        Rope { inv, max_positions: cfg.max_position_embeddings, dtype, device, cache: Mutex::new(None) }
    }

    fn build(&self, n: usize) -> Result<(Tensor, Tensor)> {
        let d = self.inv.len() * 2;
        let (mut cos, mut sin) = (Vec::with_capacity(n * d), Vec::with_capacity(n * d));
        for pos in 0..n {
            for j in 0..d {
                let angle = (pos as f32 * self.inv[j % (d / 2)]) as f64;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let mk = |v: Vec<f64>| Tensor::from_vec(v, vec![n, d], Device::Cpu)?.to_dtype(self.dtype)?.to_device(self.device);
        Ok((mk(cos)?, mk(sin)?))
    }

    /// (cos, sin) rows for positions start..start+len, each (len, D). The caller has checked
    /// that start + len <= max_position_embeddings.
    pub fn tables(&self, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let need = start + len;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.as_ref().is_none_or(|(c, _)| c.dim(0) < need) {
            let n = need.next_power_of_two().max(64).min(self.max_positions).max(need);
            *cache = Some(self.build(n)?);
        }
        let (cos, sin) = cache.as_ref().expect("built above");
        Ok((cos.narrow(0, start, len)?, sin.narrow(0, start, len)?))
    }
}
