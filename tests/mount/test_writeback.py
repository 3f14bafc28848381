"""Write-back to a backing directory (the burst buffer of issue 4), through real mounts.

Every test mounts memfs with ``--backing DIR`` the way a user does, writes real
files (from this process, from threads and from writer subprocesses), drives it
with the real ``memfs flush/status/umount`` commands, and compares the trees by
content checksum, mode, mtime (ns) and symlink target.  What must hold:

* after ``memfs flush --wait`` and after ``memfs umount``, DIR mirrors MNT, even
  when files and directories were renamed and deleted while being written back;
* unmounting drains everything (unless ``--discard-on-unmount``), and a new
  mount over DIR shows the files again (read-through);
* a daemon killed with SIGKILL leaves every file ``flush --wait`` reported as
  clean intact in DIR, never a torn file, and the next mount removes its
  temporary copies;
* a file rewritten while it is being written back only ever lands in DIR as one
  whole version;
* a backing filesystem that is full, read-only, or has lost directories never
  fails the application's writes and never loses data: status shows the errors,
  and write-back completes once the fault is gone;
* the dirty cap makes writers wait instead of filling the pool.

The faults use a small tmpfs mounted as DIR by the test itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memfs.cli.runtime import control_socket
from memfs.control import ControlClient
from tests.conftest import MEMFS, Mounted, wait_gone
from tests.mount.test_space import PUNCH, fallocate

pytestmark = [pytest.mark.mount, pytest.mark.timeout(150)]

MiB = 1 << 20
TMP_DIR = ".memfs-tmp"

#: (type, mode bits, mtime_ns (0 for directories), sha256 of a file | target of a symlink)
Entry = tuple[str, int, int, str]
Manifest = dict[str, Entry]
MountFn = Callable[..., Mounted]


# -- trees --------------------------------------------------------------------------------


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_manifest(root: Path) -> Manifest:
    """``{relpath: Entry}`` of everything below *root*, except DIR's ``.memfs-tmp``.

    Directory mtimes are left out (0): DIR's change as write-back fills them.
    """
    out: Manifest = {}
    stack = [(str(root), "")]
    while stack:
        top, rel = stack.pop()
        with os.scandir(top) as it:
            for e in it:
                r = f"{rel}/{e.name}" if rel else e.name
                if r == TMP_DIR:
                    continue
                st = e.stat(follow_symlinks=False)
                mode = stat.S_IMODE(st.st_mode)
                if stat.S_ISDIR(st.st_mode):
                    out[r] = ("dir", mode, 0, "")
                    stack.append((e.path, r))
                elif stat.S_ISLNK(st.st_mode):
                    out[r] = ("symlink", mode, st.st_mtime_ns, os.readlink(e.path))
                elif stat.S_ISREG(st.st_mode):
                    out[r] = ("file", mode, st.st_mtime_ns, sha256_file(e.path))
                else:
                    out[r] = ("other", mode, st.st_mtime_ns, "")
    return out


def link_groups(root: Path) -> set[frozenset[str]]:
    """Names that are hard links of one another (files with nlink > 1)."""
    groups: dict[tuple[int, int], set[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root and TMP_DIR in dirnames:
            dirnames.remove(TMP_DIR)
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                groups.setdefault((st.st_dev, st.st_ino), set()).add(
                    os.path.relpath(p, root))
    return {frozenset(g) for g in groups.values()}


def show(e: Entry) -> str:
    return f"({e[0]}, mode {e[1]:o}, mtime_ns {e[2]}, {e[3][:16]})"


def owners(root: Path) -> dict[str, tuple[int, int]]:
    """``{relpath: (uid, gid)}`` of what is not owned by root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root and TMP_DIR in dirnames:
            dirnames.remove(TMP_DIR)
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_uid or st.st_gid:
                out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_uid, st.st_gid)
    return out


def tree_diff(expected: Manifest, actual: Manifest, limit: int = 25) -> list[str]:
    lines = []
    for p in sorted(expected.keys() | actual.keys()):
        a, b = expected.get(p), actual.get(p)
        if a == b:
            continue
        if a is not None and b is None:
            lines.append(f"missing: {p} {show(a)}")
        elif a is None and b is not None:
            lines.append(f"unexpected: {p} {show(b)}")
        elif a is not None and b is not None:
            what = [n for n, x, y in zip(("type", "mode", "mtime_ns", "content"), a, b,
                                         strict=True) if x != y]
            lines.append(f"differs in {'/'.join(what)}: {p}: expected {show(a)}, got {show(b)}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines


def assert_same_tree(expected: Manifest, actual: Manifest, what: str) -> None:
    diff = tree_diff(expected, actual)
    assert not diff, f"{what}:\n" + "\n".join(diff)


def assert_same_subtree(mnt: Path, backing: Path, names: list[str], what: str) -> None:
    """The entries *names* are the same in MNT and DIR (what else DIR holds is not asked)."""
    now, got = tree_manifest(mnt), tree_manifest(backing)
    assert_same_tree({n: now[n] for n in names},
                     {n: got[n] for n in names if n in got}, what)


def tmp_leftovers(backing: Path) -> list[str]:
    """Files in ``.memfs-tmp`` (each daemon has its own directory there,
    HOST-PID-TOKEN, holding its flock'ed ``.lock``, which is not a leftover)."""
    top = backing / TMP_DIR
    return sorted(str(p.relative_to(top)) for p in top.rglob("*")
                  if not p.is_dir() and p.name != ".lock")


def tmp_sizes(backing: Path) -> list[int]:
    """Sizes of the copies in ``.memfs-tmp`` now (they come and go while we look)."""
    out = []
    for dirpath, _, files in os.walk(backing / TMP_DIR):
        for name in files:
            try:
                out.append(os.stat(os.path.join(dirpath, name)).st_size)
            except FileNotFoundError:
                pass
    return out


def write_file(path: Path, data: bytes | bytearray, mode: int | None = None) -> None:
    """Write *data* and fsync: the application's writes must all succeed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        path.chmod(mode)


# -- the memfs command ----------------------------------------------------------------------


def memfs(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([*MEMFS, *map(str, args)], capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, (
        f"memfs {' '.join(map(str, args))} exited {res.returncode}: {res.stderr}")
    return res


def control(m: Mounted) -> ControlClient:
    """The daemon's control socket, for polling faster than ``memfs status`` can."""
    return ControlClient(control_socket(str(m.path)), str(m.path), timeout=30)


def start_writeback(client: ControlClient, *, or_done: bool = False) -> dict[str, Any]:
    """``memfs flush`` without --wait; returns the status once write-back is seen under
    way (polled over one connection: ``memfs status`` would often see it finished),
    or (*or_done*) once nothing is left dirty either (a loaded machine may not let us
    look before it is over)."""
    client.call("flush", {"paths": []})
    deadline = time.monotonic() + 10
    while (st := client.call("status"))["flushing_files"] == 0:
        if or_done and st["dirty_files"] == 0:
            break
        assert time.monotonic() < deadline, f"write-back did not start: {st}"
    return st


def status(m: Mounted) -> dict[str, Any]:
    st: dict[str, Any] = json.loads(memfs("status", "--json", m.path, timeout=30).stdout)
    return st


def wait_status(
    m: Mounted, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30,
) -> dict[str, Any]:
    """Poll ``memfs status --json`` until *pred* holds; fail after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(m)
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s; last status: {st}")
        time.sleep(0.1)


def flush_wait(m: Mounted, *paths: Path, timeout: float = 60) -> None:
    memfs("flush", "--wait", m.path, *paths, timeout=timeout)


def error_paths(st: dict[str, Any]) -> set[str]:
    return {e["path"] for e in st["errors"]}


def mount_backed(memfs_mount: MountFn, backing: Path, *args: str) -> Mounted:
    return memfs_mount("--size", "256M", "--backing", str(backing), *args)


def daemon_log(m: Mounted) -> str:
    return m.log.read_text() if m.log.exists() else ""


def assert_warned_not_erred(m: Mounted, *needles: str) -> None:
    text = daemon_log(m)
    warnings = [line for line in text.splitlines() if " WARNING " in line]
    assert warnings, f"no WARNING in the daemon log:\n{text[-3000:]}"
    for needle in needles:
        assert any(needle in line for line in warnings), (
            f"no WARNING mentioning {needle!r}:\n" + "\n".join(warnings[-20:]))
    assert " ERROR " not in text and "Traceback" not in text, text[-3000:]


# -- a tmpfs as the backing directory ------------------------------------------------------


class Tmpfs:
    def __init__(self, path: Path) -> None:
        self.path = path

    def remount(self, options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(self.path)],
                       check=True, capture_output=True, timeout=30)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    """An 8 MiB tmpfs for DIR, unmounted at the end.

    Request it *before* ``memfs_mount``: fixtures are torn down in reverse
    order, so the memfs mount (which writes back into DIR when it goes away) is
    unmounted first.  Tests that make DIR full or read-only restore it in a
    ``finally`` for the same reason.
    """
    path = tmp_path / "backing"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(path)],
                   check=True, capture_output=True, timeout=30)
    try:
        yield Tmpfs(path)
    finally:
        res = subprocess.run(["umount", str(path)], capture_output=True, text=True)
        if res.returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
            pytest.fail(f"could not unmount the tmpfs {path}: {res.stderr}")


def kill_daemon(m: Mounted) -> None:
    """SIGKILL the daemon; detach its dead mount (the conftest cleanup then finds it gone)."""
    os.kill(m.pid, signal.SIGKILL)
    assert wait_gone(m.pid, 10), f"daemon {m.pid} survived SIGKILL"
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True, timeout=30)


# -- 1. mirroring a tree ----------------------------------------------------------------------


OLD_NS = 1_600_000_000_123_456_789


def build_tree(mnt: Path) -> None:
    """2,000 small files in nested directories, large random files, symlinks, hard
    links, empty files and directories, odd modes and mtimes."""
    rng = random.Random(1)
    for d in range(20):
        for s in range(5):
            sub = mnt / f"d{d:02}" / f"s{s}"
            sub.mkdir(parents=True)
            for f in range(20):
                size = 0 if f == 7 else rng.randrange(1, 6000)
                (sub / f"f{f:03}").write_bytes(rng.randbytes(size))
    (mnt / "big").mkdir()
    for n in range(3):
        (mnt / "big" / f"L{n}").write_bytes(os.urandom(24 * MiB))
    links = mnt / "links"
    links.mkdir()
    (links / "rel").symlink_to("../d00/s0/f000")
    (links / "dangling").symlink_to("/nonexistent/target")
    (links / "todir").symlink_to("../d01")
    (links / "old").symlink_to("d00")
    os.utime(links / "old", ns=(OLD_NS, OLD_NS), follow_symlinks=False)
    hard = mnt / "hard"
    hard.mkdir()
    (hard / "a").write_bytes(b"hard link\n" * 1000)
    os.link(hard / "a", hard / "b")
    os.link(mnt / "d00/s0/f001", mnt / "d01/s0/hl")
    os.link(mnt / "d02/s0/f001", hard / "c")
    os.link(mnt / "d02/s0/f001", hard / "c2")
    (mnt / "empty").mkdir()
    for n in range(5):
        (mnt / "empty" / f"e{n}").write_bytes(b"")
    (mnt / "emptydirs/x/y/z").mkdir(parents=True)
    (mnt / "emptydirs/w").mkdir()
    (mnt / "d00/s0/f002").chmod(0o600)
    (mnt / "d00/s0/f003").chmod(0o755)
    (mnt / "d00/s0/f004").chmod(0o444)
    (mnt / "d00/s1").chmod(0o750)
    (mnt / "emptydirs/w").chmod(0o711)
    os.utime(mnt / "d00/s0/f005", ns=(OLD_NS, OLD_NS))
    os.utime(mnt / "big/L0", ns=(OLD_NS, OLD_NS + 1))
    os.utime(mnt / "empty/e1", ns=(OLD_NS, 0))
    os.chown(mnt / "d00/s0/f006", 1234, 5678)
    os.chown(mnt / "d00/s2", 1234, 5678)


_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """renameat2(RENAME_EXCHANGE); False where the C library lacks it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))
    return True


def mutate_tree(mnt: Path, kick: Callable[[], None]) -> None:
    """Renames of files and directories, deletes, rewrites and attribute changes.

    In rounds: make files dirty, ``kick()`` (write-back of them starts and is
    seen under way), then move them and their directories about, delete them,
    rewrite them.
    """
    rng = random.Random(2)

    def rewrite(*dirs: str) -> None:
        for d in dirs:
            for p in sorted((mnt / d).rglob("f*")):
                if p.is_file():
                    p.write_bytes(rng.randbytes(rng.randrange(1, 30000)))

    # 1: directories full of files being copied are renamed; so is a large file.
    rewrite("d05", "d06")
    (mnt / "d05/s0/big").write_bytes(os.urandom(24 * MiB))
    (mnt / "big/L0").write_bytes(os.urandom(24 * MiB))
    os.utime(mnt / "big/L0", ns=(OLD_NS, OLD_NS + 1))
    kick()
    os.rename(mnt / "d05", mnt / "d05-renamed")
    os.rename(mnt / "d06/s1", mnt / "d07/s1-moved")  # ... to another parent
    os.rename(mnt / "big/L0", mnt / "big/L0-renamed")

    # 2: files being copied are rewritten, deleted, replaced; a tree is removed.
    rewrite("d08", "d09", "d10")
    (mnt / "big/L1").write_bytes(os.urandom(24 * MiB))
    (mnt / "big/L2").write_bytes(os.urandom(24 * MiB))
    (mnt / "d09/big").write_bytes(os.urandom(16 * MiB))
    kick()
    (mnt / "big/L1").write_bytes(os.urandom(24 * MiB))
    os.unlink(mnt / "big/L2")
    for s in range(5):
        for f in range(10):
            os.unlink(mnt / f"d08/s{s}/f{f:03}")
    shutil.rmtree(mnt / "d09")
    os.rename(mnt / "d10/s0/f000", mnt / "d10/s0/f001")  # replaces a file

    # 3: everything else, while new files are being copied.
    rewrite("d11", "d12", "d14", "d15", "d16")
    (mnt / "new").mkdir()
    for n in range(50):
        (mnt / f"new/n{n}").write_bytes(rng.randbytes(rng.randrange(1, 70000)))
    (mnt / "d16/big").write_bytes(os.urandom(24 * MiB))
    kick()
    for n in range(50):
        os.rename(mnt / f"new/n{n}", mnt / f"new/m{n}")
    os.rename(mnt / "d16", mnt / "d05-renamed/d16")  # into a renamed directory
    os.rename(mnt / "d05-renamed", mnt / "d05-again")  # renamed twice
    os.rename(mnt / "d11/s0/f010", mnt / "d11/s0/swap")  # a three-way swap
    os.rename(mnt / "d11/s0/f011", mnt / "d11/s0/f010")
    os.rename(mnt / "d11/s0/swap", mnt / "d11/s0/f011")
    (mnt / "d11/s0/f000").chmod(0o640)
    os.utime(mnt / "d11/s0/f001", ns=(OLD_NS, OLD_NS + 7))
    os.rename(mnt / "links/rel", mnt / "links/rel-renamed")
    os.unlink(mnt / "hard/a")  # hard/b lives on
    os.link(mnt / "d12/s0/f000", mnt / "hard/late")  # a new link of a dirty file
    os.rename(mnt / "d12", mnt / "d12-old")  # and a new directory with the old name
    (mnt / "d12").mkdir(mode=0o700)
    (mnt / "d12/fresh").write_bytes(b"fresh\n")
    (mnt / "d13-target").mkdir()
    os.rename(mnt / "d13", mnt / "d13-target")  # a directory over an empty one
    shutil.rmtree(mnt / "emptydirs/x/y")
    exchange(mnt / "d14/s0", mnt / "d14/s1")
    with open(mnt / "d15/s0/f000", "ab") as fh:  # an append
        fh.write(b"appended\n" * 100)
    os.truncate(mnt / "d15/s0/f001", 3)  # a truncate


def test_tree_mirrors_through_flush_and_umount(memfs_mount: MountFn, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    # 2,000 small files take 64 KiB chunks each: room for them and the large ones.
    m = memfs_mount("--size", "512M", "--backing", str(backing), "--flush-delay", "0.5")
    build_tree(m.path)  # written back as it is built, 0.5 s after each file's last write
    kicks: list[dict[str, Any]] = []
    with control(m) as client:
        mutate_tree(m.path, lambda: kicks.append(start_writeback(client)))
    assert len(kicks) == 3 and all(s["dirty_files"] > 0 for s in kicks), kicks

    flush_wait(m, timeout=90)
    st = status(m)
    assert st["dirty_files"] == 0 and st["namespace_ops"] == 0 and not st["errors"], st
    expected = tree_manifest(m.path)
    assert "big/L0-renamed" in expected and "d05-again/d16/s0/f000" in expected
    assert expected["d15/s0/f001"][0] == "file"
    assert_same_tree(expected, tree_manifest(backing), "DIR after flush --wait")
    assert link_groups(backing) == link_groups(m.path)
    assert owners(backing) == owners(m.path)
    assert tmp_leftovers(backing) == []

    memfs("umount", m.path, timeout=90)
    assert_same_tree(expected, tree_manifest(backing), "DIR after umount")
    assert tmp_leftovers(backing) == []


# -- 2. unmount drains; --discard-on-unmount; read-through ---------------------------------


def test_umount_drains_and_a_new_mount_reads_through(
    memfs_mount: MountFn, tmp_path: Path,
) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    m = mount_backed(memfs_mount, backing, "--flush-delay", "60")
    rng = random.Random(3)
    files = {f"out/r{n}/f{k}": rng.randbytes(rng.randrange(0, 300_000))
             for n in range(4) for k in range(25)}
    files["out/big"] = os.urandom(40 * MiB)
    for name, data in files.items():
        write_file(m.path / name, data)
    (m.path / "out/r0/f0").chmod(0o640)
    os.utime(m.path / "out/r1/f1", ns=(OLD_NS, OLD_NS))
    (m.path / "out/link").symlink_to("r0/f0")
    os.link(m.path / "out/r2/f2", m.path / "out/hardlink")
    st = status(m)
    assert st["dirty_files"] == len(files) and st["flush_delay"] == 60, st
    assert not any((backing / "out").rglob("f*")), "written back before its delay"
    expected = tree_manifest(m.path)

    memfs("umount", m.path, timeout=90)  # must write everything back first
    assert_same_tree(expected, tree_manifest(backing), "DIR after umount")
    assert tmp_leftovers(backing) == []

    # A new mount over DIR shows the files; their data is read through from DIR.
    m2 = mount_backed(memfs_mount, backing, "--flush-delay", "60", "--discard-on-unmount")
    st = status(m2)
    assert st["evicted_files"] >= len([d for d in files.values() if d]), st
    assert st["dirty_files"] == 0, st
    assert_same_tree(expected, tree_manifest(m2.path), "a new mount over DIR")
    assert link_groups(m2.path) == link_groups(backing) == {
        frozenset({"out/r2/f2", "out/hardlink"})}
    assert status(m2)["fetched_bytes"] >= sum(map(len, files.values()))

    # --discard-on-unmount: new files and changes are dropped, DIR stays as it was.
    write_file(m2.path / "out/r0/f1", b"changed, then discarded")
    write_file(m2.path / "out/new", os.urandom(MiB))
    write_file(m2.path / "discarded", b"x" * 1000)
    assert status(m2)["dirty_files"] == 3
    memfs("umount", m2.path, timeout=60)
    assert_same_tree(expected, tree_manifest(backing), "DIR after --discard-on-unmount")
    assert tmp_leftovers(backing) == []


# -- 3. SIGKILL ----------------------------------------------------------------------------------


def test_sigkill_keeps_what_flush_wait_reported(memfs_mount: MountFn, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    m = mount_backed(memfs_mount, backing, "--flush-delay", "60")
    rng = random.Random(5)
    for n in range(200):
        write_file(m.path / f"a/d{n % 7}/f{n}", rng.randbytes(rng.randrange(0, 50_000)))
    write_file(m.path / "a/big0", os.urandom(16 * MiB))
    write_file(m.path / "a/big1", os.urandom(16 * MiB), mode=0o600)
    (m.path / "a/sym").symlink_to("big0")
    flush_wait(m)
    assert status(m)["dirty_files"] == 0
    flushed = tree_manifest(m.path)

    # More changes, and write-back of them under way, when the daemon is killed.
    old_sums: dict[str, set[str]] = {}
    for name in ("a/big0", "a/d1/f1", "a/d2/f2"):
        old_sums[name] = {flushed[name][3]}
        data = os.urandom(len((m.path / name).read_bytes()) or 10)
        write_file(m.path / name, data)
        old_sums[name].add(sha(data))
    unflushed: dict[str, str] = {}
    for n in range(300):
        data = rng.randbytes(rng.randrange(1, 40_000))
        write_file(m.path / f"b/d{n % 5}/g{n}", data)
        unflushed[f"b/d{n % 5}/g{n}"] = sha(data)
    # Kill it while a large copy is half done (small ones come and go too fast to
    # catch).  On a loaded machine the whole write-back may be over before we look:
    # then the large file is rewritten and written back again, until we catch it.
    huge: set[str] = set()  # every version written (an earlier one may be in DIR)
    for attempt in range(5):
        data = os.urandom(96 * MiB)
        write_file(m.path / "b/huge", data)
        huge.add(sha(data))
        with control(m) as client:
            st = start_writeback(client, or_done=True)
        deadline = time.monotonic() + 10
        caught = False
        while not caught and time.monotonic() < deadline and st["dirty_files"] > 0:
            caught = max(tmp_sizes(backing), default=0) >= MiB
        if caught:
            break
        assert attempt < 4, "no large copy seen in progress in .memfs-tmp"
    kill_daemon(m)
    assert st["dirty_files"] > 0

    # DIR: what flush --wait reported is intact; everything else is whole or absent.
    # Leftovers: the killed daemon's copy in progress, and another killed one's.
    planted = backing / TMP_DIR / f"{socket.gethostname()}-999999999" / "99.1.deadbeef"
    planted.parent.mkdir()
    planted.write_bytes(b"a leftover of a killed daemon")
    leftovers = tmp_leftovers(backing)
    have = tree_manifest(backing)
    for name, entry in flushed.items():
        assert name in have, f"{name} was reported clean but is missing after SIGKILL"
        if name in old_sums:
            assert have[name][3] in old_sums[name], f"{name} in DIR is not a whole version"
        else:
            assert have[name] == entry, f"{name}: flushed {entry}, after SIGKILL {have[name]}"
    for name, entry in have.items():
        if name in flushed:
            continue
        if entry[0] == "dir":
            assert name in ("b", "b/d0", "b/d1", "b/d2", "b/d3", "b/d4"), name
            continue
        if name == "b/huge":
            assert entry[3] in huge, f"{name} is torn in DIR"
            continue
        assert name in unflushed, f"unexpected {name} in DIR"
        assert entry[3] == unflushed[name], f"{name} is torn in DIR"

    # The next mount over DIR removes the leftovers and shows the files.
    m2 = mount_backed(memfs_mount, backing, "--flush-delay", "60")
    assert tmp_leftovers(backing) == [], f"left over from before: {leftovers}"
    assert_same_tree(have, tree_manifest(m2.path), "a new mount over DIR after SIGKILL")


# -- 4. versions --------------------------------------------------------------------------------


VERSION_WRITER = r"""
import os, sys, time
path, first, last, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fd = os.open(path, os.O_WRONLY)
for v in range(first, last + 1):
    data = bytes([v]) * size
    # One write() per version: the file in memfs is a mix only for the instant
    # between the kernel's FUSE write requests of this one call.
    assert os.pwrite(fd, data, 0) == size
    if v % 8 == 0:
        time.sleep(0.15)  # long enough for a copy to finish and be published
os.close(fd)
"""


def mid_write(sample: bytes) -> bool:
    """The one mix memfs itself holds: a 8 MiB pwrite reaches the daemon as 1 MiB FUSE
    requests in order, so between two of them the file *is* version n+1 up to a 1 MiB
    boundary and version n after it; a copy of that state is a whole memfs version.
    (A writer stalled there, on a loaded CI machine, made this happen.)  A copy that
    ignored versions would mostly show the other shape: older bytes first."""
    new, old = sample[0], sample[-1]
    cut = sample.find(bytes([old]))
    return (new == old + 1 and cut % MiB == 0
            and sample[:cut] == bytes([new]) * cut and sample[cut:] == bytes([old]) * (len(sample) - cut))


def test_rewritten_file_lands_as_whole_versions(memfs_mount: MountFn, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    m = mount_backed(memfs_mount, backing, "--flush-delay", "0")
    size, last = 8 * MiB, 64
    write_file(m.path / "v", bytes([1]) * size)
    flush_wait(m)
    writer = subprocess.Popen([sys.executable, "-c", VERSION_WRITER,
                               str(m.path / "v"), "2", str(last), str(size)])
    seen: list[int] = []
    bad: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while writer.poll() is None and time.monotonic() < deadline:
            sample = (backing / "v").read_bytes()
            if len(sample) != size or (
                sample != bytes([sample[0]]) * size and not mid_write(sample)
            ):
                parts = sorted({(b, sample.count(b)) for b in set(sample)})
                bad.append(f"{len(sample)} bytes, (byte, count): {parts[:8]}")
            elif not seen or seen[-1] != sample[0]:
                seen.append(sample[0])
            time.sleep(0.003)
        assert writer.wait(timeout=30) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert not bad, f"DIR held a mix of versions: {bad[:5]}"
    assert len(seen) >= 3, f"too few versions published during the run: {seen}"
    assert seen == sorted(seen), f"versions went backwards in DIR: {seen}"
    flush_wait(m)
    assert (backing / "v").read_bytes() == bytes([last]) * size
    assert_same_tree(tree_manifest(m.path), tree_manifest(backing), "DIR after the last version")


# -- 5. backing-filesystem faults ---------------------------------------------------------------


def test_backing_full(tmpfs: Tmpfs, memfs_mount: MountFn) -> None:
    backing = tmpfs.path
    m = mount_backed(memfs_mount, backing, "--flush-delay", "0.2")
    try:
        files = {f"out/f{n}": os.urandom(3 * MiB) for n in range(6)}  # 18 MiB > 8 MiB
        for name, data in files.items():
            write_file(m.path / name, data)  # the application sees no error
        st = wait_status(m, lambda s: bool(error_paths(s) & files.keys()),
                         "write-back errors naming the files")
        assert any("No space left" in e["error"] for e in st["errors"]), st["errors"]
        assert st["dirty_files"] > 0, st
        time.sleep(1)  # retries keep failing; nothing is dropped meanwhile
        st = status(m)
        assert st["dirty_files"] > 0 and st["errors"], st
        for name, data in files.items():
            assert sha256_file(m.path / name) == sha(data), name
            if (backing / name).exists():
                assert sha256_file(backing / name) == sha(data), f"{name} is torn in DIR"

        tmpfs.remount("size=64m")
        wait_status(m, lambda s: s["dirty_files"] == 0 and s["namespace_ops"] == 0,
                    "write-back to finish once there is space", timeout=60)
        assert_same_tree(tree_manifest(m.path), tree_manifest(backing), "DIR after ENOSPC")
        assert tmp_leftovers(backing) == []
        assert not status(m)["errors"]
        assert_warned_not_erred(m, "No space left")
    finally:
        tmpfs.remount("rw,size=256m")


def test_backing_read_only(tmpfs: Tmpfs, memfs_mount: MountFn) -> None:
    backing = tmpfs.path
    tmpfs.remount("size=64m")
    m = mount_backed(memfs_mount, backing, "--flush-delay", "0.2")
    try:
        mnt = m.path
        write_file(mnt / "d/x", os.urandom(MiB))
        write_file(mnt / "d/y", b"y" * 1000)
        write_file(mnt / "z", b"z" * 1000)
        flush_wait(m)
        base = tree_manifest(backing)

        tmpfs.remount("ro")
        write_file(mnt / "d/new", os.urandom(2 * MiB))
        write_file(mnt / "d/x", os.urandom(MiB // 2), mode=0o600)
        (mnt / "e").mkdir()
        write_file(mnt / "e/f", b"in a new directory")
        os.rename(mnt / "z", mnt / "z2")
        os.unlink(mnt / "d/y")
        expected = tree_manifest(mnt)
        st = wait_status(m, lambda s: bool(s["errors"]), "write-back errors")
        assert any("Read-only" in e["error"] for e in st["errors"]), st["errors"]
        time.sleep(1)
        st = status(m)
        assert st["dirty_files"] >= 3 and st["namespace_ops"] > 0 and st["errors"], st
        assert tree_manifest(backing) == base, "DIR changed while read-only?"
        assert_same_tree(expected, tree_manifest(mnt), "MNT while DIR is read-only")

        tmpfs.remount("rw")
        flush_wait(m, timeout=60)
        assert_same_tree(expected, tree_manifest(backing), "DIR once writable again")
        assert tmp_leftovers(backing) == []
        assert not status(m)["errors"]
        assert_warned_not_erred(m, "Read-only file system")
    finally:
        tmpfs.remount("rw,size=256m")


def test_namespace_changes_wait_no_longer_than_the_fault(
    tmpfs: Tmpfs, memfs_mount: MountFn,
) -> None:
    """Only namespace changes pending (no dirty file) while DIR is read-only: once it
    is writable again, ``flush --wait`` applies them now, not after the retry backoff."""
    backing = tmpfs.path
    m = mount_backed(memfs_mount, backing, "--flush-delay", "0.2")
    try:
        write_file(m.path / "a", b"a")
        (m.path / "dir").mkdir()
        flush_wait(m)
        tmpfs.remount("ro")
        os.rename(m.path / "a", m.path / "dir/a")
        (m.path / "dir").chmod(0o700)
        (m.path / "other").mkdir()
        # Let a few retries fail, so that the next one is several seconds away.
        wait_status(m, lambda s: any(e["count"] >= 4 for e in s["errors"]),
                    "four failed attempts", timeout=30)
        tmpfs.remount("rw")
        start = time.monotonic()
        flush_wait(m, timeout=60)
        took = time.monotonic() - start
        assert_same_tree(tree_manifest(m.path), tree_manifest(backing), "DIR")
        assert took < 3, f"flush --wait took {took:.1f} s after DIR became writable"
    finally:
        tmpfs.remount("rw,size=256m")


def flushed_tree(memfs_mount: MountFn, backing: Path) -> Mounted:
    """A mount over *backing* with a small tree written back (private directories too)."""
    m = mount_backed(memfs_mount, backing, "--flush-delay", "0.2")
    mnt = m.path
    write_file(mnt / "a/b/f1", os.urandom(300_000), mode=0o640)
    write_file(mnt / "a/b/f2", b"two" * 1000)
    write_file(mnt / "a/b/c/f3", b"three" * 1000)
    write_file(mnt / "t", b"top")
    (mnt / "a/b").chmod(0o750)
    (mnt / "a/b/c").chmod(0o700)
    flush_wait(m)
    assert_same_tree(tree_manifest(mnt), tree_manifest(backing), "DIR before the damage")
    return m


def test_backing_subdirectory_vanishes(memfs_mount: MountFn, tmp_path: Path) -> None:
    """A subtree of DIR vanishes behind memfs's back: files changed afterwards are
    written back, with the directories above them as they are in memfs."""
    backing = tmp_path / "backing"
    backing.mkdir()
    m = flushed_tree(memfs_mount, backing)
    shutil.rmtree(backing / "a")
    write_file(m.path / "a/b/f1", os.urandom(200_000))
    write_file(m.path / "a/b/c/new", b"new" * 1000)
    flush_wait(m, timeout=30)
    assert_same_subtree(m.path, backing, ["a", "a/b", "a/b/c", "a/b/f1", "a/b/c/new"],
                        "DIR after a/ vanished")
    assert tmp_leftovers(backing) == []
    assert not status(m)["errors"]


def test_backing_directory_emptied(memfs_mount: MountFn, tmp_path: Path) -> None:
    """Everything in DIR vanishes, ``.memfs-tmp`` too: write-back makes what it needs."""
    backing = tmp_path / "backing"
    backing.mkdir()
    m = flushed_tree(memfs_mount, backing)
    for p in list(backing.iterdir()):
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    write_file(m.path / "t", b"top, again")
    write_file(m.path / "a/b/f2", b"two, again")
    flush_wait(m, timeout=30)
    assert_same_subtree(m.path, backing, ["t", "a", "a/b", "a/b/f2"],
                        "DIR after everything in it vanished")
    assert tmp_leftovers(backing) == []
    assert not status(m)["errors"]


# -- 6. backpressure ---------------------------------------------------------------------------


STREAM_WRITER = r"""
import hashlib, os, sys
path, total = sys.argv[1], int(sys.argv[2])
h = hashlib.sha256()
with open(path, "wb", buffering=0) as f:
    for _ in range(total >> 20):
        block = os.urandom(1 << 20)
        h.update(block)
        f.write(block)
print(h.hexdigest())
"""


def test_dirty_cap_makes_writers_wait(tmpfs: Tmpfs, memfs_mount: MountFn) -> None:
    backing = tmpfs.path
    m = memfs_mount("--size", "128M", "--backing", str(backing), "--dirty-max", "16M",
                    "--flush-delay", "0")
    total = 48 * MiB
    writer = None
    try:
        tmpfs.remount("ro")  # nothing can be written back
        writer = subprocess.Popen([sys.executable, "-c", STREAM_WRITER,
                                   str(m.path / "stream"), str(total)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        st = wait_status(m, lambda s: s["writers_waiting"] > 0, "a writer waiting")
        cap = st["dirty_max"]
        assert cap == 16 * MiB
        for _ in range(10):
            assert writer.poll() is None, f"the writer ended: {writer.communicate()}"
            st = status(m)
            assert st["writers_waiting"] > 0, st
            assert st["dirty_bytes"] <= cap + MiB, st
            assert st["used"] <= cap + 2 * MiB < st["capacity"], st
            time.sleep(0.1)
        assert os.stat(m.path / "stream").st_size <= cap + MiB
        assert st["errors"], st

        tmpfs.remount("rw,size=256m")
        out, err = writer.communicate(timeout=90)
        assert writer.returncode == 0, err
        digest = out.strip()
        flush_wait(m)
        assert sha256_file(m.path / "stream") == digest
        assert sha256_file(backing / "stream") == digest
        assert_same_tree(tree_manifest(m.path), tree_manifest(backing), "DIR")
        assert_warned_not_erred(m, "Read-only file system")
    finally:
        tmpfs.remount("rw,size=256m")  # first: a writer blocked on the cap can then go on
        if writer is not None and writer.poll() is None:
            writer.kill()
            writer.wait()


def test_backing_filesystem_unmounted(memfs_mount: MountFn, tmp_path: Path) -> None:
    """DIR's filesystem goes away (a parallel filesystem unmounted under the job):
    memfs must not re-create DIR on whatever is left at that path (the node's root
    disk), must not report the new data as written back, and must keep it."""
    lus = tmp_path / "lus"
    lus.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(lus)], check=True)
    try:
        (lus / "job").mkdir()
        m = mount_backed(memfs_mount, lus / "job", "--flush-delay", "0.2", "--discard-on-unmount")
        write_file(m.path / "a", b"before")
        flush_wait(m)
        assert (lus / "job" / "a").read_bytes() == b"before"
    finally:
        subprocess.run(["umount", "-l", str(lus)], check=True)
    write_file(m.path / "b", b"after")
    # Still retrying: --wait cannot be satisfied; give it a few seconds, not forever.
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([*MEMFS, "flush", "--wait", str(m.path)], capture_output=True, timeout=4)
    st = wait_status(m, lambda s: any("vanished" in e["error"] for e in s["errors"]),
                     "an error saying DIR vanished")
    assert st["dirty_files"] >= 1, st
    assert not (lus / "job").exists(), "DIR was re-created on the filesystem underneath"
    assert (m.path / "a").read_bytes() == b"before" and (m.path / "b").read_bytes() == b"after"


# -- review findings: renames that replace or swap files only partly in DIR ------------------


def test_rename_over_an_open_file_keeps_its_data(memfs_mount: MountFn, tmp_path: Path) -> None:
    """`mv new old` while `old` (never read, data only in DIR) is open: the open handle
    keeps reading old's bytes, not new's."""
    backing = tmp_path / "backing"
    backing.mkdir()
    old, new = os.urandom(300_000), os.urandom(200_000)
    (backing / "old").write_bytes(old)
    (backing / "new").write_bytes(new)
    m = mount_backed(memfs_mount, backing, "--flush-delay", "60")
    with open(m.path / "old", "rb") as f:
        os.rename(m.path / "new", m.path / "old")
        flush_wait(m)  # the rename reaches DIR: old's copy there is replaced
        assert sha((backing / "old").read_bytes()) == sha(new)
        assert sha(f.read()) == sha(old)
    assert sha((m.path / "old").read_bytes()) == sha(new)


def test_exchange_with_a_file_not_yet_written_back(memfs_mount: MountFn, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    (backing / "a").write_bytes(b"a, from DIR")
    m = mount_backed(memfs_mount, backing, "--flush-delay", "60")
    write_file(m.path / "b", b"b, only in memory")
    if not exchange(m.path / "a", m.path / "b"):
        pytest.skip("no renameat2 in this C library")
    flush_wait(m)
    assert (backing / "a").read_bytes() == b"b, only in memory"
    assert (backing / "b").read_bytes() == b"a, from DIR"
    assert tmp_leftovers(backing) == []


def test_hard_links_into_a_vanished_directory(memfs_mount: MountFn, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    m = mount_backed(memfs_mount, backing, "--flush-delay", "0.2")
    (m.path / "d").mkdir()
    write_file(m.path / "d" / "f", b"linked")
    os.link(m.path / "d" / "f", m.path / "g")
    flush_wait(m)
    shutil.rmtree(backing / "d")
    write_file(m.path / "d" / "f", b"linked, changed")
    flush_wait(m, timeout=30)
    assert (backing / "d" / "f").read_bytes() == b"linked, changed"
    assert os.path.samefile(backing / "d" / "f", backing / "g")
    assert tmp_leftovers(backing) == []


def test_shutdown_with_a_hung_backing_directory(memfs_mount: MountFn) -> None:
    """DIR stops answering (its servers are gone: here a FUSE filesystem whose daemon
    is stopped).  Unmounting waits for write-back as ever; a second signal gives up,
    and then the daemon exits at once, however many of its threads are stuck in DIR."""
    lus = memfs_mount("--size", "64M")  # the "parallel filesystem"
    (lus.path / "job").mkdir()
    m = mount_backed(memfs_mount, lus.path / "job", "--flush-delay", "0.1")
    m.expect_errors = True  # "exiting without writing back ...": asked to
    write_file(m.path / "before", b"written back\n")
    flush_wait(m)
    assert (lus.path / "job" / "before").read_bytes() == b"written back\n"
    os.kill(lus.pid, signal.SIGSTOP)
    try:
        for n in range(4):
            write_file(m.path / f"stuck{n}", os.urandom(3 << 20))  # copies hang in DIR
        time.sleep(1.0)
        os.kill(m.pid, signal.SIGTERM)  # drains: cannot finish
        time.sleep(1.0)
        assert not wait_gone(m.pid, 0.5), "exited without writing back, unasked"
        os.kill(m.pid, signal.SIGTERM)  # gives up
        assert wait_gone(m.pid, 20), "the daemon hung on the stopped backing directory"
        assert "exiting without writing back" in daemon_log(m)
    finally:
        os.kill(lus.pid, signal.SIGCONT)


def test_punched_holes_are_written_back(memfs_mount: MountFn, tmp_path: Path) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE) with a backing directory: in a file only in
    DIR (not fetched yet) the range reads as zeros at once and the rest as DIR's
    bytes; in a file written here it frees the pool memory; either way DIR's copy
    shows the hole after write-back (a new version, like any change)."""
    backing = tmp_path / "backing"
    backing.mkdir()
    rng = random.Random(5)
    old = bytearray(rng.randbytes(3 * MiB + 100))
    (backing / "old").write_bytes(old)
    m = mount_backed(memfs_mount, backing, "--flush-delay", "60")
    new = bytearray(rng.randbytes(4 * MiB))
    write_file(m.path / "new", new)
    flush_wait(m)
    for name, data, off, n in (("old", old, 100_000, MiB), ("new", new, MiB - 1, 2 * MiB + 2)):
        fd = os.open(m.path / name, os.O_RDWR)
        try:
            fallocate(fd, PUNCH, off, n)
            assert os.fstat(fd).st_size == len(data)
        finally:
            os.close(fd)
        data[off:off + n] = bytes(n)
        assert sha((m.path / name).read_bytes()) == sha(data), name
    assert status(m)["dirty_files"] == 2
    flush_wait(m)
    assert sha((backing / "old").read_bytes()) == sha(old)
    assert sha((backing / "new").read_bytes()) == sha(new)
    assert sha((m.path / "old").read_bytes()) == sha(old)
