"""A cluster client's file locks: calls to the metadata server, waits, and what it holds.

The metadata server keeps every client's locks (memfs.meta.locks) and never
waits: a lock in another owner's way is refused.  A caller that would wait
(``F_SETLKW``, ``flock`` without ``LOCK_NB``) asks again when the server says a
lock on that file went (an UNLOCKED frame), and at least every
:data:`RETRY_EVERY` seconds anyway (a frame lost with a connection), until the
kernel interrupts the request (a signal: the wait is cancelled).

What this client holds is kept here as well, in a :class:`LockTable` of its own:
it is stated with every registration, so after a lost connection or a server
restart the server has exactly these again, and those another client took
meanwhile are reported lost (logged: the application is not told).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from memfs.errors import FsError
from memfs.meta.locks import END, F_UNLCK, FLOCK, POSIX, LockTable, Owner, span

log = logging.getLogger(__name__)

#: a waiter asks again at least this often (the UNLOCKED frame is only a hint)
RETRY_EVERY = 1.0
#: an interrupted waiter tells the server it no longer waits, for at most this long
UNWAIT_WITHIN = 1.0


class LockClient:
    """This client's side of the lock calls (memfs.meta.Locks), for session *sid*,
    through *call* (a metadata call: RemoteMeta._call)."""

    def __init__(self, sid: bytes, call: Callable[..., Awaitable[Any]]) -> None:
        self._sid = sid
        self._call = call
        self.held = LockTable()
        #: inode -> set when the server says a lock there went (while anyone waits there)
        self._freed: dict[int, trio.Event] = {}
        #: inode -> calls waiting there
        self._waiters: dict[int, int] = {}

    async def getlk(self, ino: int, owner: int, type_: int, start: int, length: int,
                    pid: int) -> tuple[int, int, int, int]:
        t, s, n, p = await self._call("getlk", ino, _signed(owner), type_, start, length, pid)
        return t, s, n, p

    async def setlk(self, ino: int, owner: int, type_: int, start: int, length: int, pid: int,
                    wait: bool) -> None:
        lo, hi = span(start, length)
        owner = _signed(owner)

        async def attempt() -> None:
            await self._call("setlk", ino, owner, type_, start, length, pid, int(wait))
            self.held.lock(ino, Owner(self._sid, owner), type_, lo, hi, pid)

        try:
            await self._until_taken(ino, attempt, wait)
        except BaseException:
            if wait:  # (interrupted, or EDEADLK): deadlock detection must not count it
                with trio.CancelScope(shield=True), trio.move_on_after(UNWAIT_WITHIN):
                    try:
                        await self._call("unwait", ino, owner)
                    except FsError as exc:
                        log.debug("inode %d: unwait not sent: %s", ino, exc)
            raise

    async def flock(self, ino: int, owner: int, type_: int, wait: bool) -> None:
        owner = _signed(owner)

        async def attempt() -> None:
            o = Owner(self._sid, owner)
            try:
                await self._call("flock", ino, owner, type_, int(wait))
            except FsError as exc:
                if exc.errno == errno.EAGAIN:  # a conversion refused drops the old lock
                    self.held.flock(ino, o, F_UNLCK)
                raise
            self.held.flock(ino, o, type_)

        await self._until_taken(ino, attempt, wait and type_ != F_UNLCK)

    async def unlock(self, ino: int, owner: int) -> None:
        owner = _signed(owner)
        self.held.unlock(ino, Owner(self._sid, owner))
        await self._call("unlock", ino, owner)

    async def _until_taken(self, ino: int, attempt: Callable[[], Awaitable[None]], wait: bool) -> None:
        """*attempt* until it is not refused (EAGAIN); without *wait*, once.

        Each attempt is shielded: one that reached the server must be heard out, or
        a lock taken there would be held by nobody's knowledge.  Cancellation (the
        kernel's interrupt) ends the waits between attempts."""
        if not wait:
            with trio.CancelScope(shield=True):
                await attempt()
            return
        self._waiters[ino] = self._waiters.get(ino, 0) + 1
        try:
            while True:
                freed = self._freed.get(ino)
                if freed is None or freed.is_set():  # (made before asking: none is missed)
                    freed = self._freed[ino] = trio.Event()
                try:
                    with trio.CancelScope(shield=True):
                        await attempt()
                    return
                except FsError as exc:
                    if exc.errno != errno.EAGAIN:
                        raise
                with trio.move_on_after(RETRY_EVERY):
                    await freed.wait()
        finally:
            n = self._waiters[ino] - 1
            if n:
                self._waiters[ino] = n
            else:  # the last waiter there: nobody needs telling
                del self._waiters[ino]
                self._freed.pop(ino, None)

    def unlocked(self, ino: int) -> None:
        """The server says a lock on *ino* went: its waiters ask again."""
        freed = self._freed.pop(ino, None)
        if freed is not None:
            freed.set()

    def claims(self) -> list[list[int]]:
        """What this client holds, as the registration states it."""
        return self.held.held(self._sid)

    def refused(self, positions: list[int], claims: list[list[int]]) -> None:
        """The server refused these claims (another owner took them meanwhile)."""
        for k in positions:
            if not 0 <= k < len(claims):
                continue
            kind, ino, owner, type_, start, end, _ = claims[k]
            log.error("lost a %s lock on inode %d (owner %x, bytes %d-%s): the metadata server "
                      "no longer has it for this client (another client took it while this one "
                      "was cut off, or the file is gone)",
                      "flock" if kind == FLOCK else "POSIX", ino, owner, start,
                      "end" if end >= END else end - 1)
            o = Owner(self._sid, owner)
            if kind == POSIX:
                self.held.lock(ino, o, F_UNLCK, start, end, 0)
            else:
                self.held.flock(ino, o, F_UNLCK)


def _signed(owner: int) -> int:
    """The kernel's 64-bit lock owner as the signed integer the wire carries."""
    return owner - (1 << 64) if owner >= 1 << 63 else owner
