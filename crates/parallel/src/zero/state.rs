//! Where a rank's optimizer state lives, as a strategy the engine holds: on the device next to
//! the parameters (`OnDevice`), or in host memory in subgroups updated on the CPU and the device
//! in turn (`Offloaded`, `crate::offload`). The engine hands either the same things: each
//! bucket's optimizer range of the parameters and its summed gradient, with the data-parallel
//! scale, the clip factor and the step's hyper-parameters.
use crate::offload::{Offload, OffloadConfig, OffloadPlan};
use ferrolm_nn::optim::{adamw_update, AdamWConfig, AdamWHyper};
use ferrolm_tensor::{fused_adamw_scaled, no_grad, AdamWRange, DType, Device, Result, Tensor};

/// One bucket of an update: this rank's optimizer range of the parameters (a device view,
/// updated in place) and its gradient as reduced (parameter dtype, summed over the ranks).
pub(crate) struct BucketUpdate {
    pub params: Tensor,
    pub grad: Tensor,
}

/// The scalars of one update: gradients are multiplied by `scale` (1/dp), then by `clip`.
#[derive(Clone, Copy)]
pub(crate) struct UpdateScalars {
    pub scale: f64,
    pub clip: f64,
    pub hyper: AdamWHyper,
}

pub(crate) trait OptimState: Send {
    /// Updates every bucket; `done(i)` is called as soon as bucket `i`'s parameters are final
    /// (the engine launches their all-gather behind the next bucket's update).
    fn update(&mut self, buckets: &[BucketUpdate], s: UpdateScalars, done: &mut dyn FnMut(usize) -> Result<()>) -> Result<()>;
    /// A bucket's optimizer-range gradient was launched in the last micro-batch.
    fn grad_ready(&mut self, _bucket: usize, _grad: &Tensor) -> Result<()> {
        Ok(())
    }
    /// The last micro-batch's backward is over: every `grad_ready` of the step has been called.
    fn grads_complete(&mut self) -> Result<()> {
        Ok(())
    }
    /// The step was skipped: forget what `grad_ready` received.
    fn discard(&mut self) {}
    /// Bucket `i`'s fp32 state (master when the parameters are lower precision, m, v), for
    /// checkpoints.
    fn tensors(&mut self, i: usize) -> Result<(Option<Tensor>, Tensor, Tensor)>;
    /// Sets bucket `i`'s state from fp32 tensors of its optimizer range.
    fn load(&mut self, i: usize, master: &Tensor, m: &Tensor, v: &Tensor) -> Result<()>;
    /// Bytes of optimizer state on the device.
    fn device_bytes(&self) -> usize;
    /// The offload schedule, when the state is offloaded.
    fn offload_plan(&self) -> Option<&OffloadPlan> {
        None
    }
    /// With offload: (CPU subgroups whose gradient left for the host this step, CPU subgroups).
    fn grads_streamed(&self) -> Option<(usize, usize)> {
        None
    }
}

/// Runs of equal weight decay over a bucket's optimizer range: (start, len, decays).
pub(crate) type Runs = Vec<(usize, usize, bool)>;

/// The state next to the parameters: per bucket fp32 master (for low-precision parameters),
/// m and v over the optimizer range, updated by `adamw_update` run by run.
pub(crate) struct OnDevice {
    buckets: Vec<DeviceBucket>,
}

struct DeviceBucket {
    master: Option<Tensor>,
    m: Tensor,
    v: Tensor,
    segments: Vec<(usize, usize, f64)>,
}

impl OnDevice {
    /// Zero moments; the master copy from `params` (each bucket's optimizer range of the
    /// parameters) when they are lower precision than f32.
    pub fn new(params: &[Tensor], runs: &[Runs], cfg: &AdamWConfig) -> Result<OnDevice> {
        let _g = no_grad();
        let mut buckets = Vec::with_capacity(params.len());
        for (p, runs) in params.iter().zip(runs) {
            let (n, dev) = (p.numel(), p.device());
            let master = if p.dtype() == DType::F32 { None } else { Some(p.to_dtype(DType::F32)?.deep_copy()?) };
            let segments = runs.iter().map(|&(s, l, d)| (s, l, if d { cfg.weight_decay } else { 0.0 })).collect();
            buckets.push(DeviceBucket {
                master,
                m: Tensor::zeros([n], DType::F32, dev)?,
                v: Tensor::zeros([n], DType::F32, dev)?,
                segments,
            });
        }
        Ok(OnDevice { buckets })
    }
}

impl OptimState for OnDevice {
    fn update(&mut self, buckets: &[BucketUpdate], s: UpdateScalars, done: &mut dyn FnMut(usize) -> Result<()>) -> Result<()> {
        let _g = no_grad();
        for (i, (u, st)) in buckets.iter().zip(&self.buckets).enumerate() {
            // A device reads the raw gradient (bf16 or f32) and scales it inside the kernel.
            let raw =
                AdamWRange { param: &u.params, master: st.master.as_ref(), grad: &u.grad, m: &st.m, v: &st.v, segments: &st.segments };
            if fused_adamw_scaled(&[raw], s.hyper, s.scale * s.clip)? {
                done(i)?;
                continue;
            }
            let mut g = u.grad.to_dtype(DType::F32)?;
            if s.scale != 1.0 {
                g = g.mul_scalar(s.scale)?;
            }
            if s.clip != 1.0 {
                g = g.mul_scalar(s.clip)?;
            }
            let range = AdamWRange { param: &u.params, master: st.master.as_ref(), grad: &g, m: &st.m, v: &st.v, segments: &st.segments };
            adamw_update(&[range], s.hyper)?;
            done(i)?;
        }
        Ok(())
    }
    fn tensors(&mut self, i: usize) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        let b = &self.buckets[i];
        Ok((b.master.clone(), b.m.clone(), b.v.clone()))
    }
    fn load(&mut self, i: usize, master: &Tensor, m: &Tensor, v: &Tensor) -> Result<()> {
        let _g = no_grad();
        let b = &self.buckets[i];
        b.m.assign(m)?;
        b.v.assign(v)?;
        if let Some(w) = &b.master {
            w.assign(master)?;
        }
        Ok(())
    }
    fn device_bytes(&self) -> usize {
        self.buckets.iter().map(|b| b.m.storage_bytes() + b.v.storage_bytes() + b.master.as_ref().map_or(0, |t| t.storage_bytes())).sum()
    }
}

/// The state in host memory (`crate::offload`), with its CPU/device update schedule.
pub(crate) struct Offloaded {
    off: Offload,
    weight_decay: f64,
    param_dtype: DType,
}

impl Offloaded {
    /// Seeds the host master from `params` (each bucket's optimizer range of the parameters);
    /// the device never holds the state.
    pub fn new(cfg: &OffloadConfig, params: &[Tensor], runs: &[Runs], adamw: &AdamWConfig) -> Result<Offloaded> {
        let param_dtype = params.first().map_or(DType::F32, |p| p.dtype());
        let off = Offload::new(cfg, params, runs, adamw.weight_decay != 0.0, param_dtype)?;
        Ok(Offloaded { off, weight_decay: adamw.weight_decay, param_dtype })
    }
}

impl OptimState for Offloaded {
    fn update(&mut self, buckets: &[BucketUpdate], s: UpdateScalars, done: &mut dyn FnMut(usize) -> Result<()>) -> Result<()> {
        let params: Vec<Tensor> = buckets.iter().map(|b| b.params.clone()).collect();
        let grads: Vec<Tensor> = buckets.iter().map(|b| b.grad.clone()).collect();
        self.off.step(&params, &grads, s.scale, s.clip, self.weight_decay, s.hyper)?;
        (0..buckets.len()).try_for_each(done)
    }
    fn grad_ready(&mut self, bucket: usize, grad: &Tensor) -> Result<()> {
        self.off.stream_grad(bucket, grad)
    }
    fn grads_complete(&mut self) -> Result<()> {
        self.off.grads_complete()
    }
    fn discard(&mut self) {
        self.off.discard();
    }
    fn tensors(&mut self, i: usize) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        let (w, m, v) = self.off.state(i)?;
        Ok(((self.param_dtype != DType::F32).then_some(w), m, v))
    }
    fn load(&mut self, i: usize, master: &Tensor, m: &Tensor, v: &Tensor) -> Result<()> {
        let host = |t: &Tensor| t.to_device(Device::Cpu);
        self.off.load(i, &host(master)?, &host(m)?, &host(v)?)
    }
    fn device_bytes(&self) -> usize {
        0
    }
    fn offload_plan(&self) -> Option<&OffloadPlan> {
        Some(self.off.plan())
    }
    fn grads_streamed(&self) -> Option<(usize, usize)> {
        Some(self.off.grads_streamed())
    }
}
