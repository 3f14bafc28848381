"""The data engine: file byte ranges to striped volume I/O.

Asks the metadata service where a range lives (``map_read``/``map_write``) and
moves the bytes with the transport, concurrently across volumes when the
transport can overlap requests.  Holes come back as zeros; newly allocated
chunks are zero already (the scrubber cleared them when they were freed).

Cluster clients cache chunk maps under leases (:mod:`memfs.meta.cache`): each
transfer runs inside ``meta.io(ino)`` and only with a map whose generation did
not move while it was fetched, so a recall (which waits for ``io``) never lets
a chunk be freed while a transfer still uses it.

Posted writes (a cluster client holding a file's write lease, or writing it
through a handle without one while the mds grants leases; tcp): the write
returns once its frame is in the socket, before the memory server has applied
it (the socket's buffer is the write-behind buffer: no copy, bounded by the
kernel).  Until the server answers, the inode stays pinned (``meta.io``), so a
recall waits for the data: under a lease any other session's access to the
file causes one; without, the mds marks the writer, and another session's
read, write or truncate of the bytes it wrote does.  This node's own reads and
truncates of the file, its fsync and its release wait for them first.  A posted write that failed fails the file's next
write or fsync with EIO, once (as a local filesystem reports writeback errors:
not at close; one still unreported at a close is logged and dropped).  Its bytes
may be lost, or land in part; a late frame is refused once the mds has fenced
this client's lease token (see ARCHITECTURE, "Fencing").

Copies: a read that falls in one contiguous extent returns the transport's view
of volume memory (no copy in Python; libfuse copies it into the reply).  Other
reads are assembled in one buffer.  A write is one copy from the kernel's
request buffer into volume memory.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager

import numpy as np
import trio

from memfs.errors import FsError, SpaceBusy
from memfs.meta import MAP_TRIES, NOT_RESIDENT, Extent, Meta, WritePlan, map_retry_delay
from memfs.transport import Buffer, Posted, Transport

log = logging.getLogger(__name__)

#: fallocate asks for its range in pieces of this (the kernel's largest write)
ALLOCATE_PIECE = 1 << 20


class _Posted:
    """The writes of one file that the transport has not had answered yet."""

    __slots__ = ("count", "tails", "error", "hold", "posting", "changed")

    def __init__(self) -> None:
        self.count = 0
        #: writes between their plan (the size is ours from then) and the end of their
        #: posting, by number, and an event set (and replaced) whenever one ends
        self.posting: set[int] = set()
        self.changed: trio.Event | None = None
        #: the last write posted on each channel (waiting for it waits for the others)
        self.tails: dict[object, Posted] = {}
        #: the first failure not reported yet
        self.error: Exception | None = None
        #: the inode's pin (meta.io), held while any is outstanding
        self.hold: AbstractContextManager[object] | None = None


class DataEngine:
    def __init__(self, meta: Meta, transport: Transport) -> None:
        self.meta = meta
        self.transport = transport
        #: files with posted writes outstanding or a failed one not reported yet
        self._posted: dict[int, _Posted] = {}
        self._posts = 0  # writes that began posting, ever (numbers them)
        #: waits, without yielding, until no reader still copies out of pool memory
        #: read() returned (set by the mount's FUSE layer: memfs.fs.replies_written_now)
        self.quiesce: Callable[[], bool] | None = None
        if transport.posts_writes:  # no size reported ahead of the bytes under it
            meta.order_sizes_after(self.wait_posted)
        meta.zero_tails_with(self._zero_tail)

    @property
    def posts_writes(self) -> bool:
        return self.transport.posts_writes

    async def settle(self, ino: int) -> None:
        """Until the writes of *ino* posted so far are answered (fsync); EIO if one
        failed since the last report."""
        await self.wait_posted(ino)
        out = self._posted.get(ino)
        if out is not None and out.error is not None:
            self._report(ino, out)

    def _report(self, ino: int, out: _Posted) -> None:
        err, out.error = out.error, None
        if not out.count and not out.posting:
            del self._posted[ino]
        raise FsError(errno.EIO, f"inode {ino}: a write failed after it returned: {err}")

    async def release(self, ino: int) -> None:
        """A handle of *ino* is closed: its posted writes reach the memory servers
        first (the last release ends the write lease); a failure no write or fsync
        reported is logged and dropped here, not left for a later opener."""
        await self.wait_posted(ino)
        out = self._posted.get(ino)
        if out is not None and not out.count and not out.posting and out.error is not None:
            del self._posted[ino]
            log.error("inode %d: a write failed after it returned, and no write or fsync "
                      "after it reported it before this close: %s", ino, out.error)

    async def drain(self) -> None:
        """Until every write posted so far is answered (or failed): before the transport
        closes at unmount, so that a write(2) that returned is not dropped."""
        for ino in list(self._posted):
            await self.wait_posted(ino)

    async def wait_posted(self, ino: int) -> None:
        """Until the writes of *ino* made so far are answered (those still being posted:
        once they are); a failure stays to be reported by :meth:`settle` or the next
        write."""
        out = self._posted.get(ino)
        if out is None:
            return
        begun = set(out.posting)
        while begun & out.posting:
            if out.changed is None:
                out.changed = trio.Event()
            await out.changed.wait()
        if out.count:
            for h in list(out.tails.values()):
                await h.wait()

    async def read(self, ino: int, offset: int, length: int) -> Buffer:
        if ino in self._posted:
            await self.wait_posted(ino)  # on another connection the read could overtake them
        meta = self.meta
        for tries in range(MAP_TRIES):
            if (pause := map_retry_delay(tries)) > 0:
                await trio.sleep(pause)
            gen = meta.generation(ino)
            extents = await meta.map_read(ino, offset, length)
            with meta.io(ino):
                if meta.generation(ino) != gen:
                    continue  # recalled while we asked: the map may name freed chunks
                return await self._read(ino, offset, extents)
        raise FsError(errno.EIO, f"inode {ino}: its chunk map keeps changing")

    async def _read(self, ino: int, offset: int, extents: list[Extent]) -> Buffer:
        if not extents:
            return b""
        if any(e.volume == NOT_RESIDENT for e in extents):  # never zeros for missing data
            raise FsError(errno.EIO, f"inode {ino}: data not fetched from the backing directory")
        if len(extents) == 1:
            e = extents[0]
            if e.volume < 0:
                return bytes(e.length)
            return await self.transport.read(e.volume, e.voffset, e.length)
        total = extents[-1].offset + extents[-1].length - offset
        # Not zero-filled (a memset of every byte): holes and gaps are zeroed here,
        # the rest is read into it, or it is dropped with the error.
        buf = np.empty(total, np.uint8)
        pos = offset
        for e in extents:
            if e.offset > pos:
                buf[pos - offset : e.offset - offset] = 0
            if e.volume < 0:
                buf[e.offset - offset : e.offset - offset + e.length] = 0
            pos = e.offset + e.length
        view = buf.data
        data = [e for e in extents if e.volume >= 0]
        if self.transport.concurrent and len({e.volume for e in data}) > 1:
            await _concurrently([functools.partial(self._readinto, e, view, offset) for e in data])
        else:
            for e in data:
                await self._readinto(e, view, offset)
        return view

    async def _readinto(self, e: Extent, view: memoryview, base: int) -> None:
        start = e.offset - base
        await self.transport.readinto(e.volume, e.voffset, view[start : start + e.length])

    async def write(self, ino: int, offset: int, data: Buffer, *, append: bool = False) -> int:
        """*append*: an ``O_APPEND`` write where sizes change elsewhere, placed by
        ``Meta.map_append`` (*offset* unused).  Once placed the file's size counts
        it: a retry (the map recalled meanwhile) writes there, and a failure after
        that leaves zeros there (as a crash of the writer would)."""
        src = memoryview(data).cast("B")
        if append and not len(src):
            return 0
        meta = self.meta
        out = self._posted.get(ino)
        if out is not None and out.error is not None:
            self._report(ino, out)  # an earlier write's failure, reported here
        for tries in range(MAP_TRIES):
            if (pause := map_retry_delay(tries)) > 0:
                await trio.sleep(pause)
            gen = meta.generation(ino)
            offset, plan = await self._plan(ino, offset, len(src), append=append)
            append = False
            with meta.io(ino):
                if meta.generation(ino) != gen:
                    continue  # recalled while we asked: the plan may name freed chunks
                if plan.posted and self.transport.posts_writes:
                    await self._post(ino, plan, src, offset)
                else:
                    if ino in self._posted:  # posted ones go first
                        await self.wait_posted(ino)
                    await self._write(plan, src, offset)
                return len(src)
        raise FsError(errno.EIO, f"inode {ino}: its chunk map keeps changing")

    async def _post(self, ino: int, plan: WritePlan, src: memoryview, base: int) -> None:
        # Entries exist exactly while writes are being posted or outstanding, or a
        # failure is unreported.  Registered before the first await: the size this
        # write makes is the metadata client's from its plan on, and a size report
        # waits for the write (wait_posted) however long its posting takes.
        out = self._posted.get(ino)
        if out is None:
            out = self._posted[ino] = _Posted()
        self._posts += 1
        me = self._posts
        out.posting.add(me)
        done = functools.partial(self._posted_done, ino)
        try:
            for e in plan.extents:
                start = e.offset - base
                h = await self.transport.post_write(
                    e.volume, e.voffset, src[start : start + e.length], ino, done)
                if h is None:
                    continue
                if not out.count:
                    out.hold = self.meta.io(ino)
                    out.hold.__enter__()
                out.count += 1
                out.tails[h.channel] = h
        finally:
            out.posting.discard(me)
            if out.changed is not None:
                out.changed.set()
                out.changed = None
            if not out.count and not out.posting and out.error is None:
                del self._posted[ino]

    def _posted_done(self, ino: int, err: Exception | None) -> None:
        out = self._posted[ino]
        if err is not None:
            log.warning("inode %d: a posted write failed: %s", ino, err)
            if out.error is None:
                out.error = err
        out.count -= 1
        if not out.count:
            hold, out.hold = out.hold, None
            out.tails.clear()
            if out.error is None and not out.posting:
                del self._posted[ino]
            if hold is not None:
                hold.__exit__(None, None, None)

    async def _plan(
        self, ino: int, offset: int, length: int, *, append: bool = False,
    ) -> tuple[int, WritePlan]:
        """The write's offset (*append*: where ``Meta.map_append`` placed it) and plan."""
        async def plan() -> tuple[int, WritePlan]:
            if append:
                return await self.meta.map_append(ino, length)
            return offset, await self.meta.map_write(ino, offset, length)

        try:
            return await plan()
        except SpaceBusy:
            # Only freed-but-unzeroed space is left: wait for the scrubber, once.
            await self.meta.reclaim()
            try:
                return await plan()
            except SpaceBusy:
                raise FsError(errno.ENOSPC) from None

    async def _write(self, plan: WritePlan, src: memoryview, offset: int) -> None:
        if self.transport.concurrent and len({e.volume for e in plan.extents}) > 1:
            await _concurrently(
                [functools.partial(self._write_extent, e, src, offset) for e in plan.extents]
            )
        else:
            for e in plan.extents:
                await self._write_extent(e, src, offset)

    async def _write_extent(self, e: Extent, src: memoryview, base: int) -> None:
        start = e.offset - base
        await self.transport.write(e.volume, e.voffset, src[start : start + e.length])

    async def allocate(self, ino: int, offset: int, length: int, *, keep_size: bool) -> None:
        """Reserve pool memory for ``[offset, offset+length)`` (``fallocate(2)``): its
        chunks are allocated now (zero), so writes there cannot fail with ENOSPC, and
        the size grows to cover it unless *keep_size*.

        Asked for a piece at a time, as a sequential writer would (the burst
        buffer's dirty cap and a cluster client's allocation ahead see what they
        know).  A failure (ENOSPC) puts back the size it found, as tmpfs does; the
        chunks it allocated below that size stay (they read as zeros either way).
        Chunks past the end of file are not kept for a file (truncate, and the end
        of a cluster client's write lease, free them): *keep_size* past it is
        refused (EOPNOTSUPP), never silently not reserved.
        """
        size = (await self.meta.getattr(ino)).size
        end = offset + length
        if keep_size and end > size:
            raise FsError(errno.EOPNOTSUPP, "fallocate: FALLOC_FL_KEEP_SIZE past the end of file")
        pos = offset
        try:
            while pos < end:
                n = min(ALLOCATE_PIECE - pos % ALLOCATE_PIECE, end - pos)
                await self._plan(ino, pos, n)
                pos += n
        except FsError:
            if pos > size and (await self.meta.getattr(ino)).size == pos:
                await self.truncate(ino, size)
            raise

    async def truncate(self, ino: int, size: int) -> None:
        if ino in self._posted:
            await self.wait_posted(ino)  # a zeroing could overtake them
        await self._zero_tail(ino, await self.meta.truncate(ino, size))

    async def punch(self, ino: int, offset: int, length: int) -> None:
        """``FALLOC_FL_PUNCH_HOLE``: whole chunks freed, the rest of the range zeroed."""
        if ino in self._posted:
            await self.wait_posted(ino)  # a zeroing could overtake them
        await self._zero_tail(ino, await self.meta.punch(ino, offset, length))

    async def _zero_tail(self, ino: int, ranges: list[tuple[int, int, int]]) -> None:
        """Zero what a truncate or punch cut off in chunks that stay (see
        Meta.zero_tails_with)."""
        if not ranges:
            return
        if self.quiesce is not None:
            # A read's reply may still be copying the tail out (fs.replies_written_now).
            # No await from here to the zeroing: nothing may free and reuse the chunk
            # meanwhile.  Zeroed even if the wait gives up: past EOF must read as zeros.
            self.quiesce()
        with self.meta.io(ino):  # a transfer: a new lease token waits for it (cluster)
            for vol, voff, n in ranges:
                await self.transport.zero(vol, voff, n)


async def _concurrently(jobs: list[Callable[[], Awaitable[None]]]) -> None:
    """Run *jobs* at once; a failure is raised as itself, not in an exception group,
    when every failure is an FsError (a memory server that died mid-transfer is an
    EIO for the caller, not an internal error)."""
    try:
        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(job)
    except BaseExceptionGroup as group:
        errors, rest = group.split(FsError)
        if errors is None or rest is not None:
            raise
        first: BaseException = errors
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
