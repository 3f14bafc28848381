"""Reads and rewrites of a few files from two cluster nodes at once, checked.

Readers on both nodes (``O_DIRECT`` and through the page cache) read whole files;
one writer on c1 rewrites them (``O_TRUNC`` half the time), each rewrite a new
generation of tagged blocks; a read that began after a rewrite's close and before
the next rewrite began must be exactly that generation.  With a backing directory
and a full pool (tests/mount/test_cluster_backing.py) it found the stale reads
that the lease code now prevents (docs/ARCHITECTURE.md, "Consistency model").
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BLOCK = 4096


def tagged(name: str, gen: int, size: int) -> bytes:
    """*size* bytes of 4 KiB blocks, each naming its file, generation and place."""
    out = []
    for k in range(size // BLOCK):
        tag = f"<{name}|g{gen:06d}|b{k:06d}>".encode()
        out.append((tag * (BLOCK // len(tag) + 1))[:BLOCK])
    return b"".join(out)


def direct_read(path: Path, size: int) -> bytes:
    """The whole file with O_DIRECT (no page cache of this node in the way)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, size + BLOCK)
        n = os.preadv(fd, [buf], 0)
        return bytes(buf[:n])
    finally:
        os.close(fd)


def churn(c1: Path, c2: Path, names: list[str], size: int, seconds: float,
          extra: Callable[[Path, threading.Event], None] | None = None) -> tuple[list[str], dict[str, int]]:
    """Run the readers and the rewriter for *seconds* (and *extra*, on c1, if given)
    over files *names* of *size* bytes that hold generation 0; (problems, counts)."""
    committed = dict.fromkeys(names, 0)  # generation whose close returned
    started = dict.fromkeys(names, 0)  # generation being written
    lock = threading.Lock()
    problems: list[str] = []
    counts = {"reads": 0, "rewrites": 0}
    stop = threading.Event()

    def guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            problems.append(f"{getattr(fn, '__name__', fn)}: {exc!r}")
            stop.set()

    def reader(mnt: Path, seed: int, buffered: bool = False) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            name = rng.choice(names)
            with lock:
                lo = committed[name]
            data = (mnt / name).read_bytes() if buffered else direct_read(mnt / name, size)
            with lock:
                hi = started[name]
            counts["reads"] += 1
            want = tagged(name, lo, size)
            if lo == hi and data != want:
                k = next((k for k in range(0, min(len(data), size), BLOCK)
                          if data[k : k + BLOCK] != want[k : k + BLOCK]), min(len(data), size))
                problems.append(f"{name} read on {mnt.name}{' buffered' if buffered else ''}: "
                                f"{len(data)} bytes, not generation {lo}'s {size}: from byte {k}: "
                                f"{data[k : k + 24]!r}")
                stop.set()

    def rewriter(mnt: Path) -> None:
        rng = random.Random(1)
        while not stop.is_set():
            name = rng.choice(names)
            with lock:
                gen = started[name] = started[name] + 1
            trunc = os.O_TRUNC if rng.random() < 0.5 else 0
            fd = os.open(mnt / name, os.O_WRONLY | trunc)
            try:
                data = tagged(name, gen, size)
                assert os.pwrite(fd, data, 0) == len(data)
                os.fsync(fd)
            finally:
                os.close(fd)
            with lock:
                committed[name] = gen
            counts["rewrites"] += 1
            time.sleep(rng.random() * 0.2)

    # Three page-cache readers on c2 and an O_DIRECT reader on each node: the mix
    # that found the last stale reads (2026-11-27), one of them c1's own reads
    # racing its own truncates.
    jobs: list[tuple[Any, ...]] = [
        (reader, c2, 1), (reader, c2, 2, True), (reader, c2, 3, True), (reader, c2, 5, True),
        (reader, c1, 4), (rewriter, c1)]
    if extra is not None:
        jobs.append((extra, c1, stop))
    threads = [threading.Thread(target=guarded, args=a) for a in jobs]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(120)
    return problems, counts
