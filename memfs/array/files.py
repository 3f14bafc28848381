"""Array files, reached directly through the mount daemon or through the mount itself.

Both kinds offer the same few calls (:class:`ArrayTarget`), so that
:mod:`memfs.array` is written once:

* :class:`DirectFile`: a handle in a direct-access session with the mount
  daemon (:mod:`memfs.array.service`).  Each transfer asks the daemon where a
  piece of the file lives, moves its bytes with a mover
  (:mod:`memfs.array.movers`) and tells the daemon it is done;
* :class:`MountFile`: an ordinary descriptor on the mount (``preadv`` into the
  array, ``pwritev`` from it: one copy in the kernel, then FUSE), for a
  process that may not reach the pool itself, or a path outside any memfs mount.

A new file (:func:`create_file`) is written under a temporary name beside its
path and renamed over it by ``commit``: readers see the old file or the new
one, never a mix, and a failure leaves no partial file behind.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
from typing import Any, Protocol

from memfs.array.movers import LocalMover, RemoteMover
from memfs.errors import ControlError, UsageError

log = logging.getLogger(__name__)

#: a read piece whose chunk map changed under it is read again, this often
_MAX_TRIES = 20


class ArrayTarget(Protocol):
    """An open array file."""

    path: str
    size: int
    direct: bool

    def read(self, offset: int, view: memoryview) -> None: ...

    def write(self, offset: int, view: memoryview, *, publish: bool = True) -> None: ...

    def commit(self) -> None: ...

    def close(self) -> None: ...


def _os_error(exc: ControlError, path: str) -> OSError:
    return OSError(exc.errno, exc.message, path)


class DirectSession:
    """A direct-access session with the daemon of one mount (one control connection)."""

    def __init__(self, client: Any, mover: LocalMover | RemoteMover, piece: int) -> None:
        self.client = client
        self.mover = mover
        self.piece = piece

    @classmethod
    def connect(cls, mnt: str) -> DirectSession | None:
        """A session with the daemon of *mnt*, or None if this process may not (or cannot)
        reach the pool itself: then it uses the mount."""
        from memfs.cli.client import connect

        try:
            client = connect(mnt)
        except UsageError as exc:  # no daemon socket we can reach
            log.debug("%s: no direct access: %s", mnt, exc)
            return None
        return cls.over(client, mnt)

    @classmethod
    def over(cls, client: Any, mnt: str) -> DirectSession | None:
        """A session on *client* (a connected :class:`memfs.control.ControlClient`), or
        None (the client is closed) if there is no direct access."""
        fds: list[int] = []
        try:
            reply = client.call("array.hello", {}, fds=fds)
            if not reply.get("direct"):
                log.debug("%s: no direct access: %s", mnt, reply.get("why"))
                raise _NoDirect
            pool = reply["pool"]
            mover: LocalMover | RemoteMover
            if pool.get("kind") == "local":
                mover = LocalMover(fds, [int(x) for x in pool["sizes"]])
                fds = []
            else:
                mover = RemoteMover(pool)
            return cls(client, mover, int(reply["piece"]))
        except (_NoDirect, UsageError) as exc:  # refused for who we are
            if isinstance(exc, UsageError):
                log.debug("%s: no direct access: %s", mnt, exc)
        except ControlError as exc:
            # EBUSY: the daemon's connections are all taken (the mount still works)
            if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL, errno.EBUSY):
                raise _os_error(exc, mnt) from None
            log.debug("%s: no direct access: %s", mnt, exc.message)
        except Exception as exc:  # noqa: BLE001 - e.g. a verbs pool and no RDMA device here
            log.info("%s: cannot reach the pool directly (%s); using the mount", mnt, exc)
        for fd in fds:
            os.close(fd)
        client.close()
        return None

    def call(self, where: str, op: str, /, **args: Any) -> dict[str, Any]:
        """*op*'s answer; an error is an OSError naming *where* (the user's path)."""
        if not self.client.connected:
            # A new connection would be a new session, without this one's handles.
            raise OSError(errno.ENOTCONN, f"lost the daemon of {self.client.name} "
                                          "(unmounted?)", where)
        try:
            result: dict[str, Any] = self.client.call(op, args)
        except ControlError as exc:
            raise _os_error(exc, where) from None
        return result

    def transfer(self, path: str, h: int, offset: int, view: memoryview, *,
                 write: bool, publish: bool = False) -> None:
        """Move *view* to (*write*) or from ``[offset, offset+len(view))`` of handle *h*."""
        total = len(view)
        pos = 0
        while pos < total:
            n = min(self.piece, total - pos)
            last = pos + n >= total
            for _ in range(_MAX_TRIES):
                m = self.call(path, "array.map", h=h, offset=offset + pos, length=n, write=write)
                extents = m["extents"]
                try:
                    covered = sum(e[1] for e in extents)
                    if covered < n:
                        raise OSError(errno.EIO, f"the file ends at {offset + pos + covered}, "
                                      f"before the array does (truncated?)", path)
                    part = view[pos : pos + n]
                    if write:
                        self.mover.write(extents, offset + pos, part)
                    else:
                        self.mover.read(extents, offset + pos, part)
                except BaseException:
                    try:
                        self.call(path, "array.done", h=h)
                    except OSError:
                        pass
                    raise
                d = self.call(path, "array.done", h=h, publish=publish and last)
                if not d.get("stale"):
                    break
            else:
                raise OSError(errno.EIO, "its chunk map keeps changing", path)
            pos += n

    def close(self) -> None:
        self.mover.close()
        self.client.close()


class _NoDirect(Exception):
    pass


class DirectFile:
    """A file in a direct session (the session is this file's own: closed with it)."""

    direct = True

    def __init__(self, session: DirectSession, path: str, h: int, size: int) -> None:
        self.session = session
        self.path = path
        self.h = h
        self.size = size

    def read(self, offset: int, view: memoryview) -> None:
        self.session.transfer(self.path, self.h, offset, view, write=False)

    def write(self, offset: int, view: memoryview, *, publish: bool = True) -> None:
        self.session.transfer(self.path, self.h, offset, view, write=True, publish=publish)

    def commit(self) -> None:
        self.session.call(self.path, "array.commit", h=self.h)

    def close(self) -> None:
        try:
            self.session.call(self.path, "array.close", h=self.h)
        except OSError:
            pass  # the daemon is gone (it released everything) or will on disconnect
        finally:
            self.session.close()


class MountFile:
    """A file opened through the mount (or any filesystem)."""

    direct = False

    def __init__(self, path: str, fd: int, size: int, temp: str | None = None,
                 dest: str | None = None) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        #: a created file's temporary name, renamed to *dest* by commit
        self.temp = temp
        self.dest = dest or path

    def read(self, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"the file ends at {offset + done}, before the "
                              "array does (truncated?)", self.path)
            done += n

    def write(self, offset: int, view: memoryview, *, publish: bool = True) -> None:
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)

    def commit(self) -> None:
        assert self.temp is not None
        os.rename(self.temp, self.dest)
        self.temp = None

    def close(self) -> None:
        try:
            os.close(self.fd)
        finally:
            if self.temp is not None:
                try:
                    os.unlink(self.temp)
                except OSError as exc:
                    log.debug("cannot remove %s: %s", self.temp, exc)


def umask() -> int:
    """This process's umask, without changing it (which is not thread-safe)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def locate(path: str) -> tuple[str, str] | None:
    """(mountpoint, path relative to it) if *path* is in a memfs mount, else None."""
    from memfs.cli.mounts import memfs_mount_of

    real = os.path.realpath(path)
    mnt = memfs_mount_of(real)
    if mnt is None:
        return None
    return mnt, "" if real == mnt else os.path.relpath(real, mnt)


def _session(path: str) -> tuple[DirectSession, str] | None:
    where = locate(path)
    if where is None:
        return None
    session = DirectSession.connect(where[0])
    return None if session is None else (session, where[1])


def open_file(path: str, *, write: bool) -> ArrayTarget:
    """An existing file, directly if this process may, else through the mount."""
    found = _session(path)
    if found is not None:
        session, rel = found
        try:
            r = session.call(path, "array.open", path=rel, write=write)
        except BaseException:
            session.close()
            raise
        return DirectFile(session, path, int(r["h"]), int(r["size"]))
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        return MountFile(path, fd, os.fstat(fd).st_size)
    except BaseException:
        os.close(fd)
        raise


def create_file(path: str, size: int) -> ArrayTarget:
    """A new file of *size* bytes (space allocated now where the pool is direct), under a
    temporary name until ``commit``.  Replacing a file keeps its permissions."""
    mode = 0o666 & ~umask()
    found = _session(path)
    if found is not None:
        session, rel = found
        try:
            r = session.call(path, "array.create", path=rel, size=size, mode=mode)
        except BaseException:
            session.close()
            raise
        return DirectFile(session, path, int(r["h"]), size)
    real = os.path.realpath(path)
    directory, name = os.path.split(real)
    short = os.fsdecode(os.fsencode(name)[:200])  # a name is at most 255 bytes
    temp = os.path.join(directory, f".{short}.memfs-array-{secrets.token_hex(4)}")
    keep: int | None = None
    try:
        keep = os.stat(real).st_mode & 0o7777
    except FileNotFoundError:
        pass
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    f = MountFile(path, fd, size, temp, real)
    try:
        if keep is not None:
            os.fchmod(fd, keep)
        os.ftruncate(fd, size)
    except BaseException:
        f.close()
        raise
    return f
