//! PyTorch's TCPStore wire protocol: the constants, the framing, and a client.
//!
//! Under torchrun the elastic agent serves a TCPStore on `MASTER_ADDR:MASTER_PORT` and every
//! worker joins it as a client, so ferrolm speaks this protocol. Our own server
//! (`tcpstore_server`, served by rank 0 when no agent does) speaks it too, so one client talks to
//! both and a torch client can talk to ours.
//!
//! The protocol, as PyTorch's `TCPStore.cpp` / `TCPStoreLibUvBackend.cpp` put it on the wire
//! (checked against bytes recorded from torch 2.15, `tests/fixtures/tcpstore_torch_session.jsonl`):
//! - every integer is little endian; a string or byte vector is a `u64` length and the bytes;
//! - a request is one query-type byte and its arguments; a connection starts with `VALIDATE`
//!   and the `u32` magic number `0x3C85F7CE` (no reply: a server that disagrees stays silent or
//!   hangs up), then torch's client sends `PING` with a `u32` nonce (its process id), which the
//!   server echoes: the first reply of the connection, so it proves the server speaks this
//!   version;
//! - `SET key value` and `APPEND key value` have no reply; `GET key` replies the value (empty
//!   when absent); `ADD key i64` stores the decimal sum and replies it as `i64`;
//!   `COMPARE_SET key expected desired` replies the value now stored (or `expected` when the key
//!   is absent and `expected` is not empty); `CHECK n keys` replies `READY`/`NOT_READY` (`u8`);
//!   `WAIT n keys` replies `STOP_WAITING` once every key is set, and a client that gives up sends
//!   `CANCEL_WAIT`, answered by `WAIT_CANCELED` (after a `STOP_WAITING` that crossed it);
//!   `DELETE_KEY key` replies the number removed (`i64`); `GETNUMKEYS` the key count (`i64`);
//!   `MULTI_GET n keys` replies n values; `MULTI_SET n (key value)*` has no reply.
//! - torch's `get` is `WAIT [key]` then `GET key`; torch's client puts "/" before every key.
use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// The validation magic number of the TCPStore protocol version we speak (recorded from torch 2.15).
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// Query types, in PyTorch's order.
pub mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
}

pub const CHECK_READY: u8 = 0;
pub const CHECK_NOT_READY: u8 = 1;
pub const STOP_WAITING: u8 = 0;
pub const WAIT_CANCELED: u8 = 1;

/// Keys and values are small (ids, counters, descriptors); a longer field is a corrupt stream.
pub const MAX_FIELD: u64 = 64 << 20;

/// How long a plain request may wait for its reply before the server counts as dead.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// Appends a `u64`-length-prefixed field.
pub(crate) fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
    buf.extend_from_slice(b);
}

pub(crate) fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}
pub(crate) fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}
pub(crate) fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
pub(crate) fn read_bytes(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let n = read_u64(r)?;
    if n > MAX_FIELD {
        return Err(invalid(format!("a {n}-byte field is too large for the store")));
    }
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

pub(crate) fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Local addresses of this process's client connections: our server does not wait for these
/// when it lingers before shutting down (they belong to the process that is shutting down).
pub(crate) fn own_clients() -> &'static Mutex<HashSet<SocketAddr>> {
    static OWN: OnceLock<Mutex<HashSet<SocketAddr>>> = OnceLock::new();
    OWN.get_or_init(Mutex::default)
}

/// Why a connection attempt failed.
#[derive(Debug)]
pub enum ConnectError {
    /// Nothing answered (refused, unreachable, unresolved): the server may not be up yet.
    Unreachable(String),
    /// Something answered but did not complete the TCPStore validation handshake: a different
    /// protocol version, or not a store at all. Retrying does not help.
    NotAStore(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Unreachable(m) | ConnectError::NotAStore(m) => f.write_str(m),
        }
    }
}

/// One client connection speaking the TCPStore protocol. Keys are sent as given (no prefix).
pub struct TcpStoreClient {
    stream: TcpStream,
    local: Option<SocketAddr>,
    peer: SocketAddr,
}

impl TcpStoreClient {
    /// One attempt: connects to `addr` ("host:port") and runs the validation handshake (VALIDATE,
    /// then PING with `nonce`), waiting at most `handshake` for the echo.
    pub fn connect(addr: &str, handshake: Duration, nonce: u32) -> Result<TcpStoreClient, ConnectError> {
        let addrs: Vec<SocketAddr> =
            addr.to_socket_addrs().map_err(|e| ConnectError::Unreachable(format!("cannot resolve {addr}: {e}")))?.collect();
        let mut last = format!("{addr} resolved to no address");
        for a in addrs {
            let stream = match TcpStream::connect_timeout(&a, handshake.max(Duration::from_millis(10))) {
                Ok(s) => s,
                Err(e) => {
                    last = format!("{a}: {e}");
                    continue;
                }
            };
            return Self::handshake(stream, a, handshake, nonce);
        }
        Err(ConnectError::Unreachable(last))
    }

    fn handshake(stream: TcpStream, peer: SocketAddr, timeout: Duration, nonce: u32) -> Result<TcpStoreClient, ConnectError> {
        let not_a_store = |what: String| {
            ConnectError::NotAStore(format!(
                "{peer} {what}; expected PyTorch's TCPStore protocol (validation magic {VALIDATION_MAGIC:#010X}, then a PING that is echoed)"
            ))
        };
        let _ = stream.set_nodelay(true);
        let _ = stream.set_write_timeout(Some(REPLY_TIMEOUT));
        let _ = stream.set_read_timeout(Some(timeout.max(Duration::from_millis(1))));
        let mut hello = vec![query::VALIDATE];
        hello.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        hello.push(query::PING);
        hello.extend_from_slice(&nonce.to_le_bytes());
        let mut s = &stream;
        if let Err(e) = s.write_all(&hello) {
            return Err(not_a_store(format!("refused the validation handshake ({e})")));
        }
        let mut echo = [0u8; 4];
        let mut got = 0;
        while got < 4 {
            match s.read(&mut echo[got..]) {
                Ok(0) => {
                    return Err(not_a_store(if got == 0 {
                        "closed the connection during the validation handshake (a store of another protocol version hangs up on a magic number it does not know)".into()
                    } else {
                        format!("sent {:?} and closed the connection during the validation handshake", String::from_utf8_lossy(&echo[..got]))
                    }))
                }
                Ok(n) => got += n,
                Err(e) if is_timeout(&e) => {
                    return Err(not_a_store(format!(
                        "did not answer the validation handshake within {:.1} s (a store of another protocol version, or a server that is not a store)",
                        timeout.as_secs_f64()
                    )))
                }
                Err(e) => return Err(not_a_store(format!("dropped the connection during the validation handshake ({e})"))),
            }
        }
        if u32::from_le_bytes(echo) != nonce {
            // Show what the other side says: an HTTP server answers with a status line.
            let mut more = [0u8; 60];
            let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
            let n = s.read(&mut more).unwrap_or(0);
            let text: String = String::from_utf8_lossy(&[&echo[..], &more[..n]].concat()).chars().take(64).collect();
            return Err(not_a_store(format!("answered the validation handshake with {text:?}, not the echo of its PING")));
        }
        let local = stream.local_addr().ok();
        if let Some(l) = local {
            own_clients().lock().unwrap_or_else(|e| e.into_inner()).insert(l);
        }
        Ok(TcpStoreClient { stream, local, peer })
    }

    /// The server's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    fn send(&mut self, buf: &[u8]) -> io::Result<()> {
        (&self.stream).write_all(buf)
    }

    fn reply<T>(&mut self, timeout: Duration, read: impl FnOnce(&mut &TcpStream) -> io::Result<T>) -> io::Result<T> {
        self.stream.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
        read(&mut &self.stream)
    }

    fn request(op: u8) -> Vec<u8> {
        let mut b = Vec::with_capacity(64);
        b.push(op);
        b
    }

    fn with_keys(op: u8, keys: &[&[u8]]) -> Vec<u8> {
        let mut b = Self::request(op);
        b.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_bytes(&mut b, k);
        }
        b
    }

    pub fn ping(&mut self, nonce: u32) -> io::Result<()> {
        let mut b = Self::request(query::PING);
        b.extend_from_slice(&nonce.to_le_bytes());
        self.send(&b)?;
        let echo = self.reply(REPLY_TIMEOUT, |s| read_u32(s))?;
        if echo != nonce {
            return Err(invalid(format!("PING {nonce} answered with {echo}")));
        }
        Ok(())
    }

    pub fn set(&mut self, key: &[u8], value: &[u8]) -> io::Result<()> {
        let mut b = Self::request(query::SET);
        put_bytes(&mut b, key);
        put_bytes(&mut b, value);
        self.send(&b)
    }

    pub fn append(&mut self, key: &[u8], value: &[u8]) -> io::Result<()> {
        let mut b = Self::request(query::APPEND);
        put_bytes(&mut b, key);
        put_bytes(&mut b, value);
        self.send(&b)
    }

    pub fn multi_set(&mut self, keys: &[&[u8]], values: &[&[u8]]) -> io::Result<()> {
        assert_eq!(keys.len(), values.len(), "multi_set: one value per key");
        let mut b = Self::request(query::MULTI_SET);
        b.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for (k, v) in keys.iter().zip(values) {
            put_bytes(&mut b, k);
            put_bytes(&mut b, v);
        }
        self.send(&b)
    }

    /// Waits until every key is set: `Ok(false)` after `timeout` (the wait is cancelled first,
    /// as torch's client does, so the connection stays usable).
    pub fn wait(&mut self, keys: &[&[u8]], timeout: Duration) -> io::Result<bool> {
        self.send(&Self::with_keys(query::WAIT, keys))?;
        match self.reply(timeout, |s| read_u8(s)) {
            Ok(STOP_WAITING) => return Ok(true),
            Ok(r) => return Err(invalid(format!("WAIT answered with {r}, not STOP_WAITING"))),
            Err(e) if is_timeout(&e) => {}
            Err(e) => return Err(e),
        }
        self.send(&[query::CANCEL_WAIT])?;
        match self.reply(REPLY_TIMEOUT, |s| read_u8(s))? {
            WAIT_CANCELED => Ok(false),
            // The keys arrived while the cancel was on its way: the cancel is answered next.
            STOP_WAITING => match self.reply(REPLY_TIMEOUT, |s| read_u8(s))? {
                WAIT_CANCELED => Ok(true),
                r => Err(invalid(format!("CANCEL_WAIT answered with {r}, not WAIT_CANCELED"))),
            },
            r => Err(invalid(format!("CANCEL_WAIT answered with {r}"))),
        }
    }

    /// `GET` alone: the value, empty when the key is absent (the server does not wait).
    pub fn get_now(&mut self, key: &[u8]) -> io::Result<Vec<u8>> {
        let mut b = Self::request(query::GET);
        put_bytes(&mut b, key);
        self.send(&b)?;
        self.reply(REPLY_TIMEOUT, |s| read_bytes(s))
    }

    /// torch's `get`: waits up to `timeout` for the key, then reads it; `None` on timeout.
    pub fn get(&mut self, key: &[u8], timeout: Duration) -> io::Result<Option<Vec<u8>>> {
        if !self.wait(&[key], timeout)? {
            return Ok(None);
        }
        self.get_now(key).map(Some)
    }

    /// torch's `multi_get`: waits for every key, then reads them all; `None` on timeout.
    pub fn multi_get(&mut self, keys: &[&[u8]], timeout: Duration) -> io::Result<Option<Vec<Vec<u8>>>> {
        if !self.wait(keys, timeout)? {
            return Ok(None);
        }
        self.send(&Self::with_keys(query::MULTI_GET, keys))?;
        self.reply(REPLY_TIMEOUT, |s| keys.iter().map(|_| read_bytes(s)).collect::<io::Result<Vec<_>>>()).map(Some)
    }

    /// Adds `delta` to the integer stored at `key` (absent: 0) and returns the sum.
    pub fn add(&mut self, key: &[u8], delta: i64) -> io::Result<i64> {
        let mut b = Self::request(query::ADD);
        put_bytes(&mut b, key);
        b.extend_from_slice(&delta.to_le_bytes());
        self.send(&b)?;
        self.reply(REPLY_TIMEOUT, |s| read_u64(s)).map(|v| v as i64)
    }

    /// Whether every key is set (does not wait).
    pub fn check(&mut self, keys: &[&[u8]]) -> io::Result<bool> {
        self.send(&Self::with_keys(query::CHECK, keys))?;
        match self.reply(REPLY_TIMEOUT, |s| read_u8(s))? {
            CHECK_READY => Ok(true),
            CHECK_NOT_READY => Ok(false),
            r => Err(invalid(format!("CHECK answered with {r}"))),
        }
    }

    /// Stores `desired` if the value is `expected` (absent counts as empty) and returns the
    /// value now stored.
    pub fn compare_set(&mut self, key: &[u8], expected: &[u8], desired: &[u8]) -> io::Result<Vec<u8>> {
        let mut b = Self::request(query::COMPARE_SET);
        put_bytes(&mut b, key);
        put_bytes(&mut b, expected);
        put_bytes(&mut b, desired);
        self.send(&b)?;
        self.reply(REPLY_TIMEOUT, |s| read_bytes(s))
    }

    /// Removes the key; whether it existed.
    pub fn delete_key(&mut self, key: &[u8]) -> io::Result<bool> {
        let mut b = Self::request(query::DELETE_KEY);
        put_bytes(&mut b, key);
        self.send(&b)?;
        self.reply(REPLY_TIMEOUT, |s| read_u64(s)).map(|n| n == 1)
    }

    pub fn num_keys(&mut self) -> io::Result<i64> {
        self.send(&[query::GETNUMKEYS])?;
        self.reply(REPLY_TIMEOUT, |s| read_u64(s)).map(|v| v as i64)
    }
}

impl Drop for TcpStoreClient {
    fn drop(&mut self) {
        if let Some(l) = self.local {
            own_clients().lock().unwrap_or_else(|e| e.into_inner()).remove(&l);
        }
    }
}
