"""Files written from several clients at once (memfs.meta.contention): no write
leases while contended, recalls only where the ranges touched overlap."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.lowlevel

from memfs.meta import contention
from memfs.meta.contention import WHOLE, Contention
from memfs.meta.leases import Item, LeaseTable
from memfs.meta.remote import RemoteMeta
from memfs.meta.server import MetaServer
from tests.unit.test_leases import POOL, ROOT, F, calls, cluster

CS = POOL.chunk_size


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_switches_within_the_window_make_a_file_contended_for_a_while() -> None:
    clock = Clock()
    c = Contention(clock)
    a, b = object(), object()
    for _ in range(contention.SWITCHES // 2):
        c.wrote(a, 1)
        c.wrote(b, 1)
        clock.t += 0.01
    assert not c.contended(1)  # the first write is no switch
    c.wrote(a, 1)
    assert c.contended(1) and c.started == 1
    clock.t += contention.WINDOW / 2
    c.wrote(b, 1)  # a switch while contended holds it on
    clock.t += contention.HOLD - 0.01
    assert c.contended(1)
    clock.t += 0.02
    assert not c.contended(1)
    # Turns further apart than the window are no switches; one writer none at all.
    for _ in range(3 * contention.SWITCHES):
        c.wrote(a, 2)
        clock.t += contention.WINDOW
        c.wrote(b, 2)
        c.wrote(b, 3)
    assert not c.contended(2) and not c.contended(3)


def test_write_histories_are_pruned_at_most_once_a_window() -> None:
    clock = Clock()
    c = Contention(clock)
    a = object()
    n = contention._HISTORY + 10
    for ino in range(n):
        c.wrote(a, ino)
    assert len(c._last) == n  # all within the window: kept (and not rebuilt per write)
    clock.t += contention.WINDOW
    c.wrote(a, n)
    assert list(c._last) == [n]


def test_ranges_sent_merge_and_overlap_by_chunk() -> None:
    c = Contention(Clock())
    a, b = object(), object()
    for k in range(10):  # a sequential writer: one range
        c.sent(a, 1, (k * CS, (k + 1) * CS))
    c.sent(a, 1, (20 * CS, 21 * CS))
    assert c.spans[1][a] == [(0, 10 * CS), (20 * CS, 21 * CS)]
    c.sent(a, 1, (5 * CS, 20 * CS))
    assert c.spans[1][a] == [(0, 21 * CS)]
    c.sent(b, 1, (30 * CS, 31 * CS))
    assert c.overlaps(a, 1, (20 * CS, 22 * CS)) and not c.overlaps(a, 1, (21 * CS, 30 * CS))
    assert c.overlaps(b, 1, None) and not c.overlaps(b, 2, None)
    for k in range(0, 4 * contention.MAX_SPANS, 2):  # too many apart: one range covers them
        c.sent(b, 1, (100 * CS + k * CS, 100 * CS + (k + 1) * CS))
    assert len(c.spans[1][b]) == 1 and c.overlaps(b, 1, (40 * CS, 41 * CS))
    c.sent(b, 2, None)
    assert c.spans[2][b] == [WHOLE]
    c.take(a, 1)
    c.forget(b)
    assert c.spans == {}


async def _by_turns(server: MetaServer, a: RemoteMeta, b: RemoteMeta, ino: int) -> int:
    """a and b write chunks 2k and 2k+1 of *ino* by turns until it is contended; the
    next k."""
    k = 0
    while not server.leases.contention.contended(ino):
        assert k < 2 * contention.SWITCHES, "never contended"
        await a.map_write(ino, 2 * k * CS, CS)
        await b.map_write(ino, (2 * k + 1) * CS, CS)
        k += 1
    return k


async def test_writes_by_turns_to_other_chunks_recall_no_one_once_contended() -> None:
    async with cluster(2) as (server, (a, b), _):
        f = await a.create(ROOT, b"shared", F, 0, 0)
        await b.open(f.ino)
        k = await _by_turns(server, a, b, f.ino)
        before = calls(server)
        for j in range(k, k + 10):
            # Posted (not waited for) without a lease too: the server marks them writing.
            assert (await a.map_write(f.ino, 2 * j * CS, CS)).posted
            assert (await b.map_write(f.ino, (2 * j + 1) * CS, CS)).posted
        assert calls(server) == before, "writes of other chunks recalled someone"
        assert not a.cache.is_writer(f.ino) and not b.cache.is_writer(f.ino)
        assert f.ino not in server.leases.writers
        end = 2 * (k + 10) * CS
        # Sizes and times are the server's at once: each asks (nothing is cacheable).
        assert (await a.getattr(f.ino)).size == end == (await b.getattr(f.ino)).size
        assert a.attr_ttl(f.ino) == 0 and b.attr_ttl(f.ino) == 0
        # A write into a chunk b was sent recalls b, and only b.
        await a.map_write(f.ino, end - CS + 10, 100)
        assert calls(server) == before + 1
        # a writes chunk 0 (its bytes may be on their way): b's read of chunk 4, which
        # a was not sent since, recalls no one; b's read of chunk 0 recalls a.
        await a.map_write(f.ino, 0, 10)
        await b.map_read(f.ino, 4 * CS, 10)
        assert calls(server) == before + 1
        await b.map_read(f.ino, 0, 10)
        assert calls(server) == before + 2
        # b's kernel may keep the pages it read: a's write there recalls it.
        await a.map_write(f.ino, 4 * CS, 10)
        assert calls(server) == before + 3
        # Any other change recalls every receiver of a map: a truncate here.
        await b.map_write(f.ino, CS, 10)
        await a.map_write(f.ino, 2 * CS, 10)
        await a.truncate(f.ino, 3 * CS)
        assert calls(server) == before + 4
        assert (await b.getattr(f.ino)).size == 3 * CS


async def test_a_contended_file_gets_leases_again_once_its_writers_stop_taking_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(contention, "HOLD", 0.3)
    monkeypatch.setattr(contention, "WINDOW", 0.2)
    async with cluster(2) as (server, (a, b), _):
        f = await a.create(ROOT, b"shared", F, 0, 0)
        await b.open(f.ino)
        k = await _by_turns(server, a, b, f.ino)
        await trio.sleep(0.5)  # (a write now is a turn, not a switch)
        before = calls(server)
        await a.map_write(f.ino, 2 * k * CS, CS)  # b's chunks go first (its kernel's pages)
        assert calls(server) == before + 1
        assert a.cache.is_writer(f.ino)
        assert len(server.leases.contention.spans[f.ino]) == 1  # a's own ranges only
        await a.map_write(f.ino, (2 * k + 2) * CS, CS)
        assert calls(server) == before + 1
        assert (await b.getattr(f.ino)).size == (2 * k + 3) * CS  # a's lease recalled
        assert calls(server) == before + 2


class _Silent:
    """A holder that is sent recalls and does not answer them."""

    def __init__(self) -> None:
        self.last_heard = 0.0
        self.registrations = 0

    def send_recall(self, rid: int, payload: list[Any]) -> bool:
        return True

    def evict(self, reason: str) -> None:
        raise AssertionError("not evicted here")


async def test_a_writer_whose_recall_was_given_up_is_recalled_by_any_read() -> None:
    """A glimpse of a writer that gives up (the write-back waits 0.5 s at most) took
    its ranges with it: the writer then holds the whole file, so a read of the
    chunk whose bytes it never confirmed still recalls it, also once it was sent
    ranges elsewhere."""
    lt = LeaseTable(term=4.0, recall_timeout=2.0)
    a, reader = _Silent(), _Silent()
    ino = 7
    lt.contention.until[ino] = math.inf
    lt.register(a, [ino], transfer=True, span=(0, CS))
    lt.wrote(a, ino, placed=True)
    read0 = Item(ino, write_only=True, span=(0, CS))
    assert lt.needs_recall(reader, [read0])
    with trio.move_on_after(0.1):
        await lt.recall(None, [Item(ino, write_only=True)])
    assert lt.writing[ino], "a's mark stays (nothing confirmed)"
    lt.register(a, [ino], transfer=True, span=(5 * CS, 6 * CS))
    lt.wrote(a, ino, placed=True)
    assert lt.needs_recall(reader, [read0])


def test_a_map_is_not_cached_while_another_session_writes_without_a_lease() -> None:
    """A read whose conflicts were limited to its range (the file contended then)
    and registered once the contention ended: not cacheable (it would be widened
    over chunks whose bytes the writer may still be sending)."""
    clock = Clock()
    lt = LeaseTable(term=4.0, recall_timeout=2.0)
    lt.contention = Contention(clock)
    a, reader = _Silent(), _Silent()
    ino = 7
    lt.contention.until[ino] = clock.t + 0.001
    lt.register(a, [ino], transfer=True, span=(CS, 2 * CS))
    lt.wrote(a, ino, placed=True)
    read0 = Item(ino, write_only=True, span=(0, CS))
    assert not lt.needs_recall(reader, [read0])
    clock.t += 0.01
    assert not lt.register(reader, [ino], transfer=True, span=(0, CS))


class _Answering:
    """A holder that answers recalls at once while connected (send_recall False
    while cut off)."""

    def __init__(self, table: LeaseTable) -> None:
        self.table = table
        self.last_heard = 0.0
        self.registrations = 0
        self.connected = True

    def send_recall(self, rid: int, payload: list[Any]) -> bool:
        if not self.connected:
            return False

        async def answer() -> None:
            self.table.recalled(self, rid, [])

        trio.lowlevel.spawn_system_task(answer)
        return True

    def evict(self, reason: str) -> None:
        pass


async def test_a_given_up_recall_gives_nothing_back_to_a_session_that_registered_again(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """A glimpse (0.5 s at most) of a cut-off writer, which registers again within it
    (and so holds nothing of the file): the glimpse gives up without giving it ranges
    (which no recall could find: a write elsewhere would loop recalling no one)."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # a is evicted
    lt = LeaseTable(term=4.0, recall_timeout=2.0)
    a, b = _Answering(lt), _Answering(lt)
    a.connected = False
    lt.contention.until[7] = math.inf
    lt.register(a, [7], transfer=True, span=(0, CS))
    lt.wrote(a, 7, placed=True)
    async with trio.open_nursery() as nursery:
        async def registers_again() -> None:
            await trio.sleep(0.2)
            a.registrations += 1
            a.connected = True
            lt.forget(a, said=True)  # (SessionClaims._replay)

        nursery.start_soon(registers_again)
        with trio.move_on_after(0.5):  # (LeasePolicy.glimpse_writers_of)
            await lt.recall(None, [Item(7, write_only=True)])
    assert a not in lt.holders.get(7, {}) and a not in lt.contention.spans.get(7, {})
    items = [Item(7, span=(0, CS))]
    first = True
    for _ in range(5):  # (MetaServer.run_call's loop)
        if not lt.needs_recall(b, items, first=first):
            break
        await lt.recall(b, items)
        first = False
    else:
        raise AssertionError("the recalls never end")


async def test_a_recall_once_leaves_those_who_fetched_meanwhile_to_the_next_change(
    autojump_clock: Any,
) -> None:
    """recall(once=True) (a takeback's) recalls only who held the file then: one that
    read a chunk meanwhile keeps its range, so a later write there recalls it."""
    lt = LeaseTable(term=4.0, recall_timeout=2.0)
    a, r, b = _Answering(lt), _Answering(lt), _Answering(lt)
    lt.contention.until[7] = math.inf
    lt.register(a, [7], transfer=True, span=(0, CS))

    def slowly(rid: int, payload: list[Any]) -> bool:
        async def answer() -> None:
            await trio.sleep(0.2)
            lt.recalled(a, rid, [])

        trio.lowlevel.spawn_system_task(answer)
        return True

    a.send_recall = slowly  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        async def reads_meanwhile() -> None:
            await trio.sleep(0.1)
            lt.register(r, [7], transfer=True, span=(3 * CS, 4 * CS))

        nursery.start_soon(reads_meanwhile)
        await lt.recall(None, [Item(7)], once=True)
    assert lt.needs_recall(b, [Item(7, span=(3 * CS, 4 * CS))])


@pytest.mark.parametrize("contended", [False, True])
async def test_a_change_waits_for_a_writer_another_recall_waits_for(
    autojump_clock: Any, contended: bool,
) -> None:
    """a's posted bytes are on their way and another session's read recalls a (its
    answer waits for them): meanwhile b's truncate or write there still recalls a,
    which a recall under way had marked told (and, contended, taken the ranges of)."""
    lt = LeaseTable(term=4.0, recall_timeout=2.0)
    a, c, b = _Silent(), _Silent(), _Silent()
    if contended:
        lt.contention.until[7] = math.inf
    lt.register(a, [7], transfer=True, span=(0, CS) if contended else None)
    lt.register(a, [7], transfer=True, span=(4 * CS, 5 * CS) if contended else None)
    lt.wrote(a, 7, placed=True)
    change = Item(7, span=(4 * CS, 5 * CS)) if contended else Item(7)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lt.recall, c, [Item(7, write_only=True, span=(0, CS) if contended else None)])
        await trio.sleep(0.1)
        waits = lt.needs_recall(b, [change])
        nursery.cancel_scope.cancel()
    assert waits


async def test_writes_without_a_lease_are_not_posted_once_the_mds_grants_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Back to an mds that keeps no leases (restarted with --lease-term 0), which marks
    no writer: the writes of a client that had leases wait for their bytes again."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # the connection drops
    async with cluster(2) as (server, (a, b), _):
        f = await a.create(ROOT, b"f", F, 0, 0)
        await b.open(f.ino)
        server.leases.term = 0
        assert b._conn is not None
        b._conn.kill("test")
        await b.getattr(ROOT)  # (registered again: its describe says no leases)
        plan = await b.map_write(f.ino, 0, CS)
        assert not server.leases.writing and not plan.posted


async def test_a_told_writer_sent_another_range_still_holds_off_changes_where_it_wrote(
    autojump_clock: Any,
) -> None:
    """A recall of a contended writer under way (its answer waits for its bytes of X)
    took its ranges; it is sent a map of Y meanwhile: until it answers it holds the
    whole file, so another session's write or read of X still waits for it."""
    lt = LeaseTable(term=4.0, recall_timeout=2.0)
    a, c, b = _Silent(), _Silent(), _Silent()
    lt.contention.until[7] = math.inf
    x, y = (0, CS), (4 * CS, 5 * CS)
    lt.register(a, [7], transfer=True, span=x)
    lt.wrote(a, 7, placed=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lt.recall, c, [Item(7, write_only=True, span=x)])
        await trio.sleep(0.1)
        lt.register(a, [7], transfer=True, span=y)
        lt.wrote(a, 7, placed=True)
        change = lt.needs_recall(b, [Item(7, span=x)])
        read = lt.needs_recall(b, [Item(7, write_only=True, span=x)])
        nursery.cancel_scope.cancel()
    assert (change, read) == (True, True)
