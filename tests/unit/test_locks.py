"""The metadata server's lock table and lock calls (memfs.meta.locks), and the
client's waits (memfs.meta.lock_client), without processes or sockets."""

from __future__ import annotations

import collections
import errno
from fcntl import F_RDLCK, F_UNLCK, F_WRLCK
from typing import Any

import pytest
import trio
import trio.testing

from memfs.errors import FsError
from memfs.meta.lock_client import RETRY_EVERY, LockClient
from memfs.meta.locks import (
    BLOCKED_FOR,
    END,
    FLOCK,
    POSIX,
    LockService,
    LockTable,
    Owner,
    valid_lock,
)

A, B = Owner(b"a" * 16, 1), Owner(b"b" * 16, 1)
A2 = Owner(b"a" * 16, 2)  # another owner (process) on A's node


def ranges(t: LockTable, ino: int = 7) -> list[tuple[Any, ...]]:
    return [(r.owner, r.type, r.start, r.end) for r in t._posix.get(ino, [])]


def test_posix_ranges_split_merge_and_conflict_as_in_linux() -> None:
    t = LockTable()
    assert t.lock(7, A, F_WRLCK, 0, 100, 1)
    assert t.lock(7, A, F_UNLCK, 40, 60, 1)  # a hole in the middle
    assert ranges(t) == [(A, F_WRLCK, 0, 40), (A, F_WRLCK, 60, 100)]
    assert t.lock(7, A, F_RDLCK, 40, 60, 1)  # fills it with another type: three ranges
    assert [r[1:] for r in ranges(t)] == [(F_WRLCK, 0, 40), (F_RDLCK, 40, 60), (F_WRLCK, 60, 100)]
    assert t.lock(7, A, F_WRLCK, 30, 70, 1)  # one type again: merged
    assert ranges(t) == [(A, F_WRLCK, 0, 100)]
    assert t.lock(7, A, F_WRLCK, 100, 110, 1)  # touching: merged
    assert ranges(t) == [(A, F_WRLCK, 0, 110)]
    # other owners: a write lock excludes any overlap, not neighbours
    assert not t.lock(7, B, F_RDLCK, 109, 110, 2)
    assert not t.lock(7, A2, F_RDLCK, 0, 1, 3)  # another process of the same node too
    assert t.lock(7, B, F_WRLCK, 110, END, 2)
    assert t.conflicts(7, B, F_RDLCK, 0, 5)[0].owner == A
    assert not t.conflicts(7, B, F_UNLCK, 0, END)
    # read locks share; a write lock over them does not go
    t.lock(7, A, F_UNLCK, 0, END, 1)
    t.lock(7, B, F_UNLCK, 0, END, 2)
    assert t.lock(7, A, F_RDLCK, 0, 10, 1) and t.lock(7, B, F_RDLCK, 5, 15, 2)
    assert not t.lock(7, A, F_WRLCK, 0, 10, 1)  # an upgrade blocked by B's share
    assert t.lock(7, A, F_WRLCK, 0, 5, 1)  # where B has none
    assert len(t) == 3


def test_flock_is_whole_file_and_apart_from_posix_locks() -> None:
    t = LockTable()
    assert t.flock(7, A, F_RDLCK) and t.flock(7, B, F_RDLCK)
    assert not t.flock(7, A, F_WRLCK)  # upgrade blocked by B's share: A's share is gone
    assert t.flock(7, B, F_WRLCK)  # (as in Linux, where two upgraders cannot deadlock)
    assert t.flock(7, B, F_UNLCK) and t.flock(7, A, F_WRLCK)
    assert not t.flock(7, B, F_RDLCK)
    assert t.lock(7, B, F_WRLCK, 0, END, 2)  # POSIX locks do not see flock locks
    assert t.holders(7) == {A.sid, B.sid}
    assert t.unlock(7, A) and not t.unlock(7, A)
    assert t.flock(7, B, F_WRLCK)
    assert t.drop_session(B.sid) == {7} and len(t) == 0


def test_held_lists_what_reclaim_takes_back() -> None:
    t = LockTable()
    t.lock(7, A, F_WRLCK, 0, 10, 1)
    t.lock(8, A, F_RDLCK, 5, END, 1)
    t.flock(9, A2, F_WRLCK)
    t.lock(7, B, F_WRLCK, 10, 20, 2)
    held = t.held(A.sid)
    assert sorted(held) == sorted([[POSIX, 7, 1, F_WRLCK, 0, 10, 1], [POSIX, 8, 1, F_RDLCK, 5, END, 1],
                                   [FLOCK, 9, 2, F_WRLCK, 0, END, 0]])
    assert all(valid_lock(*x) for x in held)
    assert not valid_lock(2, 7, 1, F_WRLCK, 0, 1, 0)
    assert not valid_lock(POSIX, 7, 1, F_UNLCK, 0, 1, 0)
    assert not valid_lock(POSIX, 7, 1, F_WRLCK, 5, 5, 0)


class Fakes:
    def __init__(self) -> None:
        self.silent: set[bytes] = set()
        self.evicted: list[bytes] = []
        self.told: list[tuple[bytes, int]] = []
        self.service = LockService(self.silent.__contains__,
                                   lambda sid, why: self.evicted.append(sid),
                                   lambda sid, ino: self.told.append((sid, ino)))


def test_service_refuses_tells_waiters_and_evicts_silent_holders() -> None:
    f = Fakes()
    s = f.service
    s.call(A.sid, "setlk", [7, 1, F_WRLCK, 0, 0, 100, 0])
    with pytest.raises(FsError) as e:
        s.call(B.sid, "setlk", [7, 1, F_RDLCK, 5, 1, 200, 1])  # would wait
    assert e.value.errno == errno.EAGAIN
    assert s.call(B.sid, "getlk", [7, 1, F_RDLCK, 0, 0, 200]) == [F_WRLCK, 0, 0, 0]
    assert s.call(A.sid, "getlk", [7, 9, F_RDLCK, 0, 0, 300]) == [F_WRLCK, 0, 0, 100]  # same node
    assert s.call(B.sid, "getlk", [7, 1, F_UNLCK, 0, 0, 200])[0] == F_UNLCK
    s.call(A.sid, "setlk", [7, 1, F_WRLCK, 0, 0, 100, 0])  # A takes more: nobody told
    assert f.told == []
    s.call(A.sid, "unlock", [7, 1])
    assert f.told == [(B.sid, 7)]  # once
    s.call(A.sid, "unlock", [7, 1])
    assert f.told == [(B.sid, 7)]
    # a silent holder is evicted and loses every lock when someone else asks
    s.call(A.sid, "flock", [7, 1, F_WRLCK, 0])
    s.call(A.sid, "setlk", [8, 1, F_WRLCK, 0, 0, 100, 0])
    with pytest.raises(FsError):
        s.call(B.sid, "flock", [7, 1, F_RDLCK, 1])
    f.silent.add(A.sid)
    s.call(B.sid, "flock", [7, 1, F_RDLCK, 1])
    assert f.evicted == [A.sid] and s.table.held(A.sid) == [] and s.evictions == 1
    for bad in ([7, 1, 99, 0, 0, 1, 0], [7, 1, F_WRLCK, END, 0, 1, 0], [7, 1, F_WRLCK, -1, 0, 1, 0]):
        with pytest.raises(FsError) as e:
            s.call(B.sid, "setlk", bad)
        assert e.value.errno == errno.EINVAL
    # a session holding a lock in its own way is never evicted for it (a registration
    # reclaims while its own last word is old)
    C = b"c" * 16
    s.call(C, "setlk", [9, 1, F_WRLCK, 20, 10, 1, 0])
    f.silent.add(B.sid)
    claims = [[POSIX, 9, 2, F_RDLCK, 0, 10, 1], [POSIX, 9, 2, F_RDLCK, 25, 1, 1]]
    assert s.reclaim(B.sid, claims, lambda ino: True) == [1]
    assert f.evicted == [A.sid]


def test_reclaim_makes_a_sessions_locks_exactly_what_it_states() -> None:
    f = Fakes()
    s = f.service
    s.call(A.sid, "setlk", [7, 1, F_WRLCK, 0, 10, 100, 0])
    s.call(A.sid, "setlk", [9, 1, F_WRLCK, 0, 10, 100, 0])  # dropped: not stated again
    s.call(B.sid, "setlk", [8, 1, F_WRLCK, 0, 0, 200, 0])
    claims = [[POSIX, 7, 1, F_WRLCK, 0, 10, 100], [POSIX, 8, 1, F_RDLCK, 0, 1, 100],
              [FLOCK, 7, 3, F_RDLCK, 0, END, 0]]
    bad = [POSIX, 7, 1, F_WRLCK, END, END, 100]  # makes no sense: refused
    assert s.reclaim(A.sid, [*claims, bad, [POSIX, 6, 1, F_WRLCK, 0, 1, 0]],
                     lambda ino: ino != 6) == [1, 3, 4]  # B holds inode 8; 6 is gone
    assert sorted(s.table.held(A.sid)) == sorted([claims[0], claims[2]])
    assert s.table.held(B.sid) == [[POSIX, 8, 1, F_WRLCK, 0, END, 200]]


async def test_a_waiter_asks_again_when_told_and_when_it_times_out(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    f = Fakes()
    s = f.service
    calls: list[float] = []

    async def call(name: str, *args: int) -> Any:
        calls.append(trio.current_time())
        return s.call(B.sid, name, list(args))

    client = LockClient(B.sid, call)
    s.call(A.sid, "setlk", [7, 1, F_WRLCK, 0, 0, 100, 0])
    with pytest.raises(FsError):
        await client.setlk(7, 1, F_WRLCK, 0, 0, 200, False)
    async with trio.open_nursery() as n:
        n.start_soon(client.setlk, 7, 1, F_WRLCK, 0, 0, 200, True)
        await trio.sleep(2.5 * RETRY_EVERY)  # asked again every RETRY_EVERY
        assert len(calls) == 1 + 3
        s.call(A.sid, "unlock", [7, 1])
        client.unlocked(7)  # what the UNLOCKED frame does
    assert trio.current_time() == pytest.approx(2.5 * RETRY_EVERY)  # at once
    assert client.claims() == [[POSIX, 7, 1, F_WRLCK, 0, END, 200]]
    # cancelled while waiting (the kernel's interrupt): nothing taken
    s.call(A.sid, "flock", [7, 1, F_WRLCK, 0])
    with trio.move_on_after(0.5):
        await client.flock(7, 2, F_WRLCK, True)
    assert s.table.held(B.sid) == [[POSIX, 7, 1, F_WRLCK, 0, END, 200]]
    # a refused flock upgrade loses the shared lock (Linux), here and at the server,
    # whose other waiters are told at once
    s.call(A.sid, "flock", [7, 1, F_UNLCK, 0])
    s.call(A.sid, "flock", [7, 1, F_RDLCK, 0])
    await client.flock(7, 2, F_RDLCK, False)
    with pytest.raises(FsError):
        await client.flock(7, 3, F_WRLCK, False)  # B's other open file: refused, not waiting
    f.told.clear()
    s.waiting[7] = {b"c" * 16}
    with pytest.raises(FsError):
        await client.flock(7, 2, F_WRLCK, False)
    assert f.told == [(b"c" * 16, 7)]
    assert [c for c in client.claims() if c[0] == FLOCK] == []
    assert s.table.holders(7) == {A.sid, B.sid}  # A's share, B's POSIX lock
    client.refused([0], client.claims())  # a claim the server refused: forgotten, logged
    assert client.claims() == []
    assert "lost a POSIX lock on inode 7" in caplog.text


class _FakeLocks:
    def __init__(self, calls: list[tuple[Any, ...]], fail: bool = False) -> None:
        self.calls, self.fail = calls, fail

    async def setlk(self, ino: int, owner: int, *_: Any) -> None:
        self.calls.append(("setlk", ino, owner))

    async def flock(self, ino: int, owner: int, *_: Any) -> None:
        self.calls.append(("flock", ino, owner))

    async def unlock(self, ino: int, owner: int) -> None:
        self.calls.append(("unlock", ino, owner))
        if self.fail:
            raise FsError(errno.EIO, "metadata server gone")


def _operations(locks: _FakeLocks, calls: list[tuple[Any, ...]]) -> Any:
    from memfs.fs import Operations

    class Meta:
        def locks(self) -> _FakeLocks:
            return locks

        async def release(self, ino: int) -> None:
            calls.append(("release", ino))

    class Data:
        async def release(self, ino: int) -> None:
            pass

    ops = Operations.__new__(Operations)
    ops.meta, ops.data = Meta(), Data()  # type: ignore[assignment]
    ops._lock_owners, ops._open_files = {}, set()
    ops._writable_files, ops._writable = set(), collections.Counter()
    return ops


async def test_a_released_open_file_drops_only_its_own_locks(caplog: pytest.LogCaptureFixture) -> None:
    """RELEASE comes after the close, maybe after the process opened the file again
    and locked through the new open file: that owner's locks stay until the new one
    is released.  flock locks belong to memfs's handle, not to the kernel's owner
    (a struct file's address, reused).  A failed unlock still releases the file."""
    calls: list[tuple[Any, ...]] = []
    ops = _operations(_FakeLocks(calls), calls)
    fh1, fh2, fh3 = (5 | n << 40 for n in (1, 2, 3))
    owner = 0xDEAD
    await ops.setlk(fh1, owner, F_WRLCK, 0, 0, 1, False)
    await ops.setlk(fh2, owner, F_WRLCK, 0, 0, 1, False)  # reopened, locked again
    await ops.flock(fh3, owner, 2)  # LOCK_EX, the kernel's owner
    await ops.release(fh1)
    assert ("unlock", 5, owner) not in calls and ("release", 5) in calls
    await ops.release(fh2)
    assert calls[-2:] == [("unlock", 5, owner), ("release", 5)]
    assert ("flock", 5, fh3) in calls
    await ops.release(fh3)
    assert calls[-2:] == [("unlock", 5, fh3), ("release", 5)]
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    calls.clear()
    ops = _operations(_FakeLocks(calls, fail=True), calls)
    await ops.setlk(fh1, owner, F_RDLCK, 0, 0, 1, False)
    await ops.release(fh1)
    assert calls[-2:] == [("unlock", 5, owner), ("release", 5)]


async def test_every_waiter_on_a_file_is_woken_by_one_unlock(
        autojump_clock: trio.testing.MockClock) -> None:
    """Waiters on one file share one wake-up; one whose wait timed out (and asked
    again) does not take it away from the others."""
    f = Fakes()
    s = f.service

    async def call(name: str, *args: int) -> Any:
        return s.call(B.sid, name, list(args))

    client = LockClient(B.sid, call)
    s.call(A.sid, "setlk", [7, 1, F_WRLCK, 0, 0, 100, 0])
    done: dict[int, float] = {}

    async def wait(owner: int, start: float) -> None:
        await trio.sleep(start)
        await client.setlk(7, owner, F_RDLCK, 0, 0, 200, True)
        done[owner] = trio.current_time()

    async with trio.open_nursery() as n:
        n.start_soon(wait, 1, 0.0)
        n.start_soon(wait, 2, 0.5 * RETRY_EVERY)
        await trio.sleep(1.2 * RETRY_EVERY)  # the first has timed out once
        s.call(A.sid, "unlock", [7, 1])
        client.unlocked(7)
    assert done == {1: pytest.approx(1.2 * RETRY_EVERY), 2: pytest.approx(1.2 * RETRY_EVERY)}
    assert client._freed == {} and client._waiters == {}
    assert s.waiting == {}  # both got theirs: nobody left to tell


def test_a_wait_that_would_deadlock_is_edeadlk() -> None:
    """F_SETLKW that closes a cycle of waits is EDEADLK, across sessions and within
    one; a waiter that stopped waiting (unwait, or silent past BLOCKED_FOR) counts
    no more."""
    now = [0.0]
    f = Fakes()
    s = LockService(f.silent.__contains__, lambda sid, why: None, lambda sid, ino: None,
                    lambda: now[0])
    C = b"c" * 16
    s.call(A.sid, "setlk", [7, 1, F_WRLCK, 0, 1, 1, 0])  # A1 holds byte 0
    s.call(B.sid, "setlk", [7, 1, F_WRLCK, 1, 1, 2, 0])  # B1 holds byte 1
    s.call(C, "setlk", [7, 1, F_WRLCK, 2, 1, 3, 0])  # C1 holds byte 2

    def setlkw(sid: bytes, owner: int, start: int) -> int:
        try:
            s.call(sid, "setlk", [7, owner, F_WRLCK, start, 1, 9, 1])
        except FsError as exc:
            return exc.errno
        return 0

    assert setlkw(A.sid, 1, 1) == errno.EAGAIN  # A1 waits for B1
    assert setlkw(B.sid, 1, 2) == errno.EAGAIN  # B1 waits for C1
    assert setlkw(C, 1, 0) == errno.EDEADLK  # C1 -> A1 -> B1 -> C1
    assert setlkw(A2.sid, 2, 0) == errno.EAGAIN  # A2 waits for A1: no cycle
    # B1 stops waiting (interrupted): C1 may wait for A1
    s.call(B.sid, "unwait", [7, 1])
    assert setlkw(C, 1, 0) == errno.EAGAIN
    # ... and a waiter that stopped asking is forgotten after BLOCKED_FOR
    assert setlkw(B.sid, 1, 2) == errno.EDEADLK  # B1 -> C1 -> A1 -> B1
    now[0] += BLOCKED_FOR + 0.1
    assert setlkw(B.sid, 1, 2) == errno.EAGAIN
    # a waiter whose lock was let go (it has not asked again yet) waits for nobody:
    # no false deadlock (the case Linux never reports, its waiter is woken at once)
    now[0] += BLOCKED_FOR + 0.1
    s.call(B.sid, "unlock", [7, 1])  # B1 let byte 1 go
    assert setlkw(A.sid, 1, 1) == 0  # A1 took byte 1 (it waited for it): A1 holds 0, 1
    s.call(A.sid, "setlk", [7, 1, F_UNLCK, 1, 1, 1, 0])
    s.call(B.sid, "setlk", [7, 1, F_WRLCK, 1, 1, 2, 0])
    assert setlkw(A.sid, 1, 1) == errno.EAGAIN  # A1 waits for B1 (byte 1)
    s.call(B.sid, "setlk", [7, 1, F_UNLCK, 1, 1, 2, 0])  # B1 lets it go...
    assert setlkw(B.sid, 1, 0) == errno.EAGAIN  # ...and waits for A1: not a deadlock
    s.call(A.sid, "unlock", [7, 1])
    assert setlkw(B.sid, 1, 0) == 0
    # a lock taken ends the wait; the session's departure too
    s.call(C, "unlock", [7, 1])
    assert setlkw(B.sid, 1, 2) == 0
    assert Owner(B.sid, 1) not in s.blocked
    s.drop_session(A.sid)
    assert not any(o.sid == A.sid for o in s.blocked)
