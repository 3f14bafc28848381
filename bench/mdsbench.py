"""Load on one ``memfs mds``: how many metadata calls a second it sustains.

One memd (2 small volumes: the mds asks it for the pool geometry) and one mds
on 127.0.0.1; a client makes a tree (``mdsbench/`` with --files files and a
directory per client).  Then --clients processes, each one
:func:`memfs.meta.remote.open_remote_meta` connection with --tasks calls in
flight (trio tasks), run for --warmup + --seconds; calls that complete inside
the last --seconds count.  Modes:

* ``read``: getattr of a file, lookup of an existing name, lookup of a missing
  name (ENOENT), in turn;
* ``mixed``: create a file (mknod) in the client's directory, getattr it,
  lookup an existing name, lookup a missing one, unlink it: 2 of 5 calls change
  the namespace;
* ``create``: only creates (mknod), each client in its own directory.

``--journal-compare`` runs every round twice, on an mds without and one with
``--journal`` (a fresh directory on this machine's disk; the order alternates
from round to round), and reports the ratio of their medians: group commit's
goal is creates with a journal at 0.7 of the rate without.

Reported: ops/s in all and per client, client-side latency (median, p99), the
mds's CPU (utime+stime from /proc/PID/stat over the window, 100% = one core),
how long the mds was runnable but waited for a CPU (/proc/PID/task/*/schedstat),
the clients' CPU, and the machine's busy share (100% = one core): an mds near
100% CPU is the bottleneck; an mds that waits for a CPU on a busy machine
shares it with its clients.  ``--profile FILE`` runs
py-spy on the mds during the window of the first round of the first mode
(collapsed stacks to FILE) and prints the functions with the most samples.

With client caching (leases, the mds default) the repeated reads of ``read``
mode are answered by the clients' own caches after the first one, and
``mixed`` recalls nothing (each client works in its own directory): that is
what applications see.  ``--mds-arg=--lease-term --mds-arg=0`` turns caching
off, so every call reaches the mds: that measures the mds itself.

Like bench/clusterbench.py, ``--code DIR`` runs another checkout (the memd,
mds and clients all import it) and every process is stopped on any exit.

    python bench/mdsbench.py [--clients 4] [--tasks 32] [--seconds 5] [--warmup 2]
        [--mode read|mixed|create|both] [--rounds 3] [--code DIR] [--json FILE] [--profile FILE]
        [--mds-arg=ARG ...] [--journal-compare]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

GOAL = 20_000  # read ops/s from 4 clients
JOURNAL_GOAL = 0.7  # creates with --journal / without
SETUP_TIMEOUT = 60.0
STARTUP_TIMEOUT = 30.0  # a client connects and looks its inodes up
ROOT_INO = 1
TREE = b"mdsbench"


# -- client side (runs in the worker processes, with the code under test) -----------------

def _worker(cfg: dict[str, Any]) -> None:
    import trio

    trio.run(_worker_main, cfg)


async def _worker_main(cfg: dict[str, Any]) -> None:
    import errno
    import random
    import stat

    import trio

    import memfs
    from memfs.errors import FsError
    from memfs.meta.remote import open_remote_meta
    from memfs.wire import load_secret

    secret = load_secret(cfg["secret"])
    reply: dict[str, Any] = {"memfs": memfs.__file__}
    async with open_remote_meta(cfg["host"], cfg["port"], secret) as meta:
        if cfg["role"] == "setup":
            await _make_tree(meta, cfg)
            print(json.dumps(reply), flush=True)
            return
        tree = await meta.lookup(ROOT_INO, TREE)
        names = [f"f{i}".encode() for i in range(cfg["files"])]
        inos = [(await meta.lookup(tree.ino, n)).ino for n in names]
        mine = (await meta.lookup(tree.ino, f"c{cfg['client']}".encode())).ino
        print(json.dumps({"ready": True, **reply}), flush=True)
        # the parent's "go START END" (wall clock, shared by all clients)
        line = await trio.to_thread.run_sync(sys.stdin.readline)
        start_wall, end_wall = (float(x) for x in line.split())
        now = trio.current_time()
        start = now + start_wall - time.time()
        end = now + end_wall - time.time()
        counts: Counter[str] = Counter()
        latencies: list[float] = []
        cpu: list[float] = []

        async def call(op: str, fn: Any, *a: Any, missing_ok: bool = False) -> Any:
            t0 = trio.current_time()
            try:
                result = await fn(*a)
            except FsError as exc:
                if not (missing_ok and exc.errno == errno.ENOENT):
                    counts["error " + op] += 1
                    return None
                result = None
            t1 = trio.current_time()
            if start <= t1 < end:
                counts[op] += 1
                latencies.append(t1 - t0)
            return result

        async def task(k: int) -> None:
            rng = random.Random(k)
            n = 0
            while trio.current_time() < end:
                i = rng.randrange(len(names))
                if cfg["mode"] == "create":
                    await call("create", meta.mknod, mine, f"t{k}-{n}".encode(), stat.S_IFREG | 0o644, 0, 0)
                    n += 1
                    continue
                if cfg["mode"] == "mixed":
                    name = f"t{k}-{n}".encode()
                    n += 1
                    attr = await call("create", meta.mknod, mine, name, stat.S_IFREG | 0o644, 0, 0)
                    if attr is not None:
                        await call("getattr", meta.getattr, attr.ino)
                else:
                    await call("getattr", meta.getattr, inos[i])
                await call("lookup", meta.lookup, tree.ino, names[i])
                await call("lookup missing", meta.lookup, tree.ino, b"no-" + names[i], missing_ok=True)
                if cfg["mode"] == "mixed":
                    await call("unlink", meta.unlink, mine, name)

        async def cpu_marks() -> None:
            await trio.sleep_until(start)
            cpu.append(time.process_time())
            await trio.sleep_until(end)
            cpu.append(time.process_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cpu_marks)
            for k in range(cfg["tasks"]):
                nursery.start_soon(task, cfg["client"] * 1000 + k)
    latencies.sort()
    seconds = end_wall - start_wall
    reply.update(
        counts=dict(counts), ops=sum(v for k, v in counts.items() if not k.startswith("error")),
        cpu=(cpu[1] - cpu[0]) / seconds * 100 if len(cpu) == 2 else float("nan"),
        p50_ms=latencies[len(latencies) // 2] * 1e3 if latencies else float("nan"),
        p99_ms=latencies[len(latencies) * 99 // 100] * 1e3 if latencies else float("nan"),
    )
    print(json.dumps(reply), flush=True)


async def _make_tree(meta: Any, cfg: dict[str, Any]) -> None:
    import stat

    tree = (await meta.mknod(ROOT_INO, TREE, stat.S_IFDIR | 0o755, 0, 0)).ino
    for i in range(cfg["files"]):
        await meta.mknod(tree, f"f{i}".encode(), stat.S_IFREG | 0o644, 0, 0)
    for c in range(cfg["clients"]):
        await meta.mknod(tree, f"c{c}".encode(), stat.S_IFDIR | 0o755, 0, 0)


# -- the parent ------------------------------------------------------------------------------

def cpu_ticks(pid: int) -> int:
    """utime + stime of *pid*, all threads, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def sched_ns(pid: int) -> tuple[int, int]:
    """(on a CPU, runnable but waiting for one) in ns, summed over *pid*'s threads."""
    run = wait = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # a thread that just ended
            continue
        run, wait = run + int(fields[0]), wait + int(fields[1])
    return run, wait


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def spawn(cfg: dict[str, Any], runner: Any) -> subprocess.Popen[str]:
    # the script's directory (bench/) comes first on sys.path, then PYTHONPATH: memfs is
    # found where runner says, not in the caller's directory
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=runner.env,
        cwd=runner.workdir, start_new_session=True,
    )


def wait_line_text(proc: subprocess.Popen[str], timeout: float) -> str:
    """One stdout line of *proc* within *timeout*; RuntimeError otherwise."""
    import select

    assert proc.stdout is not None
    if select.select([proc.stdout], [], [], timeout)[0]:
        line = proc.stdout.readline()
        if line:
            return line
    raise RuntimeError(f"no answer from a client within {timeout:.0f} s (exit {proc.poll()!r})")


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def one_window(
    args: argparse.Namespace, runner: Any, base: dict[str, Any], mode: str, mds_pid: int,
    profile: str | None,
) -> dict[str, Any]:
    """K clients against the mds for warm-up + seconds; the window's numbers."""
    procs: list[subprocess.Popen[str]] = []
    spy: subprocess.Popen[bytes] | None = None
    try:
        for c in range(args.clients):
            procs.append(spawn({**base, "role": "load", "mode": mode, "client": c,
                                "tasks": args.tasks}, runner))
        for p in procs:
            hello = json.loads(wait_line_text(p, STARTUP_TIMEOUT))
            if not hello.get("ready"):
                raise RuntimeError(f"client not ready: {hello}")
        start = time.time() + args.warmup
        end = start + args.seconds
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{start} {end}\n")
            p.stdin.flush()
        time.sleep(max(0.0, start - time.time()))
        if profile:
            spy = subprocess.Popen(
                [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(mds_pid),
                 "--duration", str(int(args.seconds)), "--rate", "250", "--format", "raw",
                 "--output", profile], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t0, s0, b0 = cpu_ticks(mds_pid), sched_ns(mds_pid), machine_busy()
        time.sleep(max(0.0, end - time.time()))
        t1, s1, b1 = cpu_ticks(mds_pid), sched_ns(mds_pid), machine_busy()
        results = [json.loads(wait_line_text(p, STARTUP_TIMEOUT + args.seconds)) for p in procs]
        if spy is not None:
            _, err = spy.communicate(timeout=60)
            if spy.returncode:
                print(f"py-spy failed: {err.decode(errors='replace')[-500:]}", file=sys.stderr)
    finally:
        for p in procs:
            stop(p)
        if spy is not None:
            stop(spy)
    hz = os.sysconf("SC_CLK_TCK")
    counts: Counter[str] = Counter()
    for r in results:
        counts.update(r["counts"])
    total = sum(r["ops"] for r in results)
    return {
        "ops_per_s": total / args.seconds,
        "per_client": [r["ops"] / args.seconds for r in results],
        "mds_cpu": (t1 - t0) / hz / args.seconds * 100,
        "mds_runq_wait": (s1[1] - s0[1]) / 1e9 / args.seconds * 100,
        "clients_cpu": [r["cpu"] for r in results],
        "machine_busy": (b1[0] - b0[0]) / max(1, b1[1] - b0[1]) * 100 * (os.cpu_count() or 1),
        "p50_ms": statistics.median(r["p50_ms"] for r in results),
        "p99_ms": max(r["p99_ms"] for r in results),
        "counts": dict(counts),
    }


def fs_type(path: Path) -> str:
    """The type of the filesystem *path* is on (the longest mount point above it)."""
    best, kind = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        mnt, typ = line.split()[1:3]
        if (str(path) + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best):
            best, kind = mnt, typ
    return kind


def summarize_profile(path: str, top: int = 15) -> list[str]:
    """The functions with the most samples in py-spy's collapsed stacks: own and total."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    samples = 0
    for line in Path(path).read_text().splitlines():
        stack, _, num = line.rpartition(" ")
        if not stack:
            continue
        count = int(num)
        samples += count
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  for f in stack.split(";") if f]
        own[frames[-1]] += count
        for f in set(frames):
            inclusive[f] += count
    out = [f"py-spy: {samples} samples of the mds while busy (collapsed stacks: {path})",
           "| function | own % | total % |", "|---|---:|---:|"]
    for f, n in own.most_common(top):
        out.append(f"| {f} | {n / samples * 100:.1f} | {inclusive[f] / samples * 100:.1f} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--tasks", type=int, default=32, help="calls in flight per client (default 32)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured window (default 5)")
    ap.add_argument("--warmup", type=float, default=2.0, help="load before the window (default 2)")
    ap.add_argument("--files", type=int, default=100, help="files in the tree (default 100)")
    ap.add_argument("--mode", choices=("read", "mixed", "create", "both"), default="both",
                    help="both: read and mixed")
    ap.add_argument("--rounds", type=int, default=3, help="fresh servers each round; medians")
    ap.add_argument("--code", help="memfs checkout to run (first on PYTHONPATH)")
    ap.add_argument("--json", help="also write results here")
    ap.add_argument("--profile", help="py-spy collapsed stacks of the mds (first window) to this file")
    ap.add_argument("--mds-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for memfs mds, e.g. --mds-arg=--lease-term --mds-arg=0 "
                         "(no client caching: every call reaches the mds)")
    ap.add_argument("--journal-compare", action="store_true",
                    help="each round also on an mds with --journal (a fresh directory); ratio of medians")
    args = ap.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return 0

    from clusterbench import LOOPBACK, Runner, server, write_secret  # bench/ is on sys.path

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    modes = ("read", "mixed") if args.mode == "both" else (args.mode,)
    if args.profile and not Path(sys.executable).with_name("py-spy").exists():
        print("--profile needs py-spy in the venv (pip install py-spy)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="memfs-mdsbench-"))
    variants = ("", "journal") if args.journal_compare else ("",)
    rounds: dict[str, list[dict[str, Any]]] = {f"{v} {m}".strip(): [] for v in variants for m in modes}
    try:
        runner = Runner(tmp, args.code)
        code = runner.where()
        print(f"memfs processes import {code}", file=sys.stderr, flush=True)
        secret = str(write_secret(tmp / "secret"))
        order = [(r, v) for r in range(args.rounds) for v in (variants if r % 2 == 0 else variants[::-1])]
        for r, variant in order:
            extra = ["--journal", str(tmp / f"journal-{r}")] if variant else []
            with ExitStack() as stack:
                memd = stack.enter_context(server(runner, [
                    "memd", "--listen", f"{LOOPBACK}:0", "--volumes", "2", "--volume-size", "64M",
                    "--secret-file", secret], "memd listening", tmp / "memd.log"))
                spec = "+".join(f"tcp://{LOOPBACK}:{memd.port}/{v}" for v in (0, 1))
                mds = stack.enter_context(server(runner, [
                    "mds", "--listen", f"{LOOPBACK}:0", "--pool", spec, "--secret-file", secret,
                    *args.mds_arg, *extra], "mds listening", tmp / "mds.log"))
                base = {"host": LOOPBACK, "port": mds.port, "secret": secret,
                        "files": args.files, "clients": args.clients}
                setup = spawn({**base, "role": "setup"}, runner)
                try:
                    got = json.loads(wait_line_text(setup, SETUP_TIMEOUT))
                finally:
                    stop(setup)
                if Path(got["memfs"]).resolve() != Path(code).resolve():
                    raise SystemExit(f"clients import {got['memfs']}, not {code}")
                for mode in modes:
                    profile = args.profile if r == 0 and mode == modes[0] and not variant else None
                    window = one_window(args, runner, base, mode, mds.proc.pid, profile)
                    rounds[f"{variant} {mode}".strip()].append(window)
                    print(f"round {r + 1}/{args.rounds} {variant} {mode}: {window['ops_per_s']:.0f} ops/s, "
                          f"mds cpu {window['mds_cpu']:.0f}%", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nmds load: {args.clients} clients x {args.tasks} calls in flight, {args.seconds:g} s "
          f"after {args.warmup:g} s warm-up, medians of {args.rounds} rounds; code {code}; "
          f"mds {' '.join(args.mds_arg) or '(defaults: clients cache under leases)'}")
    if args.journal_compare:
        print(f"journal: a fresh directory in {tmp.parent} ({fs_type(tmp.parent)}, fdatasync per commit)")
    print("| mode | ops/s | per client | p50 ms | p99 ms | mds CPU % | mds waits for CPU % | "
          "clients CPU % | machine busy % | goal |")
    print("|---|---:|---|---:|---:|---:|---:|---|---:|---|")
    for mode, res in rounds.items():
        med = statistics.median(x["ops_per_s"] for x in res)
        per = [statistics.median(x["per_client"][c] for x in res) for c in range(args.clients)]
        cl = [statistics.median(x["clients_cpu"][c] for x in res) for c in range(args.clients)]
        goal = f">= {GOAL} {'ok' if med >= GOAL else 'MISSED'}" if mode == "read" else ""
        if mode.startswith("journal"):
            base_med = statistics.median(x["ops_per_s"] for x in rounds[mode.split()[-1]])
            ratio = med / base_med if base_med else float("nan")
            goal = f"{ratio:.2f} of no journal (goal {JOURNAL_GOAL}: {'ok' if ratio >= JOURNAL_GOAL else 'MISSED'})"
        print(f"| {mode} | {med:.0f} | {' '.join(f'{p:.0f}' for p in per)} | "
              f"{statistics.median(x['p50_ms'] for x in res):.2f} | "
              f"{statistics.median(x['p99_ms'] for x in res):.2f} | "
              f"{statistics.median(x['mds_cpu'] for x in res):.0f} | "
              f"{statistics.median(x['mds_runq_wait'] for x in res):.0f} | "
              f"{' '.join(f'{c:.0f}' for c in cl)} | "
              f"{statistics.median(x['machine_busy'] for x in res):.0f} | {goal} |")
        errors = {k: v for x in res for k, v in x["counts"].items() if k.startswith("error")}
        if errors:
            print(f"  {mode}: errors {errors}")
    if args.profile and Path(args.profile).exists():
        print("\n" + "\n".join(summarize_profile(args.profile)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"code": code, "args": vars(args), "rounds": rounds},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
