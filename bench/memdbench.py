"""One ``memfs memd`` under many small requests at once: reads/s and its CPU per read.

P client processes, each with C blocking connections to one memory server on
loopback, keep one 16 KiB READ outstanding on every connection for
``--seconds``.  Reported per P x C: reads/s over all of them and the memory
server's CPU (user + system, from /proc) per read.  This is what a memory
server with many clients does all day; the clients here are plain sockets,
no transport, so that they cost as little as possible of this machine's CPUs.
The CPU per read is the figure to compare across code (``--code``); the
reads/s also depend on what the client processes leave over.

    python bench/memdbench.py [--configs 1x1,1x2,2x8,2x64] [--seconds 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import secrets
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tcpbench import start_memd, stop_process  # bench/ is the script's directory

REQUEST = 16 << 10
VOLUME = 256 << 20


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the memory server closed the connection")
        got += k


def _frame(sock: socket.socket, limit: int) -> tuple[object, bytes]:
    from memfs import wire

    head = bytearray(wire.HEADER_SIZE)
    _recv_exactly(sock, memoryview(head))
    h = wire.parse_header(head, limit)
    payload = bytearray(h.length)
    _recv_exactly(sock, memoryview(payload))
    return h, bytes(payload)


def _connect(port: int, secret: bytes) -> socket.socket:
    from memfs import wire
    from memfs.wire import Kind

    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hs = wire.Handshake(secret)
    _, hello = _frame(sock, 1024)
    sock.sendall(wire.frame(Kind.AUTH, 0, hs.auth(hello, "tcp")))
    _, welcome = _frame(sock, 1024)
    hs.check_welcome(welcome)
    return sock


def _client(port: int, secret: bytes, conns: int, start: float, seconds: float,
            out: multiprocessing.Queue) -> None:
    from memfs import wire
    from memfs.wire import Kind

    socks = [_connect(port, secret) for _ in range(conns)]
    rng = random.Random(os.getpid())
    head = memoryview(bytearray(wire.HEADER_SIZE))
    data = memoryview(bytearray(REQUEST))
    n = 0
    while time.time() < start:
        time.sleep(0.001)
    end = start + seconds
    while time.time() < end:
        for s in socks:
            offset = rng.randrange(0, VOLUME - REQUEST, REQUEST)
            s.sendall(wire.frame(Kind.READ, 7, wire.READ.pack(0, offset, REQUEST)))
        for s in socks:
            _recv_exactly(s, head)
            _recv_exactly(s, data)
        n += conns
    for s in socks:
        s.close()
    out.put(n)


def _cpu_ticks(pid: int) -> int:
    """User + system time of every thread of *pid*, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@contextmanager
def memd(code: str | None, secret_file: Path) -> Iterator[tuple[int, int]]:
    """A memory server (from *code*, a checkout, or this one): (pid, port)."""
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = code
    p, port = start_memd(["--volumes", "1", "--volume-size", str(VOLUME),
                          "--secret-file", str(secret_file)], env)
    try:
        yield p.pid, port
    finally:
        stop_process(p)


def run(pid: int, port: int, secret: bytes, procs: int, conns: int,
        seconds: float) -> tuple[float, float]:
    """(reads/s, memd CPU us per read) of one P x C run."""
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()
    start = time.time() + 1.0
    workers = [ctx.Process(target=_client, args=(port, secret, conns, start, seconds, out))
               for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        while time.time() < start:
            time.sleep(0.005)
        c0 = _cpu_ticks(pid)
        total = sum(out.get(timeout=seconds + 60) for _ in workers)
        c1 = _cpu_ticks(pid)
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
                w.join()
    tick = os.sysconf("SC_CLK_TCK")
    return total / seconds, (c1 - c0) / tick / max(total, 1) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="1x1,1x2,2x8,2x64",
                    help="client processes x connections each, comma-separated")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--code", help="run the memd of another checkout (a baseline)")
    args = ap.parse_args()
    configs = []
    for c in args.configs.split(","):
        p, _, n = c.partition("x")
        configs.append((int(p), int(n)))
    results: dict[tuple[int, int], list[tuple[float, float]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = Path(tmp) / "secret"
        secret = secrets.token_hex(32).encode()
        secret_file.write_bytes(secret)
        secret_file.chmod(0o600)
        for r in range(args.rounds):
            with memd(args.code, secret_file) as (pid, port):
                for procs, conns in configs:
                    results[(procs, conns)].append(
                        run(pid, port, secret, procs, conns, args.seconds))
                    print(f"round {r + 1}: {procs} x {conns} done", file=sys.stderr)
    print(f"\none memfs memd ({args.code or 'this checkout'}), 16 KiB READs, one outstanding "
          f"per connection, {args.seconds:g} s, medians of {args.rounds}")
    print("| processes x connections | reads/s | memd CPU per read |")
    print("|---|---:|---:|")
    for (procs, conns), rs in results.items():
        rate = statistics.median(r for r, _ in rs)
        cpu = statistics.median(c for _, c in rs)
        print(f"| {procs} x {conns} | {rate:,.0f} | {cpu:.1f} us |")


if __name__ == "__main__":
    main()
