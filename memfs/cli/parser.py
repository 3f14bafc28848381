"""The ``memfs`` command line: subcommands, their options, and options into configs.

Only argparse and :mod:`memfs.config` here: ``memfs --help`` imports no trio.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from memfs import __version__
from memfs.cli.common import format_bytes
from memfs.config import FlushConfig, PoolConfig, parse_size
from memfs.errors import UsageError


def split_o(values: Sequence[str]) -> list[str]:
    return [o.strip() for v in values for o in v.split(",") if o.strip()]


class _SubParser(argparse.ArgumentParser):
    """A subcommand's parser; with ``intermixed`` set, options may follow the
    positional arguments too (``memfs flush MNT --wait PATH``)."""

    intermixed = False
    _inside = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._inside:
            return super().parse_known_args(args, namespace)
        if self.intermixed:
            self._inside = True  # parse_known_intermixed_args calls back here
            try:
                ns, extra = self.parse_known_intermixed_args(args, namespace)
            finally:
                self._inside = False
        else:
            ns, extra = super().parse_known_args(args, namespace)
        if extra:
            # Said here, with this command's usage: the top-level parser would show
            # only ``memfs COMMAND ...``.
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra


DESCRIPTION = ("memfs: a FUSE filesystem over pooled memory, on one node or a cluster; "
               "with --backing DIR, a burst buffer in front of a parallel filesystem.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memfs", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"memfs {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=_SubParser)

    m = sub.add_parser("mount", help="mount a memfs filesystem")
    m.add_argument("mountpoint")
    m.add_argument("--size", default="4G", help="pool capacity, e.g. 512M, 4G (default 4G)")
    m.add_argument("--volumes", default="4", help="number of memory volumes (default 4)")
    m.add_argument("--stripe-size", default="1M", help="stripe unit (default 1M)")
    m.add_argument("--chunk-size", default="64K", help="allocation unit (default 64K)")
    m.add_argument("-o", dest="options", action="append", default=[],
                   help="FUSE mount options, comma separated; writeback_cache enables "
                        "the kernel writeback cache; direct_io keeps file data out of the "
                        "kernel's page cache (each read and write goes to the daemon, data "
                        "is in memory once); passthrough (embedded, root) keeps each file's "
                        "bytes in a backing file on a private tmpfs that the kernel reads and "
                        "writes itself, without the daemon; localflock keeps a cluster client's flock and "
                        "fcntl locks on this node (by default they hold across nodes)")
    m.add_argument("--attr-timeout", type=float, default=None,
                   help="seconds the kernel may cache attributes and names (default: a "
                        "day for an embedded pool, where every change goes through this "
                        "kernel; 1 with --backing); with --mds the metadata server's leases "
                        "decide instead (only if it runs with --lease-term 0 does this "
                        "apply, default 0 there)")
    m.add_argument("--mds", metavar="HOST:PORT",
                   help="cluster mode: use this metadata server (and its memory servers) "
                        "instead of an embedded pool; --size/--volumes/--stripe-size/"
                        "--chunk-size then come from the server")
    m.add_argument("--secret-file", help="shared secret (mode 0600) for --mds and its memory servers")
    m.add_argument("--readahead", default="4M",
                   help="kernel readahead for sequential reads (default 4M; 0 keeps the kernel's)")
    m.add_argument("--foreground", "-f", action="store_true", help="do not fork into the background")
    m.add_argument("--debug", "-d", action="store_true", help="log at debug level")
    m.add_argument("--log", help="daemon log file (default: /run/memfs/MOUNTPOINT.log)")
    m.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics")
    _add_flush_arguments(m, mount=True)

    u = sub.add_parser("umount", help="unmount and wait for the daemon to exit")
    u.add_argument("mountpoint")
    u.add_argument("--lazy", "-l", action="store_true", help="detach now even if busy")

    d = sub.add_parser("memd", help="serve memory volumes to memfs clients over TCP (foreground)")
    d.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="address to listen on, e.g. 10.0.0.2:7100 ([V6]:PORT for IPv6)")
    d.add_argument("--volumes", default="1", help="number of volumes (default 1)")
    d.add_argument("--size", help="memory served in all, split evenly over --volumes, e.g. 64G "
                                  "(the whole, like memfs mount --size)")
    d.add_argument("--volume-size", help="bytes per volume, e.g. 16G (with --size, the two "
                                         "must agree)")
    d.add_argument("--secret-file", help="shared secret (mode 0600) clients must prove they know; "
                                          "without it anyone who can reach the port may use it")
    d.add_argument("--rdma-device", default="auto", metavar="NAME",
                   help="RDMA device for verbs:// clients: auto (default: the first one pyverbs "
                        "finds, if any), off, or a name such as mlx5_0")
    d.add_argument("--debug", "-d", action="store_true", help="log at debug level")
    d.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics")

    ms = sub.add_parser("mds", help="serve metadata to memfs mounts over TCP (foreground)")
    ms.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="address to listen on, e.g. 10.0.0.1:7000 ([V6]:PORT for IPv6)")
    ms.add_argument("--pool", required=True, metavar="SPEC",
                   help="the pool's volumes in order, e.g. tcp://10.0.0.2:7100/0+tcp://10.0.0.3:7100/0")
    ms.add_argument("--secret-file", help="shared secret (mode 0600) clients must prove they know; "
                                          "also used to ask the memory servers for volume sizes")
    ms.add_argument("--journal", metavar="DIR",
                   help="keep metadata in DIR (journal + snapshots) so it survives restarts")
    ms.add_argument("--chunk-size", default="64K", help="allocation unit (default 64K)")
    ms.add_argument("--stripe-size", default="1M", help="default stripe unit (default 1M)")
    ms.add_argument("--volume-size",
                   help="bytes per volume (default: ask the memory servers of the pool)")
    ms.add_argument("--grace", type=float, default=60.0, metavar="SECONDS",
                   help="how long open files of a vanished client (and, after a restart, "
                        "unlinked files clients held open) are kept for it to return (default 60)")
    ms.add_argument("--lease-term", type=float, default=4.0, metavar="SECONDS",
                   help="how long clients may trust what they cache (leases, recalled before "
                        "any conflicting change); 0: clients cache nothing (default 4)")
    ms.add_argument("--recall-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="a client that does not answer a recall within this is evicted; the "
                        "change then waits at most --lease-term more (default 2)")
    ms.add_argument("--sync-creates", action="store_true",
                   help="every create waits for this server (by default a client alone in a "
                        "directory creates files there itself and tells this server without "
                        "waiting: a create lease, recalled before anyone else looks)")
    ms.add_argument("--backing-write-leases", action=argparse.BooleanOptionalAction, default=None,
                   help="with --backing: clients write under write leases, no call per write "
                        "(the default); --no-backing-write-leases: every write asks this server")
    ms.add_argument("--debug", "-d", action="store_true", help="log at debug level")
    ms.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics")
    _add_flush_arguments(ms, mount=False)

    paths_help = ("files or directories in the mount: absolute, or relative to the current "
                  "directory (or else to MNT); default: everything")
    f = sub.add_parser("flush", help="write dirty data back to the backing directory now")
    f.intermixed = True
    f.add_argument("mountpoint", metavar="MNT", help="the memfs mountpoint")
    f.add_argument("paths", nargs="*", default=[], metavar="PATH", help=paths_help)
    f.add_argument("--wait", action="store_true",
                   help="return when everything named is clean in the backing directory")
    f.add_argument("--quiet", "-q", action="store_true", help="no progress line, even on a terminal")

    st = sub.add_parser("status", help="capacity, dirty data, write-back and stage-in progress")
    st.add_argument("mountpoint", metavar="MNT", help="the memfs mountpoint")
    st.add_argument("--json", action="store_true", help="the daemon's status as JSON")

    si = sub.add_parser("stage-in", help="fetch files from the backing directory into memory")
    si.intermixed = True
    si.add_argument("mountpoint", metavar="MNT", help="the memfs mountpoint")
    si.add_argument("paths", nargs="*", default=[], metavar="PATH", help=paths_help)
    si.add_argument("--manifest", metavar="FILE",
                    help="more paths, one per line (absolute, or relative to MNT); "
                         "blank lines and # comments are ignored")
    si.add_argument("--no-wait", action="store_true",
                    help="return once queued, saying how much is being fetched, instead of "
                         "waiting (memfs status shows what is left)")

    so = sub.add_parser("stage-out", help="write a tree as one tar archive instead of file by file")
    so.add_argument("path", metavar="MNT/PATH", help="a file or directory in a memfs mount")
    so.add_argument("--archive", required=True, metavar="FILE",
                    help="the tar file to write (outside the mount, e.g. in the backing directory)")
    return p


def _add_flush_arguments(p: argparse.ArgumentParser, *, mount: bool) -> None:
    p.add_argument("--backing", metavar="DIR",
                   help="burst buffer: write files back to DIR (e.g. on the parallel filesystem) "
                        "in the background" + ("; files already in DIR show in the mount"
                                               if mount else ""))
    p.add_argument("--flush-delay", metavar="SECONDS",
                   help="write a file back this long after its last change (default 5)")
    p.add_argument("--dirty-max", metavar="SIZE",
                   help="data not yet written back at which writers wait (default: half the pool)")
    p.add_argument("--flush-workers", metavar="N", help="files written back in parallel (default 4)")
    p.add_argument("--no-backing-fsync", action="store_true",
                   help="do not fsync files in DIR before renaming them into place")
    if mount:
        p.add_argument("--discard-on-unmount", action="store_true",
                       help="do not write dirty data back at unmount: drop it")


def pool_from_args(args: argparse.Namespace) -> PoolConfig:
    try:
        volumes = int(args.volumes)
    except ValueError:
        raise UsageError(f"bad --volumes {args.volumes!r}: expected a whole number") from None
    return PoolConfig(
        size=parse_size(args.size, "--size"),
        volumes=volumes,
        stripe_size=parse_size(args.stripe_size, "--stripe-size"),
        chunk_size=parse_size(args.chunk_size, "--chunk-size"),
    )


def check_backing(path: str) -> str:
    """A usable backing directory, as its canonical path."""
    if not os.path.exists(path):
        raise UsageError(f"backing directory {path} does not exist")
    if not os.path.isdir(path):
        raise UsageError(f"backing directory {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"backing directory {path} is not writable")
    return os.path.realpath(path)


def flush_from_args(args: argparse.Namespace, pool_size: int | None) -> FlushConfig | None:
    """The ``--backing`` settings, or None without ``--backing``.

    *pool_size* (None: not known here) bounds ``--dirty-max``.
    """
    knobs = {
        "--flush-delay": args.flush_delay is not None,
        "--dirty-max": args.dirty_max is not None,
        "--flush-workers": args.flush_workers is not None,
        "--no-backing-fsync": args.no_backing_fsync,
        "--discard-on-unmount": getattr(args, "discard_on_unmount", False),
    }
    if args.backing is None:
        for name, given in knobs.items():
            if given:
                raise UsageError(f"{name} goes with --backing DIR")
        return None
    backing = check_backing(args.backing)
    delay = 5.0
    if args.flush_delay is not None:
        try:
            delay = float(args.flush_delay)
        except ValueError:
            raise UsageError(f"bad --flush-delay {args.flush_delay!r}: expected seconds") from None
    workers = 4
    if args.flush_workers is not None:
        try:
            workers = int(args.flush_workers)
        except ValueError:
            raise UsageError(
                f"bad --flush-workers {args.flush_workers!r}: expected a whole number"
            ) from None
    dirty_max = None
    if args.dirty_max is not None:
        dirty_max = parse_size(args.dirty_max, "--dirty-max")
        if pool_size is not None and dirty_max > pool_size:
            raise UsageError(f"--dirty-max {args.dirty_max} is larger than the pool "
                             f"({format_bytes(pool_size)})")
    return FlushConfig(  # checks delay and workers
        backing=backing, delay=delay, dirty_max=dirty_max, workers=workers,
        fsync=not args.no_backing_fsync,
        discard_on_unmount=bool(getattr(args, "discard_on_unmount", False)),
    )
