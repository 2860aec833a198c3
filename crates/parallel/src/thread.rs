//! `ThreadComm`: ranks are threads of one process. This is how `--tp`/`--dp` run on the CPU and
//! how every parallel test runs in CI.
//!
//! Each rank's communicator has a worker thread (its "stream"): a launch gives the collective a
//! sequence number and queues it; the worker reads the input (waiting there if the input is
//! itself pending) and deposits a host copy in the group's slot for that sequence number. The
//! rank that completes a slot computes the result once, in a fixed order (see `reduce.rs`), so
//! results are deterministic and independent of thread timing. A rank's `Work` waits for the
//! slot's result where it is first read. Tensors on other devices (the emulated CUDA backend)
//! are staged through the host.
//!
//! Failure handling: every wait polls the world's failure flag and the slot's missing ranks, so
//! a rank that errors, panics or returns without joining makes the others fail promptly with
//! "rank R exited: ...", and a rank that never comes makes them fail at the timeout with the
//! group, the collective, its sequence number and the ranks it was waiting for.
use crate::comm::{copy_storage, storage_on, Collective, CommOptions, CommStats, Communicator, Completion, InFlightResult};
use crate::reduce;
use ferrolm_tensor::{bail, CpuStorage, DType, Error, Result, Shape, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Environment variable, for benchmarks and tests: `1` makes a thread rank wait for a pending
/// collective input on the thread that launches the collective, as NCCL does (it reads the
/// input's device pointer there), instead of on its communication thread. Inputs that are
/// themselves collective results in flight are chained either way. Read when a world is made.
pub const ENV_CALLER_RESOLVE: &str = "FERROLM_THREADCOMM_CALLER_RESOLVE";

/// Whether `ENV_CALLER_RESOLVE` turns caller resolution on; an error names a value that is
/// neither `1` nor `0`.
pub fn caller_resolve_from_env() -> Result<bool> {
    match std::env::var(ENV_CALLER_RESOLVE) {
        Err(_) => Ok(false),
        Ok(v) => match v.trim() {
            "" | "0" => Ok(false),
            "1" => Ok(true),
            _ => bail!("thread_comm", "{ENV_CALLER_RESOLVE}={v:?}: expected 1 (on) or 0 (off)"),
        },
    }
}

/// Collectives whose launching thread waited for a pending input under caller resolution, in
/// this process (`ThreadComm::caller_waits`).
static CALLER_WAITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How often a waiting rank re-checks for failed or exited ranks.
const POLL: Duration = Duration::from_millis(20);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Shared by every group of one `ThreadComm` world.
struct World {
    /// The first rank to fail (world rank) and why.
    failure: Mutex<Option<(usize, String)>>,
    /// Ranks whose function returned normally.
    exited: Vec<AtomicBool>,
    /// `FERROLM_THREADCOMM_CALLER_RESOLVE=1`: a pending input is waited for by the launching
    /// thread, as NCCL does, unless it is a collective's result (chained on the stream).
    caller_resolve: bool,
}

impl World {
    fn fail(&self, world_rank: usize, msg: String) {
        let mut f = lock(&self.failure);
        if f.is_none() {
            *f = Some((world_rank, msg));
        }
    }
    fn failure(&self) -> Option<(usize, String)> {
        lock(&self.failure).clone()
    }
}

/// What one rank asked for under one sequence number.
#[derive(Clone, Debug, PartialEq)]
enum Request {
    /// `site`: the launching call site under FERROLM_COMM_CHECK=1 (`comm::call_site`).
    Data {
        op: Collective,
        shape: Shape,
        dtype: DType,
        site: Option<String>,
    },
    Barrier,
    Split {
        name: String,
        color: usize,
        key: usize,
    },
}

impl Request {
    fn describe(&self) -> String {
        match self {
            Request::Data { op, shape, dtype, site: None } => format!("{op} of {:?} {dtype}", shape.dims()),
            Request::Data { op, shape, dtype, site: Some(at) } => format!("{op} of {:?} {dtype} at {at}", shape.dims()),
            Request::Barrier => "barrier".into(),
            Request::Split { name, color, key } => format!("split {name:?} (color {color}, key {key})"),
        }
    }
    /// Ranks agree when they launched the same collective with the same arguments (a split's
    /// color and key are per rank by design).
    fn agrees(&self, other: &Request) -> bool {
        match (self, other) {
            (Request::Split { name: a, .. }, Request::Split { name: b, .. }) => a == b,
            (a, b) => a == b,
        }
    }
    fn verb(&self) -> String {
        match self {
            Request::Data { op, .. } => op.to_string(),
            Request::Barrier => "barrier".into(),
            Request::Split { .. } => "split".into(),
        }
    }
}

enum Outcome {
    Same(CpuStorage),
    PerRank(Vec<CpuStorage>),
    Nothing,
    Split(Vec<(Arc<Group>, usize)>),
}

struct Slot {
    reqs: Vec<Option<Request>>,
    inputs: Vec<Option<CpuStorage>>,
    outcome: Option<std::result::Result<Arc<Outcome>, String>>,
    released: usize,
}

struct State {
    /// Per group rank: how many collectives it has launched (its next sequence number).
    launched: Vec<u64>,
    slots: HashMap<u64, Slot>,
}

pub(crate) struct Group {
    world: Arc<World>,
    name: String,
    /// World rank of each group rank.
    ranks: Vec<usize>,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl Group {
    fn new(world: Arc<World>, name: String, ranks: Vec<usize>, timeout: Duration) -> Arc<Group> {
        let n = ranks.len();
        Arc::new(Group {
            world,
            name,
            ranks,
            timeout,
            state: Mutex::new(State { launched: vec![0; n], slots: HashMap::new() }),
            cv: Condvar::new(),
        })
    }
    fn size(&self) -> usize {
        self.ranks.len()
    }
    /// "rank 1" in the world group, "rank 1 (world rank 5)" in a sub-group.
    fn who(&self, rank: usize) -> String {
        if self.ranks[rank] == rank && self.name == "world" {
            format!("rank {rank}")
        } else {
            format!("rank {rank} (world rank {})", self.ranks[rank])
        }
    }
    fn context(&self, rank: usize, seq: u64, verb: &str) -> String {
        format!("{} of group {} {:?}: {verb} #{seq}", self.who(rank), self.name, self.ranks)
    }
    fn failed(&self) -> Option<String> {
        self.world.failure().map(|(r, msg)| format!("rank {r} exited: {msg}"))
    }

    /// Called at launch, in launch order: the slot exists from now until every rank released it.
    fn open(&self, rank: usize, seq: u64) {
        let n = self.size();
        let mut st = lock(&self.state);
        st.launched[rank] = seq + 1;
        st.slots.entry(seq).or_insert_with(|| Slot { reqs: vec![None; n], inputs: vec![None; n], outcome: None, released: 0 });
    }

    /// The worker's contribution; the rank that completes the slot computes the outcome.
    fn deposit(self: &Arc<Self>, rank: usize, seq: u64, req: Request, input: std::result::Result<Option<CpuStorage>, String>) {
        let mut st = lock(&self.state);
        let Some(slot) = st.slots.get_mut(&seq) else { return };
        if slot.outcome.is_some() {
            return;
        }
        let fail = |slot: &mut Slot, msg: String| {
            slot.outcome = Some(Err(msg));
            self.cv.notify_all();
        };
        let input = match input {
            Ok(i) => i,
            Err(e) => return fail(slot, format!("{} could not read its input: {e}", self.who(rank))),
        };
        if let Some((other, theirs)) = slot.reqs.iter().enumerate().find_map(|(p, q)| q.as_ref().map(|q| (p, q))) {
            if !theirs.agrees(&req) {
                let msg = format!(
                    "ranks disagree on collective #{seq}: {} launched {}, {} launched {}",
                    self.who(other),
                    theirs.describe(),
                    self.who(rank),
                    req.describe()
                );
                return fail(slot, msg);
            }
        }
        slot.reqs[rank] = Some(req);
        slot.inputs[rank] = input;
        if slot.reqs.iter().any(Option::is_none) {
            return;
        }
        let reqs: Vec<Request> = slot.reqs.iter().map(|q| q.clone().expect("all present")).collect();
        let inputs: Vec<Option<CpuStorage>> = slot.inputs.iter_mut().map(Option::take).collect();
        drop(st);
        // Computed outside the lock: other sequence numbers go on meanwhile.
        let outcome = self.compute(seq, &reqs, inputs);
        let mut st = lock(&self.state);
        if let Some(slot) = st.slots.get_mut(&seq) {
            slot.outcome = Some(outcome.map(Arc::new));
        }
        drop(st);
        self.cv.notify_all();
    }

    fn compute(self: &Arc<Self>, seq: u64, reqs: &[Request], inputs: Vec<Option<CpuStorage>>) -> std::result::Result<Outcome, String> {
        let n = self.size();
        let data = || -> Vec<CpuStorage> { inputs.into_iter().map(|i| i.expect("data collectives carry inputs")).collect() };
        let res = match &reqs[0] {
            Request::Barrier => Ok(Outcome::Nothing),
            Request::Data { op: Collective::AllReduce(op), .. } => reduce::reduce(*op, &data()).map(Outcome::Same),
            Request::Data { op: Collective::AllGather, .. } => Ok(Outcome::Same(reduce::concat(data()))),
            Request::Data { op: Collective::ReduceScatter(op), .. } => {
                reduce::reduce(*op, &data()).map(|r| Outcome::PerRank(reduce::split(r, n)))
            }
            Request::Data { op: Collective::Broadcast { root }, .. } => Ok(Outcome::Same(data().swap_remove(*root))),
            Request::Split { name, .. } => {
                let colors: Vec<(usize, usize)> = reqs
                    .iter()
                    .map(|q| match q {
                        Request::Split { color, key, .. } => (*color, *key),
                        _ => unreachable!("requests agree"),
                    })
                    .collect();
                let mut out: Vec<Option<(Arc<Group>, usize)>> = vec![None; n];
                let mut by_color: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
                for (p, &(c, _)) in colors.iter().enumerate() {
                    by_color.entry(c).or_default().push(p);
                }
                for (color, mut members) in by_color {
                    members.sort_by_key(|&p| (colors[p].1, p));
                    let ranks = members.iter().map(|&p| self.ranks[p]).collect();
                    let g = Group::new(self.world.clone(), format!("{}/{name}{color}", self.name), ranks, self.timeout);
                    for (i, &p) in members.iter().enumerate() {
                        out[p] = Some((g.clone(), i));
                    }
                }
                Ok(Outcome::Split(out.into_iter().map(|o| o.expect("every rank has a color")).collect()))
            }
        };
        res.map_err(|e| format!("collective #{seq} failed: {e}"))
    }

    /// Waits for the outcome of `seq`, failing on a failed world, a rank that exited without
    /// joining, or the deadline.
    fn wait(&self, rank: usize, seq: u64, verb: &str, deadline: Instant) -> Result<Arc<Outcome>> {
        self.wait_open(rank, seq, verb, deadline)?
            .ok_or_else(|| Error::new(self.context(rank, seq, verb), "internal error: the collective's slot is gone"))
    }

    /// As `wait`, but None when the slot is gone (every rank has taken the outcome).
    fn wait_open(&self, rank: usize, seq: u64, verb: &str, deadline: Instant) -> Result<Option<Arc<Outcome>>> {
        let ctx = || self.context(rank, seq, verb);
        let mut st = lock(&self.state);
        loop {
            let Some(slot) = st.slots.get(&seq) else { return Ok(None) };
            if let Some(o) = &slot.outcome {
                return o.clone().map(Some).map_err(|m| Error::new(ctx(), m));
            }
            if let Some(msg) = self.failed() {
                bail!(ctx(), "{msg}");
            }
            let missing: Vec<usize> = (0..self.size()).filter(|&p| slot.reqs[p].is_none()).collect();
            for &p in &missing {
                if self.world.exited[self.ranks[p]].load(Ordering::Acquire) && st.launched[p] <= seq {
                    bail!(ctx(), "{} exited without joining it", self.who(p));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                let who: Vec<String> = missing.iter().map(|&p| self.who(p)).collect();
                let what = if who.is_empty() { "the result".to_string() } else { format!("{} to join", who.join(", ")) };
                bail!(ctx(), "timed out after {:.1} s waiting for {what}", self.timeout.as_secs_f64());
            }
            st = self.cv.wait_timeout(st, (deadline - now).min(POLL)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn release(&self, seq: u64) {
        let mut st = lock(&self.state);
        let n = self.size();
        if let Some(slot) = st.slots.get_mut(&seq) {
            slot.released += 1;
            if slot.released == n {
                st.slots.remove(&seq);
            }
        }
    }

    fn poll(&self, seq: u64) -> bool {
        self.world.failure().is_some() || lock(&self.state).slots.get(&seq).is_none_or(|s| s.outcome.is_some())
    }
}

/// One rank's claim on a slot: released when taken or dropped, so slots do not pile up when a
/// result is never read.
struct Ticket {
    group: Arc<Group>,
    rank: usize,
    seq: u64,
    verb: String,
    deadline: Instant,
    released: bool,
}

impl Ticket {
    fn outcome(mut self) -> Result<Arc<Outcome>> {
        let r = self.group.wait(self.rank, self.seq, &self.verb, self.deadline);
        self.released = true;
        self.group.release(self.seq);
        r
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.released {
            self.group.release(self.seq);
        }
    }
}

struct Job {
    seq: u64,
    req: Request,
    input: Option<Tensor>,
    /// The input is another collective's result in flight: its host copy is taken from there
    /// (no staging through the device), on this thread, never the launching one.
    chained: Option<Arc<InFlightResult>>,
    /// Submitted inside a training step: the staging's host waits are that step's (the CUDA
    /// emulator's accounting).
    in_step: bool,
}

struct Stream {
    next_seq: u64,
    tx: Option<Sender<Job>>,
}

/// One rank's handle on a group of thread ranks.
pub struct ThreadComm {
    group: Arc<Group>,
    rank: usize,
    stream: Mutex<Stream>,
    stats: Mutex<CommStats>,
}

impl ThreadComm {
    fn new(group: Arc<Group>, rank: usize) -> Arc<ThreadComm> {
        Arc::new(ThreadComm { group, rank, stream: Mutex::new(Stream { next_seq: 0, tx: None }), stats: Mutex::default() })
    }

    /// The world communicators of `world_size` thread ranks, one per rank, for callers that run
    /// the rank threads themselves (`run` does that and handles failures; here a failing rank
    /// must call `abort`, or the others see it only at the timeout).
    pub fn world(world_size: usize, options: CommOptions) -> Result<Vec<Arc<dyn Communicator>>> {
        Ok(Self::make_world(world_size, options)?.1.into_iter().map(|c| c as Arc<dyn Communicator>).collect())
    }

    fn make_world(world_size: usize, options: CommOptions) -> Result<(Arc<World>, Vec<Arc<ThreadComm>>)> {
        if world_size == 0 {
            bail!("thread_comm", "world size must be at least 1");
        }
        let world = Arc::new(World {
            failure: Mutex::new(None),
            exited: (0..world_size).map(|_| AtomicBool::new(false)).collect(),
            caller_resolve: options.caller_resolve || caller_resolve_from_env()?,
        });
        let g = Group::new(world.clone(), "world".into(), (0..world_size).collect(), options.timeout);
        Ok((world, (0..world_size).map(|r| ThreadComm::new(g.clone(), r)).collect()))
    }

    /// How many collectives, in this process so far, found their input pending and waited for it
    /// on the launching thread under caller resolution (`CommOptions::caller_resolve` or
    /// `FERROLM_THREADCOMM_CALLER_RESOLVE=1`). A collective result in flight is chained on the
    /// communication thread instead and never counts; with every input chained or ready, caller
    /// resolution runs exactly the schedule of the default mode.
    pub fn caller_waits() -> u64 {
        CALLER_WAITS.load(Ordering::Relaxed)
    }

    /// A world of one rank (what a single-process run uses): collectives are copies.
    pub fn solo(options: CommOptions) -> Arc<dyn Communicator> {
        Self::world(1, options).expect("one rank").remove(0)
    }

    /// Runs `f` on `world_size` rank threads (named `rank-R`) and returns their results in rank
    /// order. A rank that returns an error or panics marks the world failed: every other rank's
    /// pending or next collective fails promptly with "rank R exited: ...", and `run` returns
    /// the first failure's error, naming its rank.
    pub fn run<T, F>(world_size: usize, options: CommOptions, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(Arc<dyn Communicator>) -> Result<T> + Sync,
    {
        let (world, comms) = Self::make_world(world_size, options)?;
        let f = &f;
        let results: Vec<std::result::Result<T, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(r, comm)| {
                    let world = world.clone();
                    std::thread::Builder::new().name(format!("rank-{r}")).spawn_scoped(s, move || {
                        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm as Arc<dyn Communicator>)));
                        let out = match res {
                            Ok(Ok(v)) => {
                                world.exited[r].store(true, Ordering::Release);
                                return Ok(v);
                            }
                            Ok(Err(e)) => e.to_string(),
                            Err(p) => format!("panicked: {}", panic_message(&p)),
                        };
                        world.fail(r, out.clone());
                        Err(out)
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|p| Err(format!("panicked: {}", panic_message(&p)))),
                    Err(e) => {
                        world.fail(r, format!("could not start its thread: {e}"));
                        Err(format!("could not start its thread: {e}"))
                    }
                })
                .collect()
        });
        if let Some((r, msg)) = world.failure() {
            let others = results.iter().filter(|x| x.is_err()).count() - 1;
            let also = if others > 0 { format!(" ({others} other rank(s) failed after it)") } else { String::new() };
            bail!("thread_comm", "rank {r} failed: {msg}{also}");
        }
        Ok(results.into_iter().map(|r| r.expect("no failure recorded")).collect())
    }

    /// Assigns the next sequence number and queues the job on this rank's stream.
    fn submit(&self, req: Request, input: Option<Tensor>, chained: Option<Arc<InFlightResult>>) -> Result<Ticket> {
        let verb = req.verb();
        let mut st = lock(&self.stream);
        let seq = st.next_seq;
        if let Some(msg) = self.group.failed() {
            bail!(self.group.context(self.rank, seq, &verb), "{msg}");
        }
        if st.tx.is_none() {
            let (tx, rx) = channel::<Job>();
            let (group, rank) = (self.group.clone(), self.rank);
            std::thread::Builder::new()
                .name(format!("{}-r{}-comm", self.group.name, self.rank))
                .spawn(move || {
                    for job in rx {
                        let _step = ferrolm_cuda::StepScope::on_behalf(job.in_step);
                        let input = match (&job.input, job.chained.as_deref()) {
                            (Some(t), Some(InFlightResult::Host(host))) => match host() {
                                Ok(Some(s)) => Ok(Some(s)),
                                Ok(None) => t.to_cpu_storage().map(Some),
                                Err(e) => Err(e),
                            }
                            .map_err(|e| e.to_string()),
                            (Some(t), _) => t.to_cpu_storage().map(Some).map_err(|e| e.to_string()),
                            (None, _) => Ok(None),
                        };
                        group.deposit(rank, job.seq, job.req, input);
                    }
                })
                .map_err(|e| Error::new("thread_comm", format!("cannot start the communication thread: {e}")))?;
            st.tx = Some(tx);
        }
        self.group.open(self.rank, seq);
        st.next_seq += 1;
        let ticket = Ticket {
            group: self.group.clone(),
            rank: self.rank,
            seq,
            verb,
            deadline: Instant::now() + self.group.timeout,
            released: false,
        };
        st.tx
            .as_ref()
            .expect("started")
            .send(Job { seq, req, input, chained, in_step: ferrolm_cuda::StepScope::in_step() })
            .map_err(|_| Error::new("thread_comm", "the communication thread stopped"))?;
        Ok(ticket)
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".into()
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.group.size()
    }
    fn name(&self) -> &str {
        &self.group.name
    }
    fn world_ranks(&self) -> &[usize] {
        &self.group.ranks
    }
    fn timeout(&self) -> Duration {
        self.group.timeout
    }

    fn launch(&self, op: Collective, x: &Tensor) -> Result<Completion> {
        let n = self.size();
        let shape = op.output_shape(x.shape(), n)?;
        op.check_dtype(x.dtype())?;
        let (dtype, device) = (x.dtype(), x.device());
        lock(&self.stats).record(op, n, self.rank, x.numel() * dtype.size_in_bytes());
        if n == 1 {
            // A group of one: every collective is a copy, made now on the tensor's own device.
            let s = copy_storage(&op.to_string(), x)?;
            return Ok(Completion::new(shape, dtype, device, move || Ok(s), || true));
        }
        // A collective's result in flight is chained: this rank's communication thread waits for
        // it. Any other pending input is waited for here under caller resolution (as NCCL reads
        // it on the launching thread), else on the communication thread.
        let chained = InFlightResult::of(x);
        if self.group.world.caller_resolve && chained.is_none() {
            if x.is_pending() {
                CALLER_WAITS.fetch_add(1, Ordering::Relaxed);
            }
            x.wait()?;
        }
        let req = Request::Data { op, shape: x.shape().clone(), dtype, site: crate::comm::current_site() };
        let ticket = self.submit(req, Some(x.detach()), chained)?;
        let (group, seq, rank, deadline) = (self.group.clone(), ticket.seq, self.rank, ticket.deadline);
        let mine = move |out: &Outcome| match out {
            Outcome::Same(s) => s.clone(),
            Outcome::PerRank(v) => v[rank].clone(),
            _ => unreachable!("data collectives have data outcomes"),
        };
        let wait = move || {
            let out = ticket.outcome()?;
            storage_on(&op.to_string(), mine(&out), device)
        };
        let g = group.clone();
        let host = move || Ok(g.wait_open(rank, seq, &op.to_string(), deadline)?.map(|o| mine(&o)));
        let c = Completion::new(shape, dtype, device, wait, move || group.poll(seq));
        Ok(c.produced_by(InFlightResult::Host(Box::new(host)).producer()))
    }

    fn barrier(&self) -> Result<()> {
        self.submit(Request::Barrier, None, None)?.outcome().map(|_| ())
    }

    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        let out = self.submit(Request::Split { name: name.to_string(), color, key }, None, None)?.outcome()?;
        match &*out {
            Outcome::Split(v) => {
                let (g, r) = &v[self.rank];
                Ok(ThreadComm::new(g.clone(), *r))
            }
            _ => unreachable!("split has a split outcome"),
        }
    }

    fn stats(&self) -> CommStats {
        *lock(&self.stats)
    }

    fn abort(&self, reason: &str) {
        self.group.world.fail(self.group.ranks[self.rank], reason.to_string());
        self.group.cv.notify_all();
    }
}
