//! A small TCP rendezvous store on `MASTER_ADDR:MASTER_PORT`, for bootstrapping processes:
//! rank 0 serves it, every rank (rank 0 included) connects as a client, retrying until the
//! timeout while the server comes up. It holds small byte values (`set`, and `get`, which waits
//! until the key is set), counts barriers, and keeps a failure notice: once a rank reports a
//! failure, every waiting and later request of every rank fails with it instead of hanging.
//!
//! Wire format (little endian), one request and one reply at a time per connection:
//! request `op u8, rank u32, world u32, wait_ms u64, key (u32 len + bytes), value (u32 len + bytes)`;
//! reply `status u8 (0 ok, 1 error), payload (u32 len + bytes)`.
use ferrolm_tensor::{bail, Error, Result};
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const SET: u8 = 1;
const GET: u8 = 2;
const BARRIER: u8 = 3;
const FAIL: u8 = 4;
const CHECK: u8 = 5;
/// Values are small (ids, descriptors); anything larger is a corrupt stream.
const MAX_LEN: u32 = 16 << 20;

#[derive(Default)]
struct Shared {
    kv: HashMap<String, Vec<u8>>,
    barriers: HashMap<String, usize>,
    failure: Option<String>,
}

struct ServerState {
    shared: Mutex<Shared>,
    cv: Condvar,
    stop: AtomicBool,
}

/// The serving side (rank 0). Stops accepting when dropped; open connections end with it.
pub struct StoreServer {
    addr: SocketAddr,
    state: Arc<ServerState>,
}

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port; see `addr()`).
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<StoreServer> {
        let what = format!("{addr:?}");
        let listener = TcpListener::bind(addr).map_err(|e| Error::new("store", format!("cannot listen on {what}: {e}")))?;
        let local = listener.local_addr().map_err(|e| Error::new("store", e.to_string()))?;
        let state = Arc::new(ServerState { shared: Mutex::default(), cv: Condvar::new(), stop: AtomicBool::new(false) });
        let st = state.clone();
        std::thread::Builder::new()
            .name("store-server".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if st.stop.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let st = st.clone();
                    let _ = std::thread::Builder::new().name("store-conn".into()).spawn(move || serve(conn, &st));
                }
            })
            .map_err(|e| Error::new("store", format!("cannot start the store thread: {e}")))?;
        Ok(StoreServer { addr: local, state })
    }
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        self.state.cv.notify_all();
        // Wake the accept loop so it sees the flag.
        let wake = if self.addr.ip().is_unspecified() { SocketAddr::new([127, 0, 0, 1].into(), self.addr.port()) } else { self.addr };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
    }
}

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}
fn read_bytes(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let n = read_u32(r)?;
    if n > MAX_LEN {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("a {n}-byte field is too large for the store")));
    }
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}
fn write_bytes(w: &mut impl Write, b: &[u8]) -> std::io::Result<()> {
    w.write_all(&(b.len() as u32).to_le_bytes())?;
    w.write_all(b)
}

/// One client connection: answers requests until it closes.
fn serve(conn: TcpStream, st: &ServerState) {
    let _ = conn.set_nodelay(true);
    let Ok(wconn) = conn.try_clone() else { return };
    let (mut r, mut w) = (BufReader::new(conn), BufWriter::new(wconn));
    loop {
        let req = (|| -> std::io::Result<(u8, u32, u32, u64, String, Vec<u8>)> {
            let mut op = [0u8; 1];
            r.read_exact(&mut op)?;
            let (rank, world) = (read_u32(&mut r)?, read_u32(&mut r)?);
            let mut ms = [0u8; 8];
            r.read_exact(&mut ms)?;
            let key = String::from_utf8_lossy(&read_bytes(&mut r)?).into_owned();
            Ok((op[0], rank, world, u64::from_le_bytes(ms), key, read_bytes(&mut r)?))
        })();
        let Ok((op, rank, world, wait_ms, key, value)) = req else { return };
        let reply = handle(st, op, rank, world, Duration::from_millis(wait_ms), &key, value);
        let (status, payload) = match reply {
            Ok(v) => (0u8, v),
            Err(m) => (1u8, m.into_bytes()),
        };
        if w.write_all(&[status]).and_then(|()| write_bytes(&mut w, &payload)).and_then(|()| w.flush()).is_err() {
            return;
        }
    }
}

fn handle(
    st: &ServerState,
    op: u8,
    rank: u32,
    world: u32,
    wait: Duration,
    key: &str,
    value: Vec<u8>,
) -> std::result::Result<Vec<u8>, String> {
    let deadline = Instant::now() + wait;
    let mut sh = lock(&st.shared);
    // Waits until `ready` holds, failing on a failure notice, a stopping server or the deadline.
    macro_rules! wait_for {
        ($ready:expr, $what:expr) => {
            loop {
                if let Some(f) = &sh.failure {
                    return Err(f.clone());
                }
                if $ready(&*sh) {
                    break;
                }
                let now = Instant::now();
                if now >= deadline || st.stop.load(Ordering::Acquire) {
                    return Err(format!("timed out after {:.1} s waiting for {}", wait.as_secs_f64(), $what));
                }
                sh = st.cv.wait_timeout(sh, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
            }
        };
    }
    match op {
        SET => {
            if let Some(f) = &sh.failure {
                return Err(f.clone());
            }
            sh.kv.insert(key.to_string(), value);
            st.cv.notify_all();
            Ok(Vec::new())
        }
        GET => {
            wait_for!(|s: &Shared| s.kv.contains_key(key), format!("key {key:?}"));
            Ok(sh.kv[key].clone())
        }
        BARRIER => {
            if let Some(f) = &sh.failure {
                return Err(f.clone());
            }
            *sh.barriers.entry(key.to_string()).or_default() += 1;
            st.cv.notify_all();
            let world = world as usize;
            let count = |s: &Shared| s.barriers.get(key).copied().unwrap_or(0);
            wait_for!(|s: &Shared| count(s) >= world, format!("barrier {key:?} ({} of {world} ranks arrived)", count(&sh)));
            Ok(Vec::new())
        }
        FAIL => {
            if sh.failure.is_none() {
                sh.failure = Some(format!("rank {rank} failed: {}", String::from_utf8_lossy(&value)));
            }
            st.cv.notify_all();
            Ok(Vec::new())
        }
        CHECK => Ok(sh.failure.clone().unwrap_or_default().into_bytes()),
        _ => Err(format!("unknown store request {op}")),
    }
}

/// One rank's connection to the store.
pub struct Store {
    addr: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    conn: Mutex<(BufReader<TcpStream>, BufWriter<TcpStream>)>,
    barriers: AtomicU64,
    /// Rank 0's server, kept alive as long as its own connection.
    _server: Option<StoreServer>,
}

impl Store {
    /// Connects to the store at `addr` ("host:port"), retrying until `timeout` while the server
    /// is not up yet. `timeout` also bounds every later wait (`get`, `barrier`).
    pub fn connect(addr: &str, rank: usize, world_size: usize, timeout: Duration) -> Result<Store> {
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no address resolved");
        let stream = loop {
            if let Ok(s) = Self::try_connect(addr, deadline, &mut last) {
                break s;
            }
            if Instant::now() >= deadline {
                bail!(
                    "store",
                    "rank {rank} could not reach the rendezvous store at {addr} within {:.1} s (is rank 0 running, are MASTER_ADDR/MASTER_PORT right?): {last}",
                    timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let _ = stream.set_nodelay(true);
        let w = stream.try_clone().map_err(|e| Error::new("store", e.to_string()))?;
        Ok(Store {
            addr: addr.to_string(),
            rank,
            world_size,
            timeout,
            conn: Mutex::new((BufReader::new(stream), BufWriter::new(w))),
            barriers: AtomicU64::new(0),
            _server: None,
        })
    }

    fn try_connect(addr: &str, deadline: Instant, last: &mut String) -> std::result::Result<TcpStream, ()> {
        let addrs = addr.to_socket_addrs().map_err(|e| *last = format!("cannot resolve {addr}: {e}"))?;
        for a in addrs {
            let left = deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(10), Duration::from_secs(2));
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => return Ok(s),
                Err(e) => *last = format!("{a}: {e}"),
            }
        }
        Err(())
    }

    /// The torchrun-style rendezvous: rank 0 serves on all interfaces at `port`, every rank
    /// connects to `master_addr:port`.
    pub fn rendezvous(master_addr: &str, port: u16, rank: usize, world_size: usize, timeout: Duration) -> Result<Store> {
        let server = if rank == 0 { Some(StoreServer::bind(("0.0.0.0", port))?) } else { None };
        let mut s = Store::connect(&format!("{master_addr}:{port}"), rank, world_size, timeout)?;
        s._server = server;
        Ok(s)
    }

    /// A second connection for the same rank (a watchdog thread polls on its own connection so
    /// it never queues behind a blocking `get`).
    pub fn reconnect(&self) -> Result<Store> {
        Store::connect(&self.addr, self.rank, self.world_size, self.timeout)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    fn request(&self, op: u8, key: &str, value: &[u8], wait: Duration) -> Result<Vec<u8>> {
        let what = match op {
            SET => "set",
            GET => "get",
            BARRIER => "barrier",
            FAIL => "report_failure",
            _ => "check",
        };
        let ctx = || format!("store {what} {key:?} (rank {} at {})", self.rank, self.addr);
        let mut c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let (r, w) = &mut *c;
        // The server answers a wait at its deadline; a silent server is dead after a margin.
        let _ = r.get_ref().set_read_timeout(Some(wait + Duration::from_secs(10)));
        let io = (|| -> std::io::Result<(u8, Vec<u8>)> {
            w.write_all(&[op])?;
            w.write_all(&(self.rank as u32).to_le_bytes())?;
            w.write_all(&(self.world_size as u32).to_le_bytes())?;
            w.write_all(&(wait.as_millis() as u64).to_le_bytes())?;
            write_bytes(w, key.as_bytes())?;
            write_bytes(w, value)?;
            w.flush()?;
            let mut status = [0u8; 1];
            r.read_exact(&mut status)?;
            Ok((status[0], read_bytes(r)?))
        })();
        match io {
            Ok((0, v)) => Ok(v),
            Ok((_, m)) => Err(Error::new(ctx(), String::from_utf8_lossy(&m).into_owned())),
            Err(e) => Err(Error::new(ctx(), format!("connection to the store lost (did rank 0 exit?): {e}"))),
        }
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.request(SET, key, value, Duration::ZERO).map(|_| ())
    }
    /// The value of `key`, waiting (up to the timeout) until some rank sets it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.request(GET, key, &[], self.timeout)
    }
    /// Returns when every rank has entered this barrier (barriers are numbered per connection
    /// so each rank must call them in the same order).
    pub fn barrier(&self, name: &str) -> Result<()> {
        let k = self.barriers.fetch_add(1, Ordering::Relaxed);
        self.request(BARRIER, &format!("{name}#{k}"), &[], self.timeout).map(|_| ())
    }
    /// Posts a failure notice: every rank's waiting and later requests fail with it.
    pub fn report_failure(&self, msg: &str) -> Result<()> {
        self.request(FAIL, "", msg.as_bytes(), Duration::ZERO).map(|_| ())
    }
    /// The failure notice, if any rank has posted one ("rank R failed: ...").
    pub fn failure(&self) -> Result<Option<String>> {
        let v = self.request(CHECK, "", &[], Duration::ZERO)?;
        Ok(if v.is_empty() { None } else { Some(String::from_utf8_lossy(&v).into_owned()) })
    }
}
