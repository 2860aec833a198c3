//! `Tensor`: a strided view of shared storage, plus the autograd links of the op that made it.
pub use crate::autograd::Hook;
use crate::autograd::{self, Node};
use crate::backend::{self, Backend, View};
use crate::storage::StorageCell;
use crate::{bail, CpuStorage, DType, Device, Error, Layout, Result, Shape, Storage};
use half::bf16;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

pub struct TensorInner {
    pub(crate) id: usize,
    pub(crate) storage: Arc<StorageCell>,
    pub(crate) layout: Layout,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    /// Leaf flag: this tensor wants a `.grad()` (parameters). Op outputs use `grad_fn` instead.
    pub(crate) leaf_requires_grad: AtomicBool,
    pub(crate) grad_fn: Option<Arc<Node>>,
    pub(crate) grad: Mutex<Option<Tensor>>,
    pub(crate) hooks: Mutex<Vec<Hook>>,
    /// Takes the leaf's final gradient instead of `.grad()` (see `set_grad_sink`).
    pub(crate) sink: Mutex<Option<Hook>>,
    /// Where an op may write the leaf's gradient in place (see `set_grad_dest`).
    pub(crate) dest: Mutex<Option<autograd::GradDest>>,
}

/// A cheap handle (an `Arc`): clones share storage, layout and gradient.
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<TensorInner>);

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({:?}, {}, {})", self.shape(), self.dtype(), self.device())
    }
}

/// Rust element types that map to a `DType`.
pub trait Element: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    fn into_storage(v: Vec<Self>) -> CpuStorage;
    fn from_storage(s: CpuStorage) -> Option<Vec<Self>>;
}
macro_rules! element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn into_storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$d(v)
            }
            fn from_storage(s: CpuStorage) -> Option<Vec<Self>> {
                match s {
                    CpuStorage::$d(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
element!(f32, F32);
element!(f64, F64);
element!(bf16, BF16);
element!(i32, I32);

impl Tensor {
    // ---- construction ----------------------------------------------------------------------

    /// A tensor over `storage` (a cell shared by its views) with no gradient yet.
    fn from_cell(storage: Arc<StorageCell>, layout: Layout, dtype: DType, device: Device, node: Option<Arc<Node>>) -> Tensor {
        Tensor(Arc::new(TensorInner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            storage,
            layout,
            dtype,
            device,
            leaf_requires_grad: AtomicBool::new(false),
            grad_fn: node,
            grad: Mutex::new(None),
            hooks: Mutex::new(Vec::new()),
            sink: Mutex::new(None),
            dest: Mutex::new(None),
        }))
    }

    pub(crate) fn from_storage(storage: Storage, layout: Layout, node: Option<Arc<Node>>) -> Tensor {
        let (dtype, device) = (storage.dtype(), storage.device());
        Tensor::from_cell(Arc::new(StorageCell::new(storage)), layout, dtype, device, node)
    }

    /// A contiguous tensor of `shape` over `storage` (for ops defined outside this crate, which
    /// make their output storage themselves and wrap it with `from_op`).
    pub fn new(storage: Storage, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if storage.len() != shape.numel() {
            bail!("Tensor::new", "{} elements do not fill shape {:?}", storage.len(), shape);
        }
        Ok(Tensor::from_storage(storage, Layout::contiguous(shape), None))
    }

    /// A new view of this tensor's storage (no copy), recorded as an op when grads flow.
    pub(crate) fn view(&self, layout: Layout, node: Option<Arc<Node>>) -> Tensor {
        Tensor::from_cell(self.0.storage.clone(), layout, self.0.dtype, self.0.device, node)
    }

    /// A tensor whose bytes are still being produced (by a collective in flight): `storage`
    /// is the already-allocated result buffer, `fill` completes it. Nothing waits until the
    /// first read of the storage (an op using the value, a host copy), which runs `fill` once.
    pub fn pending(storage: Storage, shape: impl Into<Shape>, fill: crate::storage::Fill) -> Result<Tensor> {
        Self::pending_from(storage, shape, fill, None)
    }

    /// As `pending`, naming what produces the bytes when `producer` is given: a consumer that
    /// understands it (a collective on a communication stream) may chain behind it instead of
    /// reading it.
    pub fn pending_from(
        storage: Storage,
        shape: impl Into<Shape>,
        fill: crate::storage::Fill,
        producer: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> Result<Tensor> {
        let shape = shape.into();
        if storage.len() != shape.numel() {
            bail!("pending", "{} elements do not fill shape {:?}", storage.len(), shape);
        }
        let (dtype, device) = (storage.dtype(), storage.device());
        let cell = StorageCell::pending_from(storage, fill, producer);
        Ok(Tensor::from_cell(Arc::new(cell), Layout::contiguous(shape), dtype, device, None))
    }

    /// The producer named by `pending_from`, while the bytes are still pending and this tensor
    /// views all of them in order (None otherwise: the consumer reads the tensor as usual).
    pub fn pending_producer(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        let l = &self.0.layout;
        if l.offset != 0 || !l.is_contiguous() || l.numel() != self.0.storage.numel() {
            return None;
        }
        self.0.storage.pending_producer()
    }

    /// A tensor computed by `f` when it is first read: work that need not happen where it is
    /// written (a weight gradient, deferred so that a collective launched before it can run
    /// meanwhile). The autograd engine runs such work when everything else ready is waiting
    /// on communication.
    pub fn deferred(
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
        f: impl FnOnce() -> Result<Tensor> + Send + 'static,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let placeholder = Storage::Cpu(CpuStorage::zeros(0, dtype));
        let n = shape.numel();
        let fill: crate::storage::Fill = Box::new(move |s| {
            let t = f()?;
            if t.numel() != n || t.dtype() != dtype || t.device() != device {
                bail!("deferred", "computed {:?} {} on {}, promised {n} {dtype} elements on {device}", t.shape(), t.dtype(), t.device());
            }
            *s = t.storage_copy()?;
            Ok(())
        });
        // The cell promises the result's size; the placeholder is replaced by the fill.
        let cell = StorageCell::local_pending(placeholder, fill);
        Ok(Tensor::from_cell(Arc::new(cell.promising(n)), Layout::contiguous(shape), dtype, device, None))
    }

    /// True while this tensor's storage is still being computed locally (see `deferred`).
    pub fn is_deferred(&self) -> bool {
        self.0.storage.is_local_pending()
    }

    /// True while this tensor's storage is still being produced (see `pending`); false once it
    /// is ready, failed or released.
    pub fn is_pending(&self) -> bool {
        self.0.storage.is_pending()
    }

    /// Drops this tensor's bytes (shared by all its views) until the next read, which calls
    /// `refill`, unless `prefetch` brings them back first. For sharded parameters between uses.
    pub fn release(&self, refill: std::sync::Arc<dyn crate::storage::Refill>) -> Result<()> {
        self.0.storage.release(refill)
    }
    /// As `release`, but only when the bytes are not in use at this moment; false otherwise.
    pub fn try_release(&self, refill: std::sync::Arc<dyn crate::storage::Refill>) -> Result<bool> {
        self.0.storage.try_release(refill)
    }
    /// True while the bytes are released.
    pub fn is_released(&self) -> bool {
        self.0.storage.is_released()
    }
    /// Starts bringing released bytes back (`fill` produces them at the next read); false
    /// when they are not released.
    pub fn prefetch(&self, fill: crate::storage::Fill) -> Result<bool> {
        self.0.storage.prefetch(fill)
    }

    /// A copy with its own storage (contiguous), even when this tensor is already contiguous
    /// (`contiguous()` returns a view then). No autograd history.
    pub fn deep_copy(&self) -> Result<Tensor> {
        Ok(Tensor::from_storage(self.storage_copy()?, Layout::contiguous(self.shape().clone()), None))
    }

    /// A fresh contiguous copy of this tensor's elements as storage on its own device.
    pub fn storage_copy(&self) -> Result<Storage> {
        let b = self.backend("storage_copy")?;
        self.with_storage(|x| b.copy_strided(x))
    }

    /// Waits until a pending value is complete (a no-op otherwise). Reading does this anyway;
    /// call it to surface a collective's error or to bound where the wait happens.
    pub fn wait(&self) -> Result<()> {
        self.0.storage.resolve()
    }

    /// Wraps `out` as the result of a custom differentiable op over `inputs` (for ops defined
    /// outside this crate, such as collectives): `backward` maps the output gradient to one
    /// optional gradient per input. Nothing is recorded under `no_grad` or when no input
    /// requires grad. The gradients it returns may themselves be pending.
    pub fn from_op(out: Tensor, name: &'static str, inputs: &[&Tensor], backward: crate::autograd::BackwardFn) -> Tensor {
        Tensor::record(out, name, inputs, backward)
    }
    /// As `from_op`, with a backward that also takes what the engine offers (`GradCtx`): the
    /// gradient an input has so far, to add into its own result, and a leaf's destination.
    pub fn from_op_ctx(out: Tensor, name: &'static str, inputs: &[&Tensor], backward: crate::autograd::CtxBackwardFn) -> Tensor {
        Tensor::record_node(out, name, inputs, crate::autograd::Backward::Ctx(backward))
    }

    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            bail!("from_vec", "{} elements do not fill shape {:?} ({} elements)", data.len(), shape, shape.numel());
        }
        Self::from_cpu_storage(T::into_storage(data), shape, device)
    }

    pub fn from_cpu_storage(s: CpuStorage, shape: Shape, device: Device) -> Result<Tensor> {
        if s.len() != shape.numel() {
            bail!("from_cpu_storage", "{} elements do not fill shape {:?}", s.len(), shape);
        }
        let st = backend::get("from_vec", device)?.from_cpu(&s)?;
        Ok(Tensor::from_storage(st, Layout::contiguous(shape), None))
    }

    pub fn full(shape: impl Into<Shape>, v: f64, dtype: DType, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        let st = backend::get("full", device)?.full(shape.numel(), dtype, v)?;
        Ok(Tensor::from_storage(st, Layout::contiguous(shape), None))
    }
    /// A tensor whose values are unspecified (a device's fresh memory; zeros on the CPU): for
    /// a buffer every element of which is written before any is read.
    pub fn empty(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        let st = backend::get("empty", device)?.empty(shape.numel(), dtype)?;
        Ok(Tensor::from_storage(st, Layout::contiguous(shape), None))
    }
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Self::full(shape, 0.0, dtype, device)
    }
    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Self::full(shape, 1.0, dtype, device)
    }
    pub fn zeros_like(&self) -> Result<Tensor> {
        Self::zeros(self.shape().clone(), self.dtype(), self.device())
    }
    pub fn scalar(v: f64, dtype: DType, device: Device) -> Result<Tensor> {
        Self::full((), v, dtype, device)
    }
    /// Normal(0, std) samples from `rng`, drawn in f64 and rounded to `dtype`.
    pub fn randn(shape: impl Into<Shape>, std: f64, dtype: DType, device: Device, rng: &mut crate::Rng) -> Result<Tensor> {
        let shape = shape.into();
        let v: Vec<f64> = (0..shape.numel()).map(|_| rng.normal() * std).collect();
        Tensor::from_vec(v, shape, Device::Cpu)?.to_dtype(dtype)?.to_device(device)
    }
    /// Uniform samples in [lo, hi).
    pub fn rand_uniform(shape: impl Into<Shape>, lo: f64, hi: f64, dtype: DType, device: Device, rng: &mut crate::Rng) -> Result<Tensor> {
        let shape = shape.into();
        let v: Vec<f64> = (0..shape.numel()).map(|_| lo + (hi - lo) * rng.uniform()).collect();
        Tensor::from_vec(v, shape, Device::Cpu)?.to_dtype(dtype)?.to_device(device)
    }

    // ---- accessors -------------------------------------------------------------------------

    pub fn id(&self) -> usize {
        self.0.id
    }
    pub fn shape(&self) -> &Shape {
        &self.0.layout.shape
    }
    pub fn dims(&self) -> &[usize] {
        self.0.layout.dims()
    }
    pub fn dim(&self, d: usize) -> usize {
        self.dims()[d]
    }
    pub fn rank(&self) -> usize {
        self.shape().rank()
    }
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    pub fn device(&self) -> Device {
        self.0.device
    }
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    /// True when both tensors view the same storage.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }
    pub fn storage_bytes(&self) -> usize {
        self.0.storage.bytes()
    }
    pub(crate) fn backend(&self, op: &str) -> Result<Arc<dyn Backend>> {
        backend::get(op, self.device())
    }
    /// Runs `f` with this tensor's storage and layout (read lock held).
    /// Waits first if the storage is pending (a collective still producing it).
    pub fn with_storage<R>(&self, f: impl FnOnce(View) -> Result<R>) -> Result<R> {
        let g = self.0.storage.read()?;
        f((&g, &self.0.layout))
    }
    /// Runs `f` with the storages and layouts of `ts`, in order, under one read lock per
    /// distinct storage (views of one storage share it). Waits for pending storage first.
    pub fn with_storages<R>(ts: &[&Tensor], f: impl FnOnce(&[View]) -> Result<R>) -> Result<R> {
        crate::optim_ops::with_views(ts, f)
    }

    // ---- autograd surface ------------------------------------------------------------------

    pub fn requires_grad(&self) -> bool {
        self.0.grad_fn.is_some() || self.0.leaf_requires_grad.load(Ordering::Relaxed)
    }
    pub fn is_leaf(&self) -> bool {
        self.0.grad_fn.is_none()
    }
    /// Marks a leaf as a variable whose gradient `backward` accumulates.
    pub fn set_requires_grad(&self, on: bool) -> Result<&Tensor> {
        if !self.is_leaf() {
            bail!("set_requires_grad", "only leaf tensors can change requires_grad; detach() first");
        }
        if on && !self.dtype().is_float() {
            bail!("set_requires_grad", "only float tensors can require grad, this one is {}", self.dtype());
        }
        self.0.leaf_requires_grad.store(on, Ordering::Relaxed);
        Ok(self)
    }
    /// The accumulated gradient of a leaf, if any backward reached it.
    pub fn grad(&self) -> Option<Tensor> {
        self.0.grad.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    pub fn set_grad(&self, g: Option<Tensor>) {
        *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = g;
    }
    pub fn zero_grad(&self) {
        self.set_grad(None);
    }
    /// Same storage, no history: a leaf that does not require grad.
    pub fn detach(&self) -> Tensor {
        self.view(self.0.layout.clone(), None)
    }
    /// Calls `f(grad)` once per backward pass, as soon as this leaf's gradient is final
    /// (after accumulation). Collectives and host copies launch from here while backward goes on.
    pub fn register_hook(&self, f: impl Fn(&Tensor) + Send + Sync + 'static) {
        self.0.hooks.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::new(f));
    }
    /// Hands this leaf's gradient to `f` once per backward pass, when it is final, instead of
    /// accumulating it into `.grad()` (hooks do not run). A sharding engine reduces it and
    /// keeps only its shard, so no full gradient outlives its bucket. `None` restores `.grad()`.
    pub fn set_grad_sink(&self, f: Option<Hook>) {
        *self.0.sink.lock().unwrap_or_else(|e| e.into_inner()) = f;
    }

    /// Offers ops a place to write this leaf's gradient in place: when an op that can (a
    /// linear layer's weight-gradient GEMM) is this leaf's only consumer in a backward pass, it
    /// asks `f` for a dense view of the leaf's shape (any float dtype, typically the leaf's
    /// slice of an f32 gradient bucket), writes the gradient there and hands that view to the
    /// sink, which can tell it arrived in place (`same_view`). `f` may answer `None`. `None`
    /// here withdraws the offer. Without a sink the offer is taken only while `.grad()` is
    /// empty (a gradient accumulated over passes is never overwritten).
    pub fn set_grad_dest(&self, f: Option<autograd::GradDest>) {
        *self.0.dest.lock().unwrap_or_else(|e| e.into_inner()) = f;
    }
    /// The destination `set_grad_dest` offers, asked for by an op that computes this leaf's
    /// gradient in its forward (the fused LM head + loss: its chunks' weight-gradient GEMMs
    /// accumulate into it). The op must return that view as the leaf's gradient from its backward
    /// in the same pass: the sink then sees it arrive in place, and any other consumer's
    /// contribution is added to it by the engine before the sink copies the sum. `None`: not a
    /// leaf that requires grad, no offer, or (without a sink) a `.grad()` already holding a
    /// gradient that must not be overwritten.
    pub fn grad_dest(&self) -> Result<Option<Tensor>> {
        if !self.is_leaf() || !self.requires_grad() {
            return Ok(None);
        }
        let fresh = self.0.sink.lock().unwrap_or_else(|e| e.into_inner()).is_some() || self.grad().is_none();
        let offer = self.0.dest.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(d) = offer.filter(|_| fresh).map(|f| f()).transpose()?.flatten() else { return Ok(None) };
        if d.shape() != self.shape() || !d.is_contiguous() || !d.dtype().is_float() || d.device() != self.device() {
            bail!(
                "grad_dest",
                "the destination offered is {:?} {} on {}, not a dense float view of {:?}",
                d.shape(),
                d.dtype(),
                d.device(),
                self.shape()
            );
        }
        Ok(Some(d))
    }
    /// True when both tensors are the same elements of the same storage (same offset, shape
    /// and strides).
    pub fn same_view(&self, other: &Tensor) -> bool {
        self.shares_storage(other) && self.0.layout == other.0.layout
    }

    pub fn backward(&self) -> Result<()> {
        autograd::backward(self)
    }

    // ---- host transfer ---------------------------------------------------------------------

    /// Contiguous host copy of the elements, as the tensor's own dtype.
    pub fn to_cpu_storage(&self) -> Result<CpuStorage> {
        let b = self.backend("to_cpu")?;
        self.with_storage(|x| b.to_cpu(x))
    }
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            bail!("to_vec", "tensor is {}, asked for {}", self.dtype(), T::DTYPE);
        }
        T::from_storage(self.to_cpu_storage()?).ok_or_else(|| Error::new("to_vec", "dtype mismatch"))
    }
    /// The elements in row-major order as f32, on the host (converted after the copy, so it
    /// works on every device, including CUDA, which has no f64).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        Ok(match self.to_cpu_storage()? {
            CpuStorage::F32(v) => v,
            CpuStorage::BF16(v) => v.into_iter().map(f32::from).collect(),
            CpuStorage::F64(v) => v.into_iter().map(|x| x as f32).collect(),
            CpuStorage::I32(v) => v.into_iter().map(|x| x as f32).collect(),
        })
    }
    /// The elements in row-major order as f64, on the host (see `to_vec_f32`).
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        Ok(match self.to_cpu_storage()? {
            CpuStorage::F64(v) => v,
            CpuStorage::F32(v) => v.into_iter().map(f64::from).collect(),
            CpuStorage::BF16(v) => v.into_iter().map(f64::from).collect(),
            CpuStorage::I32(v) => v.into_iter().map(f64::from).collect(),
        })
    }
    /// The single value of a one-element tensor.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            bail!("item", "tensor of shape {:?} has {} elements, not 1", self.shape(), self.numel());
        }
        Ok(self.to_vec_f64()?[0])
    }

    /// In place (no autograd): copies `src` (same shape; dtype converted, device must match).
    pub fn assign(&self, src: &Tensor) -> Result<()> {
        if src.shape() != self.shape() {
            bail!("assign", "shape mismatch: destination {:?} source {:?}", self.shape(), src.shape());
        }
        if src.device() != self.device() {
            bail!("assign", "device mismatch: destination {} source {}", self.device(), src.device());
        }
        let b = self.backend("assign")?;
        if src.dtype() != self.dtype() && !Arc::ptr_eq(&src.0.storage, &self.0.storage) {
            let sg = src.0.storage.read()?;
            if b.assign_cast(&mut *self.0.storage.write()?, &self.0.layout, (&sg, &src.0.layout))? {
                return Ok(());
            }
        }
        let src = if src.dtype() != self.dtype() {
            let _g = autograd::no_grad();
            src.to_dtype(self.dtype())?
        } else {
            src.clone()
        };
        if Arc::ptr_eq(&src.0.storage, &self.0.storage) {
            let copy = src.with_storage(|x| b.copy_strided(x))?;
            let l = Layout::contiguous(src.shape().clone());
            return b.assign(&mut *self.0.storage.write()?, &self.0.layout, (&copy, &l));
        }
        let sg = src.0.storage.read()?;
        b.assign(&mut *self.0.storage.write()?, &self.0.layout, (&sg, &src.0.layout))
    }
}
