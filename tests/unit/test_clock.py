"""memfs.meta.clock: our timestamps never below one the kernel stamped just before."""

from __future__ import annotations

import time

import pytest

from memfs.meta import clock

COARSE = 1_000_000_000_000
FINE = COARSE + 3_000_000  # the fine clock, a tick ahead of the coarse one


@pytest.fixture(autouse=True)
def _clocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clock, "_floor", 0)
    monkeypatch.setattr(time, "clock_gettime_ns", lambda _clock: COARSE)
    monkeypatch.setattr(time, "time_ns", lambda: FINE)


def test_a_kernel_stamp_ahead_of_the_coarse_clock_is_a_floor() -> None:
    assert clock.now_ns() == COARSE
    clock.saw(COARSE + 2_000_000)  # the kernel's touch, from its multigrain floor
    assert clock.now_ns() == COARSE + 2_000_000
    clock.saw(COARSE + 1_000_000)  # an earlier one: the floor stays
    assert clock.now_ns() == COARSE + 2_000_000


def test_old_and_future_times_are_not_floors() -> None:
    clock.saw(COARSE - 10**9)  # a time someone chose, or the coarse clock's own
    clock.saw(COARSE)
    clock.saw(FINE + 1)  # touch -d tomorrow
    assert clock.now_ns() == COARSE


def test_a_floor_far_ahead_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    clock.saw(COARSE + 2_000_000)
    back = COARSE - 60 * 10**9  # the clock stepped back a minute
    monkeypatch.setattr(time, "clock_gettime_ns", lambda _clock: back)
    assert clock.now_ns() == back
