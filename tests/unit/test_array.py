"""memfs.array without a mount: the .npy codec, the API over ordinary files (the
path a process without pool access takes), and the daemon's session service over
a real control socket with an embedded store, scrubber and memfd volumes."""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import trio

import memfs.array as ma
from memfs.array import npy
from memfs.array.files import DirectFile, DirectSession
from memfs.array.movers import LocalMover
from memfs.array.service import (
    MAX_STRIPE,
    TEMP_TAG,
    ArrayService,
    PoolAccess,
    array_layout,
    may_access,
    wait_exit,
)
from memfs.config import PoolConfig
from memfs.control import ControlClient, serve_control
from memfs.errors import FsError, TransportError
from memfs.host import Peer
from memfs.layout import LAYOUT_XATTR
from memfs.meta import WritePlan
from memfs.meta.store import MetaStore
from memfs.scrub import Scrubber
from memfs.transport.local import LocalTransport

T = TypeVar("T")
POOL = PoolConfig(size=32 << 20, volumes=4, chunk_size=64 << 10, stripe_size=1 << 20)


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


ARRAYS = [
    np.arange(12.0).reshape(3, 4),
    np.asfortranarray(np.arange(12, dtype="i2").reshape(3, 4)),
    np.array(3.5),
    np.zeros((0, 7)),
    np.array([1], dtype="u1"),
    np.arange(5, dtype=">c8"),
    np.zeros(4, dtype=[("a", "<i4"), ("b", "S3"), ("c", "<f8", (2,))]),
    np.array(["x", "yz"], dtype="U3"),
]


@pytest.mark.parametrize("arr", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_header_and_bytes_are_numpys(arr: np.ndarray) -> None:
    a, data = npy.data_view(arr)
    header = npy.encode_header(a.shape, a.dtype, npy.is_fortran(a))
    assert header + bytes(data) == npy_bytes(arr)
    h = npy.decode_header(header)
    assert (h.shape, h.dtype, h.data_offset, h.nbytes) == (arr.shape, arr.dtype, len(header),
                                                           arr.nbytes)


def test_long_headers_use_format_2() -> None:
    wide = np.dtype([(f"field_{i:05d}", "<f8") for i in range(4000)])
    header = npy.encode_header((2,), wide, False)
    assert header[6] == 2 and len(header) > 65536 and len(header) % 64 == 0
    assert npy.decode_header(header).dtype == wide
    with pytest.warns(UserWarning, match="format 2.0"):  # numpy says so when it does it
        theirs = npy_bytes(np.zeros(2, dtype=wide))
    assert header == theirs[: len(header)]


def test_bad_headers_and_object_arrays() -> None:
    with pytest.raises(ValueError, match="magic"):
        npy.header_length(b"PK\x03\x04 not npy!")
    with pytest.raises(ValueError, match="version 9"):
        npy.header_length(b"\x93NUMPY\x09\x00\x10\x00")
    with pytest.raises(ValueError, match="truncated"):
        npy.decode_header(npy.encode_header((3,), np.dtype("f8"), False)[:50])
    with pytest.raises(ValueError, match="pickled"):
        npy.data_view(np.array([{}, []], dtype=object))


def test_array_layout_uses_large_stripes_for_large_arrays() -> None:
    chunk = 64 << 10
    assert array_layout(10 << 20, 4, chunk) is None  # small: the pool default
    assert array_layout(1 << 30, 4, chunk) == b"stripe_count=-1 stripe_size=16M"
    assert array_layout(128 << 20, 4, chunk) == b"stripe_count=-1 stripe_size=8M"
    assert array_layout(1 << 40, 1, chunk) == f"stripe_count=-1 stripe_size={MAX_STRIPE >> 20}M".encode()
    assert array_layout(64 << 20, 1, 4 << 20) == b"stripe_count=-1 stripe_size=16M"


def test_cluster_pools_are_for_root_and_the_daemons_user_only() -> None:
    local = PoolAccess("local", fds=(3,), sizes=(1,))
    remote = PoolAccess("tcp", volumes=("tcp://h:1/0",), secret=b"s")
    me, other = os.geteuid(), 54321
    assert may_access(Peer(1, other, other), local) is None  # the control socket decided
    assert may_access(Peer(1, 0, 0), remote) is None
    assert may_access(Peer(1, me, me), remote) is None
    assert "secret" in str(may_access(Peer(1, other, other), remote))


# -- the API over ordinary files (what a process without pool access uses) -----------------


def test_api_over_a_plain_directory(tmp_path: Path) -> None:
    for i, arr in enumerate(ARRAYS):
        p = tmp_path / f"a{i}.npy"
        ma.save(p, arr)
        assert p.read_bytes() == npy_bytes(arr)
        back = ma.load(p)
        assert back.dtype == arr.dtype and np.array_equal(back, arr)
        with ma.open(p) as af:
            assert not af.direct and af.shape == arr.shape
    masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])  # a subclass: its data
    ma.save(tmp_path / "m.npy", masked)
    assert np.array_equal(np.load(tmp_path / "m.npy"), [1.0, 2.0, 3.0])
    assert not [n for n in os.listdir(tmp_path) if "memfs-array" in n]


def test_replacing_keeps_permissions_and_never_leaves_temp_files(tmp_path: Path) -> None:
    p = tmp_path / "keep.npy"
    ma.save(p, np.ones(3))
    p.chmod(0o640)
    ma.save(p, np.zeros(5))
    assert stat.S_IMODE(p.stat().st_mode) == 0o640 and np.array_equal(np.load(p), np.zeros(5))
    with pytest.raises(ValueError, match="pickled"):
        ma.save(p, np.array([None, 1], dtype=object))
    assert sorted(os.listdir(tmp_path)) == ["keep.npy"]
    assert np.array_equal(np.load(p), np.zeros(5))


def test_slabs_and_indexing(tmp_path: Path) -> None:
    p = tmp_path / "s.npy"
    with ma.open(p, "w", shape=(10, 3), dtype="i4") as af:
        af[2:4] = [[1, 2, 3], [4, 5, 6]]
        af[np.int64(5)] = 7
        af[-1] = [8, 9, 10]
        af.write(6, np.full((2, 3), 11))
        assert len(af) == 10 and af[np.int64(5)].tolist() == [7, 7, 7]
        assert af[2:4].tolist() == [[1, 2, 3], [4, 5, 6]] and af[-1].tolist() == [8, 9, 10]
        out = np.empty((2, 3), dtype="i4")
        assert af.read(6, 8, out=out) is out and (out == 11).all()
        with pytest.raises(IndexError, match="step"):
            af[::2]
        with pytest.raises(IndexError):
            af[10]
        with pytest.raises(IndexError, match="first axis"):
            af[1, 2]
    expect = np.zeros((10, 3), dtype="i4")
    expect[2:4] = [[1, 2, 3], [4, 5, 6]]
    expect[5], expect[-1], expect[6:8] = 7, [8, 9, 10], 11
    assert np.array_equal(np.load(p), expect) and np.array_equal(ma.load(p), expect)
    with ma.open(p) as af, pytest.raises(OSError) as info:
        af[0] = 1
    assert info.value.errno == errno.EBADF
    with pytest.raises(ValueError, match="shape= and dtype="):
        ma.open(p, "w")
    with pytest.raises(ValueError, match="takes shape"):
        ma.open(p, "r", shape=(3,))


def test_fortran_files_are_read_whole(tmp_path: Path) -> None:
    p = tmp_path / "f.npy"
    a = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    np.save(p, a)
    with ma.open(p) as af:
        assert af.fortran_order and np.array_equal(af[...], a) and af[...].flags.f_contiguous
        with pytest.raises(ValueError, match="Fortran"):
            af[0:2]
    with pytest.raises(ValueError, match="Fortran order"):
        ma.load(p, out=np.empty((3, 4)))
    assert np.array_equal(ma.load(p, out=np.empty((3, 4), order="F")), a)


def test_zero_d_and_truncated_files(tmp_path: Path) -> None:
    p = tmp_path / "z.npy"
    ma.save(p, np.array(2.5))
    with ma.open(p, "r+") as af:
        assert af[()] == 2.5
        af[...] = 4.0
    assert np.load(p) == 4.0
    q = tmp_path / "t.npy"
    q.write_bytes(npy_bytes(np.arange(100.0))[:-8])
    with pytest.raises(ValueError, match="header says"):
        ma.load(q)
    (tmp_path / "n.npy").write_bytes(b"not an array at all")
    with pytest.raises(ValueError, match="magic"):
        ma.load(tmp_path / "n.npy")


# -- the daemon's side, over a real control socket ---------------------------------------


async def test_a_waiting_scrubber_round_goes_before_new_transfers(tmp_path: Path) -> None:
    async with daemon(tmp_path) as d:
        a = d.service.session(Peer(os.getpid(), 0, 0))
        b = d.service.session(Peer(os.getpid(), 0, 0))
        ra, _ = await a.call("array.create", {"path": "a", "size": 2 << 20, "mode": 0o600})
        rb, _ = await b.call("array.create", {"path": "b", "size": 1 << 20, "mode": 0o600})
        ma_, _ = await a.call("array.map", {"h": ra["h"], "offset": 0, "length": 1 << 20,
                                           "write": True})
        await d.store.truncate(ra["ino"], 1 << 20)  # 16 chunks freed under the transfer
        order: list[str] = []

        async def scrub() -> None:
            await d.scrubber.drain()
            order.append("scrubbed")

        async def map_b() -> None:
            mb, _ = await b.call("array.map", {"h": rb["h"], "offset": 0, "length": 1 << 20,
                                               "write": True})
            order.append(f"mapped with {d.store.space.dirty_chunks} dirty")
            await b.call("array.done", {"h": rb["h"], "t": mb["t"]})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(scrub)
            await trio.sleep(0.05)  # the round waits for a's transfer ...
            nursery.start_soon(map_b)
            await trio.sleep(0.05)
            assert order == []  # ... and b waits for the round
            await a.call("array.done", {"h": ra["h"], "t": ma_["t"]})
        assert "mapped with 0 dirty" in order and d.store.space.dirty_chunks == 0
        await a.aclose()
        await b.aclose()


async def test_an_idle_session_with_open_files_is_not_closed(tmp_path: Path) -> None:
    async with daemon(tmp_path) as d:
        sock = str(tmp_path / "idle.sock")
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_control(
                sock, d.store, sessions=d.service.session, idle_timeout=0.2,
                task_status=task_status))
            s = await blocking(lambda: DirectSession.over(ControlClient(sock, "t"), "t"))
            assert s is not None
            r = await blocking(lambda: s.call("x", "array.create", path="i", size=10, mode=0o600))
            await trio.sleep(0.5)  # longer than the idle timeout, a file open
            await blocking(functools.partial(s.call, "x", "array.close", h=r["h"]))
            await trio.sleep(0.5)  # nothing open: idle, closed
            with pytest.raises(OSError) as info:
                await blocking(functools.partial(s.call, "x", "array.open", path="i"))
            assert info.value.errno in (errno.EIO, errno.ENOTCONN, errno.ENOENT)
            await blocking(s.close)
            nursery.cancel_scope.cancel()


class Daemon:
    def __init__(self, store: MetaStore, service: ArrayService, scrubber: Scrubber,
                 sock: str) -> None:
        self.store = store
        self.service = service
        self.scrubber = scrubber
        self.sock = sock

    fds: list[int]
    sizes: list[int]

    def session(self) -> DirectSession:
        s = DirectSession.over(ControlClient(self.sock, "test"), "test")
        assert s is not None
        return s

    def pipelined(self, piece: int, mover: Any = None) -> DirectSession:
        """A session as a cluster client's (two transfers open), copying locally."""
        local = LocalMover([os.dup(fd) for fd in self.fds], self.sizes)
        client = ControlClient(self.sock, "test")
        client.connect()
        return DirectSession(client, mover or local, piece, depth=2)

    def names(self) -> list[bytes]:
        return sorted(self.store.inodes[1].children or {})


@asynccontextmanager
async def daemon(tmp_path: Path, pool: PoolConfig = POOL, *,
                 cluster: bool = False) -> AsyncIterator[Daemon]:
    """An embedded store and its sessions; *cluster*: sessions as a cluster client's
    daemon serves them (pipelined, no scrubber here), memory still local to test with."""
    transport = LocalTransport(pool.volumes, pool.volume_size)
    store = MetaStore(pool)
    scrubber = Scrubber(store, transport)
    if cluster:
        access = PoolAccess("tcp", volumes=("tcp://127.0.0.1:9/0", "tcp://127.0.0.1:9/1"))
        service = ArrayService(store, access)
    else:
        access = PoolAccess("local", fds=tuple(transport.volume_fds()),
                            sizes=tuple(v.size for v in transport.volumes))
        service = ArrayService(store, access, scrub_hold=scrubber.hold,
                               scrub_turn=scrubber.wait_turn)
    sock = str(tmp_path / "ctl.sock")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(scrubber.run)
            await nursery.start(service.run)
            await nursery.start(lambda task_status: serve_control(
                sock, store, sessions=service.session, task_status=task_status))
            d = Daemon(store, service, scrubber, sock)
            d.fds = list(transport.volume_fds())
            d.sizes = [v.size for v in transport.volumes]
            yield d
            nursery.cancel_scope.cancel()
    finally:
        await transport.aclose()


async def blocking(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


async def test_direct_round_trip_and_holes(tmp_path: Path) -> None:
    async with daemon(tmp_path) as d:
        data = np.arange(1 << 18, dtype="f8")  # 2 MiB over 4 volumes in 1 MiB stripes

        def work() -> None:
            s = d.session()
            s.piece = 256 << 10  # many pieces: the pipelined loop, two transfers open
            r = s.call("x", "array.create", path="a.npy", size=data.nbytes, mode=0o644,
                       allocate=False)
            f = DirectFile(s, "x", r["h"], data.nbytes)
            f.write(0, npy.byte_view(data))
            f.commit()
            f.close()
            s = d.session()
            s.piece = 192 << 10  # not a divisor of the size: a short last piece
            r = s.call("x", "array.open", path="a.npy", write=False)
            f = DirectFile(s, "x", r["h"], r["size"])
            back = np.empty_like(data)
            f.read(0, npy.byte_view(back))
            f.close()
            assert np.array_equal(back, data)

        await blocking(work)
        assert d.names() == [b"a.npy"]
        ino = d.store.inodes[1].children[b"a.npy"]  # type: ignore[index]
        assert d.store.inodes[ino].opens == 0 and d.store.inodes[ino].size == data.nbytes

        def hole() -> None:  # a sparse file reads zeros where nothing was written
            s = d.session()
            r = s.call("x", "array.open", path="a.npy", write=False)
            out = bytearray(b"\xff" * 16)
            f = DirectFile(s, "x", r["h"], r["size"])
            f.read(0, memoryview(out))
            f.close()
            assert bytes(out) == bytes(data.view(np.uint8)[:16])

        await blocking(hole)


async def test_pipelined_transfers(tmp_path: Path) -> None:
    """Two transfers open: many pieces, a short last one, both ways, intact."""
    async with daemon(tmp_path, cluster=True) as d:
        data = np.arange(3 << 17, dtype="f8")  # 3 MiB

        def work() -> None:
            s = d.pipelined(320 << 10)
            r = s.call("x", "array.create", path="p", size=data.nbytes, mode=0o600,
                       allocate=False)
            f = DirectFile(s, "x", r["h"], data.nbytes)
            f.write(0, npy.byte_view(data))
            f.commit()
            back = np.zeros_like(data)
            f.read(0, npy.byte_view(back))
            f.close()
            assert np.array_equal(back, data)

        await blocking(work)
        assert d.service.orphans == 0


class TruncatingStore(MetaStore):
    """A store as a cluster client's meta looks to a memfs.array session while that
    node truncates a file: right after the *at*-th map_write of the file it is
    truncating (maps asked for then wait) until every piece open then has landed."""

    def __init__(self, pool: PoolConfig, at: int) -> None:
        super().__init__(pool)
        self.at = at
        self.maps = 0
        self.waiting: set[int] = set()  # the pieces the truncate waits for
        self.pieces: set[int] = set()  # open now
        self.over = trio.Event()
        self.began = False
        self._next = 0

    def truncating(self, ino: int) -> bool:
        return self.began and not self.over.is_set()

    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        if self.truncating(ino):
            await self.over.wait()
        plan = await super().map_write(ino, offset, length)
        self.maps += 1
        if self.maps == self.at:  # (the service pins the piece before it awaits again)
            trio.lowlevel.current_trio_token().run_sync_soon(self._begin)
        return plan

    def _begin(self) -> None:
        self.began = True
        self.waiting = set(self.pieces)
        if not self.waiting:
            self.over.set()

    @contextlib.contextmanager
    def io(self, ino: int, *, here: bool = True) -> Iterator[Callable[[], None]]:
        k, self._next = self._next, self._next + 1
        self.pieces.add(k)

        def landed() -> None:
            self.pieces.discard(k)
            self.waiting.discard(k)
            if self.began and not self.waiting:
                self.over.set()

        try:
            yield landed
        finally:
            landed()


@pytest.mark.parametrize("overlaps", [True, False], ids=["tcp", "in-turn"])
async def test_a_pipelined_writer_ends_its_open_piece_when_a_truncate_waits_for_it(
    tmp_path: Path, overlaps: bool,
) -> None:
    """A truncate on the writer's node waits for the pieces open there, and the map
    of the next piece is answered EAGAIN meanwhile: the client ends the piece it
    has open (with tcp pools it has not said done yet), asks again, and goes on."""
    async with daemon(tmp_path, cluster=True) as d:
        store = TruncatingStore(POOL, at=3)
        d.service.meta = store
        data = np.arange(1 << 17, dtype="f8")  # 1 MiB in 4 pieces

        def work() -> None:
            s = d.pipelined(256 << 10)
            s.mover = FailingMover(s.mover, 0, overlaps=overlaps)  # type: ignore[arg-type]
            r = s.call("x", "array.create", path="p", size=data.nbytes, mode=0o600)
            f = DirectFile(s, "x", r["h"], data.nbytes)
            f.write(0, npy.byte_view(data))
            back = np.zeros_like(data)
            f.read(0, npy.byte_view(back))
            f.close()
            s.close()
            assert np.array_equal(back, data)

        with trio.fail_after(10):
            await blocking(work)
        assert store.began and store.over.is_set()


class FailingMover:
    """A local mover whose *n*-th copy fails, as with a dead memory server: when it is
    begun, or (*late*) when it is waited for (the pipeline has begun the next piece
    by then).  *log* records each copy's begin, wait and cancel, numbered."""

    populate_ahead = False

    def __init__(self, inner: LocalMover, n: int, *, late: bool = False,
                 overlaps: bool = True) -> None:
        self.inner, self.n, self.late = inner, n, late
        #: as the tcp mover's copies (a pipelined session begins the next piece early)
        self.overlaps = overlaps
        self.log: list[str] = []
        self.begun = 0

    def begin(self, extents: Any, base: int, view: memoryview, *, write: bool) -> _Copy:
        k, self.begun = self.begun, self.begun + 1
        self.log.append(f"begin {k}")
        self.n -= 1
        if self.n == 0 and not self.late:
            raise TransportError("memory server 127.0.0.1:9 went away")
        self.inner.begin(extents, base, view, write=write).wait()
        return _Copy(self.log, k, failing=self.n == 0)

    def set_token(self, token: int) -> None:
        self.inner.set_token(token)

    def adopt(self, incarnations: dict[str, int]) -> None:
        self.inner.adopt(incarnations)

    def close(self) -> None:
        self.inner.close()


class _Copy:
    def __init__(self, log: list[str], k: int, *, failing: bool) -> None:
        self.log, self.k, self.failing = log, k, failing

    def wait(self) -> None:
        self.log.append(f"wait {self.k}")
        if self.failing:
            raise TransportError("memory server 127.0.0.1:9 went away")

    def cancel(self) -> None:
        self.log.append(f"cancel {self.k}")


async def test_a_pipelined_transfer_begins_the_next_piece_before_waiting(tmp_path: Path) -> None:
    """Cluster sessions keep every memory-server connection busy: piece i+1 is begun
    before piece i's copies are waited for (at most two transfers open: the daemon
    refuses a third with EBUSY); a copy that fails when waited for stops the one
    begun after it, and no transfer stays open."""
    async with daemon(tmp_path, cluster=True) as d:
        data = np.arange(1 << 17, dtype="f8")  # 1 MiB in 4 pieces

        def work() -> list[list[str]]:
            s = d.pipelined(256 << 10)
            logs = []
            s.mover = mover = FailingMover(s.mover, 0)  # type: ignore[arg-type]
            r = s.call("x", "array.create", path="p", size=data.nbytes, mode=0o600)
            f = DirectFile(s, "/mnt/p", r["h"], data.nbytes)
            f.write(0, npy.byte_view(data))
            f.commit()
            back = np.zeros_like(data)
            f.read(0, npy.byte_view(back))
            assert np.array_equal(back, data)
            logs.append(mover.log)
            s.mover = mover = FailingMover(mover.inner, 2, late=True)
            with pytest.raises(OSError) as info:
                f.read(0, npy.byte_view(back))
            assert info.value.errno == errno.EIO and info.value.filename == "/mnt/p"
            logs.append(mover.log)
            f.close()
            s.close()
            return logs

        logs = await blocking(work)
        order = ["begin 0", "begin 1", "wait 0", "begin 2", "wait 1", "begin 3", "wait 2",
                 "wait 3"]
        then = [f"{verb} {int(k) + 4}" for verb, k in (e.split() for e in order)]
        assert logs[0] == order + then  # the write, then the read
        # the failed copy and the one begun after it are cancelled (stopped, waited for)
        assert logs[1] == ["begin 0", "begin 1", "wait 0", "begin 2", "wait 1", "cancel 1",
                           "cancel 2"]
        with trio.fail_after(5):
            await d.scrubber.drain()
        assert d.service.orphans == 0 and d.scrubber._holds == 0


@pytest.mark.parametrize("cluster", [False, True], ids=["embedded", "pipelined"])
async def test_a_failed_copy_leaves_no_transfer_open(tmp_path: Path, cluster: bool) -> None:
    async with daemon(tmp_path, cluster=cluster) as d:
        data = np.ones(1 << 18)  # 2 MiB in 256 KiB pieces: fails on the third

        def work() -> None:
            s = d.pipelined(256 << 10) if cluster else d.session()
            s.piece = 256 << 10
            local = LocalMover([os.dup(fd) for fd in d.fds], d.sizes)
            s.mover.close()
            s.mover = FailingMover(local, 3)
            r = s.call("x", "array.create", path="f", size=data.nbytes, mode=0o600,
                       allocate=False)
            f = DirectFile(s, "/mnt/f", r["h"], data.nbytes)
            with pytest.raises(OSError) as info:
                f.write(0, npy.byte_view(data))
            assert info.value.errno == errno.EIO and info.value.filename == "/mnt/f"
            f.close()  # would be EBUSY with a transfer open (and is logged, not raised)

        await blocking(work)
        with trio.fail_after(5):
            await d.scrubber.drain()
        assert d.service.orphans == 0 and d.scrubber._holds == 0 and d.names() == []


@pytest.mark.parametrize("overlaps", [True, False], ids=["overlapping", "in-turn"])
async def test_a_stale_read_is_read_again(tmp_path: Path, overlaps: bool) -> None:
    """A chunk map recalled during a read (cluster): the pieces it caught in flight are
    read again (with copies that overlap, two of them; one after the other, one)."""
    async with daemon(tmp_path, cluster=True) as d:
        data = np.arange(1 << 17, dtype="f8")  # 1 MiB
        moves = [0]
        gen = [0]
        begun: list[int] = []  # the file offset of each copy begun

        def bump() -> int:
            return gen[0]

        d.store.generation = lambda ino: bump()  # type: ignore[method-assign]

        class Recalling(FailingMover):
            def begin(self, *args: Any, write: bool) -> _Copy:
                moves[0] += 1
                begun.append(args[1])
                if moves[0] == 2:
                    gen[0] += 1  # recalled while the second piece moves
                return super().begin(*args, write=write)

        def work() -> None:
            s = d.pipelined(256 << 10)
            r = s.call("x", "array.create", path="s", size=data.nbytes, mode=0o600)
            f = DirectFile(s, "x", r["h"], data.nbytes)
            f.write(0, npy.byte_view(data))
            f.commit()
            s.mover = Recalling(s.mover, 0, overlaps=overlaps)  # type: ignore[arg-type]
            back = np.zeros_like(data)
            f.read(0, npy.byte_view(back))
            f.close()
            assert np.array_equal(back, data)

        await blocking(work)
        # 4 pieces; overlapping, the recall came while the first two were begun and not
        # yet done (the second begins before the first is waited for): both are read
        # again; in turn, the first was done already.  The third piece's map was asked
        # for before the second began: whether the daemon answered it before or after
        # the recall is a race between two threads, so it may be read once or twice.
        base = min(begun)
        times = [begun.count(base + k * (256 << 10)) for k in range(4)]
        assert times[:2] == ([2, 2] if overlaps else [1, 2]), begun
        assert times[2] in (1, 2) and times[3] == 1 and len(begun) == sum(times), begun


async def test_a_transfer_blocks_other_requests_and_scrubbing(tmp_path: Path) -> None:
    async with daemon(tmp_path) as d:
        s = await blocking(d.session)
        r = await blocking(lambda: s.call("x", "array.create", path="b", size=4 << 20, mode=0o600))
        await blocking(lambda: s.call("x", "array.commit", h=r["h"]))
        m = await blocking(lambda: s.call("x", "array.map", h=r["h"], offset=0, length=1 << 20,
                                          write=True))
        for op, args in (("array.open", {"path": "b"}), ("array.close", {"h": r["h"]}),
                         ("array.map", {"h": r["h"], "offset": 0, "length": 1})):  # one at a time
            with pytest.raises(OSError) as info:
                await blocking(functools.partial(s.call, "x", op, **args))
            assert info.value.errno == errno.EBUSY
        # Chunks freed meanwhile are not zeroed (and so not handed out again) ...
        await d.store.truncate(r["ino"], 0)
        assert d.store.space.dirty_chunks == 64
        with trio.move_on_after(0.5):
            await d.scrubber.drain()
        assert d.store.space.dirty_chunks == 64
        # ... until the transfer ends.
        await blocking(functools.partial(s.call, "x", "array.done", h=r["h"], t=m["t"]))
        with trio.fail_after(5):
            await d.scrubber.drain()
        assert d.store.space.dirty_chunks == 0
        await blocking(s.close)


async def test_a_session_that_ends_leaves_nothing(tmp_path: Path) -> None:
    async with daemon(tmp_path) as d:
        free = d.store.space.totals()

        def leave() -> None:
            s = d.session()
            s.call("x", "array.create", path="gone.npy", size=3 << 20, mode=0o600)
            s.client.close()  # the process "dies": no commit, no close

        await blocking(leave)
        with trio.fail_after(5):
            while d.names() or d.store.space.totals() != free:
                await trio.sleep(0.01)
                await d.scrubber.drain()
        assert not [n for n in d.names() if TEMP_TAG in n]


async def test_enospc_at_create_leaves_no_file(tmp_path: Path) -> None:
    async with daemon(tmp_path) as d:
        free = d.store.space.totals()
        s = await blocking(d.session)
        with pytest.raises(OSError) as info:
            await blocking(lambda: s.call("/mnt/x.npy", "array.create", path="x.npy",
                                          size=64 << 20, mode=0o600))
        assert info.value.errno == errno.ENOSPC and info.value.filename == "/mnt/x.npy"
        await blocking(s.close)
        with trio.fail_after(5):
            await d.scrubber.drain()
        assert d.names() == [] and d.store.space.totals() == free


async def test_large_arrays_get_large_stripes_unless_the_directory_says(tmp_path: Path) -> None:
    pool = PoolConfig(size=256 << 20, volumes=4, chunk_size=64 << 10, stripe_size=1 << 20)
    async with daemon(tmp_path, pool) as d:
        sub = await d.store.mknod(1, b"d", stat.S_IFDIR | 0o755, 0, 0)
        await d.store.setxattr(sub.ino, LAYOUT_XATTR, b"stripe_size=2M")
        s = await blocking(d.session)
        for path in ("big", "d/big"):
            r = await blocking(functools.partial(s.call, "x", "array.create", path=path,
                                                 size=128 << 20, mode=0o600))
            layout = await d.store.getxattr(r["ino"], LAYOUT_XATTR)
            want = b"stripe_size=8M" if path == "big" else b"stripe_size=2M"
            assert want in layout, layout
            await blocking(functools.partial(s.call, "x", "array.close", h=r["h"]))
        await blocking(s.close)


async def test_an_orphaned_transfer_is_held_until_its_process_exits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with daemon(tmp_path) as d:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # noqa: ASYNC220
        try:
            session = d.service.session(Peer(child.pid, 0, 0))
            r, _ = await session.call("array.create", {"path": "o", "size": 1 << 20, "mode": 0o600})
            await session.call("array.map", {"h": r["h"], "offset": 0, "length": 1 << 20,
                                             "write": True})
            await session.aclose()  # the connection ended mid-transfer
            assert d.service.orphans == 1 and d.scrubber._holds == 1
            assert [n for n in d.names() if TEMP_TAG in n], "kept while the process lives"
            await trio.sleep(0.2)
            assert d.service.orphans == 1
            assert "left with 1 transfer(s) open" in caplog.text
            child.kill()
            with trio.fail_after(5):
                while d.service.orphans:  # noqa: ASYNC110 - polled: no event to wait on
                    await trio.sleep(0.01)
            assert d.scrubber._holds == 0 and d.names() == []
        finally:
            child.kill()
            child.wait()


async def test_wait_exit_of_a_process_that_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: ASYNC220
    child.wait()
    with trio.fail_after(1):
        await wait_exit(child.pid)


async def test_bad_requests_are_errors_not_crashes(tmp_path: Path) -> None:
    async with daemon(tmp_path) as d:
        session = d.service.session(Peer(os.getpid(), 0, 0))
        for op, args, err in (
            ("array.nope", {}, errno.EINVAL),
            ("array.open", {"path": 5}, errno.EINVAL),
            ("array.open", {"path": "../x"}, errno.EINVAL),
            ("array.open", {"path": "missing"}, errno.ENOENT),
            ("array.open", {"path": ""}, errno.EISDIR),
            ("array.create", {"path": "x", "size": -1, "mode": 0}, errno.EINVAL),
            ("array.map", {"h": 99, "offset": 0, "length": 1}, errno.EBADF),
            ("array.done", {"h": 99}, errno.EBADF),
        ):
            with pytest.raises(FsError) as info:
                await session.call(op, args)
            assert info.value.errno == err, (op, args)
        r, _ = await session.call("array.create", {"path": "x", "size": 10, "mode": 0o600})
        with pytest.raises(FsError) as info:
            await session.call("array.map", {"h": r["h"], "offset": 8, "length": 4, "write": True})
        assert info.value.errno == errno.EINVAL  # past the end of a fixed-size array file
        await session.call("array.close", {"h": r["h"]})
        await session.aclose()
        assert d.names() == []


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_descriptors_are_not_leaked(tmp_path: Path) -> None:
    async with daemon(tmp_path) as d:
        # One first: what its first use opens for good (a worker thread's wakeup
        # descriptor, ...) is not a leak; run alone, the test counted it.
        await blocking(lambda: d.session().close())
        before = fds_of(os.getpid())

        def many() -> None:
            for _ in range(20):
                s = d.session()
                s.close()

        await blocking(many)
        # The daemon's side of a session's connection closes as that task ends:
        # a moment after the client's close returns.
        # (The warm-up's may still have been open when *before* was counted.)
        with trio.move_on_after(5):
            while fds_of(os.getpid()) > before:  # noqa: ASYNC110 - nothing to wait on
                await trio.sleep(0.01)
        assert fds_of(os.getpid()) <= before

