"""The tcp transport against two ``memfs memd`` servers, vs raw sockets, on loopback.

Raw: one sender process ``sendall``s 1 MiB messages to one receiver process
that ``recv_into``s them into a 1 MiB buffer: what Python can move over one
loopback TCP stream here, with no protocol at all.  Once more with the receiver
writing through as much memory as the transport's volumes (each byte lands in
memory not touched for a while): the copy out of the socket then runs at memory
speed instead of cache speed, which is the bound a memory server works under.

Transport: two ``memfs memd`` subprocesses (2 volumes each), a
:class:`~memfs.transport.tcp.TcpTransport` over the 4 volumes (2 connections
per server), ``--tasks`` concurrent tasks issuing 1 MiB writes, then 1 MiB
reads (``readinto`` registered buffers), ``--total`` bytes each way.

Rounds alternate raw and transport runs; the table shows medians.  As root
with fio, it first also measures a real ``memfs mount --mds`` over an mds and
two fresh memory servers (fio, one job, 1 MiB sequential write then read).

    python bench/tcpbench.py [--total 1G] [--rounds 3] [--tasks 8]
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import random
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import trio

from memfs.config import VolumeAddr, parse_size
from memfs.transport.tcp import open_tcp_transport

MIB = 1 << 20
MSG = MIB
N_SERVERS = 2
VOLUMES_PER_SERVER = 2


# -- raw sockets -------------------------------------------------------------------


def _receiver(sock: socket.socket, total: int, span: int, populate: bool) -> None:
    # Populated up front like a memd volume (or, not *populate*, faulted in as it
    # fills, like a new array); the sender starts the clock on "r".
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
    mem = mmap.mmap(-1, span, flags=flags)
    view = memoryview(mem)
    conn, _ = sock.accept()
    conn.sendall(b"r")
    got = 0
    while got < total:
        off = got % span
        n = conn.recv_into(view[off : off + MSG - got % MSG])
        if not n:
            raise SystemExit("sender went away")
        got += n
    conn.sendall(b"k")
    conn.close()


def raw_throughput(total: int, span: int = MSG, populate: bool = True) -> float:
    """MiB/s of one sender/receiver pair (two processes) moving *total* bytes.

    The receiver ``recv_into``s successive 1 MiB pieces of a *span*-byte
    buffer: with ``span == MSG`` it reuses one cache-warm buffer; with a large
    span each byte lands in memory not touched for a while, as in a volume.
    Not *populate*: the buffer's pages are first touched by the receive (timed).
    """
    listener = socket.create_server(("127.0.0.1", 0))
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_receiver, args=(listener, total, span, populate))
    proc.start()
    try:
        sender = socket.create_connection(listener.getsockname())
        sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = memoryview(random.randbytes(MSG))
        assert sender.recv(1) == b"r"
        t0 = time.perf_counter()
        for _ in range(total // MSG):
            sender.sendall(msg)
        assert sender.recv(1) == b"k"
        elapsed = time.perf_counter() - t0
        sender.close()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
        listener.close()
    return total / MIB / elapsed


# -- memd + transport ------------------------------------------------------------------


def start_memd(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
    """A ``memfs memd --listen 127.0.0.1:0`` with *args*, once it says it listens:
    (process, port).  Stop it with :func:`stop_process`."""
    p = subprocess.Popen(
        [sys.executable, "-P", "-m", "memfs", "memd", "--listen", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 60)
    line = p.stdout.readline() if ready else ""
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    if not m:
        stop_process(p)
        raise SystemExit(f"memd did not start: {line!r}")
    return p, int(m[1])


def stop_process(p: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s; reaped either way."""
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    if p.stdout is not None:
        p.stdout.close()


@contextmanager
def memd_servers(volume_size: int) -> Iterator[list[int]]:
    """Start the memory servers; yield their ports; always kill and reap them."""
    procs: list[subprocess.Popen[str]] = []
    try:
        ports = []
        for _ in range(N_SERVERS):
            p, port = start_memd(["--volumes", str(VOLUMES_PER_SERVER),
                                  "--volume-size", str(volume_size)])
            procs.append(p)
            ports.append(port)
        yield ports
    finally:
        for p in procs:
            stop_process(p)


async def transport_throughput(ports: list[int], total: int, tasks: int,
                               volume_size: int) -> tuple[float, float]:
    """(write MiB/s, read MiB/s) of 1 MiB requests from *tasks* concurrent tasks."""
    pool = [VolumeAddr("tcp", "127.0.0.1", ports[i % N_SERVERS], i // N_SERVERS)
            for i in range(N_SERVERS * VOLUMES_PER_SERVER)]
    n_req = total // MSG
    per_volume = volume_size // MSG

    def where(i: int) -> tuple[int, int]:
        return i % len(pool), (i // len(pool)) % per_volume * MSG

    async with open_tcp_transport(pool, b"") as t:
        bufs = [t.register(MSG) for _ in range(tasks)]
        for k, b in enumerate(bufs):
            b[:] = random.Random(k).randbytes(MSG)

        async def writer(k: int) -> None:
            for i in range(k, n_req, tasks):
                await t.write(*where(i), bufs[k])

        async def reader(k: int) -> None:
            for i in range(k, n_req, tasks):
                await t.readinto(*where(i), bufs[k])

        rates = []
        for job in (writer, reader):
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for k in range(tasks):
                    nursery.start_soon(job, k)
            rates.append(total / MIB / (time.perf_counter() - t0))
        # spot check: the last request of task 0 read back what some task wrote there
        vol, off = where(n_req - 1)
        got = bytes(await t.read(vol, off, MSG))
        assert got == random.Random((n_req - 1) % tasks).randbytes(MSG), "data mismatch"
    return rates[0], rates[1]


@contextmanager
def cluster_mount(ports: list[int]) -> Iterator[str]:
    """An mds over the memory servers and a ``memfs mount --mds`` of it; yields the mountpoint."""
    spec = "+".join(f"tcp://127.0.0.1:{ports[i % N_SERVERS]}/{i // N_SERVERS}"
                    for i in range(N_SERVERS * VOLUMES_PER_SERVER))
    mds = subprocess.Popen(
        [sys.executable, "-m", "memfs", "mds", "--listen", "127.0.0.1:0", "--pool", spec],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    mnt = tempfile.mkdtemp(prefix="memfs-tcpbench-")
    try:
        assert mds.stdout is not None
        ready, _, _ = select.select([mds.stdout], [], [], 60)
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", mds.stdout.readline() if ready else "")
        if not m:
            raise SystemExit("mds did not start")
        subprocess.run([sys.executable, "-m", "memfs", "mount", mnt, "--mds",
                        f"127.0.0.1:{m[1]}"], check=True)
        try:
            yield mnt
        finally:
            subprocess.run([sys.executable, "-m", "memfs", "umount", mnt], check=False)
    finally:
        stop_process(mds)
        os.rmdir(mnt)


def fio_mibs(directory: str, rw: str, size: int) -> float:
    out = subprocess.run(
        ["fio", "--name=tcpbench", f"--directory={directory}", f"--rw={rw}", "--bs=1M",
         f"--size={size}", "--numjobs=1", "--ioengine=psync", "--end_fsync=1",
         "--invalidate=1", "--output-format=json"],
        check=True, capture_output=True, text=True,
    ).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return float(job["write" if "write" in rw else "read"]["bw_bytes"]) / MIB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", default="1G", help="bytes moved per measurement (default 1G)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=8, help="concurrent transport requests")
    args = ap.parse_args()
    total = parse_size(args.total, "--total") // MSG * MSG
    # The pool holds the whole total, so the writes touch every byte once.
    volume_size = max(total // (N_SERVERS * VOLUMES_PER_SERVER) // MSG, 1) * MSG
    results: dict[str, list[float]] = {"raw": [], "raw_cold": [], "write": [], "read": []}
    # Through a real mount: needs root, /dev/fuse and fio; fresh memory servers, since
    # the transport runs below write straight into volumes the mds would think empty.
    with_mount = os.geteuid() == 0 and os.path.exists("/dev/fuse") and shutil.which("fio")
    if with_mount:
        results["mount_write"], results["mount_read"] = [], []
        with memd_servers(volume_size) as ports, cluster_mount(ports) as mnt:
            for r in range(args.rounds):
                results["mount_write"].append(fio_mibs(mnt, "write", total // 2))
                results["mount_read"].append(fio_mibs(mnt, "read", total // 2))
                os.unlink(os.path.join(mnt, "tcpbench.0.0"))
                print(f"round {r + 1}: memfs mount over tcp: write "
                      f"{results['mount_write'][-1]:.0f}, read {results['mount_read'][-1]:.0f} MiB/s",
                      file=sys.stderr)
    with ExitStack() as stack:
        ports = stack.enter_context(memd_servers(volume_size))
        for r in range(args.rounds):
            results["raw"].append(raw_throughput(total))
            results["raw_cold"].append(raw_throughput(total, total))
            w, rd = trio.run(transport_throughput, ports, total, args.tasks, volume_size)
            results["write"].append(w)
            results["read"].append(rd)
            print(f"round {r + 1}: raw {results['raw'][-1]:.0f}, raw into {total >> 20} MiB "
                  f"{results['raw_cold'][-1]:.0f}, transport write {w:.0f}, read {rd:.0f} MiB/s",
                  file=sys.stderr)
    med = {k: statistics.median(v) for k, v in results.items()}
    raw = med["raw"]
    print(f"loopback, {total >> 20} MiB per run, 1 MiB messages/requests, "
          f"{args.rounds} rounds (medians), {args.tasks} concurrent requests, "
          f"{N_SERVERS} memd x {VOLUMES_PER_SERVER} volumes")
    print(f"| {'measurement':<46} | {'MiB/s':>7} | {'vs raw':>6} |")
    print(f"|{'-' * 48}|{'-' * 9}|{'-' * 8}|")
    rows = [
        ("raw", "raw socket, 1 stream, one 1 MiB buffer"),
        ("raw_cold", f"raw socket, 1 stream, into {total >> 20} MiB of memory"),
        ("write", "TcpTransport write, 1 MiB requests"),
        ("read", "TcpTransport read, 1 MiB requests"),
    ]
    if with_mount:
        rows += [
            ("mount_write", "memfs mount --mds, fio 1 MiB write (1 job)"),
            ("mount_read", "memfs mount --mds, fio 1 MiB read (1 job)"),
        ]
    for key, label in rows:
        print(f"| {label:<46} | {med[key]:>7.0f} | {med[key] / raw:>6.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
