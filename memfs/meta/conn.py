"""Frames over a non-blocking TCP socket, for the metadata server and its client.

Metadata messages are small and many, and each trio checkpoint costs several
microseconds, so this drives a stdlib socket directly: reads are buffered (one
``recv`` usually brings several pipelined frames) and sends are first tried
synchronously (:meth:`FrameSocket.send_now`), which also lets a caller queue a
request atomically with its own bookkeeping.  Only a send that would block
goes through a writer task (:meth:`FrameSocket.flush`).

Nothing here sets a deadline: callers wrap waits in ``trio.fail_after``.  A
wait cut short by a deadline may leave a frame half sent or half read, so
whoever cancels one must close the socket.
"""

from __future__ import annotations

import collections
import socket

import trio
import trio.lowlevel

from memfs import wire
from memfs.net import close_socket

_READ_SIZE = 1 << 16
#: the role metadata clients name in the handshake (memory servers refuse it, and we theirs)
ROLE = "meta"
#: largest reply a client accepts (a directory listing of millions of entries)
MAX_REPLY = 256 << 20


class FrameSocket:
    """Buffered frame reads and ordered frame writes on one connected socket."""

    def __init__(self, sock: socket.socket, max_payload: int = wire.MAX_PAYLOAD) -> None:
        self.sock = sock
        self.max_payload = max_payload
        self._buf = bytearray()
        self._pos = 0
        self._out: collections.deque[memoryview] = collections.deque()

    # -- receiving -------------------------------------------------------------------------

    def buffered(self) -> bool:
        """True if bytes are already here (the next receive may need no syscall)."""
        return len(self._buf) > self._pos

    async def receive(self) -> tuple[wire.Header, bytes] | None:
        """The next frame, or None if the peer closed the connection between frames.

        :class:`memfs.wire.WireError` for a bad header or a connection closed
        inside a frame.  Does not checkpoint when a whole frame is already buffered.
        """
        while True:
            buf, pos = self._buf, self._pos
            avail = len(buf) - pos
            want = wire.HEADER_SIZE
            if avail >= wire.HEADER_SIZE:
                h = wire.parse_header(bytes(buf[pos : pos + wire.HEADER_SIZE]), self.max_payload)
                want += h.length
                if avail >= want:
                    payload = bytes(buf[pos + wire.HEADER_SIZE : pos + want])
                    self._pos = pos + want
                    if self._pos == len(buf):
                        buf.clear()
                        self._pos = 0
                    return h, payload
            if pos:
                del buf[:pos]
                self._pos = 0
            try:
                data = self.sock.recv(max(_READ_SIZE, want - avail))
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
            if not data:
                if buf:
                    raise wire.WireError(f"connection closed inside a frame ({len(buf)} bytes)")
                return None
            buf += data

    # -- sending ---------------------------------------------------------------------------

    def pending(self) -> bool:
        """True while earlier frames still wait for :meth:`flush`."""
        return bool(self._out)

    def send_now(self, data: bytes) -> None:
        """Queue *data* after anything queued, sending what the socket takes right away.

        Never blocks; what does not fit waits for :meth:`flush` (see :meth:`pending`).
        """
        if not self._out:
            try:
                n = self.sock.send(data)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
            if n == len(data):
                return
            data = data[n:]
        self._out.append(memoryview(data))

    async def flush(self) -> None:
        """Send everything queued (waits until the socket takes it)."""
        while self._out:
            try:
                n = self.sock.send(self._out[0])
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
            if n == len(self._out[0]):
                self._out.popleft()
            else:
                self._out[0] = self._out[0][n:]

    async def send(self, data: bytes) -> None:
        """Send *data* now (after anything queued): handshakes and direct exchanges."""
        self.send_now(data)
        await self.flush()

    def close(self) -> None:
        close_socket(self.sock)
