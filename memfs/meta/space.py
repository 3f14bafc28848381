"""Free space of a pool: every volume's chunks, handed out clean, zeroed before reuse.

A chunk is free (allocatable, all zeros), allocated (the metadata store has
placed it in a file), or dirty (freed, waiting for the scrubber,
:mod:`memfs.scrub`, to zero it).  The store decides *which* chunks a file
needs and where they go; this module only counts and hands them out, all or
none, and passes freed ones through the scrubber.  Like the store, nothing here
awaits but :meth:`ChunkSpace.reclaim`: each call is atomic on the trio loop.
"""

from __future__ import annotations

import errno
import heapq
from collections.abc import Awaitable, Callable, Container

from memfs.config import PoolConfig
from memfs.errors import FsError, SpaceBusy


class VolumeAllocator:
    """Chunks of one volume: a bump pointer, a min-heap of clean freed chunks, and
    the dirty chunks (freed, not yet zeroed by the scrubber).

    Only clean chunks are handed out, so a newly allocated chunk reads as zeros
    and no writer ever has to zero anything: two clients writing disjoint parts
    of one fresh chunk cannot undo each other.

    Freed chunks go out lowest first, so a run of allocations on a volume gets
    ascending, mostly adjacent chunks that merge into one extent: one transfer
    per stripe unit instead of one per chunk.  (A last-in-first-out list handed
    a file's freed chunks back in descending order: after any deletion, a 1 MiB
    read became 16 requests to the memory server.)  ``lowest_first`` is off only
    while a journal written under that old rule is replayed.
    """

    __slots__ = ("chunk_size", "n_chunks", "next", "freed", "dirty", "scrubbing", "lowest_first")

    def __init__(self, n_chunks: int, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.n_chunks = n_chunks
        self.next = 0
        self.freed: list[int] = []
        self.dirty: dict[int, None] = {}  # an ordered set of chunk numbers
        self.scrubbing: set[int] = set()  # taken by the scrubber, not yet back
        self.lowest_first = True

    @property
    def free(self) -> int:
        """Chunks that can be allocated now."""
        return self.n_chunks - self.next + len(self.freed)

    @property
    def reclaimable(self) -> int:
        """Freed chunks that become allocatable once scrubbed."""
        return len(self.dirty) + len(self.scrubbing)

    def alloc(self) -> int:
        if self.freed:
            idx = heapq.heappop(self.freed) if self.lowest_first else self.freed.pop()
            return idx * self.chunk_size
        if self.next >= self.n_chunks:
            raise FsError(errno.ENOSPC)
        self.next += 1
        return (self.next - 1) * self.chunk_size

    def release(self, voffset: int) -> None:
        self.dirty[voffset // self.chunk_size] = None

    def put_free(self, idx: int) -> None:
        """Chunk *idx* holds zeros: allocatable."""
        if self.lowest_first:
            heapq.heappush(self.freed, idx)
        else:
            self.freed.append(idx)

    def use_lowest_first(self) -> None:
        """From now on hand out freed chunks lowest first (after an old journal's replay)."""
        if not self.lowest_first:
            heapq.heapify(self.freed)
            self.lowest_first = True


class ChunkSpace:
    """The chunks of every volume of one pool, and their way through the scrubber."""

    def __init__(self, pool: PoolConfig) -> None:
        self.chunk_size = pool.chunk_size
        self.allocators = [
            VolumeAllocator(pool.volume_size // pool.chunk_size, pool.chunk_size)
            for _ in range(pool.volumes)
        ]
        #: zeroes dirty chunks and hands them back (the scrubber); None: freed space
        #: stays unusable, which is safe, until something that can zero it attaches
        self.reclaimer: Callable[[], Awaitable[None]] | None = None
        #: called when chunks become dirty (wakes the scrubber)
        self.on_dirty: Callable[[], None] | None = None
        #: called with chunks put back clean (the journal records it)
        self.on_clean: Callable[[list[tuple[int, int]]], None] | None = None

    def totals(self) -> tuple[int, int]:
        """(chunks in the pool, chunks free or reclaimable)."""
        return (sum(a.n_chunks for a in self.allocators),
                sum(a.free + a.reclaimable for a in self.allocators))

    def take(self, vols: list[int]) -> list[int]:
        """One clean chunk on each of *vols* (a volume may repeat), all or none: their
        offsets, in order.  ENOSPC, or SpaceBusy if scrubbing would make room."""
        need: dict[int, int] = {}
        for vol in vols:
            need[vol] = need.get(vol, 0) + 1
        for vol, n in need.items():
            a = self.allocators[vol]
            if a.free < n:
                if a.free + a.reclaimable >= n:
                    raise SpaceBusy()
                raise FsError(errno.ENOSPC)
        return [self.allocators[vol].alloc() for vol in vols]

    def release(self, chunks: list[tuple[int, int]]) -> None:
        """Freed chunks ``(volume, voffset)``: dirty until the scrubber zeroes them."""
        for vol, voff in chunks:
            self.allocators[vol].release(voff)
        if chunks and self.on_dirty is not None:
            self.on_dirty()

    @property
    def dirty_chunks(self) -> int:
        return sum(len(a.dirty) for a in self.allocators)

    def take_dirty(self, limit: int, skip: Container[int] = ()) -> list[tuple[int, int]]:
        """Up to *limit* dirty chunks as (volume, voffset), now owned by the scrubber.

        None from the volumes in *skip* (the scrubber cannot zero them right now).
        Shared out over the volumes: they are zeroed in parallel, and a slow one
        does not hold up the others' turn.
        """
        out: list[tuple[int, int]] = []
        vols = [(vol, a) for vol, a in enumerate(self.allocators) if a.dirty and vol not in skip]
        share = max(1, limit // len(vols)) if vols else 0
        for vol, a in vols:
            for _ in range(min(share, limit - len(out), len(a.dirty))):
                idx = next(iter(a.dirty))
                del a.dirty[idx]
                a.scrubbing.add(idx)
                out.append((vol, idx * self.chunk_size))
        return out

    def put_clean(self, chunks: list[tuple[int, int]]) -> None:
        """Chunks that now hold zeros become allocatable (in the order given)."""
        for vol, voff in chunks:
            a = self.allocators[vol]
            idx = voff // self.chunk_size
            if idx in a.scrubbing:
                a.scrubbing.discard(idx)
            else:  # journal replay: never taken
                del a.dirty[idx]
            a.put_free(idx)
        if self.on_clean is not None and chunks:
            self.on_clean(chunks)

    def return_dirty(self, chunks: list[tuple[int, int]]) -> None:
        """The scrubber could not zero these: they stay dirty."""
        for vol, voff in chunks:
            a = self.allocators[vol]
            a.scrubbing.discard(voff // self.chunk_size)
            a.dirty[voff // self.chunk_size] = None

    def recycle_unzeroed(self) -> None:
        """Metadata-only use (no data plane, e.g. tests): dirty chunks become clean as they are."""
        self.put_clean(self.take_dirty(1 << 62))

    async def reclaim(self) -> None:
        """Zero what is dirty now (if a scrubber is attached), so that it can be allocated."""
        if self.reclaimer is not None:
            await self.reclaimer()
