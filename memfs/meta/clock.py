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
stay at or below the kernel's next one, and at or above its last one.  pyfuse3
does not say whether a ``setattr`` time was the kernel's "now" or one the caller
chose, so a time chosen within the last tick counts too; if the kernel never
handed that time out, a ``touch`` in the next tick may look older than our
stamps after it (a caller making up fine-grained "now" times; times copied
from another filesystem were handed out by the kernel).  A floor more than
:data:`LEAD` ahead of the coarse clock (the clock was stepped back) is ignored.
"""

from __future__ import annotations

import time

#: the kernel's coarse realtime clock (5 on Linux; not exported by ``time``)
CLOCK = getattr(time, "CLOCK_REALTIME_COARSE", 5)
#: the most the kernel's floor leads its coarse clock (a tick, 10 ms at HZ=100), with room
LEAD = 20_000_000

_floor = 0


def now_ns() -> int:
    """Now, for a timestamp memfs sets itself."""
    t = time.clock_gettime_ns(CLOCK)
    return _floor if t < _floor < t + LEAD else t


def saw(ns: int) -> None:
    """A time a ``setattr`` set (the kernel's ``touch``, or a time someone chose):
    the floor of :func:`now_ns` from now on if it is *now* on the kernel's clock,
    ahead of the coarse clock and not in the future."""
    global _floor
    if ns > _floor and time.clock_gettime_ns(CLOCK) < ns <= time.time_ns():
        _floor = ns
