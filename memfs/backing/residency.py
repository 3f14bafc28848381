"""What of each file is in the pool: fetch from DIR, eviction, room for writes.

A file entered from DIR (stage-in at mount, or evicted since) has ``backed``
bytes whose chunks may be missing from the pool; :meth:`Residency.ensure_resident`
fetches what a read or write needs, a STEP at a time, each part claimed just
before it is read so that concurrent readers of other parts fetch those
themselves.  When the pool is full, whole clean files are evicted, least
recently used first (files named by a live stage-in ticket last), after the
clients that cache their chunk maps let go (``before_evict``, cluster mode).
Writers that would take dirty data past the cap wait for write-back.

A full pool answers ENOSPC only when no room is on its way.  One task evicts
at a time, and a task that waited for its turn first tries again (the one
before it may have made room: two evicting at once chose the same victims,
and the loser, finding them gone, gave up).  When nothing can be evicted but
something in flight will make it possible (another fetch installing its
chunks, a transfer ending, write-back cleaning a dirty file), the call waits
for that, for at most ``ROOM_WAIT`` seconds.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import itertools
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import trio

from memfs.backing.dirside import BackingDir, close_soon, in_thread, open_in_thread, pread_full
from memfs.backing.mirror import NamespaceMirror
from memfs.backing.ops import ErrorLog, NsOp, Retry
from memfs.backing.surface import BackingStore
from memfs.backing.tracker import ChangeTracker
from memfs.errors import FsError, SpaceBusy
from memfs.transport import Transport

log = logging.getLogger(__name__)

#: bytes moved per step of a copy or a fetch (a read waits for at most this much)
STEP = 1 << 20
#: how long a call that needs room waits for fetches, transfers or write-back in
#: flight to make some, before ENOSPC (the mds answers its clients "not yet" sooner)
ROOM_WAIT = 30.0
#: waits for room further apart than this are not one stall (see _room_coming)
STALL_GAP = 10.0
T = TypeVar("T")


class Residency:
    """Fetches, eviction and the dirty cap of one pool with a backing directory."""

    def __init__(
        self, store: BackingStore, transport: Transport, dirside: BackingDir,
        mirror: NamespaceMirror, errors: ErrorLog,
    ) -> None:
        self.store = store
        self.transport = transport
        self.dirside = dirside
        self.mirror = mirror
        self.errors = errors
        self.chunk_size = store.chunk_size
        self.tracker: ChangeTracker | None = None  # set by BackedMeta (they refer to each other)
        #: cluster (memfs mds): takes chunk maps of these inodes back from the clients
        #: that cache them (memfs.meta.leases) before eviction frees their chunks
        self.before_evict: Callable[[list[int]], Awaitable[None]] | None = None
        #: cluster: no eviction for now (an mds restarted from its journal: clients of
        #: the run before may still report writes made under write leases, into
        #: chunks an eviction would free; their reports come with their registration)
        self.evictions_held: Callable[[], bool] = lambda: False
        #: before eviction: forget tickets that expired (their files stop being spared)
        self.expire: Callable[[], None] = lambda: None
        #: files with data in the pool, least recently used first (eviction order)
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: files named by live stage-in tickets (-> how many): evicted only as a last resort
        self.kept: collections.Counter[int] = collections.Counter()
        #: files whose chunks a transfer uses right now (memfs.array's run outside this
        #: process, across awaits): never evicted under it
        self.busy: collections.Counter[int] = collections.Counter()
        self._fetching: dict[tuple[int, int], trio.Event] = {}
        self._evicting = trio.Lock()  # one eviction at a time
        self.evictions = 0  # evictions that freed something (a task that waited retries)
        self._settled = trio.Event()  # a fetch or transfer ended: room may be evictable
        self._settles = 0
        #: while calls wait for room: (progress seen, since when, last looked at)
        self._stall: tuple[tuple[int, int, int], float, float] | None = None
        self.fetched_bytes = 0
        self.evicted_bytes = 0

    @contextlib.contextmanager
    def using(self, ino: int) -> Iterator[None]:
        """*ino*'s chunks are in use by a transfer: not evicted until it ends."""
        self.busy[ino] += 1
        try:
            yield
        finally:
            self.busy[ino] -= 1
            if self.busy[ino] <= 0:
                del self.busy[ino]
                self._settle()

    def touch(self, ino: int) -> None:
        lru = self.lru
        if ino in lru:
            lru.move_to_end(ino)
        else:
            lru[ino] = None

    def forget(self, ino: int) -> None:
        self.lru.pop(ino, None)
        self.kept.pop(ino, None)

    def missing_bytes(self, ino: int) -> int:
        i = self.store.inodes.get(ino)
        if i is None or not i.backed:
            return 0
        return min(len(self.store.missing(ino, 0, i.backed)) * self.chunk_size, i.backed)

    # -- room: the dirty cap and a full pool ---------------------------------------------

    async def wait_dirty_room(self, ino: int, offset: int, length: int) -> None:
        """Backpressure: wait while this write would take dirty data past the cap."""
        tracker = self.tracker
        assert tracker is not None
        cs = self.chunk_size
        first, last = offset // cs, (offset + length - 1) // cs
        while True:
            d = tracker.dirty.get(ino)
            new = (last - first + 1) - (sum(1 for k in range(first, last + 1) if k in d.chunks) if d else 0)
            if (not new or not tracker.dirty_chunks
                    or (tracker.dirty_chunks + new) * cs <= tracker.dirty_max):
                return
            if ino in tracker.pinned and tracker.excluded(ino):
                return
            await tracker.wait_cleaned()

    async def with_room(self, fn: Callable[[], Awaitable[T]], protect: int = 0) -> T:
        """Run store call *fn*; on a full pool evict clean data, scrub, and retry.
        *protect*: a file that must keep its pool data (the one being written).
        ENOSPC when nothing can be evicted and nothing in flight will change that,
        or not within ``ROOM_WAIT`` (of this call, or of no progress at all: a
        cluster client asks again every few seconds, each time a new call)."""
        deadline = trio.current_time() + ROOM_WAIT
        busy = evicted = 0
        while True:
            seen = self.evictions
            try:
                return await fn()
            except SpaceBusy:
                busy += 1
                if busy > 64:  # nothing attached that zeroes freed chunks
                    raise FsError(errno.ENOSPC) from None
                await self.store.reclaim()
                continue
            except FsError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if trio.current_time() >= deadline:
                    raise
                async with self._evicting:
                    if self.evictions != seen:
                        continue  # evicted by the task before us: try the room it made
                    # (Evicting helps only if it frees the volume the call needs: at
                    # most 16 rounds, 64 MiB, of other files for one call.)
                    evicted += 1
                    if evicted <= 16 and await self.evict(STEP // self.chunk_size * 4, protect):
                        continue
                if not self._room_coming(protect):
                    raise
            with trio.move_on_at(deadline):
                await self._wait_settled()

    def _progress(self) -> tuple[int, int, int]:
        tracker = self.tracker
        assert tracker is not None
        return (self._settles, self.evictions, tracker.progress)

    def _room_coming(self, protect: int) -> bool:
        """Will something in flight make clean data evictable?  A fetch between its
        reserve and install, a transfer on another file (``using``), a dirty file
        that write-back has not failed on; and not if nothing of the kind has
        happened for ``ROOM_WAIT`` while calls waited for it (write-back stuck in
        a hung DIR, say)."""
        tracker = self.tracker
        assert tracker is not None
        if self.dirside.lost:
            return False  # nothing can be evicted
        if self.evictions_held():
            return True  # until the clients are back, or the grace is over
        # The mirror applying a change fetches what it must keep first, under the
        # lock that write-back's publishing needs: no waiting for write-back then.
        mirror_busy = self.mirror.lock.statistics().owner is trio.lowlevel.current_task()
        now, progress = trio.current_time(), self._progress()
        st = self._stall
        if st is None or st[0] != progress or now - st[2] > STALL_GAP:
            st = (progress, now, now)  # something moved, or nobody waited for a while
        self._stall = (st[0], st[1], now)
        if now - st[1] >= ROOM_WAIT:
            return False
        return (bool(self.store.reserved)
                or any(ino != protect for ino in self.busy)
                or (not mirror_busy
                    and any(ino != protect and not d.failures for ino, d in tracker.dirty.items())))

    def _settle(self) -> None:
        self._settles += 1
        self._settled.set()
        self._settled = trio.Event()

    async def _wait_settled(self) -> None:
        """Until a fetch or transfer ends, or write-back cleans a file (which this
        wait makes urgent, as a writer waiting on the dirty cap does)."""
        tracker = self.tracker
        assert tracker is not None
        async with trio.open_nursery() as nursery:
            async def first(wait: Callable[[], Awaitable[None]]) -> None:
                await wait()
                nursery.cancel_scope.cancel()
            nursery.start_soon(first, self._settled.wait)
            nursery.start_soon(first, tracker.wait_cleaned)
            if self.evictions_held():
                nursery.start_soon(first, functools.partial(trio.sleep, HELD_POLL))

    async def evict(self, want: int, protect: int = 0) -> bool:
        """Evict clean files, least recently used first, until *want* chunks are freed."""
        tracker = self.tracker
        assert tracker is not None
        if self.dirside.lost:
            return False  # DIR is gone: the pool may hold the only copy of everything
        if self.evictions_held():
            return False
        self.expire()  # staged files stop being spared when their ticket ends
        freed = 0
        inodes = self.store.inodes

        # Files just staged in are kept while anything else can go.  The oldest few
        # thousand are almost always enough; the rest only if not.
        def evictable(ino: int, spare_staged: bool) -> bool:
            if not self._clean(ino):
                return False
            return not (ino == protect or (spare_staged and ino in self.kept))

        for spare_staged, start, stop in ((True, 0, 4096), (True, 4096, None), (False, 0, None)):
            if not spare_staged and not self.kept:
                break  # nothing was spared: the first passes saw everything
            victims = []
            need = want - freed
            for ino in list(itertools.islice(self.lru, start, stop)):
                if need <= 0:
                    break
                if evictable(ino, spare_staged):
                    victims.append(ino)
                    need -= len(inodes[ino].chunks or ())
            if victims and self.before_evict is not None:
                # Clients reading these files through cached chunk maps let go first
                # (the chunks are reused as soon as they are scrubbed).
                await self.before_evict(victims)
            for ino in victims:
                if freed >= want:
                    break
                if not evictable(ino, spare_staged):  # changed while the clients answered
                    continue
                n = self.store.evict(ino)
                self.lru.pop(ino, None)
                freed += n
                self.evicted_bytes += n * self.chunk_size
                log.debug("evicted inode %d (%d chunks)", ino, n)
            if freed >= want:
                break
        if freed:
            self.evictions += 1
            await self.store.reclaim()
        return freed > 0

    def _clean(self, ino: int) -> bool:
        """Could *ino*'s pool copy go (its data all in DIR, nothing using it)?"""
        tracker = self.tracker
        assert tracker is not None
        i = self.store.inodes.get(ino)
        if i is None or not i.chunks:
            self.lru.pop(ino, None)
            return False
        return not (ino in tracker.dirty or ino in tracker.pinned or ino in self.busy
                    or i.nlink <= 0 or not stat.S_ISREG(i.mode) or tracker.excluded(ino))

    def evict_clean(self, ino: int) -> bool:
        """Evict *ino* now if it is clean, with no recall (memfs.meta.takeback: its
        memory server restarted blank, and the clients let go of its maps first);
        True if it was.  Its data is then fetched from DIR again when read."""
        if self.dirside.lost or not self._clean(ino):
            return False
        n = self.store.evict(ino)
        self.lru.pop(ino, None)
        self.evicted_bytes += n * self.chunk_size
        return True

    # -- fetch ----------------------------------------------------------------------------

    async def ensure_resident(
        self, ino: int, offset: int, length: int, path: bytes | None = None
    ) -> None:
        """Fetch what ``[offset, offset+length)`` of *ino* needs from DIR; wait for fetches
        others started of the same chunks.  *path*: where in DIR (default: its name now)."""
        while ks := self.store.missing(ino, offset, length):
            mine = [k for k in ks if (ino, k) not in self._fetching]
            if mine:
                try:
                    await self._fetch(ino, mine, path)
                except FsError:
                    if self.store.missing(ino, offset, length):
                        raise
                    return  # fetched by someone else meanwhile (a file being unlinked)
            for k in ks:
                ev = self._fetching.get((ino, k))
                if ev is not None:
                    await ev.wait()

    async def keep(self, op: NsOp) -> None:
        """The mirror's hook: fetch *op*'s ``keep`` inode whole from where DIR has it,
        before *op* removes that copy."""
        i = self.store.inodes.get(op.keep)
        if i is None:
            return
        try:
            await self.ensure_resident(op.keep, 0, i.backed, op.keep_from or op.path)
        except FsError as exc:
            log.warning("inode %d: could not keep its data before %s: %s",
                        op.keep, op.kind.value, exc)

    async def _fetch(self, ino: int, ks: list[int], path: bytes | None = None) -> None:
        """Fetch chunks *ks* of *ino* from DIR: one open of its copy, then a STEP at a
        time, each part claimed just before it is read, so a reader that needs a later
        part meanwhile fetches that part itself instead of waiting for this one."""
        cs = self.chunk_size
        # Open first: that may wait for the namespace lock, whose holder may be
        # fetching this very file (before an unlink): chunks are claimed only after.
        fd = await self.open_backing(ino, path)
        try:
            for run in runs(ks):
                for part in (run[j : j + STEP // cs] for j in range(0, len(run), STEP // cs)):
                    mine = [k for k in part if (ino, k) not in self._fetching]
                    events = {k: trio.Event() for k in mine}
                    for k, ev in events.items():
                        self._fetching[(ino, k)] = ev
                    try:
                        for sub in runs(mine):
                            await self._fetch_run(ino, fd, sub)
                    finally:
                        for k, ev in events.items():
                            del self._fetching[(ino, k)]
                            ev.set()
        finally:
            close_soon(fd)

    async def open_backing(self, ino: int, path: bytes | None) -> int:
        """Open *ino*'s copy in DIR for reading (at *path*, else at its name now)."""
        if path is None:
            # DIR must match the namespace first: a rename may still be queued.
            async with self.mirror.lock:
                try:
                    await self.mirror.apply_all()
                except Retry:
                    pass  # reading may work where writing does not, if no change is in the way
                paths = self.store.paths(ino)
                if not paths:
                    raise FsError(errno.EIO, f"inode {ino}: data only in the backing directory, "
                                             "and the file has no name there any more")
                path = paths[0]
                if self.mirror.touches(path):
                    # A change not applied yet moves what DIR has at that path: reading
                    # it could give another file's bytes.
                    raise FsError(errno.EIO, f"{os.fsdecode(path)}: its data is in the backing "
                                             "directory, which cannot be updated right now")
        try:
            return await open_in_thread(self.dirside.open_read, path)
        except OSError as exc:
            self.errors.record(path, "read", exc)
            full = self.dirside.path(path)
            raise FsError(errno.EIO, f"cannot read {os.fsdecode(full)}: {exc.strerror}") from None

    async def _fetch_run(self, ino: int, fd: int, ks: list[int]) -> None:
        cs = self.chunk_size
        i = self.store.inodes.get(ino)
        if i is None:
            return
        ks = [k for k in ks if k not in (i.chunks or {}) and k * cs < i.backed]
        if not ks:
            return
        if ks[-1] - ks[0] != len(ks) - 1:  # another reader filled a chunk in between
            for run in runs(ks):
                await self._fetch_run(ino, fd, run)
            return
        start = ks[0] * cs
        n = min(len(ks) * cs, i.backed - start)
        cuts = i.cuts
        buf = bytearray(len(ks) * cs)
        try:
            got = await in_thread(pread_full, fd, memoryview(buf)[:n], start)
        except OSError as exc:
            self.errors.record(self.store.path(ino) or b"?", "read", exc)
            raise FsError(errno.EIO, f"cannot read inode {ino} from the backing directory: "
                                     f"{exc.strerror}") from None
        if got < n:  # shrunk behind our back: zeros would be wrong data
            path = self.store.path(ino) or b"(unlinked)"
            short = OSError(errno.EIO, f"the backing copy ends at {start + got}, expected {i.backed} bytes")
            self.errors.record(path, "read", short)
            raise FsError(errno.EIO, f"{os.fsdecode(path)}: {short.strerror}")
        placed = await self.with_room(lambda: self._reserve(ino, ks))
        view = memoryview(buf)
        try:
            for k, vol, voff in placed:
                off = (k - ks[0]) * cs
                await self.transport.write(vol, voff, view[off : off + cs])
        except BaseException:
            for _, vol, voff in placed:
                self.store.unreserve(vol, voff)
            self._settle()
            raise
        if self.store.inodes.get(ino) is not i or i.cuts != cuts:
            # A truncate cut the backing copy short meanwhile, so writes could then fill
            # these chunks without waiting for this fetch, and write-back and eviction
            # could follow: what was read may be old bytes.  (Nothing else rewrites
            # chunks being fetched: writes wait for the fetch.)  The caller's loop
            # fetches what is still missing afresh.
            for _, vol, voff in placed:
                self.store.unreserve(vol, voff)
            self._settle()
            return
        for k, vol, voff in placed:
            self.store.install(ino, k, vol, voff)
        self._settle()
        self.fetched_bytes += n
        self.touch(ino)

    async def _reserve(self, ino: int, ks: list[int]) -> list[tuple[int, int, int]]:
        return self.store.reserve(ino, ks)


#: how often a call waiting for room looks again while evictions are held
HELD_POLL = 0.25


def runs(ks: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted chunk numbers."""
    out: list[list[int]] = []
    for k in sorted(ks):
        if out and out[-1][-1] == k - 1:
            out[-1].append(k)
        else:
            out.append([k])
    return out


