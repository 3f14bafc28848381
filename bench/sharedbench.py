"""One shared file versus a file per process, written from two cluster nodes.

IOR's two layouts with its POSIX calls, on one loopback cluster (2 ``memfs
memd`` x 2 volumes, one ``memfs mds``) with two client mounts: --procs
processes per mount, each writing --block bytes in --xfer pieces per segment,
--segments segments, then fsync.  Shared: one file, process r's piece k of
segment s at ``(s * P + r) * block + k * xfer`` (IOR's default, "N-1").  A
file per process (IOR ``-F``): the same pieces at ``s * block + k * xfer`` of
its own file.  Each round writes both layouts for every --xfer (the order
alternates from round to round); MiB/s is all bytes over the slowest
process's time.  The table shows medians and the shared/per-process ratio.

Then mdtest's two layouts, with --files empty files per process: created,
stat'ed and removed (each phase starts on a barrier; files/s is all files over
the slowest process's time) in one directory that the first node made
(mdtest's default) or in a directory per process that its own node made
(mdtest ``-u``).

Leases are whole-file: on the shared file the nodes' writes by turns make it
contended (no write leases, recalls only where ranges overlap: README,
"Consistency across nodes"; docs/ARCHITECTURE.md, "Contended files").

Like bench/clusterbench.py (whose helpers it uses): ``--code DIR`` runs
another checkout, servers and mounts are stopped on any exit, and a step that
runs past its alarm fails the run.  Needs root.

    python bench/sharedbench.py [--rounds 3] [--xfer 64K,1M] [--block 4M]
        [--segments 4] [--procs 2] [--files 1000] [--code DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from clusterbench import LOOPBACK, Runner, alarm, mounted, parse_size, server, write_secret

LAYOUTS = ("shared", "per process")
STEP_TIMEOUT = 600.0  # one layout's writes, or one layout's metadata phases
PHASES = ("create", "stat", "remove")


def _writer(path: str, rank: int, ranks: int, shared: bool, block: int, xfer: int,
            segments: int, barrier: Barrier, out: Connection) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    buf = os.urandom(xfer)
    barrier.wait()
    t = time.perf_counter()
    for s in range(segments):
        base = (s * ranks + rank) * block if shared else s * block
        for k in range(0, block, xfer):
            os.pwrite(fd, buf, base + k)
    os.fsync(fd)
    os.close(fd)
    out.send(time.perf_counter() - t)


def _files(d: str, rank: int, n: int, barrier: Barrier, out: Connection) -> None:
    names = [os.path.join(d, f"{rank}.{i}") for i in range(n)]
    times = []
    for phase in PHASES:
        barrier.wait()
        t = time.perf_counter()
        for p in names:
            if phase == "create":
                os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            elif phase == "stat":
                os.stat(p)
            else:
                os.unlink(p)
        times.append(time.perf_counter() - t)
    out.send(times)


def _run(ctx: Any, target: Callable[..., None], jobs: list[tuple[Any, ...]], what: str) -> list[Any]:
    """Run *target* once per job in its own process (each given a pipe to send its
    result on last) and return their results in order."""
    workers, pipes = [], []
    for job in jobs:
        recv, send = ctx.Pipe(duplex=False)
        workers.append(ctx.Process(target=target, args=(*job, send)))
        pipes.append(recv)
    for w in workers:
        w.start()
    try:
        results = [p.recv() for p in pipes]
    finally:
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
                w.join()
    bad = [w.exitcode for w in workers if w.exitcode]
    if bad:
        raise RuntimeError(f"{what} failed: exit codes {bad}")
    return results


def files_layout(mounts: list[Path], procs: int, shared: bool, n: int, tag: str) -> list[float]:
    """Files/s of each phase (create, stat, remove) of one layout: every process of
    every mount at once, in one directory the first node made or each in its own,
    made by its own node."""
    ctx = multiprocessing.get_context("fork")
    ranks = procs * len(mounts)
    barrier = ctx.Barrier(ranks)
    if shared:
        os.mkdir(mounts[0] / tag)
    jobs = []
    for r in range(ranks):
        mnt = mounts[r % len(mounts)]
        d = mnt / (tag if shared else f"{tag}.{r}")
        if not shared:
            os.mkdir(d)
        jobs.append((str(d), r, n, barrier))
    times = _run(ctx, _files, jobs, "metadata workers")
    for d in mounts[0].glob(f"{tag}*"):
        os.rmdir(d)
    return [ranks * n / max(t[k] for t in times) for k in range(len(PHASES))]


def write_layout(mounts: list[Path], procs: int, shared: bool, block: int, xfer: int,
                 segments: int, tag: str) -> float:
    """MiB/s of one layout: every process of every mount writing at once."""
    ctx = multiprocessing.get_context("fork")
    ranks = procs * len(mounts)
    barrier = ctx.Barrier(ranks)
    jobs = []
    for r in range(ranks):
        mnt = mounts[r % len(mounts)]  # ranks alternate between the nodes, as IOR's do
        path = mnt / (f"{tag}.shared" if shared else f"{tag}.{r}")
        jobs.append((str(path), r, ranks, shared, block, xfer, segments, barrier))
    times = _run(ctx, _writer, jobs, "writers")
    for f in mounts[0].glob(f"{tag}.*"):
        f.unlink()
    return ranks * segments * block / max(times) / (1 << 20)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--xfer", default="64K,1M", help="write sizes, comma-separated (default 64K,1M)")
    ap.add_argument("--block", default="4M", help="bytes per process per segment (default 4M)")
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--procs", type=int, default=2, help="processes per mount (default 2)")
    ap.add_argument("--files", type=int, default=1000,
                    help="empty files per process for the metadata layouts (default 1000; 0: none)")
    ap.add_argument("--volume-size", default="1G", help="per memd volume (2 memd x 2 volumes)")
    ap.add_argument("--code", help="memfs checkout to run (first on PYTHONPATH of memfs processes)")
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args()
    xfers = [parse_size(x) for x in args.xfer.split(",")]
    block = parse_size(args.block)
    if os.geteuid() != 0:
        print("sharedbench needs root (FUSE mounts)", file=sys.stderr)
        return 2
    if not xfers or any(x <= 0 or block % x for x in xfers) or args.segments < 1 or args.procs < 1 \
            or args.files < 0:
        print("--xfer sizes must divide --block; --segments and --procs at least 1, --files "
              "not negative", file=sys.stderr)
        return 2
    total = 2 * args.procs * args.segments * block
    if total * 5 // 4 > 4 * parse_size(args.volume_size):
        print(f"{total >> 20} MiB per layout does not fit 4 x --volume-size {args.volume_size} "
              "with room", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))

    samples: dict[tuple[int, str], list[float]] = {(x, lay): [] for x in xfers for lay in LAYOUTS}
    meta: dict[tuple[str, str], list[float]] = {(ph, lay): [] for ph in PHASES for lay in LAYOUTS}
    tmp = Path(tempfile.mkdtemp(prefix="memfs-sharedbench-"))
    try:
        runner = Runner(tmp, args.code)
        code = runner.where()
        print(f"memfs processes import {code}", file=sys.stderr, flush=True)
        secret = str(write_secret(tmp / "secret"))
        with ExitStack() as stack:  # unwinds mounts, mds, memds
            memds = [stack.enter_context(server(runner, [
                "memd", "--listen", f"{LOOPBACK}:0", "--volumes", "2",
                "--volume-size", args.volume_size, "--secret-file", secret,
            ], "memd listening", tmp / f"memd{i}.log")) for i in range(2)]
            spec = "+".join(f"tcp://{LOOPBACK}:{m.port}/{v}" for v in (0, 1) for m in memds)
            mds = stack.enter_context(server(runner, [
                "mds", "--listen", f"{LOOPBACK}:0", "--pool", spec, "--secret-file", secret,
            ], "mds listening", tmp / "mds.log"))
            mounts = [stack.enter_context(mounted(
                runner, tmp / f"node{k}", ["--mds", f"{LOOPBACK}:{mds.port}", "--secret-file", secret],
                tmp / f"node{k}.log")) for k in range(2)]
            for r in range(args.rounds):
                for x in xfers:
                    for lay in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                        with alarm(STEP_TIMEOUT, f"{lay} writes of {x}"):
                            mibs = write_layout(mounts, args.procs, lay == "shared", block, x,
                                                args.segments, f"r{r}x{x}")
                        samples[(x, lay)].append(mibs)
                        print(f"{time.strftime('%H:%M:%S')} round {r + 1}/{args.rounds}: "
                              f"{x >> 10} KiB {lay}: {mibs:.0f} MiB/s", file=sys.stderr, flush=True)
                for lay in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]) if args.files else ():
                    with alarm(STEP_TIMEOUT, f"{lay} metadata"):
                        rates = files_layout(mounts, args.procs, lay == "shared", args.files, f"m{r}")
                    for ph, rate in zip(PHASES, rates, strict=True):
                        meta[(ph, lay)].append(rate)
                    print(f"{time.strftime('%H:%M:%S')} round {r + 1}/{args.rounds}: files, {lay}: "
                          + ", ".join(f"{ph} {rate:.0f}/s" for ph, rate in zip(PHASES, rates, strict=True)),
                          file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n2 client mounts x {args.procs} processes, {args.segments} segments of "
          f"{block >> 20} MiB per process, pwrite + fsync; medians of {args.rounds} rounds; "
          f"code {code}")
    print("| write size | shared file (MiB/s) | file per process (MiB/s) | shared/per process |")
    print("|---|---:|---:|---:|")
    out = []
    for x in xfers:
        sh, pp = (statistics.median(samples[(x, lay)]) for lay in LAYOUTS)
        print(f"| {x >> 10} KiB | {sh:.0f} | {pp:.0f} | {sh / pp:.2f} |")
        out.append({"xfer": x, "shared": samples[(x, "shared")], "per_process": samples[(x, "per process")]})
    files = []
    if args.files:
        print(f"\n{args.files} empty files per process, one directory made by the first node "
              "(mdtest's default) or one per process made by its node (mdtest -u)")
        print("| phase | shared directory (files/s) | directory per process (files/s) | "
              "shared/per process |")
        print("|---|---:|---:|---:|")
        for ph in PHASES:
            sh, pp = (statistics.median(meta[(ph, lay)]) for lay in LAYOUTS)
            print(f"| {ph} | {sh:.0f} | {pp:.0f} | {sh / pp:.2f} |")
            files.append({"phase": ph, "shared": meta[(ph, "shared")],
                          "per_process": meta[(ph, "per process")]})
    if args.json:
        Path(args.json).write_text(json.dumps({"code": code, "results": out, "files": files}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
