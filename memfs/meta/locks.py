"""Cluster-wide file locks: POSIX record locks (``fcntl``) and BSD locks (``flock``).

The metadata server keeps one :class:`LockTable` for every client; a client keeps
one of its own locks (what it reclaims when it registers again).  Pure state, no
I/O: the server decides who may wait and whom to tell (memfs.meta.server).

An owner is a client session and the kernel's lock owner there: the process
(its files table) for POSIX locks, the open file for OFD and flock locks.
POSIX ranges are ``[start, end)`` with :data:`END` for "to the end of the file",
kept sorted and merged per owner as Linux does; flock locks are whole-file,
shared or exclusive.  The two kinds do not conflict with each other (Linux).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfs.errors import FsError

F_RDLCK, F_WRLCK, F_UNLCK = fcntl.F_RDLCK, fcntl.F_WRLCK, fcntl.F_UNLCK
#: the end of a range that runs to the end of the file (``l_len`` 0)
END = (1 << 63) - 1
#: lock kinds, as they travel (registration's reclaim list)
POSIX, FLOCK = 0, 1
#: a waiter asks again at least every memfs.meta.lock_client.RETRY_EVERY (1 s): one
#: refused longer ago than this no longer waits (deadlock detection ignores it)
BLOCKED_FOR = 2.5
#: owners a deadlock check follows at most (Linux: 10 steps)
MAX_DEADLOCK_WALK = 64


@dataclass(frozen=True, slots=True)
class Owner:
    sid: bytes
    owner: int


@dataclass(frozen=True, slots=True)
class Range:
    owner: Owner
    type: int
    start: int
    end: int
    pid: int


def span(start: int, length: int) -> tuple[int, int]:
    """``struct flock``'s (start, length), length 0 to the end, as ``[start, end)``."""
    return start, END if length == 0 else min(END, start + length)


def length_of(start: int, end: int) -> int:
    return 0 if end >= END else end - start


class LockTable:
    """Every lock held on the filesystem, by inode."""

    def __init__(self) -> None:
        self._posix: dict[int, list[Range]] = {}
        self._flock: dict[int, dict[Owner, int]] = {}

    # -- POSIX record locks -------------------------------------------------------------

    def conflicts(self, ino: int, owner: Owner, type_: int, start: int, end: int) -> list[Range]:
        """Other owners' locks that a lock of *type_* on ``[start, end)`` would break."""
        if type_ == F_UNLCK:
            return []
        return [r for r in self._posix.get(ino, ())
                if r.owner != owner and r.start < end and start < r.end
                and (type_ == F_WRLCK or r.type == F_WRLCK)]

    def lock(self, ino: int, owner: Owner, type_: int, start: int, end: int, pid: int) -> bool:
        """Take, change or drop *owner*'s lock on ``[start, end)``: False (nothing
        changed) if another owner's lock is in the way."""
        if self.conflicts(ino, owner, type_, start, end):
            return False
        kept: list[Range] = []
        mine: list[Range] = []
        for r in self._posix.get(ino, ()):
            if r.owner != owner:
                kept.append(r)
                continue
            if r.end <= start or r.start >= end:
                mine.append(r)
                continue
            if r.start < start:  # the parts outside the range stay
                mine.append(Range(owner, r.type, r.start, start, r.pid))
            if r.end > end:
                mine.append(Range(owner, r.type, end, r.end, r.pid))
        if type_ != F_UNLCK:
            mine.append(Range(owner, type_, start, end, pid))
        mine.sort(key=lambda r: r.start)
        merged: list[Range] = []
        for r in mine:  # touching ranges of one type become one, as in Linux
            last = merged[-1] if merged else None
            if last is not None and last.type == r.type and last.end >= r.start:
                merged[-1] = Range(owner, r.type, last.start, max(last.end, r.end), r.pid)
            else:
                merged.append(r)
        ranges = sorted(kept + merged, key=lambda r: (r.start, r.end))
        if ranges:
            self._posix[ino] = ranges
        else:
            self._posix.pop(ino, None)
        return True

    # -- flock locks ------------------------------------------------------------------------

    def flock_conflicts(self, ino: int, owner: Owner, type_: int) -> list[Owner]:
        if type_ == F_UNLCK:
            return []
        return [o for o, t in self._flock.get(ino, {}).items()
                if o != owner and (type_ == F_WRLCK or t == F_WRLCK)]

    def has_flock(self, ino: int, owner: Owner) -> bool:
        return owner in self._flock.get(ino, ())

    def flock(self, ino: int, owner: Owner, type_: int) -> bool:
        """Take, convert or drop *owner*'s flock lock; False if another owner's is in the
        way (a conversion refused has lost the lock it had: Linux's flock(2) too)."""
        held = self._flock.setdefault(ino, {})
        if held.get(owner, type_) != type_:
            del held[owner]  # a conversion drops the old lock first, as in Linux
        ok = not self.flock_conflicts(ino, owner, type_)
        if type_ == F_UNLCK:
            held.pop(owner, None)
        elif ok:
            held[owner] = type_
        if not held:
            del self._flock[ino]
        return ok

    # -- owners and sessions ------------------------------------------------------------

    def holders(self, ino: int) -> set[bytes]:
        """Sessions holding any lock on *ino*."""
        return ({r.owner.sid for r in self._posix.get(ino, ())}
                | {o.sid for o in self._flock.get(ino, {})})

    def unlock(self, ino: int, owner: Owner) -> bool:
        """Drop every lock of *owner* on *ino* (its file was closed); True if it had any."""
        had = False
        ranges = self._posix.get(ino)
        if ranges is not None:
            left = [r for r in ranges if r.owner != owner]
            had = len(left) != len(ranges)
            if left:
                self._posix[ino] = left
            else:
                del self._posix[ino]
        held = self._flock.get(ino)
        if held is not None and owner in held:
            had = True
            del held[owner]
            if not held:
                del self._flock[ino]
        return had

    def drop_session(self, sid: bytes) -> set[int]:
        """Drop every lock of session *sid*: the inodes that had some."""
        touched = set()
        for ino in list(self._posix):
            if any(r.owner.sid == sid for r in self._posix[ino]):
                touched.add(ino)
                left = [r for r in self._posix[ino] if r.owner.sid != sid]
                if left:
                    self._posix[ino] = left
                else:
                    del self._posix[ino]
        for ino in list(self._flock):
            held = self._flock[ino]
            gone = [o for o in held if o.sid == sid]
            if gone:
                touched.add(ino)
                for o in gone:
                    del held[o]
                if not held:
                    del self._flock[ino]
        return touched

    def drop_inode(self, ino: int) -> None:
        self._posix.pop(ino, None)
        self._flock.pop(ino, None)

    def held(self, sid: bytes) -> list[list[int]]:
        """Session *sid*'s locks as ``[kind, ino, owner, type, start, end, pid]``."""
        out = [[POSIX, ino, r.owner.owner, r.type, r.start, r.end, r.pid]
               for ino, ranges in self._posix.items() for r in ranges if r.owner.sid == sid]
        out += [[FLOCK, ino, o.owner, t, 0, END, 0]
                for ino, held in self._flock.items() for o, t in held.items() if o.sid == sid]
        return out

    def __len__(self) -> int:
        return sum(len(r) for r in self._posix.values()) + sum(len(h) for h in self._flock.values())


class LockService:
    """The metadata server's side of the lock calls (``getlk``, ``setlk``, ``flock``,
    ``unlock`` and a registration's reclaim), over one :class:`LockTable`.

    Nobody waits here: a call that finds another owner's lock in the way is
    refused (EAGAIN), and if it would wait, its session is told (*notify*) when a
    lock on that file goes, and asks again.  A lock whose session has not been
    heard from for a while (*stale*: a dead, stopped or cut-off client) does not
    stand in anyone's way: that session is evicted (*evict*) and loses every lock.
    A POSIX wait that would close a cycle of waits is EDEADLK (:attr:`blocked`).
    """

    def __init__(
        self, stale: Callable[[bytes], bool], evict: Callable[[bytes, str], None],
        notify: Callable[[bytes, int], None], clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = LockTable()
        self._stale = stale
        self._evict = evict
        self._notify = notify
        self._clock = clock
        #: POSIX owners refused a lock they wait for -> (inode, type, start, end, when):
        #: what deadlock detection follows (to whoever is in that lock's way now); an
        #: owner that asks again no later than BLOCKED_FOR after its last refusal
        #: still waits
        self.blocked: dict[Owner, tuple[int, int, int, int, float]] = {}
        #: inode -> sessions refused a lock they wait for (told once when one goes)
        self.waiting: dict[int, set[bytes]] = {}
        #: sessions evicted for holding a lock while silent
        self.evictions = 0

    def call(self, sid: bytes, name: str, args: list[int]) -> Any:
        """One lock call of session *sid*; FsError EAGAIN, EDEADLK, EINVAL."""
        ino, owner = args[0], Owner(sid, args[1])
        if name == "unwait":
            self._unblock(owner, ino)
            return None
        if name == "unlock":
            self._unblock(owner, ino)
            if self.table.unlock(ino, owner):
                self._changed(ino)
            return None
        if name == "flock":
            type_, wait = args[2], args[3]
            _check_type(type_)
            had = self.table.has_flock(ino, owner)
            if not self._retrying(ino, sid, lambda: self.table.flock(ino, owner, type_)):
                if had:  # a conversion refused: the old lock went
                    self._changed(ino)
                self._refuse(ino, sid, wait)
            self._taken(ino, sid)
            if type_ != F_WRLCK:  # an exclusive lock frees nothing
                self._changed(ino)
            return None
        type_, start, length, pid = args[2:6]
        _check_type(type_)
        if not 0 <= start < END or length < 0:
            raise FsError(errno.EINVAL, f"lock range {start}+{length} is out of range")
        lo, hi = span(start, length)
        if name == "getlk":
            found = self.table.conflicts(ino, owner, type_, lo, hi)
            if found and self._expire(ino, sid):
                found = self.table.conflicts(ino, owner, type_, lo, hi)
            if not found:
                return [F_UNLCK, start, length, pid]
            r = found[0]
            # A process of another node has no pid here (the kernel shows 0).
            return [r.type, r.start, length_of(r.start, r.end), r.pid if r.owner.sid == sid else 0]
        if not self._retrying(ino, sid, lambda: self.table.lock(ino, owner, type_, lo, hi, pid)):
            if args[6]:
                self._check_deadlock(ino, owner, type_, lo, hi)
            self._refuse(ino, sid, args[6])
        self._unblock(owner, ino)
        self._taken(ino, sid)
        if type_ != F_WRLCK:
            self._changed(ino)
        return None

    def _check_deadlock(self, ino: int, owner: Owner, type_: int, lo: int, hi: int) -> None:
        """EDEADLK if an owner in *owner*'s way waits, through others maybe, for
        *owner* (as Linux's F_SETLKW, across nodes); else *owner* waits from now."""
        now = self._clock()
        seen: set[Owner] = set()
        todo = [r.owner for r in self.table.conflicts(ino, owner, type_, lo, hi)]
        while todo and len(seen) < MAX_DEADLOCK_WALK:
            b = todo.pop()
            if b == owner:
                self.blocked.pop(owner, None)
                raise FsError(errno.EDEADLK, f"inode {ino}: waiting would deadlock")
            if b in seen:
                continue
            seen.add(b)
            entry = self.blocked.get(b)
            if entry is not None and now - entry[4] <= BLOCKED_FOR:
                # whoever is in its way now (one that let go since is not waited for)
                w_ino, w_type, w_lo, w_hi, _ = entry
                todo.extend(r.owner for r in self.table.conflicts(w_ino, b, w_type, w_lo, w_hi))
        self.blocked[owner] = (ino, type_, lo, hi, now)

    def _unblock(self, owner: Owner, ino: int) -> None:
        """*owner* no longer waits for a lock on *ino* (it got one, or let go there)."""
        if self.blocked.get(owner, (0,))[0] == ino:
            del self.blocked[owner]

    def reclaim(self, sid: bytes, locks: list[list[int]], exists: Callable[[int], bool]) -> list[int]:
        """Make session *sid*'s locks exactly *locks* (as :meth:`LockTable.held` lists
        them: what its client holds, stated when it registers): the positions of those
        another owner holds now (lost by the client: it was cut off long enough, or the
        server restarted and another client took them first) or on files that no
        longer *exist*."""
        touched = self.table.drop_session(sid)
        refused = []
        for k, (kind, ino, owner, type_, start, end, pid) in enumerate(locks):
            o = Owner(sid, owner)
            if not valid_lock(kind, ino, owner, type_, start, end, pid) or not exists(ino):
                ok = False  # (a lock that makes no sense: refused as well)
            elif kind == FLOCK:
                ok = self._retrying(ino, sid, functools.partial(self.table.flock, ino, o, type_))
            else:
                ok = self._retrying(ino, sid, functools.partial(self.table.lock, ino, o, type_,
                                                                 start, end, pid))
            if not ok:
                refused.append(k)
        for ino in touched:
            self._changed(ino)
        return refused

    def drop_inode(self, ino: int) -> None:
        """*ino* no longer exists."""
        self.table.drop_inode(ino)
        self.waiting.pop(ino, None)
        for o in [o for o, entry in self.blocked.items() if entry[0] == ino]:
            del self.blocked[o]

    def drop_session(self, sid: bytes) -> None:
        """Session *sid* is gone (expired, unmounted): its locks go."""
        for o in [o for o in self.blocked if o.sid == sid]:
            del self.blocked[o]
        for ino in self.table.drop_session(sid):
            self._changed(ino)
        for ino in list(self.waiting):
            self._taken(ino, sid)

    def _retrying(self, ino: int, sid: bytes, attempt: Callable[[], bool]) -> bool:
        return attempt() or (self._expire(ino, sid) and attempt())

    def _expire(self, ino: int, sid: bytes) -> bool:
        """Drop the locks on *ino* of other sessions gone silent (evicted); True if any."""
        dropped = False
        for holder in self.table.holders(ino) - {sid}:
            if self._stale(holder):
                self._evict(holder, "it holds a lock another client asked for, and has "
                                    "not been heard from within its lease term")
                self.evictions += 1
                self.drop_session(holder)
                dropped = True
        return dropped

    def _taken(self, ino: int, sid: bytes) -> None:
        """*sid* got what it asked for on *ino*: it waits there no more (unless
        another of its calls does: that one is told, and asks again, in vain)."""
        sids = self.waiting.get(ino)
        if sids is not None:
            sids.discard(sid)
            if not sids:
                del self.waiting[ino]

    def _refuse(self, ino: int, sid: bytes, wait: int) -> None:
        if wait:
            self.waiting.setdefault(ino, set()).add(sid)
        raise FsError(errno.EAGAIN, f"inode {ino}: another owner's lock is in the way")

    def _changed(self, ino: int) -> None:
        for sid in self.waiting.pop(ino, ()):
            self._notify(sid, ino)


def _check_type(type_: int) -> None:
    if type_ not in (F_RDLCK, F_WRLCK, F_UNLCK):
        raise FsError(errno.EINVAL, f"lock type {type_} is not F_RDLCK, F_WRLCK or F_UNLCK")


def valid_lock(kind: int, ino: int, owner: int, type_: int, start: int, end: int, pid: int) -> bool:
    """Whether a lock as :meth:`LockTable.held` lists it makes sense."""
    return kind in (POSIX, FLOCK) and type_ in (F_RDLCK, F_WRLCK) and 0 <= start < end <= END
