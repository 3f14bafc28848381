"""One mds connection (memfs.meta.server_conn.Connection) against a fake dispatcher.

The connection decides the order of calls and replies; what a call means is the
dispatcher's.  A real socket pair carries the frames, so these are the bytes a
client would see: calls answered in arrival order even when the first must
wait, recall answers read meanwhile, replies held until the journal records they
depend on are durable, silent and misbehaving clients closed.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from memfs import wire
from memfs.meta.conn import FrameSocket
from memfs.meta.server_conn import Connection, Parsed, Session, parse_call
from memfs.wire import Kind


class FakeJournal:
    """What a connection needs of a journal: the last record and a wait for it."""

    def __init__(self) -> None:
        self.seq = 0
        self.durable_seq = 0
        self._changed = trio.Event()

    def make_durable(self, seq: int) -> None:
        self.durable_seq = seq
        self._changed.set()
        self._changed = trio.Event()

    async def wait_durable(self, seq: int) -> None:
        while self.durable_seq < seq:
            await self._changed.wait()


class FakeServer:
    """A dispatcher: ``getattr`` of an inode with a gate waits for the gate."""

    def __init__(self, journal: FakeJournal | None = None, idle_timeout: float = 60.0) -> None:
        self.journal = journal
        self.idle_timeout = idle_timeout
        self.gates: dict[int, trio.Event] = {}
        self.executed: list[int] = []
        self.recalls: list[tuple[int, Any]] = []
        self.recall_came = trio.Event()
        #: the connection of the last call executed
        self.conn: Connection | None = None

    def may_wait(self, session: Session, value: Any, parsed: Parsed) -> bool:
        return isinstance(parsed, tuple) and parsed[1][0] in self.gates

    async def execute(
        self, conn: Connection, value: Any, parsed: Parsed, *, checked: bool = False,
    ) -> tuple[Kind, bytes]:
        assert isinstance(parsed, tuple)
        self.conn = conn
        ino = parsed[1][0]
        gate = self.gates.get(ino)
        if gate is not None:
            await gate.wait()
        self.executed.append(ino)
        if ino < 0:
            return Kind.ERROR, wire.encode_error(2, "no such inode")
        return Kind.OK, wire.encode(ino)

    def recalled(self, session: Session, rid: int, payload: Any) -> None:
        self.recalls.append((rid, payload))
        self.recall_came.set()

    def early_open(self, session: Session, parsed: Parsed) -> bool:
        return False


@asynccontextmanager
async def connection(server: FakeServer) -> AsyncIterator[tuple[FrameSocket, trio.Event]]:
    """A served connection and the client's end of it; the event is set once
    :meth:`Connection.serve` has returned (the server then closes its end)."""
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
    conn = Connection("test-peer", Session(b"s" * 16), server)
    conn.session.conn = conn
    served = FrameSocket(a)
    client = FrameSocket(b)
    ended = trio.Event()

    async def serve() -> None:
        try:
            await conn.serve(served)
        finally:
            served.close()
            ended.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            yield client, ended
            nursery.cancel_scope.cancel()
    finally:
        client.close()


def call(rid: int, ino: int) -> bytes:
    return wire.frame(Kind.CALL, rid, wire.encode(["getattr", ino]))


async def replies(client: FrameSocket, n: int) -> list[tuple[int, Kind, Any]]:
    out = []
    with trio.fail_after(5):
        for _ in range(n):
            got = await client.receive()
            assert got is not None
            h, payload = got
            out.append((h.req_id, h.kind, wire.decode(payload) if h.kind is Kind.OK else payload))
    return out


async def test_calls_behind_one_that_waits_run_and_answer_in_arrival_order() -> None:
    server = FakeServer()
    server.gates[1] = trio.Event()
    async with connection(server) as (client, _):
        await client.send(call(1, 1) + call(2, 2) + call(3, 3))
        await trio.sleep(0.1)
        assert server.executed == []  # 2 and 3 could not wait, yet they queue behind 1
        with trio.move_on_after(0.1):
            await client.receive()
            pytest.fail("a reply came before the call that waits was done")
        server.gates[1].set()
        assert await replies(client, 3) == [(1, Kind.OK, 1), (2, Kind.OK, 2), (3, Kind.OK, 3)]
        assert server.executed == [1, 2, 3]


async def test_recall_answers_are_read_while_a_call_waits() -> None:
    """Two clients recalling from each other would otherwise wait for each other."""
    server = FakeServer()
    server.gates[1] = trio.Event()
    async with connection(server) as (client, _):
        await client.send(call(1, 1))
        await client.send(wire.frame(Kind.RECALLED, 77, wire.encode([[5, 100, 200]])))
        with trio.fail_after(5):
            await server.recall_came.wait()
        assert server.recalls == [(77, [[5, 100, 200]])]
        assert server.executed == []
        server.gates[1].set()
        assert await replies(client, 1) == [(1, Kind.OK, 1)]


async def test_a_reply_read_with_a_recall_answer_goes_out_without_waiting_for_more() -> None:
    """Replies to calls that came in one read go out in one send, after the last of
    them; a recall answer that ended such a read must not leave the reply waiting
    for the client's next frame (a keepalive a second later, when it has nothing
    else to say)."""
    server = FakeServer()
    async with connection(server) as (client, _):
        await client.send(call(1, 1) + wire.frame(Kind.RECALLED, 9, wire.encode([])))
        with trio.fail_after(2):
            await server.recall_came.wait()
            assert await replies(client, 1) == [(1, Kind.OK, 1)]


async def test_a_reply_waits_for_the_journal_records_before_it() -> None:
    journal = FakeJournal()
    journal.seq = 5  # a change the reply may reflect
    journal.durable_seq = 4
    server = FakeServer(journal)
    async with connection(server) as (client, _):
        await client.send(call(1, 10))
        with trio.move_on_after(0.2):
            await client.receive()
            pytest.fail("a reply left before the journal had its record")
        assert server.executed == [10]
        journal.make_durable(5)
        assert await replies(client, 1) == [(1, Kind.OK, 10)]


async def test_a_call_without_request_id_gets_no_reply_even_when_it_fails() -> None:
    server = FakeServer()
    async with connection(server) as (client, _):
        await client.send(call(0, -1) + call(4, 4))
        assert await replies(client, 1) == [(4, Kind.OK, 4)]
        assert server.executed == [-1, 4]


async def test_a_silent_client_is_closed_after_the_idle_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = FakeServer(idle_timeout=30.0)
    async with connection(server) as (client, ended):
        start = trio.current_time()
        with trio.fail_after(60):
            await ended.wait()
        assert trio.current_time() - start >= 30.0
        with trio.fail_after(5):
            assert await client.receive() is None


async def test_an_unexpected_frame_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    server = FakeServer()
    async with connection(server) as (client, ended):
        await client.send(wire.frame(Kind.OK, 1, b""))
        with trio.fail_after(5):
            await ended.wait()
    assert "protocol error" in caplog.text and "unexpected OK frame" in caplog.text


async def test_a_superseded_connection_runs_nothing_more_after_the_call_under_way() -> None:
    """The session registered on a newer connection: the call under way here ends
    first, what is queued is dropped, what still comes refused, and the connection
    closes."""
    server = FakeServer()
    server.gates[1] = trio.Event()
    async with connection(server) as (client, ended):
        await client.send(call(1, 1) + call(2, 2) + call(3, 3))
        await trio.sleep(0.1)
        conn = server.conn
        assert conn is not None
        superseded = trio.Event()

        async def supersede() -> None:
            await conn.supersede()
            superseded.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(supersede)
            await client.send(call(4, 4))
            await trio.sleep(0.1)
            assert not superseded.is_set(), "returned while the call under way still ran"
            server.gates[1].set()
            with trio.fail_after(5):
                await superseded.wait()
                await ended.wait()
        assert server.executed == [1]


async def test_creates_queued_behind_a_registration_do_not_pass_it() -> None:
    """A recall answer lets the creates queued on a connection run ahead of a call that
    waits (Connection._run_made_now), but not ahead of a registration: they name the
    session it registers."""
    server = FakeServer()
    conn = Connection("test-peer", Session(b"s" * 16), server)
    value = ["create_at", 1, b"f", 0o100644, 0, 0, 5, 1]
    conn.calls.append((7, value, parse_call(value)))
    conn.registering = True
    await conn._run_made_now()
    assert server.executed == [] and len(conn.calls) == 1
