//! The rendezvous store of a multi-process run, on `MASTER_ADDR:MASTER_PORT`: small values (the
//! NCCL unique id), counted barriers, and a failure notice. It speaks PyTorch's TCPStore protocol
//! (`tcpstore`): under torchrun every rank joins the agent's store as a client; without an agent
//! (the `launch` example, srun, mpirun) rank 0 serves one (`StoreServer`) and every rank, rank 0
//! included, connects to it.
//!
//! On top of plain keys, a `Store` keeps:
//! - a key namespace per launch attempt (`/worker/attempt_{TORCHELASTIC_RESTART_COUNT}/`), so a
//!   restarted torchrun group does not read the last attempt's keys from the agent's store;
//! - barriers with their own timeout (`barrier_timeout`): a counter every rank adds to, the last
//!   arrival sets a "done" key the others wait on (as torch's store barrier does). Rank-0-only
//!   phases wait here, not inside a collective under the NCCL watchdog;
//! - a failure notice: the first `report_failure` wins (compare-and-set), and every waiting and
//!   later request of every rank fails with it. The protocol has no wait-for-any, so waits run in
//!   slices (50 ms growing to 1 s) with a check of the notice between them; the awaited key
//!   itself wakes a wait at once;
//! - a lost connection (the process serving the store died) fails that request and every later
//!   one with a message that says so, instead of hanging.
use crate::env::DistEnv;
use crate::tcpstore::{ConnectError, TcpStoreClient};
pub use crate::tcpstore_server::StoreServer;
use ferrolm_tensor::{Error, Result};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a server may take to answer the validation handshake. Past it, whatever listens on
/// the port is not a store we can talk to (decided quickly, not after the rendezvous timeout).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// Longest slice of a wait between two checks of the failure notice.
const MAX_SLICE: Duration = Duration::from_secs(1);

/// Who serves the store (for messages when it goes away).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreHost {
    /// Rank 0 of this job (our `StoreServer`).
    Rank0,
    /// torchrun's elastic agent (`TORCHELASTIC_USE_AGENT_STORE=True`).
    Agent,
    /// Whoever listens at the address `Store::connect` was given.
    External,
}

impl StoreHost {
    fn who(self) -> &'static str {
        match self {
            StoreHost::Rank0 => "rank 0, which serves it,",
            StoreHost::Agent => "the torchrun agent, which serves it,",
            StoreHost::External => "its server",
        }
    }
}

struct Conn {
    client: Option<TcpStoreClient>,
    /// Set once the connection broke; every later request fails with it.
    lost: Option<String>,
}

/// One rank's connection to the store.
pub struct Store {
    addr: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    prefix: String,
    host: StoreHost,
    conn: Mutex<Conn>,
    barriers: AtomicU64,
    /// Rank 0's server, kept alive as long as its own connection.
    server: Option<StoreServer>,
}

fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "this host".into())
}

/// "host:port", bracketing an IPv6 literal.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Connects, retrying while nothing answers (the server may not be up yet) until `deadline`;
/// gives up at once on something that answers but is not a store. Each attempt may take
/// `HANDSHAKE_TIMEOUT` past the deadline.
fn connect_until(addr: &str, deadline: Instant) -> std::result::Result<TcpStoreClient, ConnectError> {
    loop {
        match TcpStoreClient::connect(addr, HANDSHAKE_TIMEOUT, std::process::id()) {
            Ok(c) => return Ok(c),
            Err(ConnectError::Unreachable(_)) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e),
        }
    }
}

impl Store {
    /// Connects to the store at `addr` ("host:port") as `rank` of `world_size`, retrying until
    /// `timeout` while the server is not up yet. `timeout` also bounds every later wait (`get`,
    /// `barrier`). Keys are put under "/".
    pub fn connect(addr: &str, rank: usize, world_size: usize, timeout: Duration) -> Result<Store> {
        let client = connect_until(addr, Instant::now() + timeout).map_err(|e| match e {
            ConnectError::Unreachable(m) => Error::new(
                "store",
                format!(
                    "rank {rank} could not reach the rendezvous store at {addr} within {:.1} s (is rank 0 running, are MASTER_ADDR/MASTER_PORT right?): {m}",
                    timeout.as_secs_f64()
                ),
            ),
            ConnectError::NotAStore(m) => Error::new("store", format!("rank {rank}: the server at {addr} is not a rendezvous store: {m}")),
        })?;
        Ok(Store::from_client(client, addr, rank, world_size, timeout, "/".into(), StoreHost::External, None))
    }

    #[allow(clippy::too_many_arguments)]
    fn from_client(
        client: TcpStoreClient,
        addr: &str,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        prefix: String,
        host: StoreHost,
        server: Option<StoreServer>,
    ) -> Store {
        Store {
            addr: addr.to_string(),
            rank,
            world_size,
            timeout,
            prefix,
            host,
            conn: Mutex::new(Conn { client: Some(client), lost: None }),
            barriers: AtomicU64::new(0),
            server,
        }
    }

    /// Joins the job's store as `env` describes it: under torchrun's agent
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`) as a client of the agent's store; otherwise rank 0
    /// serves the store on `MASTER_PORT` (all interfaces) and every rank connects to
    /// `MASTER_ADDR:MASTER_PORT`. Then the rank claims its number (two processes with one `RANK`
    /// both fail, naming it) and waits, up to `timeout`, until every rank has joined.
    pub fn rendezvous(env: &DistEnv, timeout: Duration) -> Result<Store> {
        let addr = join_host_port(&env.master_addr, env.master_port);
        let at = format!("MASTER_ADDR:MASTER_PORT = {addr}");
        let ctx = format!("rendezvous (rank {} of {})", env.rank, env.world_size);
        let deadline = Instant::now() + timeout;
        let host = if env.agent_store { StoreHost::Agent } else { StoreHost::Rank0 };
        let mut bind_err = None;
        let server = if env.serves_store() {
            let any = if env.master_addr.contains(':') { "::" } else { "0.0.0.0" };
            match StoreServer::bind_io((any, env.master_port)) {
                Ok(s) => Some(s),
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                    // Something holds the port: another rank 0 (found below by the claim), or
                    // something that is not a store (found by the handshake).
                    bind_err = Some(e);
                    None
                }
                Err(e) => {
                    return Err(Error::new(
                        ctx,
                        format!("rank 0 cannot serve the rendezvous store on port {} (MASTER_PORT): {e}", env.master_port),
                    ))
                }
            }
        } else {
            None
        };
        // Rank 0 that found the port taken looks once: nobody will start a store there later.
        let client = connect_until(&addr, if bind_err.is_some() { Instant::now() } else { deadline }).map_err(|e| {
            let held = match &bind_err {
                Some(b) => format!(" (rank 0 could not listen on port {}: {b})", env.master_port),
                None => String::new(),
            };
            let msg = match e {
                ConnectError::NotAStore(m) => format!(
                    "{at} is held by something that is not a rendezvous store{held}: {m}. {}",
                    if env.agent_store {
                        "Under torchrun the agent serves this store: its TCPStore protocol version is not the one ferrolm speaks"
                    } else {
                        "Pick a free MASTER_PORT, or check that MASTER_ADDR names rank 0's node"
                    }
                ),
                ConnectError::Unreachable(m) if bind_err.is_some() => {
                    format!("port {} (MASTER_PORT) is in use but no store answers on {at}{held}: {m}. Pick a free MASTER_PORT", env.master_port)
                }
                ConnectError::Unreachable(m) => format!(
                    "could not reach the rendezvous store at {at} within {:.1} s ({} should serve it: is it running, are MASTER_ADDR/MASTER_PORT right?): {m}",
                    timeout.as_secs_f64(),
                    if env.agent_store { "the torchrun agent" } else { "rank 0" }
                ),
            };
            Error::new(ctx.clone(), msg)
        })?;
        let prefix = format!("/worker/attempt_{}/", env.restart_count);
        let store = Store::from_client(client, &addr, env.rank, env.world_size, timeout, prefix, host, server);
        store.claim_rank(env)?;
        match store.barrier_inner("rendezvous", deadline.saturating_duration_since(Instant::now()))? {
            Ok(()) => Ok(store),
            Err(arrived) => {
                let missing = store.missing_ranks()?;
                let hint = match env.launcher {
                    crate::env::Launcher::Slurm => {
                        " Under SLURM, start one process per task with srun (not the tool itself in the batch script)."
                    }
                    _ => "",
                };
                let msg = format!(
                    "only {arrived} of {} ranks joined the rendezvous at {at} within {:.1} s; missing ranks: {missing}.{hint}",
                    env.world_size,
                    timeout.as_secs_f64()
                );
                // The ranks that did come end with the same reason, not each at its own timeout.
                let _ = store.report_failure(&msg);
                Err(Error::new(ctx, msg))
            }
        }
    }

    /// Claims this rank's number; a second process with the same rank fails here and posts a
    /// failure notice, so the first fails too.
    fn claim_rank(&self, env: &DistEnv) -> Result<()> {
        // Unique per connection, so two threads of one process claiming one rank differ too.
        static CLAIMS: AtomicU64 = AtomicU64::new(0);
        let me = format!("{} pid {} #{}", this_host(), std::process::id(), CLAIMS.fetch_add(1, Ordering::Relaxed));
        let key = self.key(&format!("rank/{}", env.rank));
        let owner = self.io("claim rank", &key, |c| c.compare_set(&key, b"", me.as_bytes()))?;
        if owner != me.as_bytes() {
            let var = env.launcher.rank_var();
            let msg = format!(
                "{var}={} is used by two processes ({} and {me}): every process of the job needs its own rank",
                env.rank,
                String::from_utf8_lossy(&owner)
            );
            let _ = self.report_failure(&msg);
            return Err(Error::new(format!("rendezvous (rank {} of {})", env.rank, env.world_size), msg));
        }
        Ok(())
    }

    /// Ranks that have not claimed their number (at most 16 listed).
    fn missing_ranks(&self) -> Result<String> {
        let mut missing = Vec::new();
        let mut more = 0;
        for r in 0..self.world_size {
            let key = self.key(&format!("rank/{r}"));
            if !self.io("check", &key, |c| c.check(&[&key]))? {
                if missing.len() < 16 {
                    missing.push(r.to_string());
                } else {
                    more += 1;
                }
            }
        }
        let mut s = missing.join(", ");
        if more > 0 {
            s += &format!(" and {more} more");
        }
        Ok(if s.is_empty() { "none (a rank left early)".into() } else { s })
    }

    /// A second connection for the same rank (a watchdog thread polls on its own connection so
    /// it never queues behind a blocking `get`).
    pub fn reconnect(&self) -> Result<Store> {
        let client = connect_until(&self.addr, Instant::now() + self.timeout).map_err(|e| {
            Error::new("store", format!("rank {} cannot open a second connection to the store at {}: {e}", self.rank, self.addr))
        })?;
        Ok(Store::from_client(client, &self.addr, self.rank, self.world_size, self.timeout, self.prefix.clone(), self.host, None))
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// The default bound of `get` and `barrier`.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    /// "host:port" of the store.
    pub fn addr(&self) -> &str {
        &self.addr
    }
    pub fn host(&self) -> StoreHost {
        self.host
    }
    /// Whether this process serves the store (rank 0 without an agent).
    pub fn is_server(&self) -> bool {
        self.server.is_some()
    }
    /// For a process about to exit on an error: if it serves the store, keeps it up until the
    /// other ranks have disconnected (at most `max`), so they read its failure notice instead of
    /// finding the store gone. Returns at once elsewhere.
    pub fn linger(&self, max: Duration) {
        if let Some(s) = &self.server {
            s.wait_for_other_clients(max);
        }
    }

    /// The namespace put before every key on the wire.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, k: &str) -> Vec<u8> {
        format!("{}{k}", self.prefix).into_bytes()
    }

    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one exchange; an I/O error marks the connection lost for good.
    fn io<T>(&self, what: &str, key: &[u8], f: impl FnOnce(&mut TcpStoreClient) -> io::Result<T>) -> Result<T> {
        let ctx = || format!("store {what} {:?} (rank {} at {})", String::from_utf8_lossy(key), self.rank, self.addr);
        let mut c = self.lock();
        if let Some(l) = &c.lost {
            return Err(Error::new(ctx(), l.clone()));
        }
        let client = c.client.as_mut().expect("a connection that is not lost has a client");
        match f(client) {
            Ok(v) => Ok(v),
            Err(e) => {
                let why = match e.kind() {
                    io::ErrorKind::InvalidData => format!("the rendezvous store at {} broke the protocol: {e}", self.addr),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
                        "the rendezvous store at {} stopped answering (no reply within {} s; did {} hang or exit?)",
                        self.addr,
                        crate::tcpstore::REPLY_TIMEOUT.as_secs(),
                        self.host.who()
                    ),
                    io::ErrorKind::UnexpectedEof => {
                        format!(
                            "connection to the rendezvous store at {} lost (did {} exit?): the server closed it",
                            self.addr,
                            self.host.who()
                        )
                    }
                    _ => format!("connection to the rendezvous store at {} lost (did {} exit?): {e}", self.addr, self.host.who()),
                };
                c.lost = Some(why.clone());
                c.client = None;
                Err(Error::new(ctx(), why))
            }
        }
    }

    fn fail_if_notice(&self, what: &str, key: &[u8]) -> Result<()> {
        match self.failure_for(what, key)? {
            Some(f) => Err(Error::new(format!("store {what} {:?} (rank {} at {})", String::from_utf8_lossy(key), self.rank, self.addr), f)),
            None => Ok(()),
        }
    }

    /// Waits up to `timeout` until `key` is set, failing on a failure notice; whether it is set.
    fn wait_key(&self, what: &str, key: &[u8], timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        let mut slice = Duration::from_millis(50);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.io(what, key, |c| c.wait(&[key], slice.min(left)))? {
                return Ok(true);
            }
            self.fail_if_notice(what, key)?;
            if Instant::now() >= deadline {
                return Ok(false);
            }
            slice = (slice * 2).min(MAX_SLICE);
        }
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = self.key(key);
        self.fail_if_notice("set", &k)?;
        self.io("set", &k, |c| c.set(&k, value))
    }

    /// The value of `key`, waiting (up to the store's timeout) until some rank sets it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// `get` with its own bound.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let k = self.key(key);
        self.fail_if_notice("get", &k)?;
        if !self.wait_key("get", &k, timeout)? {
            return Err(Error::new(
                format!("store get {key:?} (rank {} at {})", self.rank, self.addr),
                format!("timed out after {:.1} s waiting for key {key:?}", timeout.as_secs_f64()),
            ));
        }
        self.io("get", &k, |c| c.get_now(&k))
    }

    /// Adds `delta` to the counter at `key` (absent: 0); the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = self.key(key);
        self.io("add", &k, |c| c.add(&k, delta))
    }

    /// Whether `key` is set (does not wait).
    pub fn check(&self, key: &str) -> Result<bool> {
        let k = self.key(key);
        self.io("check", &k, |c| c.check(&[&k]))
    }

    /// Returns when every rank has entered this barrier, waiting at most the store's timeout.
    /// Barriers are numbered per connection, so every rank must call them in the same order.
    pub fn barrier(&self, name: &str) -> Result<()> {
        self.barrier_timeout(name, self.timeout)
    }

    /// `barrier` with its own bound: ranks that wait for a rank-0-only phase (tokenising,
    /// consolidating a checkpoint) wait here, with a timeout longer than the collectives'.
    pub fn barrier_timeout(&self, name: &str, timeout: Duration) -> Result<()> {
        match self.barrier_inner(name, timeout)? {
            Ok(()) => Ok(()),
            Err(arrived) => Err(Error::new(
                format!("store barrier {name:?} (rank {} at {})", self.rank, self.addr),
                format!(
                    "timed out after {:.1} s waiting for barrier {name:?} ({arrived} of {} ranks arrived)",
                    timeout.as_secs_f64(),
                    self.world_size
                ),
            )),
        }
    }

    /// `Ok(Err(arrived))` when the barrier timed out.
    fn barrier_inner(&self, name: &str, timeout: Duration) -> Result<std::result::Result<(), i64>> {
        let k = self.barriers.fetch_add(1, Ordering::Relaxed);
        let base = format!("barrier/{name}#{k}");
        let (count, done) = (self.key(&format!("{base}/count")), self.key(&format!("{base}/done")));
        self.fail_if_notice("barrier", &count)?;
        let n = self.io("barrier", &count, |c| c.add(&count, 1))?;
        if n == self.world_size as i64 {
            self.io("barrier", &done, |c| c.set(&done, b"1"))?;
        }
        if self.wait_key("barrier", &done, timeout)? {
            return Ok(Ok(()));
        }
        let arrived = self.io("barrier", &count, |c| c.add(&count, 0))?;
        Ok(Err(arrived))
    }

    /// Posts a failure notice ("rank R failed: msg"): every rank's waiting and later requests
    /// fail with it. The first notice wins.
    pub fn report_failure(&self, msg: &str) -> Result<()> {
        let k = self.key("failure");
        let notice = format!("rank {} failed: {msg}", self.rank);
        self.io("report_failure", &k, |c| c.compare_set(&k, b"", notice.as_bytes())).map(|_| ())
    }

    /// The failure notice, if any rank has posted one ("rank R failed: ...").
    pub fn failure(&self) -> Result<Option<String>> {
        let k = self.key("failure");
        self.failure_for("check", &k)
    }

    fn failure_for(&self, what: &str, ctx_key: &[u8]) -> Result<Option<String>> {
        let k = self.key("failure");
        let v = self.io(what, ctx_key, |c| if c.check(&[&k])? { c.get_now(&k).map(Some) } else { Ok(None) })?;
        Ok(v.map(|v| String::from_utf8_lossy(&v).into_owned()))
    }
}
