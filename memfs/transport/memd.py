"""The memory server (``memfs memd``): volumes of this node's memory, served over TCP.

A :class:`MemoryServer` allocates and touches its volumes up front (a
:class:`~memfs.transport.local.LocalTransport` holds them), picks a random
*incarnation* and serves the ``memd`` requests of :mod:`memfs.wire` to any
number of clients:

* every connection starts with the HMAC handshake (HELLO, AUTH, WELCOME); a
  client that fails it is dropped before a single request is read;
* then requests (INFO, READ, WRITE, ZERO) are served in order, one at a time
  per connection; a client may pipeline them, and each reply carries its
  request's id;
* data moves between the socket and volume memory with no copy in Python:
  WRITE payloads are received straight into the volume (after the range is
  checked), READ replies are sent straight from it with ``sendmsg``;
* a connection may sit idle between frames forever, but a frame that has
  started must be received, served and answered within ``frame_timeout``;
* anything malformed (bad header, wrong payload size, a frame kind that is not
  a request) is logged and closes that connection only.  A WRITE whose range
  lies outside the volume is answered EINVAL and its payload discarded.

Clients tell a restarted server by its incarnation: the memory behind a new
incarnation is blank, whatever was written to the old one is gone.

Consistency: requests on different connections run interleaved; a READ that
overlaps a concurrent WRITE may see part of it (like the local transport).
A WRITE whose sender disappears mid-payload may leave part of its data in the
volume; the client reports that write failed.
"""

from __future__ import annotations

import errno
import faulthandler
import logging
import secrets
import signal
import socket
import struct
from typing import Any

import trio
import trio.lowlevel

from memfs import wire
from memfs.config import format_size
from memfs.errors import UsageError
from memfs.host import mem_available, sd_notify
from memfs.transport.local import LocalTransport
from memfs.transport.sockio import (
    PeerClosed,
    close_socket,
    recv_exactly_into,
    recv_some_into,
    send_all,
)
from memfs.wire import Kind

log = logging.getLogger(__name__)

#: a started frame must be completely received, served and answered within this
FRAME_TIMEOUT = 30.0
#: from accept to a completed AUTH
HANDSHAKE_TIMEOUT = 10.0
#: AUTH is 65 bytes plus a short role name; nothing larger is read before it
_AUTH_MAX = 512
_DISCARD = 1 << 20


class _Drop(Exception):
    """End this connection, logging the reason as a warning."""


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MemoryServer:
    """*n_volumes* volumes of *volume_size* bytes, served to clients that know *secret*.

    An empty *secret* still runs the handshake, with an empty key: anyone who
    can reach the port can read and write the memory.
    """

    def __init__(
        self,
        n_volumes: int,
        volume_size: int,
        secret: bytes = b"",
        *,
        frame_timeout: float = FRAME_TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_payload: int = wire.MAX_PAYLOAD,
    ) -> None:
        self.memory = LocalTransport(n_volumes, volume_size)
        # A random 63-bit number: the value codec carries signed 64-bit integers.
        self.incarnation = secrets.randbits(63)
        self.secret = secret
        self.frame_timeout = frame_timeout
        self.handshake_timeout = handshake_timeout
        self.max_payload = max_payload
        self._info = wire.encode(
            {"incarnation": self.incarnation, "volumes": [v.size for v in self.memory.volumes]}
        )
        self._views = [self.memory.volume_memory(i) for i in range(n_volumes)]

    async def aclose(self) -> None:
        """Give the volumes back (after serving has stopped)."""
        self._views.clear()
        await self.memory.aclose()

    # -- listening -----------------------------------------------------------------

    @staticmethod
    async def listen(host: str, port: int) -> socket.socket:
        """A listening socket on *host*:*port* (port 0: any free port).

        Separate from :meth:`serve` so that a daemon can report a bind failure
        as a user error before it starts any task.
        """
        infos = await trio.socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on *host*:*port* and serve until cancelled; reports the bound port."""
        sock = await self.listen(host, port)
        await self.serve_socket(sock, task_status=task_status)

    async def serve_socket(
        self, sock: socket.socket, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept and serve connections on listening *sock* until cancelled; closes it."""
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(sock.getsockname()[1])
                while True:
                    try:
                        conn, addr = sock.accept()
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(sock)
                        continue
                    except OSError as exc:
                        # Out of descriptors or buffers: let connections drain and retry.
                        log.warning("accept failed: %s", exc)
                        await trio.sleep(0.1)
                        continue
                    nursery.start_soon(self._connection, conn, format_addr(*addr[:2]))
                    await trio.lowlevel.checkpoint()
        finally:
            close_socket(sock)

    # -- one connection ------------------------------------------------------------

    async def _connection(self, sock: socket.socket, peer: str) -> None:
        """Serve one client; whatever it sends, only this connection ends."""
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            role: str | None = None
            with trio.move_on_after(self.handshake_timeout) as scope:
                role = await self._handshake(sock)
            if scope.cancelled_caught:
                raise _Drop(f"no authentication within {self.handshake_timeout:g}s")
            if role is None:
                log.info("%s connected and left without a word", peer)  # a port probe
                return
            log.debug("%s authenticated (%s)", peer, role)
            await self._serve_requests(sock)
            log.debug("%s disconnected", peer)
        except (wire.WireError, _Drop) as exc:
            log.warning("closing connection from %s: %s", peer, exc)
        except PeerClosed as exc:
            log.warning("connection from %s closed in the middle of a frame (%s)", peer, exc)
        except OSError as exc:
            log.info("connection from %s failed: %s", peer, exc)
        except Exception:
            log.exception("connection from %s: unexpected error", peer)
        finally:
            close_socket(sock)

    async def _handshake(self, sock: socket.socket) -> str | None:
        """The client's role once authenticated; None if it left before sending anything."""
        hs = wire.Handshake(self.secret)
        await send_all(sock, [wire.frame(Kind.HELLO, 0, hs.hello())])
        head = bytearray(wire.HEADER_SIZE)
        n = await recv_some_into(sock, memoryview(head))
        if n == 0:
            return None
        await recv_exactly_into(sock, memoryview(head)[n:])
        h = wire.parse_header(head, _AUTH_MAX)
        payload = bytearray(h.length)
        await recv_exactly_into(sock, memoryview(payload))
        if h.kind is not Kind.AUTH:
            raise wire.WireError(f"expected AUTH, got {h.kind.name}")
        role = hs.check_auth(payload)
        await send_all(sock, [wire.frame(Kind.WELCOME, h.req_id, hs.welcome())])
        return role

    async def _serve_requests(self, sock: socket.socket) -> None:
        head = bytearray(wire.HEADER_SIZE)
        hv = memoryview(head)
        small = bytearray(32)
        while True:
            n = await recv_some_into(sock, hv)  # idle between frames: no deadline
            if n == 0:
                return
            with trio.move_on_after(self.frame_timeout) as scope:
                if n < wire.HEADER_SIZE:
                    await recv_exactly_into(sock, hv[n:])
                h = wire.parse_header(head, self.max_payload)
                await self._request(sock, h, small)
            if scope.cancelled_caught:
                raise _Drop(f"a frame was not completed within {self.frame_timeout:g}s")
            # A client that pipelines without pause must not starve the others.
            await trio.lowlevel.checkpoint()

    async def _request(self, sock: socket.socket, h: wire.Header, small: bytearray) -> None:
        kind = h.kind
        if kind is Kind.WRITE:
            if h.length < wire.WRITE.size:
                raise wire.WireError(f"WRITE payload of {h.length} bytes")
            volume, offset = await _recv_struct(sock, wire.WRITE, small)
            n = h.length - wire.WRITE.size
            bad = self._check(volume, offset, n)
            if bad:
                await _discard(sock, n)
                await self._error(sock, h.req_id, errno.EINVAL, bad)
                return
            await recv_exactly_into(sock, self._views[volume][offset : offset + n])
            await send_all(sock, [wire.pack_header(Kind.OK, h.req_id, 0)])
        elif kind is Kind.READ:
            if h.length != wire.READ.size:
                raise wire.WireError(f"READ payload of {h.length} bytes")
            volume, offset, n = await _recv_struct(sock, wire.READ, small)
            bad = self._check(volume, offset, n)
            if not bad and n > self.max_payload:
                bad = f"read of {n} bytes exceeds the limit of {self.max_payload}"
            if bad:
                await self._error(sock, h.req_id, errno.EINVAL, bad)
                return
            await send_all(
                sock,
                [wire.pack_header(Kind.OK, h.req_id, n), self._views[volume][offset : offset + n]],
            )
        elif kind is Kind.ZERO:
            if h.length != wire.ZERO.size:
                raise wire.WireError(f"ZERO payload of {h.length} bytes")
            volume, offset, n = await _recv_struct(sock, wire.ZERO, small)
            bad = self._check(volume, offset, n)
            if bad:
                await self._error(sock, h.req_id, errno.EINVAL, bad)
                return
            await self.memory.zero(volume, offset, n)
            await send_all(sock, [wire.pack_header(Kind.OK, h.req_id, 0)])
        elif kind is Kind.INFO:
            if h.length:
                raise wire.WireError(f"INFO payload of {h.length} bytes")
            await send_all(sock, [wire.frame(Kind.OK, h.req_id, self._info)])
        else:
            raise wire.WireError(f"unexpected {kind.name} frame")

    def _check(self, volume: int, offset: int, length: int) -> str | None:
        try:
            self.memory.check_range(volume, offset, length)
        except ValueError as exc:
            return str(exc)
        return None

    @staticmethod
    async def _error(sock: socket.socket, req_id: int, err: int, message: str) -> None:
        await send_all(sock, [wire.frame(Kind.ERROR, req_id, wire.encode_error(err, message))])


async def _recv_struct(sock: socket.socket, st: struct.Struct, small: bytearray) -> tuple[Any, ...]:
    view = memoryview(small)[: st.size]
    await recv_exactly_into(sock, view)
    return st.unpack(view)


async def _discard(sock: socket.socket, n: int) -> None:
    """Read and drop *n* payload bytes, keeping the stream in step."""
    scratch = memoryview(bytearray(min(n, _DISCARD)))
    while n:
        k = min(n, len(scratch))
        await recv_exactly_into(sock, scratch[:k])
        n -= k


# -- the daemon -------------------------------------------------------------------------


def run(n_volumes: int, volume_size: int, host: str, port: int, secret: bytes) -> int:
    """``memfs memd``: serve in the foreground until SIGTERM/SIGINT; the exit status."""
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    total = n_volumes * volume_size
    avail = mem_available()
    if avail is not None and total > avail:
        raise UsageError(
            f"{n_volumes} volumes x {format_size(volume_size)} = {total >> 20} MiB exceeds "
            f"the memory available on this node ({avail >> 20} MiB)"
        )
    try:
        server = MemoryServer(n_volumes, volume_size, secret)
    except MemoryError as exc:
        raise UsageError(str(exc)) from None
    trio.run(_serve_until_signalled, server, host, port)
    return 0


async def _serve_until_signalled(server: MemoryServer, host: str, port: int) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        try:
            sock = await server.listen(host, port)
        except OSError as exc:
            raise UsageError(
                f"cannot listen on {format_addr(host, port)}: {exc.strerror or exc}"
            ) from None
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(server.serve_socket, sock)
            if not server.secret:
                log.warning(
                    "no --secret-file: memd runs unauthenticated; anyone who can reach %s "
                    "can read and write its memory", format_addr(host, bound),
                )
            vols = server.memory.volumes
            log.info(
                "serving %d volumes x %s on %s, incarnation %x",
                len(vols), format_size(vols[0].size), format_addr(host, bound), server.incarnation,
            )
            print(
                f"memd listening on {format_addr(host, bound)} ({len(vols)} "
                f"volume{'s' if len(vols) > 1 else ''} x {format_size(vols[0].size)})",
                flush=True,
            )
            sd_notify("READY=1")
            async for signum in signals:
                log.info("received %s, stopping", signal.Signals(signum).name)
                break
            sd_notify("STOPPING=1")
            nursery.cancel_scope.cancel()
    await server.aclose()
