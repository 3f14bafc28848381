"""A session's registration: the ``session`` call a client makes on every connection.

The client states its open handles, the sizes it wrote under write leases,
the calls it made under its leases and has no answer to (memfs.meta.creates),
and the lease token its transfers may still run under.  The server makes the
session's open counts exactly those, keeps or refuses the sizes (after a
restart, within ``--grace``), replays the held calls in their order, and
answers with what is lost.  :mod:`memfs.meta.sessions` keeps the sessions and
their open counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from memfs.errors import FsError
from memfs.meta import codec
from memfs.meta.journal import REGISTERED
from memfs.meta.leases import Settle
from memfs.meta.server_conn import Connection, Session
from memfs.meta.store import ANY_EARLIER, Inode, MetaStore

if TYPE_CHECKING:
    from memfs.meta.server import MetaServer

log = logging.getLogger(__name__)


#: the bits (codec.SET_*) of the attributes a setattr sets, in :func:`_values`' order
_BITS = (codec.SET_MODE, codec.SET_UID, codec.SET_GID, codec.SET_ATIME, codec.SET_MTIME)
Fields = tuple[int, int, int, int, int]


def fields_set(name: str, args: list[Any]) -> dict[int, int]:
    """The inodes whose setattr fields (codec.SET_*) call *name* may set, with those
    it sets whenever it is applied: a setattr its own, a write or truncate the
    mtime, a change of names the directory's.  Whatever else moves (an access
    time, a settle's mtime) is found by comparing (:meth:`SessionClaims.after`):
    the clock is coarse, so a field set to the value it had would not show.  A
    privileges drop sets only set-ID bits, which no setattr made under a lease
    carries; a chown leaves the mode alone."""
    if name == "drop_privileges" or not args or type(args[0]) is not int:
        return {}
    if name == "setattr":
        return {args[0]: codec.setattr_at_args(args[1])[0]}
    if name == "setattr_at":
        return {args[0]: args[1]}
    if name in ("map_write", "allocate_ahead"):
        return {args[0]: codec.SET_MTIME if args[2] else 0}
    if name in ("truncate", "punch", "create", "mknod", "create_at", "unlink_at", "unlink", "rmdir"):
        return {args[0]: codec.SET_MTIME}
    if name == "link":
        return {args[1]: codec.SET_MTIME}
    if name == "rename":
        return {args[0]: codec.SET_MTIME, args[2]: codec.SET_MTIME}
    return {args[0]: 0}


def _values(i: Inode) -> Fields:
    return i.mode, i.uid, i.gid, i.atime_ns, i.mtime_ns


#: a change under way (SessionClaims.before): the watches it may concern, and per
#: watched inode the fields it always sets and the values before it
_Window = list[tuple["_Watch", dict[int, tuple[int, Fields]]]]


@dataclass(eq=False)
class _Watch:
    """A registration's replayed setattrs, and the fields of their files that other
    sessions set meanwhile."""

    sid: bytes
    setattrs: set[int]
    #: ino -> fields (codec.SET_*) set by others since the registration began
    taken: dict[int, int] = field(default_factory=dict)

    def before(self, sets: dict[int, int], store: MetaStore) -> dict[int, tuple[int, Fields]] | None:
        """For those of *sets* (ino -> fields a change sets) watched here: those
        fields and what the inode has now (None: none watched)."""
        out = {}
        for ino, bits in sets.items():
            if ino in self.setattrs and (i := store.inodes.get(ino)) is not None:
                out[ino] = (bits, _values(i))
        return out or None

    def left(self, args: list[Any]) -> list[Any] | None:
        """A replayed ``setattr_at`` without the fields others set since (None: no
        field left: each was set again later, as if this one came first)."""
        fields = args[1] & ~self.taken.get(args[0], 0)
        return None if not fields else [args[0], fields, *args[2:]]


class SessionClaims:
    """Registrations of client sessions; see the module docstring."""

    def __init__(self, server: MetaServer) -> None:
        self.server = server
        #: registrations replaying setattrs, which changes by other sessions make stale
        self.watching: list[_Watch] = []
        #: session -> setattrs (inode, fields, time) its last registration replayed
        #: with fields taken by others: done, also if sent again (that answer may be lost)
        self.taken: dict[bytes, set[tuple[int, int, int]]] = {}
        #: changes by other sessions under way (before/after), which may await between
        self._open: list[_Window] = []

    async def claim(
        self, conn: Connection, sid: bytes, claimed: dict[int, int],
        settles: list[Settle] | None = None,
        ops: list[tuple[str, list[Any]]] | None = None,
        *, fence: int = 0,
    ) -> list[Any]:
        """Attach *conn* to session *sid* and make its open counts exactly *claimed*.

        The client starts from empty caches on every connection, so whatever the
        session held is forgotten; *settles* are the sizes and mtimes of the files it
        was writing under write leases (kept unless its leases were taken from it:
        after a server restart nobody holds any, and they are what it wrote).
        Returns the inodes that no longer exist (the client drops those handles),
        those whose reported writes were refused (the client fails their writers) and
        the lease token its memory-server connections must name.  *fence*: the token
        under which transfers the client cannot stop (memfs.array processes') may
        still run: fenced before anything the session held is let go.
        """
        srv = self.server
        s = await srv.sessions.attach(conn, sid)
        s.last_heard = trio.current_time()  # (this frame was read before it was named)
        srv.stamp()
        # A size counts if the session still holds the write lease (cut off for less
        # than its term, or evicted and back before its lease ran out: its chunks are
        # all there), or if it is a session of an earlier run back within --grace of
        # a restart (nobody holds leases then, and chunks past EOF are kept until the
        # grace ends) on a file that is not marked for it (``store.unsaid``: its lease
        # ended without its word before the restart) nor for every earlier session
        # (``ANY_EARLIER``: the file's chunks changed during this grace).  Where the
        # file is marked for it, or it is a stranger to this run (back after the
        # grace, or after its session expired), the chunks past the end of file known
        # then were freed: a larger size covers freed space, and the client must tell
        # its writers (EIO), never report it.  A size no larger than the known one is
        # stale (an answer that did arrive): ignored.
        s.registrations += 1
        if fence:
            # Before the forget below lets the recalls waiting for it go: a change
            # they let through that grants or cuts chunks waits for this fence
            # (MetaServer.run_call).  Its sizes count as usual: only the token is taken.
            log.warning("%s: transfers under lease token %x may still run: fencing it",
                        conn.peer, fence)
            if fence == s.token:
                srv.take_token(s)
            elif srv.nursery is not None:
                # A token of the session before it expired, or of an earlier run of
                # this server (tokens are not journaled): not the session's now.
                srv.fencing.begin(srv.nursery, fence)
        renamed = s.fenced  # its token changed since it last heard one
        s.fenced = False  # it hears its token now
        # The session's first registration in this run: of an earlier run (eligible
        # within --grace of the restart), or a stranger (back too late).
        first = srv.store.registered(sid)
        if first:
            srv.journal_session(REGISTERED, sid)
        previous_run = srv.recovering and first and sid in srv.store.eligible
        marks = srv.store.unsaid
        lost_here = {ino for ino, sids in marks.items() if sid in sids}
        # The same client under an older object (dropped from the session table with no open
        # handles while it still held a write lease): still its lease.
        olds = {w for w in srv.leases.writers.values()
                if w is not s and isinstance(w, Session) and w.sid == sid}
        failed = []

        def counts(ino: int) -> bool:
            w = srv.leases.writers.get(ino)
            return w is s or w in olds or (previous_run and w is None and ino not in lost_here
                                           and ANY_EARLIER not in marks.get(ino, ()))

        # Setattrs it made under write leases count as its sizes do (decided before
        # those end the leases), unless, back after a restart, the file changed after
        # it (another client, this grace); replayed below, then its mtimes again: one
        # set before writes it made after would take theirs away.
        set_at = {args[0] for name, args in ops or () if name == "setattr_at" and counts(args[0])
                  and (srv.leases.writers.get(args[0]) is not None
                       or (i := srv.store.inodes.get(args[0])) is None or i.ctime_ns <= args[-1])}
        for ino, size, mtime, span in settles or ():
            w = srv.leases.writers.get(ino)
            if counts(ino):
                if w is not None:
                    # Its lease ends here with its word: what it took ahead goes now.
                    srv.leases.release_write(w, ino)
                seen = self.before(sid, "settle", [ino])
                if srv.store.settle_now(ino, size, mtime, True, span) and srv.journal is not None:
                    srv.journal.append(srv.clock(), "settle", [ino, size, mtime, 1, *span])
                self.after(seen)
                continue
            i = srv.store.inodes.get(ino)
            if i is None or (size <= i.size and srv.meta is srv.store):
                continue
            # Through a backing directory no size is stale evidence: an overwrite in
            # place reports the size the file has, and eviction may have freed the
            # chunks it wrote.
            if ino in lost_here or first:
                log.warning("%s: size %d of inode %d (%d known) not applied: the client lost "
                            "its write lease without its word (evicted, cut off, or back after "
                            "--grace); its writes since its last report are lost",
                            conn.peer, size, ino, i.size)
                failed.append(ino)
        # Refusals stay marked until a registration no longer reports them (this answer
        # may be lost, and the same sizes come again); the rest are settled now.
        for ino in failed:
            srv.lost_write_of(ino, sid)
        for ino in lost_here.difference(failed):
            srv.lost_write_of(ino, sid, False)
        # Another session that sets a field of one of those files while we wait below
        # (a claim, a recall, a registration of its own) sets it after this setattr,
        # which then leaves that field alone (as if it came first): watched until the
        # replay is done.
        watch = _Watch(sid, set_at)
        if set_at:
            self.watching.append(watch)
        try:
            refused_ops = await self._replay(s, conn, claimed, olds, ops or [], settles or [], watch)
        finally:
            if set_at:
                self.watching.remove(watch)
                # (Changes cancelled under way never came back to say what they set.)
                self._open = [window for window in self._open
                              if any(w in self.watching for w, _ in window)]
        if renamed or first:
            # The client hears a token other than the one its inode numbers were
            # reserved under and drops them (RemoteMeta._connect): so do we, once its
            # creates above had theirs.  (Not journaled: a restart makes this
            # registration a first one again.)
            srv.store.delegated.pop(sid, None)
        lost = [ino for ino in set(claimed) | set(s.opens)
                if not await srv.sessions.set_opens(s, ino, claimed.get(ino, 0))]
        srv.journal_destroys()
        if claimed:
            log.info("%s: session re-registered %d open inodes (%d gone)", conn.peer, len(claimed), len(lost))
        srv.check_recovered()
        if srv.adopted:  # (before the answer: the client adopts once registered)
            s.send_pool(dict(srv.adopted))
        if ops is not None:
            return [sorted(lost), failed, s.token, refused_ops]
        return [sorted(lost), failed, s.token]

    async def _replay(
        self, s: Session, conn: Connection, claimed: dict[int, int], olds: set[Session],
        ops: list[tuple[str, list[Any]]], settles: list[Settle], watch: _Watch,
    ) -> list[list[int]]:
        """Count *s*'s claimed handles, end its (and its *olds*') leases, and replay the
        calls it made under them (*ops*): the positions and errnos of those refused."""
        srv = self.server
        # Handles it claims beyond those counted here (opens it made under its lease
        # and had not sent when its connection went: RemoteMeta.open) are counted
        # before the forget lets the recalls waiting for it go, and before any await:
        # a change let through (an unlink elsewhere) must find those files open.
        # (Lower counts wait for the end: a release must not free a file the
        # replayed creates or unlinks below still name.)
        for ino, n in claimed.items():
            if n > s.opens.get(ino, 0) and ino in srv.store.inodes:
                await srv.sessions.set_opens(s, ino, n)  # (the store does not await)
        for o in olds:
            srv.leases.forget(o, said=True)
        srv.leases.forget(s, said=True)  # it has just said every size it had
        # Creates and unlinks it made under a create lease and has no answer to (in its
        # order; one that arrived before is answered as it is): before its claims,
        # which count their handles.
        refused_ops: list[list[int]] = []
        taken: set[tuple[int, int, int]] = set()
        unlinked_later = {args[2]: k for k, (name, args) in enumerate(ops) if name == "unlink_at"}
        for k, (name, args) in enumerate(ops):
            key = (args[0], args[1], args[-1]) if name == "setattr_at" else None
            seen: _Window = []
            if key is not None and key in self.taken.get(s.sid, ()):
                taken.add(key)  # done by the registration before (its answer lost)
                continue
            try:
                # (A setattr made under a lease now replayed: others may hold the file.)
                await srv.lease_policy.recall_for(s, "setattr" if name == "setattr_at" else name, args)
                if name == "unlink_at":
                    # A file it holds open stays as an orphan (an mds restarted since
                    # counts no opens yet): its claim first.
                    ino = args[2]
                    if claimed.get(ino, 0) > s.opens.get(ino, 0) and ino in srv.store.inodes:
                        await srv.sessions.set_opens(s, ino, claimed[ino])
                # (What each sets goes to other registrations' watches: before/after.)
                if name == "create_at":
                    if unlinked_later.get(args[5], -1) > k and args[5] not in srv.store.inodes \
                            and args[5] not in srv.store.delegated.get(s.sid, ()):
                        continue  # made and unlinked before (answers lost), and gone since
                    seen = self.before(s.sid, name, args)
                    srv.made.create_at(s, args)
                elif name == "setattr_at":
                    assert key is not None
                    ino = args[0]
                    if ino in watch.setattrs:
                        left = watch.left(args)
                        if left is None:
                            taken.add(key)
                            continue
                        seen = self.before(s.sid, name, left)
                        await srv.made.setattr_at(s, left, True)
                        if left[1] & codec.SET_MTIME:
                            self._mtimes_again(ino, settles)
                        if left != args:
                            taken.add(key)
                    else:
                        seen = self.before(s.sid, name, args)
                        await srv.made.setattr_at(s, args, False)
                else:
                    seen = self.before(s.sid, name, args)
                    await srv.made.unlink_at(s, args)
                self.after(seen)
                self._ours(watch, fields_set(name, args))
            except FsError as exc:
                self.after(seen, applied=False)
                why = exc.args[1] if len(exc.args) > 1 else exc
                if name == "setattr_at":
                    log.warning("%s: setattr of inode %d, made under a lease, failed on "
                                "its way again: %s", conn.peer, args[0], why)
                else:
                    log.warning("%s: %s of %r in inode %d, made under a create lease, failed "
                                "on its way again: %s", conn.peer, name, args[1], args[0], why)
                refused_ops.append([k, exc.errno])
            srv.journal_destroys()
        if taken:
            self.taken[s.sid] = taken
        else:
            self.taken.pop(s.sid, None)
        return refused_ops

    def _mtimes_again(self, ino: int, settles: list[Settle]) -> None:
        """After a replayed setattr of *ino*'s mtime, the mtimes of the writes the
        session reported (made after it, or the setattr would carry theirs): a
        time set before writes made after must not take theirs away.  Never its
        size again (another session may have truncated the file since)."""
        srv = self.server
        i = srv.store.inodes.get(ino)
        for f, _, mtime, _ in settles:
            if f == ino and i is not None and srv.store.settle_now(ino, i.size, mtime, False, (0, 0)) \
                    and srv.journal is not None:
                srv.journal.append(srv.clock(), "settle", [ino, i.size, mtime, 0, 0, 0])

    def before(self, sid: bytes | None, name: str, args: list[Any]) -> _Window:
        """Before session *sid* (None: one whose recall answer reported writes) applies
        call *name*: what it may set of files other sessions' registrations watch;
        :meth:`after` tells them what it did set (there may be awaits between)."""
        sets = fields_set(name, args)
        window: _Window = []
        for w in self.watching:
            if w.sid != sid and (seen := w.before(sets, self.server.store)) is not None:
                window.append((w, seen))
        if window:
            self._open.append(window)
        return window

    def after(self, window: _Window, *, applied: bool = True) -> None:
        """The call :meth:`before` was asked about is over: the fields it set (those it
        always sets if *applied*, and any that moved) are taken from the setattrs
        those registrations replay (see :meth:`claim`)."""
        if not window:
            return
        for k, open_ in enumerate(self._open):
            if open_ is window:
                del self._open[k]
                break
        inodes = self.server.store.inodes
        for w, fields in window:
            for ino, (bits, old) in fields.items():
                i = inodes.get(ino)
                new = old if i is None else _values(i)
                moved = sum(bit for bit, a, b in zip(_BITS, old, new, strict=True) if a != b)
                if bits := (bits if applied else 0) | moved:
                    w.taken[ino] = w.taken.get(ino, 0) | bits

    def _ours(self, watch: _Watch, inos: Iterable[int]) -> None:
        """The replay of *watch* changed *inos*: changes by others still under way
        (awaiting the backing directory, say) compare with the values it left."""
        inodes = self.server.store.inodes
        for window in self._open:
            for w, fields in window:
                if w is watch:
                    for ino in inos:
                        if ino in fields and (i := inodes.get(ino)) is not None:
                            fields[ino] = (fields[ino][0], _values(i))
