"""Where files' bytes are: each regular file's chunk map, for the metadata store.

:class:`Placement` turns a file's chunk map (chunk index -> offset in the volume
its layout gives that chunk) into extents, fills it with clean chunks from the
pool's :class:`memfs.meta.space.ChunkSpace` (all or none) and gives chunks back;
it applies a write lease's report (its size, the chunks it wrote, the end of its
preallocation) and keeps the chunks of data that lives in a backing directory:
which are missing, fetched into reserved chunks, installed, evicted.

:class:`memfs.meta.store.MetaStore` owns the inode table and the namespace; it
hands this class that table and the space, and calls it from its own methods.
Nothing here awaits: each call is atomic on the trio loop, like the store's.
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from memfs.errors import FsError
from memfs.meta import NOT_RESIDENT, Extent, add_run, chunks_between
from memfs.meta.space import ChunkSpace

if TYPE_CHECKING:  # the store imports this module
    from memfs.meta.store import Inode, Watcher

#: what :attr:`Placement.on_backing` reports (journal record kinds)
RESERVE, INSTALL, UNRESERVE, EVICT = "_reserve", "_install", "_unreserve", "_evict"
BACKING_RECORDS = (RESERVE, INSTALL, UNRESERVE, EVICT)


def lost_data(ino: int, offset: int) -> FsError:
    """EIO for bytes of inode *ino* at *offset* that went with a memory server's memory."""
    return FsError(errno.EIO, f"inode {ino}: its data at offset {offset} was lost (its memory "
                              "server restarted blank); truncate or remove the file")


class Placement:
    """The chunk maps of the files of one store, and the chunks of its fetches."""

    def __init__(self, inodes: Mapping[int, Inode], space: ChunkSpace) -> None:
        #: the store's inode table (shared: the store adds and removes inodes)
        self.inodes = inodes
        #: the pool's chunks: free, allocated, or freed and waiting to be zeroed
        self.space = space
        self.chunk_size = space.chunk_size
        #: chunks reserved for a fetch from the backing directory, not yet installed:
        #: owned by no file (a journal snapshot keeps them; recovery frees them)
        self.reserved: set[tuple[int, int]] = set()
        #: called with each change the burst buffer makes outside metadata calls
        #: (``_reserve``, ``_install``, ``_unreserve``, ``_evict``: the journal records them)
        self.on_backing: Callable[[str, list[Any]], None] | None = None
        #: volumes whose memory server restarted blank and is being taken back: their
        #: chunks are in no map handed out (EIO) and none is allocated there
        self.sealed: set[int] = set()
        #: chunks reserved by fetches whose memory was lost (:meth:`lose`): freed when
        #: the fetch ends (it may still write there), never installed
        self.doomed: set[tuple[int, int]] = set()

    def _get(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    # -- a file's chunks ------------------------------------------------------------

    def extents_of(self, i: Inode, offset: int, end: int) -> list[Extent]:
        """The extents of regular file *i* over ``[offset, end)``: its chunks' volume
        memory, holes, and (below ``backed``) bytes only in the backing directory."""
        assert i.chunks is not None and i.layout is not None
        cs = self.chunk_size
        get = i.chunks.get
        layout = i.layout
        # a stripe unit is on one volume; with one volume, so is all of the file
        unit = layout.stripe_size if len(layout.volumes) > 1 else max(end, 1)
        out: list[Extent] = []
        pos = offset
        k = pos // cs
        lost = i.lost
        sealed = self.sealed
        while pos < end:
            base = get(k)
            k += 1
            if base is None:
                if lost and k - 1 in lost:
                    raise lost_data(i.ino, pos)
                vol, voff = (NOT_RESIDENT if pos < i.backed else -1), 0
                stop = min(k * cs, end)
            else:
                # with the chunks after it in its stripe unit (one volume) that continue
                # its memory: one lookup each, not an extent each
                vol, voff = layout.volume_of_chunk(k - 1, cs), base + pos - (k - 1) * cs
                if sealed and vol in sealed:
                    raise lost_data(i.ino, pos)
                last = min(end, (pos // unit + 1) * unit)
                nxt = base + cs
                while k * cs < last and get(k) == nxt:
                    k += 1
                    nxt += cs
                stop = min(k * cs, end)
            add_run(out, pos, stop - pos, vol, voff)
            pos = stop
        return out

    def allocate(self, i: Inode, missing: list[int]) -> None:
        """Allocate all of *missing* or nothing (ENOSPC; EIO for a lost chunk: a fresh
        one would read as zeros where the file's data was)."""
        assert i.chunks is not None
        if i.lost and not i.lost.isdisjoint(missing):
            raise lost_data(i.ino, min(i.lost.intersection(missing)) * self.chunk_size)
        self.check_sealed(i, missing)
        for k, _, voffset in self.take_chunks(i, missing):
            i.chunks[k] = voffset

    def check_sealed(self, i: Inode, ks: Iterable[int]) -> None:
        """EIO if any of chunks *ks* of *i* lies on a sealed volume (before a call
        changes anything: a call that fails is not journaled)."""
        if self.sealed:
            assert i.layout is not None
            cs = self.chunk_size
            if any(i.layout.volume_of_chunk(k, cs) in self.sealed for k in ks):
                raise FsError(errno.EIO, f"inode {i.ino}: a memory server of its layout restarted "
                                         "blank and is being taken back: try again")

    def take_chunks(self, i: Inode, ks: list[int]) -> list[tuple[int, int, int]]:
        """Clean chunks for file chunks *ks*, all or none: ``(k, volume, voffset)``."""
        assert i.layout is not None
        cs = self.chunk_size
        vols = [i.layout.volume_of_chunk(k, cs) for k in ks]
        return list(zip(ks, vols, self.space.take(vols), strict=True))

    def free_chunks(self, inode: Inode, keep_below: int = 0) -> None:
        """Return chunks with index >= *keep_below* to their volumes."""
        if not inode.chunks:
            return
        assert inode.layout is not None
        cs = self.chunk_size
        doomed = [k for k in inode.chunks if k >= keep_below]
        self.space.release([(inode.layout.volume_of_chunk(k, cs), inode.chunks.pop(k))
                            for k in doomed])

    def punch(self, i: Inode, offset: int, end: int) -> list[tuple[int, int, int]]:
        """A hole punched in ``[offset, end)`` of *i* (*end* at most its size): chunks
        wholly inside (or from *offset* to EOF: past EOF a chunk holds zeros) are
        freed, the parts of the others there are returned to zero ``(volume,
        voffset, length)``.  Below ``backed`` a missing chunk means "in the backing
        directory": a hole that reaches ``backed`` lowers it to *offset* (nothing
        past there is read from DIR again; to 0 when nothing is missing below it,
        :meth:`punch_plan`), and chunks wholly inside a hole below
        it are zeroed, not freed (the caller made them resident first, with clean
        chunks where only DIR had them: ``BackedMeta.punch``).  Lost chunks wholly
        inside become holes, or zeros where the caller gave them a chunk."""
        free, zero, backed = self.punch_plan(i, offset, end)
        self.check_sealed(i, zero)  # (before any change: nothing is journaled on failure)
        assert i.chunks is not None
        cs, chunks = self.chunk_size, i.chunks
        if backed != i.backed:
            i.backed = backed
            i.cuts += 1  # (a fetch under way installs nothing: see Residency._fetch_run)
        out = []
        if zero or free:
            assert i.layout is not None
            for k in zero:
                lo, hi = max(offset, k * cs), min(end, (k + 1) * cs)
                out.append((i.layout.volume_of_chunk(k, cs), chunks[k] + lo - k * cs, hi - lo))
            self.space.release([(i.layout.volume_of_chunk(k, cs), chunks.pop(k)) for k in free])
        if i.lost:
            whole = self._whole(i, offset, end)
            i.lost = {k for k in i.lost
                      if not (k * cs < end and whole(k) and (k in chunks or k * cs >= backed))
                      } or None
        return out

    def punch_plan(self, i: Inode, offset: int, end: int) -> tuple[list[int], list[int], int]:
        """What :meth:`punch` would do: the chunks it frees, those it zeroes (in part or
        whole), and ``backed`` after it.  Without ``backed`` a file wholly in the pool
        (staged in, say) has nothing left in DIR to read: it drops to 0."""
        assert i.chunks is not None
        cs = self.chunk_size
        ks = chunks_between(i.chunks, offset // cs, (end - 1) // cs)
        backed = self.backed_after(i, offset, end)
        whole = self._whole(i, offset, end)

        def freed(k: int) -> bool:
            return whole(k) and k * cs >= backed

        return [k for k in ks if freed(k)], [k for k in ks if not freed(k)], backed

    def _whole(self, i: Inode, offset: int, end: int) -> Callable[[int], bool]:
        """Whether a chunk lies wholly inside a hole punched in ``[offset, end)`` (one
        that reaches EOF covers the last chunk: past EOF a chunk holds zeros)."""
        cs, to_eof = self.chunk_size, end >= i.size
        return lambda k: offset <= k * cs and ((k + 1) * cs <= end or to_eof)

    def backed_after(self, i: Inode, offset: int, end: int) -> int:
        """``backed`` once a hole is punched in ``[offset, end)``: 0 if every chunk below
        it is in the pool or wholly inside the hole (nothing left to read from DIR),
        *offset* if the hole reaches it, else as it was."""
        assert i.chunks is not None
        cs, chunks, backed = self.chunk_size, i.chunks, i.backed
        if not backed:
            return 0
        nb = -(-backed // cs)
        a = -(-offset // cs)  # the chunks wholly inside: [a, b)
        b = nb if end >= i.size else min(nb, end // cs)
        b = max(a, b)
        if len(chunks) >= nb - max(0, min(b, nb) - a) and all(
                k in chunks for k in itertools.chain(range(min(a, nb)), range(b, nb))):
            return 0
        return offset if offset < backed <= end else backed

    def seek(self, i: Inode, offset: int, data: bool) -> int:
        """``lseek(SEEK_DATA)`` (*data*) or ``SEEK_HOLE`` in regular file *i* from
        *offset*, chunk by chunk: a chunk is data if it holds memory, is lost (its
        bytes are not known to be zeros), or lies below ``backed`` (in the backing
        directory); the end of the file is a hole.  ENXIO at or past the end, and
        for data when only holes follow."""
        assert i.chunks is not None
        if offset < 0 or offset >= i.size:
            raise FsError(errno.ENXIO)
        cs = self.chunk_size
        chunks, lost = i.chunks, i.lost or ()
        first, last = offset // cs, (i.size - 1) // cs
        backed = -(-i.backed // cs)  # chunks below this one are data

        def is_data(k: int) -> bool:
            return k < backed or k in chunks or k in lost

        if data:
            if is_data(first):
                return offset
            # Step as far as there are data chunks, then scan them: at most the gap to
            # the next data either way, so a copy seeking through a file stays linear.
            stop = min(last, first + len(chunks) + len(lost))
            found = next((k for k in range(first + 1, stop + 1) if is_data(k)), None)
            if found is None and stop < last:
                found = min((k for k in (*chunks, *lost) if stop < k <= last), default=None)
            if found is None:
                raise FsError(errno.ENXIO)
            return found * cs
        k = max(first, backed)  # (one step per data chunk from there)
        while k <= last and (k in chunks or k in lost):
            k += 1
        return min(i.size, max(offset, k * cs))

    # -- memory lost with a memory server that restarted blank ---------------------------

    def holding(self, volumes: set[int]) -> list[int]:
        """Regular files with chunks on *volumes*."""
        cs = self.chunk_size
        out = []
        for i in self.inodes.values():
            if i.chunks and i.layout is not None \
                    and not volumes.isdisjoint(i.layout.volumes) \
                    and any(i.layout.volume_of_chunk(k, cs) in volumes for k in i.chunks):
                out.append(i.ino)
        return out

    def lose(self, volumes: set[int]) -> list[int]:
        """The memory of *volumes* is gone (their server restarted blank; clients were
        told to let go of every cached map first).  Every file's chunks there leave
        its map: those below EOF become *lost* (EIO, see :func:`lost_data`), those past
        it (preallocation) are merely dropped.  Fetches under way into them get
        nothing installed (:meth:`install`), and their chunks are freed when they
        end (they may still write there).  The chunks go to the scrubber like any
        freed chunk, so the invariant (allocated memory reads as zeros) does not rest
        on the server's memory being blank.  Returns the files that lost data."""
        cs = self.chunk_size
        freed: list[tuple[int, int]] = []
        damaged = []
        for ino in self.holding(volumes):
            i = self.inodes[ino]
            assert i.chunks is not None and i.layout is not None
            gone = [k for k in i.chunks if i.layout.volume_of_chunk(k, cs) in volumes]
            for k in gone:
                freed.append((i.layout.volume_of_chunk(k, cs), i.chunks.pop(k)))
            below = [k for k in gone if k * cs < i.size]
            if below:
                i.lost = (i.lost or set()).union(below)
                damaged.append(ino)
        fetching = {c for c in self.reserved if c[0] in volumes}
        self.reserved -= fetching
        self.doomed |= fetching
        self.space.release(freed)
        return damaged

    def cut_lost(self, i: Inode, size: int) -> None:
        """A truncate to *size*: lost chunks wholly past it are gone for good."""
        assert i.lost is not None
        keep = (size + self.chunk_size - 1) // self.chunk_size
        i.lost = {k for k in i.lost if k < keep} or None

    # -- what write leases wrote, and their preallocation -----------------------------

    def settle(
        self, ino: int, size: int, mtime_ns: int, trim: bool, span: tuple[int, int],
        watcher: Watcher | None,
    ) -> bool:
        """A write lease's size and mtime (``size < 0``: unknown), the bytes its holder
        wrote under it (*span*, ``[lo, hi)``; ``lo < 0``: unknown, anywhere; empty:
        nothing) and, with *trim*, the end of its preallocation: chunks wholly past
        EOF are freed.  *watcher*: the store's.  True if anything changed."""
        i = self.inodes.get(ino)
        if i is None or i.chunks is None:
            return False
        changed = False
        if size > i.size:
            # Only ever grows: a writer never shrinks a file without truncate.
            i.size = size
            changed = True
        if mtime_ns > i.mtime_ns and size >= 0:
            # (A setattr the writer made after those writes, under its lease, may have
            # arrived first: its ctime stays.)
            i.mtime_ns = mtime_ns
            i.ctime_ns = max(i.ctime_ns, mtime_ns)
            changed = True
        if trim and i.chunks:
            cs = self.chunk_size
            keep = (i.size + cs - 1) // cs
            if max(i.chunks) >= keep:
                self.free_chunks(i, keep_below=keep)
                changed = True
                if watcher is not None:
                    watcher.truncated(ino)  # space ahead counted dirty: not any more
        lo, hi = span
        if watcher is not None and i.chunks and (lo < 0 or hi > lo):
            # Write-back (the only watcher): the holder wrote without asking (its size
            # and mtime need not move: an overwrite, another node's clock): a new
            # version, the span counted dirty.  Changed, so that it is journaled: a
            # replay must find the file dirty too.
            if lo < 0:
                watcher.rewritten(ino)
            else:
                self._wrote_existing(i, lo // self.chunk_size, (hi - 1) // self.chunk_size,
                                     watcher)
            changed = True
        return changed

    @staticmethod
    def _wrote_existing(i: Inode, first: int, last: int, watcher: Watcher) -> None:
        """Tell the watcher of chunks *first*..*last* of *i* that exist, in runs (a span
        is the hull of a lease's writes: sparse ones would count chunks that do not)."""
        assert i.chunks is not None
        start = prev = -2
        for k in chunks_between(i.chunks, first, last):
            if k != prev + 1:
                if start >= 0:
                    watcher.wrote(i.ino, start, prev)
                start = k
            prev = k
        if start >= 0:
            watcher.wrote(i.ino, start, prev)

    def preallocated(self) -> list[int]:
        """Regular files holding chunks wholly past their EOF (unused preallocation)."""
        cs = self.chunk_size
        return [
            i.ino for i in self.inodes.values()
            if i.chunks and max(i.chunks) >= (i.size + cs - 1) // cs
        ]

    # -- data that lives in a backing directory (memfs.flush) ----------------------

    def missing(self, ino: int, offset: int, length: int) -> list[int]:
        """Chunks of ``[offset, offset+length)`` whose data is only in the backing directory."""
        i = self._get(ino)
        if not i.backed or i.chunks is None or length <= 0:
            return []
        cs = self.chunk_size
        # Whole chunks: a write past ``backed`` into its last chunk needs the chunk too.
        last = min((offset + length - 1) // cs, (i.backed - 1) // cs)
        lost = i.lost or ()  # (newer than the backing copy: never fetched from it)
        return [k for k in range(offset // cs, last + 1) if k not in i.chunks and k not in lost]

    def reserve(self, ino: int, ks: list[int]) -> list[tuple[int, int, int]]:
        """Allocate chunks for fetching *ks* of *ino*: ``(k, volume, voffset)``, not yet
        part of the file (:meth:`install` makes them so).  ENOSPC/SpaceBusy like a write."""
        i = self._get(ino)
        assert i.chunks is not None
        self.check_sealed(i, ks)
        placed = self.take_chunks(i, ks)
        self.reserved.update((vol, voff) for _, vol, voff in placed)
        if self.on_backing is not None:
            self.on_backing(RESERVE, [ino, *(x for p in placed for x in p)])
        return placed

    def install(self, ino: int, k: int, volume: int, voffset: int) -> bool:
        """Make fetched chunk *k* part of *ino*; False (chunk freed) if no longer wanted."""
        if self.on_backing is not None:
            self.on_backing(INSTALL, [ino, k, volume, voffset])
        if (volume, voffset) in self.doomed:  # its memory was lost meanwhile (:meth:`lose`)
            self.doomed.discard((volume, voffset))
            self.space.release([(volume, voffset)])
            return False
        self.reserved.discard((volume, voffset))
        i = self.inodes.get(ino)
        if i is None or i.chunks is None or k in i.chunks or k * self.chunk_size >= i.backed:
            self.space.release([(volume, voffset)])
            return False
        i.chunks[k] = voffset
        return True

    def unreserve(self, volume: int, voffset: int) -> None:
        """Give back a reserved chunk (it may hold partial data: it is scrubbed first)."""
        if self.on_backing is not None:
            self.on_backing(UNRESERVE, [volume, voffset])
        self.reserved.discard((volume, voffset))
        self.doomed.discard((volume, voffset))  # (its memory was lost meanwhile)
        self.space.release([(volume, voffset)])

    def release_reserved(self) -> None:
        """Recovery: fetches that were under way died with the server; their chunks
        (maybe partly written) go to the scrubber."""
        self.space.release(sorted(self.reserved | self.doomed))
        self.reserved.clear()
        self.doomed.clear()

    def evict(self, ino: int) -> int:
        """Drop the pool copy of clean file *ino*: its data is in the backing directory.
        Returns the number of chunks freed."""
        i = self._get(ino)
        if not i.chunks:
            return 0
        if self.on_backing is not None:
            self.on_backing(EVICT, [ino])
        n = len(i.chunks)
        i.backed = i.size
        self.free_chunks(i)
        return n

    def replay_backing(self, kind: str, args: list[int]) -> None:
        """Apply a change recorded through :attr:`on_backing` (journal replay); it must
        come out as it did (allocation is deterministic), else ValueError."""
        if kind == RESERVE:
            ino, flat = args[0], args[1:]
            want = [tuple(flat[j : j + 3]) for j in range(0, len(flat), 3)]
            got = self.reserve(ino, [k for k, _, _ in want])
            if [tuple(p) for p in got] != want:
                raise ValueError(f"reserve for inode {ino} gave {got}, recorded {want}")
        elif kind == INSTALL:
            self.install(*args)
        elif kind == UNRESERVE:
            self.unreserve(*args)
        elif kind == EVICT:
            self.evict(args[0])
        else:
            raise ValueError(f"not a burst-buffer record: {kind!r}")
