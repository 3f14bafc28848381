"""The burst buffer's read side on real mounts: stage-in, read-through, eviction, stage-out.

A backing directory DIR is filled *before* ``memfs mount --backing DIR``: its
tree must show in the mount at once (names and attributes; the data stays in
DIR until read), read back byte for byte, also when it is larger than the
pool (clean data is evicted and fetched again), while ``memfs stage-in`` is
fetching it, and after it was changed, renamed or unlinked without ever having
been read.  Then the capacity rules (writing more than the pool works; ENOSPC
only for data that cannot be written back) and ``memfs stage-out``.

Every check compares checksums of what DIR held, what the mount returns and
what DIR holds afterwards; reads that matter drop the kernel's cached pages
first so the daemon serves them.  Every wait has a deadline: commands and
readers run as subprocesses with a timeout.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import stat
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from memfs.cli.runtime import control_socket
from memfs.control import ControlClient
from tests.conftest import MEMFS, Mounted

pytestmark = pytest.mark.mount

MiB = 1 << 20
CHUNK = 64 << 10  # the default allocation unit
FLUSH_XATTR = "user.memfs.flush"

Mount = Callable[..., Mounted]


# -- helpers --------------------------------------------------------------------------------


def memfs(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a ``memfs`` subcommand; it must succeed within *timeout* seconds."""
    res = subprocess.run([*MEMFS, *args], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"memfs {' '.join(args)} exited {res.returncode}: {res.stderr}"
    return res


def control(m: Mounted, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """One call on the daemon's control socket, in-process (what the CLI sends)."""
    with ControlClient(control_socket(str(m.path)), str(m.path), timeout=10) as client:
        return client.call(op, args)


def status(m: Mounted) -> dict[str, Any]:
    """``memfs status --json``, without starting a process for it."""
    return control(m, "status")


def status_cli(m: Mounted) -> dict[str, Any]:
    st: dict[str, Any] = json.loads(memfs("status", "--json", str(m.path), timeout=20).stdout)
    return st


def flush_wait(m: Mounted, timeout: float = 60) -> None:
    memfs("flush", "--wait", str(m.path), timeout=timeout)


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def drop_cache(path: Path) -> None:
    """Drop the kernel's pages of *path*, so the next read is served by the daemon."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def file_sha(path: Path) -> str:
    drop_cache(path)
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(MiB):
            h.update(block)
    return h.hexdigest()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_file(path: Path, data: bytes, mode: int = 0o644, mtime_ns: int | None = None) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return sha(data)


def log_problems(m: Mounted) -> list[str]:
    text = m.log.read_text() if m.log.exists() else ""
    return [line for line in text.splitlines() if " ERROR " in line or "Traceback" in line]


def not_resident(root: Path, sizes: dict[str, int]) -> list[str]:
    """Files of *sizes* not wholly in pool memory: st_blocks counts pool chunks
    (the kernel may show attributes up to the mount's attr timeout, 1 s, old: poll)."""
    return [rel for rel, size in sizes.items() if os.stat(root / rel).st_blocks * 512 < size]


def wait_resident(root: Path, sizes: dict[str, int], timeout: float = 5) -> list[str]:
    """Poll until all of *sizes* is resident; what still is not after *timeout*."""
    deadline = time.monotonic() + timeout
    while (left := not_resident(root, sizes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def random_sizes(rng: random.Random, n: int, total: int) -> list[int]:
    """*n* sizes that add up to about *total*, none of them chunk-aligned."""
    weights = [rng.uniform(0.5, 1.5) for _ in range(n)]
    scale = total / sum(weights)
    return [int(w * scale) // CHUNK * CHUNK + rng.randrange(1, CHUNK) for w in weights]


def make_files(root: Path, names: list[str], sizes: list[int]) -> dict[str, str]:
    """Random files under *root*; returns relative name -> sha256."""
    return {name: write_file(root / name, os.urandom(size)) for name, size in zip(names, sizes, strict=True)}


# -- 1: lazy stage-in -------------------------------------------------------------------------

T0 = 1_600_000_000_123_456_789  # an mtime with nanoseconds, long before the mount


def make_tree(root: Path) -> None:
    """Nested directories, files of awkward sizes, modes and owners, symlinks, a hard link."""
    files = {
        "empty": (0, 0o644),
        "one": (1, 0o600),
        "chunk": (CHUNK, 0o640),
        "chunk_plus_one": (CHUNK + 1, 0o755),
        "a": (100_000, 0o640),
        "d1/mid": (3 * MiB + 12345, 0o444),
        "d1/d2/d3/deep": (2 * MiB + 7, 0o604),
        "d1/d2/exact": (4 * MiB, 0o700),
        "d1/d2/d3/empty2": (0, 0o600),
        "other/x": (777_777, 0o664),
    }
    for n, (name, (size, mode)) in enumerate(sorted(files.items())):
        write_file(root / name, os.urandom(size), mode, T0 + n * 1_000_000_007)
    os.chown(root / "other/x", 1234, 5678)
    os.chown(root / "d1/mid", 0, 4321)
    os.link(root / "a", root / "d1/hard_a")
    os.symlink("d1/mid", root / "rel_link")
    os.symlink("/nonexistent/target", root / "d1/dangling")
    os.symlink("d2", root / "d1/dir_link")
    for n, link in enumerate(["rel_link", "d1/dangling", "d1/dir_link"]):
        os.utime(root / link, ns=(T0 - n, T0 - n), follow_symlinks=False)
    os.chown(root / "other", 1234, 5678)
    # directories last, deepest first: creating their entries changed their mtimes
    for n, (d, mode) in enumerate([("d1/d2/d3", 0o700), ("d1/d2", 0o750), ("d1", 0o755),
                                    ("other", 0o711)]):
        os.chmod(root / d, mode)
        os.utime(root / d, ns=(T0 + 10**9 * (n + 1), T0 + 10**9 * (n + 1)))


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """relative path -> (kind, size, mode, uid, gid, mtime_ns, nlink, symlink target)."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        names = dirnames + filenames
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d != ".memfs-tmp"]
            names = ["", *dirnames, *filenames]  # "": the root itself, "."
        for name in names:
            p = Path(dirpath, name)
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            kind = stat.S_IFMT(st.st_mode)
            size = st.st_size if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode) else None
            target = os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
            nlink = st.st_nlink if stat.S_ISREG(st.st_mode) else None
            out[rel] = (kind, size, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                        st.st_mtime_ns, nlink, target)
    return out


def test_lazy_stage_in_shows_the_tree_before_reading(memfs_mount: Mount, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    make_tree(backing)
    want = snapshot(backing)
    regular = {rel: v for rel, v in want.items() if v[0] == stat.S_IFREG}
    distinct = {os.stat(backing / rel).st_ino: v[1] for rel, v in regular.items()}
    m = memfs_mount("--size", "32M", "--backing", str(backing))

    got = snapshot(m.path)
    assert sorted(got) == sorted(want), "names differ"
    files = [rel for rel, v in want.items() if v[0] != stat.S_IFDIR]
    diffs = {rel: (want[rel], got[rel]) for rel in files if got[rel] != want[rel]}
    assert not diffs, f"(kind, size, mode, uid, gid, mtime_ns, nlink, target) DIR vs MNT: {diffs}"
    assert os.stat(m / "a").st_ino == os.stat(m / "d1/hard_a").st_ino, "hard link split in two"

    # Nothing read yet: the data is still only in DIR.
    st = status_cli(m)
    assert st["evicted_files"] == sum(1 for size in distinct.values() if size), st
    assert st["fetched_bytes"] == 0 and st["used"] == 0, st

    for rel in regular:
        assert file_sha(m / rel) == file_sha(backing / rel), rel
    assert os.readlink(m / "rel_link") == "d1/mid"
    assert file_sha(m / "rel_link") == file_sha(backing / "d1/mid")
    st = status(m)
    assert st["evicted_files"] == 0, st
    assert st["fetched_bytes"] >= sum(distinct.values()), st
    assert not log_problems(m)


def test_lazy_stage_in_keeps_directory_attributes(memfs_mount: Mount, tmp_path: Path) -> None:
    """Directories keep mode, owner and mtime; a setgid directory changes nothing
    that was already in DIR (what it imposes applies to new entries only)."""
    backing = tmp_path / "backing"
    make_tree(backing)
    shared = backing / "shared"
    shared.mkdir()
    os.chown(shared, 0, 100)
    os.chmod(shared, 0o2775)
    write_file(shared / "f", b"data", 0o644)
    os.chown(shared / "f", 1000, 200)
    (shared / "plain").mkdir()
    os.chown(shared / "plain", 0, 300)
    os.chmod(shared / "plain", 0o755)  # setgid dropped on purpose
    os.utime(shared, ns=(T0, T0))
    os.chown(backing, 1234, 5678)
    os.chmod(backing, 0o750)
    os.utime(backing, ns=(T0 + 42, T0 + 42))
    want = snapshot(backing)
    m = memfs_mount("--size", "32M", "--backing", str(backing))

    got = snapshot(m.path)
    check = [rel for rel, v in want.items() if v[0] == stat.S_IFDIR or rel.startswith("shared/")]
    diffs = {rel: (want[rel], got.get(rel)) for rel in check if got.get(rel) != want[rel]}
    assert not diffs, f"(kind, size, mode, uid, gid, mtime_ns, nlink, target) DIR vs MNT: {diffs}"


# -- 2: a tree larger than the pool -------------------------------------------------------------


def big_tree(backing: Path) -> dict[str, str]:
    """About 100 MiB in 40 files: small/ (4 files, ~10 MiB) and d0..d3 (nested)."""
    rng = random.Random(4)
    names = [f"small/s{i}" for i in range(4)]
    names += [f"d{i % 4}/" + ("deep/er/" if i % 5 == 0 else "") + f"f{i:02d}" for i in range(36)]
    return make_files(backing, names, random_sizes(rng, len(names), 100 * MiB))


def test_stage_in_of_a_tree_larger_than_the_pool(memfs_mount: Mount, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    want = big_tree(backing)
    assert sum((backing / rel).stat().st_size for rel in want) > 95 * MiB
    m = memfs_mount("--size", "32M", "--backing", str(backing))

    # More than fits: it cannot all stay, but stage-in must finish all the same.
    memfs("stage-in", str(m.path), timeout=90)
    st = status(m)
    assert st["evicted_bytes_total"] > 0, st
    assert st["fetched_bytes"] >= 95 * MiB, st
    assert st["staging_files"] == 0 and st["errors"] == [], st

    bad = [rel for rel in want if file_sha(m / rel) != want[rel]]
    assert not bad, f"wrong content through the mount: {bad}"
    st = status(m)
    assert st["fetched_bytes"] >= 150 * MiB, f"evicted files were not fetched again? {st}"
    assert st["errors"] == [] and st["used"] <= st["capacity"], st
    # Nothing was changed, so nothing was written to DIR.
    assert st["flushed_files"] == 0, st
    assert {rel: file_sha(backing / rel) for rel in want} == want
    assert not log_problems(m)


def test_stage_in_of_named_paths_leaves_them_resident(memfs_mount: Mount, tmp_path: Path) -> None:
    """``stage-in MNT PATH...`` and ``--manifest``: when it returns, what it named is in
    memory (contract: "done" means every byte named is resident), also when some of it
    was resident already and room has to be made by evicting other clean data."""
    backing = tmp_path / "backing"
    want = big_tree(backing)
    sizes = {rel: (backing / rel).stat().st_size for rel in want}
    m = memfs_mount("--size", "32M", "--backing", str(backing))

    # small/ read first (the least recently used data), then the pool filled up with
    # other files, without evicting anything yet.
    small = [rel for rel in want if rel.startswith("small/")]
    for rel in small:
        assert file_sha(m / rel) == want[rel]
    capacity = status(m)["capacity"]
    used = status(m)["used"]
    others = [rel for rel in want if rel.startswith("d0/") or rel.startswith("d2/")]
    for rel in others:
        if used + sizes[rel] + MiB // 2 <= capacity:
            assert file_sha(m / rel) == want[rel]
            used = status(m)["used"]
    extra = max((rel for rel in want if rel.startswith("d1/")), key=lambda rel: sizes[rel])
    st = status(m)
    assert st["evicted_bytes_total"] == 0 and st["used"] + sizes[extra] > capacity, \
        f"test set-up: the pool should be nearly full, nothing evicted yet: {st}"

    # A directory (resident already) and a file that needs room.
    named = {rel: sizes[rel] for rel in [*small, extra]}
    memfs("stage-in", str(m.path), str(m / "small"), str(m / extra), timeout=60)
    left_paths = wait_resident(m.path, named)

    # A manifest: absolute and relative paths, comments and blank lines, ~10 MiB.
    listed = ["d3/f03", "d3/f07", "d3/deep/er/f15", "d3/f11"]
    manifest = tmp_path / "manifest"
    manifest.write_text(
        f"# inputs of the job\n{m / listed[0]}\n\n{listed[1]}\n{m / listed[2]}\n{listed[3]}\n"
    )
    memfs("stage-in", str(m.path), "--manifest", str(manifest), timeout=60)
    left_manifest = wait_resident(m.path, {rel: sizes[rel] for rel in listed})

    assert not left_paths and not left_manifest, (
        f"not resident after stage-in PATH...: {left_paths}; after --manifest: {left_manifest}; "
        f"{status(m)}"
    )
    bad = [rel for rel in [*named, *listed] if file_sha(m / rel) != want[rel]]
    assert not bad, f"wrong content through the mount: {bad}"
    assert not log_problems(m)


def test_a_file_larger_than_the_pool_reads_back(memfs_mount: Mount, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    write_file(backing / "big", os.urandom(48 * MiB + 4321))
    m = memfs_mount("--size", "32M", "--backing", str(backing))
    assert os.stat(m / "big").st_size == 48 * MiB + 4321
    res = subprocess.run(
        f"dd if={m / 'big'} bs=1M status=none | cmp - {backing / 'big'}",
        shell=True, capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, f"dd | cmp: {res.stdout}{res.stderr}"
    drop_cache(m / "big")
    res = subprocess.run(["cmp", str(m / "big"), str(backing / "big")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"second read: {res.stdout}{res.stderr}"
    st = status(m)
    assert st["evicted_bytes_total"] > 0, st
    assert st["errors"] == [], st
    assert not log_problems(m)


# -- 3: readers while staging -------------------------------------------------------------------

READER = textwrap.dedent("""
    import hashlib, json, os, random, sys
    mnt, backing, manifest, seed, ops, ready = sys.argv[1:7]
    want = json.loads(open(manifest).read())
    rng = random.Random(int(seed))
    names = sorted(want)
    open(ready, "w").close()
    sys.stdin.readline()  # go
    bad = []
    for n in range(int(ops)):
        rel = rng.choice(names)
        path = os.path.join(mnt, rel)
        if n % 3 == 0:  # a whole file
            h = hashlib.sha256()
            with open(path, "rb", buffering=0) as f:
                while block := f.read(1 << 20):
                    h.update(block)
            if h.hexdigest() != want[rel]:
                bad.append(("sha", rel))
        else:  # a random piece, compared with DIR
            size = os.path.getsize(os.path.join(backing, rel))
            off = rng.randrange(size)
            length = rng.choice([1, 4096, 65537, 1 << 20])
            fd = os.open(path, os.O_RDONLY)
            ref = os.open(os.path.join(backing, rel), os.O_RDONLY)
            try:
                if os.pread(fd, length, off) != os.pread(ref, length, off):
                    bad.append(("pread", rel, off, length))
            finally:
                os.close(fd)
                os.close(ref)
    print(json.dumps(bad))
    sys.exit(1 if bad else 0)
""")


def cold(root: Path) -> None:
    """Out of the page cache: fetches from DIR go to the disk, so staging takes a while."""
    os.sync()
    for p in root.rglob("*"):
        if p.is_file():
            drop_cache(p)


def test_readers_while_staging(memfs_mount: Mount, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    rng = random.Random(3)
    names = [f"in/{'sub/' if i % 3 else ''}f{i:02d}" for i in range(30)]
    want = make_files(backing, names, random_sizes(rng, len(names), 200 * MiB))
    want["big1"] = write_file(backing / "big1", os.urandom(64 * MiB))
    want["big2"] = write_file(backing / "big2", os.urandom(64 * MiB))
    m = memfs_mount("--size", "512M", "--backing", str(backing))

    # A 4 KiB read in the middle of a non-resident 64 MiB file fetches what it needs,
    # not the whole file: compare with reading a whole (equally non-resident) file.
    fd = os.open(m / "big1", os.O_RDONLY)
    try:
        t = time.monotonic()
        piece = os.pread(fd, 4096, 40 * MiB)
        t_piece = time.monotonic() - t
    finally:
        os.close(fd)
    with open(backing / "big1", "rb") as f:
        f.seek(40 * MiB)
        assert piece == f.read(4096)
    fetched_for_piece = status(m)["fetched_bytes"]
    t = time.monotonic()
    assert file_sha(m / "big2") == want["big2"]
    t_whole = time.monotonic() - t
    assert fetched_for_piece < 16 * MiB, f"a 4 KiB read fetched {fetched_for_piece} bytes"
    assert t_piece < t_whole / 3, f"4 KiB at 40 MiB took {t_piece:.3f} s, all 64 MiB {t_whole:.3f} s"

    # Readers ready and waiting; stage-in starts; the readers go at once.
    manifest = tmp_path / "want.json"
    manifest.write_text(json.dumps(want))
    cold(backing)
    readers = [
        subprocess.Popen([sys.executable, "-c", READER, str(m.path), str(backing), str(manifest),
                          str(seed), "24", str(tmp_path / f"ready{seed}")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for seed in range(4)
    ]
    try:
        wait_until(lambda: all((tmp_path / f"ready{n}").exists() for n in range(4)), 30,
                   "the readers to start")
        ticket = control(m, "stage_in", {"paths": []})["ticket"]  # what stage-in --no-wait sends
        for r in readers:
            assert r.stdin is not None
            r.stdin.write("go\n")
            r.stdin.flush()
        at_start = control(m, "progress", {"ticket": ticket})
        for r in readers:
            stdout, stderr = r.communicate(timeout=90)
            assert r.returncode == 0, f"reader saw wrong data: {stdout} {stderr}"
    finally:
        for r in readers:
            if r.poll() is None:
                r.kill()
            r.communicate(timeout=10)  # reap it and close its pipes
    assert not at_start["done"] and at_start["files"] > 0, \
        f"stage-in was over before the readers started (test too small?): {at_start}"

    wait_until(lambda: bool(control(m, "progress", {"ticket": ticket})["done"]), 60,
               "stage-in to finish")
    st = status(m)
    assert st["staging_files"] == 0 and st["errors"] == [], st
    assert st["evicted_files"] == 0 and st["evicted_bytes_total"] == 0, st
    bad = [rel for rel in want if file_sha(m / rel) != want[rel]]
    assert not bad, f"wrong content after stage-in: {bad}"
    assert not log_problems(m)


# -- 4: changing files that were never read ----------------------------------------------------


def _overwrite_middle(path: Path, old: bytes) -> bytes:
    mid = len(old) // 2 + 3
    with open(path, "r+b", buffering=0) as f:
        f.seek(mid)
        f.write(b"0123456789")
    return old[:mid] + b"0123456789" + old[mid + 10:]


def _append(path: Path, old: bytes) -> bytes:
    tail = os.urandom(100_003)
    with open(path, "ab", buffering=0) as f:
        f.write(tail)
    return old + tail


def _truncate_and_extend(path: Path, old: bytes) -> bytes:
    cut = 1_000_003  # inside a chunk
    os.truncate(path, cut)
    os.truncate(path, 2_000_000)
    with open(path, "r+b", buffering=0) as f:
        f.seek(2_000_000)
        f.write(b"END")
    return old[:cut] + bytes(2_000_000 - cut) + b"END"


@pytest.mark.parametrize("change", [_overwrite_middle, _append, _truncate_and_extend],
                         ids=["overwrite-middle", "append", "truncate-extend"])
def test_modify_staged_file(
    memfs_mount: Mount, tmp_path: Path, change: Callable[[Path, bytes], bytes]
) -> None:
    """A file never read (its data only in DIR) changed in place: old data outside the
    change is kept, through the mount and in DIR after ``flush --wait``."""
    backing = tmp_path / "backing"
    old = os.urandom(5 * MiB + 1017)  # the last chunk is partial
    write_file(backing / "f", old)
    m = memfs_mount("--size", "32M", "--backing", str(backing))
    assert status(m)["evicted_files"] == 1

    expect = change(m / "f", old)
    assert os.stat(m / "f").st_size == len(expect)
    assert file_sha(m / "f") == sha(expect), "wrong content through the mount"
    flush_wait(m)
    assert (backing / "f").read_bytes() == expect, "wrong content in DIR after flush --wait"
    assert status(m)["errors"] == []
    assert not log_problems(m)


# -- 5: rename and unlink of files that were never read ---------------------------------------


def test_rename_non_resident(memfs_mount: Mount, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    want = {
        "f1": write_file(backing / "f1", os.urandom(2 * MiB + 5)),
        "dir1/x": write_file(backing / "dir1/x", os.urandom(MiB + 3)),
        "dir1/sub/y": write_file(backing / "dir1/sub/y", os.urandom(300_000)),
    }
    m = memfs_mount("--size", "32M", "--backing", str(backing))

    os.rename(m / "f1", m / "f1_new")
    os.rename(m / "dir1", m / "dir2")
    assert status(m)["evicted_files"] == 3, "renaming read data"
    moved = {"f1_new": want["f1"], "dir2/x": want["dir1/x"], "dir2/sub/y": want["dir1/sub/y"]}
    assert {rel: file_sha(m / rel) for rel in moved} == moved
    assert sorted(os.listdir(m.path)) == ["dir2", "f1_new"]
    flush_wait(m)
    assert {rel: file_sha(backing / rel) for rel in moved} == moved
    assert sorted(set(os.listdir(backing)) - {".memfs-tmp"}) == ["dir2", "f1_new"]
    assert status(m)["errors"] == []
    assert not log_problems(m)


def test_unlink_open_non_resident(memfs_mount: Mount, tmp_path: Path) -> None:
    """An fd opened before the unlink keeps the whole file, also once the unlink
    has reached DIR, though nothing of it was read before."""
    backing = tmp_path / "backing"
    want = write_file(backing / "victim", os.urandom(3 * MiB + 11))
    m = memfs_mount("--size", "32M", "--backing", str(backing))

    fd = os.open(m / "victim", os.O_RDONLY)
    try:
        assert status(m)["evicted_files"] == 1, "opening read data"
        os.unlink(m / "victim")
        flush_wait(m)
        assert not (backing / "victim").exists(), "the unlink did not reach DIR"
        h = hashlib.sha256()
        off = 0
        try:
            while block := os.pread(fd, MiB, off):
                h.update(block)
                off += len(block)
        except OSError as exc:
            raise AssertionError(f"reading the open fd at {off}: {exc}") from None
        assert off == 3 * MiB + 11 and h.hexdigest() == want, f"read {off} bytes, wrong content"
    finally:
        os.close(fd)
    assert status(m)["errors"] == []
    assert not log_problems(m)


# -- 6: capacity -------------------------------------------------------------------------------

FILL = textwrap.dedent("""
    import json, os, sys
    path, limit = sys.argv[1], int(sys.argv[2])
    block = os.urandom(1 << 20)
    written = err = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while written < limit:
            written += os.write(fd, block)
    except OSError as exc:
        err = exc.errno
    try:
        os.close(fd)
    except OSError as exc:
        err = err or exc.errno
    print(json.dumps({"written": written, "errno": err}))
""")


def test_capacity_clean_data_is_evicted_pinned_data_is_enospc(
    memfs_mount: Mount, tmp_path: Path
) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    src = tmp_path / "src"
    want = make_files(src, [f"f{i}" for i in range(10)], [10 * MiB + 17 * i for i in range(10)])
    m = memfs_mount("--size", "32M", "--backing", str(backing), "--flush-delay", "0")

    for name in want:  # 100 MiB into 32: writers may wait on the dirty cap, never fail
        res = subprocess.run(["dd", f"if={src / name}", f"of={m / name}", "bs=1M", "status=none"],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"writing {name}: {res.stderr}"
    bad = [name for name in want if file_sha(m / name) != want[name]]
    assert not bad, f"wrong content through the mount: {bad}"
    st = status(m)
    assert st["evicted_bytes_total"] > 0, st
    flush_wait(m)
    assert {name: file_sha(backing / name) for name in want} == want

    # A tree excluded from write-back cannot be evicted: filling the pool with it is ENOSPC.
    (m / "pinned").mkdir()
    os.setxattr(m / "pinned", FLUSH_XATTR, b"off")
    res = subprocess.run([sys.executable, "-c", FILL, str(m / "pinned/big"), str(64 * MiB)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    fill = json.loads(res.stdout)
    assert fill["errno"] == errno.ENOSPC, fill
    assert 24 * MiB <= fill["written"] <= 32 * MiB, f"ENOSPC with clean data to evict? {fill}"

    st = status(m)  # still answering
    assert st["pinned_bytes"] >= 24 * MiB, st
    assert st["errors"] == [], st
    os.unlink(m / "pinned/big")
    assert file_sha(m / "f3") == want["f3"]
    data = os.urandom(5 * MiB)
    (m / "after").write_bytes(data)
    assert file_sha(m / "after") == sha(data)
    assert not (backing / "pinned/big").exists()
    assert not log_problems(m)


# -- 7: stage-out -----------------------------------------------------------------------------


def test_stage_out_archive(memfs_mount: Mount, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    m = memfs_mount("--size", "64M", "--backing", str(backing), "--flush-delay", "0")
    (m / "results").mkdir()
    os.setxattr(m / "results", FLUSH_XATTR, b"off")

    rng = random.Random(7)
    # member name -> (mode, sha256 of a file / target of a symlink / None for a directory)
    want: dict[str, tuple[int, str | None]] = {"results": (0o755, None)}
    for d in range(5):
        sub = f"results/rank{d}"
        (m / sub).mkdir()
        os.chmod(m / sub, 0o750)
        want[sub] = (0o750, None)
        for i in range(60):
            name = f"{sub}/out{i:03d}.dat"
            mode = rng.choice([0o600, 0o644, 0o755])
            data = os.urandom(rng.choice([0, 1, 100, 4096, 20_000, 70_000]))
            (m / name).write_bytes(data)
            os.chmod(m / name, mode)
            want[name] = (mode, sha(data))
    os.symlink("rank0/out000.dat", m / "results/latest")
    want["results/latest"] = (0o777, "-> rank0/out000.dat")
    os.chmod(m / "results", 0o755)
    (m / "unrelated").write_bytes(b"written back as usual")
    flush_wait(m)
    assert (backing / "unrelated").read_bytes() == b"written back as usual"
    # "results" itself was made before it was excluded; nothing made in it since may be.
    mirrored = sorted(str(p.relative_to(backing)) for p in (backing / "results").rglob("*"))
    assert not mirrored, f"excluded tree mirrored into DIR: {mirrored}"

    memfs("stage-out", str(m / "results"), "--archive", str(backing / "out.tar"), timeout=60)
    got: dict[str, tuple[int, str | None]] = {}
    with tarfile.open(backing / "out.tar") as tar:
        for member in tar.getmembers():
            what = None
            if member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                what = sha(f.read())
            elif member.issym():
                what = f"-> {member.linkname}"
            else:
                assert member.isdir(), member.name
            got[member.name] = (member.mode, what)
    assert sorted(got) == sorted(want)
    assert got == want

    memfs("umount", str(m.path), timeout=60)
    mirrored = sorted(str(p.relative_to(backing)) for p in (backing / "results").rglob("*"))
    assert not mirrored, f"umount wrote the excluded tree: {mirrored}"
    assert sorted(os.listdir(backing)) in (
        ["out.tar", "unrelated"], ["out.tar", "results", "unrelated"]
    )


def test_failed_stage_out_leaves_the_tree_to_write_back(memfs_mount: Mount, tmp_path: Path) -> None:
    """An archive that cannot be written (its filesystem is full) must not leave the
    tree excluded from write-back: nothing would keep it then."""
    backing = tmp_path / "backing"
    backing.mkdir()
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], check=True)
    try:
        m = memfs_mount("--size", "64M", "--backing", str(backing), "--flush-delay", "60")
        (m / "res").mkdir()
        data = os.urandom(2 * MiB)
        (m / "res" / "big.dat").write_bytes(data)
        res = subprocess.run([*MEMFS, "stage-out", str(m / "res"), "--archive", str(small / "a.tar")],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 1, res
        assert "memfs: error:" in res.stderr and "Traceback" not in res.stderr
        assert not list(small.iterdir()), "no torn archive or temporary file left"
        with pytest.raises(OSError) as exc:
            os.getxattr(m / "res", FLUSH_XATTR)
        assert exc.value.errno == errno.ENODATA
        flush_wait(m)
        assert file_sha(backing / "res" / "big.dat") == sha(data)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
