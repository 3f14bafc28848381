"""``memfs flush MNT [PATH...] [--wait]``: write dirty data back to the backing directory now."""

from __future__ import annotations

import argparse

from memfs.cli.client import connect
from memfs.cli.mounts import memfs_mountpoint, user_path
from memfs.cli.progress import stderr_is_terminal
from memfs.cli.tickets import start_tickets, wait_tickets


def run(args: argparse.Namespace) -> int:
    mnt = memfs_mountpoint(args.mountpoint, draining=True)
    paths = [user_path(mnt, p) for p in args.paths]
    with connect(mnt) as client:
        tickets = start_tickets(client, "flush", paths)
        if args.wait:
            wait_tickets(client, tickets, "flushing", "write-back of",
                         show=stderr_is_terminal() and not args.quiet)
    return 0
