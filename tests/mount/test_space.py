"""Pool space on a real mount: ENOSPC, deferred frees, no leaks, no stale bytes.

Pools are tiny (16 MiB over two volumes) so that filling them is quick.  Freed
chunks are handed out again without being cleared, so the hole tests first
dirty every chunk of the pool with 0xFF and then check that nothing a file did
not write ever reads as anything but zero.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from memfs.config import PoolConfig
from memfs.data import DataEngine
from memfs.fs import Operations
from memfs.meta.store import MetaStore
from memfs.transport.local import LocalTransport
from tests.conftest import Mounted

pytestmark = pytest.mark.mount

CHUNK = 64 << 10
STRIPE = 1 << 20
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10
PUNCH = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
SMALL_POOL = ("--size", "16M", "--volumes", "2")


def sha256(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def read_uncached(path: Path) -> bytes:
    """The file's bytes as the daemon serves them, not as the page cache remembers them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while block := os.read(fd, 1 << 20):
            chunks.append(block)
        return b"".join(chunks)
    finally:
        os.close(fd)


def free_bytes(m: Mounted) -> int:
    st = os.statvfs(m.path)
    return st.f_bfree * st.f_frsize


def wait_free(m: Mounted, expected: int, timeout: float = 5.0) -> int:
    """Poll statfs until it shows *expected* free bytes: release is asynchronous."""
    deadline = time.monotonic() + timeout
    while (free := free_bytes(m)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return free


def fill(m: Mounted, prefix: str, byte: int = 0xFF) -> dict[Path, int]:
    """Write *byte* in whole chunks until the pool is full; returns bytes stored per file.

    Files start on different volumes, so new files keep finding room until every
    volume is full: a run of fresh files that cannot store a single chunk.  Each
    chunk is fsynced, so that with a writeback cache the error shows up there.
    """
    block = bytes([byte]) * CHUNK
    stored: dict[Path, int] = {}
    refused = 0
    for i in range(10_000):
        path = m / f"{prefix}{i}"
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
        n = 0
        try:
            while True:
                try:
                    w = os.write(fd, block)
                    os.fsync(fd)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
                assert w == len(block), "a short write must be followed by ENOSPC"
                n += w
        finally:
            try:
                os.close(fd)
            except OSError as exc:  # a writeback error not yet reported by fsync
                assert exc.errno == errno.ENOSPC, exc
        stored[path] = n
        refused = refused + 1 if n == 0 else 0
        if refused == 4:
            return stored
    raise AssertionError("the pool never filled up")


def wait_for(what: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("writeback", [False, True], ids=["write_through", "writeback_cache"])
def test_enospc(memfs_mount: Callable[..., Mounted], writeback: bool) -> None:
    """A full pool refuses writes with ENOSPC, keeps existing data, and recovers after rm."""
    m: Mounted = memfs_mount(*SMALL_POOL, *(["-o", "writeback_cache"] if writeback else []))
    total = free_bytes(m)
    assert total == 16 << 20
    keep = os.urandom(3 * STRIPE + 777)
    (m / "keep").write_bytes(keep)

    data = os.urandom(STRIPE)
    big = m / "big"
    written = 0
    error_at = None
    fd = os.open(big, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for _ in range(64):  # 64 MiB: far more than the pool holds
            try:
                n = os.write(fd, data)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                error_at = "write"
                break
            written += n  # a short count: the next write(2) gets the ENOSPC
        if error_at is None:
            try:
                os.fsync(fd)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                error_at = "fsync"
    finally:
        try:
            os.close(fd)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            error_at = error_at or "close"
    assert error_at is not None, "64 MiB went into a 16 MiB pool without an error"
    if not writeback:
        # No writeback cache: each write(2) is a request to the daemon, which says no.
        assert error_at == "write"
        assert written < 16 << 20
        assert big.stat().st_size == written
        pattern = (data * (written // len(data) + 1))[:written]
        assert sha256(read_uncached(big)) == sha256(pattern), "bytes before ENOSPC damaged"

    fill(m, "more")  # whatever the big file left on one volume
    assert free_bytes(m) == 0
    assert sha256(read_uncached(m / "keep")) == sha256(keep)

    big.unlink()
    assert wait_for(lambda: free_bytes(m) >= 4 * STRIPE), "rm did not free the space"
    fresh = os.urandom(2 * STRIPE + 5)
    (m / "fresh").write_bytes(fresh)
    fd = os.open(m / "fresh", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    assert sha256(read_uncached(m / "fresh")) == sha256(fresh)
    assert sha256(read_uncached(m / "keep")) == sha256(keep)


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) itself (os.posix_fallocate would fall back to writing zeros)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def test_fallocate_reserves_space(memfs_mount: Callable[..., Mounted]) -> None:
    """fallocate(2) reaches memfs (pyfuse3 patch 0004): the range's chunks are taken at
    once and read as zeros; KEEP_SIZE within the file works, past it and the modes
    tmpfs lacks too are EOPNOTSUPP; a range larger than the pool is ENOSPC and leaves the file and the
    free space as they were."""
    m: Mounted = memfs_mount(*SMALL_POOL)
    total = free_bytes(m)
    dirt = fill(m, "dirt")  # freed chunks come back holding 0xFF unless cleared
    for path in dirt:
        path.unlink()
    assert wait_free(m, total) == total
    path = m / "f"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"head")
        fallocate(fd, 0, CHUNK, 3 * STRIPE)
        assert os.fstat(fd).st_size == CHUNK + 3 * STRIPE
        assert free_bytes(m) == total - CHUNK - 3 * STRIPE, "every chunk of the range taken now"
        fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, STRIPE)
        assert os.fstat(fd).st_size == CHUNK + 3 * STRIPE
        for mode, offset in ((FALLOC_FL_KEEP_SIZE, 3 * STRIPE), (FALLOC_FL_ZERO_RANGE, 0)):
            with pytest.raises(OSError) as info:
                fallocate(fd, mode, offset, STRIPE)
            assert info.value.errno == errno.EOPNOTSUPP
        before = free_bytes(m)
        with pytest.raises(OSError) as info:
            fallocate(fd, 0, 0, 64 << 20)
        assert info.value.errno == errno.ENOSPC
        assert os.fstat(fd).st_size == CHUNK + 3 * STRIPE
        assert free_bytes(m) == before
    finally:
        os.close(fd)
    assert read_uncached(path) == b"head" + bytes(CHUNK + 3 * STRIPE - 4)
    path.unlink()
    assert wait_free(m, total) == total


def test_unlink_while_open(memfs_mount: Callable[..., Mounted]) -> None:
    """An unlinked file stays readable (and writable) through its fd; space returns at close."""
    m: Mounted = memfs_mount("--size", "64M")
    empty = free_bytes(m)
    data = os.urandom(8 * STRIPE + 3)
    path = m / "doomed"
    path.write_bytes(data)
    used = free_bytes(m)
    assert used <= empty - len(data)

    fd = os.open(path, os.O_RDWR)
    try:
        path.unlink()
        assert not path.exists()
        assert "doomed" not in os.listdir(m.path)
        time.sleep(0.2)  # give a wrongly early free the time to show
        assert free_bytes(m) == used
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert sha256(os.pread(fd, len(data) + 10, 0)) == sha256(data)
        tail = os.urandom(CHUNK + 1)
        assert os.pwrite(fd, tail, len(data)) == len(tail)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert sha256(os.pread(fd, 2 * len(data), 0)) == sha256(data + tail)
    finally:
        os.close(fd)
    assert wait_free(m, empty) == empty


@pytest.mark.parametrize("writeback", [False, True], ids=["write_through", "writeback_cache"])
def test_holes_are_zero_after_reuse(memfs_mount: Callable[..., Mounted], writeback: bool) -> None:
    """Bytes a file never wrote read as zero, although every chunk was 0xFF before."""
    m: Mounted = memfs_mount(*SMALL_POOL, *(["-o", "writeback_cache"] if writeback else []))
    empty = free_bytes(m)
    dirty = fill(m, "dirty")
    assert free_bytes(m) == 0
    assert sum(dirty.values()) == empty  # so every chunk of the pool now holds 0xFF
    for path in dirty:
        path.unlink()
    assert wait_free(m, empty) == empty

    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    cases: dict[str, bytearray] = {}

    def check(name: str) -> None:
        got = read_uncached(m / name)
        want = cases[name]
        assert len(got) == len(want), f"{name}: size"
        if got != want:
            bad = next(i for i in range(len(want)) if got[i] != want[i])
            pytest.fail(f"{name} (seed {seed}): byte {bad} is {got[bad]:#x}, want {want[bad]:#x}")

    # Single bytes at scattered offsets: every chunk is fresh and mostly unwritten.
    model = bytearray(6 * STRIPE + 1234)
    with open(m / "scattered", "wb") as f:
        f.truncate(len(model))
        for off in rng.sample(range(len(model)), 48) + [0, CHUNK - 1, CHUNK, STRIPE - 1, STRIPE]:
            f.seek(off)
            f.write(b"\x01")
            model[off] = 1
    cases["scattered"] = model
    check("scattered")

    # Sparse: data, a hole of several chunks, data mid-chunk, a hole up to EOF.
    model = bytearray(3 * STRIPE)
    with open(m / "sparse", "wb") as f:
        for off, n in ((100, 5000), (STRIPE + CHUNK + 17, 3 * CHUNK), (2 * STRIPE - 9, 19)):
            f.seek(off)
            f.write(b"\x02" * n)
            model[off : off + n] = b"\x02" * n
        f.truncate(len(model))
    cases["sparse"] = model
    check("sparse")

    # Extend by truncate from mid-chunk.
    model = bytearray(b"\x03" * 100_001) + bytes(3 * STRIPE + 7 - 100_001)
    with open(m / "extended", "wb") as f:
        f.write(b"\x03" * 100_001)
        f.truncate(len(model))
    cases["extended"] = model
    check("extended")

    # Shrink then extend: the cut-off bytes must not come back.
    for name, cut in (("shrunk_mid", 70_000), ("shrunk_edge", CHUNK), ("shrunk_1", 1)):
        (m / name).write_bytes(b"\x04" * 2 * STRIPE)
        with open(m / name, "r+b") as rw:
            rw.truncate(cut)
            rw.truncate(2 * STRIPE)
            rw.seek(STRIPE + 3)
            rw.write(b"\x05")
        model = bytearray(b"\x04" * cut) + bytes(2 * STRIPE - cut)
        model[STRIPE + 3] = 5
        cases[name] = model
        check(name)

    # Write past EOF after a shrink inside the same chunk.
    with open(m / "regrow", "wb") as f:
        f.write(b"\x06" * 50_000)
        f.truncate(10)
        f.seek(40_000)
        f.write(b"\x07")
    model = bytearray(b"\x06" * 10) + bytes(40_000 - 10) + b"\x07"
    cases["regrow"] = model
    check("regrow")

    for name in cases:  # and again, after everything else reused the pool around them
        check(name)


def test_no_leak(memfs_mount: Callable[..., Mounted]) -> None:
    """2000 create/write/delete cycles (with links, renames, truncates) give every block back."""
    m: Mounted = memfs_mount(*SMALL_POOL)
    st0 = os.statvfs(m.path)
    rng = random.Random(3)
    for i in range(2000):
        path = m / f"f{i % 7}"
        data = rng.randbytes(rng.choice((1, 4096, CHUNK - 1, CHUNK + 1, 200_000)))
        with open(path, "wb") as f:
            f.write(data)
            if i % 13 == 0:
                f.truncate(3 * CHUNK + 5)
            if i % 17 == 0:
                f.seek(STRIPE + 1)
                f.write(b"x")
        if i % 10 == 0:
            os.link(path, m / "hard")
            path.unlink()
            (m / "hard").unlink()
        elif i % 7 == 3:
            os.rename(path, m / "renamed")  # replaces the previous one, if any
        elif i % 5 == 0:
            fd = os.open(path, os.O_RDONLY)
            path.unlink()
            os.close(fd)
        else:
            path.unlink()
    for leftover in m.path.iterdir():
        leftover.unlink()
    blocks_free = st0.f_bfree * st0.f_frsize
    assert wait_free(m, blocks_free) == blocks_free
    assert os.statvfs(m.path).f_ffree == st0.f_ffree, "inodes leaked"


async def test_statfs_past_the_nominal_inode_count() -> None:
    """Inodes are not capped, so there may be more than statfs's nominal f_files.

    f_ffree must then be 0, not negative: statvfs fields are unsigned, and the
    negative count made every statfs (df) fail with EIO.  Creating a million
    real inodes takes seconds, so stand-ins fill the embedded store's table.
    """
    pool = PoolConfig(size=16 << 20, volumes=2)
    store = MetaStore(pool)
    data = DataEngine(store, LocalTransport(pool.volumes, pool.volume_size))
    ops = Operations(store, data)
    nominal = (await store.statfs()).files
    root = store.inodes[1]
    store.inodes.update((10**9 + k, root) for k in range(nominal))
    st = await ops.statfs(None)  # type: ignore[arg-type]  # ctx is not used
    assert st.f_ffree == st.f_favail == 0
    assert st.f_files >= len(store.inodes)
    await data.transport.aclose()


def test_punch_hole_frees_space_and_reads_zeros(memfs_mount: Callable[..., Mounted]) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE), as on tmpfs: the size stays, the range reads
    as zeros at once (pages this node cached too), whole chunks inside go back to
    the pool (``st_blocks``, ``df``), the bytes around it are intact, mtime moves;
    writing into the hole again takes a clean chunk (never the 0xFF of freed ones)."""
    m: Mounted = memfs_mount(*SMALL_POOL)
    total = free_bytes(m)
    for path in fill(m, "dirt"):
        path.unlink()
    assert wait_free(m, total) == total
    data = random.Random(7).randbytes(6 * CHUNK - 100)
    path = m / "f"
    path.write_bytes(data)
    assert path.read_bytes() == data  # in this node's page cache now
    fd = os.open(path, os.O_RDWR)
    try:
        os.utime(fd, ns=(1, 1))
        blocks = os.fstat(fd).st_blocks
        fallocate(fd, PUNCH, CHUNK + 10, 2 * CHUNK + 20)  # chunk 2 whole, 1 and 3 in part
        st = os.fstat(fd)
        assert st.st_size == len(data) and st.st_mtime_ns > 1
        assert st.st_blocks == blocks - CHUNK // 512
        assert wait_free(m, total - 5 * CHUNK) == total - 5 * CHUNK
        want = data[:CHUNK + 10] + bytes(2 * CHUNK + 20) + data[3 * CHUNK + 30:]
        assert sha256(path.read_bytes()) == sha256(want), "the page cache shows the hole"
        assert sha256(read_uncached(path)) == sha256(want)

        fallocate(fd, PUNCH, 4 * CHUNK, 10 * CHUNK)  # to EOF and past: chunks 4, 5 go
        want = want[:4 * CHUNK] + bytes(len(data) - 4 * CHUNK)
        assert os.fstat(fd).st_size == len(data)
        assert wait_free(m, total - 3 * CHUNK) == total - 3 * CHUNK
        assert sha256(read_uncached(path)) == sha256(want)

        os.pwrite(fd, b"new", 2 * CHUNK + 5)  # into the hole: a clean chunk again
        want = want[:2 * CHUNK + 5] + b"new" + want[2 * CHUNK + 8:]
        assert sha256(read_uncached(path)) == sha256(want)
        assert sha256(path.read_bytes()) == sha256(want)
    finally:
        os.close(fd)
    path.unlink()
    assert wait_free(m, total) == total


def test_seek_data_and_hole_and_sparse_copies(memfs_mount: Callable[..., Mounted]) -> None:
    """lseek(SEEK_DATA / SEEK_HOLE) reaches memfs (pyfuse3 patch 0008) and answers from
    the chunk map: without it the kernel would take the whole file for data (the
    first hole at the end).  cp, which looks for holes that way, keeps them."""
    m: Mounted = memfs_mount(*SMALL_POOL)
    path = m / "sparse"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.pwrite(fd, b"a" * CHUNK, 0)
        os.pwrite(fd, b"b" * 10, 4 * CHUNK + 7)
        os.ftruncate(fd, 8 * CHUNK)
        assert os.lseek(fd, 0, os.SEEK_HOLE) == CHUNK  # (write only: no shared mapping)
        rw = os.open(path, os.O_RDWR)
        try:  # (open to read and write here: all data, see the test below)
            assert os.lseek(fd, 0, os.SEEK_HOLE) == 8 * CHUNK
        finally:
            os.close(rw)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.lseek(fd, 0, os.SEEK_DATA) == 0
        assert os.lseek(fd, 0, os.SEEK_HOLE) == CHUNK
        assert os.lseek(fd, CHUNK, os.SEEK_DATA) == 4 * CHUNK
        assert os.lseek(fd, 4 * CHUNK, os.SEEK_HOLE) == 5 * CHUNK
        with pytest.raises(OSError) as info:
            os.lseek(fd, 5 * CHUNK, os.SEEK_DATA)
        assert info.value.errno == errno.ENXIO
        w = os.open(path, os.O_WRONLY)
        try:
            fallocate(w, PUNCH, 0, CHUNK)
        finally:
            os.close(w)
        assert os.lseek(fd, 0, os.SEEK_DATA) == 4 * CHUNK
    finally:
        os.close(fd)
    subprocess.run(["cp", "--sparse=auto", str(path), str(m / "copy")], check=True)
    assert (m / "copy").read_bytes() == path.read_bytes()
    assert os.stat(m / "copy").st_blocks == os.stat(path).st_blocks == CHUNK // 512


def test_seek_with_the_writeback_cache_takes_everything_for_data(
    memfs_mount: Callable[..., Mounted],
) -> None:
    """With ``-o writeback_cache`` the kernel holds written pages the daemon has not
    seen: memfs answers LSEEK with ENOSYS, and the kernel then takes every file for
    data up to its size (never a hole where unwritten-back data is)."""
    m: Mounted = memfs_mount(*SMALL_POOL, "-o", "writeback_cache")
    fd = os.open(m / "f", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, b"x", 4 * CHUNK)
        assert os.lseek(fd, 0, os.SEEK_DATA) == 0
        assert os.lseek(fd, 0, os.SEEK_HOLE) == 4 * CHUNK + 1
    finally:
        os.close(fd)


MAPPER = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644)
os.ftruncate(fd, 8 * 65536)
mm = mmap.mmap(fd, 8 * 65536)
mm[4 * 65536:4 * 65536 + 5] = b"hello"  # dirty in the page cache, not written back
print("written", flush=True)
sys.stdin.read()
mm.close()
os.close(fd)
"""


def test_seek_counts_a_shared_mapping_s_dirty_pages_as_data(
    memfs_mount: Callable[..., Mounted], tmp_path: Path,
) -> None:
    """A process writing through a shared mapping leaves dirty pages the daemon has
    not seen (the kernel writes none back before LSEEK): while the file is open for
    writing on this node, every byte to EOF is data, so cp copies them (found by a
    review: cp copied zeros where a read showed the bytes).  Once it is closed, the
    holes show again."""
    m: Mounted = memfs_mount(*SMALL_POOL)
    path = m / "mapped"
    w = subprocess.Popen([sys.executable, "-c", MAPPER, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout is not None and w.stdout.readline().strip() == "written"
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.lseek(fd, 0, os.SEEK_DATA) == 0
            assert os.lseek(fd, 0, os.SEEK_HOLE) == 8 * CHUNK
        finally:
            os.close(fd)
        subprocess.run(["cp", str(path), str(tmp_path / "copy")], check=True)
        assert (tmp_path / "copy").read_bytes()[4 * CHUNK:4 * CHUNK + 5] == b"hello"
    finally:
        w.communicate("", timeout=30)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.lseek(fd, 0, os.SEEK_DATA) == 4 * CHUNK  # written back at the close
        assert os.lseek(fd, 4 * CHUNK, os.SEEK_HOLE) == 5 * CHUNK
    finally:
        os.close(fd)
