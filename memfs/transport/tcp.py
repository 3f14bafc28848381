"""The ``tcp`` transport: pool volumes held by ``memfs memd`` servers, reached over TCP.

Pool volume ``i`` is ``volumes[i]``, a (server, volume index on that server)
pair from a pool spec (``tcp://host:port/N``).  Open it with
:func:`open_tcp_transport`, which owns the nursery of the connection readers.

Connections and requests:

* up to ``connections_per_server`` connections per server, used round robin
  and opened lazily: at start one per server (its INFO gives the volume
  sizes), the others on first use, and a failed one again on the next request
  that picks it;
* requests are multiplexed: each connection has any number outstanding,
  matched to replies by request id by one reader task per connection.  A
  request's frame is sent whole under the connection's send lock (shielded
  from the caller's cancellation, never from the deadline), so frames never
  interleave;
* READ replies are received straight into the caller's buffer; WRITE data is
  sent straight from it with scatter/gather ``sendmsg``.  If a caller gives up
  while its reply is arriving, the rest lands in a scratch buffer instead.

Failures (all :class:`~memfs.errors.TransportError`, EIO to applications):

* every request, including any connect and handshake it needs, finishes within
  ``io_timeout`` or fails; the connection it waited on is then reset (its
  other requests fail at once) and reconnected on the next request.  A dead or
  hung server stalls only requests to its own volumes: other servers have
  their own connections and readers;
* a server's *incarnation* (from INFO) is remembered on first contact.  If a
  reconnect finds another one, the server restarted and the memory behind its
  volumes is blank: every later request to those volumes fails ("memory
  server X restarted; its data is lost") instead of reading zeros as data.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.lowlevel

from memfs import wire
from memfs.config import VolumeAddr
from memfs.errors import TransportError, UsageError
from memfs.transport import Buffer, Transport, VolumeInfo
from memfs.transport.sockio import (
    PeerClosed,
    close_socket,
    connect,
    recv_exactly_into,
    recv_exactly_into_current,
    recv_frame,
    send_all,
)
from memfs.wire import Kind

log = logging.getLogger(__name__)

DEFAULT_IO_TIMEOUT = 10.0
#: data bytes per request; larger reads and writes are split (wire.MAX_PAYLOAD
#: leaves room for the WRITE struct)
MAX_IO = 16 << 20
ROLE = "tcp"
_INFO_ID = 1
_INFO_MAX = 1 << 20
_SMALL_REPLY_MAX = 64 << 10  # OK to WRITE/ZERO is empty, ERROR is short


def _name(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def memd_handshake(sock: socket.socket, secret: bytes, role: str) -> tuple[int, list[int]]:
    """HELLO, AUTH, WELCOME, then INFO: (incarnation, volume sizes) of a memory server.

    Shared by the tcp and verbs transports (the verbs transport's control
    connection starts the same way).  No deadline here: callers set one.
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
    await send_all(sock, [wire.frame(Kind.INFO, _INFO_ID)])
    h, payload = await recv_frame(sock, _INFO_MAX)
    if h.kind is not Kind.OK or h.req_id != _INFO_ID:
        raise wire.WireError(f"unexpected {h.kind.name} reply to INFO")
    info = wire.decode(payload)
    if not (
        isinstance(info, dict)
        and isinstance(info.get("incarnation"), int)
        and isinstance(info.get("volumes"), list)
        and all(isinstance(s, int) and s > 0 for s in info["volumes"])
    ):
        raise wire.WireError(f"malformed INFO reply {info!r:.200}")
    return info["incarnation"], info["volumes"]


class _Pending:
    """One request awaiting its reply."""

    __slots__ = ("dest", "event", "kind", "payload", "error")

    def __init__(self, dest: memoryview | None) -> None:
        self.dest = dest  # READ: where the reply's data goes
        self.event = trio.Event()
        self.kind = Kind.OK
        self.payload = bytearray()
        self.error: str | None = None  # the connection failed before the reply

    def target(self) -> memoryview:
        assert self.dest is not None
        return self.dest

    def abandon(self) -> None:
        """The caller is gone: its buffer is no longer ours to write."""
        if self.dest is not None and not self.event.is_set():
            self.dest = memoryview(bytearray(len(self.dest)))


class _Conn:
    """One authenticated connection to a memory server and its reply reader."""

    def __init__(self, server: _Server, sock: socket.socket, slot: int) -> None:
        self.server = server
        self.sock = sock
        self.slot = slot
        self.send_lock = trio.Lock()
        self.pending: dict[int, _Pending] = {}
        self.closed = False
        self.reason = ""
        self._next_id = _INFO_ID
        self._scope = trio.CancelScope()

    def add(self, p: _Pending) -> int:
        while True:
            self._next_id = (self._next_id + 1) & 0xFFFFFFFF
            if self._next_id > _INFO_ID and self._next_id not in self.pending:
                self.pending[self._next_id] = p
                return self._next_id

    def fail(self, reason: str) -> None:
        """Reset: close the socket, stop the reader, fail every outstanding request."""
        if self.closed:
            return
        self.closed = True
        self.reason = reason
        self._scope.cancel()
        close_socket(self.sock)
        self.server.drop(self)
        for p in self.pending.values():
            p.error = reason
            p.event.set()
        self.pending.clear()

    async def reader(self) -> None:
        with self._scope:
            try:
                await self._read_replies()
            except (OSError, wire.WireError, trio.ClosedResourceError) as exc:
                if self.closed:  # we closed the socket under it (reset, aclose)
                    return
                reason = f"lost connection to memory server {self.server.name}: {exc}"
                log.warning("%s", reason)
                self.fail(reason)
            except Exception as exc:
                log.exception("reader of memory server %s failed", self.server.name)
                self.fail(f"memory server {self.server.name}: {exc!r}")

    async def _read_replies(self) -> None:
        """Match replies to requests; no deadline here: each requester has its own."""
        head = bytearray(wire.HEADER_SIZE)
        hv = memoryview(head)
        while True:
            await recv_exactly_into(self.sock, hv)
            h = wire.parse_header(head)
            p = self.pending.get(h.req_id)
            if p is None:
                raise wire.WireError(f"reply to unknown request {h.req_id}")
            if h.kind is Kind.OK and p.dest is not None:
                if h.length != len(p.dest):
                    raise wire.WireError(f"READ reply of {h.length} bytes, asked {len(p.dest)}")
                await recv_exactly_into_current(self.sock, h.length, p.target)
            elif h.kind in (Kind.OK, Kind.ERROR):
                if h.length > _SMALL_REPLY_MAX:
                    raise wire.WireError(f"{h.kind.name} reply of {h.length} bytes")
                p.payload = bytearray(h.length)
                await recv_exactly_into(self.sock, memoryview(p.payload))
            else:
                raise wire.WireError(f"unexpected {h.kind.name} frame")
            p.kind = h.kind
            del self.pending[h.req_id]
            p.event.set()
            # Under a steady stream of replies no recv would block: let others run.
            await trio.lowlevel.checkpoint()


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


class _Server:
    """What the client knows about one memory server."""

    def __init__(self, host: str, port: int, n_conns: int) -> None:
        self.host, self.port = host, port
        self.name = _name(host, port)
        self.slots: list[_Conn | None] = [None] * n_conns
        self.connecting = [trio.Lock() for _ in range(n_conns)]
        self.incarnation: int | None = None
        self.sizes: list[int] = []
        self.lost: str | None = None
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
) -> AsyncIterator[TcpTransport]:
    """Connect to the servers of *volumes* and yield the transport; close it on exit.

    Raises :class:`TransportError` if a server cannot be reached or refuses us
    within *io_timeout*, :class:`UsageError` if a volume does not exist there.
    """
    t = TcpTransport(volumes, secret, connections_per_server=connections_per_server,
                     io_timeout=io_timeout)
    for srv in t._servers.values():  # known to the pool: a different one means lost memory
        if incarnations and srv.name in incarnations:
            srv.incarnation = incarnations[srv.name]
    error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            t._nursery = nursery
            try:
                await t._open()
                yield t
            finally:
                t._close()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Readers never raise, so a group only wraps the opening's or the
        # body's one exception: give callers that exception itself.
        if len(group.exceptions) != 1:
            raise
        error = group.exceptions[0]
    if error is not None:
        raise error


class TcpTransport(Transport):
    concurrent = True  # requests to different servers (and connections) overlap

    def __init__(
        self,
        volumes: Sequence[VolumeAddr],
        secret: bytes,
        *,
        connections_per_server: int = 2,
        io_timeout: float = DEFAULT_IO_TIMEOUT,
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
        self._info: list[VolumeInfo] = []
        self._nursery: trio.Nursery | None = None
        self._closed = False

    # -- opening and closing ----------------------------------------------------------

    async def _open(self) -> None:
        for server in self._servers.values():
            with trio.move_on_after(self.io_timeout) as scope:
                try:
                    await self._connect(server, 0)
                except TransportError:
                    if not server.lost:  # unreachable: no pool without it
                        raise
                    # restarted since the pool knew it: its volumes answer EIO
            if scope.cancelled_caught:
                raise TransportError(
                    f"memory server {server.name} did not answer within {self.io_timeout:g}s"
                )
        self._info.extend(volume_infos(self._map, self._addrs))

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

    async def _connect(self, server: _Server, slot: int) -> _Conn:
        """Connect, authenticate, check the incarnation and start the reader."""
        try:
            sock = await connect(server.host, server.port)
        except OSError as exc:
            raise TransportError(
                f"cannot connect to memory server {server.name}: {exc.strerror or exc}"
            ) from None
        try:
            incarnation, sizes = await self._handshake(sock)
        except (OSError, wire.WireError) as exc:
            close_socket(sock)
            raise TransportError(f"memory server {server.name}: {exc}") from None
        except BaseException:
            close_socket(sock)
            raise
        if self._closed:
            close_socket(sock)
            raise TransportError("the tcp transport is closed")
        if not server.sizes:
            server.sizes = sizes
        if server.incarnation is None:
            server.incarnation = incarnation
        elif incarnation != server.incarnation or server.lost:
            close_socket(sock)
            if not server.lost:
                server.lost = f"memory server {server.name} restarted; its data is lost"
                log.error("%s (incarnation %x, was %x)", server.lost, incarnation,
                          server.incarnation)
                server.close_all(server.lost)
            raise TransportError(server.lost)
        conn = _Conn(server, sock, slot)
        server.slots[slot] = conn
        assert self._nursery is not None
        self._nursery.start_soon(conn.reader)
        log.debug("connected to memory server %s (slot %d)", server.name, slot)
        return conn

    async def _handshake(self, sock: socket.socket) -> tuple[int, list[int]]:
        return await memd_handshake(sock, self._secret, ROLE)

    async def _conn_for(self, server: _Server) -> _Conn:
        if server.lost:
            raise TransportError(server.lost)
        slot = server.next_slot()
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
        """Send one request and wait for its reply, all within ``io_timeout``."""
        deadline = trio.current_time() + self.io_timeout
        p = _Pending(dest)
        conn: _Conn | None = None
        with trio.move_on_at(deadline):
            conn = await self._conn_for(server)
            async with conn.send_lock:
                if conn.closed:
                    raise TransportError(conn.reason)
                req_id = conn.add(p)
                length = len(head) + (len(data) if data is not None else 0)
                # Shielded: a frame cut short by the caller's cancellation would
                # corrupt the stream for every other request on the connection.
                with trio.CancelScope(shield=True, deadline=deadline) as send_scope:
                    try:
                        await send_all(conn.sock, [wire.pack_header(kind, req_id, length), head,
                                                   data if data is not None else b""])
                    except OSError as exc:
                        conn.fail(f"lost connection to memory server {server.name}: {exc}")
                if send_scope.cancelled_caught:
                    conn.fail(f"memory server {server.name} took no data for "
                              f"{self.io_timeout:g}s")
            try:
                await p.event.wait()
            except BaseException:
                p.abandon()
                raise
        if not p.event.is_set():
            reason = f"memory server {server.name} did not answer within {self.io_timeout:g}s"
            if conn is not None:
                log.warning("%s; resetting the connection", reason)
                conn.fail(reason)
            raise TransportError(reason)
        if p.error is not None:
            raise TransportError(p.error)
        if p.kind is Kind.ERROR:
            err, msg = wire.decode_error(p.payload)
            raise TransportError(f"memory server {server.name}: {msg or os.strerror(err)}")
        return p

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
        buf = memoryview(bytearray(length))
        await self.readinto(volume, offset, buf)
        return buf

    async def readinto(self, volume: int, offset: int, buf: memoryview) -> None:
        dest = memoryview(buf).cast("B")
        if dest.readonly:  # the reader task would fail on it, taking the connection down
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
