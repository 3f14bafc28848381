"""The in-memory metadata store: the embedded metadata service.

All state lives in Python dicts in this process.  Methods never await, so each
one is atomic with respect to the other tasks of the trio loop: no locks needed.
The same class is meant to sit behind ``memfs mds`` for remote clients.

Invariant that keeps stale pool bytes from ever being visible: every byte of an
allocated chunk that lies at or past EOF, or that was never written, is zero.
Only clean chunks are allocated (freed ones are zeroed by the scrubber,
:mod:`memfs.scrub`, before reuse), and a shrinking truncate returns the tail of
the chunk holding the new EOF for the caller to zero.

Files' chunk maps (extents, allocation, write leases' reports, data that lives
in a backing directory) are :class:`memfs.meta.placement.Placement`'s, which the
store hands its inode table and its pool's :class:`ChunkSpace`.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from memfs.config import PoolConfig
from memfs.errors import FsError, UsageError
from memfs.layout import LAYOUT_XATTR, Layout, LayoutSpec
from memfs.meta import (
    CAPABILITY_XATTR,
    NAME_MAX,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    Attr,
    Extent,
    Meta,
    SetAttr,
    StatFs,
    WritePlan,
    apply_setattr,
    check_xattr_name,
    clock,
    set_ids_to_drop,
)
from memfs.meta.placement import Placement
from memfs.meta.space import ChunkSpace

log = logging.getLogger(__name__)

ROOT_INO = 1
XATTR_SIZE_MAX = 65536
_DAY_NS = 86400 * 10**9
# Timestamps in the kernel's order (see memfs.meta.clock).
_now = clock.now_ns


class Inode:
    __slots__ = (
        "ino", "mode", "uid", "gid", "nlink", "size", "rdev",
        "atime_ns", "mtime_ns", "ctime_ns",
        "target", "xattrs", "children", "parent", "name", "links",
        "spec", "layout", "chunks", "opens", "backed", "cuts", "lost",
    )

    def __init__(self, ino: int, mode: int, uid: int, gid: int, now: int) -> None:
        self.ino = ino
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.nlink = 1
        self.size = 0
        self.rdev = 0
        self.atime_ns = self.mtime_ns = self.ctime_ns = now
        self.target: bytes | None = None
        self.xattrs: dict[bytes, bytes] | None = None
        self.children: dict[bytes, int] | None = None  # directories only
        # The entry naming this inode: (parent, name) of its first link; further
        # hard links in ``links``.  Write-back needs paths, which only these give.
        self.parent = 0
        self.name = b""
        self.links: list[tuple[int, bytes]] | None = None
        #: bytes below this offset whose chunk is missing live only in the backing
        #: directory (staged lazily or evicted): they are fetched, never read as holes
        self.backed = 0
        #: truncates that lowered ``backed``: after one, bytes a fetch read from the
        #: backing copy may have been rewritten and written back (see Residency)
        self.cuts = 0
        self.spec: LayoutSpec | None = None  # directories: default for new files
        self.layout: Layout | None = None  # regular files
        self.chunks: dict[int, int] | None = None  # regular files: chunk -> volume offset
        #: chunks whose data went with their memory server's memory (it restarted
        #: blank): reading or writing them is EIO until a truncate cuts them off
        self.lost: set[int] | None = None
        self.opens = 0


class Watcher(Protocol):
    """Told of every change that write-back to a backing directory must follow.

    One rule for every callback: it is called from inside the store method,
    synchronously, once the change is complete (names, link counts, and the
    destruction of an inode the change freed, reported first by
    :meth:`destroyed`), so paths computed in a callback are those of the namespace
    right after that change, and an inode it names may already be gone.
    """

    def wrote(self, ino: int, first: int, last: int) -> None:
        """Chunks *first*..*last* of *ino* were written (or are about to be)."""

    def rewritten(self, ino: int) -> None:
        """Any of *ino*'s chunks below EOF may have been written (a write lease's
        report: its holder writes without saying where)."""

    def truncated(self, ino: int) -> None: ...

    def punched(self, ino: int, first: int, last: int) -> None:
        """A hole was punched over chunks *first*..*last* of *ino*: those still there
        were zeroed in part (or whole), the others freed."""

    def attrs_changed(self, ino: int) -> None:
        """mode, owner, times or xattrs changed (not atime alone)."""

    def created(self, ino: int) -> None:
        """A new name for *ino* (mknod, mkdir, symlink, link)."""

    def removed(self, parent: int, name: bytes, ino: int, directory: bool) -> None:
        """Entry *name* of *parent* (which named *ino*, a directory if *directory*) is
        gone (unlink, rmdir)."""

    def renamed(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes,
        exchange: bool, replaced: int,
    ) -> None:
        """A rename happened; *replaced*: the inode the target used to name (0: none)."""

    def destroyed(self, ino: int) -> None: ...


#: an :attr:`MetaStore.unsaid` mark for every session of an earlier run (the file's
#: chunks changed during the grace that follows a restart)
ANY_EARLIER = b"*"


def _check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG)
    if not name or b"/" in name or name in (b".", b".."):
        raise FsError(errno.EINVAL, f"invalid name {name!r}")


class MetaStore(Meta):
    """Namespace and allocation for one pool, all in memory."""

    def __init__(
        self, pool: PoolConfig, *, root_mode: int = 0o1777, root_uid: int = 0, root_gid: int = 0
    ) -> None:
        self.chunk_size = pool.chunk_size
        self.n_volumes = pool.volumes
        self.default_spec = LayoutSpec(-1, pool.stripe_size, -1)
        #: the pool's chunks: free, allocated, or freed and waiting to be zeroed
        self.space = ChunkSpace(pool)
        self.inodes: dict[int, Inode] = {}
        #: regular files' chunk maps: extents, allocation, write leases' reports, and
        #: the chunks of data that lives in a backing directory (fetch, eviction)
        self.placement = Placement(self.inodes, self.space)
        self._next_ino = ROOT_INO
        #: the clock every timestamp comes from; the metadata server injects one that
        #: it records, so journal replay stamps exactly the same times
        self.now: Callable[[], int] = _now
        #: called with the number of every inode destroyed (the journal records it)
        self.on_destroy: Callable[[int], None] | None = None
        #: journal replay: destroy nothing implicitly; the recorded destructions are
        #: applied with :meth:`destroy` (open counts, which decide when an unlinked
        #: inode dies, are not journaled)
        self.defer_destroy = False
        #: write-back to a backing directory (memfs.backing) follows changes through this
        self.watcher: Watcher | None = None
        #: file -> sessions whose write lease on it ended without their word (their
        #: space past EOF freed): such a session's larger size, reported after an mds
        #: restart, covers freed space (memfs.meta.server refuses it).  Journaled
        #: (``LOST_WRITE`` records), so it survives restarts.
        self.unsaid: dict[int, set[bytes]] = {}
        #: client sessions of earlier server runs that may still report sizes (within
        #: --grace of a restart), and those that registered in this run; with
        #: :attr:`unsaid`'s ``ANY_EARLIER`` marks (a file changed during the grace),
        #: journaled so that a crash during a grace does not widen what is accepted
        self.eligible: set[bytes] = set()
        self.this_run: set[bytes] = set()
        #: session -> inode numbers reserved for its asynchronous creates (never handed
        #: out otherwise: ``_next_ino`` moved past them).  Journaled (``reserve_inos``,
        #: ``create_at``; a session's go when it does)
        self.delegated: dict[bytes, set[int]] = {}
        #: with a journal: returns once every change recorded so far is durable (the
        #: scrubber waits for it before zeroing freed chunks: a crash must not bring
        #: back a file whose memory was already zeroed)
        self.wait_durable: Callable[[], Awaitable[None]] | None = None
        root = self._new_inode(stat.S_IFDIR | root_mode, root_uid, root_gid, self.now())
        root.nlink = 2
        root.parent = ROOT_INO

    # -- helpers -----------------------------------------------------------------

    def _new_inode(self, mode: int, uid: int, gid: int, now: int, ino: int = 0) -> Inode:
        if not ino:
            ino = self._next_ino
            self._next_ino += 1
        inode = Inode(ino, mode, uid, gid, now)
        if stat.S_ISDIR(mode):
            inode.children = {}
        self.inodes[ino] = inode
        return inode

    def _get(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    def _dir(self, ino: int) -> Inode:
        inode = self._get(ino)
        if inode.children is None:
            raise FsError(errno.ENOTDIR)
        return inode

    def _child(self, parent: Inode, name: bytes) -> Inode:
        assert parent.children is not None
        try:
            return self.inodes[parent.children[name]]
        except KeyError:
            if len(name) > NAME_MAX:
                raise FsError(errno.ENAMETOOLONG) from None
            raise FsError(errno.ENOENT) from None

    def _attr(self, i: Inode) -> Attr:
        blocks = len(i.chunks) * (self.chunk_size // 512) if i.chunks else 0
        if i.target is not None:
            size = len(i.target)
        elif i.children is not None:
            size = 4096
        else:
            size = i.size
        return Attr(
            i.ino, i.mode, i.nlink, i.uid, i.gid, i.rdev, size, blocks,
            i.atime_ns, i.mtime_ns, i.ctime_ns,
        )

    def _drop_link(self, inode: Inode, now: int) -> None:
        inode.nlink -= 1
        inode.ctime_ns = now
        self._maybe_destroy(inode)

    def _maybe_destroy(self, inode: Inode) -> None:
        if inode.nlink <= 0 and inode.opens <= 0 and not self.defer_destroy:
            self._destroy(inode)

    def _destroy(self, inode: Inode) -> None:
        self.placement.free_chunks(inode)
        del self.inodes[inode.ino]
        self.unsaid.pop(inode.ino, None)
        if self.on_destroy is not None:
            self.on_destroy(inode.ino)
        if self.watcher is not None:
            self.watcher.destroyed(inode.ino)

    def destroy(self, ino: int) -> None:
        """Free unlinked inode *ino* now, whatever its open count (journal replay)."""
        inode = self._get(ino)
        if inode.nlink > 0:
            raise FsError(errno.EBUSY, f"inode {ino} still has {inode.nlink} links")
        self._destroy(inode)

    def _touch_dir(self, d: Inode, now: int) -> None:
        d.mtime_ns = d.ctime_ns = now

    def _is_ancestor(self, maybe_ancestor: int, ino: int) -> bool:
        """True if directory *maybe_ancestor* is *ino* or contains it."""
        while True:
            if ino == maybe_ancestor:
                return True
            if ino == ROOT_INO:
                return False
            ino = self.inodes[ino].parent

    def effective_spec(self, d: Inode) -> LayoutSpec:
        return d.spec.merged(self.default_spec) if d.spec else self.default_spec

    # -- names -------------------------------------------------------------------

    @staticmethod
    def _unname(i: Inode, parent: int, name: bytes) -> None:
        """Entry (parent, name) no longer names *i*."""
        if i.parent == parent and i.name == name:
            if i.links:
                i.parent, i.name = i.links.pop()
            # else: the last name; kept (``..`` of an open removed directory)
        elif i.links and (parent, name) in i.links:
            i.links.remove((parent, name))
        if i.links is not None and not i.links:
            i.links = None

    @staticmethod
    def _rename_link(i: Inode, parent: int, name: bytes, new_parent: int, new_name: bytes) -> None:
        if i.parent == parent and i.name == name:
            i.parent, i.name = new_parent, new_name
        elif i.links and (parent, name) in i.links:
            i.links[i.links.index((parent, name))] = (new_parent, new_name)

    def entry_path(self, parent: int, name: bytes) -> bytes | None:
        """The path of entry *name* in directory *parent*, relative to the root."""
        p = self.path(parent)
        if p is None:
            return None
        return p + b"/" + name if p else name

    def path(self, ino: int) -> bytes | None:
        """The path of *ino* relative to the root (``b""`` for the root), None if unlinked."""
        parts: list[bytes] = []
        while ino != ROOT_INO:
            i = self.inodes.get(ino)
            if i is None or i.nlink <= 0:
                return None
            parts.append(i.name)
            ino = i.parent
        return b"/".join(reversed(parts))

    def paths(self, ino: int) -> list[bytes]:
        """Every path naming *ino* (hard links), primary first."""
        i = self.inodes.get(ino)
        if i is None or i.nlink <= 0:
            return []
        first = self.path(ino)
        out = [] if first is None else [first]
        for parent, name in i.links or ():
            p = self.entry_path(parent, name)
            if p is not None:
                out.append(p)
        return out

    def resolve(self, path: bytes) -> Inode:
        """The inode at *path* (relative to the root, ``/``-separated)."""
        i = self._get(ROOT_INO)
        for part in path.split(b"/"):
            if part in (b"", b"."):
                continue
            if i.children is None:
                raise FsError(errno.ENOTDIR, f"{path!r}: not a directory")
            if part == b"..":
                raise FsError(errno.EINVAL, "'..' in a path")
            i = self._child(i, part)
        return i

    def rebuild_names(self) -> None:
        """Derive every inode's names from the directories (after loading a snapshot)."""
        for i in self.inodes.values():
            i.links = None
            i.name = b""
        for d in self.inodes.values():
            for name, ino in (d.children or {}).items():
                i = self.inodes[ino]
                if not i.name and i.parent in (d.ino, 0):  # the saved parent stays primary
                    i.parent, i.name = d.ino, name
                else:
                    if i.links is None:
                        i.links = []
                    i.links.append((d.ino, name))

    # -- namespace ----------------------------------------------------------------

    async def lookup(self, parent: int, name: bytes) -> Attr:
        d = self._dir(parent)
        if name == b".":
            return self._attr(d)
        if name == b"..":
            return self._attr(self._get(d.parent))
        return self._attr(self._child(d, name))

    async def find(self, parent: int, name: bytes) -> Attr | None:
        d = self.inodes.get(parent)
        if d is None or d.children is None or name in (b".", b"..") or len(name) > NAME_MAX:
            return await super().find(parent, name)  # (lookup's answers and errors)
        i = self.inodes.get(d.children.get(name, 0))
        return None if i is None else self._attr(i)

    async def getattr(self, ino: int) -> Attr:
        return self._attr(self._get(ino))

    async def setattr(self, ino: int, changes: SetAttr) -> Attr:
        i = self._get(ino)
        apply_setattr(i, changes)
        for t in (changes.atime_ns, changes.mtime_ns):
            if t is not None:
                clock.saw(t)
        i.ctime_ns = self.now()
        if self.watcher is not None and (
            changes.mode is not None or changes.uid is not None
            or changes.gid is not None or changes.mtime_ns is not None
        ):
            self.watcher.attrs_changed(ino)
        return self._attr(i)

    @staticmethod
    def _privileges(i: Inode, set_ids: bool) -> tuple[int, bool]:
        """(set-ID bits, whether a capability xattr) that :meth:`drop_privileges` takes."""
        if i.children is not None:
            return 0, False
        return (set_ids_to_drop(i.mode) if set_ids else 0,
                i.xattrs is not None and CAPABILITY_XATTR in i.xattrs)

    def has_privileges(self, ino: int, set_ids: bool) -> bool:
        """Whether :meth:`drop_privileges` would change anything."""
        i = self.inodes.get(ino)
        return i is not None and any(self._privileges(i, set_ids))

    async def drop_privileges(self, ino: int, set_ids: bool) -> bool:
        i = self._get(ino)
        drop, cap = self._privileges(i, set_ids)
        if not drop and not cap:
            return False
        i.mode &= ~drop
        if cap:
            assert i.xattrs is not None
            del i.xattrs[CAPABILITY_XATTR]
        i.ctime_ns = self.now()
        if drop and self.watcher is not None:
            self.watcher.attrs_changed(ino)
        return True

    async def truncate(self, ino: int, size: int) -> list[tuple[int, int, int]]:
        i = self._get(ino)
        if i.children is not None:
            raise FsError(errno.EISDIR)
        if not stat.S_ISREG(i.mode):
            raise FsError(errno.EINVAL)
        if size < 0:
            raise FsError(errno.EINVAL)
        zero: list[tuple[int, int, int]] = []
        if size < i.size and i.chunks:
            assert i.layout is not None
            cs = self.chunk_size
            tail_chunk, tail_off = divmod(size, cs)
            if tail_off and tail_chunk in i.chunks:  # (its tail is zeroed by the caller)
                self.placement.check_sealed(i, (tail_chunk,))
            self.placement.free_chunks(i, keep_below=tail_chunk + (1 if tail_off else 0))
            if tail_off and tail_chunk in i.chunks:
                vol = i.layout.volume_of_chunk(tail_chunk, cs)
                zero.append((vol, i.chunks[tail_chunk] + tail_off, cs - tail_off))
        if i.lost and size < i.size:
            self.placement.cut_lost(i, size)
        i.size = size
        if size < i.backed:
            i.backed = size
            i.cuts += 1
        i.mtime_ns = i.ctime_ns = self.now()
        if self.watcher is not None:
            self.watcher.truncated(ino)
        return zero

    async def seek(self, ino: int, offset: int, whence: int) -> int:
        i = self._get(ino)
        if i.children is not None or not stat.S_ISREG(i.mode) or i.chunks is None \
                or whence not in (os.SEEK_DATA, os.SEEK_HOLE):
            raise FsError(errno.EINVAL)
        return self.placement.seek(i, offset, data=whence == os.SEEK_DATA)

    async def punch(self, ino: int, offset: int, length: int) -> list[tuple[int, int, int]]:
        i = self._get(ino)
        if i.children is not None:
            raise FsError(errno.EISDIR)
        if not stat.S_ISREG(i.mode):
            raise FsError(errno.ENODEV)
        if offset < 0 or length <= 0:
            raise FsError(errno.EINVAL)
        end = min(offset + length, i.size)
        zero: list[tuple[int, int, int]] = []
        if end > offset and i.chunks is not None:
            zero = self.placement.punch(i, offset, end)
        i.mtime_ns = i.ctime_ns = self.now()
        if self.watcher is not None:
            if end > offset:
                cs = self.chunk_size
                self.watcher.punched(ino, offset // cs, (end - 1) // cs)
            else:
                self.watcher.attrs_changed(ino)
        return zero

    async def mknod(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int,
        rdev: int = 0, target: bytes | None = None,
    ) -> Attr:
        return self._mknod_now(parent, name, mode, uid, gid, rdev, target)

    def _mknod_now(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int,
        rdev: int, target: bytes | None, *, exact: bool = False, ino: int = 0,
    ) -> Attr:
        """*exact*: an existing file is entered as it is (no setgid inheritance, the
        parent's mtime stays); *ino*: a number reserved for it (``create_at``)."""
        d = self._dir(parent)
        assert d.children is not None
        _check_name(name)
        if name in d.children:
            raise FsError(errno.EEXIST)
        if d.nlink == 0:  # removed while someone had it as cwd
            raise FsError(errno.ENOENT)
        now = self.now()
        if d.mode & stat.S_ISGID and not exact:
            gid = d.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        inode = self._new_inode(mode, uid, gid, now, ino)
        inode.rdev = rdev
        inode.parent = d.ino
        inode.name = name
        if stat.S_ISDIR(mode):
            inode.nlink = 2
            inode.spec = d.spec
            d.nlink += 1
        elif stat.S_ISLNK(mode):
            inode.target = target or b""
        elif stat.S_ISREG(mode):
            inode.chunks = {}
            inode.layout = Layout.resolve(
                self.effective_spec(d), self.n_volumes, self.chunk_size, inode.ino
            )
        d.children[name] = inode.ino
        if not exact:
            self._touch_dir(d, now)
        if self.watcher is not None:
            self.watcher.created(inode.ino)
        return self._attr(inode)

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        return self._link_now(ino, parent, name)

    def _link_now(self, ino: int, parent: int, name: bytes) -> Attr:
        i = self._get(ino)
        d = self._dir(parent)
        assert d.children is not None
        _check_name(name)
        if i.children is not None:
            raise FsError(errno.EPERM)
        if name in d.children:
            raise FsError(errno.EEXIST)
        if i.nlink == 0:  # linkat() of an unlinked open file: not allowed without O_TMPFILE
            raise FsError(errno.ENOENT)
        now = self.now()
        d.children[name] = ino
        i.nlink += 1
        if i.links is None:
            i.links = []
        i.links.append((parent, name))
        i.ctime_ns = now
        self._touch_dir(d, now)
        if self.watcher is not None:
            self.watcher.created(ino)
        return self._attr(i)

    async def unlink(self, parent: int, name: bytes) -> None:
        d = self._dir(parent)
        assert d.children is not None
        i = self._child(d, name)
        if i.children is not None:
            raise FsError(errno.EISDIR)
        now = self.now()
        del d.children[name]
        self._touch_dir(d, now)
        self._unname(i, parent, name)
        self._drop_link(i, now)
        if self.watcher is not None:
            self.watcher.removed(parent, name, i.ino, False)

    async def rmdir(self, parent: int, name: bytes) -> None:
        d = self._dir(parent)
        assert d.children is not None
        if name == b".":
            raise FsError(errno.EINVAL)
        if name == b"..":
            raise FsError(errno.ENOTEMPTY)
        i = self._child(d, name)
        if i.children is None:
            raise FsError(errno.ENOTDIR)
        if i.children:
            raise FsError(errno.ENOTEMPTY)
        now = self.now()
        del d.children[name]
        d.nlink -= 1
        self._touch_dir(d, now)
        i.nlink = 0
        self._maybe_destroy(i)
        if self.watcher is not None:
            self.watcher.removed(parent, name, i.ino, True)

    async def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == (
            RENAME_NOREPLACE | RENAME_EXCHANGE
        ):
            raise FsError(errno.EINVAL)
        src_dir = self._dir(parent)
        dst_dir = self._dir(new_parent)
        assert src_dir.children is not None and dst_dir.children is not None
        src = self._child(src_dir, name)
        _check_name(new_name)
        dst_ino = dst_dir.children.get(new_name)
        dst = self.inodes[dst_ino] if dst_ino is not None else None
        # A directory may not move below itself (the kernel checks this too; a
        # remote client might not).
        if src.children is not None and self._is_ancestor(src.ino, dst_dir.ino):
            raise FsError(errno.EINVAL)
        now = self.now()

        if flags & RENAME_EXCHANGE:
            if dst is None:
                raise FsError(errno.ENOENT)
            if dst.children is not None and self._is_ancestor(dst.ino, src_dir.ino):
                raise FsError(errno.EINVAL)
            src_dir.children[name] = dst.ino
            dst_dir.children[new_name] = src.ino
            self._rename_link(src, parent, name, new_parent, new_name)
            self._rename_link(dst, new_parent, new_name, parent, name)
            if src_dir is not dst_dir:
                for moved, old, new in ((src, src_dir, dst_dir), (dst, dst_dir, src_dir)):
                    if moved.children is not None:
                        moved.parent = new.ino
                        old.nlink -= 1
                        new.nlink += 1
            src.ctime_ns = dst.ctime_ns = now
            self._touch_dir(src_dir, now)
            self._touch_dir(dst_dir, now)
            if self.watcher is not None:
                self.watcher.renamed(parent, name, new_parent, new_name, True, 0)
            return

        if dst is not None:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if dst is src:
                return  # POSIX: two links to one file, nothing happens
            if src.children is not None:
                if dst.children is None:
                    raise FsError(errno.ENOTDIR)
                if dst.children:
                    raise FsError(errno.ENOTEMPTY)
            elif dst.children is not None:
                raise FsError(errno.EISDIR)

        # All checks passed: from here on nothing can fail.
        del src_dir.children[name]
        if dst is not None:
            self._unname(dst, new_parent, new_name)
            if dst.children is not None:
                dst_dir.nlink -= 1
                dst.nlink = 0
                self._maybe_destroy(dst)
            else:
                self._drop_link(dst, now)
        dst_dir.children[new_name] = src.ino
        self._rename_link(src, parent, name, new_parent, new_name)
        if src.children is not None and src_dir is not dst_dir:
            src_dir.nlink -= 1
            dst_dir.nlink += 1
        src.ctime_ns = now
        self._touch_dir(src_dir, now)
        self._touch_dir(dst_dir, now)
        if self.watcher is not None:
            self.watcher.renamed(
                parent, name, new_parent, new_name, False, 0 if dst is None else dst.ino
            )

    async def readlink(self, ino: int) -> bytes:
        i = self._get(ino)
        if i.target is None:
            raise FsError(errno.EINVAL)
        return i.target

    async def readdir(self, ino: int) -> list[tuple[bytes, int]]:
        d = self._dir(ino)
        assert d.children is not None
        return list(d.children.items())

    async def readdirplus(self, ino: int) -> list[tuple[bytes, Attr]]:
        d = self._dir(ino)
        assert d.children is not None
        inodes = self.inodes
        return [(name, self._attr(inodes[c])) for name, c in d.children.items()]

    async def open(self, ino: int) -> Attr:
        i = self._get(ino)
        i.opens += 1
        return self._attr(i)

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        a = self._mknod_now(parent, name, mode, uid, gid, 0, None)
        self.inodes[a.ino].opens += 1
        return a

    # -- asynchronous creates (see memfs.meta.leases, "create leases") -----------------

    def reserve_inos(self, sid: bytes, count: int) -> int:
        """Reserve *count* inode numbers for session *sid*'s creates; the first."""
        first = self._next_ino
        self._next_ino += count
        self.delegated.setdefault(sid, set()).update(range(first, first + count))
        return first

    def create_at(
        self, sid: bytes, parent: int, name: bytes, mode: int, uid: int, gid: int, ino: int,
    ) -> tuple[Attr, bool]:
        """Create regular file *name* in *parent* as inode *ino*, one that was reserved
        for *sid*; (its attributes, True if it was created now).  Applied already (a
        client sends it again after a lost connection): (attributes, False)."""
        i = self.inodes.get(ino)
        if i is not None:
            # Reserved numbers are never handed out otherwise: it was made by this
            # call, sent before (and maybe renamed or unlinked since).
            return self._attr(i), False
        owned = self.delegated.get(sid)
        if owned is None or ino not in owned:
            raise FsError(errno.EINVAL, f"inode number {ino} was not reserved for this client")
        if not stat.S_ISREG(mode):
            raise FsError(errno.EINVAL, "only regular files are created asynchronously")
        a = self._mknod_now(parent, name, mode, uid, gid, 0, None, ino=ino)
        owned.discard(ino)
        if not owned:
            del self.delegated[sid]
        return a, True

    async def release(self, ino: int) -> None:
        i = self.inodes.get(ino)
        if i is None:
            log.warning("release of unknown inode %d", ino)
            return
        i.opens -= 1
        self._maybe_destroy(i)

    # -- extended attributes -----------------------------------------------------------

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        i = self._get(ino)
        if name == LAYOUT_XATTR:
            if i.layout is not None:
                return i.layout.format().encode()
            if i.spec is not None:
                return i.spec.format().encode()
            raise FsError(errno.ENODATA)
        if i.xattrs is None or name not in i.xattrs:
            raise FsError(errno.ENODATA)
        return i.xattrs[name]

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        i = self._get(ino)
        if name == LAYOUT_XATTR:
            self._set_layout(i, value)
        else:
            check_xattr_name(name)
            if len(value) > XATTR_SIZE_MAX:
                raise FsError(errno.E2BIG)
            if i.xattrs is None:
                i.xattrs = {}
            i.xattrs[name] = bytes(value)
        i.ctime_ns = self.now()

    def _set_layout(self, i: Inode, value: bytes) -> None:
        try:
            spec = LayoutSpec.parse(value.decode("utf-8", "replace"))
            if i.children is not None:
                # Validate against the pool now rather than at the first create.
                Layout.resolve(spec.merged(self.default_spec), self.n_volumes, self.chunk_size, 0)
                i.spec = spec
                return
            if not stat.S_ISREG(i.mode):
                raise FsError(errno.EINVAL, "layouts apply to regular files and directories")
            if i.chunks or i.size:
                # Like `lfs setstripe` on a file with data: the layout is fixed once
                # bytes are placed.
                raise FsError(errno.EBUSY, "file already has data; layout is fixed")
            assert i.layout is not None
            i.layout = Layout.resolve(
                spec.merged(self.default_spec), self.n_volumes, self.chunk_size, i.ino
            )
        except UsageError as exc:
            raise FsError(errno.EINVAL, str(exc)) from None

    async def listxattr(self, ino: int) -> list[bytes]:
        i = self._get(ino)
        return list(i.xattrs) if i.xattrs else []

    async def removexattr(self, ino: int, name: bytes) -> None:
        i = self._get(ino)
        if name == LAYOUT_XATTR and i.children is not None and i.spec is not None:
            i.spec = None
        elif i.xattrs and name in i.xattrs:
            del i.xattrs[name]
        else:
            raise FsError(errno.ENODATA)
        i.ctime_ns = self.now()

    async def statfs(self) -> StatFs:
        total, free = self.space.totals()
        per = self.chunk_size // 4096
        # Inodes are not limited (beyond daemon memory); the count shown must only
        # never go negative (statvfs fields are unsigned: df would get EIO).
        used = len(self.inodes)
        files = max(total * 16, 1 << 20, used)
        return StatFs(4096, total * per, free * per, files, files - used, NAME_MAX)

    # -- data placement -------------------------------------------------------------

    def _read_now(self, i: Inode) -> bool:
        """A read of *i* now: relatime (enough for ``find -atime`` and mail readers,
        cheap on the read path).  True if its access time moved."""
        if i.atime_ns <= i.mtime_ns or i.atime_ns <= i.ctime_ns or self.now() - i.atime_ns > _DAY_NS:
            i.atime_ns = self.now()
            return True
        return False

    def read_at(self, ino: int) -> bool:
        """A read of regular file *ino* now, served from a client's cached chunk map
        (its access time, as :meth:`map_read`'s); True if it moved.  A file gone: False."""
        i = self.inodes.get(ino)
        return i is not None and i.chunks is not None and self._read_now(i)

    async def map_read(self, ino: int, offset: int, length: int) -> list[Extent]:
        i = self._get(ino)
        if i.chunks is None:
            raise FsError(errno.EISDIR if i.children is not None else errno.EINVAL)
        end = min(offset + length, i.size)
        self._read_now(i)
        if end <= offset:
            return []
        return self.placement.extents_of(i, offset, end)

    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        i = self._get(ino)
        if i.chunks is None:
            raise FsError(errno.EISDIR if i.children is not None else errno.EINVAL)
        assert i.layout is not None
        if not length:  # POSIX: a zero-length write has no other results (size, mtime)
            return WritePlan([])
        cs = self.chunk_size
        end = offset + length
        chunks = i.chunks
        first, last = offset // cs, (end - 1) // cs
        self.placement.check_sealed(i, range(first, last + 1))
        missing = [k for k in range(first, last + 1) if k not in chunks]
        if missing:
            if i.backed and missing[0] * cs < i.backed:
                # A fresh chunk would read as zeros where the backing copy has data.
                raise FsError(errno.EIO, f"inode {ino}: write to data not fetched yet")
            self.placement.allocate(i, missing)  # clean chunks: they read as zeros already
        if end > i.size:
            i.size = end
        i.mtime_ns = i.ctime_ns = self.now()
        if self.watcher is not None:
            self.watcher.wrote(ino, first, last)
        return WritePlan(self.placement.extents_of(i, offset, end))

    async def allocate_ahead(
        self, ino: int, offset: int, length: int, ahead: int
    ) -> tuple[WritePlan, Attr]:
        plan = await self.map_write(ino, offset, length)
        i = self.inodes[ino]
        assert i.chunks is not None
        end = offset + length
        if ahead > 0 and not i.backed:
            cs = self.chunk_size
            first, last = (end + cs - 1) // cs, (end + ahead - 1) // cs
            missing = [k for k in range(first, last + 1) if k not in i.chunks]
            if missing and self.placement.sealed:
                try:  # (the plan below covers chunks there that exist too)
                    self.placement.check_sealed(i, range(first, last + 1))
                except FsError:
                    missing = []  # ahead of need is best effort
            if missing:
                try:
                    self.placement.allocate(i, missing)
                except FsError:  # SpaceBusy too: ahead of need is best effort
                    pass
                else:
                    plan = WritePlan(self.placement.extents_of(i, offset, end + ahead))
                    if self.watcher is not None:
                        # Write-back: the writer fills them without asking (its
                        # reports mark the file again), so they count as dirty now.
                        self.watcher.wrote(ino, first, last)
        return plan, self._attr(i)

    async def settle_write(
        self, ino: int, size: int, mtime_ns: int, trim: int, lo: int = -1, hi: int = -1,
    ) -> None:
        self.settle_now(ino, size, mtime_ns, bool(trim), (lo, hi))

    def settle_now(
        self, ino: int, size: int, mtime_ns: int, trim: bool, span: tuple[int, int] = (-1, -1),
    ) -> bool:
        """:meth:`Placement.settle` (a write lease's report; memfs.meta.server's call)."""
        return self.placement.settle(ino, size, mtime_ns, trim, span, self.watcher)

    def preallocated(self) -> list[int]:
        """:meth:`Placement.preallocated` (memfs.meta.server trims them)."""
        return self.placement.preallocated()

    # -- sessions of write leases (memfs.meta.server) ---------------------------------

    def new_run(self) -> None:
        """A server starts: sessions of the run before may report within its grace."""
        self.eligible |= self.this_run
        self.this_run = set()

    def registered(self, sid: bytes) -> bool:
        """Session *sid* registered in this run; True if that is news."""
        if sid in self.this_run:
            return False
        self.this_run.add(sid)
        return True

    def grace_ended(self) -> None:
        """No session of an earlier run may report any more (marks of sessions not
        in this run go too: back now, they are strangers, refused anyway)."""
        self.eligible.clear()
        for ino in list(self.unsaid):
            sids = self.unsaid[ino] & self.this_run
            if sids:
                self.unsaid[ino] = sids
            else:
                del self.unsaid[ino]

    def session_gone(self, sid: bytes) -> None:
        """Session *sid* expired: what it had is released, its marks go (if it comes
        back it is a stranger to this run, whose sizes are refused)."""
        self.this_run.discard(sid)
        self.eligible.discard(sid)
        self.delegated.pop(sid, None)  # numbers never used: they stay unused
        for ino in [i for i, sids in self.unsaid.items() if sid in sids]:
            self.lost_write(ino, sid, False)

    def lost_write(self, ino: int, sid: bytes, lost: bool) -> bool:
        """Mark (or, *lost* False, clear) session *sid*'s write lease on *ino* as ended
        without its word; True if anything changed."""
        if lost:
            if ino not in self.inodes:
                return False
            sids = self.unsaid.setdefault(ino, set())
            if sid in sids:
                return False
            sids.add(sid)
            return True
        have = self.unsaid.get(ino)
        if have is None or sid not in have:
            return False
        have.discard(sid)
        if not have:
            del self.unsaid[ino]
        return True

    # -- data that lives in a backing directory (memfs.flush) ----------------------

    def extents(self, ino: int, offset: int, length: int) -> list[Extent]:
        """Like :meth:`map_read` without touching atime (write-back reads through this)."""
        i = self._get(ino)
        if i.chunks is None:
            raise FsError(errno.EISDIR if i.children is not None else errno.EINVAL)
        end = min(offset + length, i.size)
        return self.placement.extents_of(i, offset, end) if end > offset else []

    # The burst buffer's calls (memfs.backing.surface): see :class:`Placement`.

    @property
    def reserved(self) -> set[tuple[int, int]]:
        """:attr:`Placement.reserved`: chunks of fetches not yet installed."""
        return self.placement.reserved

    @property
    def on_backing(self) -> Callable[[str, list[Any]], None] | None:
        """:attr:`Placement.on_backing` (memfs.meta.server journals what it reports)."""
        return self.placement.on_backing

    @on_backing.setter
    def on_backing(self, hook: Callable[[str, list[Any]], None] | None) -> None:
        self.placement.on_backing = hook

    def missing(self, ino: int, offset: int, length: int) -> list[int]:
        """:meth:`Placement.missing`."""
        return self.placement.missing(ino, offset, length)

    def reserve(self, ino: int, ks: list[int]) -> list[tuple[int, int, int]]:
        """:meth:`Placement.reserve`."""
        return self.placement.reserve(ino, ks)

    def install(self, ino: int, k: int, volume: int, voffset: int) -> bool:
        """:meth:`Placement.install`."""
        return self.placement.install(ino, k, volume, voffset)

    def unreserve(self, volume: int, voffset: int) -> None:
        """:meth:`Placement.unreserve`."""
        self.placement.unreserve(volume, voffset)

    def evict(self, ino: int) -> int:
        """:meth:`Placement.evict`."""
        return self.placement.evict(ino)

    def holding(self, volumes: set[int]) -> list[int]:
        """:meth:`Placement.holding`."""
        return self.placement.holding(volumes)

    def lose_memory(self, volumes: set[int]) -> list[int]:
        """:meth:`Placement.lose` (a memory server restarted blank; journaled by
        memfs.meta.takeback as ``_memory_lost``).  Each file that lost data is a new
        version to the watcher (write-back: a copy under way is dropped, and the
        next one fails with EIO rather than write zeros into DIR)."""
        damaged = self.placement.lose(volumes)
        if self.watcher is not None:
            for ino in damaged:
                self.watcher.rewritten(ino)
        return damaged

    def adopt(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int, *,
        size: int = 0, atime_ns: int = 0, mtime_ns: int = 0, rdev: int = 0,
        target: bytes | None = None,
    ) -> Attr:
        """Enter a file found in the backing directory: its data stays there until read."""
        watcher, self.watcher = self.watcher, None
        try:
            a = self._mknod_now(parent, name, mode, uid, gid, rdev, target, exact=True)
        finally:
            self.watcher = watcher
        i = self.inodes[a.ino]
        if i.chunks is not None:
            i.size = i.backed = size
        i.atime_ns, i.mtime_ns = atime_ns, mtime_ns
        return self._attr(i)

    def adopt_link(self, ino: int, parent: int, name: bytes) -> None:
        """A further hard link found in the backing directory (no watcher call)."""
        watcher, self.watcher = self.watcher, None
        try:
            self._link_now(ino, parent, name)
        finally:
            self.watcher = watcher

    def adopt_attrs(
        self, ino: int, *, mtime_ns: int, mode: int | None = None, uid: int | None = None,
        gid: int | None = None,
    ) -> None:
        """Attributes as found in the backing directory (no watcher call): a
        directory's mtime after its children were entered, the root's owner."""
        i = self._get(ino)
        i.mtime_ns = mtime_ns
        if mode is not None:
            i.mode = mode
        if uid is not None:
            i.uid = uid
        if gid is not None:
            i.gid = gid


    async def reclaim(self) -> None:
        await self.space.reclaim()

    async def aclose(self) -> None:
        self.inodes.clear()
