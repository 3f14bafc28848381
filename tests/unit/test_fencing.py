"""The mds's fences (memfs.meta.fencing.Fencing) with the transports' shared
``Fences`` and no memory server: servers confirm by hand, time is the mock clock."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from memfs.meta.fencing import FENCE_TIMEOUT, Fencing
from memfs.transport.tcp import Fences


def fencing(*servers: str) -> Fencing:
    f = Fencing()
    f.fences = Fences(list(servers))
    return f


async def test_a_write_grant_waits_for_fences_begun_before_it_not_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    f = fencing("a:1", "b:1")
    async with trio.open_nursery() as nursery:
        f.begin(nursery, 0x11)
        before = f.seq
        assert f.busy and f.fences is not None and f.fences.waiting(0x11) == ["a:1", "b:1"]
        waited = trio.Event()

        async def grant() -> None:
            assert await f.wait_begun(before)
            waited.set()

        f.begin(nursery, 0x22)  # begun after the grant's call looked: not its to wait for
        nursery.start_soon(grant)
        await trio.sleep(0.5)
        f.fences.confirmed("a:1", 0x11)
        await trio.sleep(0.5)
        assert not waited.is_set()  # b:1 has not confirmed 0x11 yet
        f.fences.confirmed("b:1", 0x11)
        with trio.fail_after(1):
            await waited.wait()
        assert f.busy  # 0x22 is still out
        for name in ("a:1", "b:1"):
            f.fences.confirmed(name, 0x22)
        await trio.sleep(1)
        assert not f.busy and f.unconfirmed() == 0
        assert not await f.wait_begun(f.seq)  # nothing left to wait for


async def test_a_server_that_never_confirms_is_given_up_on_and_stays_pending(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    f = fencing("up:1", "down:1")
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        f.begin(nursery, 0x33)
        assert f.fences is not None
        f.fences.confirmed("up:1", 0x33)
        assert await f.wait_begun(f.seq)
        assert FENCE_TIMEOUT <= trio.current_time() - start < FENCE_TIMEOUT + 1
    # Writes go ahead, but the server still gets the fence before anything else.
    assert not f.busy and f.unconfirmed() == 1 and f.fences.waiting(0x33) == ["down:1"]
    assert "down:1 have not confirmed its fence" in caplog.text


async def test_without_memory_servers_nothing_is_fenced() -> None:
    f = Fencing()
    async with trio.open_nursery() as nursery:
        f.begin(nursery, 0x44)
    assert f.seq == 0 and not f.busy and f.unconfirmed() == 0
