"""Metadata: namespace, inodes, layouts and allocation of volume space.

:class:`Meta` is the interface the data engine and the FUSE layer use.  The
embedded implementation (:class:`memfs.meta.store.MetaStore`) keeps everything
in this process; a remote client for ``memfs mds`` implements the same
interface.  One conformance suite (``tests/test_meta_conformance.py``) runs
against every implementation.

Errors are :class:`memfs.errors.FsError` with the errno POSIX prescribes.
Permission checks (EACCES/EPERM on mode bits) are the kernel's, through the
``default_permissions`` mount option; structural checks are done here.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import stat
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from memfs.errors import FsError


@dataclass(slots=True)
class Attr:
    """What ``stat`` shows of an inode."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    blocks: int  # 512-byte units actually allocated in the pool
    atime_ns: int
    mtime_ns: int
    ctime_ns: int


@dataclass(slots=True)
class Extent:
    """A run of file bytes ``[offset, offset+length)`` at ``voffset`` in ``volume``.

    ``volume == -1`` is a hole: it reads as zeros.  ``volume == NOT_RESIDENT``
    (only inside a mount with a backing directory, never handed to the data
    engine) is data that lives in the backing directory and must be fetched.
    """

    offset: int
    length: int
    volume: int
    voffset: int


#: a transfer whose chunk map is recalled while it is fetched asks again, this often
MAP_TRIES = 100


def map_retry_delay(tries: int) -> float:
    """How long to wait before asking again for a chunk map whose generation moved
    under the last *tries* answers (a recall came while it was fetched).  A change
    waiting for its recalls (another node's truncate, or stat of a file written
    here) recalls again every map fetched meanwhile: asking again at once, a busy
    writer can keep it from being applied for as long as its own tries last, and
    then fail (memfs.array slab writes failed with EIO "keeps changing" that way).
    The first few go at once, then 1 ms doubling to 50 ms (all 100: ~4.6 s)."""
    return 0.0 if tries < 3 else min(0.05, 0.001 * 2 ** (tries - 3))


def add_run(out: list[Extent], pos: int, n: int, volume: int, voffset: int) -> None:
    """Append ``n`` bytes at file offset *pos* to *out*, extending the last extent when
    they continue it (the same hole, or contiguous volume memory)."""
    if out:
        last = out[-1]
        if last.volume == volume and (volume < 0 or last.voffset + last.length == voffset):
            last.length += n
            return
    out.append(Extent(pos, n, volume, voffset))


def chunks_between(chunks: Collection[int], first: int, last: int) -> list[int]:
    """The chunk numbers of *chunks* from *first* to *last*, in order: by stepping
    through the range or by scanning *chunks*, whichever is shorter (a file whose
    holes are punched one by one costs no scan of all its chunks each)."""
    if last - first + 1 <= len(chunks):
        return [k for k in range(first, last + 1) if k in chunks]
    return sorted(k for k in chunks if first <= k <= last)


@dataclass(slots=True)
class WritePlan:
    """Where a write goes.  Newly allocated chunks are already zero (scrub-on-free)."""

    extents: list[Extent]
    #: the writer holds the file's write lease: any other access recalls it first, and
    #: the recall waits for transfers (Meta.io), so the data may arrive after the
    #: write returns (memfs.data: posted writes)
    posted: bool = False


@dataclass(slots=True)
class StatFs:
    block_size: int
    blocks: int
    blocks_free: int
    files: int
    files_free: int
    name_max: int


@dataclass(slots=True)
class SetAttr:
    """Attribute changes; ``None`` leaves a field alone.  Size goes via ``truncate``."""

    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None


class _Settable(Protocol):
    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int


def apply_setattr(x: _Settable, changes: SetAttr) -> None:
    """Lay *changes* over *x* (an inode, or attributes; its file type stays): the
    store's setattr, and a client's made under its lease (RemoteMeta.setattr)."""
    if changes.mode is not None:
        x.mode = stat.S_IFMT(x.mode) | (changes.mode & 0o7777)
    if changes.uid is not None:
        x.uid = changes.uid
    if changes.gid is not None:
        x.gid = changes.gid
    if changes.atime_ns is not None:
        x.atime_ns = changes.atime_ns
    if changes.mtime_ns is not None:
        x.mtime_ns = changes.mtime_ns


NAME_MAX = 255
#: file capabilities (setcap); a change of a file's data or owner takes them away
CAPABILITY_XATTR = b"security.capability"


def check_xattr_name(name: bytes) -> None:
    """EOPNOTSUPP for an xattr memfs does not keep: ``system.*`` (no ACLs, so that tools
    know they are not kept: ``cp -a`` then goes on) and unknown namespaces.  Checked
    by the store, and by a cluster client before it asks (cp -a tries an ACL on
    every file it copies)."""
    if name.startswith(b"system."):
        raise FsError(errno.EOPNOTSUPP)
    if not name.startswith((b"user.", b"trusted.", b"security.")):
        raise FsError(errno.EOPNOTSUPP)


def set_ids_to_drop(mode: int) -> int:
    """The set-ID bits of *mode* that a write, truncate or chown takes away (Linux's
    rule as FUSE_HANDLE_KILLPRIV_V2 hands it to filesystems): set-user-ID, and
    set-group-ID when group execute is set (without it the bit marks mandatory
    locking, not a privilege).  None of a directory's."""
    if stat.S_ISDIR(mode):
        return 0
    drop = mode & stat.S_ISUID
    if mode & stat.S_ISGID and mode & stat.S_IXGRP:
        drop |= stat.S_ISGID
    return drop

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
#: Extent.volume of bytes that are only in the backing directory
NOT_RESIDENT = -2


class Locks(Protocol):
    """File locks kept beyond this node (memfs.meta.lock_client): POSIX record locks by
    (start, length; 0 to the end) as ``struct flock`` has them, flock locks by type
    (F_RDLCK shared, F_WRLCK exclusive, F_UNLCK); *owner* is the kernel's lock owner.
    A lock in another owner's way is EAGAIN, or with *wait* waited for."""

    async def getlk(self, ino: int, owner: int, type_: int, start: int, length: int,
                    pid: int) -> tuple[int, int, int, int]: ...

    async def setlk(self, ino: int, owner: int, type_: int, start: int, length: int, pid: int,
                    wait: bool) -> None: ...

    async def flock(self, ino: int, owner: int, type_: int, wait: bool) -> None: ...

    async def unlock(self, ino: int, owner: int) -> None: ...


class Meta(abc.ABC):
    """The metadata service as seen by one mount."""

    #: allocation unit in bytes; file chunk *k* covers ``[k*chunk_size, (k+1)*chunk_size)``
    chunk_size: int
    #: number of volumes in the pool
    n_volumes: int
    #: set by the FUSE layer: drops the kernel's cached attributes and pages of inodes
    #: (a client that caches under leases calls it when they are recalled)
    invalidator: Callable[[list[int]], Awaitable[None]] | None = None
    #: set by the FUSE layer if it can make the kernel forget every cached name at once
    #: without a directory lock; only then does a cluster client let the kernel cache names
    names_invalidator: Callable[[], None] | None = None

    @abc.abstractmethod
    async def lookup(self, parent: int, name: bytes) -> Attr: ...

    async def find(self, parent: int, name: bytes) -> Attr | None:
        """:meth:`lookup`, but None where it says ENOENT (an absent name, or parent):
        the kernel looks up every name it creates first, and an exception per create
        showed in profiles.  Other errors raise as from lookup."""
        try:
            return await self.lookup(parent, name)
        except FsError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise

    @abc.abstractmethod
    async def getattr(self, ino: int) -> Attr: ...

    @abc.abstractmethod
    async def setattr(self, ino: int, changes: SetAttr) -> Attr:
        """Apply *changes* and set ctime."""

    @abc.abstractmethod
    async def truncate(self, ino: int, size: int) -> list[tuple[int, int, int]]:
        """Set the size, free chunks past it, return ranges the caller must zero."""

    @abc.abstractmethod
    async def punch(self, ino: int, offset: int, length: int) -> list[tuple[int, int, int]]:
        """Punch a hole (``FALLOC_FL_PUNCH_HOLE``, the size kept): free the chunks wholly
        inside ``[offset, offset+length)`` below EOF and return the parts of the
        others there that the caller must zero, like :meth:`truncate`'s tail."""

    @abc.abstractmethod
    async def seek(self, ino: int, offset: int, whence: int) -> int:
        """``lseek(2)``'s ``SEEK_DATA`` or ``SEEK_HOLE`` (*whence*) from *offset*, with
        the chunk as the grain (a chunk that holds memory is data even where it
        holds zeros); ENXIO at or past the end of the file, or for data when
        only holes follow."""

    @abc.abstractmethod
    async def mknod(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int,
        rdev: int = 0, target: bytes | None = None,
    ) -> Attr:
        """Create a file, directory, symlink (*target*) or special file; EEXIST if taken."""

    @abc.abstractmethod
    async def link(self, ino: int, parent: int, name: bytes) -> Attr: ...

    @abc.abstractmethod
    async def unlink(self, parent: int, name: bytes) -> None:
        """Remove a non-directory entry; the data lives until the last release."""

    @abc.abstractmethod
    async def rmdir(self, parent: int, name: bytes) -> None: ...

    @abc.abstractmethod
    async def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        """Atomic rename; *flags* may be RENAME_NOREPLACE or RENAME_EXCHANGE."""

    @abc.abstractmethod
    async def readlink(self, ino: int) -> bytes: ...

    @abc.abstractmethod
    async def readdir(self, ino: int) -> list[tuple[bytes, int]]:
        """A snapshot of the entries of directory *ino* as (name, ino)."""

    async def readdirplus(self, ino: int) -> list[tuple[bytes, Attr]]:
        """The entries of directory *ino* with their attributes (one call for ``ls -l``)."""
        out = []
        for name, _ in await self.readdir(ino):
            try:
                out.append((name, await self.lookup(ino, name)))
            except FsError as exc:
                if exc.errno != errno.ENOENT:
                    raise
        return out

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        """:meth:`mknod` of a regular file and :meth:`open` of it, in one call."""
        a = await self.mknod(parent, name, mode, uid, gid)
        return await self.open(a.ino)

    async def allocate_ahead(
        self, ino: int, offset: int, length: int, ahead: int
    ) -> tuple[WritePlan, Attr]:
        """:meth:`map_write`, plus (best effort) chunks for *ahead* bytes past the write,
        which stay past EOF until written; the plan covers them too."""
        plan = await self.map_write(ino, offset, length)
        return plan, await self.getattr(ino)

    def ahead_room(self, offset: int, length: int, ahead: int) -> int:
        """How much of *ahead* bytes of space past a write of *length* at *offset*
        :meth:`allocate_ahead` may give now (a burst buffer: what its dirty cap has
        room for)."""
        return ahead

    async def settle_write(
        self, ino: int, size: int, mtime_ns: int, trim: int, lo: int = -1, hi: int = -1,
    ) -> None:
        """A writer's coalesced size and mtime (size only grows); *trim*: free chunks
        wholly past EOF (preallocation it did not use); ``[lo, hi)``: the bytes it
        wrote under its lease (``lo < 0``: anywhere)."""
        raise FsError(errno.ENOTSUP, "write leases are not served here")

    # -- client caches (cluster clients override these; see memfs.meta.cache) ----------

    def attr_ttl(self, ino: int, returned: Attr | None = None) -> float | None:
        """How long the kernel may cache what was just returned about *ino* (*returned*:
        those attributes; a cluster client gives none to what its lease does not cover);
        None: the mount's configured timeouts (every change goes through this node)."""
        return None

    def entry_ttl(self, parent: int, name: bytes, ino: int, listed: bool = False) -> float | None:
        """Like :meth:`attr_ttl`, for the entry *name* of *parent* that names inode *ino*
        (0: absent), found by a lookup or made here, or (*listed*) in a listing."""
        return None

    def keep_cache(self, ino: int) -> bool | None:
        """Whether pages the kernel cached for *ino* are still right at this open; None:
        the mount's default."""
        return None

    async def end_of_file(self, ino: int) -> int:
        """The size of *ino* as known now, this node's own writes included (the default
        :meth:`map_append` appends there)."""
        return (await self.getattr(ino)).size

    async def map_append(self, ino: int, length: int) -> tuple[int, WritePlan]:
        """Where an ``O_APPEND`` write of *length* bytes of *ino* goes when sizes change
        elsewhere (see :meth:`sizes_change_elsewhere`), and its :meth:`map_write`
        plan.  Here: at :meth:`end_of_file`, then mapped, so two nodes appending at
        once may meet (as on NFS); a cluster client's server places it itself."""
        offset = await self.end_of_file(ino)
        return offset, await self.map_write(ino, offset, length)

    def sizes_change_elsewhere(self) -> bool:
        """Other nodes change files' sizes (a cluster client): the kernel's cached size
        of a file may be behind, so an ``O_APPEND`` write's offset, which the kernel
        takes from it without asking, is taken from here instead (``fs.Operations``)."""
        return False

    def recalls_drop_pages(self) -> bool:
        """No one but this node changes file data, or every change made elsewhere first
        makes this node drop the file's cached pages (a recall): so the kernel need not
        drop them itself whenever it sees a new mtime (libfuse's AUTO_INVAL_DATA)."""
        return True

    def io(self, ino: int, *, here: bool = True) -> contextlib.AbstractContextManager[object]:
        """Held around the volume transfers of one read or write of *ino*: a client that
        caches chunk maps waits for these before it lets a change free those chunks.
        *here*: made by this process's transport (not by a memfs.array process on its
        own connections): a client waits for these before its transport names a new
        lease token.  What it yields, if callable, is called once a memfs.array
        process says the transfer's bytes have moved (RemoteMeta: a reconnection stops
        waiting for it; the hold itself still lasts until the block ends)."""
        return contextlib.nullcontext()

    def generation(self, ino: int) -> int:
        """Changes whenever chunk maps of *ino* fetched before may have become stale: a
        map taken under one generation is used only if it is still current inside :meth:`io`."""
        return 0

    def order_sizes_after(self, barrier: Callable[[int], Awaitable[None]]) -> None:  # noqa: B027
        """*barrier(ino)*: until the bytes of the writes made so far to *ino* are in
        volume memory (posted writes answered).  A client that reports sizes of its
        own accord (coalesced, under a write lease) passes it first, so that no
        size it has reported covers bytes still on their way: were it then cut off
        (evicted), others would read zeros there.  A no-op where sizes are exact at
        once."""

    def zero_tails_with(  # noqa: B027 (a no-op where nothing gates maps during a truncate)
        self, zero: Callable[[int, list[tuple[int, int, int]]], Awaitable[None]],
    ) -> None:
        """*zero(ino, ranges)*: zeroes what a truncate of *ino* cut off in chunks that
        stay (:meth:`truncate`'s ranges; :meth:`punch`'s too).  A client that hands out no map of a file
        while it truncates it (RemoteMeta) runs it before it hands one out again, and
        its truncate then returns no ranges: a memfs.array process of the node could
        otherwise write past the new end before those zeros land over its bytes."""

    def truncating(self, ino: int) -> bool:
        """A truncate of *ino* made on this node is under way: its chunk maps (and calls
        that wait for them) wait until it is over (RemoteMeta).  A memfs.array session
        that holds a piece of the file open must end it instead of waiting: that
        truncate waits for it (memfs.array.service)."""
        return False

    async def truncates_over(self, ino: int) -> None:  # noqa: B027 (see truncating)
        """Until no truncate of *ino* made on this node is under way."""

    def locks(self) -> Locks | None:
        """Where the kernel's lock requests go (cluster-wide locks: a cluster client);
        None: the kernel keeps locks itself, per node (one node sees every change)."""
        return None

    async def sync_all(self) -> None:  # noqa: B027 (a no-op unless a client caches)
        """At unmount, after the data engine's last transfers: make every size and mtime
        this client holds exact on the metadata service (:meth:`sync` of each)."""

    async def sync(self, ino: int) -> None:  # noqa: B027 (a no-op unless a client caches)
        """fsync: make *ino*'s size and mtime exact on the metadata service (and its
        creation, or for a directory the creates in it, known there)."""

    @abc.abstractmethod
    async def drop_privileges(self, ino: int, set_ids: bool) -> bool:
        """Take away what a change of *ino*'s data or owner must, in one step: its file
        capabilities and, with *set_ids*, the set-ID bits of :func:`set_ids_to_drop`
        (a directory keeps both).  True if anything changed (nothing does, not even
        ctime, when there is nothing to drop).

        The kernel leaves this to memfs once it negotiated FUSE_HANDLE_KILLPRIV_V2
        (memfs.fs), which spares every write(2) a GETXATTR round trip.
        """

    @abc.abstractmethod
    async def open(self, ino: int) -> Attr:
        """Count an open handle; unlinked inodes live while any handle is open."""

    @abc.abstractmethod
    async def release(self, ino: int) -> None: ...

    @abc.abstractmethod
    async def getxattr(self, ino: int, name: bytes) -> bytes: ...

    @abc.abstractmethod
    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None: ...

    @abc.abstractmethod
    async def listxattr(self, ino: int) -> list[bytes]: ...

    @abc.abstractmethod
    async def removexattr(self, ino: int, name: bytes) -> None: ...

    @abc.abstractmethod
    async def statfs(self) -> StatFs: ...

    @abc.abstractmethod
    async def map_read(self, ino: int, offset: int, length: int) -> list[Extent]:
        """Extents covering ``[offset, offset+length)`` clipped at EOF; updates atime."""

    @abc.abstractmethod
    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        """Allocate what the write needs (ENOSPC, all or nothing; SpaceBusy while
        freed space is still being zeroed), extend the size, update mtime/ctime,
        and say where the bytes go."""

    @abc.abstractmethod
    async def reclaim(self) -> None:
        """Wait until space freed by unlink/truncate is zeroed and allocatable again.

        ``map_write`` raises :class:`memfs.errors.SpaceBusy` (EAGAIN) when only
        such space is left; the data engine then calls this and retries once.
        """

    async def control(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """A burst-buffer command (``memfs flush/status/stage-in``; see :mod:`memfs.flush`).

        Only a mount with a backing directory (embedded ``--backing``, or an mds
        started with one) has them; everything else answers ENOTSUP.
        """
        raise FsError(errno.ENOTSUP, "this filesystem has no backing directory (--backing)")

    @abc.abstractmethod
    async def aclose(self) -> None: ...
