"""``memfs flush`` and ``memfs stage-in`` requests: tickets and their progress.

A request names trees; a ticket remembers which files it waits for and how much
there was, so the CLI can poll :meth:`Tickets.progress` and draw a progress
line.  Stage-in tickets also keep their files in memory in preference to others
(residency spares them at eviction) while the ticket lives; a ticket nobody
asked about for :data:`TICKET_TTL` seconds expires.  The stager tasks fetch the
named files whole, one file per task at a time.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

from memfs.backing.mirror import NamespaceMirror
from memfs.backing.ops import ErrorLog
from memfs.backing.residency import Residency
from memfs.backing.status import BackingError, TicketProgress
from memfs.backing.surface import BackingStore
from memfs.backing.tracker import ChangeTracker
from memfs.backing.writeback import WriteBack
from memfs.errors import FsError
from memfs.meta.store import ROOT_INO

log = logging.getLogger(__name__)

TICKET_TTL = 600.0
#: inodes looked at between two checkpoints of a whole-tree walk (a walk of a
#: million-file tree must not hold up every FUSE request and client call)
WALK_STEP = 4096


@dataclass(eq=False)
class Ticket:
    flush: bool  # else stage-in
    inos: set[int]
    total_files: int
    total_bytes: int
    touched: float
    #: flush: namespace operations queued before the request (must be applied too)
    ns_target: int = 0
    #: stage-in: every file named, kept in memory in preference while the ticket lives
    keep: set[int] = field(default_factory=set)
    #: stage-in: files whose fetch failed -> (path, why)
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)


class Tickets:
    """Live requests, and the stagers that serve stage-in requests."""

    def __init__(
        self, store: BackingStore, tracker: ChangeTracker, mirror: NamespaceMirror,
        residency: Residency, writeback: WriteBack, errors: ErrorLog,
        *, clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.tracker = tracker
        self.mirror = mirror
        self.residency = residency
        self.writeback = writeback
        self.errors = errors
        self.clock = clock
        self._tickets: dict[int, Ticket] = {}
        self._ids = itertools.count(1)
        self._send, self._recv = trio.open_memory_channel[tuple[int, int]](1 << 20)

    def resolve(self, p: str) -> int:
        """The inode of *p*, a path relative to the mount."""
        raw = os.fsencode(p)
        if raw.startswith(b"/") or b".." in raw.split(b"/"):
            raise FsError(errno.EINVAL, f"{p!r}: expected a path relative to the mount")
        try:
            return self.store.resolve(raw).ino
        except FsError as exc:
            raise FsError(exc.errno, f"{p}: {os.strerror(exc.errno)}") from None

    async def _walk(self, roots: Iterable[int]) -> list[int]:
        """Every inode under *roots* (they included), letting other tasks run every
        WALK_STEP inodes; some may be gone by the time the list is returned."""
        inodes = self.store.inodes
        stack = list(roots)
        out: list[int] = []
        while stack:
            ino = stack.pop()
            i = inodes.get(ino)
            if i is None:
                continue
            out.append(ino)
            if i.children:
                stack.extend(i.children.values())
            if len(out) % WALK_STEP == 0:
                await trio.lowlevel.checkpoint()
        return out

    async def flush(self, roots: list[int]) -> int:
        """Write back everything dirty under *roots* now."""
        dirty = self.tracker.dirty
        if roots == [ROOT_INO]:
            inos = set(dirty)
        else:
            inos = {ino for ino in await self._walk(roots) if ino in dirty}
        self.writeback.force(inos)
        self.mirror.retry_now()
        t = Ticket(True, inos, len(inos), sum(len(dirty[x].chunks) for x in inos) * self.tracker.chunk_size,
                   self.clock(), ns_target=self.mirror.queued)
        return self._add(t)

    async def stage_in(self, roots: list[int]) -> int:
        """Fetch every file under *roots* into the pool, in the background."""
        inodes = self.store.inodes
        found = await self._walk(roots)
        named = {ino for ino in found if (i := inodes.get(ino)) is not None and i.chunks is not None}
        inos = {ino for ino in named
                if (i := inodes[ino]).backed and self.store.missing(ino, 0, i.backed)}
        t = Ticket(False, inos, len(inos), sum(self.residency.missing_bytes(x) for x in inos),
                   self.clock(), keep=named)
        for ino in named:
            self.residency.kept[ino] += 1
            self.residency.touch(ino)
        tid = self._add(t)
        for ino in sorted(inos):
            self._send.send_nowait((ino, tid))
        return tid

    def _add(self, t: Ticket) -> int:
        tid = next(self._ids)
        self._tickets[tid] = t
        return tid

    def expire(self) -> None:
        now = self.clock()
        for tid in [k for k, t in self._tickets.items() if now - t.touched > TICKET_TTL]:
            self.residency.kept -= collections.Counter(self._tickets.pop(tid).keep)

    def progress(self, tid: object) -> TicketProgress:
        t = self._tickets.get(tid) if isinstance(tid, int) else None
        if t is None:
            raise FsError(errno.ENOENT, f"no ticket {tid!r}")
        t.touched = self.clock()
        cs = self.tracker.chunk_size
        if t.flush:
            dirty = self.tracker.dirty
            left = [ino for ino in t.inos if ino in dirty]
            nbytes = sum(len(dirty[x].chunks) for x in left) * cs
            done = not left and self.mirror.applied >= t.ns_target
        else:
            left = [ino for ino in t.inos if ino in self.store.inodes]
            t.inos.intersection_update(left)
            nbytes = sum(self.residency.missing_bytes(x) for x in left)
            done = not left
        paths = {os.fsdecode(p) for ino in left for p in self.store.paths(ino)} if self.errors else set()
        return TicketProgress(
            done=done, files=len(left), bytes=nbytes,
            total_files=t.total_files, total_bytes=t.total_bytes,
            failed=tuple(BackingError(p, e) for p, e in t.failed.values()),
            errors=tuple(self.errors.entries(paths)),
        )

    async def staging(self) -> tuple[int, int]:
        """(files, bytes) stage-in requests still wait for."""
        stage = [t for t in self._tickets.values() if not t.flush]
        files = nbytes = 0
        for t in stage:
            for ino in list(t.inos):
                files += 1
                nbytes += self.residency.missing_bytes(ino)
                if files % WALK_STEP == 0:
                    await trio.lowlevel.checkpoint()
        return files, nbytes

    async def stager(self) -> None:
        """Fetch the files of stage-in requests, whole, one at a time."""
        while True:
            ino, ticket = await self._recv.receive()
            i = self.store.inodes.get(ino)
            try:
                if i is not None and i.backed:
                    # The whole file at once: its copy in DIR is opened once (and the
                    # namespace lock taken once), not once per STEP.
                    await self.residency.ensure_resident(ino, 0, i.backed)
            except FsError as exc:
                if exc.errno != errno.ENOENT:  # removed meanwhile: nothing to stage
                    where = os.fsdecode(self.store.path(ino) or b"(unlinked)")
                    log.warning("stage-in of %s: %s", where, exc)
                    t = self._tickets.get(ticket)
                    if t is not None:
                        t.failed[ino] = (where, exc.args[1])
            except Exception as exc:  # a bug: the backing copy is intact; report, go on
                self.errors.bug(f"stage-in of inode {ino}", exc)
                t = self._tickets.get(ticket)
                if t is not None:
                    t.failed[ino] = (os.fsdecode(self.store.path(ino) or b"(unlinked)"),
                                     f"internal error: {exc!r}")
            t = self._tickets.get(ticket)
            if t is not None:
                t.inos.discard(ino)
