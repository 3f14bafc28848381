"""What the burst buffer may use of the namespace store, and nothing more.

:class:`memfs.meta.store.MetaStore` satisfies :class:`BackingStore` (mypy checks
it where :class:`memfs.backing.meta.BackedMeta` is built); tests may hand the
parts a smaller fake.  Inodes are read through :class:`InodeView`, read-only:
the burst buffer changes files only through the store's methods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

from memfs.meta import Attr, Extent, WritePlan
from memfs.meta.store import Watcher


class InodeView(Protocol):
    """The fields of an inode that write-back, residency and the mirror read."""

    @property
    def ino(self) -> int: ...
    @property
    def mode(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def nlink(self) -> int: ...
    @property
    def rdev(self) -> int: ...
    @property
    def atime_ns(self) -> int: ...
    @property
    def mtime_ns(self) -> int: ...
    @property
    def target(self) -> bytes | None: ...
    @property
    def xattrs(self) -> Mapping[bytes, bytes] | None: ...
    @property
    def children(self) -> Mapping[bytes, int] | None: ...
    @property
    def parent(self) -> int: ...
    @property
    def links(self) -> Sequence[tuple[int, bytes]] | None: ...
    @property
    def chunks(self) -> Mapping[int, int] | None:
        """Regular files: chunk number -> volume offset of what is in the pool."""
    @property
    def opens(self) -> int: ...
    @property
    def backed(self) -> int:
        """Bytes below this offset whose chunk is missing live only in DIR."""
    @property
    def cuts(self) -> int:
        """Truncates that lowered ``backed`` (a fetch spanning one may hold old bytes)."""


class SpaceTotals(Protocol):
    """How full the pool is (:class:`memfs.meta.space.ChunkSpace`)."""

    def totals(self) -> tuple[int, int]:
        """(chunks in the pool, chunks free or reclaimable)."""


class BackingStore(Protocol):
    """The store calls of the burst buffer: the namespace, residency, adoption."""

    @property
    def chunk_size(self) -> int: ...
    @property
    def inodes(self) -> Mapping[int, InodeView]: ...

    watcher: Watcher | None

    # namespace: paths of inodes (relative to the root, as in DIR)
    def path(self, ino: int) -> bytes | None: ...
    def paths(self, ino: int) -> list[bytes]: ...
    def entry_path(self, parent: int, name: bytes) -> bytes | None: ...
    def resolve(self, path: bytes) -> InodeView: ...

    # data: where a file's bytes are, and which are only in DIR
    def extents(self, ino: int, offset: int, length: int) -> list[Extent]: ...
    def missing(self, ino: int, offset: int, length: int) -> list[int]: ...
    @property
    def space(self) -> SpaceTotals: ...

    # residency: fetch (reserve, write, install), give back, evict
    @property
    def reserved(self) -> AbstractSet[tuple[int, int]]:
        """(volume, voffset) of chunks reserved by fetches not yet installed."""
    def reserve(self, ino: int, ks: list[int]) -> list[tuple[int, int, int]]: ...
    def install(self, ino: int, k: int, volume: int, voffset: int) -> bool: ...
    def unreserve(self, volume: int, voffset: int) -> None: ...
    def evict(self, ino: int) -> int: ...
    async def reclaim(self) -> None: ...

    # start-up: DIR's tree entered as it is (no watcher calls)
    def adopt(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int, *,
        size: int = 0, atime_ns: int = 0, mtime_ns: int = 0, rdev: int = 0,
        target: bytes | None = None,
    ) -> Attr: ...
    def adopt_link(self, ino: int, parent: int, name: bytes) -> None: ...
    def adopt_attrs(
        self, ino: int, *, mtime_ns: int, mode: int | None = None, uid: int | None = None,
        gid: int | None = None,
    ) -> None: ...

    # the Meta calls BackedMeta passes on
    async def map_read(self, ino: int, offset: int, length: int) -> list[Extent]: ...
    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan: ...
