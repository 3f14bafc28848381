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
between them.

Same wire protocol, handshake and checks as :mod:`memfs.transport.tcp` (the
shared parts live there): a server's incarnation is compared with what the pool
knows, so a server restarted blank is an error, never zeros; every send and
receive has the I/O deadline; any failure is a :class:`TransportError` naming
the server, and the connection is dropped (reopened by the next transfer).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from memfs import wire
from memfs.config import VolumeAddr
from memfs.errors import TransportError, UsageError
from memfs.transport.tcp import (
    DEFAULT_IO_TIMEOUT,
    MAX_IO,
    ROLE,
    SESSION_ID,
    check_info,
    check_session_reply,
    server_name,
)
from memfs.wire import Kind

log = logging.getLogger(__name__)

#: one transfer: (pool volume, offset in it, the caller's memory)
Job = tuple[int, int, memoryview]

_INFO_ID = 1


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
        io_timeout: float = DEFAULT_IO_TIMEOUT, token: int = 0,
    ) -> None:
        if not volumes or any(v.scheme != "tcp" for v in volumes):
            raise UsageError("bulk transfers need a pool of tcp:// volumes")
        self.secret = secret
        self.io_timeout = io_timeout
        #: the mount's lease token, named to every server (SESSION; see memfs.transport.memd)
        self.token = token
        self.expected = dict(incarnations or {})
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
        try:
            for s in self._servers.values():
                s.socks[0] = self._connect(s)
                s.tokens[0] = self.token
        except BaseException:
            self.close()
            raise

    # -- connections -------------------------------------------------------------------

    def _connect(self, s: _Server) -> socket.socket:
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
            if self.token:
                sock.sendall(wire.frame(Kind.SESSION, SESSION_ID, wire.TOKEN.pack(self.token)))
                try:
                    h, payload = _recv_frame(sock, 1 << 20)
                except EOFError:
                    raise wire.WireError("closed at SESSION") from None
                check_session_reply(h, payload)
            sock.sendall(wire.frame(Kind.INFO, _INFO_ID))
            h, payload = _recv_frame(sock, 1 << 20)
            if h.kind is not Kind.OK or h.req_id != _INFO_ID:
                raise wire.WireError(f"unexpected {h.kind.name} reply to INFO")
            incarnation, sizes = check_info(wire.decode(payload))
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

    def _sock(self, s: _Server, slot: int) -> socket.socket:
        """The connection of *slot* (on its own thread): opened again if it named
        another token than the one to name now."""
        with self._lock:
            sock, token = s.socks[slot], self.token
        if sock is not None and s.tokens[slot] != token:
            self._drop(s, slot)
            sock = None
        if sock is None:
            sock = self._connect(s)
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
        batch = Batch()
        try:
            for (s, slot), q in queues.items():
                batch.futures.append(s.threads[slot].submit(self._run, s, slot, q, write,
                                                            batch.stop))
        except BaseException:
            batch.cancel()
            raise
        return batch

    def _run(self, s: _Server, slot: int, q: list[tuple[int, int, memoryview]], write: bool,
             stop: threading.Event) -> None:
        try:
            sock = self._sock(s, slot)
            if write:
                for i, (remote, off, part) in enumerate(q):
                    if stop.is_set():
                        q = q[:i]
                        break
                    sock.sendall(wire.pack_header(Kind.WRITE, i + 2, wire.WRITE.size + len(part))
                                 + wire.WRITE.pack(remote, off))
                    sock.sendall(part)
                for i in range(len(q)):
                    self._reply(sock, s, i + 2, None)
            else:
                sock.sendall(b"".join(wire.frame(Kind.READ, i + 2, wire.READ.pack(remote, off, len(part)))
                                      for i, (remote, off, part) in enumerate(q)))
                for i, (_, _, part) in enumerate(q):
                    if stop.is_set():  # the rest is dropped with the connection
                        raise _Stopped
                    self._reply(sock, s, i + 2, part)
        except _Stopped:
            self._drop(s, slot)
        except BaseException as exc:
            stop.set()
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
            got = 0
            while got < len(dest):
                k = sock.recv_into(dest[got:], len(dest) - got)
                if not k:
                    raise EOFError("connection closed inside a reply")
                got += k

    def set_token(self, token: int) -> None:
        """Name *token* from now on (the mount's lease token changed): each connection
        that named the old one is opened again before its next transfer (by its own
        thread; one under way finishes, or fails if that token was fenced)."""
        with self._lock:
            self.token = token

    def close(self) -> None:
        for s in self._servers.values():
            for t in s.threads:
                t.shutdown()
        for s in self._servers.values():
            for slot in range(len(s.socks)):
                self._drop(s, slot)


class Batch:
    """The transfers of one :meth:`BulkTcp.begin`, one per connection they use."""

    def __init__(self) -> None:
        self.futures: list[Future[None]] = []
        #: set by the first failure (or the caller): the others stop early
        self.stop = threading.Event()

    def wait(self) -> None:
        """Wait for every transfer, through KeyboardInterrupt (which stops the rest
        early); then raise the first failure."""
        interrupted: BaseException | None = None
        for f in self.futures:
            while True:
                try:
                    wait_futures([f])  # done, or cancelled before it started
                    break
                except KeyboardInterrupt as exc:
                    interrupted = exc
                    self.stop.set()
        if interrupted is not None:
            raise interrupted
        for f in self.futures:
            failure = None if f.cancelled() else f.exception()
            if failure is not None:
                raise failure

    def cancel(self) -> None:
        """Stop what has not moved yet and wait until nothing of it runs (another
        transfer of the caller failed); failures are not raised."""
        self.stop.set()
        for f in self.futures:
            f.cancel()
        with contextlib.suppress(Exception):  # the caller is raising its own failure
            self.wait()


class _Stopped(Exception):
    """Another connection's transfer failed, or the caller was interrupted."""


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
