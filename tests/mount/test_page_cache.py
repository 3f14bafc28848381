"""The kernel's page cache on an embedded mount, and what memfs negotiates with the
kernel at INIT (pyfuse3 with memfs's patch: scripts/build-pyfuse3.sh).

Embedded mode is the only writer of its files, so pages this kernel cached stay
valid across its own writes: libfuse's default AUTO_INVAL_DATA (drop a file's
pages whenever its mtime moves) is turned off.  These tests fail when the
negotiation is not in effect, e.g. on a plain PyPI pyfuse3.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyfuse3
import pytest

from memfs import fs
from memfs.fs import MAX_BACKGROUND, Operations
from tests.conftest import Mounted

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_PROT_READ, _MAP_SHARED, _PAGE = 1, 1, os.sysconf("SC_PAGE_SIZE")
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: Path) -> int:
    """How many of *path*'s pages are in the page cache (mincore; touches none)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    assert addr not in (None, _MAP_FAILED), os.strerror(ctypes.get_errno())
    try:
        vec = ctypes.create_string_buffer((size + _PAGE - 1) // _PAGE)
        assert _libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(b & 1 for b in vec.raw)
    finally:
        _libc.munmap(addr, size)


@pytest.mark.mount
def test_own_writes_keep_the_page_cache(memfs_mount: Callable[..., Mounted]) -> None:
    """A write through this kernel, then stat (which fetches the new mtime), leaves the
    file's other cached pages in place; its bytes read back are the new ones."""
    m = memfs_mount("--size", "64M")
    path = m / "f"
    data = bytearray(os.urandom(1 << 20))
    path.write_bytes(data)
    assert path.read_bytes() == data
    pages = len(data) // _PAGE
    assert resident_pages(path) == pages
    for round_ in range(3):
        with open(path, "r+b") as f:
            f.seek(round_ * _PAGE)
            f.write(b"x" * _PAGE)
        data[round_ * _PAGE : (round_ + 1) * _PAGE] = b"x" * _PAGE
        before = os.stat(path).st_mtime_ns
        assert resident_pages(path) == pages, "the write or stat dropped cached pages"
        assert path.read_bytes() == data
        assert os.stat(path).st_mtime_ns == before


@pytest.fixture
def fusectl() -> Iterator[Path]:
    """/sys/fs/fuse/connections, mounted for the test if it was not (and unmounted after)."""
    root = Path("/sys/fs/fuse/connections")
    with open("/proc/self/mounts") as f:
        present = any(line.split()[1:3] == [str(root), "fusectl"] for line in f)
    mounted_here = False
    if not present:
        r = subprocess.run(["mount", "-t", "fusectl", "none", str(root)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount fusectl: {r.stderr.decode().strip()}")
        mounted_here = True
    try:
        yield root
    finally:
        if mounted_here:
            subprocess.run(["umount", str(root)], check=False)


@pytest.mark.mount
def test_max_background_negotiated(memfs_mount: Callable[..., Mounted], fusectl: Path) -> None:
    m = memfs_mount("--size", "16M")
    conn = fusectl / str(os.minor(os.stat(m.path).st_dev))
    assert int((conn / "max_background").read_text()) == MAX_BACKGROUND
    assert int((conn / "congestion_threshold").read_text()) == MAX_BACKGROUND * 3 // 4


@pytest.mark.mount
@pytest.mark.parametrize("workers", ["one", "several"])
def test_queued_requests_taken_without_waiting(
    memfs_mount: Callable[..., Mounted], tmp_path: Path, workers: str
) -> None:
    """pyfuse3 with memfs's patch 0002 reads /dev/fuse non-blocking, so a request the
    kernel already queued is taken without a pass of the event loop: the daemon's FUSE
    descriptor must be O_NONBLOCK (it is not on a pyfuse3 without the patch), and a
    burst of requests from several processes is served right, by one worker (embedded)
    or by several that race for requests (``--backing``: 16)."""
    extra = [] if workers == "one" else ["--backing", str(tmp_path / "backing")]
    if extra:
        (tmp_path / "backing").mkdir()
    m = memfs_mount("--size", "64M", *extra)
    flags = []
    for fd in os.listdir(f"/proc/{m.pid}/fd"):
        try:
            if os.readlink(f"/proc/{m.pid}/fd/{fd}") == "/dev/fuse":
                with open(f"/proc/{m.pid}/fdinfo/{fd}") as f:
                    flags += [int(line.split()[1], 8) for line in f if line.startswith("flags:")]
        except FileNotFoundError:
            continue
    assert flags and all(f & os.O_NONBLOCK for f in flags), flags
    data = [os.urandom(2000 * 4096) for _ in range(3)]
    for i, d in enumerate(data):
        (m / f"src{i}").write_bytes(d)
    writers = [subprocess.Popen(["dd", f"if={m / f'src{i}'}", f"of={m / f'w{i}'}", "bs=4k",
                                 "status=none"]) for i in range(3)]
    for w in writers:
        assert w.wait(120) == 0
    for i, d in enumerate(data):
        assert (m / f"w{i}").read_bytes() == d


def test_request_loop_lingers_and_spins() -> None:
    """With one worker (embedded) pyfuse3 (patch 0002) waits for the next request in
    ppoll, polling without sleeping at first; a cluster client's several workers only
    poll, briefly, since a worker lingering might not see another's reply; on a
    ``--backing`` mount (several workers, write-back threads) they do neither."""
    before = pyfuse3.LINGER, pyfuse3.SPIN, pyfuse3.REPLY_THREADS, pyfuse3.REPLY_MIN
    try:
        fs.tune_request_loop(1, cluster=False)
        assert (pyfuse3.LINGER, pyfuse3.SPIN) == (fs.LINGER, fs.SPIN)
        assert 0 < fs.SPIN < fs.LINGER
        assert (pyfuse3.REPLY_THREADS, pyfuse3.REPLY_MIN) == (fs.REPLY_THREADS, fs.REPLY_MIN)
        fs.tune_request_loop(4, cluster=True)
        assert (pyfuse3.LINGER, pyfuse3.SPIN) == (fs.SPIN, fs.SPIN)
        assert pyfuse3.REPLY_THREADS == fs.REPLY_THREADS > 0
        fs.tune_request_loop(16, cluster=False)
        assert pyfuse3.LINGER == 0.0
        # direct I/O: no folio lock holds a write of the same bytes back meanwhile
        fs.tune_request_loop(1, cluster=False, direct_io=True)
        assert pyfuse3.REPLY_THREADS == 0
    finally:
        pyfuse3.LINGER, pyfuse3.SPIN, pyfuse3.REPLY_THREADS, pyfuse3.REPLY_MIN = before


async def test_replies_written_waits_for_the_mark_then_gives_up(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: Any,
) -> None:
    """Memory read() returned is reused only once every reply submitted before is
    written (pyfuse3.reply_count's mark), or after the patience: False then."""
    seen = iter([(5, 3), (5, 4), (5, 5)])
    monkeypatch.setattr(pyfuse3, "reply_count", lambda: next(seen), raising=False)
    assert await fs.replies_written()
    seen = iter([(5, 3), (7, 4), (7, 5)])  # later replies do not count
    assert fs.replies_written_now()
    monkeypatch.setattr(pyfuse3, "reply_count", lambda: (5, 4), raising=False)
    assert not await fs.replies_written()  # a reply that is never written
    monkeypatch.setattr(fs, "REPLY_PATIENCE_NOW", 0.01)
    assert not fs.replies_written_now()


class FakeConn:
    def __init__(self, kernel_flags: int) -> None:
        self.capable = pyfuse3.FUSE_CAP_POSIX_LOCKS | pyfuse3.FUSE_CAP_FLOCK_LOCKS
        self.want = pyfuse3.FUSE_CAP_AUTO_INVAL_DATA | pyfuse3.FUSE_CAP_ASYNC_READ
        self.max_background = 12
        self.congestion_threshold = 9
        self.kernel_flags = kernel_flags
        self.extra_flags = 0


@pytest.mark.parametrize("pages_follow_changes", [True, False])
@pytest.mark.parametrize("offered", [True, False], ids=["v2-offered", "v2-not-offered"])
def test_init_connection(pages_follow_changes: bool, offered: bool) -> None:
    """Only a sole writer (embedded) gives up AUTO_INVAL_DATA: on a cluster client
    other nodes change files, and the kernel must notice a new mtime.  KILLPRIV_V2
    is asked for whenever the kernel offers it, and only then is it memfs's job."""
    v2 = pyfuse3.FUSE_HANDLE_KILLPRIV_V2
    ops = Operations.__new__(Operations)
    ops.pages_follow_changes, ops.max_background, ops.negotiated = pages_follow_changes, 32, None
    ops.drops_privileges = ops.direct_io = ops.shared_mmap = ops.cluster_locks = False
    ops.want_cluster_locks = True
    ops.meta = SimpleNamespace(locks=lambda: None,  # type: ignore[assignment]
                               sizes_change_elsewhere=lambda: not pages_follow_changes)
    conn = FakeConn(v2 | 1 if offered else 1)
    ops.init_connection(conn)
    assert bool(conn.want & pyfuse3.FUSE_CAP_AUTO_INVAL_DATA) is not pages_follow_changes
    assert conn.want & pyfuse3.FUSE_CAP_ASYNC_READ
    assert (conn.max_background, conn.congestion_threshold) == (32, 24)
    assert conn.extra_flags == (v2 if offered else 0)
    assert ops.drops_privileges is offered
    assert ops.negotiated == {"want": conn.want, "max_background": 32,
                              "extra_flags": conn.extra_flags}


@pytest.mark.parametrize("local", [False, True], ids=["", "localflock"])
@pytest.mark.parametrize("cluster", [True, False])
def test_lock_requests_are_asked_for_where_the_metadata_service_keeps_locks(
        cluster: bool, local: bool) -> None:
    """A cluster client (its Meta keeps locks) asks the kernel for lock requests
    (pyfuse3 patch 0005 clears them by default), unless mounted ``-o localflock``;
    an embedded mount leaves locks to the kernel."""
    caps = pyfuse3.FUSE_CAP_POSIX_LOCKS | pyfuse3.FUSE_CAP_FLOCK_LOCKS
    ops = Operations.__new__(Operations)
    ops.pages_follow_changes, ops.max_background, ops.negotiated = not cluster, 32, None
    ops.drops_privileges = ops.direct_io = ops.shared_mmap = ops.cluster_locks = False
    ops.want_cluster_locks = True
    ops.meta = SimpleNamespace(locks=lambda: object() if cluster else None,  # type: ignore[assignment]
                               sizes_change_elsewhere=lambda: cluster)
    ops.want_cluster_locks = not local
    conn = FakeConn(0)
    ops.init_connection(conn)
    forwarded = cluster and not local
    assert conn.want & caps == (caps if forwarded else 0)
    assert ops.cluster_locks is forwarded


@pytest.mark.parametrize("why", ["direct_io", "cluster", "neither"])
@pytest.mark.parametrize("offered", [True, False])
def test_direct_io_asks_for_shared_mappings(offered: bool, why: str) -> None:
    """With -o direct_io, FUSE_DIRECT_IO_ALLOW_MMAP when the kernel offers it; not
    for a cluster client's O_APPEND opens (direct I/O too): the kernel would write
    a shared mapping's pages back through them, and their writes go to the end."""
    v2 = pyfuse3.FUSE_HANDLE_KILLPRIV_V2
    ops = Operations.__new__(Operations)
    ops.pages_follow_changes, ops.max_background, ops.negotiated = True, 32, None
    ops.drops_privileges, ops.direct_io, ops.shared_mmap = False, why == "direct_io", False
    ops.cluster_locks = False
    ops.meta = SimpleNamespace(locks=lambda: None,  # type: ignore[assignment]
                               sizes_change_elsewhere=lambda: why == "cluster")
    ops.want_cluster_locks = True
    conn = FakeConn(v2 | (fs.FUSE_DIRECT_IO_ALLOW_MMAP if offered else 0))
    ops.init_connection(conn)
    asked = offered and why == "direct_io"
    assert conn.extra_flags == v2 | (fs.FUSE_DIRECT_IO_ALLOW_MMAP if asked else 0)
    assert ops.shared_mmap is asked


@pytest.mark.parametrize("offered", [True, False])
def test_passthrough_is_asked_for_with_backing_files(offered: bool) -> None:
    """With -o passthrough (backing files), FUSE_PASSTHROUGH when the kernel offers it."""
    v2 = pyfuse3.FUSE_HANDLE_KILLPRIV_V2
    ops = Operations.__new__(Operations)
    ops.pages_follow_changes, ops.max_background, ops.negotiated = True, 32, None
    ops.drops_privileges = ops.direct_io = ops.shared_mmap = ops.cluster_locks = False
    ops.meta = SimpleNamespace(locks=lambda: None,  # type: ignore[assignment]
                               sizes_change_elsewhere=lambda: False)
    ops.want_cluster_locks = True
    ops.backing = SimpleNamespace()  # type: ignore[assignment]
    conn = FakeConn(v2 | (fs.FUSE_PASSTHROUGH if offered else 0))
    ops.init_connection(conn)
    assert conn.extra_flags == v2 | (fs.FUSE_PASSTHROUGH if offered else 0)
    assert ops.passthrough_asked is offered


@pytest.mark.mount
def test_direct_io_keeps_file_data_out_of_the_page_cache(memfs_mount: Callable[..., Mounted]) -> None:
    """``-o direct_io``: reads and writes go between the application and the daemon,
    and no page of the file stays in the page cache (the default keeps them all, see
    above); MAP_SHARED mappings still work and stay coherent with read and write."""
    m = memfs_mount("--size", "64M", "-o", "direct_io")
    path = m / "f"
    data = os.urandom(1 << 20)
    path.write_bytes(data)
    assert path.read_bytes() == data
    assert resident_pages(path) == 0, "file data went through the page cache"
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), len(data)) as mm:
        assert mm[:_PAGE] == data[:_PAGE]
        os.pwrite(f.fileno(), b"w" * 10, 100)  # a direct write drops the mapped page
        assert mm[100:110] == b"w" * 10
        mm[200:210] = b"m" * 10
        mm.flush()
        assert os.pread(f.fileno(), 10, 200) == b"m" * 10
    assert path.read_bytes()[:300] == data[:100] + b"w" * 10 + data[110:200] + b"m" * 10 + data[210:300]
    # replies copied by threads after the loop went on would not be atomic against
    # writes here (nothing holds a write of the same bytes back meanwhile)
    assert reply_thread_switches(m.pid) == {}


@pytest.mark.mount
def test_writes_ask_for_no_capability_xattr(memfs_mount: Callable[..., Mounted]) -> None:
    """With FUSE_HANDLE_KILLPRIV_V2 in effect the kernel marks an inode as having no
    privileges to drop (S_NOSEC) after one look, instead of asking for
    ``security.capability`` (a GETXATTR round trip) before every write(2)."""
    from tests.mount.test_metrics import free_port, http_get, samples

    port = free_port()
    m = memfs_mount("--size", "64M", "--metrics", f"127.0.0.1:{port}")

    def getxattrs() -> float:
        got = samples(http_get(f"http://127.0.0.1:{port}/metrics"))
        return got.get(("memfs_requests_total", (("op", "getxattr"),)), 0.0)

    fd = os.open(m / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.pwrite(fd, b"x" * 16384, 0)  # the one look
        before = getxattrs()
        for i in range(1, 65):
            os.pwrite(fd, b"y" * 16384, i * 16384)
    finally:
        os.close(fd)
    assert getxattrs() - before == 0
    assert os.stat(m / "f").st_size == 65 * 16384


@pytest.mark.parametrize("extra", [[], ["--attr-timeout", "1"]], ids=["default", "1s"])
def test_embedded_kernel_keeps_names_and_attributes(
    memfs_mount: Callable[..., Mounted], extra: list[str]
) -> None:
    """Embedded without --backing, the kernel is the only way in: by default it keeps
    names (present and absent) and attributes, and a stat a while later asks the
    daemon nothing.  With a 1 s timeout (the old default) it asks again."""
    from tests.mount.test_metrics import free_port, http_get, samples

    port = free_port()
    m = memfs_mount("--size", "16M", "--metrics", f"127.0.0.1:{port}", *extra)
    (m / "f").write_bytes(b"x" * 1000)
    os.stat(m / "f")  # after its own write the kernel asks once, whatever the timeout
    assert not (m / "absent").exists()
    time.sleep(1.5)

    def asked() -> float:
        got = samples(http_get(f"http://127.0.0.1:{port}/metrics"))
        return sum(got.get(("memfs_requests_total", (("op", op),)), 0.0)
                   for op in ("lookup", "getattr"))

    before = asked()
    assert os.stat(m / "f").st_size == 1000
    assert not (m / "absent").exists()
    after = asked()
    if extra:
        assert after > before  # expired: looked up again
    else:
        assert after == before, "the kernel asked the daemon again"


def reply_thread_switches(pid: int) -> dict[int, int]:
    """pyfuse3's reply threads in *pid* (patch 0006 names them) and how often each has
    been switched out: once per wait for work, so it grows only with replies written."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != "pyfuse3-reply":
                continue
            status = (task / "status").read_text().splitlines()
        except FileNotFoundError:  # a thread that just ended
            continue
        out[int(task.name)] = sum(int(line.split(":")[1]) for line in status
                                  if line.split(":")[0].endswith("ctxt_switches"))
    return out


@pytest.mark.mount
def test_large_read_replies_are_written_by_reply_threads(
    memfs_mount: Callable[..., Mounted],
) -> None:
    """The kernel's copy of a large read's reply happens on pyfuse3's reply threads
    (patch 0006), a small one's and an O_DIRECT one's in the request loop; the bytes
    are right either way,
    with files being truncated and removed meanwhile (freed memory is zeroed only
    after the replies reading it are written: fs.replies_written)."""
    m = memfs_mount("--size", "256M")
    path = m / "f"
    data = os.urandom(64 << 20)
    path.write_bytes(data)
    threads = reply_thread_switches(m.pid)
    assert len(threads) == fs.REPLY_THREADS

    fd = os.open(path, os.O_RDONLY)
    try:  # no readahead: READ requests of 16 KiB through the page cache
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for off in range(12288, len(data), 4 << 20):
            assert os.pread(fd, 16 << 10, off) == data[off : off + (16 << 10)]
    finally:
        os.close(fd)
    assert reply_thread_switches(m.pid) == threads, "a small reply went to a thread"
    # O_DIRECT: the kernel reads into the reader's buffer with no page-cache folio
    # locked, so a write of the same bytes could come while a thread copied the reply:
    # the loop writes those itself, whatever their size
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, 1 << 20)
        for off in range(0, len(data), 4 << 20):
            assert os.preadv(fd, [buf], off) == 1 << 20
            assert buf[:] == data[off : off + (1 << 20)]
    finally:
        os.close(fd)
    assert reply_thread_switches(m.pid) == threads, "an O_DIRECT reply went to a thread"

    churn_path = m / "churn"
    stop = time.monotonic() + 2

    def churn() -> None:  # frees and reuses memory while the reads run
        while time.monotonic() < stop:
            churn_path.write_bytes(b"\x5a" * (8 << 20))
            os.truncate(churn_path, 4096)
            churn_path.unlink()

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        rounds = 0
        while time.monotonic() < stop or rounds < 2:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # READs again
                got = b"".join(os.pread(fd, 1 << 20, off) for off in range(0, len(data), 1 << 20))
            finally:
                os.close(fd)
            assert got == data, f"round {rounds}: wrong bytes read"
            rounds += 1
    finally:
        churner.join()
    after = reply_thread_switches(m.pid)
    assert after.keys() == threads.keys()
    assert sum(after.values()) > sum(threads.values()), "no reply was written by a thread"
