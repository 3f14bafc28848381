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

* a change (any of them but ``map_read``) shuts out the other sessions' calls
  of these kinds on the file, and while it runs their replies carrying the
  file's state are not cacheable (:meth:`LeaseTable.begin_change`);
* ``map_read`` calls share the gate with each other, and a change waits for
  them (their maps are used for a transfer) and they for it;
* a change waiting keeps new readers of other sessions out (it is not starved);
* calls of one session never wait for each other: its own client orders them.

A call waits at most until its deadline, then is answered EINPROGRESS, like a
call that waited that long for DIR itself: the client asks again.
"""

from __future__ import annotations

import collections
import errno
from dataclasses import dataclass, field

import trio

from memfs.errors import FsError
from memfs.meta.leases import Holder, LeaseTable


@dataclass(eq=False, slots=True)
class _Gate:
    #: sessions in the gate -> how many of their calls
    readers: collections.Counter[Holder] = field(default_factory=collections.Counter)
    writer: Holder | None = None
    writes: int = 0
    #: changes of other sessions waiting to get in (new readers wait behind them)
    wanting: collections.Counter[Holder] = field(default_factory=collections.Counter)
    #: calls waiting (the gate is kept while any does)
    waiters: int = 0
    changed: trio.Event = field(default_factory=trio.Event)

    def admits(self, session: Holder, change: bool) -> bool:
        if self.writer is not None and self.writer is not session:
            return False
        if change:
            return all(s is session for s in self.readers)
        return all(s is session for s in self.wanting)

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

    async def enter(self, session: Holder, ino: int, *, change: bool, deadline: float) -> None:
        """Wait for the gate of *ino*; FsError(EINPROGRESS) at *deadline*."""
        g = self._gates.get(ino)
        if g is None:
            g = self._gates[ino] = _Gate()
        if not g.admits(session, change):
            g.waiters += 1
            if change:
                g.wanting[session] += 1
            try:
                with trio.move_on_at(deadline):
                    while not g.admits(session, change):
                        await g.changed.wait()
            finally:
                g.waiters -= 1
                if change:
                    g.wanting[session] -= 1
                    if not g.wanting[session]:
                        del g.wanting[session]
                        g.wake()  # readers held back for it may go on
                admitted = g.admits(session, change)
                if not admitted and g.idle():
                    del self._gates[ino]
            if not admitted:
                raise FsError(errno.EINPROGRESS, f"inode {ino} is being changed by another client")
        if change:
            g.writer = session
            g.writes += 1
            self.leases.begin_change(session, ino)
        else:
            g.readers[session] += 1

    def leave(self, session: Holder, ino: int, *, change: bool) -> None:
        g = self._gates[ino]
        if change:
            self.leases.end_change(session, ino)
            g.writes -= 1
            if not g.writes:
                g.writer = None
        else:
            g.readers[session] -= 1
            if not g.readers[session]:
                del g.readers[session]
        g.wake()
        if g.idle():
            del self._gates[ino]
