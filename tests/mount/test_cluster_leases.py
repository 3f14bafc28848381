"""Leases with recall, end to end: real mounts on two client hosts (see test_cluster.py).

What the lease protocol promises (docs/ARCHITECTURE.md, memfs/meta/leases.py),
checked with real processes and real kernels' caches:

* a change on one node is visible to the other node's very next call, however
  warm that node's caches (its daemon's and its kernel's: attributes, dentries,
  negative dentries, pages, open files);
* a client that cannot answer a recall (stopped) delays a change at most
  ``--recall-timeout + --lease-term``, and serves nothing stale when it runs again;
* a client that dies releases its leases at once, its open files after ``--grace``;
* an mds restart from its journal loses no byte and leaks no chunk;
* a writer whose lease was taken without its word (evicted, or back after the
  restarted mds's ``--grace``) hears EIO, and nobody reads the lost tail as data;
* space taken ahead of need comes back at close, and ENOSPC still comes at write(2).

Short timings (``--lease-term 2 --recall-timeout 1 --grace 5``) keep this quick.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import random
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from memfs.cli.runtime import alive, pid_file
from tests.conftest import wait_gone
from tests.mount.test_cluster import PORT_MDS, Cluster, fill, make_cluster, sha, until, wait_line
from tests.mount.test_cluster import pytestmark as cluster_marks
from tests.mount.test_space import PUNCH, fallocate

# Skipped as test_cluster.py is (root, /dev/fuse, network namespaces).
pytestmark = [*cluster_marks, pytest.mark.timeout(120)]

LEASE_TERM, RECALL_TIMEOUT, GRACE = 2.0, 1.0, 5.0
#: what a machine under load may add to a documented bound
SLACK = 1.0
CHUNK = 64 << 10
STRIPE = 1 << 20
POOL = 4 * (128 << 20)  # make_cluster: 2 memd x 2 volumes x 128 MiB
#: a read(2) size larger than any file here: one call reads the whole file
WHOLE = 4 << 20

HOLDER = """
import os, random, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
os.write(fd, random.Random(int(sys.argv[2])).randbytes(int(sys.argv[3])))
os.fsync(fd)
print("holding", flush=True)
sys.stdin.read()
"""

WRITER = """
import os, random, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
rng = random.Random(int(sys.argv[2]))
total = 0
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "write":
        try:
            for _ in range(int(args[0])):
                total += os.write(fd, rng.randbytes(int(args[1])))
        except OSError as exc:
            print("write failed", exc.errno, flush=True)
            continue
        print("wrote", total, flush=True)
    elif cmd == "fsync":
        try:
            os.fsync(fd)
        except OSError as exc:
            print("fsync failed", exc.errno, flush=True)
            continue
        print("fsynced", flush=True)
    elif cmd == "close":
        try:
            os.close(fd)
        except OSError as exc:
            print("close failed", exc.errno, flush=True)
            break
        print("closed", total, flush=True)
        break
"""

CREATOR = """
import os, sys, time
d, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
worst = 0.0
for i in range(n):
    t = time.monotonic()
    with open(os.path.join(d, tag + str(i)), "wb") as f:
        f.write(tag.encode())
    worst = max(worst, time.monotonic() - t)
print("worst", round(worst, 3), flush=True)
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    mds_args = [
        "--journal", str(tmp_path / "journal"), "--lease-term", str(LEASE_TERM),
        "--recall-timeout", str(RECALL_TIMEOUT), "--grace", str(GRACE),
    ]
    with make_cluster(tmp_path, mds_args) as c:
        yield c


def daemon_pid(mnt: Path) -> int:
    return int(pid_file(str(mnt)).read_text())


def used(mnt: Path) -> int:
    """Bytes of the pool in use, as statfs on *mnt* reports them."""
    st = os.statvfs(mnt)
    assert st.f_blocks * st.f_frsize == POOL
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def chunks(n: int) -> int:
    """Bytes of whole chunks a file of *n* bytes takes."""
    return -(-n // CHUNK) * CHUNK


def wait_used(mnt: Path, expected: int, timeout: float) -> float:
    """Poll statfs until *expected* bytes are in use; returns when (time.monotonic)."""
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        got = used(mnt)
        if got == expected:
            return now
        if now > deadline:
            raise AssertionError(f"{got} bytes in use after {timeout} s, expected {expected}")
        time.sleep(0.05)


def same_stat(first: Path, second: Path) -> os.stat_result:
    """stat *first* (the node that did not make the change: its very next call), then
    *second*: both nodes must agree on everything the mds keeps."""
    s1, s2 = first.stat(), second.stat()
    fields = ("st_ino", "st_mode", "st_nlink", "st_size", "st_mtime_ns", "st_ctime_ns")
    assert [getattr(s1, f) for f in fields] == [getattr(s2, f) for f in fields], (first, s1, s2)
    return s1


def log_lines(cluster: Cluster, name: str, *words: str) -> list[str]:
    path = cluster.tmp / name
    text = path.read_text() if path.exists() else ""
    return [line for line in text.splitlines() if any(w in line for w in words)]


@contextlib.contextmanager
def on_host(cluster: Cluster, host: str, script: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A Python process on *host*, talking over pipes; killed and reaped at the end."""
    proc = subprocess.Popen(
        cluster.net.cmd(host, [sys.executable, "-c", script, *args]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def tell(proc: subprocess.Popen[bytes], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")


@contextlib.contextmanager
def stopped(pid: int, already: bool = False) -> Iterator[None]:
    """*pid* SIGSTOPped for the block (*already*: it is); always continued (a stopped
    daemon would hang the fixture's unmount)."""
    if not already:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)


# -- 1. coherence with warm caches ------------------------------------------------------------


@dataclass
class Expected:
    """What the shared directory holds; both nodes must always show exactly this."""

    data: bytes = b""
    mode: int = 0o644
    names: dict[str, bytes] = field(default_factory=dict)


def check_file(b: Path, a: Path, want: bytes, read_first: bool) -> None:
    """B's very next call after A's change sees it (alternately a read and a stat)."""
    if read_first:
        assert b.read_bytes() == want, b
    st = same_stat(b, a)
    assert st.st_size == len(want)
    if not read_first:
        assert b.read_bytes() == want, b


def check_names(b: Path, exp: Expected) -> None:
    assert sorted(os.listdir(b)) == sorted(exp.names)


def coherence_round(a: Path, b: Path, r: int, exp: Expected) -> None:
    """B warms every cache it has, A changes things, B's next calls must see each change."""
    rng = random.Random(r)
    co_a, co_b = a / "co", b / "co"
    f_a, f_b = co_a / "f", co_b / "f"
    first = r % 4 < 2  # read before stat, or stat before read

    # B's caches: pages and attributes of f, the listing, a negative entry, the last
    # round's names.
    assert f_b.read_bytes() == exp.data
    assert stat.S_IMODE(f_b.stat().st_mode) == exp.mode
    check_names(co_b, exp)
    for name, content in exp.names.items():
        if name != "f":
            assert (co_b / name).read_bytes() == content
    new = f"n{r}"
    assert not (co_b / new).exists()

    # Rewritten (open O_TRUNC + write + close), alternately shorter and longer, while
    # B holds f open: B's open file shows it too.
    fd = os.open(f_b, os.O_RDONLY)
    try:
        assert os.pread(fd, WHOLE, 0) == exp.data
        n = len(exp.data)
        size = n + rng.randint(1, 300_000) if r % 2 or n == 0 else rng.randint(0, n - 1)
        exp.data = exp.names["f"] = rng.randbytes(size)
        f_a.write_bytes(exp.data)
        check_file(f_b, f_a, exp.data, first)
        assert os.pread(fd, WHOLE, 0) == exp.data
    finally:
        os.close(fd)

    # Overwritten in place: same size, new bytes in the middle (B read it before).
    assert f_b.read_bytes() == exp.data
    if exp.data:
        off = rng.randrange(len(exp.data))
        patch = rng.randbytes(min(5000, len(exp.data) - off))
        with open(f_a, "r+b") as fa:
            fa.seek(off)
            fa.write(patch)
        exp.data = exp.names["f"] = exp.data[:off] + patch + exp.data[off + len(patch):]
        check_file(f_b, f_a, exp.data, not first)

    # truncate(2) alone, shorter or longer (zeros beyond the old end).
    assert f_b.read_bytes() == exp.data
    size = rng.randint(0, 2 * len(exp.data) + 1000)
    os.truncate(f_a, size)
    exp.data = exp.names["f"] = exp.data[:size].ljust(size, b"\0")
    check_file(f_b, f_a, exp.data, first)

    # chmod
    exp.mode = rng.choice([m for m in (0o600, 0o640, 0o644, 0o664, 0o700, 0o755) if m != exp.mode])
    os.chmod(f_a, exp.mode)
    assert stat.S_IMODE(f_b.stat().st_mode) == exp.mode
    same_stat(f_b, f_a)

    # A name B looked up and did not find, created by A.
    content = rng.randbytes(rng.randint(0, 100_000))
    (co_a / new).write_bytes(content)
    exp.names[new] = content
    assert (co_b / new).read_bytes() == content
    same_stat(co_b / new, co_a / new)
    check_names(co_b, exp)

    # Renamed (B knows both the old name and the absent new one).
    moved = f"m{r}"
    assert not (co_b / moved).exists()
    os.rename(co_a / new, co_a / moved)
    exp.names[moved] = exp.names.pop(new)
    assert not (co_b / new).exists()
    assert (co_b / moved).read_bytes() == content
    check_names(co_b, exp)

    # Replaced by rename (the atomic-update idiom): B read the old file.
    old = f"m{r - 1}"
    if old in exp.names:
        assert (co_b / old).read_bytes() == exp.names[old]
        tmp = co_a / f"tmp{r}"
        fresh = rng.randbytes(rng.randint(1, 100_000))
        tmp.write_bytes(fresh)
        os.rename(tmp, co_a / old)
        exp.names[old] = fresh
        assert (co_b / old).read_bytes() == fresh
        assert not (co_b / f"tmp{r}").exists()
        same_stat(co_b / old, co_a / old)

    # Unlinked (B read it just before).
    gone = f"m{r - 2}"
    if gone in exp.names:
        assert (co_b / gone).read_bytes() == exp.names[gone]
        os.unlink(co_a / gone)
        del exp.names[gone]
        assert not (co_b / gone).exists()
        check_names(co_b, exp)

    # mkdir, B lists it (empty: complete), a name appears in it, then it goes away.
    d = f"d{r}"
    os.mkdir(co_a / d)
    exp.names[d] = b""
    assert (co_b / d).is_dir()
    assert os.listdir(co_b / d) == []
    (co_a / d / "x").write_bytes(b"x")
    assert os.listdir(co_b / d) == ["x"]
    assert (co_b / d / "x").read_bytes() == b"x"
    os.unlink(co_a / d / "x")
    assert os.listdir(co_b / d) == []
    assert not (co_b / d / "x").exists()
    os.rmdir(co_a / d)
    del exp.names[d]
    assert not (co_b / d).exists()
    check_names(co_b, exp)
    same_stat(co_b, co_a)  # the directory's mtime, ctime and nlink


def test_coherence_with_warm_caches_both_ways(cluster: Cluster) -> None:
    """Forty rounds each way: whatever one node changed, the other node's next call sees,
    whatever it had cached (pages, attributes, dentries, negative dentries, open files)."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    os.mkdir(c1 / "co")
    exp = Expected()
    (c1 / "co" / "f").write_bytes(b"")
    os.chmod(c1 / "co" / "f", exp.mode)
    exp.names["f"] = b""
    t0 = time.monotonic()
    for r in range(80):
        a, b = (c1, c2) if r % 2 == 0 else (c2, c1)
        coherence_round(a, b, r, exp)
    elapsed = time.monotonic() - t0
    # Every recall was answered: nobody was evicted, no client lost its connection.
    assert log_lines(cluster, "mds.log", " WARNING ", " ERROR ") == []
    for host in ("c1", "c2"):
        assert log_lines(cluster, f"{host}.log", " WARNING ", " ERROR ") == []
    assert elapsed < 60, f"80 rounds took {elapsed:.1f} s"


@contextlib.contextmanager
def hammered(action: Callable[[], object], pause: float = 0.0) -> Iterator[list[int]]:
    """*action* in a loop on a thread for the block (a node that keeps asking while the
    other changes things); yields the count of calls made so far."""
    stop = threading.Event()
    calls = [0]

    def loop() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                action()
            calls[0] += 1
            if pause:
                time.sleep(pause)

    t = threading.Thread(target=loop)
    t.start()
    try:
        yield calls
    finally:
        stop.set()
        t.join(30)


def test_calls_racing_recalls_leave_nothing_stale(cluster: Cluster) -> None:
    """A reply that grants a lease and the recall that takes it back can be read in one
    go: the reply's caller then runs after the recall was handled.  Caching the reply
    then would leave the node stale for good (the mds thinks it holds nothing and never
    asks again).  One node keeps stat'ing a file while the other chmods it; then a
    lookup of a name not there yet is answered with the recall of the other node's
    create of it right behind (forced by stopping the mds, then the looking daemon):
    after each change returns, the other node's next call sees it.  (Before the fix,
    the first batch of chmods left the other node stale, and so did a forced lookup
    within 2 rounds.)"""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "f").write_bytes(b"x")
    os.mkdir(c1 / "d")
    with hammered(lambda: os.stat(c2 / "f")) as calls:
        for batch in range(8):
            for i in range(60):
                mode = 0o600 | ((batch * 60 + i) % 64)
                os.chmod(c1 / "f", mode)
            assert stat.S_IMODE(os.stat(c2 / "f").st_mode) == mode, f"batch {batch}"
    assert calls[0] > 100, "the other node hardly asked: this tested nothing"
    # A lookup answered "absent" with the recall of another node's create of that name
    # right behind it in the socket (forced: the mds and then the looking daemon are
    # stopped while the lookup and the create go out).
    os.listdir(c2 / "d")  # c2 holds the directory: its lookups may be cached
    looker_pid, mds_pid = daemon_pid(c2), cluster.servers["mds"].pid
    for r in range(4):
        name = c2 / "d" / f"n{r}"
        looker = threading.Thread(target=os.path.exists, args=(name,))
        creator = threading.Thread(target=(c1 / "d" / f"n{r}").write_bytes, args=(b"n",))
        with stopped(mds_pid):
            looker.start()
            time.sleep(0.05)  # the lookup waits in the mds's socket
            os.kill(looker_pid, signal.SIGSTOP)
        with stopped(looker_pid, already=True):
            time.sleep(0.05)  # the mds answered it: "absent, cacheable"
            creator.start()
            time.sleep(0.05)  # the create's recall of c2 follows that answer
        creator.join(10)
        looker.join(10)
        assert name.exists(), f"round {r}: a lookup cached the name as absent"
    assert log_lines(cluster, "mds.log", " ERROR ") == []


def test_appends_while_another_node_stats_lose_nothing(cluster: Cluster) -> None:
    """One node appends while another polls the file's size (each stat revokes the
    writer's lease, a glimpse): the writer must not keep writing under a write lease
    that the recall took back, into preallocated chunks that the revocation freed.
    (Before the fix every round lost blocks that write(2), fsync and close had
    acknowledged.)"""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    block = 64 << 10
    for r in range(3):
        name = f"a{r}"
        (c2 / name).write_bytes(b"")
        with hammered(functools.partial(os.stat, c2 / name), pause=0.001) as calls:
            fd = os.open(c1 / name, os.O_WRONLY)
            try:
                for k in range(128):
                    assert os.pwrite(fd, (b"%08d" % k) * (block // 8), k * block) == block
                os.fsync(fd)
            finally:
                os.close(fd)
        assert calls[0] > 10
        data = (c2 / name).read_bytes()
        assert len(data) == 128 * block, f"round {r}: {len(data)} bytes"
        bad = [k for k in range(128) if data[k * block:(k + 1) * block] != (b"%08d" % k) * (block // 8)]
        assert not bad, f"round {r}: blocks {bad[:10]} lost"
        os.unlink(c2 / name)
    assert log_lines(cluster, "mds.log", " WARNING ", " ERROR ") == []


def test_a_node_that_keeps_asking_does_not_hold_off_a_change(cluster: Cluster) -> None:
    """Replies sent while a recall is under way are not cacheable; one that carries
    no chunk map leaves its receiver holding nothing, so the change is not held up
    asking it again.  (Before, a stat loop on one node made every chmod and write on
    the other wait for as long as the loop ran: 4-10 s, and the mds dropped the
    changing client's connection.)"""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "g").write_bytes(b"g" * 5000)
    with hammered(lambda: os.stat(c2 / "g")), hammered(lambda: os.stat(c2 / "g")):
        time.sleep(0.2)
        for i in range(20):
            t = time.monotonic()
            os.chmod(c1 / "g", 0o600 | i)
            with open(c1 / "g", "r+b") as f:
                f.write(b"w" * 4096)
            took = time.monotonic() - t
            assert took < RECALL_TIMEOUT + LEASE_TERM + SLACK, f"change {i} took {took:.1f} s"
    assert log_lines(cluster, "mds.log", " WARNING ", " ERROR ") == []


def test_own_writes_keep_the_page_cache_until_another_node_writes(cluster: Cluster) -> None:
    """Under leases a client's kernel keeps a file's pages across its own writes and
    the new mtime a stat shows it (no AUTO_INVAL_DATA: recalls drop pages); another
    node's write still drops them before it returns, both ways, over many rounds."""
    from tests.mount.test_page_cache import resident_pages

    page = os.sysconf("SC_PAGE_SIZE")
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    rng = random.Random(11)
    data = bytearray(rng.randbytes(1 << 20))
    (c1 / "pc").write_bytes(data)
    pages = len(data) // page
    for r in range(6):
        mine, other = (c1, c2) if r % 2 == 0 else (c2, c1)
        assert (mine / "pc").read_bytes() == data
        assert resident_pages(mine / "pc") == pages
        with open(mine / "pc", "r+b") as f:
            f.seek(r * page)
            f.write(b"m" * page)
        data[r * page : (r + 1) * page] = b"m" * page
        os.stat(mine / "pc")
        assert resident_pages(mine / "pc") == pages, "a write or stat dropped cached pages"
        assert (mine / "pc").read_bytes() == data
        patch = rng.randbytes(3 * page)
        off = rng.randrange(len(data) - len(patch))
        with open(other / "pc", "r+b") as f:  # the other node's write recalls ours
            f.seek(off)
            f.write(patch)
        data[off : off + len(patch)] = patch
        assert (mine / "pc").read_bytes() == data
        assert os.stat(mine / "pc").st_mtime_ns == os.stat(other / "pc").st_mtime_ns
    assert log_lines(cluster, "mds.log", " WARNING ", " ERROR ") == []


def test_a_file_written_from_two_nodes_by_turns_stays_coherent(cluster: Cluster) -> None:
    """IOR's shared file: two nodes writing their own blocks of one file by turns make
    it contended (memfs.meta.contention: no write leases, each write asks the mds and
    recalls only a node whose ranges it overlaps).  Then each node's next read, with
    the file still open and its own blocks in its page cache, sees the other's
    writes over them, a truncate's size at once, and the same bytes everywhere
    (whether the file is still contended then or leases came back)."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    block, n = 64 << 10, 100  # (a chunk each)
    rng = random.Random(5)
    data = bytearray(2 * n * block)
    fds = [os.open(c1 / "ior", os.O_CREAT | os.O_RDWR, 0o644)]
    fds.append(os.open(c2 / "ior", os.O_RDWR))
    try:
        for i in range(n):
            for node in (0, 1):
                k = 2 * i + node
                data[k * block : (k + 1) * block] = rng.randbytes(block)
                assert os.pwrite(fds[node], data[k * block : (k + 1) * block], k * block) == block
        assert log_lines(cluster, "mds.log", "(contended)"), "the file was never contended"
        for fd in fds:
            assert os.pread(fd, len(data), 0) == data
        for r in range(30):
            writer = r % 2
            patch = rng.randbytes(rng.randrange(1, 3 * block))
            off = rng.randrange(len(data) - len(patch))
            os.pwrite(fds[writer], patch, off)
            data[off : off + len(patch)] = patch
            near = max(0, off - block)  # (a read of the chunks around it first)
            assert os.pread(fds[1 - writer], len(patch) + 2 * block, near) == \
                data[near : off + len(patch) + block], r
            assert os.pread(fds[1 - writer], len(data), 0) == data, r
            assert os.fstat(fds[1 - writer]).st_size == len(data)
        os.ftruncate(fds[0], 3 * block + 5)
        del data[3 * block + 5 :]
        assert os.fstat(fds[1]).st_size == len(data)
        assert os.pread(fds[1], 4 * block, 0) == data
    finally:
        for fd in fds:
            os.close(fd)
    assert (c1 / "ior").read_bytes() == data == (c2 / "ior").read_bytes()
    assert log_lines(cluster, "mds.log", " WARNING ", " ERROR ") == []


def test_a_file_open_on_one_node_outlives_an_unlink_on_the_other(cluster: Cluster) -> None:
    """A node opens a file it holds without asking the mds (the open goes with its
    next call); another node's unlink recalls it first, whose answer carries that
    open, so the file stays readable through the handle, over many rounds; its
    space comes back when the handles close."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    free = os.statvfs(c1).f_bfree
    rng = random.Random(23)
    for r in range(16):
        data = rng.randbytes(rng.randint(1, 300_000))
        (c1 / f"u{r}").write_bytes(data)
        assert (c1 / f"u{r}").read_bytes() == data  # (c1 holds it now)
        with open(c1 / f"u{r}", "rb") as f:
            os.unlink(c2 / f"u{r}")
            assert not (c1 / f"u{r}").exists()
            assert f.read() == data
    until(lambda: os.statvfs(c1).f_bfree == free, timeout=20)
    assert log_lines(cluster, "mds.log", " WARNING ", " ERROR ") == []


#: the access ACL equivalent to mode 0644 (user::rw-, group::r--, other::r--), as
#: ``cp -a`` sets it on every file it copies
ACL_OF_MODE_644 = bytes.fromhex("02000000" "01000600ffffffff" "04000400ffffffff" "20000400ffffffff")


def test_xattr_names_cached_on_one_node_follow_changes_on_the_other(cluster: Cluster) -> None:
    """A node lists a file's xattrs (cached under its lease, and a name not in the
    list is known absent); each change on the other node is seen at its next look,
    both ways, over many rounds; ACLs are refused on both (memfs keeps none)."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "x").write_bytes(b"x")
    want: dict[str, bytes] = {}
    rng = random.Random(31)
    def check(mnt: Path, r: int) -> None:
        assert sorted(os.listxattr(mnt / "x")) == sorted(want)
        for name, value in want.items():
            assert os.getxattr(mnt / "x", name) == value
        with pytest.raises(OSError) as info:
            os.getxattr(mnt / "x", f"user.absent{r}")
        assert info.value.errno == errno.ENODATA

    for r in range(30):
        mine, other = (c1, c2) if r % 4 < 2 else (c2, c1)  # (each changes twice in a row)
        check(mine, r)  # cached here now
        name = f"user.k{rng.randrange(4)}"
        if name in want and rng.random() < 0.4:
            os.removexattr(other / "x", name)
            del want[name]
        else:
            want[name] = rng.randbytes(rng.randint(0, 64))
            os.setxattr(other / "x", name, want[name])
        check(mine, r)  # the change seen at once
        check(other, r)
    with pytest.raises(OSError) as info:
        os.setxattr(c2 / "x", "system.posix_acl_access", ACL_OF_MODE_644)  # (as cp -a)
    assert info.value.errno == errno.EOPNOTSUPP
    assert log_lines(cluster, "mds.log", " WARNING ", " ERROR ") == []


def test_times_owner_and_mode_set_while_writing_are_seen_at_once_elsewhere(cluster: Cluster) -> None:
    """tar's way with every file (create, write, futimens, fchown, fchmod, close): the
    writer's node answers those under its write lease, without the mds; the other
    node's very next stat sees them all, ctime too, over many rounds both ways, also
    while the file is still open; and ``tar -d`` on the other node finds nothing
    different from the archive extracted on the first."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    rng = random.Random(43)
    for r in range(40):
        mine, other = (c1, c2) if r % 2 == 0 else (c2, c1)
        name = f"t{r}"
        data = rng.randbytes(rng.randint(1, 200_000))
        mtime = rng.randint(-10**9, 1_700_000_000) * 10**9 + rng.randrange(10**9)
        mode, uid, gid = rng.choice([0o644, 0o600, 0o755, 0o640]), rng.randrange(5000), rng.randrange(5000)
        fd = os.open(mine / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.utime(fd, ns=(mtime, mtime))
            if r % 4 == 0:  # seen while still open (the write lease recalled)
                st = other.joinpath(name).stat()
                assert (st.st_size, st.st_mtime_ns) == (len(data), mtime)
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        st = same_stat(other / name, mine / name)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns, st.st_size) == \
            (mode, uid, gid, mtime, len(data))
        assert (other / name).read_bytes() == data
    src = cluster.tmp / "src"
    for k in range(60):
        p = src / f"d{k % 6}" / f"f{k}"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(rng.randint(0, 30_000)))
        p.chmod(rng.choice([0o644, 0o600, 0o755, 0o444]))
        os.chown(p, rng.randrange(5000), rng.randrange(5000))
        os.utime(p, ns=(rng.randrange(10**18), rng.randrange(10**18)))
    tarball = cluster.tmp / "src.tar"
    subprocess.run(["tar", "-C", str(src), "-cf", str(tarball), "."], check=True)
    subprocess.run(["tar", "-C", str(c1), "-xf", str(tarball)], check=True)
    diff = subprocess.run(["tar", "-C", str(c2), "-df", str(tarball)], capture_output=True, text=True)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert log_lines(cluster, "mds.log", " WARNING ", " ERROR ") == []


def test_a_first_read_after_writing_moves_atime_for_every_node(cluster: Cluster) -> None:
    """A node reads files it wrote from the chunk map it kept at the close, asking
    the mds nothing; the access time moves there at once (relatime) and reaches
    the other node within a moment (told with the node's next call)."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    for k in range(10):
        (c1 / f"a{k}").write_bytes(b"a" * 5000 * (k + 1))
    time.sleep(0.05)  # (the coarse clock moves past the writes)
    for k in range(10):
        assert (c1 / f"a{k}").read_bytes() == b"a" * 5000 * (k + 1)
        st = (c1 / f"a{k}").stat()
        assert st.st_atime_ns > st.st_mtime_ns
    def read_there(k: int) -> bool:
        st = (c2 / f"a{k}").stat()
        return st.st_atime_ns > st.st_mtime_ns

    for k in range(10):
        until(functools.partial(read_there, k), timeout=5)
    assert log_lines(cluster, "mds.log", " WARNING ", " ERROR ") == []


def test_concurrent_creates_in_one_directory(cluster: Cluster) -> None:
    """Both nodes create files in one directory at the same time (N ranks writing their
    output side by side): every create succeeds promptly, nobody is evicted, and both
    nodes list every file.  (Each create recalls the other node's entries of the
    directory while that node's kernel may hold the directory locked for its own create.)"""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    os.mkdir(c1 / "out")
    assert os.listdir(c2 / "out") == []  # both nodes hold the directory
    n = 30
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(on_host(cluster, host, CREATOR, str(mnt / "out"), host, str(n)))
                 for host, mnt in (("c1", c1), ("c2", c2))]
        for proc in procs:
            wait_line(proc, "ready")
        for proc in procs:
            tell(proc, "go")
        outs = [proc.communicate(timeout=60)[0].decode() for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0], outs
    worst = max(float(out.split()[1]) for out in outs)
    assert log_lines(cluster, "mds.log", "evicting") == []
    assert worst < RECALL_TIMEOUT / 2, f"a create took {worst} s"
    names = sorted(f"{h}{i}" for h in ("c1", "c2") for i in range(n))
    for mnt in (c1, c2):
        assert sorted(os.listdir(mnt / "out")) == names
        for name in names:
            assert (mnt / "out" / name).read_bytes() == name[:2].encode()


def test_a_shared_directory_shows_each_node_what_the_other_changed(cluster: Cluster) -> None:
    """Both nodes work in one directory (mdtest's shared directory).  A node's kernel
    keeps the names it holds across the other node's changes of other names, and its
    daemon the directory's completeness: whatever the other node then changes, names
    this node holds present or absent, or never saw, its next call sees."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    os.mkdir(c1 / "sh")
    names: set[str] = set()
    for r in range(30):
        a, b = (c1 / "sh", c2 / "sh") if r % 2 == 0 else (c2 / "sh", c1 / "sh")
        if r % 3 == 0:
            assert sorted(os.listdir(b)) == sorted(names)  # b: complete
        own, absent = f"own{r}", f"absent{r}"
        (b / own).write_bytes(own.encode())
        names.add(own)
        assert (b / own).stat().st_size == len(own)
        assert not (b / absent).exists()
        others = [f"a{r}.{k}" for k in range(8)]
        for name in others:  # names b never looked up
            (a / name).write_bytes(name.encode())
        names.update(others)
        assert (b / own).read_bytes() == own.encode()
        (a / absent).write_bytes(b"now")
        names.add(absent)
        assert (b / absent).read_bytes() == b"now"
        os.unlink(a / own)
        names.discard(own)
        assert not (b / own).exists()
        os.rename(a / others[0], a / f"moved{r}")
        names.discard(others[0])
        names.add(f"moved{r}")
        assert not (b / others[0]).exists()
        assert (b / f"moved{r}").read_bytes() == others[0].encode()
        for name in others[1:]:
            assert (b / name).read_bytes() == name.encode()
        assert not (b / f"never{r}").exists()
    for mnt in (c1, c2):
        assert sorted(os.listdir(mnt / "sh")) == sorted(names)
    same_stat(c2 / "sh", c1 / "sh")
    assert log_lines(cluster, "mds.log", " WARNING ", " ERROR ") == []


EMPTY_CREATOR = """
import os, sys
d, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):
    os.close(os.open(os.path.join(d, tag + str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640))
print("created", n, flush=True)
"""


REMOVER = """
import os, sys
for name in sys.argv[2:]:
    os.unlink(os.path.join(sys.argv[1], name))
print("removed", len(sys.argv) - 2, flush=True)
"""


def create_on(cluster: Cluster, host: str, d: Path, tag: str, n: int, *, empty: bool) -> list[str]:
    """*n* files made in *d* by a process on *host* (empty, or holding their tag)."""
    script = EMPTY_CREATOR if empty else CREATOR
    with on_host(cluster, host, script, str(d), tag, str(n)) as proc:
        if not empty:
            wait_line(proc, "ready")
            tell(proc, "go")
        out = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 0, out
    return sorted(f"{tag}{i}" for i in range(n))


def journaled(cluster: Cluster, record: bytes) -> int:
    """Records of this kind in the mds's journal files (snapshots aside)."""
    return sum(p.read_bytes().count(record) for p in (cluster.tmp / "journal").glob("journal.*"))


def test_creates_under_a_create_lease(cluster: Cluster) -> None:
    """A node alone in a directory creates files there without waiting for the mds (a
    create lease; the mds hears of them in batches), and unlinks them again so.  The
    other node's very next call sees every one, with the same attributes; a stop of the
    creating node right after its creates, and an mds restart right after creates and
    unlinks, lose none; deleted, they leave no space behind."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    before = journaled(cluster, b"_create_at")
    os.mkdir(c1 / "own")
    names = create_on(cluster, "c1", c1 / "own", "a", 200, empty=False)
    names += create_on(cluster, "c1", c1 / "own", "e", 200, empty=True)
    assert sorted(os.listdir(c2 / "own")) == sorted(names)
    same_stat(c2 / "own", c1 / "own")  # mtime: the last create's, on both nodes
    for name in names[::23]:
        st = same_stat(c2 / "own" / name, c1 / "own" / name)
        assert (c2 / "own" / name).read_bytes() == (b"a" if name[0] == "a" else b"")
        assert stat.S_IMODE(st.st_mode) == (0o644 if name[0] == "a" else 0o640)
    # All but the first went without waiting (the first asked, and got the lease).
    assert journaled(cluster, b"_create_at") - before >= len(names) - 2
    # Now both nodes hold the directory: creates there ask the mds again, and are seen.
    (c1 / "own" / "late").write_bytes(b"late")
    assert (c2 / "own" / "late").read_bytes() == b"late"
    names.append("late")

    # Stopped right after its creates: c2's listing waits for the eviction and sees
    # what reached the mds; continued, c1 sends what did not; nothing is lost.
    os.mkdir(c1 / "own2")
    more = create_on(cluster, "c1", c1 / "own2", "s", 300, empty=True)
    with stopped(daemon_pid(c1)):
        t0 = time.monotonic()
        seen = os.listdir(c2 / "own2")
        waited = time.monotonic() - t0
    assert set(seen) <= set(more)
    assert RECALL_TIMEOUT <= waited <= RECALL_TIMEOUT + LEASE_TERM + SLACK, waited
    deadline = time.monotonic() + 10
    while sorted(os.listdir(c2 / "own2")) != more:
        assert time.monotonic() < deadline, "creates of the stopped client were lost"
        time.sleep(0.1)
    assert sorted(os.listdir(c1 / "own2")) == more

    # An mds SIGKILLed right after a burst of creates and unlinks (files made under the
    # lease are unlinked without waiting too) comes back with every one of them.
    os.mkdir(c1 / "own3")
    last = create_on(cluster, "c1", c1 / "own3", "r", 300, empty=True)
    with on_host(cluster, "c1", REMOVER, str(c1 / "own3"), *last[::3]) as proc:
        assert proc.communicate(timeout=60)[0].decode().split() == ["removed", str(len(last[::3]))]
    last = [n for n in last if n not in set(last[::3])]
    cluster.restart("mds")
    # The other node first: the restarted mds holds its calls until c1 has registered
    # again and replayed what it had not sent (its recovery window).
    assert sorted(os.listdir(c2 / "own3")) == last
    assert sorted(os.listdir(c1 / "own3")) == last
    same_stat(c2 / "own3" / last[-1], c1 / "own3" / last[-1])

    for d, ns in (("own", names), ("own2", more), ("own3", last)):
        for name in ns:
            os.unlink(c2 / d / name)
        os.rmdir(c1 / d)
    assert os.listdir(c2) == []
    wait_used(c1, 0, GRACE + 10)


# -- 2. a stopped client ------------------------------------------------------------------------


def test_recall_of_a_stopped_client(cluster: Cluster) -> None:
    """A client that cannot answer (SIGSTOP) delays a change no longer than
    recall_timeout + lease_term, and once continued serves nothing it cached before."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    old, new = random.Random(1).randbytes(300_000), random.Random(2).randbytes(123_456)
    (c1 / "f").write_bytes(old)
    os.chmod(c1 / "f", 0o644)
    assert (c2 / "f").read_bytes() == old  # c2 caches pages, attributes and the entry
    assert stat.S_IMODE((c2 / "f").stat().st_mode) == 0o644
    pid = daemon_pid(c2)
    heard = time.monotonic()
    os.statvfs(c2)  # never cached: the mds hears from c2 after *heard*
    with stopped(pid):
        t0 = time.monotonic()
        (c1 / "f").write_bytes(new)  # O_TRUNC, then the new content
        t1 = time.monotonic()
        os.chmod(c1 / "f", 0o600)
        t2 = time.monotonic()
    # It waited for c2 (which holds f) until c2's lease had surely run out ...
    assert t1 - t0 >= RECALL_TIMEOUT, f"c2 was not waited for: {t1 - t0:.2f} s"
    assert t1 - heard >= LEASE_TERM, f"went ahead {t1 - heard:.2f} s after c2 was last heard"
    # ... and no longer than the documented bound; the evicted client is not waited for again.
    assert t2 - t0 <= RECALL_TIMEOUT + LEASE_TERM + SLACK, f"took {t2 - t0:.2f} s"
    assert t2 - t1 < RECALL_TIMEOUT, f"chmod after the eviction took {t2 - t1:.2f} s"

    with open(c2 / "f", "rb") as f:
        assert f.read() == new
    st = same_stat(c2 / "f", c1 / "f")
    assert (st.st_size, stat.S_IMODE(st.st_mode)) == (len(new), 0o600)
    assert len(log_lines(cluster, "mds.log", "evicting the client: did not answer a recall")) == 1

    # The continued client works both ways again, with its caches.
    (c2 / "g").write_bytes(b"from c2")
    assert (c1 / "g").read_bytes() == b"from c2"
    (c1 / "g").write_bytes(b"from c1, longer")
    assert (c2 / "g").read_bytes() == b"from c1, longer"


STALE_WRITER = """
import os, signal, sys
import trio
from memfs.config import parse_pool_spec
from memfs.errors import FsError
from memfs.meta.remote import open_remote_meta
from memfs.transport.pool import open_pool_transport
from memfs.wire import load_secret

host, port, secret_file, name = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

async def main():
    secret = load_secret(secret_file)
    async with open_remote_meta(host, port, secret) as meta:
        desc = await meta.describe()
        volumes = parse_pool_spec("+".join(desc.volumes))
        async with open_pool_transport(volumes, secret, incarnations=desc.incarnations) as t:
            meta.follow_token(t.set_session)  # what the mount does
            a = await meta.create(1, name.encode(), 0o100644, 0, 0)
            e = (await meta.map_write(a.ino, 0, 65536)).extents[0]
            await t.write(e.volume, e.voffset, b"A" * e.length)
            # As the data engine moves bytes: the map checked inside io(), then the
            # transfer.  Stopped right between the two, past the check.
            gen = meta.generation(a.ino)
            with meta.io(a.ino):
                assert meta.generation(a.ino) == gen
                print("ready", e.length, flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
                try:
                    await t.write(e.volume, e.voffset, b"S" * e.length)
                    print("stale write landed", flush=True)
                except FsError as exc:
                    print("stale write refused:", exc, flush=True)

trio.run(main)
"""


def test_evicted_client_cannot_land_a_transfer_it_began(cluster: Cluster) -> None:
    """A client stopped in the middle of a write, past its chunk map's last check, is
    evicted; the writer on another node then writes the same bytes.  When the stopped
    client continues, its transfer is refused by the memory server (its lease token
    was fenced before the other writer was granted chunks): the other node's bytes
    stay, on every node.  Without fencing the stale bytes landed over them."""
    c1 = cluster.mnt["c1"]
    mds = f"{cluster.net.addr['mds']}:{PORT_MDS}"
    proc = subprocess.Popen(
        cluster.net.cmd("c2", [sys.executable, "-c", STALE_WRITER, *mds.split(":"),
                               str(cluster.secret), "stale"]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["ready"], (line, proc.stderr.read() if proc.stderr else "")
        n = int(line[1])
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the writer did not stop"
            time.sleep(0.01)
        t0 = time.monotonic()
        with open(c1 / "stale", "r+b") as f:  # recalls the stopped client: evicted
            f.write(b"B" * n)
        assert time.monotonic() - t0 <= RECALL_TIMEOUT + LEASE_TERM + SLACK + 3.0
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=30)
        assert "stale write refused" in out, (out, err)
        assert (c1 / "stale").read_bytes()[:n] == b"B" * n
        assert (cluster.mnt["c2"] / "stale").read_bytes()[:n] == b"B" * n
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert log_lines(cluster, "mds.log", "fenced on every memory server")
    for host in ("mem1", "mem2"):  # each memory server heard the fence
        assert log_lines(cluster, f"{host}.log", "fenced:"), host


# -- 3. a killed client -------------------------------------------------------------------------


def test_killed_client_releases_its_leases_at_once(cluster: Cluster) -> None:
    """SIGKILL a client daemon that holds read leases and a write lease with space ahead
    (a process keeps the file open): the other node proceeds at once, the space ahead
    is freed at once, the open file's space after --grace."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    assert used(c1) == 0
    r_data = random.Random(3).randbytes(200_000)
    (c1 / "r").write_bytes(r_data)
    assert (c2 / "r").read_bytes() == r_data  # c2: a read lease
    w_size = 100_000
    w_data = random.Random(4).randbytes(w_size)
    with on_host(cluster, "c2", HOLDER, str(c2 / "w"), "4", str(w_size)) as holder:
        wait_line(holder, "holding", timeout=30)
        # The write's chunks and a stripe unit ahead of it, held by c2's write lease.
        assert used(c1) == chunks(len(r_data)) + chunks(w_size + STRIPE)
        pid = daemon_pid(c2)
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        assert wait_gone(pid, 10)

        t0 = time.monotonic()
        st = (c1 / "w").stat()
        assert time.monotonic() - t0 < RECALL_TIMEOUT / 2, "waited for the dead client"
        assert st.st_size == w_size  # what c2 settled at fsync
        assert used(c1) == chunks(len(r_data)) + chunks(w_size)  # space ahead freed

        t0 = time.monotonic()
        with open(c1 / "w", "r+b") as f:
            f.seek(w_size)
            f.write(b"appended by c1")
        (c1 / "r").write_bytes(b"rewritten by c1")
        assert time.monotonic() - t0 < RECALL_TIMEOUT / 2, "waited for the dead client"
        assert (c1 / "w").read_bytes() == w_data + b"appended by c1"
        assert (c1 / "r").read_bytes() == b"rewritten by c1"

        # The dead client's open handle keeps w's chunks for --grace, then they go.
        os.unlink(c1 / "w")
        os.unlink(c1 / "r")
        assert used(c1) == chunks(w_size + 14)
        freed = wait_used(c1, 0, GRACE + 10)
        assert freed - t_kill >= GRACE - 0.25, "released before the session's grace"
    with pytest.raises(OSError) as info:
        os.stat(c2 / "r")  # the dead mount stays until the fixture unmounts it
    assert info.value.errno == errno.ENOTCONN


def test_client_killed_while_a_recall_waits_for_it(cluster: Cluster) -> None:
    """A client that dies while the mds waits for its answer to a recall (here: stopped,
    then killed) releases at once: the waiting change does not wait out the bound."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    w_size = 100_000
    with on_host(cluster, "c2", HOLDER, str(c2 / "w"), "5", str(w_size)) as holder:
        wait_line(holder, "holding", timeout=30)
        pid = daemon_pid(c2)
        result: dict[str, object] = {}

        def stat_on_c1() -> None:
            try:
                result["size"] = (c1 / "w").stat().st_size  # revokes c2's write lease
            except OSError as exc:
                result["error"] = exc
            result["done"] = time.monotonic()

        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            thread = threading.Thread(target=stat_on_c1, daemon=True)
            thread.start()
            time.sleep(0.3)
            assert "done" not in result, "the stat did not wait for c2's answer"
            os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
        finally:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
        assert wait_gone(pid, 10)
        thread.join(RECALL_TIMEOUT + LEASE_TERM + 10)
        assert not thread.is_alive()
        assert "error" not in result, result
        assert result["size"] == w_size
        done = result["done"]
        assert isinstance(done, float)
        assert done - t_kill < RECALL_TIMEOUT / 2, (
            f"the stat returned {done - t_kill:.2f} s after the client died "
            f"({done - t0:.2f} s after it started)"
        )


# -- 4. mds restart -----------------------------------------------------------------------------


def test_mds_restart_with_leases_and_a_writer_mid_file(cluster: Cluster) -> None:
    """SIGKILL the mds while both clients hold leases, c1 is in the middle of writing a
    file under its write lease (with space ahead) and c2 has just written one it closes
    only after the restart; restart it from the journal.  No byte is lost, nothing
    stale is served, and once everything is deleted and --grace has passed no chunk
    is leaked."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    assert used(c1) == 0
    rng = random.Random(6)
    files = {name: rng.randbytes(rng.randint(1, 400_000)) for name in ("a", "b", "sub/x", "sub/z")}
    os.mkdir(c1 / "sub")
    for name, data in files.items():
        (c1 / name).write_bytes(data)
    os.chmod(c1 / "b", 0o644)
    for name, data in files.items():  # c2 caches all of it
        assert (c2 / name).read_bytes() == data
    assert sorted(os.listdir(c2 / "sub")) == ["x", "z"]
    assert not (c2 / "later").exists()

    block = 300_000
    with contextlib.ExitStack() as stack:
        # c1 writes on across the restart; c2 only closes after it (its size, not yet
        # sent when the mds died, comes with its re-registration).
        closer = stack.enter_context(on_host(cluster, "c2", WRITER, str(c2 / "stream2"), "8"))
        tell(closer, "write 0 0")  # created (not at the same time as c1's file: see
        wait_line(closer, "wrote 0")  # test_concurrent_creates_in_one_directory)
        writer = stack.enter_context(on_host(cluster, "c1", WRITER, str(c1 / "stream"), "7"))
        tell(writer, f"write 5 {block}")
        wait_line(writer, f"wrote {5 * block}")
        written = sum(chunks(len(d)) for d in files.values()) + chunks(5 * block)
        assert used(c1) > written, "the writer holds no space ahead: the test lost its point"
        tell(closer, f"write 3 {block}")
        wait_line(closer, f"wrote {3 * block}")
        cluster.restart("mds")
        t_restart = time.monotonic()
        tell(closer, "close")
        wait_line(closer, f"closed {3 * block}")

        # Changed after the restart: c2 still has pre-restart pages and dentries.
        new_a = rng.randbytes(333_333)
        (c1 / "a").write_bytes(new_a)
        os.chmod(c1 / "b", 0o600)
        (c1 / "later").write_bytes(b"created after the restart")
        os.rename(c1 / "sub" / "x", c1 / "sub" / "y")
        os.unlink(c1 / "sub" / "z")
        assert (c2 / "a").read_bytes() == new_a
        same_stat(c2 / "a", c1 / "a")
        assert stat.S_IMODE((c2 / "b").stat().st_mode) == 0o600
        assert (c2 / "b").read_bytes() == files["b"]
        assert (c2 / "later").read_bytes() == b"created after the restart"
        assert sorted(os.listdir(c2 / "sub")) == ["y"]
        assert (c2 / "sub" / "y").read_bytes() == files["sub/x"]
        assert not (c2 / "sub" / "x").exists()

        # Cached again under the new mds's leases, changed again.
        newer_a = rng.randbytes(22_222)
        (c1 / "a").write_bytes(newer_a)
        assert (c2 / "a").read_bytes() == newer_a
        same_stat(c2 / "a", c1 / "a")

        # The writer carries on where it was and closes.
        tell(writer, f"write 5 {block}")
        wait_line(writer, f"wrote {10 * block}")
        tell(writer, "close")
        wait_line(writer, f"closed {10 * block}")
        assert writer.wait(10) == 0 and closer.wait(10) == 0
    for name, seed, n, reader in (("stream", 7, 10, c2), ("stream2", 8, 3, c1)):
        rng_w = random.Random(seed)
        expected = b"".join(rng_w.randbytes(block) for _ in range(n))
        other = c1 if reader == c2 else c2
        st = same_stat(reader / name, other / name)
        assert st.st_size == len(expected), name
        assert sha((reader / name).read_bytes()) == sha(expected), name

    # Delete everything: once the restarted mds's grace is over, all space is back.
    for name in ("a", "b", "later", "sub/y", "stream", "stream2"):
        os.unlink(c2 / name)
    os.rmdir(c2 / "sub")
    assert os.listdir(c1) == []
    time.sleep(max(0.0, t_restart + GRACE + 0.5 - time.monotonic()))
    wait_used(c1, 0, 10)
    assert used(c2) == 0


# -- 5. space -----------------------------------------------------------------------------------


def test_space_ahead_comes_back_at_close_and_enospc_at_write(cluster: Cluster) -> None:
    """Space taken ahead of a sequential writer is counted used while the file is open and
    freed at its close; a full pool still reports ENOSPC at write(2), not earlier, and
    takes writes again once space is freed."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    assert used(c1) == 0
    with open(c1 / "small", "wb") as f:
        f.write(b"0123456789")
        f.flush()
        # While open: the write's chunk and a stripe unit ahead of it.
        assert used(c1) == chunks(10 + STRIPE)
    # Closed: exactly one chunk, once the kernel's RELEASE (sent after close(2)
    # returns, not waited for) has been served.
    wait_used(c1, CHUNK, 5)
    assert used(c2) == CHUNK
    assert (c2 / "small").read_bytes() == b"0123456789"
    os.unlink(c2 / "small")
    assert used(c1) == 0

    # The pool fills to the last byte: space ahead never costs a write its own chunks.
    assert fill(c1 / "full", 600) == POOL >> 20
    assert used(c1) == POOL
    assert (c2 / "full").stat().st_size == POOL
    os.unlink(c2 / "full")
    assert used(c1) == 0
    data = random.Random(8).randbytes(16 << 20)
    (c1 / "again").write_bytes(data)
    assert sha((c2 / "again").read_bytes()) == sha(data)
    assert used(c2) == len(data)

    # fallocate(2): the range is taken at once and seen by the other node; ENOSPC for
    # more than the pool leaves the size and the space as they were.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fd = os.open(c1 / "pre", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert libc.fallocate(fd, 0, 0, 8 << 20) == 0, os.strerror(ctypes.get_errno())
        assert (c2 / "pre").stat().st_size == 8 << 20
        assert used(c2) >= len(data) + (8 << 20)
        assert libc.fallocate(fd, 0, 0, 2 * POOL) != 0 and ctypes.get_errno() == errno.ENOSPC
        assert os.fstat(fd).st_size == 8 << 20
        os.pwrite(fd, b"x", 5 << 20)
    finally:
        os.close(fd)
    assert used(c2) == len(data) + (8 << 20), "exactly the range once closed"
    assert (c2 / "pre").read_bytes() == bytes(5 << 20) + b"x" + bytes((3 << 20) - 1)
    os.unlink(c2 / "pre")
    os.unlink(c1 / "again")
    assert used(c1) == 0


def test_a_punched_hole_is_seen_by_the_other_node_at_once(cluster: Cluster) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE) on one node, in rounds both ways: once it
    returns the other node's very next read (through a descriptor it kept open, its
    pages warm) shows the zeros; the punching node's own size, written and not yet
    reported, stays; the freed chunks are free on both nodes; lseek's SEEK_DATA and
    SEEK_HOLE on one node see the other's fresh writes."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    rng = random.Random(11)
    size = 3 * STRIPE + 1000
    for rnd in range(10):
        a, b = (c1, c2) if rnd % 2 == 0 else (c2, c1)
        data = bytearray(rng.randbytes(size))
        (b / "h").write_bytes(data)
        assert (a / "h").read_bytes() == data  # warm on both nodes
        seen = os.open(b / "h", os.O_RDONLY)
        fd = os.open(a / "h", os.O_RDWR)
        try:
            assert os.pread(seen, len(data), 0) == data
            tail = rng.randbytes(100)
            os.pwrite(fd, tail, size)  # past EOF, under a's write lease: unreported
            data += tail
            off, n = rng.randrange(len(data)), rng.randrange(1, 2 * STRIPE)
            fallocate(fd, PUNCH, off, n)
            data[off:off + n] = bytes(len(data[off:off + n]))
            assert os.fstat(fd).st_size == len(data)
            assert os.pread(seen, len(data) + 1, 0) == data, f"round {rnd}: {off}+{n}"
        finally:
            os.close(fd)
            os.close(seen)
        assert sha((a / "h").read_bytes()) == sha(data)
        assert sha((b / "h").read_bytes()) == sha(data)
    fd = os.open(c1 / "h", os.O_RDWR)
    try:
        fallocate(fd, PUNCH, 0, 4 * STRIPE)
    finally:
        os.close(fd)
    assert (c2 / "h").read_bytes() == bytes(size + 100)
    wait_used(c2, 0, 5)
    assert used(c1) == 0
    # SEEK_DATA / SEEK_HOLE on one node find what the other wrote a moment ago, its
    # size not yet reported (the mds recalls the writer first).
    fd = os.open(c1 / "h", os.O_RDWR)
    seen = os.open(c2 / "h", os.O_RDONLY)
    try:
        os.pwrite(fd, b"d", 5 * STRIPE)
        assert os.lseek(seen, 0, os.SEEK_DATA) == 5 * STRIPE
        assert os.lseek(seen, 5 * STRIPE, os.SEEK_HOLE) == 5 * STRIPE + 1
        assert os.lseek(seen, 0, os.SEEK_HOLE) == 0
    finally:
        os.close(fd)
        os.close(seen)
    os.unlink(c2 / "h")


def test_posted_writes_return_before_the_memory_server_answers(cluster: Cluster) -> None:
    """A writer holding the write lease does not wait for the memory server: its
    write(2) returns while that server is stopped.  What it wrote is seen by the
    other node as soon as the server answers (the other node's read recalls the
    lease, and the recall waits for the writes); a server that dies instead fails
    the writer's fsync with EIO, and another file's writes go on."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    d = c1 / "on-mem1"
    d.mkdir()
    os.setxattr(d, "user.memfs.layout", b"stripe_count=1 stripe_offset=0")  # mem1/0
    mem1 = cluster.servers["mem1"].pid
    with on_host(cluster, "c1", WRITER, str(d / "seen"), "3") as w:
        assert answer(w, "write 4 65536") == "wrote 262144"
        with stopped(mem1):
            t0 = time.monotonic()
            assert answer(w, "write 4 65536") == "wrote 524288"
            assert time.monotonic() - t0 < 3.0, "the write waited for the stopped server"
        # The other node's read waits for them (its recall of the write lease does).
        want = random.Random(3).randbytes(4 * 65536 * 2)
        assert (c2 / "on-mem1" / "seen").read_bytes() == want
        assert answer(w, "close") == "closed 524288"

    with on_host(cluster, "c1", WRITER, str(d / "lost"), "4") as w:
        assert answer(w, "write 1 65536") == "wrote 65536"
        with stopped(mem1):
            assert answer(w, "write 4 65536") == "wrote 327680"
            cluster.kill("mem1")  # stopped, then killed: the writes are never answered
        assert answer(w, "fsync") == f"fsync failed {errno.EIO}"
        assert answer(w, "fsync") == "fsynced"  # reported once
        assert answer(w, "close") == "closed 327680"
    other = c1 / "on-mem2"
    other.mkdir()
    os.setxattr(other, "user.memfs.layout", b"stripe_count=1 stripe_offset=1")  # mem2/0
    (other / "f").write_bytes(b"unaffected")
    assert (c2 / "on-mem2" / "f").read_bytes() == b"unaffected"
    cluster.restart("mem1")


def test_a_stopping_client_waits_for_its_posted_writes(cluster: Cluster) -> None:
    """SIGTERM a client daemon while writes it posted wait for a stopped memory server
    (a writer still has the file open): the daemon stays until they are answered, then
    tells the mds the size it held back (not sent before its bytes landed), and the
    other node reads every byte.  Had it closed its connections with answers unread,
    the kernel would have reset them and the server dropped the frames; had it not
    sent the size at unmount, the other node would see only the first write."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    d = c1 / "on-mem1"
    d.mkdir()
    os.setxattr(d, "user.memfs.layout", b"stripe_count=1 stripe_offset=0")  # mem1/0
    pid = daemon_pid(c1)
    with on_host(cluster, "c1", WRITER, str(d / "f"), "5") as w:
        assert answer(w, "write 1 65536") == "wrote 65536"
        with stopped(cluster.servers["mem1"].pid):
            assert answer(w, "write 4 65536") == "wrote 327680"
            time.sleep(0.3)  # a size report (~50 ms) waits for the bytes under it
            os.kill(pid, signal.SIGTERM)
            time.sleep(1.0)
            assert alive(pid), "the daemon left with its writes unanswered"
        assert wait_gone(pid, 15)
    assert (c2 / "on-mem1" / "f").read_bytes() == random.Random(5).randbytes(5 * 65536)


def answer(proc: subprocess.Popen[bytes], line: str, timeout: float = 30) -> str:
    """Tell *proc* one command and return the one line it answers."""
    tell(proc, line)
    assert proc.stdout is not None
    fd, got = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while not got.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no answer to {line!r}: exit {proc.poll()!r}, said {got!r}")
        if select.select([fd], [], [], min(left, 0.2))[0]:
            chunk = os.read(fd, 1)
            if not chunk:
                raise AssertionError(f"no answer to {line!r}: exit {proc.poll()!r}, said {got!r}")
            got += chunk
    return got.decode().strip()


def check_lost_writes(cluster: Cluster, writer: subprocess.Popen[bytes], name: str,
                      expected: bytes, *, must_fail: bool) -> bool:
    """After the writer's daemon lost its write lease without its word: its writers hear
    EIO from fsync and write (or nothing was lost at all); both nodes then show the
    same bytes, a prefix of what was written (the size the mds knew), never zeros or
    another file's bytes.  Returns whether the loss was reported."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    # Space freed by the loss is taken by another file first (what made it zeros).
    (c1 / "a").write_bytes(random.Random(1).randbytes(2_000_000))
    got = answer(writer, "fsync")
    failed = got == f"fsync failed {errno.EIO}"
    assert failed or (got == "fsynced" and not must_fail), got
    if failed:
        assert answer(writer, "write 1 1000") == f"write failed {errno.EIO}"
        assert answer(writer, "fsync") == f"fsync failed {errno.EIO}"
    assert answer(writer, "close").startswith("closed")
    assert writer.wait(10) == 0
    content = (c1 / name).read_bytes()
    assert (c2 / name).read_bytes() == content
    same_stat(c1 / name, c2 / name)
    if failed:
        if content != expected[:len(content)]:
            bad = next(i for i in range(len(content)) if content[i] != expected[i])
            raise AssertionError(f"{len(content)} bytes, differ from {bad}: {content[bad:bad+16]!r} zeros={content[bad:].count(0)}")
    else:
        assert sha(content) == sha(expected)
    # Nothing leaked: the refused tail's chunks were freed once, not kept or doubly used.
    os.unlink(c1 / name)
    os.unlink(c1 / "a")
    wait_used(c2, 0, 10)
    return failed


def test_a_writer_back_after_the_grace_hears_its_writes_are_lost(cluster: Cluster) -> None:
    """c2 writes (space ahead under its write lease); the mds hangs, so c2 writes on into
    that space but its size report gets no answer; c2 is stopped, the mds killed and
    restarted, c2 stays stopped for longer than --grace, then runs again: its writer
    hears EIO, and nobody sees the freed tail as data (before the fix: zeros, and the
    size accepted without a word)."""
    c2 = cluster.mnt["c2"]
    block = 300_000
    rng = random.Random(8)
    expected = b"".join(rng.randbytes(block) for _ in range(4))
    with on_host(cluster, "c2", WRITER, str(c2 / "stream2"), "8") as writer:
        assert answer(writer, f"write 1 {block}") == f"wrote {block}"
        time.sleep(0.3)  # its size reaches the mds
        with stopped(cluster.servers["mds"].pid):
            # Into the space it holds ahead: no mds needed (its lease runs for --lease-term).
            assert answer(writer, f"write 3 {block}") == f"wrote {4 * block}"
            time.sleep(0.2)  # its size report is sent, and never answered
            pid = daemon_pid(c2)
            os.kill(pid, signal.SIGSTOP)
            cluster.kill("mds")  # the report dies with it
        with stopped(pid, already=True):
            cluster.restart("mds")
            time.sleep(GRACE + 2 * SLACK)
        check_lost_writes(cluster, writer, "stream2", expected, must_fail=True)
    assert log_lines(cluster, "c2.log", "writes to inode")


def test_an_evicted_writer_hears_its_writes_are_lost(cluster: Cluster) -> None:
    """c2 is stopped with writes it has not reported; c1 stats the file, the recall
    times out and c2 is evicted (its space ahead freed).  When c2 runs again (and finds
    the recall in its socket, answering it on a dead connection: the answer must not
    count as told) its writer hears EIO, unless its size had reached the mds before it
    stopped."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    block = 300_000
    rng = random.Random(9)
    expected = b"".join(rng.randbytes(block) for _ in range(4))
    with on_host(cluster, "c2", WRITER, str(c2 / "s"), "9") as writer:
        assert answer(writer, f"write 1 {block}") == f"wrote {block}"
        time.sleep(0.3)
        assert answer(writer, f"write 3 {block}") == f"wrote {4 * block}"
        with stopped(daemon_pid(c2)):  # at once: its size is sent 50 ms after a write
            t0 = time.monotonic()
            st = (c1 / "s").stat()  # recalls c2's write lease: no answer, evicted
            assert time.monotonic() - t0 <= RECALL_TIMEOUT + LEASE_TERM + SLACK
            assert st.st_size in (block, 4 * block)
        # c1 saw the size the mds knew: if that was not all of it, c2 must hear so.
        check_lost_writes(cluster, writer, "s", expected, must_fail=st.st_size < 4 * block)
