"""Calls a client made under its leases and told the server afterwards.

A client holding a directory's create lease creates and unlinks there itself,
and the holder of a file's write lease (or a directory's create lease) sets
its attributes and access times itself (memfs.meta.creates): it answers the
kernel at once and sends the server ``create_at``, ``unlink_at``,
``setattr_at`` and ``atime_at`` calls with its next call, each at the time it
was made (batched in ``made`` calls).  Here they are applied at that time and
journaled as the plain calls they stand for; a registration replays those
whose answers were lost (:mod:`memfs.meta.server_claims`).
"""

from __future__ import annotations

import errno
import stat
import time
from typing import TYPE_CHECKING, Any

from memfs import wire
from memfs.errors import FsError
from memfs.meta import codec
from memfs.meta.journal import CREATE_AT, RESERVE_INOS
from memfs.meta.server_conn import Connection, Session
from memfs.wire import Kind

if TYPE_CHECKING:
    from memfs.meta.server import MetaServer

#: most inode numbers one reserve_inos call hands a session
MAX_RESERVE = 4096


class MadeCalls:
    """The server's side of the calls held by clients; see the module docstring."""

    def __init__(self, server: MetaServer) -> None:
        self.server = server

    def reserve_inos(self, session: Session, count: int) -> int:
        """Hand *session* *count* inode numbers for the creates it makes itself."""
        srv = self.server
        if not srv.create_leases:
            raise FsError(errno.EOPNOTSUPP, "this metadata server makes every create itself")
        if not 0 < count <= MAX_RESERVE:
            raise FsError(errno.EINVAL, f"reserve 1 to {MAX_RESERVE} inode numbers, not {count}")
        first = srv.store.reserve_inos(session.sid, count)
        if srv.journal is not None:
            srv.journal.append(srv.clock(), RESERVE_INOS, [session.sid, first, count])
        return first

    async def run(self, conn: Connection, calls: list[list[Any]], checked: bool) -> tuple[Kind, bytes]:
        """A ``made`` call: each of its held calls as if it came on its own, in
        order (its recalls, its journal record, its metrics); answered with the
        position, errno and message of each refused, all at once: one that waits for
        a recall (only once the client lost its create lease) holds up the answers
        of those before it.

        *checked* (:meth:`MetaServer.may_wait` found nothing to recall for any of them) holds
        across ``create_at`` calls: one neither awaits nor changes what another
        session holds.  After anything else the conflicts are asked again."""
        srv = self.server
        refused = []
        obs = srv.metrics
        for k, call in enumerate(calls):
            name = call[0]
            started = time.perf_counter() if obs is not None else 0.0
            kind, body = await srv.run_call(conn, call, codec.METHODS[name], call[1:], checked=checked)
            checked = checked and name == "create_at"
            err = None
            if kind is Kind.ERROR:
                err, msg = wire.decode_error(body)
                refused.append([k, err, msg])
            if obs is not None:
                obs.observe(name, started, err)
        return Kind.OK, wire.encode(refused)

    def create_at(self, session: Session, args: list[Any]) -> None:
        """A create a client made under its create lease (see memfs.meta.leases): at
        its time, with an inode number reserved for it, and the file open there."""
        srv = self.server
        parent, name, mode, uid, gid, ino, t = args
        srv.stamp(t)
        _, new = srv.store.create_at(session.sid, parent, name, mode, uid, gid, ino)
        if new:
            srv.store.inodes[ino].opens += 1
            session.opens[ino] = session.opens.get(ino, 0) + 1
            if srv.journal is not None:
                srv.journal.append(t, CREATE_AT, [session.sid, parent, name, mode, uid, gid, ino])

    async def unlink_at(self, session: Session, args: list[Any]) -> list[int]:
        """An unlink a client made under its create lease, at its time, of a file it
        made there: journaled as a plain unlink.  One that was applied before (sent
        again after a lost connection) is answered as it is."""
        srv = self.server
        parent, name, ino, t = args
        child = srv.child(parent, name)
        if child != ino:
            i = srv.store.inodes.get(ino)
            if i is None or i.nlink == 0:
                return [ino, t]  # unlinked already (sent again), whatever took the name since
            raise FsError(errno.ENOENT, f"{name!r} no longer names inode {ino}")
        srv.stamp(t)
        await srv.meta.unlink(parent, name)
        if srv.journal is not None:
            srv.journal.append(t, "unlink", [parent, name])
        return [ino, t]

    def atime_at(self, args: list[Any]) -> None:
        """A read's access time, from a client that read from the chunk map it caches
        (relatime, at its time, without waiting: no holder of the file is recalled
        for an access time, here or at a map_read, which recalls only writers).  A
        file gone since: nothing."""
        srv = self.server
        ino, t = args
        srv.stamp(t)
        if srv.store.read_at(ino) and srv.journal is not None:
            srv.journal.append(t, "map_read", [ino, 0, 0])  # (replayed: the same rule)

    async def setattr_at(self, session: Session, args: list[Any], held: bool) -> None:
        """A setattr a client made under its write lease of the file, at its time
        (RemoteMeta.setattr): *held* is whether its lease still holds (no other
        session has the file's state then: nothing to recall), or, replayed by a
        registration, whether it counts (``SessionClaims.claim``).  Else refused, unless
        applied already (sent again after a lost connection): the lease ended
        without the client's word (its answers to recalls go after this), and
        another client may have changed the file since."""
        srv = self.server
        ino, fields, *values, t = args
        if not 0 < fields < 2 * codec.SET_MTIME:
            raise FsError(errno.EINVAL, f"setattr_at: bad fields {fields}")
        changes = codec.setattr_at_changes(fields, *values)
        if not held:
            i = srv.store.inodes.get(ino)
            if i is not None and i.ctime_ns >= t and all(
                    v is None or (stat.S_IMODE(v) == stat.S_IMODE(i.mode) if k == "mode"
                                  else v == getattr(i, k))
                    for k, v in zip(("mode", "uid", "gid", "atime_ns", "mtime_ns"),
                                    codec.setattr_to_wire(changes), strict=True)):
                return
            raise FsError(errno.ESTALE, f"setattr of inode {ino} refused: the write lease "
                                        "ended without this client")
        i = srv.store.inodes.get(ino)
        # (Never a ctime below the file's: a replay after writes of ours it passed.)
        t = t if i is None else max(t, i.ctime_ns)
        srv.stamp(t)
        await srv.meta.setattr(ino, changes)
        if srv.journal is not None:
            srv.journal.append(t, "setattr", [ino, codec.setattr_to_wire(changes)])
