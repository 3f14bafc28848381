"""The mount table, and which memfs mount (and which path in it) a user names.

One reader of ``/proc/self/mounts`` (:func:`mount_entries`), typed entries
(:class:`MountEntry`); every question about what is mounted where asks it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import NamedTuple

from memfs.cli.client import draining_daemon
from memfs.cli.common import canonical, within
from memfs.errors import UsageError

MOUNTS = "/proc/self/mounts"
#: the type of a memfs mount in the mount table
MEMFS_TYPE = "fuse.memfs"


class MountEntry(NamedTuple):
    """One line of the mount table."""

    #: ``memfs`` for an embedded pool, ``HOST:PORT`` for a client of a metadata server
    source: str
    #: the mountpoint, canonical
    point: str
    #: ``fuse.memfs``, ``ext4``, ...
    fstype: str


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_entries() -> Iterator[MountEntry]:
    """Every mount, later entries mounted on top of earlier ones; OSError if the
    table cannot be read."""
    with open(MOUNTS) as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        if len(fields) > 2:
            yield MountEntry(_unescape(fields[0]), _unescape(fields[1]), fields[2])


def mount_table() -> list[MountEntry]:
    """:func:`mount_entries` as a list, empty if the table cannot be read."""
    try:
        return list(mount_entries())
    except OSError:
        return []


def is_mounted(path: str) -> bool:
    real = canonical(path)
    try:
        return any(e.point == real for e in mount_entries())
    except OSError:
        return os.path.ismount(real)


def topmost_mount(path: str) -> MountEntry | None:
    """The entry of the filesystem mounted at *path* last (the one seen there), or None."""
    real = canonical(path)
    return next((e for e in reversed(mount_table()) if e.point == real), None)


def mount_type(path: str) -> str | None:
    """The type of the topmost filesystem mounted at *path* (``fuse.memfs``), or None."""
    entry = topmost_mount(path)
    return entry.fstype if entry is not None else None


def mount_source(path: str) -> str | None:
    """The source field of the topmost mount at *path* (``memfs`` for an embedded
    pool, ``HOST:PORT`` for a client of a metadata server), or None."""
    entry = topmost_mount(path)
    return entry.source if entry is not None else None


def memfs_mountpoint(arg: str, *, draining: bool = False) -> str:
    """The memfs mountpoint *arg* names (a symlink to it too); UsageError otherwise.

    With *draining*, also a mountpoint that is no longer mounted but whose daemon
    still runs (writing back after an interrupted ``memfs umount``): its control
    socket still answers.
    """
    table = mount_table()
    path = canonical(arg)
    if all(e.point != path for e in table) and os.path.islink(path):
        path = os.path.realpath(path)
    types = [e.fstype for e in table if e.point == path]
    if not types:
        if draining and (client := draining_daemon(path)) is not None:
            client.close()
            return path
        raise UsageError(f"{arg} is not a memfs mount (not mounted)")
    if types[-1] != MEMFS_TYPE:
        raise UsageError(f"{arg} is a {types[-1]} mount, not memfs")
    return path


def memfs_mount_of(path: str) -> str | None:
    """The memfs mountpoint that canonical *path* lies in, or None."""
    best: MountEntry | None = None
    for e in mount_table():
        if within(path, e.point) and (best is None or len(e.point) >= len(best.point)):
            best = e
    return best.point if best is not None and best.fstype == MEMFS_TYPE else None


def mount_relative(mnt: str, path: str, base: str | None = None) -> str:
    """*path* (absolute, or relative to *base*, default the working directory) as the
    daemon names it: relative to the mount root, ``""`` for the root itself."""
    full = canonical(os.path.join(base, path) if base is not None else path)
    if not within(full, mnt):
        raise UsageError(f"{path} is not inside {mnt}")
    rel = os.path.relpath(full, mnt)
    return "" if rel == "." else rel


def user_path(mnt: str, path: str) -> str:
    """A PATH argument of flush/stage-in as the daemon names it (see :func:`mount_relative`).

    Absolute, or relative to the working directory; a relative PATH that does
    not exist there but does in the mount is taken relative to the mount root,
    as manifest lines are (``memfs stage-in /mnt/bb inputs`` from anywhere).
    It must exist: a mistyped name is the user's mistake, said with the full path.
    """
    full = canonical(path)
    exists = os.path.lexists(full)
    if exists:
        if not within(full, mnt):
            raise UsageError(f"{path} is not inside {mnt}")
        return mount_relative(mnt, full)
    alt = None if os.path.isabs(path) else canonical(os.path.join(mnt, path))
    if alt is not None and within(alt, mnt) and os.path.lexists(alt):
        return mount_relative(mnt, alt)
    if within(full, mnt):
        raise UsageError(f"{full} does not exist")
    if alt is not None and within(alt, mnt):
        raise UsageError(f"{alt} does not exist")
    raise UsageError(f"{path} is not inside {mnt}")
