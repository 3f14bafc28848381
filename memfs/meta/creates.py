"""Asynchronous creates (and unlinks), the client half (see "create" leases in
:mod:`memfs.meta.leases`).

A client that holds a directory's create lease, knows a name in it to be
absent and has inode numbers reserved for it by the server makes a regular
file there itself: it names the inode, stamps its times, answers the kernel,
and sends ``create_at`` without waiting for the answer.  Such calls leave in
batches (held for :data:`CREATE_HOLD`, or until the next call that waits for its
answer, which must come after them anyway), as one ``made`` call (a lone one
as itself; at most 128 a call; each alone to an mds that takes no ``made``
call), and their answers are taken as they are read: no task waits for
them.  So a create costs this client no round trip to the server, and the
server one call per batch.

Until the server has answered, a create is *pending* here (in order):

* every later call about the file or its directory goes on the same
  connection after it, so the server sees them in order;
* a recall of the directory's lease is answered only once every create made
  under it has been answered (the caller waiting for that recall then sees the
  new names);
* ``fsync`` of the file, or of its directory, waits for it;
* if the connection is lost, the next registration carries the pending creates,
  in order, before the open handles it claims (one that did arrive is answered
  as it is: the server knows the inode number).

A file made so, still with its one name, may be unlinked the same way
(``unlink_at``, at the client's time): no other client can know its inode
without looking in the directory, which takes the lease first.  An unlink of
anything else asks the server.

A create the server refuses (only possible if the lease was lost meanwhile:
evicted, and the name taken by another client before this one came back) is
logged; its file is gone from this client's caches, the kernel's too, and its
writers and fsync get EIO, as for writes lost to an eviction.  A refused
unlink (evicted, and the file renamed by another client meanwhile) is logged,
and the directory is looked up again.  Sent again after a lost connection,
what the server applied before counts as done.

A setattr of a file under this client's write lease (``setattr_at``, made by
RemoteMeta.setattr) is pending here too, the same way (in order, replayed,
waited for by ``fsync``), but a recall's answer does not wait for it: the
server runs it before the answer that comes after it (``Connection._run_made_now``).
One refused (the write lease ended without this client's word, and another
client may have changed the file) is logged and fails the file's writers.

Everything here runs in the client's trio loop and never awaits, except
:meth:`AsyncCreates.wait`.
"""

from __future__ import annotations

import collections
import logging
import stat
from typing import Any

import trio

from memfs.meta import Attr
from memfs.meta.cache import ClientCache

log = logging.getLogger(__name__)

#: inode numbers asked for at a time
RESERVE = 1024
#: creates made within this of each other leave in one send
CREATE_HOLD = 0.001
#: longest name a create may have (the server's NAME_MAX)
_NAME_MAX = 255


class AsyncCreates:
    """Reserved inode numbers and the creates and unlinks not answered yet; see the
    module docstring."""

    def __init__(self, cache: ClientCache) -> None:
        self.cache = cache
        #: inode numbers the server reserved for this client's session
        self.inos: collections.deque[int] = collections.deque()
        #: operation id -> the call (``create_at``, ``unlink_at`` or ``setattr_at``, then
        #: its arguments), made and not answered yet, in the order they were made
        self.pending: dict[int, list[Any]] = {}
        self._next_op = 1
        self._answered = trio.Event()
        #: counters for tests and metrics
        self.made = 0
        self.removed = 0

    def _add(self, call: list[Any]) -> int:
        op = self._next_op
        self._next_op += 1
        self.pending[op] = call
        return op

    def make(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
             now_ns: int) -> tuple[Attr, int, list[Any]] | None:
        """The new file's attributes, the operation's id and the ``create_at`` call if
        this client may make it itself now (create lease, name known absent, a number
        at hand); else None."""
        cache = self.cache
        born = cache.creators.get(parent)
        if (born is None or not self.inos or not stat.S_ISREG(mode)
                or not 0 < len(name) <= _NAME_MAX or b"/" in name or name in (b".", b"..")
                or cache.entry(parent, name) != 0):
            return None
        pa = cache.attr(parent)
        if pa is None:
            return None
        if pa.mode & stat.S_ISGID:  # as the server's mknod: the directory's group
            gid = pa.gid
        ino = self.inos.popleft()
        a = Attr(ino, mode, 1, uid, gid, 0, 0, 0, now_ns, now_ns, now_ns)
        call = ["create_at", parent, name, mode, uid, gid, ino, now_ns]
        born.add(ino)
        self.made += 1
        return a, self._add(call), call

    def remove(self, parent: int, name: bytes, now_ns: int) -> tuple[int, int, list[Any]] | None:
        """(inode, operation id, ``unlink_at`` call) if this client may unlink *name*
        itself now: a file it made under its current create lease on *parent* (so no
        other client can know the inode: one would have had to look in *parent*, which
        takes the lease), with one link; else None."""
        cache = self.cache
        born = cache.creators.get(parent)
        if born is None:
            return None
        ino = cache.entry(parent, name)
        if not ino or ino not in born:
            return None
        a = cache.attrs.get(ino)
        if a is None or a.nlink != 1 or not stat.S_ISREG(a.mode):
            return None
        born.discard(ino)
        call = ["unlink_at", parent, name, ino, now_ns]
        self.removed += 1
        return ino, self._add(call), call

    def answered(self, op: int) -> list[Any] | None:
        """The server answered operation *op*; its call (None: not pending)."""
        call = self.pending.pop(op, None)
        self._answered.set()
        return call

    def unanswered(self) -> list[tuple[int, list[Any]]]:
        """The pending operations (id, call), in order (for a registration)."""
        return list(self.pending.items())

    def setattr_made(self, call: list[Any]) -> int:
        """A ``setattr_at`` made under a file's write lease (RemoteMeta.setattr): its
        operation id.  Pending as the others (fsync waits for it, a registration
        sends it again), but a recall's answer does not wait for it
        (:meth:`pending_under`; one of a directory's own, which ``wait`` matches,
        is answered before it anyway): the server runs it before it applies the
        answer."""
        return self._add(call)

    @staticmethod
    def _touches(call: list[Any], want: set[int]) -> bool:
        """Does *call* make, unlink or set one of *want*, or change directory one of *want*?"""
        if call[0] == "setattr_at":
            return call[1] in want
        ino = call[6] if call[0] == "create_at" else call[3]
        return ino in want or call[1] in want

    def pending_about(self, ino: int) -> bool:
        """Is an operation of *ino* (its setattrs too), or in directory *ino*, pending?"""
        want = {ino}
        return any(self._touches(call, want) for call in self.pending.values())

    def pending_under(self, ino: int) -> bool:
        """Is a create or unlink of *ino*, or in directory *ino*, pending?"""
        want = {ino}
        return any(call[0] != "setattr_at" and self._touches(call, want)
                   for call in self.pending.values())

    async def wait(self, inos: list[int] | None = None) -> None:
        """Until the operations pending now (of these files or in these directories, if
        given) are answered.  Callers bound it: a lost connection leaves them pending
        until the next registration."""
        if inos is None:
            waiting = set(self.pending)
        else:
            want = set(inos)
            waiting = {op for op, call in self.pending.items() if self._touches(call, want)}
        while waiting & self.pending.keys():
            if self._answered.is_set():
                self._answered = trio.Event()
            await self._answered.wait()
