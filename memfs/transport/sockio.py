"""Exact-length socket I/O for the memory server and the tcp transport.

Volume data must go straight between a socket and its final place (volume
memory on the server, the caller's buffer on the client).  trio's
``SocketStream.receive_some`` returns fresh ``bytes`` (a copy), and trio socket
methods retry a ``recv_into`` on a buffer chosen *before* they wait, so a client
could not redirect a reply whose reader gave up.  These helpers therefore drive
non-blocking stdlib sockets directly: try the syscall, and only when it would
block, wait with ``trio.lowlevel.wait_readable``/``wait_writable``.

Small requests are dominated by per-call overhead, not by bytes, so two
helpers let the common case go without any wait at all: :func:`send_now` hands
a frame to the socket synchronously (only the rest of a frame the socket did
not take needs an awaited :func:`send_all`), and a :class:`RecvBuffer`
receives ahead, so that one ``recv`` usually brings a whole small frame (or
several pipelined ones).  Its buffer is small: the bulk of a large payload is
still received straight into its destination.

None of these functions sets a deadline; callers wrap them in
``trio.fail_after``/``move_on_at`` (a socket can be closed under a waiting task
only through :func:`close_socket`, which wakes it).
"""

from __future__ import annotations

import enum
import logging
import select
import socket
import time
from collections.abc import Iterable, Sequence
from typing import Any

import trio
import trio.lowlevel

from memfs import wire
from memfs.net import close_socket, connect

log = logging.getLogger(__name__)

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


#: a large receive waits for this much to have arrived (or the rest), not for any byte
RCVLOWAT = 256 << 10
#: receives of less than this wait for any byte (two setsockopt calls cost more there)
RCVLOWAT_FROM = 64 << 10


def set_rcvlowat(sock: socket.socket, have: int, n: int, got: int) -> int:
    """Make *sock*'s ``SO_RCVLOWAT`` what a receive of *n* bytes with *got* in needs
    (min(rest, :data:`RCVLOWAT`) past :data:`RCVLOWAT_FROM`, else 1), *have* being
    what it is now; returns the new mark.  Put it back with ``have=mark, n=0``."""
    want = min(n - got, RCVLOWAT) if n >= RCVLOWAT_FROM else 1
    if want != have:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
    return want


async def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fill *view* completely; :class:`PeerClosed` if the stream ends first.

    Past :data:`RCVLOWAT_FROM` the socket is readable only once min(rest,
    :data:`RCVLOWAT`) has arrived (``SO_RCVLOWAT``): a bulk payload then wakes us
    every few hundred KiB rather than for every segment.
    """
    got, n = 0, len(view)
    lowat = 1
    try:
        while got < n:
            try:
                k = sock.recv_into(view[got:])
            except BlockingIOError:
                lowat = set_rcvlowat(sock, lowat, n, got)
                await trio.lowlevel.wait_readable(sock)
                continue
            if k == 0:
                raise PeerClosed(f"connection closed after {got} of {n} bytes")
            got += k
    finally:
        set_rcvlowat(sock, lowat, 0, 0)


def send_now(sock: socket.socket, buffers: Sequence[Buf]) -> list[memoryview]:
    """Send as much of *buffers* as the socket takes without waiting; the unsent rest.

    One scatter/gather ``sendmsg`` (no joining copy) of buffers of bytes
    (memoryviews of format ``B``); an empty list means all was sent.  Whoever
    gets a non-empty rest owns the stream until it has sent it
    (:func:`send_all`): the peer has part of a frame.
    """
    try:
        sent = sock.sendmsg(buffers)
    except BlockingIOError:
        sent = 0
    if sent == sum(map(len, buffers)):
        return []
    rest = []
    for b in buffers:
        if sent >= len(b):
            sent -= len(b)
        else:
            rest.append(memoryview(b)[sent:])
            sent = 0
    return rest


async def send_all(sock: socket.socket, buffers: Iterable[Buf]) -> None:
    """Send all *buffers* in order with scatter/gather ``sendmsg`` (no joining copy)."""
    bufs: list[Buf] = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    while bufs:
        rest = send_now(sock, bufs)
        if not rest:
            return
        await trio.lowlevel.wait_writable(sock)
        bufs = list(rest)


class Linger(enum.Enum):
    """How :meth:`RecvBuffer.linger` ended."""

    READY = "the socket became readable"
    BUSY = "the event loop has something to do now"
    DONE = "nothing came in time, or another task's I/O did"


#: the loop could not be read once (a trio whose internals differ): never poll again
_unreadable = False


def _idle_loop() -> tuple[float, int] | None:
    """Seconds trio's loop has nothing to do (no runnable task, no callback queued,
    until its next timer; 0 if it has something now) and its epoll descriptor
    (readable once any other task's I/O is ready); None where that cannot be
    known (not trio's epoll backend, or a trio whose internals differ: then never
    again).  Read from the runner directly: ``trio.lowlevel.current_statistics()``
    costs ~5 us, a tenth of a small read's round trip (as in memfs's pyfuse3
    patch 0002).  Tasks woken in the loop's current pass are not in its run queue
    any more, so they are not seen: the caller lets them run first."""
    global _unreadable
    if _unreadable:
        return None
    try:
        runner = trio._core._run.GLOBAL_RUN_CONTEXT.runner
        epfd = runner.io_manager._epoll.fileno()
        queue = runner.entry_queue
        if runner.runq or queue.queue or queue.idempotent_queue:
            return 0.0, epfd
        return max(0.0, runner.deadlines.next_deadline() - runner.clock.current_time()), epfd
    except AttributeError:  # not in a trio run, or not the epoll backend
        return None
    except Exception:
        _unreadable = True
        log.warning("trio's event loop cannot be read here: small reads will not poll",
                    exc_info=True)
        return None


class RecvBuffer:
    """Bytes received ahead from a non-blocking socket, consumed frame by frame.

    A ``recv`` asks for as much as fits, so a small frame (header, struct and
    data) or several pipelined ones usually arrive in one syscall.  A receive
    that did not fill the buffer means the socket is (very likely) empty: the
    next one waits for readability first instead of spending a syscall on
    ``EAGAIN``.  Payloads larger than what is buffered are taken with
    :meth:`take_into` and the rest received straight into their destination.
    """

    __slots__ = ("sock", "start", "end", "drained", "_buf", "_mv", "_poller", "_polled")

    def __init__(self, sock: socket.socket, capacity: int) -> None:
        self.sock = sock
        self._buf = bytearray(capacity)
        self._mv = memoryview(self._buf)
        self.start = 0  # buffered bytes are _buf[start:end]
        self.end = 0
        #: the socket is presumed empty: the next receive waits for it first.  Only
        #: for a receiver that can wait: one that cannot clears it to try anyway.
        self.drained = False
        self._poller: Any = None  # (select.poll of the socket and trio's epoll fd)
        self._polled = (-1, -1)  # the descriptors registered there

    def __len__(self) -> int:
        return self.end - self.start

    def view(self, n: int) -> memoryview:
        """The next *n* buffered bytes, not consumed (valid until the next receive)."""
        assert n <= self.end - self.start
        return self._mv[self.start : self.start + n]

    def consume(self, n: int) -> None:
        assert n <= self.end - self.start
        self.start += n
        if self.start == self.end:
            self.start = self.end = 0

    def take_into(self, dest: memoryview) -> int:
        """Move up to ``len(dest)`` buffered bytes into *dest*; how many."""
        k = min(len(dest), self.end - self.start)
        if k:
            dest[:k] = self._mv[self.start : self.start + k]
            self.consume(k)
        return k

    def linger(self, seconds: float) -> Linger:
        """Poll the socket for up to *seconds* without leaving the task, if trio's loop
        has nothing else to do meanwhile; stop as soon as another task's I/O is
        ready.

        For a reply due within tens of microseconds (a small READ's): waiting in
        the loop parks the task and sleeps in ``epoll_wait``, and on a virtual
        machine the wake-up of an idle CPU costs more than that round trip
        (docs/ARCHITECTURE.md, "Memory servers").  The loop's thread is held
        meanwhile, so only while nothing is runnable (else :attr:`Linger.BUSY`:
        the caller may let the others run first and try once more).
        """
        loop = _idle_loop()
        if loop is None:
            return Linger.DONE
        idle, epfd = loop
        if idle <= 0:
            return Linger.BUSY
        fd = self.sock.fileno()
        if fd < 0:  # closed under us: the wait says so
            return Linger.DONE
        if self._polled != (fd, epfd):
            self._poller = select.poll()
            self._poller.register(fd, select.POLLIN)
            self._poller.register(epfd, select.POLLIN)
            self._polled = (fd, epfd)
        poll = self._poller.poll
        end = time.perf_counter() + min(seconds, idle)
        while True:
            ready = poll(0)
            if ready:
                if any(got == fd for got, _ in ready):
                    self.drained = False
                    return Linger.READY
                return Linger.DONE
            if time.perf_counter() >= end:
                return Linger.DONE

    async def wait_readable(self) -> None:
        """Wait until the socket has something to receive (or its end)."""
        await trio.lowlevel.wait_readable(self.sock)
        self.drained = False

    def receive_now(self, n: int) -> int | None:
        """One receive toward *n* buffered bytes, without waiting: how many bytes
        came, 0 at the end of the stream, None if the socket has nothing now."""
        if self.drained:
            return None
        if len(self._buf) - self.start < n:  # make room: move the partial frame to the front
            size = self.end - self.start
            self._mv[:size] = self._mv[self.start : self.end]
            self.start, self.end = 0, size
        try:
            k = self.sock.recv_into(self._mv[self.end :])
        except BlockingIOError:
            self.drained = True
            return None
        self.end += k
        self.drained = 0 < k and self.end < len(self._buf)
        return k

    def receive_into_now(self, view: memoryview) -> int | None:
        """Receive past the (empty) buffer straight into *view*, without waiting:
        as :meth:`receive_now`.

        For the bulk of a large payload, which keeps arriving while we copy: a
        short receive is no sign of an empty socket here, only ``EAGAIN`` is.
        """
        assert self.end == self.start
        if self.drained:
            return None
        try:
            return self.sock.recv_into(view)
        except BlockingIOError:
            self.drained = True
            return None


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
