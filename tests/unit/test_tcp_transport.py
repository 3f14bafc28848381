"""The tcp transport's own promises, in-process, beyond the shared conformance suite.

Some guarantees need a server that misbehaves on cue, so here the test plays the
memory server itself: a caller that gives up (cancelled) must never find bytes
landing in its buffer afterwards, however the reply is cut; replies may come in
any order; a server that never answers costs ``io_timeout``, not forever.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from memfs import wire
from memfs.config import VolumeAddr
from memfs.errors import TransportError, UsageError
from memfs.transport import Posted, tcp
from memfs.transport.memd import MemoryServer
from memfs.transport.tcp import MAX_IO, TcpTransport, open_tcp_transport
from memfs.wire import Kind

SECRET = b"tcp-transport-test-secret"
SIZE = 1 << 20


async def recv_exactly(stream: trio.SocketStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


async def recv_frame(stream: trio.SocketStream) -> tuple[wire.Header, bytes]:
    h = wire.parse_header(await recv_exactly(stream, wire.HEADER_SIZE))
    return h, await recv_exactly(stream, h.length)


Script = Callable[[trio.SocketStream], Awaitable[None]]


@asynccontextmanager
async def fake_memd(
    script: Script, incarnation: int = 42, features: list[str] | None = None
) -> AsyncIterator[VolumeAddr]:
    """A one-volume memory server on 127.0.0.1 that authenticates each connection,
    answers INFO (offering *features*), then hands the connection to *script*."""

    async def handler(stream: trio.SocketStream) -> None:
        hs = wire.Handshake(SECRET)
        await stream.send_all(wire.frame(Kind.HELLO, 0, hs.hello()))
        _, auth = await recv_frame(stream)
        hs.check_auth(auth)
        await stream.send_all(wire.frame(Kind.WELCOME, 0, hs.welcome()))
        h, _ = await recv_frame(stream)
        assert h.kind is Kind.INFO
        offer = {"incarnation": incarnation, "volumes": [SIZE]}
        if features is not None:
            offer["features"] = features
        info = wire.encode(offer)
        await stream.send_all(wire.frame(Kind.OK, h.req_id, info))
        try:
            await script(stream)
        except (EOFError, trio.BrokenResourceError):
            pass
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield VolumeAddr("tcp", "127.0.0.1", port, 0)
        nursery.cancel_scope.cancel()


async def test_cancelled_read_never_writes_the_callers_buffer() -> None:
    half_sent = trio.Event()
    go_on = trio.Event()

    async def script(stream: trio.SocketStream) -> None:
        h, _ = await recv_frame(stream)  # the READ
        assert h.kind is Kind.READ
        await stream.send_all(wire.pack_header(Kind.OK, h.req_id, 1000) + b"\1" * 300)
        half_sent.set()
        await go_on.wait()
        await stream.send_all(b"\2" * 700)
        h, _ = await recv_frame(stream)  # a WRITE after it
        await stream.send_all(wire.frame(Kind.OK, h.req_id))
        await recv_frame(stream)

    async with fake_memd(script) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1, io_timeout=5
    ) as t:
        buf = t.register(1000)
        buf[:] = b"\xaa" * 1000

        async def reader(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                await t.readinto(0, 0, buf)

        async with trio.open_nursery() as nursery:
            scope = await nursery.start(reader)
            await half_sent.wait()
            await trio.testing.wait_all_tasks_blocked()  # the first 300 bytes are in
            scope.cancel()
        go_on.set()
        await t.write(0, 0, b"x")  # its reply comes after the rest of the READ's
        assert bytes(buf[300:]) == b"\xaa" * 700, "bytes arrived after the caller gave up"


async def test_replies_matched_by_id_in_any_order() -> None:
    async def script(stream: trio.SocketStream) -> None:
        reqs = [await recv_frame(stream) for _ in range(3)]
        for h, payload in reversed(reqs):
            _, offset, n = wire.unpack_exact(wire.READ, payload)
            await stream.send_all(wire.frame(Kind.OK, h.req_id, bytes([offset]) * n))
        await recv_frame(stream)

    async with fake_memd(script) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1, io_timeout=5
    ) as t:
        got: dict[int, bytes] = {}

        async def read(offset: int) -> None:
            got[offset] = bytes(await t.read(0, offset, 10 + offset))

        async with trio.open_nursery() as nursery:
            for offset in (1, 2, 3):
                nursery.start_soon(read, offset)
        assert got == {o: bytes([o]) * (10 + o) for o in (1, 2, 3)}


async def test_protocol_errors_fail_requests_not_the_client(caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    connections = 0

    async def script(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        h, _ = await recv_frame(stream)
        if connections == 1:  # a reply to a request never made
            await stream.send_all(wire.frame(Kind.OK, h.req_id + 1000))
        elif connections == 2:  # an errno from the server
            await stream.send_all(wire.frame(Kind.ERROR, h.req_id,
                                             wire.encode_error(errno.EINVAL, "nope")))
            await recv_frame(stream)
        await trio.sleep_forever()

    async with fake_memd(script) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1, io_timeout=5
    ) as t:
        with trio.fail_after(5), pytest.raises(TransportError, match="unknown request"):
            await t.read(0, 0, 10)
        with trio.fail_after(5), pytest.raises(TransportError, match="nope"):
            await t.write(0, 0, b"y")  # reconnected lazily


async def test_hung_server_costs_io_timeout(caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]

    async def script(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()  # reads nothing, answers nothing

    async with fake_memd(script) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1, io_timeout=0.3
    ) as t:
        for _ in range(2):
            start = trio.current_time()
            with pytest.raises(TransportError, match="did not answer within 0.3s"):
                await t.read(0, 0, 10)
            assert 0.25 < trio.current_time() - start < 2.0

    # a server that accepts connections but never says HELLO
    with trio.socket.socket() as listener:
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        vol = VolumeAddr("tcp", "127.0.0.1", listener.getsockname()[1], 0)
        with trio.fail_after(3), pytest.raises(TransportError, match="did not answer"):
            async with open_tcp_transport([vol], SECRET, io_timeout=0.3):
                pass


@asynccontextmanager
async def memory_server(n_volumes: int, size: int) -> AsyncIterator[int]:
    server = MemoryServer(n_volumes, size, SECRET)
    try:
        async with trio.open_nursery() as nursery:
            yield await nursery.start(server.serve, "127.0.0.1", 0)
            nursery.cancel_scope.cancel()
    finally:
        await server.aclose()


async def test_bad_pools() -> None:
    async with memory_server(2, SIZE) as port:
        with pytest.raises(UsageError, match="has 2 volumes"):
            async with open_tcp_transport([VolumeAddr("tcp", "127.0.0.1", port, 2)], SECRET):
                pass
        with pytest.raises(UsageError, match="tcp:// volumes only"):
            async with open_tcp_transport([VolumeAddr("verbs", "127.0.0.1", port, 0)], SECRET):
                pass
        with pytest.raises(UsageError, match="at least one volume"):
            async with open_tcp_transport([], SECRET):
                pass


async def test_a_pool_of_known_size_opens_without_a_server_that_does_not_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With the pool's volume size (a mount's, from the mds) the transport opens
    though a server cannot be reached: its volume fails with EIO, the others work,
    and once it answers it is used (if its volumes are the pool's)."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with memory_server(1, SIZE) as up:
        with trio.socket.socket() as s:  # a port with nothing behind it, for now
            await s.bind(("127.0.0.1", 0))
            down = s.getsockname()[1]
        vols = [VolumeAddr("tcp", "127.0.0.1", up, 0), VolumeAddr("tcp", "127.0.0.1", down, 0)]
        with pytest.raises(TransportError, match="cannot connect"):
            async with open_tcp_transport(vols, SECRET, io_timeout=5):  # size unknown
                pass
        async with open_tcp_transport(vols, SECRET, io_timeout=5, volume_size=SIZE) as t:
            assert [v.size for v in t.volumes] == [SIZE, SIZE]
            await t.write(0, 0, b"up")
            with pytest.raises(TransportError, match="cannot connect"):
                await t.write(1, 0, b"down")
            server = MemoryServer(1, SIZE, SECRET)
            async with trio.open_nursery() as nursery:
                await nursery.start(server.serve, "127.0.0.1", down)
                await t.write(1, 0, b"back")
                assert bytes(await t.read(1, 0, 4)) == b"back"
                nursery.cancel_scope.cancel()
            await server.aclose()
        assert "going on without it" in caplog.text
        with pytest.raises(TransportError, match="cannot connect"):  # none answers: no pool
            async with open_tcp_transport(vols[1:], SECRET, io_timeout=5, volume_size=SIZE):
                pass
        with pytest.raises(TransportError, match="wrong secret"):  # one refuses us: no pool
            async with open_tcp_transport(vols, b"not the secret", io_timeout=5,
                                          volume_size=SIZE):
                pass
        for size, fits in ((SIZE // 2, False), (2 * SIZE, True)):  # smaller: not the pool's
            async with open_tcp_transport(vols, SECRET, io_timeout=5, volume_size=SIZE) as t:
                server = MemoryServer(1, size, SECRET)
                async with trio.open_nursery() as nursery:
                    await nursery.start(server.serve, "127.0.0.1", down)
                    if fits:
                        await t.write(1, 0, b"more")
                    else:
                        with pytest.raises(TransportError, match="not the pool's"):
                            await t.read(1, 0, 4)
                    nursery.cancel_scope.cancel()
                await server.aclose()


async def test_requests_larger_than_a_frame() -> None:
    size = MAX_IO * 2 + 4096
    async with memory_server(1, size) as port, open_tcp_transport(
        [VolumeAddr("tcp", "127.0.0.1", port, 0)], SECRET, connections_per_server=3
    ) as t:
        data = bytes(range(256)) * (size // 256)
        await t.write(0, 0, data)
        buf = t.register(size)
        await t.readinto(0, 0, buf)
        assert bytes(buf) == data
        await t.zero(0, 1, size - 2)
        assert bytes(await t.read(0, 0, size)) == data[:1] + bytes(size - 2) + data[-1:]


async def test_errors_inside_the_body_come_out_unwrapped() -> None:
    """The context manager owns a nursery, but callers see their own exception."""
    async with memory_server(1, SIZE) as port:
        with pytest.raises(KeyError):
            async with open_tcp_transport([VolumeAddr("tcp", "127.0.0.1", port, 0)], SECRET):
                raise KeyError("mine")


async def test_cancelled_receiver_hands_over() -> None:
    """Requesters receive the replies themselves: the one receiving gives up, the
    other still gets its reply (and the first one's bytes go to scratch)."""
    both_in = trio.Event()
    go_on = trio.Event()

    async def script(stream: trio.SocketStream) -> None:
        reqs = [await recv_frame(stream) for _ in range(2)]
        both_in.set()
        await go_on.wait()
        for h, payload in reqs:
            _, offset, n = wire.unpack_exact(wire.READ, payload)
            await stream.send_all(wire.frame(Kind.OK, h.req_id, bytes([offset]) * n))
        h, _ = await recv_frame(stream)  # a WRITE after them
        await stream.send_all(wire.frame(Kind.OK, h.req_id))
        await recv_frame(stream)

    async with fake_memd(script) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1, io_timeout=5
    ) as t:
        first = t.register(100)
        first[:] = b"\xaa" * 100
        second = t.register(100)

        async def read(buf: memoryview, offset: int,
                       task_status: trio.TaskStatus[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                await t.readinto(0, offset, buf)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                receiver = await nursery.start(read, first, 1)
                await trio.testing.wait_all_tasks_blocked()  # the first one receives
                await nursery.start(read, second, 2)
                await both_in.wait()
                await trio.testing.wait_all_tasks_blocked()
                receiver.cancel()
                await trio.testing.wait_all_tasks_blocked()
                go_on.set()
        assert bytes(second) == b"\2" * 100
        assert bytes(first) == b"\xaa" * 100
        await t.write(0, 0, b"x")  # the connection is in step


async def test_late_reply_to_an_abandoned_request_is_no_timeout() -> None:
    """Nobody waits for a cancelled request's reply; when it comes, it is taken
    (not left for the deadline watchdog to call the server hung)."""
    connections = 0
    sent = trio.Event()

    async def script(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        h, payload = await recv_frame(stream)
        await trio.sleep(0.2)  # the caller gives up meanwhile
        await stream.send_all(wire.frame(Kind.OK, h.req_id, b"\1" * 10))
        sent.set()
        while True:
            h, payload = await recv_frame(stream)
            await stream.send_all(wire.frame(Kind.OK, h.req_id, b"\2" * 10))

    async with fake_memd(script) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1, io_timeout=0.5
    ) as t:
        with trio.move_on_after(0.05):
            await t.read(0, 0, 10)
        await sent.wait()
        await trio.sleep(0.6)  # past the abandoned request's deadline: no reset (no warning)
        assert bytes(await t.read(0, 0, 10)) == b"\2" * 10
        assert connections == 1


async def test_idle_connection_closed_by_the_server_is_replaced() -> None:
    """With no request outstanding nobody reads the socket; a connection the
    server closed meanwhile is noticed before the next request uses it."""
    connections = 0

    async def script(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        h, _ = await recv_frame(stream)
        await stream.send_all(wire.frame(Kind.OK, h.req_id))  # then hang up

    async with fake_memd(script) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1, io_timeout=5
    ) as t:
        for _ in range(3):
            await t.write(0, 0, b"x")
            await trio.sleep(0.05)
        assert connections == 3


async def test_fenced_lease_token_shuts_a_client_out_until_it_has_a_new_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client's connections name its lease token; the mds's transport delivers a
    fence (pending ones go before anything else it sends that server), after which
    the client's requests fail (EIO, never a hang) and its new connections are
    refused; a new token (its next registration) works again.  The blocking bulk
    client (memfs.array) names the token too."""
    from memfs.transport.bulk import BulkTcp
    from memfs.transport.tcp import Fences, server_name

    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with memory_server(2, SIZE) as port:
        vols = [VolumeAddr("tcp", "127.0.0.1", port, v) for v in (0, 1)]
        fences = Fences([server_name("127.0.0.1", port)])
        async with open_tcp_transport(vols, SECRET, io_timeout=5) as client, \
                open_tcp_transport(vols, SECRET, io_timeout=5, fences=fences) as mds:
            client.set_session(0x77)
            await client.write(0, 0, b"a" * 100)
            bulk = await trio.to_thread.run_sync(partial(BulkTcp, vols, SECRET, token=0x77))
            try:
                fences.add(0x77)
                await mds.zero(1, 0, 10)  # the pending fence goes first, answered
                assert not fences.pending
                with trio.fail_after(10):
                    for _ in range(3):  # every connection, new ones too
                        with pytest.raises(TransportError):
                            await client.write(0, 0, b"b" * 100)
                    with pytest.raises(TransportError):
                        await trio.to_thread.run_sync(
                            partial(bulk.move, [(0, 0, memoryview(b"c" * 100))], write=True))
                assert bytes(await mds.read(0, 0, 100)) == b"a" * 100
                client.set_session(0x99)
                await client.write(0, 0, b"d" * 100)
                assert bytes(await mds.read(0, 0, 100)) == b"d" * 100
            finally:
                bulk.close()
            # A fence for a server this transport does not reach stays pending;
            # the others are delivered.
            fences.add(0x99)
            fences.servers.append("127.0.0.1:1")
            fences.add(0x55)
            assert set(fences.pending) == {server_name("127.0.0.1", port), "127.0.0.1:1"}
            await mds.deliver_fences()
            assert set(fences.pending) == {"127.0.0.1:1"}
            with pytest.raises(TransportError):
                await client.write(0, 0, b"e" * 100)


# -- blocking bulk transfers (memfs.array's cluster path) ---------------------------------


@pytest.mark.parametrize("splice", [True, False], ids=["vmsplice", "sendall"])
async def test_bulk_transfers_round_trip_and_agree_with_the_transport(
    splice: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BulkTcp writes what the trio transport reads and back, over two connections,
    pieces larger than one request, and ranges it refuses; writes of 64 KiB and more
    go by reference (vmsplice) where the system has it, and by copy otherwise."""
    from memfs.transport import bulk as bulk_mod
    from memfs.transport import splice as splice_mod
    from memfs.transport.bulk import BulkTcp

    if splice and not splice_mod.available():
        pytest.skip("no vmsplice here")
    monkeypatch.setattr(bulk_mod, "_SPLICE", splice)
    sent = []
    real_send = splice_mod.SpliceSender.send

    def counting_send(self: splice_mod.SpliceSender, sock: object, view: memoryview,
                      timeout: float | None) -> None:
        sent.append(len(view))
        real_send(self, sock, view, timeout)  # type: ignore[arg-type]

    monkeypatch.setattr(splice_mod.SpliceSender, "send", counting_send)

    async with memory_server(2, SIZE) as port:
        vols = [VolumeAddr("tcp", "127.0.0.1", port, v) for v in (0, 1)]
        data = bytes(range(256)) * (SIZE // 256)
        bulk = await trio.to_thread.run_sync(partial(BulkTcp, vols, SECRET))
        try:
            src = memoryview(data)
            half = SIZE // 2
            jobs = [(0, 0, src[:half]), (1, 0, src[half:]), (0, half, src[half:])]
            await trio.to_thread.run_sync(partial(bulk.move, jobs, write=True))
            async with open_tcp_transport(vols, SECRET) as t:
                assert bytes(await t.read(1, 0, SIZE - half)) == data[half:]
                assert bytes(await t.read(0, half, SIZE - half)) == data[half:]
                await t.write(1, 5, b"hello")
            back = bytearray(SIZE)
            view = memoryview(back)
            await trio.to_thread.run_sync(partial(bulk.move, [(1, 0, view[:16]), (0, 0, view[16:])],
                                                  write=False))
            assert bytes(back[:16]) == data[half:half + 5] + b"hello" + data[half + 10:half + 16]
            assert bytes(back[16:]) == data[: SIZE - 16]
            with pytest.raises(TransportError, match="outside volume"):
                await trio.to_thread.run_sync(partial(bulk.move, [(0, SIZE - 1, view[:2])],
                                                      write=False))
            with pytest.raises(TransportError, match="no volume 7"):
                await trio.to_thread.run_sync(partial(bulk.move, [(7, 0, view[:2])], write=True))
            # the three writes above, whole (each under MAX_IO), by reference or not at all
            assert sent == ([SIZE // 2] * 3 if splice else [])
        finally:
            await trio.to_thread.run_sync(bulk.close)


async def test_bulk_refuses_a_restarted_server_and_a_wrong_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from memfs.transport.bulk import BulkTcp

    caplog.expected_warnings = True  # type: ignore[attr-defined]  # memd: auth failed

    async with memory_server(1, SIZE) as port:
        vols = [VolumeAddr("tcp", "127.0.0.1", port, 0)]
        with pytest.raises(TransportError, match="restarted; its data is lost"):
            await trio.to_thread.run_sync(partial(
                BulkTcp, vols, SECRET, incarnations={f"127.0.0.1:{port}": -1}))
        with pytest.raises(TransportError, match="wrong secret"):
            await trio.to_thread.run_sync(partial(BulkTcp, vols, b"not the secret"))


async def test_bulk_transfers_overlap_in_order_each_under_its_own_token() -> None:
    """Transfers begun one after the other queue per connection (the later one's bytes
    land last); each names the token that was current when it was begun, so one begun
    under a token fenced since fails even if the token changed before it started, and
    the failure stops the transfer queued behind it; what is begun under the new
    token works.  close() stops what is under way."""
    from memfs.transport.bulk import BulkTcp, TransferStopped

    server = MemoryServer(2, SIZE, SECRET)
    try:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            vols = [VolumeAddr("tcp", "127.0.0.1", port, v) for v in (0, 1)]
            bulk = await trio.to_thread.run_sync(partial(BulkTcp, vols, SECRET, token=0x77))
            try:
                a, b = memoryview(b"a" * SIZE), memoryview(b"b" * SIZE)

                def in_order() -> None:
                    first = bulk.begin([(0, 0, a), (1, 0, a)], write=True)
                    second = bulk.begin([(0, 0, b), (1, 0, b)], write=True)
                    second.wait()
                    first.wait()

                await trio.to_thread.run_sync(in_order)
                async with open_tcp_transport(vols, SECRET) as t:
                    assert bytes(await t.read(0, 0, SIZE)) == b"b" * SIZE
                    assert bytes(await t.read(1, 0, SIZE)) == b"b" * SIZE

                server.fence(0x77)

                def tokens() -> tuple[BaseException | None, BaseException | None]:
                    old = bulk.begin([(0, 0, a)], write=True)  # under 0x77
                    bulk.set_token(0x88)
                    behind = bulk.begin([(0, 0, a)], write=True)  # same connection
                    out: list[BaseException | None] = []
                    for batch in (old, behind):
                        try:
                            batch.wait()
                            out.append(None)
                        except TransportError as exc:
                            out.append(exc)
                    return out[0], out[1]

                first_err, second_err = await trio.to_thread.run_sync(tokens)
                assert first_err is not None and not isinstance(first_err, TransferStopped)
                assert isinstance(second_err, TransferStopped), second_err
                c = memoryview(b"c" * SIZE)
                await trio.to_thread.run_sync(partial(bulk.move, [(0, 0, c)], write=True))
                async with open_tcp_transport(vols, SECRET) as t:
                    assert bytes(await t.read(0, 0, SIZE)) == b"c" * SIZE

                def closing() -> BaseException | None:
                    batch = bulk.begin([(0, 0, a), (1, 0, a)] * 8, write=True)
                    bulk.close()
                    try:
                        batch.wait()
                    except TransportError as exc:
                        return exc
                    return None

                with trio.fail_after(20):
                    err = await trio.to_thread.run_sync(closing)
                assert err is None or isinstance(err, TransferStopped), err
                with pytest.raises(TransportError, match="closed"):
                    bulk.begin([(0, 0, a)], write=True)
            finally:
                await trio.to_thread.run_sync(bulk.close)
            nursery.cancel_scope.cancel()
    finally:
        await server.aclose()


# -- posted writes (TcpTransport.post_write; memfs.data posts a write-lease holder's) --


class Completions(list[Exception | None]):
    """Completion callbacks' results, with a wait for the first *n*."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = trio.Event()

    def append(self, result: Exception | None) -> None:
        super().append(result)
        self.changed.set()

    async def wait_for(self, n: int) -> None:
        while len(self) < n:
            self.changed = trio.Event()
            await self.changed.wait()


async def posted_write_times_out(t: TcpTransport, results: Completions) -> None:
    """Post a write to a server that never answers it (a transport with io_timeout
    0.3 s): waiting for it fails it through its callback within that deadline."""
    start = trio.current_time()
    h = await t.post_write(0, 0, b"w" * 100, 1, results.append)
    assert h is not None
    await h.wait()
    assert isinstance(results[-1], TransportError)
    assert "did not answer within 0.3s" in str(results[-1])
    assert 0.25 < trio.current_time() - start < 1.5


async def test_posted_writes_of_one_key_land_in_order_and_complete_unwatched() -> None:
    """Writes posted with one key go over one connection: a server applies them in
    order, so the last one posted wins, with two connections per server.  Nobody
    waits for them, yet every completion callback runs (the drainer takes the
    answers), and waiting for the last handle of a channel waits for the rest."""
    big = 1 << 20
    async with memory_server(1, 4 * big) as port, open_tcp_transport(
        [VolumeAddr("tcp", "127.0.0.1", port, 0)], SECRET, connections_per_server=2,
    ) as t:
        assert t.posts_writes
        results = Completions()
        handles = []
        for key in (7, 8):  # both slots of the server
            base = (key - 7) * 2 * big
            for i in range(40):
                # a small write right after a large one over the same bytes: on
                # another connection it would often land first
                for data in (bytes([i]) * big, bytes([100 + i]) * 4096):
                    h = await t.post_write(0, base, data, key, results.append)
                    if h is not None:
                        handles.append(h)
        assert handles, "nothing was posted: every write waited for its answer"
        assert len({h.channel for h in handles}) == 2
        with trio.fail_after(5):
            await results.wait_for(len(handles))
        assert results == [None] * len(handles)
        for key in (7, 8):
            got = bytes(await t.read(0, (key - 7) * 2 * big, big))
            assert got == bytes([139]) * 4096 + bytes([39]) * (big - 4096)
        # waiting for the last handle needs no drainer: it receives itself
        h = await t.post_write(0, 0, b"last", 7, results.append)
        if h is not None:
            await h.wait()
        assert results[-1] is None and bytes(await t.read(0, 0, 4)) == b"last"


async def test_posted_write_failures_reach_the_callback(caplog: pytest.LogCaptureFixture) -> None:
    """A posted write the server refuses, or never answers, is reported through its
    callback (within io_timeout), never silently dropped, with nobody waiting."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    release = trio.Event()

    async def script(stream: trio.SocketStream) -> None:
        h, _ = await recv_frame(stream)  # refused
        await stream.send_all(wire.frame(Kind.ERROR, h.req_id, wire.encode_error(errno.ESTALE, "fenced")))
        await recv_frame(stream)  # never answered
        await release.wait()

    async with fake_memd(script) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1, io_timeout=0.3
    ) as t:
        results = Completions()
        with trio.fail_after(2):
            first = await t.post_write(0, 0, b"a" * 100, 1, results.append)
            assert first is not None
            await results.wait_for(1)
            assert isinstance(results[0], TransportError) and "fenced" in str(results[0])
            await posted_write_times_out(t, results)
        assert len(results) == 2
        release.set()


async def test_quiet_posted_writes_are_confirmed_by_a_later_answer(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """To a server that offers it, posted writes go unanswered (WRITE_QUIET) but for
    every 16th: its answer, or any later answer on that connection (an ERROR's, a
    READ's), confirms the ones before it (a server serves a connection in order),
    and not before it comes.  A refused one is reported as such.  (The drainer,
    which would send a SYNC once posting stops, is made too slow to here; the test
    with a real server above has it confirm writes nobody waits for.)"""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    monkeypatch.setattr(tcp, "_DRAIN_EVERY", 60.0)
    seen: list[Kind] = []
    answer_16th = trio.Event()

    async def script(stream: trio.SocketStream) -> None:
        while True:
            h, _ = await recv_frame(stream)
            seen.append(h.kind)
            if len(seen) == 3:
                assert h.kind is Kind.WRITE_QUIET
                await stream.send_all(wire.frame(Kind.ERROR, h.req_id,
                                                 wire.encode_error(errno.EINVAL, "refused")))
            elif len(seen) == 16:
                assert h.kind is Kind.WRITE
                await answer_16th.wait()
                await stream.send_all(wire.frame(Kind.OK, h.req_id))
            elif h.kind is Kind.READ:
                await stream.send_all(wire.frame(Kind.OK, h.req_id, b"r" * 10))
            elif h.kind in (Kind.WRITE, Kind.SYNC):
                await stream.send_all(wire.frame(Kind.OK, h.req_id))

    async with fake_memd(script, features=["quiet-writes"]) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1
    ) as t:
        results = Completions()
        with trio.fail_after(5):
            handles: list[Posted] = []
            for i in range(20):
                h = await t.post_write(0, 0, bytes([i]) * 100, 1, results.append)
                assert h is not None
                handles.append(h)
            await handles[2].wait()  # the refusal, an answer: it confirms the two before
            await trio.sleep(0.05)
            assert len(results) == 3 and results[:2] == [None, None]
            assert isinstance(results[2], TransportError) and "refused" in str(results[2])
            answer_16th.set()
            await handles[15].wait()  # an answered one: no SYNC, its answer confirms
            assert len(results) == 16 and results[3:] == [None] * 13
            assert bytes(await t.read(0, 0, 10)) == b"r" * 10  # confirms the last 4
            assert len(results) == 20 and results[16:] == [None] * 4
        assert seen[:20] == [Kind.WRITE_QUIET] * 15 + [Kind.WRITE] + [Kind.WRITE_QUIET] * 4
        assert seen[20:] == [Kind.READ]  # no SYNC: the READ's answer covered them


async def test_quiet_writes_of_bytes_go_out_with_the_next_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quiet writes of ``bytes`` (a FUSE write's) are held back and go out in one
    ``sendmsg`` with the next frame on their connection, in order: a READ's
    here, or at the drainer's next look, or at once once ``CORK_BYTES`` are
    held.  Other buffers, read-only views of a bytearray too, go out at once:
    their owner may change them after ``post_write`` returns."""
    monkeypatch.setattr(tcp, "_DRAIN_EVERY", 60.0)
    seen: list[tuple[Kind, bytes]] = []
    arrived = trio.Event()

    async def script(stream: trio.SocketStream) -> None:
        nonlocal arrived
        while True:
            h, payload = await recv_frame(stream)
            seen.append((h.kind, payload[wire.WRITE.size:] if h.kind is not Kind.READ else b""))
            arrived.set()
            arrived = trio.Event()
            if h.kind is Kind.READ:
                await stream.send_all(wire.frame(Kind.OK, h.req_id, b"r" * 10))

    async def settled() -> None:
        await trio.sleep(0.05)

    async with fake_memd(script, features=["quiet-writes"]) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1
    ) as t:
        with trio.fail_after(5):
            for i in range(3):
                assert await t.post_write(0, 0, bytes([i]) * 100, 1, lambda _: None)
            await settled()
            assert seen == []  # held back
            assert bytes(await t.read(0, 0, 10)) == b"r" * 10
            assert seen == [(Kind.WRITE_QUIET, bytes([i]) * 100) for i in range(3)] + [(Kind.READ, b"")]
            for mutable in (bytearray(b"w" * 100), memoryview(bytearray(b"v" * 100)).toreadonly()):
                del seen[:]
                await t.post_write(0, 0, mutable, 1, lambda _: None)
                await arrived.wait()
                assert seen == [(Kind.WRITE_QUIET, bytes(mutable))]  # sent at once
            del seen[:]
            big = bytes(tcp.CORK_BYTES // 2)
            await t.post_write(0, 0, big, 1, lambda _: None)
            await settled()
            assert seen == []
            await t.post_write(0, 0, big, 1, lambda _: None)  # past CORK_BYTES: both go
            while len(seen) < 2:
                await arrived.wait()
            assert [k for k, _ in seen] == [Kind.WRITE_QUIET] * 2
    del seen[:]
    monkeypatch.setattr(tcp, "_DRAIN_EVERY", 0.01)
    monkeypatch.setattr(tcp, "_CONFIRM_WITHIN", 60.0)  # no SYNC: the look itself sends
    async with fake_memd(script, features=["quiet-writes"]) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1
    ) as t:
        with trio.fail_after(5):
            # While writes keep coming (no SYNC then), each look sends what is held.
            for i in range(12):  # (fewer than the 16 of a quiet run)
                await t.post_write(0, 0, bytes([i]) * 10, 1, lambda _: None)
                await trio.sleep(0.005)
            assert seen and seen[0] == (Kind.WRITE_QUIET, bytes(10))


async def test_a_server_that_stops_reading_fails_held_writes_not_the_transport(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A memory server that takes no more data, with writes held back and a flush
    of them stuck half sent: the deadline fails the connection, and with it the
    writes (EIO to their writers), and the transport goes on (it once died of the
    drainer's send finding its socket closed under it)."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    stop = trio.Event()

    async def script(stream: trio.SocketStream) -> None:
        await stop.wait()  # reads nothing

    async with fake_memd(script, features=["quiet-writes"]) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1, io_timeout=0.5
    ) as t:
        results = Completions()
        with trio.fail_after(10):
            with trio.move_on_after(1.5):
                while True:
                    with contextlib.suppress(TransportError):  # refused: the connection failed
                        await t.post_write(0, 0, bytes(16 << 10), 1, results.append)
                    await trio.sleep(0.0005)
            await results.wait_for(1)
        assert isinstance(results[0], TransportError)
        assert "did not answer" in str(results[0]) or "took no data" in str(results[0])
        stop.set()


async def test_an_unanswered_sync_fails_quiet_writes_within_io_timeout(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that takes quiet writes and never confirms them costs io_timeout:
    waiting for the handle sends a SYNC (the waiter's: the drainer is made too slow
    to), and the deadline fails both."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    monkeypatch.setattr(tcp, "_DRAIN_EVERY", 60.0)
    seen: list[Kind] = []

    async def script(stream: trio.SocketStream) -> None:
        while True:
            seen.append((await recv_frame(stream))[0].kind)

    async with fake_memd(script, features=["quiet-writes"]) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1, io_timeout=0.3
    ) as t:
        results = Completions()
        with trio.fail_after(2):
            await posted_write_times_out(t, results)
        assert len(results) == 1 and seen == [Kind.WRITE_QUIET, Kind.SYNC]


async def test_every_task_waiting_for_one_request_is_woken() -> None:
    """Several tasks may wait for one request (a posted write: the drainer and an
    fsync): one receives, the others sleep, and the answer wakes them all.  With
    one sleeper remembered per request, the first was forgotten and slept forever."""
    answer = trio.Event()

    async def script(stream: trio.SocketStream) -> None:
        h, _ = await recv_frame(stream)
        await answer.wait()
        await stream.send_all(wire.frame(Kind.OK, h.req_id))
        while True:
            await recv_frame(stream)

    async with fake_memd(script) as vol, open_tcp_transport(
        [vol], SECRET, connections_per_server=1
    ) as t:
        h = await t.post_write(0, 0, b"w" * 100, 1, lambda _: None)
        assert h is not None
        finished: list[int] = []

        async def waiter(k: int) -> None:
            await h.wait()
            finished.append(k)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for k in range(3):  # the first receives, two sleep
                    nursery.start_soon(waiter, k)
                await trio.testing.wait_all_tasks_blocked()
                answer.set()
        assert sorted(finished) == [0, 1, 2]


async def serve_at(
    nursery: trio.Nursery, port: int,
) -> tuple[int, Callable[[], Awaitable[None]], MemoryServer]:
    """Start a memory server (a new incarnation each time) on *port* (0: any): its port,
    what stops it, and the server."""
    server = MemoryServer(1, SIZE, SECRET)
    scope = trio.CancelScope()
    ended = trio.Event()

    async def run(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await server.serve("127.0.0.1", port, task_status=task_status)
        finally:
            ended.set()

    async def stop() -> None:
        scope.cancel()
        await server.aclose()  # (stops its data loop's thread)
        await ended.wait()

    return await nursery.start(run), stop, server


async def test_a_restarted_server_is_found_and_can_be_taken_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server found at another incarnation is told to the owner (on_restart) once per
    incarnation, also by probe() with nothing sent there; its volumes fail until
    adopt() names that incarnation, and then serve again; a further restart is found
    and refused in the same way."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # "restarted; its data is lost"
    found: list[tuple[str, int]] = []
    async with trio.open_nursery() as nursery:
        port, stop, _ = await serve_at(nursery, 0)
        vols = [VolumeAddr("tcp", "127.0.0.1", port, 0)]
        name = f"127.0.0.1:{port}"
        async with open_tcp_transport(vols, SECRET, io_timeout=5,
                                      on_restart=lambda n, i: found.append((n, i))) as t:
            first = t.incarnations()[name]
            await t.write(0, 0, b"old data")
            for round_ in range(2):
                await stop()
                _, stop, _ = await serve_at(nursery, port)
                await t.probe()  # nothing sent: found all the same
                assert len(found) == round_ + 1 and found[-1][0] == name
                new = found[-1][1]
                assert new != first
                with pytest.raises(TransportError, match="restarted; its data is lost"):
                    await t.read(0, 0, 8)
                await t.probe()
                assert len(found) == round_ + 1  # told once
                t.adopt({name: new})
                assert t.incarnations()[name] == new
                assert bytes(await t.read(0, 0, 8)) == bytes(8)  # blank, served again
                await t.write(0, 0, b"new data")
                assert bytes(await t.read(0, 0, 8)) == b"new data"
                first = new
        await stop()


async def test_hung_servers_cost_one_timeout_at_open(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture,
) -> None:
    """Servers that accept connections and never answer (stopped, hung) are waited for
    all at once when the transport opens: one io_timeout in all, not one each."""
    import socket

    caplog.expected_warnings = True  # type: ignore[attr-defined]  # "going on without it"

    hung = []
    try:
        for _ in range(3):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(4)  # the kernel completes connections; nobody ever answers
            hung.append(s)
        vols = [VolumeAddr("tcp", "127.0.0.1", s.getsockname()[1], 0) for s in hung]
        t0 = trio.current_time()
        with pytest.raises(TransportError, match="did not answer within 4s"):
            async with open_tcp_transport(vols, SECRET, io_timeout=4, volume_size=SIZE):
                pass
        assert trio.current_time() - t0 < 8
    finally:
        for s in hung:
            s.close()


async def test_bulk_transfers_adopt_a_server_taken_back(caplog: pytest.LogCaptureFixture) -> None:
    """memfs.array's bulk connections refuse a restarted server until told it was taken
    back (the mount passes on what the mds said), then use it."""
    from memfs.transport.bulk import BulkTcp

    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with trio.open_nursery() as nursery:
        port, stop, _ = await serve_at(nursery, 0)
        vols = [VolumeAddr("tcp", "127.0.0.1", port, 0)]
        bulk = await trio.to_thread.run_sync(partial(BulkTcp, vols, SECRET))
        try:
            data = memoryview(b"d" * 4096)

            def move(write: bool, view: memoryview) -> None:
                bulk.begin([(0, 0, view)], write=write).wait()

            await trio.to_thread.run_sync(move, True, data)
            await stop()
            _, stop, again = await serve_at(nursery, port)
            said = []
            for _ in range(4):  # (the first ones may meet the old connections' end)
                with pytest.raises(TransportError) as info:
                    await trio.to_thread.run_sync(move, True, data)
                said.append(str(info.value))
                if "restarted; its data is lost" in said[-1]:
                    break
            assert "restarted; its data is lost" in said[-1], said
            bulk.adopt({f"127.0.0.1:{port}": again.incarnation})
            await trio.to_thread.run_sync(move, True, data)
            got = memoryview(bytearray(4096))
            await trio.to_thread.run_sync(move, False, got)
            assert bytes(got) == bytes(data)
        finally:
            bulk.close()
            await stop()
