"""Exact-length socket I/O for the memory server and the tcp transport.

Volume data must go straight between a socket and its final place (volume
memory on the server, the caller's buffer on the client).  trio's
``SocketStream.receive_some`` returns fresh ``bytes`` (a copy), and trio socket
methods retry a ``recv_into`` on a buffer chosen *before* they wait, so a client
could not redirect a reply whose reader gave up.  These helpers therefore drive
non-blocking stdlib sockets directly: try the syscall, and only when it would
block, wait with ``trio.lowlevel.wait_readable``/``wait_writable``.

None of these functions sets a deadline; callers wrap them in
``trio.fail_after``/``move_on_at`` (a socket can be closed under a waiting task
only through :func:`close_socket`, which wakes it).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable

import trio
import trio.lowlevel

from memfs import wire
from memfs.net import close_socket, connect

__all__ = ["close_socket", "connect"]  # re-exported for the transport modules

Buf = bytes | bytearray | memoryview


class PeerClosed(ConnectionError):
    """The peer closed the connection in the middle of a message."""


async def recv_some_into(sock: socket.socket, view: memoryview) -> int:
    """Receive at least one byte into *view*; 0 means the peer closed cleanly."""
    while True:
        try:
            return sock.recv_into(view)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fill *view* completely; :class:`PeerClosed` if the stream ends first."""
    await recv_exactly_into_current(sock, len(view), lambda: view)


async def recv_exactly_into_current(
    sock: socket.socket, n: int, target: Callable[[], memoryview]
) -> None:
    """Receive *n* bytes into whatever buffer ``target()`` names at each step.

    For the client's reader: the caller that owns the destination may give up
    while the reply is still arriving and swap in a scratch buffer; the next
    chunk must then land there, never in memory the caller has taken back.
    ``target()`` is evaluated right before each ``recv_into``, with no await
    in between.
    """
    got = 0
    while got < n:
        try:
            k = sock.recv_into(target()[got:n])
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
            continue
        if k == 0:
            raise PeerClosed(f"connection closed after {got} of {n} bytes")
        got += k


async def send_all(sock: socket.socket, buffers: Iterable[Buf]) -> None:
    """Send all *buffers* in order with scatter/gather ``sendmsg`` (no joining copy)."""
    bufs = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    while bufs:
        try:
            sent = sock.sendmsg(bufs)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        while sent:
            first = bufs[0]
            if sent >= len(first):
                sent -= len(first)
                bufs.pop(0)
            else:
                bufs[0] = first[sent:]
                sent = 0


async def recv_frame(
    sock: socket.socket, max_payload: int
) -> tuple[wire.Header, bytearray]:
    """One whole frame with a small payload (handshake and control messages)."""
    head = bytearray(wire.HEADER_SIZE)
    await recv_exactly_into(sock, memoryview(head))
    h = wire.parse_header(head, max_payload)
    payload = bytearray(h.length)
    await recv_exactly_into(sock, memoryview(payload))
    return h, payload
