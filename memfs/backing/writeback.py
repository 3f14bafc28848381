"""Write-back: the scheduler and workers that copy versions of files to DIR.

A worker copies the file's current version to a temporary file in DIR
(:meth:`memfs.backing.dirside.BackingDir.tmp_name`), fsyncs it, and renames it
into place under the mirror's lock, after every earlier namespace operation.  A
copy whose version moved on while it was written is thrown away and made again,
never published, so DIR only ever holds whole versions.  Files are due
``delay`` seconds after their last change, at once when ``memfs flush`` asks
(*forced*), when dirty data passes half the cap, when writers wait on the cap,
and while draining.  Small files go to a worker in batches (:data:`BATCH`): each
is still written, fsynced and renamed on its own, but a batch makes one trip to
a DIR thread to be written and one, under the mirror's lock, to be published.  A failure keeps the file dirty and retries it with
exponential back-off; a bug in a round or a worker is logged and shown by
``memfs status`` and the work goes on.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

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
#: small files (together at most STEP bytes) handed to a worker at once.  Measured
#: (20,000 files of 16 KiB): one file per trip, the hand-offs between the trio
#: thread and DIR's threads took most of the daemon's own CPU per file
BATCH = 32


#: cluster mode: recalls of a file's writers before a copy that writers wait for
GLIMPSES = 3


@dataclass(eq=False)
class _SmallCopy:
    """One file of a batch: version *v* of *ino*, read into *view*, bound for *tmp*."""

    ino: int
    d: Dirty
    v: int
    started: float
    landed: bool  # WriteBack.landed when v was taken
    tmp: bytes
    view: memoryview
    mode: int
    uid: int
    gid: int
    times: tuple[int, int]


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
        #: cluster mode: has every write placed in this file so far landed (no writer
        #: without a write lease that has not confirmed its bytes; a lease's holder
        #: reports its writes once they landed, which makes the file dirty again)?  A
        #: copy begun then is the file's content, however soon after its last change.
        self.landed: Callable[[int], bool] = lambda ino: False
        #: cluster mode: have this file's writers without a write lease confirm their
        #: bytes (a recall, given up on after a while) before a copy that writers wait for
        self.glimpse: Callable[[int], Awaitable[None]] | None = None
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
        send, recv = trio.open_memory_channel[list[int]](0)
        for _ in range(self.workers):
            nursery.start_soon(self._worker, recv.clone())
        await self._schedule(send)

    # -- the scheduler ---------------------------------------------------------------------

    async def _schedule(self, send: trio.MemorySendChannel[list[int]]) -> None:
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

    async def schedule_round(self, send: trio.MemorySendChannel[list[int]]) -> None:
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
        batch: list[int] = []
        room = STEP
        for ino in due:
            d2 = tracker.dirty.get(ino)
            if d2 is None or d2.busy:
                continue
            d2.busy = True
            self.forced.discard(ino)
            i = self.store.inodes.get(ino)
            size = i.size if i is not None else 0
            if size > STEP // 4:
                await send.send([ino])  # large: a worker of its own
                continue
            if size > room or len(batch) == BATCH:
                await send.send(batch)
                batch, room = [], STEP
            batch.append(ino)
            room -= size
        if batch:
            await send.send(batch)

    # -- the workers -------------------------------------------------------------------------

    async def _worker(self, recv: trio.MemoryReceiveChannel[list[int]]) -> None:
        buf = self.transport.register(STEP)
        async for inos in recv:
            if len(inos) > 1:
                await self._batch(inos, buf)
                continue
            d = self.tracker.dirty.get(inos[0])
            if d is not None:
                await self._worker_one(inos[0], d, buf)

    async def _worker_one(self, ino: int, d: Dirty, buf: memoryview) -> None:
        try:
            await self.flush_one(ino, d, buf)
        except Retry:
            self._backoff(d)
        except FsError as exc:  # pool memory unreadable (dead memory server...)
            self._unreadable(ino, exc)
            self._backoff(d)
        except Exception as exc:  # a bug: log it, keep the data dirty, keep the mount alive
            self.errors.bug(f"write-back of inode {ino}", exc)
            self._backoff(d)
        finally:
            d.busy = False
            self.tracker.wake()

    def _unreadable(self, ino: int, exc: FsError) -> None:
        self.errors.record(self.store.path(ino) or b"?", "read from the pool", exc)

    def _backoff(self, d: Dirty) -> None:
        d.failures += 1
        d.retry_at = self.clock() + min(MAX_BACKOFF, 0.5 * 2 ** min(d.failures, 10))

    def _nothing_to_copy(self, ino: int, v: int) -> bool:
        """Unlinked (clean now) or excluded from write-back (pinned): no copy to make."""
        i = self.store.inodes.get(ino)
        if i is None or i.nlink <= 0 or not self.store.paths(ino):
            self.tracker.clean(ino, v)  # unlinked: nothing to write
            return True
        if self.tracker.excluded(ino):
            self.tracker.pin(ino, v)
            return True
        return False

    async def _namespace_first(self) -> None:
        """Every namespace change first, and nothing reaches DIR before the changes it
        shows are durable (a crash must not leave DIR ahead of the journal); changes
        queued while we waited are applied too, so a copy lands at the path its file
        has now.  Hold the mirror's lock; no await between this and reading paths."""
        while True:
            await self.mirror.apply_all()
            await self.mirror.recorder.durable()
            if not self.mirror.ops:
                break

    def _published(self, ino: int, d: Dirty, v: int, started: float, landed: bool, size: int,
                   path: bytes) -> None:
        """Version *v* of *ino* is in DIR: clean, unless a write may still be on its way
        (*landed*: none could be when the copy began)."""
        self.flushed_files += 1
        self._count_rate(size)
        self.errors.clear(path)
        if not landed and started - d.since < self.settle and self.tracker.version(ino) == v:
            # A write placed just before the copy began may still have been on its
            # way to a memory server: copy once more when that cannot be so.
            d.retry_at = d.since + self.settle
            self.forced.add(ino)
            return
        self.tracker.clean(ino, v)

    async def flush_one(self, ino: int, d: Dirty, buf: memoryview) -> None:
        """Copy *ino*'s current version to DIR and publish it; clean if unchanged."""
        tracker = self.tracker
        for _ in range(GLIMPSES):
            if (self.glimpse is None or not self._awaited() or self.landed(ino)
                    or self.clock() - d.since >= self.settle):
                break
            # Writers wait for room: rather than the settle time, ask this file's
            # writers for their bytes (each answers once they have landed; a writer
            # given room meanwhile, by the end of its lease, is asked again).
            await self.glimpse(ino)
        v = d.version
        landed = self.landed(ino)  # of every write in version v (no await since)
        if self._nothing_to_copy(ino, v):
            return
        i = self.store.inodes[ino]
        started = self.clock()
        tmp = await self._copy(ino, v, buf)
        if tmp is None:
            return  # changed while copying: stays dirty, goes round again
        published = False
        try:
            async with self.mirror.lock:
                await self._namespace_first()
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
        self._published(ino, d, v, started, landed, i.size, paths[0])

    def _awaited(self) -> bool:
        """Is someone waiting for write-back now (writers at the dirty cap, room for
        a fetch or a write, the daemon's exit)?"""
        return self.draining or self.tracker.writers_waiting > 0 or self.tracker.pressing

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
            view = buf[:size]
            got = await self._read_whole(ino, v, view)
            if got is not None:
                if not got:
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
                self.tracker.progress += 1
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

    async def _read_whole(self, ino: int, v: int, view: memoryview) -> bool | None:
        """Read all of a small file (``len(view)`` bytes) from the pool into *view*: True;
        False if it changed meanwhile; None if some of it is only in DIR."""
        extents = self.store.extents(ino, 0, len(view))
        if any(e.volume == NOT_RESIDENT for e in extents):
            return None
        for e in extents:
            if e.volume >= 0:
                await self.transport.readinto(e.volume, e.voffset, view[e.offset : e.offset + e.length])
            else:
                view[e.offset : e.offset + e.length] = bytes(e.length)
        return self.tracker.version(ino) == v

    async def _batch(self, inos: list[int], buf: memoryview) -> None:
        """Write back several small files: each as :meth:`flush_one` would, but the
        copies are written in one trip to a DIR thread and published in one more.
        A file that does not fit (grown, not all in the pool) goes on its own after."""
        copies: list[_SmallCopy] = []
        alone: list[int] = []
        held = [(ino, d) for ino in inos if (d := self.tracker.dirty.get(ino)) is not None]
        try:
            used = 0
            for ino, d in held:
                v = d.version
                if self._nothing_to_copy(ino, v):
                    continue
                i = self.store.inodes[ino]
                if i.size > len(buf) - used:
                    alone.append(ino)
                    continue
                c = _SmallCopy(ino, d, v, self.clock(), self.landed(ino),
                               self.dirside.tmp_name(ino, v), buf[used : used + i.size],
                               i.mode, i.uid, i.gid, (i.atime_ns, i.mtime_ns))
                try:
                    got = await self._read_whole(ino, v, c.view)
                except FsError as exc:
                    self._unreadable(ino, exc)
                    self._backoff(d)
                    continue
                if got is None:
                    alone.append(ino)
                elif got:
                    used += len(c.view)
                    copies.append(c)
            if copies:
                await self._write_and_publish(copies)
        except Retry:  # DIR refused a namespace change that must come first
            for _ino, d in held:
                self._backoff(d)
        except Exception as exc:  # a bug: as in _worker_one, for every file of the batch
            self.errors.bug(f"write-back of {len(inos)} small files", exc)
            for _ino, d in held:
                self._backoff(d)
        finally:
            for ino, d in held:
                if ino not in alone:
                    d.busy = False
            self.tracker.wake()
        for ino in alone:
            d = self.tracker.dirty.get(ino)
            if d is not None:
                await self._worker_one(ino, d, buf)

    async def _write_and_publish(self, copies: list[_SmallCopy]) -> None:
        """The batch's copies to temporary files (one DIR thread trip), then into place."""
        def unlink_written(results: list[OSError | None]) -> None:
            for c, r in zip(copies, results, strict=True):
                if r is None:
                    unlink_quiet(c.tmp)

        items = [(c.tmp, c.view, c.mode, c.uid, c.gid, c.times) for c in copies]
        results = await in_thread(self.dirside.write_each, items, on_late=unlink_written)
        written: list[_SmallCopy] = []
        for c, r in zip(copies, results, strict=True):
            if r is None:
                written.append(c)
            else:
                self.errors.record(self._where(c.ino), "write back", r)
                self._backoff(c.d)
        if not written:
            return
        published: list[tuple[_SmallCopy, bytes]] = []
        unnamed: list[_SmallCopy] = []
        try:
            async with self.mirror.lock:
                await self._namespace_first()
                todo: list[tuple[_SmallCopy, list[bytes]]] = []
                for c in written:
                    if self.tracker.version(c.ino) != c.v:
                        continue  # changed since: stays dirty, goes round again
                    paths = self.store.paths(c.ino)
                    if paths:
                        todo.append((c, paths))
                    else:
                        unnamed.append(c)  # lost its last name: nothing to write
                if todo:
                    pairs = [(c.tmp, paths) for c, paths in todo]
                    outcome = await self.mirror.dir_call(self.dirside.publish_each, pairs)
                    for (c, paths), r in zip(todo, outcome, strict=True):
                        if isinstance(r, FileNotFoundError):
                            try:
                                await self.mirror.dir_call(self.dirside.publish, c.tmp, paths,
                                                           self._parent_dirs(c.ino))
                                r = None
                            except OSError as exc:
                                r = exc
                        if r is None:
                            published.append((c, paths[0]))
                        else:
                            self.errors.record(paths[0], "write back", r)
                            self._backoff(c.d)
                    if published:
                        faults.kill_at("kill-mid-publish")
        finally:
            done = {id(c) for c, _p in published}
            left = [c.tmp for c in written if id(c) not in done]
            if left:
                await in_thread(_unlink_all, left)
        for c in unnamed:
            self.tracker.clean(c.ino, c.v)
        for c, path in published:
            self._published(c.ino, c.d, c.v, c.started, c.landed, len(c.view), path)

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


def _unlink_all(paths: list[bytes]) -> None:
    for p in paths:
        unlink_quiet(p)
