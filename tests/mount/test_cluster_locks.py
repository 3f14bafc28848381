"""Cluster-wide file locks, end to end: flock(2) and fcntl(2) locks taken through two
client hosts' mounts (see test_cluster.py) exclude each other as on one node.

What memfs promises (README, "Locks"; docs/ARCHITECTURE.md, memfs/meta/locks.py):

* flock and POSIX record locks (fcntl F_SETLK/F_SETLKW/F_GETLK, OFD locks) hold
  across nodes, with Linux's semantics on each kind (ranges, shared/exclusive,
  upgrades, flock and POSIX locks independent);
* a waiter is woken when the lock in its way goes, and a signal interrupts its
  wait (EINTR), a fatal one at once;
* a file's locks go when the open file they were taken through is released (its
  last close, or its process's death);
* a client that stops answering (SIGSTOP, dead) loses its locks to a waiter on
  another node within a lease term and a retry; it logs each lock it lost;
* an mds restart from its journal keeps every lock (clients state theirs again).

Short timings (``--lease-term 2 --recall-timeout 1 --grace 5``) keep this quick.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_gone
from tests.mount.test_cluster import Cluster, make_cluster
from tests.mount.test_cluster_leases import (
    LEASE_TERM,
    RECALL_TIMEOUT,
    SLACK,
    daemon_pid,
    log_lines,
    on_host,
    stopped,
    tell,
)
from tests.mount.test_cluster_leases import cluster as leases_cluster
from tests.mount.test_cluster_leases import pytestmark as lease_marks

pytestmark = lease_marks
#: the lease tests' cluster (journal, short lease term, recall timeout and grace)
cluster = leases_cluster

#: memfs.meta.lock_client.RETRY_EVERY: a waiter asks again at least this often
RETRY = 1.0

#: a process on a client host: takes or tests locks on a file as told, one per line
LOCKER = """
import errno, fcntl, os, signal, struct, sys, time
class Alarm(Exception):
    pass
def alarm(*_):
    raise Alarm()
signal.signal(signal.SIGALRM, alarm)
f = open(sys.argv[1], "r+b")
FLOCK = {"sh": fcntl.LOCK_SH, "ex": fcntl.LOCK_EX, "un": fcntl.LOCK_UN}
TYPES = {"rd": fcntl.F_RDLCK, "wr": fcntl.F_WRLCK, "un": fcntl.F_UNLCK}
print("ready", os.getpid(), flush=True)
for line in sys.stdin:
    cmd, *a = line.split()
    t = time.monotonic()
    try:
        if cmd == "flock":  # flock sh|ex|un [nb]
            fcntl.flock(f, FLOCK[a[0]] | (fcntl.LOCK_NB if "nb" in a else 0))
        elif cmd in ("setlk", "setlkw", "ofd"):  # setlk rd|wr|un START LEN
            op = {"setlk": fcntl.F_SETLK, "setlkw": fcntl.F_SETLKW, "ofd": 37}[cmd]  # F_OFD_SETLK
            fcntl.fcntl(f, op, struct.pack("hhqqi", TYPES[a[0]], 0, int(a[1]), int(a[2]), 0))
        elif cmd == "getlk":  # getlk rd|wr START LEN
            got = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack("hhqqi", TYPES[a[0]], 0, int(a[1]), int(a[2]), 0))
            ty, _, start, length, pid = struct.unpack("hhqqi", got)
            print("lock", ty, start, length, pid, flush=True)
            continue
        elif cmd == "alarm":  # the next command is interrupted after this many seconds
            signal.setitimer(signal.ITIMER_REAL, float(a[0]))
            print("armed", flush=True)
            continue
        elif cmd == "close":
            f.close()
        print("ok", cmd, round(time.monotonic() - t, 3), flush=True)
    except Alarm:
        print("interrupted", round(time.monotonic() - t, 3), flush=True)
    except OSError as exc:
        print("refused", errno.errorcode[exc.errno], flush=True)
"""


class Locker:
    """A LOCKER process on a client host, told one command at a time."""

    def __init__(self, proc: subprocess.Popen[bytes], *, ready: bool = True) -> None:
        self.proc = proc
        self._buf = b""
        self.pid = int(self.line().split()[1]) if ready else proc.pid  # "ready PID"

    def line(self, timeout: float = 30) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"no answer within {timeout} s; said {self._buf!r}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"exited {self.proc.poll()!r}; said {self._buf!r}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def send(self, cmd: str) -> None:
        tell(self.proc, cmd)

    def ok(self, cmd: str, timeout: float = 30) -> float:
        """*cmd* succeeds: how long it took."""
        self.send(cmd)
        got = self.line(timeout)
        assert got.startswith("ok "), (cmd, got)
        return float(got.split()[2])

    def refused(self, cmd: str, err: str = "EAGAIN") -> None:
        self.send(cmd)
        got = self.line()
        assert got == f"refused {err}", (cmd, got)

    def getlk(self, cmd: str) -> tuple[int, ...]:
        self.send(cmd)
        got = self.line()
        assert got.startswith("lock "), (cmd, got)
        return tuple(int(x) for x in got.split()[1:])


@contextlib.contextmanager
def locker(cluster: Cluster, host: str, path: Path) -> Iterator[Locker]:
    with on_host(cluster, host, LOCKER, str(path)) as proc:
        yield Locker(proc)


def test_flock_and_fcntl_locks_hold_across_nodes(cluster: Cluster) -> None:
    """Every kind of lock, both directions, many rounds: what one node holds, the
    other cannot take; what one lets go, the other can."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "f").write_bytes(b"x" * 100)
    with locker(cluster, "c1", c1 / "f") as a, \
            locker(cluster, "c2", c2 / "f") as b:
        pid_a = a.pid
        for r in range(20):
            x, y = (a, b) if r % 2 == 0 else (b, a)
            # flock: exclusive excludes all, shared excludes exclusive, conversions
            x.ok("flock ex nb")
            y.refused("flock sh nb", "EAGAIN")
            y.refused("flock ex nb", "EAGAIN")
            x.ok("flock sh nb")  # downgrade
            y.ok("flock sh nb")
            x.refused("flock ex nb", "EAGAIN")  # upgrade blocked by the other's share,
            y.ok("flock ex nb")  # and x's share is gone (Linux: no deadlocked upgraders)
            y.ok("flock un")
            x.ok("flock ex nb")
            x.ok("flock un")
            y.ok("flock ex nb")
            y.ok("flock un")
            # POSIX ranges: write locks exclude overlaps, not neighbours; read locks share
            x.ok("setlk wr 0 10")
            y.refused("setlk rd 9 1")
            y.ok("setlk wr 10 10")
            y.ok("setlk rd 50 0")  # to the end of the file
            x.refused("setlk wr 60 5")
            x.ok("setlk rd 60 5")
            # and flock is independent of POSIX locks (as in Linux)
            x.ok("flock ex nb")
            x.ok("flock un")
            x.ok("setlk un 0 0")
            y.ok("setlk un 0 0")
            y.ok("setlk wr 0 0")
            y.ok("setlk un 0 0")
        # F_GETLK names the lock in the way: its range and type; a process on another
        # node shows as pid 0
        a.ok("setlk wr 20 30")
        assert b.getlk("getlk rd 0 0") == (fcntl.F_WRLCK, 20, 30, 0)
        assert b.getlk("getlk rd 0 20") == (fcntl.F_UNLCK, 0, 20, 0)
        a.ok("setlk un 30 10")  # splits it: 20-29 and 40-49
        assert b.getlk("getlk wr 30 10")[0] == fcntl.F_UNLCK
        assert b.getlk("getlk wr 45 1") == (fcntl.F_WRLCK, 40, 10, 0)
        with locker(cluster, "c1", c1 / "f") as a2:
            assert a2.getlk("getlk rd 25 1") == (fcntl.F_WRLCK, 20, 10, pid_a)  # same node
        # OFD locks belong to the open file: two opens of one process conflict
        a.ok("setlk un 0 0")
        a.ok("ofd wr 0 1")
        b.refused("ofd wr 0 1")
        a.ok("ofd un 0 1")
        b.ok("ofd wr 0 1")


def test_a_waiter_is_woken_and_a_signal_ends_its_wait(cluster: Cluster) -> None:
    """F_SETLKW and blocking flock wait for the other node's unlock and get the lock
    at once (told by the mds, not by polling); a signal interrupts the wait (EINTR),
    and a killed waiter goes at once instead of hanging in the kernel."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "f").write_bytes(b"x")
    with locker(cluster, "c1", c1 / "f") as a, \
            locker(cluster, "c2", c2 / "f") as b:
        for cmd, unlock in (("flock ex", "flock un"), ("setlkw wr 0 0", "setlk un 0 0")):
            for _ in range(5):
                a.ok(cmd.replace("setlkw", "setlk") + (" nb" if cmd.startswith("flock") else ""))
                b.send(cmd)
                time.sleep(0.3)
                a.ok(unlock)
                got = b.line(10)
                assert got.startswith("ok "), got
                waited = float(got.split()[2])
                assert waited < 0.3 + RETRY, f"{cmd}: waited {waited} s, not woken by the unlock"
                b.ok(unlock)
            # A signal ends the wait: EINTR (here the handler raises).
            a.ok(cmd.replace("setlkw", "setlk") + (" nb" if cmd.startswith("flock") else ""))
            b.send("alarm 0.5")
            assert b.line() == "armed"
            b.send(cmd)
            got = b.line(10)
            assert got.startswith("interrupted"), got
            a.ok(unlock)
            b.ok(cmd)  # nothing was left behind by the interrupted wait
            b.ok(unlock)
        # A waiter killed (SIGKILL) goes at once, and takes nothing with it.
        a.ok("flock ex nb")
        with locker(cluster, "c2", c2 / "f") as w:
            w.send("flock ex")
            time.sleep(0.5)
            t = time.monotonic()
            os.kill(w.pid, signal.SIGKILL)
            w.proc.wait(10)
            assert time.monotonic() - t < 5
        a.ok("flock un")
        b.ok("flock ex nb")
        b.ok("flock un")


MANY_WAITERS = """
import fcntl, sys, threading, time
path, n = sys.argv[1], int(sys.argv[2])
holder = open(path, "r+b")
fcntl.flock(holder, fcntl.LOCK_EX)
got = []
def wait():
    with open(path, "r+b") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        got.append(1)
threads = [threading.Thread(target=wait) for _ in range(n)]
for t in threads:
    t.start()
time.sleep(2)  # all of them wait in the daemon now
t0 = time.monotonic()
with open(path + ".other", "wb") as f:  # the mount still serves other requests
    f.write(b"served")
print("served", round(time.monotonic() - t0, 3), flush=True)
fcntl.flock(holder, fcntl.LOCK_UN)
for t in threads:
    t.join()
print("got", len(got), flush=True)
"""


def test_waiters_do_not_take_the_daemons_workers(cluster: Cluster) -> None:
    """More waiters than the daemon has request workers (64): each wait runs in a task
    of its own, so the node still serves other requests, the holder's unlock among
    them (with waits in the workers, that node's mount would hang for good)."""
    c1 = cluster.mnt["c1"]
    (c1 / "f").write_bytes(b"x")
    with on_host(cluster, "c1", MANY_WAITERS, str(c1 / "f"), "80") as proc:
        w = Locker(proc, ready=False)
        served = w.line(60)
        assert served.startswith("served") and float(served.split()[1]) < 5, served
        assert w.line(60) == "got 80"
    assert (c1 / "f.other").read_bytes() == b"served"


def test_a_stopping_client_ends_its_lock_waits(cluster: Cluster) -> None:
    """SIGTERM to a client daemon while one of its processes waits for a lock another
    node holds: the daemon answers the wait (ENOLCK) and exits, instead of waiting
    for the lock forever."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "f").write_bytes(b"x")
    with locker(cluster, "c2", c2 / "f") as b, locker(cluster, "c1", c1 / "f") as a:
        b.ok("flock ex nb")
        a.send("flock ex")
        time.sleep(0.5)
        pid = daemon_pid(c1)
        os.kill(pid, signal.SIGTERM)
        assert wait_gone(pid, 15), "the client daemon did not exit"
        assert a.line(10) == "refused ENOLCK"  # (not EINTR: no signal is pending)
        b.ok("flock un")


def test_a_wait_that_would_deadlock_is_edeadlk(cluster: Cluster) -> None:
    """F_SETLKW that would close a cycle of waits fails with EDEADLK, as Linux's does,
    between nodes and between processes of one node; an interrupted wait is no
    longer part of any cycle."""
    c1 = cluster.mnt["c1"]
    (c1 / "f").write_bytes(b"x" * 10)
    for host in ("c2", "c1"):  # across nodes, then on one node
        with locker(cluster, "c1", c1 / "f") as a, \
                locker(cluster, host, cluster.mnt[host] / "f") as b:
            a.ok("setlk wr 0 1")
            b.ok("setlk wr 1 1")
            a.send("setlkw wr 1 1")  # a waits for b
            time.sleep(0.3)
            b.refused("setlkw wr 0 1", errno.errorcode[errno.EDEADLK])  # b would wait for a
            b.ok("setlk un 1 1")
            assert a.line(10).startswith("ok "), host  # a got it
            # a waits for b again, and is interrupted: b may then wait for a
            a.ok("setlk un 1 1")
            b.ok("setlk wr 1 1")
            a.send("alarm 0.5")
            assert a.line() == "armed"
            a.send("setlkw wr 1 1")
            assert a.line(10).startswith("interrupted")
            b.send("setlkw wr 0 1")
            time.sleep(0.3)
            a.ok("setlk un 0 0")
            assert b.line(10).startswith("ok "), host
            b.ok("setlk un 0 0")


def test_locks_go_with_the_open_file(cluster: Cluster) -> None:
    """Closing the file, or the death of the process, lets its locks go; another
    node's lock on the same file stays."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "f").write_bytes(b"x" * 10)
    with locker(cluster, "c2", c2 / "f") as b:
        for how in ("close", "kill"):
            with locker(cluster, "c1", c1 / "f") as a:
                a.ok("flock sh nb")
                a.ok("setlk wr 0 5")
                a.ok("ofd rd 5 5")
                b.ok("flock sh nb")  # shared with c1's
                b.refused("setlk rd 0 1")
                b.refused("ofd wr 5 1")
                if how == "close":
                    a.ok("close")
                else:
                    a.proc.kill()
                    a.proc.wait(10)
                b.ok("setlkw wr 0 0", timeout=10)
                b.ok("setlk un 0 0")
                b.ok("flock un")
                # c2's own flock stayed with it meanwhile
                b.ok("flock ex nb")
                b.ok("flock un")


def test_a_stopped_client_loses_its_locks_to_a_waiter(cluster: Cluster) -> None:
    """A lock holder whose daemon stops (SIGSTOP) stands in another node's way for at
    most a lease term and a retry; after SIGCONT it logs the lock it lost, and the
    lock stays with the node that took it."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "f").write_bytes(b"x")
    with locker(cluster, "c1", c1 / "f") as a, \
            locker(cluster, "c2", c2 / "f") as b:
        a.ok("setlk wr 0 0")
        b.refused("setlk wr 0 0")
        with stopped(daemon_pid(c1)):
            waited = b.ok("setlkw wr 0 0", timeout=30)
            assert waited < LEASE_TERM + RETRY + SLACK + 1, waited
        deadline = time.monotonic() + 10
        while not log_lines(cluster, "c1.log", "lost a POSIX lock"):
            assert time.monotonic() < deadline, "c1 never said it lost its lock"
            time.sleep(0.1)
        assert log_lines(cluster, "mds.log", "holds a lock another client asked for")
        with locker(cluster, "c1", c1 / "f") as a2:  # c2 still holds it
            a2.refused("setlk rd 0 1")
        b.ok("setlk un 0 0")


def test_locks_survive_an_mds_restart(cluster: Cluster) -> None:
    """SIGKILL the mds while both clients hold locks; restart it from the journal: each
    client states its locks again, so they still exclude each other."""
    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    (c1 / "f").write_bytes(b"x" * 10)
    with locker(cluster, "c1", c1 / "f") as a, \
            locker(cluster, "c2", c2 / "f") as b:
        a.ok("setlk wr 0 5")
        a.ok("flock ex nb")
        b.ok("setlk rd 5 5")
        cluster.restart("mds")
        b.refused("setlk wr 0 1")  # (sent again by the client until the mds is back)
        a.refused("setlk wr 5 1")
        b.refused("flock sh nb")
        a.ok("flock un")
        b.ok("flock sh nb")
        a.ok("setlk un 0 0")
        b.ok("setlk wr 0 0")
    assert not log_lines(cluster, "c1.log", "lost a")
    assert not log_lines(cluster, "c2.log", "lost a")


def test_localflock_keeps_a_clients_locks_on_its_node(tmp_path: Path) -> None:
    """``-o localflock`` (Lustre's option of that name): c1's kernel keeps its locks,
    which hold between its own processes and mean nothing to c2, whose locks still
    go to the mds."""
    mds_args = ["--lease-term", str(LEASE_TERM), "--recall-timeout", str(RECALL_TIMEOUT)]
    with make_cluster(tmp_path, mds_args, c1_args=("-o", "localflock")) as cluster:
        c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
        (c1 / "f").write_bytes(b"x")
        with locker(cluster, "c1", c1 / "f") as a, locker(cluster, "c1", c1 / "f") as a2, \
                locker(cluster, "c2", c2 / "f") as b, locker(cluster, "c2", c2 / "f") as b2:
            a.ok("flock ex nb")
            a2.refused("flock ex nb")  # the kernel's lock, on its node
            b.ok("flock ex nb")  # c2 knows nothing of it
            b2.refused("flock ex nb")  # through the mds
            a.ok("setlk wr 0 0")
            a2.refused("setlk wr 0 0")
            b.ok("setlk wr 0 0")
            b2.refused("setlk rd 0 1")


HDF5_OPEN = """
import sys, h5py
try:
    f = h5py.File(sys.argv[1], sys.argv[2])
except OSError as exc:
    print("refused", "unable to lock file" in str(exc), flush=True)
else:
    print("opened", int(f["x"][-1]), flush=True)
"""


def test_hdf5_file_locking_holds_across_nodes(cluster: Cluster) -> None:
    """HDF5 locks a file it opens (flock): a file one node has open for writing cannot
    be opened for writing, or reading, on another node meanwhile (it could on a
    filesystem whose locks are per node); once closed, it can."""
    h5py = pytest.importorskip("h5py")  # (a test dependency: see pyproject.toml)
    import numpy as np

    c1, c2 = cluster.mnt["c1"], cluster.mnt["c2"]
    with h5py.File(c1 / "d.h5", "w") as f:
        f["x"] = np.arange(1000)
    with h5py.File(c1 / "d.h5", "r+") as f:
        for mode in ("r+", "r"):
            with on_host(cluster, "c2", HDF5_OPEN, str(c2 / "d.h5"), mode) as p:
                assert Locker(p, ready=False).line() == "refused True", mode
        f["x"][-1] = 7
    with on_host(cluster, "c2", HDF5_OPEN, str(c2 / "d.h5"), "r+") as p:
        assert Locker(p, ready=False).line() == "opened 7"
