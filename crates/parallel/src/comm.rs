//! The communicator contract: `Communicator` (collectives over a group of ranks), `Work` (a
//! collective's result as a pending tensor), `ReduceOp`, byte counters and options.
//!
//! A collective is functional: it reads its input tensor (made contiguous first) and returns a
//! new tensor. Its input must not be modified in place until the result has been read, as with
//! NCCL. Results are pending tensors (`Tensor::pending`): code that only passes them along never
//! waits; the first read waits (or, on a GPU, orders the compute stream after the collective).
use crate::cost::{self, Kind};
use ferrolm_cuda::CudaBackend;
use ferrolm_tensor::backend::Backend;
use ferrolm_tensor::{bail, CpuStorage, DType, Device, DeviceStorage, Error, Result, Shape, Storage, Tensor};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A shared communicator: how every group, engine and layer holds one.
pub type Comm = Arc<dyn Communicator>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size (in the accumulation precision, rounded once).
    Avg,
    Max,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
        })
    }
}

/// One collective with its arguments (what every rank must agree on).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    AllReduce(ReduceOp),
    /// Concatenation of every rank's tensor along dim 0, in rank order.
    AllGather,
    /// Reduction of the ranks' tensors, of which rank r keeps block r of dim 0.
    ReduceScatter(ReduceOp),
    Broadcast {
        root: usize,
    },
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Collective::AllReduce(op) => write!(f, "all_reduce({op})"),
            Collective::AllGather => f.write_str("all_gather"),
            Collective::ReduceScatter(op) => write!(f, "reduce_scatter({op})"),
            Collective::Broadcast { root } => write!(f, "broadcast(root {root})"),
        }
    }
}

impl Collective {
    pub fn kind(&self) -> Kind {
        match self {
            Collective::AllReduce(_) => Kind::AllReduce,
            Collective::AllGather => Kind::AllGather,
            Collective::ReduceScatter(_) => Kind::ReduceScatter,
            Collective::Broadcast { .. } => Kind::Broadcast,
        }
    }

    /// The result's shape on a group of `n` ranks for an input of `shape`, or an error saying
    /// why the input does not fit (checked on each rank before anything is sent).
    pub fn output_shape(&self, shape: &Shape, n: usize) -> Result<Shape> {
        let op = self.to_string();
        let dims = shape.dims();
        match self {
            Collective::AllGather | Collective::ReduceScatter(_) if dims.is_empty() => {
                bail!(op, "needs a tensor with a dim 0 to gather or scatter along, got a scalar")
            }
            Collective::AllGather => {
                let mut d = dims.to_vec();
                d[0] *= n;
                Ok(Shape(d))
            }
            Collective::ReduceScatter(_) => {
                if !dims[0].is_multiple_of(n) {
                    bail!(op, "dim 0 of shape {dims:?} is not divisible by the group size {n}");
                }
                let mut d = dims.to_vec();
                d[0] /= n;
                Ok(Shape(d))
            }
            Collective::Broadcast { root } if *root >= n => bail!(op, "root {root} is not a rank of a group of {n}"),
            _ => Ok(shape.clone()),
        }
    }

    /// Bytes of the full tensor (the `total` of `cost`) for an input of `input_bytes`.
    pub fn total_bytes(&self, input_bytes: usize, n: usize) -> f64 {
        match self {
            Collective::AllGather => (input_bytes * n) as f64,
            _ => input_bytes as f64,
        }
    }

    /// Checks the reduce op against the dtype (averaging integers is refused, not truncated).
    pub(crate) fn check_dtype(&self, dtype: DType) -> Result<()> {
        if let Collective::AllReduce(ReduceOp::Avg) | Collective::ReduceScatter(ReduceOp::Avg) = self {
            if !dtype.is_float() {
                bail!(self.to_string(), "cannot average {dtype} tensors");
            }
        }
        Ok(())
    }
}

/// Per-communicator settings.
#[derive(Clone, Debug, PartialEq)]
pub struct CommOptions {
    /// How long a collective may wait for the other ranks before it fails (default 10 minutes).
    pub timeout: Duration,
    /// Thread ranks only: wait for a pending input on the launching thread, as NCCL does (see
    /// `thread::ENV_CALLER_RESOLVE`, which turns it on too). Default off.
    pub caller_resolve: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions { timeout: Duration::from_secs(600), caller_resolve: false }
    }
}

impl CommOptions {
    /// The defaults, with `FERROLM_COMM_TIMEOUT_S` (seconds, may be fractional) overriding the
    /// timeout when set.
    pub fn from_env() -> Result<CommOptions> {
        let mut o = CommOptions::default();
        if let Ok(v) = std::env::var("FERROLM_COMM_TIMEOUT_S") {
            let s: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s > 0.0)
                .ok_or_else(|| Error::new("comm", format!("FERROLM_COMM_TIMEOUT_S={v:?} is not a positive number of seconds")))?;
            o.timeout = Duration::from_secs_f64(s);
        }
        Ok(o)
    }
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
    pub fn with_caller_resolve(mut self, on: bool) -> Self {
        self.caller_resolve = on;
        self
    }
}

/// Calls and bytes sent for one kind of collective.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KindStats {
    pub calls: u64,
    /// Bytes this rank sent under the ring accounting of `cost` (`cost::bytes_sent`).
    pub bytes: f64,
}

/// What one rank has sent through one communicator (counted at launch).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommStats {
    pub all_reduce: KindStats,
    pub all_gather: KindStats,
    pub reduce_scatter: KindStats,
    pub broadcast: KindStats,
}

impl CommStats {
    pub fn total_bytes(&self) -> f64 {
        self.all_reduce.bytes + self.all_gather.bytes + self.reduce_scatter.bytes + self.broadcast.bytes
    }
    pub fn get(&self, kind: Kind) -> KindStats {
        match kind {
            Kind::AllReduce => self.all_reduce,
            Kind::AllGather => self.all_gather,
            Kind::ReduceScatter => self.reduce_scatter,
            Kind::Broadcast => self.broadcast,
        }
    }
    /// Collectives launched, of every kind.
    pub fn calls(&self) -> u64 {
        self.all_reduce.calls + self.all_gather.calls + self.reduce_scatter.calls + self.broadcast.calls
    }
    /// What was launched since `earlier` (a snapshot of the same counters).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let d = |a: KindStats, b: KindStats| KindStats { calls: a.calls - b.calls, bytes: a.bytes - b.bytes };
        CommStats {
            all_reduce: d(self.all_reduce, earlier.all_reduce),
            all_gather: d(self.all_gather, earlier.all_gather),
            reduce_scatter: d(self.reduce_scatter, earlier.reduce_scatter),
            broadcast: d(self.broadcast, earlier.broadcast),
        }
    }
    /// Counts one collective of `op` launched by `rank` of `n` on an input of `input_bytes`.
    pub fn record(&mut self, op: Collective, n: usize, rank: usize, input_bytes: usize) {
        let root = if let Collective::Broadcast { root } = op { root } else { 0 };
        let b = cost::bytes_sent(op.kind(), n, rank, root, op.total_bytes(input_bytes, n));
        let k = match op.kind() {
            Kind::AllReduce => &mut self.all_reduce,
            Kind::AllGather => &mut self.all_gather,
            Kind::ReduceScatter => &mut self.reduce_scatter,
            Kind::Broadcast => &mut self.broadcast,
        };
        k.calls += 1;
        k.bytes += b;
    }
}

type WaitFn = Box<dyn FnOnce() -> Result<Storage> + Send>;
type PollFn = Arc<dyn Fn() -> bool + Send + Sync>;
/// What a communicator knows about a result in flight, so that a later collective reading it
/// (on this or another communicator of the same kind) can chain behind it on its own stream
/// instead of waiting for it where it is launched (`Tensor::pending_producer`). Always an
/// `Arc<InFlightResult>`.
pub(crate) type Producer = Arc<dyn std::any::Any + Send + Sync>;

/// A collective's result still in flight, as a later collective may consume it.
pub(crate) enum InFlightResult {
    /// Thread ranks: blocks (on the consuming communicator's thread) until the host copy of the
    /// result is there and returns it; None once the producer's slot is gone (the result has
    /// been read, so reading the tensor no longer waits).
    Host(Box<dyn Fn() -> Result<Option<CpuStorage>> + Send + Sync>),
    /// A result whose wait is communication (a simulated link's delay): a communication thread
    /// may wait for it, the launching thread need not.
    Comm,
    /// NCCL: the result's device buffer (`ptr`, alive while the pending tensor is) is complete
    /// when `event`, recorded on the producing communication stream, fires.
    Device { event: Arc<ferrolm_cuda::CudaEvent>, ptr: u64 },
}

impl InFlightResult {
    pub(crate) fn producer(self) -> Producer {
        Arc::new(self)
    }
    /// The in-flight collective result `x` is, if it is one (pending, viewed whole).
    pub(crate) fn of(x: &Tensor) -> Option<Arc<InFlightResult>> {
        x.pending_producer()?.downcast::<InFlightResult>().ok()
    }
    /// The completion event and result buffer of the NCCL collective whose result in flight `x`
    /// is (`Device`), if it is one.
    pub(crate) fn device_of(x: &Tensor) -> Option<(Arc<ferrolm_cuda::CudaEvent>, u64)> {
        match InFlightResult::of(x).as_deref() {
            Some(InFlightResult::Device { event, ptr }) => Some((event.clone(), *ptr)),
            _ => None,
        }
    }
}

/// A launched collective before it becomes a tensor: the result's shape, dtype and device, a
/// `wait` that returns the result storage (blocking on the CPU; on a GPU it only orders the
/// compute stream), and a `poll` that says whether it has completed. Wrappers such as `SimLink`
/// compose these before a `Work` is made.
pub struct Completion {
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    pub(crate) wait: WaitFn,
    pub(crate) poll: PollFn,
    /// Set by the communicator that launched the collective (see `Producer`).
    pub(crate) producer: Option<Producer>,
}

impl Completion {
    pub fn new(
        shape: Shape,
        dtype: DType,
        device: Device,
        wait: impl FnOnce() -> Result<Storage> + Send + 'static,
        poll: impl Fn() -> bool + Send + Sync + 'static,
    ) -> Self {
        Completion { shape, dtype, device, wait: Box::new(wait), poll: Arc::new(poll), producer: None }
    }
    /// Names what produces the result, for collectives that chain behind it.
    pub(crate) fn produced_by(mut self, p: Producer) -> Self {
        self.producer = Some(p);
        self
    }
    /// Runs `after` on the result inside `wait` (a delay, a conversion); `done` refines `poll`.
    /// The result is then no longer the collective's own: later collectives read it instead of
    /// chaining behind the collective.
    pub fn then(
        self,
        after: impl FnOnce(Storage) -> Result<Storage> + Send + 'static,
        done: impl Fn() -> bool + Send + Sync + 'static,
    ) -> Self {
        let (wait, poll) = (self.wait, self.poll);
        Completion { wait: Box::new(move || after(wait()?)), poll: Arc::new(move || poll() && done()), producer: None, ..self }
    }
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
}

/// Stands in for a result buffer until the collective's `wait` hands over the real storage, so
/// a pending tensor owns no memory that a collective is still writing (the in-flight buffer
/// stays with the collective, which orders its release; see nccl.rs).
#[derive(Debug)]
struct InFlight {
    dtype: DType,
    len: usize,
    device: Device,
}

impl DeviceStorage for InFlight {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device(&self) -> Device {
        self.device
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// A collective in flight. Its result is a pending tensor: `tensor()` hands it out without
/// waiting, and it is waited on where it is first read (or by `wait()`).
pub struct Work {
    tensor: Tensor,
    poll: PollFn,
}

impl Work {
    pub fn new(c: Completion) -> Result<Work> {
        let placeholder = Storage::Device(Box::new(InFlight { dtype: c.dtype, len: c.shape.numel(), device: c.device }));
        let wait = c.wait;
        let fill: ferrolm_tensor::Fill = Box::new(move |s| {
            *s = wait()?;
            Ok(())
        });
        let tensor = Tensor::pending_from(placeholder, c.shape, fill, c.producer)?;
        Ok(Work { tensor, poll: c.poll })
    }
    /// The result, still pending: nothing waits until it is read.
    pub fn tensor(&self) -> Tensor {
        self.tensor.clone()
    }
    /// Waits for the result (surfacing the collective's error) and returns it.
    pub fn wait(&self) -> Result<Tensor> {
        self.tensor.wait()?;
        Ok(self.tensor.clone())
    }
    /// True once the collective has completed (or failed); never blocks.
    pub fn is_done(&self) -> bool {
        !self.tensor.is_pending() || (self.poll)()
    }
}

/// A group of ranks that run collectives together. Every rank of the group must launch the
/// same collectives, with the same arguments, in the same order; each rank's collectives run in
/// launch order on the communicator's own stream, concurrently with the rank's compute.
pub trait Communicator: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The group's name, used in messages ("world", "world/tp0", ...).
    fn name(&self) -> &str;
    /// The world rank of every member, indexed by group rank.
    fn world_ranks(&self) -> &[usize];
    fn timeout(&self) -> Duration;
    /// Starts `op` on `x` (made contiguous) and returns its completion; `Work::new` turns it
    /// into a pending tensor. The `*_async` methods are the usual way in.
    fn launch(&self, op: Collective, x: &Tensor) -> Result<Completion>;
    /// Returns once every rank of the group has called it (and launched everything before it).
    fn barrier(&self) -> Result<()>;
    /// Like `MPI_Comm_split`: ranks with the same `color` form a new group, ordered by `key`
    /// (ties by rank). Every rank of this group must call it, in the same order relative to its
    /// other collectives. `name` prefixes the new group's name (`"{self}/{name}{color}"`).
    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>>;
    /// Bytes and calls this rank has launched on this communicator.
    fn stats(&self) -> CommStats;
    /// Declares this rank failed: the other ranks' pending and later collectives fail with
    /// `reason` instead of waiting for it.
    fn abort(&self, reason: &str);

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        self.split_named(color, key, "split")
    }
    fn all_reduce_async(&self, x: &Tensor, op: ReduceOp) -> Result<Work> {
        Work::new(self.launch(Collective::AllReduce(op), x)?)
    }
    /// Every rank's tensor concatenated along dim 0, in rank order.
    fn all_gather_async(&self, x: &Tensor) -> Result<Work> {
        Work::new(self.launch(Collective::AllGather, x)?)
    }
    /// The reduction of every rank's tensor; rank r gets block r of dim 0 (dim 0 must divide).
    fn reduce_scatter_async(&self, x: &Tensor, op: ReduceOp) -> Result<Work> {
        Work::new(self.launch(Collective::ReduceScatter(op), x)?)
    }
    /// `root`'s tensor on every rank (the others' inputs give shape and dtype only).
    fn broadcast_async(&self, x: &Tensor, root: usize) -> Result<Work> {
        Work::new(self.launch(Collective::Broadcast { root }, x)?)
    }
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.all_reduce_async(x, op)?.wait()
    }
    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        self.all_gather_async(x)?.wait()
    }
    fn reduce_scatter(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.reduce_scatter_async(x, op)?.wait()
    }
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.broadcast_async(x, root)?.wait()
    }
}

/// Implements the `Communicator` methods that a wrapper around `self.inner` (an
/// `Arc<dyn Communicator>`) passes on unchanged: rank, size, name, world ranks, timeout, stats
/// and abort. The wrapper writes `launch`, `barrier` and `split_named` (`SimLink`; test wrappers).
#[macro_export]
macro_rules! forward_to_inner {
    () => {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn size(&self) -> usize {
            self.inner.size()
        }
        fn name(&self) -> &str {
            self.inner.name()
        }
        fn world_ranks(&self) -> &[usize] {
            self.inner.world_ranks()
        }
        fn timeout(&self) -> ::std::time::Duration {
            self.inner.timeout()
        }
        fn stats(&self) -> $crate::CommStats {
            self.inner.stats()
        }
        fn abort(&self, reason: &str) {
            self.inner.abort(reason)
        }
    };
}

impl fmt::Debug for dyn Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Communicator({}, rank {} of {})", self.name(), self.rank(), self.size())
    }
}

/// The backend of a CUDA device, for moving host results there (thread ranks on the emulated
/// backend) and device copies.
pub(crate) fn cuda_backend(op: &str, ordinal: usize) -> Result<Arc<CudaBackend>> {
    CudaBackend::latest(ordinal).ok_or_else(|| Error::new(op, format!("no CUDA backend is initialised for cuda:{ordinal}")))
}

/// Host elements as storage on `device`.
pub(crate) fn storage_on(op: &str, cpu: CpuStorage, device: Device) -> Result<Storage> {
    match device {
        Device::Cpu => Ok(Storage::Cpu(cpu)),
        Device::Cuda(o) => cuda_backend(op, o)?.from_cpu(&cpu),
    }
}

/// A contiguous copy of `x`'s elements as storage on its own device (no host round trip on a GPU).
pub(crate) fn copy_storage(op: &str, x: &Tensor) -> Result<Storage> {
    match x.device() {
        Device::Cpu => Ok(Storage::Cpu(x.to_cpu_storage()?)),
        Device::Cuda(o) => {
            let b = cuda_backend(op, o)?;
            x.with_storage(|sl| b.copy_strided(sl))
        }
    }
}

/// The sub-group of `size` ranks of `parent` this rank joins, as `split_named(color, key, name)`
/// (a collective over `parent`: every rank calls it with the same `size`), without a new
/// communicator where none is needed: a group of one is a solo communicator (no NCCL), and a
/// group of all of `parent`'s ranks, which the callers order by their `parent` rank, is `parent`.
pub fn sub_group(parent: &Arc<dyn Communicator>, size: usize, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
    if size == 1 {
        Ok(crate::ThreadComm::solo(crate::CommOptions::default()))
    } else if size == parent.size() {
        Ok(parent.clone())
    } else {
        parent.split_named(color, key, name)
    }
}

/// The sum of `v` over the ranks of `c` (norms, failure counts). The one-element tensor is built
/// on `device`, the device of the tensors the communicator serves: NCCL refuses a host tensor.
/// f64 on the CPU; f32 on a GPU, whose backend has no f64 tensors.
pub fn all_reduce_scalar(c: &dyn Communicator, v: f64, device: Device) -> Result<f64> {
    if c.size() == 1 {
        return Ok(v);
    }
    let t = if device == Device::Cpu { Tensor::from_vec(vec![v], [1], device)? } else { Tensor::from_vec(vec![v as f32], [1], device)? };
    c.all_reduce(&t, ReduceOp::Sum)?.item()
}

/// Environment variable: `1` makes every collective carry its call site (`call_site`) and
/// checks that the ranks of a group launch the same collective from the same site, so ranks
/// that issue buckets in a different order fail with the site named.
pub const ENV_COMM_CHECK: &str = "FERROLM_COMM_CHECK";

/// Whether `FERROLM_COMM_CHECK=1` is set (read at each collective: tests may turn it on).
pub fn comm_check() -> bool {
    std::env::var(ENV_COMM_CHECK).is_ok_and(|v| v == "1")
}

thread_local! {
    static SITE: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Restores the previous call site when dropped.
pub struct SiteGuard(Option<String>);

impl Drop for SiteGuard {
    fn drop(&mut self) {
        let prev = self.0.take();
        SITE.with(|s| *s.borrow_mut() = prev);
    }
}

/// Names the call site (for example "bucket 3, gradient reduce-scatter") of the collectives this
/// thread launches until the guard drops. Formats nothing unless `FERROLM_COMM_CHECK=1`.
pub fn call_site(site: impl FnOnce() -> String) -> SiteGuard {
    let new = comm_check().then(site);
    SiteGuard(SITE.with(|s| std::mem::replace(&mut *s.borrow_mut(), new)))
}

/// The call site this thread's next collective carries (None without `FERROLM_COMM_CHECK=1`).
pub fn current_site() -> Option<String> {
    SITE.with(|s| s.borrow().clone()).filter(|_| comm_check())
}
