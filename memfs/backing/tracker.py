"""Which files need writing back: the store's watcher.

The store calls a :class:`ChangeTracker` after every change
(:class:`memfs.meta.store.Watcher`; one rule: after the change is complete).
A change to a regular file's data or attributes makes it *dirty*: a new
version, stamped with the clock, with the chunks it wrote counted against the
dirty cap.  A change to the namespace (mkdir, rmdir, unlink, rename, symlink,
mknod, attributes of a clean file) becomes an :class:`memfs.backing.ops.NsOp`
for the mirror, with DIR paths computed at that moment.  Files in trees marked
``user.memfs.flush=off`` are *pinned* instead: never written back file by file.

Everything here is synchronous (the store calls it from inside its methods);
the scheduler and the writers waiting on the cap are woken through events.
"""

from __future__ import annotations

import collections
import itertools
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from memfs.backing.ops import WRITTEN_BACK, NoRecord, NsKind, NsOp, Recorder
from memfs.backing.surface import BackingStore
from memfs.meta import chunks_between
from memfs.meta.store import ROOT_INO

#: ``setfattr -n user.memfs.flush -v off DIR``: never write this tree back file by file
EXCLUDE_XATTR = b"user.memfs.flush"


@dataclass(eq=False, slots=True)
class Dirty:
    """A file whose pool copy differs from DIR's."""

    version: int
    since: float
    chunks: set[int] = field(default_factory=set)
    busy: bool = False  # queued for or held by a worker
    failures: int = 0
    retry_at: float = 0.0


class ChangeTracker:
    """Dirty files (least recently changed first), their versions and chunks, the
    pinned files, and the namespace operations the store's changes imply."""

    def __init__(
        self, store: BackingStore, *, dirty_max: int, delay: float,
        queue: Callable[[NsOp], None], touch: Callable[[int], None],
        forget: Callable[[int], None], clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.chunk_size = store.chunk_size
        self.dirty_max = dirty_max
        self.delay = delay
        self.clock = clock
        #: the mirror's queue, residency's use (LRU) and forgetting of a file
        self._queue = queue
        self._touch = touch
        self._forget = forget
        #: records a file written back (the mds journal; see memfs.backing.recovery)
        self.recorder: Recorder = NoRecord()
        #: journal replay: open counts are not journaled, so ``keep`` assumes open
        self.replaying = False
        self._versions = itertools.count(1)
        self.dirty: collections.OrderedDict[int, Dirty] = collections.OrderedDict()
        self.dirty_chunks = 0
        #: files in trees excluded from write-back (``user.memfs.flush=off``)
        self.pinned: set[int] = set()
        #: writers waiting for the dirty cap to make room
        self.writers_waiting = 0
        self._wake = trio.Event()  # the scheduler: something to do
        self._cleaned = trio.Event()  # writers waiting on the cap
        #: dirty data taken off the cap, and steps write-back copied (what a call
        #: waiting for room counts as progress: memfs.backing.residency)
        self.progress = 0

    def connect(
        self, *, queue: Callable[[NsOp], None], touch: Callable[[int], None],
        forget: Callable[[int], None],
    ) -> None:
        """Hand a tracker rebuilt by journal replay to the live parts."""
        self._queue, self._touch, self._forget = queue, touch, forget

    # -- for the scheduler and the writers ---------------------------------------------

    def wake(self) -> None:
        """Something may be due: the scheduler looks again."""
        self._wake.set()

    async def wait_wake(self, at_most: float) -> None:
        with trio.move_on_after(at_most):
            await self._wake.wait()
        self._wake = trio.Event()

    async def wait_cleaned(self) -> None:
        """A writer waits for write-back to take dirty chunks off the cap."""
        self.writers_waiting += 1
        self._wake.set()
        try:
            await self._cleaned.wait()
        finally:
            self.writers_waiting -= 1

    def _signal_cleaned(self) -> None:
        self.progress += 1
        self._cleaned.set()
        self._cleaned = trio.Event()

    @property
    def pressing(self) -> bool:
        """Dirty data past half the cap: write back without waiting for the delay."""
        return self.dirty_chunks * self.chunk_size >= self.dirty_max // 2

    def version(self, ino: int) -> int:
        d = self.dirty.get(ino)
        return -1 if d is None else d.version

    def clean(self, ino: int, v: int) -> None:
        """Version *v* of *ino* is in DIR: clean, unless it changed since."""
        d = self.dirty.get(ino)
        if d is None or d.version != v:
            return
        del self.dirty[ino]
        self.dirty_chunks -= len(d.chunks)
        self.recorder.note(WRITTEN_BACK, [ino])
        self._signal_cleaned()

    def pin(self, ino: int, v: int) -> None:
        """Version *v* of *ino* is in an excluded tree: not written back, pinned.  Not
        recorded: after a restart the file is found dirty and pinned again."""
        d = self.dirty.get(ino)
        if d is None or d.version != v:
            return
        del self.dirty[ino]
        self.dirty_chunks -= len(d.chunks)
        self.pinned.add(ino)
        self._signal_cleaned()

    def replay_clean(self, ino: int) -> None:
        """Journal replay: the file was written back here (whatever its version)."""
        d = self.dirty.pop(ino, None)
        if d is not None:
            self.dirty_chunks -= len(d.chunks)

    def mark(self, ino: int) -> Dirty | None:
        """*ino* changed: a new version (None: pinned, not written back)."""
        if ino in self.pinned and self.excluded(ino):
            return None
        self.pinned.discard(ino)
        d = self.dirty.get(ino)
        now = self.clock()
        if d is None:
            d = self.dirty[ino] = Dirty(next(self._versions), now)
        else:
            d.version = next(self._versions)
            d.since = now
            self.dirty.move_to_end(ino)
        # The scheduler sleeps until the oldest change is due; a change now is due
        # no sooner, so it only needs waking when it had nothing to wait for (a task
        # switch per write is measurable on the create path).
        if len(self.dirty) == 1 or not self.delay:
            self._wake.set()
        return d

    def _add_chunks(self, d: Dirty, ks: collections.abc.Iterable[int]) -> None:
        before = len(d.chunks)
        d.chunks.update(ks)
        self.dirty_chunks += len(d.chunks) - before

    # -- exclusion (user.memfs.flush=off) ------------------------------------------------

    def excluded(self, ino: int) -> bool:
        """Is *ino* in a tree marked ``user.memfs.flush=off``?"""
        return self.exclusion()(ino)

    def exclusion(self) -> Callable[[int], bool]:
        """:meth:`excluded` for one walk over many files: each directory is looked
        at once (the answers hold until the next xattr change or rename)."""
        inodes = self.store.inodes
        known: dict[int, bool] = {}

        def excluded(ino: int) -> bool:
            path = []
            answer = False
            while True:
                if ino in known:
                    answer = known[ino]
                    break
                i = inodes.get(ino)
                if i is None:
                    break
                path.append(ino)
                if i.xattrs and i.xattrs.get(EXCLUDE_XATTR) == b"off":
                    answer = True
                    break
                if ino == ROOT_INO:
                    break
                ino = i.parent
            for x in path:
                known[x] = answer
            return answer

        return excluded

    def unpin(self) -> None:
        """An exclusion was lifted: pinned files are written back after all."""
        for ino in list(self.pinned):
            if not self.excluded(ino):
                self.pinned.discard(ino)
                i = self.store.inodes.get(ino)
                if i is not None and i.chunks is not None:
                    d = self.mark(ino)
                    if d is not None:
                        self._add_chunks(d, i.chunks)

    # -- the store's Watcher ---------------------------------------------------------------

    def wrote(self, ino: int, first: int, last: int) -> None:
        d = self.mark(ino)
        if d is not None:
            self._add_chunks(d, range(first, last + 1))
            if self.pressing:
                self._wake.set()  # past half the cap: write back without waiting
        self._touch(ino)

    def rewritten(self, ino: int) -> None:
        d = self.mark(ino)
        i = self.store.inodes.get(ino)
        # Counted once per version copied, not per report: a holder reports every
        # ~50 ms, and a large file has a million chunks.
        if d is not None and i is not None and i.chunks and len(d.chunks) < len(i.chunks):
            last = (i.size - 1) // self.chunk_size
            self._add_chunks(d, (k for k in i.chunks if k <= last))
            if self.pressing:
                self._wake.set()
        self._touch(ino)

    def truncated(self, ino: int) -> None:
        d = self.mark(ino)
        i = self.store.inodes.get(ino)
        if d is not None and i is not None and d.chunks:
            keep = -(-i.size // self.chunk_size)
            gone = {k for k in d.chunks if k >= keep}
            d.chunks -= gone
            self.dirty_chunks -= len(gone)
            if gone:
                self._signal_cleaned()  # writers waiting on the cap may go on

    def punched(self, ino: int, first: int, last: int) -> None:
        d = self.mark(ino)
        i = self.store.inodes.get(ino)
        if d is not None and i is not None and i.chunks is not None:
            chunks = i.chunks
            gone = [k for k in chunks_between(d.chunks, first, last) if k not in chunks]
            d.chunks.difference_update(gone)
            self.dirty_chunks -= len(gone)
            self._add_chunks(d, chunks_between(chunks, first, last))
            if gone:
                self._signal_cleaned()
            if self.pressing:
                self._wake.set()
        self._touch(ino)

    def attrs_changed(self, ino: int) -> None:
        i = self.store.inodes.get(ino)
        if i is None:
            return
        if ino in self.dirty or ino in self.pinned:
            # The copy carries the attributes: just a new version.  (A pinned file
            # too: replay finds it dirty, not pinned, and must queue the same.)
            self.mark(ino)
            return
        path = self.store.path(ino)
        if path is not None and not self.excluded(ino):
            self._queue(NsOp(NsKind.ATTRS, path, mode=i.mode, uid=i.uid, gid=i.gid,
                             mtime_ns=i.mtime_ns))

    def created(self, ino: int) -> None:
        i = self.store.inodes[ino]
        if stat.S_ISREG(i.mode):
            self.mark(ino)
            return
        paths = self.store.paths(ino)
        if not paths or self.excluded(ino):
            return
        path = paths[-1]  # a new hard link is the last name
        if stat.S_ISDIR(i.mode):
            self._queue(NsOp(NsKind.MKDIR, path, mode=i.mode, uid=i.uid, gid=i.gid))
        elif stat.S_ISLNK(i.mode):
            self._queue(NsOp(NsKind.SYMLINK, path, target=i.target or b"", uid=i.uid,
                             gid=i.gid, mtime_ns=i.mtime_ns))
        else:
            self._queue(NsOp(NsKind.MKNOD, path, mode=i.mode, rdev=i.rdev, uid=i.uid, gid=i.gid))

    def removed(self, parent: int, name: bytes, ino: int, directory: bool) -> None:
        path = self.store.entry_path(parent, name)
        if path is None:
            return
        self._queue(NsOp(NsKind.RMDIR if directory else NsKind.UNLINK, path,
                         keep=self.keep(ino)))

    def renamed(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes,
        exchange: bool, replaced: int,
    ) -> None:
        old = self.store.entry_path(parent, name)
        new = self.store.entry_path(new_parent, new_name)
        if old is None or new is None:
            return
        # The replaced file's copy in DIR is at the target path until the rename.
        self._queue(NsOp(NsKind.EXCHANGE if exchange else NsKind.RENAME, old, new,
                         keep=self.keep(replaced) if replaced else 0, keep_from=new))
        if self.pinned:
            d = self.store.inodes.get(new_parent)
            moved = d.children.get(new_name) if d is not None and d.children else None
            i = self.store.inodes.get(moved) if moved is not None else None
            if i is not None and (i.ino in self.pinned or i.children) and not self.excluded(i.ino):
                self.unpin()  # moved out of an excluded tree: written back after all

    def destroyed(self, ino: int) -> None:
        d = self.dirty.pop(ino, None)
        if d is not None:
            self.dirty_chunks -= len(d.chunks)
            self._signal_cleaned()
        self.pinned.discard(ino)
        self._forget(ino)

    def keep(self, ino: int) -> int:
        """*ino* lost its last name while still open, with data only in DIR: it must
        be fetched before DIR's copy goes (0: nothing to keep)."""
        i = self.store.inodes.get(ino)
        if i is None or (i.opens <= 0 and not self.replaying) or i.nlink > 0 or not i.backed:
            return 0
        return ino if self.store.missing(ino, 0, i.backed) else 0
