"""memfs.meta.clock: our timestamps never below one the kernel stamped just before."""

from __future__ import annotations

import time

import pytest

from memfs.meta import clock


@pytest.fixture(autouse=True)
def _fresh_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clock, "_floor", 0)


def test_a_kernel_stamp_ahead_of_the_coarse_clock_is_a_floor() -> None:
    ahead = time.clock_gettime_ns(clock.CLOCK) + 2_000_000  # the multigrain floor's lead
    while time.time_ns() < ahead:  # (until it is no longer in the future)
        time.sleep(0.0005)
    clock.saw(ahead)
    assert clock.now_ns() >= ahead


def test_old_and_future_times_are_not_floors() -> None:
    now = time.time_ns()
    clock.saw(now - 10**9)  # a time someone chose, or the coarse clock's own
    clock.saw(now + 10**9)  # touch -d tomorrow
    assert clock.now_ns() <= time.clock_gettime_ns(clock.CLOCK)
