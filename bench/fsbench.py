"""memfs vs tmpfs (and bindfs, a compiled FUSE filesystem, over a tmpfs), in the same run.

Data: fio (POSIX psync engine, 2 jobs, one file per job) for sequential 1 MiB
write (fsync at end) and read, and random 16 KiB write and read.  Metadata:
create, stat, open (and close) and remove 20,000 empty files in one directory
(one process) and split over 2 directories (two processes in parallel).

Runs alternate the filesystems and the table shows medians, because this kind
of machine is noisy.  The data cases also run memfs with ``-o direct_io`` (file
data kept out of the page cache; ``--no-direct-io`` leaves it out), and every
case memfs with ``-o passthrough`` (the kernel reads and writes files' backing
files itself; ``--no-passthrough`` leaves it out).  Needs root (mounting tmpfs and memfs) and fio; bindfs
(Debian's) is measured when installed (``make bench-fs`` installs it), and
``--chart PNG`` draws the ratios to tmpfs (matplotlib).

    python bench/fsbench.py [--rounds 3] [--size 512M] [--memfs-opt=-o --memfs-opt=writeback_cache]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

JOBS = 2

FIO_CASES = [
    # name, fio rw, block size, goal (memfs/tmpfs)
    ("seq write 1M", "write", "1M", 0.5),
    ("seq read 1M", "read", "1M", 0.5),
    ("rand write 16K", "randwrite", "16k", 0.25),
    ("rand read 16K", "randread", "16k", 0.25),
]


#: memfs with -o direct_io (data cases only: metadata does not touch file data)
DIO = "memfs direct_io"
PT = "memfs passthrough"


@contextmanager
def mounted_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextmanager
def mounted_memfs(path: Path, size: str, extra: list[str]) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    memfs = [sys.executable, "-m", "memfs"]
    subprocess.run([*memfs, "mount", str(path), "--size", size, *extra], check=True)
    try:
        yield path
    finally:
        subprocess.run([*memfs, "umount", str(path)], check=False)


@contextmanager
def mounted_bindfs(path: Path, size: str) -> Iterator[Path]:
    """bindfs (C, libfuse, multi-threaded) mirroring a tmpfs: a compiled FUSE
    filesystem doing the same round trips through the kernel as memfs."""
    src = path.with_name(path.name + "-src")
    with mounted_tmpfs(src, size):
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["bindfs", "--no-allow-other", str(src), str(path)], check=True)
        try:
            yield path
        finally:
            subprocess.run(["fusermount3", "-u", "-z", str(path)], check=False)


def fio(directory: Path, rw: str, bs: str, size: str, runtime: int) -> float:
    """Aggregate MiB/s of one fio run, a file per job (``bench.N.0``).

    fio runs in *directory*: it names every job's file after the job alone
    ("bench", one file shared by all jobs) when its working directory has an
    entry of that name that is not a regular file, as this repository's
    ``bench/`` is for ``make bench`` (whatever ``--filename_format`` says).
    """
    args = [
        "fio", "--name=bench", f"--directory={directory}", f"--rw={rw}", f"--bs={bs}",
        f"--size={size}", f"--numjobs={JOBS}", "--ioengine=psync", "--group_reporting",
        "--output-format=json", "--end_fsync=1", "--invalidate=1",
        f"--runtime={runtime}", "--time_based=0", "--file_service_type=sequential",
    ]
    out = subprocess.run(args, check=True, capture_output=True, text=True, cwd=directory).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    part = job["write"] if "write" in rw else job["read"]
    return float(part["bw_bytes"]) / (1 << 20)


#: the metadata phases, in order; "open": open read-only and close (mdtest's read phase
#: of empty files; what make, grep and Python's imports do to files there)
META_PHASES = ("create", "stat", "open", "remove")


def _meta_worker(directory: str, n: int, conn: object, barrier: Any) -> None:
    """Create, stat, open and remove *n* files; every process starts a phase together (as
    mdtest's ranks do): a phase's time is from the first start to the last end, and
    without the barrier a process that finished creating first would start its stats
    while another still creates, and the stat phase would count that wait."""
    times = []
    for phase in META_PHASES:
        barrier.wait()
        t0 = time.perf_counter()
        for i in range(n):
            path = f"{directory}/f{i}"
            if phase == "create":
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            elif phase == "stat":
                os.stat(path)
            elif phase == "open":
                os.close(os.open(path, os.O_RDONLY))
            else:
                os.unlink(path)
        times.append((t0, time.perf_counter()))
    conn.send(times)  # type: ignore[attr-defined]


def metadata(root: Path, files: int, dirs: int) -> dict[str, float]:
    """files/s for each of :data:`META_PHASES`, aggregated over *dirs* parallel processes."""
    ctx = multiprocessing.get_context("fork")
    procs, pipes = [], []
    barrier = ctx.Barrier(dirs)
    for d in range(dirs):
        path = root / f"meta{d}"
        path.mkdir()
        r, w = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_meta_worker, args=(str(path), files // dirs, w, barrier)))
        pipes.append(r)
    for p in procs:
        p.start()
    times = [r.recv() for r in pipes]
    for p in procs:
        p.join()
    for d in range(dirs):
        (root / f"meta{d}").rmdir()
    out = {}
    for i, phase in enumerate(META_PHASES):
        start = min(t[i][0] for t in times)
        end = max(t[i][1] for t in times)
        out[phase] = files / (end - start)
    return out


def median_runs(
    rounds: int, filesystems: list[str], fn: Callable[[str], dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Medians per filesystem of *rounds* rounds, each round in another order."""
    samples: dict[str, dict[str, list[float]]] = {fs: {} for fs in filesystems}
    for r in range(rounds):
        k = r % len(filesystems)
        for fs in filesystems[k:] + filesystems[:k]:
            for key, value in fn(fs).items():
                samples[fs].setdefault(key, []).append(value)
    return {fs: {k: statistics.median(v) for k, v in d.items()} for fs, d in samples.items()}


def chart(results: dict[str, dict[str, dict[str, float]]], path: str, title: str) -> None:
    """Bars of each filesystem's speed relative to tmpfs, per case (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(section, key) for section in ("data", "meta") if section in results
             for key in results[section]["memfs"]]
    others = [fs for fs in ("memfs", PT, DIO, "bindfs") if any(fs in results[s] for s, _ in cases)]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(others)
    for n, fs in enumerate(others):
        at = [(i, results[s][fs][k] / results[s]["tmpfs"][k])
              for i, (s, k) in enumerate(cases) if fs in results[s]]
        bars = ax.bar([i + n * width for i, _ in at], [r for _, r in at], width, label=fs)
        ax.bar_label(bars, labels=[f"{r:.2f}" for _, r in at], fontsize=7, rotation=90,
                     padding=2)
    ax.set_xticks([i + width * (len(others) - 1) / 2 for i in range(len(cases))],
                  [k for _, k in cases], rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(top=3)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("speed / tmpfs (log)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="512M", help="fio file size per job")
    ap.add_argument("--pool", default="4G", help="memfs pool and tmpfs size")
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--runtime", type=int, default=30, help="fio cap per run, seconds")
    ap.add_argument("--memfs-opt", action="append", default=[], help="extra memfs mount argument")
    ap.add_argument("--json", help="also write results here")
    ap.add_argument("--skip-data", action="store_true")
    ap.add_argument("--skip-meta", action="store_true")
    ap.add_argument("--no-bindfs", action="store_true", help="leave bindfs out")
    ap.add_argument("--no-direct-io", action="store_true",
                    help="leave out the data cases of memfs with -o direct_io")
    ap.add_argument("--no-passthrough", action="store_true",
                    help="leave out memfs with -o passthrough")
    ap.add_argument("--chart", metavar="PNG", help="draw the ratios to tmpfs here")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("fio") is None:
        print("bench needs root and fio (apt-get install fio)", file=sys.stderr)
        return 2

    base = Path(tempfile.mkdtemp(prefix="memfs-bench-"))
    results: dict[str, dict[str, dict[str, float]]] = {}

    filesystems = ["memfs", "tmpfs"]
    if not args.no_bindfs and shutil.which("bindfs"):
        filesystems.append("bindfs")

    def mount(fs: str) -> object:
        if fs == "memfs":
            return mounted_memfs(base / "memfs", args.pool, args.memfs_opt)
        if fs == DIO:
            return mounted_memfs(base / "memfs", args.pool, [*args.memfs_opt, "-o", "direct_io"])
        if fs == PT:
            return mounted_memfs(base / "memfs", args.pool, [*args.memfs_opt, "-o", "passthrough"])
        if fs == "bindfs":
            return mounted_bindfs(base / "bindfs", args.pool)
        return mounted_tmpfs(base / "tmpfs", args.pool)

    pt = [] if args.no_passthrough else [PT]
    try:
        if not args.skip_data:
            def data_round(fs: str) -> dict[str, float]:
                with mount(fs) as root:  # type: ignore[attr-defined]
                    out = {}
                    for name, rw, bs, _ in FIO_CASES:
                        out[name] = fio(root, rw, bs, args.size, args.runtime)
                        if rw in ("read", "randread"):
                            # next case lays out its own files
                            for f in Path(root).glob("bench.*"):
                                f.unlink()
                    return out

            dio = [] if args.no_direct_io else [DIO]
            results["data"] = median_runs(args.rounds, filesystems + pt + dio, data_round)
        if not args.skip_meta:
            def meta_round(fs: str) -> dict[str, float]:
                with mount(fs) as root:  # type: ignore[attr-defined]
                    out = {}
                    for dirs in (1, 2):
                        for phase, v in metadata(Path(root), args.files, dirs).items():
                            out[f"{phase} ({dirs} dir{'s' if dirs > 1 else ''})"] = v
                    return out

            results["meta"] = median_runs(args.rounds, filesystems + pt, meta_round)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    goals = {name: goal for name, _, _, goal in FIO_CASES}
    title = (f"{' vs '.join(filesystems)}, medians of {args.rounds} alternating rounds, {JOBS} jobs"
             f"{' memfs ' + ' '.join(args.memfs_opt) if args.memfs_opt else ''}")
    print(f"\n{title}")
    bindfs = "bindfs" in filesystems
    for section, unit in (("data", "MiB/s"), ("meta", "files/s")):
        if section not in results:
            continue
        head = f"| {section} | memfs {unit} | tmpfs {unit} | memfs/tmpfs | goal |"
        rule = "|---|---:|---:|---:|---|"
        if bindfs:
            head += f" bindfs {unit} | bindfs/tmpfs | memfs/bindfs |"
            rule += "---:|---:|---:|"
        print(f"\n{head}\n{rule}")
        mem, tmp = results[section]["memfs"], results[section]["tmpfs"]
        for key in mem:
            ratio = mem[key] / tmp[key] if tmp[key] else float("nan")
            goal = goals.get(key)
            if goal is not None:
                verdict = f">= {goal} {'ok' if ratio >= goal else 'MISSED'}"
            elif key.startswith("create"):
                verdict = f">= 5000/s {'ok' if mem[key] >= 5000 else 'MISSED'}"
            else:
                verdict = ""
            row = f"| {key} | {mem[key]:.0f} | {tmp[key]:.0f} | {ratio:.2f} | {verdict} |"
            if bindfs:
                b = results[section]["bindfs"][key]
                row += f" {b:.0f} | {b / tmp[key]:.2f} | {mem[key] / b:.2f} |"
            print(row)
        for variant in (PT, DIO):
            if variant not in results[section]:
                continue
            print(f"\n| {section} | {variant} {unit} | /tmpfs | goal | vs memfs |"
                  f"{' vs bindfs |' if bindfs else ''}\n|---|---:|---:|---|---:|"
                  f"{'---:|' if bindfs else ''}")
            for key, v in results[section][variant].items():
                ratio = v / tmp[key] if tmp[key] else float("nan")
                goal = goals.get(key)
                verdict = f">= {goal} {'ok' if ratio >= goal else 'MISSED'}" if goal else ""
                row = f"| {key} | {v:.0f} | {ratio:.2f} | {verdict} | {v / mem[key]:.2f} |"
                if bindfs:
                    row += f" {v / results[section]['bindfs'][key]:.2f} |"
                print(row)
    if args.chart:
        chart(results, args.chart, title)
        print(f"\nchart: {args.chart}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
