"""The socket helpers under the tcp transport and the memory server.

:class:`RecvBuffer` receives ahead and hands out frames that may be split
anywhere by the network (across receives, across the end of its buffer);
:func:`send_now` sends what the socket takes without waiting and returns the
exact rest, which :func:`send_all` finishes.  The stream must come out byte
for byte whatever the cuts.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from memfs.transport.sockio import Linger, PeerClosed, RecvBuffer, send_all, send_now


async def fill(rx: RecvBuffer, n: int) -> None:
    """Until *n* bytes are buffered, as the tcp transport and memd's loop receive:
    ``receive_now``, and wait only when it says the socket has nothing."""
    while len(rx) < n:
        k = rx.receive_now(n)
        if k is None:
            await rx.wait_readable()
        elif k == 0:
            raise PeerClosed(f"connection closed after {len(rx)} of {n} bytes")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


async def test_frames_cut_anywhere(pair: tuple[socket.socket, socket.socket]) -> None:
    """Random message sizes sent in random pieces through a 100-byte buffer."""
    ours, peer = pair
    rng = random.Random(1)
    messages = [rng.randbytes(rng.randrange(1, 300)) for _ in range(200)]
    stream = b"".join(messages)
    rx = RecvBuffer(ours, 100)

    async def sender() -> None:
        pos = 0
        while pos < len(stream):
            k = rng.randrange(1, 150)
            peer.sendall(stream[pos : pos + k])
            pos += k
            if rng.random() < 0.3:
                await trio.sleep(0.001)
        peer.shutdown(socket.SHUT_WR)

    got = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        for m in messages:
            n = len(m)
            if n <= 100:  # small: whole in the buffer
                if rng.random() < 0.5:
                    await fill(rx, n)
                    got.append(bytes(rx.view(n)))
                    rx.consume(n)
                else:
                    await fill(rx, min(n, 8))
                    out = bytearray(n)
                    k = rx.take_into(memoryview(out))
                    if k < n:
                        await fill(rx, n - k)
                        rx.take_into(memoryview(out)[k:])
                    got.append(bytes(out))
            else:  # large: what is buffered, then straight into the destination
                await fill(rx, 1)
                out = bytearray(n)
                k = rx.take_into(memoryview(out))
                while k < n:
                    r = rx.receive_into_now(memoryview(out)[k:])
                    if r is None:
                        await rx.wait_readable()
                        continue
                    assert r > 0
                    k += r
                got.append(bytes(out))
        while (end := rx.receive_now(1)) is None:
            await rx.wait_readable()
        assert end == 0 and not len(rx)  # a clean end between messages
    assert got == messages


async def test_more_than_the_buffer_and_end_of_stream(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A payload larger than the buffer is taken in pieces (as memd's loop skips a
    refused WRITE's); the stream ending inside a message is PeerClosed."""
    ours, peer = pair
    rx = RecvBuffer(ours, 16)
    peer.sendall(b"a" * 40 + b"keep" + b"xy")
    left = 40
    while left:
        await fill(rx, 1)
        k = min(left, len(rx))
        assert bytes(rx.view(k)) == b"a" * k
        rx.consume(k)
        left -= k
    await fill(rx, 4)
    assert bytes(rx.view(4)) == b"keep"
    rx.consume(4)
    peer.shutdown(socket.SHUT_WR)
    with pytest.raises(PeerClosed, match="after 2 of 6 bytes"):
        await fill(rx, 6)  # the stream ends inside a message


async def test_short_receive_waits_before_the_next(pair: tuple[socket.socket, socket.socket]) -> None:
    """After a receive that did not fill the buffer, the next one waits for the
    socket instead of spending a syscall on EAGAIN; nothing is lost by that."""
    ours, peer = pair
    rx = RecvBuffer(ours, 64)
    assert rx.receive_now(1) is None  # nothing there yet
    peer.sendall(b"one")
    await rx.wait_readable()
    assert rx.receive_now(1) == 3
    peer.sendall(b"two")
    assert rx.receive_now(4) is None  # presumed empty: wait first
    await fill(rx, 6)
    assert bytes(rx.view(6)) == b"onetwo"


async def test_send_now_returns_the_exact_rest(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    rng = random.Random(2)
    parts = [rng.randbytes(n) for n in (12, 12, 1 << 20)]
    rest = send_now(ours, [parts[0], parts[1], memoryview(parts[2])])
    assert rest, "a socket buffer cannot take 1 MiB at once"
    assert send_now(ours, [b""]) == []
    received = bytearray()

    async def drain() -> None:
        while len(received) < sum(map(len, parts)):
            try:
                chunk = peer.recv(1 << 16)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(peer)
                continue
            received.extend(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain)
        await trio.testing.wait_all_tasks_blocked()
        await send_all(ours, rest)
    assert received == b"".join(parts)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


async def test_a_large_receive_waits_for_its_last_short_piece() -> None:
    """recv_exactly_into raises SO_RCVLOWAT for the bulk of a payload: the rest,
    shorter than that mark, must still wake it, and the mark is put back."""
    from memfs.transport.sockio import RCVLOWAT, recv_exactly_into

    ours, peer = _tcp_pair()
    with ours, peer:
        ours.setblocking(False)
        data = random.Random(2).randbytes(3 * RCVLOWAT + 1234)
        dest = bytearray(len(data))

        async def sender() -> None:
            for pos in range(0, len(data), 100_000):
                peer.sendall(data[pos : pos + 100_000])
                await trio.sleep(0.01)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                await recv_exactly_into(ours, memoryview(dest))
        assert dest == data
        assert ours.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


def test_a_blocking_bulk_receive_waits_for_its_last_short_piece() -> None:
    """The same for memfs.transport.bulk's blocking receive (a socket with a timeout)."""
    import threading
    import time

    from memfs.transport.bulk import recv_exactly
    from memfs.transport.sockio import RCVLOWAT

    ours, peer = _tcp_pair()
    with ours, peer:
        ours.settimeout(10)
        data = random.Random(3).randbytes(2 * RCVLOWAT + 77)
        dest = bytearray(len(data))

        def sender() -> None:
            for pos in range(0, len(data), 50_000):
                peer.sendall(data[pos : pos + 50_000])
                time.sleep(0.005)

        t = threading.Thread(target=sender)
        t.start()
        recv_exactly(ours, memoryview(dest))
        t.join()
        assert dest == data
        assert ours.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


async def test_linger_catches_what_comes_while_the_loop_is_idle(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A reply sent by another thread while the task polls: READY, the task never
    left; nothing comes: DONE after the time given."""
    import threading

    a, b = pair
    rx = RecvBuffer(a, 1024)
    rx.drained = True
    t = threading.Timer(0.002, b.send, (b"x",))
    t.start()
    try:
        assert rx.linger(1.0) is Linger.READY
    finally:
        t.join()
    assert not rx.drained and rx.receive_now(1) == 1
    start = trio.current_time()
    assert rx.linger(0.01) is Linger.DONE
    assert 0.01 <= trio.current_time() - start < 0.5


async def test_linger_leaves_the_loop_to_tasks_that_can_run(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """With a task runnable the loop's thread is not held (BUSY); once it parked, the
    poll goes on, until another task's I/O is ready (DONE, before its time)."""
    import threading

    a, b = pair
    rx = RecvBuffer(a, 1024)
    other_a, other_b = socket.socketpair()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.lowlevel.wait_readable, other_a)
            assert rx.linger(1.0) is Linger.BUSY  # (just started: runnable)
            await trio.testing.wait_all_tasks_blocked()
            t = threading.Timer(0.05, other_b.send, (b"y",))  # its I/O, not ours
            start = trio.current_time()
            t.start()
            try:
                assert rx.linger(1.0) is Linger.DONE
            finally:
                t.join()
            assert 0.04 <= trio.current_time() - start < 0.5
    finally:
        other_a.close()
        other_b.close()


def test_linger_never_polls_where_the_loop_cannot_be_read(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A trio whose internals differ: no poll (and no failure), now or later."""
    import memfs.transport.sockio as sockio

    caplog.expected_warnings = True  # type: ignore[attr-defined]  # said once

    class Odd:
        @property
        def runner(self) -> object:
            raise TypeError("not what it was")

    monkeypatch.setattr(sockio, "_unreadable", False)
    monkeypatch.setattr(trio._core._run, "GLOBAL_RUN_CONTEXT", Odd())
    rx = RecvBuffer(pair[0], 1024)
    start = time.monotonic()
    assert rx.linger(1.0) is Linger.DONE
    assert time.monotonic() - start < 0.5 and sockio._unreadable
    monkeypatch.undo()
    monkeypatch.setattr(sockio, "_unreadable", True)
    assert rx.linger(1.0) is Linger.DONE  # not again, whatever the loop
