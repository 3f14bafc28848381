"""A client of the metadata server: its session, its connection, the handshake.

A :class:`Session` is what a client holds (open handles, its lease token) and
outlives connections; a :class:`Connection` runs one authenticated socket: it
reads frames, executes calls in arrival order through the server (a
:class:`Dispatcher`, memfs.meta.server.MetaServer), queues those that may
wait and the calls behind them, and sends each reply once the journal records
it may reflect are durable.  What a call means is the server's business.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
import trio.lowlevel

from memfs import wire
from memfs.meta import codec
from memfs.meta.conn import ROLE, FrameSocket
from memfs.wire import Kind, WireError

log = logging.getLogger(__name__)

#: before authentication, payloads above this are refused
HANDSHAKE_MAX_PAYLOAD = 4096
#: a client that takes no reply for this long is closed
SEND_TIMEOUT = 30.0
#: calls a client may queue behind one that waits (for a recall, the backing directory)
MAX_QUEUED = 4096


#: a parsed call: (method, arguments); None for control calls; an unknown method
Parsed = tuple[codec.Method, list[Any]] | None | codec.UnknownMethod


class CloseConnection(Exception):
    """This connection must end (already logged)."""


def parse_call(value: Any) -> Parsed:
    """A call's method and arguments; None for a control call; the UnknownMethod
    (answered ENOSYS); WireError for anything malformed."""
    if type(value) is list and value and value[0] in ("describe", "session", "ping", "control"):
        return None
    try:
        return codec.decode_call(value)
    except codec.UnknownMethod as exc:
        return exc


async def handshake(fs: FrameSocket, peer: str, secret: bytes, within: float) -> None:
    """Authenticate a new connection (HELLO, AUTH, WELCOME) *within* seconds; refused:
    logged, ERROR(EACCES) sent, :class:`CloseConnection`."""
    hs = wire.Handshake(secret)
    try:
        with trio.fail_after(within):
            await fs.send(wire.frame(Kind.HELLO, 0, hs.hello()))
            got = await fs.receive()
            if got is None:
                raise WireError("connection closed before AUTH")
            h, payload = got
            if h.kind is not Kind.AUTH:
                raise WireError(f"expected AUTH, got {h.kind.name}")
            role = hs.check_auth(payload)
            if role != ROLE:
                raise WireError(f"role {role!r} is not served here (expected {ROLE!r})")
            await fs.send(wire.frame(Kind.WELCOME, h.req_id, hs.welcome()))
    except trio.TooSlowError:
        log.warning("%s: refused: no authentication within %.0f s", peer, within)
        raise CloseConnection from None
    except WireError as exc:
        log.warning("%s: refused: %s", peer, exc)
        with trio.move_on_after(1):
            try:
                await fs.send(wire.frame(Kind.ERROR, 0, wire.encode_error(errno.EACCES, str(exc))))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        raise CloseConnection from None


def new_token() -> int:
    """A lease token: 63 random bits (the value codec carries signed 64-bit integers)."""
    return secrets.randbits(63) | 1


@dataclass(eq=False)
class Session:
    """A client: its open handles and (memfs.meta.leases.Holder) what it caches."""

    sid: bytes
    opens: dict[int, int] = field(default_factory=dict)
    #: what it names to the memory servers (SESSION); replaced, and the old one
    #: fenced, when its leases are taken without its word (MetaServer.take_token)
    token: int = field(default_factory=new_token)
    #: its token was replaced since it last registered
    fenced: bool = False
    conn: Connection | None = None
    generation: int = 0
    last_heard: float = 0.0
    #: times it has (re-)registered (memfs.meta.leases.Holder)
    registrations: int = 0
    #: the newest connection (:attr:`Connection.serial`) that registered it, or is
    #: registering it: older ones may not any more
    claimant: int = 0

    def send_recall(self, rid: int, payload: list[Any]) -> bool:
        conn = self.conn
        if conn is None or conn.fs is None or conn.scope is None or conn.scope.cancel_called:
            return False
        frame = wire.frame(Kind.RECALL, rid, wire.encode(payload))
        conn.push(frame, 0)
        return True

    def send_unlocked(self, ino: int) -> None:
        """Tell the client a lock on *ino* went (it waits for one there)."""
        conn = self.conn
        if conn is not None and conn.fs is not None and conn.scope is not None \
                and not conn.scope.cancel_called:
            conn.push(wire.frame(Kind.UNLOCKED, 0, wire.encode([ino])), 0)

    def send_pool(self, incarnations: dict[str, int]) -> None:
        """Tell the client these memory servers were taken back at these incarnations
        (memfs.meta.takeback); not a session whose leases were taken without its word:
        it hears them when it registers again, its caches dropped."""
        conn = self.conn
        if conn is not None and conn.fs is not None and conn.scope is not None \
                and not conn.scope.cancel_called and not self.fenced:
            conn.push(wire.frame(Kind.POOL, 0, wire.encode(incarnations)), 0)

    def evict(self, reason: str) -> None:
        conn = self.conn
        if conn is not None and conn.scope is not None:
            log.warning("%s: evicting the client: %s", conn.peer, reason)
            conn.scope.cancel()


class Durability(Protocol):
    """What a connection needs of the journal (memfs.meta.journal.Journal)."""

    @property
    def seq(self) -> int:
        """The last record appended."""
        ...

    @property
    def durable_seq(self) -> int:
        """The last record on disk."""
        ...

    async def wait_durable(self, seq: int) -> None:
        """Until record *seq* is on disk."""
        ...


class Dispatcher(Protocol):
    """What a connection needs of the server that gives its calls meaning."""

    @property
    def journal(self) -> Durability | None:
        """Replies wait until the records they may reflect are on disk (None: no journal)."""
        ...

    #: a connection silent this long is closed (clients ping when idle)
    idle_timeout: float

    def may_wait(self, session: Session, value: Any, parsed: Parsed) -> bool:
        """Could executing this call wait?  Then it runs in the connection's queue."""
        ...

    async def execute(
        self, conn: Connection, value: Any, parsed: Parsed, *, checked: bool = False,
    ) -> tuple[Kind, bytes]:
        """Run one call: the reply's kind and body; WireError for a malformed one.
        *checked*: :meth:`may_wait` said False for it in this same step (nothing
        awaited since), so what it looked at need not be looked at again."""
        ...

    def recalled(self, session: Session, rid: int, payload: Any) -> None:
        """The client answered recall *rid* (*payload*: what it reports with it)."""
        ...

    def early_open(self, session: Session, parsed: Parsed) -> bool:
        """Is this call opens only, of files that exist, that need no recall?  (Then it
        runs as it is read, before calls queued ahead of it: see Connection.serve.)"""
        ...


_serials = itertools.count(1)


@dataclass(eq=False)
class Connection:
    """One connection of a client: its calls run in arrival order (see :meth:`serve`)."""

    peer: str
    session: Session
    server: Dispatcher
    #: frames waiting for the journal, as (frame, seq that must be durable first); a
    #: recall waits behind the replies before it, so a client never sees a reply
    #: that a recall it already handled should have invalidated
    outbox: collections.deque[tuple[bytes, int]] = field(default_factory=collections.deque)
    wake: trio.Event = field(default_factory=trio.Event)
    closing: bool = False
    fs: FrameSocket | None = None
    scope: trio.CancelScope | None = None
    #: calls queued behind one that waits (executed in arrival order)
    calls: collections.deque[tuple[int, Any, Parsed]] = field(default_factory=collections.deque)
    #: replies held back while more calls are already buffered (sent together)
    deferred: list[bytes] = field(default_factory=list)
    calls_wake: trio.Event = field(default_factory=trio.Event)
    busy: bool = False
    #: the client closed the connection itself (it exited, or dropped it after a
    #: timeout): it trusts nothing it cached before, so its leases end at once
    clean_close: bool = False
    #: the session registers on a newer connection (:meth:`supersede`): nothing
    #: more of this one runs; *retired* once its last call has ended
    superseded: bool = False
    retired: bool = False
    #: calls of this connection being executed
    running: int = 0
    #: set when :attr:`running` drops to 0 (for :meth:`supersede`)
    _quiet: trio.Event | None = None
    #: the order connections were accepted in (a client's later one is newer)
    serial: int = field(default_factory=lambda: next(_serials))
    #: a registration (``session`` call) runs in the executor: nothing passes it
    registering: bool = False

    async def _execute(self, value: Any, parsed: Parsed, *, checked: bool = False) -> tuple[Kind, bytes]:
        """Execute one call of this connection's, unless it was superseded (*checked*:
        see :meth:`Dispatcher.execute`)."""
        if self.superseded:
            return Kind.ERROR, wire.encode_error(
                errno.ESTALE, "this connection's session registered on a newer one")
        self.running += 1
        try:
            return await self.server.execute(self, value, parsed, checked=checked)
        finally:
            self.running -= 1
            if not self.running and self._quiet is not None:
                self._quiet.set()

    async def supersede(self) -> None:
        """The session registers on a newer connection: run nothing more of this one
        (its queued calls are dropped, later ones refused), wait for the call under
        way to finish, then close it.

        The client gave this connection up (a timeout, a lost network) with calls
        maybe still queued here, and takes the calls it has no answer to for
        failed; its registration states what it holds now.  A call of the old
        connection that ran after the registration would undo it: a close's report
        ending the write lease granted again since, a release dropping an open
        count it claims.  The call under way finishes first (within its own
        bounds), as if the connection had been served promptly.
        """
        self.superseded = True
        self.calls.clear()
        while self.running:
            if self._quiet is None or self._quiet.is_set():  # (shared by every waiter)
                self._quiet = trio.Event()
            await self._quiet.wait()
        self.retired = True
        if self.scope is not None:
            self.scope.cancel()

    def push(self, frame: bytes, needed: int, *, defer: bool = False) -> None:
        """Send *frame* after everything before it, once journal seq *needed* is durable.

        *defer*: more calls are already here; hold the frame until :meth:`push` is
        called without it (one send for the batch).
        """
        fs = self.fs
        assert fs is not None
        if self.outbox or needed:
            self.push_deferred()
            self.outbox.append((frame, needed))
            self.wake.set()
            return
        self.deferred.append(frame)
        if defer and len(self.deferred) < 64:
            return
        self.push_deferred()

    def push_deferred(self) -> None:
        """Send the replies held back by ``defer``."""
        if not self.deferred:
            return
        fs = self.fs
        assert fs is not None
        data = self.deferred[0] if len(self.deferred) == 1 else b"".join(self.deferred)
        self.deferred.clear()
        try:
            fs.send_now(data)
        except trio.BrokenResourceError:
            if self.scope is not None:
                self.scope.cancel()
            return
        if fs.pending():
            self.wake.set()

    def unanswered(self, kind: Kind, body: bytes) -> None:
        """A call with request id 0 wants no reply (a client's releases); its error is
        only logged (the client states its open counts again at its next registration)."""
        if kind is Kind.ERROR:
            log.debug("%s: a call without reply failed: %s", self.peer, wire.decode_error(body))

    def needed(self) -> int:
        """The journal record a reply sent now must wait for (0: none)."""
        journal = self.server.journal
        return journal.seq if journal is not None else 0

    async def serve(self, fs: FrameSocket) -> None:
        """Read frames; execute calls in arrival order; reply at once unless a reply must wait.

        A call that may wait (for a recall, or for the backing directory) runs in
        :meth:`_run_calls` and the calls after it queue behind it, while this task
        keeps reading: recall acknowledgements must get through meanwhile, or two
        clients recalling from each other would wait for each other.  Replies wait
        (in ``self.outbox``, sent by :meth:`_send_replies`) while the journal
        records they may reflect are not durable yet, or the socket does not take them.
        """
        self.fs = fs
        server = self.server
        async with trio.open_nursery() as nursery:
            self.scope = nursery.cancel_scope
            nursery.start_soon(self._send_replies, fs, nursery.cancel_scope)
            nursery.start_soon(self._run_calls)
            n = 0
            try:
                # One scope whose deadline moves: cheaper than a fail_after per frame.
                step = min(1.0, server.idle_timeout / 8)
                with trio.CancelScope(deadline=trio.current_time() + server.idle_timeout) as idle:
                    while True:
                        if n >= 32:  # calls read since the last look (each of a made call's too)
                            n = 0
                            await trio.lowlevel.checkpoint()  # a pipelining client must not starve others
                        if not fs.buffered():  # about to wait: from now on, at most this long
                            # (moved in steps: setting a deadline is not free)
                            now = trio.current_time()
                            if now + server.idle_timeout - idle.deadline > step:
                                idle.deadline = now + server.idle_timeout
                        got = await fs.receive()
                        if got is None:
                            log.debug("%s: client closed the connection", self.peer)
                            self.clean_close = True
                            break
                        h, payload = got
                        self.session.last_heard = trio.current_time()
                        if h.kind is Kind.RECALLED:
                            n += 1
                            if self.calls:
                                await self._run_made_now()
                            server.recalled(self.session, h.req_id, wire.decode(payload))
                            if not fs.buffered():  # replies held back for more input
                                self.push_deferred()
                            continue
                        if h.kind is not Kind.CALL:
                            raise WireError(f"unexpected {h.kind.name} frame")
                        value = wire.decode(payload)
                        parsed = parse_call(value)
                        n += codec.calls_in(parsed)
                        # Opens only count handles (a client's held opens, and others):
                        # counted as they are read, not behind calls of this session
                        # that wait (for a recall of a stopped node, say), so a recall's
                        # answer read after one finds its handle counted.  Sooner than
                        # the calls they pass changes nothing those do; an open of a
                        # file not made yet (its create waits ahead) stays in turn, and
                        # a client sends nothing behind its registration before that
                        # is answered.
                        early = ((self.busy or bool(self.calls)) and not self.registering
                                 and server.early_open(self.session, parsed))
                        if not early and (self.busy or self.calls
                                          or server.may_wait(self.session, value, parsed)):
                            if len(self.calls) >= MAX_QUEUED:
                                raise WireError(f"more than {MAX_QUEUED} calls queued")
                            self.calls.append((h.req_id, value, parsed))
                            self.calls_wake.set()
                            self.push_deferred()  # earlier replies must not wait for it
                            continue
                        # (may_wait or early_open just said no recall: none since, no await)
                        kind, body = await self._execute(value, parsed, checked=True)
                        if not h.req_id:  # no reply wanted
                            self.unanswered(kind, body)
                            if not fs.buffered():
                                self.push_deferred()
                            continue
                        # Replies to calls that came in one read go out in one send.
                        self.push(wire.frame(kind, h.req_id, body), self.needed(),
                                  defer=fs.buffered())
                if idle.cancelled_caught:
                    log.info("%s: silent for %.0f s, closing", self.peer, server.idle_timeout)
                    raise CloseConnection
                # The client is done sending: let the queued calls and last replies go out.
                while self.busy or self.calls:
                    await self.calls_wake.wait()
                self.closing = True
                self.wake.set()
                self.calls_wake.set()
            except WireError as exc:
                log.warning("%s: protocol error, closing the connection: %s", self.peer, exc)
                nursery.cancel_scope.cancel()
            except CloseConnection:
                nursery.cancel_scope.cancel()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                # The client went away (killed, or gave up on us): not an error.  Caught
                # here, or the nursery would wrap it in a group that the server logs as one.
                log.info("%s: connection lost: %s", self.peer, exc)
                # A reset comes from the client's kernel: its end is closed (the
                # process died with frames unread), as good as a clean close.
                self.clean_close = isinstance(exc.__cause__, ConnectionResetError)
                nursery.cancel_scope.cancel()


    async def _run_made_now(self) -> None:
        """Creates and unlinks made under a create lease, opens made under a file's
        lease and setattrs made under its write lease (``codec.HELD_CALLS``), that
        wait in this connection's queue (behind a call that waits, for a recall
        from another client say) run now, before the recall answer that came after
        them is applied: the client answers a recall once its creates are answered
        (or after ``answer_within`` anyway), and sends its held opens and setattrs
        before the answer, and the call that recalled must see them (an unlink must
        find the file open there, a stat the mode set).  They never wait (a create's
        directory is this session's alone, and an open's or setattr's file has no
        other writer while this session holds it; a create that would waits in
        turn, and the creates after it too; an open that waits holds up nothing)
        and do not depend on the calls they pass: a call naming one of their files
        comes after its create, and one before its unlink (a release, a write's
        allocation, a setattr) works as well on the unlinked file, an orphan until
        its last release; the client holds no setattr while a report, truncate or
        setattr of the file's mtime it sent waits (``LeaseKeeper.quiet``).  (Opens
        held under a file's lease seldom wait here: :meth:`serve` runs them as it
        reads them.)"""
        if self.registering:  # (they came after it, and its session is not settled yet)
            return
        server = self.server
        calls = list(self.calls)
        picked: list[tuple[int, Any, Parsed]] = []
        rest: list[tuple[int, Any, Parsed]] = []
        for n, item in enumerate(calls):
            _, value, parsed = item
            made = isinstance(parsed, tuple) and parsed[0].name in (*codec.HELD_CALLS, "made")
            if (parsed is None and value[0] not in ("ping", "describe")) or (
                    made and server.may_wait(self.session, value, parsed)):
                if made and codec.opens_only(parsed):
                    # Opens that wait (for another node's write lease) hold up
                    # nothing: what follows names other files, or counts handles.
                    rest.append(item)
                    continue
                # A session change, or one of them that must wait: they keep their
                # order among themselves, so what follows keeps its turn.
                rest += calls[n:]
                break
            (picked if made else rest).append(item)
        if not picked:
            return
        self.calls.clear()
        self.calls.extend(rest)
        for rid, value, parsed in picked:
            kind, body = await self._execute(value, parsed)
            if rid:
                self.push(wire.frame(kind, rid, body), self.needed())
            else:
                self.unanswered(kind, body)


    async def _run_calls(self) -> None:
        """Execute the calls that queued (see :meth:`serve`), in order, letting other
        clients' calls run after every 32 (each of a made call's counted)."""
        n = 0
        while True:
            while not self.calls:
                if self.closing:
                    return
                self.calls_wake = trio.Event()
                await self.calls_wake.wait()
            self.busy = True
            try:
                while self.calls:
                    if n >= 32:
                        n = 0
                        await trio.lowlevel.checkpoint()
                        continue  # (a RECALLED may have run some meanwhile)
                    rid, value, parsed = self.calls.popleft()
                    n += codec.calls_in(parsed)
                    self.registering = parsed is None and value[0] == "session"
                    try:
                        kind, body = await self._execute(value, parsed)
                    except WireError as exc:
                        log.warning("%s: protocol error, closing the connection: %s", self.peer, exc)
                        assert self.scope is not None
                        self.scope.cancel()
                        return
                    if rid:
                        self.push(wire.frame(kind, rid, body), self.needed())
                    else:
                        self.unanswered(kind, body)
            finally:
                self.busy = False
                self.registering = False
                self.calls_wake.set()


    async def _send_replies(self, fs: FrameSocket, scope: trio.CancelScope) -> None:
        """Send replies in order, each only once the changes it may reflect are durable."""
        journal = self.server.journal
        try:
            while True:
                if self.outbox:
                    if journal is not None:
                        await journal.wait_durable(self.outbox[0][1])
                    while self.outbox and (journal is None or self.outbox[0][1] <= journal.durable_seq):
                        fs.send_now(self.outbox.popleft()[0])
                if fs.pending():
                    with trio.fail_after(SEND_TIMEOUT):
                        await fs.flush()
                    continue
                if self.outbox:
                    continue
                if self.closing:
                    return
                await self.wake.wait()
                self.wake = trio.Event()
        except trio.TooSlowError:
            log.warning("%s: client does not read its replies, closing", self.peer)
            scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("%s: connection lost: %s", self.peer, exc)
            scope.cancel()

