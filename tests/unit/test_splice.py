"""memfs.transport.splice: a caller's memory sent by reference over real loopback TCP."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from memfs.transport import splice

pytestmark = pytest.mark.skipif(not splice.available(), reason="no vmsplice here")


@contextmanager
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname(), timeout=5)
        b, _ = listener.accept()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def receive(sock: socket.socket, n: int, out: bytearray) -> None:
    view = memoryview(out)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:n])
        if not k:
            break
        got += k


def test_sends_read_only_and_unaligned_buffers_whole() -> None:
    """More than a pipe's worth, from bytes (read-only) at an odd offset, then a
    writable buffer: the peer receives exactly those bytes, in order."""
    data = os.urandom(3 * splice.PIPE_SIZE + 12345)
    src = memoryview(data)[7:]
    more = bytearray(os.urandom(100_000))
    want = bytes(src) + bytes(more)
    out = bytearray(len(want))
    s = splice.SpliceSender()
    with tcp_pair() as (a, b):
        t = threading.Thread(target=receive, args=(b, len(want), out))
        t.start()
        s.send(a, src, 5.0)
        s.send(a, memoryview(more), 5.0)
        t.join(10)
    s.close()
    assert bytes(out) == want


def test_a_peer_that_does_not_read_costs_the_timeout() -> None:
    s = splice.SpliceSender()
    with tcp_pair() as (a, b):
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            s.send(a, memoryview(bytes(32 << 20)), 0.3)
        assert time.monotonic() - t0 < 5
    s.close()


def test_a_peer_that_closed_is_an_os_error() -> None:
    s = splice.SpliceSender()
    with tcp_pair() as (a, b):
        b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        b.close()  # reset: the next sends fail
        time.sleep(0.05)
        with pytest.raises(OSError):
            for _ in range(4):
                s.send(a, memoryview(bytes(splice.PIPE_SIZE)), 1.0)
    s.close()
