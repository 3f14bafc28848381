"""memfs in cluster mode versus embedded, on one machine over loopback.

Cluster: 2 ``memfs memd`` (2 volumes of --volume-size each), one ``memfs mds``
over those 4 volumes and one client ``memfs mount --mds``, every socket on
127.0.0.1.  Embedded: ``memfs mount --size`` of the same total (4 volumes).
Both run what bench/fsbench.py runs: fio (psync, 2 jobs, a file per job) for
sequential 1 MiB write (fsync at end) and read, random 16 KiB write and read;
then create, stat, open (and close) and remove of 2 x --files empty files by 2
processes in 2 directories.  Rounds alternate the order and the table shows medians (this
kind of machine is noisy).  Every round starts its servers and mounts afresh.

``--code DIR`` puts DIR first on PYTHONPATH of every memfs process (``--code
/work/base`` measures another checkout); children run with ``python -P`` from
a scratch directory, so neither the script's nor the caller's directory can
shadow it.  The ``memfs.__file__`` they import is printed and checked.

Servers must say they listen within a deadline, fio and metadata phases are cut
off by an alarm, and servers and mounts are stopped on any exit (error,
Ctrl-C, SIGTERM).  Warnings and errors from the servers' and mounts' logs are
reported with the results.  Needs root and fio.

    python bench/clusterbench.py [--rounds 3] [--size 512M] [--volume-size 1G]
        [--files 3000] [--code DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from fsbench import FIO_CASES, META_PHASES, fio, metadata  # bench/ is the script's directory

LOOPBACK = "127.0.0.1"  # every server listens here and only here
READY_TIMEOUT = 30.0  # seconds for a server's "listening" line
MOUNT_TIMEOUT = 60.0  # `memfs mount` returns once the mount answers
UMOUNT_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0  # SIGTERM to SIGKILL
META_TIMEOUT = 600.0  # one set of metadata phases
SIDES = ("embedded", "cluster")
#: minimum cluster/embedded ratio per result key
GOALS = {
    "seq write 1M": 0.8, "seq read 1M": 0.8, "rand write 16K": 0.5, "rand read 16K": 0.5,
    "create": 0.5, "stat": 0.5,
}
LOG_PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")


class StepTimeout(Exception):
    """A benchmark step ran past its alarm."""


@contextmanager
def alarm(seconds: float, what: str) -> Iterator[None]:
    """Raise StepTimeout in this (main) thread after *seconds*: no step may hang the run.

    subprocess.run kills its child when interrupted this way.
    """
    def ring(signum: int, frame: FrameType | None) -> None:
        raise StepTimeout(f"{what}: no result within {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Runner:
    """How to start memfs processes: which code, from where."""

    workdir: Path
    code: str | None = None
    env: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.env = dict(os.environ)
        if self.code:
            self.env["PYTHONPATH"] = os.pathsep.join(
                p for p in (os.path.abspath(self.code), os.environ.get("PYTHONPATH")) if p
            )

    @property
    def memfs(self) -> list[str]:
        # -P: the current directory (`python -m`) would come before PYTHONPATH
        return [sys.executable, "-P", "-m", "memfs"]

    def where(self) -> str:
        """The memfs package this runner's processes import (to check --code took)."""
        out = subprocess.run(
            [sys.executable, "-P", "-c", "import memfs; print(memfs.__file__)"],
            env=self.env, cwd=self.workdir, capture_output=True, text=True, check=True, timeout=60,
        )
        path = out.stdout.strip()
        if self.code and not Path(path).resolve().is_relative_to(Path(self.code).resolve()):
            raise SystemExit(f"--code {self.code}: memfs processes would import {path}")
        return path


def wait_line(proc: subprocess.Popen[bytes], prefix: str, timeout: float) -> str:
    """The first stdout line of *proc* starting with *prefix*; RuntimeError after *timeout*."""
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
            for line in seen.decode(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line
    raise RuntimeError(f"no {prefix!r} from {proc.args!r} within {timeout:.0f} s: "
                       f"exit {proc.poll()!r}, said {seen[-2000:]!r}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path


@contextmanager
def server(runner: Runner, argv: list[str], ready: str, log: Path) -> Iterator[Server]:
    """A memd or mds on its own session (a terminal's Ctrl-C reaches us, not it: we stop
    it after the mounts that use it).  Its stderr goes to *log*; yields the bound port."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [*runner.memfs, *argv], stdout=subprocess.PIPE, stderr=err, bufsize=0,
            env=runner.env, cwd=runner.workdir, start_new_session=True,
        )
    try:
        line = wait_line(proc, ready, READY_TIMEOUT)
        m = re.search(r"listening on \S*:(\d+)", line)
        if m is None:
            raise RuntimeError(f"cannot read the port from {line!r}")
        yield Server(proc, int(m[1]), log)
    finally:
        stop_process(proc)


def is_mounted(path: Path) -> bool:
    """From /proc/self/mounts: stat(2) on a mount whose daemon is gone could hang."""
    target = str(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _daemon_pid(path: Path) -> int | None:
    from memfs.cli.runtime import pid_file  # where `memfs mount` writes it

    try:
        return int(pid_file(str(path)).read_text())
    except (OSError, ValueError):
        return None


@contextmanager
def mounted(runner: Runner, path: Path, args: list[str], log: Path) -> Iterator[Path]:
    """``memfs mount PATH ARGS``; on the way out ``memfs umount``, then lazy unmount and
    SIGKILL of the daemon if that did not end it."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            [*runner.memfs, "mount", str(path), *args, "--log", str(log)], env=runner.env,
            cwd=runner.workdir, check=True, timeout=MOUNT_TIMEOUT, capture_output=True,
        )
        yield path
    finally:
        pid = _daemon_pid(path)
        if is_mounted(path):
            try:
                subprocess.run([*runner.memfs, "umount", str(path)], env=runner.env,
                               cwd=runner.workdir, timeout=UMOUNT_TIMEOUT, capture_output=True)
            except subprocess.TimeoutExpired:
                pass
        if is_mounted(path):
            subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)
        deadline = time.monotonic() + 20
        while pid is not None and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def write_secret(path: Path) -> Path:
    path.write_bytes(os.urandom(24).hex().encode())
    path.chmod(0o600)
    return path


def backing_args(tmp: Path, side: str, backing: bool, leases: bool = True,
                 dirty_max: str | None = None) -> list[str]:
    """``--backing``: a burst buffer on either side, its backing directory (fresh each
    round) on this machine's disk, write-back held past the run (``--flush-delay``)
    so that the rounds measure the mount, not the disk; with *dirty_max*, writers
    past it wait for write-back (the disk's pace, and how soon the burst buffer
    lets them go on)."""
    if not backing:
        return []
    d = tmp / f"backing-{side}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    off = ["--no-backing-write-leases"] if side == "cluster" and not leases else []
    cap = ["--dirty-max", dirty_max] if dirty_max else []
    return ["--backing", str(d), "--flush-delay", "600", *off, *cap]


@contextmanager
def cluster(runner: Runner, tmp: Path, volume_size: str, backing: bool = False,
            leases: bool = True, dirty_max: str | None = None) -> Iterator[Path]:
    """2 memd x 2 volumes, an mds over the 4 volumes and one client mount, on loopback."""
    secret = str(write_secret(tmp / "secret"))
    with ExitStack() as stack:  # unwinds mount, mds, memds: users before what they use
        memds = [
            stack.enter_context(server(runner, [
                "memd", "--listen", f"{LOOPBACK}:0", "--volumes", "2", "--volume-size", volume_size,
                "--secret-file", secret,
            ], "memd listening", tmp / f"memd{i}.log"))
            for i in range(2)
        ]
        # volume order like tests/test_cluster.py: memd0/0, memd1/0, memd0/1, memd1/1
        spec = "+".join(f"tcp://{LOOPBACK}:{m.port}/{v}" for v in (0, 1) for m in memds)
        mds = stack.enter_context(server(runner, [
            "mds", "--listen", f"{LOOPBACK}:0", "--pool", spec, "--secret-file", secret,
            *backing_args(tmp, "cluster", backing, leases, dirty_max),
        ], "mds listening", tmp / "mds.log"))
        yield stack.enter_context(mounted(
            runner, tmp / "cluster",
            ["--mds", f"{LOOPBACK}:{mds.port}", "--secret-file", secret], tmp / "cluster.log",
        ))


def embedded(runner: Runner, tmp: Path, size: str, backing: bool = False,
             dirty_max: str | None = None) -> AbstractContextManager[Path]:
    return mounted(runner, tmp / "embedded", ["--size", size, "--volumes", "4",
                                              *backing_args(tmp, "embedded", backing,
                                                            dirty_max=dirty_max)],
                   tmp / "embedded.log")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMGT]?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 1G)")
    return int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m[2]]


def workloads(root: Path, args: argparse.Namespace, problems: list[str], side: str) -> dict[str, float]:
    """One round on one side; a failing case gives NaN and a line in *problems*."""
    out: dict[str, float] = {}
    for name, rw, bs, _ in [] if args.skip_data else FIO_CASES:
        try:
            with alarm(args.runtime + 120, f"{side} fio {name}"):
                out[name] = fio(root, rw, bs, args.size, args.runtime)
        except (subprocess.CalledProcessError, StepTimeout) as exc:
            detail = getattr(exc, "stderr", None) or ""
            problems.append(f"{side}: fio {name} failed: {exc} {detail[-500:]}".strip())
            out[name] = math.nan
        if rw in ("read", "randread"):  # the next case lays out its own files
            for f in root.glob("bench.*"):
                f.unlink()
    try:
        with alarm(META_TIMEOUT, f"{side} metadata"):
            out.update(metadata(root, 2 * args.files, 2))
    except Exception as exc:  # a worker that died leaves EOFError, a full dir OSError
        problems.append(f"{side}: metadata failed: {exc!r}")
        out.update({k: math.nan for k in META_PHASES})
    return out


def log_problems(tmp: Path, side: str) -> list[str]:
    """WARNING/ERROR lines of this round's logs (daemons' and servers')."""
    names = ["embedded.log"] if side == "embedded" else ["cluster.log", "mds.log", "memd0.log", "memd1.log"]
    found = []
    for name in names:
        path = tmp / name
        if path.exists():
            lines = path.read_text(errors="replace").splitlines()
            found += [f"{side} {name}: {line.strip()}" for line in lines if LOG_PROBLEM.search(line)]
            path.unlink()
    return found


def median(values: list[float]) -> float:
    ok = [v for v in values if not math.isnan(v)]
    return statistics.median(ok) if ok else math.nan


def run_rounds(rounds: int, one: Callable[[str], dict[str, float]]) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {s: {} for s in SIDES}
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            print(f"{time.strftime('%H:%M:%S')} round {r + 1}/{rounds}: {side}", file=sys.stderr,
                  flush=True)
            for key, value in one(side).items():
                samples[side].setdefault(key, []).append(value)
    return samples


def table(med: dict[str, dict[str, float]]) -> list[str]:
    rows = ["| case | embedded | cluster | cluster/embedded | goal |", "|---|---:|---:|---:|---|"]
    for key, emb in med["embedded"].items():
        clu = med["cluster"][key]
        unit = "files/s" if key in META_PHASES else "MiB/s"
        ratio = clu / emb if emb else math.nan
        goal = GOALS.get(key)
        verdict = "" if goal is None else f">= {goal} {'ok' if ratio >= goal else 'MISSED'}"
        rows.append(f"| {key} ({unit}) | {emb:.0f} | {clu:.0f} | {ratio:.2f} | {verdict} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="512M", help="fio file size per job (default 512M)")
    ap.add_argument("--volume-size", default="1G",
                    help="per memd volume (2 memd x 2 volumes); embedded gets 4 x this")
    ap.add_argument("--files", type=int, default=3000, help="files per metadata process (2 processes)")
    ap.add_argument("--runtime", type=int, default=30, help="fio cap per run, seconds")
    ap.add_argument("--skip-data", action="store_true", help="metadata only, no fio")
    ap.add_argument("--code", help="memfs checkout to run (first on PYTHONPATH of memfs processes)")
    ap.add_argument("--json", help="also write results here")
    ap.add_argument("--backing", action="store_true",
                    help="both sides burst buffers (--backing on the embedded mount and the "
                         "mds), write-back held past the run")
    ap.add_argument("--no-backing-write-leases", dest="backing_write_leases", action="store_false",
                    help="with --backing: the mds grants no write leases, every write is a call "
                         "(memfs mds --no-backing-write-leases)")
    ap.add_argument("--dirty-max", metavar="SIZE",
                    help="with --backing: both sides' dirty cap (e.g. 64M): writes past it wait "
                         "for write-back to the disk (default: half the pool, never reached)")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("fio") is None or shutil.which("fusermount3") is None:
        print("clusterbench needs root, fio and fusermount3", file=sys.stderr)
        return 2
    if args.dirty_max and not args.backing:
        print("--dirty-max goes with --backing", file=sys.stderr)
        return 2
    fio_total = 2 * parse_size(args.size)
    if fio_total * 5 // 4 > 4 * parse_size(args.volume_size):
        print(f"--size {args.size} x 2 jobs does not fit 4 x --volume-size {args.volume_size} "
              "with room", file=sys.stderr)
        return 2
    total = f"{4 * parse_size(args.volume_size) >> 20}M"
    # SIGTERM (timeout(1), make being stopped) must run the cleanup too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))

    tmp = Path(tempfile.mkdtemp(prefix="memfs-clusterbench-"))
    problems: list[str] = []
    try:
        runner = Runner(tmp, args.code)
        code = runner.where()
        print(f"memfs processes import {code}", file=sys.stderr, flush=True)

        def one(side: str) -> dict[str, float]:
            mount = (cluster(runner, tmp, args.volume_size, args.backing,
                             args.backing_write_leases, args.dirty_max) if side == "cluster"
                     else embedded(runner, tmp, total, args.backing, args.dirty_max))
            try:
                with mount as root:
                    return workloads(root, args, problems, side)
            finally:
                problems.extend(log_problems(tmp, side))

        samples = run_rounds(args.rounds, one)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = {side: {k: median(v) for k, v in d.items()} for side, d in samples.items()}
    print(f"\nmemfs cluster (2 memd x 2 x {args.volume_size}, mds, 1 client; 127.0.0.1) vs "
          f"embedded ({total}){', both with --backing' if args.backing else ''}"
          f"{f' --dirty-max {args.dirty_max}' if args.dirty_max else ''}, "
          f"medians of {args.rounds} alternating rounds; "
          f"{'no fio' if args.skip_data else f'fio 2 jobs x {args.size}'}, "
          f"metadata 2 x {args.files} files; code {code}")
    print("\n".join(table(med)))
    if problems:
        print(f"\n{len(problems)} problems (first 20):")
        for line in problems[:20]:
            print(f"  {line}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "code": code, "args": vars(args), "median": med, "samples": samples,
            "problems": problems,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
