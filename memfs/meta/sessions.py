"""The metadata server's client sessions and their open counts (memfs.meta.server).

Open counts belong to client *sessions*, not connections: a client names its
session (a random id) on every connection and states the handles it holds; the
server sets that session's counts to exactly that (so saying it twice is
harmless).  This is how handles survive a dropped connection and a server
restart.  A session whose client is gone for ``session_grace`` seconds is
released, and after a restart the unlinked-but-open inodes found in the journal
are held for the same time so their clients can reconnect and claim them.

:class:`SessionTable` keeps the sessions by id: it moves one to the connection
that names it, keeps its open counts in the store, and lets it go once its client
is gone (its leases when their term runs out, its handles after the grace).  What
a registration says besides (sizes, replayed creates, fences, locks) is the
server's business (``SessionClaims.claim``, memfs.meta.server_claims).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, ValuesView
from dataclasses import dataclass
from typing import Any

import trio

from memfs.errors import FsError
from memfs.meta import codec
from memfs.meta.leases import Item, LeaseTable, Settle, settles_from_wire
from memfs.meta.server_conn import Connection, Session
from memfs.meta.store import MetaStore
from memfs.wire import WireError

log = logging.getLogger(__name__)

#: with leases off, a client pings every few seconds when idle: silent longer than
#: this, its locks stand in nobody's way (with leases: silent for a lease term)
LOCK_SILENCE = 15.0
#: most handles one client may claim on one inode when it re-registers
MAX_HANDLES = 1 << 20


@dataclass
class Registration:
    """What a client states when it names its session on a connection (a ``session``
    call, see memfs.meta.server): the lists after *settles* are optional."""

    sid: bytes
    #: ino -> the handles it holds open
    claimed: dict[int, int]
    #: the sizes and mtimes of files it wrote under write leases
    settles: list[Settle]
    #: creates and unlinks made under create leases that it has no answer to, in
    #: order (None: not stated)
    ops: list[tuple[str, list[Any]]] | None
    #: the file locks it holds (None: not stated)
    locks: list[list[int]] | None
    #: a lease token under which its transfers may still run (0: none)
    fence: int

    @classmethod
    def from_wire(cls, raw: list[Any]) -> Registration:
        """The arguments of a ``session`` call (2 to 6 of them); WireError if malformed."""
        sid = codec.check_bytes(raw[0], "session id")
        if not 8 <= len(sid) <= 64:
            raise WireError("session id of a bad length")
        claimed: dict[int, int] = {}
        for item in codec.check_list(raw[1], "open handles"):
            ino, count = (codec.check_int(x, "open handle") for x in codec.check_list(item, "open handle", 2))
            if not 0 < count <= MAX_HANDLES:
                raise WireError(f"open handle count {count} out of range")
            claimed[ino] = claimed.get(ino, 0) + count
        settles = settles_from_wire(raw[2]) if len(raw) >= 3 else []
        if len(raw) < 4:
            return cls(sid, claimed, settles, None, None, 0)
        ops = []
        for item in codec.check_list(raw[3], "operations"):
            try:
                m, args = codec.decode_call(item)
            except codec.UnknownMethod as exc:
                raise WireError(f"registration: {exc.args[0]!r} is not replayed") from None
            if m.name not in codec.MADE_CALLS:
                raise WireError(f"registration: {m.name} is not replayed")
            ops.append((m.name, args))
        if len(raw) < 5:
            return cls(sid, claimed, settles, ops, None, 0)
        locks = [[codec.check_int(x, "lock") for x in codec.check_list(item, "lock", 7)]
                 for item in codec.check_list(raw[4], "locks")]
        fence = codec.check_int(raw[5], "fence") if len(raw) == 6 else 0
        return cls(sid, claimed, settles, ops, locks, fence)


class SessionTable:
    """The sessions of a metadata server by id, their open counts, and their end;
    see the module docstring.

    *conflicts* is what a call must recall first (``LeasePolicy.conflicts``);
    *stamp* gives what follows the time now (the server's one timestamp per
    change), *destroyed* journals the inodes a change destroyed, and *gone* is
    called with a session that this run forgets (unmounted, or expired).
    """

    def __init__(
        self, store: MetaStore, leases: LeaseTable, *, grace: float,
        conflicts: Callable[[Session | None, str, list[Any]], list[Item]],
        stamp: Callable[[], None], destroyed: Callable[[], None],
        gone: Callable[[bytes], None],
    ) -> None:
        self.store = store
        self.leases = leases
        #: seconds a vanished client's open files are kept for it (``MetaServer.session_grace``)
        self.grace = grace
        self._conflicts = conflicts
        self._stamp = stamp
        self._destroyed = destroyed
        self._gone = gone
        self._sessions: dict[bytes, Session] = {}

    def __getitem__(self, sid: bytes) -> Session:
        return self._sessions[sid]

    def __len__(self) -> int:
        return len(self._sessions)

    def values(self) -> ValuesView[Session]:
        """Every session (for tests and gauges; not to be changed)."""
        return self._sessions.values()

    def connected(self) -> int:
        """Sessions with a connection now (``--metrics``)."""
        return sum(1 for x in self._sessions.values() if x.conn is not None)

    def new(self) -> Session:
        """The session of a new connection, until its client names its own."""
        s = Session(os.urandom(16))
        self._sessions[s.sid] = s
        return s

    async def attach(self, conn: Connection, sid: bytes) -> Session:
        """Move *conn* to session *sid* (made if new), unless the client registers it
        on a newer connection already; *conn*'s session, now *sid*'s."""
        old = conn.session
        if old.sid != sid:
            if old.opens:
                raise FsError(errno.EINVAL, "session must be named before opening files")
            while (s := self._sessions.get(sid)) is not None:
                # Connections register in the order the client made them: one that
                # asks after a newer one did was given up by the client.
                if conn.serial < s.claimant:
                    raise FsError(errno.ESTALE, "this session registers on a newer connection")
                s.claimant = conn.serial
                prev = s.conn
                if prev is None or prev is conn or prev.retired:
                    break
                # The client gave that connection up: the call still running there
                # happens before this registration, what is queued there never
                # (Connection.supersede).  Waited for while the session is still
                # attached there: a recall of it goes there unanswered, and its
                # eviction cancels that connection, not this one.  (Its own detach
                # comes later and finds the session taken over, or before, and
                # hands it over as for any lost connection.)
                log.info("%s: session moves here from %s", conn.peer, prev.peer)
                await prev.supersede()
            self._sessions.pop(old.sid, None)
            s = self._sessions.get(sid)
            if s is None:
                s = self._sessions[sid] = Session(sid)
                s.claimant = conn.serial
            s.conn = conn
            s.generation += 1
            conn.session = s
        return conn.session

    # -- for the lock service (memfs.meta.locks) -------------------------------------------

    def holder_silent(self, sid: bytes) -> bool:
        """Has session *sid* not been heard from for a lease term (or gone)?"""
        s = self._sessions.get(sid)
        if s is None:
            return True
        silence = self.leases.term or LOCK_SILENCE
        return trio.current_time() - s.last_heard > silence

    def evict(self, sid: bytes, reason: str) -> None:
        """Close session *sid*'s connection, if it has one."""
        s = self._sessions.get(sid)
        if s is not None:
            s.evict(reason)

    def tell_unlocked(self, sid: bytes, ino: int) -> None:
        """Tell session *sid*'s client that a lock on *ino* went."""
        s = self._sessions.get(sid)
        if s is not None:
            s.send_unlocked(ino)

    def tell_pool(self, incarnations: dict[str, int]) -> None:
        """Tell every connected client which memory servers were taken back (and at
        which incarnation)."""
        for s in self._sessions.values():
            s.send_pool(incarnations)

    # -- open counts -------------------------------------------------------------------------

    async def set_opens(self, s: Session, ino: int, want: int) -> bool:
        """Make session *s*'s open count of *ino* *want*; False if it no longer exists."""
        have = s.opens.get(ino, 0)
        there = True
        try:
            while have < want:
                await self.store.open(ino)
                have += 1
        except FsError:
            there = False
        while have > want:
            await self.store.release(ino)
            have -= 1
        if have:
            s.opens[ino] = have
        else:
            s.opens.pop(ino, None)
        return there

    async def open(self, s: Session, ino: int) -> Any:
        """Open *ino* for session *s*; its attributes."""
        attr = await self.store.open(ino)
        s.opens[ino] = s.opens.get(ino, 0) + 1
        return attr

    async def release(self, s: Session, ino: int) -> None:
        """Release one of session *s*'s handles of *ino*."""
        n = s.opens.get(ino, 0)
        if n <= 0:
            # Never let one client drop another's counts; a re-registration may have
            # already settled this one.
            log.debug("release of inode %d that this session does not hold: ignored", ino)
            return
        if n == 1:
            del s.opens[ino]
            self.leases.done_writing(s, ino)  # its writes landed before it released
        else:
            s.opens[ino] = n - 1
        await self.store.release(ino)

    async def _release_ino(self, ino: int) -> None:
        items = self._conflicts(None, "release", [ino])
        first = True
        while items and self.leases.needs_recall(None, items, first=first):
            await self.leases.recall(None, items)
            first = False
        self._stamp()
        await self.store.release(ino)
        self._destroyed()

    async def hold_orphans(self, nursery: trio.Nursery) -> None:
        """After a restart: keep unlinked inodes that clients may still hold open."""
        orphans = [i.ino for i in self.store.inodes.values() if i.nlink <= 0]
        if not orphans:
            return
        for ino in orphans:
            await self.store.open(ino)
        log.info(
            "holding %d unlinked inodes for %.0f s for their clients to reclaim",
            len(orphans), self.grace,
        )
        nursery.start_soon(self._drop_orphans, orphans)

    async def _drop_orphans(self, orphans: list[int]) -> None:
        await trio.sleep(self.grace)
        for ino in orphans:
            await self._release_ino(ino)

    # -- a client gone -------------------------------------------------------------------------

    def detach(self, conn: Connection, nursery: trio.Nursery | None) -> None:
        """*conn* ended: its session ends too, or waits in *nursery* for its client
        (its leases for their term, its handles for the grace)."""
        s = conn.session
        if s.conn is not conn:
            return  # taken over by a newer connection
        s.conn = None
        assert nursery is not None
        # A connection the session is moving away from (a registration waits for it,
        # Connection.supersede) was given up, not closed for good: its session is
        # handled as cut off, so that registration finds its leases and sizes.
        clean = conn.clean_close and not conn.superseded
        if clean:
            self.leases.forget(s)
            self._destroyed()
        elif self.leases.holds(s) or any(w is s for w in self.leases.writers.values()):
            # Cut off: its caches stay trusted (by it) until its lease runs out.
            nursery.start_soon(self._forget_later, s, s.registrations)
        if not s.opens:
            self._sessions.pop(s.sid, None)
            if clean:
                self._gone(s.sid)  # unmounted (or gone): forgotten by this run
            return
        s.generation += 1
        log.info("%s: client gone with %d open inodes; holding them for %.0f s",
                 conn.peer, len(s.opens), self.grace)
        assert nursery is not None
        nursery.start_soon(self._expire, s, s.generation)

    async def _forget_later(self, s: Session, registrations: int) -> None:
        await trio.sleep_until(s.last_heard + self.leases.term)
        if s.conn is None and s.registrations == registrations:  # else: back since
            self._stamp()
            self.leases.forget(s)
            self._destroyed()

    async def _expire(self, s: Session, generation: int) -> None:
        await trio.sleep(self.grace)
        if s.conn is not None or s.generation != generation or self._sessions.get(s.sid) is not s:
            return
        del self._sessions[s.sid]
        # Back later, it is a stranger to this run: its sizes are refused.  (Now, not
        # after the releases below, which may wait: it may be back by then.)
        self._gone(s.sid)
        log.info("session expired: releasing %d open inodes", len(s.opens))
        for ino, n in s.opens.items():
            for _ in range(n):
                await self._release_ino(ino)
        s.opens.clear()
