//! The training engine: flexible ZeRO sharding (AMSP, arXiv 2311.00257) over the flat parameter
//! buckets (`ferrolm_nn::buckets::ParamBuckets`). Parameters, gradients and optimizer states
//! are each sharded over their own group of data-parallel ranks,
//! `ShardSpec { params: s_p, grads: s_g, optim: s_os }`.
//! Training on one device is this engine on a world of one, spec (1, 1, 1): the same code path,
//! with every collective of size one skipped.
//!
//! Shards are ranges of each padded layer bucket (AMSP's intra-tensor layout, its Fig. 6a), so
//! every hand-over is a reduce-scatter or an all-gather, never AMSP's all-reduce with
//! select-and-drop. `groups` says which ranks hold which range; per micro-batch each bucket's
//! gradient is reduce-scattered over G as soon as its last parameter's gradient exists and
//! accumulated (`grads`); in the step's last micro-batch the whole hand-over to the optimizer
//! range runs behind the rest of the backward pass. The update then goes bucket by bucket on the
//! optimizer state wherever it lives (`state`: on the device, or offloaded), each bucket's
//! parameter all-gather launched as soon as its range is updated, behind the next bucket's
//! update. With s_p > 1 (ZeRO-3) parameters are released after use and re-gathered (`gather`).
//!
//! ZeRO-1 is (1, 1, dp), ZeRO-2 (1, dp, dp), ZeRO-3 (dp, dp, dp), MiCS (s, s, s), plain data
//! parallelism (1, 1, 1). The step's traffic per rank is `traffic_bytes` (tests hold the
//! implementation to it).
pub mod ckpt;
mod gather;
mod grads;
pub mod groups;
mod spec;
mod state;

pub use gather::expected_gathers;
pub use groups::{members, ShardPosition, ZeroGroup};
pub use spec::{traffic_bytes, GradReduceDtype, ShardSpec};

use crate::comm::ReduceOp;
use crate::engine::{StepReport, TrainEngine};
use crate::offload::{OffloadConfig, OffloadPlan};
use crate::tp::TpShardings;
use crate::{DeviceMesh, ThreadComm};
use ferrolm_nn::buckets::ParamBuckets;
use ferrolm_nn::optim::AdamWConfig;
use ferrolm_nn::safetensors_io::TensorMap;
use ferrolm_nn::CausalLm;
use ferrolm_tensor::{fused_sum_squares, no_grad, DType, Device, Error, Result, Tensor};
use gather::Gatherer;
use grads::GradPipeline;
use groups::{Comm, ShardGroups};
use state::{BucketUpdate, Offloaded, OnDevice, OptimState, Runs, UpdateScalars};
use std::sync::{Arc, Mutex, MutexGuard};

/// One layer bucket's shards on this rank.
struct Bucket {
    numel: usize,
    /// (numel) the bucket's flat buffer, which the model's parameters view; released between uses
    /// when s_p > 1.
    flat: Tensor,
    /// (numel / s_p) this rank's parameter range (the flat buffer itself when s_p = 1).
    param_range: Tensor,
    /// (numel / s_os) each element's weight in the global gradient norm: 1 over the number of
    /// tensor-parallel ranks holding the same value. None without tensor parallelism, where every
    /// element weighs 1 (padding only ever holds zero gradients): no mask on the device.
    norm_weight: Option<Tensor>,
}

/// The sharded data-parallel engine of one rank (see the module comment). Drive it through
/// [`TrainEngine`]: `micro_batch` per micro-batch, then `step`.
pub struct Zero {
    pub spec: ShardSpec,
    mesh: DeviceMesh,
    tp: Option<TpShardings>,
    groups: Arc<ShardGroups>,
    buckets: Vec<Bucket>,
    store: ParamBuckets,
    grads: GradPipeline,
    gather: Option<Arc<Gatherer>>,
    state: Arc<Mutex<Box<dyn OptimState>>>,
    cfg: AdamWConfig,
    /// Optimizer steps taken.
    pub step: u64,
    /// Seconds the last step spent updating (the AdamW loop, without waiting for gradients).
    pub last_update_s: f64,
    micro: usize,
    dtype: DType,
    grad_reduce: GradReduceDtype,
}

/// What `Zero::new` does with the optimizer state.
pub enum Placement<'a> {
    /// On the device, next to the parameters.
    Device,
    /// In host memory (`--offload-optimizer`).
    Offload(&'a OffloadConfig),
}

impl Zero {
    /// Moves `model`'s parameters into flat buckets and shards them over `mesh`'s data-parallel
    /// group by `spec`. With tensor parallelism, `tp` is the layout `parallelize` returned (the
    /// store then holds this rank's tensor-parallel shards). Collective over the mesh.
    pub fn new(
        model: &mut dyn CausalLm,
        mesh: DeviceMesh,
        spec: ShardSpec,
        tp: Option<TpShardings>,
        cfg: AdamWConfig,
        placement: Placement,
    ) -> Result<Zero> {
        if let Placement::Offload(o) = placement {
            o.validate()?;
        }
        let dp = mesh.dp();
        spec.validate(dp, (mesh.ranks_per_node() / mesh.tp()).max(1))?;
        let groups = Arc::new(ShardGroups::new(mesh.dp_group(), spec)?);
        let (sp, so) = (spec.params, spec.optim);
        // Every range of every bucket must be a whole number of elements.
        let store = ParamBuckets::from_model(model, dp * 8)?;
        let dtype = store.buckets.first().map_or(DType::F32, |b| b.dtype);
        let _g = no_grad();
        let (mut buckets, mut runs, mut optim_params) = (Vec::new(), Vec::new(), Vec::new());
        for bk in &store.buckets {
            let n = bk.padded;
            let param_range =
                if sp == 1 { bk.flat.clone() } else { bk.flat.narrow(0, groups.pos.param_range * n / sp, n / sp)?.deep_copy()? };
            let (lo, len) = (groups.pos.optim_range * n / so, n / so);
            // Per-element decay and (under TP only) norm weight over the optimizer range, from
            // the slots it overlaps.
            let (mut decay, mut weight) = (vec![false; len], tp.as_ref().map(|_| vec![0f32; len]));
            for s in &bk.slots {
                let (s0, s1) = (s.offset.max(lo), (s.offset + s.numel()).min(lo + len));
                if s1 <= s0 {
                    continue; // outside this rank's range
                }
                let w = match &tp {
                    None => 1.0,
                    Some(l) => match l.params.get(&s.name) {
                        Some(sh) if sh.dim.is_some() => 1.0 / sh.replicas as f32,
                        _ => 1.0 / l.tp as f32,
                    },
                };
                decay[s0 - lo..s1 - lo].fill(s.kind.weight_decay());
                if let Some(weight) = weight.as_mut() {
                    weight[s0 - lo..s1 - lo].fill(w);
                }
            }
            let mut r: Runs = Vec::new();
            for (e, &d) in decay.iter().enumerate() {
                match r.last_mut() {
                    Some(last) if last.2 == d => last.1 += 1,
                    _ => r.push((e, 1, d)),
                }
            }
            runs.push(r);
            optim_params.push(bk.flat.narrow(0, lo, len)?);
            let norm_weight = weight.map(|w| Tensor::from_vec(w, [len], bk.flat.device())).transpose()?;
            buckets.push(Bucket { numel: n, flat: bk.flat.clone(), param_range, norm_weight });
        }
        let state: Box<dyn OptimState> = match placement {
            Placement::Device => Box::new(OnDevice::new(&optim_params, &runs, &cfg)?),
            Placement::Offload(o) => Box::new(Offloaded::new(o, &optim_params, &runs, &cfg)?),
        };
        let state = Arc::new(Mutex::new(state));
        let grad_reduce = GradReduceDtype::default();
        let grads = GradPipeline::new(&store, groups.clone(), spec, grad_reduce.dtype(dtype));
        grads.install_sinks(&store, model)?;
        let gather = if sp > 1 {
            let pshards = buckets.iter().map(|b| b.param_range.clone()).collect();
            Some(Gatherer::new(groups.params.clone(), pshards, buckets.iter().map(|b| b.flat.clone()).collect())?)
        } else {
            None
        };
        let mut z = Zero {
            spec,
            mesh,
            tp,
            groups,
            buckets,
            store,
            grads,
            gather,
            state,
            cfg,
            step: 0,
            last_update_s: 0.0,
            micro: 0,
            dtype,
            grad_reduce,
        };
        z.install_grad_ready();
        Ok(z)
    }

    /// Hooks the optimizer state's gradient-ready handler (offload streams each reduced
    /// gradient to the host as soon as it is launched) to the gradient pipeline.
    fn install_grad_ready(&mut self) {
        if lock(&self.state).grads_streamed().is_some() {
            let st = self.state.clone();
            self.grads.set_grad_ready(Some(Arc::new(move |i, g| lock(&st).grad_ready(i, g))));
        }
    }

    /// The dtype gradients are accumulated and reduced in (`--grad-reduce-dtype`): f32 main
    /// gradients by default, as Megatron-LM and DeepSpeed do with bf16 parameters, or the
    /// parameter dtype. Set it before the first micro-batch (collective: every rank the same).
    pub fn set_grad_reduce_dtype(&mut self, d: GradReduceDtype) -> Result<()> {
        if self.micro != 0 {
            return Err(Error::new("zero", "the gradient reduce dtype changes between steps only"));
        }
        if d != self.grad_reduce {
            self.grad_reduce = d;
            self.grads.set_dtype(d.dtype(self.dtype));
        }
        Ok(())
    }
    /// The dtype gradients are accumulated and reduced in.
    pub fn grad_dtype(&self) -> DType {
        self.grad_reduce.dtype(self.dtype)
    }
    /// The dtype of the reduced optimizer-range gradients the last step used (None before one).
    pub fn reduced_grad_dtype(&self) -> Option<DType> {
        self.grads.handed_over()
    }

    /// The engine of a single device: a world of one rank, nothing sharded.
    pub fn single(model: &mut dyn CausalLm, cfg: AdamWConfig, placement: Placement) -> Result<Zero> {
        let mesh = DeviceMesh::new(ThreadComm::solo(crate::CommOptions::default()), 1, 1, 1)?;
        Zero::new(model, mesh, ShardSpec::zero(0, 1)?, None, cfg, placement)
    }

    fn state(&self) -> MutexGuard<'_, Box<dyn OptimState>> {
        lock(&self.state)
    }

    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }
    /// The device of the model's parameters (where this engine's collectives run).
    pub fn device(&self) -> Device {
        self.buckets.first().map_or(Device::Cpu, |b| b.param_range.device())
    }
    /// The parameter dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Bucket `i`'s optimizer state: (fp32 master for low-precision parameters, m, v).
    pub fn optim_state(&self, i: usize) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        self.state().tensors(i)
    }

    /// Whether the optimizer state is offloaded.
    pub fn offloaded(&self) -> bool {
        self.state().offload_plan().is_some()
    }
    /// The offload schedule (k, subgroups, what `auto` measured), when offload is on.
    pub fn offload_plan(&self) -> Option<OffloadPlan> {
        self.state().offload_plan().cloned()
    }
    /// With offload: (CPU subgroups whose gradient already left for the host this step, CPU
    /// subgroups). After the last micro-batch's backward every one has, launched from the sinks.
    pub fn offload_grads_streamed(&self) -> Option<(usize, usize)> {
        self.state().grads_streamed()
    }

    /// Bytes of model states this rank holds now: (parameters, gradients, optimizer states on
    /// the device). Released parameter buckets count nothing; gradients count the range a rank
    /// accumulates into (numel / s_g), held between micro-batches.
    pub fn state_bytes(&self) -> (usize, usize, usize) {
        let g: usize = self.buckets.iter().map(|b| b.numel / self.spec.grads * self.grad_dtype().size_in_bytes()).sum();
        let mut p = 0;
        for bk in &self.buckets {
            p += bk.param_range.storage_bytes();
            if self.spec.params > 1 && !bk.flat.is_released() {
                p += bk.flat.storage_bytes();
            }
        }
        (p, g, self.state().device_bytes())
    }
    /// Bytes of accumulated gradient ranges held right now (between micro-batches of a step).
    pub fn grad_bytes_held(&self) -> usize {
        self.grads.bytes_held()
    }
    /// Padded elements of each bucket.
    pub fn bucket_numel(&self) -> Vec<usize> {
        self.buckets.iter().map(|b| b.numel).collect()
    }
    /// Parameter all-gathers each bucket has needed since the engine was built (0 when s_p = 1).
    pub fn gathers(&self) -> Vec<usize> {
        match &self.gather {
            Some(g) => g.gathers(),
            None => vec![0; self.buckets.len()],
        }
    }
    /// The communicators this engine uses (for traffic accounting), without duplicates.
    pub fn comms(&self) -> Vec<Comm> {
        self.groups.all()
    }

    /// The global sums a step decides on, over every rank of the world in one all-reduce: the
    /// loss (averaged over the data-parallel ranks; tensor-parallel ranks hold the same value)
    /// and the gradient's squared norm (each optimizer range counted once, tensor-parallel
    /// copies weighted; the dp/s_os replicas of a range hold the same value).
    fn global_loss_and_sq_norm(&self, loss: f64, sq: f64) -> Result<(f64, f64)> {
        let world = self.mesh.world();
        if world.size() == 1 {
            return Ok((loss, sq));
        }
        let t = match self.device() {
            Device::Cpu => Tensor::from_vec(vec![loss, sq], [2], Device::Cpu)?,
            d => Tensor::from_vec(vec![loss as f32, sq as f32], [2], d)?, // no f64 on a GPU
        };
        let _site = crate::comm::call_site(|| "step, loss and squared-norm all-reduce".to_string());
        let v = world.all_reduce(&t, ReduceOp::Sum)?.to_vec_f64()?;
        let replicas = (self.mesh.dp() / self.spec.optim) as f64;
        Ok((v[0] / world.size() as f64, v[1] / replicas))
    }
}

fn lock<T: ?Sized>(m: &Mutex<Box<T>>) -> MutexGuard<'_, Box<T>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl TrainEngine for Zero {
    fn micro_batch(&mut self, last: bool, forward: &mut dyn FnMut() -> Result<Tensor>) -> Result<()> {
        if let Some(g) = &self.gather {
            g.release_all(false)?;
        }
        let loss = forward()?;
        self.grads.begin_backward(last);
        if let Some(g) = &self.gather {
            g.release_all(true)?;
        }
        loss.backward()?;
        self.grads.end_backward()?;
        if last {
            // The offloaded state streams the gradient it held back (the last bucket's).
            lock(&self.state).grads_complete()?;
        }
        self.micro += 1;
        if let Some(g) = &self.gather {
            g.release_all(false)?;
        }
        Ok(())
    }

    fn step(&mut self, lr: f64, max_norm: f64, local_loss: f64) -> Result<StepReport> {
        if self.micro == 0 {
            return Err(Error::new("zero", "step() without a backward pass since the last step"));
        }
        let _g = no_grad();
        let scale = 1.0 / self.mesh.dp() as f64;
        let grads = self.grads.take_optim_grads()?;
        // This rank's squared norm over its optimizer ranges, read back once: one fused pass
        // over every bucket's gradient where the device has one (each gradient read once in
        // its dtype), else composed from ops bucket by bucket (the CPU).
        let weights: Vec<Option<&Tensor>> = self.buckets.iter().map(|b| b.norm_weight.as_ref()).collect();
        let local_sq = match fused_sum_squares(&grads.iter().collect::<Vec<_>>(), &weights, scale)? {
            Some(sq) => sq,
            None => {
                let mut sums = Vec::with_capacity(grads.len());
                for (g, w) in grads.iter().zip(&weights) {
                    let g32 = g.to_dtype(DType::F32)?;
                    let g32 = if scale != 1.0 { g32.mul_scalar(scale)? } else { g32 };
                    let sq = g32.sqr()?;
                    let sq = match w {
                        Some(w) => sq.mul(w)?,
                        None => sq,
                    };
                    sums.push(sq.sum_all()?.reshape([1])?);
                }
                if sums.is_empty() {
                    0.0
                } else {
                    Tensor::cat(&sums, 0)?.to_vec_f64()?.iter().sum()
                }
            }
        };
        let (loss, sq) = self.global_loss_and_sq_norm(local_loss, local_sq)?;
        let norm = sq.sqrt();
        self.micro = 0;
        if !loss.is_finite() || !norm.is_finite() {
            self.state().discard(); // a skipped step: the gradients are dropped, nothing is updated
            return Ok(StepReport { loss, grad_norm: norm, applied: false });
        }
        let clip = if max_norm > 0.0 && norm > max_norm { max_norm / (norm + 1e-6) } else { 1.0 };
        self.step += 1;
        let k = self.spec.optim / self.spec.params;
        let b = self.groups.pos.sub_index;
        let mut updates = Vec::with_capacity(grads.len());
        for (g, bk) in grads.into_iter().zip(&self.buckets) {
            let len = bk.numel / self.spec.optim;
            // The raw gradient: the state applies the scale (Offloaded per subgroup).
            updates.push(BucketUpdate { params: bk.param_range.narrow(0, b * len, len)?, grad: g });
        }
        let scalars = UpdateScalars { scale, clip, hyper: self.cfg.hyper(lr, self.step) };
        let t_update = std::time::Instant::now();
        let mut gathered: Vec<Option<Tensor>> = vec![None; updates.len()];
        let os_sub = self.groups.optim_sub.clone();
        // Hand-back OS -> P of each bucket, launched as soon as its range is updated.
        self.state().update(&updates, scalars, &mut |i| {
            if k > 1 {
                let _site = crate::comm::call_site(|| format!("bucket {i}, updated-range all-gather"));
                gathered[i] = Some(os_sub.all_gather_async(&updates[i].params.deep_copy()?)?.tensor());
            }
            Ok(())
        })?;
        self.last_update_s = t_update.elapsed().as_secs_f64();
        for (bk, g) in self.buckets.iter().zip(gathered) {
            if let Some(full) = g {
                bk.param_range.assign(&full)?;
            }
        }
        Ok(StepReport { loss, grad_norm: norm, applied: true })
    }

    fn discard(&mut self) -> Result<()> {
        let pending = self.grads.discard();
        self.state().discard();
        // Collectives already launched must complete on every rank before the next ones.
        for t in pending {
            t.wait()?;
        }
        self.micro = 0;
        Ok(())
    }

    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        ckpt::shard_tensors(self)
    }

    fn owner_of(&self, name: &str, index: usize) -> Option<String> {
        ckpt::shard_element_owner(self, name, index)
    }

    fn save_shards(&self, dir: &std::path::Path) -> Result<()> {
        ckpt::save_shards(dir, self)
    }

    fn full_params(&self) -> Result<Option<TensorMap>> {
        ckpt::full_params(self)
    }

    fn load(&mut self, params: &TensorMap, state: &TensorMap, step: u64) -> Result<()> {
        ckpt::load_into(self, params, state, step)
    }

    fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }
}
