"""The burst buffer's state as typed values, one spelling for every reader.

The mount daemon (or ``memfs mds``) builds a :class:`BackingStatus`; the
control socket carries it as JSON (:meth:`BackingStatus.to_json`); ``memfs
status``, ``memfs umount``, the metrics endpoint and the tests read it back with
:meth:`BackingStatus.from_json`, which tolerates missing or ill-typed fields (a
daemon of another version) by keeping the defaults.  No trio here: the CLI
imports this without the daemon's dependencies.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BackingError:
    """A path whose write-back (or read from DIR) keeps failing, or ``(internal) WHAT``
    for a bug in background work."""

    path: str
    error: str
    count: int = 1
    #: wall-clock time (``time.time()``) of the last failure
    last: float = 0.0


@dataclass(frozen=True, slots=True)
class BackingStatus:
    """What ``memfs status`` shows (sizes in bytes, rates in bytes/s)."""

    backing: str = "?"
    capacity: int = 0
    used: int = 0
    dirty_bytes: int = 0
    dirty_files: int = 0
    dirty_max: int = 0
    pinned_bytes: int = 0
    pinned_files: int = 0
    queued_files: int = 0
    flushing_files: int = 0
    namespace_ops: int = 0
    flush_rate: float = 0.0
    flushed_bytes: int = 0
    flushed_files: int = 0
    resident_files: int = 0
    evicted_files: int = 0
    evicted_bytes_total: int = 0
    fetched_bytes: int = 0
    staging_files: int = 0
    staging_bytes: int = 0
    writers_waiting: int = 0
    draining: bool = False
    flush_delay: float = 0.0
    workers: int = 0
    errors: tuple[BackingError, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["errors"] = [dataclasses.asdict(e) for e in self.errors]
        return out

    @classmethod
    def from_json(cls, data: object) -> BackingStatus:
        return _typed(cls, data)

    def gauges(self, prefix: str) -> dict[str, float]:
        """The numbers, as Prometheus gauge values named PREFIX_FIELD."""
        return {
            f"{prefix}_{f.name}": float(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.type in ("int", "float")
        }


@dataclass(frozen=True, slots=True)
class TicketProgress:
    """How far a ``memfs flush`` / ``memfs stage-in`` request has got."""

    done: bool = False
    files: int = 0
    bytes: int = 0
    total_files: int = 0
    total_bytes: int = 0
    #: stage-in: files whose fetch failed (``path``, ``error``)
    failed: tuple[BackingError, ...] = ()
    #: write-back errors of the files this request waits for
    errors: tuple[BackingError, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["failed"] = [{"path": e.path, "error": e.error} for e in self.failed]
        out["errors"] = [dataclasses.asdict(e) for e in self.errors]
        return out

    @classmethod
    def from_json(cls, data: object) -> TicketProgress:
        return _typed(cls, data)


_LISTS = {"errors", "failed"}


def _typed(cls: type[T], data: object) -> T:
    """*cls* from a JSON object: fields of the wrong type (or missing) keep defaults."""
    if not isinstance(data, dict):
        return cls()
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        v = data[f.name]
        if f.name in _LISTS:
            kw[f.name] = tuple(_error(e) for e in v if isinstance(e, dict)) if isinstance(v, list) else ()
        elif f.type == "bool":
            if isinstance(v, bool):
                kw[f.name] = v
        elif f.type == "int":
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                kw[f.name] = int(v)
        elif f.type == "float":
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                kw[f.name] = float(v)
        elif f.type == "str" and isinstance(v, str):
            kw[f.name] = v
    return cls(**kw)


def _error(e: dict[str, Any]) -> BackingError:
    count, last = e.get("count", 1), e.get("last", 0.0)
    return BackingError(
        path=str(e.get("path") or ""), error=str(e.get("error") or ""),
        count=count if isinstance(count, int) and not isinstance(count, bool) else 1,
        last=float(last) if isinstance(last, (int, float)) and math.isfinite(last) else 0.0,
    )


