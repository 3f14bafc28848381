"""The chunk maps a cluster client reads and writes by (``Meta.map_read`` and
``map_write`` of :class:`~memfs.meta.remote.RemoteMeta`).

Under the server's leases a map comes from the :class:`~memfs.meta.cache.ClientCache`
when it knows it (writes under a write lease: no call at all); otherwise from a
``map_read``, ``map_write`` or ``allocate_ahead`` call, whose answer the cache keeps
when the server granted it.  Sequential writers get space ahead of need, more
each time, like readahead.  No map of a file is handed out while this node
truncates it (``LeaseKeeper.truncating``).
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from memfs.errors import FsError
from memfs.meta import Attr, Extent, WritePlan, clock, codec
from memfs.meta.cache import ClientCache, FileState
from memfs.meta.lease_client import LeaseKeeper
from memfs.wire import Kind

#: most space a sequential writer asks for ahead of its writes (the server caps it too)
MAX_AHEAD = 64 << 20

#: the clock the metadata server stamps with too: timestamps stay in the kernel's order
_now_ns = clock.now_ns


class MapClient:
    """See the module docstring.  *call_kind* is the client's call (reply kind and
    result), *getattr* its ``Meta.getattr``; *opens* its open handles per inode
    (write leases end at close, so only a file open here is written under one);
    *check_write_error* raises EIO for a file whose writes were lost."""

    def __init__(
        self, cache: ClientCache, leases: LeaseKeeper,
        call_kind: Callable[..., Awaitable[tuple[Kind, Any]]],
        getattr: Callable[[int], Awaitable[Attr]],  # noqa: A002 (Meta's name for it)
        opens: dict[int, int], check_write_error: Callable[[int], None],
    ) -> None:
        self.cache = cache
        self.leases = leases
        self._call_kind = call_kind
        self.getattr = getattr
        self.opens = opens
        self.check_write_error = check_write_error
        #: the pool's stripe size (set once the client knows it): a sequential
        #: writer's first space ahead
        self.stripe_size = 0
        #: (inode, map window) -> set once the map_read that will bring it has ended
        self._maps_asked: dict[tuple[int, int], trio.Event] = {}
        #: inodes whose last map_read answer was not cacheable (reads do not wait)
        self._maps_plain: set[int] = set()
        #: the server places appends itself (``codec.append_offset``; set at registration)
        self.appends = False
        #: the server marks writers without a lease (it grants leases: set at registration),
        #: whose writes may then be posted
        self.posts_unleased = False
        #: hold a read's access time for the server, ``touch(ino, time_ns)``; False if
        #: it cannot (no connection, an older mds): set by RemoteMeta
        self.touch: Callable[[int, int], bool] | None = None
        #: files whose space ahead of need the server may hold for us although the reply
        #: that gave it was not cacheable here (a recall or a change of ours came
        #: meanwhile): their last close gives it back all the same
        self.ahead_unsure: set[int] = set()

    async def read(self, ino: int, offset: int, length: int) -> list[Extent]:
        """Where the bytes of ``[offset, offset+length)`` of *ino* live (``Meta.map_read``)."""
        if self.leases.truncating:
            await self.leases.truncates_over(ino)
        extents = await self._map_read(ino, offset, length)
        self._pages_here(ino)
        return extents

    async def write(self, ino: int, offset: int, length: int) -> WritePlan:
        """Where to write ``[offset, offset+length)`` of *ino* (``Meta.map_write``)."""
        if self.leases.truncating:
            await self.leases.truncates_over(ino)
        _, plan = await self._map_write(ino, offset, length)
        self._pages_here(ino)
        return plan

    async def append(self, ino: int, length: int) -> tuple[int, WritePlan]:
        """Where an ``O_APPEND`` write of *length* bytes of *ino* goes, and the plan
        (``Meta.map_append``).  Under our write lease the end of file is ours: taken
        and written (``ClientCache.wrote``) with no await between, so a recall's
        answer says it.  Otherwise the server places it, at the end as it grants the
        write: reading the end first and writing there later, two nodes appending at
        once could both read the same end."""
        if self.leases.truncating:
            await self.leases.truncates_over(ino)
        self.check_write_error(ino)
        cache = self.cache
        a = cache.attr(ino)
        if cache.term and self.opens.get(ino) and cache.is_writer(ino):
            if a is not None and cache.valid() and length:
                offset = a.size  # (before the write grows it)
                plan = self._into_held_space(ino, offset, offset + length)
                if plan is not None:
                    self._pages_here(ino)
                    return offset, plan
        else:
            # What we told the server of our writes reaches it first (a report on its
            # way, a recall's answer waiting for transfers): it places us after them.
            await self.leases.reports_sent(ino)
            await self.leases.answer_known(ino)
            a = cache.attr(ino) if cache.is_writer(ino) else None
        # Our writes the server may not have heard of: a size under our write lease, or
        # one not reported yet although our cache no longer says we write (the lease
        # lapsed here; the server, still counting us the writer, takes the floor).
        d = cache.dirty.get(ino)
        floor = max(a.size if a is not None else 0, d[0] if d is not None else 0)
        offset, plan = await self._map_write(ino, codec.append_offset(floor), length)
        self._pages_here(ino)
        return offset, plan

    def _into_held_space(self, ino: int, offset: int, end: int) -> WritePlan | None:
        """A write of ours under our write lease into chunks it holds: no call, the size
        and mtime ours to keep (None: a chunk there is not ours yet)."""
        extents = self.cache.extents(ino, offset, end, allocated=True)
        if extents is None:
            return None
        self.cache.wrote(ino, offset, end, _now_ns())
        self.leases.dirty_wake.set()
        return WritePlan(extents, posted=True)

    def _ahead(self, f: FileState | None, length: int) -> int:
        """Space ahead of a write that goes on a stream: like readahead, more each time."""
        return min(MAX_AHEAD, max(self.stripe_size, length, 2 * f.ahead if f is not None else 0))

    def _pages_here(self, ino: int) -> None:
        """The kernel may keep the pages of what is read or written here (also of a
        file it was given no attributes to keep): a lost lease drops them
        (LeaseKeeper.lost).  Counted once the map is ours, under a valid lease (the
        loss of an expired one is being handled, and a read that waited for the
        connection counts once it got its map)."""
        cache = self.cache
        if cache.term and cache.valid():
            cache.kernel_inodes.add(ino)

    async def _map_read(self, ino: int, offset: int, length: int) -> list[Extent]:
        """From the cache when it knows; else, at most one call per map window on its
        way: the kernel's readahead sends several reads of one window at once, and
        they wait for the first one's answer (a cacheable map of the window around
        it) instead of each asking the mds.  A read waits once; what the answer did
        not bring to the cache it then asks for itself.  Files whose answers are not
        cacheable (still in the backing directory, recalled) are not waited for."""
        if not self.cache.term or ino in self._maps_plain:
            return await self._map_read_call(ino, offset, length)
        key = (ino, offset // codec.MAP_WINDOW)
        extents = await self._map_read_cached(ino, offset, length)
        if extents is not None:
            return extents
        asked = self._maps_asked.get(key)
        if asked is not None:
            await asked.wait()
            extents = await self._map_read_cached(ino, offset, length)
            if extents is not None:
                return extents
            return await self._map_read_call(ino, offset, length)
        self._maps_asked[key] = asked = trio.Event()
        try:
            return await self._map_read_call(ino, offset, length)
        finally:
            del self._maps_asked[key]
            asked.set()

    async def _map_read_cached(self, ino: int, offset: int, length: int) -> list[Extent] | None:
        """The map from the cache, or None: ask the mds."""
        cache = self.cache
        a = cache.attr(ino)
        if a is None and cache.files.get(ino) is not None and cache.valid():
            # A map but no size (a recall of another kind dropped it): one call
            # for the attributes, then reads go on without the mds.
            await self.getattr(ino)
            a = cache.attr(ino)
        stale_atime = a is not None and (a.atime_ns <= a.mtime_ns or a.atime_ns <= a.ctime_ns)
        if a is not None and stale_atime and cache.is_writer(ino):
            # relatime, kept here (our own writes are not news; told at our last
            # close: RemoteMeta.release), not at every read after a write
            a.atime_ns = _now_ns()
            cache.files[ino].read_here = True
            stale_atime = False
        if a is not None:
            end = min(offset + length, a.size)
            extents = [] if end <= offset else cache.extents(ino, offset, end)
            if extents is not None and stale_atime and self.touch is not None \
                    and self.touch(ino, t := _now_ns()):
                # relatime, the server told with our next call (within 1 ms), not
                # asked: no holder elsewhere is recalled for an access time anyway
                # (the first read of every file after it was written: grep, cp, a
                # build)
                a.atime_ns = t
                stale_atime = False
            if extents is not None and not stale_atime:
                return extents
        if stale_atime:
            cache.attrs.pop(ino, None)  # the server moves atime (relatime): ask it next time
        if (w := self.leases.settled_first(ino)) is not None:
            await w  # the server clips at the size it knows
        return None

    async def _map_read_call(self, ino: int, offset: int, length: int) -> list[Extent]:
        cache = self.cache
        while True:
            try:
                kind, extents = await self._call_kind("map_read", ino, offset, length)
            except FsError as exc:
                # The server is still fetching from its backing directory.  Ask again.
                if exc.errno != errno.EINPROGRESS:
                    raise
                continue
            if kind is Kind.OK_CACHE:
                cache.put_extents(ino, extents)
                self._maps_plain.discard(ino)
            elif cache.term:
                self._maps_plain.add(ino)  # nothing to wait for: see map_read
            # A wider window than asked comes with a lease, and stays wider when the
            # lease went with a recall before we ran (_roundtrip answers OK then).
            return _clip(extents, offset, offset + length)

    async def _map_write(self, ino: int, offset: int, length: int) -> tuple[int, WritePlan]:
        """The write's offset (negative *offset*: an append the server places, see
        :meth:`append`) and its plan."""
        self.check_write_error(ino)
        cache = self.cache
        appends = offset < 0
        end = offset + length
        if appends:
            # Space ahead only for a writer of ours going on (a log appended from one
            # node): appends from several nodes in turn would give and take it each time.
            f = cache.files.get(ino)
            ahead = (self._ahead(f, length)
                     if cache.term and self.opens.get(ino) and f is not None and f.writer else 0)
            method, args = "allocate_ahead", [ino, offset, length, ahead]
        elif cache.term and self.opens.get(ino):  # write leases end at close: only with a handle
            if cache.is_writer(ino) and cache.valid() and length:
                held = self._into_held_space(ino, offset, end)
                if held is not None:
                    return offset, held
            f = cache.files.get(ino)
            sequential = offset == 0 or (f is not None and f.last_end == offset)
            ahead = self._ahead(f, length) if sequential and length else 0
            method, args = "allocate_ahead", [ino, offset, length, ahead]
        else:
            method, args = "map_write", [ino, offset, length]
        if method == "allocate_ahead":
            # A close of ours reporting the end of our last lease on it goes first:
            # after a new grant the server would take it as the end of that one.
            await self.leases.lease_ended(ino)
        granted: list[Kind] = []  # the reply's kind as read (before _roundtrip's downgrade)
        sent = cache.seq
        while True:
            try:
                kind, result = await self._call_kind(method, *args, on_ok=lambda k, _: granted.append(k))
            except FsError as exc:
                # The server's write-back is behind (its dirty cap): it said so after
                # waiting a while, rather than let this call time out.  Ask again.
                if exc.errno != errno.EINPROGRESS:
                    raise
                continue
            if method == "map_write":
                plan = result
                kind = Kind.OK
            else:
                plan, a = result
            if appends:
                # Placed at the end of file, which the write made the new end.
                offset = a.size - length
                end = a.size
            if granted and granted[-1] is Kind.OK_WRITE and length:
                # The server counted these chunks written as it answered, and holds
                # us as their writer (also when the reply came back not cacheable,
                # our generation unmoved: the write goes ahead with this plan); it
                # hears of the bytes (the span) once they have landed.
                cache.written(ino, offset, end)
                self.leases.dirty_wake.set()
            if kind is Kind.OK_WRITE or kind is Kind.OK_CACHE:
                cache.put_extents(ino, plan.extents, writer=kind is Kind.OK_WRITE)
                if cache.stale(ino, sent):  # a chmod of ours since: not those attributes
                    cache.attrs.pop(ino, None)
                else:
                    cache.put_attr(a)
                f = cache.files.get(ino)
                if f is not None:
                    f.last_end = end
                    f.ahead = args[3] if method == "allocate_ahead" else 0
            else:
                # Size, blocks, mtime moved and holes may be data now.  (Our own change:
                # maps taken before stay usable, so the generation stays.)
                cache.attrs.pop(ino, None)
                cache.files.pop(ino, None)
                if granted and granted[-1] is Kind.OK_WRITE:
                    self.ahead_unsure.add(ino)  # the server holds the lease and space for us
            # Posted (not waited for) under our write lease, and, while the server
            # keeps leases (this connection's describe said so), also without one:
            # the server marks us as writing the file until our close or our answer
            # to a recall, which waits for those bytes, so another node's read,
            # write or truncate of it waits for them first.  (Not without a
            # handle: no close would wait for it.)
            posted = kind is Kind.OK_WRITE or (
                method == "allocate_ahead" and self.posts_unleased and bool(self.opens.get(ino)))
            return offset, WritePlan(_clip(plan.extents, offset, end), posted=posted)


def _clip(extents: list[Extent], start: int, end: int) -> list[Extent]:
    """*extents* within ``[start, end)`` (the server answers with a wider window)."""
    out = []
    for e in extents:
        e_end = e.offset + e.length
        if e_end <= start:
            continue
        if e.offset >= end:
            break
        lo, hi = max(e.offset, start), min(e_end, end)
        if hi <= lo:
            continue
        if (lo, hi) != (e.offset, e_end):
            e = Extent(lo, hi - lo, e.volume, e.voffset + (lo - e.offset) if e.volume >= 0 else e.voffset)
        out.append(e)
    return out
