"""The ``tcp`` transport: pool volumes held by ``memfs memd`` servers, reached over TCP.

Pool volume ``i`` is ``volumes[i]``, a (server, volume index on that server)
pair from a pool spec (``tcp://host:port/N``).  Open it with
:func:`open_tcp_transport`, which owns the nursery of its deadline watchdog.

Connections and requests:

* up to ``connections_per_server`` connections per server, used round robin
  and opened lazily: at start one per server (its INFO gives the volume
  sizes), the others on first use, and a failed one again on the next request
  that picks it;
* requests are multiplexed: each connection has any number outstanding,
  matched to replies by request id.  The requesters receive the replies
  themselves, one at a time (see :class:`_Conn`), so a small request costs
  one task and no timer: its frame goes to the socket synchronously when
  nobody else is sending, and the requester waits on the socket for its
  reply.  A frame the socket does not take at once is finished under the
  connection's send lock (shielded from the caller's cancellation, never from
  the deadline), so frames never interleave;
* READ replies are received straight into the caller's buffer (a small one
  through the connection's receive buffer); WRITE data is sent straight from
  it with scatter/gather ``sendmsg``.  If a caller gives up while its reply is
  arriving, the rest lands in a scratch buffer instead;
* posted writes (:meth:`TcpTransport.post_write`) to a server that offers it go
  as WRITE_QUIET, not answered one by one: the server serves a connection in
  order, so the answer to any later request there (every 16th write is sent
  answered; a SYNC where none follows soon) confirms them.  Quiet writes of
  ``bytes`` (a FUSE write's, immutable) are held back and go out with the next
  frame on their connection (up to ``CORK_BYTES``, or at the drainer's next
  look): one ``sendmsg`` and one wake-up of the server for a run of them.

Failures (all :class:`~memfs.errors.TransportError`, EIO to applications):

* every request, including any connect and handshake it needs, finishes within
  ``io_timeout`` or fails; the connection it waited on is then reset (its
  other requests fail at once) and reconnected on the next request.  Waits
  for a connection or to send have their own deadlines; waits for replies are
  watched by one task (:meth:`TcpTransport._watch_deadlines`) instead of a
  timer per request.  A dead or hung server stalls only requests to its own
  volumes: other servers have their own connections;
* a client of a filesystem (*fsid*: the mds, its mounts) claims the volumes
  it uses on every connection to a server that offers it (CLAIM, see
  :mod:`memfs.transport.memd`): volumes another filesystem holds are refused,
  and the connection attempt fails with :class:`~memfs.errors.ClaimRefused`
  naming the server and volume;
* a server's *incarnation* (from INFO) is remembered on first contact.  If a
  reconnect finds another one, the server restarted and the memory behind its
  volumes is blank: every later request to those volumes fails ("memory
  server X restarted; its data is lost") instead of reading zeros as data.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import trio
import trio.lowlevel

from memfs import wire
from memfs.config import VolumeAddr
from memfs.errors import ClaimRefused, TransportError, UsageError
from memfs.transport import Buffer, Posted, Transport, VolumeInfo
from memfs.transport.sockio import (
    Linger,
    PeerClosed,
    RecvBuffer,
    close_socket,
    connect,
    recv_frame,
    send_all,
    send_now,
)
from memfs.wire import Kind

log = logging.getLogger(__name__)

DEFAULT_IO_TIMEOUT = 10.0
#: the longest a server that refused our claim is left alone before we ask again
CLAIM_BACKOFF_MAX = 30.0
#: data bytes per request; larger reads and writes are split (wire.MAX_PAYLOAD
#: leaves room for the WRITE struct)
MAX_IO = 16 << 20
ROLE = "tcp"
_INFO_ID = 1
#: the request id of SESSION (also memfs.transport.bulk's)
SESSION_ID = 2
#: the request id of CLAIM (also memfs.transport.bulk's)
CLAIM_ID = 3
_INFO_MAX = 1 << 20
_SMALL_REPLY_MAX = 64 << 10  # OK to WRITE/ZERO is empty, ERROR is short
#: a small READ's reply (up to 64 KiB of data) arrives in one recv
_RECV_BUFFER = _SMALL_REPLY_MAX + 64
#: a receiver lets other tasks run after about this much work without a wait
#: (a reply counts like _REPLY_WORK bytes of data)
_RECEIVE_WORK = 1 << 20
_REPLY_WORK = 64 << 10
#: how long a small READ's reply is polled for before its task parks, while the loop
#: has nothing else to do (RecvBuffer.linger); 0: never
LINGER = 50e-6
#: an idle connection is checked for a server that went away after this long
_IDLE_CHECK = 0.001
#: a drainer of posted writes takes their answers this often while writes keep coming
#: (each look is a wake-up of the client: 1 ms cost it ~10% more CPU per 16 KiB
#: random write than 4 ms, with quiet writes answered one in 16)
_DRAIN_EVERY = 0.004
#: quiet writes of ``bytes`` held back on a connection, at most this many bytes in
#: all (see TcpTransport.post_write)
CORK_BYTES = 256 << 10
#: posted writes sent unanswered (WRITE_QUIET) in a row, between answered ones
_QUIET_RUN = 15
#: a drainer sends a SYNC for quiet writes unconfirmed for longer than this
_CONFIRM_WITHIN = 0.02


def server_name(host: str, port: int) -> str:
    """``host:port`` (``[v6]:port``): how servers are named in messages and incarnations."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ServerInfo(NamedTuple):
    """What a memory server's INFO says: its incarnation, volume sizes, and features
    (``"quiet-writes"``: WRITE_QUIET and SYNC, see :mod:`memfs.wire`)."""

    incarnation: int
    sizes: list[int]
    features: frozenset[str]


def check_info(info: object) -> tuple[int, list[int]]:
    """(incarnation, volume sizes) from a decoded INFO reply (WireError if malformed)."""
    if not (
        isinstance(info, dict)
        and isinstance(info.get("incarnation"), int)
        and isinstance(info.get("volumes"), list)
        and all(isinstance(s, int) and s > 0 for s in info["volumes"])
    ):
        raise wire.WireError(f"malformed INFO reply {info!r:.200}")
    return info["incarnation"], info["volumes"]


def check_session_reply(h: wire.Header, payload: bytes | bytearray) -> None:
    """The answer to SESSION: OK, or WireError saying why (a fenced token: ESTALE)."""
    if h.kind is Kind.ERROR:
        raise wire.WireError(wire.decode_error(payload)[1])
    if h.kind is not Kind.OK or h.req_id != SESSION_ID:
        raise wire.WireError(f"unexpected {h.kind.name} reply to SESSION")


def check_claim_reply(h: wire.Header, payload: bytes | bytearray) -> None:
    """The answer to CLAIM: OK, or :class:`ClaimRefused` with the server's reason
    (EBUSY: another filesystem's volume), WireError for anything else."""
    if h.req_id != CLAIM_ID or h.kind not in (Kind.OK, Kind.ERROR):
        raise wire.WireError(f"unexpected {h.kind.name} reply to CLAIM")
    if h.kind is Kind.ERROR:
        err, why = wire.decode_error(payload)
        if err == errno.EBUSY:
            raise ClaimRefused(why)
        raise wire.WireError(f"CLAIM refused: {why}")


def should_claim(
    fsid: bytes | None, volumes: Sequence[int], features: Iterable[object], sizes: Sequence[int],
    incarnation: int, expected: int | None,
) -> bool:
    """Whether a new connection CLAIMs *volumes* for *fsid*: only where the server
    offers claims, and not on a server that restarted since we knew it (another
    *incarnation* than *expected*: our data there is gone and the caller says so;
    another filesystem may own the blank memory by now) nor for volumes it does
    not have (the caller says so too: a wrong pool, not a taken one)."""
    return (fsid is not None and bool(volumes) and "claims" in features
            and (expected is None or incarnation == expected)
            and all(0 <= v < len(sizes) for v in volumes))


async def memd_handshake(
    sock: socket.socket, secret: bytes, role: str, token: int = 0,
    fsid: bytes | None = None, volumes: Sequence[int] = (), expected: int | None = None,
) -> ServerInfo:
    """HELLO, AUTH, WELCOME, then (with a lease *token*) SESSION and INFO: what a
    memory server says of itself; then, with *fsid*, CLAIM of *volumes* (this
    server's volume indices) if the server offers claims (see
    :func:`should_claim`; *expected*: the incarnation we knew it by, if any).

    Shared by the tcp and verbs transports (the verbs transport's control
    connection starts the same way).  No deadline here: callers set one.
    WireError if the server refuses *token* (fenced: the mds took that lease);
    :class:`ClaimRefused` (the server's message) if the volumes belong to
    another filesystem.
    """
    hs = wire.Handshake(secret)
    h, hello = await recv_frame(sock, wire.NONCE_SIZE)
    if h.kind is not Kind.HELLO:
        raise wire.WireError(f"expected HELLO, got {h.kind.name}")
    await send_all(sock, [wire.frame(Kind.AUTH, 0, hs.auth(hello, role))])
    try:
        h, welcome = await recv_frame(sock, wire.MAC_SIZE)
    except PeerClosed:
        raise wire.WireError("authentication refused (wrong secret?)") from None
    if h.kind is not Kind.WELCOME:
        raise wire.WireError(f"expected WELCOME, got {h.kind.name}")
    hs.check_welcome(welcome)
    frames = [wire.frame(Kind.INFO, _INFO_ID)]
    if token:
        frames.insert(0, wire.frame(Kind.SESSION, SESSION_ID, wire.TOKEN.pack(token)))
    await send_all(sock, frames)
    if token:
        try:
            h, payload = await recv_frame(sock, _INFO_MAX)
        except PeerClosed:
            raise wire.WireError("closed at SESSION") from None
        check_session_reply(h, payload)
    h, payload = await recv_frame(sock, _INFO_MAX)
    if h.kind is not Kind.OK or h.req_id != _INFO_ID:
        raise wire.WireError(f"unexpected {h.kind.name} reply to INFO")
    info = wire.decode(payload)
    incarnation, sizes = check_info(info)
    features = info.get("features", []) if isinstance(info, dict) else []
    if not isinstance(features, list):
        raise wire.WireError(f"malformed INFO features {features!r:.200}")
    offered = frozenset(f for f in features if isinstance(f, str))
    if should_claim(fsid, volumes, offered, sizes, incarnation, expected):
        assert fsid is not None
        # After INFO: a server that predates CLAIM would take it for a broken frame.
        await send_all(sock, [wire.frame(Kind.CLAIM, CLAIM_ID,
                                         wire.encode_claim(fsid, sorted(set(volumes))))])
        try:
            h, payload = await recv_frame(sock, _INFO_MAX)
        except PeerClosed:
            raise wire.WireError("closed at CLAIM") from None
        check_claim_reply(h, payload)
    return ServerInfo(incarnation, sizes, offered)


class _Pending:
    """One request awaiting its reply."""

    __slots__ = ("dest", "deadline", "done", "task", "others", "kind", "payload", "error",
                 "on_done", "req_id", "seq", "quiet")

    def __init__(self, dest: memoryview | None, deadline: float) -> None:
        self.dest = dest  # READ: where the reply's data goes
        self.deadline = deadline  # the connection is reset if no reply came by then
        self.done = False
        self.task: trio.lowlevel.Task | None = None  # asleep in _Conn.wait
        #: more tasks asleep in _Conn.wait for this one request (a posted write's:
        #: the drainer and an fsync, say), rare enough for a list made on demand
        self.others: list[trio.lowlevel.Task] | None = None
        self.kind = Kind.OK
        self.payload = b""
        self.error: str | None = None  # the connection failed before the reply
        #: a posted write's completion (see TcpTransport.post_write): called once, at once
        self.on_done: Callable[[_Pending], None] | None = None
        self.req_id = 0
        self.seq = 0  # the frame's place in its connection's stream (_Conn.sent)
        self.quiet = False  # a WRITE_QUIET: done when a later answer confirms it

    def target(self) -> memoryview:
        assert self.dest is not None
        return self.dest

    def wake(self) -> None:
        """Wake every task asleep for this request (each looks again: done, or it
        takes over the receiving)."""
        if self.task is not None:
            trio.lowlevel.reschedule(self.task)
            self.task = None
        if self.others is not None:
            for task in self.others:
                trio.lowlevel.reschedule(task)
            self.others = None

    def sleeping(self) -> bool:
        return self.task is not None or self.others is not None

    def complete(self) -> None:
        self.done = True
        self.wake()
        if self.on_done is not None:
            self.on_done(self)

    def abandon(self) -> None:
        """The caller is gone: its buffer is no longer ours to write."""
        if self.dest is not None and not self.done:
            self.dest = memoryview(bytearray(len(self.dest)))


class _Conn:
    """One authenticated connection to a memory server.

    Replies are received by the requesters themselves (leader/follower): a
    requester whose reply has not come receives whatever arrives, completing
    other requests on the way, unless another one already does; then it
    sleeps until its reply is in or it is handed the receiving.  A small
    request thus costs no task switch.  The receive state (:class:`RecvBuffer`
    and a READ reply whose data is still arriving) lives here, so a receiver
    that gives up leaves it for the next one.  A receiver that gets cancelled
    hands over to a sleeping requester; replies to abandoned requests with no
    one left to receive them are drained by the transport's watchdog.
    """

    def __init__(self, server: _Server, sock: socket.socket, slot: int, io_timeout: float) -> None:
        self.server = server
        self.sock = sock
        self.slot = slot
        self.io_timeout = io_timeout
        #: held while a frame is partly sent: by a sender the socket did not take
        #: a whole frame from at once, or one that found it held (a frame sent
        #: whole and synchronously needs no lock)
        self.send_lock = trio.Lock()
        self.pending: dict[int, _Pending] = {}
        self.closed = False
        self.reason = ""
        self.receiving = False  # a requester is receiving replies
        self.last_send = -math.inf
        self._rx = RecvBuffer(sock, _RECV_BUFFER)
        #: a READ reply whose data goes straight to its destination: (request id, bytes in)
        self._partial: tuple[int, int] | None = None
        self._next_id = _INFO_ID
        #: posted writes outstanding here, the last one posted, how many were ever
        #: posted, and whether a drainer takes their replies (TcpTransport._drain)
        self.posted = 0
        self.last_posted: _Pending | None = None
        self.posts = 0
        self.draining = False
        #: frames handed to the socket so far (each request's seq is its place)
        self.sent = 0
        #: WRITE_QUIETs sent and not yet confirmed, in order; how many were sent since
        #: the last answered request, when the first of those was, and that
        #: request's seq: the server serves a connection's frames in order, so any
        #: answer confirms every one sent before it (:meth:`_confirm_before`)
        self.unconfirmed: collections.deque[_Pending] = collections.deque()
        self.quiet_run = 0
        self.quiet_since = 0.0
        self.last_answered = -1
        #: WRITE_QUIET frames held back to go out with the next frame (one sendmsg, one
        #: wake-up of the server for several writes), and their bytes
        self.corked: list[bytes | memoryview] = []
        self.corked_bytes = 0

    def add(self, p: _Pending) -> int:
        while True:
            self._next_id = (self._next_id + 1) & 0xFFFFFFFF
            if self._next_id > _INFO_ID and self._next_id not in self.pending:
                self.pending[self._next_id] = p
                p.req_id = self._next_id
                return self._next_id

    def usable(self, now: float) -> bool:
        """False if the connection is closed, or (checked when idle) the server closed it.

        With no requests outstanding nobody watches the socket, so a server
        that went away (or restarted) would otherwise only be noticed by the
        next request, which would fail with it instead of reconnecting.  Not
        checked (a syscall) within a millisecond of the last request: no
        server restarts that fast.
        """
        if self.closed:
            return False
        if self.pending or now - self.last_send < _IDLE_CHECK:
            return True
        try:
            peek = self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            self._rx.drained = True  # nothing until our reply: wait before receiving
            return True
        except OSError as exc:
            reason = f"lost connection to memory server {self.server.name}: {exc}"
        else:
            if peek:
                return True  # a frame nobody asked for: the receiver reports it
            reason = f"memory server {self.server.name} closed the connection"
        log.info("%s (idle; reconnecting)", reason)
        self.fail(reason)
        return False

    def send(self, p: _Pending, kind: Kind, head: bytes, data: memoryview | None) -> list[memoryview]:
        """Register *p* and hand its frame to the socket, as far as it takes it now.

        Nobody else may be in the middle of a frame: :attr:`send_lock` is free
        (and no await since that was checked) or the caller holds it.  An
        unsent rest must be sent (:meth:`finish_send`) under the lock before
        anyone else sends.  A failed send fails the connection (and so *p*).
        """
        req_id = self.add(p)
        p.seq = self.sent
        self.sent += 1
        if kind is Kind.WRITE_QUIET:
            p.quiet = True
            self.unconfirmed.append(p)
            if not self.quiet_run:
                self.quiet_since = p.deadline - self.io_timeout
            self.quiet_run += 1
        else:
            self.last_answered = p.seq
            self.quiet_run = 0
        self.last_send = p.deadline - self.io_timeout  # when the request started
        length = len(head) + (len(data) if data is not None else 0)
        bufs: list[bytes | memoryview] = [wire.pack_header(kind, req_id, length), head]
        if data is not None:
            bufs.append(data)
            if (kind is Kind.WRITE_QUIET and isinstance(data.obj, bytes)
                    and self.corked_bytes + length < CORK_BYTES):
                self.corked += bufs
                self.corked_bytes += length
                return []
        if self.corked:
            bufs = self.corked + bufs
            self.corked = []
            self.corked_bytes = 0
        try:
            return send_now(self.sock, bufs)
        except OSError as exc:
            self.fail(f"lost connection to memory server {self.server.name}: {exc}")
            return []

    async def finish_send(self, rest: list[memoryview], deadline: float) -> None:
        """Send the rest of a frame the socket did not take at once.

        Shielded: a frame cut short by the caller's cancellation would corrupt
        the stream for every other request on the connection; never from the
        deadline, which fails the connection instead.
        """
        with trio.CancelScope(shield=True, deadline=deadline) as scope:
            try:
                await send_all(self.sock, rest)
            except (OSError, trio.ClosedResourceError) as exc:
                # (closed under us: failed already, by the watchdog or a new session)
                self.fail(f"lost connection to memory server {self.server.name}: {exc}")
        if scope.cancelled_caught:
            self.fail(f"memory server {self.server.name} took no data for {self.io_timeout:g}s")

    async def flush(self) -> None:
        """Send the frames held back (:attr:`corked`), if any."""
        if not self.corked or self.closed:
            return
        async with self.send_lock:
            if not self.corked or self.closed:
                return
            bufs = self.corked
            self.corked = []
            self.corked_bytes = 0
            try:
                rest = send_now(self.sock, bufs)
            except OSError as exc:
                self.fail(f"lost connection to memory server {self.server.name}: {exc}")
                return
            if rest:
                await self.finish_send(rest, trio.current_time() + self.io_timeout)

    def covered(self, p: _Pending) -> bool:
        """Whether a request that is answered went out after *p* (its answer will
        confirm *p*)."""
        return self.last_answered > p.seq

    def _confirm_before(self, seq: int) -> None:
        """An answer to the request sent *seq*-th came: every WRITE_QUIET sent before it
        was served (one refused was answered ERROR before it, and is done)."""
        queue = self.unconfirmed
        pending = self.pending
        while queue and queue[0].seq < seq:
            p = queue.popleft()
            if not p.done:
                del pending[p.req_id]
                p.complete()

    def fail(self, reason: str) -> None:
        """Reset: close the socket (waking its receiver), fail every outstanding request."""
        if self.closed:
            return
        self.closed = True
        self.reason = reason
        close_socket(self.sock)
        self.server.drop(self)
        self.unconfirmed.clear()
        self.corked = []
        self.corked_bytes = 0
        for p in self.pending.values():
            p.error = reason
            p.complete()
        self.pending.clear()

    async def wait(self, p: _Pending, alone: Callable[[], bool] | None = None) -> None:
        """Until *p* has its reply (or failed): receive, or sleep while another does.

        On cancellation *p* is abandoned: the rest of its reply goes to scratch.
        """

        me = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            if p.task is me:
                p.task = None
            elif p.others is not None:
                p.others.remove(me)
                if not p.others:
                    p.others = None
            return trio.lowlevel.Abort.SUCCEEDED

        try:
            while not p.done:
                if self.receiving:
                    if p.task is None:
                        p.task = me
                    elif p.others is None:
                        p.others = [me]
                    else:
                        p.others.append(me)
                    await trio.lowlevel.wait_task_rescheduled(abort)
                else:
                    await self._receive_until(p, alone)
        except BaseException:
            p.abandon()
            raise

    async def _receive_until(self, p: _Pending, alone: Callable[[], bool] | None = None) -> None:
        """*alone*: may this small READ poll for its reply (RecvBuffer.linger)?  Asked
        before each poll (another call may have begun meanwhile)."""
        self.receiving = True
        try:
            yielded = False
            while not self.receive_available() and not p.done:
                if alone is not None:
                    if not yielded:
                        # Tasks woken in this pass of the loop (a worker with the next
                        # FUSE request) are not in its run queue: they run first.
                        yielded = True
                        await trio.lowlevel.checkpoint()
                        continue
                    if alone() and self._rx.linger(LINGER) is Linger.READY:
                        continue
                    alone = None
                await self._rx.wait_readable()
            if not p.done:
                await trio.lowlevel.checkpoint()  # many replies came at once: let others run
        except (OSError, wire.WireError, trio.ClosedResourceError) as exc:
            if not self.closed:  # else we closed the socket under it (reset, aclose)
                reason = f"lost connection to memory server {self.server.name}: {exc}"
                log.warning("%s", reason)
                self.fail(reason)
        except Exception as exc:
            log.exception("receiving from memory server %s failed", self.server.name)
            self.fail(f"memory server {self.server.name}: {exc!r}")
        finally:
            self.receiving = False
            for other in self.pending.values():  # hand the receiving over to a sleeper
                if other.sleeping():
                    other.wake()
                    break

    def poll(self) -> bool:
        """Take replies that have arrived, for a caller that cannot wait: True if it
        stopped with more to take (its share of work done, see receive_available)."""
        if self.closed:  # (its requests failed with it: nothing to take)
            return False
        self._rx.drained = False  # a hint for receivers that wait, so maybe stale
        try:
            return self.receive_available()
        except (OSError, wire.WireError) as exc:
            reason = f"lost connection to memory server {self.server.name}: {exc}"
            log.warning("%s", reason)
            self.fail(reason)
            return False

    def receive_available(self) -> bool:
        """Take the replies that have arrived, without waiting; matched by request id.

        True if it stopped with more to do (a share of work done), False once
        the socket had nothing more.  A small reply (a WRITE's OK, a small READ's
        data) usually comes whole in one recv and is copied from the buffer; the
        bulk of a large READ reply is received straight into its destination.
        Raises for a broken stream (the caller fails the connection).
        """
        rx = self._rx
        pending = self.pending
        work = 0
        while work < _RECEIVE_WORK:
            if self._partial is not None:
                req_id, got = self._partial
                p = pending[req_id]
                n = len(p.target())
                k = rx.receive_into_now(p.target()[got:])
                if k is None:
                    return False
                if k == 0:
                    raise PeerClosed(f"connection closed after {got} of {n} bytes")
                work += k
                got += k
                if got < n:
                    self._partial = (req_id, got)
                    continue
                self._partial = None
                kind = Kind.OK
            else:
                if len(rx) < wire.HEADER_SIZE:
                    k = rx.receive_now(wire.HEADER_SIZE)
                    if k is None:
                        return False
                    if k == 0:
                        if len(rx):
                            raise PeerClosed(f"connection closed after {len(rx)} bytes of a header")
                        raise PeerClosed("connection closed by the memory server")
                    continue
                h = wire.parse_header(rx.view(wire.HEADER_SIZE))
                req_id, kind, n = h.req_id, h.kind, h.length
                found = pending.get(req_id)
                if found is None:
                    raise wire.WireError(f"reply to unknown request {req_id}")
                p = found
                if kind is Kind.OK and p.dest is not None:
                    if n != len(p.dest):
                        raise wire.WireError(f"READ reply of {n} bytes, asked {len(p.dest)}")
                    rx.consume(wire.HEADER_SIZE)
                    got = rx.take_into(p.dest)
                    work += got
                    if got < n:
                        self._partial = (req_id, got)
                        continue
                elif kind is Kind.OK or kind is Kind.ERROR:
                    if n > _SMALL_REPLY_MAX:
                        raise wire.WireError(f"{kind.name} reply of {n} bytes")
                    if len(rx) < wire.HEADER_SIZE + n:
                        k = rx.receive_now(wire.HEADER_SIZE + n)
                        if k is None:
                            return False
                        if k == 0:
                            raise PeerClosed(f"connection closed inside a {kind.name} reply")
                        continue
                    rx.consume(wire.HEADER_SIZE)
                    if n:
                        p.payload = bytes(rx.view(n))
                        rx.consume(n)
                else:
                    raise wire.WireError(f"unexpected {kind.name} frame")
            p.kind = kind
            del pending[req_id]
            if self.unconfirmed and self.unconfirmed[0].seq < p.seq:
                self._confirm_before(p.seq)
            p.complete()
            work += _REPLY_WORK
        return True


def _failure(server: _Server, p: _Pending) -> str | None:
    """Why request *p* failed (its connection, or the server's ERROR answer), or None."""
    if p.error is not None:
        return p.error
    if p.kind is Kind.ERROR:
        err, msg = wire.decode_error(p.payload)
        return f"memory server {server.name}: {msg or os.strerror(err)}"
    return None


class _PostedWrite(Posted):
    __slots__ = ("transport", "conn", "p")

    def __init__(self, transport: TcpTransport, conn: _Conn, p: _Pending) -> None:
        self.transport = transport
        self.conn = conn
        self.p = p

    @property
    def channel(self) -> object:
        return self.conn

    async def wait(self) -> None:
        await self.transport._wait_posted(self.conn, self.p)


def volume_infos(vmap: Sequence[tuple[Any, int]], addrs: Sequence[VolumeAddr]) -> list[VolumeInfo]:
    """The pool's volumes from (server, remote volume) pairs whose servers know
    their volume sizes (``.sizes``, ``.name``): shared by the tcp and verbs clients."""
    infos = []
    for i, (server, remote) in enumerate(vmap):
        if remote >= len(server.sizes):
            raise UsageError(
                f"pool volume {addrs[i]}: memory server {server.name} has "
                f"{len(server.sizes)} volumes"
            )
        infos.append(VolumeInfo(i, server.sizes[remote], str(addrs[i])))
    return infos


class KnownServer(Protocol):
    name: str
    incarnation: int | None


S = TypeVar("S", bound=KnownServer)


def taken_back(servers: Iterable[S], incarnations: Mapping[str, int]) -> Iterator[tuple[S, int]]:
    """The servers of a transport that *incarnations* (an adoption) names at another
    incarnation than the one it knows, each with that one (logged)."""
    for server in servers:
        want = incarnations.get(server.name)
        if want is None or want == server.incarnation:
            continue  # (the same one, lost or not: not taken back)
        if server.incarnation is not None:
            log.info("memory server %s: taken back at incarnation %x", server.name, want)
        yield server, want


class _Unreachable(TransportError):
    """No connection to a memory server (refused, unroutable, timed out connecting):
    unlike one that answers and refuses us, a pool of known size opens without it."""


class _Server:
    """What the client knows about one memory server."""

    def __init__(self, host: str, port: int, n_conns: int) -> None:
        self.host, self.port = host, port
        self.name = server_name(host, port)
        self.slots: list[_Conn | None] = [None] * n_conns
        self.connecting = [trio.Lock() for _ in range(n_conns)]
        self.incarnation: int | None = None
        self.sizes: list[int] = []
        #: sizes taken from the pool's (unreachable at open): checked when it answers
        self.assumed = False
        self.lost: str | None = None
        #: the incarnation a reconnect found instead (told to ``on_restart`` once)
        self.found: int | None = None
        #: it refused our claim: (not asked again before this time, why, back-off)
        self.refused: tuple[float, str, float] | None = None
        #: it offers WRITE_QUIET and SYNC (INFO's features)
        self.quiet_writes = False
        self._turn = 0

    def next_slot(self) -> int:
        self._turn = (self._turn + 1) % len(self.slots)
        return self._turn

    def drop(self, conn: _Conn) -> None:
        if self.slots[conn.slot] is conn:
            self.slots[conn.slot] = None

    def close_all(self, reason: str) -> None:
        for c in list(self.slots):
            if c is not None:
                c.fail(reason)


@asynccontextmanager
async def open_tcp_transport(
    volumes: Sequence[VolumeAddr],
    secret: bytes,
    *,
    connections_per_server: int = 2,
    io_timeout: float = DEFAULT_IO_TIMEOUT,
    incarnations: Mapping[str, int] | None = None,
    fences: Fences | None = None,
    lazy: bool = False,
    fsid: bytes | None = None,
    volume_size: int | None = None,
    on_restart: Callable[[str, int], None] | None = None,
) -> AsyncIterator[TcpTransport]:
    """Connect to the servers of *volumes* and yield the transport; close it on exit.

    Raises :class:`TransportError` if a server cannot be reached or refuses us
    within *io_timeout* (:class:`ClaimRefused` if a volume belongs to another
    filesystem than *fsid*; None: claim nothing), :class:`UsageError` if a
    volume does not exist there.
    *lazy*: connect to each server only when a request goes there, and never fail
    for one that cannot be reached (the mds's fence courier: volume sizes unknown).
    *volume_size*: the pool's volume size, known beforehand (a mount's, from the
    mds): a server that cannot be reached now does not fail the opening; its
    volumes fail with EIO until it answers.
    *on_restart*: called with a server's name and its new incarnation when a
    connection finds that it restarted (the mds takes it back, see :meth:`adopt`).
    """
    t = TcpTransport(volumes, secret, connections_per_server=connections_per_server,
                     io_timeout=io_timeout, fences=fences, fsid=fsid, volume_size=volume_size)
    t.on_restart = on_restart
    for srv in t._servers.values():  # known to the pool: a different one means lost memory
        if incarnations and srv.name in incarnations:
            srv.incarnation = incarnations[srv.name]
    error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                if not lazy:
                    await t._open()
                nursery.start_soon(t._watch_deadlines)
                t._nursery = nursery
                yield t
            finally:
                t._close()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The watchdog never raises but Cancelled (from a scope around us, which
        # sees it again at its next checkpoint), so a group wraps the opening's or
        # the body's one exception: give callers that exception itself.
        errors = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
        if len(errors) > 1:
            raise
        error = errors[0] if errors else group.exceptions[0]
    if error is not None:
        raise error


class Fences:
    """Lease tokens the mds has fenced (``memfs.meta.server``), by memory server, that
    the server has not confirmed yet.  Shared by the mds's transports: each sends a
    server the fences pending for it, and waits for their answers, before any other
    request to it; so memory is zeroed (and reused) on a server only after it shut
    out every client whose lease was taken."""

    #: fences kept pending per server at most (as many as a memory server remembers:
    #: one unreachable for that long has long been restarted, its memory blank)
    MAX_PENDING = 1 << 16

    def __init__(self, servers: Sequence[str]) -> None:
        self.servers = list(dict.fromkeys(servers))
        #: server name -> tokens (a dict as an ordered set, oldest first)
        self.pending: dict[str, dict[int, None]] = {}
        #: the transport that delivers new fences at once (see delivering), if open
        self.courier: TcpTransport | None = None

    def add(self, token: int) -> None:
        for name in self.servers:
            mine = self.pending.setdefault(name, {})
            mine[token] = None
            if len(mine) > self.MAX_PENDING:
                del mine[next(iter(mine))]

    def confirmed(self, name: str, token: int) -> None:
        mine = self.pending.get(name)
        if mine is not None:
            mine.pop(token, None)
            if not mine:
                del self.pending[name]

    def waiting(self, token: int) -> list[str]:
        """The servers that have not confirmed *token*'s fence."""
        return [name for name, tokens in self.pending.items() if token in tokens]

    @contextmanager
    def delivering(self, transport: TcpTransport) -> Iterator[None]:
        """*transport* delivers new fences at once while the block runs."""
        self.courier = transport
        try:
            yield
        finally:
            if self.courier is transport:
                self.courier = None


class TcpTransport(Transport):
    concurrent = True  # requests to different servers (and connections) overlap
    posts_writes = True

    def __init__(
        self,
        volumes: Sequence[VolumeAddr],
        secret: bytes,
        *,
        connections_per_server: int = 2,
        io_timeout: float = DEFAULT_IO_TIMEOUT,
        fences: Fences | None = None,
        fsid: bytes | None = None,
        volume_size: int | None = None,
    ) -> None:
        if not volumes:
            raise UsageError("a tcp pool needs at least one volume")
        if connections_per_server < 1:
            raise UsageError("connections_per_server must be at least 1")
        self._secret = secret
        self.io_timeout = io_timeout
        self._servers: dict[tuple[str, int], _Server] = {}
        self._map: list[tuple[_Server, int]] = []
        for v in volumes:
            if v.scheme != "tcp":
                raise UsageError(f"volume {v}: the tcp transport serves tcp:// volumes only")
            server = self._servers.get(v.server)
            if server is None:
                server = self._servers[v.server] = _Server(v.host, v.port, connections_per_server)
            self._map.append((server, v.volume))
        self._addrs = list(volumes)
        #: the filesystem whose volumes these are (CLAIM on every connection); None: no claim
        self._fsid = fsid
        #: the pool's volume size, if known without asking the servers (a mount's, from
        #: the mds): then a server unreachable at open does not fail it (see _open)
        self._volume_size = volume_size
        self._info: list[VolumeInfo] = []
        self._closed = False
        #: calls waiting for their replies (one alone may poll for a small one)
        self._waiting = 0
        #: the lease token our connections name (SESSION), 0: none (see set_session)
        self._token = 0
        self._fences = fences
        self._delivering = trio.Lock()
        #: told of a server found restarted (name, new incarnation): see open_tcp_transport
        self.on_restart: Callable[[str, int], None] | None = None
        #: where drainers of posted writes run (open_tcp_transport's; None: no posting)
        self._nursery: trio.Nursery | None = None

    # -- opening and closing ----------------------------------------------------------

    async def _open(self) -> None:
        """Connect to every server, all at once (hung ones cost ``io_timeout`` once,
        not each); their failures are then taken in pool order."""
        failed: dict[str, Exception] = {}

        async def one(server: _Server) -> None:
            with trio.move_on_after(self.io_timeout) as scope:
                try:
                    await self._connect(server, 0)
                except (TransportError, UsageError) as exc:
                    failed[server.name] = exc
            if scope.cancelled_caught:
                failed[server.name] = _Unreachable(
                    f"memory server {server.name} did not answer within {self.io_timeout:g}s")

        async with trio.open_nursery() as nursery:
            for server in self._servers.values():
                nursery.start_soon(one, server)
        missing: list[TransportError] = []
        for server in self._servers.values():
            exc = failed.get(server.name)
            if exc is None:
                continue
            if isinstance(exc, _Unreachable):
                missing.append(self._unreachable(server, exc))
            elif not (isinstance(exc, TransportError) and server.lost):
                raise exc  # refused us (secret, claim, protocol, no such volume): no pool
            # (restarted since the pool knew it: its volumes answer EIO)
        if len(missing) == len(self._servers):
            raise missing[0]  # none at all: no pool to speak of
        self._info.extend(volume_infos(self._map, self._addrs))

    def _unreachable(self, server: _Server, exc: TransportError) -> TransportError:
        """*server* cannot be reached now (no connection, or no answer).  Without the
        pool's volume size there is no pool without it (*exc*); with it (a mount:
        the mds said the size), the transport opens all the same, like a server
        that died after it did: its volumes fail with EIO, and each request tries
        it again (Lustre mounts with an OST down, too: the node can use the files
        of the others).  A server that answers and refuses us is no such case."""
        if self._volume_size is None:
            raise exc
        log.warning("%s: going on without it (its volumes give EIO until it answers)",
                    exc.args[1])
        n = 1 + max(remote for s, remote in self._map if s is server)
        server.sizes = [self._volume_size] * n
        server.assumed = True
        return exc

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for server in self._servers.values():
            server.close_all("the tcp transport is closed")

    async def aclose(self) -> None:
        self._close()
        await trio.lowlevel.checkpoint()

    def incarnations(self) -> dict[str, int]:
        """Each server's incarnation as first seen ("host:port" -> number).

        Handed to later clients (through the mds) as ``open_tcp_transport(...,
        incarnations=)``, so a client that first meets a server after it
        restarted blank also reports its volumes as lost, not as zeros.
        """
        return {s.name: s.incarnation for s in self._servers.values() if s.incarnation is not None}

    def adopt(self, incarnations: Mapping[str, int]) -> None:
        """The pool's data lives in these incarnations now ("host:port" -> number): the
        mds took a server that restarted blank back, after every file's data there
        was marked lost and every client let go of its maps.  Its volumes serve
        again; connections to any other incarnation are dropped."""
        for server, want in taken_back(self._servers.values(), incarnations):
            server.close_all(f"memory server {server.name} was taken back at another incarnation")
            server.incarnation, server.lost, server.found = want, None, None

    async def probe(self) -> None:
        """Connect to every server that has no usable connection now (none, or the
        server closed it while idle; the mds, every few seconds): a server that
        restarted blank is found (``on_restart``) even when nothing is sent to it.
        Failures are for the requests to report."""
        async def one(server: _Server) -> None:
            with trio.move_on_after(self.io_timeout):
                try:
                    await self._conn_at(server, 0)
                except TransportError as exc:
                    log.debug("probing memory server %s: %s", server.name, exc.args[1])

        now = trio.current_time()
        async with trio.open_nursery() as nursery:
            for server in self._servers.values():
                conn = server.slots[0]
                if (conn is None or not conn.usable(now)) and not self._closed:
                    nursery.start_soon(one, server)

    async def _connect(self, server: _Server, slot: int) -> _Conn:
        """Connect, authenticate and check the incarnation.

        A server that refused our claim is not asked again before its back-off
        ends (1 s, doubling to ``CLAIM_BACKOFF_MAX``): each request meanwhile fails
        with the same refusal, without a handshake (and a warning in its log)."""
        refused = server.refused
        if refused is not None and trio.current_time() < refused[0]:
            raise ClaimRefused(refused[1])
        try:
            sock = await connect(server.host, server.port)
        except OSError as exc:
            raise _Unreachable(
                f"cannot connect to memory server {server.name}: {exc.strerror or exc}"
            ) from None
        knew = server.incarnation
        try:
            incarnation, sizes, features = await self._handshake(sock, server)
        except ClaimRefused as exc:
            close_socket(sock)
            why = f"memory server {server.name}: {exc.args[1]}"
            wait = min(CLAIM_BACKOFF_MAX, 2 * refused[2]) if refused is not None else 1.0
            server.refused = (trio.current_time() + wait, why, wait)
            raise ClaimRefused(why) from None
        except (OSError, wire.WireError) as exc:
            close_socket(sock)
            raise TransportError(f"memory server {server.name}: {exc}") from None
        except BaseException:
            close_socket(sock)
            raise
        if self._closed:
            close_socket(sock)
            raise TransportError("the tcp transport is closed")
        server.refused = None
        if knew is not None and server.incarnation != knew:  # adopted another one meanwhile:
            close_socket(sock)  # claims and checks were made for the one we knew
            raise TransportError(f"memory server {server.name} was taken back while we "
                                 "connected: try again")
        if not server.sizes:
            server.sizes = sizes
        server.quiet_writes = "quiet-writes" in features
        if server.incarnation is None:
            server.incarnation = incarnation
        elif incarnation != server.incarnation or server.lost:
            close_socket(sock)
            if not server.lost:
                server.lost = f"memory server {server.name} restarted; its data is lost"
                log.error("%s (incarnation %x, was %x)", server.lost, incarnation,
                          server.incarnation)
                server.close_all(server.lost)
            if incarnation != server.found:
                server.found = incarnation
                if self.on_restart is not None:
                    self.on_restart(server.name, incarnation)
            raise TransportError(server.lost)
        if server.assumed:  # unreachable at open: its sizes were taken from the pool's
            # (Larger volumes are the pool's too: the mds takes the smallest.)
            if any(r >= len(sizes) or sizes[r] < server.sizes[r]
                   for s, r in self._map if s is server):
                close_socket(sock)
                raise TransportError(f"memory server {server.name}: its volumes are not "
                                     f"the pool's (sizes {sizes}, the pool's {server.sizes})")
            server.assumed = False
        conn = _Conn(server, sock, slot, self.io_timeout)
        server.slots[slot] = conn
        log.debug("connected to memory server %s (slot %d)", server.name, slot)
        return conn

    async def _handshake(self, sock: socket.socket, server: _Server) -> ServerInfo:
        token = self._token
        mine = [remote for s, remote in self._map if s is server]
        got = await memd_handshake(sock, self._secret, ROLE, token, self._fsid, mine,
                                   server.incarnation)
        if token != self._token:  # a new lease meanwhile: this one names the old
            raise wire.WireError("the lease token changed while connecting")
        return got

    def set_session(self, token: int) -> None:
        """Work under lease *token* from now on (the mds's registration says which).

        A new token: the mds took the leases we worked under without our word
        (evicted, cut off; it fenced the old token), or restarted.  Connections
        that named the old one are dropped (the caller waits for transfers begun
        under it first), new ones name the new token."""
        if token == self._token:
            return
        self._token = token
        for server in self._servers.values():
            server.close_all("the lease token this client worked under was replaced")

    # -- fences (the mds) -------------------------------------------------------------

    async def _deliver(self, server: _Server) -> None:
        """Send *server* the fences pending for it, each answered before we go on."""
        assert self._fences is not None
        for token in list(self._fences.pending.get(server.name, ())):
            if server.lost:  # restarted: its memory is blank and no client uses it
                self._fences.confirmed(server.name, token)
                continue
            await self._call(server, Kind.FENCE, wire.TOKEN.pack(token))
            self._fences.confirmed(server.name, token)

    async def deliver_fences(self) -> None:
        """Every pending fence to its server, all servers at once; one that fails
        stays pending (logged), to go before that server's next request."""
        fences = self._fences
        if fences is None:
            return

        async def one(server: _Server) -> None:
            try:
                await self._deliver(server)
            except TransportError as exc:  # the caller says which, once
                log.debug("memory server %s has not confirmed a fence: %s", server.name, exc)

        async with self._delivering, trio.open_nursery() as nursery:
            for server in self._servers.values():
                if server.name in fences.pending:
                    nursery.start_soon(one, server)

    async def _conn_at(self, server: _Server, slot: int) -> _Conn:
        conn = server.slots[slot]
        if conn is not None:
            return conn
        async with server.connecting[slot]:
            conn = server.slots[slot]
            if conn is None:
                conn = await self._connect(server, slot)
            return conn

    # -- requests -------------------------------------------------------------------

    async def _call(
        self,
        server: _Server,
        kind: Kind,
        head: bytes,
        data: memoryview | None = None,
        dest: memoryview | None = None,
    ) -> _Pending:
        """Send one request and wait for its reply, all within ``io_timeout``.

        Fast path: on an open connection that nobody is sending on, the frame
        goes to the socket synchronously, with no lock wait and no timer; the
        reply wait has no timer either (:meth:`_watch_deadlines` enforces it).
        Only a missing connection, a busy one or a frame the socket does not
        take at once needs waits with deadlines.
        """
        conn, p = await self._send(server, server.next_slot(), kind, head, data, dest)
        # A small READ's reply comes within tens of microseconds: polled for, not parked
        # for, while the loop has nothing else to do (RecvBuffer.linger) and this is the
        # only call waiting (with more, the CPU serves them better than a poll).
        self._waiting += 1
        try:
            await conn.wait(p, self._alone if LINGER and dest is not None
                            and len(dest) <= _SMALL_REPLY_MAX else None)
        finally:
            self._waiting -= 1
        failure = _failure(server, p)
        if failure is not None:
            raise TransportError(failure)
        return p

    async def _send(
        self, server: _Server, slot: int, kind: Kind, head: bytes,
        data: memoryview | None, dest: memoryview | None = None,
    ) -> tuple[_Conn, _Pending]:
        """Send one request on *server*'s connection *slot* (see :meth:`_call`): the
        connection it went on and its registered pending reply."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if server.lost:
            raise TransportError(server.lost)
        fences = self._fences
        if fences is not None and fences.pending and kind is not Kind.FENCE \
                and server.name in fences.pending:
            await self._deliver(server)
        now = trio.current_time()
        p = _Pending(dest, now + self.io_timeout)
        conn = server.slots[slot]
        if conn is not None and not conn.send_lock.locked() and conn.usable(now):
            rest = conn.send(p, kind, head, data)  # no await since the check: nobody cut in
            if rest:
                conn.send_lock.acquire_nowait()  # the stream is ours until the frame is out
                try:
                    await conn.finish_send(rest, p.deadline)
                finally:
                    conn.send_lock.release()
            return conn, p
        return await self._send_waiting(server, slot, p, kind, head, data), p

    def _alone(self) -> bool:
        return self._waiting == 1

    async def post_write(
        self, volume: int, offset: int, data: Buffer, key: int,
        done: Callable[[Exception | None], None],
    ) -> Posted | None:
        """Hand *data* to the connection's socket; the memory server's answer comes later.

        Writes posted with one *key* to one server go over one connection, so a
        server applies them in the order posted (and answers them in that order:
        waiting for the last one posted on a connection waits for all before it).
        The frame is in the socket when this returns (the caller may reuse
        *data*), unless it is ``bytes`` (below); a drainer task takes the answers
        when nobody waits for them, so *done* is called within ``io_timeout``
        even if nobody does.

        To a server that offers it the frame is a WRITE_QUIET, answered only if
        refused, but for every ``_QUIET_RUN + 1``-th write: a server serves a
        connection in order, so that one's answer confirms the ones before it.
        A memory server sends, and this client receives and parses, one answer
        per run instead of one per write (and no frame more).  Where no answered
        request follows soon enough, the drainer (or a waiter) sends a SYNC.

        A WRITE_QUIET of *data* that is a view of ``bytes`` (a FUSE write's: nobody
        can change it) is also held back, up to ``CORK_BYTES`` a connection, and
        goes out with the next frame there (the run's answered write, a SYNC, a
        READ) or at the drainer's next look: one ``sendmsg`` and one wake-up of
        the server for several writes.  Its frame is not in the socket when this
        returns; anything that waits for the write sends first.
        """
        src = memoryview(data).cast("B")
        n = len(src)
        self.check_range(volume, offset, n)
        server, remote = self._map[volume]
        slot = key % len(server.slots)
        if n > MAX_IO or self._nursery is None:
            conn = server.slots[slot]
            last = conn.last_posted if conn is not None else None
            if conn is not None and last is not None and not last.done:
                await self._wait_posted(conn, last)  # on another connection it could overtake them
            await self.write(volume, offset, src)
            return None
        kind = Kind.WRITE
        if server.quiet_writes:
            c = server.slots[slot]
            if c is not None and c.quiet_run < _QUIET_RUN:
                kind = Kind.WRITE_QUIET
        conn, p = await self._send(server, slot, kind, wire.WRITE.pack(remote, offset), src)
        if p.done:  # failed at once, or answered while the frame was still going out
            failure = _failure(server, p)
            if failure is not None:
                raise TransportError(failure)
            return None

        def completed(q: _Pending) -> None:
            conn.posted -= 1
            failure = _failure(server, q)
            done(None if failure is None else TransportError(failure))

        if not conn.draining:
            self._nursery.start_soon(self._drain, conn)
            conn.draining = True
        p.on_done = completed
        conn.posted += 1
        conn.posts += 1
        conn.last_posted = p
        return _PostedWrite(self, conn, p)

    async def _drain(self, conn: _Conn) -> None:
        """Take the answers to *conn*'s posted writes that nobody waits for.

        While writes keep being posted it looks every ``_DRAIN_EVERY`` and takes
        all that has arrived without waiting (a ``recv`` for many answers, none
        of the writers' time), and sends a SYNC for quiet writes left
        unconfirmed longer than ``_CONFIRM_WITHIN`` (a slow writer's); once
        they stop, it waits for the last one.
        """
        try:
            seen = -1
            while conn.posted and not conn.closed:
                await trio.sleep(_DRAIN_EVERY)
                await conn.flush()
                if conn.quiet_run and trio.current_time() - conn.quiet_since > _CONFIRM_WITHIN:
                    await self._sync(conn)  # (a SYNC sent ends the run: one per run)
                if conn.posts != seen:
                    seen = conn.posts
                    while not conn.receiving and conn.poll():
                        await trio.lowlevel.checkpoint()  # more came than one share
                    continue
                last = conn.last_posted
                if last is not None and not last.done:
                    await self._wait_posted(conn, last)
        finally:
            conn.draining = False

    async def _sync(self, conn: _Conn) -> None:
        """Send a SYNC on *conn* (not waiting for its answer), unless it is closed.

        One that cannot be sent needs no report: the connection failed, and with
        it the writes it would have confirmed."""
        if conn.closed:
            return
        try:
            await self._send(conn.server, conn.slot, Kind.SYNC, b"", None)
        except TransportError as exc:
            log.debug("no SYNC to memory server %s: %s", conn.server.name, exc)

    async def _wait_posted(self, conn: _Conn, p: _Pending) -> None:
        """Until posted write *p* is answered or confirmed (a SYNC sent for it if
        none was since), or failed."""
        if p.done:
            return
        if p.quiet and not conn.covered(p):
            await self._sync(conn)
        await conn.wait(p)

    async def _send_waiting(
        self, server: _Server, slot: int, p: _Pending, kind: Kind, head: bytes,
        data: memoryview | None,
    ) -> _Conn:
        """Send when that means waiting: for a connection, or for another sender."""
        conn: _Conn | None = None
        with trio.move_on_at(p.deadline):
            conn = await self._conn_at(server, slot)
            async with conn.send_lock:
                if conn.closed:
                    raise TransportError(conn.reason)
                rest = conn.send(p, kind, head, data)
                if rest:
                    await conn.finish_send(rest, p.deadline)
            return conn
        reason = f"memory server {server.name} did not answer within {self.io_timeout:g}s"
        if conn is not None:
            log.warning("%s; resetting the connection", reason)
            conn.fail(reason)
        raise TransportError(reason)

    async def _watch_deadlines(self) -> None:
        """Reset every connection with a request older than ``io_timeout``.

        One timer for all requests instead of a cancel scope each.  It sleeps
        until the earliest deadline outstanding, or ``io_timeout`` if there is
        none: a request sent meanwhile cannot expire sooner.
        """
        while True:
            now = trio.current_time()
            wake = now + self.io_timeout
            for server in self._servers.values():
                for conn in server.slots:
                    if conn is None or not conn.pending:
                        continue
                    if not conn.receiving:  # only abandoned requests: take their replies
                        conn.poll()
                        if not conn.pending:
                            continue
                    first = min(p.deadline for p in conn.pending.values())
                    if first <= now:
                        reason = (f"memory server {server.name} did not answer within "
                                  f"{self.io_timeout:g}s")
                        log.warning("%s; resetting the connection", reason)
                        conn.fail(reason)
                    else:
                        wake = min(wake, first)
            await trio.sleep_until(wake)

    def servers_up(self) -> dict[str, bool]:
        return {
            server.name: not server.lost
            and any(c is not None and not c.closed for c in server.slots)
            for server in self._servers.values()
        }

    def check_range(self, volume: int, offset: int, length: int) -> None:
        if self._closed:  # EIO for late requests
            raise TransportError("the tcp transport is closed")
        super().check_range(volume, offset, length)

    @property
    def volumes(self) -> list[VolumeInfo]:
        return self._info

    def register(self, size: int) -> memoryview:
        return memoryview(bytearray(size))

    async def read(self, volume: int, offset: int, length: int) -> Buffer:
        # Not zero-filled (a tenth of a client's time on 1 MiB reads): every byte is
        # received into it, or it is dropped with the error.
        buf = np.empty(length, np.uint8).data
        await self.readinto(volume, offset, buf)
        return buf

    async def readinto(self, volume: int, offset: int, buf: memoryview) -> None:
        dest = memoryview(buf).cast("B")
        if dest.readonly:  # receiving would fail on it, taking the connection down
            raise ValueError("readinto needs a writable buffer")
        n = len(dest)
        self.check_range(volume, offset, n)
        server, remote = self._map[volume]
        for pos in range(0, n, MAX_IO):
            k = min(MAX_IO, n - pos)
            await self._call(server, Kind.READ, wire.READ.pack(remote, offset + pos, k),
                             dest=dest[pos : pos + k])

    async def write(self, volume: int, offset: int, data: Buffer) -> None:
        src = memoryview(data).cast("B")
        n = len(src)
        self.check_range(volume, offset, n)
        server, remote = self._map[volume]
        for pos in range(0, n, MAX_IO):
            k = min(MAX_IO, n - pos)
            await self._call(server, Kind.WRITE, wire.WRITE.pack(remote, offset + pos),
                             data=src[pos : pos + k])

    async def zero(self, volume: int, offset: int, length: int) -> None:
        self.check_range(volume, offset, length)
        if length:
            server, remote = self._map[volume]
            await self._call(server, Kind.ZERO, wire.ZERO.pack(remote, offset, length))
