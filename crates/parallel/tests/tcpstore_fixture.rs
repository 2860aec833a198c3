//! Replays a real PyTorch TCPStore exchange (recorded by scripts/record_tcpstore_fixture.py from
//! torch 2.15: a torch client talking to torch's server through a recording proxy) in both
//! directions, so CI checks the wire protocol without Python:
//! - our client, run through the same operations against a fake server that plays the recorded
//!   replies, must send exactly the torch client's bytes and return torch's results;
//! - our server, sent the torch client's bytes, must answer exactly the torch server's bytes.
use ferrolm_parallel::store::StoreServer;
use ferrolm_parallel::tcpstore::TcpStoreClient;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tcpstore_torch_session.jsonl");

struct Record {
    op: String,
    args: Value,
    /// (from the client?, bytes)
    exchange: Vec<(bool, Vec<u8>)>,
    result: Value,
}

fn hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex {s:?}");
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn records() -> Vec<Record> {
    let text = std::fs::read_to_string(FIXTURE).unwrap_or_else(|e| panic!("{FIXTURE}: {e}"));
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            Record {
                op: v["op"].as_str().unwrap().to_string(),
                args: v["args"].clone(),
                exchange: v["exchange"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| (c[0].as_str().unwrap() == "C", hex(c[1].as_str().unwrap())))
                    .collect(),
                result: v["result"].clone(),
            }
        })
        .collect()
}

fn arg_bytes(r: &Record, name: &str) -> Vec<u8> {
    let v = &r.args[name];
    match v.as_str() {
        // Keys are text, values hex.
        Some(s) if name == "key" => s.as_bytes().to_vec(),
        Some(s) => hex(s),
        None => panic!("{}: no argument {name}", r.op),
    }
}

fn arg_keys(r: &Record) -> Vec<Vec<u8>> {
    r.args["keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap().as_bytes().to_vec()).collect()
}

fn bytes_json(b: &[u8]) -> Value {
    json!({ "bytes": to_hex(b) })
}

/// The connect record: VALIDATE + magic, then PING + nonce, answered by the nonce.
fn nonce_of(handshake: &[u8]) -> [u8; 4] {
    assert_eq!(handshake.len(), 10, "VALIDATE(1) magic(4) PING(1) nonce(4): {}", to_hex(handshake));
    handshake[6..10].try_into().unwrap()
}

#[test]
fn the_fixture_is_a_real_torch_session() {
    let recs = records();
    assert!(recs.len() >= 20, "{} operations", recs.len());
    assert_eq!(recs[0].op, "connect");
    let (c, s) = (&recs[0].exchange[0], &recs[0].exchange[1]);
    assert!(c.0 && !s.0);
    assert_eq!(c.1[..6], [0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d], "VALIDATE 0x3C85F7CE then PING");
    assert_eq!(s.1, nonce_of(&c.1), "the server echoes the nonce");
    for op in ["set", "get", "add", "check", "compare_set", "wait", "delete_key", "num_keys"] {
        assert!(recs.iter().any(|r| r.op == op), "no {op} in the fixture");
    }
}

/// Plays the server side of `recs` to one client; returns the first difference.
fn fake_server(listener: TcpListener, recs: Vec<Record>) -> Result<(), String> {
    let (mut s, _) = listener.accept().map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut ours = [0u8; 4];
    for r in &recs {
        for (from_client, bytes) in &r.exchange {
            if *from_client {
                let mut got = vec![0u8; bytes.len()];
                s.read_exact(&mut got).map_err(|e| format!("{} {}: reading the client's {} bytes: {e}", r.op, r.args, bytes.len()))?;
                let (mut want, mut got_cmp) = (bytes.clone(), got.clone());
                if r.op == "connect" {
                    ours = nonce_of(&got);
                    // The nonce is the client's process id: compare everything else.
                    want[6..10].fill(0);
                    got_cmp[6..10].fill(0);
                }
                if got_cmp != want {
                    return Err(format!("{} {}: our client sent {}, torch's sent {}", r.op, r.args, to_hex(&got), to_hex(bytes)));
                }
            } else {
                let reply = if r.op == "connect" { ours.to_vec() } else { bytes.clone() };
                s.write_all(&reply).map_err(|e| e.to_string())?;
            }
        }
    }
    // Nothing more: the client sent no stray bytes.
    s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut extra = [0u8; 64];
    match s.read(&mut extra) {
        Ok(n) if n > 0 => Err(format!("our client sent {} more bytes: {}", n, to_hex(&extra[..n]))),
        _ => Ok(()),
    }
}

#[test]
fn our_client_sends_what_torchs_client_sent_and_reads_torchs_replies() {
    let recs = records();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn({
        let recs = records();
        move || fake_server(listener, recs)
    });
    let mut c = TcpStoreClient::connect(&addr, Duration::from_secs(5), 0x1234_5678).unwrap_or_else(|e| panic!("connect: {e}"));
    let long = Duration::from_secs(5);
    let mut mismatches = Vec::new();
    for r in &recs[1..] {
        let got: std::io::Result<Value> = match r.op.as_str() {
            "set" => c.set(&arg_bytes(r, "key"), &arg_bytes(r, "value")).map(|()| Value::Null),
            "get" => c.get(&arg_bytes(r, "key"), long).map(|v| v.map_or(json!("timeout"), |v| bytes_json(&v))),
            "add" => c.add(&arg_bytes(r, "key"), r.args["delta"].as_i64().unwrap()).map(|v| json!(v)),
            "check" => {
                let keys = arg_keys(r);
                c.check(&keys.iter().map(Vec::as_slice).collect::<Vec<_>>()).map(|v| json!(v))
            }
            "compare_set" => {
                c.compare_set(&arg_bytes(r, "key"), &arg_bytes(r, "expected"), &arg_bytes(r, "desired")).map(|v| bytes_json(&v))
            }
            "wait" => {
                let keys = arg_keys(r);
                let t = Duration::from_millis(r.args["timeout_ms"].as_u64().unwrap());
                c.wait(&keys.iter().map(Vec::as_slice).collect::<Vec<_>>(), t).map(|ok| if ok { Value::Null } else { json!("timeout") })
            }
            "delete_key" => c.delete_key(&arg_bytes(r, "key")).map(|v| json!(v)),
            "append" => c.append(&arg_bytes(r, "key"), &arg_bytes(r, "value")).map(|()| Value::Null),
            "multi_set" => {
                let keys = arg_keys(r);
                let values: Vec<Vec<u8>> = r.args["values"].as_array().unwrap().iter().map(|v| hex(v.as_str().unwrap())).collect();
                c.multi_set(&keys.iter().map(Vec::as_slice).collect::<Vec<_>>(), &values.iter().map(Vec::as_slice).collect::<Vec<_>>())
                    .map(|()| Value::Null)
            }
            "multi_get" => {
                let keys = arg_keys(r);
                c.multi_get(&keys.iter().map(Vec::as_slice).collect::<Vec<_>>(), long)
                    .map(|v| v.map_or(json!("timeout"), |vs| Value::Array(vs.iter().map(|b| bytes_json(b)).collect())))
            }
            "num_keys" => c.num_keys().map(|v| json!(v)),
            other => panic!("the fixture has an operation this test does not know: {other}"),
        };
        let got = match got {
            Ok(v) => v,
            Err(e) => {
                // The fake server hangs up at the first difference: its report says what it was.
                drop(c);
                let fake = server.join().unwrap();
                panic!("{} {}: {e}; the fake server says: {fake:?}", r.op, r.args);
            }
        };
        if got != r.result {
            mismatches.push(format!("{} {}: we returned {got}, torch returned {}", r.op, r.args, r.result));
        }
    }
    drop(c);
    server.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
    assert!(mismatches.is_empty(), "{mismatches:#?}");
}

#[test]
fn our_server_answers_torchs_client_as_torchs_server_did() {
    let recs = records();
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    for r in &recs {
        for (from_client, bytes) in &r.exchange {
            if *from_client {
                s.write_all(bytes).unwrap();
            } else {
                let mut got = vec![0u8; bytes.len()];
                s.read_exact(&mut got)
                    .unwrap_or_else(|e| panic!("{} {}: no {}-byte reply from our server: {e}", r.op, r.args, bytes.len()));
                assert_eq!(to_hex(&got), to_hex(bytes), "{} {}: our server's reply differs from torch's", r.op, r.args);
            }
        }
    }
    s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut extra = [0u8; 16];
    assert!(!matches!(s.read(&mut extra), Ok(n) if n > 0), "our server sent more than torch's");
}
