"""File bytes in backing files that the kernel reads and writes itself (``-o passthrough``).

An embedded mount with ``-o passthrough`` keeps each regular file's bytes in
a file of its own on a private tmpfs instance, sized like the pool.  The
instance is detached (``fsopen``/``fsmount``: no path reaches it, and it goes
with the daemon); each backing file is named after its inode there.
Opens hand that file to the kernel (FUSE passthrough, kernel 6.9+, memfs's
pyfuse3 patch 0007): reads, writes and mmap of the open file then go from
the kernel to tmpfs with no request to this daemon, at tmpfs's speed, and
the bytes are in memory once (the backing file's pages are both the page
cache and the storage).  ``ENOSPC`` comes from tmpfs at ``write(2)``.

The daemon keeps the namespace, modes, owners, xattrs and links in its
metadata store as before; size, blocks and times of a regular file are the
backing file's (:meth:`BackingFiles.overlay`), since reads and writes no
longer pass through the daemon.  Where the daemon itself must see a write
(an unprivileged writer of a file with set-ID bits, which the write must
clear), the open is ``FOPEN_DIRECT_IO`` with the same backing file (mmap
still goes to it) and the daemon reads and writes the backing file.
Without passthrough (the kernel or pyfuse3 cannot) every open is served that
way: slower, still correct.

Passthrough needs ``CAP_SYS_ADMIN`` (the kernel's rule for
``FUSE_DEV_IOC_BACKING_OPEN``).  Not with ``--backing``, cluster mounts,
``-o writeback_cache`` (the kernel refuses the combination) or ``-o
direct_io``; :mod:`memfs.array` uses the mount's file I/O on such a mount.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import resource
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager

from memfs.errors import FsError
from memfs.meta import Attr, Meta

log = logging.getLogger(__name__)

#: linux/fuse.h: _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t)
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501
FUSE_DEV_IOC_BACKING_CLOSE = 0x4004E502

# linux/mount.h and the syscall numbers (the same on x86_64 and arm64)
_SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 430, 431, 432
_FSOPEN_CLOEXEC = 1
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6
_FSMOUNT_CLOEXEC = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def private_tmpfs(size: int) -> int:
    """A new tmpfs instance of *size* bytes that no path reaches: its root's
    descriptor (the instance goes when the last reference to it does)."""
    fsfd = _check(_libc.syscall(_SYS_FSOPEN, b"tmpfs", _FSOPEN_CLOEXEC), "fsopen(tmpfs)")
    try:
        # nr_inodes 0: no limit of its own on files (the metadata store counts them)
        for key, value in ((b"size", str(size).encode()), (b"nr_inodes", b"0"), (b"mode", b"0700")):
            _check(_libc.syscall(_SYS_FSCONFIG, fsfd, _FSCONFIG_SET_STRING, key, value, 0),
                   f"fsconfig({key.decode()})")
        _check(_libc.syscall(_SYS_FSCONFIG, fsfd, _FSCONFIG_CMD_CREATE, None, None, 0),
               "fsconfig(create)")
        return _check(_libc.syscall(_SYS_FSMOUNT, fsfd, _FSMOUNT_CLOEXEC, 0), "fsmount")
    finally:
        os.close(fsfd)


def raise_fd_limit() -> None:
    """As many descriptors as this process may have (root: the kernel's ``nr_open``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with open("/proc/sys/fs/nr_open") as f:
            most = int(f.read())
        resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
    except (OSError, ValueError):  # without CAP_SYS_RESOURCE: up to the hard limit
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class BackingFiles:
    """The backing file of each regular file of one mount, and its passthrough id.

    A backing file is named after its inode in the private tmpfs's root.  The
    daemon holds a descriptor of it, and the kernel an id (which pins the file),
    only while the file is open: a mount of a million files costs no descriptors.
    Every passthrough open of an inode must name the same id while any is open,
    and the kernel has let go of it by the time the last RELEASE arrives, so the
    id lives from the first open to the last release.

    Also the mount's data engine for the requests that still reach the daemon
    (opens without passthrough): the same calls as :class:`memfs.data.DataEngine`.
    """

    posts_writes = False

    def __init__(self, size: int) -> None:
        #: the metadata store (set once it is open): truncate tells it the new size
        self.meta: Meta | None = None
        self.root = private_tmpfs(size)
        #: inode -> [descriptor of its backing file, opens of it now]
        self._open: dict[int, list[int]] = {}
        #: inode -> the kernel's id of its backing file, while it is open
        self._ids: dict[int, int] = {}
        #: the session's /dev/fuse descriptor once the kernel took FUSE_PASSTHROUGH
        self.dev_fd: int | None = None

    @property
    def active(self) -> bool:
        """Whether opens are handed to the kernel (else the daemon serves the I/O)."""
        return self.dev_fd is not None

    def close(self) -> None:
        for ino in list(self._open):
            self._close(ino)
        os.close(self.root)

    def _file(self, ino: int) -> int:
        """A new descriptor of *ino*'s backing file (made empty if there is none)."""
        try:
            return os.open(str(ino), os.O_RDWR | os.O_CLOEXEC | os.O_CREAT, 0o600, dir_fd=self.root)
        except OSError as exc:
            raise FsError(exc.errno or errno.EIO, f"inode {ino}: backing file: {exc.strerror}") from None

    def create(self, ino: int) -> None:
        """*ino* is a new regular file (mknod): its backing file is born with it, so the
        times a stat shows do not jump at its first open."""
        os.close(self._file(ino))

    def opened(self, ino: int) -> None:
        """An open of *ino* begins (:meth:`released` ends it): its descriptor stays."""
        held = self._open.get(ino)
        if held is None:
            self._open[ino] = [self._file(ino), 1]
        else:
            held[1] += 1

    def released(self, ino: int) -> None:
        held = self._open.get(ino)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            self._close(ino)

    def _close(self, ino: int) -> None:
        bid = self._ids.pop(ino, None)
        if bid is not None and self.dev_fd is not None:
            try:
                fcntl.ioctl(self.dev_fd, FUSE_DEV_IOC_BACKING_CLOSE, struct.pack("I", bid))
            except OSError as exc:  # unmounted meanwhile: the kernel dropped them all
                log.debug("inode %d: backing id %d not closed: %s", ino, bid, exc)
        held = self._open.pop(ino, None)
        if held is not None:
            os.close(held[0])

    def backing_id(self, ino: int) -> int | None:
        """The kernel's id of *ino*'s backing file, for an open of it (between
        :meth:`opened` and :meth:`released`).

        None if passthrough is not in effect after all (the kernel did not take
        FUSE_PASSTHROUGH, or this process lacks CAP_SYS_ADMIN: EPERM): logged once,
        and from then on the daemon serves reads and writes."""
        bid = self._ids.get(ino)
        if bid is None:
            if self.dev_fd is None:
                return None
            arg = bytearray(struct.pack("iIQ", self._open[ino][0], 0, 0))
            try:
                bid = fcntl.ioctl(self.dev_fd, FUSE_DEV_IOC_BACKING_OPEN, arg, True)
            except OSError as exc:
                # Falling back is only right before any open was passed through: the
                # kernel answers an open of such an inode without its id with EIO.
                if exc.errno != errno.EPERM or self._ids:
                    raise FsError(exc.errno or errno.EIO, f"inode {ino}: the kernel refused "
                                  f"its backing file: {exc.strerror}") from None
                log.warning("-o passthrough not in effect (the kernel refused a backing file: "
                            "%s; it needs CAP_SYS_ADMIN): the daemon serves every read and "
                            "write", exc.strerror)
                self.dev_fd = None
                return None
            self._ids[ino] = bid
        return bid

    def forget(self, ino: int) -> None:
        """*ino* is destroyed (no links, no opens): its bytes go."""
        self._close(ino)
        try:
            os.unlink(str(ino), dir_fd=self.root)
        except FileNotFoundError:  # never written nor opened
            pass

    def _stat(self, ino: int) -> os.stat_result | None:
        held = self._open.get(ino)
        try:
            return os.fstat(held[0]) if held is not None else os.stat(str(ino), dir_fd=self.root)
        except FileNotFoundError:
            return None

    def overlay(self, a: Attr) -> Attr:
        """*a* with the size, blocks and times its backing file has (reads and writes
        went there: its atime moves as relatime says, like any tmpfs file's)."""
        if not stat.S_ISREG(a.mode):
            return a
        st = self._stat(a.ino)
        if st is None:
            return a
        return Attr(a.ino, a.mode, a.nlink, a.uid, a.gid, a.rdev, st.st_size, st.st_blocks,
                    st.st_atime_ns, st.st_mtime_ns, max(a.ctime_ns, st.st_ctime_ns))

    @contextmanager
    def _fd(self, ino: int) -> Iterator[int]:
        """A descriptor of *ino*'s backing file for one operation."""
        held = self._open.get(ino)
        if held is not None:
            yield held[0]
            return
        fd = self._file(ino)
        try:
            yield fd
        finally:
            os.close(fd)

    def set_times(self, ino: int, atime_ns: int | None, mtime_ns: int | None) -> None:
        """utimensat on the file: the backing file keeps the times a stat shows (None:
        the one not set keeps its value, which only the backing file knows)."""
        with self._fd(ino) as fd:
            st = os.fstat(fd)
            os.utime(fd, ns=(st.st_atime_ns if atime_ns is None else atime_ns,
                             st.st_mtime_ns if mtime_ns is None else mtime_ns))

    def space(self) -> tuple[int, int, int]:
        """(block size, blocks, free blocks) of the backing tmpfs: the pool."""
        st = os.fstatvfs(self.root)
        return st.f_frsize, st.f_blocks, st.f_bavail

    # -- the requests that reach the daemon (the DataEngine interface) ------------------

    @contextmanager
    def _io(self, ino: int, what: str) -> Iterator[int]:
        """:meth:`_fd` for one call, whose OSError becomes the request's FsError."""
        with self._fd(ino) as fd:
            try:
                yield fd
            except OSError as exc:
                raise FsError(exc.errno or errno.EIO, f"inode {ino}: {what}: {exc.strerror}") from None

    async def read(self, ino: int, offset: int, size: int) -> bytes:
        with self._io(ino, "read") as fd:
            return os.pread(fd, size, offset)

    async def write(self, ino: int, offset: int, buf: bytes) -> int:
        with self._io(ino, "write") as fd:
            return os.pwrite(fd, buf, offset)

    async def truncate(self, ino: int, size: int) -> None:
        with self._io(ino, "truncate") as fd:
            os.ftruncate(fd, size)
        assert self.meta is not None
        await self.meta.truncate(ino, size)

    async def allocate(self, ino: int, offset: int, length: int, *, keep_size: bool) -> None:
        self._fallocate(ino, 1 if keep_size else 0, offset, length)

    async def punch(self, ino: int, offset: int, length: int) -> None:
        """tmpfs punches the hole (and sets the times, which are the backing file's)."""
        self._fallocate(ino, 3, offset, length)  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE

    def seek(self, ino: int, offset: int, whence: int) -> int:
        """tmpfs finds data and holes in the backing file."""
        with self._io(ino, "lseek") as fd:
            return os.lseek(fd, offset, whence)

    def _fallocate(self, ino: int, mode: int, offset: int, length: int) -> None:
        with self._fd(ino) as fd:
            failed = _libc.fallocate(fd, mode, offset, length) < 0
        if failed:
            err = ctypes.get_errno()
            raise FsError(err, f"inode {ino}: fallocate: {os.strerror(err)}")

    async def settle(self, ino: int) -> None:
        """fsync: the bytes are in memory, which is this tier's durable copy."""

    async def release(self, ino: int) -> None:
        """Nothing is outstanding: every write happened in its request."""

    async def wait_posted(self, ino: int) -> None:
        """Nothing is posted."""

    async def drain(self) -> None:
        """Nothing is posted."""
