"""Several hosts on one machine: 2 memory servers, 1 metadata server, 2 client mounts.

Every host is a network namespace made by the test (see ``tests/netns.py``) and
removed afterwards; traffic stays on their private bridge.  The clients mount
for real (``memfs mount --mds``), so this is what two compute nodes see.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from memfs.cli.mounts import is_mounted
from memfs.cli.runtime import pid_file
from tests.conftest import MOUNT_SKIP, stop_server, wait_gone
from tests.netns import TestNet, netns_unavailable

SKIP = MOUNT_SKIP or netns_unavailable()
pytestmark = [pytest.mark.mount, pytest.mark.skipif(SKIP is not None, reason=str(SKIP))]

MEMFS = [sys.executable, "-m", "memfs"]
PORT_MEMD, PORT_MDS = 7100, 7000
HELPER = "import sys; from memfs.cli import mount_helper; sys.exit(mount_helper())"
STREAM_WRITER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o644)
block = os.urandom(1 << 20)
print("writing", flush=True)
deadline = time.monotonic() + 60
try:
    while time.monotonic() < deadline:
        os.pwrite(fd, block, 0)
        os.pwrite(fd, block, 1 << 20)
    print("no error")
except OSError as exc:
    print("errno", exc.errno)
"""


@dataclass
class Cluster:
    net: TestNet
    secret: Path
    mnt: dict[str, Path]
    servers: dict[str, subprocess.Popen[bytes]]
    argv: dict[str, list[str]]
    tmp: Path
    #: extra environment of each server's latest start (merged over os.environ)
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    #: the log file of each server's latest start
    logs: dict[str, Path] = field(default_factory=dict)

    def mount(self, host: str, name: str) -> Path:
        """Mount the filesystem once more, on *host*, at ``tmp/NAME`` (log ``NAME.log``),
        unmounted with the others at the end."""
        path = self.tmp / name
        path.mkdir()
        res = subprocess.run(self.net.cmd(host, [
            *MEMFS, "mount", str(path), "--mds", f"{self.net.addr['mds']}:{PORT_MDS}",
            "--secret-file", str(self.secret), "--log", str(self.tmp / f"{name}.log"),
        ]), capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        self.mnt[name] = path
        return path

    def kill(self, host: str) -> None:
        """SIGKILL *host*'s server (nothing if it has exited already) and reap it."""
        proc = self.servers[host]
        proc.kill()
        proc.wait()

    def restart(self, host: str, env: dict[str, str] | None = None, wait: bool = True) -> None:
        """SIGKILL *host*'s server and start it again with the same arguments (same port).

        *env*: its extra environment this time (None: the same as last time; ``{}``:
        none).  *wait*: wait for its ready line (a server expected to die soon after
        starting, e.g. under a ``MEMFS_TEST_FAULT``, may not live to print it).  Each
        start logs to its own file, ``HOST.restartN.log``."""
        self.kill(host)
        assert self.servers[host].stdout is not None
        self.servers[host].stdout.close()  # type: ignore[union-attr]
        if env is not None:
            self.env[host] = env
        ready = ("mds listening" if host == "mds" else "memd listening") if wait else None
        n = 1
        while (log := self.tmp / f"{host}.restart{n}.log").exists():
            n += 1
        self.servers[host] = start(self.net, host, self.argv[host], ready, log,
                                   env=self.env.get(host))
        self.logs[host] = log


def wait_line(proc: subprocess.Popen[bytes], prefix: str, timeout: float = 30) -> None:
    """Read the server's unbuffered stdout until its ready line."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk
            if any(line.startswith(prefix.encode()) for line in seen.splitlines()):
                return
    raise AssertionError(f"no {prefix!r} from {proc.args!r}: exit {proc.poll()!r}, said {seen[-2000:]!r}")


def start(
    net: TestNet, host: str, argv: list[str], ready: str | None, log: Path,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """A server on *host*; its log (stderr) goes to a file, so no pipe can fill up.

    *env* is merged over this process's environment (``nsenter`` passes it on);
    *ready* None: return at once, without waiting for the server's ready line."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            net.cmd(host, [*MEMFS, *argv]), stdout=subprocess.PIPE, stderr=err, bufsize=0,
            env={**os.environ, **env} if env else None,
        )
    if ready is None:
        return proc
    try:
        wait_line(proc, ready)
    except BaseException:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        raise
    return proc


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with make_cluster(tmp_path, ["--journal", str(tmp_path / "journal")]) as c:
        yield c


@contextlib.contextmanager
def make_cluster(
    tmp_path: Path, mds_args: list[str], memd_args: tuple[str, ...] = (),
    c1_args: tuple[str, ...] = (), mds_env: dict[str, str] | None = None,
    volume_size: str = "128M",
) -> Iterator[Cluster]:
    """The five hosts, the servers started and both clients mounted; all of it torn
    down afterwards, whatever happened.  *mds_env*: extra environment of the mds
    (e.g. ``MEMFS_TEST_FAULT``); *volume_size*: of each of the 4 volumes."""
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(24).hex().encode())
    secret.chmod(0o600)
    servers: dict[str, subprocess.Popen[bytes]] = {}
    argv: dict[str, list[str]] = {}
    mnt: dict[str, Path] = {}
    with TestNet(["mem1", "mem2", "mds", "c1", "c2"]) as net:
        try:
            for host in ("mem1", "mem2"):  # started together, each ~0.5 s of Python start-up
                argv[host] = [
                    "memd", "--listen", f"{net.addr[host]}:{PORT_MEMD}", "--volumes", "2",
                    "--volume-size", volume_size, "--secret-file", str(secret), *memd_args,
                ]
                servers[host] = start(net, host, argv[host], None, tmp_path / f"{host}.log")
            for host in ("mem1", "mem2"):
                wait_line(servers[host], "memd listening")
            # Pool volume order: 0 mem1/0, 1 mem2/0, 2 mem1/1, 3 mem2/1.
            spec = "+".join(
                f"tcp://{net.addr[h]}:{PORT_MEMD}/{v}" for v in (0, 1) for h in ("mem1", "mem2")
            )
            argv["mds"] = [
                "mds", "--listen", f"{net.addr['mds']}:{PORT_MDS}", "--pool", spec,
                "--secret-file", str(secret), *mds_args,
            ]
            servers["mds"] = start(net, "mds", argv["mds"], "mds listening", tmp_path / "mds.log",
                                   env=mds_env)
            mds = f"{net.addr['mds']}:{PORT_MDS}"
            mounting: dict[str, subprocess.Popen[str]] = {}
            try:
                for host in ("c1", "c2"):  # both at once
                    path = tmp_path / host
                    path.mkdir()
                    log = tmp_path / f"{host}.log"
                    if host == "c1":
                        argv_mount = [*MEMFS, "mount", str(path), "--mds", mds,
                                      "--secret-file", str(secret), "--log", str(log), *c1_args]
                    else:  # what mount(8) runs for an fstab line `HOST:PORT MNT fuse.memfs ...`
                        argv_mount = [sys.executable, "-c", HELPER, mds, str(path), "-o",
                                      f"secret_file={secret},log={log},_netdev,nofail"]
                    mounting[host] = subprocess.Popen(net.cmd(host, argv_mount), text=True,
                                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                said = {host: proc.communicate(timeout=60) for host, proc in mounting.items()}
            finally:
                for host, proc in mounting.items():
                    if proc.poll() is None:
                        proc.kill()
                        proc.communicate()
                    mnt[host] = tmp_path / host  # unmounted below if it was mounted
            for host, proc in mounting.items():
                assert proc.returncode == 0, said[host][1]
            yield Cluster(net, secret, mnt, servers, argv, tmp_path,
                          env={"mds": mds_env} if mds_env else {},
                          logs={h: tmp_path / f"{h}.log" for h in servers})
        finally:
            pids = [int(pid_file(str(p)).read_text()) for p in mnt.values() if pid_file(str(p)).exists()]
            for path in mnt.values():
                subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)
            for pid in pids:
                if not wait_gone(pid, 20):
                    os.kill(pid, signal.SIGKILL)
            # The mds first: with --backing it writes back what is dirty, from the
            # memory servers, before it exits.
            if "mds" in servers:
                stop_server(servers["mds"])
            stop_server(*(proc for host, proc in servers.items() if host != "mds"))
    for path in mnt.values():
        assert not is_mounted(str(path))
    for log_file in tmp_path.glob("*.log"):
        text = log_file.read_text()
        assert "Traceback" not in text, text


def sha(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def test_written_on_one_node_read_on_the_other(cluster: Cluster) -> None:
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    rng = random.Random(1)
    files = {f"f{n}": rng.randbytes(n) for n in (0, 1, 65535, 1 << 20, (1 << 20) + 1, 9 << 20)}
    (c1 / "dir").mkdir()
    for name, data in files.items():
        (c1 / "dir" / name).write_bytes(data)
    for name, data in files.items():
        assert sha((c2 / "dir" / name).read_bytes()) == sha(data), name
        assert (c2 / "dir" / name).stat().st_size == len(data)
    assert sorted(os.listdir(c2 / "dir")) == sorted(files)


def test_privileges_dropped_on_one_node_seen_on_the_other(cluster: Cluster) -> None:
    """A write, truncate or chown through one client takes set-ID bits and file
    capabilities away (its FUSE layer does, under FUSE_HANDLE_KILLPRIV_V2) and the
    other client's next stat shows it (the change recalls its lease)."""
    from tests.mount.privileges import check_privileges_dropped

    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "priv").mkdir(mode=0o777)
    os.chmod(c1 / "priv", 0o777)
    check_privileges_dropped(c1 / "priv", c2 / "priv")
    check_privileges_dropped(c2 / "priv", c1 / "priv")


def test_shared_file_disjoint_blocks(cluster: Cluster) -> None:
    """IOR's shared-file pattern: each node writes every other block of one file, then
    reads the other node's blocks.  The block size is not a multiple of the chunk
    size, so both nodes write into the same fresh chunks."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    block, nblocks = 100_000, 64
    blocks = [random.Random(i).randbytes(block) for i in range(nblocks)]
    fds = {
        0: os.open(c1 / "shared", os.O_CREAT | os.O_RDWR, 0o644),
        1: os.open(c2 / "shared", os.O_CREAT | os.O_RDWR, 0o644),
    }
    try:
        for i, data in enumerate(blocks):
            os.pwrite(fds[i % 2], data, i * block)
    finally:
        for fd in fds.values():
            os.close(fd)
    for node, mnt in enumerate((c1, c2)):
        data = (mnt / "shared").read_bytes()
        assert len(data) == block * nblocks
        other = [i for i in range(nblocks) if i % 2 != node]
        for i in other:
            assert data[i * block : (i + 1) * block] == blocks[i], (node, i)


def test_close_to_open_and_namespace_visibility(cluster: Cluster) -> None:
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "a").write_bytes(b"old contents")
    assert (c2 / "a").read_bytes() == b"old contents"  # c2 now has it cached
    time.sleep(0.01)
    (c1 / "a").write_bytes(b"new, longer contents")
    # Closed on c1, opened afterwards on c2: the whole new file, right size and mtime.
    assert (c2 / "a").read_bytes() == b"new, longer contents"
    s1, s2 = (c1 / "a").stat(), (c2 / "a").stat()
    assert (s2.st_size, s2.st_mtime_ns) == (s1.st_size, s1.st_mtime_ns)
    os.rename(c1 / "a", c1 / "b")
    assert not (c2 / "a").exists() and (c2 / "b").read_bytes() == b"new, longer contents"
    os.unlink(c2 / "b")
    assert not (c1 / "b").exists()
    os.mkdir(c2 / "d")
    assert (c1 / "d").is_dir()


def test_dead_memory_server_gives_eio_not_a_hang(cluster: Cluster) -> None:
    """SIGKILL one memd: files on it fail with EIO within the I/O timeout, files on
    the other keep working; after it restarts (its memory gone) they are reported
    damaged (EIO), never read as zeros."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    safe = c1 / "on-mem2"
    safe.mkdir()
    os.setxattr(safe, "user.memfs.layout", b"stripe_count=1 stripe_offset=1")  # mem2/0
    wide = os.urandom(4 << 20)  # striped over all four volumes: half of it on mem1
    (c1 / "wide").write_bytes(wide)
    kept = os.urandom(2 << 20)
    (safe / "kept").write_bytes(kept)

    # A writer streaming into a wide file while mem1 dies: it gets EIO, not a hang.
    writer = subprocess.Popen([sys.executable, "-c", STREAM_WRITER, str(c1 / "stream")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "writing"
        time.sleep(0.3)
        cluster.kill("mem1")
        t0 = time.monotonic()
        out, _ = writer.communicate(timeout=25)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert out.strip() == f"errno {errno.EIO}", out
    assert time.monotonic() - t0 < 25

    t0 = time.monotonic()
    with pytest.raises(OSError) as info:
        (c2 / "wide").read_bytes()
    assert info.value.errno == errno.EIO
    assert time.monotonic() - t0 < 25, "EIO must come within the I/O timeout"
    assert sha((c2 / "on-mem2" / "kept").read_bytes()) == sha(kept)
    (c2 / "on-mem2" / "new").write_bytes(b"still writable")
    assert (c1 / "on-mem2" / "new").read_bytes() == b"still writable"

    cluster.restart("mem1")  # blank memory on the same address
    # c1 wrote "wide" and may keep its pages (the bytes last written) until the mds
    # takes mem1 back, which recalls them.
    until(lambda: "taken back" in cluster.logs["mds"].read_text())
    with pytest.raises(OSError) as info:
        (c1 / "wide").read_bytes()
    assert info.value.errno == errno.EIO
    assert sha((c1 / "on-mem2" / "kept").read_bytes()) == sha(kept)

    # A node that mounts only now has never seen mem1's old memory: the mds tells it
    # which incarnation the pool's data lives in, so it too reports EIO, not zeros.
    late = cluster.mount("c1", "late")
    with pytest.raises(OSError) as info:
        (late / "wide").read_bytes()
    assert info.value.errno == errno.EIO
    assert sha((late / "on-mem2" / "kept").read_bytes()) == sha(kept)


def eio(path: Path) -> bool:
    try:
        path.read_bytes()
    except OSError as exc:
        return exc.errno == errno.EIO
    return False


def until(what: Callable[[], bool], timeout: float = 30, step: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(step)


def written_and_read(writer: Path, reader: Path, data: bytes) -> bool:
    """Written on one node and read back on the other (False if either got EIO: a node
    that has not heard yet that a memory server was taken back)."""
    try:
        writer.write_bytes(data)
        return sha(reader.read_bytes()) == sha(data)
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        return False


def test_a_memory_server_restarted_blank_is_taken_back(cluster: Cluster) -> None:
    """A memd restarted blank on the same address: the mds finds it by itself (nothing
    is sent there), marks the data the files had there lost and takes the server
    back.  Those files then give EIO on every node, a late one too, and after an mds
    restart (never zeros); everything else reads as it was; new files use the
    server again from both nodes; a lost file rewritten from offset 0 (O_TRUNC) is
    whole again; it can be renamed and removed like any other."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "on-mem2").mkdir()
    os.setxattr(c1 / "on-mem2", "user.memfs.layout", b"stripe_count=1 stripe_offset=1")
    kept = os.urandom(2 << 20)
    (c1 / "on-mem2" / "kept").write_bytes(kept)
    wide = {name: os.urandom(4 << 20) for name in ("wide", "other")}  # over all four volumes
    for name, data in wide.items():
        (c1 / name).write_bytes(data)
        assert sha((c2 / name).read_bytes()) == sha(data)  # cached on both nodes

    cluster.restart("mem1")
    until(lambda: "taken back" in cluster.logs["mds"].read_text())
    for node in (c1, c2):
        assert eio(node / "wide") and eio(node / "other")
        assert os.stat(node / "wide").st_size == 4 << 20  # the namespace is whole
        assert sha((node / "on-mem2" / "kept").read_bytes()) == sha(kept)
    new = os.urandom(4 << 20)
    until(lambda: written_and_read(c1 / "new", c2 / "new", new), timeout=10)
    back = os.urandom(3 << 20)
    until(lambda: written_and_read(c2 / "wide", c1 / "wide", back), timeout=10)
    refused = []
    fd = os.open(c1 / "other", os.O_WRONLY)
    try:  # writes into data that was lost (two of its four stripes): EIO, not zeros around
        for stripe in range(4):
            try:
                os.pwrite(fd, b"x", stripe << 20)
            except OSError as exc:
                assert exc.errno == errno.EIO
                refused.append(stripe)
    finally:
        os.close(fd)
    assert len(refused) == 2, refused
    os.rename(c1 / "other", c1 / "moved")

    cluster.restart("mds")  # the journal keeps what was lost and what was taken back
    late = cluster.mount("c2", "late")
    for node in (c1, c2, late):
        assert eio(node / "moved")
        assert sha((node / "new").read_bytes()) == sha(new)
        assert sha((node / "wide").read_bytes()) == sha(back)
        assert sha((node / "on-mem2" / "kept").read_bytes()) == sha(kept)
    assert cluster.logs["mds"].read_text().count("taken back") == 0  # nothing to take again
    os.unlink(late / "moved")
    assert not (c1 / "moved").exists()


def test_a_node_mounts_while_a_memory_server_does_not_answer(cluster: Cluster) -> None:
    """One memd stopped (a hung or cut-off node): a node mounting meanwhile mounts
    all the same, after the I/O timeout, and uses the files on the other memd; once
    the stopped one answers again, the node reaches its files too (same memory:
    nothing was lost), and writes across both."""
    c1 = cluster.mnt["c1"]
    for name, offset in (("on-mem1", 0), ("on-mem2", 1)):  # pool volumes 0 mem1/0, 1 mem2/0
        (c1 / name).mkdir()
        os.setxattr(c1 / name, "user.memfs.layout", f"stripe_count=1 stripe_offset={offset}".encode())
    data = {name: os.urandom(1 << 20) for name in ("on-mem1", "on-mem2")}
    for name, blob in data.items():
        (c1 / name / "f").write_bytes(blob)
    mem1 = cluster.servers["mem1"]
    mem1.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        late = cluster.mount("c2", "late")
        assert time.monotonic() - t0 < 30
        log = (cluster.tmp / "late.log").read_text()
        assert "going on without it" in log and cluster.net.addr["mem1"] in log, log
        assert sha((late / "on-mem2" / "f").read_bytes()) == sha(data["on-mem2"])
    finally:
        mem1.send_signal(signal.SIGCONT)
    assert sha((late / "on-mem1" / "f").read_bytes()) == sha(data["on-mem1"])
    wide = os.urandom(4 << 20)  # over all four volumes
    (late / "wide").write_bytes(wide)
    assert sha((c1 / "wide").read_bytes()) == sha(wide)


def test_appends_from_two_nodes_in_turn_keep_every_line(cluster: Cluster) -> None:
    """O_APPEND on two nodes, one write at a time (under flock, then merely one after
    the other): each lands at the end.  The kernel appends at the size it cached,
    which the other node's appends leave behind (a recall only marks it stale):
    every line of one node overwrote one of the other's (found running a shared
    log from two nodes).  The daemon now appends at the end the mds knows."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    for name, lock in (("locked.log", True), ("turns.log", False)):
        fds = [os.open(m / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) for m in (c1, c2)]
        try:
            want = b""
            for i in range(20):
                for fd, tag in zip(fds, "AB", strict=True):
                    line = f"{tag}{i:03d}\n".encode()
                    if lock:
                        fcntl.flock(fd, fcntl.LOCK_EX)
                    os.write(fd, line)
                    if lock:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    want += line
        finally:
            for fd in fds:
                os.close(fd)
        assert (c1 / name).read_bytes() == want
        assert (c2 / name).read_bytes() == want


APPENDER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
tag, n, size = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.stdin.readline()  # all start together
for i in range(n):
    rec = f"{tag}{i:06d}".encode().ljust(size - 1, b".") + b"\\n"
    assert os.write(fd, rec) == size
os.close(fd)
"""


def append_at_once(mounts: list[Path], name: str, n: int, size: int) -> list[bytes]:
    """Processes appending *n* records of *size* bytes to *name*, one per mount, all at
    once and without a lock; the records each should have written."""
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(m / name), f"{k}-", str(n), str(size)],
                              stdin=subprocess.PIPE) for k, m in enumerate(mounts)]
    try:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()
        for p in procs:
            assert p.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdin is not None:
                p.stdin.close()
    return [f"{k}-{i:06d}".encode().ljust(size - 1, b".") + b"\n"
            for k in range(len(mounts)) for i in range(n)]


def test_appends_from_two_nodes_at_once_keep_every_record(cluster: Cluster) -> None:
    """O_APPEND from two nodes at the same instant, no lock (a shared log of many
    ranks): every record lands once and whole, as on a local disk and on Lustre.
    Each node used to read the end of file, then write there: two nodes could read
    the same end and one wrote over the other.  The mds now places each append
    itself, at the end it knows as it grants the write (a writer's own appends
    under its lease included)."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    for size in (100, 70_000):  # within one chunk; across chunks and stripes
        name = f"shared-{size}.log"
        (c1 / name).write_bytes(b"")
        want = append_at_once([c1, c2, c1, c2], name, 300 if size < 1000 else 40, size)
        for m in (c1, c2):
            data = (m / name).read_bytes()
            assert len(data) == len(want) * size, f"{m.name}: {len(data)} bytes, want {len(want) * size}"
            got = sorted(data[k:k + size] for k in range(0, len(data), size))
            assert got == sorted(want), f"{m.name}: records lost or torn"


def test_metadata_server_restart_with_journal(cluster: Cluster) -> None:
    """SIGKILL the mds and start it again from its journal: the clients carry on,
    no file or byte is lost, and new work succeeds."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    tree = {f"d{i}/f{j}": os.urandom(70_000 * (j + 1)) for i in range(3) for j in range(4)}
    for rel, data in tree.items():
        (c1 / rel).parent.mkdir(exist_ok=True)
        (c1 / rel).write_bytes(data)
    os.rename(c1 / "d0", c1 / "moved")
    held = open(c2 / "d1" / "f0", "rb")  # noqa: SIM115 - kept open across the restart
    os.unlink(c1 / "d1" / "f0")

    cluster.restart("mds")
    try:
        for rel, data in tree.items():
            rel = rel.replace("d0/", "moved/")
            if rel == "d1/f0":
                assert not (c2 / rel).exists()
                continue
            assert sha((c2 / rel).read_bytes()) == sha(data), rel
        assert sha(held.read()) == sha(tree["d1/f0"])  # unlinked but open: still there
        (c1 / "after").write_bytes(b"new work")
        assert (c2 / "after").read_bytes() == b"new work"
    finally:
        held.close()


def fill(path: Path, limit: int) -> int:
    """Write 1 MiB blocks to *path* until ENOSPC; returns how many fitted."""
    block = os.urandom(1 << 20)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for n in range(limit):
            try:
                os.write(fd, block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return n
    finally:
        os.close(fd)
    raise AssertionError(f"{path}: no ENOSPC after {limit} MiB")


def test_freed_space_is_usable_at_once(cluster: Cluster) -> None:
    """Fill the pool, delete on the other node, write again at once: the write waits
    for the mds's scrubber (it used to fail with EAGAIN, "Resource temporarily
    unavailable", which the README promises applications never see).  The new file
    is on the last volume, which the scrubber reaches last."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    assert fill(c1 / "full", 600) > 500  # 4 volumes of 128 MiB
    (c1 / "last").mkdir()
    os.setxattr(c1 / "last", "user.memfs.layout", b"stripe_count=1 stripe_offset=3")
    os.unlink(c2 / "full")
    data = os.urandom(8 << 20)
    (c1 / "last" / "again").write_bytes(data)
    assert sha((c2 / "last" / "again").read_bytes()) == sha(data)


def test_dead_memory_server_with_freed_chunks_does_not_stop_the_mds(cluster: Cluster) -> None:
    """Chunks freed on a dead memory server cannot be zeroed: they stay dirty, the
    other servers' freed chunks are reused, and the mds keeps serving (a batch of
    chunks spanning both servers used to crash it with an exception group)."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "wide").write_bytes(os.urandom(8 << 20))  # 2 MiB on each of the 4 volumes
    cluster.kill("mem2")
    os.unlink(c1 / "wide")
    time.sleep(2)  # scrubber rounds (retried every second)
    assert cluster.servers["mds"].poll() is None, "the mds died"
    (c1 / "on-mem1").mkdir()
    os.setxattr(c1 / "on-mem1", "user.memfs.layout", b"stripe_count=1 stripe_offset=0")
    (c1 / "on-mem1" / "f").write_bytes(b"still works")
    assert (c2 / "on-mem1" / "f").read_bytes() == b"still works"
    log = (cluster.tmp / "mds.log").read_text()
    assert log.count("cannot zero freed chunks of volume 1") == 1, log


def test_mount_table_names_the_mds(cluster: Cluster) -> None:
    """The mount's source is the mds address an fstab line gives, so `mount -a` sees
    the line mounted (it was "memfs": a second `mount -a` failed on every line)."""
    mds = f"{cluster.net.addr['mds']}:{PORT_MDS}"
    with open("/proc/self/mounts") as f:
        sources = {fields[1]: fields[0] for fields in (line.split() for line in f)}
    for path in cluster.mnt.values():
        assert sources[str(path)] == mds


# -- burst buffer: the mds writes the pool back to a directory ------------------------------


@pytest.fixture
def bb_cluster(tmp_path: Path) -> Iterator[Cluster]:
    back = tmp_path / "backing"
    (back / "input").mkdir(parents=True)
    (back / "input" / "small.txt").write_bytes(b"staged in\n")
    (back / "input" / "big.bin").write_bytes(random.Random(7).randbytes(5 << 20))
    with make_cluster(tmp_path, ["--backing", str(back), "--flush-delay", "0.5"]) as c:
        yield c


def memfs_cli(*args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([*MEMFS, *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res


def test_burst_buffer_through_the_mds(bb_cluster: Cluster) -> None:
    """Input in the backing directory is visible on every node (data fetched by the mds
    on first read); output from any node reaches the backing directory; stopping the
    mds writes back what is still dirty."""
    c1, c2 = bb_cluster.mnt["c1"], bb_cluster.mnt["c2"]
    back = bb_cluster.tmp / "backing"
    big = (back / "input" / "big.bin").read_bytes()
    assert sha((c2 / "input" / "big.bin").read_bytes()) == sha(big)
    assert (c1 / "input" / "small.txt").read_bytes() == b"staged in\n"

    rng = random.Random(3)
    out = {f"out/r{n}.dat": rng.randbytes(rng.choice((0, 100, 70_000, 3 << 20))) for n in range(12)}
    (c1 / "out").mkdir()
    for name, data in out.items():
        (c1 / name).write_bytes(data)
    (c1 / "out" / "r0.dat").rename(c1 / "out" / "renamed.dat")
    out["out/renamed.dat"] = out.pop("out/r0.dat")
    (c1 / "out" / "r1.dat").unlink()
    del out["out/r1.dat"]
    memfs_cli("flush", str(c2), "--wait")  # asked on the other node: the mds knows all
    for name, data in out.items():
        assert sha((back / name).read_bytes()) == sha(data), name
    assert sorted(os.listdir(back / "out")) == sorted(n.split("/")[1] for n in out)
    st = json.loads(memfs_cli("status", str(c1), "--json").stdout)
    assert st["dirty_files"] == 0 and st["errors"] == [], st

    # Still dirty when the mds is told to stop: it writes back first, then exits 0.
    late = rng.randbytes(2 << 20)
    (c2 / "late.bin").write_bytes(late)
    mds = bb_cluster.servers["mds"]
    mds.send_signal(signal.SIGTERM)
    assert mds.wait(60) == 0
    assert sha((back / "late.bin").read_bytes()) == sha(late)


def test_mds_dirty_cap_holds_writers_without_timing_out(tmp_path: Path) -> None:
    """With the backing filesystem read-only, a node's writer waits at the mds's dirty
    cap for longer than any call timeout (10 s), without an error, and finishes once
    write-back works again."""
    back = tmp_path / "backing"
    back.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(back)], check=True)
    try:
        with make_cluster(tmp_path, ["--backing", str(back), "--flush-delay", "0",
                                     "--dirty-max", "8M"]) as c:
            subprocess.run(["mount", "-o", "remount,ro", str(back)], check=True)
            data = random.Random(5).randbytes(24 << 20)
            src = tmp_path / "src.bin"
            src.write_bytes(data)
            writer = subprocess.Popen(
                c.net.cmd("c1", ["dd", f"if={src}", f"of={c.mnt['c1'] / 'big.bin'}", "bs=1M",
                                 "status=none"]),
                stderr=subprocess.PIPE, text=True,
            )
            try:
                time.sleep(13)
                assert writer.poll() is None, f"writer ended early: {writer.communicate()}"
                st = json.loads(memfs_cli("status", str(c.mnt["c2"]), "--json").stdout)
                assert st["writers_waiting"] > 0 and st["dirty_bytes"] <= 8 << 20, st
                assert st["errors"], st
            finally:
                subprocess.run(["mount", "-o", "remount,rw", str(back)], check=True)
            _, err = writer.communicate(timeout=60)
            assert writer.returncode == 0, err
            memfs_cli("flush", str(c.mnt["c1"]), "--wait")
            assert sha((back / "big.bin").read_bytes()) == sha(data)
            assert sha((c.mnt["c2"] / "big.bin").read_bytes()) == sha(data)
    finally:
        subprocess.run(["umount", "-l", str(back)], check=False)


_SCRAPE = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


def test_mds_metrics(tmp_path: Path) -> None:
    """``--metrics`` on ``memfs mds`` (calls per method, the pool, sessions) and ``memfs
    memd`` (requests and bytes, volumes, clients), scraped from a client node."""
    from tests.mount.test_metrics import scrape_until  # the same parsing as the mount's test

    port = 9187
    metrics = ("--metrics", f"0.0.0.0:{port}")
    with make_cluster(tmp_path, list(metrics), memd_args=metrics,
                      c1_args=("--metrics", f"127.0.0.1:{port}")) as c:
        (c.mnt["c1"] / "f").write_bytes(b"x" * 4_000_000)  # stripes over both memory servers
        assert (c.mnt["c2"] / "f").read_bytes() == b"x" * 4_000_000

        def getter(host: str) -> Callable[[], str]:
            where = "127.0.0.1" if host == "c1" else c.net.addr[host]  # c1: its own mount
            url = f"http://{where}:{port}/metrics"

            def get() -> str:
                r = subprocess.run(c.net.cmd("c1", [sys.executable, "-c", _SCRAPE, url]),
                                   capture_output=True, text=True, timeout=30)
                assert r.returncode == 0, r.stderr
                return r.stdout

            return get

        for host in ("mem1", "mem2"):
            # Both clients are connected to each memory server (and the mds, to scrub).
            mem = scrape_until(getter(host), lambda g: g.get(("memfs_memd_connections", ()), 0) >= 2)
            assert mem[("memfs_up", (("role", "memd"),))] == 1
            assert mem[("memfs_memd_connections", ())] >= 2
            assert mem[("memfs_memd_volume_bytes", ())] == 2 * (128 << 20)
            assert mem[("memfs_bytes_total", (("op", "write"),))] >= 1_000_000
            assert mem[("memfs_bytes_total", (("op", "read"),))] >= 1_000_000
            assert mem[("memfs_requests_total", (("op", "write"),))] >= 1
        get = getter("mds")
        got = scrape_until(get, lambda g: g.get(("memfs_mds_sessions_connected", ())) == 2
                           and g.get(("memfs_files", ())) == 2)
        assert got[("memfs_up", (("role", "mds"),))] == 1
        assert got[("memfs_requests_total", (("op", "create"),))] >= 1
        # c1's kernel looked for security.capability before the first write to the file
        # it had just created: c1 answered from its cache (a new inode has none)
        assert got.get(("memfs_requests_total", (("op", "getxattr"),)), 0) == 0
        assert got[("memfs_request_seconds_count", (("op", "create"),))] >= 1
        assert got[("memfs_pool_bytes", ())] == 4 * (128 << 20)
        assert got[("memfs_pool_free_bytes", ())] < 4 * (128 << 20)
        assert got[("memfs_mds_sessions_connected", ())] == 2
        assert got[("memfs_mds_fences_unconfirmed", ())] == 0
        assert ("memfs_mds_fences_sent", ()) in got
        assert got[("memfs_mds_locks", ())] == got[("memfs_mds_lock_waiters", ())] == 0
        assert ("memfs_mds_journal_durable_seq", ()) not in got  # no --journal here

        # The client mount: requests, and the health of each memory server it uses.
        names = {h: f"{c.net.addr[h]}:{PORT_MEMD}" for h in ("mem1", "mem2")}
        up = ("memfs_memory_server_up", (("server", names["mem2"]),))
        cli = scrape_until(getter("c1"), lambda g: g.get(up) == 1)
        assert cli[("memfs_up", (("role", "mount"),))] == 1
        assert cli[("memfs_requests_total", (("op", "write"),))] >= 1
        assert cli[up] == 1
        c.kill("mem2")
        fd = os.open(c.mnt["c1"] / "f", os.O_RDONLY | os.O_DIRECT)
        try:
            with pytest.raises(OSError):  # the next use of mem2 finds it gone
                os.pread(fd, 4_000_000, 0)
        finally:
            os.close(fd)  # open, it would keep c1's daemon after its (lazy) unmount
        cli = scrape_until(getter("c1"), lambda g: g.get(up) == 0)
        assert cli[up] == 0
        assert cli[("memfs_memory_server_up", (("server", names["mem1"]),))] == 1


def test_memory_belongs_to_one_filesystem(tmp_path: Path) -> None:
    """A second mds whose pool names the memory servers' volumes of a live
    filesystem (a typo'd --pool, or the same mds restarted without its journal
    while the old mounts still run) stops with a one-line error instead of
    serving, and the first filesystem's files keep their bytes.  Once the old
    filesystem's connections are gone, a new one may have the memory."""
    with make_cluster(tmp_path, []) as c:  # no journal: a restart is another filesystem
        data = os.urandom(3 << 20)
        (c.mnt["c1"] / "kept").write_bytes(data)
        mds = c.net.addr["mds"]

        def refused(argv: list[str], name: str) -> str:
            log = c.tmp / f"{name}.log"
            proc = start(c.net, "mds", argv, None, log)
            try:
                assert proc.wait(timeout=60) == 2, log.read_text()
            finally:
                proc.stdout.close()  # type: ignore[union-attr]
            lines = log.read_text().splitlines()
            assert lines and lines[-1].startswith("memfs: error: memory server "), lines
            log.unlink()  # (its lines are the expected refusal)
            return lines[-1]

        # Another mds on the same memory servers (its own port, a pool of one volume)
        spec = f"tcp://{c.net.addr['mem2']}:{PORT_MEMD}/1"
        line = refused(["mds", "--listen", f"{mds}:{PORT_MDS + 1}", "--pool", spec,
                        "--secret-file", str(c.secret)], "second-mds")
        assert f"{c.net.addr['mem2']}:{PORT_MEMD}: volume 1 belongs to another memfs " \
               "filesystem, in use by" in line, line
        assert sha((c.mnt["c2"] / "kept").read_bytes()) == sha(data)

        # The mds restarted without its journal: refused while the old mounts hold on
        c.kill("mds")
        line = refused(c.argv["mds"], "restarted-mds")
        assert "belongs to another memfs filesystem" in line, line

        # ... and serves once they are gone (the memds forget claims with connections)
        pids = [int(pid_file(str(p)).read_text()) for p in c.mnt.values()]
        for path in c.mnt.values():
            subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)
        for pid in pids:
            assert wait_gone(pid, 20)
        c.restart("mds")
        again = c.mount("c1", "again")
        assert not (again / "kept").exists()  # a new, empty filesystem
        (again / "new").write_bytes(b"on the freed memory")
        assert (again / "new").read_bytes() == b"on the freed memory"
