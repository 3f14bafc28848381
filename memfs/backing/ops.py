"""Typed values that cross the burst buffer's parts: namespace operations, errors."""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from memfs.backing.status import BackingError
from memfs.errors import FsError

log = logging.getLogger(__name__)

#: errors kept for ``memfs status`` (oldest dropped first)
MAX_ERRORS = 20


class NsKind(enum.Enum):
    """A change of DIR's namespace, mirrored from memfs in the order it happened."""

    MKDIR = "mkdir"
    SYMLINK = "symlink"
    MKNOD = "mknod"
    UNLINK = "unlink"
    RMDIR = "rmdir"
    RENAME = "rename"
    EXCHANGE = "exchange"
    #: mode, owner and mtime of a clean file (a dirty one's copy carries them)
    ATTRS = "attrs"


@dataclass(eq=False, slots=True)
class NsOp:
    """One namespace operation; paths are relative to DIR, as they were when it happened."""

    kind: NsKind
    path: bytes
    path2: bytes = b""
    mode: int = 0
    uid: int = -1
    gid: int = -1
    mtime_ns: int = 0
    target: bytes = b""
    rdev: int = 0
    #: an inode that must be fetched whole (from ``keep_from``, else ``path``) before
    #: this op removes its copy in DIR
    keep: int = 0
    keep_from: bytes = b""
    #: EXCHANGE with a journal: which renames it takes (:data:`EXCHANGE_PLANS`) and how
    #: many are done, so that one cut short by a crash resumes instead of swapping back
    plan: int = 0
    step: int = 0

    def to_plain(self) -> list[Any]:
        return [self.kind.value, self.path, self.path2, self.mode, self.uid, self.gid,
                self.mtime_ns, self.target, self.rdev, self.keep, self.keep_from,
                self.plan, self.step]

    @classmethod
    def from_plain(cls, v: list[Any]) -> NsOp:
        (kind, path, path2, mode, uid, gid, mtime_ns, target, rdev, keep, keep_from,
         plan, step) = v
        return cls(NsKind(kind), path, path2, mode, uid, gid, mtime_ns, target, rdev, keep,
                   keep_from, plan, step)


#: EXCHANGE plans: the renames (source, destination) that swap ``a`` and ``b`` in DIR,
#: by which of them exist there ("s" is a swap name of the journal's own)
EXCHANGE_PLANS: dict[int, tuple[tuple[str, str], ...]] = {
    1: (("a", "s"), ("b", "a"), ("s", "b")),  # both exist
    2: (("a", "b"),),  # only a (b was never written back)
    3: (("b", "a"),),  # only b
    4: (),  # neither
}

#: records of the burst buffer's own (replayed by :mod:`memfs.backing.recovery`)
WRITTEN_BACK = "_wb"  # [ino]: the file's current version is in DIR
NS_DONE = "_nsdone"  # []: the head of the namespace queue is applied
NS_STEP = "_nsstep"  # [plan, step]: the head EXCHANGE took its plan / did a rename


class Recorder(Protocol):
    """Where the burst buffer records what it did to DIR (the mds journal), and waits
    until that is durable before the next change to DIR."""

    @property
    def journaled(self) -> bool: ...
    def note(self, kind: str, args: list[Any]) -> None: ...
    async def durable(self) -> None: ...


class NoRecord:
    """No journal: nothing to record, nothing to wait for."""

    journaled = False

    def note(self, kind: str, args: list[Any]) -> None:
        pass

    async def durable(self) -> None:
        pass


class Retry(Exception):
    """The backing directory failed; try again later (already recorded)."""


@dataclass
class _Record:
    error: str
    count: int = 0
    last: float = 0.0
    logged: float = 0.0


class ErrorLog:
    """Failures shown by ``memfs status``: per path, the latest error and how often;
    logged at most once a minute per path."""

    def __init__(self, wallclock: Callable[[], float] = time.time) -> None:
        self.wallclock = wallclock
        self._records: dict[str, _Record] = {}

    def record(self, path: bytes, what: str, exc: OSError | FsError) -> None:
        p = os.fsdecode(path)
        msg = f"{what}: {exc.strerror if isinstance(exc, OSError) else exc.args[1]}"
        rec = self._records.get(p)
        now = self.wallclock()
        if rec is None or rec.error != msg:
            rec = self._add(p, msg)
        rec.count += 1
        rec.last = now
        if now - rec.logged >= 60:
            rec.logged = now
            if what == "read":
                log.warning("backing directory: %s: %s", p, msg)
            else:
                log.warning("backing directory: %s: %s (data kept in memory, retrying)", p, msg)

    def bug(self, what: str, exc: Exception) -> None:
        """An unexpected error in background work: logged with its traceback and shown
        as ``(internal) WHAT``; the caller keeps the data and carries on."""
        log.error("%s failed (a bug; the data is kept and the work retried)", what, exc_info=exc)
        key = f"(internal) {what}"
        rec = self._records.get(key) or self._add(key, "")
        rec.error = f"{exc!r}"
        rec.count += 1
        rec.last = rec.logged = self.wallclock()

    def clear(self, path: bytes) -> None:
        p = os.fsdecode(path)
        rec = self._records.pop(p, None)
        if rec is not None:
            log.info("backing directory: %s written back after %d failures", p, rec.count)

    def _add(self, key: str, msg: str) -> _Record:
        rec = self._records[key] = _Record(msg)
        while len(self._records) > MAX_ERRORS:
            del self._records[next(iter(self._records))]
        return rec

    def __bool__(self) -> bool:
        return bool(self._records)

    def entries(self, paths: set[str] | None = None) -> list[BackingError]:
        """All errors, oldest first; or those of *paths* (all, if none match)."""
        out = [BackingError(p, r.error, r.count, r.last) for p, r in self._records.items()
               if not paths or p in paths]
        return sorted(out, key=lambda e: e.last)
