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


# -- pool specs ---------------------------------------------------------------------

SCHEMES = ("tcp", "verbs")
_VOLUME_RE = re.compile(r"^(?P<scheme>[a-z]+)://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d+)/(?P<vol>\d+)$")


@dataclass(frozen=True, slots=True)
class VolumeAddr:
    """One volume of a pool: ``tcp://host:port/N`` is volume N of the memd at host:port."""

    scheme: str
    host: str
    port: int
    volume: int

    @property
    def server(self) -> tuple[str, int]:
        return (self.host, self.port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/{self.volume}"


def parse_pool_spec(spec: str) -> list[VolumeAddr]:
    """Parse ``tcp://10.0.0.2:7100/0+tcp://10.0.0.2:7100/1+verbs://mem3:7100/0``.

    Grammar: ``SPEC := VOLUME ("+" VOLUME)*``, ``VOLUME := SCHEME "://" HOST ":"
    PORT "/" INDEX`` with SCHEME ``tcp`` or ``verbs``, HOST a name, an IPv4
    address or a bracketed IPv6 address.  The order is the pool's volume order.
    """
    vols: list[VolumeAddr] = []
    if not spec.strip():
        raise UsageError("empty pool spec")
    for item in spec.strip().split("+"):
        m = _VOLUME_RE.match(item.strip())
        if not m:
            raise UsageError(
                f"bad pool volume {item!r}: expected SCHEME://HOST:PORT/INDEX, "
                "e.g. tcp://10.0.0.2:7100/0"
            )
        if m["scheme"] not in SCHEMES:
            raise UsageError(f"bad pool volume {item!r}: scheme must be one of {', '.join(SCHEMES)}")
        port = int(m["port"])
        if not 0 < port < 65536:
            raise UsageError(f"bad pool volume {item!r}: port out of range")
        vol = VolumeAddr(m["scheme"], m["host"].strip("[]"), port, int(m["vol"]))
        if vol in vols:
            raise UsageError(f"pool volume {item} is listed twice")
        vols.append(vol)
    return vols


def parse_hostport(text: str, what: str = "address") -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``."""
    m = re.match(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]*):(\d+)$", text.strip())
    if not m or not 0 <= int(m[2]) < 65536:
        raise UsageError(f"bad {what} {text!r}: expected HOST:PORT")
    return (m[1].strip("[]") or "0.0.0.0", int(m[2]))


@dataclass(frozen=True)
class FlushConfig:
    """Burst-buffer settings: write-behind to a backing directory (``--backing``).

    *delay*: seconds after a file's last change before it is written back.
    *dirty_max*: bytes of not-yet-written-back data at which writers wait
    (None: half the pool).  *workers*: files written back in parallel.
    *fsync*: fsync each file before it is renamed into place (a node crash
    then cannot leave an empty file behind in DIR).
    """

    backing: str
    delay: float = 5.0
    dirty_max: int | None = None
    workers: int = 4
    fsync: bool = True
    discard_on_unmount: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.delay < 86400:
            raise UsageError(f"bad --flush-delay {self.delay}: expected seconds from 0 to 86400")
        if not 1 <= self.workers <= 256:
            raise UsageError(f"bad --flush-workers {self.workers}: expected 1 to 256")
