"""POSIX namespace semantics through a real memfs mount.

Everything here goes through the kernel with ordinary system calls (and child
processes where POSIX talks about several processes), so it checks what
applications see: the kernel's checks, its attribute cache and memfs together.
One mount serves the whole module (a mount costs ~0.5 s); every test works in a
directory of its own, and when that is removed the pool must be whole again, so a
leak of space or inodes fails the test that caused it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import random
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MOUNT_SKIP, Mounted, _mount, unmount

pytestmark = pytest.mark.mount

SIZE = 256 << 20  # pool of the module mount
CHUNK = 64 << 10  # default allocation unit
STRIPE = 1 << 20  # default stripe unit
NOBODY = 65534
OLD_NS = 1_000_000_000_123_456_789  # 2001-09-09, far from "now"
AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
CLOCK_REALTIME_COARSE = 5  # Linux; not exported by the time module

_libc = ctypes.CDLL(None, use_errno=True)
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]


# -- fixtures and helpers ---------------------------------------------------------------

#: mount -> its allocation unit: a chunk of pool memory, or (-o passthrough) a tmpfs page
_UNIT: dict[Path, int] = {}


def unit(fs: Mounted) -> int:
    return _UNIT[fs.path]



@pytest.fixture(scope="module", params=["pool", "passthrough"])
def fs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Mounted]:
    """One mount for the module; its log must stay free of errors and warnings.

    Twice: files in pool volumes (the default), and in backing files the kernel
    reads and writes itself (``-o passthrough``, memfs.passthrough)."""
    if MOUNT_SKIP:
        pytest.skip(MOUNT_SKIP)
    made: list[Mounted] = []
    extra = ["-o", "passthrough"] if request.param == "passthrough" else []
    m = _mount(tmp_path_factory.mktemp("posix"), "mnt", ["--size", "256M", *extra], made)
    _UNIT[m.path] = 4096 if extra else CHUNK
    try:
        yield m
    finally:
        unmount(m)
        text = m.log.read_text() if m.log.exists() else ""
        bad = [w for w in ("Traceback", " ERROR ", " WARNING ") if w in text]
        assert not bad, f"daemon log {m.log} has {bad}:\n{text[-3000:]}"


@pytest.fixture
def d(fs: Mounted, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory of the shared mount for one test.

    Afterwards it is removed and the pool must be whole again: every test gives
    back all the space and inodes it took, so a leak fails the test that made it.
    """
    path = fs.path / request.node.name.replace("[", "_").replace("]", "")
    path.mkdir()
    yield path
    close_fds_into(fs.path)
    shutil.rmtree(path)
    st = os.statvfs(fs.path)
    assert wait_bfree(fs.path, st.f_blocks) == st.f_blocks, "space not returned"
    assert wait_for(lambda: os.statvfs(fs.path).f_ffree, st.f_files - 1), "inodes not freed"


def close_fds_into(mountpoint: Path) -> None:
    """Close fds a failed test left open: they would keep the mount (and daemon) alive."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{mountpoint}/"):
            os.close(int(fd))


def expect(err: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Call *fn* and require it to fail with *err*."""
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    assert info.value.errno == err, (
        f"{fn.__name__}{args}: {errno.errorcode.get(info.value.errno or 0)}, "
        f"expected {errno.errorcode[err]}"
    )


def renameat2(old: Path, new: Path, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags):
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(old))


def bfree(path: Path) -> int:
    return os.statvfs(path).f_bfree


def wait_for(probe: Callable[[], int], want: int, timeout: float = 5.0) -> bool:
    """Poll until *probe* gives *want*: the kernel sends RELEASE asynchronously."""
    deadline = time.monotonic() + timeout
    while (now := probe()) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return now == want


def wait_bfree(path: Path, want: int, timeout: float = 5.0) -> int:
    wait_for(lambda: bfree(path), want, timeout)
    return bfree(path)


def read_uncached(path: Path) -> bytes:
    """The file as the daemon has it: drop the kernel's cached pages first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out = bytearray()
        while chunk := os.read(fd, 1 << 20):
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)


def in_child(fn: Callable[[], object], *, cwd: Path, uid: int | None = None) -> int:
    """Run *fn* in a forked process (as *uid*, no groups); return its errno, 0 on success.

    The child enters *cwd* before dropping privileges: pytest's base temp
    directory is 0700, so the mount is reached by relative paths only.
    """
    with warnings.catch_warnings():
        # Python >= 3.12 warns about fork() with threads (faulthandler's watchdog);
        # the child only makes system calls and exits, so no lock can bite it.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 255
        try:
            os.chdir(cwd)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            fn()
            code = 0
        except OSError as exc:
            code = exc.errno or 254
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def as_nobody(fn: Callable[[], object], cwd: Path) -> int:
    return in_child(fn, cwd=cwd, uid=NOBODY)


def coarse_now() -> int:
    """The clock file timestamps come from: the kernel's (and memfs's) coarse one."""
    return time.clock_gettime_ns(CLOCK_REALTIME_COARSE)


def next_tick(t: int) -> None:
    """Wait until the timestamp clock is past *t*, so a later update is visibly later."""
    deadline = time.monotonic() + 1
    while coarse_now() <= t and time.monotonic() < deadline:
        time.sleep(0.001)


def dot_inos(path: Path) -> dict[str, int]:
    """Inode numbers readdir gives for "." and ".." (os.listdir hides them)."""
    out = subprocess.run(["ls", "-a1i", path], capture_output=True, text=True, check=True)
    found = (line.split(maxsplit=1) for line in out.stdout.splitlines())
    return {name: int(ino) for ino, name in found if name in (".", "..")}


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


# -- lookup, getattr, setattr ----------------------------------------------------------


def test_lookup_getattr(fs: Mounted, d: Path) -> None:
    root = os.stat(fs.path)
    assert stat.S_IMODE(root.st_mode) == 0o1777 and stat.S_ISDIR(root.st_mode)
    fd = os.open(d / "f", os.O_CREAT | os.O_WRONLY, 0o640)
    os.write(fd, b"hello")
    st = os.stat(d / "f")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    assert (st.st_uid, st.st_gid, st.st_nlink, st.st_size) == (0, 0, 1, 5)
    assert os.fstat(fd).st_ino == st.st_ino
    os.close(fd)
    assert os.stat(f"{d}/./f").st_ino == st.st_ino
    os.mkdir(d / "sub")
    assert os.stat(d / "sub" / "..").st_ino == os.stat(d).st_ino
    assert {e.name: e.inode() for e in os.scandir(d)}["f"] == st.st_ino
    expect(errno.ENOENT, os.stat, d / "missing")
    expect(errno.ENOENT, os.stat, d / "missing" / "f")
    expect(errno.ENOTDIR, os.stat, d / "f" / "x")
    expect(errno.ENOTDIR, os.open, d / "f" / "x", os.O_CREAT | os.O_WRONLY)


def test_chmod_chown(d: Path) -> None:
    f = d / "f"
    f.touch()
    os.chmod(f, 0o4751)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o4751
    os.chmod(f, 0o600)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    os.chown(f, NOBODY, 1234)
    st = os.stat(f)
    assert (st.st_uid, st.st_gid) == (NOBODY, 1234)
    os.chown(f, -1, 4321)  # -1 leaves the owner alone
    st = os.stat(f)
    assert (st.st_uid, st.st_gid) == (NOBODY, 4321)
    os.mkdir(d / "sub", 0o700)
    os.chmod(d / "sub", 0o2775)
    st = os.stat(d / "sub")
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o2775
    os.symlink("f", d / "l")
    os.chown(d / "l", 7, 8, follow_symlinks=False)
    assert (os.lstat(d / "l").st_uid, os.stat(d / "l").st_uid) == (7, NOBODY)


def test_utime_precision_and_now(d: Path) -> None:
    f = d / "f"
    f.touch()
    os.utime(f, ns=(OLD_NS, OLD_NS + 987654321))
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (OLD_NS, OLD_NS + 987654321)
    ctime = st.st_ctime_ns
    next_tick(ctime)
    before = coarse_now()  # the kernel supplies UTIME_NOW from its coarse clock
    os.utime(f)  # UTIME_NOW for both
    after = time.time_ns()
    st = os.stat(f)
    assert before <= st.st_atime_ns <= after
    assert before <= st.st_mtime_ns <= after
    assert st.st_ctime_ns > ctime
    # only one of the two: the other keeps its value
    os.utime(f, ns=(OLD_NS, OLD_NS))
    fd = os.open(f, os.O_RDONLY)
    try:
        libc_ts = (ctypes.c_long * 4)(0, (1 << 30) - 2, 5, 6)  # atime UTIME_OMIT, mtime 5.000000006
        assert _libc.futimens(fd, libc_ts) == 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (OLD_NS, 5_000_000_006)
    os.utime(d, ns=(OLD_NS, OLD_NS))
    assert os.stat(d).st_mtime_ns == OLD_NS


def test_truncate_shrink_extend(fs: Mounted, d: Path) -> None:
    f = d / "f"
    data = random.Random(1).randbytes(3 * CHUNK + 1000)
    write_file(f, data)
    for size in (2 * CHUNK + 123, 2 * CHUNK, CHUNK - 1, 10):
        os.truncate(f, size)
        assert os.stat(f).st_size == size
        assert f.read_bytes() == data[:size]
        assert read_uncached(f) == data[:size]
    # Growing again must show zeros, never the bytes that were cut off.
    os.truncate(f, 3 * CHUNK + 1000)
    want = data[:10] + bytes(3 * CHUNK + 990)
    assert f.read_bytes() == want
    assert read_uncached(f) == want
    fd = os.open(f, os.O_RDWR)
    try:
        os.ftruncate(fd, 5)
        assert os.fstat(fd).st_size == 5
        os.ftruncate(fd, CHUNK + 7)
        assert os.pread(fd, CHUNK + 100, 0) == data[:5] + bytes(CHUNK + 2)
        os.pwrite(fd, b"xy", CHUNK + 7)  # writing at EOF after an extending truncate
        assert os.pread(fd, CHUNK + 100, 0) == data[:5] + bytes(CHUNK + 2) + b"xy"
    finally:
        os.close(fd)
    os.truncate(f, 0)
    assert os.stat(f).st_blocks == 0 and f.read_bytes() == b""
    expect(errno.EISDIR, os.truncate, d, 0)
    expect(errno.EINVAL, os.truncate, f, -1)


def test_st_blocks_sparse_vs_written(fs: Mounted, d: Path) -> None:
    start = bfree(fs.path)
    sparse = d / "sparse"
    sparse.touch()
    os.truncate(sparse, 10 << 20)
    st = os.stat(sparse)
    assert (st.st_size, st.st_blocks) == (10 << 20, 0)
    assert bfree(fs.path) == start
    fd = os.open(sparse, os.O_WRONLY)
    os.pwrite(fd, b"x", 5 << 20)  # one chunk in the middle
    os.close(fd)
    assert os.stat(sparse).st_blocks == unit(fs) // 512
    assert bfree(fs.path) == start - unit(fs) // 4096
    written = d / "written"
    write_file(written, os.urandom(STRIPE + 1))
    st = os.stat(written)
    assert st.st_blocks * 512 == STRIPE + unit(fs)  # whole chunks (or pages)
    assert st.st_blksize >= 4096
    assert os.stat(d).st_blocks == 0 and os.stat(d).st_size > 0


def test_nlink_files_and_dirs(fs: Mounted, d: Path) -> None:
    f = d / "f"
    f.write_bytes(b"abc")
    assert os.stat(f).st_nlink == 1
    os.link(f, d / "g")
    os.link(f, d / "h")
    assert os.stat(f).st_nlink == os.stat(d / "g").st_nlink == 3
    assert os.stat(d / "h").st_ino == os.stat(f).st_ino
    os.unlink(d / "g")
    assert os.stat(f).st_nlink == 2
    assert os.stat(d).st_nlink == 2
    for n in ("a", "b", "c"):
        os.mkdir(d / n)
    assert os.stat(d).st_nlink == 5  # files do not count
    os.mkdir(d / "a" / "x")
    assert (os.stat(d).st_nlink, os.stat(d / "a").st_nlink) == (5, 3)
    os.rmdir(d / "b")
    assert os.stat(d).st_nlink == 4
    subdirs = [e for e in os.scandir(fs.path) if e.is_dir(follow_symlinks=False)]
    assert os.stat(fs.path).st_nlink == 2 + len(subdirs)


# -- timestamps -------------------------------------------------------------------------


def age(*paths: Path) -> list[int]:
    """Set atime and mtime to OLD_NS; return the ctimes that leaves, once they are past."""
    for p in paths:
        os.utime(p, ns=(OLD_NS, OLD_NS), follow_symlinks=False)
    ctimes = [os.lstat(p).st_ctime_ns for p in paths]
    next_tick(max(ctimes))
    return ctimes


def test_timestamps_write_and_chmod(d: Path) -> None:
    f = d / "f"
    f.write_bytes(b"x" * 100)
    (ctime,) = age(f)
    with open(f, "r+b") as fh:
        fh.write(b"y")
    st = os.stat(f)
    assert st.st_mtime_ns > OLD_NS and st.st_ctime_ns > ctime
    assert st.st_atime_ns == OLD_NS  # writing is not reading
    (ctime,) = age(f)
    os.chmod(f, 0o600)
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (OLD_NS, OLD_NS) and st.st_ctime_ns > ctime
    (ctime,) = age(f)
    os.chown(f, 1, 1)
    st = os.stat(f)
    assert st.st_mtime_ns == OLD_NS and st.st_ctime_ns > ctime
    (ctime,) = age(f)
    os.truncate(f, 10)
    st = os.stat(f)
    assert st.st_mtime_ns > OLD_NS and st.st_ctime_ns > ctime and st.st_atime_ns == OLD_NS
    (ctime,) = age(f)
    os.setxattr(f, "user.k", b"v")
    st = os.stat(f)
    assert st.st_mtime_ns == OLD_NS and st.st_ctime_ns > ctime


def test_timestamps_keep_order_with_touch(d: Path) -> None:
    """`touch b` after writing `a` must not leave b older than a (make relies on it).

    The kernel stamps UTIME_NOW itself, from its coarse clock or (Linux 6.13 on) the
    multigrain floor past it, which fine-grained stamps on other filesystems push
    ahead (busy ext4 or tmpfs on the node, made here with one on /dev/shm before each
    touch): memfs's own stamps must stay in that order (memfs.meta.clock).
    """
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # (tmpfs: multigrain times)
    watched = tempfile.NamedTemporaryFile(dir=shm)  # noqa: SIM115 - closed below
    try:
        for i in range(50):
            a, b = d / f"a{i}", d / f"b{i}"
            b.touch()
            a.write_bytes(b"x")
            os.utime(b)
            assert os.stat(b).st_mtime_ns >= os.stat(a).st_mtime_ns, i
            os.stat(watched.name)  # its timestamps are watched: the next one is fine-grained
            os.utime(watched.name)  # and pushes the kernel's floor past the coarse clock
            os.utime(b)
            a.write_bytes(b"y")
            assert os.stat(a).st_mtime_ns >= os.stat(b).st_mtime_ns, i
    finally:
        watched.close()


def test_timestamps_read_updates_atime(d: Path) -> None:
    f = d / "f"
    f.write_bytes(b"x" * 100)
    age(f)  # atime <= mtime: relatime updates it on the next read
    assert f.read_bytes() == b"x" * 100  # a plain read: no cache the kernel keeps may hide it
    st = os.stat(f)
    assert st.st_atime_ns > OLD_NS and st.st_mtime_ns == OLD_NS


def test_timestamps_namespace_ops(d: Path) -> None:
    a, b = d / "a", d / "b"
    a.mkdir()
    b.mkdir()
    # create: the new inode is "now", the parent's mtime and ctime move
    (ca,) = age(a)
    before = coarse_now()
    (a / "f").write_bytes(b"1")
    st, sa = os.stat(a / "f"), os.stat(a)
    assert before <= st.st_mtime_ns and before <= st.st_ctime_ns and before <= st.st_atime_ns
    assert sa.st_mtime_ns > OLD_NS and sa.st_ctime_ns > ca
    for make in (
        lambda: os.mkdir(a / "sub"),
        lambda: os.symlink("f", a / "sym"),
        lambda: os.mkfifo(a / "fifo"),
        lambda: os.link(a / "f", a / "f2"),
    ):
        (ca,) = age(a)
        make()
        sa = os.stat(a)
        assert sa.st_mtime_ns > OLD_NS and sa.st_ctime_ns > ca
    # link also changes the inode's ctime, not its mtime
    cf, ca = age(a / "f", a)
    os.link(a / "f", a / "f3")
    st = os.stat(a / "f")
    assert st.st_ctime_ns > cf and st.st_mtime_ns == OLD_NS
    # unlink: the parent and the inode's ctime (seen through the other link)
    cf, ca = age(a / "f", a)
    os.unlink(a / "f2")
    st, sa = os.stat(a / "f"), os.stat(a)
    assert st.st_ctime_ns > cf and st.st_mtime_ns == OLD_NS
    assert sa.st_mtime_ns > OLD_NS and sa.st_ctime_ns > ca
    # rmdir
    (ca,) = age(a)
    os.rmdir(a / "sub")
    sa = os.stat(a)
    assert sa.st_mtime_ns > OLD_NS and sa.st_ctime_ns > ca
    # rename between parents: both parents change, the file's ctime moves, mtime does not
    cf, ca, cb = age(a / "f", a, b)
    os.rename(a / "f", b / "g")
    st, sa, sb = os.stat(b / "g"), os.stat(a), os.stat(b)
    assert sa.st_mtime_ns > OLD_NS and sa.st_ctime_ns > ca
    assert sb.st_mtime_ns > OLD_NS and sb.st_ctime_ns > cb
    assert st.st_mtime_ns == OLD_NS and st.st_ctime_ns > cf
    # rename within one directory
    (cb,) = age(b)
    os.rename(b / "g", b / "h")
    sb = os.stat(b)
    assert sb.st_mtime_ns > OLD_NS and sb.st_ctime_ns > cb


# -- open, read, write --------------------------------------------------------------------


def test_open_flags(d: Path) -> None:
    f = d / "f"
    old_umask = os.umask(0o022)
    try:
        fd = os.open(f, os.O_CREAT | os.O_WRONLY, 0o666)
    finally:
        os.umask(old_umask)
    os.write(fd, b"0123456789")
    os.close(fd)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o644
    expect(errno.EEXIST, os.open, f, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    fd = os.open(f, os.O_CREAT | os.O_RDONLY)  # O_CREAT without O_EXCL opens the file
    assert os.read(fd, 100) == b"0123456789"
    expect(errno.EBADF, os.write, fd, b"x")
    os.close(fd)
    fd = os.open(f, os.O_WRONLY)
    expect(errno.EBADF, os.read, fd, 1)
    os.close(fd)
    os.symlink("f", d / "link")
    expect(errno.EEXIST, os.open, d / "link", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    expect(errno.ELOOP, os.open, d / "link", os.O_RDONLY | os.O_NOFOLLOW)
    # O_TRUNC empties the file and gives its space back
    write_file(f, os.urandom(2 * CHUNK))
    fd = os.open(f, os.O_WRONLY | os.O_TRUNC)
    assert os.fstat(fd).st_size == 0 and os.stat(f).st_blocks == 0
    os.close(fd)
    assert f.read_bytes() == b"" and read_uncached(f) == b""
    # O_APPEND: every write lands at the current end, whatever fd wrote last
    fd1 = os.open(f, os.O_WRONLY | os.O_APPEND)
    fd2 = os.open(f, os.O_WRONLY | os.O_APPEND)
    try:
        for i in range(20):
            os.write(fd1 if i % 2 else fd2, b"%02d" % i)
        os.lseek(fd1, 0, os.SEEK_SET)
        os.write(fd1, b"!")
    finally:
        os.close(fd1)
        os.close(fd2)
    assert f.read_bytes() == b"".join(b"%02d" % i for i in range(20)) + b"!"
    # directories
    expect(errno.EISDIR, os.open, d, os.O_WRONLY)
    expect(errno.EISDIR, os.open, d, os.O_RDWR)
    expect(errno.EISDIR, os.open, d, os.O_CREAT | os.O_WRONLY)
    expect(errno.ENOTDIR, os.open, f, os.O_RDONLY | os.O_DIRECTORY)
    expect(errno.ENOENT, os.open, d / "nope", os.O_RDONLY)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    expect(errno.EISDIR, os.read, fd, 1)
    os.close(fd)


def test_concurrent_appenders(d: Path) -> None:
    """Two processes appending through O_APPEND never overwrite each other."""
    f = d / "log"
    f.touch()
    script = (
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)\n"
        "for i in range(300):\n"
        "    os.write(fd, (sys.argv[2] * 99 + '\\n').encode())\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(f), c]) for c in "ab"]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    lines = f.read_bytes().splitlines()
    assert sorted(lines) == sorted([b"a" * 99] * 300 + [b"b" * 99] * 300)


def test_pread_pwrite_holes(fs: Mounted, d: Path) -> None:
    f = d / "f"
    rng = random.Random(2)
    model = bytearray()
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        offsets = [0, 1, CHUNK - 3, 5 * CHUNK + 17, STRIPE - 5, 3 * STRIPE + 1, 7, 2 * STRIPE]
        offsets += [rng.randrange(4 * STRIPE) for _ in range(20)]
        for off in offsets:
            data = rng.randbytes(rng.choice([1, 100, CHUNK, CHUNK + 3, STRIPE + 11]))
            assert os.pwrite(fd, data, off) == len(data)
            if off > len(model):
                model += bytes(off - len(model))
            model[off : off + len(data)] = data
            assert os.fstat(fd).st_size == len(model)
        for _ in range(30):
            off = rng.randrange(len(model) + 10)
            n = rng.randrange(1, 2 * STRIPE)
            assert os.pread(fd, n, off) == bytes(model[off : off + n])
        # past EOF: nothing, and no size change
        assert os.pread(fd, 10, len(model) + 5) == b""
        # a write far past EOF leaves a hole of zeros and allocates only what it touches
        free = bfree(fs.path)
        hole_at = len(model) + 3 * STRIPE + 5
        os.pwrite(fd, b"tail", hole_at)
        assert bfree(fs.path) == free - unit(fs) // 4096
        model += bytes(hole_at - len(model)) + b"tail"
        # lseek/read at arbitrary offsets
        os.lseek(fd, 12345, os.SEEK_SET)
        assert os.read(fd, 1000) == bytes(model[12345:13345])
    finally:
        os.close(fd)
    assert f.read_bytes() == bytes(model)
    assert read_uncached(f) == bytes(model)


# -- directories, unlink --------------------------------------------------------------------


def test_mkdir_rmdir_unlink_errors(d: Path) -> None:
    os.mkdir(d / "a", 0o750)
    assert stat.S_IMODE(os.stat(d / "a").st_mode) == 0o750
    (d / "a" / "f").touch()
    (d / "file").touch()
    expect(errno.EEXIST, os.mkdir, d / "a")
    expect(errno.EEXIST, os.mkdir, d / "file")
    expect(errno.ENOENT, os.mkdir, d / "missing" / "x")
    expect(errno.ENOTDIR, os.mkdir, d / "file" / "x")
    expect(errno.ENOTEMPTY, os.rmdir, d / "a")
    expect(errno.ENOTDIR, os.rmdir, d / "file")
    expect(errno.ENOENT, os.rmdir, d / "missing")
    expect(errno.EINVAL, os.rmdir, f"{d}/a/.")  # pathlib would drop the "."
    expect(errno.ENOTEMPTY, os.rmdir, f"{d}/a/..")
    expect(errno.EISDIR, os.unlink, d / "a")
    expect(errno.ENOENT, os.unlink, d / "missing")
    expect(errno.ENOTDIR, os.unlink, d / "file" / "x")
    assert (d / "a" / "f").exists()
    os.unlink(d / "a" / "f")
    os.rmdir(d / "a")
    assert not (d / "a").exists()
    assert sorted(os.listdir(d)) == ["file"]


def test_unlink_while_open(fs: Mounted, d: Path) -> None:
    start = bfree(fs.path)
    f = d / "f"
    data = os.urandom(2 * STRIPE)
    write_file(f, data)
    used = start - bfree(fs.path)
    assert used == 2 * STRIPE // 4096
    fd = os.open(f, os.O_RDWR)
    try:
        os.unlink(f)
        assert not f.exists() and os.listdir(d) == []
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, len(data), 0) == data
        os.pwrite(fd, b"more", len(data))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, 10, len(data) - 6) == data[-6:] + b"more"
        assert os.fstat(fd).st_size == len(data) + 4
        # a new file with the old name is a different file
        (d / "f").write_bytes(b"new")
        assert os.fstat(fd).st_ino != os.stat(f).st_ino
        os.unlink(f)
        held = start - used - unit(fs) // 4096  # the unlinked file is still held by the fd
        assert wait_bfree(fs.path, held) == held
    finally:
        os.close(fd)
    assert wait_bfree(fs.path, start) == start


# -- rename ----------------------------------------------------------------------------------


def test_rename_files(fs: Mounted, d: Path) -> None:
    os.mkdir(d / "x")
    os.mkdir(d / "y")
    (d / "x" / "a").write_bytes(b"A")
    ino = os.stat(d / "x" / "a").st_ino
    os.rename(d / "x" / "a", d / "x" / "b")
    assert os.listdir(d / "x") == ["b"] and os.stat(d / "x" / "b").st_ino == ino
    os.rename(d / "x" / "b", d / "y" / "c")
    assert os.listdir(d / "x") == [] and os.listdir(d / "y") == ["c"]
    assert (d / "y" / "c").read_bytes() == b"A" and os.stat(d / "y" / "c").st_ino == ino
    # replacing a file: the old target's data is gone and its space freed
    start = bfree(fs.path)
    write_file(d / "y" / "big", os.urandom(3 * STRIPE))
    assert bfree(fs.path) == start - 3 * STRIPE // 4096
    os.rename(d / "y" / "c", d / "y" / "big")
    assert (d / "y" / "big").read_bytes() == b"A" and os.stat(d / "y" / "big").st_ino == ino
    assert os.listdir(d / "y") == ["big"]
    assert wait_bfree(fs.path, start) == start
    # replacing a target that is still open: its data lives until the close
    write_file(d / "y" / "victim", b"V" * CHUNK)
    fd = os.open(d / "y" / "victim", os.O_RDONLY)
    os.rename(d / "y" / "big", d / "y" / "victim")
    assert os.read(fd, 10) == b"V" * 10 and os.fstat(fd).st_nlink == 0
    assert (d / "y" / "victim").read_bytes() == b"A"
    os.close(fd)
    assert wait_bfree(fs.path, start) == start
    # renaming one hard link onto another of the same inode does nothing
    os.link(d / "y" / "victim", d / "y" / "twin")
    os.rename(d / "y" / "victim", d / "y" / "twin")
    assert sorted(os.listdir(d / "y")) == ["twin", "victim"]
    assert os.stat(d / "y" / "twin").st_nlink == 2
    expect(errno.ENOENT, os.rename, d / "y" / "missing", d / "y" / "z")
    expect(errno.ENOENT, os.rename, d / "y" / "twin", d / "missing" / "z")
    expect(errno.ENOTDIR, os.rename, d / "y" / "twin", d / "y" / "victim" / "z")


def test_rename_directories(d: Path) -> None:
    for n in ("p", "q"):
        os.mkdir(d / n)
    os.makedirs(d / "p" / "m" / "deep")
    (d / "p" / "m" / "file").write_bytes(b"M")
    assert (os.stat(d / "p").st_nlink, os.stat(d / "q").st_nlink) == (3, 2)
    os.rename(d / "p" / "m", d / "q" / "m")
    assert (os.stat(d / "p").st_nlink, os.stat(d / "q").st_nlink) == (2, 3)
    assert os.stat(d / "q" / "m" / "..").st_ino == os.stat(d / "q").st_ino
    assert dot_inos(d / "q" / "m")[".."] == os.stat(d / "q").st_ino  # memfs's own parent link
    assert os.stat(d / "q" / "m" / "deep" / ".." / "..").st_ino == os.stat(d / "q").st_ino
    assert (d / "q" / "m" / "file").read_bytes() == b"M"
    # over an empty directory: allowed, the target is replaced
    os.mkdir(d / "p" / "empty")
    os.rename(d / "q" / "m", d / "p" / "empty")
    assert sorted(os.listdir(d / "p" / "empty")) == ["deep", "file"]
    assert (os.stat(d / "p").st_nlink, os.stat(d / "q").st_nlink) == (3, 2)
    # over a non-empty directory: ENOTEMPTY, and both sides intact
    os.makedirs(d / "q" / "full" / "inner")
    os.mkdir(d / "q" / "src")
    expect(errno.ENOTEMPTY, os.rename, d / "q" / "src", d / "q" / "full")
    expect(errno.ENOTEMPTY, renameat2, d / "q" / "src", d / "q" / "full", 0)
    assert os.listdir(d / "q" / "full") == ["inner"] and (d / "q" / "src").is_dir()
    # file over directory and directory over file
    (d / "q" / "f").write_bytes(b"F")
    expect(errno.EISDIR, os.rename, d / "q" / "f", d / "q" / "src")
    expect(errno.ENOTDIR, os.rename, d / "q" / "src", d / "q" / "f")
    assert (d / "q" / "f").read_bytes() == b"F" and (d / "q" / "src").is_dir()
    # into itself or below itself
    expect(errno.EINVAL, os.rename, d / "q", d / "q" / "full" / "inner" / "q")
    expect(errno.EINVAL, os.rename, d / "q", d / "q" / "sub")
    assert sorted(os.listdir(d / "q")) == ["f", "full", "src"]
    assert os.stat(d / "q").st_nlink == 4
    # renaming a directory onto itself is a no-op
    os.rename(d / "q" / "src", d / "q" / "src")
    assert (d / "q" / "src").is_dir()


def test_renameat2_noreplace_exchange(d: Path) -> None:
    os.mkdir(d / "p1")
    os.mkdir(d / "p2")
    a, b = d / "p1" / "a", d / "p2" / "b"
    a.write_bytes(b"AAA")
    b.write_bytes(b"BB")
    ia, ib = os.stat(a).st_ino, os.stat(b).st_ino
    expect(errno.EEXIST, renameat2, a, b, RENAME_NOREPLACE)
    assert a.read_bytes() == b"AAA" and b.read_bytes() == b"BB"
    renameat2(a, d / "p2" / "new", RENAME_NOREPLACE)
    assert not a.exists() and (d / "p2" / "new").read_bytes() == b"AAA"
    renameat2(d / "p2" / "new", a, 0)
    # exchange two files in different directories
    renameat2(a, b, RENAME_EXCHANGE)
    assert (a.read_bytes(), b.read_bytes()) == (b"BB", b"AAA")
    assert (os.stat(a).st_ino, os.stat(b).st_ino) == (ib, ia)
    expect(errno.ENOENT, renameat2, a, d / "p2" / "missing", RENAME_EXCHANGE)
    assert a.read_bytes() == b"BB"
    expect(errno.EINVAL, renameat2, a, b, RENAME_EXCHANGE | RENAME_NOREPLACE)
    # exchange a file and a directory in different parents: parents' nlink follow
    os.mkdir(d / "p2" / "dir")
    (d / "p2" / "dir" / "inside").write_bytes(b"I")
    assert (os.stat(d / "p1").st_nlink, os.stat(d / "p2").st_nlink) == (2, 3)
    renameat2(a, d / "p2" / "dir", RENAME_EXCHANGE)
    assert os.listdir(a) == ["inside"] and (d / "p2" / "dir").read_bytes() == b"BB"
    assert (os.stat(d / "p1").st_nlink, os.stat(d / "p2").st_nlink) == (3, 2)
    assert os.stat(a / "..").st_ino == os.stat(d / "p1").st_ino
    assert dot_inos(a)[".."] == os.stat(d / "p1").st_ino
    # two directories in different parents: both parents keep their counts
    os.mkdir(d / "p2" / "other")
    renameat2(a, d / "p2" / "other", RENAME_EXCHANGE)
    assert (os.stat(d / "p1").st_nlink, os.stat(d / "p2").st_nlink) == (3, 3)
    assert os.listdir(d / "p2" / "other") == ["inside"] and os.listdir(a) == []
    assert dot_inos(a)[".."] == os.stat(d / "p1").st_ino
    assert dot_inos(d / "p2" / "other")[".."] == os.stat(d / "p2").st_ino
    renameat2(a, d / "p2" / "other", RENAME_EXCHANGE)
    os.rmdir(d / "p2" / "other")
    # exchanging a directory with its own descendant is refused
    os.mkdir(a / "child")
    expect(errno.EINVAL, renameat2, a, a / "child", RENAME_EXCHANGE)
    assert (a / "child").is_dir() and (a / "inside").read_bytes() == b"I"
    # a directory can be removed after moving (its nlink is consistent)
    os.rmdir(a / "child")
    os.unlink(a / "inside")
    os.rmdir(a)
    assert os.stat(d / "p1").st_nlink == 2


# -- links, symlinks, special files -----------------------------------------------------------


def test_hard_links(d: Path) -> None:
    f = d / "f"
    f.write_bytes(b"one")
    os.mkdir(d / "sub")
    os.link(f, d / "sub" / "g")
    assert os.stat(d / "sub" / "g").st_ino == os.stat(f).st_ino
    assert os.stat(f).st_nlink == 2
    with open(d / "sub" / "g", "ab") as fh:
        fh.write(b"two")
    assert f.read_bytes() == b"onetwo"
    expect(errno.EEXIST, os.link, f, d / "sub" / "g")
    expect(errno.EPERM, os.link, d / "sub", d / "dirlink")
    expect(errno.ENOENT, os.link, d / "missing", d / "x")
    os.unlink(f)
    assert (d / "sub" / "g").read_bytes() == b"onetwo"
    assert os.stat(d / "sub" / "g").st_nlink == 1


def test_symlinks(fs: Mounted, d: Path) -> None:
    (d / "target").write_bytes(b"T")
    os.symlink("target", d / "rel")
    os.symlink(d / "target", d / "abs")
    os.symlink("rel", d / "chain")
    os.symlink("nowhere", d / "dangling")
    assert os.readlink(d / "rel") == "target"
    assert os.readlink(d / "abs") == str(d / "target")
    st = os.lstat(d / "rel")
    assert stat.S_ISLNK(st.st_mode) and st.st_size == len("target")
    assert (d / "chain").read_bytes() == b"T"
    assert os.path.realpath(d / "chain") == str(d / "target")
    assert os.path.lexists(d / "dangling") and not os.path.exists(d / "dangling")
    assert os.path.realpath(d / "dangling") == str(d / "nowhere")
    expect(errno.ENOENT, os.stat, d / "dangling")
    # creating through a dangling symlink creates its target
    (d / "dangling").write_bytes(b"now")
    assert (d / "nowhere").read_bytes() == b"now"
    os.symlink("loop2", d / "loop1")
    os.symlink("loop1", d / "loop2")
    expect(errno.ELOOP, os.stat, d / "loop1")
    expect(errno.EEXIST, os.symlink, "x", d / "rel")
    expect(errno.EINVAL, os.readlink, d / "target")
    long_target = "x/" * 2000
    os.symlink(long_target, d / "long")
    assert os.readlink(d / "long") == long_target
    os.mkdir(d / "dir")
    os.symlink("dir", d / "dirlink")
    (d / "dirlink" / "f").touch()
    assert os.listdir(d / "dir") == ["f"]
    os.unlink(d / "dirlink")  # removes the link, not the directory
    assert (d / "dir" / "f").exists()


def test_fifo(d: Path) -> None:
    fifo = d / "fifo"
    os.mkfifo(fifo, 0o600)
    st = os.stat(fifo)
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    payload = bytes(range(256)) * 64
    rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; f = open(sys.argv[1], 'wb'); f.write(bytes(range(256)) * 64); f.close()",
         str(fifo)]
    )
    got = bytearray()
    deadline = time.monotonic() + 20
    try:
        while len(got) < len(payload) and time.monotonic() < deadline:
            select.select([rfd], [], [], 0.5)
            try:
                got += os.read(rfd, 65536)
            except BlockingIOError:
                pass
    finally:
        os.close(rfd)
        assert writer.wait(timeout=20) == 0
    assert bytes(got) == payload
    assert os.stat(fifo).st_size == 0


def test_mknod_device_and_socket(d: Path) -> None:
    os.mknod(d / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    st = os.stat(d / "null")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert st.st_size == 0 and os.listdir(d) == ["null"]
    # a unix socket bound in memfs is an S_IFSOCK inode that still connects
    with socket.socket(socket.AF_UNIX) as srv, socket.socket(socket.AF_UNIX) as cli:
        srv.bind(str(d / "sock"))
        srv.listen()
        assert stat.S_ISSOCK(os.stat(d / "sock").st_mode)
        cli.connect(str(d / "sock"))
        conn, _ = srv.accept()
        with conn:
            cli.sendall(b"ping")
            assert conn.recv(4) == b"ping"


# -- readdir ----------------------------------------------------------------------------------


def test_readdir_sizes(d: Path) -> None:
    os.mkdir(d / "zero")
    assert os.listdir(d / "zero") == []
    os.mkdir(d / "one")
    (d / "one" / "only").touch()
    assert os.listdir(d / "one") == ["only"]
    many = d / "many"
    os.mkdir(many)
    names = {f"file-{i:05d}-{'x' * (i % 40)}" for i in range(5000)}
    for n in names:
        os.mknod(many / n)
    listing = os.listdir(many)
    assert len(listing) == 5000 and set(listing) == names
    by_scandir = {e.name: (e.inode(), e.is_file()) for e in os.scandir(many)}
    assert len(by_scandir) == 5000
    sample = sorted(names)[::500]
    assert all(by_scandir[n] == (os.stat(many / n).st_ino, True) for n in sample)
    out = subprocess.run(["ls", "-a", many], capture_output=True, text=True, check=True).stdout
    assert sorted(out.split()) == sorted([".", "..", *names])  # dot entries exactly once
    os.mkdir(d / "kinds")
    (d / "kinds" / "f").touch()
    os.mkdir(d / "kinds" / "sub")
    os.symlink("f", d / "kinds" / "l")
    os.mkfifo(d / "kinds" / "p")
    kinds = {
        e.name: (e.is_file(follow_symlinks=False), e.is_dir(follow_symlinks=False), e.is_symlink())
        for e in os.scandir(d / "kinds")
    }
    assert kinds == {
        "f": (True, False, False), "sub": (False, True, False),
        "l": (False, False, True), "p": (False, False, False),
    }
    for n in names:
        os.unlink(many / n)
    assert os.listdir(many) == []


CHURN = r"""
import os, sys, time
d, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
i = 0
while time.monotonic() < deadline:
    for k in range(20):
        open(os.path.join(d, f"tmp{i}_{k}"), "wb").close()
    for k in range(20):
        os.unlink(os.path.join(d, f"tmp{i}_{k}"))
    os.rename(os.path.join(d, "flip"), os.path.join(d, "flop"))
    os.rename(os.path.join(d, "flop"), os.path.join(d, "flip"))
    i += 1
"""


def test_readdir_stable_under_churn(d: Path) -> None:
    """Names that exist for the whole listing appear exactly once, whatever else changes."""
    stable = {f"stable-{i:04d}-{'s' * 30}" for i in range(400)}
    for n in stable:
        os.mknod(d / n)
    os.mknod(d / "flip")
    churn = subprocess.Popen([sys.executable, "-c", CHURN, str(d), "30"])
    try:
        time.sleep(0.2)
        for _ in range(60):
            listing = os.listdir(d)
            assert len(listing) == len(set(listing)), "a name was listed twice"
            missing = stable - set(listing)
            assert not missing, f"{len(missing)} stable names missing"
            extra = set(listing) - stable - {"flip", "flop"}
            assert all(n.startswith("tmp") for n in extra), extra
        assert churn.poll() is None, "the churning process stopped early"
    finally:
        churn.terminate()
        churn.wait(timeout=10)


def test_dot_entries(fs: Mounted, d: Path) -> None:
    """readdir returns "." and ".." with the right inode numbers, also at the mount root."""
    os.mkdir(d / "sub")
    out = subprocess.run(["ls", "-a1", d / "sub"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [".", ".."]
    assert dot_inos(d / "sub") == {".": os.stat(d / "sub").st_ino, "..": os.stat(d).st_ino}
    out = subprocess.run(["ls", "-a1", fs.path], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines().count(".") == 1 and out.stdout.splitlines().count("..") == 1


def test_removed_directory_still_open(fs: Mounted, d: Path) -> None:
    """Like an unlinked open file, a removed directory lives while a handle is open."""
    os.mkdir(d / "gone")
    files = os.statvfs(fs.path).f_ffree
    fd = os.open(d / "gone", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rmdir(d / "gone")
        assert not (d / "gone").exists()
        st = os.fstat(fd)
        assert stat.S_ISDIR(st.st_mode) and st.st_nlink == 0
        assert os.listdir(fd) == []
        expect(errno.ENOENT, os.open, "new", os.O_CREAT | os.O_WRONLY, dir_fd=fd)
        expect(errno.ENOENT, os.mkdir, "new", dir_fd=fd)
    finally:
        os.close(fd)
    # the inode went with the last handle
    assert wait_for(lambda: os.statvfs(fs.path).f_ffree, files + 1)


def test_rewinddir_sees_new_entries(d: Path) -> None:
    """A fresh listing (new opendir) reflects creations and removals at once."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert os.listdir(fd) == []
        (d / "a").touch()
        assert os.listdir(fd) == ["a"]  # listdir(fd) rewinds
        os.unlink(d / "a")
        (d / "b").touch()
        assert os.listdir(fd) == ["b"]
    finally:
        os.close(fd)


# -- statfs, access ----------------------------------------------------------------------------


def test_statfs(fs: Mounted, d: Path) -> None:
    st = os.statvfs(fs.path)
    assert st.f_blocks * st.f_frsize == SIZE
    assert st.f_namemax == 255 and st.f_bavail == st.f_bfree <= st.f_blocks
    assert st.f_ffree < st.f_files
    start = st.f_bfree
    write_file(d / "f", os.urandom(8 << 20))
    after = os.statvfs(fs.path)
    assert start - after.f_bfree == (8 << 20) // after.f_frsize
    assert after.f_ffree == st.f_ffree - 1
    os.unlink(d / "f")
    assert wait_bfree(fs.path, start) == start
    assert os.statvfs(d).f_blocks == st.f_blocks  # any path of the mount
    df = subprocess.run(["df", "-B1", "--output=size", fs.path], capture_output=True, text=True)
    assert df.returncode == 0 and int(df.stdout.split()[-1]) == SIZE


def test_statfs_other_geometry(memfs_mount: Callable[..., Mounted]) -> None:
    m = memfs_mount("--size", "64M", "--volumes", "2", "--chunk-size", "128K")
    st = os.statvfs(m.path)
    assert st.f_blocks * st.f_frsize == 64 << 20 and st.f_bfree == st.f_blocks
    write_file(m / "f", b"x")
    assert st.f_bfree - bfree(m.path) == (128 << 10) // st.f_frsize
    assert os.stat(m / "f").st_blocks == (128 << 10) // 512


def test_access(d: Path) -> None:
    f = d / "f"
    f.touch()
    os.chmod(f, 0o644)
    assert os.access(f, os.R_OK | os.W_OK) and not os.access(f, os.X_OK)
    os.chmod(f, 0o744)
    assert os.access(f, os.X_OK)
    os.chmod(f, 0o000)
    assert os.access(f, os.R_OK | os.W_OK)  # root reads and writes anything
    assert not os.access(d / "missing", os.F_OK) and os.access(d, os.X_OK)
    os.chmod(f, 0o604)
    os.chmod(d, 0o755)
    name = f.name

    def access_is(mode: int, want: bool) -> Callable[[], None]:
        def fn() -> None:
            if os.access(name, mode) != want:
                raise OSError(errno.EPROTO, f"access({mode}) is not {want}")

        return fn

    assert as_nobody(access_is(os.R_OK, True), d) == 0
    assert as_nobody(access_is(os.W_OK, False), d) == 0
    assert as_nobody(access_is(os.X_OK, False), d) == 0
    assert as_nobody(lambda: os.open(name, os.O_RDONLY), d) == 0
    assert as_nobody(lambda: os.open(name, os.O_WRONLY), d) == errno.EACCES


# -- extended attributes ------------------------------------------------------------------------


def test_xattrs(d: Path) -> None:
    f = d / "f"
    f.touch()
    os.mkdir(d / "sub")
    for p in (f, d / "sub"):
        assert os.listxattr(p) == []
        os.setxattr(p, "user.a", b"1")
        os.setxattr(p, "user.b", b"\x00binary\xff" * 100)
        assert os.getxattr(p, "user.a") == b"1"
        assert os.getxattr(p, "user.b") == b"\x00binary\xff" * 100
        assert sorted(os.listxattr(p)) == ["user.a", "user.b"]
        os.setxattr(p, "user.a", b"22")
        assert os.getxattr(p, "user.a") == b"22"
        os.setxattr(p, "user.empty", b"")
        assert os.getxattr(p, "user.empty") == b""
        expect(errno.EEXIST, os.setxattr, p, "user.a", b"3", os.XATTR_CREATE)
        expect(errno.ENODATA, os.setxattr, p, "user.new", b"3", os.XATTR_REPLACE)
        os.setxattr(p, "user.a", b"4", os.XATTR_REPLACE)
        assert os.getxattr(p, "user.a") == b"4"
        os.removexattr(p, "user.a")
        expect(errno.ENODATA, os.getxattr, p, "user.a")
        expect(errno.ENODATA, os.removexattr, p, "user.a")
        assert sorted(os.listxattr(p)) == ["user.b", "user.empty"]
        expect(errno.EOPNOTSUPP, os.setxattr, p, "system.memfs_test", b"x")
        expect(errno.EOPNOTSUPP, os.setxattr, p, "bogus.name", b"x")
        expect(errno.ERANGE, os.setxattr, p, "user." + "n" * 251, b"x")
    os.setxattr(f, "trusted.t", b"root only")
    assert os.getxattr(f, "trusted.t") == b"root only"
    # getfattr-style size probe and a too-small buffer
    size = _libc.getxattr(os.fsencode(f), b"user.b", None, 0)
    assert size == len(b"\x00binary\xff" * 100)
    buf = ctypes.create_string_buffer(10)
    assert _libc.getxattr(os.fsencode(f), b"user.b", buf, 10) == -1
    assert ctypes.get_errno() == errno.ERANGE
    # xattrs follow the inode: through a hard link, across renames, gone with it
    os.link(f, d / "g")
    assert os.getxattr(d / "g", "user.b") == os.getxattr(f, "user.b")
    os.rename(f, d / "h")
    assert os.getxattr(d / "h", "user.empty") == b""
    os.symlink("h", d / "l")
    assert os.getxattr(d / "l", "user.empty") == b""  # follows the link
    expect(errno.ENODATA, os.getxattr, d / "l", "user.empty", follow_symlinks=False)


def test_layout_xattr(fs: Mounted, d: Path) -> None:
    if unit(fs) != CHUNK:
        pytest.skip("-o passthrough: files live in backing files, not striped over volumes")
    f = d / "f"
    f.touch()
    layout = os.getxattr(f, "user.memfs.layout").decode()
    assert "stripe_count=4" in layout.split() and "stripe_size=1M" in layout.split()
    expect(errno.ENODATA, os.getxattr, d, "user.memfs.layout")
    os.mkdir(d / "narrow")
    os.setxattr(d / "narrow", "user.memfs.layout", b"stripe_count=1")
    assert os.getxattr(d / "narrow", "user.memfs.layout") == b"stripe_count=1"
    (d / "narrow" / "g").write_bytes(os.urandom(3 * STRIPE))
    assert "stripe_count=1" in os.getxattr(d / "narrow" / "g", "user.memfs.layout").decode().split()
    os.mkdir(d / "narrow" / "sub")  # new subdirectories inherit the spec
    (d / "narrow" / "sub" / "h").touch()
    assert "stripe_count=1" in os.getxattr(d / "narrow" / "sub" / "h", "user.memfs.layout").decode()
    # an empty file can still change layout; one with data cannot
    os.setxattr(f, "user.memfs.layout", b"stripe_count=2 stripe_size=2M")
    fields = os.getxattr(f, "user.memfs.layout").decode().split()
    assert "stripe_count=2" in fields and "stripe_size=2M" in fields
    data = os.urandom(5 * STRIPE + 3)
    f.write_bytes(data)
    assert read_uncached(f) == data
    expect(errno.EBUSY, os.setxattr, f, "user.memfs.layout", b"stripe_count=1")
    assert "stripe_count=2" in os.getxattr(f, "user.memfs.layout").decode().split()
    (d / "sized").write_bytes(b"")
    os.truncate(d / "sized", 100)  # a size counts as data even when sparse
    expect(errno.EBUSY, os.setxattr, d / "sized", "user.memfs.layout", b"stripe_count=1")
    for garbage in (b"garbage", b"stripe_count=zero", b"stripe_count=0", b"stripe_count=99",
                    b"stripe_size=1000", b"", b"stripe_offset=4"):
        expect(errno.EINVAL, os.setxattr, d / "narrow", "user.memfs.layout", garbage)
    assert os.getxattr(d / "narrow", "user.memfs.layout") == b"stripe_count=1"
    os.removexattr(d / "narrow", "user.memfs.layout")
    expect(errno.ENODATA, os.getxattr, d / "narrow", "user.memfs.layout")
    (d / "narrow" / "wide").touch()
    assert "stripe_count=4" in os.getxattr(d / "narrow" / "wide", "user.memfs.layout").decode()


# -- names ---------------------------------------------------------------------------------------


def test_name_too_long(d: Path) -> None:
    ok, bad = "n" * 255, "n" * 256
    (d / "f").touch()
    expect(errno.ENAMETOOLONG, os.open, d / bad, os.O_CREAT | os.O_WRONLY)
    expect(errno.ENAMETOOLONG, os.mkdir, d / bad)
    expect(errno.ENAMETOOLONG, os.stat, d / bad)
    expect(errno.ENAMETOOLONG, os.rename, d / "f", d / bad)
    expect(errno.ENAMETOOLONG, os.link, d / "f", d / bad)
    expect(errno.ENAMETOOLONG, os.symlink, "f", d / bad)
    expect(errno.ENAMETOOLONG, os.mknod, d / bad)
    expect(errno.ENAMETOOLONG, os.mkfifo, d / bad)
    assert os.listdir(d) == ["f"]
    os.rename(d / "f", d / ok)
    os.mkdir(d / ("d" * 255))
    (d / ("d" * 255) / ok).write_bytes(b"long")
    assert sorted(os.listdir(d)) == sorted([ok, "d" * 255])
    assert (d / ("d" * 255) / ok).read_bytes() == b"long"
    utf8 = "é" * 127 + "x"  # 255 bytes
    (d / utf8).touch()
    expect(errno.ENAMETOOLONG, os.mknod, d / ("é" * 128))
    assert utf8 in os.listdir(d)


# -- permissions as another user -------------------------------------------------------------------


def test_permissions_as_nobody(fs: Mounted, d: Path) -> None:
    os.chmod(d, 0o755)
    (d / "ro").write_bytes(b"root's")
    os.chmod(d / "ro", 0o644)
    (d / "secret").write_bytes(b"hidden")
    os.chmod(d / "secret", 0o600)
    os.mkdir(d / "rootdir", 0o755)
    os.mkdir(d / "mine", 0o755)
    os.chown(d / "mine", NOBODY, NOBODY)

    assert as_nobody(lambda: os.open("ro", os.O_WRONLY), d) == errno.EACCES
    assert as_nobody(lambda: os.truncate("ro", 0), d) == errno.EACCES
    assert as_nobody(lambda: os.open("secret", os.O_RDONLY), d) == errno.EACCES
    assert as_nobody(lambda: os.open("rootdir/new", os.O_CREAT | os.O_WRONLY), d) == errno.EACCES
    assert as_nobody(lambda: os.mkdir("rootdir/new"), d) == errno.EACCES
    assert as_nobody(lambda: os.unlink("ro"), d) == errno.EACCES
    assert as_nobody(lambda: os.rename("ro", "mine/ro"), d) == errno.EACCES
    assert as_nobody(lambda: os.chmod("ro", 0o666), d) == errno.EPERM
    assert as_nobody(lambda: os.chown("mine", 0, 0), d) == errno.EPERM
    assert as_nobody(lambda: os.utime("ro", ns=(1, 1)), d) == errno.EPERM
    assert as_nobody(lambda: os.setxattr("ro", "user.x", b"1"), d) == errno.EACCES
    assert (d / "ro").read_bytes() == b"root's" and os.listdir(d / "rootdir") == []

    def work_in_own_dir() -> None:
        with open("mine/f", "wb") as f:
            f.write(b"by nobody")
        os.mkdir("mine/sub")
        os.rename("mine/f", "mine/sub/g")
        os.chmod("mine/sub/g", 0o600)
        os.setxattr("mine/sub/g", "user.x", b"1")
        os.symlink("g", "mine/sub/l")
        os.link("mine/sub/g", "mine/h")
        assert open("mine/sub/l", "rb").read() == b"by nobody"
        os.unlink("mine/h")

    assert as_nobody(work_in_own_dir, d) == 0
    st = os.stat(d / "mine" / "sub" / "g")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o600)
    assert os.stat(d / "mine" / "sub").st_uid == NOBODY
    assert (d / "mine" / "sub" / "g").read_bytes() == b"by nobody"
    # the group of a setgid directory is inherited
    os.chmod(d / "mine", 0o2775)
    os.chown(d / "mine", NOBODY, 4242)
    assert as_nobody(lambda: open("mine/grp", "wb").close(), d) == 0
    assert os.stat(d / "mine" / "grp").st_gid == 4242
    # a chown by root clears set-user-ID
    (d / "suid").touch()
    os.chmod(d / "suid", 0o4755)
    os.chown(d / "suid", NOBODY, NOBODY)
    assert stat.S_IMODE(os.stat(d / "suid").st_mode) & stat.S_ISUID == 0


def test_sticky_directories(fs: Mounted, d: Path) -> None:
    # the mount root is 1777, like /tmp
    root_file = fs.path / f"{d.name}-rootfile"
    root_file.write_bytes(b"root's")
    try:
        assert as_nobody(lambda: os.unlink(root_file.name), fs.path) == errno.EPERM
        assert as_nobody(lambda: os.rename(root_file.name, "stolen"), fs.path) == errno.EPERM
        assert root_file.read_bytes() == b"root's"
    finally:
        root_file.unlink()
    os.chmod(d, 0o1777)
    (d / "other").touch()
    os.chown(d / "other", 1000, 1000)  # another user's file
    os.chmod(d / "other", 0o666)
    assert as_nobody(lambda: os.unlink("other"), d) == errno.EPERM
    assert as_nobody(lambda: os.open("other", os.O_WRONLY | os.O_TRUNC), d) == 0  # 0666: writable
    assert as_nobody(lambda: open("own", "wb").close(), d) == 0
    assert as_nobody(lambda: os.rename("own", "own2"), d) == 0
    assert as_nobody(lambda: os.unlink("own2"), d) == 0
    assert sorted(os.listdir(d)) == ["other"]
    os.chmod(d, 0o777)  # without the sticky bit anyone with write access may delete
    assert as_nobody(lambda: os.unlink("other"), d) == 0


# -- locks ----------------------------------------------------------------------------------------


def test_flock_between_processes(d: Path) -> None:
    f = d / "lock"
    f.touch()
    name = f.name

    def try_flock(op: int) -> Callable[[], None]:
        def fn() -> None:
            fd = os.open(name, os.O_RDWR)
            fcntl.flock(fd, op | fcntl.LOCK_NB)

        return fn

    fd = os.open(f, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert in_child(try_flock(fcntl.LOCK_EX), cwd=d) == errno.EWOULDBLOCK
        assert in_child(try_flock(fcntl.LOCK_SH), cwd=d) == errno.EWOULDBLOCK
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert in_child(try_flock(fcntl.LOCK_SH), cwd=d) == 0
        assert in_child(try_flock(fcntl.LOCK_EX), cwd=d) == errno.EWOULDBLOCK
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert in_child(try_flock(fcntl.LOCK_EX), cwd=d) == 0
    finally:
        os.close(fd)


def test_posix_locks_between_processes(d: Path) -> None:
    f = d / "lock"
    f.write_bytes(bytes(100))
    name = f.name

    def try_lockf(op: int, length: int, start: int) -> Callable[[], None]:
        def fn() -> None:
            fd = os.open(name, os.O_RDWR)
            fcntl.lockf(fd, op | fcntl.LOCK_NB, length, start)

        return fn

    fd = os.open(f, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 0)  # bytes 0..9
        assert in_child(try_lockf(fcntl.LOCK_EX, 1, 5), cwd=d) in (errno.EAGAIN, errno.EACCES)
        assert in_child(try_lockf(fcntl.LOCK_SH, 0, 0), cwd=d) in (errno.EAGAIN, errno.EACCES)
        assert in_child(try_lockf(fcntl.LOCK_EX, 10, 20), cwd=d) == 0  # a disjoint range
        fcntl.lockf(fd, fcntl.LOCK_UN, 10, 0)
        assert in_child(try_lockf(fcntl.LOCK_EX, 0, 0), cwd=d) == 0
        # F_GETLK reports the holder
        fcntl.lockf(fd, fcntl.LOCK_EX, 0, 0)

        def getlk() -> None:
            import struct

            fd2 = os.open(name, os.O_RDWR)
            lk = struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)
            ltype, _, _, _, pid = struct.unpack("hhqqi", fcntl.fcntl(fd2, fcntl.F_GETLK, lk))
            os._exit(0 if ltype == fcntl.F_WRLCK and pid == os.getppid() else 1)

        assert in_child(getlk, cwd=d) == 0
    finally:
        os.close(fd)


# -- several processes at once ----------------------------------------------------------------------


WORKER = r"""
import errno, os, sys
root, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
priv, shared = os.path.join(root, f"p{me}"), os.path.join(root, "shared")
os.mkdir(priv)
won = []
for j in range(n):
    a, b = os.path.join(priv, f"a{j}"), os.path.join(priv, f"b{j}")
    with open(a, "wb") as f:
        f.write(f"{me}:{j};".encode() * (j % 50 + 1))
    os.rename(a, b)
    if j % 3 == 0:
        os.unlink(b)
    elif j % 3 == 1:
        os.rename(b, os.path.join(shared, f"s{me}_{j}"))
    sub = os.path.join(shared, f"d{me}_{j}")
    os.mkdir(sub)
    if j % 5:
        os.rmdir(sub)
    try:
        fd = os.open(os.path.join(shared, f"claim{j}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        pass
    else:
        os.write(fd, str(me).encode())
        os.close(fd)
        won.append(j)
    hot = os.path.join(priv, "hot")
    with open(hot, "wb") as f:
        f.write(str(me).encode() * 1000)
    os.rename(hot, os.path.join(shared, "hot"))
print(" ".join(map(str, won)))
"""


def test_concurrent_processes(fs: Mounted, d: Path) -> None:
    n, procs_n = 500, 4
    start = bfree(fs.path)
    files_start = os.statvfs(fs.path).f_ffree
    os.mkdir(d / "shared")
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(d), str(me), str(n)],
                         stdout=subprocess.PIPE, text=True)
        for me in range(procs_n)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * procs_n
    won = [{int(j) for j in out.split()} for out in outs]
    # every O_EXCL claim was won exactly once, and the file names the winner
    assert sum(len(w) for w in won) == n and set().union(*won) == set(range(n))
    for me, w in enumerate(won):
        for j in list(w)[:50]:
            assert (d / "shared" / f"claim{j}").read_bytes() == str(me).encode()
    for me in range(procs_n):
        want = {f"b{j}" for j in range(n) if j % 3 == 2}
        assert set(os.listdir(d / f"p{me}")) == want
        for j in (2, 5, n - 1 if (n - 1) % 3 == 2 else 2):
            assert (d / f"p{me}" / f"b{j}").read_bytes() == f"{me}:{j};".encode() * (j % 50 + 1)
    want_shared = {"hot"} | {f"claim{j}" for j in range(n)}
    want_shared |= {f"s{me}_{j}" for me in range(procs_n) for j in range(n) if j % 3 == 1}
    want_shared |= {f"d{me}_{j}" for me in range(procs_n) for j in range(n) if j % 5 == 0}
    listing = os.listdir(d / "shared")
    assert len(listing) == len(want_shared) and set(listing) == want_shared
    hot = (d / "shared" / "hot").read_bytes()
    assert len(hot) == 1000 and len(set(hot)) == 1
    ndirs = sum(1 for j in range(n) if j % 5 == 0) * procs_n
    assert os.stat(d / "shared").st_nlink == 2 + ndirs
    assert os.stat(d).st_nlink == 2 + 1 + procs_n
    for me in range(procs_n):
        j = 4
        assert (d / "shared" / f"s{me}_{j}").read_bytes() == f"{me}:{j};".encode() * (j % 50 + 1)
    shutil.rmtree(d / "shared")
    for me in range(procs_n):
        shutil.rmtree(d / f"p{me}")
    assert wait_bfree(fs.path, start) == start
    assert wait_for(lambda: os.statvfs(fs.path).f_ffree, files_start)


def test_write_truncate_chown_drop_privileges(d: Path) -> None:
    """Set-ID bits and file capabilities go as Linux takes them away (memfs does it
    itself under FUSE_HANDLE_KILLPRIV_V2), and ``stat`` shows it at once."""
    from tests.mount.privileges import check_privileges_dropped

    os.chmod(d, 0o777)
    check_privileges_dropped(d, d)
