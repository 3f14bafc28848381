"""What the metadata server's calls mean for leases (memfs.meta.server).

The lease table (:mod:`memfs.meta.leases`) is the mechanism: who holds what,
recalls, write leases.  :class:`LeasePolicy` is what each call means over it,
read from the store's state before the change: what other clients must give
back before the call runs, which inodes its reply lets the caller cache (and the
chunk map around the range it asked), and, for the burst buffer's write-back,
whether every write to a file has landed on the memory servers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from memfs import wire
from memfs.errors import FsError
from memfs.meta import RENAME_EXCHANGE, codec
from memfs.meta.contention import Span
from memfs.meta.leases import Item, LeaseTable
from memfs.meta.server_conn import Session
from memfs.meta.store import MetaStore

log = logging.getLogger(__name__)

#: seconds a truncate's caller may take to zero the tail of the file's last chunk
#: (as the write-back's settle time, memfs.mds.SETTLE)
TAIL_SETTLE = 2.0
#: seconds the write-back waits for a glimpse of a file's writers (memfs.backing)
GLIMPSE_WAIT = 0.5


class LeasePolicy:
    """The leases a call of the server's conflicts with and those its reply grants;
    see the module docstring.  *recovering*: within the grace after a restart (the
    writers of the run before are not known yet)."""

    def __init__(self, store: MetaStore, leases: LeaseTable, recovering: Callable[[], bool]) -> None:
        self.store = store
        self.leases = leases
        self._recovering = recovering
        #: ino -> when a truncate last sent its caller a tail to zero (those zeros are
        #: confirmed by nothing: the write-back gives them its settle time)
        self._tails: dict[int, float] = {}

    def conflicts(self, session: Session | None, name: str, args: list[Any]) -> list[Item]:
        """What other clients must give up before call *name* runs (pre-change state)."""
        store = self.store
        leases = self.leases
        if name == "map_read":
            ino = args[0]
            return ([Item(ino, write_only=True, span=self.span(name, args))]
                    if ino in leases.writers or leases.others_writing(session, ino) else [])
        if name in ("map_write", "allocate_ahead"):
            return [Item(args[0], span=self.span(name, args))]
        if name in ("getattr", "open", "readlink", "seek"):  # (seek: for the writers' sizes)
            return [Item(args[0], write_only=True)] if args[0] in leases.writers else []
        if name == "lookup":
            if not leases.writers:
                return []
            d = store.inodes.get(args[0])
            child = d.children.get(args[1]) if d is not None and d.children is not None else None
            items = [Item(child, write_only=True)] if child in leases.writers else []
            if args[0] in leases.writers:  # a create lease: its creates must arrive first
                items.append(Item(args[0], write_only=True))
            return items
        if name in ("readdirplus", "readdir"):
            d = store.inodes.get(args[0])
            if not leases.writers or d is None or d.children is None:
                return []
            items = [Item(c, write_only=True) for c in d.children.values()
                     if c in leases.writers] if name == "readdirplus" else []
            if args[0] in leases.writers:
                items.append(Item(args[0], write_only=True))
            return items
        if name in ("setattr", "truncate", "punch", "setxattr", "removexattr"):
            return [Item(args[0])]
        if name == "drop_privileges":  # only if there is something to drop
            return [Item(args[0])] if store.has_privileges(args[0], bool(args[1])) else []
        if name in ("mknod", "create", "create_at"):
            return [Item(args[0], (args[1],), directory=True)]
        if name == "link":
            return [Item(args[0]), Item(args[1], (args[2],), directory=True)]
        if name in ("unlink", "rmdir", "unlink_at"):
            items = [Item(args[0], (args[1],), directory=True)]
            d = store.inodes.get(args[0])
            child = d.children.get(args[1]) if d is not None and d.children is not None else None
            if child is not None:
                # (b".",): the directory itself goes (its holders forget its names)
                items.append(Item(child, (b".",) if name == "rmdir" else (),
                                  directory=name == "rmdir"))
            return items
        if name == "rename":
            parent, old, new_parent, new = args[:4]
            items = [Item(parent, (old,), directory=True), Item(new_parent, (new,), directory=True)]
            exchange = len(args) > 4 and args[4] & RENAME_EXCHANGE
            for d_ino, n in ((parent, old), (new_parent, new)):
                d = store.inodes.get(d_ino)
                child = d.children.get(n) if d is not None and d.children is not None else None
                if child is not None:
                    c = store.inodes[child]
                    # a moved directory's ".." changes; one renamed over goes (b".")
                    gone = d_ino == new_parent and n == new and not exchange
                    items.append(Item(child, ((b".",) if gone else (b"..",))
                                      if c.children is not None else (),
                                      directory=c.children is not None))
            return items
        if name in ("release", "releases"):
            # An unlinked file's last handle: its chunks are freed.
            left: dict[int, int] = {}  # handles the call leaves, per unlinked inode
            for ino in args[0] if name == "releases" else args[:1]:
                i = store.inodes.get(ino)
                if i is not None and i.nlink <= 0:
                    left[ino] = left.get(ino, i.opens) - 1
            return [Item(ino) for ino, n in left.items() if n <= 0]
        return []

    def span(self, name: str, args: list[Any]) -> Span | None:
        """The whole chunks a read or write of a contended file touches (its space ahead
        included), for recalls by range (memfs.meta.contention); None: the whole file
        (not contended, an append, anything else)."""
        ino = args[0]
        contention = self.leases.contention
        if name not in ("map_read", "map_write", "allocate_ahead") or args[1] < 0 \
                or not contention.contended(ino):
            return None
        cs = self.store.chunk_size
        end = args[1] + args[2] + (args[3] if name == "allocate_ahead" else 0)
        return (args[1] - args[1] % cs, -(-end // cs) * cs)

    async def recall_for(self, session: Session, name: str, args: list[Any]) -> None:
        """Recall what other sessions hold that call *name* changes."""
        first = True
        while (items := self.conflicts(session, name, args)) and \
                self.leases.needs_recall(session, items, first=first):
            await self.leases.recall(session, items)
            first = False

    @staticmethod
    def holds(name: str, args: list[Any], result: Any) -> list[int]:
        """Inodes whose state a reply to call *name* carries (the caller caches them)."""
        if name in ("lookup", "mknod", "create"):
            return [args[0], result.ino]
        if name == "create_at":  # (answered with nothing: the client made the inode)
            return [args[0], args[5]]
        if name == "link":
            return [args[1], args[0]]
        if name in ("unlink", "rmdir", "unlink_at"):
            return [args[0]]
        if name == "rename":
            return [args[0], args[2]]
        if name == "readdirplus":
            return [args[0], *(a.ino for _, a in result)]
        return [args[0]]

    def widened(self, name: str, args: list[Any], result: Any) -> bytes | None:
        """A cacheable chunk map around the range asked (``codec.MAP_WINDOW`` aligned), so the
        client's next reads and writes nearby need no call; None: nothing to add."""
        ino, offset, length = args[0], args[1], args[2]
        i = self.store.inodes.get(ino)
        if i is None or i.chunks is None or i.backed or not length:
            return None
        lo = offset - offset % codec.MAP_WINDOW
        try:
            if name == "map_read":
                hi = min(i.size, offset + length - (offset + length) % codec.MAP_WINDOW
                         + codec.MAP_WINDOW)
                if hi <= offset + length and lo == offset:
                    return None
                return wire.encode(codec.extents_to_wire(self.store.extents(ino, lo, hi - lo)))
            plan, attr = result
            end = offset + length + args[3]
            hi = max(end, min(i.size, end - end % codec.MAP_WINDOW + codec.MAP_WINDOW))
            extents = self.store.placement.extents_of(i, lo, hi)
        except FsError:  # lost chunks nearby (memfs.meta.takeback): the range asked only
            return None
        return wire.encode(codec.ahead_to_wire((type(plan)(extents), attr)))

    def tail_sent(self, ino: int) -> None:
        """A truncate of *ino* sent its caller the tail of the last chunk to zero."""
        if len(self._tails) >= 4096:
            gone_by = trio.current_time() - TAIL_SETTLE
            self._tails = {i: t for i, t in self._tails.items() if t > gone_by}
        self._tails[ino] = trio.current_time()

    # -- for the burst buffer (memfs.backing) --------------------------------------------

    async def recall_inodes(self, inos: list[int]) -> None:
        """Take everything clients cache of *inos* back (the server itself is about to
        change them: burst-buffer eviction frees their chunks)."""
        items = [Item(ino) for ino in inos]
        first = True
        while self.leases.needs_recall(None, items, first=first):
            await self.leases.recall(None, items)
            first = False

    async def recall_held(self, inos: list[int]) -> None:
        """Take back what clients hold of *inos* now, once (the server made what they
        fetch meanwhile harmless: memfs.meta.takeback seals the volumes first)."""
        items = [Item(ino) for ino in inos]
        if self.leases.needs_recall(None, items):
            await self.leases.recall(None, items, once=True)

    def writes_landed(self, ino: int) -> bool:
        """Has every write the file's state shows reached the memory servers?  True when
        no session placed writes there that it has not confirmed (by a recall's
        answer or its close) and no truncate's tail is being zeroed, outside a
        restart's recovery (writers of the run before are not known yet).  A write
        lease's holder counts as confirmed: it reports writes only once they landed,
        and its report makes the file dirty again (``LeaseTable.unconfirmed``).  The
        write-back then needs no settle time."""
        if self.leases.term <= 0 or self._recovering() or self.leases.unconfirmed(ino):
            return False  # (without leases, writers are not marked)
        t = self._tails.get(ino)
        if t is not None:
            if trio.current_time() - t < TAIL_SETTLE:
                return False
            del self._tails[ino]
        return True

    async def glimpse_writers_of(self, ino: int) -> None:
        """Recall *ino*'s writers that have not confirmed their placed writes: each
        answers once its bytes have landed.  Only a glimpse: not while a write
        lease is held (its recall would revoke it), and given up after
        ``GLIMPSE_WAIT`` rather than evicting a writer that does not answer (its
        transfer may run long, a memfs.array slab): the copy then waits the
        settle time instead."""
        items = [Item(ino, write_only=True)]
        if (not self.leases.unconfirmed(ino) or ino in self.leases.writers
                or not self.leases.needs_recall(None, items)):
            return
        with trio.move_on_after(min(GLIMPSE_WAIT, self.leases.recall_timeout / 2)):
            await self.leases.recall(None, items)

    async def glimpse_writers(self, session: Session | None) -> None:
        """Every other session's write leases end with their reports (which mark the
        files dirty), so a flush asked on one node takes what another node wrote and
        closed a moment ago: the writer's close does not wait for its report."""
        items = [Item(ino, write_only=True) for ino in self.leases.writers]
        first = True
        while items and self.leases.needs_recall(session, items, first=first):
            await self.leases.recall(session, items)
            first = False
