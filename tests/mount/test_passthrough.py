"""``-o passthrough`` (memfs.passthrough): the kernel reads and writes files' backing
files itself.  Real mounts; the daemon's request counters (``--metrics``) show which
requests still reach it.  The POSIX suite runs on such a mount too
(tests/mount/test_posix.py, ``[passthrough]``)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Mounted
from tests.mount.test_metrics import free_port, http_get, samples
from tests.mount.test_posix import NOBODY, in_child
from tests.mount.test_space import PUNCH, fallocate

MEMFS = [sys.executable, "-m", "memfs"]
pytestmark = pytest.mark.mount

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
_AT_STATX_FORCE_SYNC = 0x2000  # ask the filesystem, not the kernel's cached attributes
_STATX_BASIC_STATS = 0x7FF
_UTIME_OMIT = (1 << 30) - 2


def statx_times(path: Path) -> tuple[int, int, int]:
    """(atime, mtime, ctime) in ns as the daemon says now (embedded mounts let the
    kernel cache attributes for a day: os.stat would show the kernel's copy)."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statx(_AT_FDCWD, os.fsencode(path), _AT_STATX_FORCE_SYNC, _STATX_BASIC_STATS, buf):
        raise OSError(ctypes.get_errno(), "statx")

    def ts(off: int) -> int:
        sec, nsec = struct.unpack_from("<qI", buf.raw, off)
        return sec * 10**9 + nsec

    return ts(64), ts(112), ts(96)  # stx_atime, stx_mtime, stx_ctime


def utimens(path: Path, atime_ns: int | None, mtime_ns: int | None) -> None:
    """utimensat(2) that may leave one of the two alone (UTIME_OMIT)."""
    def spec(ns: int | None) -> tuple[int, int]:
        return (0, _UTIME_OMIT) if ns is None else divmod(ns, 10**9)

    times = (ctypes.c_long * 4)(*spec(atime_ns), *spec(mtime_ns))
    if _libc.utimensat(_AT_FDCWD, os.fsencode(path), times, 0):
        raise OSError(ctypes.get_errno(), "utimensat")


def requests(port: int, op: str) -> float:
    got = samples(http_get(f"http://127.0.0.1:{port}/metrics"))
    return got.get(("memfs_requests_total", (("op", op),)), 0.0)


def test_reads_and_writes_do_not_reach_the_daemon(memfs_mount: Callable[..., Mounted]) -> None:
    port = free_port()
    m = memfs_mount("--size", "64M", "-o", "passthrough", "--metrics", f"127.0.0.1:{port}")
    data = os.urandom(64 * 16384)
    f = m / "f"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        for i in range(64):  # 16 KiB at a time, backwards: no request may merge them
            off = (63 - i) * 16384
            assert os.pwrite(fd, data[off:off + 16384], off) == 16384
        assert os.fstat(fd).st_size == len(data)
        with mmap.mmap(fd, len(data)) as mm:  # the mapping is the backing file's too
            assert mm[:16384] == data[:16384]
            mm[0:4] = b"MMAP"
    finally:
        os.close(fd)
    fd = os.open(f, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert f.read_bytes() == b"MMAP" + data[4:]
    st = os.stat(f)
    assert st.st_size == len(data) and st.st_blocks * 512 >= len(data)
    assert requests(port, "create") >= 1
    assert requests(port, "write") == 0 and requests(port, "read") == 0
    vfs = os.statvfs(m.path)
    assert vfs.f_blocks * vfs.f_frsize == 64 << 20
    assert (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize >= len(data)

    # An unprivileged writer of a set-user-ID file: its writes come to the daemon,
    # which takes the bit away (the kernel leaves that to memfs, KILLPRIV_V2).
    s = m / "s"
    s.write_bytes(b"x")
    os.chown(s, NOBODY, NOBODY)
    os.chmod(s, 0o4755)

    def append() -> None:
        with open("s", "ab") as out:
            out.write(b"by nobody")

    assert in_child(append, cwd=m.path, uid=NOBODY) == 0
    assert requests(port, "write") >= 1
    assert stat.S_IMODE(os.stat(s).st_mode) == 0o755
    assert s.read_bytes() == b"xby nobody"


def test_a_full_pool_is_enospc_at_write(memfs_mount: Callable[..., Mounted]) -> None:
    m = memfs_mount("--size", "16M", "-o", "passthrough")
    start = os.statvfs(m.path).f_bfree
    keep = os.urandom(1 << 20)
    (m / "keep").write_bytes(keep)
    fd = os.open(m / "fill", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        with pytest.raises(OSError) as full:
            for _ in range(32):
                os.write(fd, b"z" * (1 << 20))
        assert full.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert (m / "keep").read_bytes() == keep
    os.unlink(m / "fill")
    os.unlink(m / "keep")
    assert os.statvfs(m.path).f_bfree == start


def test_a_punched_hole_frees_space(memfs_mount: Callable[..., Mounted]) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE) reaches the backing file: zeros, the size
    kept, its blocks back in df, mtime moved; lseek finds the hole there."""
    m = memfs_mount("--size", "16M", "-o", "passthrough")
    start = os.statvfs(m.path).f_bfree
    data = os.urandom(4 << 20)
    (m / "f").write_bytes(data)
    fd = os.open(m / "f", os.O_RDWR)
    try:
        os.utime(fd, ns=(1, 1))
        fallocate(fd, PUNCH, 4096 + 1, 2 << 20)
        st = os.fstat(fd)
        assert st.st_size == len(data) and st.st_mtime_ns > 1
        assert os.lseek(fd, 0, os.SEEK_HOLE) == 8192  # tmpfs's pages: SEEK_HOLE goes there
        assert os.lseek(fd, 8192, os.SEEK_DATA) == (4097 + (2 << 20)) // 4096 * 4096
    finally:
        os.close(fd)
    want = data[:4097] + bytes(2 << 20) + data[4097 + (2 << 20):]
    assert (m / "f").read_bytes() == want
    assert os.statvfs(m.path).f_bfree > start - (3 << 20) // os.statvfs(m.path).f_frsize
    os.unlink(m / "f")


@pytest.mark.parametrize("args, says", [
    (["--mds", "127.0.0.1:1"], "embedded pool"),
    (["--backing", "BACKING"], "--backing"),
    (["-o", "writeback_cache"], "exclude each other"),
    (["-o", "direct_io"], "exclude each other"),
])
def test_what_passthrough_does_not_go_with(tmp_path: Path, args: list[str], says: str) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (tmp_path / "backing").mkdir()
    args = [str(tmp_path / "backing") if a == "BACKING" else a for a in args]
    r = subprocess.run([*MEMFS, "mount", str(mnt), "-o", "passthrough", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not os.path.ismount(mnt)


def test_arrays_go_through_the_mount(memfs_mount: Callable[..., Mounted]) -> None:
    """memfs.array on such a mount: no direct access (the pool's volumes hold no file's
    bytes), so its calls are the mount's file I/O, which the kernel passes through."""
    import numpy as np

    from memfs import array

    m = memfs_mount("--size", "64M", "-o", "passthrough")
    arr = np.arange(1 << 20, dtype=np.float64).reshape(1024, 1024)
    array.save(m / "a.npy", arr)
    assert np.array_equal(np.load(m / "a.npy"), arr)
    assert np.array_equal(array.load(m / "a.npy"), arr)
    with array.open(m / "a.npy", "r+") as af:
        assert not af.direct
        af[3:5] = -arr[3:5]
    want = arr.copy()
    want[3:5] *= -1
    assert np.array_equal(np.load(m / "a.npy"), want)


def test_without_cap_sys_admin_it_says_so(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin",
                        *MEMFS, "mount", str(mnt), "--size", "16M", "-o", "passthrough",
                        "--log", str(tmp_path / "log")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "CAP_SYS_ADMIN" in r.stderr, r.stderr
    assert not os.path.ismount(mnt)


def test_times_are_the_backing_files_and_move_only_as_asked(memfs_mount: Callable[..., Mounted]) -> None:
    """Writes and reads do not reach the daemon: the times a stat shows are the
    backing file's, set there by utimensat field by field, and a file made by mknod
    has its backing file from birth (its times do not jump at its first open)."""
    m = memfs_mount("--size", "16M", "-o", "passthrough")
    f = m / "f"
    f.write_bytes(b"data")
    time.sleep(0.05)
    with open(f, "ab") as out:
        out.write(b"more")  # the mtime moves without the daemon
    atime, mtime, _ = statx_times(f)
    assert mtime > atime
    utimens(f, 10**18, None)  # touch -a: the mtime stays
    assert statx_times(f)[:2] == (10**18, mtime)
    utimens(f, None, 2 * 10**18)  # touch -m: the atime stays
    assert statx_times(f)[:2] == (10**18, 2 * 10**18)
    assert os.stat(f).st_size == 8

    n = m / "n"
    os.mknod(n, stat.S_IFREG | 0o644)
    born = statx_times(n)
    time.sleep(0.05)
    os.close(os.open(n, os.O_RDONLY))
    assert statx_times(n) == born


def test_the_pool_volumes_cost_no_memory(memfs_mount: Callable[..., Mounted]) -> None:
    """The files' bytes are in the backing tmpfs: the pool's volumes, which hold none,
    are not populated (they would double what the mount takes)."""
    m = memfs_mount("--size", "256M", "-o", "passthrough")
    (m / "f").write_bytes(os.urandom(1 << 20))
    status = Path(f"/proc/{m.pid}/status").read_text()
    shmem_kib = int(next(x for x in status.splitlines() if x.startswith("RssShmem:")).split()[1])
    assert shmem_kib < 32 << 10, status


def test_opens_and_closes_racing_on_one_file_never_fail(memfs_mount: Callable[..., Mounted]) -> None:
    """The kernel wants one backing file per inode while any open exists, and drops
    it before the last RELEASE: threads opening, writing, mapping and closing one
    file (and a second link to it) at once must never see EIO, and the bytes stay
    the writers'."""
    import threading

    m = memfs_mount("--size", "64M", "-o", "passthrough")
    f = m / "f"
    f.write_bytes(bytes(1 << 16))
    os.link(f, m / "g")
    errors: list[BaseException] = []
    stop = time.monotonic() + 3

    def worker(k: int) -> None:
        name = m / ("f" if k % 2 else "g")
        try:
            while time.monotonic() < stop:
                fd = os.open(name, os.O_RDWR)
                try:
                    os.pwrite(fd, bytes([k]) * 4096, k * 4096)
                    with mmap.mmap(fd, 1 << 16) as mm:
                        assert mm[k * 4096:(k + 1) * 4096] == bytes([k]) * 4096
                finally:
                    os.close(fd)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    data = f.read_bytes()
    for k in range(1, 7):
        assert data[k * 4096:(k + 1) * 4096] == bytes([k]) * 4096


def test_a_kernel_that_refuses_backing_files_leaves_the_daemon_serving(tmp_path: Path) -> None:
    """In a user namespace the daemon may mount (and make its tmpfs) but the kernel
    takes backing files only from CAP_SYS_ADMIN in the initial namespace: the first
    open's EPERM turns passthrough off with a warning, and the daemon reads and writes
    the backing files itself."""
    mnt, log = tmp_path / "mnt", tmp_path / "log"
    mnt.mkdir()
    memfs = " ".join(MEMFS)
    script = f"""
set -e
trap '{memfs} umount {mnt} >/dev/null 2>&1 || true' EXIT
{memfs} mount {mnt} --size 16M -o passthrough --log {log}
head -c 100000 /dev/urandom > {tmp_path}/data
cp {tmp_path}/data {mnt}/f
cmp {tmp_path}/data {mnt}/f
echo appended >> {mnt}/f
test "$(stat -c %s {mnt}/f)" = 100009
echo ok
"""
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "unshare" in r.stderr:
        pytest.skip(f"no user namespaces here: {r.stderr.strip()}")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    text = log.read_text()
    assert "passthrough not in effect" in text and "Traceback" not in text, text
