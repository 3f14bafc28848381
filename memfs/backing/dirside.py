"""The DIR side: every syscall the burst buffer makes on the backing directory.

Nothing here touches the pool or the namespace store, and nothing here is
async: callers run these functions in worker threads (``trio.to_thread``), so a
slow or hung parallel filesystem never blocks the trio thread.  What DIR is (its
identity at mount), where temporary copies live, how a copy becomes visible
(rename into place, so DIR only ever holds whole versions) and how a namespace
operation is applied all live here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import secrets
import shutil
import socket
import stat
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from memfs.backing import faults
from memfs.backing.ops import EXCHANGE_PLANS, NsKind, NsOp
from memfs.host import process_alive

log = logging.getLogger(__name__)
T = TypeVar("T")

#: where copies are written before they are renamed into place (inside DIR: same filesystem)
TMP_DIR = b".memfs-tmp"
#: in each daemon's temporary directory, flock'ed for the daemon's life
TMP_LOCK = b".lock"

#: (relative path, lstat, symlink target) of one entry of DIR's tree
Entry = tuple[bytes, os.stat_result, "bytes | None"]


class BackingDir:
    """The backing directory DIR of one daemon (DIR may be shared by several)."""

    def __init__(self, backing: str, *, fsync: bool) -> None:
        self.root = os.fsencode(backing)
        self.fsync = fsync
        #: this daemon's temporary copies: DIR/.memfs-tmp/HOST-PID-TOKEN (DIR may be
        #: shared), in use while TMP_LOCK in it is flock'ed (see remove_leftovers)
        self.tmp_top = os.path.join(self.root, TMP_DIR)
        self.tmp = os.path.join(self.tmp_top, b"%s-%d-%s" % (
            socket.gethostname().encode(), os.getpid(), secrets.token_hex(4).encode()))
        self._tmp_lock = -1
        #: (st_dev, st_ino) of DIR at mount: a DIR that vanished (its filesystem
        #: unmounted) is never re-created under the same name on another filesystem
        self._root_id: tuple[int, int] | None = None
        #: DIR is gone or replaced: the pool may hold the only copy of everything
        self.lost = False
        self.is_root = os.geteuid() == 0

    def path(self, rel: bytes) -> bytes:
        return os.path.join(self.root, rel)

    # -- start-up ----------------------------------------------------------------------

    def prepare(self, keep: bytes = b"") -> os.stat_result:
        """Take DIR's identity, make our temporary directory (and *keep*, a directory
        beside it that outlives this daemon), remove dead daemons' leftovers."""
        root_st = os.stat(self.root)
        self._root_id = (root_st.st_dev, root_st.st_ino)
        if not os.path.isdir(self.tmp_top):
            os.mkdir(self.tmp_top, 0o700)
            os.utime(self.root, ns=(root_st.st_atime_ns, root_st.st_mtime_ns))  # ours, not news
        self.remove_leftovers()
        os.mkdir(self.tmp, 0o700)
        self._lock_tmp()
        if keep and not os.path.isdir(keep):
            os.mkdir(keep, 0o700)
        return root_st

    def scan(self, keep: bytes = b"") -> tuple[os.stat_result, list[Entry]]:
        """:meth:`prepare`, then list DIR's tree (parents before children)."""
        root_st = self.prepare(keep)
        out: list[Entry] = []
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

    def remove_leftovers(self) -> None:
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
                unlink_quiet(path)  # junk
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

    def check_root(self) -> None:
        """OSError(ESTALE) if DIR is gone or is not the directory we mounted with."""
        try:
            st = os.stat(self.root)
            ok = (st.st_dev, st.st_ino) == self._root_id
        except OSError:
            ok = False
        self.lost = not ok
        if not ok:
            raise OSError(errno.ESTALE, "the backing directory vanished or was replaced")

    def close(self, keep: bytes = b"") -> None:
        """Remove our temporary directory, *keep* if empty, and DIR/.memfs-tmp if no
        one else uses it."""
        unlink_quiet(os.path.join(self.tmp, TMP_LOCK))
        for d in (self.tmp, *([keep] if keep else []), self.tmp_top):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        if self._tmp_lock >= 0:
            os.close(self._tmp_lock)
            self._tmp_lock = -1

    # -- copies of files -----------------------------------------------------------------

    def tmp_name(self, ino: int, version: int) -> bytes:
        return os.path.join(self.tmp, b"%d.%d.%s" % (ino, version, secrets.token_hex(4).encode()))

    def open_read(self, rel: bytes) -> int:
        return os.open(os.path.join(self.root, rel), os.O_RDONLY | os.O_CLOEXEC)

    def create_tmp(self, tmp: bytes) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            return os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            # Someone emptied DIR: make our directories again, but only inside the
            # DIR we mounted (if it is gone, its filesystem may be unmounted).
            self.check_root()
            for d in (self.tmp_top, self.tmp):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d, 0o700)
            self._lock_tmp()
            return os.open(tmp, flags, 0o600)

    def finish_copy(
        self, fd: int, size: int, mode: int, uid: int, gid: int, times: tuple[int, int]
    ) -> None:
        os.ftruncate(fd, size)
        if self.is_root:
            os.fchown(fd, uid, gid)
        os.fchmod(fd, stat.S_IMODE(mode))
        os.utime(fd, ns=times)
        if self.fsync:
            os.fsync(fd)

    def write_whole(
        self, tmp: bytes, view: memoryview, size: int, mode: int, uid: int, gid: int,
        times: tuple[int, int],
    ) -> None:
        """A small file's copy in one trip to a worker thread."""
        fd = self.create_tmp(tmp)
        try:
            if size:
                pwrite_full(fd, view, 0)
            self.finish_copy(fd, size, mode, uid, gid, times)
        except BaseException:
            os.close(fd)
            unlink_quiet(tmp)
            raise
        os.close(fd)

    def publish(self, tmp: bytes, paths: list[bytes], dirs: list[NsOp] | None) -> None:
        """Rename the copy into place under every name (hard links stay hard links).

        FileNotFoundError without *dirs*: a directory is missing in DIR; the caller
        computes which (from the store, in the trio thread) and calls again."""
        self.check_root()  # never into a DIR that is not the one we mounted
        for n, p in enumerate(paths):
            dest = os.path.join(self.root, p)
            src = tmp
            if n < len(paths) - 1:
                src = tmp + b".%d" % n
                unlink_quiet(src)  # left by an attempt that failed on a missing directory
                os.link(tmp, src)
            try:
                os.rename(src, dest)
                if n == 0 and len(paths) > 1:
                    faults.kill_at("kill-mid-publish")
            except FileNotFoundError:
                if dirs is None:
                    raise
                # A directory vanished from DIR behind our back (or its mkdir was
                # skipped): make the missing ones as they are in memfs.
                self.check_root()
                for op in dirs:
                    if not os.path.isdir(os.path.join(self.root, op.path)):
                        self.apply(op)
                os.rename(src, dest)

    def write_each(
        self, items: list[tuple[bytes, memoryview, int, int, int, tuple[int, int]]],
    ) -> list[OSError | None]:
        """:meth:`write_whole` for each (tmp, view, mode, uid, gid, times): what each raised."""
        out: list[OSError | None] = []
        for tmp, view, mode, uid, gid, times in items:
            try:
                self.write_whole(tmp, view, len(view), mode, uid, gid, times)
                out.append(None)
            except OSError as exc:
                out.append(exc)
        return out

    def publish_each(self, pairs: list[tuple[bytes, list[bytes]]]) -> list[OSError | None]:
        """:meth:`publish` (without *dirs*) for each (tmp, paths): what each raised."""
        out: list[OSError | None] = []
        for tmp, paths in pairs:
            try:
                self.publish(tmp, paths, None)
                out.append(None)
            except OSError as exc:
                out.append(exc)
        return out

    # -- namespace operations --------------------------------------------------------------

    def apply(self, op: NsOp) -> None:
        try:
            self._apply(op)
        except FileNotFoundError:
            self.check_root()  # ENOENT because all of DIR is gone: retry, do not skip
            raise

    def _apply(self, op: NsOp) -> None:
        path = os.path.join(self.root, op.path)
        k = op.kind
        if k is NsKind.MKDIR:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                if not os.path.isdir(path):
                    raise
            self._set_attrs(path, op, times=False)
        elif k is NsKind.SYMLINK:
            unlink_quiet(path)
            os.symlink(op.target, path)
            if self.is_root:
                os.lchown(path, op.uid, op.gid)
            os.utime(path, ns=(op.mtime_ns, op.mtime_ns), follow_symlinks=False)
        elif k is NsKind.MKNOD:
            unlink_quiet(path)
            if stat.S_ISFIFO(op.mode):
                os.mkfifo(path, 0o600)
            elif stat.S_ISSOCK(op.mode):
                return  # a socket is not data: nothing to keep
            else:
                os.mknod(path, op.mode, op.rdev)
            self._set_attrs(path, op, times=False)
        elif k is NsKind.UNLINK:
            os.unlink(path)
        elif k is NsKind.RMDIR:
            os.rmdir(path)
        elif k is NsKind.RENAME:
            os.rename(path, os.path.join(self.root, op.path2))
        elif k is NsKind.EXCHANGE:
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
        elif k is NsKind.ATTRS:
            self._set_attrs(path, op, times=True)

    def exchange_plan(self, op: NsOp) -> int:
        """Which of :data:`EXCHANGE_PLANS` swaps *op*'s two paths as DIR is now."""
        here = os.path.lexists(os.path.join(self.root, op.path))
        there = os.path.lexists(os.path.join(self.root, op.path2))
        return 1 if here and there else 2 if here else 3 if there else 4

    def exchange_step(self, op: NsOp, swap_dir: bytes) -> None:
        """Rename number ``op.step`` of its plan; a source already gone means that
        rename was done before a crash (it is recorded only after)."""
        names = {"a": os.path.join(self.root, op.path), "b": os.path.join(self.root, op.path2),
                 "s": os.path.join(swap_dir, b"swap")}
        src, dst = EXCHANGE_PLANS[op.plan][op.step]
        self.check_root()
        if "s" in (src, dst) and not os.path.isdir(swap_dir):
            for d in (self.tmp_top, swap_dir):  # someone emptied DIR/.memfs-tmp
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d, 0o700)
        try:
            os.rename(names[src], names[dst])
        except FileNotFoundError:
            # Done before a crash (the rename is recorded only after), or the file
            # was removed from DIR behind our back: either way nothing to move,
            # and the plan goes on (never left half done, a copy parked in swap).
            if os.path.lexists(names[src]):
                raise

    def _set_attrs(self, path: bytes, op: NsOp, *, times: bool) -> None:
        if stat.S_ISLNK(op.mode):
            if times:
                os.utime(path, ns=(op.mtime_ns, op.mtime_ns), follow_symlinks=False)
            return
        if self.is_root and op.uid >= 0:
            os.chown(path, op.uid, op.gid, follow_symlinks=False)
        os.chmod(path, stat.S_IMODE(op.mode))
        if times and not stat.S_ISDIR(op.mode):
            st = os.stat(path, follow_symlinks=False)
            os.utime(path, ns=(st.st_atime_ns, op.mtime_ns), follow_symlinks=False)


# -- file descriptors and whole reads/writes (worker threads) ------------------------------

#: worker threads for syscalls on DIR at once: a hung DIR ties up at most these, in
#: a limiter of their own (the journal's fdatasync keeps trio's default one)
DIR_THREADS = 32
_DIR_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("memfs_dir_threads")


def dir_limiter() -> trio.CapacityLimiter:
    try:
        return _DIR_LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(DIR_THREADS)
        _DIR_LIMITER.set(limiter)
        return limiter


async def in_thread(
    fn: Callable[..., T], *args: Any, on_late: Callable[[T], None] | None = None,
    on_skipped: Callable[[], None] | None = None,
    after: Callable[[bool], None] | None = None,
) -> T:
    """``fn(*args)`` in a worker thread, for a syscall on DIR.

    Cancelled, the caller stops waiting at once (a hung parallel filesystem must
    not hold up shutdown, nor a client's call past its deadline), and exactly one
    of these follows: *fn* never runs (cancelled before its thread began) and
    *on_skipped* is called; or *fn* runs to its end in its thread, then
    *on_late* (in a worker thread) gets a result no one will use (a descriptor
    to close) and *after* (on the trio thread) learns whether it succeeded.
    """
    lock = threading.Lock()
    st: dict[str, Any] = {"abandoned": False, "started": False, "done": False, "ok": False,
                          "result": None}
    token = trio.lowlevel.current_trio_token()

    def run() -> Any:
        with lock:
            if st["abandoned"]:
                return None  # given up before it began: it never runs
            st["started"] = True
        ok = False
        result: T | None = None
        try:
            result = fn(*args)
            ok = True
            return result
        finally:
            with lock:
                late = st["abandoned"]
                st["done"], st["ok"], st["result"] = True, ok, result
            if late:
                if ok and on_late is not None:
                    on_late(result)  # type: ignore[arg-type]
                if after is not None:
                    with contextlib.suppress(trio.RunFinishedError):
                        token.run_sync_soon(after, ok)

    try:
        out: T = await trio.to_thread.run_sync(run, abandon_on_cancel=True, limiter=dir_limiter())
        return out
    except trio.Cancelled:
        with lock:
            st["abandoned"] = True
            started, done, ok, result = st["started"], st["done"], st["ok"], st["result"]
        if not started:
            if on_skipped is not None:
                on_skipped()
        elif done:  # it finished, but its result was dropped
            if ok and on_late is not None:
                late_fn = on_late
                trio.lowlevel.start_thread_soon(lambda: late_fn(result), _log_close_error)
            if after is not None:
                after(ok)
        raise


async def open_in_thread(fn: Callable[..., int], *args: Any) -> int:
    """:func:`in_thread` for a call that opens a file: never leaks the descriptor."""
    return await in_thread(fn, *args, on_late=os.close)


async def close_written(fd: int) -> None:
    """Close a file we wrote, in a worker thread (closing it on a parallel filesystem
    may flush and report a write error: raised as OSError).  Cancelled, it is still
    closed, once: by that thread, or in the background if the thread never began."""
    await in_thread(os.close, fd, on_skipped=lambda: close_soon(fd))


def close_soon(fd: int) -> None:
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


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def write_step(
    fd: int, view: memoryview, offset: int, src: int, old: list[tuple[int, int]]
) -> None:
    """Fill the *old* parts of *view* from *src* (zeros past its end), write it at *offset*."""
    for a, b in old:
        got = pread_full(src, view[a:b], offset + a)
        if got < b - a:
            view[a + got : b] = bytes(b - a - got)
    pwrite_full(fd, view, offset)


def pwrite_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def unlink_quiet(path: bytes) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
