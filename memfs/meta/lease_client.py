"""The client half of leases (see :mod:`memfs.meta.leases`): answering recalls,
noticing a lost lease, sending sizes written under write leases.

:class:`LeaseKeeper` works on the :class:`~memfs.meta.cache.ClientCache` that
:class:`~memfs.meta.remote.RemoteMeta` consults on every call; the remote client
owns the connection and hands RECALL frames here (from its reader task, so
nothing here may wait in :meth:`LeaseKeeper.on_recall`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import trio

from memfs import wire
from memfs.errors import FsError
from memfs.meta import Attr
from memfs.meta.cache import ClientCache, FileState
from memfs.meta.creates import AsyncCreates
from memfs.meta.leases import items_from_wire

log = logging.getLogger(__name__)

#: a recall is answered within this, whatever the kernel does (the server waits 2 s by
#: default; a client answers within 60% of what the server says it waits)
RECALL_ANSWER = 1.5
#: sizes written under a write lease reach the server within about this
SETTLE_DELAY = 0.05

Invalidator = Callable[[list[int]], Awaitable[None]]


class KernelHooks(Protocol):
    """What the FUSE layer set on the :class:`~memfs.meta.Meta` (both None: no kernel)."""

    invalidator: Invalidator | None
    names_invalidator: Callable[[], None] | None

    def write_lost(self, inos: list[int]) -> None:
        """The server refused our sizes of *inos*: their writers must hear EIO."""


class RecallChannel(Protocol):
    """Where a recall's answer goes (the connection it came on)."""

    def send_recalled(self, rid: int, payload: bytes) -> None: ...

    def flush_held(self) -> None:
        """Send the calls held for a batch now."""

    async def delivered(self) -> bool:
        """True once the server has read everything sent before (a reply came after)."""
        ...


def _seen(a: Attr) -> tuple[int, ...]:
    """What the kernel keeps of *a* (atime aside: the server moves it on reads)."""
    return (a.size, a.mtime_ns, a.ctime_ns, a.mode, a.nlink, a.uid, a.gid)


class LeaseKeeper:
    """See the module docstring.  ``tasks`` (a nursery) must be set before recalls come."""

    def __init__(self, cache: ClientCache, call: Callable[..., Awaitable[Any]], kernel: KernelHooks,
                 creates: AsyncCreates | None = None) -> None:
        self.cache = cache
        #: creates made under create leases, not answered yet (memfs.meta.creates)
        self.creates = creates
        #: RemoteMeta._call: how ``settle`` reaches the server
        self.call = call
        #: the FUSE layer's kernel-cache invalidation, if any (looked up when needed)
        self.kernel = kernel
        self.tasks: trio.Nursery | None = None
        #: ino -> set once the recall answer that carried its size is known delivered
        self.answering: dict[int, trio.Event] = {}
        #: recalls being answered: each one's end -> [answered?, its connection]
        self.recalls_open: dict[trio.Event, list[Any]] = {}
        #: ino -> set once our report that ends its write lease (a close's) is over:
        #: a call that may be granted the lease again waits for it (the server would
        #: take that late report as the end of the new lease, and free its space ahead)
        self.ending: dict[int, trio.Event] = {}
        #: inodes we truncated while such a report was on its way (see :meth:`truncated`)
        self._cut_while_ending: set[int] = set()
        #: inodes this node is truncating -> set once that is over (RemoteMeta.truncate:
        #: maps of the file, and a close's size report, wait for it)
        self.truncating: dict[int, trio.Event] = {}
        #: ino -> reports of it taken and not yet answered (see :meth:`reports_sent`)
        self._reporting: dict[int, int] = {}
        #: ino -> set when its last report under way is answered
        self._reports_over: dict[int, trio.Event] = {}
        #: inodes we truncated while reports or recall answers of them were on their way
        self._answers_cut: set[int] = set()
        #: ino -> (setattrs of its mtime under way, set when the last is over)
        self._setting_mtime: dict[int, tuple[int, trio.Event]] = {}
        #: a recall is answered within this (below the server's --recall-timeout)
        self.answer_within = RECALL_ANSWER
        self.dirty_wake = trio.Event()
        #: until the bytes of writes made so far to an inode have landed (posted
        #: writes answered): passed before a size is reported (Meta.order_sizes_after)
        self.barrier: Callable[[int], Awaitable[None]] | None = None

    def server_patience(self, recall_timeout: float) -> None:
        """The server evicts a client that takes longer than *recall_timeout* to answer."""
        if recall_timeout:
            self.answer_within = min(RECALL_ANSWER, recall_timeout * 0.6)

    def on_recall(self, conn: RecallChannel, rid: int, payload: bytes) -> None:
        """A RECALL frame (called by the connection's reader: must not wait)."""
        items = items_from_wire(wire.decode(payload))
        cache = self.cache
        settles: list[list[int]] = []
        told: list[tuple[int, tuple[int, int]]] = []
        inos: list[int] = []
        names_changed = False
        # A create lease taken back with no names changed anywhere (another session
        # reads the directory, or changes its attributes) leaves its names right; with
        # names changed elsewhere in the same change not (an rmdir or a rename over it
        # by an mds that does not say b"." for a directory that goes).
        renamed = any(names for _ino, names, _revoke in items)
        created_in: list[int] = []
        done = trio.Event()
        for ino, names, revoke in items:
            names_changed = names_changed or (bool(names) and cache.kernel_names.any_of(ino, names))
            if cache.creators.pop(ino, None) is not None or (
                    self.creates is not None and self.creates.pending_under(ino)):
                # Our create lease ends (or ended, and what we made under it has not
                # been answered): no more creates here without asking, and the answer
                # waits for those made (the caller must see them).
                created_in.append(ino)
            if revoke:
                a = cache.attrs.get(ino)
                span = cache.end_span(ino)  # the lease ends with this answer
                took = cache.take_write(ino)
                if took is not None and ino in self._setting_mtime:
                    took = (took[0], 0)  # (see setting_mtime)
                if took is not None:
                    settles.append([ino, *took, *span])
                    # Ours until the server is known to have it (see _finish_recall).
                    cache.answered[ino] = took
                    self.answering[ino] = done
                    told.append((ino, took))
                elif (prior := cache.answered.get(ino)) is not None:
                    # An answer of ours on its way carries our writes' size: this one
                    # says it too, for the server ends our lease with whichever answer
                    # it reads first, and ignores the other.
                    settles.append([ino, prior[0], 0 if ino in self._setting_mtime else prior[1],
                                    *span])
                elif a is not None:
                    settles.append([ino, a.size, 0 if ino in self._setting_mtime else a.mtime_ns,
                                    *span])
            if b"." in names:
                cache.drop(ino)  # (the directory itself went: rmdir, renamed over)
            elif (names or (revoke and not renamed)) and ino in cache.dirs:
                # A directory: the names changed go; a create lease taken back changes
                # none (the creates made under it are answered before our answer).
                cache.drop_names(ino, names)
            else:
                cache.drop(ino)
            inos.append(ino)
        if names_changed:
            self.forget_kernel_names()
        for entry in settles:  # reports too, until sent (see reports_sent)
            self._reporting[entry[0]] = self._reporting.get(entry[0], 0) + 1
        assert self.tasks is not None
        ended = trio.Event()
        self.recalls_open[ended] = [False, conn]
        self.tasks.start_soon(self._finish_recall, conn, rid, inos, settles, told, done, created_in,
                              ended)

    async def _finish_recall(
        self, conn: RecallChannel, rid: int, inos: list[int], settles: list[list[int]],
        told: list[tuple[int, tuple[int, int]]], done: trio.Event, created_in: list[int],
        ended: trio.Event,
    ) -> None:
        try:
            answered = await self._answer_recall(conn, rid, inos, settles, told, done, created_in)
            self.recalls_open[ended][0] = answered
        finally:
            for entry in settles:
                self._report_over(entry[0])
            del self.recalls_open[ended]
            ended.set()

    def open_recalls(self) -> list[tuple[trio.Event, list[Any]]]:
        """The recalls received so far and not yet answered (for :meth:`after_recalls`)."""
        return list(self.recalls_open.items())

    @staticmethod
    async def after_recalls(pending: list[tuple[trio.Event, list[Any]]]) -> bool:
        """Until the recalls *pending* (:meth:`open_recalls`) have been answered (the
        transfers under the maps they took have ended) or given up on; False if one
        was not answered on a connection still alive (we are being evicted: whatever
        we still run is fenced).  One whose connection died was answered by our
        registration since, which waited for those transfers."""
        for ended, _ in pending:
            await ended.wait()
        return all(answered or getattr(conn, "dead", False) for _, (answered, conn) in pending)

    async def _answer_recall(
        self, conn: RecallChannel, rid: int, inos: list[int], settles: list[list[int]],
        told: list[tuple[int, tuple[int, int]]], done: trio.Event, created_in: list[int],
    ) -> bool:
        """Let transfers that use the old chunk maps end, drop the kernel's caches, answer.

        Answered within ``answer_within`` even if the kernel is slow to let go (a
        page it must drop is locked by a read this daemon is serving, which may
        itself wait for the server): before the server's patience runs out.
        """
        unpinned = False
        with trio.move_on_after(self.answer_within):
            # A reply read just before this RECALL woke its caller in the step that
            # started this task, and trio runs the two in either order: let the
            # caller run first.  A truncate's caller pins the inode for zeroing its
            # tail as soon as it runs (reads and writes instead find the generation
            # moved and ask again), so the pin is there to be waited for below.
            await trio.lowlevel.checkpoint()
            if created_in and self.creates is not None:
                conn.flush_held()
                await self.creates.wait(created_in)
            if self.barrier is not None:
                # Posted writes confirmed now (a SYNC if need be), not when the
                # transport's drainer next looks: their pins end sooner.
                for ino in inos:
                    await self.barrier(ino)
            await self.cache.wait_unpinned(inos)
            unpinned = True  # (a transfer begun after this used a new map)
            invalidate = self.kernel.invalidator
            if invalidate is not None:
                self.cache.kernel_inodes.difference_update(inos)
                await invalidate(inos)
        if not unpinned and self.cache.any_pinned(inos):
            # Transfers that used the old chunk maps still run (a memory server slow
            # to answer posted writes, a long memfs.array transfer): an answer now
            # would let the change free chunks they may still write.  No answer: the
            # server evicts us and fences our lease token on the memory servers,
            # which then refuse those transfers' late frames.
            log.warning("transfers of %d recalled inode(s) still run after %.1f s: not "
                        "answering the recall (the metadata server will evict this client)",
                        len(inos), self.answer_within)
            for ino, _ in told:
                if self.answering.get(ino) is done:
                    del self.answering[ino]
            done.set()
            return False
        for entry in settles:
            if entry[0] in self._answers_cut:
                entry[1], entry[2] = 0, 0  # no size (see truncated; sizes only grow)
        conn.send_recalled(rid, wire.encode(settles))
        if not told:
            return True
        try:
            if await conn.delivered():
                # The server applied our sizes as it read the answer, before the ping
                # (had it evicted us first, the connection would have ended, and the
                # next registration sends them again).
                for ino, took in told:
                    if self.cache.answered.get(ino) == took:
                        del self.cache.answered[ino]
        finally:
            for ino, _ in told:
                if self.answering.get(ino) is done:
                    del self.answering[ino]
            done.set()
        return True

    async def answer_known(self, ino: int) -> None:
        """Until our answer to a recall that carried *ino*'s size is known delivered
        (or its connection is gone, and the next registration carries it)."""
        ev = self.answering.get(ino)
        if ev is not None:
            await ev.wait()

    def lost(self, why: str) -> None:
        """Stop trusting every cache, the kernel's too (connection lost, lease expired)."""
        cache = self.cache
        if not cache.term:
            return
        had = bool(cache.attrs or cache.dirs or cache.files or cache.kernel_inodes)
        cache.clear()
        inos = list(cache.kernel_inodes)
        cache.kernel_inodes.clear()
        if had:
            log.info("leases lost (%s): dropping %d cached inodes", why, len(inos))
        self.forget_kernel_names()
        if inos:
            self.drop_kernel(inos)

    def drop_kernel(self, inos: list[int]) -> None:
        """The kernel's pages and attributes of *inos* go (their bytes here may be
        ones the server no longer has)."""
        invalidate = self.kernel.invalidator
        if invalidate is not None and self.tasks is not None:
            self.tasks.start_soon(self._invalidate_all, invalidate, inos)

    def kernel_named(self, parent: int, name: bytes) -> None:
        """The kernel holds *name* in *parent* with a timeout (our rename moved a dentry
        there), if it can be made to forget names at all."""
        if self.cache.term and self.kernel.names_invalidator is not None:
            self.cache.kernel_names.add(parent, name)

    def forget_kernel_names(self) -> None:
        """Every name the kernel cached goes (lock-free, so at once: a create on this
        node may hold the directory's lock while it waits for the server, which waits
        for this recall)."""
        forget = self.kernel.names_invalidator
        if forget is not None and self.cache.kernel_names:
            self.cache.kernel_names.clear()
            forget()

    async def _invalidate_all(self, invalidate: Invalidator, inos: list[int]) -> None:
        self.cache.invalidating += 1
        try:
            await invalidate(inos)
        finally:
            self.cache.invalidating -= 1

    async def watch(self) -> None:
        """Notice a lease that ran out (this process was stopped, or the server is
        silent) before anything cached is used again."""
        cache = self.cache
        while True:
            await trio.sleep_until(max(cache.until, trio.current_time() + 0.05))
            if not cache.valid() and (cache.attrs or cache.dirs or cache.files or cache.kernel_inodes):
                self.lost("lease expired")

    async def settle_dirty(self) -> None:
        """Send sizes, mtimes and spans of files written under write leases, coalesced."""
        cache = self.cache
        while True:
            await self.dirty_wake.wait()
            self.dirty_wake = trio.Event()
            await trio.sleep(SETTLE_DELAY)
            for ino in cache.unreported():
                await self.settle(ino, trim=False)

    async def settle(self, ino: int, *, trim: bool, again: bool = False) -> None:
        """Tell the server *ino*'s size and mtime now (and, *trim*, end our write lease).

        The size is taken, then the bytes of the writes made until then are waited
        for (:attr:`barrier`), then it is sent: a size this client reports is not
        ahead of its posted writes, as ext4's ``data=ordered``.  (The server keeps
        only a writer's reports, and sizes only grow; a report that finds the file
        recalled meanwhile is dropped: the recall's answer carried the size.)
        *again*: the spans of reports on their way go again (fsync, ``memfs flush``:
        this report's reply says the server has them)."""
        cache = self.cache
        while (setting := self._setting_mtime.get(ino)) is not None:
            # Taken now, the report would carry the mtime of our writes and reach the
            # server after the time being set (see setting_mtime).
            await setting[1].wait()
        ended = None
        if trim:
            # (From here: a call that may be granted the lease again waits, lease_ended.)
            ended = self.ending[ino] = trio.Event()
            if ino not in cache.dirty and ino in self.answering:
                # A recall's answer on its way carries the size and span of our last
                # writes (it took them): a close's report that reached the server
                # first, with neither, would end the lease, and the answer that came
                # after would count for nothing (a writer's last appends lost while
                # another node stat'ed the file).  It says them, and ends the lease.
                try:
                    await self.answer_known(ino)
                except BaseException:
                    self._ending_over(ino, ended)
                    raise
        d = cache.dirty.get(ino)
        if d is None and not trim and ino not in cache.spans and not (again and ino in cache.sending):
            return
        if d is None:
            a = cache.attrs.get(ino)
            d = (-1, 0) if a is None else (a.size, a.mtime_ns)
        if trim:
            # No more writes without asking; the size stays in ``dirty`` until the
            # server has it (a reconnection in between sends it with the registration).
            f = cache.files.pop(ino, None)
            cache.reported.pop(ino, None)
            if f is not None and d[0] > 0 and ino not in self.truncating:
                # The map below our size stays, to read by: we still hold the file
                # (a change elsewhere recalls us), and the server frees only chunks
                # past its size, which is no smaller.  So the first read after a
                # close (grep, cp, a build) asks nothing.
                keep = -(-d[0] // cache.chunk_size)
                cache.files[ino] = FileState({k: v for k, v in f.chunks.items() if k < keep})
        gen = cache.generation(ino)
        # What was written since the last report; writes made from now on start a
        # new span, sent with the next report (their bytes may land after this one).
        ranges = cache.take_span(ino, again=trim or again)
        heard = False
        self._reporting[ino] = self._reporting.get(ino, 0) + 1
        try:
            if self.barrier is not None:
                await self.barrier(ino)
                if not trim and cache.generation(ino) != gen:
                    return  # recalled meanwhile: the answer carried the size (and d may be stale)
            try:
                # One call per range (the call says one), the one that ends the
                # lease last: a report after it would be ignored.  A size taken
                # before a truncate of ours is not sent after it (the server keeps a
                # writer's sizes, which only grow: it would undo the truncate); -1:
                # no size.  (A coalesced report's first call went before any such
                # change, or not at all; a close's report still carries its size
                # after a recall or a lost lease: the server may have no other.)
                *before, last = ranges or [(0, 0)]
                for span in before:
                    size, mtime = await self._still(ino, d, gen, trim)
                    await self.call("settle", ino, size, mtime, 0, *span)
                size, mtime = await self._still(ino, d, gen, trim)
                # Landed as its reply is read, not when this task runs again: replies
                # read after it (whose callers may run first) reflect it.
                await self.call("settle", ino, size, mtime, int(trim), *last,
                                on_ok=lambda _k, _p: cache.land(ino, d, cache.generation(ino) == gen))
            except FsError as exc:
                if exc.errno == errno.ESTALE:  # our lease ended without us: lost
                    heard = True  # (nothing to say it to)
                    if cache.dirty.get(ino) == d:
                        del cache.dirty[ino]
                    self.kernel.write_lost([ino])
                    return
                # Kept (it is the application's data): sent again, or with the next registration.
                log.debug("settle of inode %d failed: %s", ino, exc)
                return
            heard = True
        finally:
            self._report_over(ino)
            cache.span_sent(ino, ranges, heard=heard)
            if ended is not None:
                self._ending_over(ino, ended)
        if cache.dirty.get(ino) == d:
            del cache.dirty[ino]
        if not trim and d[0] >= 0 and cache.is_writer(ino) and cache.generation(ino) == gen:
            # Still ours (no recall, no truncate of ours since d was taken): replies
            # answered before this report are not news (ClientCache.newest).
            r = cache.reported.get(ino)
            cache.reported[ino] = d if r is None else (max(r[0], d[0]), max(r[1], d[1]))

    async def _still(self, ino: int, d: tuple[int, int], gen: int, trim: bool) -> tuple[int, int]:
        """What a report taken as *d* at generation *gen* may say now.  A close's report
        waits for a truncate of ours under way (sent before it, the server applies it
        first; sent after it, the older size would undo it): none if it was applied."""
        if trim:
            await self.truncates_over(ino)
            return (-1, 0) if ino in self._cut_while_ending else d
        return d if self.cache.generation(ino) == gen else (-1, 0)

    async def truncates_over(self, ino: int) -> None:
        """Until no truncate of *ino* by this node is under way."""
        while (ev := self.truncating.get(ino)) is not None:
            await ev.wait()

    def truncated(self, ino: int) -> None:
        """The server applied our truncate of *ino*: a close's report of it on its way
        sends no size from before, nor does an answer to a recall (taken before, it
        waited for the truncate's zeroing; the server, which still counts us as the
        writer, would grow the file back)."""
        if ino in self.ending:
            self._cut_while_ending.add(ino)
        if self._reporting.get(ino):
            self._answers_cut.add(ino)

    def _ending_over(self, ino: int, ended: trio.Event) -> None:
        if self.ending.get(ino) is ended:
            del self.ending[ino]
            self._cut_while_ending.discard(ino)
        ended.set()

    async def lease_ended(self, ino: int) -> None:
        """Until our report that ends *ino*'s write lease, if one is on its way, is over."""
        ev = self.ending.get(ino)
        if ev is not None:
            await ev.wait()

    def _report_over(self, ino: int) -> None:
        n = self._reporting[ino] - 1
        if n:
            self._reporting[ino] = n
        else:
            del self._reporting[ino]
            self._answers_cut.discard(ino)
            over = self._reports_over.pop(ino, None)
            if over is not None:
                over.set()

    @contextlib.contextmanager
    def setting_mtime(self, ino: int) -> Iterator[None]:
        """Around a setattr of *ino*'s mtime, from its send until its reply is in the
        cache: a report of the file (a close's RELEASE arrives meanwhile) waits, and
        a recall answered meanwhile says no mtime: either would carry our writes'
        mtime, taken before the reply, and reach the server after the time set."""
        n, over = self._setting_mtime.get(ino, (0, trio.Event()))
        self._setting_mtime[ino] = (n + 1, over)
        try:
            yield
        finally:
            n, over = self._setting_mtime[ino]
            if n > 1:
                self._setting_mtime[ino] = (n - 1, over)
            else:
                del self._setting_mtime[ino]
                over.set()

    async def reports_sent(self, ino: int) -> None:
        """Until every report of *ino* taken so far has been answered (a recall's answer
        that carries it: sent).  A call that sets
        the file's mtime waits for them: a report taken before it (a close's, whose
        RELEASE the kernel sends after close(2) has returned, and which waits for
        the bytes to land first) carries the mtime of the writes, and sent after
        the call it would replace an older time set explicitly (``tar``, ``cp -a``,
        ``rsync`` set times right after writing).  (Reports taken from now on carry
        the new mtime, or later writes'.)"""
        while self._reporting.get(ino):
            over = self._reports_over.get(ino)
            if over is None:
                over = self._reports_over[ino] = trio.Event()
            await over.wait()

    def quiet(self, ino: int) -> bool:
        """Nothing of ours about *ino* on its way that carries its state as taken
        before now (a report, a recall's answer, a truncate, a setattr of its mtime):
        a call held now reaches the server after all it would otherwise pass."""
        return not (self._reporting.get(ino) or ino in self._setting_mtime or ino in self.answering
                    or ino in self.ending or ino in self.truncating)

    def settled_first(self, ino: int) -> Awaitable[None] | None:
        """A call about *ino* that the server answers from its own state needs our unsent size."""
        if ino in self.cache.dirty:
            return self.settle(ino, trim=False)
        return None

    def attr_ttl(self, ino: int, returned: Attr | None = None) -> float | None:
        cache = self.cache
        if not cache.term:
            return None
        cached = cache.attrs.get(ino)
        if cached is None:
            return 0.0
        if returned is not None and returned is not cached and _seen(returned) != _seen(cached):
            # Not what our lease covers: an answer not cacheable (another node's change
            # was under way) while a later call of ours cached newer attributes.  With
            # a timeout the kernel would keep this older size as valid (a read past it
            # stops there, O_DIRECT too) and nothing would ever recall it.
            return 0.0
        ttl = cache.ttl()
        if ttl:
            cache.kernel_inodes.add(ino)
        return ttl

    def entry_ttl(self, parent: int, name: bytes, ino: int, listed: bool = False) -> float | None:
        # The kernel may cache a name (present or absent) that our lease covers only if
        # it can be made to forget it without the directory's lock: a create or unlink
        # on this node holds that lock while it waits for the mds, which may be waiting
        # for our answer to a recall (FUSE_NOTIFY_INVAL_ENTRY would deadlock two nodes
        # working in one directory).  FUSE_NOTIFY_INC_EPOCH takes no lock but drops every
        # name at once.  Without it, lookups are answered from our cache: a round trip
        # to this daemon, not to the mds.  Only if what is sent (*ino*, 0: absent) is
        # what the cache holds: a listing taken before another node's change of the
        # name, sent after another call cached the name anew, would give the kernel
        # the old inode under it for the lease's term (found by a review).
        cache = self.cache
        if not cache.term:
            return None
        if listed or self.kernel.names_invalidator is None or cache.entry(parent, name) != ino:
            return 0.0
        ttl = cache.ttl()
        if ttl:
            cache.kernel_names.add(parent, name)
        return ttl
