"""``memfs mds`` as a real process: authentication, hostile input, restarts, outages.

Every server runs as ``python -m memfs mds`` on 127.0.0.1 and is killed and
reaped when its test ends, whatever happened.  What must hold:

* nothing is served before the handshake, to no one without the secret;
* garbage closes the connection that sent it, never the server: another client
  keeps working throughout a bounded fuzz;
* only metadata methods can be called;
* with ``--journal``, SIGKILL and a restart on the same port lose nothing a
  client was told had happened: a client that stayed connected sees exactly the
  same namespace, attributes and extents, and its handle on an unlinked file
  still works (it re-registers its open files);
* a torn last journal record (a crash mid-write) is dropped, not fatal;
* while the server is down or hung, calls fail with EIO within their timeout.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import select
import signal
import socket
import stat
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from memfs import wire
from memfs.errors import FsError
from memfs.layout import LAYOUT_XATTR
from memfs.meta import Meta, SetAttr
from memfs.meta.remote import open_remote_meta
from memfs.meta.remote_conn import AuthRefused
from memfs.wire import Kind
from tests.conftest import MEMFS

#: replies of a call that succeeded (the server says whether the client may cache them)
OK_KINDS = (Kind.OK, Kind.OK_CACHE, Kind.OK_WRITE)

K, M = 1 << 10, 1 << 20
ROOT = 1
SECRET = b"mds-test-secret-0123456789abcdef"
POOL_SPEC = "+".join(f"tcp://127.0.0.1:7100/{i}" for i in range(4))
READY_TIMEOUT = 20.0


class Mds:
    """One ``memfs mds`` process."""

    def __init__(
        self, tmp: Path, name: str, args: list[str], port: int = 0,
        env: dict[str, str] | None = None, pool: str = POOL_SPEC,
        volume_size: str | None = "16M",
    ) -> None:
        secret = tmp / "secret"
        if not secret.exists():
            secret.write_bytes(SECRET)
            secret.chmod(0o600)
        self.log = tmp / f"{name}.log"
        with open(self.log, "w") as logf:
            self.proc = subprocess.Popen(
                [*MEMFS, "mds", "--listen", f"127.0.0.1:{port}", "--pool", pool,
                 *(["--volume-size", volume_size] if volume_size else []),
                 "--chunk-size", "64K", "--stripe-size", "256K",
                 "--secret-file", str(secret), *args],
                stdout=subprocess.PIPE, stderr=logf, text=True, env={**os.environ, **(env or {})},
            )
        self.port = 0

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        m = re.fullmatch(r"mds listening on 127\.0\.0\.1:(\d+)\n", line)
        if not m:
            self.stop(signal.SIGKILL)
            raise AssertionError(f"mds did not get ready: {line!r}\n{self.log.read_text()}")
        self.port = int(m[1])

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    def log_text(self) -> str:
        return self.log.read_text()


@pytest.fixture
def start_mds(tmp_path: Path) -> Iterator[Callable[..., Mds]]:
    """``start_mds(*args, port=0)``: a ready server; all are killed and reaped at the end."""
    started: list[Mds] = []

    def start(*args: str, port: int = 0, name: str | None = None, **kw: Any) -> Mds:
        m = Mds(tmp_path, name or f"mds{len(started)}", list(args), port, **kw)
        started.append(m)
        m.wait_ready()
        return m

    try:
        yield start
    finally:
        for m in started:
            m.stop(signal.SIGKILL)


async def start_async(start: Callable[..., Mds], *args: str, **kw: Any) -> Mds:
    """Start a server without freezing this trio loop (clients keep reconnecting)."""
    return await trio.to_thread.run_sync(lambda: start(*args, **kw))


# -- a raw client (blocking sockets: these tests poke at the bytes) ------------------------


def raw_connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def read_frame(sock: socket.socket) -> tuple[wire.Header, bytes] | None:
    """One frame, or None once the server closed the connection."""
    def exactly(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    head = exactly(wire.HEADER_SIZE)
    if head is None:
        return None
    h = wire.parse_header(head, wire.MAX_PAYLOAD * 16)
    payload = exactly(h.length)
    return None if payload is None else (h, payload)


def authenticate(sock: socket.socket, secret: bytes = SECRET, role: str = "meta") -> tuple[wire.Header, bytes] | None:
    got = read_frame(sock)
    assert got is not None and got[0].kind is Kind.HELLO
    sock.sendall(wire.frame(Kind.AUTH, 0, wire.Handshake(secret).auth(got[1], role)))
    return read_frame(sock)


def authed(port: int) -> socket.socket:
    sock = raw_connect(port)
    got = authenticate(sock)
    assert got is not None and got[0].kind is Kind.WELCOME
    return sock


def call(sock: socket.socket, value: Any, req_id: int = 7) -> tuple[Kind, Any]:
    sock.sendall(wire.frame(Kind.CALL, req_id, wire.encode(value)))
    got = read_frame(sock)
    assert got is not None, "the server closed a healthy connection"
    h, payload = got
    assert h.req_id == req_id
    if h.kind is Kind.ERROR:
        return h.kind, wire.decode_error(payload)
    return h.kind, wire.decode(payload)


def refused_and_closed(sock: socket.socket) -> None:
    """The server answers nothing useful and closes: at most one ERROR frame, then EOF."""
    got = read_frame(sock)
    if got is not None:
        assert got[0].kind is Kind.ERROR, got
        assert wire.decode_error(got[1])[0] == errno.EACCES
        got = read_frame(sock)
    assert got is None


# -- authentication, hostile input, the allow-list ---------------------------------------------


def test_authentication(start_mds: Callable[..., Mds]) -> None:
    mds = start_mds()
    for secret in (b"", b"not-the-secret-0123456789"):
        with raw_connect(mds.port) as sock:
            got = authenticate(sock, secret)
            assert got is not None and got[0].kind is Kind.ERROR
            assert read_frame(sock) is None
    with raw_connect(mds.port) as sock:  # skipping the handshake gets nothing
        assert read_frame(sock) is not None  # HELLO
        sock.sendall(wire.frame(Kind.CALL, 1, wire.encode(["getattr", 1])))
        refused_and_closed(sock)
    with raw_connect(mds.port) as sock:  # a memory-server client is not a metadata client
        got = authenticate(sock, role="tcp")
        assert got is not None and got[0].kind is Kind.ERROR
    with authed(mds.port) as sock:
        kind, value = call(sock, ["getattr", ROOT])
        assert kind in OK_KINDS and value[0] == ROOT
    log = mds.log_text()
    assert log.count("refused") >= 4 and "Traceback" not in log


def test_a_mount_with_the_wrong_secret_says_which_option(
    start_mds: Callable[..., Mds], tmp_path: Path
) -> None:
    mds = start_mds()
    wrong = tmp_path / "wrong.secret"
    wrong.write_bytes(os.urandom(32).hex().encode())
    wrong.chmod(0o600)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run([*MEMFS, "mount", str(mnt), "--mds", f"127.0.0.1:{mds.port}",
                          "--secret-file", str(wrong), "--log", str(tmp_path / "mount.log")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "refused authentication" in lines[0], res.stderr
    assert "is --secret-file the secret" in lines[0], res.stderr
    assert not os.path.ismount(mnt)


async def test_wrong_secret_with_the_client(start_mds: Callable[..., Mds]) -> None:
    mds = await start_async(start_mds)
    with pytest.raises(AuthRefused) as info:
        async with open_remote_meta("127.0.0.1", mds.port, b"wrong-secret-0123456789", timeout=5):
            pass
    assert info.value.errno == errno.EACCES


def test_only_metadata_methods_can_be_called(start_mds: Callable[..., Mds]) -> None:
    mds = start_mds()
    with authed(mds.port) as sock:
        for value in (["aclose"], ["destroy", 1], ["_get", 1], ["__init__"], ["inodes"],
                      ["_new_inode", 0o100644, 0, 0, 0], ["on_destroy", 1], ["now"]):
            kind, (err, _) = call(sock, value)
            assert (kind, err) == (Kind.ERROR, errno.ENOSYS), value
        kind, value = call(sock, ["getattr", ROOT])  # the connection is still good
        assert kind in OK_KINDS
        # Pipelined: many calls in one write, each reply carries its call's id.
        sock.sendall(b"".join(
            wire.frame(Kind.CALL, 100 + i, wire.encode(["getattr", ROOT] if i % 2 else ["statfs"]))
            for i in range(50)
        ))
        for i in range(50):
            got = read_frame(sock)
            assert got is not None and got[0].kind in OK_KINDS and got[0].req_id == 100 + i
        # Request id 0 wants no reply, failing or not; it runs in order with the others.
        sock.sendall(wire.frame(Kind.CALL, 0, wire.encode(["release", 99999]))
                     + wire.frame(Kind.CALL, 0, wire.encode(["mknod", ROOT, b"cast", 0o100644, 0, 0, 0, None])))
        kind, value = call(sock, ["lookup", ROOT, b"cast"], req_id=9)
        assert kind in OK_KINDS, "the reply-less mknod ran before this call, and nothing else came back"
        kind, desc = call(sock, ["describe"])
        assert kind in OK_KINDS
        assert desc["volumes"] == POOL_SPEC.split("+")
        assert (desc["chunk_size"], desc["stripe_size"], desc["volume_size"]) == (64 * K, 256 * K, 16 * M)
    assert "Traceback" not in mds.log_text()


@contextlib.contextmanager
def memory_server(tmp_path: Path, volume_size: str) -> Iterator[int]:
    """A real ``memfs memd`` with 2 volumes on loopback; yields its port."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    memd = subprocess.Popen(
        [*MEMFS, "memd", "--listen", "127.0.0.1:0", "--volumes", "2", "--volume-size",
         volume_size, "--secret-file", str(secret)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert memd.stdout is not None
        ready, _, _ = select.select([memd.stdout], [], [], READY_TIMEOUT)
        line = memd.stdout.readline() if ready else ""
        m = re.match(r"memd listening on 127\.0\.0\.1:(\d+)", line)
        assert m, line
        yield int(m[1])
    finally:
        memd.kill()
        memd.wait(timeout=10)
        if memd.stdout is not None:
            memd.stdout.close()


def test_volume_sizes_come_from_the_memory_servers(
    start_mds: Callable[..., Mds], tmp_path: Path
) -> None:
    """Without --volume-size, the mds asks the memory servers (their INFO)."""
    with memory_server(tmp_path, "8M") as port:
        pool = f"tcp://127.0.0.1:{port}/1+tcp://127.0.0.1:{port}/0"
        mds = start_mds(pool=pool, volume_size=None)
        with authed(mds.port) as sock:
            kind, desc = call(sock, ["describe"])
        assert kind in OK_KINDS
        assert (desc["volumes"], desc["n_volumes"], desc["volume_size"]) == (pool.split("+"), 2, 8 * M)


def test_backing_tree_is_whole_before_the_mds_serves(
    start_mds: Callable[..., Mds], tmp_path: Path
) -> None:
    """With --backing, the mds answers no call before DIR's tree is entered and
    write-back follows the store: the first call sees every file, and with
    ``--no-backing-write-leases`` no write lease is handed out (every write is a call)."""
    backing = tmp_path / "backing"
    backing.mkdir()
    names = [f"f{i:05d}" for i in range(3000)]
    for n in names:
        (backing / n).write_bytes(b"x")
    with memory_server(tmp_path, "16M") as port:
        pool = f"tcp://127.0.0.1:{port}/0+tcp://127.0.0.1:{port}/1"
        mds = start_mds("--backing", str(backing), "--no-backing-write-leases", pool=pool,
                        volume_size=None)
        with authed(mds.port) as sock:  # the very first calls after "listening"
            kind, entries = call(sock, ["readdir", ROOT])
            assert kind in OK_KINDS, entries
            inos = dict(entries)
            kind, plan = call(sock, ["allocate_ahead", inos[names[0].encode()], 0, 64 * K, M],
                              req_id=8)
        assert sorted(n.decode() for n in inos if n not in (b".", b"..")) == names
        assert kind in (Kind.OK, Kind.OK_CACHE), (kind, plan)  # no write lease


def _attack(rng: random.Random) -> bytes:
    """One hostile message: garbage, a broken frame, or a well-framed nonsense call."""
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 64))
    if kind == 1:  # a header that lies about its payload, then too little of it
        return wire.pack_header(Kind.CALL, 1, rng.randrange(1, 1 << 20)) + rng.randbytes(rng.randrange(16))
    if kind == 2:  # bad magic/version/kind
        head = bytearray(wire.pack_header(Kind.CALL, 1, 0))
        head[rng.randrange(4)] ^= 1 + rng.randrange(255)
        return bytes(head)
    if kind == 3:  # an undecodable value
        return wire.frame(Kind.CALL, 1, rng.randbytes(rng.randrange(1, 40)))
    if kind == 4:  # a frame kind a client must not send
        return wire.frame(rng.choice([Kind.OK, Kind.ERROR, Kind.READ, Kind.HELLO, Kind.WELCOME]), 1, b"")
    # a decodable value of the wrong shape for a real method
    method = rng.choice(["getattr", "mknod", "map_write", "rename", "setattr", "session", "describe"])
    args: list[Any] = [rng.choice([None, True, -1, 2**62, b"x", "s", [], {}, [1, 2], 1.5])
                       for _ in range(rng.randrange(6))]
    return wire.frame(Kind.CALL, 1, wire.encode([method, *args]))


def test_garbage_closes_only_its_connection(start_mds: Callable[..., Mds]) -> None:
    mds = start_mds()
    rng = random.Random(1234)
    with authed(mds.port) as good:
        t0 = time.monotonic()
        for i in range(150):
            with raw_connect(mds.port) as bad:
                if i % 3:  # most attacks come after a valid handshake
                    got = authenticate(bad)
                    assert got is not None and got[0].kind is Kind.WELCOME
                else:
                    assert read_frame(bad) is not None  # HELLO
                bad.sendall(_attack(rng))
                bad.shutdown(socket.SHUT_WR)
                while (got := read_frame(bad)) is not None:  # replies, if any, then EOF
                    assert got[0].kind in (*OK_KINDS, Kind.ERROR, Kind.ERROR_CACHE)
            if i % 10 == 0:
                kind, value = call(good, ["getattr", ROOT], req_id=i + 1)  # id 0 would want no reply
                assert kind in OK_KINDS and value[0] == ROOT
        assert time.monotonic() - t0 < 20
        kind, _ = call(good, ["statfs"])
        assert kind in OK_KINDS
    assert mds.proc.poll() is None
    log = mds.log_text()
    assert "protocol error" in log and "Traceback" not in log


# -- restarts ------------------------------------------------------------------------------------


async def dump(meta: Meta, extra: tuple[int, ...] = ()) -> dict[Any, Any]:
    """Everything a client can see: the tree, attributes, xattrs, links, extents."""
    out: dict[Any, Any] = {"statfs": await meta.statfs()}

    async def entry(ino: int, path: bytes) -> None:
        a = await meta.getattr(ino)
        names = await meta.listxattr(ino)
        item: dict[str, Any] = {
            "attr": a, "xattrs": {n: await meta.getxattr(ino, n) for n in names},
        }
        try:
            item["layout"] = await meta.getxattr(ino, LAYOUT_XATTR)
        except FsError as exc:
            assert exc.errno == errno.ENODATA
        if stat.S_ISDIR(a.mode):
            item["entries"] = await meta.readdir(ino)
            for name, child in item["entries"]:
                await entry(child, path + b"/" + name)
        elif stat.S_ISLNK(a.mode):
            item["target"] = await meta.readlink(ino)
        elif stat.S_ISREG(a.mode):
            item["extents"] = await meta.map_read(ino, 0, a.size)
        out[path] = item

    await entry(ROOT, b"")
    for ino in extra:
        await entry(ino, b"#%d" % ino)
    return out


async def build_tree(meta: Meta) -> int:
    """A bit of everything; returns an unlinked inode held open."""
    mode_f, mode_d = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755
    a = await meta.mknod(ROOT, b"a", mode_d, 1000, 1000)
    b = await meta.mknod(a.ino, b"b", mode_d, 1000, 1000)
    await meta.setxattr(b.ino, LAYOUT_XATTR, b"stripe_count=2 stripe_size=128K")
    for i in range(6):
        f = await meta.mknod(b.ino if i % 2 else a.ino, b"f%d" % i, mode_f, 1000, 1000)
        await meta.map_write(f.ino, i * 100 * K, 300 * K + i)
        await meta.map_write(f.ino, 3 * M, 10)  # sparse
        await meta.setxattr(f.ino, b"user.n", b"%d" % i)
    await meta.truncate((await meta.lookup(a.ino, b"f0")).ino, 150 * K)  # frees chunks
    await meta.rename(a.ino, b"f2", b.ino, b"moved")
    await meta.rename(b.ino, b"f3", a.ino, b"f4")  # replaces f4: its chunks are freed
    await meta.link((await meta.lookup(b.ino, b"f1")).ino, ROOT, b"hard")
    await meta.mknod(ROOT, b"sym", stat.S_IFLNK | 0o777, 0, 0, target=b"a/b/f1")
    await meta.mknod(ROOT, b"fifo", stat.S_IFIFO | 0o600, 0, 0)
    await meta.unlink(b.ino, b"f5")
    await meta.setattr((await meta.lookup(ROOT, b"hard")).ino, SetAttr(mode=0o600, mtime_ns=12345))
    await meta.removexattr((await meta.lookup(a.ino, b"f0")).ino, b"user.n")
    c = await meta.mknod(ROOT, b"c", mode_d, 0, 0)
    await meta.rmdir(ROOT, b"c")
    await meta.setxattr(ROOT, b"user.root", b"r")
    held = await meta.mknod(ROOT, b"held", mode_f, 0, 0)
    await meta.map_write(held.ino, 0, 200 * K)
    await meta.open(held.ino)
    await meta.unlink(ROOT, b"held")
    assert c.ino != held.ino
    return held.ino


async def test_restart_with_journal_keeps_everything(
    start_mds: Callable[..., Mds], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # the client reports the outage
    journal = str(tmp_path / "journal")
    grace = 4.0
    mds = await start_async(start_mds, "--journal", journal, "--grace", str(grace))
    async with open_remote_meta("127.0.0.1", mds.port, SECRET, timeout=10) as meta:
        held = await build_tree(meta)
        await dump(meta, (held,))  # reads settle atimes (relatime) first
        before = await dump(meta, (held,))

        await trio.to_thread.run_sync(mds.stop, signal.SIGKILL)
        mds2 = await start_async(start_mds, "--journal", journal, "--grace", str(grace), port=mds.port)
        restarted = trio.current_time()
        after = await dump(meta, (held,))  # waits for the client to reconnect
        assert after == before, [(before[k]["attr"], after[k]["attr"]) for k in before if before[k] != after.get(k)]

        # Once the restart grace is over, only the client's re-registration keeps the
        # unlinked file alive; its handle still reads and writes.
        await trio.sleep_until(restarted + grace + 0.5)
        assert (await meta.getattr(held)).nlink == 0
        assert await meta.map_read(held, 0, 200 * K) == before[b"#%d" % held]["extents"]
        await meta.map_write(held, 200 * K, 10)
        await meta.release(held)
        with pytest.raises(FsError) as info:
            await meta.getattr(held)
        assert info.value.errno == errno.ENOENT
        assert (await meta.statfs()).blocks_free > before["statfs"].blocks_free
    log = mds2.log_text()
    assert "replayed" in log and "re-registered 1 open inodes" in log
    assert "Traceback" not in mds.log_text() + log


def append_to_journal(journal: Path, data: bytes) -> None:
    (path,) = journal.glob("journal.*")
    with path.open("ab") as f:
        f.write(data)


async def test_torn_journal_tail_is_tolerated(
    start_mds: Callable[..., Mds], tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    mds = await start_async(start_mds, "--journal", str(journal))
    async with open_remote_meta("127.0.0.1", mds.port, SECRET, timeout=10) as meta:
        await build_tree(meta)
        await dump(meta)  # reads settle atimes (relatime) first
        before = await dump(meta)
    await trio.to_thread.run_sync(mds.stop, signal.SIGKILL)
    # A record the server was writing when it died: a header promising more than is there.
    append_to_journal(journal, struct.pack("!II", 100, 0) + b"partial")
    mds2 = await start_async(start_mds, "--journal", str(journal))
    async with open_remote_meta("127.0.0.1", mds2.port, SECRET, timeout=10) as meta:
        after = await dump(meta)
    assert after == before  # statfs too: the server holds the unlinked-open file for now
    assert "torn record" in mds2.log_text()


async def test_calls_fail_with_eio_when_the_server_is_down_or_hung(
    start_mds: Callable[..., Mds], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    # Without leases every call needs the server (with them, cached state is served
    # until the lease runs out: test_leases.py).
    mds = await start_async(start_mds, "--lease-term", "0")
    timeout = 0.5
    async with open_remote_meta("127.0.0.1", mds.port, SECRET, timeout=timeout) as meta:
        f = await meta.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0)
        await meta.open(f.ino)

        async def fails_in_time(aw: Any) -> None:
            t0 = trio.current_time()
            with trio.fail_after(timeout + 2):  # never hang
                with pytest.raises(FsError) as info:
                    await aw
            assert info.value.errno == errno.EIO
            assert trio.current_time() - t0 < timeout + 0.5

        os.kill(mds.proc.pid, signal.SIGSTOP)  # hung: connected, silent
        try:
            await fails_in_time(meta.getattr(f.ino))
            await fails_in_time(meta.map_write(f.ino, 0, 10))
        finally:
            os.kill(mds.proc.pid, signal.SIGCONT)
        await trio.to_thread.run_sync(mds.stop, signal.SIGKILL)  # down: refused
        await fails_in_time(meta.getattr(f.ino))
        await fails_in_time(meta.mknod(ROOT, b"g", stat.S_IFREG | 0o644, 0, 0))
        await meta.release(f.ino)  # never fails: settled at the next connection


async def test_restart_without_journal_is_another_filesystem(
    start_mds: Callable[..., Mds], caplog: pytest.LogCaptureFixture
) -> None:
    """Inode numbers from before would name other files now: the client must stop."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    mds = await start_async(start_mds)
    async with open_remote_meta("127.0.0.1", mds.port, SECRET, timeout=10) as meta:
        f = await meta.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0)
        await trio.to_thread.run_sync(mds.stop, signal.SIGKILL)
        await start_async(start_mds, port=mds.port)
        with trio.fail_after(10):
            with pytest.raises(FsError) as info:
                await meta.getattr(f.ino)
        assert info.value.errno == errno.EIO and "another filesystem" in str(info.value)
        with pytest.raises(FsError):
            await meta.lookup(ROOT, b"f")


def test_readiness_sigterm_and_user_errors(start_mds: Callable[..., Mds], tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(tmp_path / "notify"))
        notify.settimeout(10)
        mds = start_mds(env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
        assert notify.recv(256) == b"READY=1"
        assert mds.stop(signal.SIGTERM) == 0
        assert notify.recv(256) == b"STOPPING=1"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*MEMFS, "mds", *args], capture_output=True, text=True, timeout=30)

    base = ["--listen", "127.0.0.1:0", "--volume-size", "16M"]
    loose = tmp_path / "loose"
    loose.write_bytes(SECRET)
    loose.chmod(0o644)
    blocker = tmp_path / "file"
    blocker.write_text("")
    for args, message in [
        ([*base, "--pool", "tcp://h:1"], "bad pool volume"),
        ([*base, "--pool", POOL_SPEC, "--secret-file", str(loose)], "readable by others"),
        ([*base, "--pool", POOL_SPEC, "--journal", str(blocker / "j")], "journal directory"),
        (["--listen", "nowhere", "--pool", POOL_SPEC, "--volume-size", "16M"], "bad --listen"),
        ([*base, "--pool", POOL_SPEC, "--chunk-size", "3K"], "chunk-size"),
    ]:
        res = run(*args)
        assert res.returncode == 2, (args, res)
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("memfs: error: ") and message in lines[0], res


def test_client_vanishing_mid_conversation_is_no_error(start_mds: Callable[..., Mds]) -> None:
    """A client that goes away with calls and replies in flight (killed, or it gave
    up on a hung server and closed) is an ordinary event: no ERROR, no traceback."""
    mds = start_mds()
    for _ in range(5):
        with authed(mds.port) as sock:
            for i in range(300):
                sock.sendall(wire.frame(Kind.CALL, i + 1, wire.encode(["statfs"])))
            # Reset, not FIN: the server's next send or receive fails.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with authed(mds.port) as good:
        kind, _ = call(good, ["statfs"])
        assert kind in OK_KINDS
    assert mds.proc.poll() is None
    log = mds.log_text()
    assert "Traceback" not in log and " ERROR " not in log, log


def test_memory_server_incarnations_are_kept_with_the_journal(tmp_path: Path) -> None:
    """What memory the pool's data lives in survives an mds restart (with --journal),
    so a memory server that restarted blank meanwhile is still recognised as lost."""
    from memfs.mds import INCARNATIONS, StartupError, _load_incarnations, _save_incarnations

    assert _load_incarnations(None) == {}
    assert _load_incarnations(str(tmp_path)) == {}
    known = {"10.0.0.2:7100": 12345, "[::1]:7101": (1 << 62) + 7}
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        _save_incarnations(str(tmp_path), known)
    assert synced[-1] == str(tmp_path), "the rename is made durable: the directory is fsynced after it"
    assert _load_incarnations(str(tmp_path)) == known
    (tmp_path / INCARNATIONS).write_bytes(b"garbage")
    with pytest.raises(StartupError):
        _load_incarnations(str(tmp_path))


async def test_a_silent_connection_is_closed_after_the_idle_timeout() -> None:
    """Calls keep a connection open; silence longer than the idle timeout closes it."""
    from memfs.config import PoolConfig
    from memfs.meta.server import MetaServer
    from tests.unit.test_meta_conformance import metadata_only

    pool = PoolConfig(size=8 * M, volumes=2, chunk_size=64 * K, stripe_size=256 * K)
    async with trio.open_nursery() as nursery:
        server = MetaServer(metadata_only(pool), SECRET, idle_timeout=0.8)
        port = await nursery.start(server.serve, "127.0.0.1", 0)

        def client() -> float:
            with authed(port) as sock:
                for _ in range(4):  # 1.2 s of calls: longer than the timeout, never silent
                    time.sleep(0.3)
                    assert call(sock, ["getattr", ROOT])[0] in OK_KINDS
                t0 = time.monotonic()
                assert read_frame(sock) is None, "closed"
                return time.monotonic() - t0

        silent = await trio.to_thread.run_sync(client)
        assert 0.6 <= silent < 3.0, silent
        nursery.cancel_scope.cancel()
