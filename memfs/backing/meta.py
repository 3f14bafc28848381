""":class:`BackedMeta`: the :class:`memfs.meta.Meta` of a pool with a backing directory.

It wraps the namespace store of a pool (embedded, or inside ``memfs mds``) and
a transport to the pool's memory, and keeps DIR in step with it, through the
parts of :mod:`memfs.backing` (see that package's docstring).  The facade
itself only wires them: Meta calls go to the store, except the data path
(``map_read``/``map_write``: fetch what is missing, wait on the dirty cap, make
room by eviction) and the names reserved for our temporary copies.

Cluster mode: the same object runs inside ``memfs mds``; clients see fetches
and backpressure as slower ``map_read``/``map_write`` replies.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import trio

from memfs.backing.dirside import TMP_DIR, BackingDir, in_thread
from memfs.backing.mirror import NamespaceMirror
from memfs.backing.ops import ErrorLog
from memfs.backing.recovery import BackingJournal
from memfs.backing.residency import STEP, Residency
from memfs.backing.status import BackingStatus
from memfs.backing.surface import BackingStore
from memfs.backing.tickets import WALK_STEP, Tickets
from memfs.backing.tracker import EXCLUDE_XATTR, ChangeTracker
from memfs.backing.writeback import WriteBack
from memfs.config import FlushConfig
from memfs.errors import FsError
from memfs.meta import NOT_RESIDENT, Attr, Extent, Meta, SetAttr, StatFs, WritePlan
from memfs.meta.store import ROOT_INO, MetaStore
from memfs.transport import Transport

log = logging.getLogger(__name__)

__all__ = ["STEP", "TMP_DIR", "BackedMeta"]

#: seconds the daemon waits, when it exits, to remove its temporary directory in DIR
CLOSE_TIMEOUT = 5.0


class BackedMeta(Meta):
    """A pool's store plus write-behind, stage-in and eviction against DIR."""

    def __init__(
        self, store: MetaStore, transport: Transport, cfg: FlushConfig, *,
        clock: Callable[[], float] = time.monotonic, settle: float = 0.0,
        wallclock: Callable[[], float] = time.time, recovered: BackingJournal | None = None,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.clock = clock
        self.chunk_size = store.chunk_size
        self.n_volumes = store.n_volumes
        surface: BackingStore = store  # mypy: the store offers what the parts may use
        self.dirside = BackingDir(cfg.backing, fsync=cfg.fsync)
        self.errors = ErrorLog(wallclock)
        self.mirror = NamespaceMirror(self.dirside, self.errors)
        self.residency = Residency(surface, transport, self.dirside, self.mirror, self.errors)
        total, _ = store.space.totals()
        dirty_max = cfg.dirty_max if cfg.dirty_max is not None else total * store.chunk_size // 2
        #: cluster mode with a journal: the state replay rebuilt, and where to record
        self.recovered = recovered
        if recovered is None:
            self.tracker = ChangeTracker(
                surface, dirty_max=dirty_max, delay=cfg.delay, queue=self.mirror.queue,
                touch=self.residency.touch, forget=self.residency.forget, clock=clock,
            )
        else:
            assert recovered.tracker is not None
            self.tracker = recovered.tracker
            self.tracker.connect(queue=self.mirror.queue, touch=self.residency.touch,
                                 forget=self.residency.forget)
            self.tracker.dirty_max, self.tracker.clock = dirty_max, clock
            self.tracker.replaying = False
            self.tracker.recorder = self.mirror.recorder = recovered
            self.mirror.ops = recovered.ops
            self.mirror.queued = len(recovered.ops)
            self.mirror.swap_dir = os.path.join(
                self.dirside.tmp_top, b"journal-" + recovered.journal.fsid.hex().encode())
        self.residency.tracker = self.tracker
        self.mirror.keep = self.residency.keep
        self.writeback = WriteBack(
            surface, transport, self.dirside, self.tracker, self.mirror, self.residency,
            self.errors, workers=cfg.workers, clock=clock, settle=settle,
        )
        self.tickets = Tickets(surface, self.tracker, self.mirror, self.residency,
                               self.writeback, self.errors, clock=clock)
        self.residency.expire = self.tickets.expire

    @property
    def before_evict(self) -> Callable[[list[int]], Awaitable[None]] | None:
        """Cluster: recall the chunk maps clients cache of files about to be evicted."""
        return self.residency.before_evict

    @before_evict.setter
    def before_evict(self, fn: Callable[[list[int]], Awaitable[None]] | None) -> None:
        self.residency.before_evict = fn

    @property
    def dirty_max(self) -> int:
        return self.tracker.dirty_max

    # -- start-up: the backing tree becomes the namespace ---------------------------------

    async def load(self) -> int:
        """Enter DIR's tree (names and attributes; data stays there until read).

        Returns the number of entries.  Leftover temporary copies of a daemon that
        was killed are removed: they were never renamed into place.
        """
        root_st, entries = await trio.to_thread.run_sync(self.dirside.scan, self.mirror.swap_dir)
        store = self.store
        seen: dict[tuple[int, int], int] = {}
        by_path: dict[bytes, int] = {b"": ROOT_INO}
        for rel, st, target in entries:
            parent_rel, _, name = rel.rpartition(b"/")
            parent = by_path.get(parent_rel)
            if parent is None:
                continue
            key = (st.st_dev, st.st_ino)
            try:
                if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1 and key in seen:
                    store.adopt_link(seen[key], parent, name)
                    continue
                a = store.adopt(
                    parent, name, st.st_mode, st.st_uid, st.st_gid,
                    size=st.st_size if stat.S_ISREG(st.st_mode) else 0,
                    atime_ns=st.st_atime_ns, mtime_ns=st.st_mtime_ns,
                    rdev=st.st_rdev, target=target,
                )
            except FsError as exc:
                log.warning("backing entry %r not usable: %s", os.fsdecode(rel), exc)
                continue
            if stat.S_ISDIR(st.st_mode):
                by_path[rel] = a.ino
            elif st.st_nlink > 1:
                seen[key] = a.ino
        # Directory mtimes as in DIR (entering their children touched them).  The
        # mount's root is DIR's root: same owner and mode (a job's directory stays
        # the job's), and a chmod/chown of the root is mirrored onto DIR.
        for rel, st, _ in entries:
            if stat.S_ISDIR(st.st_mode) and rel in by_path:
                store.adopt_attrs(by_path[rel], mtime_ns=st.st_mtime_ns)
        store.adopt_attrs(ROOT_INO, mtime_ns=root_st.st_mtime_ns, mode=root_st.st_mode,
                          uid=root_st.st_uid, gid=root_st.st_gid)
        store.watcher = self.tracker
        log.info("backing directory %s: %d entries visible", self.cfg.backing, len(entries))
        return len(entries)

    async def resume(self) -> int:
        """After an mds restart from its journal: the store already holds DIR's tree
        and the write-back state (:mod:`memfs.backing.recovery`); DIR is not scanned
        again.  Returns the number of files with data in the pool."""
        await trio.to_thread.run_sync(self.dirside.prepare, self.mirror.swap_dir)
        resident = [i.ino for i in self.store.inodes.values() if i.chunks]
        for ino in resident:  # eviction candidates (their order of use is not journaled)
            self.residency.touch(ino)
        self.store.watcher = self.tracker
        log.info("backing directory %s: resumed from the journal: %d files dirty, %d "
                 "namespace changes to apply, %d files in memory", self.cfg.backing,
                 len(self.tracker.dirty), len(self.mirror.ops), len(resident))
        self.tracker.wake()
        self.mirror.wake()
        return len(resident)

    # -- Meta: the data path ------------------------------------------------------------

    def io(self, ino: int, *, here: bool = True) -> contextlib.AbstractContextManager[object]:
        return self.residency.using(ino)

    async def map_read(self, ino: int, offset: int, length: int) -> list[Extent]:
        for _ in range(8):
            extents = await self.store.map_read(ino, offset, length)
            if not any(e.volume == NOT_RESIDENT for e in extents):
                self.residency.touch(ino)
                return extents
            await self.residency.ensure_resident(ino, offset, length)
        raise FsError(errno.EIO, f"inode {ino}: data keeps being evicted (pool too small?)")

    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        cs = self.store.chunk_size
        tracker, residency = self.tracker, self.residency
        span = (offset + length - 1) // cs - offset // cs + 1 if length else 0
        if length and (self.store.missing(ino, offset, length)
                       or (tracker.dirty_chunks + span) * cs > tracker.dirty_max):
            for _ in range(8):
                await residency.ensure_resident(ino, offset, length)
                await residency.wait_dirty_room(ino, offset, length)
                if not self.store.missing(ino, offset, length):
                    break
            else:
                raise FsError(errno.EIO, f"inode {ino}: data keeps being evicted (pool too small?)")
        try:  # the common case: data resident, room below the cap, free chunks
            return await self.store.map_write(ino, offset, length)
        except FsError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EAGAIN):
                raise

        async def now() -> WritePlan:
            # Another task may have evicted this file while we waited for room.
            await residency.ensure_resident(ino, offset, length)
            return await self.store.map_write(ino, offset, length)

        return await residency.with_room(now, protect=ino)

    def ahead_room(self, offset: int, length: int, ahead: int) -> int:
        """Space ahead only as far as the dirty cap has room beside the write itself:
        the writer fills it without asking, so it counts as dirty from when it is
        given (:meth:`MetaStore.allocate_ahead`), as a map_write's chunks do before
        their bytes land."""
        cs, tracker = self.store.chunk_size, self.tracker
        span = (offset + length - 1) // cs - offset // cs + 1 if length else 0
        return max(0, min(ahead, (tracker.dirty_max // cs - tracker.dirty_chunks - span) * cs))

    async def allocate_ahead(
        self, ino: int, offset: int, length: int, ahead: int
    ) -> tuple[WritePlan, Attr]:
        """:meth:`map_write` (fetch, the dirty cap, room), then space ahead if the file
        has nothing in DIR past it (best effort, as without DIR)."""
        plan = await self.map_write(ino, offset, length)
        # No await from here: the chunks just mapped are still there.  (Length 0 too:
        # the journal's replay gives the space ahead the record names.)
        if ahead > 0:
            return await self.store.allocate_ahead(ino, offset, length, ahead)
        return plan, await self.store.getattr(ino)

    async def truncate(self, ino: int, size: int) -> list[tuple[int, int, int]]:
        i = self.store.inodes.get(ino)
        if i is not None and i.backed and size and size % self.store.chunk_size:
            # The chunk holding the new EOF keeps its head: fetch it so it is not lost.
            await self.residency.ensure_resident(ino, size - 1, 1)
        return await self.store.truncate(ino, size)

    async def seek(self, ino: int, offset: int, whence: int) -> int:
        # (What is only in DIR counts as data: nothing is fetched to look.)
        return await self.store.seek(ino, offset, whence)

    async def punch(self, ino: int, offset: int, length: int) -> list[tuple[int, int, int]]:
        i = self.store.inodes.get(ino)
        if i is None or i.chunks is None or length <= 0 or not 0 <= offset < i.backed:
            return await self.store.punch(ino, offset, length)
        end = min(offset + length, i.size)
        with self.residency.using(ino):  # not evicted meanwhile: ``backed`` stays
            placed = await self._hole_ready(ino, offset, end)
            # No await from here to the punch: it zeroes what it finds resident now.
            try:
                self.store.placement.check_sealed(i, self.store.placement.punch_plan(i, offset, end)[1])
            except BaseException:
                for _, vol, voff in placed:
                    self.store.unreserve(vol, voff)
                raise
            for k, vol, voff in placed:
                self.store.install(ino, k, vol, voff)
            return await self.store.punch(ino, offset, length)

    async def _hole_ready(self, ino: int, offset: int, end: int) -> list[tuple[int, int, int]]:
        """Below ``backed`` a missing chunk reads DIR's copy (``Placement.punch``).  The
        chunks at the hole's edges keep bytes outside it: fetched.  Inside it a
        missing chunk needs a clean one (zeros, counted dirty until written back),
        unless the hole reaches ``backed``, which the punch then lowers instead:
        returned reserved, for the caller to install with the punch."""
        cs, store = self.chunk_size, self.store
        i = store.inodes[ino]
        chunks = i.chunks
        assert chunks is not None
        edges = [k for k in {offset // cs, (end - 1) // cs}
                 if k * cs < offset or ((k + 1) * cs > end and end < i.size)]
        for _ in range(8):
            for k in edges:
                await self.residency.ensure_resident(ino, k * cs, 1)
            if not any(store.missing(ino, k * cs, 1) for k in edges):
                break
        else:
            raise FsError(errno.EIO, f"inode {ino}: data keeps being evicted (pool too small?)")
        backed = store.placement.backed_after(i, offset, end)
        if not (ks := [k for k in range(-(-offset // cs), end // cs)
                       if k * cs < backed and k not in chunks]):
            return []
        span = (ks[-1] - ks[0] + 1) * cs
        if span <= self.tracker.dirty_max:  # (a hole larger than the cap goes past it)
            await self.residency.wait_dirty_room(ino, ks[0] * cs, span)

        async def take() -> list[tuple[int, int, int]]:
            # (The edges stay: the file is held; a fetch by a reader may fill some.)
            return store.reserve(ino, [k for k in ks if k not in chunks])

        return await self.residency.with_room(take, protect=ino)

    # -- Meta: everything else goes straight to the store ---------------------------------

    async def lookup(self, parent: int, name: bytes) -> Attr:
        return await self.store.lookup(parent, name)

    async def find(self, parent: int, name: bytes) -> Attr | None:
        return await self.store.find(parent, name)

    async def getattr(self, ino: int) -> Attr:
        return await self.store.getattr(ino)

    async def setattr(self, ino: int, changes: SetAttr) -> Attr:
        return await self.store.setattr(ino, changes)

    async def drop_privileges(self, ino: int, set_ids: bool) -> bool:
        return await self.store.drop_privileges(ino, set_ids)

    @staticmethod
    def _check_reserved(parent: int, name: bytes) -> None:
        # DIR/.memfs-tmp holds our temporary copies; a file of that name would be
        # written back into it and removed at the next mount.
        if parent == ROOT_INO and name == TMP_DIR:
            raise FsError(errno.EPERM, f"{TMP_DIR.decode()} is reserved in a mount with a backing directory")

    async def mknod(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int,
        rdev: int = 0, target: bytes | None = None,
    ) -> Attr:
        self._check_reserved(parent, name)
        return await self.store.mknod(parent, name, mode, uid, gid, rdev, target)

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        self._check_reserved(parent, name)
        return await self.store.link(ino, parent, name)

    async def unlink(self, parent: int, name: bytes) -> None:
        await self.store.unlink(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self.store.rmdir(parent, name)

    async def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        self._check_reserved(new_parent, new_name)
        await self.store.rename(parent, name, new_parent, new_name, flags)

    async def readlink(self, ino: int) -> bytes:
        return await self.store.readlink(ino)

    async def readdir(self, ino: int) -> list[tuple[bytes, int]]:
        return await self.store.readdir(ino)

    async def open(self, ino: int) -> Attr:
        return await self.store.open(ino)

    async def release(self, ino: int) -> None:
        await self.store.release(ino)

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self.store.getxattr(ino, name)

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        await self.store.setxattr(ino, name, value)
        if name == EXCLUDE_XATTR:
            self.tracker.unpin()  # set to something other than "off": no longer excluded
            self.tracker.wake()  # dirty files below may now be pinned

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self.store.listxattr(ino)

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self.store.removexattr(ino, name)
        if name == EXCLUDE_XATTR:
            self.tracker.unpin()

    async def statfs(self) -> StatFs:
        return await self.store.statfs()

    async def reclaim(self) -> None:
        await self.store.reclaim()

    async def aclose(self) -> None:
        await self.store.aclose()

    # -- the background work ----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write back, apply namespace operations and stage in, until cancelled."""
        async with trio.open_nursery() as nursery:
            for _ in range(self.cfg.workers):
                nursery.start_soon(self.tickets.stager)
            nursery.start_soon(self.mirror.run)
            task_status.started()
            await self.writeback.run(nursery)

    @property
    def pending(self) -> tuple[int, int]:
        """(files, bytes) not yet written back, plus queued namespace operations as files."""
        return (len(self.tracker.dirty) + len(self.mirror.ops),
                self.tracker.dirty_chunks * self.store.chunk_size)

    async def drain(self, give_up_on: AsyncIterable[object] | None = None) -> None:
        """Write everything back now (the mount is going away); returns when clean,
        or at the first item of *give_up_on* (a signal), logging what is lost."""
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                if give_up_on is not None:

                    async def give_up() -> None:
                        async for _ in give_up_on:
                            files, nbytes = self.pending
                            log.error("exiting without writing back %d MiB (%d files): asked to",
                                      nbytes >> 20, files)
                            scope.cancel()

                    nursery.start_soon(give_up)
                await self._drain()
                nursery.cancel_scope.cancel()

    async def _drain(self) -> None:
        tracker, mirror = self.tracker, self.mirror
        self.writeback.draining = True
        tracker.wake()
        started = self.clock()
        said = retried = 0.0
        while tracker.dirty or mirror.ops:
            now = self.clock()
            if now - started > 2 and now - said >= 10:
                files, nbytes = self.pending
                log.info("writing back %d MiB (%d files) to %s before exit",
                         nbytes >> 20, files, self.cfg.backing)
                said = now
            for d in tracker.dirty.values():
                d.retry_at = min(d.retry_at, now + 2.0)  # keep retrying, but not wildly
            tracker.wake()
            mirror.wake()
            if now - retried >= 2:
                mirror.retry_now()
                retried = now
            await trio.sleep(0.05)
        log.info("everything written back to %s", self.cfg.backing)
        if tracker.pinned:
            inodes = self.store.inodes
            nbytes = sum(len(i.chunks or ()) for x in tracker.pinned if (i := inodes.get(x)))
            log.warning("%d files (%d MiB) under user.memfs.flush=off trees were not written "
                        "back (stage-out archives them)", len(tracker.pinned),
                        math.ceil(nbytes * self.store.chunk_size / (1 << 20)))

    async def close(self, give_up_after: float = CLOSE_TIMEOUT) -> None:
        """Remove our temporary directory (and DIR/.memfs-tmp if no one else uses it).
        Bounded: the daemon must exit even when DIR hangs (a parallel filesystem
        whose servers are gone); the next start removes what is left.  (Tests on an
        autojump clock pass ``math.inf``: virtual time jumps past any deadline while
        a worker thread runs.)"""
        with trio.move_on_after(give_up_after):
            await in_thread(self.dirside.close, self.mirror.swap_dir)
            return
        log.warning("backing directory %s does not answer: leaving %s behind",
                    self.cfg.backing, os.fsdecode(self.dirside.tmp))

    # -- control commands --------------------------------------------------------------------

    async def control(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        tickets = self.tickets
        tickets.expire()
        if op == "status":
            return (await self.status()).to_json()
        if op in ("flush", "stage_in"):
            paths = args.get("paths", [])
            if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
                raise FsError(errno.EINVAL, "paths must be a list of strings")
            roots = [tickets.resolve(p) for p in paths] or [ROOT_INO]
            tid = await (tickets.flush(roots) if op == "flush" else tickets.stage_in(roots))
            return {"ticket": tid}
        if op == "progress":
            return tickets.progress(args.get("ticket")).to_json()
        raise FsError(errno.ENOSYS, f"unknown command {op!r}")

    async def status(self) -> BackingStatus:
        """The numbers ``memfs status`` shows.  The walk over every inode lets other
        tasks (FUSE requests, client calls) run every WALK_STEP inodes: a big tree
        must not stall them; the counts are those of a moment, roughly."""
        s = self.store
        cs = s.chunk_size
        total, free = s.space.totals()
        tracker = self.tracker
        resident = evicted = pinned_chunks = 0
        # Changed files in excluded trees are dirty until write-back looks at them
        # (after the flush delay) and pins them: they are shown as pinned at once,
        # since they will not be written back (memfs umount warns of them).
        excluded = tracker.exclusion()
        excluded_files = excluded_dirty = 0
        for n, i in enumerate(list(s.inodes.values())):
            if n % WALK_STEP == WALK_STEP - 1:
                await trio.lowlevel.checkpoint()
            if i.chunks is None or i.ino not in s.inodes:
                continue
            if i.backed and len(i.chunks) * cs < i.backed and s.missing(i.ino, 0, i.backed):
                evicted += 1
            else:
                resident += 1
            if i.ino in tracker.pinned:
                pinned_chunks += len(i.chunks)
            elif (d := tracker.dirty.get(i.ino)) is not None and excluded(i.ino):
                pinned_chunks += len(i.chunks)
                excluded_files += 1
                excluded_dirty += len(d.chunks)
        staging_files, staging_bytes = await self.tickets.staging()
        wb = self.writeback
        return BackingStatus(
            backing=self.cfg.backing,
            capacity=total * cs,
            used=(total - free) * cs,
            dirty_bytes=max(0, tracker.dirty_chunks - excluded_dirty) * cs,
            dirty_files=max(0, len(tracker.dirty) - excluded_files),
            dirty_max=tracker.dirty_max,
            pinned_bytes=pinned_chunks * cs,
            pinned_files=len(tracker.pinned) + excluded_files,
            queued_files=wb.queued_files(),
            flushing_files=sum(1 for d in tracker.dirty.values() if d.busy),
            namespace_ops=len(self.mirror.ops),
            flush_rate=wb.rate(),
            flushed_bytes=wb.flushed_bytes,
            flushed_files=wb.flushed_files,
            resident_files=resident,
            evicted_files=evicted,
            evicted_bytes_total=self.residency.evicted_bytes,
            fetched_bytes=self.residency.fetched_bytes,
            staging_files=staging_files,
            staging_bytes=staging_bytes,
            writers_waiting=tracker.writers_waiting,
            draining=wb.draining,
            errors=tuple(self.errors.entries()),
            flush_delay=self.cfg.delay,
            workers=self.cfg.workers,
        )
