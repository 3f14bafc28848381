"""Files written from several nodes at once: no write leases, recalls by byte range.

A write lease is whole-file, so two nodes writing one file (IOR's shared file,
a checkpoint every rank writes its part of) took it from each other at every
write: each write waited for a recall of the other node, which dropped its
caches and waited for its transfers first (30 MiB/s of 64 KiB writes from 2
nodes, against 312 with a file per process).  Lustre meets the same with
extent locks, and where a resource is contended, stops granting locks for a
while (``contention_seconds``) and lets clients write without them.  This does
the latter:

* a *switch* is a write call (``map_write``, ``allocate_ahead``) of a file by
  another session than the last one, within ``WINDOW`` of it; ``SWITCHES`` of
  them within ``WINDOW`` make the file *contended* until ``HOLD`` after the
  last switch;
* while a file is contended, no write lease is granted for it, and nothing sent
  about it may be cached (attributes, chunk maps): each write asks for its
  chunks, which also sets the size and mtime at the server, and each stat asks;
* a chunk map sent then is used for one transfer, and the receiver's kernel may
  keep the pages it read or wrote with it: the map's range (``spans``, whole
  chunks) is remembered instead of marking the receiver as holding the file.
  Another session's write recalls only the receivers whose ranges overlap it
  (its kernel's pages there would be stale, or its bytes may still be on their
  way), and a read recalls only writers whose ranges overlap it; any other
  change of the file (a truncate, a setattr) recalls every receiver;
* a receiver answers a recall as for any file (its transfers landed, the
  kernel's pages and attributes dropped), which ends its ranges; a recall given
  up on leaves it holding the whole file;
* a session marked writing (bytes it was sent where to write may be on their
  way) with no ranges, or ranges over a read, is recalled by that read, and
  while one is, another session's map is not cached (it would be widened
  over the writer's chunks).

Ranges outlive the contention: they are kept until recalled, and no write lease
is granted while another session has any (the call asking for one recalls
them first).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import NamedTuple

import trio

log = logging.getLogger(__name__)

#: seconds between write calls of two sessions that count as a switch
WINDOW = 1.0
#: switches within WINDOW that make a file contended
SWITCHES = 16
#: seconds a file stays contended after its last switch (Lustre's contention_seconds)
HOLD = 2.0
#: ranges kept per receiver and file; past this, one range covers them all
MAX_SPANS = 64
#: write histories kept before old ones are pruned
_HISTORY = 4096

Span = tuple[int, int]
#: a range that covers the whole file
WHOLE: Span = (0, 1 << 63)


def overlap(spans: list[Span], span: Span | None) -> bool:
    """Does any of *spans* overlap *span* (None: any)?"""
    if span is None:
        return bool(spans)
    lo, hi = span
    return any(a < hi and lo < b for a, b in spans)


class _Turns(NamedTuple):
    """A file's last write call, and the switches counted in the window."""

    writer: object
    at: float
    switches: int
    #: when the window the switches are counted in began
    since: float


class Contention:
    """Which files are contended, and the ranges sent of them; see the module doc."""

    def __init__(self, clock: Callable[[], float] = trio.current_time) -> None:
        self._clock = clock
        #: ino -> until when it is contended
        self.until: dict[int, float] = {}
        #: ino -> its last write call and the switches counted
        self._last: dict[int, _Turns] = {}
        #: ino -> receiver -> ranges of chunk maps sent while contended
        self.spans: dict[int, dict[object, list[Span]]] = {}
        self._pruned = -WINDOW
        #: files that became contended (for status and tests)
        self.started = 0

    def wrote(self, holder: object, ino: int) -> None:
        """A write call of *ino* by *holder*: counts the switches."""
        now = self._clock()
        last = self._last.get(ino)
        if last is None or last.writer is holder:
            self._last[ino] = (_Turns(holder, now, 0, now) if last is None
                               else last._replace(at=now))
            if last is None:
                self._prune(now)
            return
        if now - last.at >= WINDOW:
            self._last[ino] = _Turns(holder, now, 0, now)  # a turn, not a switch
            return
        switches, since = (last.switches, last.since) if now - last.since < WINDOW else (0, now)
        self._last[ino] = _Turns(holder, now, switches + 1, since)
        if switches + 1 >= SWITCHES or self.contended(ino):
            if ino not in self.until:
                self.started += 1
                log.info("inode %d is written from several clients by turns: no write leases "
                         "for it while that goes on (contended)", ino)
            self.until[ino] = now + HOLD
        self._prune(now)

    def count(self) -> int:
        """Files contended now."""
        now = self._clock()
        return sum(1 for until in self.until.values() if until > now)

    def _prune(self, now: float) -> None:
        """Forget the writes older than WINDOW once there are many (at most once per
        WINDOW: a node writing thousands of files a second keeps more)."""
        if len(self._last) > _HISTORY and now - self._pruned >= WINDOW:
            self._pruned = now
            self._last = {i: v for i, v in self._last.items() if now - v.at < WINDOW}

    def contended(self, ino: int) -> bool:
        if not self.until:  # (the common case: asked at every call of a map)
            return False
        until = self.until.get(ino)
        if until is None:
            return False
        if until <= self._clock():
            del self.until[ino]
            return False
        return True

    def sent(self, holder: object, ino: int, span: Span | None) -> None:
        """*holder* was sent a chunk map of *ino* for *span* (None: the whole file).
        Kept sorted and merged (a sequential writer's maps make one range)."""
        per = self.spans.setdefault(ino, {})
        lo, hi = WHOLE if span is None else span
        spans = per.get(holder, [])
        k = bisect.bisect_left(spans, (lo, hi))
        if k and spans[k - 1][1] >= lo:
            k -= 1
        j = k
        while j < len(spans) and spans[j][0] <= hi:
            lo, hi = min(lo, spans[j][0]), max(hi, spans[j][1])
            j += 1
        spans[k:j] = [(lo, hi)]
        if len(spans) > MAX_SPANS:
            spans = [(spans[0][0], spans[-1][1])]
        per[holder] = spans

    def overlaps(self, holder: object, ino: int, span: Span | None) -> bool:
        """Was *holder* sent a map of *ino* overlapping *span* (None: any)?"""
        per = self.spans.get(ino)
        return per is not None and holder in per and overlap(per[holder], span)

    def take(self, holder: object, ino: int) -> None:
        """*holder* is recalled for *ino*: its answer ends what it was sent."""
        per = self.spans.get(ino)
        if per is not None and per.pop(holder, None) is not None and not per:
            del self.spans[ino]

    def forget(self, holder: object) -> None:
        for ino in [i for i, per in self.spans.items() if holder in per]:
            self.take(holder, ino)

    def destroyed(self, ino: int) -> None:
        self.spans.pop(ino, None)
        self.until.pop(ino, None)
        self._last.pop(ino, None)
