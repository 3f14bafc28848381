"""Moving bytes between a process's memory and pool volumes, once.

A mover gets extents from the mount daemon (``[file offset, length, volume,
volume offset]``, volume -1 a hole) and a memoryview that holds a file range,
and copies each extent straight between the view and volume memory:

* :class:`LocalMover` (embedded pools): the volumes are the daemon's memfds,
  received over its control socket.  ``preadv``/``pwritev`` copy between the
  memfd's pages and the view in the kernel: no mapping to build, no buffer in
  between.  The copies run on a few threads (the GIL is released in the
  syscall): a fresh destination array is faulted in while it is filled, which
  is what bounds one thread.
* :class:`TcpMover` (cluster pools of ``tcp://`` volumes): the memory servers,
  with blocking bulk transfers, a thread per connection
  (:mod:`memfs.transport.bulk`): READ replies are received straight into the
  view, WRITE data is sent straight from it;
* :class:`RemoteMover` (other cluster pools: ``verbs://``): the transport the
  mount uses, in a trio loop on a thread of its own so that the API stays
  blocking.

A move that fails, or is interrupted (``KeyboardInterrupt``), returns only once
none of its copies is still running: the caller then tells the daemon the
transfer is over, after which that memory may belong to another file.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import trio

from memfs.errors import FsError

log = logging.getLogger(__name__)

#: an extent is split into pieces of at most this for the copy threads
SPLIT = 8 << 20
#: and into requests of at most this for memory servers (the tcp transport's largest)
REMOTE_SPLIT = 16 << 20
#: copy threads of a local mover
THREADS = max(1, min(8, os.cpu_count() or 1))
#: transfers a remote mover keeps in flight
REMOTE_CONCURRENCY = 16
#: an interrupted remote move has ended within this (every request has a 10 s deadline)
STOP_TIMEOUT = 60.0

Extent = Sequence[int]  # [file offset, length, volume, volume offset]


class Pending(Protocol):
    """A copy begun by :meth:`Mover.begin`."""

    def wait(self) -> None:
        """Return once the copy has ended; raise its failure."""

    def cancel(self) -> None:
        """Stop what has not been copied yet; return once nothing of it runs."""


class Ended:
    """A copy that ended before :meth:`Mover.begin` returned."""

    def wait(self) -> None:
        pass

    def cancel(self) -> None:
        pass


class Mover(Protocol):
    """Copies between a view of a file range and the volumes its extents name."""

    populate_ahead: bool
    #: whether :meth:`begin` returns before the copy ends (a copy begun next may
    #: start before it ends)
    overlaps: bool

    def begin(self, extents: Sequence[Extent], base: int, view: memoryview, *,
              write: bool) -> Pending:
        """Start the copy and return at once (:attr:`overlaps`), or copy and return
        an :class:`Ended` one."""

    def set_token(self, token: int) -> None:
        """The mount's lease token for the extents given next (cluster): memory-server
        connections that named another one name this one before their next copy."""

    def adopt(self, incarnations: dict[str, int]) -> None:
        """Memory servers the mds took back after a blank restart, as the mount heard
        it (cluster): their new incarnations are the pool's from now on."""

    def close(self) -> None: ...


def _zero(view: memoryview) -> None:
    if len(view):
        np.frombuffer(view, dtype=np.uint8)[:] = 0


_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc: ctypes.CDLL | None = None


def populate(view: memoryview) -> None:
    """Fault in the pages of *view* (writable), without writing them: what a copy into
    fresh memory otherwise does one page fault at a time in the copying thread.  Best
    effort (older kernels: nothing)."""
    global _libc
    if len(view) < 2 * _PAGE:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
    start = -(-addr // _PAGE) * _PAGE
    end = (addr + len(view)) // _PAGE * _PAGE
    # ctypes lets go of the GIL for the call: the copying threads go on meanwhile
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE)


def settle(wait: Callable[[], object]) -> None:
    """Run *wait* to its end, through any number of KeyboardInterrupts."""
    while True:
        try:
            wait()
            return
        except KeyboardInterrupt:
            continue


def _split(extents: Sequence[Extent], most: int) -> list[tuple[int, int, int, int]]:
    out = []
    for off, n, vol, voff in extents:
        for k in range(0, n, most):
            m = min(most, n - k)
            out.append((off + k, m, vol, voff + k if vol >= 0 else 0))
    return out


class LocalMover:
    """Copies to and from an embedded pool's volumes (see the module docstring)."""

    #: whether a read into fresh memory goes faster with its pages faulted in by another
    #: thread meanwhile (measured: no, the copy threads fault them in parallel already)
    populate_ahead = False
    overlaps = False

    def __init__(self, fds: list[int], sizes: list[int]) -> None:
        if len(fds) != len(sizes):
            raise FsError(errno.EIO, f"the daemon sent {len(fds)} volumes for a pool of {len(sizes)}")
        self.fds = fds
        self.sizes = sizes
        self._pool: ThreadPoolExecutor | None = None

    def _check(self, vol: int, voff: int, n: int) -> None:
        if not 0 <= vol < len(self.fds) or voff < 0 or voff + n > self.sizes[vol]:
            raise FsError(errno.EIO, f"extent {vol}:{voff}+{n} is outside the pool")

    def begin(self, extents: Sequence[Extent], base: int, view: memoryview, *,
              write: bool) -> Pending:
        self._run(extents, base, view, write=write)
        return Ended()

    def _run(self, extents: Sequence[Extent], base: int, view: memoryview, *, write: bool) -> None:
        jobs = _split(extents, SPLIT)
        for _, n, vol, voff in jobs:
            if vol >= 0:
                self._check(vol, voff, n)

        def one(job: tuple[int, int, int, int]) -> None:
            off, n, vol, voff = job
            part = view[off - base : off - base + n]
            if vol < 0:
                if not write:
                    _zero(part)  # a hole reads as zeros; a write never gets one
                return
            fd = self.fds[vol]
            done = 0
            while done < n:
                if write:
                    k = os.pwritev(fd, [part[done:]], voff + done)
                else:
                    k = os.preadv(fd, [part[done:]], voff + done)
                if k <= 0:
                    raise FsError(errno.EIO, f"volume {vol} ended at {voff + done}")
                done += k

        if len(jobs) < 2 or THREADS < 2:
            for j in jobs:
                one(j)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="memfs-array")
        futures = [self._pool.submit(one, j) for j in jobs]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            settle(lambda: concurrent.futures.wait(futures))
            raise

    def set_token(self, token: int) -> None:
        pass  # the daemon's own memory: no memory servers, no leases

    def adopt(self, incarnations: dict[str, int]) -> None:
        pass  # (nor their incarnations)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def pool_fsid(pool: dict[str, Any]) -> bytes | None:
    """The filesystem the pool's volumes belong to (hex in the mount's description),
    claimed on our connections too; None from a mount that names none."""
    fsid = pool.get("fsid")
    return bytes.fromhex(fsid) if isinstance(fsid, str) and fsid else None


class TcpMover:
    """Copies to and from a tcp pool's memory servers with blocking bulk transfers
    (:class:`memfs.transport.bulk.BulkTcp`: a thread per connection, each byte
    received straight into the array or sent straight from it)."""

    #: measured: with several receiving threads, faulting pages in on one more only
    #: takes a CPU from them
    populate_ahead = False
    overlaps = True

    def __init__(self, pool: dict[str, Any]) -> None:
        from memfs.config import parse_pool_spec
        from memfs.transport.bulk import BulkTcp

        self._bulk = BulkTcp(
            parse_pool_spec("+".join(str(v) for v in pool["volumes"])),
            bytes.fromhex(pool["secret"]),
            incarnations={str(k): int(v) for k, v in dict(pool.get("incarnations", {})).items()},
            token=int(pool.get("token", 0)), fsid=pool_fsid(pool))

    def begin(self, extents: Sequence[Extent], base: int, view: memoryview, *,
              write: bool) -> Pending:
        """Queued on each connection behind what was begun there before: a caller
        that begins its next piece before this one ends keeps every connection busy
        (isolated 1 GiB loads into an existing array, loopback: 3.33 -> 3.53 GiB/s)."""
        jobs = []
        for off, n, vol, voff in extents:
            part = view[off - base : off - base + n]
            if vol >= 0:
                jobs.append((vol, voff, part))
            elif not write:
                _zero(part)
        return self._bulk.begin(jobs, write=write)

    def set_token(self, token: int) -> None:
        self._bulk.set_token(token)

    def adopt(self, incarnations: dict[str, int]) -> None:
        self._bulk.adopt(incarnations)

    def close(self) -> None:
        self._bulk.close()


class RemoteMover:
    """Copies to and from a cluster pool's memory servers (see the module docstring).

    Opening connects to every memory server of the pool (with the mount's secret),
    so a pool this process cannot reach fails here, before any file is touched.
    """

    #: the receiving runs on one thread: faulting fresh pages in on another helps
    #: (1 GiB into a new array, loopback: 1.25 -> 1.56 GiB/s, medians of 5)
    populate_ahead = True
    overlaps = False

    def __init__(self, pool: dict[str, Any]) -> None:
        from memfs.config import parse_pool_spec

        self._volumes = parse_pool_spec("+".join(str(v) for v in pool["volumes"]))
        self._secret = bytes.fromhex(pool["secret"])
        self._incarnations = {str(k): int(v) for k, v in dict(pool.get("incarnations", {})).items()}
        self._lease_token = int(pool.get("token", 0))
        self._adopted = dict(self._incarnations)
        self._fsid = pool_fsid(pool)
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._transport: Any = None
        self._error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), daemon=True,
                                        name="memfs-array-io")
        self._thread.start()
        ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _main(self, ready: threading.Event) -> None:
        try:
            trio.run(self._serve, ready)
        except BaseException as exc:  # noqa: BLE001 - reported to the opener
            self._error = exc
        finally:
            ready.set()

    async def _serve(self, ready: threading.Event) -> None:
        from memfs.transport.pool import open_pool_transport

        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with open_pool_transport(self._volumes, self._secret,
                                       incarnations=self._incarnations,
                                       fsid=self._fsid) as transport:
            transport.set_session(self._lease_token)
            self._transport = transport
            ready.set()
            await self._stop.wait()

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._token is None:
            raise FsError(errno.EIO, "the memory-server connections are closed")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def begin(self, extents: Sequence[Extent], base: int, view: memoryview, *,
              write: bool) -> Pending:
        self._run(extents, base, view, write)
        return Ended()

    def _run(self, extents: Sequence[Extent], base: int, view: memoryview, write: bool) -> None:
        ended = threading.Event()
        scope = trio.CancelScope()

        async def move() -> None:
            try:
                with scope:
                    await self._move(extents, base, view, write)
            finally:
                ended.set()

        try:
            self._call(move)
        except BaseException:
            if self._token is not None:  # interrupted here, or failed there: stop it, wait
                try:
                    trio.from_thread.run_sync(scope.cancel, trio_token=self._token)
                except trio.RunFinishedError:
                    pass
                settle(lambda: ended.wait(STOP_TIMEOUT))
            raise

    async def _move(self, extents: Sequence[Extent], base: int, view: memoryview, write: bool) -> None:
        t = self._transport
        limit = trio.CapacityLimiter(REMOTE_CONCURRENCY)

        async def one(off: int, n: int, vol: int, voff: int) -> None:
            part = view[off - base : off - base + n]
            if vol < 0:
                if not write:
                    _zero(part)
                return
            async with limit:
                if write:
                    await t.write(vol, voff, part)
                else:
                    await t.readinto(vol, voff, part)

        try:
            async with trio.open_nursery() as nursery:
                for off, n, vol, voff in _split(extents, REMOTE_SPLIT):
                    nursery.start_soon(one, off, n, vol, voff)
        except BaseExceptionGroup as group:
            first: BaseException = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None

    def set_token(self, token: int) -> None:
        if token != self._lease_token:
            self._lease_token = token
            self._call(self._set_session, token)

    async def _set_session(self, token: int) -> None:
        self._transport.set_session(token)

    def adopt(self, incarnations: dict[str, int]) -> None:
        if incarnations != self._adopted:
            self._adopted = dict(incarnations)
            self._call(self._adopt, self._adopted)

    async def _adopt(self, incarnations: dict[str, int]) -> None:
        self._transport.adopt(incarnations)

    def close(self) -> None:
        if self._token is not None and self._stop is not None:
            stop = self._stop
            try:
                trio.from_thread.run_sync(stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
            self._token = None
        self._thread.join(timeout=30)
