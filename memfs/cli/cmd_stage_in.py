"""``memfs stage-in MNT [PATH...] [--manifest FILE]``: fetch files from the backing
directory into memory, waiting (with progress) unless ``--no-wait``."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import TYPE_CHECKING

from memfs.backing.status import BackingStatus
from memfs.cli.client import connect
from memfs.cli.common import EXIT_FAILED, format_bytes
from memfs.cli.mounts import memfs_mountpoint, mount_relative, user_path
from memfs.cli.progress import stderr_is_terminal
from memfs.cli.tickets import start_tickets, ticket_progress, wait_tickets
from memfs.errors import ControlError, UsageError

if TYPE_CHECKING:
    from memfs.control import ControlClient

#: ``memfs stage-in`` names at most this many files that failed, then counts the rest
FAILED_SHOWN = 10


def read_manifest(manifest: str, mnt: str) -> list[str]:
    """The paths a stage-in manifest names, relative to the mount root."""
    try:
        with open(manifest, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read manifest {manifest}: {exc.strerror}") from None
    out = []
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(mount_relative(mnt, line, base=mnt))
        except UsageError:
            raise UsageError(f"{manifest}:{n}: {line} is not inside {mnt}") from None
    return out


def run(args: argparse.Namespace) -> int:
    mnt = memfs_mountpoint(args.mountpoint)
    paths = [user_path(mnt, p) for p in args.paths]
    if args.manifest is not None:
        named = read_manifest(args.manifest, mnt)
        if not named and not paths:
            return 0  # an empty manifest names nothing (not "everything")
        paths += named
    with connect(mnt) as client:
        tickets = start_tickets(client, "stage_in", paths)
        if args.no_wait:
            progress = [ticket_progress(client, t) for t in tickets]
            files = sum(p.total_files for p in progress)
            if files:
                print(f"staging in {files} files "
                      f"({format_bytes(sum(p.total_bytes for p in progress))}) in the background; "
                      f"`memfs status {mnt}` shows what is left")
            else:
                print("nothing to stage in: all of it is in memory already")
        else:
            progress = wait_tickets(client, tickets, "staging in", "stage-in of",
                                    show=stderr_is_terminal())
        _warn_capacity(client, sum(p.total_bytes for p in progress))
    failed: dict[str, str] = {}
    for p in progress:
        for f in p.failed:
            failed.setdefault(f.path, f.error)
    if not failed:
        return 0
    for path, error in list(failed.items())[:FAILED_SHOWN]:
        print(f"memfs: error: stage-in of {os.path.join(mnt, path) if path else mnt}: {error}",
              file=sys.stderr)
    if len(failed) > FAILED_SHOWN:
        print(f"memfs: error: ... and {len(failed) - FAILED_SHOWN} more", file=sys.stderr)
    return EXIT_FAILED


def _warn_capacity(client: ControlClient, staged: int) -> None:
    """Staging in more than the pool holds evicts the first part again."""
    try:
        capacity = BackingStatus.from_json(client.call("status")).capacity
    except ControlError:
        return
    if 0 < capacity < staged:
        print(f"memfs: warning: staged {math.ceil(staged / (1 << 20))} MiB into a pool of "
              f"{capacity >> 20} MiB: only the most recently staged part stays in memory",
              file=sys.stderr)
