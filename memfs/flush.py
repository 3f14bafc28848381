"""memfs as a burst buffer: write-behind to a backing directory, stage-in, eviction.

:class:`BackedMeta` wraps the metadata store of a pool (embedded, or inside
``memfs mds``) and a transport to that pool's memory, and keeps a backing
directory DIR (the parallel filesystem) in step with it:

* **Write-behind.**  The store tells us (:class:`memfs.meta.store.Watcher`) of
  every change.  A regular file that changed is *dirty*; a worker writes it to
  ``DIR/.memfs-tmp/``, fsyncs it, and renames it into place, so DIR only ever
  holds whole versions of a file.  Each change bumps the file's version; a copy
  whose version moved on while it was being written is thrown away and made
  again, never published.  Files are eligible ``delay`` seconds after their last
  change, at once when ``memfs flush`` asks, when dirty data passes half the cap,
  and when the mount is going away.
* **Namespace.**  mkdir, rmdir, unlink, rename, symlink and chmod/utime of clean
  files become operations on DIR, with paths computed when they happened, and
  are applied in order by one task.  Publishing a file first applies every
  queued operation, under the same lock, so a file always lands at the path it
  has in memfs at that moment.
* **Backpressure.**  Dirty bytes are counted per chunk.  A write that would add
  dirty chunks beyond ``dirty_max`` waits until write-back makes room: the pool
  never fills with data that exists nowhere else.
* **Stage-in and read-through.**  At mount, DIR's tree is entered into the store
  with names and attributes only (``Inode.backed``).  A read of data that is not
  in the pool fetches the chunks it needs (a read waits for the part it needs,
  not the whole file); ``memfs stage-in`` fetches whole trees in the background.
* **Eviction.**  When the pool is full, whole clean files (their data is in DIR)
  are evicted, least recently used first, and fetched back on demand.  ENOSPC
  only when nothing clean is left to evict.

Backing-filesystem errors never fail an application's write: the data stays
dirty, the error is logged and shown by ``memfs status``, and the file is
retried with exponential backoff.  So are bugs: an unexpected exception in any
background task (scheduler, workers, namespace mirror, stager) is logged with
its traceback, shown by ``memfs status`` as ``(internal) ...``, and that task
carries on; none of them can end the mount without draining.

Cluster mode: the same object runs inside ``memfs mds``; clients see fetches
and backpressure as slower ``map_read``/``map_write`` replies.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import functools
import itertools
import logging
import os
import secrets
import shutil
import socket
import stat
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from memfs.config import FlushConfig
from memfs.errors import FsError, SpaceBusy
from memfs.host import process_alive
from memfs.meta import NOT_RESIDENT, Attr, Extent, Meta, SetAttr, StatFs, WritePlan
from memfs.meta.store import ROOT_INO, MetaStore
from memfs.transport import Transport

log = logging.getLogger(__name__)

#: where copies are written before they are renamed into place (inside DIR: same filesystem)
TMP_DIR = b".memfs-tmp"
#: in each daemon's temporary directory, flock'ed for the daemon's life
TMP_LOCK = b".lock"
#: ``setfattr -n user.memfs.flush -v off DIR``: never write this tree back file by file
EXCLUDE_XATTR = b"user.memfs.flush"
#: bytes moved per step of a copy or a fetch (a read waits for at most this much)
STEP = 1 << 20
MAX_BACKOFF = 30.0
RATE_WINDOW = 10.0
MAX_ERRORS = 20
TICKET_TTL = 600.0
#: errors of a namespace operation that mean DIR already differs from what we expected
#: (a file that was never written back, a directory someone else filled): nothing to retry
_SKIP_ERRNOS = {errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR, errno.EXDEV, errno.EINVAL}


class _Retry(Exception):
    """The backing directory failed; try again later (already recorded)."""


@dataclass(eq=False, slots=True)
class _Dirty:
    """A file whose pool copy differs from DIR's."""

    version: int
    since: float
    chunks: set[int] = field(default_factory=set)
    busy: bool = False  # queued for or held by a worker
    failures: int = 0
    retry_at: float = 0.0


@dataclass(eq=False)
class _NsOp:
    kind: str
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


@dataclass(eq=False)
class _Ticket:
    kind: str
    inos: set[int]
    total_files: int
    total_bytes: int
    ns_target: int = 0
    touched: float = field(default_factory=time.monotonic)
    #: stage-in: every file named, kept in memory in preference while the ticket lives
    keep: set[int] = field(default_factory=set)
    #: stage-in: files whose fetch failed -> (path, why)
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)


@dataclass
class _ErrorRecord:
    path: str
    error: str
    count: int = 0
    last: float = 0.0
    logged: float = 0.0


class BackedMeta(Meta):
    """The :class:`Meta` of a pool with a backing directory; see the module docstring."""

    def __init__(
        self, store: MetaStore, transport: Transport, cfg: FlushConfig, *,
        clock: Callable[[], float] = time.monotonic, settle: float = 0.0,
    ) -> None:
        self.store = store
        self.transport = transport
        self.cfg = cfg
        self.chunk_size = store.chunk_size
        self.n_volumes = store.n_volumes
        self.root = os.fsencode(cfg.backing)
        #: this daemon's temporary copies: DIR/.memfs-tmp/HOST-PID-TOKEN (DIR may be
        #: shared), in use while TMP_LOCK in it is flock'ed (see _remove_leftovers)
        self.tmp_top = os.path.join(self.root, TMP_DIR)
        self.tmp = os.path.join(self.tmp_top, b"%s-%d-%s" % (
            socket.gethostname().encode(), os.getpid(), secrets.token_hex(4).encode()))
        self._tmp_lock = -1
        #: (st_dev, st_ino) of DIR at mount: a DIR that vanished (its filesystem
        #: unmounted) is never re-created under the same name on another filesystem
        self._root_id: tuple[int, int] | None = None
        self.root_lost = False
        #: cluster (memfs mds): takes chunk maps of these inodes back from the clients
        #: that cache them (memfs.meta.leases) before eviction frees their chunks
        self.before_evict: Callable[[list[int]], Awaitable[None]] | None = None
        self.clock = clock
        #: cluster mode: seconds a write's bytes may take to reach a memory server after
        #: the mds placed it (the mds sees the placement, not the bytes); a copy begun
        #: sooner after a file's last change does not make it clean
        self.settle = settle
        capacity = sum(a.n_chunks for a in store.allocators) * store.chunk_size
        self.dirty_max = cfg.dirty_max if cfg.dirty_max is not None else capacity // 2
        self._is_root = os.geteuid() == 0
        self._versions = itertools.count(1)
        #: dirty files, least recently changed first
        self.dirty: collections.OrderedDict[int, _Dirty] = collections.OrderedDict()
        self.dirty_chunks = 0
        #: files in trees excluded from write-back (``user.memfs.flush=off``)
        self.pinned: set[int] = set()
        #: files with data in the pool, least recently used first (eviction order)
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.ns_ops: collections.deque[_NsOp] = collections.deque()
        self.ns_queued = 0  # operations ever queued
        self.ns_applied = 0  # ... and applied (or found moot)
        self.ns_lock = trio.Lock()
        self._fetching: dict[tuple[int, int], trio.Event] = {}
        self._forced: set[int] = set()  # files ``memfs flush`` asked for
        self._wake = trio.Event()  # scheduler: something to do
        self._ns_wake = trio.Event()
        self._ns_retry = trio.Event()  # `memfs flush`, unmount: retry namespace changes now
        self._cleaned = trio.Event()  # writers waiting on the cap
        self._stage_send, self._stage_recv = trio.open_memory_channel[tuple[int, int]](1 << 20)
        self.writers_waiting = 0
        self.draining = False
        self.flushed_bytes = 0
        self.flushed_files = 0
        self.fetched_bytes = 0
        self.evicted_bytes = 0
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self.errors: dict[str, _ErrorRecord] = {}
        self._tickets: dict[int, _Ticket] = {}
        self._ticket_ids = itertools.count(1)
        #: files named by live stage-in tickets (-> how many): evicted only as a last resort
        self._kept: collections.Counter[int] = collections.Counter()

    # -- start-up: the backing tree becomes the namespace ---------------------------------

    async def load(self) -> int:
        """Enter DIR's tree (names and attributes; data stays there until read).

        Returns the number of entries.  Leftover temporary copies of a daemon that
        was killed are removed: they were never renamed into place.
        """
        root_st, entries = await trio.to_thread.run_sync(self._scan)
        seen: dict[tuple[int, int], int] = {}
        by_path: dict[bytes, int] = {b"": ROOT_INO}
        for rel, st, target in entries:
            parent_rel, _, name = rel.rpartition(b"/")
            parent = by_path.get(parent_rel)
            if parent is None:
                continue
            key = (st.st_dev, st.st_ino)
            try:
                if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1 and key in seen:
                    watcher, self.store.watcher = self.store.watcher, None
                    try:
                        await self.store.link(seen[key], parent, name)
                    finally:
                        self.store.watcher = watcher
                    continue
                a = self.store.adopt(
                    parent, name, st.st_mode, st.st_uid, st.st_gid,
                    size=st.st_size if stat.S_ISREG(st.st_mode) else 0,
                    atime_ns=st.st_atime_ns, mtime_ns=st.st_mtime_ns,
                    rdev=st.st_rdev, target=target,
                )
            except FsError as exc:
                log.warning("backing entry %r not usable: %s", os.fsdecode(rel), exc)
                continue
            if stat.S_ISDIR(st.st_mode):
                by_path[rel] = a.ino
            elif st.st_nlink > 1:
                seen[key] = a.ino
        # Directory mtimes as in DIR (entering their children touched them).  The
        # mount's root is DIR's root: same owner and mode (a job's directory stays
        # the job's), and a chmod/chown of the root is mirrored onto DIR.
        for rel, st, _ in entries:
            if stat.S_ISDIR(st.st_mode) and rel in by_path:
                self.store.inodes[by_path[rel]].mtime_ns = st.st_mtime_ns
        root = self.store.inodes[ROOT_INO]
        root.mode, root.uid, root.gid = root_st.st_mode, root_st.st_uid, root_st.st_gid
        root.mtime_ns = root_st.st_mtime_ns
        self.store.watcher = self
        log.info("backing directory %s: %d entries visible", self.cfg.backing, len(entries))
        return len(entries)

    def _scan(self) -> tuple[os.stat_result, list[tuple[bytes, os.stat_result, bytes | None]]]:
        root_st = os.stat(self.root)
        self._root_id = (root_st.st_dev, root_st.st_ino)
        if not os.path.isdir(self.tmp_top):
            os.mkdir(self.tmp_top, 0o700)
            os.utime(self.root, ns=(root_st.st_atime_ns, root_st.st_mtime_ns))  # ours, not news
        self._remove_leftovers()
        os.mkdir(self.tmp, 0o700)
        self._lock_tmp()
        out: list[tuple[bytes, os.stat_result, bytes | None]] = []
        stack = [b""]
        while stack:
            rel = stack.pop()
            with os.scandir(os.path.join(self.root, rel) if rel else self.root) as it:
                for e in it:
                    if not rel and e.name == TMP_DIR:
                        continue
                    path = rel + b"/" + e.name if rel else e.name
                    st = e.stat(follow_symlinks=False)
                    target = os.readlink(e.path) if stat.S_ISLNK(st.st_mode) else None
                    out.append((path, st, target))
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(path)
        out.sort(key=lambda x: x[0].count(b"/"))  # parents before children
        return root_st, out

    def _lock_tmp(self) -> None:
        """Create the lock file in our temporary directory and hold an flock on it
        while this daemon lives: that, not a pid, tells another daemon on this host
        that the directory is in use (a pid means nothing across PID namespaces)."""
        # Read-only: a file open for writing would keep DIR from being remounted ro.
        fd = os.open(os.path.join(self.tmp, TMP_LOCK), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        old, self._tmp_lock = self._tmp_lock, fd
        if old >= 0:
            os.close(old)

    def _remove_leftovers(self) -> None:
        """Temporary copies of daemons of this host that are gone (killed): never
        renamed into place, so never part of DIR.  Other hosts' are theirs.

        A directory is gone when its lock file can be flock'ed (its daemon held it
        until it died); one from an older memfs (HOST-PID, no lock file) when no
        process has that pid.  A directory of this host with neither is a daemon
        between mkdir and lock: left alone.
        """
        host = socket.gethostname().encode()
        for name in os.listdir(self.tmp_top):
            path = os.path.join(self.tmp_top, name)
            if not os.path.isdir(path) or os.path.islink(path):
                _unlink_quiet(path)  # junk
                continue
            if not name.startswith(host + b"-"):
                continue
            try:
                fd = os.open(os.path.join(path, TMP_LOCK), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                pid = name[len(host) + 1 :]
                if pid.isdigit() and not process_alive(int(pid)):
                    shutil.rmtree(path, ignore_errors=True)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its daemon lives (maybe in another PID namespace)
            else:
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)

    def _check_root(self) -> None:
        """OSError(ESTALE) if DIR is gone or is not the directory we mounted with."""
        try:
            st = os.stat(self.root)
            ok = (st.st_dev, st.st_ino) == self._root_id
        except OSError:
            ok = False
        self.root_lost = not ok
        if not ok:
            raise OSError(errno.ESTALE, "the backing directory vanished or was replaced")

    # -- the store's change notifications (Watcher) ---------------------------------------

    def _mark(self, ino: int) -> _Dirty | None:
        if ino in self.pinned and self._excluded(ino):
            return None
        self.pinned.discard(ino)
        d = self.dirty.get(ino)
        now = self.clock()
        if d is None:
            d = self.dirty[ino] = _Dirty(next(self._versions), now)
        else:
            d.version = next(self._versions)
            d.since = now
            self.dirty.move_to_end(ino)
        # The scheduler sleeps until the oldest change is due; a change now is due
        # no sooner, so it only needs waking when it had nothing to wait for (a task
        # switch per write is measurable on the create path).
        if len(self.dirty) == 1 or not self.cfg.delay:
            self._wake.set()
        return d

    def wrote(self, ino: int, first: int, last: int) -> None:
        d = self._mark(ino)
        if d is not None:
            before = len(d.chunks)
            d.chunks.update(range(first, last + 1))
            self.dirty_chunks += len(d.chunks) - before
            if self.dirty_chunks * self.chunk_size >= self.dirty_max // 2:
                self._wake.set()  # past half the cap: write back without waiting
        self._touch(ino)

    def truncated(self, ino: int) -> None:
        d = self._mark(ino)
        i = self.store.inodes.get(ino)
        if d is not None and i is not None and d.chunks:
            keep = -(-i.size // self.chunk_size)
            gone = {k for k in d.chunks if k >= keep}
            d.chunks -= gone
            self.dirty_chunks -= len(gone)
            if gone:
                self._cleaned.set()  # writers waiting on the cap may go on
                self._cleaned = trio.Event()

    def attrs_changed(self, ino: int) -> None:
        i = self.store.inodes.get(ino)
        if i is None:
            return
        if ino in self.dirty:
            self._mark(ino)  # the copy carries the attributes: just a new version
            return
        path = self.store.path(ino)
        if path is not None and not self._excluded(ino):
            self._queue(_NsOp("attrs", path, mode=i.mode, uid=i.uid, gid=i.gid, mtime_ns=i.mtime_ns))

    def created(self, ino: int) -> None:
        i = self.store.inodes[ino]
        if stat.S_ISREG(i.mode):
            self._mark(ino)
            return
        paths = self.store.paths(ino)
        if not paths or self._excluded(ino):
            return
        path = paths[-1]  # a new hard link is the last name
        if stat.S_ISDIR(i.mode):
            self._queue(_NsOp("mkdir", path, mode=i.mode, uid=i.uid, gid=i.gid))
        elif stat.S_ISLNK(i.mode):
            self._queue(_NsOp("symlink", path, target=i.target or b"", uid=i.uid, gid=i.gid,
                              mtime_ns=i.mtime_ns))
        else:
            self._queue(_NsOp("mknod", path, mode=i.mode, rdev=i.rdev, uid=i.uid, gid=i.gid))

    def removed(self, parent: int, name: bytes, ino: int) -> None:
        path = self.store.entry_path(parent, name)
        i = self.store.inodes.get(ino)
        if path is None or i is None:
            return
        self._queue(_NsOp("rmdir" if i.children is not None else "unlink", path,
                          keep=self._keep(ino, dropping=1)))

    def renamed(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes,
        exchange: bool, replaced: int,
    ) -> None:
        old = self.store.entry_path(parent, name)
        new = self.store.entry_path(new_parent, new_name)
        if old is None or new is None:
            return
        # The replaced file's copy in DIR is at the target path until the rename.
        self._queue(_NsOp("exchange" if exchange else "rename", old, new,
                          keep=self._keep(replaced) if replaced else 0, keep_from=new))
        if self.pinned:
            d = self.store.inodes.get(new_parent)
            moved = d.children.get(new_name) if d is not None and d.children else None
            i = self.store.inodes.get(moved) if moved is not None else None
            if i is not None and (i.ino in self.pinned or i.children) and not self._excluded(i.ino):
                self._unpin()  # moved out of an excluded tree: written back after all

    def destroyed(self, ino: int) -> None:
        d = self.dirty.pop(ino, None)
        if d is not None:
            self.dirty_chunks -= len(d.chunks)
            self._cleaned.set()
            self._cleaned = trio.Event()
        self.pinned.discard(ino)
        self.lru.pop(ino, None)
        self._kept.pop(ino, None)

    def _keep(self, ino: int, dropping: int = 0) -> int:
        """*ino* loses its last name while still open, with data only in DIR: fetch it
        first.  *dropping*: links the store is about to take away."""
        i = self.store.inodes.get(ino)
        if i is None or i.opens <= 0 or i.nlink - dropping > 0 or not i.backed:
            return 0
        return ino if self.store.missing(ino, 0, i.backed) else 0

    def _queue(self, op: _NsOp) -> None:
        self.ns_ops.append(op)
        self.ns_queued += 1
        self._ns_wake.set()

    def _touch(self, ino: int) -> None:
        lru = self.lru
        if ino in lru:
            lru.move_to_end(ino)
        else:
            lru[ino] = None

    def _excluded(self, ino: int) -> bool:
        """Is *ino* in a tree marked ``user.memfs.flush=off``?"""
        inodes = self.store.inodes
        while True:
            i = inodes.get(ino)
            if i is None:
                return False
            if i.xattrs and i.xattrs.get(EXCLUDE_XATTR) == b"off":
                return True
            if ino == ROOT_INO:
                return False
            ino = i.parent

    # -- Meta: the data path ------------------------------------------------------------

    async def map_read(self, ino: int, offset: int, length: int) -> list[Extent]:
        for _ in range(8):
            extents = await self.store.map_read(ino, offset, length)
            if not any(e.volume == NOT_RESIDENT for e in extents):
                self._touch(ino)
                return extents
            await self._ensure_resident(ino, offset, length)
        raise FsError(errno.EIO, f"inode {ino}: data keeps being evicted (pool too small?)")

    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        cs = self.chunk_size
        span = (offset + length - 1) // cs - offset // cs + 1 if length else 0
        if length and (self.store.missing(ino, offset, length)
                       or (self.dirty_chunks + span) * cs > self.dirty_max):
            for _ in range(8):
                await self._ensure_resident(ino, offset, length)
                await self._wait_dirty_room(ino, offset, length)
                if not self.store.missing(ino, offset, length):
                    break
            else:
                raise FsError(errno.EIO, f"inode {ino}: data keeps being evicted (pool too small?)")
        try:  # the common case: data resident, room below the cap, free chunks
            return await self.store.map_write(ino, offset, length)
        except FsError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EAGAIN):
                raise
        return await self._with_room(lambda: self._map_write_now(ino, offset, length), protect=ino)

    async def _map_write_now(self, ino: int, offset: int, length: int) -> WritePlan:
        # Another task may have evicted this file while we waited for room.
        await self._ensure_resident(ino, offset, length)
        return await self.store.map_write(ino, offset, length)

    async def _wait_dirty_room(self, ino: int, offset: int, length: int) -> None:
        """Backpressure: wait while this write would take dirty data past the cap."""
        cs = self.chunk_size
        first, last = offset // cs, (offset + length - 1) // cs
        while True:
            d = self.dirty.get(ino)
            new = (last - first + 1) - (sum(1 for k in range(first, last + 1) if k in d.chunks) if d else 0)
            if not new or not self.dirty_chunks or (self.dirty_chunks + new) * cs <= self.dirty_max:
                return
            if ino in self.pinned and self._excluded(ino):
                return
            self.writers_waiting += 1
            self._wake.set()
            try:
                await self._cleaned.wait()
            finally:
                self.writers_waiting -= 1

    async def _with_room(self, fn: Callable[[], Any], protect: int = 0) -> Any:
        """Run store call *fn*; on a full pool evict clean data, scrub, and retry.
        *protect*: a file that must keep its pool data (the one being written)."""
        for _ in range(16):
            try:
                return await fn()
            except SpaceBusy:
                await self.store.reclaim()
            except FsError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if not await self._evict(STEP // self.chunk_size * 4, protect):
                    raise
        raise FsError(errno.ENOSPC)

    async def _evict(self, want: int, protect: int = 0) -> bool:
        """Evict clean files, least recently used first, until *want* chunks are freed."""
        if self.root_lost:
            return False  # DIR is gone: the pool may hold the only copy of everything
        self._expire_tickets()  # staged files stop being spared when their ticket ends
        freed = 0
        inodes = self.store.inodes
        # Files just staged in are kept while anything else can go.  The oldest few
        # thousand are almost always enough; the rest only if not.
        def evictable(ino: int, spare_staged: bool) -> bool:
            i = inodes.get(ino)
            if i is None or not i.chunks:
                self.lru.pop(ino, None)
                return False
            return not (ino == protect or ino in self.dirty or ino in self.pinned or i.nlink <= 0
                        or not stat.S_ISREG(i.mode) or (spare_staged and ino in self._kept)
                        or self._excluded(ino))

        for spare_staged, start, stop in ((True, 0, 4096), (True, 4096, None), (False, 0, None)):
            if not spare_staged and not self._kept:
                break  # nothing was spared: the first passes saw everything
            victims = []
            need = want - freed
            for ino in list(itertools.islice(self.lru, start, stop)):
                if need <= 0:
                    break
                if evictable(ino, spare_staged):
                    victims.append(ino)
                    need -= len(inodes[ino].chunks or ())
            if victims and self.before_evict is not None:
                # Clients reading these files through cached chunk maps let go first
                # (the chunks are reused as soon as they are scrubbed).
                await self.before_evict(victims)
            for ino in victims:
                if freed >= want:
                    break
                if not evictable(ino, spare_staged):  # changed while the clients answered
                    continue
                n = self.store.evict(ino)
                self.lru.pop(ino, None)
                freed += n
                self.evicted_bytes += n * self.chunk_size
                log.debug("evicted inode %d (%d chunks)", ino, n)
            if freed >= want:
                break
        if freed:
            await self.store.reclaim()
        return freed > 0

    async def _ensure_resident(
        self, ino: int, offset: int, length: int, path: bytes | None = None
    ) -> None:
        """Fetch what ``[offset, offset+length)`` of *ino* needs from DIR; wait for fetches
        others started of the same chunks.  *path*: where in DIR (default: its name now)."""
        while ks := self.store.missing(ino, offset, length):
            mine = [k for k in ks if (ino, k) not in self._fetching]
            if mine:
                try:
                    await self._fetch(ino, mine, path)
                except FsError:
                    if self.store.missing(ino, offset, length):
                        raise
                    return  # fetched by someone else meanwhile (a file being unlinked)
            for k in ks:
                ev = self._fetching.get((ino, k))
                if ev is not None:
                    await ev.wait()

    async def _fetch(self, ino: int, ks: list[int], path: bytes | None = None) -> None:
        """Fetch chunks *ks* of *ino* from DIR: one open of its copy, then a STEP at a
        time, each part claimed just before it is read, so a reader that needs a later
        part meanwhile fetches that part itself instead of waiting for this one."""
        cs = self.chunk_size
        # Open first: that may wait for the namespace lock, whose holder may be
        # fetching this very file (before an unlink): chunks are claimed only after.
        fd = await self._open_backing(ino, path)
        try:
            for run in _runs(ks):
                for part in (run[j : j + STEP // cs] for j in range(0, len(run), STEP // cs)):
                    mine = [k for k in part if (ino, k) not in self._fetching]
                    events = {k: trio.Event() for k in mine}
                    for k, ev in events.items():
                        self._fetching[(ino, k)] = ev
                    try:
                        for sub in _runs(mine):
                            await self._fetch_run(ino, fd, sub)
                    finally:
                        for k, ev in events.items():
                            del self._fetching[(ino, k)]
                            ev.set()
        finally:
            _close_soon(fd)

    async def _open_backing(self, ino: int, path: bytes | None) -> int:
        if path is None:
            # DIR must match the namespace first: a rename may still be queued.
            async with self.ns_lock:
                try:
                    await self._apply_ns_ops()
                except _Retry:
                    pass  # reading may work where writing does not, if no change is in the way
                paths = self.store.paths(ino)
                if not paths:
                    raise FsError(errno.EIO, f"inode {ino}: data only in the backing directory, "
                                             "and the file has no name there any more")
                path = paths[0]
                if self._pending_op_touches(path):
                    # A change not applied yet moves what DIR has at that path: reading
                    # it could give another file's bytes.
                    raise FsError(errno.EIO, f"{os.fsdecode(path)}: its data is in the backing "
                                             "directory, which cannot be updated right now")
        full = os.path.join(self.root, path)
        try:
            return await trio.to_thread.run_sync(os.open, full, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._record_error(path, "read", exc)
            raise FsError(errno.EIO, f"cannot read {os.fsdecode(full)}: {exc.strerror}") from None

    def _pending_op_touches(self, path: bytes) -> bool:
        """Does a queued namespace operation name *path* or a directory above it?"""
        for op in self.ns_ops:
            for p in (op.path, op.path2):
                if p and (p == path or path.startswith(p + b"/")):
                    return True
        return False

    async def _fetch_run(self, ino: int, fd: int, ks: list[int]) -> None:
        cs = self.chunk_size
        i = self.store.inodes.get(ino)
        if i is None:
            return
        ks = [k for k in ks if k not in (i.chunks or {}) and k * cs < i.backed]
        if not ks:
            return
        if ks[-1] - ks[0] != len(ks) - 1:  # another reader filled a chunk in between
            for run in _runs(ks):
                await self._fetch_run(ino, fd, run)
            return
        start = ks[0] * cs
        n = min(len(ks) * cs, i.backed - start)
        buf = bytearray(len(ks) * cs)
        try:
            got = await trio.to_thread.run_sync(_pread_full, fd, memoryview(buf)[:n], start)
        except OSError as exc:
            self._record_error(self.store.path(ino) or b"?", "read", exc)
            raise FsError(errno.EIO, f"cannot read inode {ino} from the backing directory: "
                                     f"{exc.strerror}") from None
        if got < n:  # shrunk behind our back: zeros would be wrong data
            path = self._where(ino)
            short = OSError(errno.EIO, f"the backing copy ends at {start + got}, expected {i.backed} bytes")
            self._record_error(path, "read", short)
            raise FsError(errno.EIO, f"{os.fsdecode(path)}: {short.strerror}")
        placed = await self._with_room(lambda: self._reserve(ino, ks))
        view = memoryview(buf)
        try:
            for k, vol, voff in placed:
                off = (k - ks[0]) * cs
                await self.transport.write(vol, voff, view[off : off + cs])
        except BaseException:
            for _, vol, voff in placed:
                self.store.unreserve(vol, voff)
            raise
        for k, vol, voff in placed:
            self.store.install(ino, k, vol, voff)
        self.fetched_bytes += n
        self._touch(ino)

    async def _reserve(self, ino: int, ks: list[int]) -> list[tuple[int, int, int]]:
        return self.store.reserve(ino, ks)

    # -- Meta: everything else goes straight to the store ---------------------------------

    async def lookup(self, parent: int, name: bytes) -> Attr:
        return await self.store.lookup(parent, name)

    async def getattr(self, ino: int) -> Attr:
        return await self.store.getattr(ino)

    async def setattr(self, ino: int, changes: SetAttr) -> Attr:
        return await self.store.setattr(ino, changes)

    async def truncate(self, ino: int, size: int) -> list[tuple[int, int, int]]:
        i = self.store.inodes.get(ino)
        if i is not None and i.backed and size and size % self.chunk_size:
            # The chunk holding the new EOF keeps its head: fetch it so it is not lost.
            await self._ensure_resident(ino, size - 1, 1)
        return await self.store.truncate(ino, size)

    @staticmethod
    def _check_reserved(parent: int, name: bytes) -> None:
        # DIR/.memfs-tmp holds our temporary copies; a file of that name would be
        # written back into it and removed at the next mount.
        if parent == ROOT_INO and name == TMP_DIR:
            raise FsError(errno.EPERM, f"{TMP_DIR.decode()} is reserved in a mount with a backing directory")

    async def mknod(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int,
        rdev: int = 0, target: bytes | None = None,
    ) -> Attr:
        self._check_reserved(parent, name)
        return await self.store.mknod(parent, name, mode, uid, gid, rdev, target)

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        self._check_reserved(parent, name)
        return await self.store.link(ino, parent, name)

    async def unlink(self, parent: int, name: bytes) -> None:
        await self.store.unlink(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self.store.rmdir(parent, name)

    async def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        self._check_reserved(new_parent, new_name)
        await self.store.rename(parent, name, new_parent, new_name, flags)

    async def readlink(self, ino: int) -> bytes:
        return await self.store.readlink(ino)

    async def readdir(self, ino: int) -> list[tuple[bytes, int]]:
        return await self.store.readdir(ino)

    async def open(self, ino: int) -> Attr:
        return await self.store.open(ino)

    async def release(self, ino: int) -> None:
        await self.store.release(ino)

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self.store.getxattr(ino, name)

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        await self.store.setxattr(ino, name, value)
        if name == EXCLUDE_XATTR:
            self._wake.set()  # dirty files below may now be pinned

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self.store.listxattr(ino)

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self.store.removexattr(ino, name)
        if name == EXCLUDE_XATTR:
            self._unpin()

    async def statfs(self) -> StatFs:
        return await self.store.statfs()

    async def reclaim(self) -> None:
        await self.store.reclaim()

    async def aclose(self) -> None:
        await self.store.aclose()

    def _unpin(self) -> None:
        """An exclusion was lifted: pinned files are written back after all."""
        for ino in list(self.pinned):
            if not self._excluded(ino):
                self.pinned.discard(ino)
                i = self.store.inodes.get(ino)
                if i is not None and i.chunks is not None:
                    d = self._mark(ino)
                    if d is not None:
                        before = len(d.chunks)
                        d.chunks.update(i.chunks)
                        self.dirty_chunks += len(d.chunks) - before

    # -- the background work ----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write back, apply namespace operations and stage in, until cancelled."""
        async with trio.open_nursery() as nursery:
            send, recv = trio.open_memory_channel[int](0)
            for _ in range(self.cfg.workers):
                nursery.start_soon(self._worker, recv.clone())
                nursery.start_soon(self._stager)
            nursery.start_soon(self._ns_worker)
            task_status.started()
            await self._schedule(send)

    async def _schedule(self, send: trio.MemorySendChannel[int]) -> None:
        """Hand due files to the workers: forced ones first, then by age of last change.

        A bug in a round is logged and the next round comes a second later: the
        dirty files stay dirty, and the mount must keep draining them.
        """
        while True:
            try:
                await self._schedule_round(send)
            except Exception as exc:
                self._record_bug("write-back scheduler", exc)
                await trio.sleep(1.0)

    async def _schedule_round(self, send: trio.MemorySendChannel[int]) -> None:
        """Hand out what is due now, or wait until something may be."""
        now = self.clock()
        urgent = (
            self.draining or self.writers_waiting > 0
            or self.dirty_chunks * self.chunk_size >= self.dirty_max // 2
        )
        due: list[int] = []
        wait = 3600.0
        for ino in list(self._forced):
            d = self.dirty.get(ino)
            if d is None:
                self._forced.discard(ino)
            elif not d.busy:
                if d.retry_at > now:
                    wait = min(wait, d.retry_at - now)
                else:
                    due.append(ino)
        for ino, d in self.dirty.items():
            if len(due) >= 256:
                break
            if d.busy or ino in self._forced:
                continue
            if d.retry_at > now:
                wait = min(wait, d.retry_at - now)
                continue
            ready_at = d.since + self.cfg.delay
            if urgent or ready_at <= now:
                due.append(ino)
            else:  # ordered by last change: nothing after this one is due either
                wait = min(wait, ready_at - now)
                break
        if not due:
            with trio.move_on_after(max(wait, 0.01)):
                await self._wake.wait()
            self._wake = trio.Event()
            return
        for ino in due:
            d2 = self.dirty.get(ino)
            if d2 is None or d2.busy:
                continue
            d2.busy = True
            self._forced.discard(ino)
            await send.send(ino)

    async def _worker(self, recv: trio.MemoryReceiveChannel[int]) -> None:
        buf = self.transport.register(STEP)
        async for ino in recv:
            d = self.dirty.get(ino)
            if d is None:
                continue
            try:
                await self._flush_one(ino, d, buf)
            except _Retry:
                self._backoff(d)
            except FsError as exc:  # pool memory unreadable (dead memory server...)
                path = self.store.path(ino) or b"?"
                self._record_error(path, "read from the pool", exc)
                self._backoff(d)
            except Exception as exc:  # a bug: log it, keep the data dirty, keep the mount alive
                self._record_bug(f"write-back of inode {ino}", exc)
                self._backoff(d)
            finally:
                d.busy = False
                self._wake.set()

    def _backoff(self, d: _Dirty) -> None:
        d.failures += 1
        d.retry_at = self.clock() + min(MAX_BACKOFF, 0.5 * 2 ** min(d.failures, 10))

    async def _flush_one(self, ino: int, d: _Dirty, buf: memoryview) -> None:
        v = d.version
        i = self.store.inodes.get(ino)
        if i is None or i.nlink <= 0 or not self.store.paths(ino):
            self._clean(ino, v)  # unlinked: nothing to write
            return
        if self._excluded(ino):
            self._clean(ino, v)
            self.pinned.add(ino)
            return
        started = self.clock()
        tmp = await self._copy(ino, v, buf)
        if tmp is None:
            return  # changed while copying: stays dirty, goes round again
        published = False
        try:
            async with self.ns_lock:
                await self._apply_ns_ops()
                if self._version(ino) != v:
                    return
                paths = self.store.paths(ino)
                if paths:
                    try:
                        try:
                            await trio.to_thread.run_sync(self._publish, tmp, paths, None)
                        except FileNotFoundError:
                            dirs = self._parent_dirs(ino)
                            await trio.to_thread.run_sync(self._publish, tmp, paths, dirs)
                    except OSError as exc:
                        self._record_error(paths[0], "write back", exc)
                        raise _Retry() from None
                    published = True
        finally:
            if not published:
                await trio.to_thread.run_sync(_unlink_quiet, tmp)
        if not published:  # it lost its last name meanwhile: nothing to write
            self._clean(ino, v)
            return
        self.flushed_files += 1
        self._count_rate(i.size)
        self._clear_error(paths[0] if paths else b"")
        if started - d.since < self.settle and self._version(ino) == v:
            # A write placed just before the copy began may still have been on its
            # way to a memory server: copy once more when that cannot be so.
            d.retry_at = d.since + self.settle
            self._forced.add(ino)
            return
        self._clean(ino, v)

    def _where(self, ino: int) -> bytes:
        return self.store.path(ino) or b"(unlinked)"

    def _version(self, ino: int) -> int:
        d = self.dirty.get(ino)
        return -1 if d is None else d.version

    async def _copy(self, ino: int, v: int, buf: memoryview) -> bytes | None:
        """Write version *v* of *ino* to a temporary file in DIR; None if it changed meanwhile."""
        i = self.store.inodes[ino]
        size, mode, uid, gid = i.size, i.mode, i.uid, i.gid
        times = (i.atime_ns, i.mtime_ns)
        tmp = os.path.join(self.tmp, b"%d.%d.%s" % (ino, v, secrets.token_hex(4).encode()))
        if size <= STEP:  # one step: the whole copy in one trip to a worker thread
            extents = self.store.extents(ino, 0, size)
            if not any(e.volume == NOT_RESIDENT for e in extents):
                view = buf[:size]
                for e in extents:
                    if e.volume >= 0:
                        await self.transport.readinto(e.volume, e.voffset, view[e.offset : e.offset + e.length])
                    else:
                        view[e.offset : e.offset + e.length] = bytes(e.length)
                if self._version(ino) != v:
                    return None
                try:
                    await trio.to_thread.run_sync(
                        self._write_whole, tmp, view, size, mode, uid, gid, times
                    )
                except OSError as exc:
                    self._record_error(self._where(ino), "write back", exc)
                    raise _Retry() from None
                return tmp
        try:
            fd = await trio.to_thread.run_sync(self._create_tmp, tmp)
        except OSError as exc:
            self._record_error(self._where(ino), "write back", exc)
            raise _Retry() from None
        ok = False
        src = -1  # the copy in DIR, for data not in the pool (staged lazily, evicted)
        try:
            off = 0
            while off < size:
                n = min(STEP, size - off)
                if self._version(ino) != v:
                    return None
                extents = self.store.extents(ino, off, n)
                if not any(e.volume != -1 for e in extents):
                    off += n  # a hole: left sparse, ftruncate gives it its size
                    continue
                if src < 0 and any(e.volume == NOT_RESIDENT for e in extents):
                    src = await self._open_backing(ino, None)
                view = buf[:n]
                old: list[tuple[int, int]] = []
                for e in extents:
                    a, b = e.offset - off, e.offset - off + e.length
                    if e.volume >= 0:
                        await self.transport.readinto(e.volume, e.voffset, view[a:b])
                    elif e.volume == NOT_RESIDENT:
                        old.append((a, b))  # straight from DIR's copy, not via the pool
                    else:
                        view[a:b] = bytes(b - a)
                if self._version(ino) != v:
                    return None
                try:
                    await trio.to_thread.run_sync(_write_step, fd, view, off, src, old)
                except OSError as exc:
                    self._record_error(self._where(ino), "write back", exc)
                    raise _Retry() from None
                off += n
            try:
                await trio.to_thread.run_sync(
                    self._finish_copy, fd, size, mode, uid, gid, times
                )
            except OSError as exc:
                self._record_error(self._where(ino), "write back", exc)
                raise _Retry() from None
            written, fd = fd, -1
            try:
                await _close_written(written)
            except OSError as exc:  # a parallel filesystem may report a write error here
                self._record_error(self._where(ino), "write back", exc)
                raise _Retry() from None
            ok = True
            return tmp
        finally:
            if fd >= 0:
                _close_soon(fd)
            if src >= 0:
                _close_soon(src)
            if not ok:
                await trio.to_thread.run_sync(_unlink_quiet, tmp)

    def _write_whole(
        self, tmp: bytes, view: memoryview, size: int, mode: int, uid: int, gid: int,
        times: tuple[int, int],
    ) -> None:
        fd = self._create_tmp(tmp)
        try:
            if size:
                _pwrite_full(fd, view, 0)
            self._finish_copy(fd, size, mode, uid, gid, times)
        except BaseException:
            os.close(fd)
            _unlink_quiet(tmp)
            raise
        os.close(fd)

    def _create_tmp(self, tmp: bytes) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            return os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            # Someone emptied DIR: make our directories again, but only inside the
            # DIR we mounted (if it is gone, its filesystem may be unmounted).
            self._check_root()
            for d in (self.tmp_top, self.tmp):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d, 0o700)
            self._lock_tmp()
            return os.open(tmp, flags, 0o600)

    def _finish_copy(
        self, fd: int, size: int, mode: int, uid: int, gid: int, times: tuple[int, int]
    ) -> None:
        os.ftruncate(fd, size)
        if self._is_root:
            os.fchown(fd, uid, gid)
        os.fchmod(fd, stat.S_IMODE(mode))
        os.utime(fd, ns=times)
        if self.cfg.fsync:
            os.fsync(fd)

    def _parent_dirs(self, ino: int) -> list[_NsOp]:
        """mkdir operations for every directory above *ino*'s names, outermost first
        (to recreate what vanished from DIR, with memfs's modes and owners)."""
        i = self.store.inodes.get(ino)
        if i is None:
            return []
        out: dict[bytes, _NsOp] = {}
        for parent in [i.parent, *(p for p, _ in i.links or ())]:
            chain = []
            while parent != ROOT_INO:
                d = self.store.inodes.get(parent)
                path = self.store.path(parent)
                if d is None or path is None:
                    break
                chain.append(_NsOp("mkdir", path, mode=d.mode, uid=d.uid, gid=d.gid))
                parent = d.parent
            for op in reversed(chain):
                out.setdefault(op.path, op)
        return list(out.values())

    def _publish(self, tmp: bytes, paths: list[bytes], dirs: list[_NsOp] | None) -> None:
        """Rename the copy into place under every name (hard links stay hard links).

        FileNotFoundError without *dirs*: a directory is missing in DIR; the caller
        computes which (from the store, in the trio thread) and calls again."""
        self._check_root()  # never into a DIR that is not the one we mounted
        for n, p in enumerate(paths):
            dest = os.path.join(self.root, p)
            src = tmp
            if n < len(paths) - 1:
                src = tmp + b".%d" % n
                _unlink_quiet(src)  # left by an attempt that failed on a missing directory
                os.link(tmp, src)
            try:
                os.rename(src, dest)
            except FileNotFoundError:
                if dirs is None:
                    raise
                # A directory vanished from DIR behind our back (or its mkdir was
                # skipped): make the missing ones as they are in memfs.
                self._check_root()
                for op in dirs:
                    if not os.path.isdir(os.path.join(self.root, op.path)):
                        self._apply(op)
                os.rename(src, dest)

    def _clean(self, ino: int, v: int) -> None:
        d = self.dirty.get(ino)
        if d is None or d.version != v:
            return
        del self.dirty[ino]
        self.dirty_chunks -= len(d.chunks)
        self._cleaned.set()
        self._cleaned = trio.Event()

    def _count_rate(self, n: int) -> None:
        now = self.clock()
        self.flushed_bytes += n
        self._rate.append((now, n))
        while self._rate and self._rate[0][0] < now - RATE_WINDOW:
            self._rate.popleft()

    # -- namespace operations -------------------------------------------------------------

    async def _ns_worker(self) -> None:
        failures = 0
        while True:
            if not self.ns_ops:
                await self._ns_wake.wait()
                self._ns_wake = trio.Event()
                continue
            try:
                async with self.ns_lock:
                    await self._apply_ns_ops()
                failures = 0
                continue
            except _Retry:
                pass
            except Exception as exc:  # a bug: the queue is kept, so nothing is lost
                self._record_bug("namespace mirror", exc)
            failures += 1
            # Back off, but `memfs flush` and unmount try again at once.
            with trio.move_on_after(min(MAX_BACKOFF, 0.5 * 2 ** min(failures, 10))):
                await self._ns_retry.wait()
            if self._ns_retry.is_set():
                self._ns_retry = trio.Event()
                failures = 0

    async def _apply_ns_ops(self) -> None:
        """Apply every queued namespace operation, in order (hold ``ns_lock``)."""
        while self.ns_ops:
            op = self.ns_ops[0]
            if op.keep:
                i = self.store.inodes.get(op.keep)
                if i is not None:
                    try:
                        await self._ensure_resident(op.keep, 0, i.backed, op.keep_from or op.path)
                    except FsError as exc:
                        log.warning("inode %d: could not keep its data before %s: %s",
                                    op.keep, op.kind, exc)
            try:
                await trio.to_thread.run_sync(self._apply, op)
            except OSError as exc:
                if exc.errno in _SKIP_ERRNOS:
                    log.debug("%s %r: %s (skipped)", op.kind, op.path, exc.strerror)
                else:
                    self._record_error(op.path, op.kind, exc)
                    raise _Retry() from None
            else:
                self._clear_error(op.path)
            self.ns_ops.popleft()
            self.ns_applied += 1

    def _apply(self, op: _NsOp) -> None:
        try:
            self._apply_op(op)
        except FileNotFoundError:
            self._check_root()  # ENOENT because all of DIR is gone: retry, do not skip
            raise

    def _apply_op(self, op: _NsOp) -> None:
        path = os.path.join(self.root, op.path)
        k = op.kind
        if k == "mkdir":
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                if not os.path.isdir(path):
                    raise
            self._set_attrs(path, op, times=False)
        elif k == "symlink":
            _unlink_quiet(path)
            os.symlink(op.target, path)
            if self._is_root:
                os.lchown(path, op.uid, op.gid)
            os.utime(path, ns=(op.mtime_ns, op.mtime_ns), follow_symlinks=False)
        elif k == "mknod":
            _unlink_quiet(path)
            if stat.S_ISFIFO(op.mode):
                os.mkfifo(path, 0o600)
            elif stat.S_ISSOCK(op.mode):
                return  # a socket is not data: nothing to keep
            else:
                os.mknod(path, op.mode, op.rdev)
            self._set_attrs(path, op, times=False)
        elif k == "unlink":
            os.unlink(path)
        elif k == "rmdir":
            os.rmdir(path)
        elif k == "rename":
            os.rename(path, os.path.join(self.root, op.path2))
        elif k == "exchange":
            other = os.path.join(self.root, op.path2)
            here, there = os.path.lexists(path), os.path.lexists(other)
            if here and there:
                swap = os.path.join(self.tmp, b"swap." + secrets.token_hex(4).encode())
                os.rename(path, swap)
                try:
                    os.rename(other, path)
                except OSError:
                    os.rename(swap, path)  # never leave a copy parked in our temp dir
                    raise
                os.rename(swap, other)
            elif here:  # the other one was never written back: only this one moves
                os.rename(path, other)
            elif there:
                os.rename(other, path)
        elif k == "attrs":
            self._set_attrs(path, op, times=True)

    def _set_attrs(self, path: bytes, op: _NsOp, *, times: bool) -> None:
        if stat.S_ISLNK(op.mode):
            if times:
                os.utime(path, ns=(op.mtime_ns, op.mtime_ns), follow_symlinks=False)
            return
        if self._is_root and op.uid >= 0:
            os.chown(path, op.uid, op.gid, follow_symlinks=False)
        os.chmod(path, stat.S_IMODE(op.mode))
        if times and not stat.S_ISDIR(op.mode):
            st = os.stat(path, follow_symlinks=False)
            os.utime(path, ns=(st.st_atime_ns, op.mtime_ns), follow_symlinks=False)

    # -- errors ---------------------------------------------------------------------------

    def _record_error(self, path: bytes, what: str, exc: OSError | FsError) -> None:
        p = os.fsdecode(path)
        msg = f"{what}: {exc.strerror if isinstance(exc, OSError) else exc.args[1]}"
        rec = self.errors.get(p)
        now = time.time()
        if rec is None or rec.error != msg:
            rec = self.errors[p] = _ErrorRecord(p, msg)
            while len(self.errors) > MAX_ERRORS:
                del self.errors[next(iter(self.errors))]
        rec.count += 1
        rec.last = now
        if now - rec.logged >= 60:
            rec.logged = now
            if what == "read":
                log.warning("backing directory: %s: %s", p, msg)
            else:
                log.warning("backing directory: %s: %s (data kept in memory, retrying)", p, msg)

    def _record_bug(self, what: str, exc: Exception) -> None:
        """An unexpected error in background work: logged with its traceback and shown
        by ``memfs status`` (as ``(internal) WHAT``); the caller keeps the data and
        carries on."""
        log.error("%s failed (a bug; the data is kept and the work retried)", what,
                  exc_info=exc)
        key = f"(internal) {what}"
        rec = self.errors.get(key)
        if rec is None:
            rec = self.errors[key] = _ErrorRecord(key, f"{exc!r}")
            while len(self.errors) > MAX_ERRORS:
                del self.errors[next(iter(self.errors))]
        rec.error = f"{exc!r}"
        rec.count += 1
        rec.last = rec.logged = time.time()

    def _clear_error(self, path: bytes) -> None:
        rec = self.errors.pop(os.fsdecode(path), None)
        if rec is not None:
            log.info("backing directory: %s written back after %d failures", rec.path, rec.count)

    # -- stage-in --------------------------------------------------------------------------

    async def _stager(self) -> None:
        while True:
            ino, ticket = await self._stage_recv.receive()
            i = self.store.inodes.get(ino)
            try:
                if i is not None and i.backed:
                    # The whole file at once: its copy in DIR is opened once (and the
                    # namespace lock taken once), not once per STEP.
                    await self._ensure_resident(ino, 0, i.backed)
            except FsError as exc:
                if exc.errno != errno.ENOENT:  # removed meanwhile: nothing to stage
                    where = os.fsdecode(self._where(ino))
                    log.warning("stage-in of %s: %s", where, exc)
                    t = self._tickets.get(ticket)
                    if t is not None:
                        t.failed[ino] = (where, exc.args[1])
            except Exception as exc:  # a bug: the backing copy is intact; report, go on
                self._record_bug(f"stage-in of inode {ino}", exc)
                t = self._tickets.get(ticket)
                if t is not None:
                    t.failed[ino] = (os.fsdecode(self._where(ino)), f"internal error: {exc!r}")
            t = self._tickets.get(ticket)
            if t is not None:
                t.inos.discard(ino)

    # -- unmount --------------------------------------------------------------------------

    @property
    def pending(self) -> tuple[int, int]:
        """(files, bytes) not yet written back, plus queued namespace operations as files."""
        return len(self.dirty) + len(self.ns_ops), self.dirty_chunks * self.chunk_size

    async def drain(self, give_up_on: AsyncIterable[object] | None = None) -> None:
        """Write everything back now (the mount is going away); returns when clean,
        or at the first item of *give_up_on* (a signal), logging what is lost."""
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                if give_up_on is not None:

                    async def give_up() -> None:
                        async for _ in give_up_on:
                            files, nbytes = self.pending
                            log.error("exiting without writing back %d MiB (%d files): asked to",
                                      nbytes >> 20, files)
                            scope.cancel()

                    nursery.start_soon(give_up)
                await self._drain()
                nursery.cancel_scope.cancel()

    async def _drain(self) -> None:
        self.draining = True
        self._wake.set()
        started = self.clock()
        said = retried = 0.0
        while self.dirty or self.ns_ops:
            now = self.clock()
            if now - started > 2 and now - said >= 10:
                files, nbytes = self.pending
                log.info("writing back %d MiB (%d files) to %s before exit",
                            nbytes >> 20, files, self.cfg.backing)
                said = now
            for d in self.dirty.values():
                d.retry_at = min(d.retry_at, now + 2.0)  # keep retrying, but not wildly
            self._wake.set()
            self._ns_wake.set()
            if now - retried >= 2:
                self._ns_retry.set()
                retried = now
            await trio.sleep(0.05)
        log.info("everything written back to %s", self.cfg.backing)
        if self.pinned:
            nbytes = sum(len(i.chunks or ()) for x in self.pinned if (i := self.store.inodes.get(x)))
            log.warning("%d files (%d MiB) under user.memfs.flush=off trees were not written "
                        "back (stage-out archives them)", len(self.pinned),
                        nbytes * self.chunk_size >> 20)

    async def close(self) -> None:
        """Remove our temporary directory (and DIR/.memfs-tmp if no one else uses it)."""
        def remove() -> None:
            _unlink_quiet(os.path.join(self.tmp, TMP_LOCK))
            for d in (self.tmp, self.tmp_top):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
            if self._tmp_lock >= 0:
                os.close(self._tmp_lock)
                self._tmp_lock = -1
        await trio.to_thread.run_sync(remove)

    # -- control commands --------------------------------------------------------------------

    async def control(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self._expire_tickets()
        if op == "status":
            return self.status()
        if op in ("flush", "stage_in"):
            paths = args.get("paths", [])
            if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
                raise FsError(errno.EINVAL, "paths must be a list of strings")
            roots = [self._resolve(p) for p in paths] or [ROOT_INO]
            return {"ticket": self._flush_ticket(roots) if op == "flush" else self._stage_ticket(roots)}
        if op == "progress":
            tid = args.get("ticket")
            t = self._tickets.get(tid) if isinstance(tid, int) else None
            if t is None:
                raise FsError(errno.ENOENT, f"no ticket {tid!r}")
            t.touched = time.monotonic()
            return self._progress(t)
        raise FsError(errno.ENOSYS, f"unknown command {op!r}")

    def _resolve(self, p: str) -> int:
        raw = os.fsencode(p)
        if raw.startswith(b"/") or b".." in raw.split(b"/"):
            raise FsError(errno.EINVAL, f"{p!r}: expected a path relative to the mount")
        try:
            return self.store.resolve(raw).ino
        except FsError as exc:
            raise FsError(exc.errno, f"{p}: {os.strerror(exc.errno)}") from None

    def _walk(self, roots: Iterable[int]) -> Iterable[int]:
        inodes = self.store.inodes
        stack = list(roots)
        while stack:
            ino = stack.pop()
            i = inodes.get(ino)
            if i is None:
                continue
            yield ino
            if i.children:
                stack.extend(i.children.values())

    def _flush_ticket(self, roots: list[int]) -> int:
        if roots == [ROOT_INO]:
            inos = set(self.dirty)
        else:
            inos = {ino for ino in self._walk(roots) if ino in self.dirty}
        for ino in inos:
            self.dirty[ino].retry_at = 0.0
            self._forced.add(ino)
        self._wake.set()
        self._ns_retry.set()
        t = _Ticket("flush", inos, len(inos), sum(len(self.dirty[x].chunks) for x in inos) * self.chunk_size,
                    ns_target=self.ns_queued)
        return self._add_ticket(t)

    def _stage_ticket(self, roots: list[int]) -> int:
        inodes = self.store.inodes
        named = {ino for ino in self._walk(roots) if inodes[ino].chunks is not None}
        inos = {ino for ino in named if inodes[ino].backed and self.store.missing(ino, 0, inodes[ino].backed)}
        t = _Ticket("stage_in", inos, len(inos), sum(self._missing_bytes(x) for x in inos), keep=named)
        for ino in named:
            self._kept[ino] += 1
            self._touch(ino)
        tid = self._add_ticket(t)
        for ino in sorted(inos):
            self._stage_send.send_nowait((ino, tid))
        return tid

    def _add_ticket(self, t: _Ticket) -> int:
        tid = next(self._ticket_ids)
        self._tickets[tid] = t
        return tid

    def _expire_tickets(self) -> None:
        now = time.monotonic()
        for tid in [k for k, t in self._tickets.items() if now - t.touched > TICKET_TTL]:
            self._kept -= collections.Counter(self._tickets.pop(tid).keep)

    def _missing_bytes(self, ino: int) -> int:
        i = self.store.inodes.get(ino)
        if i is None or not i.backed:
            return 0
        return min(len(self.store.missing(ino, 0, i.backed)) * self.chunk_size, i.backed)

    def _progress(self, t: _Ticket) -> dict[str, Any]:
        if t.kind == "flush":
            left = [ino for ino in t.inos if ino in self.dirty]
            nbytes = sum(len(self.dirty[x].chunks) for x in left) * self.chunk_size
            done = not left and self.ns_applied >= t.ns_target
        else:
            left = [ino for ino in t.inos if ino in self.store.inodes]
            t.inos.intersection_update(left)
            nbytes = sum(self._missing_bytes(x) for x in left)
            done = not left
        paths = {os.fsdecode(p) for ino in left for p in self.store.paths(ino)} if self.errors else set()
        return {
            "failed": [{"path": p, "error": e} for p, e in t.failed.values()],
            "done": done, "files": len(left), "bytes": nbytes,
            "total_files": t.total_files, "total_bytes": t.total_bytes,
            "errors": [vars_of(e) for e in self.errors.values() if e.path in paths or not paths],
        }

    def status(self) -> dict[str, Any]:
        s = self.store
        cs = self.chunk_size
        total = sum(a.n_chunks for a in s.allocators)
        free = sum(a.free + a.reclaimable for a in s.allocators)
        resident = evicted = 0
        pinned_chunks = 0
        for i in s.inodes.values():
            if i.chunks is None:
                continue
            if i.backed and len(i.chunks) * cs < i.backed and s.missing(i.ino, 0, i.backed):
                evicted += 1
            else:
                resident += 1
            if i.ino in self.pinned:
                pinned_chunks += len(i.chunks)
        now = self.clock()
        rate = sum(n for t, n in self._rate if t >= now - RATE_WINDOW) / RATE_WINDOW
        busy = sum(1 for d in self.dirty.values() if d.busy)
        return {
            "backing": self.cfg.backing,
            "capacity": total * cs,
            "used": (total - free) * cs,
            "dirty_bytes": self.dirty_chunks * cs,
            "dirty_files": len(self.dirty),
            "dirty_max": self.dirty_max,
            "pinned_bytes": pinned_chunks * cs,
            "pinned_files": len(self.pinned),
            "queued_files": sum(
                1 for ino, d in self.dirty.items()
                if not d.busy and (ino in self._forced or self.draining or d.since + self.cfg.delay <= now)
            ),
            "flushing_files": busy,
            "namespace_ops": len(self.ns_ops),
            "flush_rate": rate,
            "flushed_bytes": self.flushed_bytes,
            "flushed_files": self.flushed_files,
            "resident_files": resident,
            "evicted_files": evicted,
            "evicted_bytes_total": self.evicted_bytes,
            "fetched_bytes": self.fetched_bytes,
            "staging_files": sum(len(t.inos) for t in self._tickets.values() if t.kind == "stage_in"),
            "staging_bytes": sum(
                self._missing_bytes(x) for t in self._tickets.values() if t.kind == "stage_in"
                for x in t.inos
            ),
            "writers_waiting": self.writers_waiting,
            "draining": self.draining,
            "errors": sorted((vars_of(e) for e in self.errors.values()), key=lambda e: e["last"]),
            "flush_delay": self.cfg.delay,
            "workers": self.cfg.workers,
        }


def vars_of(e: _ErrorRecord) -> dict[str, Any]:
    return {"path": e.path, "error": e.error, "count": e.count, "last": e.last}


async def _close_written(fd: int) -> None:
    """Close a file we wrote, in a worker thread (closing it on a parallel filesystem
    may flush and report a write error: raised as OSError).  Cancelled before the
    thread started, it is closed in the background (once started, it finishes)."""
    try:
        await trio.to_thread.run_sync(os.close, fd)
    except trio.Cancelled:
        _close_soon(fd)
        raise


def _close_soon(fd: int) -> None:
    """Close *fd* in a worker thread, without waiting (a file we only read, or one
    given up on): closing a file on a parallel filesystem can block, and neither a
    FUSE request nor shutdown should wait behind a hung DIR."""
    trio.lowlevel.start_thread_soon(functools.partial(os.close, fd), _log_close_error)


def _log_close_error(result: Any) -> None:
    """The close's outcome (trio calls this in the worker thread)."""
    try:
        result.unwrap()
    except OSError as exc:
        log.debug("closing a backing file: %s", exc)


def _runs(ks: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted chunk numbers."""
    out: list[list[int]] = []
    for k in sorted(ks):
        if out and out[-1][-1] == k - 1:
            out[-1].append(k)
        else:
            out.append([k])
    return out


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _write_step(
    fd: int, view: memoryview, offset: int, src: int, old: list[tuple[int, int]]
) -> None:
    """Fill the *old* parts of *view* from *src* (zeros past its end), write it at *offset*."""
    for a, b in old:
        got = _pread_full(src, view[a:b], offset + a)
        if got < b - a:
            view[a + got : b] = bytes(b - a - got)
    _pwrite_full(fd, view, offset)


def _pwrite_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _unlink_quiet(path: bytes) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
