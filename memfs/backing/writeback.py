"""Write-back: the scheduler and workers that copy versions of files to DIR.

A worker copies the file's current version to a temporary file in DIR
(:meth:`memfs.backing.dirside.BackingDir.tmp_name`), fsyncs it, and renames it
into place under the mirror's lock, after every earlier namespace operation.  A
copy whose version moved on while it was written is thrown away and made again,
never published, so DIR only ever holds whole versions.  Files are due
``delay`` seconds after their last change, at once when ``memfs flush`` asks
(*forced*), when dirty data passes half the cap, when writers wait on the cap,
and while draining.  A failure keeps the file dirty and retries it with
exponential back-off; a bug in a round or a worker is logged and shown by
``memfs status`` and the work goes on.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import trio

from memfs.backing import faults
from memfs.backing.dirside import (
    BackingDir,
    close_soon,
    close_written,
    in_thread,
    open_in_thread,
    unlink_quiet,
    write_step,
)
from memfs.backing.mirror import NamespaceMirror
from memfs.backing.ops import ErrorLog, NsKind, NsOp, Retry
from memfs.backing.residency import STEP, Residency
from memfs.backing.surface import BackingStore
from memfs.backing.tracker import ChangeTracker, Dirty
from memfs.errors import FsError
from memfs.meta import NOT_RESIDENT
from memfs.meta.store import ROOT_INO
from memfs.transport import Transport

log = logging.getLogger(__name__)

MAX_BACKOFF = 30.0
#: seconds over which the write-back rate shown by ``memfs status`` is averaged
RATE_WINDOW = 10.0
#: files handed to the workers per scheduling round at most
ROUND = 256


class WriteBack:
    """Schedules dirty files and copies them to DIR."""

    def __init__(
        self, store: BackingStore, transport: Transport, dirside: BackingDir,
        tracker: ChangeTracker, mirror: NamespaceMirror, residency: Residency,
        errors: ErrorLog, *, workers: int, clock: Callable[[], float], settle: float = 0.0,
    ) -> None:
        self.store = store
        self.transport = transport
        self.dirside = dirside
        self.tracker = tracker
        self.mirror = mirror
        self.residency = residency
        self.errors = errors
        self.workers = workers
        self.clock = clock
        #: cluster mode: seconds a write's bytes may take to reach a memory server after
        #: the mds placed it (the mds sees the placement, not the bytes); a copy begun
        #: sooner after a file's last change does not make it clean
        self.settle = settle
        self.forced: set[int] = set()  # files ``memfs flush`` asked for
        self.draining = False
        self.flushed_bytes = 0
        self.flushed_files = 0
        self._rate: collections.deque[tuple[float, int]] = collections.deque()

    def force(self, inos: set[int]) -> None:
        """``memfs flush``: these now, before anything else."""
        for ino in inos:
            self.tracker.dirty[ino].retry_at = 0.0
            self.forced.add(ino)
        self.tracker.wake()

    def rate(self) -> float:
        now = self.clock()
        return sum(n for t, n in self._rate if t >= now - RATE_WINDOW) / RATE_WINDOW

    def queued_files(self) -> int:
        now = self.clock()
        return sum(
            1 for ino, d in self.tracker.dirty.items()
            if not d.busy and (ino in self.forced or self.draining or d.since + self.tracker.delay <= now)
        )

    async def run(self, nursery: trio.Nursery) -> None:
        """Start the workers in *nursery*, then schedule until cancelled."""
        send, recv = trio.open_memory_channel[int](0)
        for _ in range(self.workers):
            nursery.start_soon(self._worker, recv.clone())
        await self._schedule(send)

    # -- the scheduler ---------------------------------------------------------------------

    async def _schedule(self, send: trio.MemorySendChannel[int]) -> None:
        """Hand due files to the workers: forced ones first, then by age of last change.

        A bug in a round is logged and the next round comes a second later: the
        dirty files stay dirty, and the mount must keep draining them.
        """
        if faults.HOLD:
            await trio.sleep_forever()
        while True:
            try:
                await self.schedule_round(send)
            except Exception as exc:
                self.errors.bug("write-back scheduler", exc)
                await trio.sleep(1.0)

    async def schedule_round(self, send: trio.MemorySendChannel[int]) -> None:
        """Hand out what is due now, or wait until something may be."""
        tracker = self.tracker
        now = self.clock()
        urgent = self.draining or tracker.writers_waiting > 0 or tracker.pressing
        due: list[int] = []
        wait = 3600.0
        for ino in list(self.forced):
            d = tracker.dirty.get(ino)
            if d is None:
                self.forced.discard(ino)
            elif not d.busy:
                if d.retry_at > now:
                    wait = min(wait, d.retry_at - now)
                else:
                    due.append(ino)
        for ino, d in tracker.dirty.items():
            if len(due) >= ROUND:
                break
            if d.busy or ino in self.forced:
                continue
            if d.retry_at > now:
                wait = min(wait, d.retry_at - now)
                continue
            ready_at = d.since + tracker.delay
            if urgent or ready_at <= now:
                due.append(ino)
            else:  # ordered by last change: nothing after this one is due either
                wait = min(wait, ready_at - now)
                break
        if not due:
            await tracker.wait_wake(max(wait, 0.01))
            return
        for ino in due:
            d2 = tracker.dirty.get(ino)
            if d2 is None or d2.busy:
                continue
            d2.busy = True
            self.forced.discard(ino)
            await send.send(ino)

    # -- the workers -------------------------------------------------------------------------

    async def _worker(self, recv: trio.MemoryReceiveChannel[int]) -> None:
        buf = self.transport.register(STEP)
        async for ino in recv:
            d = self.tracker.dirty.get(ino)
            if d is None:
                continue
            try:
                await self.flush_one(ino, d, buf)
            except Retry:
                self._backoff(d)
            except FsError as exc:  # pool memory unreadable (dead memory server...)
                path = self.store.path(ino) or b"?"
                self.errors.record(path, "read from the pool", exc)
                self._backoff(d)
            except Exception as exc:  # a bug: log it, keep the data dirty, keep the mount alive
                self.errors.bug(f"write-back of inode {ino}", exc)
                self._backoff(d)
            finally:
                d.busy = False
                self.tracker.wake()

    def _backoff(self, d: Dirty) -> None:
        d.failures += 1
        d.retry_at = self.clock() + min(MAX_BACKOFF, 0.5 * 2 ** min(d.failures, 10))

    async def flush_one(self, ino: int, d: Dirty, buf: memoryview) -> None:
        """Copy *ino*'s current version to DIR and publish it; clean if unchanged."""
        tracker = self.tracker
        v = d.version
        i = self.store.inodes.get(ino)
        if i is None or i.nlink <= 0 or not self.store.paths(ino):
            tracker.clean(ino, v)  # unlinked: nothing to write
            return
        if tracker.excluded(ino):
            tracker.pin(ino, v)
            return
        started = self.clock()
        tmp = await self._copy(ino, v, buf)
        if tmp is None:
            return  # changed while copying: stays dirty, goes round again
        published = False
        try:
            async with self.mirror.lock:
                # Every namespace change first, and nothing reaches DIR before the
                # changes it shows are durable (a crash must not leave DIR ahead of
                # the journal); changes queued while we waited are applied too, so
                # the copy lands at the path the file has now.  No await between
                # the last check and reading that path.
                while True:
                    await self.mirror.apply_all()
                    await self.mirror.recorder.durable()
                    if not self.mirror.ops:
                        break
                if tracker.version(ino) != v:
                    return
                paths = self.store.paths(ino)
                if paths:
                    try:
                        try:
                            await self.mirror.dir_call(self.dirside.publish, tmp, paths, None)
                        except FileNotFoundError:
                            dirs = self._parent_dirs(ino)
                            await self.mirror.dir_call(self.dirside.publish, tmp, paths, dirs)
                    except OSError as exc:
                        self.errors.record(paths[0], "write back", exc)
                        raise Retry() from None
                    published = True
                    if len(paths) == 1:
                        faults.kill_at("kill-mid-publish")
        finally:
            if not published:
                await in_thread(unlink_quiet, tmp)
        if not published:  # it lost its last name meanwhile: nothing to write
            tracker.clean(ino, v)
            return
        self.flushed_files += 1
        self._count_rate(i.size)
        self.errors.clear(paths[0] if paths else b"")
        if started - d.since < self.settle and tracker.version(ino) == v:
            # A write placed just before the copy began may still have been on its
            # way to a memory server: copy once more when that cannot be so.
            d.retry_at = d.since + self.settle
            self.forced.add(ino)
            return
        tracker.clean(ino, v)

    def _where(self, ino: int) -> bytes:
        return self.store.path(ino) or b"(unlinked)"

    async def _copy(self, ino: int, v: int, buf: memoryview) -> bytes | None:
        """Write version *v* of *ino* to a temporary file in DIR; None if it changed meanwhile."""
        version = self.tracker.version
        i = self.store.inodes[ino]
        size, mode, uid, gid = i.size, i.mode, i.uid, i.gid
        times = (i.atime_ns, i.mtime_ns)
        tmp = self.dirside.tmp_name(ino, v)
        if size <= STEP:  # one step: the whole copy in one trip to a worker thread
            extents = self.store.extents(ino, 0, size)
            if not any(e.volume == NOT_RESIDENT for e in extents):
                view = buf[:size]
                for e in extents:
                    if e.volume >= 0:
                        await self.transport.readinto(e.volume, e.voffset, view[e.offset : e.offset + e.length])
                    else:
                        view[e.offset : e.offset + e.length] = bytes(e.length)
                if version(ino) != v:
                    return None
                try:
                    await in_thread(
                        self.dirside.write_whole, tmp, view, size, mode, uid, gid, times
                    )
                except OSError as exc:
                    self.errors.record(self._where(ino), "write back", exc)
                    raise Retry() from None
                return tmp
        try:
            fd = await open_in_thread(self.dirside.create_tmp, tmp)
        except OSError as exc:
            self.errors.record(self._where(ino), "write back", exc)
            raise Retry() from None
        ok = False
        src = -1  # the copy in DIR, for data not in the pool (staged lazily, evicted)
        try:
            off = 0
            while off < size:
                n = min(STEP, size - off)
                if version(ino) != v:
                    return None
                extents = self.store.extents(ino, off, n)
                if not any(e.volume != -1 for e in extents):
                    off += n  # a hole: left sparse, ftruncate gives it its size
                    continue
                if src < 0 and any(e.volume == NOT_RESIDENT for e in extents):
                    src = await self.residency.open_backing(ino, None)
                view = buf[:n]
                old: list[tuple[int, int]] = []
                for e in extents:
                    a, b = e.offset - off, e.offset - off + e.length
                    if e.volume >= 0:
                        await self.transport.readinto(e.volume, e.voffset, view[a:b])
                    elif e.volume == NOT_RESIDENT:
                        old.append((a, b))  # straight from DIR's copy, not via the pool
                    else:
                        view[a:b] = bytes(b - a)
                if version(ino) != v:
                    return None
                try:
                    await in_thread(write_step, fd, view, off, src, old)
                except OSError as exc:
                    self.errors.record(self._where(ino), "write back", exc)
                    raise Retry() from None
                off += n
            try:
                await in_thread(
                    self.dirside.finish_copy, fd, size, mode, uid, gid, times
                )
            except OSError as exc:
                self.errors.record(self._where(ino), "write back", exc)
                raise Retry() from None
            written, fd = fd, -1
            try:
                await close_written(written)
            except OSError as exc:  # a parallel filesystem may report a write error here
                self.errors.record(self._where(ino), "write back", exc)
                raise Retry() from None
            ok = True
            return tmp
        except trio.Cancelled:
            # Shutdown given up: a thread we stopped waiting for may still use these
            # descriptors; closing them could let their numbers name another file.
            fd = src = -1
            raise
        finally:
            if fd >= 0:
                close_soon(fd)
            if src >= 0:
                close_soon(src)
            if not ok:
                await in_thread(unlink_quiet, tmp)

    def _parent_dirs(self, ino: int) -> list[NsOp]:
        """mkdir operations for every directory above *ino*'s names, outermost first
        (to recreate what vanished from DIR, with memfs's modes and owners)."""
        i = self.store.inodes.get(ino)
        if i is None:
            return []
        out: dict[bytes, NsOp] = {}
        for parent in [i.parent, *(p for p, _ in i.links or ())]:
            chain = []
            while parent != ROOT_INO:
                d = self.store.inodes.get(parent)
                path = self.store.path(parent)
                if d is None or path is None:
                    break
                chain.append(NsOp(NsKind.MKDIR, path, mode=d.mode, uid=d.uid, gid=d.gid))
                parent = d.parent
            for op in reversed(chain):
                out.setdefault(op.path, op)
        return list(out.values())

    def _count_rate(self, n: int) -> None:
        now = self.clock()
        self.flushed_bytes += n
        self._rate.append((now, n))
        while self._rate and self._rate[0][0] < now - RATE_WINDOW:
            self._rate.popleft()
