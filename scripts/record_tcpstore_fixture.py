#!/usr/bin/env python3
"""Record a real PyTorch TCPStore client/server exchange for ferrolm's store tests.

ferrolm's rendezvous store (crates/parallel/src/tcpstore.rs) speaks PyTorch's TCPStore wire protocol,
so that under torchrun every rank joins the agent's store as a client. CI has no Python, so this
script records what torch itself puts on the wire, and `crates/parallel/tests/tcpstore_fixture.rs`
replays it in both directions:

  - our client must send, for each operation, the bytes the torch client sent, and must parse the
    replies the torch server sent (a scripted fake server plays the recorded replies);
  - our server, sent the torch client's recorded bytes, must answer what the torch server
    answered.

How it records: a torch `TCPStore` server (the default libuv backend) listens on a free port; a
recording TCP proxy sits between it and a torch `TCPStore` client; each operation below is run
through the client and the bytes of both directions are logged, in order, per operation.

Output: tests/fixtures/tcpstore_torch_session.jsonl, one JSON object per operation:
  {"op": ..., "args": {...}, "exchange": [["C", hex], ["S", hex], ...], "result": ...}
"C" chunks went client -> server, "S" chunks server -> client (consecutive chunks of one
direction merged). Keys in `args` are the keys on the wire: torch's C++ client puts "/" in front
of every key the Python API is given. `result` is what the torch client returned: {"bytes": hex},
an integer, a boolean, a list of these, "timeout" (the wait raised its timeout error) or null.

The first operation, "connect", is the validation handshake: VALIDATE with the magic number, then
PING with a nonce (the client's process id) that the server echoes. The nonce differs from run to
run; everything else is byte-identical on rerun.

Usage (environment: scripts/requirements-fixtures.txt):

    .venv/bin/python scripts/record_tcpstore_fixture.py [--out PATH]
"""
import argparse
import datetime
import json
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "tests", "fixtures", "tcpstore_torch_session.jsonl")


class RecordingProxy:
    """Forwards one connection to `target_port` and logs every chunk with its direction."""

    def __init__(self, target_port):
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.port = self.listener.getsockname()[1]
        self.log = []  # (direction, bytes), in arrival order
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.target_port))
        for src, dst, d in ((client, server, "C"), (server, client, "S")):
            threading.Thread(target=self._pump, args=(src, dst, d), daemon=True).start()

    def _pump(self, src, dst, direction):
        while True:
            data = src.recv(65536)
            if not data:
                return
            with self.lock:
                self.log.append((direction, data))
            dst.sendall(data)

    def take(self):
        """The chunks since the last call, once the connection has been quiet for a moment."""
        last, quiet_since = -1, time.monotonic()
        while time.monotonic() - quiet_since < 0.15:
            time.sleep(0.01)
            with self.lock:
                n = len(self.log)
            if n != last:
                last, quiet_since = n, time.monotonic()
        with self.lock:
            chunks, self.log = self.log, []
        merged = []
        for d, b in chunks:
            if merged and merged[-1][0] == d:
                merged[-1][1] += b
            else:
                merged.append([d, bytearray(b)])
        return [[d, bytes(b).hex()] for d, b in merged]


def wire(key):
    return "/" + key


def encode(result):
    if isinstance(result, (bytes, bytearray)):
        return {"bytes": bytes(result).hex()}
    if isinstance(result, list):
        return [encode(r) for r in result]
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    proxy = RecordingProxy(server.port)
    client = dist.TCPStore(
        "127.0.0.1", proxy.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    records = [{"op": "connect", "args": {}, "exchange": proxy.take(), "result": None}]

    def record(op, args, call):
        try:
            result = encode(call())
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise
            result = "timeout"
        records.append({"op": op, "args": args, "exchange": proxy.take(), "result": result})

    blob = bytes(range(0, 256, 17)) + b"\x00\xff"  # zeros and high bytes, like an NCCL id
    record("set", {"key": wire("key"), "value": b"val".hex()}, lambda: client.set("key", b"val"))
    record("get", {"key": wire("key")}, lambda: client.get("key"))
    record("set", {"key": wire("blob"), "value": blob.hex()}, lambda: client.set("blob", blob))
    record("get", {"key": wire("blob")}, lambda: client.get("blob"))
    record("add", {"key": wire("cnt"), "delta": 3}, lambda: client.add("cnt", 3))
    record("add", {"key": wire("cnt"), "delta": -1}, lambda: client.add("cnt", -1))
    record("add", {"key": wire("cnt"), "delta": 0}, lambda: client.add("cnt", 0))
    record("get", {"key": wire("cnt")}, lambda: client.get("cnt"))
    record("check", {"keys": [wire("key"), wire("nokey")]}, lambda: client.check(["key", "nokey"]))
    record("check", {"keys": [wire("key")]}, lambda: client.check(["key"]))
    record(
        "compare_set",
        {"key": wire("cs"), "expected": "", "desired": b"first".hex()},
        lambda: client.compare_set("cs", b"", b"first"),
    )
    record(
        "compare_set",
        {"key": wire("cs"), "expected": b"nope".hex(), "desired": b"x".hex()},
        lambda: client.compare_set("cs", b"nope", b"x"),
    )
    record(
        "compare_set",
        {"key": wire("cs"), "expected": b"first".hex(), "desired": b"second".hex()},
        lambda: client.compare_set("cs", b"first", b"second"),
    )
    record(
        "compare_set",
        {"key": wire("absent"), "expected": b"old".hex(), "desired": b"new".hex()},
        lambda: client.compare_set("absent", b"old", b"new"),
    )
    record("wait", {"keys": [wire("key")], "timeout_ms": 5000},
           lambda: client.wait(["key"], datetime.timedelta(seconds=5)))
    record("wait", {"keys": [wire("never")], "timeout_ms": 300},
           lambda: client.wait(["never"], datetime.timedelta(milliseconds=300)))
    record("delete_key", {"key": wire("cnt")}, lambda: client.delete_key("cnt"))
    record("delete_key", {"key": wire("cnt")}, lambda: client.delete_key("cnt"))
    record("append", {"key": wire("ap"), "value": b"x".hex()}, lambda: client.append("ap", b"x"))
    record("append", {"key": wire("ap"), "value": b"yz".hex()}, lambda: client.append("ap", b"yz"))
    record("multi_set", {"keys": [wire("m1"), wire("m2")], "values": [b"1".hex(), b"22".hex()]},
           lambda: client.multi_set(["m1", "m2"], [b"1", b"22"]))
    record("multi_get", {"keys": [wire("ap"), wire("m2")]},
           lambda: client.multi_get(["ap", "m2"]))
    record("num_keys", {}, lambda: client.num_keys())

    with open(args.out, "w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    print(f"wrote {len(records)} operations to {os.path.normpath(args.out)} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
