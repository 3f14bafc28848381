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
* :class:`RemoteMover` (cluster pools): the memory servers, over the same
  transport the mount uses (tcp: READ replies are received straight into the
  view, WRITE data is sent straight from it), in a trio loop on a thread of
  its own so that the API stays blocking.

A move that fails, or is interrupted (``KeyboardInterrupt``), returns only once
none of its copies is still running: the caller then tells the daemon the
transfer is over, after which that memory may belong to another file.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


def _zero(view: memoryview) -> None:
    if len(view):
        np.frombuffer(view, dtype=np.uint8)[:] = 0


def _settle(wait: Callable[[], object]) -> None:
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

    def __init__(self, fds: list[int], sizes: list[int]) -> None:
        if len(fds) != len(sizes):
            raise FsError(errno.EIO, f"the daemon sent {len(fds)} volumes for a pool of {len(sizes)}")
        self.fds = fds
        self.sizes = sizes
        self._pool: ThreadPoolExecutor | None = None

    def _check(self, vol: int, voff: int, n: int) -> None:
        if not 0 <= vol < len(self.fds) or voff < 0 or voff + n > self.sizes[vol]:
            raise FsError(errno.EIO, f"extent {vol}:{voff}+{n} is outside the pool")

    def read(self, extents: Sequence[Extent], base: int, view: memoryview) -> None:
        self._run(extents, base, view, write=False)

    def write(self, extents: Sequence[Extent], base: int, view: memoryview) -> None:
        self._run(extents, base, view, write=True)

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
            _settle(lambda: concurrent.futures.wait(futures))
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class RemoteMover:
    """Copies to and from a cluster pool's memory servers (see the module docstring).

    Opening connects to every memory server of the pool (with the mount's secret),
    so a pool this process cannot reach fails here, before any file is touched.
    """

    def __init__(self, pool: dict[str, Any]) -> None:
        from memfs.config import parse_pool_spec

        self._volumes = parse_pool_spec("+".join(str(v) for v in pool["volumes"]))
        self._secret = bytes.fromhex(pool["secret"])
        self._incarnations = {str(k): int(v) for k, v in dict(pool.get("incarnations", {})).items()}
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
                                       incarnations=self._incarnations) as transport:
            self._transport = transport
            ready.set()
            await self._stop.wait()

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._token is None:
            raise FsError(errno.EIO, "the memory-server connections are closed")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def read(self, extents: Sequence[Extent], base: int, view: memoryview) -> None:
        self._run(extents, base, view, False)

    def write(self, extents: Sequence[Extent], base: int, view: memoryview) -> None:
        self._run(extents, base, view, True)

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
                _settle(lambda: ended.wait(STOP_TIMEOUT))
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

    def close(self) -> None:
        if self._token is not None and self._stop is not None:
            stop = self._stop
            try:
                trio.from_thread.run_sync(stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
            self._token = None
        self._thread.join(timeout=30)
