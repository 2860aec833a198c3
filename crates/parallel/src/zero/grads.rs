//! The gradient pipeline. A gradient sink copies each parameter's gradient into its bucket's
//! buffer the moment autograd has finished it, unless the op that computed it wrote it there in
//! place (each parameter offers its slice as its gradient destination, `Tensor::set_grad_dest`:
//! a linear layer's weight-gradient GEMM writes f32 straight into it, so neither a bf16 copy nor
//! a cast is made). The buffer is not zeroed first: every parameter's slice is written, and
//! what is not (the padding, a parameter that got no gradient) is zeroed on its own. A complete
//! bucket is reduce-scattered over G
//! (s_g ranks) at once, behind the rest of the backward pass, and its range accumulated over
//! the step's micro-batches, so a rank never holds more than 1/s_g of the gradients.
//!
//! In the step's last micro-batch a bucket's whole hand-over to the optimizer range is chained
//! behind its reduce-scatter without waiting: the earlier micro-batches' sum of this rank's range
//! is added to this rank's block of the reduce-scatter's input (so it is counted once in the
//! reduction), then a reduce-scatter over the OS sub-group narrows the range (s_os > s_g) and an
//! all-reduce over the replicas completes the sum. Each collective reads the previous one's
//! result in flight: it waits for it on its communication stream, never on the host. The optimizer state's
//! gradient-ready hook (offload's host stream) sees the result as soon as it is launched.
use super::groups::{Comm, ShardGroups};
use super::ShardSpec;
use crate::comm::ReduceOp;
use ferrolm_nn::buckets::ParamBuckets;
use ferrolm_nn::CausalLm;
use ferrolm_tensor::{no_grad, DType, Device, Error, Result, Tensor};
use std::sync::{Arc, Mutex, MutexGuard};

/// Called with (bucket, its optimizer-range gradient, possibly pending) when a bucket's
/// hand-over has been launched in the step's last micro-batch.
pub(crate) type GradReady = Arc<dyn Fn(usize, &Tensor) -> Result<()> + Send + Sync>;

/// One bucket's gradient on its way to the optimizer range.
struct BucketGrads {
    numel: usize,
    dtype: DType,
    device: Device,
    /// (numel) the gradients arrived in this micro-batch.
    full: Option<Tensor>,
    arrived: usize,
    expected: usize,
    /// Each parameter's (offset, shape) in the bucket.
    slots: Vec<(usize, Vec<usize>)>,
    /// Per parameter: its gradient arrived in this micro-batch.
    got: Vec<bool>,
    /// Per parameter: its slice was handed out as a gradient destination in this micro-batch
    /// (at most once: a second consumer of the parameter gets its gradient as a value).
    lent: Vec<bool>,
    /// Elements the parameters use; the rest of `numel` is padding, zero.
    used: usize,
    /// Reduced (possibly pending) ranges of this step's earlier micro-batches.
    reduced: Vec<Tensor>,
    /// (numel / s_g) the sum of the earlier micro-batches' ranges.
    acc: Option<Tensor>,
    /// (numel / s_os) after the last micro-batch: the gradient of this rank's optimizer range,
    /// summed over every data-parallel rank (pending while its collectives run).
    optim_grad: Option<Tensor>,
}

struct Assembly {
    buckets: Vec<BucketGrads>,
    /// The first failure inside a sink (sinks cannot return errors to autograd).
    error: Option<Error>,
    /// The backward pass running is the step's last micro-batch.
    last: bool,
    groups: Arc<ShardGroups>,
    spec: ShardSpec,
    grad_ready: Option<GradReady>,
    /// The dtype of the optimizer-range gradients last handed over (for tests and reports).
    handed_over: Option<DType>,
}

pub(crate) struct GradPipeline(Arc<Mutex<Assembly>>);

impl GradPipeline {
    /// Gradients are accumulated and reduced in `dtype` (f32 main-gradient buffers with
    /// low-precision parameters, or the parameter dtype).
    pub fn new(store: &ParamBuckets, groups: Arc<ShardGroups>, spec: ShardSpec, dtype: DType) -> GradPipeline {
        let buckets = store
            .buckets
            .iter()
            .map(|b| BucketGrads {
                numel: b.padded,
                dtype,
                device: b.flat.device(),
                full: None,
                arrived: 0,
                expected: b.slots.len(),
                slots: b.slots.iter().map(|s| (s.offset, s.shape.clone())).collect(),
                got: vec![false; b.slots.len()],
                lent: vec![false; b.slots.len()],
                used: b.numel,
                reduced: Vec::new(),
                acc: None,
                optim_grad: None,
            })
            .collect();
        GradPipeline(Arc::new(Mutex::new(Assembly { buckets, error: None, last: true, groups, spec, grad_ready: None, handed_over: None })))
    }

    fn lock(&self) -> MutexGuard<'_, Assembly> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Accumulates and reduces in `dtype` from the next micro-batch on (between steps only).
    pub fn set_dtype(&self, dtype: DType) {
        for b in self.lock().buckets.iter_mut() {
            b.dtype = dtype;
        }
    }

    pub fn set_grad_ready(&self, hook: Option<GradReady>) {
        self.lock().grad_ready = hook;
    }

    /// Each of `model`'s trainable parameters hands its gradient to its bucket's buffer (and offers its
    /// slice of it as the gradient's destination); the bucket is flushed when its last
    /// parameter's gradient arrives.
    pub fn install_sinks(&self, store: &ParamBuckets, model: &dyn CausalLm) -> Result<()> {
        let params: std::collections::HashMap<String, Tensor> = model.trainable_parameters().into_iter().map(|(n, t, _)| (n, t)).collect();
        for (bi, bk) in store.buckets.iter().enumerate() {
            for (si, s) in bk.slots.iter().enumerate() {
                let p = params.get(&s.name).ok_or_else(|| Error::new("zero", format!("parameter {} is not in the model", s.name)))?;
                let asm = self.0.clone();
                p.set_grad_sink(Some(Arc::new(move |grad: &Tensor| {
                    let mut a = asm.lock().unwrap_or_else(|e| e.into_inner());
                    if a.error.is_some() {
                        return;
                    }
                    if let Err(e) = a.arrive(bi, si, grad) {
                        a.error = Some(e);
                    }
                })));
                let asm = self.0.clone();
                p.set_grad_dest(Some(Arc::new(move || asm.lock().unwrap_or_else(|e| e.into_inner()).lend(bi, si))));
            }
        }
        Ok(())
    }

    /// Before a micro-batch's backward: whether it is the step's last.
    pub fn begin_backward(&self, last: bool) {
        self.lock().last = last;
    }

    /// After a micro-batch's backward: flushes buckets some parameter of which got no gradient,
    /// and accumulates the reduced ranges of a micro-batch before the last.
    pub fn end_backward(&self) -> Result<()> {
        let mut a = self.lock();
        if let Some(e) = a.error.take() {
            return Err(e);
        }
        for i in 0..a.buckets.len() {
            if a.buckets[i].full.is_some() {
                a.flush(i)?;
            }
            if !a.last && a.buckets[i].optim_grad.is_some() {
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
        Ok(())
    }

    /// After the last micro-batch: every bucket's optimizer-range gradient (summed over the
    /// data-parallel ranks, not yet averaged). A bucket that got no gradient hands over zeros.
    pub fn take_optim_grads(&self) -> Result<Vec<Tensor>> {
        let mut a = self.lock();
        let _g = no_grad();
        let mut out = Vec::with_capacity(a.buckets.len());
        for i in 0..a.buckets.len() {
            if a.buckets[i].optim_grad.is_none() {
                let b = &mut a.buckets[i];
                b.full = Some(Tensor::zeros([b.numel], b.dtype, b.device)?);
                b.got.iter_mut().for_each(|g| *g = true); // zeros already
                a.last = true;
                a.flush(i)?;
            }
            out.push(a.buckets[i].optim_grad.take().expect("flushed"));
        }
        a.handed_over = out.first().map(|t| t.dtype());
        Ok(out)
    }

    /// Forgets this step's gradients; returns the tensors still in flight, which the caller must
    /// wait for (every rank completes the collectives it launched).
    pub fn discard(&self) -> Vec<Tensor> {
        let mut a = self.lock();
        let mut out = Vec::new();
        for b in a.buckets.iter_mut() {
            b.full = None;
            b.arrived = 0;
            b.got.iter_mut().chain(b.lent.iter_mut()).for_each(|f| *f = false);
            out.append(&mut b.reduced);
            out.extend(b.acc.take());
            out.extend(b.optim_grad.take());
        }
        a.error = None;
        out
    }

    /// The dtype of the optimizer-range gradients the last step received (None before one).
    pub fn handed_over(&self) -> Option<DType> {
        self.lock().handed_over
    }

    /// Bytes of accumulated gradient ranges held now (between micro-batches of a step).
    pub fn bytes_held(&self) -> usize {
        self.lock().buckets.iter().map(|b| b.acc.as_ref().map_or(0, |t| t.storage_bytes())).sum()
    }
}

impl BucketGrads {
    /// This micro-batch's buffer, made on first use. Its values are unspecified but for the
    /// padding, zeroed here: every parameter's slice is written before the bucket is flushed.
    fn full(&mut self) -> Result<Tensor> {
        if let Some(f) = &self.full {
            return Ok(f.clone());
        }
        let _g = no_grad();
        let f = Tensor::empty([self.numel], self.dtype, self.device)?;
        if self.used < self.numel {
            let pad = self.numel - self.used;
            f.narrow(0, self.used, pad)?.assign(&Tensor::zeros([pad], self.dtype, self.device)?)?;
        }
        self.full = Some(f.clone());
        Ok(f)
    }

    /// Parameter `slot`'s range of the buffer, in its shape.
    fn slice(&mut self, slot: usize) -> Result<Tensor> {
        let (off, shape) = self.slots[slot].clone();
        let numel = shape.iter().product();
        self.full()?.narrow(0, off, numel)?.reshape(shape)
    }
}

impl Assembly {
    /// A parameter's gradient destination: its slice of the bucket's buffer, lent once per
    /// micro-batch, before its gradient arrived (`None` after, or after a failure).
    fn lend(&mut self, bucket: usize, slot: usize) -> Result<Option<Tensor>> {
        let b = &mut self.buckets[bucket];
        if self.error.is_some() || b.got[slot] || b.lent[slot] {
            return Ok(None);
        }
        b.lent[slot] = true;
        let _g = no_grad();
        b.slice(slot).map(Some)
    }

    /// A parameter's gradient: into its bucket's buffer (unless it was written there in
    /// place); the bucket flushes when complete.
    fn arrive(&mut self, bucket: usize, slot: usize, grad: &Tensor) -> Result<()> {
        let b = &mut self.buckets[bucket];
        if b.got[slot] {
            return Err(Error::new("zero", format!("bucket {bucket}: parameter {slot}'s gradient arrived twice in one backward pass")));
        }
        let dst = b.slice(slot)?;
        if !grad.same_view(&dst) {
            dst.assign(grad)?;
        }
        b.got[slot] = true;
        b.arrived += 1;
        if b.arrived == b.expected {
            self.flush(bucket)?;
        }
        Ok(())
    }

    /// Launches bucket `i`'s reduce-scatter over G (kept whole when s_g = 1); in the last
    /// micro-batch chains the hand-over to the optimizer range behind it (module comment).
    fn flush(&mut self, i: usize) -> Result<()> {
        let (g_comm, spec, last) = (&self.groups.grads, self.spec, self.last);
        let b = &mut self.buckets[i];
        if b.full.is_none() {
            return Err(Error::new("zero", "no gradient to flush"));
        }
        // Parameters that got no gradient in this micro-batch contribute zeros.
        for s in 0..b.slots.len() {
            if !b.got[s] {
                let _g = no_grad();
                let dst = b.slice(s)?;
                dst.assign(&Tensor::zeros(dst.shape().clone(), b.dtype, b.device)?)?;
            }
        }
        let mut full = b.full.take().expect("checked above");
        b.arrived = 0;
        b.got.iter_mut().chain(b.lent.iter_mut()).for_each(|f| *f = false);
        if last {
            if let Some(acc) = b.acc.take() {
                // The earlier micro-batches' sum of this rank's range joins the reduction: added
                // to this rank's block of its input, it is counted once in that block's sum. The
                // result is then the collective's own, and the collectives after it chain on
                // the communication stream (nothing in between for the host to wait for).
                let _g = no_grad();
                if spec.grads > 1 {
                    let len = b.numel / spec.grads;
                    let mine = full.narrow(0, g_comm.rank() * len, len)?;
                    mine.assign(&mine.add(&acc)?)?;
                } else {
                    full = full.add(&acc)?;
                }
            }
        }
        let _site = crate::comm::call_site(|| format!("bucket {i}, gradient reduce-scatter (last micro-batch: {last})"));
        let r = if spec.grads > 1 { g_comm.reduce_scatter_async(&full, ReduceOp::Sum)?.tensor() } else { full };
        if !last {
            b.reduced.push(r);
            return Ok(());
        }
        let mut g = r;
        if spec.optim > spec.grads {
            let _site = crate::comm::call_site(|| format!("bucket {i}, optimizer-range reduce-scatter"));
            g = reduce_scatter(&self.groups.optim_sub, &g)?;
        }
        if self.groups.optim_replicas.size() > 1 {
            let _site = crate::comm::call_site(|| format!("bucket {i}, replica all-reduce"));
            g = self.groups.optim_replicas.all_reduce_async(&g, ReduceOp::Sum)?.tensor();
        }
        if let Some(hook) = &self.grad_ready {
            hook(i, &g)?;
        }
        self.buckets[i].optim_grad = Some(g);
        Ok(())
    }
}

fn reduce_scatter(c: &Comm, x: &Tensor) -> Result<Tensor> {
    if c.size() == 1 {
        return Ok(x.clone());
    }
    Ok(c.reduce_scatter_async(x, ReduceOp::Sum)?.tensor())
}
