//! Flexible ZeRO sharding (AMSP, arXiv 2311.00257): parameters, gradients and optimizer states
//! each sharded over their own group of data-parallel ranks, `ShardSpec { params: s_p,
//! grads: s_g, optim: s_os }`, over the flat parameter store (`ferrolm_nn::store`).
//!
//! Shards are ranges of each padded layer bucket (AMSP's intra-tensor layout, its Fig. 6a),
//! so every hand-over is a reduce-scatter or an all-gather, never AMSP's all-reduce with
//! select-and-drop. Within a block of s_os consecutive data-parallel ranks, rank `r_os` has
//! parameter index `a = r_os % s_p` and sub-index `b = r_os / s_p`; its optimizer shard is
//! range `j = a * (s_os/s_p) + b` of s_os, which lies inside its parameter range `a` of s_p.
//! Groups (each ordered so that rank k of the group holds range k):
//! - P (s_p ranks, same block and b): all-gathers a bucket before use (ZeRO-3 when s_p > 1).
//! - G (s_g ranks): reduce-scatters each bucket's gradient once per micro-batch, as soon as
//!   its last parameter's gradient arrives (a gradient sink in backward); the result is
//!   accumulated over micro-batches, so a rank only ever holds 1/s_g of the gradients.
//!   s_g = s_p: G is P. s_g = s_os: G is the block, ordered by j.
//! - OS sub-group (s_os/s_p ranks, same block and a): once per step, when s_os > s_g, it
//!   reduce-scatters the accumulated gradient range down to the optimizer range; after the
//!   update it all-gathers the optimizer ranges back into the parameter range.
//! - OS replicas (dp/s_os ranks, same j): all-reduce the optimizer-range gradient, once per step.
//!
//! Overlap: in the last micro-batch of a step, a bucket's whole hand-over (reduce-scatter over
//! G, the earlier micro-batches' sum added on the communication thread, reduce-scatter over the
//! OS sub-group, all-reduce over the replicas) is launched from the gradient sink the moment the
//! bucket's gradient is complete, so it runs behind the rest of the backward pass. The update
//! then goes bucket by bucket, each bucket's parameter all-gather launched as soon as its range
//! is updated, behind the next bucket's update.
//!
//! ZeRO-1 is (1, 1, dp), ZeRO-2 (1, dp, dp), ZeRO-3 (dp, dp, dp), MiCS (s, s, s), plain data
//! parallelism (1, 1, 1). The step's traffic per rank is `traffic_bytes` (tests hold the
//! implementation to it).
use crate::comm::{all_reduce_scalar, Communicator, ReduceOp};
use crate::offload::{Offload, OffloadConfig};
use crate::tp::TpLayout;
use crate::DeviceMesh;
use ferrolm_nn::optim::AdamWConfig;
use ferrolm_nn::store::ParamStore;
use ferrolm_nn::Llama;
use ferrolm_tensor::{no_grad, DType, Device, Error, Refill, Result, Storage, Tensor};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};

pub type Comm = Arc<dyn Communicator>;

/// Group sizes over which parameters, gradients and optimizer states are sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardSpec {
    pub params: usize,
    pub grads: usize,
    pub optim: usize,
}

impl std::fmt::Display for ShardSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "(params {}, grads {}, optim {})", self.params, self.grads, self.optim)
    }
}

impl ShardSpec {
    /// `--zero 0|1|2|3`: plain data parallelism, ZeRO-1 (1, 1, dp), ZeRO-2 (1, dp, dp),
    /// ZeRO-3 (dp, dp, dp).
    pub fn zero(stage: usize, dp: usize) -> Result<ShardSpec> {
        Ok(match stage {
            0 => ShardSpec { params: 1, grads: 1, optim: 1 },
            1 => ShardSpec { params: 1, grads: 1, optim: dp },
            2 => ShardSpec { params: 1, grads: dp, optim: dp },
            3 => ShardSpec { params: dp, grads: dp, optim: dp },
            s => return Err(Error::new("--zero", format!("{s} is not a ZeRO stage (0, 1, 2 or 3)"))),
        })
    }

    /// MiCS: everything sharded within groups of `s` ranks, replicated across them.
    pub fn mics(s: usize) -> ShardSpec {
        ShardSpec { params: s, grads: s, optim: s }
    }

    /// AMSP's constraints, for `dp` data-parallel ranks of which `dp_per_node` share a node.
    pub fn validate(&self, dp: usize, dp_per_node: usize) -> Result<()> {
        let err = |m: String| Error::new("ShardSpec", format!("{self} with {dp} data-parallel ranks: {m}"));
        for (flag, s) in [("--shard-params", self.params), ("--shard-grads", self.grads), ("--shard-optim", self.optim)] {
            if s == 0 || !dp.is_multiple_of(s) {
                return Err(err(format!("{flag} {s} does not divide the data-parallel size {dp}")));
            }
            let dpn = dp_per_node.clamp(1, dp);
            let fits = if s <= dpn { dpn.is_multiple_of(s) } else { s % dpn == 0 };
            if !fits {
                return Err(err(format!(
                    "{flag} {s}: a group must fit inside a node ({dpn} data-parallel ranks per node) or span whole nodes"
                )));
            }
        }
        if !(self.params <= self.grads && self.grads <= self.optim) {
            return Err(err(
                "AMSP needs params <= grads <= optim: a rank must not hold gradients or optimizer states of parameters it does not hold"
                    .into(),
            ));
        }
        if self.grads != self.params && self.grads != self.optim {
            return Err(err("grads must equal params or optim (AMSP's s_g in {s_p, s_os})".into()));
        }
        if !self.optim.is_multiple_of(self.params) {
            return Err(err("optim must be a multiple of params, so that each optimizer shard lies inside one parameter shard".into()));
        }
        Ok(())
    }

    /// Every valid spec for `dp` ranks, `dp_per_node` per node.
    pub fn all_valid(dp: usize, dp_per_node: usize) -> Vec<ShardSpec> {
        let divs: Vec<usize> = (1..=dp).filter(|s| dp.is_multiple_of(*s)).collect();
        let mut out = Vec::new();
        for &p in &divs {
            for &o in &divs {
                for g in [p, o] {
                    let s = ShardSpec { params: p, grads: g, optim: o };
                    if !out.contains(&s) && s.validate(dp, dp_per_node).is_ok() {
                        out.push(s);
                    }
                }
            }
        }
        out
    }

    /// Bytes of model states per rank for `numel` (padded) parameter elements: parameters in
    /// `param_bytes` per element over s_p, gradients in the same type over s_g, and the
    /// optimizer's m, v (and an fp32 master copy for low-precision parameters) over s_os. Mixed
    /// precision (bf16): 2/s_p + 2/s_g + 12/s_os per element; f32: 4/s_p + 4/s_g + 8/s_os.
    pub fn state_bytes(&self, numel: u64, param_bytes: u64) -> u64 {
        let optim = if param_bytes == 4 { 8 } else { 12 };
        numel * param_bytes / self.params as u64 + numel * param_bytes / self.grads as u64 + numel * optim / self.optim as u64
    }
}

/// Bytes each rank sends per optimizer step (ring accounting of `cost::bytes_sent`), for
/// buckets of `bucket_numel` padded elements of `elem_bytes`, `micro` micro-batches, and
/// `gathers` parameter all-gathers per bucket per micro-batch (forward and backward; see
/// `Zero::gathers_per_micro_batch`). The gradient-norm all-reduce (8 bytes) is not included.
pub fn traffic_bytes(spec: ShardSpec, dp: usize, bucket_numel: &[usize], gathers: &[usize], elem_bytes: usize, micro: usize) -> f64 {
    let ring = |k: usize| (k as f64 - 1.0) / k as f64;
    let (sp, sg, so) = (spec.params, spec.grads, spec.optim);
    let mut total = 0.0;
    for (&n, &ag) in bucket_numel.iter().zip(gathers) {
        let b = (n * elem_bytes) as f64;
        total += micro as f64 * (ag as f64 * ring(sp) * b + ring(sg) * b);
        let rep = dp / so;
        if so > sg {
            total += ring(so / sg) * b / sg as f64 + 2.0 * ring(rep) * b / so as f64;
        } else {
            total += 2.0 * ring(rep) * b / sg as f64;
        }
        total += ring(so / sp) * b / sp as f64;
    }
    total
}

/// The data-parallel sub-groups of one rank (see the module comment).
struct Groups {
    p: Comm,
    g: Comm,
    os_sub: Comm,
    os_rep: Comm,
    block: Comm,
    /// Parameter range index a, optimizer sub-index b, optimizer range j.
    a: usize,
    b: usize,
    j: usize,
}

impl Groups {
    fn new(dp: &Comm, s: ShardSpec) -> Result<Groups> {
        let (sp, sg, so) = (s.params, s.grads, s.optim);
        let r = dp.rank();
        let (blk, ro) = (r / so, r % so);
        let (a, b, k) = (ro % sp, ro / sp, so / sp);
        let j = a * k + b;
        let p = dp.split_named(blk * k + b, a, "zero_p")?;
        let os_sub = dp.split_named(blk * sp + a, b, "zero_os")?;
        let block = dp.split_named(blk, j, "zero_block")?;
        let g = if sg == sp { p.clone() } else { block.clone() };
        let os_rep = dp.split_named(j, blk, "zero_rep")?;
        Ok(Groups { p, g, os_sub, os_rep, block, a, b, j })
    }
}

/// One layer bucket's shards on this rank.
struct ZBucket {
    n: usize,
    /// (n) the store's buffer, which the model's parameters view; released between uses when
    /// s_p > 1.
    flat: Tensor,
    /// (n / s_p) this rank's parameter range (the flat buffer itself when s_p = 1).
    p_shard: Tensor,
    /// (n / s_os) fp32 optimizer state of range j: master (for low-precision parameters), m, v.
    master: Option<Tensor>,
    m: Tensor,
    v: Tensor,
    /// (n / s_os) 1 where weight decay applies, 0 elsewhere (norms, embeddings, padding).
    decay: Tensor,
    /// The same as runs (start, len, decays) for the fused update.
    runs: Vec<(usize, usize, bool)>,
    /// (n / s_os) each element's weight in the global gradient norm: 1 over the number of
    /// tensor-parallel ranks holding the same value.
    /// None without tensor parallelism, where every element weighs 1 (padding, weighted 0 here,
    /// only ever holds zero gradients): no shard-sized mask on the device.
    norm_weight: Option<Tensor>,
}

/// Gradients being assembled into bucket buffers by the sinks during backward.
struct Assembly {
    buckets: Vec<AsmBucket>,
    error: Option<Error>,
    /// The backward pass running is the step's last micro-batch.
    last: bool,
    groups: Arc<Groups>,
    spec: ShardSpec,
    /// Offloaded optimizer state: CPU subgroups' gradients stream to it from the sinks.
    offload: Option<Arc<Mutex<Offload>>>,
}

struct AsmBucket {
    index: usize,
    full: Option<Tensor>,
    arrived: usize,
    expected: usize,
    /// Reduced (possibly pending) gradient ranges of this step's earlier micro-batches.
    reduced: Vec<Tensor>,
    /// (n / s_g) the sum of the earlier micro-batches' ranges.
    acc: Option<Tensor>,
    /// (n / s_os) after the last micro-batch: the gradient of this rank's optimizer range,
    /// summed over every data-parallel rank (pending while its collectives run).
    os_grad: Option<Tensor>,
}

/// Materialises released parameter buckets (s_p > 1): an all-gather over P on a miss, and a
/// prefetch of the next bucket in the direction of the pass (AMSP/DeepSpeed's prefetch), with
/// at most `MAX_LIVE` buckets materialised.
struct Gatherer {
    p: Comm,
    pshards: Vec<Tensor>,
    flats: Vec<Tensor>,
    me: Weak<Gatherer>,
    state: Mutex<GatherState>,
    /// Set while `release_all` waits for prefetches: their completion must not start more.
    releasing: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct GatherState {
    live: VecDeque<usize>,
    backward: bool,
    gathers: Vec<usize>,
}

const MAX_LIVE: usize = 3;

struct BucketRefill {
    g: Weak<Gatherer>,
    i: usize,
}

impl Refill for BucketRefill {
    fn refill(&self) -> Result<Storage> {
        let g = self.g.upgrade().ok_or_else(|| Error::new("zero", "parameter bucket read after its engine was dropped"))?;
        let full = g.p.all_gather(&g.pshards[self.i])?;
        g.state.lock().unwrap_or_else(|e| e.into_inner()).gathers[self.i] += 1;
        g.materialised(self.i)?;
        full.storage_copy()
    }
}

impl Gatherer {
    fn refill_for(&self, i: usize) -> Arc<dyn Refill> {
        Arc::new(BucketRefill { g: self.me.clone(), i })
    }

    /// Bookkeeping after bucket `i` became readable: prefetch its successor, evict the oldest.
    fn materialised(&self, i: usize) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.live.retain(|&k| k != i);
        st.live.push_back(i);
        let next = if st.backward { i.checked_sub(1) } else { Some(i + 1).filter(|&k| k < self.flats.len()) };
        if let Some(k) = next {
            if self.flats[k].is_released() {
                let w = self.p.all_gather_async(&self.pshards[k])?;
                let me = self.me.clone();
                self.flats[k].prefetch(Box::new(move |s| {
                    *s = w.wait()?.storage_copy()?;
                    match me.upgrade() {
                        Some(g) if !g.releasing.load(std::sync::atomic::Ordering::Acquire) => g.materialised(k),
                        _ => Ok(()),
                    }
                }))?;
                st.gathers[k] += 1;
                st.live.retain(|&x| x != k);
                st.live.push_back(k);
            }
        }
        while st.live.len() > MAX_LIVE {
            let old = st.live.pop_front().expect("non-empty");
            if old == i || Some(old) == next || !self.flats[old].try_release(self.refill_for(old))? {
                st.live.push_back(old);
                break;
            }
        }
        Ok(())
    }

    /// Releases every materialised bucket (between passes).
    fn release_all(&self, backward: bool) -> Result<()> {
        use std::sync::atomic::Ordering;
        self.releasing.store(true, Ordering::Release);
        // Not under the state lock: waiting for a prefetch runs its fill.
        let res = (|| {
            for (i, f) in self.flats.iter().enumerate() {
                if !f.is_released() {
                    f.wait()?; // a prefetch in flight completes first
                    f.release(self.refill_for(i))?;
                }
            }
            Ok(())
        })();
        self.releasing.store(false, Ordering::Release);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.backward = backward;
        st.live.clear();
        res
    }
}

/// The sharded data-parallel engine of one rank. Use: `begin_forward`, forward,
/// `begin_backward`, backward (gradients flow into the engine), `end_backward`; repeat per
/// micro-batch; then `step`.
pub struct Zero {
    pub spec: ShardSpec,
    dp: usize,
    groups: Arc<Groups>,
    buckets: Vec<ZBucket>,
    store: ParamStore,
    asm: Arc<Mutex<Assembly>>,
    gather: Option<Arc<Gatherer>>,
    tp: Option<Comm>,
    cfg: AdamWConfig,
    /// Optimizer steps taken.
    pub step: u64,
    /// Seconds the last step spent updating (the AdamW loop, without waiting for gradients).
    pub last_update_s: f64,
    micro: usize,
    dtype: DType,
    /// `--offload-optimizer`: this rank's optimizer state in host memory (`offload`).
    offload: Option<Arc<Mutex<Offload>>>,
}

impl Zero {
    /// Moves `model`'s parameters into the flat store and shards them over `mesh`'s
    /// data-parallel group by `spec`. With tensor parallelism, `tp` is the layout `parallelize`
    /// returned (the store then holds this rank's tensor-parallel shards).
    pub fn new(model: &mut Llama, mesh: &DeviceMesh, spec: ShardSpec, tp: Option<&TpLayout>, cfg: AdamWConfig) -> Result<Zero> {
        Ok(Self::build(model, mesh, spec, tp, cfg, None)?.0)
    }

    /// `new` with the optimizer state offloaded (`offload`) from the start: the device never holds
    /// the shard's master, m, v or decay mask, not even briefly (for a 7B model on one GPU they
    /// would not fit). Returns what `--offload-gpu-every` resolved to.
    pub fn with_offload(
        model: &mut Llama,
        mesh: &DeviceMesh,
        spec: ShardSpec,
        tp: Option<&TpLayout>,
        cfg: AdamWConfig,
        offload: &OffloadConfig,
    ) -> Result<(Zero, crate::offload::OffloadPlan)> {
        let (z, plan) = Self::build(model, mesh, spec, tp, cfg, Some(offload))?;
        Ok((z, plan.expect("offload was asked for")))
    }

    fn build(
        model: &mut Llama,
        mesh: &DeviceMesh,
        spec: ShardSpec,
        tp: Option<&TpLayout>,
        cfg: AdamWConfig,
        offload: Option<&OffloadConfig>,
    ) -> Result<(Zero, Option<crate::offload::OffloadPlan>)> {
        if let Some(o) = offload {
            o.validate()?;
        }
        let on_device = offload.is_none();
        let dp = mesh.dp();
        spec.validate(dp, (mesh.ranks_per_node() / mesh.tp()).max(1))?;
        let groups = Arc::new(Groups::new(mesh.dp_group(), spec)?);
        let (sp, so) = (spec.params, spec.optim);
        // Every range of every bucket must be a whole number of elements.
        let store = ParamStore::from_model(model, dp * 8)?;
        let dtype = store.buckets.first().map_or(DType::F32, |b| b.dtype);
        let _g = no_grad();
        let mut buckets = Vec::with_capacity(store.buckets.len());
        for bk in &store.buckets {
            let n = bk.padded;
            let p_shard = if sp == 1 { bk.flat.clone() } else { bk.flat.narrow(0, groups.a * n / sp, n / sp)?.deep_copy()? };
            let (lo, len) = (groups.j * n / so, n / so);
            let os_param = bk.flat.narrow(0, lo, len)?;
            let master = if dtype == DType::F32 || !on_device { None } else { Some(os_param.to_dtype(DType::F32)?.deep_copy()?) };
            // Per-element masks over the optimizer range, from the slots it overlaps.
            let (mut decay, mut weight) = (vec![0f32; len], vec![0f32; len]);
            for s in &bk.slots {
                let (s0, s1) = (s.offset.max(lo), (s.offset + s.numel()).min(lo + len));
                let w = match tp {
                    None => 1.0,
                    Some(l) => match l.params.get(&s.name) {
                        Some(sh) if sh.dim.is_some() => 1.0 / sh.replicas as f32,
                        _ => 1.0 / l.tp as f32,
                    },
                };
                for e in s0..s1.max(s0) {
                    decay[e - lo] = if s.kind.weight_decay() { 1.0 } else { 0.0 };
                    weight[e - lo] = w;
                }
            }
            let dev = bk.flat.device();
            let mut runs: Vec<(usize, usize, bool)> = Vec::new();
            for (e, &d) in decay.iter().enumerate() {
                match runs.last_mut() {
                    Some(r) if r.2 == (d != 0.0) => r.1 += 1,
                    _ => runs.push((e, 1, d != 0.0)),
                }
            }
            buckets.push(ZBucket {
                runs,
                n,
                flat: bk.flat.clone(),
                p_shard,
                master,
                m: Tensor::zeros([if on_device { len } else { 0 }], DType::F32, dev)?,
                v: Tensor::zeros([if on_device { len } else { 0 }], DType::F32, dev)?,
                // Only the op-based update reads the mask; offload works from `runs`.
                decay: if on_device { Tensor::from_vec(decay, [len], dev)? } else { Tensor::zeros([0], DType::F32, dev)? },
                norm_weight: if tp.is_some() { Some(Tensor::from_vec(weight, [len], dev)?) } else { None },
            });
        }
        let asm = Arc::new(Mutex::new(Assembly {
            buckets: store
                .buckets
                .iter()
                .enumerate()
                .map(|(index, b)| AsmBucket {
                    index,
                    full: None,
                    arrived: 0,
                    expected: b.slots.len(),
                    reduced: Vec::new(),
                    acc: None,
                    os_grad: None,
                })
                .collect(),
            error: None,
            last: true,
            groups: groups.clone(),
            spec,
            offload: None,
        }));
        let mut zero = Zero {
            spec,
            dp,
            groups,
            buckets,
            store,
            asm,
            gather: None,
            tp: tp.map(|_| mesh.tp_group().clone()),
            cfg,
            step: 0,
            last_update_s: 0.0,
            micro: 0,
            dtype,
            offload: None,
        };
        zero.install_sinks(model)?;
        if sp > 1 {
            let g = Arc::new_cyclic(|me| Gatherer {
                p: zero.groups.p.clone(),
                pshards: zero.buckets.iter().map(|b| b.p_shard.clone()).collect(),
                flats: zero.buckets.iter().map(|b| b.flat.clone()).collect(),
                me: me.clone(),
                state: Mutex::new(GatherState { gathers: vec![0; zero.buckets.len()], ..Default::default() }),
                releasing: std::sync::atomic::AtomicBool::new(false),
            });
            g.release_all(false)?;
            zero.gather = Some(g);
        }
        let plan = match offload {
            Some(o) => Some(zero.enable_offload(o)?),
            None => None,
        };
        Ok((zero, plan))
    }

    /// Each parameter's gradient goes into its bucket's buffer; the bucket's reduce-scatter
    /// over G is launched when its last gradient arrives.
    fn install_sinks(&self, model: &Llama) -> Result<()> {
        let params: std::collections::HashMap<String, Tensor> = model.parameters().into_iter().collect();
        for (bi, bk) in self.store.buckets.iter().enumerate() {
            let n = bk.padded;
            for s in &bk.slots {
                let p = params.get(&s.name).ok_or_else(|| Error::new("zero", format!("parameter {} is not in the model", s.name)))?;
                let (asm, off, numel, dtype, dev) = (self.asm.clone(), s.offset, s.numel(), bk.dtype, p.device());
                p.set_grad_sink(Some(Arc::new(move |grad: &Tensor| {
                    let mut a = asm.lock().unwrap_or_else(|e| e.into_inner());
                    if a.error.is_some() {
                        return;
                    }
                    let a = &mut *a;
                    let res = (|| -> Result<()> {
                        let b = &mut a.buckets[bi];
                        let full = match &b.full {
                            Some(f) => f.clone(),
                            None => {
                                let f = Tensor::zeros([n], dtype, dev)?;
                                b.full = Some(f.clone());
                                f
                            }
                        };
                        full.narrow(0, off, numel)?.assign(&grad.reshape([numel])?)?;
                        b.arrived += 1;
                        if b.arrived == b.expected {
                            flush(b, &a.groups, a.spec, a.last, a.offload.as_ref())?;
                        }
                        Ok(())
                    })();
                    if let Err(e) = res {
                        a.error = Some(e);
                    }
                })));
            }
        }
        Ok(())
    }

    /// Call before each micro-batch's forward pass.
    pub fn begin_forward(&self) -> Result<()> {
        match &self.gather {
            Some(g) => g.release_all(false),
            None => Ok(()),
        }
    }

    /// Call between the forward pass and `backward()`; `last`: this is the step's last
    /// micro-batch (its gradient hand-over starts during the backward pass).
    pub fn begin_backward(&self, last: bool) -> Result<()> {
        self.asm.lock().unwrap_or_else(|e| e.into_inner()).last = last;
        match &self.gather {
            Some(g) => g.release_all(true),
            None => Ok(()),
        }
    }

    /// Call after each micro-batch's backward: launches what did not complete and accumulates
    /// the reduced gradient ranges.
    pub fn end_backward(&mut self) -> Result<()> {
        {
            let mut a = self.asm.lock().unwrap_or_else(|e| e.into_inner());
            let a = &mut *a;
            if let Some(e) = a.error.take() {
                return Err(e);
            }
            for b in a.buckets.iter_mut() {
                if b.full.is_some() {
                    flush(b, &a.groups, a.spec, a.last, a.offload.as_ref())?; // some parameter got no gradient
                }
                if !a.last && b.os_grad.is_some() {
                    return Err(Error::new("zero", "a micro-batch after the step's last one: call step() first"));
                }
            }
            let _g = no_grad();
            for b in a.buckets.iter_mut() {
                for r in std::mem::take(&mut b.reduced) {
                    b.acc = Some(match b.acc.take() {
                        Some(acc) => acc.add(&r)?,
                        None => r.contiguous()?,
                    });
                }
            }
        }
        self.micro += 1;
        if let Some(g) = &self.gather {
            g.release_all(false)?;
        }
        Ok(())
    }

    /// The optimizer step after the last micro-batch: gradients handed over to the optimizer
    /// ranges and averaged over the data-parallel ranks, clipped to `max_norm` by the global
    /// norm (`<= 0`: no clipping), AdamW on this rank's range, updated parameters gathered
    /// back into the parameter ranges. Returns the gradient norm before clipping; when it is
    /// not finite nothing is updated (the step is skipped on every rank alike).
    pub fn step(&mut self, lr: f64, max_norm: f64) -> Result<f64> {
        if self.micro == 0 {
            return Err(Error::new("zero", "step() without a backward pass since the last step"));
        }
        let _g = no_grad();
        let (so, dp) = (self.spec.optim, self.dp);
        // The hand-over ran during the last backward; a bucket that got no gradient at all
        // hands over zeros.
        let os_grads: Vec<Tensor> = {
            let mut a = self.asm.lock().unwrap_or_else(|e| e.into_inner());
            let a = &mut *a;
            let mut out = Vec::with_capacity(a.buckets.len());
            for (b, bk) in a.buckets.iter_mut().zip(&self.buckets) {
                if b.os_grad.is_none() {
                    b.full = Some(Tensor::zeros([bk.n], self.dtype, bk.flat.device())?);
                    flush(b, &a.groups, a.spec, true, a.offload.as_ref())?;
                }
                out.push(b.os_grad.take().expect("flushed"));
            }
            out
        };
        let scale = 1.0 / dp as f64;
        let mut grads = Vec::with_capacity(os_grads.len());
        // Global norm: each optimizer range once (summed over the block), tensor-parallel
        // copies weighted. Reading each range waits for its collectives, bucket by bucket.
        let mut local = 0.0;
        for (g, bk) in os_grads.into_iter().zip(&self.buckets) {
            let g32 = g.to_dtype(DType::F32)?.mul_scalar(scale)?;
            let sq = g32.sqr()?;
            let sq = match &bk.norm_weight {
                Some(w) => sq.mul(w)?,
                None => sq,
            };
            local += sq.sum_all()?.item()?;
            // Offload converts per subgroup: the whole shard's fp32 gradient never sits on the
            // device at once.
            grads.push(if self.offload.is_some() { g } else { g32 });
        }
        let mut sq = all_reduce_scalar(self.groups.block.as_ref(), local, self.device())?;
        if let Some(tp) = &self.tp {
            sq = all_reduce_scalar(tp.as_ref(), sq, self.device())?;
        }
        let norm = sq.sqrt();
        self.micro = 0;
        if !norm.is_finite() {
            return Ok(norm); // a skipped step: the gradients are dropped, nothing is updated
        }
        let clip = if max_norm > 0.0 && norm > max_norm { max_norm / (norm + 1e-6) } else { 1.0 };
        self.step += 1;
        let c = &self.cfg;
        let (bc1, bc2) = (1.0 - c.beta1.powi(self.step as i32), 1.0 - c.beta2.powi(self.step as i32));
        let k = so / self.spec.params;
        let t_update = std::time::Instant::now();
        let mut gathered = Vec::with_capacity(self.buckets.len());
        if let Some(off) = &self.offload {
            let h = ferrolm_tensor::backend::AdamWHyper { lr, beta1: c.beta1, beta2: c.beta2, eps: c.eps, step: self.step };
            let views: Vec<Tensor> =
                self.buckets.iter().map(|bk| bk.p_shard.narrow(0, self.groups.b * (bk.n / so), bk.n / so)).collect::<Result<_>>()?;
            off.lock().unwrap_or_else(|e| e.into_inner()).step(&views, &grads, scale, clip, c.weight_decay, h)?;
            for pview in &views {
                gathered.push(if k > 1 { Some(self.groups.os_sub.all_gather_async(&pview.deep_copy()?)?.tensor()) } else { None });
            }
        }
        let grads = if self.offload.is_some() { Vec::new() } else { grads };
        for (bk, g) in self.buckets.iter_mut().zip(grads) {
            let g = if clip != 1.0 { g.mul_scalar(clip)? } else { g };
            let len = bk.n / so;
            let pview = bk.p_shard.narrow(0, self.groups.b * len, len)?;
            let w = match &bk.master {
                Some(m) => m.clone(),
                None => pview.clone(),
            };
            let segments: Vec<(usize, usize, f64)> =
                bk.runs.iter().map(|&(s, l, d)| (s, l, if d { c.weight_decay } else { 0.0 })).collect();
            let h = ferrolm_tensor::backend::AdamWHyper { lr, beta1: c.beta1, beta2: c.beta2, eps: c.eps, step: self.step };
            if ferrolm_tensor::fused_adamw_ranges(&pview, &g, &bk.m, &bk.v, bk.master.as_ref(), &segments, h)? {
                gathered.push(if k > 1 { Some(self.groups.os_sub.all_gather_async(&pview.deep_copy()?)?.tensor()) } else { None });
                continue;
            }
            let m = bk.m.mul_scalar(c.beta1)?.add(&g.mul_scalar(1.0 - c.beta1)?)?;
            let v = bk.v.mul_scalar(c.beta2)?.add(&g.sqr()?.mul_scalar(1.0 - c.beta2)?)?;
            let denom = v.mul_scalar(1.0 / bc2)?.sqrt()?.add_scalar(c.eps)?;
            let mut upd = m.mul_scalar(1.0 / bc1)?.div(&denom)?;
            if c.weight_decay != 0.0 {
                upd = upd.add(&w.to_dtype(DType::F32)?.mul(&bk.decay)?.mul_scalar(c.weight_decay)?)?;
            }
            let w_new = w.to_dtype(DType::F32)?.sub(&upd.mul_scalar(lr)?)?;
            bk.m.assign(&m)?;
            bk.v.assign(&v)?;
            if let Some(master) = &bk.master {
                master.assign(&w_new)?;
            }
            pview.assign(&w_new)?;
            // Hand-back OS -> P, launched now, behind the next bucket's update.
            gathered.push(if k > 1 { Some(self.groups.os_sub.all_gather_async(&pview.deep_copy()?)?.tensor()) } else { None });
        }
        self.last_update_s = t_update.elapsed().as_secs_f64();
        for (bk, g) in self.buckets.iter().zip(gathered) {
            if let Some(full) = g {
                bk.p_shard.assign(&full)?;
            }
        }
        self.micro = 0;
        Ok(norm)
    }

    /// Drops the gradients of this step (a skipped step): waits for what is in flight and
    /// forgets it, leaving weights and optimizer state untouched.
    pub fn discard(&mut self) -> Result<()> {
        let pending: Vec<Tensor> = {
            let mut a = self.asm.lock().unwrap_or_else(|e| e.into_inner());
            let mut out = Vec::new();
            for b in a.buckets.iter_mut() {
                b.full = None;
                b.arrived = 0;
                out.append(&mut b.reduced);
                out.extend(b.acc.take());
                out.extend(b.os_grad.take());
            }
            a.error = None;
            out
        };
        if let Some(o) = &self.offload {
            o.lock().unwrap_or_else(|e| e.into_inner()).discard();
        }
        // Collectives already launched must complete on every rank before the next ones.
        for t in pending {
            t.wait()?;
        }
        self.micro = 0;
        Ok(())
    }

    /// The optimizer step count, for checkpoints.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Whether this rank writes its parameter range in a sharded checkpoint (the first block's
    /// ranks with b = 0 hold each range once) and its optimizer range (the first block).
    pub fn writes(&self) -> (bool, bool) {
        let first_block = self.groups.os_rep.rank() == 0;
        (first_block && self.groups.b == 0, first_block)
    }

    /// This rank's shards for a sharded checkpoint, per bucket `i`: `param.{i}` (the parameter
    /// range a of s_p) when it writes parameters, and `exp_avg.{i}`, `exp_avg_sq.{i}`
    /// (`master.{i}`) (optimizer range j of s_os) when it writes optimizer state.
    pub fn shard_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let (wp, wo) = self.writes();
        let mut out = Vec::new();
        for (i, b) in self.buckets.iter().enumerate() {
            if wp {
                out.push((format!("param.{i}"), b.p_shard.clone()));
            }
            if wo && self.offload.is_some() {
                let (w, m, v) = self.offloaded_state(i)?;
                out.push((format!("exp_avg.{i}"), m));
                out.push((format!("exp_avg_sq.{i}"), v));
                if self.dtype != DType::F32 {
                    out.push((format!("master.{i}"), w));
                }
            } else if wo {
                out.push((format!("exp_avg.{i}"), b.m.clone()));
                out.push((format!("exp_avg_sq.{i}"), b.v.clone()));
                if let Some(m) = &b.master {
                    out.push((format!("master.{i}"), m.clone()));
                }
            }
        }
        Ok(out)
    }

    /// Moves this rank's optimizer state (master, m, v) into host memory, updated there and on
    /// the device in interleaved subgroups (`offload`). Call right after `new`, before training
    /// or `load` (`with_offload` does the same without ever allocating the state on the device).
    /// Returns what `--offload-gpu-every` resolved to.
    pub fn enable_offload(&mut self, cfg: &OffloadConfig) -> Result<crate::offload::OffloadPlan> {
        if self.offload.is_some() {
            return Err(Error::new("zero", "optimizer offload is already on"));
        }
        let so = self.spec.optim;
        let _g = no_grad();
        let mut views = Vec::with_capacity(self.buckets.len());
        for bk in &self.buckets {
            let len = bk.n / so;
            // The fp32 master seeds the host copy when there is one (it is the exact value).
            views.push(match &bk.master {
                Some(m) => m.clone(),
                None => bk.p_shard.narrow(0, self.groups.b * len, len)?,
            });
        }
        let runs: Vec<Vec<(usize, usize, bool)>> = self.buckets.iter().map(|b| b.runs.clone()).collect();
        let off = Offload::new(cfg, &views, &runs, self.cfg.weight_decay != 0.0, self.dtype)?;
        let plan = off.plan().clone();
        for bk in &mut self.buckets {
            let dev = bk.flat.device();
            bk.master = None;
            bk.decay = Tensor::zeros([0], DType::F32, dev)?;
            bk.m = Tensor::zeros([0], DType::F32, dev)?;
            bk.v = Tensor::zeros([0], DType::F32, dev)?;
        }
        let off = Arc::new(Mutex::new(off));
        self.asm.lock().unwrap_or_else(|e| e.into_inner()).offload = Some(off.clone());
        self.offload = Some(off);
        Ok(plan)
    }

    /// Whether the optimizer state is offloaded.
    pub fn offloaded(&self) -> bool {
        self.offload.is_some()
    }

    /// The offload schedule (k, subgroups, what `auto` measured), when offload is on.
    pub fn offload_plan(&self) -> Option<crate::offload::OffloadPlan> {
        self.offload.as_ref().map(|o| o.lock().unwrap_or_else(|e| e.into_inner()).plan().clone())
    }

    /// With offload: (CPU subgroups whose gradient already left for the host this step, CPU
    /// subgroups). After the last micro-batch's backward every one has, launched from the sinks.
    pub fn offload_grads_streamed(&self) -> Option<(usize, usize)> {
        self.offload.as_ref().map(|o| o.lock().unwrap_or_else(|e| e.into_inner()).grads_streamed())
    }

    fn offloaded_state(&self, bucket: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let off = self.offload.as_ref().ok_or_else(|| Error::new("zero", "the optimizer state is not offloaded"))?;
        off.lock().unwrap_or_else(|e| e.into_inner()).state(bucket)
    }

    /// Loads parameters and optimizer state given per parameter name as this rank's
    /// (tensor-parallel-local) tensors: `params[name]`, and `state["exp_avg.<name>"]`,
    /// `state["exp_avg_sq.<name>"]` (and `master.<name>`, else taken from the parameter)
    /// in AdamW's checkpoint names. Padding stays zero.
    pub fn load(&mut self, params: &dyn Fn(&str) -> Result<Tensor>, state: &dyn Fn(&str) -> Result<Tensor>, step: u64) -> Result<()> {
        let _g = no_grad();
        let (sp, so) = (self.spec.params, self.spec.optim);
        for (bi, (bk, sb)) in self.buckets.iter_mut().zip(&self.store.buckets).enumerate() {
            let n = bk.n;
            let dev = bk.flat.device();
            let build = |dtype: DType, get: &dyn Fn(&str) -> Result<Tensor>| -> Result<Tensor> {
                let flat = Tensor::zeros([n], dtype, dev)?;
                for s in &sb.slots {
                    flat.narrow(0, s.offset, s.numel())?.assign(&get(&s.name)?.reshape([s.numel()])?)?;
                }
                Ok(flat)
            };
            let p = build(self.dtype, params)?;
            bk.p_shard.assign(&p.narrow(0, self.groups.a * n / sp, n / sp)?)?;
            let (lo, len) = (self.groups.j * n / so, n / so);
            let m = build(DType::F32, &|name| state(&format!("exp_avg.{name}")))?;
            let v = build(DType::F32, &|name| state(&format!("exp_avg_sq.{name}")))?;
            if let Some(off) = &self.offload {
                let w = build(DType::F32, &|name| state(&format!("master.{name}")).or_else(|_| params(name)?.to_dtype(DType::F32)))?;
                let r = |t: &Tensor| t.narrow(0, lo, len)?.contiguous();
                off.lock().unwrap_or_else(|e| e.into_inner()).load(bi, &r(&w)?, &r(&m)?, &r(&v)?)?;
                continue;
            }
            bk.m.assign(&m.narrow(0, lo, len)?)?;
            bk.v.assign(&v.narrow(0, lo, len)?)?;
            if let Some(master) = &bk.master {
                let w = build(DType::F32, &|name| state(&format!("master.{name}")).or_else(|_| params(name)?.to_dtype(DType::F32)))?;
                master.assign(&w.narrow(0, lo, len)?)?;
            }
        }
        if let Some(g) = &self.gather {
            g.release_all(false)?; // stale gathered buckets
        }
        self.step = step;
        Ok(())
    }

    /// Bytes of model states this rank holds now: (parameters, gradients, optimizer states).
    /// Released parameter buckets count nothing; call it after the last backward of a step to
    /// see the gradients.
    /// The device of the model's parameters (where this engine's collectives run).
    pub fn device(&self) -> Device {
        self.buckets.first().map_or(Device::Cpu, |b| b.p_shard.device())
    }

    pub fn state_bytes(&self) -> (usize, usize, usize) {
        // Gradients: the range a rank accumulates into (n / s_g), held between micro-batches.
        let g: usize = self.buckets.iter().map(|b| b.n / self.spec.grads * self.dtype.size_in_bytes()).sum();
        let (mut p, mut o) = (0, 0);
        for bk in &self.buckets {
            p += bk.p_shard.storage_bytes();
            if self.spec.params > 1 && !bk.flat.is_released() {
                p += bk.flat.storage_bytes();
            }
            o += bk.m.storage_bytes() + bk.v.storage_bytes() + bk.master.as_ref().map_or(0, |t| t.storage_bytes());
        }
        (p, g, o)
    }

    /// Bytes of accumulated gradient ranges held right now (between micro-batches of a step).
    pub fn grad_bytes_held(&self) -> usize {
        let a = self.asm.lock().unwrap_or_else(|e| e.into_inner());
        a.buckets.iter().map(|b| b.acc.as_ref().map_or(0, |t| t.storage_bytes())).sum()
    }

    /// Parameter all-gathers per bucket per micro-batch when s_p > 1: one before the bucket's
    /// forward, one before (or prefetched for) its backward; a tied embedding, used again by
    /// the head at the end of the forward pass and in its backward, twice more. This is what
    /// the engine does (tests hold it to it) and what the planner's cost model charges.
    pub fn expected_gathers(spec: ShardSpec, buckets: usize, tied: bool) -> Vec<usize> {
        (0..buckets)
            .map(|i| {
                if spec.params == 1 {
                    0
                } else if i == 0 && tied && buckets > MAX_LIVE {
                    4
                } else {
                    2
                }
            })
            .collect()
    }

    /// Padded elements of each bucket.
    pub fn bucket_numel(&self) -> Vec<usize> {
        self.buckets.iter().map(|b| b.n).collect()
    }

    /// Parameter all-gathers each bucket has needed since the engine was built (0 when s_p = 1).
    pub fn gathers(&self) -> Vec<usize> {
        match &self.gather {
            Some(g) => g.state.lock().unwrap_or_else(|e| e.into_inner()).gathers.clone(),
            None => vec![0; self.buckets.len()],
        }
    }

    /// The communicators this engine uses (for traffic accounting), without duplicates.
    pub fn comms(&self) -> Vec<Comm> {
        let g = &self.groups;
        let mut out: Vec<Comm> = vec![g.p.clone()];
        for c in [&g.g, &g.os_sub, &g.os_rep, &g.block] {
            if !out.iter().any(|x| Arc::ptr_eq(x, c)) {
                out.push(c.clone());
            }
        }
        out
    }

    pub fn store(&self) -> &ParamStore {
        &self.store
    }
}

/// Launches a bucket's gradient reduction over G (kept whole when s_g = 1). In the last
/// micro-batch, chains the whole hand-over to the optimizer range behind it, without waiting:
/// the earlier micro-batches' sum is added when the next collective reads its input.
fn flush(b: &mut AsmBucket, groups: &Groups, spec: ShardSpec, last: bool, offload: Option<&Arc<Mutex<Offload>>>) -> Result<()> {
    let full = b.full.take().ok_or_else(|| Error::new("zero", "no gradient to flush"))?;
    b.arrived = 0;
    let r = if spec.grads > 1 { groups.g.reduce_scatter_async(&full, ReduceOp::Sum)?.tensor() } else { full };
    if !last {
        b.reduced.push(r);
        return Ok(());
    }
    let mut g = match b.acc.take() {
        None => r,
        Some(acc) => {
            let (shape, dtype, dev) = (r.shape().clone(), r.dtype(), r.device());
            crate::comm::deferred(shape, dtype, dev, move || acc.add(&r))?
        }
    };
    if spec.optim > spec.grads {
        g = reduce_scatter(&groups.os_sub, &g)?;
    }
    if groups.os_rep.size() > 1 {
        g = groups.os_rep.all_reduce_async(&g, ReduceOp::Sum)?.tensor();
    }
    if let Some(o) = offload {
        // DOS's asynchronous gradient flush: CPU subgroups' gradients leave for the host now,
        // behind the rest of the backward pass.
        o.lock().unwrap_or_else(|e| e.into_inner()).stream_grad(b.index, &g)?;
    }
    b.os_grad = Some(g);
    Ok(())
}

fn reduce_scatter(c: &Comm, x: &Tensor) -> Result<Tensor> {
    if c.size() == 1 {
        return Ok(x.clone());
    }
    Ok(c.reduce_scatter_async(x, ReduceOp::Sum)?.tensor())
}
