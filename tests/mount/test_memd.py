"""``memfs memd`` as real processes on 127.0.0.1, and the tcp transport against them.

A memory server is shared by every client node: nothing one client sends
(no secret, a wrong one, garbage, half a frame) may touch its memory or
disturb other clients.  A client must survive its servers: a dead server
(SIGKILL) or a hung one (SIGSTOP) costs requests to that server's volumes an
EIO within ``io_timeout``, never a hang and never a stall of the other
servers, and a restarted server (its memory blank) is reported as lost data,
never read back as zeros.

Every server process is killed and reaped after each test, whatever happened.
"""

from __future__ import annotations

import errno
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from memfs import wire
from memfs.config import VolumeAddr
from memfs.errors import TransportError
from memfs.transport.tcp import open_tcp_transport
from memfs.wire import Kind

SECRET = b"test-secret-0123456789abcdef"
VOLUME_SIZE = 1 << 20
READY_TIMEOUT = 20.0
IO_TIMEOUT = 1.5
SLACK = 1.0  # scheduling slack on a loaded 2-CPU test machine
READY_RE = re.compile(r"^memd listening on 127\.0\.0\.1:(\d+) \((\d+) volumes? x (\S+)\)$")


@dataclass
class Memd:
    proc: subprocess.Popen[str]
    port: int
    log: Path

    def vol(self, index: int) -> VolumeAddr:
        return VolumeAddr("tcp", "127.0.0.1", self.port, index)

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def memd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "memfs", "memd", *args]


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    f.chmod(0o600)
    return f


@pytest.fixture
def start_memd(tmp_path: Path, secret_file: Path) -> Iterator[Callable[..., Memd]]:
    """``start_memd(port=0, secret=True, volumes=2)``: a ready memd; all killed at the end."""
    procs: list[subprocess.Popen[str]] = []
    counter = iter(range(100))

    def start(port: int = 0, secret: bool = True, volumes: int = 2) -> Memd:
        log = tmp_path / f"memd{next(counter)}.log"
        args = ["--listen", f"127.0.0.1:{port}", "--volumes", str(volumes),
                "--volume-size", str(VOLUME_SIZE)]
        if secret:
            args += ["--secret-file", str(secret_file)]
        with open(log, "w") as err:
            proc = subprocess.Popen(memd_cmd(*args), stdout=subprocess.PIPE, stderr=err, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT)
        line = proc.stdout.readline().strip() if ready else ""
        m = READY_RE.match(line)
        assert m, f"memd not ready: {line!r}\n{log.read_text()}"
        assert int(m[2]) == volumes and m[3] == "1M"
        return Memd(proc, int(m[1]), log)

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot die
                proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def kill(m: Memd, sig: int = signal.SIGKILL) -> None:
    m.proc.send_signal(sig)
    if sig == signal.SIGKILL:
        m.proc.wait(timeout=10)
    elif sig == signal.SIGSTOP:
        wait_stopped(m.proc.pid)


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until every thread of *pid* is stopped.  A SIGSTOP stops a process's threads
    one after the other (the one that takes the signal stops the others): memd's
    data loop thread may serve a request that arrives meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
        if states and all(s in "tT" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: {states}"
        time.sleep(0.001)


def server_log_is_clean(m: Memd) -> None:
    """No code path the server did not expect (only warnings about bad clients)."""
    text = m.log_text()
    assert "Traceback" not in text and "unexpected error" not in text, text


# -- a plain blocking client, to send exactly the bytes a test wants -----------------


class RawClient:
    def __init__(self, port: int, secret: bytes | None = SECRET) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.next_id = 100
        if secret is not None:
            self.authenticate(secret)

    def close(self) -> None:
        self.sock.close()

    def recv_exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError(f"closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def recv_frame(self) -> tuple[wire.Header, bytes]:
        h = wire.parse_header(self.recv_exactly(wire.HEADER_SIZE))
        return h, self.recv_exactly(h.length)

    def authenticate(self, secret: bytes) -> None:
        h, hello = self.recv_frame()
        assert h.kind is Kind.HELLO
        hs = wire.Handshake(secret)
        self.sock.sendall(wire.frame(Kind.AUTH, 0, hs.auth(hello, "tcp")))
        h, welcome = self.recv_frame()
        assert h.kind is Kind.WELCOME
        hs.check_welcome(welcome)

    def request(self, kind: Kind, payload: bytes = b"") -> tuple[wire.Header, bytes]:
        self.next_id += 1
        self.sock.sendall(wire.frame(kind, self.next_id, payload))
        h, reply = self.recv_frame()
        assert h.req_id == self.next_id
        return h, reply

    def write(self, volume: int, offset: int, data: bytes) -> None:
        h, reply = self.request(Kind.WRITE, wire.WRITE.pack(volume, offset) + data)
        assert h.kind is Kind.OK, wire.decode_error(reply)

    def read(self, volume: int, offset: int, length: int) -> bytes:
        h, reply = self.request(Kind.READ, wire.READ.pack(volume, offset, length))
        assert h.kind is Kind.OK, wire.decode_error(reply)
        return reply

    def was_closed(self, timeout: float = 5.0) -> bool:
        """True once the server has closed the connection (EOF or reset)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def check_works(self, rng: random.Random) -> None:
        data = rng.randbytes(rng.randrange(1, 64 << 10))
        offset = rng.randrange(0, VOLUME_SIZE - len(data))
        volume = rng.randrange(2)
        self.write(volume, offset, data)
        assert self.read(volume, offset, len(data)) == data


def send_quietly(client: RawClient, data: bytes, *, then_eof: bool = False) -> None:
    """Send (and maybe end our side), ignoring a server that already hung up."""
    try:
        client.sock.sendall(data)
        if then_eof:
            client.sock.shutdown(socket.SHUT_WR)
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass


# -- authentication ------------------------------------------------------------------


def test_auth_refused(start_memd: Callable[..., Memd]) -> None:
    m = start_memd()
    good = RawClient(m.port)
    pattern = random.Random(1).randbytes(VOLUME_SIZE)
    for v in range(2):
        good.write(v, 0, pattern)
    attack = wire.frame(Kind.WRITE, 7, wire.WRITE.pack(0, 0) + b"\xee" * 4096)
    attack += wire.frame(Kind.ZERO, 8, wire.ZERO.pack(1, 0, VOLUME_SIZE))

    for secret in (b"", b"wrong-secret-0123456789abcdef"):
        bad = RawClient(m.port, secret=None)
        h, hello = bad.recv_frame()
        hs = wire.Handshake(secret)
        # AUTH with the wrong key, and requests right behind it without waiting
        send_quietly(bad, wire.frame(Kind.AUTH, 0, hs.auth(hello, "tcp")) + attack)
        assert bad.was_closed()
        bad.close()
    # no AUTH at all: a request as the first frame, or garbage
    for first in (attack, b"GET / HTTP/1.0\r\n\r\n" + os.urandom(100)):
        bad = RawClient(m.port, secret=None)
        bad.recv_frame()
        send_quietly(bad, first)
        assert bad.was_closed()
        bad.close()

    for v in range(2):
        assert good.read(v, 0, VOLUME_SIZE) == pattern, "an unauthenticated client changed memory"
    good.close()
    text = m.log_text()
    assert text.count("authentication failed") == 2, text
    server_log_is_clean(m)


async def test_transport_wrong_secret(start_memd: Callable[..., Memd],
                                      caplog: pytest.LogCaptureFixture) -> None:
    m = start_memd()
    with trio.fail_after(10), pytest.raises(TransportError, match="wrong secret"):
        async with open_tcp_transport([m.vol(0)], b"not-the-secret-0123456789"):
            pass
    with trio.fail_after(10), pytest.raises(TransportError, match="cannot connect"):
        async with open_tcp_transport([VolumeAddr("tcp", "127.0.0.1", 1, 0)], SECRET):
            pass


async def test_metadata_client_pointed_at_memd_is_told_so(start_memd: Callable[..., Memd]) -> None:
    """`memfs mount --mds` given a memd's address: a clear refusal, not a reset."""
    from memfs.errors import FsError
    from memfs.meta.remote import open_remote_meta

    m = start_memd()
    with trio.fail_after(20), pytest.raises(FsError) as info:
        async with open_remote_meta("127.0.0.1", m.port, SECRET, timeout=5):
            pass
    assert "memory server (memd)" in str(info.value), info.value
    with trio.fail_after(10):  # the server logs it as it closes: maybe after our error
        while "does not serve 'meta' clients" not in m.log_text():  # noqa: ASYNC110 (a file another process writes)
            await trio.sleep(0.05)


# -- malformed frames ---------------------------------------------------------------------


def test_malformed_frames_close_only_that_connection(start_memd: Callable[..., Memd]) -> None:
    m = start_memd()
    rng = random.Random(2)
    good = RawClient(m.port)
    good.check_works(rng)
    hdr = wire.HEADER.pack
    cases = {
        "bad magic": b"XY" + wire.pack_header(Kind.INFO, 1, 0)[2:],
        "bad version": hdr(wire.MAGIC, 9, Kind.INFO, 1, 0),
        "oversize length": wire.pack_header(Kind.WRITE, 1, wire.MAX_PAYLOAD + 1),
        "unknown kind": hdr(wire.MAGIC, wire.VERSION, 99, 1, 0),
        "reply kind as request": wire.frame(Kind.OK, 1, b""),
        "metadata call to memd": wire.frame(Kind.CALL, 1, wire.encode(["getattr", 1])),
        "second AUTH": wire.frame(Kind.AUTH, 1, b"\0" * 65),
        "READ struct too short": wire.frame(Kind.READ, 1, b"\0" * 8),
        "WRITE without struct": wire.frame(Kind.WRITE, 1, b"\0" * 4),
        "INFO with payload": wire.frame(Kind.INFO, 1, b"x"),
        "garbage": bytes(random.Random(3).randrange(256) for _ in range(200)),
    }
    for name, data in cases.items():
        bad = RawClient(m.port)
        send_quietly(bad, data)
        assert bad.was_closed(), name
        bad.close()
        good.check_works(rng)

    # half a frame, then the client goes away
    bad = RawClient(m.port)
    bad.sock.sendall(wire.pack_header(Kind.WRITE, 1, wire.WRITE.size + 1000)
                     + wire.WRITE.pack(0, 0) + b"\1" * 100)
    bad.sock.shutdown(socket.SHUT_WR)
    assert bad.was_closed()
    bad.close()
    good.check_works(rng)

    # a write outside the volume: refused, its payload skipped, the connection goes on
    client = RawClient(m.port)
    for volume, offset in ((0, VOLUME_SIZE - 10), (2, 0), (0, 1 << 40)):
        h, reply = client.request(Kind.WRITE, wire.WRITE.pack(volume, offset) + b"\2" * 100)
        assert h.kind is Kind.ERROR and wire.decode_error(reply)[0] == errno.EINVAL
    h, reply = client.request(Kind.READ, wire.READ.pack(0, VOLUME_SIZE, 1))
    assert h.kind is Kind.ERROR
    h, reply = client.request(Kind.ZERO, wire.ZERO.pack(1, 1, VOLUME_SIZE))
    assert h.kind is Kind.ERROR
    client.check_works(rng)
    h, reply = client.request(Kind.INFO)
    info = wire.decode(reply)
    assert info["volumes"] == [VOLUME_SIZE, VOLUME_SIZE] and isinstance(info["incarnation"], int)
    client.close()
    good.close()
    assert m.proc.poll() is None
    server_log_is_clean(m)


def test_pipelined_requests(start_memd: Callable[..., Memd]) -> None:
    """Many requests sent before any reply is read; replies in order, with their ids."""
    m = start_memd()
    c = RawClient(m.port)
    pieces = [random.Random(i).randbytes(5000) for i in range(50)]
    burst = b"".join(wire.frame(Kind.WRITE, 1000 + i, wire.WRITE.pack(i % 2, i * 5000) + p)
                     for i, p in enumerate(pieces))
    burst += b"".join(wire.frame(Kind.READ, 2000 + i, wire.READ.pack(i % 2, i * 5000, 5000))
                      for i in range(50))
    c.sock.sendall(burst)
    for i in range(50):
        h, reply = c.recv_frame()
        assert (h.kind, h.req_id, reply) == (Kind.OK, 1000 + i, b"")
    for i in range(50):
        h, reply = c.recv_frame()
        assert (h.kind, h.req_id, reply) == (Kind.OK, 2000 + i, pieces[i])
    c.close()


def random_frame(rng: random.Random) -> bytes:
    """Mostly well-formed requests with random fields, some broken in random ways."""
    kind = rng.choice([Kind.READ, Kind.WRITE, Kind.ZERO, Kind.INFO])
    vol = rng.choice([0, 1, 2, 0xFFFFFFFF])
    off = rng.choice([0, rng.randrange(VOLUME_SIZE), VOLUME_SIZE - 1, VOLUME_SIZE, 1 << 62])
    n = rng.choice([0, 1, rng.randrange(4096)])
    if kind is Kind.READ:
        payload = wire.READ.pack(vol, off, n)
    elif kind is Kind.WRITE:
        payload = wire.WRITE.pack(vol, off) + rng.randbytes(n)
    elif kind is Kind.ZERO:
        payload = wire.ZERO.pack(vol, off, n)
    else:
        payload = b""
    data = wire.frame(kind, rng.randrange(1 << 32), payload)
    r = rng.random()  # about one in ten broken, so most connections serve several frames
    if r < 0.04:
        pos = rng.randrange(len(data))
        data = data[:pos] + bytes([rng.randrange(256)]) + data[pos + 1 :]
    elif r < 0.06:
        data = data[: rng.randrange(len(data))]
    elif r < 0.08:
        data = rng.randbytes(rng.randrange(1, 64))
    elif r < 0.10:
        data = wire.pack_header(kind, 1, rng.randrange(1 << 32)) + payload
    return data


def test_live_fuzz(start_memd: Callable[..., Memd]) -> None:
    """300 random frames over 30 connections; then the server still serves correctly."""
    m = start_memd()
    rng = random.Random(4)
    good = RawClient(m.port)
    keep = rng.randbytes(64 << 10)
    good.write(1, VOLUME_SIZE - len(keep), keep)  # fuzz writes may land anywhere else
    t0 = time.monotonic()
    for _ in range(30):
        c = RawClient(m.port, secret=SECRET if rng.random() < 0.9 else None)
        send_quietly(c, b"".join(random_frame(rng) for _ in range(10)), then_eof=True)
        assert c.was_closed(timeout=10), "the server must end the connection at EOF"
        c.close()
    assert time.monotonic() - t0 < 20
    assert m.proc.poll() is None
    good.check_works(rng)
    # The pattern survives unless a fuzz frame wrote there legitimately: check a fresh one.
    good.write(1, VOLUME_SIZE - len(keep), keep)
    assert good.read(1, VOLUME_SIZE - len(keep), len(keep)) == keep
    good.close()
    server_log_is_clean(m)


# -- failures seen through the transport ---------------------------------------------------


async def test_sigkill_during_writes(start_memd: Callable[..., Memd],
                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    a, b = start_memd(), start_memd()
    pool = [a.vol(0), b.vol(0), a.vol(1), b.vol(1)]  # even volumes on a, odd on b
    piece = 64 << 10
    outcomes: dict[int, list[tuple[float, float, bool]]] = {v: [] for v in range(4)}
    killed_at = 0.0
    with trio.fail_after(20):
        async with open_tcp_transport(pool, SECRET, io_timeout=IO_TIMEOUT) as t:

            async def writer(volume: int) -> None:
                rng = random.Random(volume)
                end = trio.current_time() + 1.5
                i = 0
                while trio.current_time() < end:
                    start = trio.current_time()
                    try:
                        await t.write(volume, (i * piece) % VOLUME_SIZE, rng.randbytes(piece))
                        ok = True
                    except TransportError:
                        ok = False
                        await trio.sleep(0.02)
                    outcomes[volume].append((start, trio.current_time() - start, ok))
                    i += 1

            async def killer() -> None:
                nonlocal killed_at
                await trio.sleep(0.4)
                killed_at = trio.current_time()
                kill(a)

            async with trio.open_nursery() as nursery:
                for v in range(4):
                    nursery.start_soon(writer, v)
                nursery.start_soon(killer)

            # b's data is intact
            rng = random.Random(1)
            await t.write(1, 0, data := rng.randbytes(piece))
            assert bytes(await t.read(1, 0, piece)) == data
            with pytest.raises(TransportError):
                await t.read(0, 0, 1)

    for v in (0, 2):  # on a
        before = [o for o in outcomes[v] if o[0] + o[1] < killed_at]
        after = [o for o in outcomes[v] if o[0] > killed_at + 0.05]
        assert before and all(ok for _, _, ok in before)
        assert after and not any(ok for _, _, ok in after), outcomes[v]
        assert max(d for _, d, _ in outcomes[v]) < IO_TIMEOUT + SLACK
    for v in (1, 3):  # on b: never failed, kept going after the kill
        assert all(ok for _, _, ok in outcomes[v])
        assert sum(1 for s, _, _ in outcomes[v] if s > killed_at + 0.1) > 5
        assert max(d for _, d, _ in outcomes[v]) < SLACK
    server_log_is_clean(b)


async def test_sigstop_hung_server(start_memd: Callable[..., Memd],
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    a, b = start_memd(), start_memd()
    pool = [a.vol(0), b.vol(0)]
    data = random.Random(5).randbytes(100_000)
    with trio.fail_after(30):
        async with open_tcp_transport(pool, SECRET, io_timeout=IO_TIMEOUT) as t:
            await t.write(0, 0, data)
            await t.write(1, 0, data)
            kill(a, signal.SIGSTOP)
            try:
                b_latencies: list[float] = []
                stalled = trio.Event()

                async def use_b() -> None:
                    while not stalled.is_set():
                        start = trio.current_time()
                        assert bytes(await t.read(1, 0, len(data))) == data
                        b_latencies.append(trio.current_time() - start)
                        await trio.sleep(0.01)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(use_b)
                    # a fresh connection (accepted by the kernel, never answered),
                    # then the one that was open: both EIO within io_timeout.  (A
                    # timed-out write may still be applied when the server wakes
                    # up, as with any network storage: write the same bytes.)
                    for attempt in (t.read(0, 0, 10), t.write(0, 0, data[:10])):
                        start = trio.current_time()
                        with pytest.raises(TransportError, match="did not answer"):
                            await attempt
                        took = trio.current_time() - start
                        assert IO_TIMEOUT - 0.1 < took < IO_TIMEOUT + SLACK
                    stalled.set()
                assert len(b_latencies) > 10 and max(b_latencies) < SLACK, b_latencies
            finally:
                kill(a, signal.SIGCONT)
            # same incarnation: the data is still there
            assert bytes(await t.read(0, 0, len(data))) == data
    server_log_is_clean(a)


async def test_restarted_server_is_lost_data(start_memd: Callable[..., Memd],
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    a, b = start_memd(), start_memd()
    pool = [a.vol(0), b.vol(0), a.vol(1)]
    data = random.Random(6).randbytes(4096)
    with trio.fail_after(30):
        async with open_tcp_transport(pool, SECRET, io_timeout=IO_TIMEOUT) as t:
            for v in range(3):
                await t.write(v, 0, data)
            kill(a)
            with pytest.raises(TransportError):  # down: refused
                await t.read(0, 0, 10)
            a2 = start_memd(port=a.port)
            for _ in range(3):  # every request to a's volumes, however often
                for v in (0, 2):
                    with pytest.raises(TransportError, match="restarted; its data is lost"):
                        await t.read(v, 0, len(data))
                    with pytest.raises(TransportError, match="restarted; its data is lost"):
                        await t.readinto(v, 0, t.register(10))
                    with pytest.raises(TransportError, match="restarted"):
                        await t.write(v, 0, data)
                    with pytest.raises(TransportError, match="restarted"):
                        await t.zero(v, 0, 10)
            assert bytes(await t.read(1, 0, len(data))) == data
        # a new client of the new server starts from its (blank) memory
        async with open_tcp_transport([a2.vol(0)], SECRET, io_timeout=IO_TIMEOUT) as t2:
            assert bytes(await t2.read(0, 0, 10)) == bytes(10)


# -- the command line ---------------------------------------------------------------------


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfs: error: "), res.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "localhost", "--size", "1M"], "bad --listen 'localhost'"),
        (["--listen", "127.0.0.1:99999", "--size", "1M"], "bad --listen"),
        (["--listen", "127.0.0.1:0", "--size", "4Q"], "bad --size '4Q'"),
        (["--listen", "127.0.0.1:0", "--size", "1M", "--volumes", "0"], "--volumes must be"),
        (["--listen", "127.0.0.1:0", "--size", "1M", "--volumes", "x"], "bad --volumes"),
        (["--listen", "127.0.0.1:0", "--size", "1024T"], "exceeds the memory available"),
        (["--listen", "192.0.2.1:7100", "--size", "1M"], "cannot listen on 192.0.2.1:7100"),
        (["--listen", "127.0.0.1:0"], "needs --size (all volumes together) or --volume-size"),
        (["--listen", "127.0.0.1:0", "--volumes", "3", "--size", "1M"],
         "--size 1M does not split evenly over 3 volumes"),
        (["--listen", "127.0.0.1:0", "--volumes", "2", "--size", "1M", "--volume-size", "1M"],
         "--size 1M disagrees with --volumes 2 x --volume-size 1M = 2M"),
        (["--listen", "127.0.0.1:0", "--volume-size", "4Q"], "bad --volume-size '4Q'"),
    ],
)
def test_cli_errors(args: list[str], message: str) -> None:
    res = subprocess.run(memd_cmd(*args), capture_output=True, text=True, timeout=30)
    assert message in one_error_line(res)


def test_cli_secret_file_mode(secret_file: Path) -> None:
    secret_file.chmod(0o644)
    res = subprocess.run(
        memd_cmd("--listen", "127.0.0.1:0", "--size", "1M", "--secret-file", str(secret_file)),
        capture_output=True, text=True, timeout=30,
    )
    assert "chmod 600" in one_error_line(res)


def test_cli_port_in_use(start_memd: Callable[..., Memd]) -> None:
    a = start_memd()
    res = subprocess.run(memd_cmd("--listen", f"127.0.0.1:{a.port}", "--size", "1M"),
                         capture_output=True, text=True, timeout=30)
    assert "Address already in use" in one_error_line(res)


def test_cli_metrics_port_in_use(start_memd: Callable[..., Memd]) -> None:
    a = start_memd()  # its port is taken
    res = subprocess.run(memd_cmd("--listen", "127.0.0.1:0", "--size", "1M",
                                  "--metrics", f"127.0.0.1:{a.port}"),
                         capture_output=True, text=True, timeout=30)
    # After memd's own log lines (it has set up its volumes): the error, unwrapped.
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr and "ExceptionGroup" not in res.stderr, res.stderr
    last = res.stderr.splitlines()[-1]
    assert last.startswith("memfs: error: cannot serve metrics"), res.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_lifecycle(start_memd: Callable[..., Memd], tmp_path: Path, sig: int,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ready line, READY=1 to systemd, a warning when unauthenticated, exit 0 on signal."""
    notify = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(notify))
        monkeypatch.setenv("NOTIFY_SOCKET", str(notify))
        m = start_memd(secret=False)
        listener.settimeout(10)
        assert listener.recv(100) == b"READY=1"
        c = RawClient(m.port, secret=b"")  # unauthenticated server: empty key
        c.check_works(random.Random(7))
        c.close()
        m.proc.send_signal(sig)
        assert m.proc.wait(timeout=10) == 0
        assert listener.recv(100) == b"STOPPING=1"
    text = m.log_text()
    assert "anyone who can reach 127.0.0.1:" in text and " WARNING " in text
    server_log_is_clean(m)


@pytest.mark.parametrize("sizes", [["--size", "4M"], ["--volume-size", "2M"],
                                   ["--size", "4M", "--volume-size", "2M"]])
def test_size_is_the_whole_and_volume_size_each(sizes: list[str]) -> None:
    """``--size`` means all volumes together, as for ``memfs mount``; ``--volume-size``
    each, as for ``memfs mds``."""
    proc = subprocess.Popen(memd_cmd("--listen", "127.0.0.1:0", "--volumes", "2", *sizes),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "(2 volumes x 2M)" in line, line
    finally:
        proc.terminate()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
