//! Our TCPStore server: what rank 0 serves when no torchrun agent does (the `launch` example,
//! srun or mpirun with exported variables). It speaks the subset of PyTorch's TCPStore protocol
//! that clients use (every query but the queue and watch extensions; see `tcpstore`), with
//! torch's semantics, so our client and torch's talk to it alike.
//!
//! One thread per connection reads requests; replies and wake-ups are written under the state
//! lock, so a `STOP_WAITING` sent by the thread that set a key is ordered before the
//! `WAIT_CANCELED` of a cancel that crossed it. A connection that breaks the protocol is closed,
//! as torch's server does.
//!
//! Shutdown: dropping the server first lingers (up to `linger`, default 30 s) until every client
//! connection of *other* processes has closed, so rank 0 finishing first does not pull the store
//! from under ranks still on their way out; then it closes the listener and every connection.
use crate::tcpstore::{
    own_clients, put_bytes, query, read_bytes, read_u32, read_u64, read_u8, CHECK_NOT_READY, CHECK_READY, STOP_WAITING, VALIDATION_MAGIC,
    WAIT_CANCELED,
};
use std::collections::HashMap;
use std::io::{self, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
}

#[derive(Default)]
struct Inner {
    kv: HashMap<Vec<u8>, Vec<u8>>,
    /// key -> connections waiting for it.
    waiting: HashMap<Vec<u8>, Vec<u64>>,
    /// connection -> keys it still waits for.
    awaited: HashMap<u64, usize>,
    conns: HashMap<u64, Conn>,
}

struct State {
    inner: Mutex<Inner>,
    /// Signalled when a connection closes (the linger waits on it).
    closed: Condvar,
    stop: AtomicBool,
    next_id: AtomicU64,
}

fn lock(st: &State) -> MutexGuard<'_, Inner> {
    st.inner.lock().unwrap_or_else(|e| e.into_inner())
}

/// A TCPStore server on its own threads. Stops (after lingering) when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    state: Arc<State>,
    linger: Duration,
}

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port; see `addr()`).
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> ferrolm_tensor::Result<StoreServer> {
        let what = format!("{addr:?}");
        Self::bind_io(addr).map_err(|e| ferrolm_tensor::Error::new("store", format!("cannot listen on {what}: {e}")))
    }

    /// `bind` with the I/O error kept (rendezvous tells an address in use apart).
    pub(crate) fn bind_io(addr: impl ToSocketAddrs) -> io::Result<StoreServer> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let state =
            Arc::new(State { inner: Mutex::default(), closed: Condvar::new(), stop: AtomicBool::new(false), next_id: AtomicU64::new(0) });
        let st = state.clone();
        std::thread::Builder::new().name("store-server".into()).spawn(move || {
            for conn in listener.incoming() {
                if st.stop.load(Ordering::Acquire) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let st = st.clone();
                let _ = std::thread::Builder::new().name("store-conn".into()).spawn(move || serve(conn, &st));
            }
        })?;
        Ok(StoreServer { addr: local, state, linger: Duration::from_secs(30) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How long dropping the server waits for other processes' clients to disconnect.
    pub fn set_linger(&mut self, linger: Duration) {
        self.linger = linger;
    }

    /// Open client connections.
    pub fn connections(&self) -> usize {
        lock(&self.state).conns.len()
    }

    /// Open client connections of other processes (not in `own_clients`).
    fn foreign_connections(inner: &Inner) -> usize {
        let own = own_clients().lock().unwrap_or_else(|e| e.into_inner());
        inner.conns.values().filter(|c| !own.contains(&c.peer)).count()
    }
}

impl StoreServer {
    /// Waits until no client of another process is connected, at most `max`; whether none is.
    /// (A process that is about to exit calls it so the others can read a failure notice first.)
    pub fn wait_for_other_clients(&self, max: Duration) -> bool {
        let started = Instant::now();
        let deadline = started + max;
        let mut told = false;
        let mut inner = lock(&self.state);
        loop {
            let n = Self::foreign_connections(&inner);
            let now = Instant::now();
            if n == 0 {
                return true;
            }
            if now >= deadline {
                return false;
            }
            if !told && now - started >= Duration::from_secs(2) {
                eprintln!(
                    "ferrolm-parallel: the rendezvous store on {} waits for {n} client(s) of other ranks to disconnect (up to {:.0} s) before it stops",
                    self.addr,
                    max.as_secs_f64()
                );
                told = true;
            }
            // Short waits: own_clients changes without a signal.
            let wait = (deadline - now).min(Duration::from_millis(100));
            inner = self.state.closed.wait_timeout(inner, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.wait_for_other_clients(self.linger);
        let inner = lock(&self.state);
        self.state.stop.store(true, Ordering::Release);
        for c in inner.conns.values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        drop(inner);
        // Wake the accept loop so it sees the flag.
        let wake = if self.addr.ip().is_unspecified() { SocketAddr::new([127, 0, 0, 1].into(), self.addr.port()) } else { self.addr };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
    }
}

/// One client connection: answers requests until it closes or breaks the protocol.
fn serve(conn: TcpStream, st: &State) {
    let _ = conn.set_nodelay(true);
    // A peer that stops reading must not stall the server (writes happen under the lock).
    let _ = conn.set_write_timeout(Some(Duration::from_secs(5)));
    let (Ok(reader), Ok(writer), Ok(peer)) = (conn.try_clone(), conn.try_clone(), conn.peer_addr()) else { return };
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    {
        let mut inner = lock(st);
        if st.stop.load(Ordering::Acquire) {
            return;
        }
        inner.conns.insert(id, Conn { stream: writer, peer });
    }
    let mut r = BufReader::new(reader);
    let validated = read_u8(&mut r).ok() == Some(query::VALIDATE) && read_u32(&mut r).ok() == Some(VALIDATION_MAGIC);
    if validated {
        while let Ok(op) = read_u8(&mut r) {
            if handle(st, id, op, &mut r).is_err() {
                break;
            }
        }
    }
    let mut inner = lock(st);
    if let Some(c) = inner.conns.remove(&id) {
        let _ = c.stream.shutdown(Shutdown::Both);
    }
    inner.awaited.remove(&id);
    for w in inner.waiting.values_mut() {
        w.retain(|&c| c != id);
    }
    inner.waiting.retain(|_, w| !w.is_empty());
    st.closed.notify_all();
}

fn read_keys(r: &mut impl io::Read) -> io::Result<Vec<Vec<u8>>> {
    let n = read_u64(r)?;
    if n > 1 << 20 {
        return Err(crate::tcpstore::invalid(format!("{n} keys in one request")));
    }
    (0..n).map(|_| read_bytes(r)).collect()
}

fn write_to(inner: &Inner, id: u64, bytes: &[u8]) -> io::Result<()> {
    match inner.conns.get(&id) {
        Some(c) => (&c.stream).write_all(bytes),
        None => Err(io::ErrorKind::NotConnected.into()),
    }
}

/// Tells the connections waiting on `key` that it is set (those waiting for no other key).
fn wake(inner: &mut Inner, key: &[u8]) {
    let Some(ids) = inner.waiting.remove(key) else { return };
    for id in ids {
        let done = match inner.awaited.get_mut(&id) {
            Some(n) => {
                *n = n.saturating_sub(1);
                *n == 0
            }
            None => false,
        };
        if done {
            inner.awaited.remove(&id);
            // A failed write shows up as that connection's own read error.
            let _ = write_to(inner, id, &[STOP_WAITING]);
        }
    }
}

fn handle(st: &State, id: u64, op: u8, r: &mut impl io::Read) -> io::Result<()> {
    // Read the whole request before taking the lock.
    match op {
        query::SET | query::APPEND => {
            let (key, value) = (read_bytes(r)?, read_bytes(r)?);
            let mut inner = lock(st);
            if op == query::SET {
                inner.kv.insert(key.clone(), value);
            } else {
                inner.kv.entry(key.clone()).or_default().extend_from_slice(&value);
            }
            wake(&mut inner, &key);
            Ok(())
        }
        query::MULTI_SET => {
            let n = read_u64(r)?;
            let mut pairs = Vec::new();
            for _ in 0..n {
                pairs.push((read_bytes(r)?, read_bytes(r)?));
            }
            let mut inner = lock(st);
            for (k, v) in pairs {
                inner.kv.insert(k.clone(), v);
                wake(&mut inner, &k);
            }
            Ok(())
        }
        query::COMPARE_SET => {
            let (key, expected, desired) = (read_bytes(r)?, read_bytes(r)?, read_bytes(r)?);
            let mut inner = lock(st);
            let now = match inner.kv.get(&key) {
                None if expected.is_empty() => {
                    inner.kv.insert(key.clone(), desired.clone());
                    wake(&mut inner, &key);
                    desired
                }
                // torch answers `expected` for an absent key it did not set.
                None => expected,
                Some(v) if *v == expected => {
                    inner.kv.insert(key.clone(), desired.clone());
                    desired
                }
                Some(v) => v.clone(),
            };
            let mut out = Vec::with_capacity(now.len() + 8);
            put_bytes(&mut out, &now);
            write_to(&inner, id, &out)
        }
        query::GET => {
            let key = read_bytes(r)?;
            let inner = lock(st);
            let mut out = Vec::new();
            put_bytes(&mut out, inner.kv.get(&key).map_or(&[][..], |v| v));
            write_to(&inner, id, &out)
        }
        query::MULTI_GET => {
            let keys = read_keys(r)?;
            let inner = lock(st);
            let mut out = Vec::new();
            for k in &keys {
                put_bytes(&mut out, inner.kv.get(k).map_or(&[][..], |v| v));
            }
            write_to(&inner, id, &out)
        }
        query::ADD => {
            let key = read_bytes(r)?;
            let delta = read_u64(r)? as i64;
            let mut inner = lock(st);
            let old = match inner.kv.get(&key) {
                None => 0,
                // torch's server drops a connection that adds to a value that is not a number.
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.trim().parse::<i64>().ok())
                    .ok_or_else(|| crate::tcpstore::invalid("ADD to a value that is not an integer"))?,
            };
            let sum = old.wrapping_add(delta);
            inner.kv.insert(key.clone(), sum.to_string().into_bytes());
            write_to(&inner, id, &sum.to_le_bytes())?;
            wake(&mut inner, &key);
            Ok(())
        }
        query::CHECK => {
            let keys = read_keys(r)?;
            let inner = lock(st);
            let ready = keys.iter().all(|k| inner.kv.contains_key(k));
            write_to(&inner, id, &[if ready { CHECK_READY } else { CHECK_NOT_READY }])
        }
        query::WAIT => {
            let keys = read_keys(r)?;
            let mut inner = lock(st);
            let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !inner.kv.contains_key(k)).collect();
            if missing.is_empty() {
                return write_to(&inner, id, &[STOP_WAITING]);
            }
            inner.awaited.insert(id, missing.len());
            for k in missing {
                inner.waiting.entry(k).or_default().push(id);
            }
            Ok(())
        }
        query::CANCEL_WAIT => {
            let mut inner = lock(st);
            inner.awaited.remove(&id);
            for w in inner.waiting.values_mut() {
                w.retain(|&c| c != id);
            }
            inner.waiting.retain(|_, w| !w.is_empty());
            write_to(&inner, id, &[WAIT_CANCELED])
        }
        query::GETNUMKEYS => {
            let inner = lock(st);
            write_to(&inner, id, &(inner.kv.len() as i64).to_le_bytes())
        }
        query::DELETE_KEY => {
            let key = read_bytes(r)?;
            let mut inner = lock(st);
            let n = i64::from(inner.kv.remove(&key).is_some());
            write_to(&inner, id, &n.to_le_bytes())
        }
        query::PING => {
            let nonce = read_u32(r)?;
            let inner = lock(st);
            write_to(&inner, id, &nonce.to_le_bytes())
        }
        other => Err(crate::tcpstore::invalid(format!("unknown TCPStore query type {other}"))),
    }
}
