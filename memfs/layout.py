"""Stripe math: where each byte of a file lives.

A file's data is cut into stripe units of ``stripe_size`` bytes laid round-robin
over ``volumes`` (a tuple of pool volume indices).  Placement is deterministic, so
no per-chunk volume lookup is ever stored: only the offset inside the volume is.

Space is allocated in chunks (``chunk_size``, a divisor of ``stripe_size``), so a
chunk is always inside one stripe unit and maps to one contiguous file range and
one volume.  ``user.memfs.layout`` (like ``lfs setstripe``) sets the spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memfs.config import format_size, parse_size
from memfs.errors import UsageError

LAYOUT_XATTR = b"user.memfs.layout"
_VOLUMES_RE = re.compile(r"(?i)(?<![\w=])volumes=\d+(?:,\d+)*")


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """A requested layout; ``None`` fields inherit (from the parent directory or pool)."""

    stripe_count: int | None = None  # -1: all volumes
    stripe_size: int | None = None
    stripe_offset: int | None = None  # -1: chosen per file

    @classmethod
    def parse(cls, text: str) -> LayoutSpec:
        """Parse ``stripe_count=2 stripe_size=1M [stripe_offset=0]`` (commas also separate)."""
        fields: dict[str, int] = {}
        # ``volumes=1,2,3`` (from Layout.format) is one item: drop it before commas split it.
        text = _VOLUMES_RE.sub(" ", text)
        aliases = {
            "stripe_count": "stripe_count", "count": "stripe_count", "c": "stripe_count",
            "stripe_size": "stripe_size", "size": "stripe_size", "s": "stripe_size",
            "stripe_offset": "stripe_offset", "offset": "stripe_offset", "i": "stripe_offset",
        }
        for item in text.replace(",", " ").split():
            key, sep, value = item.partition("=")
            if key.strip().lower() == "volumes":
                continue  # informational in getfattr output; placement follows the offset
            name = aliases.get(key.strip().lower())
            if not sep or name is None:
                raise UsageError(
                    f"bad layout item {item!r}: expected stripe_count=N, stripe_size=SIZE "
                    "or stripe_offset=N"
                )
            if name == "stripe_size":
                fields[name] = parse_size(value, "stripe_size")
            else:
                try:
                    fields[name] = int(value)
                except ValueError:
                    raise UsageError(f"bad layout value {item!r}: not an integer") from None
                if fields[name] < -1 or (name == "stripe_count" and fields[name] == 0):
                    raise UsageError(f"bad layout value {item!r}")
        if not fields:
            raise UsageError("empty layout")
        return cls(**fields)

    def format(self) -> str:
        parts = []
        if self.stripe_count is not None:
            parts.append(f"stripe_count={self.stripe_count}")
        if self.stripe_size is not None:
            parts.append(f"stripe_size={format_size(self.stripe_size)}")
        if self.stripe_offset is not None:
            parts.append(f"stripe_offset={self.stripe_offset}")
        return " ".join(parts)

    def merged(self, base: LayoutSpec) -> LayoutSpec:
        """Fields of *self*, falling back to *base* where unset."""
        return LayoutSpec(
            self.stripe_count if self.stripe_count is not None else base.stripe_count,
            self.stripe_size if self.stripe_size is not None else base.stripe_size,
            self.stripe_offset if self.stripe_offset is not None else base.stripe_offset,
        )


#: Layout.resolve's answers by (spec, pool volumes, chunk size, first volume)
_RESOLVED: dict[tuple[LayoutSpec, int, int, int], Layout] = {}
_RESOLVED_MAX = 4096


@dataclass(frozen=True, slots=True)
class Layout:
    """The concrete layout of one file."""

    stripe_size: int
    volumes: tuple[int, ...]

    @classmethod
    def resolve(
        cls, spec: LayoutSpec, n_volumes: int, chunk_size: int, seed: int
    ) -> Layout:
        """Turn *spec* into a concrete layout over a pool of *n_volumes*.

        *seed* (the inode number) spreads the first stripe of different files over
        different volumes when no offset is requested.  Layouts are immutable, so
        files with the same one share it (one per spec and first volume, looked up:
        every new file asks).
        """
        key = (spec, n_volumes, chunk_size, seed % n_volumes if n_volumes > 0 else seed)
        layout = _RESOLVED.get(key)
        if layout is None:
            layout = cls._resolve(spec, n_volumes, chunk_size, seed)
            if len(_RESOLVED) >= _RESOLVED_MAX:
                _RESOLVED.clear()
            _RESOLVED[key] = layout
        return layout

    @classmethod
    def _resolve(cls, spec: LayoutSpec, n_volumes: int, chunk_size: int, seed: int) -> Layout:
        size = spec.stripe_size or chunk_size
        if size < 0 or size % chunk_size:
            raise UsageError(f"stripe_size must be a multiple of the chunk size {format_size(chunk_size)}")
        count = spec.stripe_count if spec.stripe_count not in (None, -1) else n_volumes
        assert count is not None
        if count < 1:  # a directly built spec (parse refuses these): no empty layouts
            raise UsageError(f"stripe_count {count} must be -1 or at least 1")
        if count > n_volumes:
            raise UsageError(f"stripe_count {count} exceeds the {n_volumes} volumes of the pool")
        first = spec.stripe_offset if spec.stripe_offset not in (None, -1) else seed
        assert first is not None
        if spec.stripe_offset not in (None, -1) and not 0 <= first < n_volumes:
            raise UsageError(f"stripe_offset {first} is not a volume of this pool (0..{n_volumes - 1})")
        return cls(size, tuple((first + i) % n_volumes for i in range(count)))

    def volume_of_chunk(self, chunk: int, chunk_size: int) -> int:
        """The pool volume holding file chunk number *chunk*."""
        return self.volumes[(chunk * chunk_size // self.stripe_size) % len(self.volumes)]

    def format(self) -> str:
        return (
            f"stripe_count={len(self.volumes)} stripe_size={format_size(self.stripe_size)} "
            f"stripe_offset={self.volumes[0]} volumes={','.join(map(str, self.volumes))}"
        )
