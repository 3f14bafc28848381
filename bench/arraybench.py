"""memfs.array vs numpy and h5py: save and load of one large float64 array.

Embedded: one ``memfs mount`` (4 volumes); per round, in rotating order,
``memfs.array.save``/``load`` (bytes straight between the array and the
volumes' memfds), ``numpy.save``/``numpy.load`` through the same mount (FUSE),
``numpy.save``/``numpy.load`` on tmpfs (``/dev/shm``), and h5py on tmpfs (one
contiguous dataset, no compression).  Load makes a new array each time, as
``numpy.load`` does; ``load(out=)`` into an array that exists is shown too.

Cluster (loopback): two ``memfs memd`` (2 volumes each), ``memfs mds``, one
``memfs mount --mds``; ``memfs.array`` (straight between the array and the
memory servers' sockets) vs ``numpy`` through that mount, and raw loopback TCP
in the same rounds: one stream, 1 MiB ``sendall`` into ``recv_into`` a buffer
as large as the array (bench/tcpbench.py's "raw into memory"), populated
before the clock starts (against saves and ``load(out=)``) and, for loads into
a new array, one whose pages the receive touches first ("into new memory").

Each group (a save and the loads of its file) starts from a quiet pool: the
file the save would replace is removed first and its memory given time to be
zeroed, untimed (see :func:`settle`).  "numpy via mount load, pages dropped"
drops the kernel's cached pages of the file first (``POSIX_FADV_DONTNEED``):
an embedded mount keeps what this node wrote in the page cache, so a plain
load right after a save may not reach memfs at all; the ratios of load rows
are against the dropped one, what memfs itself serves.

Each round also times "new array, first touch": ``np.empty`` as large as the
array, every page written once.  A load into a new array (memfs's or numpy's)
pays that on top of moving the bytes; on a virtual machine that gives freed
memory back to its host it is the largest part.

Each figure is the median of ``--rounds``; GiB/s of array bytes.

    python bench/arraybench.py [--size 1G] [--rounds 3] [--only embedded|cluster]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from tcpbench import cluster_mount, memd_servers, raw_throughput  # bench/ is the script's directory

import memfs.array as ma
from memfs.config import parse_size

GIB = 1 << 30
MEMFS = [sys.executable, "-m", "memfs"]


@contextmanager
def embedded_mount(pool: int) -> Iterator[str]:
    mnt = tempfile.mkdtemp(prefix="memfs-arraybench-")
    subprocess.run([*MEMFS, "mount", mnt, "--size", str(pool)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run([*MEMFS, "umount", mnt], check=False)
        os.rmdir(mnt)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def h5_save(path: str, arr: np.ndarray) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=arr)


def h5_load(path: str) -> np.ndarray:
    import h5py

    with h5py.File(path, "r") as f:
        out: np.ndarray = f["a"][...]
        return out


def pairs(a: np.ndarray, where: dict[str, str], out: np.ndarray) -> dict[str, Callable[[], object]]:
    """save/load cases over the directories in *where* (kind -> directory)."""
    cases: dict[str, Callable[[], object]] = {}
    for kind, d in where.items():
        if kind == "memfs.array":
            p = os.path.join(d, "direct.npy")
            cases["memfs.array save"] = functools.partial(ma.save, p, a)
            cases["memfs.array load"] = functools.partial(ma.load, p)
            cases["memfs.array load(out=)"] = functools.partial(ma.load, p, out=out)
        elif kind.startswith("h5py"):
            p = os.path.join(d, "h5.h5")
            cases[f"{kind} save"] = functools.partial(h5_save, p, a)
            cases[f"{kind} load"] = functools.partial(h5_load, p)
        else:
            p = os.path.join(d, "numpy.npy")
            cases[f"{kind} save"] = functools.partial(np.save, p, a)
            cases[f"{kind} load"] = functools.partial(np.load, p)
            if kind == "numpy via mount":
                # The mount keeps what this node wrote in the page cache (embedded): a
                # load right after a save may not reach memfs at all; this one does.
                cases[f"{kind} load, pages dropped"] = functools.partial(np.load, p)
    return cases


def drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def first_touch(nbytes: int) -> None:
    """A new array as large as the loaded one, each page written once: what any load
    into a new array pays on top of moving the bytes (page faults, zeroing)."""
    np.empty(nbytes // 8).fill(1.0)


def measure(cases: dict[str, Callable[[], object]], rounds: int, nbytes: int, label: str,
            raw: bool = False) -> dict[str, float]:
    """GiB/s of each case, median over *rounds*.  Rounds rotate over the groups (a save
    and the loads of its file, timed one by one); once per round, a new array's first
    touch (:func:`first_touch`) and with *raw* raw loopback TCP into memory as large as
    the array."""
    groups: dict[str, list[str]] = {}
    for name in cases:
        groups.setdefault(name.split(" save")[0].split(" load")[0], []).append(name)
    rates: dict[str, list[float]] = {k: [] for k in cases}
    rates[TOUCH] = []
    if raw:
        rates[RAW] = []
        rates[RAW_NEW] = []
    bases = list(groups)
    for r in range(rounds):
        for base in bases[r % len(bases):] + bases[: r % len(bases)]:
            settle(cases[groups[base][0]])
            for name in groups[base]:  # the save first: the loads read its file
                if name.endswith("pages dropped"):  # not timed: only the load is
                    fn = cases[name]
                    assert isinstance(fn, functools.partial)
                    drop_pages(fn.args[0])
                    rates[name].append(nbytes / GIB / timed(functools.partial(np.load, fn.args[0])))
                    continue
                rates[name].append(nbytes / GIB / timed(cases[name]))
        rates[TOUCH].append(nbytes / GIB / timed(functools.partial(first_touch, nbytes)))
        if raw:
            rates[RAW].append(raw_throughput(nbytes, nbytes) / 1024)
            rates[RAW_NEW].append(raw_throughput(nbytes, nbytes, populate=False) / 1024)
        print(f"{label} round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items()),
              file=sys.stderr, flush=True)
    return {k: statistics.median(v) for k, v in rates.items()}


RAW = "raw loopback TCP, 1 stream, into memory"
#: the same into memory the receive touches first, as a load into a new array does
RAW_NEW = "raw loopback TCP, into new memory"
TOUCH = "new array, first touch of its pages"
#: untimed pause after removing the file a save replaces: memfs zeroes freed memory in
#: the background (1 GiB in well under a second), tmpfs frees it at once
SETTLE = 1.5


def settle(save: Callable[[], object]) -> None:
    """Start each group from a quiet pool: remove the file its save would replace and
    let the memory it held be zeroed (untimed), so that no group pays for another's
    garbage.  A program that overwrites its files pays that too, as background work."""
    assert isinstance(save, functools.partial)
    path = save.args[0]
    if os.path.exists(path):
        os.unlink(path)
        time.sleep(SETTLE)


def table(title: str, med: dict[str, float], refs: dict[str, tuple[str, str]]) -> None:
    """One row per case; each column divides by a reference: (save case, load case)."""
    print(f"\n{title}")
    print(f"| {'GiB/s, medians':<30} | {'GiB/s':>6} | " + " | ".join(f"{k:>18}" for k in refs) + " |")
    print(f"|{'-' * 32}|{'-' * 8}|" + "|".join("-" * 20 for _ in refs) + "|")
    for name, v in med.items():
        cols = []
        for save_ref, load_ref in refs.values():
            ref = save_ref if name.endswith(" save") else load_ref
            if ref.endswith(" load") and f"{ref}, pages dropped" in med:
                ref = f"{ref}, pages dropped"  # what memfs itself serves
            cols.append(f"{v / med[ref]:>18.2f}" if name != ref and ref in med
                        and name not in (RAW, RAW_NEW, TOUCH)
                        else f"{'':>18}")
        print(f"| {name:<30} | {v:>6.2f} | " + " | ".join(cols) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G", help="array bytes (default 1G)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=["embedded", "cluster"])
    args = ap.parse_args()
    nbytes = parse_size(args.size, "--size") // 8 * 8
    a = np.random.default_rng(0).random(nbytes // 8)
    out = np.empty_like(a)
    shm = tempfile.mkdtemp(prefix="memfs-arraybench-", dir="/dev/shm")
    try:
        if args.only in (None, "embedded"):
            # direct file + its replacement + numpy's file, with room to spare
            with embedded_mount(4 * nbytes + (256 << 20)) as mnt:
                cases = pairs(a, {"memfs.array": mnt, "numpy via mount": mnt,
                                  "numpy on tmpfs": shm, "h5py on tmpfs": shm}, out)
                med = measure(cases, args.rounds, nbytes, "embedded")
                assert np.array_equal(ma.load(os.path.join(mnt, "direct.npy")), a)
            table(f"embedded mount, {nbytes / GIB:g} GiB float64, {args.rounds} rounds", med,
                  {"x numpy via mount": ("numpy via mount save", "numpy via mount load"),
                   "x numpy on tmpfs": ("numpy on tmpfs save", "numpy on tmpfs load")})
        if args.only in (None, "cluster"):
            volume = max(nbytes * 3 // 4 // (1 << 20) + 64, 256) << 20  # 4 volumes: 3x the array
            with memd_servers(volume) as ports, cluster_mount(ports) as mnt:
                cases = pairs(a, {"memfs.array": mnt, "numpy via mount": mnt}, out)
                med = measure(cases, args.rounds, nbytes, "cluster", raw=True)
                assert np.array_equal(ma.load(os.path.join(mnt, "direct.npy")), a)
            table(f"cluster mount (loopback, 2 memd x 2 volumes), {nbytes / GIB:g} GiB float64, "
                  f"{args.rounds} rounds", med,
                  {"x numpy via mount": ("numpy via mount save", "numpy via mount load"),
                   "of raw TCP": (RAW, RAW), "of raw, new memory": (RAW_NEW, RAW_NEW)})
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
