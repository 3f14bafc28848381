"""The burst buffer in the mds journal: nothing a client was told is lost to a crash.

``memfs mds --backing DIR --journal JDIR``.  The journal already makes the store
exact after a restart (every call is recorded, :mod:`memfs.meta.journal`); this
adds what write-back needs, so that a SIGKILLed mds resumes write-back where it
was:

* the store's own changes outside calls, recorded by the store through
  ``on_backing`` (fetches: ``_reserve``/``_install``/``_unreserve``; ``_evict``);
* which files are dirty and which namespace changes DIR has not seen yet: the
  :class:`ChangeTracker` is the store's watcher *during replay* too, so replaying
  the calls rebuilds both exactly (paths come from the replayed store, which is
  the live one); ``_wb`` records a file written back, ``_nsdone`` the head of the
  namespace queue applied, ``_nsstep`` the progress of a RENAME_EXCHANGE;
* snapshots hold the same (dirty files, the queue) beside the store's state.

The durability rule that makes replay safe: nothing is changed in DIR before
every record up to that moment is durable (:meth:`BackingJournal.durable`,
awaited before each namespace operation and each publish).  So at a crash DIR is
at most one change ahead of the journal: one namespace operation applied but not
recorded (re-applying it finds DIR already so: skipped, or the same result;
an exchange resumes from its recorded step), or one copy published but not
recorded clean (the file is still dirty: written again).  Freed chunks are
likewise zeroed only once the record that freed them is durable (the scrubber
waits), so a crash never hands back a file whose memory was zeroed.

DIR's tree is entered into the store once, at the first start, and a snapshot
written at once; after a restart the journal is authoritative and DIR is not
scanned again.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any

from memfs.backing.ops import NS_DONE, NS_STEP, WRITTEN_BACK, NsOp
from memfs.backing.tracker import ChangeTracker
from memfs.config import FlushConfig
from memfs.meta.journal import Journal, JournalError
from memfs.meta.store import MetaStore

log = logging.getLogger(__name__)


class BackingJournal:
    """The burst buffer's part of the journal: a :class:`memfs.meta.journal.Extension`
    for recovery and snapshots, and the :class:`memfs.backing.ops.Recorder` that
    write-back and the mirror record through."""

    journaled = True

    def __init__(self, cfg: FlushConfig, journal: Journal) -> None:
        self.cfg = cfg
        self.dir = os.path.realpath(cfg.backing)
        self.journal = journal
        #: rebuilt by replay; BackedMeta goes on with these very objects
        self.tracker: ChangeTracker | None = None
        self.ops: collections.deque[NsOp] = collections.deque()
        #: DIR's tree is in the store (entered at the first start)
        self.loaded = False

    # -- Extension ------------------------------------------------------------------------

    def attach(self, store: MetaStore, state: Any, fresh: bool) -> None:
        if state is None and not fresh:
            raise JournalError("it was written by an mds without --backing; a backing "
                               "directory can only be added to a new journal")
        if state is not None:
            if not isinstance(state, dict) or not isinstance(state.get("dir"), str):
                raise JournalError("its burst-buffer state is malformed")
            if state["dir"] != self.dir:
                raise JournalError(f"it belongs to backing directory {state['dir']}, "
                                   f"not {self.dir}")
            self.loaded = bool(state.get("loaded"))
        tracker = ChangeTracker(
            store, dirty_max=1 << 62, delay=self.cfg.delay, queue=self.ops.append,
            touch=_nothing, forget=_nothing, clock=time.monotonic,
        )
        tracker.replaying = True
        if state is not None:
            try:
                for ino in state.get("dirty", ()):
                    i = store.inodes.get(ino)
                    d = tracker.mark(ino) if i is not None else None
                    if d is not None and i is not None and i.chunks:
                        d.chunks.update(i.chunks)  # at most what it has: counts for the cap
                        tracker.dirty_chunks += len(d.chunks)
                self.ops.extend(NsOp.from_plain(v) for v in state.get("ops", ()))
            except (TypeError, ValueError) as exc:
                raise JournalError(f"its burst-buffer state is malformed: {exc!r}") from None
        self.tracker = tracker
        store.watcher = tracker

    def replay(self, method: str, args: list[Any]) -> bool:
        tracker = self.tracker
        assert tracker is not None
        try:
            if method == WRITTEN_BACK:
                tracker.replay_clean(int(args[0]))
            elif method == NS_DONE:
                self.ops.popleft()
            elif method == NS_STEP:
                self.ops[0].plan, self.ops[0].step = int(args[0]), int(args[1])
            else:
                return False
        except (IndexError, TypeError, ValueError) as exc:
            raise JournalError(f"{method} record does not replay: {exc!r}") from None
        return True

    def dump(self) -> Any:
        tracker = self.tracker
        assert tracker is not None
        return {
            "dir": self.dir,
            "loaded": self.loaded,
            # pinned files count as dirty: written back once the exclusion is lifted
            "dirty": [*tracker.dirty, *(x for x in tracker.pinned if x not in tracker.dirty)],
            "ops": [op.to_plain() for op in self.ops],
        }

    # -- Recorder -----------------------------------------------------------------------

    def note(self, kind: str, args: list[Any]) -> None:
        self.journal.append(0, kind, args)

    async def durable(self) -> None:
        await self.journal.wait_durable(self.journal.seq)


def _nothing(ino: int) -> None:
    pass
