"""The FUSE layer: ``pyfuse3.Operations`` over a metadata service and a data engine.

This is the only place where domain errors become errno replies, and the only
module that knows about pyfuse3's types.  It holds no storage logic: every call
is translated to the :class:`memfs.meta.Meta` interface or the
:class:`memfs.data.DataEngine`.

A file handle is its inode number (open state lives in the metadata service's open
count) and a number of its own above it (cluster-wide locks go with the open file),
with :data:`_UNPRIVILEGED` set when a uid other than 0 opened the file (and
:data:`_APPEND` for an ``O_APPEND`` open on a cluster client);
directory handles index a snapshot of the entries taken at opendir, so a
listing never skips or repeats an entry while others create and delete.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import functools
import itertools
import logging
import os
import stat
import struct
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import pyfuse3
import trio

from memfs.data import DataEngine
from memfs.errors import FsError
from memfs.meta import NAME_MAX, Attr, Locks, Meta, SetAttr, set_ids_to_drop
from memfs.passthrough import BackingFiles

if TYPE_CHECKING:
    from memfs.metrics import Metrics

log = logging.getLogger(__name__)

#: An invalidation that finds no inode where the kernel counts a lookup (an entry reply
#: not applied yet) is tried again every INSTANTIATE_POLL seconds, until this long after
#: the call began (a recall's answer is bounded anyway: memfs.meta.lease_client)
INSTANTIATE_WAIT = 1.0
INSTANTIATE_POLL = 0.0005
#: FUSE_NOTIFY_INC_EPOCH (kernel 6.16, protocol 7.44): every dentry the kernel holds
#: for this mount is stale from now on; it takes no lock (unlike FUSE_NOTIFY_INVAL_ENTRY,
#: which takes the directory's lock, even with FUSE_EXPIRE_ONLY)
_NOTIFY_INC_EPOCH = struct.pack("<IiQ", 16, 8, 0)
#: INIT flag (kernel 6.6, protocol 7.39): files opened with FOPEN_DIRECT_IO may still be
#: mapped MAP_SHARED (the kernel keeps such mappings coherent with direct I/O); a raw
#: flag libfuse 3.14 does not know, asked for through memfs's pyfuse3 patch 0003
FUSE_DIRECT_IO_ALLOW_MMAP = 1 << 36

#: INIT flag (kernel 6.9, protocol 7.40): opens may name a backing file that the kernel
#: then reads and writes itself (memfs's pyfuse3 patch 0007; memfs.passthrough)
FUSE_PASSTHROUGH = 1 << 37

#: set in the file handle of an open by any uid but 0: its writes take set-ID bits away
#: (memfs stands in for the kernel there, see Operations.init_connection)
_UNPRIVILEGED = 1 << 63
#: a file handle's low bits are its inode; the bits between number the open, so that
#: each open file has a handle of its own (its cluster-wide locks go at its release)
_INODE_BITS = 40
_INODE = (1 << _INODE_BITS) - 1
_SERIAL = (1 << (62 - _INODE_BITS)) - 1
#: set in the file handle of an ``O_APPEND`` open where other nodes change sizes (a
#: cluster client): the kernel appends at the size it cached, which another node's
#: append may have left behind (it is not asked for again before the write, only
#: marked stale by the recall), so such a handle's writes go to the file's end as the
#: metadata service knows it, and bypass the page cache (FOPEN_DIRECT_IO: the kernel
#: would cache the bytes at its own offset; so a MAP_SHARED mapping of such an open
#: fails with ENODEV, unless the mount is ``-o direct_io``).  Decided at open: an
#: ``fcntl(F_SETFL)`` of O_APPEND later does not change it.  (Cluster mounts refuse
#: the kernel's writeback cache, whose writeback could send other handles' pages
#: through such a handle; the check below only makes sure.)
_APPEND = 1 << 62
#: flock(2) operations as lock types (memfs.meta.Locks)
_FLOCK_TYPES = {fcntl.LOCK_SH: fcntl.F_RDLCK, fcntl.LOCK_EX: fcntl.F_WRLCK, fcntl.LOCK_UN: fcntl.F_UNLCK}
#: fallocate(2)'s mode flag (linux/falloc.h; not in Python's os module)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

P = ParamSpec("P")
R = TypeVar("R")


#: request counters and latencies (``--metrics``); None: not kept
OBSERVER: Metrics | None = None


def _errno_boundary(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn domain errors into FUSE replies; anything unexpected is logged and is EIO.

    Also where requests are counted and timed, when :data:`OBSERVER` is set."""
    op = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        obs = OBSERVER
        started = time.perf_counter() if obs is not None else 0.0
        err: int | None = None
        try:
            return await fn(*args, **kwargs)
        except FsError as exc:
            err = exc.errno
            raise pyfuse3.FUSEError(exc.errno) from None
        except pyfuse3.FUSEError as exc:
            err = exc.errno
            raise
        except Exception:
            err = errno.EIO
            log.exception("internal error in %s", op)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            if obs is not None:
                obs.observe(op, started, err)

    return wrapper


#: background requests (readahead, async direct I/O) the kernel may keep in flight
MAX_BACKGROUND = 64

#: idle pyfuse3 workers kept on a mount with several (cluster, --backing): with one,
#: requests that overlap on the network made pyfuse3 start a worker and end another
#: per request (cluster 16 KiB random reads: client CPU 146-203 -> 125-133 us each)
IDLE_WORKERS = 4

#: after each answer, how long pyfuse3's worker sleeps in ppoll() for the kernel's next
#: request when nothing else is to be done (memfs's patch 0002): one application
#: issuing syscalls back to back then costs no pass of the event loop per request.
#: This long only on mounts served by one worker: a task woken in the same pass of
#: trio's loop goes unseen and may wait for up to 32 lingers (of the burst), harmless
#: for the control socket, not for other workers waiting on the network (mounts with
#: several linger for :data:`SPIN` only).
LINGER = 200e-6

#: the first part of a linger polls without sleeping (memfs's patch 0002; only while
#: that catches the next request more often than not): on a virtual machine a
#: sleeping CPU's wake-up costs more than a small request (one process's empty-file
#: creates 5,360-6,842 -> 7,682-8,258/s, fio 16 KiB random writes 177-279 -> 266-362
#: MiB/s; 15-60 us tried, 20 best).  A cluster client's several workers spin this
#: long and do not sleep: what an unseen task waits is then 32 spins at most (creates
#: 2,137-2,262 -> 2,455-2,857/s).  Not on ``--backing`` mounts, whose write-back
#: threads need the CPU (small files there: no gain measured, perhaps a loss).
SPIN = 20e-6

#: threads that write READ replies to /dev/fuse (memfs's pyfuse3 patch 0006): the
#: kernel copies a reply into the page cache (or the reader's buffer) in that write,
#: which was nearly all of a 1 MiB read's time in the one request loop; two threads
#: copy on both CPUs while the loop takes the next request.  fio 2 jobs of 1 MiB
#: sequential reads, fresh mounts, alternating: 551, 2,680, 1,035 -> 3,011, 3,324,
#: 2,909 MiB/s (docs/ARCHITECTURE.md, "Reply threads").  Not with ``-o direct_io``: there no page-cache folio lock
#: holds a WRITE of the same bytes back until the reply is copied, so a read would no
#: longer be atomic against a write (and its 1 MiB reads, copied straight into the
#: reader's buffer, did not gain: 3,893 -> 3,764 MiB/s).
REPLY_THREADS = 2
#: shorter replies are written by the loop itself: handing one over and waking a
#: thread cost more than the copy (16 KiB random reads through one thread: 256-290
#: against 403-488 MiB/s); from 64 KiB on it pays (random reads of 64 KiB 566, 622
#: -> 674, 664 MiB/s; of 256 KiB 940, 597 -> 1,404, 2,137)
REPLY_MIN = 64 << 10
#: how often :func:`replies_written` looks, and how long it waits at most
REPLY_POLL = 100e-6
REPLY_PATIENCE = 5.0
#: how long :func:`replies_written_now` holds the event loop at most
REPLY_PATIENCE_NOW = 1.0


def tune_request_loop(workers: int, *, cluster: bool, direct_io: bool = False) -> None:
    """How pyfuse3's workers wait between requests (see :data:`LINGER`, :data:`SPIN`);
    a pyfuse3 without memfs's patch 0002 has neither knob."""
    linger = LINGER if workers == 1 else SPIN if cluster else 0.0
    if hasattr(pyfuse3, "LINGER"):
        pyfuse3.LINGER = linger
    if hasattr(pyfuse3, "SPIN"):
        pyfuse3.SPIN = SPIN
    if hasattr(pyfuse3, "REPLY_THREADS"):
        pyfuse3.REPLY_THREADS = 0 if direct_io else REPLY_THREADS
        pyfuse3.REPLY_MIN = REPLY_MIN


async def replies_written() -> bool:
    """Wait until every READ reply handed to pyfuse3's reply threads so far is
    written; False if that took longer than :data:`REPLY_PATIENCE`.

    An embedded mount's read() returns views of pool memory, which a reply
    thread copies from after read() has returned: memory freed meanwhile (a
    truncate, an unlink) must not be zeroed or handed to another file before
    that copy is done, or the reader would get zeros or another file's bytes.
    A reply is written within microseconds (a MiB in under a millisecond); one
    that is not within the patience means the kernel stopped taking replies
    (the mount is going away).  The scrubber waits here (the chunks it took are
    neither free nor allocatable meanwhile); a truncate uses
    :func:`replies_written_now`.
    """
    if not hasattr(pyfuse3, "reply_count"):
        return True
    submitted, written = pyfuse3.reply_count()
    with trio.move_on_after(REPLY_PATIENCE):
        while written < submitted:
            await trio.sleep(REPLY_POLL)
            written = pyfuse3.reply_count()[1]
    return written >= submitted


def replies_written_now() -> bool:
    """:func:`replies_written` without yielding to the event loop (it sleeps the
    thread: the reply threads need no GIL): for a truncate, between the metadata
    change and zeroing the tail, where no other task may free or reuse that
    memory meanwhile.  At most :data:`REPLY_PATIENCE_NOW`."""
    if not hasattr(pyfuse3, "reply_count"):
        return True
    submitted, written = pyfuse3.reply_count()
    deadline = time.monotonic() + REPLY_PATIENCE_NOW
    while written < submitted and time.monotonic() < deadline:
        time.sleep(REPLY_POLL)
        written = pyfuse3.reply_count()[1]
    return written >= submitted


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    #: ``-o passthrough``: regular files' bytes live in backing files (memfs.passthrough)
    backing: BackingFiles | None = None
    #: FUSE_PASSTHROUGH was asked for at INIT (the first open finds out if it took)
    passthrough_asked = False

    def __init__(
        self,
        meta: Meta,
        data: DataEngine | BackingFiles,
        *,
        writeback_cache: bool = False,
        direct_io: bool = False,
        keep_cache: bool = True,
        attr_timeout: float = 1.0,
        entry_timeout: float = 1.0,
        negative_timeout: float = 1.0,
        pages_follow_changes: bool = False,
        max_background: int = MAX_BACKGROUND,
        cluster_locks: bool = True,
    ) -> None:
        super().__init__()
        self.meta = meta
        self.data = data
        self.backing = data if isinstance(data, BackingFiles) else None
        self.enable_writeback_cache = writeback_cache
        #: every open file bypasses the page cache (FOPEN_DIRECT_IO)
        self.direct_io = direct_io
        self.keep_cache = keep_cache
        self.attr_timeout = attr_timeout
        self.entry_timeout = entry_timeout
        self.negative_timeout = negative_timeout
        self.pages_follow_changes = pages_follow_changes
        self.max_background = max_background
        #: what init_connection negotiated; None: not called (a pyfuse3 without the hook)
        self.negotiated: dict[str, int] | None = None
        #: the kernel left clearing set-ID bits and capabilities to us (KILLPRIV_V2)
        self.drops_privileges = False
        #: with direct_io, MAP_SHARED mappings work (FUSE_DIRECT_IO_ALLOW_MMAP)
        self.shared_mmap = False
        self._dir_handles: dict[int, list[tuple[bytes, Attr | None]]] = {}
        self._dir_inodes: dict[int, int] = {}
        self._next_dh = itertools.count(1)
        self._opened = itertools.count(1)
        #: ask for the kernel's lock requests where the metadata service keeps locks
        #: (False: ``-o localflock``, the kernel keeps them per node)
        self.want_cluster_locks = cluster_locks
        #: the kernel's lock requests go to the metadata service (cluster-wide locks)
        self.cluster_locks = False
        #: file handle -> lock owners that took cluster-wide locks through it
        self._lock_owners: dict[int, set[int]] = {}
        #: every file handle open (each open has its own)
        self._open_files: set[int] = set()
        #: handles open for reading and writing, and how many each inode has (a shared
        #: writable mapping keeps its handle open: its dirty pages are not ours to see)
        self._writable_files: set[int] = set()
        self._writable: collections.Counter[int] = collections.Counter()
        self.initialized = trio.Event()
        #: this session's /dev/fuse descriptor, if names can be dropped (see init)
        self._dev_fd: int | None = None
        #: the kernel's lookup count of each inode (FUSE: one more for every entry
        #: reply, fewer by what each FORGET says): an inode that it counts but that an
        #: invalidation does not find is one whose entry reply it has yet to apply
        self._lookups: collections.Counter[int] = collections.Counter()
        meta.invalidator = self.invalidate

    async def invalidate(self, inodes: list[int]) -> None:
        """Drop the kernel's cached attributes and pages of *inodes* (another node changed
        them; names go with :meth:`forget_names`).

        In a thread: the kernel may have to wait for a page that a request this
        daemon is serving holds locked.
        """

        def work() -> None:
            deadline = time.monotonic() + INSTANTIATE_WAIT  # for them all
            for ino in inodes:
                while True:
                    try:
                        pyfuse3.invalidate_inode(ino)
                    except OSError as exc:
                        # ENOENT: not in the kernel's inode cache.  If it counts a
                        # lookup of it, an entry reply we sent is still on its way
                        # into a new inode (the process that asked has not run yet),
                        # with the attributes from before this change and their
                        # timeout: wait until there is an inode to drop them from.
                        # (FUSE's attr_version makes the kernel ignore a late reply
                        # only for an inode it had when we invalidated.)
                        if (exc.errno == errno.ENOENT and self._lookups.get(ino)
                                and time.monotonic() < deadline):
                            time.sleep(INSTANTIATE_POLL)
                            continue
                    break

        try:
            await trio.to_thread.run_sync(work, abandon_on_cancel=True)
        except Exception as exc:  # not mounted (any more): nothing is cached
            log.debug("kernel cache invalidation failed: %s", exc)

    async def invalidate_entry(self, parent: int, name: bytes) -> None:
        """Drop the kernel's cached entry *name* of *parent*, present or absent (this
        daemon changed it without the kernel: :mod:`memfs.array` publishing a file).

        In a thread: the kernel takes the directory's lock, which a request this
        daemon is serving may hold."""

        def work() -> None:
            try:
                pyfuse3.invalidate_entry(parent, name)
            except OSError:  # not cached: nothing to drop
                pass

        try:
            await trio.to_thread.run_sync(work, abandon_on_cancel=True)
        except Exception as exc:  # not mounted (any more): nothing is cached
            log.debug("kernel entry invalidation failed: %s", exc)

    def forget_names(self) -> None:
        """Make the kernel treat every name it cached (present or absent) as stale, so
        its next use asks this daemon again.  Lock-free, so safe to call while this
        daemon serves a request that holds a directory's lock (a recall during a create)."""
        if self._dev_fd is not None:
            try:
                os.write(self._dev_fd, _NOTIFY_INC_EPOCH)
            except OSError as exc:  # unmounted: nothing is cached
                log.debug("kernel name invalidation failed: %s", exc)

    def init_connection(self, conn: Any) -> None:
        """Negotiate with the kernel (pyfuse3 with memfs's patch, scripts/pyfuse3/).

        *pages_follow_changes* (embedded mode: every change to file data comes
        through this kernel; a cluster client under leases: every change made
        elsewhere first recalls this node's lease, which drops the file's pages)
        turns off libfuse's default ``AUTO_INVAL_DATA``, under which the kernel
        dropped a file's cached pages whenever it saw a new mtime, that is after
        each of its own writes: re-reads then came from the page cache only until
        the next write.  More background requests
        (readahead, async direct I/O) may be in flight than the kernel's 12.

        FUSE_HANDLE_KILLPRIV_V2 (a raw INIT flag: libfuse 3.14 cannot ask for it) makes
        clearing set-ID bits and file capabilities on write, truncate and chown ours
        to do, and lets the kernel mark inodes as having none (``S_NOSEC``): without
        it every write(2) first asks for ``security.capability`` (a GETXATTR round
        trip).  The kernel's precise test for the writer (``CAP_FSETID``) does not
        reach us through libfuse 3.14; memfs takes uid 0 for it (see
        :meth:`_privileged`).

        With ``-o passthrough`` FUSE_PASSTHROUGH (a raw flag too, patch 0007): opens
        may hand a file's backing file to the kernel (:mod:`memfs.passthrough`).

        With ``-o direct_io`` (every file opened with FOPEN_DIRECT_IO: reads and
        writes go straight between the application's buffer and the daemon, no
        page cache) FUSE_DIRECT_IO_ALLOW_MMAP keeps MAP_SHARED mappings working.
        Not for a cluster client's ``O_APPEND`` opens (direct I/O too, see
        :data:`_APPEND`): the kernel would write a shared mapping's pages back
        through such a handle, whose writes go to the end of the file.
        """
        if self.pages_follow_changes:
            conn.want &= ~pyfuse3.FUSE_CAP_AUTO_INVAL_DATA
        conn.max_background = self.max_background
        conn.congestion_threshold = self.max_background * 3 // 4
        killpriv_v2 = getattr(pyfuse3, "FUSE_HANDLE_KILLPRIV_V2", 0)
        if killpriv_v2 and conn.kernel_flags & killpriv_v2:
            conn.extra_flags |= killpriv_v2
            self.drops_privileges = True
        lock_caps = pyfuse3.FUSE_CAP_POSIX_LOCKS | pyfuse3.FUSE_CAP_FLOCK_LOCKS
        if self.want_cluster_locks and self.meta.locks() is not None \
                and hasattr(pyfuse3.Operations, "setlk") and conn.capable & lock_caps == lock_caps:
            conn.want |= lock_caps
            self.cluster_locks = True
        # Only with KILLPRIV_V2: set-ID bits are then ours to clear (see _backing_id).
        if self.backing is not None and self.drops_privileges \
                and conn.kernel_flags & FUSE_PASSTHROUGH and hasattr(pyfuse3.FileInfo(), "backing_id"):
            conn.extra_flags |= FUSE_PASSTHROUGH
            self.passthrough_asked = True
        if self.direct_io and killpriv_v2 and conn.kernel_flags & FUSE_DIRECT_IO_ALLOW_MMAP:
            conn.extra_flags |= FUSE_DIRECT_IO_ALLOW_MMAP
            self.shared_mmap = True
        self.negotiated = {"want": conn.want, "max_background": conn.max_background,
                           "extra_flags": conn.extra_flags if killpriv_v2 else 0}

    def init(self) -> None:
        """The kernel's INIT request is being answered (the reply follows)."""
        if self.negotiated is None:
            log.info("pyfuse3 %s has no init_connection (not memfs's patched build, see "
                     "scripts/pyfuse3/): the kernel's defaults stay (cached pages dropped "
                     "after every write, 12 background requests)", pyfuse3.__version__)
        if not getattr(pyfuse3, "RECEIVE_BURST", 0):
            log.info("pyfuse3 %s waits for the event loop before every request (memfs's "
                     "patch 0002 takes queued ones at once: about a third of the CPU per "
                     "small request)", pyfuse3.__version__)
        if self.direct_io and not self.shared_mmap:
            log.warning("-o direct_io without FUSE_DIRECT_IO_ALLOW_MMAP (a kernel before 6.6, "
                        "or pyfuse3 %s without memfs's patch 0003): MAP_SHARED mappings of "
                        "files fail with ENODEV", pyfuse3.__version__)
        if self.want_cluster_locks and self.meta.locks() is not None and not self.cluster_locks:
            log.warning("pyfuse3 %s does not forward lock requests (memfs's patch 0005): "
                        "flock and fcntl locks on this mount hold on this node only",
                        pyfuse3.__version__)
        if self.negotiated is not None and not self.drops_privileges:
            log.info("FUSE_HANDLE_KILLPRIV_V2 not in effect (pyfuse3 %s without memfs's "
                     "patch 0003, or a kernel before 5.11): every write(2) is preceded by "
                     "a GETXATTR of security.capability", pyfuse3.__version__)
        session_fd = _session_fuse_fd()
        if self.backing is not None:
            if self.passthrough_asked and session_fd is not None:
                self.backing.dev_fd = session_fd  # until the first open finds it refused
            else:
                log.warning("-o passthrough not in effect (%s): the daemon serves every "
                            "read and write of files in their backing files",
                            "no single /dev/fuse descriptor" if self.passthrough_asked else
                            f"pyfuse3 {pyfuse3.__version__} without memfs's patch 0007, or a "
                            "kernel without FUSE passthrough (6.9+, CONFIG_FUSE_PASSTHROUGH)")
        self._dev_fd = _epoch_capable(session_fd)
        if self._dev_fd is not None:
            self.meta.names_invalidator = self.forget_names
        self.initialized.set()

    def _entry(self, a: Attr, parent: int = 0, name: bytes = b"", *,
               listed: bool = False) -> pyfuse3.EntryAttributes:
        """What the kernel gets of *a* (found as *name* in *parent*, if given; *listed*:
        in a listing): cached as long as the metadata service says (a cluster client:
        what its lease covers)."""
        if self.backing is not None:
            a = self.backing.overlay(a)
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        ttl = self.meta.attr_ttl(a.ino, a)
        e.attr_timeout = self.attr_timeout if ttl is None else ttl
        if parent:
            if listed:
                # A cluster client's kernel links a listing's names when the lister
                # reads the reply, not dated by the epoch of when it asked (as lookups
                # and creates are): a recall in between could not make it forget them
                # (FUSE_NOTIFY_INC_EPOCH), so they get no timeout.
                ttl = self.meta.entry_ttl(parent, name, a.ino, listed=True)
            else:
                ttl = self.meta.entry_ttl(parent, name, a.ino)
            e.entry_timeout = self.entry_timeout if ttl is None else ttl
            self._lookups[a.ino] += 1  # an entry reply (nothing below can fail)
        else:
            e.entry_timeout = self.entry_timeout
        e.st_mode = a.mode
        e.st_nlink = a.nlink
        e.st_uid = a.uid
        e.st_gid = a.gid
        e.st_rdev = a.rdev
        e.st_size = a.size
        e.st_blksize = 1 << 20
        e.st_blocks = a.blocks
        e.st_atime_ns = a.atime_ns
        e.st_mtime_ns = a.mtime_ns
        e.st_ctime_ns = a.ctime_ns
        return e

    async def _open_file(self, a: Attr, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        """The handle of an open of *a* (counted open in the metadata service already,
        released here if this fails)."""
        try:
            fi = self._fileinfo(a.ino, ctx, flags)
        except BaseException:
            await self._release(a.ino)
            raise
        backing_id = None
        if self.backing is not None and stat.S_ISREG(a.mode):
            try:
                self.backing.opened(a.ino)  # until its release
                try:
                    backing_id = await self._backing_id(a, flags, ctx)
                except BaseException:
                    self.backing.released(a.ino)
                    raise
            except BaseException:
                self._closed(fi.fh)
                await self._release(a.ino)
                raise
        if backing_id is not None:
            # The kernel refuses KEEP_CACHE with passthrough (the pages are the backing
            # file's); a negative id: passthrough for mmap only, reads and writes come here.
            fi.keep_cache = False
            fi.backing_id = abs(backing_id)
            fi.direct_io = backing_id < 0
        return fi

    async def _backing_id(self, a: Attr, flags: int, ctx: pyfuse3.RequestContext) -> int | None:
        """Which backing file the kernel reads and writes for this open of *a*
        (``-o passthrough``), negated if its reads and writes must come to this daemon
        all the same: an unprivileged writer of a file with set-ID bits, which its
        writes take away (KILLPRIV_V2 made that ours, and the kernel sends nothing for
        a write it passes through; file capabilities it still removes with a
        REMOVEXATTR).  None: no passthrough."""
        assert self.backing is not None
        bid = self.backing.backing_id(a.ino)
        if bid is None:
            return None
        if flags & os.O_ACCMODE != os.O_RDONLY and not self._privileged(ctx) \
                and set_ids_to_drop(a.mode):
            return -bid
        return bid

    def _fileinfo(self, ino: int, ctx: pyfuse3.RequestContext, flags: int = 0) -> pyfuse3.FileInfo:
        if ino > _INODE:
            raise FsError(errno.EOVERFLOW, f"inode {ino} does not fit a file handle")
        flag = 0 if self._privileged(ctx) else _UNPRIVILEGED
        # (Not with the writeback cache: its writeback may send other handles' pages
        # through this one.  Cluster mounts refuse it anyway.)
        append = (bool(flags & os.O_APPEND) and self.meta.sizes_change_elsewhere()
                  and not self.enable_writeback_cache)
        if append:
            flag |= _APPEND
        fh = ino | (next(self._opened) & _SERIAL) << _INODE_BITS | flag
        while fh in self._open_files:  # (after 2**22 opens of it) one still open
            fh = ino | (next(self._opened) & _SERIAL) << _INODE_BITS | flag
        self._open_files.add(fh)
        if flags & os.O_ACCMODE == os.O_RDWR:  # (a shared writable mapping needs it)
            self._writable_files.add(fh)
            self._writable[ino] += 1
        if self.direct_io:
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        keep = self.meta.keep_cache(ino)
        keep_cache = self.keep_cache if keep is None else keep
        if append:  # (keep_cache: other readers' pages stay)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=keep_cache)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache)

    def _closed(self, fh: int) -> None:
        self._open_files.discard(fh)
        if fh in self._writable_files:
            self._writable_files.discard(fh)
            ino = fh & _INODE
            self._writable[ino] -= 1
            if self._writable[ino] <= 0:
                del self._writable[ino]

    def _privileged(self, ctx: pyfuse3.RequestContext) -> bool:
        """Whether the caller keeps set-ID bits when it writes or truncates: the kernel
        asks whether it has ``CAP_FSETID``; memfs, told only its uid, says root has."""
        return ctx.uid == 0 or not self.drops_privileges

    async def _drop_privileges(self, ino: int, set_ids: bool) -> None:
        """What the kernel would have done before a write, truncate or chown of *ino*
        (see :meth:`init_connection`); the kernel's cached mode follows."""
        if self.drops_privileges and await self.meta.drop_privileges(ino, set_ids):
            # A write marks only size and times stale in the kernel: its cached mode
            # (what exec and permission checks use) would keep the bits until its
            # attributes time out.  Attributes only: no page lock, safe mid-request.
            try:
                pyfuse3.invalidate_inode(ino, attr_only=True)
            except OSError:  # not cached
                pass

    # -- namespace --------------------------------------------------------------------

    @_errno_boundary
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        a = await self.meta.find(parent_inode, name)
        if a is not None:
            return self._entry(a, parent_inode, name)
        ttl = self.meta.entry_ttl(parent_inode, name, 0)
        ttl = self.negative_timeout if ttl is None else ttl
        if not ttl:
            raise FsError(errno.ENOENT)
        e = pyfuse3.EntryAttributes()  # st_ino 0: a cached negative entry
        e.entry_timeout = ttl
        return e

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """Inode lifetime follows links and open handles, not the kernel's lookups; the
        count is kept only to know which inodes the kernel may be instantiating."""
        for ino, n in inode_list:
            self._forget_one(ino, n)

    def _forget_one(self, ino: int, n: int = 1) -> None:
        left = self._lookups.get(ino, 0) - n
        if left > 0:
            self._lookups[ino] = left
        else:
            self._lookups.pop(ino, None)

    @_errno_boundary
    async def getattr(
        self, inode: int, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        return self._entry(await self.meta.getattr(inode))

    @_errno_boundary
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        chown = fields.update_uid or fields.update_gid
        if (chown or fields.update_size) and not fields.update_mode:
            await self._drop_privileges(inode, chown or not self._privileged(ctx))
        if fields.update_size:
            await self.data.truncate(inode, attr.st_size)
        changes = SetAttr(
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        a = await self.meta.setattr(inode, changes)
        if self.backing is not None and (fields.update_atime or fields.update_mtime) \
                and stat.S_ISREG(a.mode):  # the backing file keeps what stat shows
            self.backing.set_times(inode, a.atime_ns if fields.update_atime else None,
                                   a.mtime_ns if fields.update_mtime else None)
        return self._entry(a)

    @_errno_boundary
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.meta.readlink(inode)

    @_errno_boundary
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        a = await self.meta.mknod(parent_inode, name, mode, ctx.uid, ctx.gid, rdev=rdev)
        if self.backing is not None and stat.S_ISREG(a.mode):
            try:
                self.backing.create(a.ino)
            except BaseException:
                await self.meta.unlink(parent_inode, name)
                raise
        return self._entry(a, parent_inode, name)

    @_errno_boundary
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        a = await self.meta.mknod(
            parent_inode, name, stat.S_IFDIR | (mode & 0o7777), ctx.uid, ctx.gid
        )
        return self._entry(a, parent_inode, name)

    @_errno_boundary
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if len(target) >= os.pathconf("/", "PC_PATH_MAX"):
            raise FsError(errno.ENAMETOOLONG)
        a = await self.meta.mknod(
            parent_inode, name, stat.S_IFLNK | 0o777, ctx.uid, ctx.gid, target=target
        )
        return self._entry(a, parent_inode, name)

    @_errno_boundary
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._entry(await self.meta.link(inode, new_parent_inode, new_name), new_parent_inode, new_name)

    @_errno_boundary
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.meta.unlink(parent_inode, name)

    @_errno_boundary
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.meta.rmdir(parent_inode, name)

    @_errno_boundary
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        await self.meta.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    # -- files ---------------------------------------------------------------------------

    @_errno_boundary
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        created = False
        try:
            a = await self.meta.create(
                parent_inode, name, stat.S_IFREG | (mode & 0o7777), ctx.uid, ctx.gid
            )
            created = True
        except FsError as exc:
            # Lost a race with another creator: O_CREAT without O_EXCL opens it.
            if exc.errno != errno.EEXIST or flags & os.O_EXCL:
                raise
            a = await self.meta.lookup(parent_inode, name)
            if stat.S_ISDIR(a.mode):
                raise FsError(errno.EISDIR) from None
            if flags & os.O_TRUNC:
                await self._drop_privileges(a.ino, not self._privileged(ctx))
                await self.data.truncate(a.ino, 0)
            a = await self.meta.open(a.ino)
        try:
            return await self._open_file(a, flags, ctx), self._entry(a, parent_inode, name)
        except FsError:
            if created and self.backing is not None:  # no backing file: no new file either
                await self.meta.unlink(parent_inode, name)
            raise

    @_errno_boundary
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        try:
            a = await self.meta.open(inode)
        except FsError as exc:
            if exc.errno != errno.ENOENT:
                raise
            # The kernel found a name that has since been renamed over or unlinked
            # without it (memfs.array publishing a file, another node): ESTALE makes
            # it look the path up again (LOOKUP_REVAL) and open what is there now.
            raise FsError(errno.ESTALE) from None
        if stat.S_ISDIR(a.mode):
            await self.meta.release(inode)
            raise FsError(errno.EISDIR)
        if flags & os.O_TRUNC:
            # libfuse asks for atomic_o_trunc, so the kernel sends no SETATTR for
            # open(O_TRUNC): truncating is ours to do, or the old data survives.
            try:
                await self._drop_privileges(inode, not self._privileged(ctx))
                await self.data.truncate(inode, 0)
                if self.backing is not None:  # set-ID bits gone, maybe: _backing_id looks
                    a = await self.meta.getattr(inode)
            except BaseException:
                await self.meta.release(inode)
                raise
        return await self._open_file(a, flags, ctx)

    @_errno_boundary
    async def read(self, fh: int, off: int, size: int) -> Any:
        return await self.data.read(fh & _INODE, off, size)

    @_errno_boundary
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        ino = fh & _INODE
        if self.drops_privileges:
            await self._drop_privileges(ino, bool(fh & _UNPRIVILEGED))
        # O_APPEND on a cluster client: at the end of the file as the metadata service
        # places it (another node's appends included, also at the same instant), not
        # the kernel's offset, which is the size it last saw.
        if fh & _APPEND and isinstance(self.data, DataEngine):  # (never passthrough)
            return await self.data.write(ino, off, buf, append=True)
        return await self.data.write(ino, off, buf)

    @_errno_boundary
    async def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """Reserve pool memory (``posix_fallocate``, fio's preallocation): mode 0 and
        ``FALLOC_FL_KEEP_SIZE`` within the file; punch holes (``FALLOC_FL_PUNCH_HOLE``,
        which the kernel pairs with ``KEEP_SIZE``), freeing the pool memory under
        them; other modes (zeroing, collapsing or inserting ranges) are EOPNOTSUPP,
        as on tmpfs.  (Forwarded by pyfuse3 patch 0004.)"""
        if mode & ~FALLOC_FL_KEEP_SIZE and mode != FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE:
            raise FsError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x} is not supported")
        ino = fh & _INODE
        if self.drops_privileges:
            await self._drop_privileges(ino, bool(fh & _UNPRIVILEGED))
        if mode & FALLOC_FL_PUNCH_HOLE:
            try:
                await self.data.punch(ino, off, length)
            except FsError as exc:
                if exc.errno != errno.ENOSYS:  # (an mds without punch: ENOSYS would turn
                    raise                      # fallocate off for the whole mount)
                raise FsError(errno.EOPNOTSUPP, str(exc)) from None
        else:
            await self.data.allocate(ino, off, length, keep_size=bool(mode & FALLOC_FL_KEEP_SIZE))

    @_errno_boundary
    async def lseek(self, fh: int, off: int, whence: int) -> int:
        """``SEEK_DATA``/``SEEK_HOLE`` (pyfuse3 patch 0008; the kernel serves the other
        whences itself): where the chunk map has data or holes.  With the kernel's
        writeback cache its dirty pages are data the daemon has not seen: ENOSYS,
        after which the kernel takes every file for data up to its size."""
        if self.enable_writeback_cache:
            raise FsError(errno.ENOSYS, "lseek: not with the kernel's writeback cache")
        ino = fh & _INODE
        writable = self._writable.get(ino)
        if self.backing is not None and (self.backing.active or not writable):
            return self.backing.seek(ino, off, whence)  # (a mapping's pages are its file's)
        if writable:
            # A shared writable mapping on this node may hold dirty pages the kernel
            # has not written here yet (it does not before LSEEK): all data, to EOF.
            a = await self.meta.getattr(ino)
            size = (a if self.backing is None else self.backing.overlay(a)).size
            if not 0 <= off < size:
                raise FsError(errno.ENXIO)
            return off if whence == os.SEEK_DATA else size
        return await self.meta.seek(ino, off, whence)

    async def flush(self, fh: int) -> None:
        """Nothing to push on close: data is in pool memory as soon as write() returns,
        or (a cluster client's posted writes) on its way there, waited for by this
        node's next look at the file, its fsync and release, and any other node's
        access (the recall).  Like writeback errors of a local filesystem, a posted
        write's failure is reported by fsync (and the next write), not by close.

        ENOSYS makes the kernel stop sending FLUSH at all, which saves a round
        trip on every close(2): measured on a cluster client answering it, empty-file
        creates fell from ~8,200-12,000/s to ~5,800-6,300/s.
        """
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_errno_boundary
    async def release(self, fh: int) -> None:
        ino = fh & _INODE
        self._closed(fh)
        if self.backing is not None:
            self.backing.released(ino)
        owners = self._lock_owners.pop(fh, None)
        try:
            if owners:
                await self._unlock_released(ino, owners)
        finally:
            await self._release(ino)

    async def _unlock_released(self, ino: int, owners: set[int]) -> None:
        """The kernel drops no lock it forwarded when a file closes (flush carries the
        owner, but memfs answers no flush): the locks taken through this open file go
        with it, but those of an owner that has locked through another open file of
        the same inode since (RELEASE comes after the close, maybe after that lock):
        they go with that one."""
        locks = self.meta.locks()
        assert locks is not None
        for owner in owners:
            if any(owner in other for fh, other in self._lock_owners.items() if fh & _INODE == ino):
                continue
            try:
                await locks.unlock(ino, owner)
            except FsError as exc:  # the metadata service drops them with the session
                log.warning("inode %d: locks of a closed file not dropped: %s", ino, exc)

    async def _release(self, ino: int) -> None:
        # Before the last release tells the metadata server we are done writing.
        await self.data.release(ino)
        await self.meta.release(ino)

    @_errno_boundary
    async def fsync(self, fh: int, datasync: bool) -> None:
        """Pool memory is the durable copy in this tier (see ARCHITECTURE: fsync); a
        cluster client's posted writes reach it, and its size and mtime become exact
        on the metadata server."""
        ino = fh & _INODE
        await self.data.settle(ino)
        await self.meta.sync(ino)

    # -- cluster-wide locks (asked for in init_connection where the metadata service
    #    keeps them; otherwise the kernel keeps locks itself and none come here) --------

    @_errno_boundary
    async def getlk(self, fh: int, owner: int, lock_type: int, start: int, length: int,
                    pid: int) -> tuple[int, int, int, int]:
        return await self._locks().getlk(fh & _INODE, owner, lock_type, start, length, pid)

    @_errno_boundary
    async def setlk(self, fh: int, owner: int, lock_type: int, start: int, length: int,
                    pid: int, sleep: bool) -> None:
        locks = self._locks()
        if lock_type != fcntl.F_UNLCK:
            self._lock_owners.setdefault(fh, set()).add(owner)  # before: it may be taken
        await locks.setlk(fh & _INODE, owner, lock_type, start, length, pid, sleep)

    @_errno_boundary
    async def flock(self, fh: int, owner: int, op: int) -> None:
        lock_type = _FLOCK_TYPES.get(op & ~fcntl.LOCK_NB)
        if lock_type is None:
            raise FsError(errno.EINVAL, f"flock operation {op:#x}")
        locks = self._locks()
        # The open file owns its flock lock: its handle is unique while it is open
        # (the kernel's owner, its struct file's address, is reused once it is freed,
        # maybe before the RELEASE that drops the lock arrives).
        if lock_type != fcntl.F_UNLCK:
            self._lock_owners.setdefault(fh, set()).add(fh)
        await locks.flock(fh & _INODE, fh, lock_type, not op & fcntl.LOCK_NB)

    def _locks(self) -> Locks:
        locks = self.meta.locks()
        if locks is None:  # never asked for: the kernel keeps locks itself
            raise FsError(errno.ENOLCK, "locks are kept by the kernel on this mount")
        return locks

    # -- directories ------------------------------------------------------------------

    @_errno_boundary
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        # Counted like an open file, so fstat/fdopendir on a directory fd keep
        # working after rmdir (nlink 0) until the handle is released.
        if not stat.S_ISDIR((await self.meta.open(inode)).mode):
            await self.meta.release(inode)
            raise FsError(errno.ENOTDIR)
        dh = next(self._next_dh)
        self._dir_inodes[dh] = inode
        return dh

    @_errno_boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        inode = self._dir_inodes[fh]
        if start_id == 0 or fh not in self._dir_handles:
            # A listing (or rewinddir) starts: take the snapshot it will page through.
            # POSIX readdir returns "." and ".." when they exist (ls -a shows them).
            # One call for the names and their attributes (readdirplus): the
            # attributes are as of opendir/rewinddir, like the names.
            listing = await self.meta.readdirplus(inode)
            self._dir_handles[fh] = [(b".", None), (b"..", None)] + [
                e for e in listing if e[0] not in (b".", b"..")
            ]
            fresh = True
        else:
            fresh = False  # a later page: the snapshot's attributes may be old by now
        entries = self._dir_handles[fh]
        counted: list[int] = []
        try:
            for idx in range(start_id, len(entries)):
                name, a = entries[idx]
                if a is None or not fresh:
                    try:
                        a = await self.meta.lookup(inode, name)
                    except FsError as exc:
                        if exc.errno == errno.ENOENT:
                            continue
                        raise
                sent = pyfuse3.readdir_reply(token, name, self._entry(a, inode, name, listed=True),
                                             idx + 1)
                if not sent or name == b"." or name == b"..":
                    self._forget_one(a.ino)  # not counted by the kernel: not sent, or these two
                else:
                    counted.append(a.ino)
                if not sent:
                    return
        except BaseException:
            # The kernel gets the error, not the entries already in the reply.
            for ino in counted:
                self._forget_one(ino)
            raise

    @_errno_boundary
    async def releasedir(self, fh: int) -> None:
        self._dir_handles.pop(fh, None)
        inode = self._dir_inodes.pop(fh, None)
        if inode is not None:
            await self.meta.release(inode)

    @_errno_boundary
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        """Namespace changes are applied in memory at once; a cluster client's creates
        made under a create lease are known to the metadata server once this returns."""
        inode = self._dir_inodes.get(fh)
        if inode is not None:
            await self.meta.sync(inode)

    # -- misc ---------------------------------------------------------------------------

    @_errno_boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = await self.meta.statfs()
        out = pyfuse3.StatvfsData()
        block_size, blocks, blocks_free = s.block_size, s.blocks, s.blocks_free
        if self.backing is not None:  # the pool is the backing files' tmpfs
            block_size, blocks, blocks_free = self.backing.space()
        out.f_bsize = block_size
        out.f_frsize = block_size
        out.f_blocks = blocks
        out.f_bfree = blocks_free
        out.f_bavail = blocks_free
        out.f_files = s.files
        out.f_ffree = s.files_free
        out.f_favail = s.files_free
        out.f_namemax = s.name_max
        return out

    @_errno_boundary
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        """Only called without default_permissions (memfs always sets it); kept correct anyway."""
        a = await self.meta.getattr(inode)
        if ctx.uid == 0:
            return not (mode & os.X_OK) or bool(a.mode & 0o111) or stat.S_ISDIR(a.mode)
        if ctx.uid == a.uid:
            perm = (a.mode >> 6) & 7
        elif ctx.gid == a.gid or a.gid in pyfuse3.get_sup_groups(ctx.pid):
            perm = (a.mode >> 3) & 7
        else:
            perm = a.mode & 7
        return mode & perm == mode

    @_errno_boundary
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.meta.getxattr(inode, name)

    @_errno_boundary
    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        if len(name) > NAME_MAX:
            raise FsError(errno.ERANGE)
        await self.meta.setxattr(inode, name, value)

    @_errno_boundary
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return await self.meta.listxattr(inode)

    @_errno_boundary
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.meta.removexattr(inode, name)


def _session_fuse_fd() -> int | None:
    """This process's one /dev/fuse descriptor: the session's (pyfuse3 does not expose
    it); None if there is none or more than one."""
    try:
        rdev = os.stat("/dev/fuse").st_rdev
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    found = []
    for name in fds:
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == rdev:
            found.append(int(name))
    if len(found) != 1:
        log.debug("%d /dev/fuse descriptors: not knowing the session's", len(found))
        return None
    return found[0]


def _epoch_capable(fd: int | None) -> int | None:
    """*fd* (the session's /dev/fuse descriptor) if the kernel takes FUSE_NOTIFY_INC_EPOCH.

    libfuse 3.14 predates this notification, but it is one write(2) of a header to
    the session fd, atomic beside libfuse's own replies.  No fd or an older kernel
    (EINVAL): None, and cluster clients give the kernel no names to cache.
    """
    if fd is None:
        log.debug("kernel name invalidation off: the session's descriptor is unknown")
        return None
    try:
        os.write(fd, _NOTIFY_INC_EPOCH)  # harmless: nothing is cached yet
    except OSError as exc:
        log.info("kernel name invalidation off (kernel before 6.16?): %s", exc)
        return None
    return fd
