"""The tar writer of ``memfs stage-out``: one PAX archive of a tree, all or nothing."""

from __future__ import annotations

import os
import stat
import tarfile
import time
from collections.abc import Callable, Iterator
from typing import IO

from memfs.backing.status import TicketProgress
from memfs.cli.common import OperationFailed
from memfs.cli.progress import REDRAW_INTERVAL, progress_text


def _walk(top: str, name: str) -> Iterator[tuple[str, str]]:
    """``(path, member name)`` of *top* and everything below it, parents first, sorted."""
    stack = [(top, name)]
    while stack:
        path, arcname = stack.pop()
        yield path, arcname
        if os.path.isdir(path) and not os.path.islink(path):
            try:
                names = sorted(os.listdir(path))
            except OSError as exc:
                raise OperationFailed(f"cannot list {path}: {exc.strerror}") from None
            stack.extend((os.path.join(path, c), f"{arcname}/{c}") for c in reversed(names))


def _pax_time(ns: int) -> str:
    sign = "-" if ns < 0 else ""
    sec, frac = divmod(abs(ns), 10**9)
    return f"{sign}{sec}.{frac:09d}"


class _Counting:
    """A file that reports how much of it has been read."""

    def __init__(self, f: IO[bytes], count: Callable[[int], None]) -> None:
        self.f = f
        self.count = count

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.count(len(data))
        return data


def write_archive(src: str, archive: str, progress: Callable[[str], None] | None = None) -> None:
    """Write the tree *src* as one PAX tar file *archive*, all or nothing.

    Members are named relative to *src*'s parent (``tar -C parent -cf archive
    name``), with modes, owners, mtimes, symlinks and hard links.  Written to a
    temporary name next to *archive*, fsynced, then renamed into place.
    """
    name = os.path.basename(src) or "."
    directory, base = os.path.split(archive)
    tmp = os.path.join(directory, f".{base}.{os.getpid()}.tmp")
    total_files = total_bytes = 0
    if progress is not None:  # one more walk for the totals: only for a person watching
        for path, _ in _walk(src, name):
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total_files += 1
                total_bytes += st.st_size
    done_files = done_bytes = 0
    last_shown = 0.0
    start = time.monotonic()

    def show(force: bool = False) -> None:
        nonlocal last_shown
        now = time.monotonic()
        if progress is not None and (force or now - last_shown >= REDRAW_INTERVAL):
            last_shown = now
            progress(progress_text("stage-out", TicketProgress(
                files=total_files - done_files, total_files=total_files,
                bytes=max(total_bytes - done_bytes, 0), total_bytes=total_bytes,
            ), now - start))

    def count(n: int) -> None:
        nonlocal done_bytes
        done_bytes += n
        show()

    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise OperationFailed(f"cannot create {tmp}: {exc.strerror}") from None
    current = src
    try:
        with open(fd, "wb", buffering=1 << 20) as out:
            with tarfile.TarFile(fileobj=out, mode="w", format=tarfile.PAX_FORMAT,
                                 copybufsize=1 << 20) as tar:
                for current, arcname in _walk(src, name):
                    info = tar.gettarinfo(current, arcname)
                    if info is None:
                        continue  # a socket: tar cannot hold it (GNU tar skips it too)
                    # Exact to the nanosecond: tarfile would write the float's repr,
                    # which GNU tar reads back a microsecond off.
                    info.pax_headers = {"mtime": _pax_time(os.lstat(current).st_mtime_ns)}
                    if info.isreg():
                        with open(current, "rb") as f:
                            tar.addfile(info, _Counting(f, count))
                        done_files += 1
                    else:
                        tar.addfile(info)
                    show()
            current = archive
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, archive)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise OperationFailed(
                f"stage-out failed at {current}: {exc.strerror or exc}; no archive written"
            ) from None
        raise
    show(force=True)
