"""One session at a time per file for calls that may wait inside their change.

A change is recalled from other clients and then applied with no await in
between: what they fetch while the recall is under way is marked not
cacheable (:mod:`memfs.meta.leases`).  Through a backing directory
(:class:`memfs.backing.meta.BackedMeta`) that no longer holds: a write may
wait for a fetch from DIR, for write-back (the dirty cap) or for room
(eviction), a truncate for the fetch of its last chunk, all after the recall.
Another client that asked about the file meanwhile got the state from before
the change, cacheable, and kept it after the change returned (a file read
right after another node's close came out short); a chunk map handed out
meanwhile could name chunks that the change then freed.

So the server (only with a backing directory) runs the calls that may wait
(``map_read``, ``map_write``, ``allocate_ahead``, ``truncate``) under a
per-inode gate, from before their recall until their reply is built:

* a change (``map_write``, ``allocate_ahead``: ``CHANGE``) shuts out the
  other sessions' changes of the file, and while it runs, what other sessions
  are sent of the file is not cacheable (:meth:`LeaseTable.begin_change`);
  their chunk maps may still be read meanwhile (the change frees none of the
  file's chunks, and a map sent then is used once);
* a truncate (``CUT``) does the same, and also waits for the other sessions'
  ``map_read`` calls under way and keeps new ones out until it is done (a map
  sent meanwhile could name chunks it then frees); new readers also wait
  and changes wait behind a cut that is waiting, so it is not starved;
* a session's calls never wait for the gate that session holds: its own
  client orders them (one connection runs its calls in order anyway).

A call waits at most until its deadline, then is answered EINPROGRESS, like a
call that waited that long for DIR itself: the client asks again.  (A reader
kept out by a cut may hold a kernel page lock that the recall of its node then
waits for; the node answers the recall within its bound anyway, 1.5 s.)
"""

from __future__ import annotations

import collections
import errno
from dataclasses import dataclass, field

import trio

from memfs.errors import FsError
from memfs.meta.leases import Holder, LeaseTable

READ, CHANGE, CUT = "read", "change", "cut"


@dataclass(eq=False, slots=True)
class _Gate:
    #: sessions reading maps (map_read) -> how many of their calls
    readers: collections.Counter[Holder] = field(default_factory=collections.Counter)
    #: the session changing the file, with how many changes and cuts
    writer: Holder | None = None
    writes: int = 0
    cuts: int = 0
    #: cuts of other sessions waiting to get in (new readers wait behind them)
    wanting: collections.Counter[Holder] = field(default_factory=collections.Counter)
    #: calls waiting (the gate is kept while any does)
    waiters: int = 0
    changed: trio.Event = field(default_factory=trio.Event)

    def admits(self, session: Holder, mode: str) -> bool:
        other_writer = self.writer is not None and self.writer is not session
        if mode == READ:
            return (not (other_writer and self.cuts)
                    and all(s is session for s in self.wanting))
        if other_writer:
            return False
        if mode == CHANGE:
            return all(s is session for s in self.wanting)  # a waiting cut goes first
        return all(s is session for s in self.readers)

    def idle(self) -> bool:
        return not self.readers and self.writer is None and not self.waiters

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class ChangeGates:
    """Per-inode gates of the calls that may wait inside their change; see module doc."""

    def __init__(self, leases: LeaseTable) -> None:
        self.leases = leases
        self._gates: dict[int, _Gate] = {}

    async def enter(self, session: Holder, ino: int, *, mode: str, deadline: float) -> None:
        """Wait for the gate of *ino* (*mode*: READ, CHANGE or CUT);
        FsError(EINPROGRESS) at *deadline*."""
        g = self._gates.get(ino)
        if g is None:
            g = self._gates[ino] = _Gate()
        if not g.admits(session, mode):
            g.waiters += 1
            if mode == CUT:
                g.wanting[session] += 1
            taking = False
            try:
                with trio.move_on_at(deadline):
                    while not g.admits(session, mode):
                        await g.changed.wait()
                taking = g.admits(session, mode)
            finally:
                self._unwait(g, ino, session, mode, taking)
            if not taking:
                raise FsError(errno.EINPROGRESS, f"inode {ino} is being changed by another client")
        if mode == READ:
            g.readers[session] += 1
            return
        g.writer = session
        g.writes += 1
        if mode == CUT:
            g.cuts += 1
        self.leases.begin_change(session, ino)

    def others_reading(self, session: Holder, ino: int) -> bool:
        """Is a ``map_read`` of *ino* by another session under way?  (Its answer,
        built later, may name chunks a change is filling now: no write lease is
        granted then, see :meth:`MetaServer.run_call`.)"""
        g = self._gates.get(ino)
        return g is not None and any(s is not session for s in g.readers)

    def _unwait(self, g: _Gate, ino: int, session: Holder, mode: str, taking: bool) -> None:
        g.waiters -= 1
        if mode == CUT:
            g.wanting[session] -= 1
            if not g.wanting[session]:
                del g.wanting[session]
                g.wake()  # readers held back for it may go on
        if not taking and g.idle():
            del self._gates[ino]

    def leave(self, session: Holder, ino: int, *, mode: str) -> None:
        g = self._gates[ino]
        if mode == READ:
            g.readers[session] -= 1
            if not g.readers[session]:
                del g.readers[session]
        else:
            self.leases.end_change(session, ino)
            g.writes -= 1
            if mode == CUT:
                g.cuts -= 1
            if not g.writes:
                g.writer = None
        g.wake()
        if g.idle():
            del self._gates[ino]
