"""The namespace mirror: memfs's namespace changes applied to DIR, in order.

Operations (:class:`memfs.backing.ops.NsOp`) are queued by the tracker as they
happen, with the paths of that moment, and applied strictly in order by one
task, or by whoever holds :attr:`NamespaceMirror.lock` (a write-back worker
publishes a file only after every earlier operation, under the same lock, so a
file always lands at the path it has in memfs at that moment).  An operation
that DIR already contradicts (ENOENT, EEXIST... : a file never written back, a
directory someone else filled) is skipped; any other error keeps it at the head
of the queue and is retried with back-off.
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from memfs.backing import faults
from memfs.backing.dirside import BackingDir, in_thread
from memfs.backing.ops import (
    EXCHANGE_PLANS,
    NS_DONE,
    NS_STEP,
    ErrorLog,
    NoRecord,
    NsKind,
    NsOp,
    Recorder,
    Retry,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BACKOFF = 30.0
#: errors of a namespace operation that mean DIR already differs from what we expected
#: (a file that was never written back, a directory someone else filled): nothing to retry
SKIP_ERRNOS = {errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR,
               errno.EXDEV, errno.EINVAL}


class NamespaceMirror:
    """The ordered queue of namespace operations and the task that applies them."""

    def __init__(self, dirside: BackingDir, errors: ErrorLog) -> None:
        self.dirside = dirside
        self.errors = errors
        #: fetch an op's ``keep`` inode before its copy in DIR goes (set by residency)
        self.keep: Callable[[NsOp], Awaitable[None]] | None = None
        self.ops: collections.deque[NsOp] = collections.deque()
        self.queued = 0  # operations ever queued
        self.applied = 0  # ... and applied (or found moot)
        #: held while applying operations and while publishing a file (see module doc)
        self.lock = trio.Lock()
        #: the mds journal (memfs.backing.recovery): what was applied is recorded, and
        #: each change to DIR waits until everything before it is durable
        self.recorder: Recorder = NoRecord()
        #: with a journal: where EXCHANGE parks a copy (outside any daemon's own
        #: temporary directory, which a restart removes)
        self.swap_dir = b""
        #: set while a DIR call made under the lock, whose caller gave up, still runs
        self._inflight: trio.Event | None = None
        self._wake = trio.Event()
        self._retry = trio.Event()  # `memfs flush`, unmount: retry now

    def queue(self, op: NsOp) -> None:
        self.ops.append(op)
        self.queued += 1
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def retry_now(self) -> None:
        """Skip the back-off (``memfs flush``, unmount)."""
        self._retry.set()
        self._wake.set()

    def touches(self, path: bytes) -> bool:
        """Does a queued operation name *path* or a directory above it?"""
        for op in self.ops:
            for p in (op.path, op.path2):
                if p and (p == path or path.startswith(p + b"/")):
                    return True
        return False

    async def dir_call(
        self, fn: Callable[..., T], *args: Any, applied: Callable[[], None] | None = None,
    ) -> T:
        """A change to DIR made holding :attr:`lock`.  If its caller is cancelled while
        it runs (a client's call past its deadline, shutdown), the lock goes free but
        the syscall does not stop: the next holder first waits for it to end
        (:meth:`settle`), and *applied* runs if it succeeded, so it is not made twice."""
        done = trio.Event()

        def after(ok: bool) -> None:
            if ok and applied is not None:
                applied()
            done.set()

        try:
            return await in_thread(fn, *args, after=after, on_skipped=done.set)
        except trio.Cancelled:
            self._inflight = done
            raise

    async def settle(self) -> None:
        """Wait until a DIR call whose caller gave up holding the lock has ended."""
        if self._inflight is not None:
            await self._inflight.wait()
            self._inflight = None

    def _done(self, op: NsOp) -> None:
        """*op* is in DIR (or moot): off the queue, recorded as applied."""
        if self.ops and self.ops[0] is op:
            self.ops.popleft()
            self.applied += 1
            self.recorder.note(NS_DONE, [])
            self.errors.clear(op.path)

    async def apply_all(self) -> None:
        """Apply every queued operation, in order (hold :attr:`lock`).  Raises
        :class:`Retry` when DIR fails (the operation stays at the head)."""
        while True:
            await self.settle()
            if not self.ops:
                return
            op = self.ops[0]
            if op.keep and self.keep is not None:
                await self.keep(op)
            # A crash may lose what follows, never what DIR already shows: the change
            # that made this operation, the fetch of its `keep`, the operations before.
            await self.recorder.durable()
            try:
                if op.kind is NsKind.EXCHANGE and self.recorder.journaled:
                    await self._exchange_in_steps(op)
                else:
                    await self.dir_call(self.dirside.apply, op, applied=functools.partial(self._done, op))
            except OSError as exc:
                if exc.errno not in SKIP_ERRNOS:
                    self.errors.record(op.path, op.kind.value, exc)
                    raise Retry() from None
                log.debug("%s %r: %s (skipped)", op.kind.value, op.path, exc.strerror)
            faults.kill_at(f"kill-after-ns:{op.kind.value}")
            self._done(op)

    async def _exchange_in_steps(self, op: NsOp) -> None:
        """RENAME_EXCHANGE as single renames, each recorded before the next: replayed
        after a crash, it goes on from where it was instead of swapping back."""
        if not op.plan:
            op.plan = await self.dir_call(self.dirside.exchange_plan, op)
            self.recorder.note(NS_STEP, [op.plan, 0])
            await self.recorder.durable()

        def stepped() -> None:
            op.step += 1
            self.recorder.note(NS_STEP, [op.plan, op.step])

        while op.step < len(EXCHANGE_PLANS[op.plan]):
            await self.dir_call(self.dirside.exchange_step, op, self.swap_dir, applied=stepped)
            stepped()
            await self.recorder.durable()

    async def run(self) -> None:
        """Apply operations as they come; back off while DIR fails.  A bug in a
        pass is logged and shown by status; the queue is kept, so nothing is lost."""
        failures = 0
        while True:
            if not self.ops:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            if faults.HOLD:
                await trio.sleep_forever()
            try:
                async with self.lock:
                    await self.apply_all()
                failures = 0
                continue
            except Retry:
                pass
            except Exception as exc:
                self.errors.bug("namespace mirror", exc)
            failures += 1
            # Back off, but `memfs flush` and unmount try again at once.
            with trio.move_on_after(min(MAX_BACKOFF, 0.5 * 2 ** min(failures, 10))):
                await self._retry.wait()
            if self._retry.is_set():
                self._retry = trio.Event()
                failures = 0
