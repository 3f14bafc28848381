"""Data integrity on a real mount: every byte written comes back, from the daemon.

Pool memory is striped over volumes and reused without clearing, so the
interesting places are stripe and chunk boundaries, unordered and overlapping
writes, concurrent appenders and the kernel paths (mmap, cp, tar, fio) that
issue I/O differently from a plain ``write()``.  Reads that matter evict the
kernel page cache first (``POSIX_FADV_DONTNEED``), so they are served by the
daemon and not by the pages the writer left behind.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Mounted

pytestmark = pytest.mark.mount

STRIPE = 1 << 20
CHUNK = 64 << 10


def sha256(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def evict(path: Path) -> None:
    """Drop the cached pages of *path* so the next read asks the daemon."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def file_sha256(path: Path, *, uncached: bool = True) -> str:
    if uncached:
        evict(path)
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def daemon_bytes_sent(pid: int) -> int:
    """Bytes the daemon wrote to /dev/fuse: grows by the size of every read it serves."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no wchar in /proc/{pid}/io")


SIZES = [
    0, 1, CHUNK - 1, CHUNK, CHUNK + 1, STRIPE - 1, STRIPE, STRIPE + 1,
    4 * STRIPE + CHUNK + 3,  # wraps round all four volumes and ends mid-chunk
]


def test_sizes_roundtrip(mnt: Mounted) -> None:
    """Boundary sizes come back exactly, from the page cache and from the daemon."""
    rng = random.Random(1)
    want = {}
    for size in SIZES:
        data = rng.randbytes(size)
        path = mnt / f"f{size}"
        path.write_bytes(data)
        want[path] = sha256(data)
        assert os.stat(path).st_size == size
        assert file_sha256(path, uncached=False) == want[path], f"size {size} (cached)"
    for path, digest in want.items():
        assert file_sha256(path) == digest, f"{path.name} (uncached)"


def test_100mib_roundtrip(mnt: Mounted) -> None:
    """A large file survives eviction, and the uncached read really is served by the daemon."""
    data = os.urandom(100 << 20)
    path = mnt / "big"
    with open(path, "wb") as f:
        f.write(data)
    before = daemon_bytes_sent(mnt.pid)
    assert file_sha256(path) == sha256(data)
    assert daemon_bytes_sent(mnt.pid) - before >= len(data), "read was served from the page cache"
    # Unaligned reads straddling stripe and chunk edges.
    evict(path)
    with open(path, "rb", buffering=0) as f:
        for off in (STRIPE - 7, 17 * STRIPE - 1, 50 * STRIPE + CHUNK - 3, len(data) - 5):
            f.seek(off)
            assert f.read(STRIPE + 11) == data[off : off + STRIPE + 11], f"offset {off}"


def test_shuffled_and_overlapping_writes(mnt: Mounted) -> None:
    """Out-of-order block writes, then unaligned overwrites and writes past EOF, match a model."""
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    size = 24 << 20
    blocks: list[tuple[int, int]] = []
    off = 0
    while off < size:
        n = min(rng.randrange(4096, STRIPE + 1, 4096), size - off)
        blocks.append((off, n))
        off += n
    rng.shuffle(blocks)
    model = bytearray(rng.randbytes(size))
    path = mnt / "shuffled"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        for off, n in blocks:
            assert os.pwrite(fd, model[off : off + n], off) == n
        assert file_sha256(path) == sha256(model), f"seed {seed}: shuffled blocks"
        for _ in range(300):
            off = rng.randrange(0, len(model) + 3 * CHUNK)  # sometimes past EOF: a hole
            data = rng.randbytes(rng.randrange(1, 3 * CHUNK))
            if off > len(model):
                model.extend(bytes(off - len(model)))
            model[off : off + len(data)] = data
            assert os.pwrite(fd, data, off) == len(data)
    finally:
        os.close(fd)
    assert os.stat(path).st_size == len(model)
    assert file_sha256(path) == sha256(model), f"seed {seed}: overwrites"


APPENDER = """
import os, sys
path, wid, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
sys.stdin.read(1)  # start together
for i in range(count):
    head = b"%d:%06d:" % (wid, i)
    rec = head + bytes([65 + wid]) * (size - len(head) - 1) + b"\\n"
    assert os.write(fd, rec) == size
os.close(fd)
"""


def test_concurrent_appends(mnt: Mounted) -> None:
    """Two O_APPEND writers: every record lands once, whole, never torn by the other."""
    path = mnt / "log"
    count, size = 3000, 1000  # records straddle page and chunk boundaries
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", APPENDER, str(path), str(w), str(count), str(size)],
            stdin=subprocess.PIPE,
        )
        for w in range(2)
    ]
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()  # EOF releases both writers at once
    for p in procs:
        assert p.wait(timeout=60) == 0
    evict(path)
    data = path.read_bytes()
    assert len(data) == 2 * count * size
    seen: list[tuple[int, int]] = []
    for r in range(0, len(data), size):
        rec = data[r : r + size]
        wid_s, idx_s, _ = rec.split(b":", 2)
        wid, idx = int(wid_s), int(idx_s)
        head = b"%d:%06d:" % (wid, idx)
        assert rec == head + bytes([65 + wid]) * (size - len(head) - 1) + b"\n", f"torn record at {r}"
        seen.append((wid, idx))
    assert sorted(seen) == [(w, i) for w in range(2) for i in range(count)]
    for w in range(2):  # each writer's records stay in its own order
        assert [i for ww, i in seen if ww == w] == list(range(count))


def _make_tree(root: Path) -> None:
    rng = random.Random(7)
    (root / "d1" / "d2" / "d3").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    (root / "empty").write_bytes(b"")
    (root / "small").write_bytes(b"hello\n")
    (root / "d1" / "big").write_bytes(rng.randbytes(3 * STRIPE + 12345))
    (root / "d1" / "d2" / "chunk").write_bytes(rng.randbytes(CHUNK))
    (root / "d1" / "d2" / "d3" / "odd").write_bytes(rng.randbytes(STRIPE - 1))
    for i in range(20):
        (root / "d1" / f"s{i}").write_bytes(rng.randbytes(rng.randrange(1, 9000)))
    os.link(root / "d1" / "big", root / "d1" / "d2" / "big_hardlink")
    os.symlink("../big", root / "d1" / "d2" / "rel_link")
    os.symlink("/nonexistent/target", root / "dangling")
    os.symlink("d1", root / "dir_link")
    os.setxattr(root / "d1" / "big", "user.checksum", b"sha256:whatever")
    os.setxattr(root / "small", "user.empty", b"")
    os.setxattr(root / "d1", "user.dir", b"x" * 200)
    os.chmod(root / "small", 0o640)
    os.chmod(root / "d1" / "d2" / "chunk", 0o4755)
    os.chmod(root / "d1" / "d2" / "d3" / "odd", 0o600)
    os.chmod(root / "d1" / "d2", 0o2750)
    os.chmod(root / "empty_dir", 0o1777)
    # Distinct nanosecond times, set leaves first so directory times stick.
    t = 1_500_000_000_123_456_789
    for dirpath, dirnames, filenames in sorted(os.walk(root), key=lambda w: -len(w[0])):
        for name in sorted(filenames + dirnames):
            t += 1_000_000_007
            os.utime(os.path.join(dirpath, name), ns=(t, t), follow_symlinks=False)


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything ``cp -a``/tar must keep, per relative path; hard links as groups."""
    out: dict[str, tuple[object, ...]] = {}
    links: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            xattrs = {}
            if not stat.S_ISLNK(st.st_mode):
                xattrs = {k: os.getxattr(p, k) for k in os.listxattr(p) if k.startswith("user.")}
            if stat.S_ISREG(st.st_mode):
                links.setdefault(st.st_ino, []).append(rel)
                content: object = file_sha256(p)
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(p)
            else:
                content = None
            out[rel] = (st.st_mode, st.st_size if not stat.S_ISDIR(st.st_mode) else None,
                        st.st_mtime_ns, content, sorted(xattrs.items()))
    for group in links.values():
        for rel in group:
            out[rel] += (tuple(sorted(group)),)
    return out


def test_tree_cp_and_tar_roundtrip(mnt: Mounted, tmp_path: Path) -> None:
    """A tree with links, modes, times and xattrs survives cp -a and tar in and out."""
    src = tmp_path / "src"
    src.mkdir()
    _make_tree(src)
    want = snapshot(src)
    assert len(want) > 30

    subprocess.run(["cp", "-a", str(src), str(mnt / "cp")], check=True)
    assert snapshot(mnt / "cp") == want
    subprocess.run(["cp", "-a", str(mnt / "cp"), str(tmp_path / "cp_out")], check=True)
    assert snapshot(tmp_path / "cp_out") == want

    # pax format keeps nanosecond times; the archive itself lives on memfs.
    tar = ["tar", "--format=posix", "--xattrs", "--xattrs-include=user.*"]
    archive = mnt / "tree.tar"
    subprocess.run([*tar, "-C", str(src), "-cf", str(archive), "."], check=True)
    (mnt / "tar").mkdir()
    subprocess.run([*tar, "-C", str(mnt / "tar"), "-xpf", str(archive)], check=True)
    assert snapshot(mnt / "tar") == want
    out = tmp_path / "tar_out"
    out.mkdir()
    subprocess.run(
        f"{' '.join(tar)} -C {mnt / 'tar'} -cf - . | {' '.join(tar)} -C {out} -xpf -",
        shell=True, check=True,
    )
    assert snapshot(out) == want


def test_mmap_read_write(mnt: Mounted) -> None:
    """MAP_SHARED stores reach the daemon: visible to read(), after reopen and eviction."""
    size = 3 * STRIPE + 4097
    data = os.urandom(size)
    path = mnt / "mapped"
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            m[:] = data
            m[STRIPE - 2 : STRIPE + 2] = b"EDGE"  # a store across a stripe boundary
            m.flush()
        expect = data[: STRIPE - 2] + b"EDGE" + data[STRIPE + 2 :]
        assert os.pread(fd, size + 100, 0) == expect
    finally:
        os.close(fd)
    assert file_sha256(path) == sha256(expect)
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            assert sha256(m[:]) == sha256(expect)
    finally:
        os.close(fd)


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed")
def test_fio_verify(mnt: Mounted, tmp_path: Path) -> None:
    """fio's own crc32c verification of random 16 KiB writes by two jobs."""
    before = daemon_bytes_sent(mnt.pid)
    res = subprocess.run(
        ["fio", "--name=v", "--rw=randwrite", "--bs=16k", "--size=64m", "--numjobs=2",
         "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0",
         "--output-format=json", f"--directory={mnt.path}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr + res.stdout[-2000:]
    assert "verify" not in res.stderr, res.stderr
    jobs = json.loads(res.stdout[res.stdout.index("{"):])["jobs"]
    assert len(jobs) == 2
    for job in jobs:
        assert job["error"] == 0
        assert job["write"]["io_bytes"] == 64 << 20
        assert job["read"]["io_bytes"] == 64 << 20  # the verify pass read everything back
    # fio invalidates its files before verifying: the verify reads came from the daemon.
    assert daemon_bytes_sent(mnt.pid) - before >= 128 << 20


@pytest.mark.parametrize(
    "layout, volumes",
    [("stripe_count=1", 1), ("stripe_count=2 stripe_size=2M", 2)],
)
def test_layout_override(mnt: Mounted, layout: str, volumes: int) -> None:
    """Files under a directory layout use it, and still read back exactly."""
    d = mnt / "striped"
    d.mkdir()
    os.setxattr(d, "user.memfs.layout", layout.encode())
    rng = random.Random(layout)
    want = {}
    for size in (0, 1, CHUNK + 1, 2 * STRIPE - 1, 2 * STRIPE, 2 * STRIPE + 1, 9 * STRIPE + 333):
        data = rng.randbytes(size)
        path = d / f"f{size}"
        path.write_bytes(data)
        want[path] = sha256(data)
        spec = dict(kv.split("=") for kv in os.getxattr(path, "user.memfs.layout").decode().split())
        assert int(spec["stripe_count"]) == volumes
        assert len(spec["volumes"].split(",")) == volumes
        if "2M" in layout:
            assert spec["stripe_size"] == "2M"
    for path, digest in want.items():
        assert file_sha256(path) == digest, path.name
