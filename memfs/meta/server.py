"""The metadata server (``memfs mds``): one :class:`MetaStore` served to many mounts.

This module gives calls their meaning (leases, locks, recovery);
:mod:`memfs.meta.server_conn` runs each connection (handshake, frames, order of
calls and replies), :mod:`memfs.meta.sessions` keeps the client sessions and
their open counts, :mod:`memfs.meta.server_claims` takes their registrations,
:mod:`memfs.meta.server_made` the calls clients made under their leases,
:mod:`memfs.meta.lease_policy` says what each call recalls and what its reply
may be cached for, and :mod:`memfs.meta.fencing` keeps the fences of lease
tokens.

Protocol (frames from :mod:`memfs.wire`):

* The server sends HELLO; the client must answer AUTH (role ``"meta"``) within
  ``handshake_timeout``; the server checks the HMAC and sends WELCOME.  On any
  failure the server logs it, sends ERROR(EACCES) and closes: nothing is served
  before authentication, and payloads above 4 KiB are refused until then.
* Then CALL frames whose value is ``[method, *args]`` (:mod:`memfs.meta.codec`
  holds the allow-list and the argument types).  Replies carry the request id:
  OK(encoded result) or ERROR(errno, message) for :class:`FsError`; a method
  off the allow-list gets ERROR(ENOSYS).  A frame or value that does not parse
  closes that connection only (logged as a warning).  Calls of one connection
  are executed in the order they arrive (a client may pipeline them); each is
  atomic, because store methods never await.
* Control calls: ``["describe"]`` (pool volume URLs in order, volume size, chunk
  and stripe size: what a client needs to build its data path),
  ``["session", id, [[ino, count], ...], [[ino, size, mtime], ...], [replayed
  creates and unlinks], [locks held], fence]`` (answered with the inodes gone, those whose
  sizes were refused, the lease token, the replays refused and the locks lost; the
  last two lists and *fence* are optional: the lease token under which transfers
  of the client's may still run, fenced first) and ``["ping"]``.
* File locks (memfs.meta.locks) are kept here for every session and never
  journaled; a client states its own with each registration, so they survive a
  restart.  Nobody waits here for a lock: a waiter is refused and sent an
  UNLOCKED frame when a lock on that file goes.

Open counts belong to client *sessions*, not connections, so that handles
survive a dropped connection and a server restart (see :mod:`memfs.meta.sessions`).

With a :class:`~memfs.meta.journal.Journal`, every change is recorded (with
the one timestamp the store used for it), and no reply leaves before the
records it could depend on are durable.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import trio
import trio.lowlevel

from memfs import net, wire
from memfs.config import VolumeAddr
from memfs.errors import FsError, UsageError
from memfs.meta import Meta, codec, gates
from memfs.meta.conn import MAX_REPLY, FrameSocket
from memfs.meta.fencing import Fencing
from memfs.meta.gates import ChangeGates
from memfs.meta.journal import (
    GRACE_ENDED,
    LOST_WRITE,
    NEW_RUN,
    SESSION_GONE,
    Journal,
)
from memfs.meta.lease_policy import LeasePolicy
from memfs.meta.leases import (
    ANYWHERE,
    LEASE_TERM,
    RECALL_TIMEOUT,
    Holder,
    Item,
    LeaseTable,
    settles_from_wire,
)
from memfs.meta.locks import LockService
from memfs.meta.server_claims import SessionClaims
from memfs.meta.server_conn import (
    HANDSHAKE_MAX_PAYLOAD,
    CloseConnection,
    Connection,
    Parsed,
    Session,
    handshake,
    new_token,
)
from memfs.meta.server_made import MadeCalls
from memfs.meta.sessions import Registration, SessionTable
from memfs.meta.store import ANY_EARLIER, MetaStore
from memfs.wire import Kind, WireError

#: calls that wait for fences: chunks granted to write, a file's tail cut (its last
#: chunk kept: a stale write there would show when the file grows again)
_FENCED_CALLS = frozenset({"map_write", "allocate_ahead", "truncate", "punch"})

if TYPE_CHECKING:
    from memfs.metrics import Metrics

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
#: clients ping every few seconds when idle; a silent connection is a dead client
IDLE_TIMEOUT = 120.0
SESSION_GRACE = 60.0
#: largest map_read/map_write range per call (FUSE sends at most a few MiB)
MAX_RANGE = 16 << 30
#: appends' floors (codec.append_offset) below this: a write of MAX_RANGE there ends
#: within a signed 64-bit size, as the kernel's
MAX_FLOOR = (1 << 63) - MAX_RANGE
REPLY_QUEUE = 64
#: longest a map_read/map_write waits on the backing directory (a fetch, the dirty cap)
#: before the client is told to ask again
CALL_WAIT = 3.0
#: after a restart, calls wait at most this long (and at most a lease term) for the
#: clients of the run before to register again and replay what they had not sent
RECOVERY_WAIT = 3.0
#: a sequential writer's preallocation is capped at this many bytes past its write
MAX_AHEAD = 64 << 20
#: methods whose reply carries state a client may cache under its lease (see LeasePolicy.holds)
_LEASED = frozenset({
    "lookup", "getattr", "setattr", "truncate", "punch", "mknod", "create", "link", "unlink", "rmdir",
    "rename", "readlink", "readdir", "readdirplus", "open", "map_read", "map_write",
    "allocate_ahead", "getxattr", "listxattr", "create_at", "unlink_at",
})
#: methods whose reply names chunks that the client transfers to at once, even when
#: it may not cache the reply (see LeaseTable.register): chunk maps, and the tail of
#: the last chunk that a shrinking truncate leaves for the caller to zero
_MAPS = frozenset({"map_read", "map_write", "allocate_ahead", "truncate", "punch"})
#: with a backing directory: calls that may wait inside their change, run under the
#: file's gate (memfs.meta.gates)
_GATED = {"map_read": gates.READ, "map_write": gates.CHANGE, "allocate_ahead": gates.CHANGE,
          "truncate": gates.CUT, "punch": gates.CUT}


#: cluster-wide lock calls (memfs.meta.locks)
_LOCK_CALLS = frozenset({"getlk", "setlk", "flock", "unlock", "unwait"})


#: calls that may allocate or free a file's chunks (args[0] is the file; sizes go by
#: truncate, never setattr)
_CHUNK_CHANGES = frozenset({"map_write", "allocate_ahead", "truncate", "punch", "settle"})


class MetaServer:
    """Serves *store* to authenticated clients; see the module docstring."""

    def __init__(
        self, store: MetaStore, secret: bytes, pool: list[VolumeAddr] | None = None,
        journal: Journal | None = None, *,
        session_grace: float = SESSION_GRACE, idle_timeout: float = IDLE_TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        lease_term: float = LEASE_TERM, recall_timeout: float = RECALL_TIMEOUT,
    ) -> None:
        #: what calls are served by: the store, or (``--backing``) memfs.flush.BackedMeta
        #: wrapped around it, which may wait (fetches, the dirty cap)
        self.meta: Meta = store
        if pool is not None and len(pool) != store.n_volumes:
            raise UsageError(f"pool lists {len(pool)} volumes, the store has {store.n_volumes}")
        self.store = store
        self.secret = secret
        self.pool = pool
        self.journal = journal
        self.idle_timeout = idle_timeout
        self.handshake_timeout = handshake_timeout
        self.port = 0
        #: this filesystem's id (``describe``): kept by the journal across restarts; without
        #: one, a restarted server is a new filesystem and clients must not carry on
        self.fsid = journal.fsid if journal is not None and journal.fsid else os.urandom(16)
        #: memory server "host:port" -> the incarnation holding this pool's data (set by
        #: memfs.mds once known); clients treat any other incarnation as lost memory
        self.incarnations: dict[str, int] = {}
        #: those of them taken back in this run after a restart (memfs.meta.takeback):
        #: told to every client, and to each that registers from then on
        self.adopted: dict[str, int] = {}
        # One timestamp per call, recorded in the journal, so replay stamps the same.
        self.real_now = store.now
        self._t = self.real_now()
        store.now = self.clock
        self._destroyed: list[int] = []
        store.on_destroy = self._destroyed.append
        if journal is not None:
            store.space.on_clean = self._cleaned
            store.on_backing = self._backing_changed
            store.wait_durable = self._wait_durable
        #: after a restart, until --grace has passed: sessions of the previous run may
        #: come back and report what they wrote (their write leases died with it)
        self.recovering = False
        #: set once calls may run after a restart: every session of the run before
        #: registered again (replaying its unsent creates, unlinks and sizes), or
        #: the recovery window passed (see _recovery_window)
        self._recovered = trio.Event()
        self._recovered.set()
        self.nursery: trio.Nursery | None = None
        #: lease_term 0: clients cache nothing (every call goes to the server)
        self.leases = LeaseTable(term=lease_term, recall_timeout=recall_timeout,
                                 settle=self._settle, lost=self._lost_write,
                                 unsaid=self.take_token)
        self.gates = ChangeGates(self.leases)
        #: what each call recalls first and what its reply may be cached for
        self.lease_policy = LeasePolicy(store, self.leases, lambda: self.recovering)
        #: the clients' sessions by id, and their open counts
        self.sessions = SessionTable(store, self.leases, grace=session_grace,
                                     conflicts=self.lease_policy.conflicts, stamp=self.stamp,
                                     destroyed=self.journal_destroys, gone=self._session_gone)
        #: fences of tokens whose leases were taken (memfs.mds sets ``fencing.fences``)
        self.fencing = Fencing()
        #: request counters and latencies (``memfs mds --metrics``); None: not kept
        self.metrics: Metrics | None = None
        #: grant create leases (``memfs mds --sync-creates`` turns them off)
        self.async_creates = True
        #: grant write leases through a backing directory too (``memfs mds
        #: --no-backing-write-leases`` turns them off there)
        self.backing_write_leases = True
        #: calls clients made under their leases (memfs.meta.server_made), and their
        #: registrations (memfs.meta.server_claims)
        self.made = MadeCalls(self)
        self.claims = SessionClaims(self)
        self.locks = LockService(self.sessions.holder_silent, self.sessions.evict,
                                 self.sessions.tell_unlocked, trio.current_time)

    @property
    def session_grace(self) -> float:
        """Seconds a vanished client's open files are kept for it (``--grace``; after a
        restart, how long sessions of the run before may come back and report)."""
        return self.sessions.grace

    @session_grace.setter
    def session_grace(self, grace: float) -> None:
        self.sessions.grace = grace

    @property
    def write_leases(self) -> bool:
        """Write leases; through a backing directory unless
        ``--no-backing-write-leases``: a holder's reports of what it wrote (``settle``,
        recall answers, registrations) mark the file dirty for write-back
        (:meth:`MetaStore.settle_now`)."""
        return self.leases.term > 0 and (self.meta is self.store or self.backing_write_leases)

    @property
    def create_leases(self) -> bool:
        """Create leases (asynchronous creates) need write leases, and a create that
        needs nothing of a backing directory (it reserves names there)."""
        return self.write_leases and self.async_creates and self.meta is self.store

    def gauges(self) -> dict[str, float]:
        """This server's numbers for ``--metrics`` (sessions, leases, journal)."""
        out = {
            "memfs_mds_sessions": float(len(self.sessions)),
            "memfs_mds_sessions_connected": float(self.sessions.connected()),
            "memfs_mds_leased_inodes": float(len(self.leases.holders)),
            "memfs_mds_recalls_sent": float(self.leases.recalls_sent),
            # files written from several clients by turns (memfs.meta.contention)
            "memfs_mds_files_contended": float(self.leases.contention.count()),
            "memfs_mds_contentions": float(self.leases.contention.started),
            "memfs_mds_lease_evictions": float(self.leases.evictions),
            "memfs_mds_fences_sent": float(self.fencing.seq),
            # cluster-wide file locks held, sessions told to wait, holders evicted
            "memfs_mds_locks": float(len(self.locks.table)),
            "memfs_mds_lock_waiters": float(sum(len(w) for w in self.locks.waiting.values())),
            "memfs_mds_lock_evictions": float(self.locks.evictions),
            # fences some memory server has not confirmed (memory there is not reused)
            "memfs_mds_fences_unconfirmed": float(self.fencing.unconfirmed()),
        }
        if self.journal is not None:
            out["memfs_mds_journal_durable_seq"] = float(self.journal.durable_seq)
        return out

    def _settle(self, ino: int, size: int | None, mtime_ns: int,
                span: tuple[int, int] = ANYWHERE) -> None:
        """A write lease ended: its size and mtime (None: unknown), what it wrote and
        the end of its preallocation, applied and journaled."""
        size_ = -1 if size is None else size
        seen = self.claims.before(None, "settle", [ino]) if self.claims.watching else None
        if self.store.settle_now(ino, size_, mtime_ns, True, span) and self.journal is not None:
            self.journal.append(self._t, "settle", [ino, size_, mtime_ns, 1, *span])
        if seen:  # (a holder's writes: registrations replaying setattrs hear of them)
            self.claims.after(seen)
        self.journal_destroys()

    def _lost_write(self, holder: Any, ino: int) -> None:
        """*holder*'s write lease on *ino* ended without its word (MetaStore.unsaid).
        A directory's (a create lease) leaves nothing behind: its creates that never
        arrived are the client's to send again."""
        i = self.store.inodes.get(ino)
        if i is not None and i.children is None:
            self.lost_write_of(ino, holder.sid)

    def lost_write_of(self, ino: int, sid: bytes, lost: bool = True) -> None:
        if self.store.lost_write(ino, sid, lost) and self.journal is not None:
            self.journal.append(self._t, LOST_WRITE, [ino, sid, int(lost)])

    def _session_gone(self, sid: bytes) -> None:
        self.locks.drop_session(sid)
        self.claims.taken.pop(sid, None)
        if sid in self.store.this_run or sid in self.store.eligible:
            self.store.session_gone(sid)
            self.journal_session(SESSION_GONE, sid)
            self.check_recovered()

    def journal_session(self, kind: str, *args: Any) -> None:
        if self.journal is not None:
            self.journal.append(self.real_now(), kind, list(args))

    def journal_now(self, kind: str, args: list[Any]) -> None:
        """Record a change the server makes by itself (not a call), stamped now."""
        if self.journal is not None:
            self.journal.append(self.real_now(), kind, args)

    async def durable(self) -> None:
        """Until every record appended so far is durable (nothing to wait for without
        a journal)."""
        if self.journal is not None:
            await self._wait_durable()

    def _cleaned(self, chunks: list[tuple[int, int]]) -> None:
        assert self.journal is not None
        self.journal.append_clean(chunks)

    def _backing_changed(self, kind: str, args: list[Any]) -> None:
        """A fetch or eviction of the burst buffer (no call records it)."""
        assert self.journal is not None
        self.journal.append(0, kind, args)

    async def _wait_durable(self) -> None:
        assert self.journal is not None
        await self.journal.wait_durable(self.journal.seq)

    def clock(self) -> int:
        return self._t

    def stamp(self, t: int | None = None) -> None:
        """What follows is stamped with *t*, or the time now (one timestamp per change)."""
        self._t = self.real_now() if t is None else t

    # -- lifecycle -----------------------------------------------------------------------

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on *host*:*port* (0: any free port) and serve until cancelled.

        Reports the bound port through *task_status* once connections are accepted.
        """
        listeners = net.listen(host, port)
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                if self.journal is not None:
                    await nursery.start(self.journal.run)
                await self.sessions.hold_orphans(nursery)
                if self.journal is not None:
                    # Sessions of the runs before may come back and report (MetaStore.eligible).
                    self.store.new_run()
                    self.journal_session(NEW_RUN)
                    self.recovering = True
                    nursery.start_soon(self._end_recovery)
                    if self.leases.term > 0 and self.store.eligible:
                        self._recovered = trio.Event()
                        nursery.start_soon(self._recovery_window)
                self.port = listeners[0].getsockname()[1]
                for sock in listeners:
                    nursery.start_soon(self._accept, sock)
                log.info("metadata server listening on %s:%d", host, self.port)
                task_status.started(self.port)
        finally:
            for sock in listeners:
                net.close_socket(sock)

    async def _accept(self, listener: socket.socket) -> None:
        assert self.nursery is not None
        nursery = self.nursery

        def serve(sock: socket.socket, addr: tuple[Any, ...]) -> None:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nursery.start_soon(self._handle, sock, f"{addr[0]}:{addr[1]}")

        await net.accept_connections(listener, serve)

    async def _recovery_window(self) -> None:
        """After a restart: hold calls until the clients of the run before are back,
        at most a lease term (and RECOVERY_WAIT, well within a client's call timeout).

        A client held creates, unlinks and sizes under its leases that the server had
        not heard of when it died; it replays them when it registers again.  Until
        then another client would see the directory without them, or an older size
        (Lustre's MDS waits for its clients in the same way: its recovery window).
        A client that does not come back in time (dead, cut off) replays them later.
        """
        with trio.move_on_after(min(self.leases.term, self.session_grace, RECOVERY_WAIT)):
            await self._recovered.wait()
        if not self._recovered.is_set():
            log.info("recovery window over: %d client(s) of the previous run not back",
                     len(self.store.eligible - self.store.this_run))
            self._recovered.set()

    def check_recovered(self) -> None:
        if not self._recovered.is_set() and self.store.eligible <= self.store.this_run:
            log.info("every client of the previous run is back (or its session ended)")
            self._recovered.set()

    async def _end_recovery(self) -> None:
        """After a restart, once --grace has passed: preallocation that no client
        reclaimed is freed, and a writer of the previous run that comes back later
        hears that what it wrote since its last report is lost.

        Writers that held write leases report their sizes when they reconnect
        (``session``); until then, chunks past EOF may hold their data.
        """
        await trio.sleep(self.session_grace)
        self.recovering = False
        self.store.grace_ended()
        self.journal_session(GRACE_ENDED)
        self.stamp()
        n = 0
        for ino in self.store.preallocated():
            if ino not in self.leases.writers:
                self._settle(ino, None, 0, ANYWHERE)
                n += 1
        if n:
            log.info("freed the unused preallocation of %d files", n)

    # -- one connection --------------------------------------------------------------------

    async def _handle(self, sock: socket.socket, peer: str) -> None:
        conn = Connection(peer, self.sessions.new(), self)
        conn.session.conn = conn
        fs = FrameSocket(sock, HANDSHAKE_MAX_PAYLOAD)
        try:
            await handshake(fs, peer, self.secret, self.handshake_timeout)
            fs.max_payload = wire.MAX_PAYLOAD
            log.debug("%s: client authenticated", peer)
            await conn.serve(fs)
        except CloseConnection:
            pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("%s: connection lost: %s", peer, exc)
        except Exception:
            log.exception("%s: connection failed", peer)
        finally:
            fs.close()
            self.sessions.detach(conn, self.nursery)

    def recalled(self, session: Session, rid: int, payload: Any) -> None:
        self.stamp()
        self.leases.recalled(session, rid, settles_from_wire(payload))

    def may_wait(self, session: Session, value: Any, parsed: Parsed) -> bool:
        """Could executing this call wait?  Then it must not run in the reading task.

        A registration may (for the connection the session moves from,
        Connection.supersede, and for its replayed creates' recalls): the reader
        then still reads the client's answers to recalls of the session."""
        if parsed is None:
            return value[0] in ("control", "session")
        if isinstance(parsed, codec.UnknownMethod):
            return False
        if not self._recovered.is_set():
            return True
        m, args = parsed
        if self.meta is not self.store and m.name in _GATED:
            return True
        if self.fencing.busy and m.name in _FENCED_CALLS:
            return True
        leases = self.leases
        if not (leases.holders or leases.writers or leases.writing):
            return False  # (what needs_recall looks at: nothing to recall)
        if m.name == "made":
            return any(self._recalls(session, call[0], call[1:]) for call in args[0])
        return self._recalls(session, m.name, args)

    def early_open(self, session: Session, parsed: Parsed) -> bool:
        """Opens only (an ``open``, or a ``made`` call of opens: memfs.meta.remote_conn
        frames held opens apart from creates), of files that exist, that need no
        recall (held opens never do: no other session holds the write lease of a
        file this one holds)."""
        if not isinstance(parsed, tuple) or not self._recovered.is_set():
            return False  # (after a restart every call waits for the recovery window)
        m, args = parsed
        if not codec.opens_only(parsed):
            return False
        inos = [args[0]] if m.name == "open" else [call[1] for call in args[0]]
        return all(ino in self.store.inodes and not self._recalls(session, "open", [ino])
                   for ino in inos)

    def _recalls(self, session: Session, name: str, args: list[Any]) -> bool:
        """Must call *name* recall other clients' leases first?"""
        items = self.lease_policy.conflicts(session, name, args)
        return bool(items) and self.leases.needs_recall(session, items)

    # -- calls ---------------------------------------------------------------------------

    async def execute(
        self, conn: Connection, value: Any, parsed: Parsed, *, checked: bool = False,
    ) -> tuple[Kind, bytes]:
        """Run one (decoded) call; WireError for a malformed one (the connection closes).
        Counted and timed per method when :attr:`metrics` is set.  *checked*: see
        :meth:`Dispatcher.execute`."""
        obs = self.metrics
        if obs is None or (type(parsed) is tuple and parsed[0].name == "made"):  # (each call counted)
            return await self._execute_call(conn, value, parsed, checked)
        started = time.perf_counter()
        kind, payload = await self._execute_call(conn, value, parsed, checked)
        if parsed is None:
            op = "control"
        elif isinstance(parsed, codec.UnknownMethod):
            op = "unknown"
        else:
            op = parsed[0].name
        obs.observe(op, started, wire.decode_error(payload)[0] if kind is Kind.ERROR else None)
        return kind, payload

    async def _execute_call(
        self, conn: Connection, value: Any, parsed: Parsed, checked: bool = False,
    ) -> tuple[Kind, bytes]:
        if parsed is None:
            try:
                return Kind.OK, wire.encode(await self._control(conn, value))
            except FsError as exc:
                return Kind.ERROR, wire.encode_error(exc.errno, exc.args[1])
        if isinstance(parsed, codec.UnknownMethod):
            log.warning("%s: refused a call of %r: not a metadata method", conn.peer, parsed.args[0])
            return Kind.ERROR, wire.encode_error(errno.ENOSYS, f"no method {parsed.args[0]!r}")
        m, args = parsed
        if m.name in ("map_read", "map_write", "allocate_ahead") and not (
            # (negative: it appends, at least at a floor that a signed 64-bit size holds)
            (args[1] >= 0 or m.name == "allocate_ahead" and -args[1] - 1 < MAX_FLOOR)
            and 0 <= args[2] <= MAX_RANGE and (m.name != "allocate_ahead" or args[3] >= 0)
        ):
            # FUSE never asks this; the store would walk (or list) every chunk of the range.
            return Kind.ERROR, wire.encode_error(errno.EINVAL, "offset or length out of range")
        if not self._recovered.is_set():
            await self._recovered.wait()  # bounded: see _recovery_window
        session = conn.session
        if m.name == "made":
            return await self.made.run(conn, args[0], checked)
        if self.meta is self.store or m.name not in _GATED:
            return await self.run_call(conn, value, m, args, checked=checked)
        # Through a backing directory the call may wait between its recall and its
        # change: one session's at a time (memfs.meta.gates).  Its wait there and
        # for DIR share one bound, the client's call timeout being well above it.
        mode = _GATED[m.name]
        start = trio.current_time()
        try:
            await self.gates.enter(session, args[0], mode=mode, deadline=start + CALL_WAIT)
        except FsError as exc:
            return Kind.ERROR, wire.encode_error(exc.errno, exc.args[1])
        try:
            return await self.run_call(conn, value, m, args,
                                        max(start + CALL_WAIT, trio.current_time() + CALL_WAIT / 3))
        finally:
            self.gates.leave(session, args[0], mode=mode)

    async def run_call(
        self, conn: Connection, value: Any, m: codec.Method, args: list[Any],
        until: float = math.inf, *, checked: bool = False,
    ) -> tuple[Kind, bytes]:
        """*until*: when a call that waits on the backing directory answers EINPROGRESS
        (default: ``CALL_WAIT`` after it gets there).  *checked*: :meth:`may_wait`
        found nothing to recall, with no await since (the conflicts are not computed
        again: a few microseconds per call, found in profiles)."""
        session = conn.session
        first = True
        fenced_before = self.fencing.seq
        if m.name in ("map_write", "allocate_ahead") and self.leases.term > 0:
            # Several sessions writing the file by turns make it contended
            # (memfs.meta.contention): no write leases, recalls by range.
            self.leases.contention.wrote(session, args[0])
        if m.name == "map_read":
            # A reader waits for writers without a lease to land their bytes; one
            # that writes on and on makes it ask again (EINPROGRESS), not time out.
            until = min(until, trio.current_time() + CALL_WAIT)
        while True:
            if checked:
                checked = False  # (only this pass: after an await, ask again)
            elif self.leases.term > 0:
                # What conflicts may change while we wait (another call renamed the
                # entry, say): ask again until nothing is left to recall.
                while (items := self.lease_policy.conflicts(session, m.name, args)) and \
                        self.leases.needs_recall(session, items, first=first):
                    if m.name == "map_read" and trio.current_time() >= until:
                        return Kind.ERROR, wire.encode_error(
                            errno.EINPROGRESS, "waiting for another client's writes")
                    await self.leases.recall(session, items)
                    first = False
                    fenced_before = self.fencing.seq  # its evictions' fences too
            # Chunks granted to write, or a tail cut, only once a client whose leases
            # were taken before (maybe by these recalls) is shut out of the memory
            # servers (not waiting for later fences); then the conflicts again.
            if not (self.fencing.busy and m.name in _FENCED_CALLS
                    and await self.fencing.wait_begun(fenced_before)):
                break
        if m.name == "allocate_ahead" and (floor := codec.append_floor(args[1])) is not None:
            self._place_append(session, args, floor)
        if (m.name in ("map_write", "allocate_ahead") and args[2] and self.leases.term > 0
                and self.meta is not self.store):
            # Through a backing directory the call may wait before it is applied, and
            # a reader let in meanwhile must wait for our bytes too: marked now, and
            # again at the reply (a mark the reader's recall cleared: that recall also
            # moved our client's generation, so it asks again, recalling the reader).
            self.leases.wrote(session, args[0])
        self.stamp()
        if self.recovering and m.name in _CHUNK_CHANGES and self.store.eligible:
            # A writer of an earlier run may no longer have its space past EOF here.
            self.lost_write_of(args[0], ANY_EARLIER)
        atime = self._atime(args[0]) if m.name == "map_read" and self.journal else None
        journaled = m.mutates
        widen = True
        # What it sets of files whose setattrs a registration replays (memfs.meta.server_claims)
        seen = self.claims.before(session.sid, m.name, args) if self.claims.watching else None
        try:
            if m.name == "open":
                result: Any = await self.sessions.open(session, args[0])
            elif m.name == "create":
                # Through the burst buffer if there is one: it reserves a name.
                result = await self.meta.create(*args)
                session.opens[result.ino] = session.opens.get(result.ino, 0) + 1
                if self.journal is not None:
                    self.journal.append(self._t, "mknod", [*value[1:6], 0, None])
            elif m.name in ("release", "releases"):
                for ino in args[0] if m.name == "releases" else args[:1]:
                    await self.sessions.release(session, ino)
                result = None
            elif m.name in _LOCK_CALLS:
                if args[0] not in self.store.inodes:
                    raise FsError(errno.ENOENT, f"no inode {args[0]}")
                result = self.locks.call(session.sid, m.name, args)
            elif m.name == "reserve_inos":
                result = self.made.reserve_inos(session, args[0])
            elif m.name == "create_at":
                self.made.create_at(session, args)
                result = None
            elif m.name == "unlink_at":
                result = await self.made.unlink_at(session, args)
            elif m.name == "atime_at":
                self.made.atime_at(args)
                result = None
            elif m.name == "setattr_at":
                await self.made.setattr_at(session, args, self.leases.is_writer(session, args[0]))
                result = None
            elif m.name == "settle":
                # Only the writer's reports count: one sent before its lease was
                # revoked arrives after the revocation's (newer) answer.
                journaled = self.leases.is_writer(session, args[0])
                if journaled:
                    await self.store.settle_write(*args)
                    if args[3]:
                        self.leases.release_write(session, args[0])
                elif (session.sid in self.store.unsaid.get(args[0], ())
                      and (i := self.store.inodes.get(args[0])) is not None and args[1] > i.size):
                    # Its lease ended without its word and this is larger than anything
                    # known: lost (it has not registered since, so it does not know).
                    raise FsError(errno.ESTALE, f"size {args[1]} of inode {args[0]} refused: "
                                                "the write lease ended without this client")
                result = None
            elif m.name in ("unlink", "rmdir", "rename"):
                named = [self.child(args[0], args[1])]
                if m.name == "rename":
                    named.append(self.child(args[2], args[3]))
                await self._call(m, args)
                # what the names named, and the directories' new mtime (the call's time)
                result = [*named, self._t]
            elif m.name == "allocate_ahead":
                sequential = args[3] > 0
                # What is journaled is what is given (replay gives the same).
                args[3] = (self.meta.ahead_room(args[1], args[2], min(args[3], MAX_AHEAD))
                           if self.write_leases and not self.leases.contention.contended(args[0])
                           else 0)
                i = self.store.inodes.get(args[0])
                had = len(i.chunks) if i is not None and i.chunks is not None else -1
                result = await self._call(m, args, until)
                # A writer that is not sequential (no space ahead) into space it had to
                # allocate writes where nothing is yet: the map around it would tell it
                # little (what it allocated itself) at the cost of encoding it all again
                # for every chunk it touches.
                widen = sequential or i is None or i.chunks is None or len(i.chunks) == had
            elif m.name == "map_read" and self.leases.term > 0:
                result = await self._map_read(session, m, args, until)
            else:
                result = await self._call(m, args, until)
        except FsError as exc:
            self.journal_destroys()
            if seen:  # (a fetch's wait may have moved an access time)
                self.claims.after(seen, applied=False)
            kind = Kind.ERROR
            if (((m.name == "lookup" and exc.errno == errno.ENOENT)
                    or (m.name == "getxattr" and exc.errno == errno.ENODATA))
                    and self.leases.term > 0 and args[0] in self.store.inodes):
                # A name known absent (an entry, an xattr): the client may cache that,
                # its holding of the inode tells it when the name appears.
                if self.leases.register(session, [args[0]]):
                    kind = Kind.ERROR_CACHE
            return kind, wire.encode_error(exc.errno, exc.args[1])
        except Exception:
            log.exception("%s: %s failed", conn.peer, m.name)
            if seen:
                self.claims.after(seen, applied=False)
            return Kind.ERROR, wire.encode_error(errno.EIO, "internal error in the metadata server")
        if m.name == "drop_privileges" and not result:
            journaled = False  # nothing dropped: nothing to replay
        if seen:
            self.claims.after(seen)
        if self.journal is not None:
            if journaled:
                # (allocate_ahead: as applied, its offset placed and its space ahead given)
                self.journal.append(self._t, m.name, args[:4] if m.name == "allocate_ahead" else value[1:])
            elif atime is not None and self._atime(args[0]) != atime:
                self.journal.append(self._t, "map_read", [args[0], 0, 0])
        self.journal_destroys()
        body = wire.encode(m.result_to_wire(result))
        if len(body) > MAX_REPLY:
            log.error("%s: %s reply of %d bytes is too large", conn.peer, m.name, len(body))
            return Kind.ERROR, wire.encode_error(errno.EOVERFLOW, "reply too large")
        kind = Kind.OK
        if m.name in _LEASED and self.leases.term > 0:
            if self.leases.register(session, self.lease_policy.holds(m.name, args, result),
                                    transfer=m.name in _MAPS, span=self.lease_policy.span(m.name, args)):
                kind = Kind.OK_CACHE
                # Not while another session's map read is under way (waiting for a
                # fetch, say): registered after this, it would cache what this writer
                # then changes without asking (its chunks read before our bytes land).
                if (m.name == "allocate_ahead" and self.write_leases
                        and not self.gates.others_reading(session, args[0])
                        and self.leases.grant_write(session, args[0])):
                    kind = Kind.OK_WRITE
                elif (m.name == "create" and self.create_leases
                        and self.leases.grant_directory(session, args[0])):
                    kind = Kind.OK_WRITE  # a create lease on the directory
                if m.name == "map_read" or (m.name == "allocate_ahead" and widen):
                    body = self.lease_policy.widened(m.name, args, result) or body
            if m.name in ("map_write", "allocate_ahead") and kind is not Kind.OK_WRITE and args[2]:
                # Its bytes go out after this reply: readers elsewhere (and the
                # write-back) wait for them.
                self.leases.wrote(session, args[0], placed=True)
        if m.name in ("truncate", "punch") and result:
            self.lease_policy.tail_sent(args[0])
            if (m.name == "punch" and self.leases.term > 0
                    and self.leases.writers.get(args[0]) is not session):
                # Zeros to land below EOF: others' reads recall the caller first, whose
                # answer waits for them (a truncate's tail is past EOF: read by none).
                # (A write lease's holder is recalled by them anyway.)
                self.leases.wrote(session, args[0], placed=True)
        return kind, body

    def _place_append(self, session: Session, args: list[Any], floor: int) -> None:
        """An ``O_APPEND`` write (``codec.append_offset``): at the end of file as of now,
        after the recalls (another writer's answer said its size), so two clients
        appending at once get places of their own.  Nothing changes the size from
        here to the write: the store applies it without an await, and through a
        backing directory (which may wait for a fetch or the dirty cap first) the
        file's change gate shuts other sessions' changes out until the reply, and
        the recalls took every other writer's lease.  The caller's *floor* counts
        only while it still holds the write lease: then no one else changed the
        size, and its own last writes may not have been reported; once its lease
        was taken, the answer said them."""
        i = self.store.inodes.get(args[0])
        size = i.size if i is not None else 0  # (the store refuses what is not a file)
        if self.leases.is_writer(session, args[0]):
            size = max(size, floor)
        args[1] = size

    async def recall_inodes(self, inos: list[int]) -> None:
        """Take everything clients cache of *inos* back, before the burst buffer's
        eviction frees their chunks (``LeasePolicy.recall_inodes``)."""
        await self.lease_policy.recall_inodes(inos)

    def writes_landed(self, ino: int) -> bool:
        """Has every write to *ino* reached the memory servers, for the write-back
        (``LeasePolicy.writes_landed``)?"""
        return self.lease_policy.writes_landed(ino)

    async def glimpse_writers_of(self, ino: int) -> None:
        """Recall, briefly, *ino*'s writers that have not confirmed their writes, for the
        write-back (``LeasePolicy.glimpse_writers_of``)."""
        await self.lease_policy.glimpse_writers_of(ino)

    def evictions_held(self) -> bool:
        """Within the grace after a restart, until every session of the run before is
        back: each may report writes made under a write lease (the journal has no
        leases) into chunks an eviction would free, and its reports come with its
        registration.  (A burst buffer's eviction waits; calls that need room wait
        with it, asking again as usual.)"""
        return (self.write_leases and self.recovering
                and bool(self.store.eligible - self.store.this_run))

    def child(self, parent: int, name: bytes) -> int:
        d = self.store.inodes.get(parent)
        if d is None or d.children is None:
            return 0
        return d.children.get(name, 0)

    async def _map_read(self, session: Session, m: codec.Method, args: list[Any],
                        until: float) -> Any:
        """A chunk map, read after every writer without a lease of the file landed its
        bytes (the recalls before the call).  Through a backing directory the read may
        wait (a fetch), and another session may be sent where to write meanwhile:
        then that writer is waited for too, and the map read again."""
        ino = args[0]
        items = [Item(ino, write_only=True)]
        while True:
            seq = self.leases.wrote_seq.get(ino)
            result = await self._call(m, args, until)
            if self.leases.wrote_seq.get(ino) == seq or not self.leases.others_writing(session, ino):
                return result
            while self.leases.needs_recall(session, items):
                if trio.current_time() >= until:
                    raise FsError(errno.EINPROGRESS, "waiting for another client's writes")
                await self.leases.recall(session, items)

    async def _call(self, m: codec.Method, args: list[Any], until: float = math.inf) -> Any:
        if m.name not in _GATED or self.meta is self.store:
            return await m.bind(self.meta)(*args)
        # With a backing directory a write may wait for write-back (the dirty cap)
        # or room, a read or a truncate for data fetched from DIR: answer "not yet"
        # well before the client's call timeout, and it asks again (RemoteMeta's
        # map_read, map_write, truncate).  What a fetch brought in so far stays; the
        # next call goes on from there.
        with trio.move_on_at(min(until, trio.current_time() + CALL_WAIT)):
            return await m.bind(self.meta)(*args)
        raise FsError(errno.EINPROGRESS, "waiting for the backing directory")

    def _atime(self, ino: int) -> int | None:
        i = self.store.inodes.get(ino)
        return None if i is None else i.atime_ns

    def journal_destroys(self) -> None:
        if self._destroyed:
            for ino in self._destroyed:
                if self.journal is not None:
                    self.journal.append_destroy(ino)
                self.leases.destroyed(ino)
                self.locks.drop_inode(ino)
            self._destroyed.clear()

    async def _control(self, conn: Connection, value: list[Any]) -> Any:
        name, *raw = value
        if name == "ping" and not raw:
            return None
        if name == "describe" and not raw:
            s = self.store
            return {
                "fsid": self.fsid,
                "volumes": [str(v) for v in self.pool] if self.pool else [],
                "n_volumes": s.n_volumes,
                "volume_size": s.space.allocators[0].n_chunks * s.chunk_size,
                "chunk_size": s.chunk_size,
                "stripe_size": s.default_spec.stripe_size,
                # memory server "host:port" -> incarnation the pool's data lives in
                "incarnations": dict(self.incarnations),
                # how long a client may trust what it caches (0: cache nothing), and
                # how soon it must answer a recall
                "lease_term": float(self.leases.term),
                "recall_timeout": float(self.leases.recall_timeout),
                # most creates and unlinks a client's ``made`` call may carry
                "made_max": codec.MAX_MADE,
                # allocate_ahead places appends itself (codec.append_offset)
                "appends": True,
                # a made call may carry opens, run before a recall's answer read
                # after them (RemoteMeta.open)
                "held_opens": True,
                # and setattrs made under a write or create lease (RemoteMeta.setattr)
                "held_setattrs": True,
                # and access times of reads from cached maps (MapClient.read)
                "held_atimes": True,
            }
        if name == "control" and len(raw) == 2:
            op, args = raw
            if type(op) is not str or type(args) is not dict:
                raise WireError("malformed control call")
            try:
                if op == "flush" and self.meta is not self.store:
                    await self.lease_policy.glimpse_writers(conn.session)
                return await self.meta.control(op, args)
            except FsError:
                raise
            except Exception:
                log.exception("%s: control %s failed", conn.peer, op)
                raise FsError(errno.EIO, "internal error in the metadata server") from None
        if name == "session" and len(raw) in (2, 3, 4, 5, 6):
            r = Registration.from_wire(raw)
            if r.ops is None:
                return await self.claims.claim(conn, r.sid, r.claimed, r.settles)
            if r.locks is None:
                return await self.claims.claim(conn, r.sid, r.claimed, r.settles, r.ops)
            answer = await self.claims.claim(conn, r.sid, r.claimed, r.settles, r.ops, fence=r.fence)
            # The locks its client holds (memfs.meta.locks): those lost meanwhile are
            # refused (after the handles: a lock is on an open file).
            conn.session.last_heard = trio.current_time()  # (the above may have waited)
            return [*answer, self.locks.reclaim(conn.session.sid, r.locks, self.store.inodes.__contains__)]
        raise WireError(f"malformed {name} call")

    # -- fencing: a lease taken without the client's word ------------------------------

    def take_token(self, holder: Holder) -> None:
        """*holder*'s leases are being taken without its word (evicted, cut off, gone):
        give it a new token (its next registration hears it) and fence the old one on
        every memory server, so that no transfer it began under them lands from now
        on.  Once per registration: the eviction and the forget that follows it
        fence once."""
        if not isinstance(holder, Session) or holder.fenced:
            return
        holder.fenced = True
        old, holder.token = holder.token, new_token()
        if self.nursery is not None:
            self.fencing.begin(self.nursery, old)
