"""Burst buffer: an application writing into memfs --backing DIR versus into DIR directly.

Two workloads, each written by --jobs processes (one file at a time each, a
file is open(O_CREAT|O_TRUNC), write, [fsync], close):

* large: --size bytes in all (default 2G) as --large-files files (default 4),
  written in --block pieces (default 1M);
* small: --small-files files (default 20,000) of --small-size (default 16K),
  one write each, one directory per writer.

Each round runs these phases, in an order that rotates from round to round:

* memfs:        mount memfs with --backing DIR/<fresh dir>, write into the mount,
                then ``memfs flush MNT --wait``, check ``memfs status``, compare
                DIR with the mount, ``memfs umount``;
* direct:       write into DIR, close only: the data is in the page cache, not
                safe yet; then sync(2), to see when it is;
* direct+fsync: write into DIR with fsync before each close: what an application
                that needs its data safe on the parallel filesystem pays;
* tmpfs:        write into a tmpfs of the pool's size, the memory-speed reference.

Times, all wall clock on one monotonic clock:

* write: application-visible, from the first writer's first open to the last
  writer's last close (close included);
* in DIR: from the same start until the data is in DIR: for memfs until
  ``memfs flush --wait`` returns (it writes each file to a temporary name,
  fsyncs unless --no-backing-fsync, renames); for direct until sync(2) returns;
  for direct+fsync the write time itself.

speed-up = direct time / memfs time (above 1: memfs is faster).  Before every
timed phase: sync, then ``echo 3 > /proc/sys/vm/drop_caches``, so one phase's
dirty or cached pages neither tax nor help the next.  The table shows medians
over --rounds, because this kind of machine is noisy.  Needs root (mounts,
drop_caches); every mount and temporary tree is removed, on failure too.

By default DIR is a directory on --backing-dir's filesystem, typically a local
disk, much faster than a parallel filesystem.  ``--throttle WBPS[,WIOPS]``
(e.g. ``200M,2000``) EMULATES a slow backing filesystem instead: a sparse image
file in --backing-dir (2 x the workloads + 512 MiB), on a loop device
(direct-io), ``mkfs.ext4``, mounted under /tmp; writes to that loop device are
limited by a cgroup v1 blkio throttle (blkio.throttle.write_bps_device and
write_iops_device) that holds the direct writer processes, or the memfs daemon
with all its threads (``memfs mount`` is started inside the cgroup; the daemon
forks from it and its threads inherit it).  A preflight measures, with dd,
which writes the throttle really limits here; cgroup v1 charges a write to the
task that submits it, so O_DIRECT and fsync-driven writes are limited, while
buffered data written back by the kernel's flusher threads (``close only`` and
its sync(2), memfs with --no-backing-fsync) and ext4 journal commits (jbd2) are
not.  The header and the tables say so, with the share of each phase's writes
to the device that went through the throttle.  The cgroup, mount, loop device
and image are removed at the end, also on failure, SIGTERM or SIGINT.

    python bench/bbbench.py [--rounds 3] [--size 2G] [--backing-dir /var/tmp]
        [--memfs-opt=--flush-workers=4] [--skip-small] [--json out.json]
        [--throttle 200M,2000]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from fsbench import mounted_tmpfs  # bench/ is the script's directory

MiB = 1 << 20
GiB = 1 << 30
MEMFS = [sys.executable, "-m", "memfs"]
PHASES = ("memfs", "direct", "direct+fsync", "tmpfs")
TIMES = ("write", "in_dir", "drain", "umount")  # result keys in seconds (the others: MiB, %)
LABELS = {
    "memfs": "memfs --backing DIR",
    "direct": "DIR direct, close only (not safe)",
    "direct+fsync": "DIR direct, fsync+close (safe)",
    "tmpfs": "tmpfs (reference)",
}
CGROUP_V1_BLKIO = Path("/sys/fs/cgroup/blkio")
WRITER_TIMEOUT = 1800.0  # seconds for one write phase (the dirty cap may hold writers back)
UMOUNT_TIMEOUT = 300.0  # `memfs umount` drains; after `flush --wait` there is nothing left


@dataclass(frozen=True)
class Workload:
    name: str
    files: int
    file_size: int
    block: int

    @property
    def total(self) -> int:
        return self.files * self.file_size

    def describe(self) -> str:
        return f"{self.files:,} x {fmt_size(self.file_size)} = {fmt_size(self.total)}"

    def layout(self, jobs: int) -> list[list[str]]:
        """Relative paths each writer writes: writer k owns directory wk/."""
        jobs = max(1, min(jobs, self.files))
        stem = "big" if self.name == "large" else "f"
        out: list[list[str]] = [[] for _ in range(jobs)]
        for i in range(self.files):
            out[i % jobs].append(f"w{i % jobs}/{stem}{i:05d}")
        return out


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16K, 512M, 2G)")
    shift = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]
    return int(float(m.group(1)) * (1 << shift))


def fmt_size(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


# -- writers -------------------------------------------------------------------


def _writer(
    root: str, paths: list[str], file_size: int, block: int, fsync: bool,
    barrier: Barrier, conn: Connection, cgroup: str | None,
) -> None:
    """One application process; reports (t_first_open, t_last_close) on one clock.
    With *cgroup* (a blkio cgroup directory) it first moves itself into it."""
    try:
        if cgroup is not None:
            Path(cgroup, "cgroup.procs").write_text(f"{os.getpid()}\n")
            if blkio_cgroup_of(os.getpid()) != "/" + os.path.basename(cgroup):
                raise RuntimeError(f"writer {os.getpid()} is not in blkio cgroup {cgroup}")
        buf = memoryview(os.urandom(min(block, file_size)))
        for d in sorted({os.path.dirname(p) for p in paths}):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        full = [os.path.join(root, p) for p in paths]
        barrier.wait(timeout=60)
        t0 = time.monotonic()
        for path in full:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                left = file_size
                while left:
                    left -= os.write(fd, buf[: min(left, len(buf))])
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        t1 = time.monotonic()
        conn.send(("ok", t0, t1))
    except BaseException as exc:  # noqa: B036 - report anything to the parent, then exit
        barrier.abort()
        conn.send(("error", f"{type(exc).__name__}: {exc}", 0.0))
        os._exit(1)


def run_writers(
    root: Path, w: Workload, jobs: int, fsync: bool, cgroup: Path | None = None,
) -> tuple[float, float]:
    """Write workload *w* under *root*, each writer in blkio *cgroup* if given;
    returns (start, end) in time.monotonic()."""
    ctx = multiprocessing.get_context("fork")
    layout = w.layout(jobs)
    barrier = ctx.Barrier(len(layout))
    procs, pipes = [], []
    try:
        for paths in layout:
            r, wr = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_writer,
                args=(str(root), paths, w.file_size, w.block, fsync, barrier, wr,
                      None if cgroup is None else str(cgroup)),
            )
            p.start()
            wr.close()
            procs.append(p)
            pipes.append(r)
        results = []
        deadline = time.monotonic() + WRITER_TIMEOUT
        for r in pipes:
            if not r.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"writers under {root} did not finish in {WRITER_TIMEOUT:.0f} s")
            try:
                results.append(r.recv())
            except EOFError:
                raise RuntimeError(f"a writer under {root} died without a word") from None
        errors = [msg for status, msg, _ in results if status != "ok"]
        if errors:
            raise RuntimeError(f"writing under {root}: {errors[0]}")
        return min(t0 for _, t0, _ in results), max(t1 for _, _, t1 in results)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def verify(root: Path, w: Workload, jobs: int, against: Path | None, full: bool,
           mounted: bool = False) -> None:
    """*root* holds exactly the files written, each of the right size (no temporaries
    left behind; while *mounted*, the daemon's own DIR/.memfs-tmp is not looked at);
    with *against*, sampled (or, with *full*, all) files match it byte for byte."""
    expected = sorted(p for paths in w.layout(jobs) for p in paths)
    found: dict[str, int] = {}
    for dirpath, dirs, names in os.walk(root):
        if mounted and dirpath == str(root) and ".memfs-tmp" in dirs:
            dirs.remove(".memfs-tmp")
        for name in names:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, root)] = os.lstat(path).st_size
    missing = [p for p in expected if p not in found]
    extra = sorted(set(found) - set(expected))
    wrong = [p for p in expected if p in found and found[p] != w.file_size]
    if missing or extra or wrong:
        raise RuntimeError(
            f"{root}: {len(missing)} files missing (e.g. {missing[:2]}), {len(extra)} unexpected"
            f" (e.g. {extra[:2]}), {len(wrong)} of the wrong size (e.g. {wrong[:2]})"
        )
    if against is not None:
        sample = expected if full else sorted({expected[0], expected[len(expected) // 2], expected[-1]})
        for p in sample:
            if not filecmp.cmp(root / p, against / p, shallow=False):
                raise RuntimeError(f"{root / p} differs from {against / p}")


# -- the system ----------------------------------------------------------------


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def mounts() -> list[tuple[str, str, str]]:
    """(mountpoint, fstype, source) from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), left.split()[4])
            fstype, source = right.split()[:2]
            out.append((mnt, fstype, source))
    return out


def is_mounted(path: Path) -> bool:
    # Not os.path.ismount: it says False for a FUSE mount whose daemon died (ENOTCONN).
    return any(m == str(path) for m, _, _ in mounts())


def filesystem_of(path: Path) -> str:
    """What a user would want to know about the backing directory's filesystem."""
    real = os.path.realpath(path)
    best = max(
        (m for m in mounts() if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
        key=lambda m: len(m[0]),
    )
    statf = subprocess.run(["stat", "-f", "-c", "%T", real], capture_output=True, text=True)
    usage = shutil.disk_usage(real)
    return (
        f"{best[1]} on {best[2]} (mounted at {best[0]}; stat -f: {statf.stdout.strip() or '?'};"
        f" {fmt_size(usage.free)} free of {fmt_size(usage.total)})"
    )


def dirty_limits() -> str:
    vm = Path("/proc/sys/vm")
    dirty_bytes = int((vm / "dirty_bytes").read_text())
    if dirty_bytes:
        return f"vm.dirty_bytes {fmt_size(dirty_bytes)}"
    ratio = int((vm / "dirty_ratio").read_text())
    bg = int((vm / "dirty_background_ratio").read_text())
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return (f"vm.dirty_ratio {ratio}% (~{fmt_size(avail * ratio / 100)} of dirty pages before"
            f" writers are throttled), dirty_background_ratio {bg}%")


def memfs(
    *args: str, timeout: float | None = None, cgroup: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `memfs ARGS`; with *cgroup*, from a shell that first moves itself into it."""
    return subprocess.run(in_cgroup([*MEMFS, *args], cgroup), capture_output=True, text=True,
                          timeout=timeout)


def memfs_lacks_backing() -> str | None:
    """Why the memfs phases cannot run with this memfs, or None."""
    mount_help = memfs("mount", "--help").stdout
    if "--backing" not in mount_help:
        return "`memfs mount` has no --backing yet"
    top = memfs("--help").stdout
    for cmd in ("flush", "status"):
        if not re.search(rf"^\s+{cmd}\b", top, re.M):
            return f"there is no `memfs {cmd}` yet"
    return None


def daemon_pids(mnt: Path) -> list[int]:
    """The memfs daemon(s) serving *mnt*: `memfs mount` forks them with its own argv."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"memfs" in argv and b"mount" in argv and os.fsencode(str(mnt)) in argv:
            pids.append(int(entry))
    return pids


def unmount_memfs(mnt: Path, pids: list[int]) -> None:
    """`memfs umount` (drains, waits for the daemon); if that fails, lazy fusermount3
    and, if the daemon still will not go, SIGKILL for the daemon we started."""
    if not is_mounted(mnt):
        return
    try:
        res = memfs("umount", str(mnt), timeout=UMOUNT_TIMEOUT)
        if res.returncode == 0 and not is_mounted(mnt):
            return
        print(f"bench: memfs umount {mnt}: {res.stderr.strip()}", file=sys.stderr)
    except subprocess.TimeoutExpired:
        print(f"bench: memfs umount {mnt} took over {UMOUNT_TIMEOUT:.0f} s", file=sys.stderr)
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, capture_output=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
            print(f"bench: killed memfs daemon {p}", file=sys.stderr)
        except ProcessLookupError:
            pass


@contextmanager
def mounted_memfs(
    mnt: Path, backing: Path, pool: int, extra: list[str], cgroup: Path | None = None,
) -> Iterator[Path]:
    """With *cgroup*, `memfs mount` starts in it, so the daemon it forks (and every
    thread the daemon starts) is in it too."""
    mnt.mkdir(parents=True, exist_ok=True)
    res = memfs("mount", str(mnt), "--size", str(pool), "--backing", str(backing), *extra,
                timeout=180, cgroup=cgroup)
    pids = daemon_pids(mnt)
    try:
        if res.returncode != 0:
            raise RuntimeError(f"memfs mount failed: {res.stderr.strip()}")
        yield mnt
    finally:
        unmount_memfs(mnt, pids)


# -- an emulated slow backing filesystem (--throttle) ----------------------------


@dataclass(frozen=True)
class Limit:
    bps: int
    iops: int | None

    def describe(self) -> str:
        return f"{fmt_size(self.bps)}/s" + (f" and {self.iops:,} IOPS" if self.iops else "")


def parse_limit(text: str) -> Limit:
    parts = text.split(",")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"not WBPS[,WIOPS]: {text!r} (e.g. 200M,2000)")
    bps = parse_size(parts[0])
    iops = None
    if len(parts) == 2:
        if not parts[1].strip().isdigit():
            raise argparse.ArgumentTypeError(f"not a number of IOPS: {parts[1]!r}")
        iops = int(parts[1])
    if bps <= 0 or iops == 0:
        raise argparse.ArgumentTypeError(f"a limit must be above 0: {text!r}")
    return Limit(bps, iops)


def blkio_cgroup_of(pid: int, tid: int | None = None) -> str | None:
    """The cgroup v1 blkio path of a process (or one of its threads), e.g. "/"."""
    path = f"/proc/{pid}/cgroup" if tid is None else f"/proc/{pid}/task/{tid}/cgroup"
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        _, controllers, cg = line.split(":", 2)
        if "blkio" in controllers.split(","):
            return cg
    return None


def in_cgroup(cmd: list[str], cgroup: Path | None) -> list[str]:
    """*cmd* run by a shell that first moves itself into *cgroup* (its children inherit it)."""
    if cgroup is None:
        return cmd
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *cmd]


class ThrottledDisk:
    """ext4 on a loop device over a sparse image, writes limited by a cgroup v1 blkio
    throttle: whatever runs in ``self.cgroup`` writes to it at most at *limit*.
    Everything it creates is removed by close(), also when set-up fails half way."""

    def __init__(self, image_dir: Path, size: int, limit: Limit) -> None:
        self.image_dir, self.size, self.limit = image_dir, size, limit
        self.image: Path | None = None
        self.loop: str | None = None
        self.majmin = ""
        self.mnt: Path | None = None
        self.mounted = False
        self.cgroup: Path | None = None
        self.dio = "?"

    def __enter__(self) -> ThrottledDisk:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        if not (CGROUP_V1_BLKIO / "blkio.throttle.write_bps_device").exists():
            raise RuntimeError(f"no cgroup v1 blkio throttle at {CGROUP_V1_BLKIO}")
        if shutil.disk_usage(self.image_dir).free < self.size + GiB:
            raise RuntimeError(f"{self.image_dir}: less than {fmt_size(self.size + GiB)} free"
                               " for the image")
        fd, name = tempfile.mkstemp(prefix="memfs-bbbench-", suffix=".img", dir=self.image_dir)
        self.image = Path(name)
        try:
            os.ftruncate(fd, self.size)  # sparse
        finally:
            os.close(fd)
        self.loop = run(["losetup", "--find", "--show", "--direct-io=on", str(self.image)]).strip()
        sysblk = Path("/sys/block") / os.path.basename(self.loop)
        self.majmin = (sysblk / "dev").read_text().strip()
        dio = sysblk / "loop" / "dio"
        self.dio = dio.read_text().strip() if dio.exists() else "?"
        # No lazy inode-table/journal init: ext4lazyinit would write behind our back.
        run(["mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", self.loop])
        self.mnt = Path(tempfile.mkdtemp(prefix="memfs-bbbench-dir-"))
        run(["mount", "-t", "ext4", self.loop, str(self.mnt)])
        self.mounted = True
        cg = CGROUP_V1_BLKIO / f"memfs-bbbench-{os.getpid()}"
        cg.mkdir()
        self.cgroup = cg
        (cg / "blkio.throttle.write_bps_device").write_text(f"{self.majmin} {self.limit.bps}\n")
        if self.limit.iops:
            (cg / "blkio.throttle.write_iops_device").write_text(
                f"{self.majmin} {self.limit.iops}\n")

    def close(self) -> None:
        if self.cgroup is not None:
            self._remove_cgroup(self.cgroup)
            self.cgroup = None
        if self.mounted and self.mnt is not None:
            if subprocess.run(["umount", str(self.mnt)], capture_output=True).returncode != 0:
                print(f"bench: umount {self.mnt} failed; detaching it lazily", file=sys.stderr)
                subprocess.run(["umount", "-l", str(self.mnt)], check=False)
            self.mounted = False
        if self.loop is not None:
            # After a lazy umount the device is still busy: -d then frees it on release.
            subprocess.run(["losetup", "-d", self.loop], check=False)
            self.loop = None
        if self.mnt is not None:
            try:
                self.mnt.rmdir()
            except OSError as exc:
                print(f"bench: rmdir {self.mnt}: {exc}", file=sys.stderr)
            self.mnt = None
        if self.image is not None:
            self.image.unlink(missing_ok=True)
            self.image = None

    @staticmethod
    def _remove_cgroup(cg: Path) -> None:
        deadline = time.monotonic() + 10
        while True:
            # Whatever is left in it (a daemon that would not go) is moved back to the root.
            for pid in (cg / "cgroup.procs").read_text().split():
                try:
                    (CGROUP_V1_BLKIO / "cgroup.procs").write_text(pid + "\n")
                except OSError:
                    pass
            try:
                cg.rmdir()
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    print(f"bench: rmdir {cg}: {exc}", file=sys.stderr)
                    return
                time.sleep(0.2)

    def counters(self) -> tuple[int, int]:
        """(bytes written to the loop device, bytes of them charged to our cgroup)."""
        assert self.loop is not None and self.cgroup is not None
        stat = (Path("/sys/block") / os.path.basename(self.loop) / "stat").read_text().split()
        charged = 0
        for line in (self.cgroup / "blkio.throttle.io_service_bytes").read_text().splitlines():
            f = line.split()
            if len(f) == 3 and f[0] == self.majmin and f[1] == "Write":
                charged = int(f[2])
        return int(stat[6]) * 512, charged

    def threads_outside(self, pids: list[int]) -> tuple[int, list[str]]:
        """(threads of *pids*, those of them not in our cgroup)."""
        assert self.cgroup is not None
        want = "/" + self.cgroup.name
        n, outside = 0, []
        for pid in pids:
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            for tid in tids:
                cg = blkio_cgroup_of(pid, tid)
                if cg is None:
                    continue  # exited meanwhile
                n += 1
                if cg != want:
                    outside.append(f"{pid}/{tid} in {cg}")
        return n, outside

    def preflight(self) -> tuple[list[str], dict[str, Any]]:
        """Which writes the throttle limits here, measured with dd: lines for the
        header and the numbers.  Raises if it does not even limit O_DIRECT writes."""
        assert self.mnt is not None and self.cgroup is not None
        lim = self.limit
        mib = int(min(GiB, max(64 * MiB, 2 * lim.bps)) // MiB)
        res: dict[str, Any] = {"mib": mib}

        def dd(name: str, args: list[str], inside: bool, sync: bool = False) -> dict[str, float]:
            assert self.mnt is not None
            path = self.mnt / "preflight.dat"
            cmd = ["dd", "if=/dev/zero", f"of={path}", *args, "status=none"]
            if sync:  # sync(2) from inside the cgroup too
                cmd = ["sh", "-c", '"$@" && sync', "sh", *cmd]
            drop_caches()
            d0, c0 = self.counters()
            t = time.monotonic()
            run(in_cgroup(cmd, self.cgroup if inside else None))
            el = time.monotonic() - t
            d1, c1 = self.counters()
            path.unlink()
            os.sync()
            out = {"s": el, "dev_bytes": d1 - d0, "charged_bytes": c1 - c0}
            res[name] = out
            return out

        def share(r: dict[str, float], nbytes: int) -> str:
            return f"{100 * min(1.0, r['charged_bytes'] / nbytes):.0f}% of its bytes charged"

        nbytes = mib * MiB
        ref = dd("odirect_outside", ["bs=1M", f"count={mib}", "oflag=direct"], inside=False)
        odir = dd("odirect", ["bs=1M", f"count={mib}", "oflag=direct"], inside=True)
        fsy = dd("fsync", ["bs=1M", f"count={mib}", "conv=fsync"], inside=True)
        buf = dd("buffered_sync", ["bs=1M", f"count={mib}"], inside=True, sync=True)
        rate = {k: nbytes / MiB / r["s"] for k, r in
                (("ref", ref), ("odir", odir), ("fsync", fsy), ("buf", buf))}
        limited = lim.bps / MiB * 1.2
        if odir["charged_bytes"] < 0.95 * nbytes or rate["odir"] > limited:
            raise RuntimeError(
                f"the blkio throttle does not limit O_DIRECT writes to {self.loop} here"
                f" ({rate['odir']:.0f} MiB/s, {share(odir, nbytes)}): no emulation possible")

        verdicts: dict[str, str] = {}

        def verdict(name: str, v: float) -> str:
            charged = res[name]["charged_bytes"]
            ok = charged >= 0.95 * nbytes and v <= limited
            free = charged < 0.05 * nbytes
            verdicts[name] = "THROTTLED" if ok else "NOT throttled" if free else "PARTLY throttled"
            return verdicts[name]

        lines = [
            f"preflight ({mib} MiB each with dd, bs=1M, after drop_caches, measured in this run):",
            f"  O_DIRECT outside the cgroup (the unthrottled device): {rate['ref']:.0f} MiB/s",
            f"  O_DIRECT in the cgroup: {rate['odir']:.0f} MiB/s, {share(odir, nbytes)}:"
            f" {verdict('odirect', rate['odir'])}",
            f"  buffered write + fsync in the cgroup: {rate['fsync']:.0f} MiB/s,"
            f" {share(fsy, nbytes)}: {verdict('fsync', rate['fsync'])}",
            f"  buffered write, then sync(2), both in the cgroup: {rate['buf']:.0f} MiB/s"
            f" including the sync, {share(buf, nbytes)}: {verdict('buffered_sync', rate['buf'])}",
        ]
        if lim.iops:
            n = int(min(20000, max(200, 2 * lim.iops)))
            io = dd("iops_4k_odirect", ["bs=4k", f"count={n}", "oflag=direct"], inside=True)
            res["iops_4k_odirect"]["ios"] = n
            ok = io["charged_bytes"] >= 0.95 * n * 4096 and n / io["s"] <= lim.iops * 1.2
            lines.append(f"  4 KiB O_DIRECT writes in the cgroup: {n / io['s']:.0f} IOPS,"
                         f" {share(io, n * 4096)}: {'THROTTLED' if ok else 'NOT (fully) throttled'}")
        if verdicts == {"odirect": "THROTTLED", "fsync": "THROTTLED", "buffered_sync": "NOT throttled"}:
            lines.append(
                "  so: O_DIRECT and fsync-driven writes issued by a task in the cgroup are limited"
                " (the 'fsync+close' writers; memfs write-back, which fsyncs each file before its"
                " rename); buffered data written back by the kernel's flusher threads is NOT"
                " (cgroup v1 charges it to the flusher, not to the writer's cgroup): the 'close"
                " only' writers' data and their sync(2) go at the device's speed, as memfs"
                " --no-backing-fsync would; nor are ext4 journal commits (jbd2), nor reads")
        else:
            lines.append("  so: the throttle does not behave as cgroup v1 usually does here; read"
                         " each phase's throttled share in the tables")
        lines.append("  the tables show, per phase, the MiB written to the loop device and the share"
                     " of them charged to the cgroup, i.e. subject to the limit")
        res["verdicts"] = verdicts
        if rate["ref"] < 1.5 * lim.bps / MiB:
            lines.append(f"  WARNING: the device itself ({rate['ref']:.0f} MiB/s) is not much"
                         " faster than the limit: the throttle is not all that bounds it")
        res["rates_mib_s"] = rate
        return lines, res


def run(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip() or f'exit {res.returncode}'}")
    return res.stdout


# -- phases --------------------------------------------------------------------


@dataclass
class Bench:
    args: argparse.Namespace
    base: Path  # mountpoints, on /tmp
    backing_root: Path  # our own directory in the backing filesystem
    disk: ThrottledDisk | None = None  # --throttle
    memfs_config: dict[str, Any] | None = None
    daemon_threads: int = 0

    @property
    def cgroup(self) -> Path | None:
        return None if self.disk is None else self.disk.cgroup

    def io(self) -> tuple[int, int]:
        return (0, 0) if self.disk is None else self.disk.counters()

    def io_result(self, before: tuple[int, int]) -> dict[str, float]:
        """MiB written to the throttled device since *before*, and MiB of them charged
        to the cgroup (the part the throttle could limit)."""
        if self.disk is None:
            return {}
        after = self.disk.counters()
        dev, charged = after[0] - before[0], after[1] - before[1]
        return {"dev_mib": dev / MiB, "throttled_mib": charged / MiB,
                "throttled_pct": 100 * charged / dev if dev else 0.0}

    def phase(self, phase: str, w: Workload, rnd: int) -> dict[str, float]:
        fn: dict[str, Callable[[Workload, int], dict[str, float]]] = {
            "memfs": self.memfs, "direct": self.direct, "direct+fsync": self.direct_fsync,
            "tmpfs": self.tmpfs,
        }
        return fn[phase](w, rnd)

    def memfs(self, w: Workload, rnd: int) -> dict[str, float]:
        a = self.args
        backing = self.backing_root / f"memfs-{w.name}-{rnd}"
        backing.mkdir()
        mnt = self.base / "memfs"
        try:
            with mounted_memfs(mnt, backing, a.pool, a.memfs_opt, cgroup=self.cgroup):
                drop_caches()
                io0 = self.io()
                t0, t1 = run_writers(mnt, w, a.jobs, fsync=False)
                res = memfs("flush", str(mnt), "--wait", timeout=a.flush_timeout)
                t2 = time.monotonic()
                io = self.io_result(io0)
                if self.disk is not None:
                    pids = daemon_pids(mnt)
                    n, outside = self.disk.threads_outside(pids)
                    if not pids or outside:
                        raise RuntimeError(f"memfs daemon {pids}: threads outside the throttled"
                                           f" cgroup: {outside[:3]}")
                    self.daemon_threads = max(self.daemon_threads, n)
                if res.returncode != 0:
                    raise RuntimeError(f"memfs flush --wait: {res.stderr.strip()}")
                st = memfs("status", str(mnt), "--json", timeout=60)
                if st.returncode != 0:
                    raise RuntimeError(f"memfs status --json: {st.stderr.strip()}")
                status = json.loads(st.stdout)
                if status.get("dirty_bytes") or status.get("errors"):
                    raise RuntimeError(
                        f"after flush --wait: dirty_bytes {status.get('dirty_bytes')},"
                        f" errors {status.get('errors')}"
                    )
                self.memfs_config = {
                    k: status.get(k) for k in ("dirty_max", "flush_delay", "workers", "capacity")
                }
                verify(backing, w, a.jobs, against=mnt, full=a.verify, mounted=True)
                t3 = time.monotonic()
                unmount_memfs(mnt, daemon_pids(mnt))
                t4 = time.monotonic()
                if is_mounted(mnt):
                    raise RuntimeError(f"{mnt} still mounted after memfs umount")
            verify(backing, w, a.jobs, against=None, full=False)  # still all there after umount
        finally:
            shutil.rmtree(backing, ignore_errors=True)
        return {"write": t1 - t0, "in_dir": t2 - t0, "drain": t2 - t1, "umount": t4 - t3, **io}

    def _direct(self, w: Workload, rnd: int, fsync: bool) -> dict[str, float]:
        d = self.backing_root / f"direct-{'fsync-' if fsync else ''}{w.name}-{rnd}"
        d.mkdir()
        try:
            drop_caches()
            io0 = self.io()
            t0, t1 = run_writers(d, w, self.args.jobs, fsync=fsync, cgroup=self.cgroup)
            if not fsync:
                os.sync()  # the backing filesystem is the only one with dirty pages now
            t2 = time.monotonic() if not fsync else t1
            io = self.io_result(io0)
            verify(d, w, self.args.jobs, against=None, full=False)
        finally:
            shutil.rmtree(d, ignore_errors=True)
            os.sync()  # the deletions, outside of any timed phase
        return {"write": t1 - t0, "in_dir": t2 - t0, **io}

    def direct(self, w: Workload, rnd: int) -> dict[str, float]:
        return self._direct(w, rnd, fsync=False)

    def direct_fsync(self, w: Workload, rnd: int) -> dict[str, float]:
        return self._direct(w, rnd, fsync=True)

    def tmpfs(self, w: Workload, rnd: int) -> dict[str, float]:
        with mounted_tmpfs(self.base / "tmpfs", str(self.args.pool)) as root:
            drop_caches()
            t0, t1 = run_writers(root, w, self.args.jobs, fsync=False)
            verify(root, w, self.args.jobs, against=None, full=False)
        return {"write": t1 - t0}


# -- report --------------------------------------------------------------------


def report(
    medians: dict[str, dict[str, dict[str, float]]], workloads: list[Workload], args: argparse.Namespace,
    header: list[str],
) -> None:
    print()
    for line in header:
        print(line)
    for w in workloads:
        med = medians[w.name]
        print(f"\n{w.name} files: {w.describe()}, {min(args.jobs, w.files)} writers;"
              f" medians of {args.rounds} rounds")
        throttled = args.throttle is not None
        print("| phase | write s | MiB/s | files/s | in DIR s | to DIR MiB/s |"
              + (" MiB to DIR's device | of it throttled |" if throttled else ""))
        print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if throttled else ""))
        for phase in PHASES:
            if phase not in med:
                continue
            m = med[phase]
            in_dir = m.get("in_dir")
            cells = [
                f"{m['write']:.2f}", f"{w.total / MiB / m['write']:.0f}", f"{w.files / m['write']:.0f}",
                f"{in_dir:.2f}" if in_dir is not None else "-",
                f"{w.total / MiB / in_dir:.0f}" if in_dir is not None else "-",
            ]
            if throttled:
                dev = m.get("dev_mib")
                cells += ["-", "-"] if dev is None else [f"{dev:.0f}", f"{m['throttled_pct']:.0f}%"]
            label = LABELS[phase]
            if throttled and phase == "direct":
                label += " [its write-back is not throttled]"
            print(f"| {label} | {' | '.join(cells)} |")
        if "memfs" in med:
            mem = med["memfs"]
            parts = []
            for other, key, what in (
                ("direct", "write", "app-visible vs close only"),
                ("direct+fsync", "write", "app-visible vs fsync+close"),
                ("direct+fsync", "in_dir", "until in DIR vs fsync+close"),
            ):
                if other in med:
                    parts.append(f"{what} {med[other][key] / mem[key]:.2f}x")
            if "tmpfs" in med:
                parts.append(f"memfs writes at {med['tmpfs']['write'] / mem['write']:.2f} of tmpfs speed")
            if parts:
                print("speed-up = direct s / memfs s: " + "; ".join(parts))
            print(f"memfs: flush --wait returned {mem['drain']:.2f} s after the last close;"
                  f" umount after it took {mem['umount']:.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=parse_size, default=parse_size("2G"),
                    help="bytes in the large-file workload (default 2G)")
    ap.add_argument("--large-files", type=int, default=4, help="files it is split into (default 4)")
    ap.add_argument("--block", type=parse_size, default=MiB, help="write size, large files (1M)")
    ap.add_argument("--small-files", type=int, default=20000)
    ap.add_argument("--small-size", type=parse_size, default=parse_size("16K"))
    ap.add_argument("--jobs", type=int, default=2, help="writer processes (default 2)")
    ap.add_argument("--backing-dir", type=Path, default=Path("/var/tmp"),
                    help="where DIR is made (a disk, not tmpfs; default /var/tmp)")
    ap.add_argument("--pool", type=parse_size, default=None,
                    help="memfs pool and tmpfs size (default: max(4G, 4 x largest workload), so that "
                         "the workload stays below the default dirty cap, half the pool)")
    ap.add_argument("--memfs-opt", action="append", default=[],
                    help="extra `memfs mount` argument, e.g. --memfs-opt=--no-backing-fsync")
    ap.add_argument("--flush-timeout", type=float, default=900.0, help="seconds for flush --wait")
    ap.add_argument("--verify", action="store_true",
                    help="compare every file in DIR with the mount (default: 3 sampled files)")
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--skip-memfs", action="store_true")
    ap.add_argument("--skip-direct", action="store_true", help="both direct phases")
    ap.add_argument("--skip-tmpfs", action="store_true")
    ap.add_argument("--json", help="also write results here")
    ap.add_argument("--throttle", type=parse_limit, metavar="WBPS[,WIOPS]",
                    help="emulate a slow DIR: ext4 on a loop device over a sparse image in"
                         " --backing-dir, writes limited by a cgroup v1 blkio throttle"
                         " (e.g. 200M,2000: 200 MiB/s, 2000 write IOPS); see the header")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench needs root (mounts, drop_caches)", file=sys.stderr)
        return 2

    workloads = []
    if not args.skip_large:
        n = max(1, args.large_files)
        workloads.append(Workload("large", n, args.size // n, args.block))
    if not args.skip_small:
        workloads.append(Workload("small", args.small_files, args.small_size, args.small_size))
    if not workloads:
        print("nothing to do (--skip-large and --skip-small)", file=sys.stderr)
        return 2
    if args.pool is None:
        # The default dirty cap is half the pool: a workload as large as the cap
        # would measure how fast DIR takes the data, not how fast memfs does.
        args.pool = max(4 * GiB, 4 * max(w.total for w in workloads))

    phases = [p for p in PHASES if not getattr(args, f"skip_{p.split('+')[0]}")]
    notes = []
    if "memfs" in phases:
        why = memfs_lacks_backing()
        if why:
            notes.append(f"memfs phases skipped: {why}")
            phases.remove("memfs")
    if not phases:
        print("nothing to do: " + "; ".join(notes or ["every phase skipped"]), file=sys.stderr)
        return 2

    if any(o.startswith("--no-backing-fsync") for o in args.memfs_opt):
        notes.append("memfs runs with --no-backing-fsync: its 'in DIR' means in DIR's page cache,"
                     " not on disk (compare it with 'close only', not with 'fsync+close')")
    args.backing_dir.mkdir(parents=True, exist_ok=True)
    host_fs = filesystem_of(args.backing_dir)
    if re.match(r"(tmpfs|ramfs|fuse\.memfs) ", host_fs):
        notes.append(f"WARNING: the backing directory is in memory ({host_fs.split()[0]}), not a disk")
    # SIGTERM (e.g. a timeout(1) around make) and SIGHUP must run the finally blocks
    # that unmount, detach the loop device and remove the cgroup.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))

    with ExitStack() as stack:
        disk: ThrottledDisk | None = None
        throttle_info: dict[str, Any] = {}
        header: list[str] = []
        if args.throttle is not None:
            image = 2 * sum(w.total for w in workloads) + 512 * MiB
            try:
                disk = stack.enter_context(ThrottledDisk(args.backing_dir, image, args.throttle))
                assert disk.mnt is not None and disk.cgroup is not None
                print(f"bench: throttled DIR: {disk.loop} ({disk.majmin}) at {disk.mnt},"
                      f" cgroup {disk.cgroup}; preflight...", file=sys.stderr)
                lines, pre = disk.preflight()
            except (RuntimeError, OSError) as exc:
                print(f"bench: --throttle: {exc}", file=sys.stderr)
                return 1
            for line in lines:
                print(line, file=sys.stderr)
            dir_parent = disk.mnt
            fs = filesystem_of(disk.mnt)
            throttle_info = {
                "limit": {"write_bps": args.throttle.bps, "write_iops": args.throttle.iops},
                "image_bytes": image, "image_on": host_fs, "loop_direct_io": disk.dio,
                "cgroup": str(disk.cgroup), "preflight": pre,
            }
            header = [
                f"DIR is an EMULATED slow backing filesystem, not a parallel filesystem: ext4 on"
                f" {disk.loop} (a sparse {fmt_size(image)} image on {host_fs}; loop direct-io"
                f" {'on' if disk.dio == '1' else disk.dio}), writes limited to"
                f" {args.throttle.describe()} by a cgroup v1 blkio throttle"
                f" (blkio.throttle.write_*_device on {disk.majmin}) that holds the direct writers,"
                " or the memfs daemon with all its threads, shared among them",
                *lines,
            ]
        else:
            dir_parent = args.backing_dir
            fs = host_fs
        base = Path(tempfile.mkdtemp(prefix="memfs-bbbench-"))
        backing_root = Path(tempfile.mkdtemp(prefix="memfs-bbbench-", dir=dir_parent))
        bench = Bench(args, base, backing_root, disk)
        samples: dict[str, dict[str, dict[str, list[float]]]] = {}
        try:
            print(f"DIR: {backing_root}, {fs}", file=sys.stderr)
            for rnd in range(args.rounds):
                order = phases[rnd % len(phases):] + phases[: rnd % len(phases)]
                for w in workloads:
                    for phase in order:
                        t = time.monotonic()
                        try:
                            result = bench.phase(phase, w, rnd)
                        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                            print(f"bench: round {rnd + 1} {w.name} {phase}: {exc}", file=sys.stderr)
                            return 1
                        print(f"round {rnd + 1}/{args.rounds} {w.name} {phase}: "
                              + ", ".join(f"{k} {v:.2f}" + (" s" if k in TIMES else "")
                                          for k, v in result.items())
                              + f" ({time.monotonic() - t:.0f} s with set-up)", file=sys.stderr)
                        for k, v in result.items():
                            samples.setdefault(w.name, {}).setdefault(phase, {}).setdefault(k, []).append(v)
        finally:
            for sub in ("memfs", "tmpfs"):
                if is_mounted(base / sub):
                    if sub == "memfs":
                        unmount_memfs(base / sub, daemon_pids(base / sub))
                    else:
                        subprocess.run(["umount", "-l", str(base / sub)], check=False)
            shutil.rmtree(backing_root, ignore_errors=True)
            if not any(is_mounted(base / sub) for sub in ("memfs", "tmpfs")):
                shutil.rmtree(base, ignore_errors=True)
            else:
                print(f"bench: {base} still has a mount under it; left in place", file=sys.stderr)
        # (the ExitStack removes the throttled disk and its cgroup here)

    medians = {
        wn: {ph: {k: statistics.median(v) for k, v in d.items()} for ph, d in per.items()}
        for wn, per in samples.items()
    }
    header = [
        f"memfs --backing DIR vs DIR direct vs tmpfs; DIR on {fs}",
        *header,
        f"page cache: sync + drop_caches before every timed phase; {dirty_limits()}",
        f"memfs: pool {fmt_size(args.pool)}"
        + (f", {' '.join(args.memfs_opt)}" if args.memfs_opt else ", default options")
        + (f"; status: {json.dumps(bench.memfs_config)}" if bench.memfs_config else "")
        + (f"; daemon threads, all checked in the cgroup: {bench.daemon_threads}"
           if bench.daemon_threads else ""),
        *notes,
    ]
    report(medians, workloads, args, header)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "config": {
                "backing_fs": fs, "pool": args.pool, "memfs_opt": args.memfs_opt,
                "memfs_status": bench.memfs_config, "jobs": args.jobs, "rounds": args.rounds,
                "workloads": {w.name: {"files": w.files, "file_size": w.file_size} for w in workloads},
                "notes": notes, "throttle": throttle_info or None,
            },
            "samples": samples, "medians": medians,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
