"""The ``memfs`` command and the ``mount.fuse.memfs`` helper.

User errors print one line (``memfs: error: ...``) and exit 2 without a
traceback.  ``memfs mount`` returns once the filesystem is mounted and ready;
the daemon it forks keeps serving until ``umount``.

One module per subcommand (``cmd_*``, each with ``run(args)``) that imports trio
(or pyfuse3) only inside ``run``, so that ``memfs --help`` starts fast; the
parts they share:

* :mod:`.parser`    the subcommands, their options, and options into configs;
* :mod:`.common`    exit codes, errors, logging, path and size helpers;
* :mod:`.runtime`   a daemon's pid file, log and control socket, and whether it runs;
* :mod:`.client`    talking to a daemon over its control socket;
* :mod:`.mounts`    the mount table, and which memfs mount a path names;
* :mod:`.tickets`   flush/stage-in requests and their progress;
* :mod:`.progress`  the progress line on a terminal;
* :mod:`.tar`       the tar writer of ``memfs stage-out``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence

from memfs.cli import (
    cmd_flush,
    cmd_mds,
    cmd_memd,
    cmd_mount,
    cmd_stage_in,
    cmd_stage_out,
    cmd_status,
    cmd_umount,
)
from memfs.cli.common import EXIT_FAILED, EXIT_USAGE, OperationFailed
from memfs.cli.parser import build_parser, split_o
from memfs.errors import ControlError, UsageError

__all__ = ["EXIT_FAILED", "EXIT_USAGE", "main", "mount_helper"]

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "mount": cmd_mount.run, "umount": cmd_umount.run, "memd": cmd_memd.run, "mds": cmd_mds.run,
    "flush": cmd_flush.run, "status": cmd_status.run, "stage-in": cmd_stage_in.run,
    "stage-out": cmd_stage_out.run,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"memfs: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ControlError, OperationFailed) as exc:
        print(f"memfs: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def mount_helper(argv: Sequence[str] | None = None) -> int:
    """``mount.fuse.memfs SOURCE MOUNTPOINT [-o opts]``, as called by mount(8).

    SOURCE ``HOST:PORT`` mounts from that metadata server (``--mds``); any
    other SOURCE (e.g. ``memfs``) mounts an embedded pool.  Options of the form
    ``size=4G``, ``volumes=4``, ``stripe_size=1M``, ``chunk_size=64K``,
    ``secret_file=F``, ``backing=DIR``, ``flush_delay=S``, ``dirty_max=SIZE``,
    ``flush_workers=N`` and the flags ``discard_on_unmount``, ``no_backing_fsync``
    (and ``debug``) become memfs arguments; the rest are FUSE options.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    positional: list[str] = []
    opts: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-o" and i + 1 < len(argv):
            opts.extend(split_o([argv[i + 1]]))
            i += 2
            continue
        if a.startswith("-o") and len(a) > 2:
            opts.extend(split_o([a[2:]]))
        elif a in ("-n", "-s", "-v", "-f"):
            pass  # mount(8) flags: no mtab, sloppy, verbose, fake
        else:
            positional.append(a)
        i += 1
    if len(positional) != 2:
        print("usage: mount.fuse.memfs SOURCE MOUNTPOINT [-o options]", file=sys.stderr)
        return EXIT_USAGE
    args = ["mount", positional[1]]
    if re.match(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):\d+$", positional[0]):
        args += ["--mds", positional[0]]
    fuse: list[str] = []
    named = {"size": "--size", "volumes": "--volumes", "stripe_size": "--stripe-size",
             "chunk_size": "--chunk-size", "log": "--log", "attr_timeout": "--attr-timeout",
             "readahead": "--readahead", "secret_file": "--secret-file",
             "backing": "--backing", "flush_delay": "--flush-delay", "dirty_max": "--dirty-max",
             "flush_workers": "--flush-workers"}
    flags = {"debug": "--debug", "discard_on_unmount": "--discard-on-unmount",
             "no_backing_fsync": "--no-backing-fsync"}
    for o in opts:
        key, sep, value = o.partition("=")
        if sep and key in named:
            args += [named[key], value]
        elif o in flags:
            args.append(flags[o])
        else:
            fuse.append(o)
    if fuse:
        args += ["-o", ",".join(fuse)]
    return main(args)

