"""Timestamps in the kernel's order.

The kernel stamps ``utimensat(UTIME_NOW)`` (``touch``) on a FUSE file itself,
from its coarse clock, and since Linux 6.13 no earlier than its *multigrain
floor*: fine-grained stamps that other filesystems (ext4, xfs, tmpfs) hand out
when their timestamps are being watched push it up to a tick (4 ms at HZ=250)
past the coarse clock.  memfs stamps its own updates (a write's mtime, a
create, every ctime) from the coarse clock as well (a finer clock would run
ahead of the kernel's next ``touch``), and never below a stamp the kernel has
handed it since: otherwise ``touch b`` and then a write to ``a`` could leave
``a`` older than ``b``, and make would skip a rebuild.

The floor itself cannot be read from userspace; a stamp the kernel set
(:func:`saw`) is a lower bound of it, which is all the order needs: our stamps
stay at or below the kernel's next one, and at or above its last one.
"""

from __future__ import annotations

import time

#: the kernel's coarse realtime clock (5 on Linux; not exported by ``time``)
CLOCK = getattr(time, "CLOCK_REALTIME_COARSE", 5)

_floor = 0


def now_ns() -> int:
    """Now, for a timestamp memfs sets itself."""
    t = time.clock_gettime_ns(CLOCK)
    return t if t >= _floor else _floor


def saw(ns: int) -> None:
    """A timestamp of a ``setattr`` (the kernel's ``touch``, or a time someone
    chose): taken as a floor for :func:`now_ns` if it is *now* on the kernel's
    clock, ahead of the coarse clock and not in the future."""
    global _floor
    if ns > _floor and time.clock_gettime_ns(CLOCK) < ns <= time.time_ns():
        _floor = ns
