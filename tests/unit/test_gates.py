"""Per-file gates of a burst-buffer mds's calls that may wait inside their change
(memfs.meta.gates), driven alone on trio's autojump clock."""

from __future__ import annotations

import errno
from typing import Any

import pytest
import trio
import trio.testing

from memfs.errors import FsError
from memfs.meta.gates import CHANGE, CUT, READ, ChangeGates
from memfs.meta.leases import LeaseTable

#: three sessions (holders: only their identity matters here)
A: Any = object()
B: Any = object()
C: Any = object()


def gates() -> ChangeGates:
    return ChangeGates(LeaseTable())


async def entered(g: ChangeGates, session: Any, mode: str, wait: float = 1.0) -> bool:
    """Did *session* get in within *wait* seconds?  (It stays in.)"""
    try:
        await g.enter(session, 7, mode=mode, deadline=trio.current_time() + wait)
    except FsError as exc:
        assert exc.errno == errno.EINPROGRESS
        return False
    return True


async def test_readers_share_and_changes_do_not_wait_for_them(
    autojump_clock: trio.abc.Clock,
) -> None:
    g = gates()
    assert await entered(g, A, READ) and await entered(g, B, READ)
    assert await entered(g, C, CHANGE)  # frees none of the file's chunks
    assert await entered(g, A, READ)  # maps may still be read
    assert not await entered(g, B, CHANGE), "one session's change at a time"
    assert not g.leases.register(A, [7]), "not cacheable while C's change runs"
    assert g.leases.register(C, [7]), "but the changer's own replies are"


async def test_a_cut_waits_for_readers_and_keeps_new_ones_out(
    autojump_clock: trio.abc.Clock,
) -> None:
    g = gates()
    assert await entered(g, A, READ)
    order: list[str] = []

    async def cut() -> None:
        await g.enter(B, 7, mode=CUT, deadline=trio.current_time() + 10)
        order.append("cut")
        await trio.sleep(1)
        g.leave(B, 7, mode=CUT)

    async def late_reader() -> None:
        await g.enter(C, 7, mode=READ, deadline=trio.current_time() + 10)
        order.append("reader")
        g.leave(C, 7, mode=READ)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cut)
        await trio.sleep(0.5)
        nursery.start_soon(late_reader)  # behind the waiting cut, not ahead of it
        await trio.sleep(0.5)
        assert order == []
        g.leave(A, 7, mode=READ)
    assert order == ["cut", "reader"]
    assert not g._gates, "nothing left behind"


async def test_a_session_never_waits_for_itself(autojump_clock: trio.abc.Clock) -> None:
    g = gates()
    assert await entered(g, A, READ)
    assert await entered(g, A, CUT)
    assert await entered(g, A, CHANGE)
    assert await entered(g, A, READ)


async def test_given_up_and_cancelled_waits_leave_nothing_behind(
    autojump_clock: trio.abc.Clock,
) -> None:
    g = gates()
    assert await entered(g, A, CUT)
    start = trio.current_time()
    assert not await entered(g, B, READ, wait=3.0)
    assert trio.current_time() - start == pytest.approx(3.0)
    with trio.move_on_after(1):
        await g.enter(B, 7, mode=CUT, deadline=trio.current_time() + 10)
    g.leave(A, 7, mode=CUT)
    assert not g._gates
    assert g.leases.register(B, [7]), "A's change is over: cacheable again"


async def test_cuts_of_two_sessions_both_get_in(autojump_clock: trio.abc.Clock) -> None:
    """Two cuts waiting at once (for a reader) do not hold each other off, and a
    change waits behind them."""
    g = gates()
    assert await entered(g, C, READ)
    done: list[object] = []

    async def cut(session: Any) -> None:
        await g.enter(session, 7, mode=CUT, deadline=trio.current_time() + 10)
        done.append(session)
        await trio.sleep(0.1)
        g.leave(session, 7, mode=CUT)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cut, A)
        nursery.start_soon(cut, B)
        await trio.sleep(0.5)
        assert not await entered(g, C, CHANGE, wait=0.1)  # behind the waiting cuts
        g.leave(C, 7, mode=READ)
    assert sorted(map(id, done)) == sorted(map(id, (A, B)))
    assert not g._gates
