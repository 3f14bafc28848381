"""How an in-process memory server takes its request stream apart.

It receives ahead into a small buffer and serves a request that arrived whole
without any wait or timer, so what matters here is the rest: frames cut
anywhere by the network (a header across two receives, a frame across the end
of the buffer), a large WRITE whose bulk still goes straight into the volume,
and the frame deadline, which applies only to a frame that is still arriving or
a reply the client does not take, never to an idle connection.
"""

from __future__ import annotations

import errno
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from memfs import wire
from memfs.transport.memd import MemoryServer
from memfs.transport.sockio import RecvBuffer
from memfs.wire import Kind

SECRET = b"memd-frames-test-secret"
SIZE = 8 << 20


@asynccontextmanager
async def serving(**kwargs: float) -> AsyncIterator[tuple[MemoryServer, int]]:
    server = MemoryServer(2, SIZE, SECRET, **kwargs)  # type: ignore[arg-type]
    try:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            yield server, port
            nursery.cancel_scope.cancel()
    finally:
        await server.aclose()


class Client:
    """An authenticated raw connection: exactly the bytes a test wants, no transport."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    @classmethod
    async def connect(cls, port: int) -> Client:
        c = cls(await trio.open_tcp_stream("127.0.0.1", port))
        h, hello = await c.frame()
        hs = wire.Handshake(SECRET)
        await c.stream.send_all(wire.frame(Kind.AUTH, 0, hs.auth(hello, "tcp")))
        h, welcome = await c.frame()
        hs.check_welcome(welcome)
        return c

    async def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = await self.stream.receive_some()
            if not chunk:
                raise EOFError(f"closed after {len(self.buf)} of {n} bytes")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def frame(self) -> tuple[wire.Header, bytes]:
        h = wire.parse_header(await self.exactly(wire.HEADER_SIZE))
        return h, await self.exactly(h.length)

    async def wait_closed(self) -> None:
        """Until the server closes the connection (reading and dropping what it sent)."""
        try:
            while await self.stream.receive_some():
                pass
        except trio.BrokenResourceError:
            pass


async def test_frames_cut_anywhere() -> None:
    """A pipelined mix of requests, dribbled in random pieces: replies in order,
    memory as written (a refused WRITE's payload skipped, the stream in step);
    a WRITE_QUIET is answered only when refused, a SYNC when its turn comes."""
    rng = random.Random(7)
    async with serving() as (server, port):
        c = await Client.connect(port)
        frames, expect = [], []
        shadow = bytearray(1 << 20)
        for i in range(300):
            op = rng.choice(["write", "write", "read", "bad", "zero", "info",
                             "quiet", "quiet", "quietbad", "sync"])
            n = rng.choice([1, 100, 4096, 16384, 70000, 200_000])
            off = rng.randrange(0, len(shadow) - n)
            if op == "write":
                data = rng.randbytes(n)
                shadow[off : off + n] = data
                frames.append(wire.frame(Kind.WRITE, i, wire.WRITE.pack(1, off) + data))
                expect.append((i, Kind.OK, b""))
            elif op == "read":
                frames.append(wire.frame(Kind.READ, i, wire.READ.pack(1, off, n)))
                expect.append((i, Kind.OK, bytes(shadow[off : off + n])))
            elif op == "bad":  # outside the volume: EINVAL, its data dropped
                frames.append(wire.frame(Kind.WRITE, i, wire.WRITE.pack(1, SIZE)
                                         + rng.randbytes(n)))
                expect.append((i, Kind.ERROR, b""))
            elif op == "quiet":  # applied like a WRITE, not answered
                data = rng.randbytes(n)
                shadow[off : off + n] = data
                frames.append(wire.frame(Kind.WRITE_QUIET, i, wire.WRITE.pack(1, off) + data))
            elif op == "quietbad":  # refused: answered, as a WRITE would be
                frames.append(wire.frame(Kind.WRITE_QUIET, i, wire.WRITE.pack(1, SIZE - n + 1)
                                         + rng.randbytes(n)))
                expect.append((i, Kind.ERROR, b""))
            elif op == "sync":
                frames.append(wire.frame(Kind.SYNC, i))
                expect.append((i, Kind.OK, b""))
            elif op == "zero":
                shadow[off : off + n] = bytes(n)
                frames.append(wire.frame(Kind.ZERO, i, wire.ZERO.pack(1, off, n)))
                expect.append((i, Kind.OK, b""))
            else:
                frames.append(wire.frame(Kind.INFO, i))
                expect.append((i, Kind.OK, server._info))
        frames.append(wire.frame(Kind.SYNC, 300))  # the last quiet writes are in after it
        expect.append((300, Kind.OK, b""))
        stream = b"".join(frames)

        async def sender() -> None:
            pos = 0
            while pos < len(stream):
                k = rng.choice([1, 5, 13, 100, 3000, 70000])
                await c.stream.send_all(stream[pos : pos + k])
                pos += k
                if rng.random() < 0.05:
                    await trio.sleep(0.001)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                for i, kind, payload in expect:
                    h, got = await c.frame()
                    assert (h.kind, h.req_id) == (kind, i)
                    if kind is Kind.ERROR:
                        assert wire.decode_error(got)[0] == errno.EINVAL
                    else:
                        assert got == payload, i
        assert bytes(server.memory.volume_memory(1)[: len(shadow)]) == bytes(shadow)
        await c.stream.aclose()


async def test_quiet_writes_are_offered_and_sync_is_checked(caplog: pytest.LogCaptureFixture) -> None:
    """INFO says the server takes WRITE_QUIET and SYNC (clients use them only then);
    a SYNC with a payload is malformed and closes that connection."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with serving() as (_, port):
        c = await Client.connect(port)
        await c.stream.send_all(wire.frame(Kind.INFO, 5))
        h, info = await c.frame()
        assert h.req_id == 5 and "quiet-writes" in wire.decode(info)["features"]
        await c.stream.send_all(wire.frame(Kind.SYNC, 6, b"x"))
        with trio.fail_after(5):
            await c.wait_closed()
        await c.stream.aclose()
    assert "SYNC payload of 1 bytes" in caplog.text


async def test_large_write_goes_straight_into_the_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what the receive buffer caught of a large WRITE is copied from it."""
    copied: list[int] = []
    take_into = RecvBuffer.take_into

    def spy(self: RecvBuffer, dest: memoryview) -> int:
        k = take_into(self, dest)
        copied.append(k)
        return k

    monkeypatch.setattr(RecvBuffer, "take_into", spy)
    data = random.Random(8).randbytes(4 << 20)
    async with serving() as (server, port):
        c = await Client.connect(port)
        await c.stream.send_all(wire.frame(Kind.WRITE, 1, wire.WRITE.pack(0, 0) + data))
        h, _ = await c.frame()
        assert h.kind is Kind.OK
        assert bytes(server.memory.volume_memory(0)[: len(data)]) == data
        assert sum(copied) <= 128 << 10, copied
        await c.stream.aclose()


async def test_frame_deadline(caplog: pytest.LogCaptureFixture) -> None:
    """Idle: forever.  Half a frame, or replies left unread: the connection is
    closed after frame_timeout, and others are served meanwhile."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with serving(frame_timeout=0.3) as (_, port):
        idle, half, greedy, good = [await Client.connect(port) for _ in range(4)]
        await half.stream.send_all(wire.pack_header(Kind.WRITE, 1, 1000) + b"\0" * 20)
        reads = b"".join(wire.frame(Kind.READ, i, wire.READ.pack(0, 0, 4 << 20))
                         for i in range(16))
        await greedy.stream.send_all(reads)  # and never read a reply: more than buffers hold
        start = trio.current_time()
        with trio.fail_after(10):
            for _ in range(20):  # meanwhile
                await good.stream.send_all(wire.frame(Kind.READ, 7, wire.READ.pack(1, 0, 10)))
                h, _ = await good.frame()
                assert h.kind is Kind.OK
            # Past greedy's deadline before reading from it: once read, its replies
            # would be taken (and the next ones given a deadline of their own).
            await trio.sleep_until(start + 1.0)
            await half.wait_closed()
            await greedy.wait_closed()
        assert trio.current_time() - start > 0.25  # not before the deadline
        await idle.stream.send_all(wire.frame(Kind.INFO, 2))
        h, _ = await idle.frame()
        assert h.kind is Kind.OK
        text = caplog.text
        assert "a frame was not completed within 0.3s" in text
        assert "a reply was not taken within 0.3s" in text
        for c in (idle, half, greedy, good):
            await c.stream.aclose()


async def test_stopping_ends_every_connection() -> None:
    """Stopping the server ends every connection wherever it waits (between
    frames, in the middle of a frame, in a reply its client does not read), and
    serve returns."""
    server = MemoryServer(2, SIZE, SECRET)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(server.serve, "127.0.0.1", 0)
                idle, half, greedy = [await Client.connect(port) for _ in range(3)]
                await half.stream.send_all(wire.pack_header(Kind.WRITE, 1, 1000) + b"\0" * 20)
                await greedy.stream.send_all(b"".join(
                    wire.frame(Kind.READ, i, wire.READ.pack(0, 0, 4 << 20)) for i in range(16)))
                await trio.sleep(0.3)  # each connection in its wait
                assert server.connections == 3
                nursery.cancel_scope.cancel()
            assert server.connections == 0
            for c in (idle, half, greedy):
                await c.wait_closed()
                await c.stream.aclose()
    finally:
        await server.aclose()


async def test_a_server_serves_again_after_a_stop() -> None:
    """Its data loop runs once; serving again gets a new one (same volumes)."""
    server = MemoryServer(2, SIZE, SECRET)
    try:
        for round_ in range(2):
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    port = await nursery.start(server.serve, "127.0.0.1", 0)
                    c = await Client.connect(port)
                    await c.stream.send_all(wire.frame(Kind.WRITE, 1, wire.WRITE.pack(0, round_)
                                                       + b"r"))
                    await c.stream.send_all(wire.frame(Kind.READ, 2, wire.READ.pack(0, 0, 2)))
                    assert (await c.frame())[0].kind is Kind.OK
                    h, data = await c.frame()
                    assert h.req_id == 2 and data == b"r" * (round_ + 1) + b"\0" * (1 - round_)
                    nursery.cancel_scope.cancel()
                await c.stream.aclose()
    finally:
        await server.aclose()


async def test_fence_shuts_out_a_lease_token(caplog: pytest.LogCaptureFixture) -> None:
    """FENCE closes every connection that named the token (also ones in the middle of
    sending a WRITE or a WRITE_QUIET), refuses the token from then on, and leaves
    others alone: no byte of a fenced connection reaches volume memory after the
    answer."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    t, u = 0x1234, 0x5678
    async with serving() as (server, port):
        named_t = [await Client.connect(port) for _ in range(2)]
        named_u, unnamed, fencer = [await Client.connect(port) for _ in range(3)]
        for c, token in ((named_t[0], t), (named_t[1], t), (named_u, u)):
            await c.stream.send_all(wire.frame(Kind.SESSION, 1, wire.TOKEN.pack(token)))
            h, _ = await c.frame()
            assert h.kind is Kind.OK
        # Large WRITEs begun (header and some data sent), the rest to follow.
        data = b"\xee" * (1 << 20)
        frames = [wire.frame(kind, 2, wire.WRITE.pack(0, 0) + data)
                  for kind in (Kind.WRITE, Kind.WRITE_QUIET)]
        for c, frame in zip(named_t, frames, strict=True):
            await c.stream.send_all(frame[: 200 << 10])
        await trio.sleep(0.1)
        await fencer.stream.send_all(wire.frame(Kind.FENCE, 3, wire.TOKEN.pack(t)))
        h, _ = await fencer.frame()
        assert h.kind is Kind.OK
        before = bytes(server.memory.volume_memory(0)[: len(data)])
        with trio.fail_after(5):
            for c, frame in zip(named_t, frames, strict=True):
                with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError, OSError)):
                    await c.stream.send_all(frame[200 << 10 :] + frame)  # the rest, then more
                    await c.stream.send_all(frame)
                    await c.stream.send_all(frame)
                await c.wait_closed()
        await trio.sleep(0.1)
        assert bytes(server.memory.volume_memory(0)[: len(data)]) == before
        assert not any(before[200 << 10 :])  # what came after the fence never landed
        # The token is refused from now on; others are served as before.
        again = await Client.connect(port)
        await again.stream.send_all(wire.frame(Kind.SESSION, 4, wire.TOKEN.pack(t)))
        h, payload = await again.frame()
        assert h.kind is Kind.ERROR and wire.decode_error(payload)[0] == errno.ESTALE
        await again.wait_closed()
        for c in (named_u, unnamed):
            await c.stream.send_all(wire.frame(Kind.WRITE, 5, wire.WRITE.pack(1, 0) + b"ok"))
            h, _ = await c.frame()
            assert h.kind is Kind.OK
        assert server.fenced == {t: None}
        for c in (*named_t, again, named_u, unnamed, fencer):
            await c.stream.aclose()
        assert "closing connection from 127.0.0.1" in caplog.text
