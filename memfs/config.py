"""Parsing of user-supplied sizes and pool parameters."""

from __future__ import annotations

import re
from dataclasses import dataclass

from memfs.errors import UsageError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str, what: str = "size") -> int:
    """Parse ``4G``, ``512M``, ``64KiB`` or a plain byte count (binary units)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise UsageError(f"bad {what} {text!r}: expected a number with an optional K/M/G/T suffix")
    value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise UsageError(f"bad {what} {text!r}: must be positive")
    return value


def format_size(n: int) -> str:
    """The shortest exact binary-unit spelling of *n* (``1M``, ``65536`` -> ``64K``)."""
    for unit in "TGMK":
        mult = _UNITS[unit]
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


@dataclass(frozen=True)
class PoolConfig:
    """Geometry of an embedded pool: *volumes* volumes of *volume_size* bytes each.

    Space is handed out in *chunk_size* units; a chunk never crosses a stripe unit,
    so *stripe_size* must be a multiple of *chunk_size*.
    """

    size: int = 4 << 30
    volumes: int = 4
    stripe_size: int = 1 << 20
    chunk_size: int = 64 << 10

    def __post_init__(self) -> None:
        if not 1 <= self.volumes <= 1024:
            raise UsageError(f"--volumes must be between 1 and 1024, not {self.volumes}")
        if self.chunk_size < 4096 or self.chunk_size & (self.chunk_size - 1):
            raise UsageError("--chunk-size must be a power of two of at least 4K")
        if self.stripe_size < self.chunk_size or self.stripe_size % self.chunk_size:
            raise UsageError(
                f"--stripe-size must be a multiple of the chunk size ({format_size(self.chunk_size)})"
            )
        if self.volume_size < self.chunk_size:
            raise UsageError(
                f"--size {format_size(self.size)} is too small for {self.volumes} volumes "
                f"of at least one {format_size(self.chunk_size)} chunk each"
            )

    @property
    def volume_size(self) -> int:
        """Bytes per volume, rounded down to whole chunks."""
        per = self.size // self.volumes
        return per - per % self.chunk_size
