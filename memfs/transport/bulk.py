"""Blocking bulk transfers with ``memfs memd`` servers, a thread per connection.

For a process that moves large arrays to and from the pool (:mod:`memfs.array`)
rather than serving many small requests: each connection's thread sends all of
its requests, then receives the replies in order (a server answers the requests
of one connection in order), straight into the caller's memory (``recv_into``
until the reply is in) or straight from it (``sendall``).  That
is the raw socket loop plus a 12-byte header per request: measured on loopback
about half again what the trio transport reaches for the same transfers, whose
event loop costs more per byte here than the copies do.

Each connection has a thread of its own, and transfers queue per connection:
:meth:`BulkTcp.begin` returns at once, so a caller starts its next transfer
while one still moves, and no connection waits for the slowest of the others
between them.  Each transfer names the lease token that was current when it
was begun (its extents were mapped under it): a connection that named another
is opened again first, by its own thread.  The first failure stops every
transfer under way (they fail too, as stopped): a caller that begins the next
piece before the last one ended gives up on both.

Same wire protocol, handshake and checks as :mod:`memfs.transport.tcp` (the
shared parts live there): a server's incarnation is compared with what the pool
knows, so a server restarted blank is an error, never zeros; the volumes are
claimed for the mount's filesystem (CLAIM, refused for another one's); every send and
receive has the I/O deadline; any failure is a :class:`TransportError` naming
the server, and the connection is dropped (reopened by the next transfer).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from memfs import wire
from memfs.config import VolumeAddr
from memfs.errors import ClaimRefused, TransportError, UsageError
from memfs.transport.sockio import set_rcvlowat
from memfs.transport.splice import SpliceSender
from memfs.transport.splice import available as splice_available
from memfs.transport.tcp import (
    CLAIM_ID,
    DEFAULT_IO_TIMEOUT,
    MAX_IO,
    ROLE,
    SESSION_ID,
    check_claim_reply,
    check_info,
    check_session_reply,
    server_name,
    should_claim,
)
from memfs.wire import Kind

log = logging.getLogger(__name__)

#: one transfer: (pool volume, offset in it, the caller's memory)
Job = tuple[int, int, memoryview]

_INFO_ID = 1
#: with MEMFS_SPLICE_SAVES=1, writes this large go by reference
#: (memfs.transport.splice); otherwise, and smaller ones, are copied (``sendall``).
#: Off by default: measured on this machine on 2026-11-26 (old and new alternating,
#: 1 GiB saves to 2 loopback memory servers), by reference 1.77-2.21 GiB/s and
#: by copy 2.40-2.71: the receiver's copy out of page-sized fragments and the
#: pinning cost more than the sender's copy (on 2026-11-25 it measured the other way).
SPLICE_MIN = 64 << 10
_SPLICE = splice_available() and os.environ.get("MEMFS_SPLICE_SAVES") == "1"


@dataclass(eq=False)  # by identity: a key of the transfer queues
class _Server:
    host: str
    port: int
    name: str
    #: open connections (None: to be opened by the next transfer that uses the slot)
    socks: list[socket.socket | None] = field(default_factory=list)
    #: the lease token each open connection named
    tokens: list[int] = field(default_factory=list)
    #: one thread per connection: its transfers, in the order they were begun
    threads: list[ThreadPoolExecutor] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


class BulkTcp:
    """See the module docstring.  Opening connects to every server (a missing or
    restarted one is an error here, before any transfer)."""

    def __init__(
        self, volumes: Sequence[VolumeAddr], secret: bytes, *,
        incarnations: Mapping[str, int] | None = None, connections_per_server: int = 2,
        io_timeout: float = DEFAULT_IO_TIMEOUT, token: int = 0, fsid: bytes | None = None,
    ) -> None:
        if not volumes or any(v.scheme != "tcp" for v in volumes):
            raise UsageError("bulk transfers need a pool of tcp:// volumes")
        self.secret = secret
        self.io_timeout = io_timeout
        #: the mount's lease token, named to every server (SESSION; see memfs.transport.memd)
        self.token = token
        self.expected = dict(incarnations or {})
        #: the filesystem the volumes belong to (CLAIM on every connection); None: no claim
        self.fsid = fsid
        self._servers: dict[tuple[str, int], _Server] = {}
        self._map: list[tuple[_Server, int]] = []
        for v in volumes:
            s = self._servers.get(v.server)
            if s is None:
                s = self._servers[v.server] = _Server(
                    v.host, v.port, server_name(v.host, v.port), [None] * connections_per_server,
                    [0] * connections_per_server,
                    [ThreadPoolExecutor(1, thread_name_prefix="memfs-bulk")
                     for _ in range(connections_per_server)])
            self._map.append((s, v.volume))
        self._lock = threading.Lock()
        #: transfers begun and not yet waited for (a failure stops them all)
        self._under_way: weakref.WeakSet[Batch] = weakref.WeakSet()
        self._closed = False
        try:
            for s in self._servers.values():
                s.socks[0] = self._connect(s, self.token)
                s.tokens[0] = self.token
        except BaseException:
            self.close()
            raise

    # -- connections -------------------------------------------------------------------

    def _connect(self, s: _Server, token: int) -> socket.socket:
        try:
            sock = socket.create_connection((s.host, s.port), timeout=self.io_timeout)
        except OSError as exc:
            raise TransportError(f"cannot connect to memory server {s.name}: "
                                 f"{exc.strerror or exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hs = wire.Handshake(self.secret)
            h, hello = _recv_frame(sock, wire.NONCE_SIZE)
            if h.kind is not Kind.HELLO:
                raise wire.WireError(f"expected HELLO, got {h.kind.name}")
            sock.sendall(wire.frame(Kind.AUTH, 0, hs.auth(hello, ROLE)))
            try:
                h, welcome = _recv_frame(sock, wire.MAC_SIZE)
            except EOFError:
                raise wire.WireError("authentication refused (wrong secret?)") from None
            if h.kind is not Kind.WELCOME:
                raise wire.WireError(f"expected WELCOME, got {h.kind.name}")
            hs.check_welcome(welcome)
            if token:
                sock.sendall(wire.frame(Kind.SESSION, SESSION_ID, wire.TOKEN.pack(token)))
                try:
                    h, payload = _recv_frame(sock, 1 << 20)
                except EOFError:
                    raise wire.WireError("closed at SESSION") from None
                check_session_reply(h, payload)
            sock.sendall(wire.frame(Kind.INFO, _INFO_ID))
            h, payload = _recv_frame(sock, 1 << 20)
            if h.kind is not Kind.OK or h.req_id != _INFO_ID:
                raise wire.WireError(f"unexpected {h.kind.name} reply to INFO")
            info = wire.decode(payload)
            incarnation, sizes = check_info(info)
            features = info.get("features", [])
            mine = sorted({remote for srv, remote in self._map if srv is s})
            if isinstance(features, list) and should_claim(
                self.fsid, mine, features, sizes, incarnation, self.expected.get(s.name),
            ):
                assert self.fsid is not None
                sock.sendall(wire.frame(Kind.CLAIM, CLAIM_ID, wire.encode_claim(self.fsid, mine)))
                h, payload = _recv_frame(sock, 1 << 20)
                check_claim_reply(h, payload)
        except ClaimRefused as exc:
            sock.close()
            raise ClaimRefused(f"memory server {s.name}: {exc.args[1]}") from None
        except (OSError, EOFError, wire.WireError) as exc:
            sock.close()
            raise TransportError(f"memory server {s.name}: {exc}") from None
        want = self.expected.get(s.name)
        if want is not None and incarnation != want:
            sock.close()
            raise TransportError(f"memory server {s.name} restarted; its data is lost")
        self.expected[s.name] = incarnation
        s.sizes = sizes
        return sock

    def _sock(self, s: _Server, slot: int, token: int) -> socket.socket:
        """The connection of *slot* (on its own thread), naming *token*: opened again
        if it named another one."""
        with self._lock:
            sock = s.socks[slot]
        if sock is not None and s.tokens[slot] != token:
            self._drop(s, slot)
            sock = None
        if sock is None:
            sock = self._connect(s, token)
            with self._lock:
                s.socks[slot], s.tokens[slot] = sock, token
        return sock

    def _drop(self, s: _Server, slot: int) -> None:
        with self._lock:
            sock, s.socks[slot] = s.socks[slot], None
        if sock is not None:
            sock.close()

    # -- transfers ---------------------------------------------------------------------

    def move(self, jobs: Sequence[Job], *, write: bool) -> None:
        """Do *jobs*, spread over every connection; returns once none is running
        (the first failure is raised after the others have stopped)."""
        self.begin(jobs, write=write).wait()

    def begin(self, jobs: Sequence[Job], *, write: bool) -> Batch:
        """Start *jobs* (spread over every connection, each behind what was begun on
        it before) and return at once; :meth:`Batch.wait` waits for them."""
        queues: dict[tuple[_Server, int], list[tuple[int, int, memoryview]]] = {}
        turn: dict[tuple[str, int], int] = {}
        for vol, voff, view in jobs:
            if not 0 <= vol < len(self._map):
                raise TransportError(f"no volume {vol} in a pool of {len(self._map)}")
            s, remote = self._map[vol]
            for k in range(0, len(view), MAX_IO):
                part = view[k : k + MAX_IO]
                if remote >= len(s.sizes) or voff + k + len(part) > s.sizes[remote]:
                    raise TransportError(f"range {voff + k}+{len(part)} outside volume {vol}")
                key = (s.host, s.port)
                slot = turn.get(key, 0)
                turn[key] = (slot + 1) % len(s.socks)
                queues.setdefault((s, slot), []).append((remote, voff + k, part))
        with self._lock:
            if self._closed:
                raise TransportError("bulk transfers are closed")
            batch = Batch(self.token)
            self._under_way.add(batch)
        try:
            for (s, slot), q in queues.items():
                batch.futures.append(s.threads[slot].submit(self._run, s, slot, q, write, batch))
        except BaseException:
            batch.cancel()
            raise
        return batch

    def _stop_all(self) -> None:
        with self._lock:
            under_way = list(self._under_way)
        for b in under_way:
            b.stop.set()

    def _run(self, s: _Server, slot: int, q: list[tuple[int, int, memoryview]], write: bool,
             batch: Batch) -> None:
        stop = batch.stop
        try:
            if stop.is_set():  # queued behind a transfer that failed
                raise TransferStopped(f"memory server {s.name}: not started, another "
                                      "transfer failed")
            sock = self._sock(s, slot, batch.token)
            if write:
                sent = len(q)
                sender = SpliceSender() if _SPLICE else None
                try:
                    for i, (remote, off, part) in enumerate(q):
                        if stop.is_set():
                            sent = i
                            break
                        head = (wire.pack_header(Kind.WRITE, i + 2, wire.WRITE.size + len(part))
                                + wire.WRITE.pack(remote, off))
                        if sender is not None and len(part) >= SPLICE_MIN:
                            sock.sendall(head, socket.MSG_MORE)
                            sender.send(sock, part, self.io_timeout)
                        else:
                            sock.sendall(head)
                            sock.sendall(part)
                finally:
                    if sender is not None:
                        sender.close()
                for i in range(sent):
                    self._reply(sock, s, i + 2, None)
                if sent < len(q):  # what was sent is answered: the connection stays
                    raise TransferStopped(f"memory server {s.name}: stopped, another "
                                          "transfer failed")
            else:
                sock.sendall(b"".join(wire.frame(Kind.READ, i + 2, wire.READ.pack(remote, off, len(part)))
                                      for i, (remote, off, part) in enumerate(q)))
                for i, (_, _, part) in enumerate(q):
                    if stop.is_set():  # the rest is dropped with the connection
                        raise _Stopped
                    self._reply(sock, s, i + 2, part)
        except _Stopped:
            self._drop(s, slot)  # replies still on their way
            raise TransferStopped(f"memory server {s.name}: stopped, another transfer "
                                  "failed") from None
        except TransferStopped:
            raise
        except BaseException as exc:
            self._stop_all()
            self._drop(s, slot)
            if isinstance(exc, TransportError):
                raise
            if isinstance(exc, (OSError, EOFError, wire.WireError)):
                why = "no answer in time" if isinstance(exc, TimeoutError) else str(exc)
                raise TransportError(f"memory server {s.name}: {why}") from None
            raise

    def _reply(self, sock: socket.socket, s: _Server, req_id: int, dest: memoryview | None) -> None:
        h = wire.parse_header(_recv_exact(sock, wire.HEADER_SIZE), wire.MAX_PAYLOAD)
        if h.req_id != req_id:
            raise wire.WireError(f"reply to request {h.req_id}, expected {req_id}")
        if h.kind is Kind.ERROR:
            err, msg = wire.decode_error(_recv_exact(sock, h.length))
            raise TransportError(f"memory server {s.name}: {msg or errno.errorcode.get(err, err)}")
        if h.kind is not Kind.OK or h.length != (0 if dest is None else len(dest)):
            raise wire.WireError(f"unexpected {h.kind.name} reply of {h.length} bytes")
        if dest is not None:
            recv_exactly(sock, dest)

    def set_token(self, token: int) -> None:
        """Name *token* in the transfers begun from now on (the mount's lease token
        changed; their extents were mapped under it): each connection that named the
        old one is opened again first, by its own thread.  Transfers begun before
        keep the old one (and fail if it was fenced)."""
        with self._lock:
            self.token = token

    def adopt(self, incarnations: Mapping[str, int]) -> None:
        """The pool's data lives in these incarnations now (the mds took a server that
        restarted blank back, see ``Transport.adopt``): connections are made to them
        from now on (one still open to the old one fails at its next use)."""
        names = {s.name for s in self._servers.values()}
        with self._lock:
            self.expected.update((k, v) for k, v in incarnations.items() if k in names)

    def close(self) -> None:
        """Stop what is under way, wait for it, close the connections."""
        with self._lock:
            self._closed = True
        self._stop_all()
        for s in self._servers.values():
            for t in s.threads:
                t.shutdown(cancel_futures=True)
        for s in self._servers.values():
            for slot in range(len(s.socks)):
                self._drop(s, slot)


class Batch:
    """The transfers of one :meth:`BulkTcp.begin`, one per connection they use."""

    def __init__(self, token: int) -> None:
        #: the lease token its connections name
        self.token = token
        self.futures: list[Future[None]] = []
        #: set by a failure anywhere (or the caller): what has not moved yet stops
        self.stop = threading.Event()

    def wait(self) -> None:
        """Wait for every transfer, through KeyboardInterrupt (which stops the rest
        early); then raise the first failure (one of its own before one that only
        stopped because of another)."""
        interrupted: BaseException | None = None
        for f in self.futures:
            while not f.cancelled():  # cancelled: never runs (and never finishes)
                try:
                    wait_futures([f])
                    break
                except KeyboardInterrupt as exc:
                    interrupted = exc
                    self._stop_now()
        if interrupted is not None:
            raise interrupted
        failures = [e for f in self.futures if not f.cancelled()
                    for e in [f.exception()] if e is not None]
        if failures:
            raise next((e for e in failures if not isinstance(e, TransferStopped)), failures[0])

    def cancel(self) -> None:
        """Stop what has not been moved yet and wait until nothing of it runs (the
        caller is giving up); failures are not raised."""
        self._stop_now()
        with contextlib.suppress(Exception):
            self.wait()

    def _stop_now(self) -> None:
        self.stop.set()
        for f in self.futures:
            f.cancel()  # not started: never will


class TransferStopped(TransportError):
    """A transfer gave up because another one failed (or its caller stopped it)."""


class _Stopped(Exception):
    """Another connection's transfer failed, or the caller was interrupted."""


def recv_exactly(sock: socket.socket, dest: memoryview) -> None:
    """Fill *dest* from blocking *sock*.  Past :data:`~memfs.transport.sockio.RCVLOWAT_FROM`
    the socket wakes us only once min(rest, 256 KiB) has arrived
    (:func:`~memfs.transport.sockio.set_rcvlowat`), not for every segment.  So the socket's timeout bounds the wait for that
    much: a server sending slower than 256 KiB per ``io_timeout`` (25 KiB/s at
    the default 10 s) counts as not answering."""
    got, n = 0, len(dest)
    lowat = 1
    try:
        while got < n:
            lowat = set_rcvlowat(sock, lowat, n, got)
            k = sock.recv_into(dest[got:], n - got)
            if not k:
                raise EOFError("connection closed inside a reply")
            got += k
    finally:
        set_rcvlowat(sock, lowat, 0, 0)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("connection closed by the memory server")
        got += k
    return buf


def _recv_frame(sock: socket.socket, max_payload: int) -> tuple[wire.Header, bytearray]:
    h = wire.parse_header(_recv_exact(sock, wire.HEADER_SIZE), max_payload)
    return h, _recv_exact(sock, h.length)
