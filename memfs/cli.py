"""The ``memfs`` command and the ``mount.fuse.memfs`` helper.

User errors print one line (``memfs: error: ...``) and exit 2 without a
traceback.  ``memfs mount`` returns once the filesystem is mounted and ready;
the daemon it forks keeps serving until ``umount``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import select
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from memfs import __version__
from memfs.config import FlushConfig, PoolConfig, parse_hostport, parse_size
from memfs.errors import ControlError, UsageError
from memfs.host import process_alive

if TYPE_CHECKING:
    from memfs.control import ControlClient

log = logging.getLogger(__name__)

EXIT_USAGE = 2
#: the daemon or the backing filesystem failed (not the user's mistake)
EXIT_FAILED = 1
READY_TIMEOUT = 120.0
#: seconds to wait for any one control request (the daemon answers at once)
CONTROL_TIMEOUT = 30.0
#: how often ``--wait`` asks for progress
POLL_INTERVAL = 0.2
#: bytes of paths per flush/stage-in request (the daemon refuses lines above 1 MiB)
REQUEST_BUDGET = 512 << 10
#: ``memfs umount`` says what the daemon is writing back if it takes longer than this
DRAIN_NOTICE_AFTER = 2.0
#: ``memfs umount`` shows write-back errors of the last this many seconds (a failing
#: write-back is retried at least every 30 s)
RECENT_ERROR = 60.0
#: longest Unix socket path (sun_path is 108 bytes with its NUL)
SUN_PATH_MAX = 107
FLUSH_XATTR = "user.memfs.flush"


class OperationFailed(Exception):
    """A command failed for a reason that is not a usage mistake (exit 1, one line)."""


#: root's daemons: pid and log files (mode 0700: nobody else's business)
ROOT_RUNTIME_DIR = Path("/run/memfs")
#: root's daemons: control sockets only (mode 0755, sockets 0666), so that the
#: owner of a mount's root directory can reach its daemon; the daemon itself
#: decides who may use it (SO_PEERCRED), see :mod:`memfs.control`
ROOT_CONTROL_DIR = Path("/run/memfs-ctl")


def runtime_dir() -> Path:
    """Where daemons keep their pid and log files."""
    if os.geteuid() == 0:
        return ROOT_RUNTIME_DIR
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/memfs-{os.getuid()}"
    return Path(base) / "memfs" if "XDG_RUNTIME_DIR" in os.environ else Path(base)


def canonical(path: str) -> str:
    """Absolute path with symlinks resolved in the parent only.

    ``realpath`` would stat the mountpoint itself, which hangs if its daemon is
    stuck; mount tables list canonical paths, so the parent is enough.
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    return os.path.join(os.path.realpath(parent), name) if name else path


def instance_name(mountpoint: str) -> str:
    """A file name for a mountpoint: ``/mnt/memfs`` -> ``mnt-memfs``.

    Escaped like ``systemd-escape -p``, so that it is unique: ``/mnt/a-b`` is
    ``mnt-a\\x2db``, not the ``mnt-a-b`` of ``/mnt/a/b`` (two mounts sharing a pid
    file made ``memfs umount`` wait for the other one's daemon, forever).
    """
    path = canonical(mountpoint).strip("/")
    out = []
    for i, ch in enumerate(path):
        if ch == "/":
            out.append("-")
        elif (ch.isascii() and (ch.isalnum() or ch in "_:")) or (ch == "." and i > 0):
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogateescape"))
    return "".join(out) or "-"


def pid_file(mountpoint: str) -> Path:
    return runtime_dir() / f"{instance_name(mountpoint)}.pid"


def control_dir() -> Path:
    """Where the daemons of this user put their control sockets.

    Root's: :data:`ROOT_CONTROL_DIR`, reachable by every user (the daemon checks
    who connects).  Anyone else's: next to the pid files, in a directory of
    their own that only they (and root) can enter.
    """
    return ROOT_CONTROL_DIR if os.geteuid() == 0 else runtime_dir()


def _socket_in(directory: Path, mountpoint: str) -> Path:
    name = instance_name(mountpoint)
    path = directory / f"{name}.ctl"
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        path = directory / f"ctl-{hashlib.sha256(name.encode()).hexdigest()[:32]}.ctl"
    return path


def control_socket(mountpoint: str) -> Path:
    """The control socket (``memfs flush/status/stage-in``) of a daemon this user starts.

    In :func:`control_dir`; a name that would not fit a Unix socket address
    (deep mountpoints) is replaced by a hash of it.
    """
    return _socket_in(control_dir(), mountpoint)


def control_sockets(mountpoint: str) -> list[Path]:
    """Where the daemon of *mountpoint* may listen, in the order to try: this
    user's own daemon's place, then (for a user other than root) root's, as the
    owner of a mount root that root mounted (a Slurm job's) talks to root's daemon."""
    own = control_socket(mountpoint)
    if os.geteuid() == 0:
        return [own]
    return list(dict.fromkeys([own, _socket_in(ROOT_CONTROL_DIR, mountpoint)]))


def default_log_file(mountpoint: str) -> Path:
    return runtime_dir() / f"{instance_name(mountpoint)}.log"


def is_mounted(path: str) -> bool:
    real = canonical(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 1 and _unescape(fields[1]) == real:
                    return True
    except OSError:
        return os.path.ismount(real)
    return False


def mount_type(path: str) -> str | None:
    """The type of the topmost filesystem mounted at *path* (``fuse.memfs``), or None."""
    real = canonical(path)
    found = None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and _unescape(fields[1]) == real:
                    found = fields[2]  # later lines are mounted on top of earlier ones
    except OSError:
        pass
    return found


def mount_table() -> list[tuple[str, str]]:
    """``(mountpoint, type)`` of every mount, later entries mounted on top of earlier ones."""
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    return [(_unescape(fl[1]), fl[2]) for fl in (line.split() for line in lines) if len(fl) > 2]


def within(path: str, top: str) -> bool:
    """True if canonical *path* is *top* or lies below it."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def mount_source(path: str) -> str | None:
    """The source field of the topmost mount at *path* (``memfs`` for an embedded
    pool, ``HOST:PORT`` for a client of a metadata server), or None."""
    real = canonical(path)
    found = None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and _unescape(fields[1]) == real:
                    found = _unescape(fields[0])
    except OSError:
        pass
    return found


def memfs_mountpoint(arg: str, *, draining: bool = False) -> str:
    """The memfs mountpoint *arg* names (a symlink to it too); UsageError otherwise.

    With *draining*, also a mountpoint that is no longer mounted but whose daemon
    still runs (writing back after an interrupted ``memfs umount``): its control
    socket still answers.
    """
    table = mount_table()
    path = canonical(arg)
    if all(m != path for m, _ in table) and os.path.islink(path):
        path = os.path.realpath(path)
    types = [t for m, t in table if m == path]
    if not types:
        if draining and (client := draining_daemon(path)) is not None:
            client.close()
            return path
        raise UsageError(f"{arg} is not a memfs mount (not mounted)")
    if types[-1] != "fuse.memfs":
        raise UsageError(f"{arg} is a {types[-1]} mount, not memfs")
    return path


def memfs_mount_of(path: str) -> str | None:
    """The memfs mountpoint that canonical *path* lies in, or None."""
    best: tuple[str, str] | None = None
    for m, t in mount_table():
        if within(path, m) and (best is None or len(m) >= len(best[0])):
            best = (m, t)
    return best[0] if best is not None and best[1] == "fuse.memfs" else None


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def check_mountpoint(path: str) -> str:
    # Before anything stats it: a mount whose daemon died answers ENOTCONN,
    # which os.path.exists() would report as "does not exist".
    if is_mounted(path):
        raise UsageError(f"{path} is already a mountpoint (umount it first)")
    if not os.path.exists(path):
        raise UsageError(f"mountpoint {path} does not exist")
    if not os.path.isdir(path):
        raise UsageError(f"mountpoint {path} is not a directory")
    if is_mounted(os.path.realpath(path)):  # reached through a symlink: do not stack
        raise UsageError(f"{path} is already a mountpoint (umount it first)")
    if not os.path.exists("/dev/fuse"):
        raise UsageError("/dev/fuse is missing: load the fuse kernel module (modprobe fuse)")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise UsageError("no permission to open /dev/fuse")
    return os.path.realpath(path)


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
        if not self.intermixed or self._inside:
            return super().parse_known_args(args, namespace)
        self._inside = True  # parse_known_intermixed_args calls back here
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


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
                        "the kernel writeback cache")
    m.add_argument("--attr-timeout", type=float, default=None,
                   help="seconds the kernel may cache attributes and names (default 1); "
                        "with --mds the metadata server's leases decide instead (only if it "
                        "runs with --lease-term 0 does this apply, default 0 there)")
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
    d.add_argument("--size", required=True, help="bytes per volume, e.g. 4G")
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


def check_overlap(backing: str, mountpoint: str) -> None:
    """Refuse write-back into the mount itself: a flush worker would wait on its own daemon."""
    if within(backing, mountpoint):
        raise UsageError(f"backing directory {backing} is inside the mountpoint {mountpoint} "
                         "(writing back into the mount itself would deadlock)")
    if within(mountpoint, backing):
        raise UsageError(f"mountpoint {mountpoint} is inside the backing directory {backing} "
                         "(writing back into the mount itself would deadlock)")


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


def setup_logging(debug: bool, log_file: str | None = None) -> None:
    handler: logging.Handler
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    if not debug:
        logging.getLogger("pyfuse3").setLevel(logging.WARNING)


def cmd_mount(args: argparse.Namespace) -> int:
    from memfs import mount, wire  # pyfuse3 is only needed here

    if args.backing is not None and args.mds:
        raise UsageError("--backing goes with an embedded pool: with --mds the metadata server "
                         "writes back (start `memfs mds` with --backing)")
    flush = flush_from_args(
        args, pool_from_args(args).size if args.dirty_max is not None and not args.mds else None
    )
    mountpoint = check_mountpoint(args.mountpoint)
    check_no_daemon(mountpoint)
    if flush is not None:
        check_overlap(flush.backing, mountpoint)
    if args.attr_timeout is None:
        args.attr_timeout = 0.0 if args.mds else 1.0
    if not 0 <= args.attr_timeout < float("inf"):  # also refuses nan
        raise UsageError(f"bad --attr-timeout {args.attr_timeout}: expected seconds, 0 or more")
    if args.secret_file and not args.mds:
        raise UsageError("--secret-file goes with --mds (an embedded pool has no network)")
    options = split_o(args.options)
    opts = mount.MountOptions(
        mountpoint=mountpoint,
        pool=pool_from_args(args),
        fuse_options=options,
        writeback_cache="writeback_cache" in options,
        attr_timeout=args.attr_timeout,
        readahead_kib=0 if args.readahead == "0" else parse_size(args.readahead, "--readahead") >> 10,
    )
    if args.mds:
        opts.mds = parse_hostport(args.mds, "--mds")
        opts.secret = wire.load_secret(args.secret_file) if args.secret_file else b""
        opts.max_tasks = 64  # requests wait on the network: overlap them
    else:
        mount.check_memory(opts.pool)
    opts.flush = flush
    opts.metrics = parse_hostport(args.metrics, "--metrics") if args.metrics else None
    # Every mount has one: in cluster mode the mds may write back for it.
    ctl = control_socket(mountpoint)
    opts.control_path = str(ctl)
    make_control_dir(ctl.parent)
    if args.foreground:
        try:
            setup_logging(args.debug, args.log)
        except OSError as exc:
            raise UsageError(f"cannot open log file {args.log}: {exc.strerror}") from None
        return mount.run(opts)
    return _daemonize(opts, args)


def check_no_daemon(mountpoint: str) -> None:
    """Refuse to mount where the daemon of an earlier mount still runs.

    After an interrupted ``memfs umount`` the daemon writes back what it holds
    to its backing directory, pid file and control socket still in use; a
    second daemon would take them over and ``memfs umount`` could no longer
    wait for the first.
    """
    client = draining_daemon(mountpoint)
    if client is None:
        return
    try:
        client.call("status", timeout=5.0)
        doing = "is still writing back to its backing directory"
    except (ControlError, UsageError):
        doing = "is still running"  # no backing directory: exiting
    finally:
        client.close()
    pid = daemon_pid(mountpoint)
    raise UsageError(f"a memfs daemon{f' (pid {pid})' if pid else ''} for {mountpoint} {doing}; "
                     f"wait with `memfs umount {mountpoint}`")


def make_control_dir(path: Path) -> None:
    """The directory for a new daemon's control socket.

    Root's (:data:`ROOT_CONTROL_DIR`) is mode 0755 and holds sockets only, so
    that the owner of a mount root can reach its daemon, which checks who
    connects; anyone else's is their private runtime directory (0700).
    """
    mode = 0o755 if path == ROOT_CONTROL_DIR else 0o700
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{path} is not a directory")
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode and \
                path == ROOT_CONTROL_DIR:
            os.chmod(path, mode)
    except OSError as exc:
        raise UsageError(f"cannot create {path}: {exc.strerror}") from None


def _daemonize(opts: object, args: argparse.Namespace) -> int:
    """Fork the daemon; return when it reports the mount ready (or failed)."""
    from memfs import mount

    assert isinstance(opts, mount.MountOptions)
    log_file = Path(args.log) if args.log else default_log_file(opts.mountpoint)
    try:
        # The pid file's directory too: with --log it may not exist yet (/run after boot).
        pid_file(opts.mountpoint).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        log_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Opened here, not in the daemon: a bad --log is a one-line user error.
        logfd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as exc:
        raise UsageError(f"cannot open log file {log_file}: {exc.strerror}") from None
    log_start = os.fstat(logfd).st_size
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(rfd)
        status = 1
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(logfd, 1)
            os.dup2(logfd, 2)
            os.close(devnull)
            os.close(logfd)
            os.chdir("/")  # a daemon must not keep the caller's directory (and its filesystem) busy
            setup_logging(args.debug)
            pidf = pid_file(opts.mountpoint)
            pidf.write_text(f"{os.getpid()}\n")

            def ready() -> None:
                os.write(wfd, b"OK\n")
                os.close(wfd)

            try:
                status = mount.run(opts, ready)
            finally:
                if _read_pid(pidf) == os.getpid():  # not a later daemon's
                    pidf.unlink(missing_ok=True)
        except UsageError as exc:
            _report(wfd, str(exc))
            status = EXIT_USAGE
        except BaseException as exc:  # noqa: B036 - the parent must hear of any failure
            logging.getLogger(__name__).exception("daemon failed")
            _report(wfd, f"{type(exc).__name__}: {exc}")
        finally:
            os._exit(status)
    os.close(wfd)
    os.close(logfd)
    chunks = []
    deadline = time.monotonic() + READY_TIMEOUT
    with os.fdopen(rfd, "rb", buffering=0) as r:
        # Until the daemon says OK/ERR and closes its end, or dies.
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([r], [], [], left)[0]:
                continue
            b = r.read(4096)
            if not b:
                break
            chunks.append(b)
        else:
            print(f"memfs: error: no answer from the daemon in {READY_TIMEOUT:.0f}s "
                  f"(pid {pid}, log: {log_file})", file=sys.stderr)
            return 1
    msg = b"".join(chunks).decode(errors="replace").strip()
    if msg == "OK":
        if os.getuid() != 0:
            # The kernel starts the root inode as uid 0 and chmod/chown check that
            # cached owner without asking the daemon: one GETATTR makes it the user's.
            try:
                os.stat(opts.mountpoint)
            except OSError:
                pass
        return 0
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    reason = msg.removeprefix("ERR ") or f"daemon exited with status {code}"
    said = _libfuse_says(log_file, log_start)
    if said:
        reason = f"{reason}: {said}"
    print(f"memfs: error: {reason} (log: {log_file})", file=sys.stderr)
    return code if code > 0 else 1


def _libfuse_says(log_file: Path, start: int) -> str:
    """The reason libfuse or fusermount3 gave for a failed mount.

    They print it on the daemon's stderr, which is the log; without it the
    user only hears "fuse_session_mount failed".
    """
    try:
        with open(log_file, "rb") as f:
            f.seek(start)
            text = f.read(1 << 16).decode(errors="replace")
    except OSError:
        return ""
    return "; ".join(
        line.strip() for line in text.splitlines() if line.startswith(("fuse:", "fusermount"))
    )


def _report(wfd: int, message: str) -> None:
    try:
        os.write(wfd, f"ERR {message}\n".encode())
    except OSError:
        pass


def cmd_memd(args: argparse.Namespace) -> int:
    from memfs import wire
    from memfs.transport import memd  # trio is only needed here

    host, port = parse_hostport(args.listen, "--listen")
    try:
        volumes = int(args.volumes)
    except ValueError:
        raise UsageError(f"bad --volumes {args.volumes!r}: expected a whole number") from None
    if not 1 <= volumes <= 1024:
        raise UsageError(f"--volumes must be between 1 and 1024, not {volumes}")
    size = parse_size(args.size, "--size")
    secret = wire.load_secret(args.secret_file) if args.secret_file else b""
    setup_logging(args.debug)
    metrics = parse_hostport(args.metrics, "--metrics") if args.metrics else None
    return memd.run(volumes, size, host, port, secret, rdma_device=args.rdma_device,
                    metrics=metrics)


def cmd_mds(args: argparse.Namespace) -> int:
    from memfs import mds, wire  # trio is only needed here
    from memfs.config import parse_pool_spec

    host, port = parse_hostport(args.listen, "--listen")
    opts = mds.MdsOptions(
        host=host, port=port, pool=parse_pool_spec(args.pool),
        secret=wire.load_secret(args.secret_file) if args.secret_file else b"",
        chunk_size=parse_size(args.chunk_size, "--chunk-size"),
        stripe_size=parse_size(args.stripe_size, "--stripe-size"),
        volume_size=parse_size(args.volume_size, "--volume-size") if args.volume_size else None,
        journal_dir=args.journal,
        grace=args.grace,
    )
    if not 0 <= opts.grace < float("inf"):
        raise UsageError(f"bad --grace {args.grace}: expected seconds, 0 or more")
    if not 0 <= args.lease_term <= 3600:
        raise UsageError(f"bad --lease-term {args.lease_term}: expected seconds, 0 to 3600")
    if not 0 < args.recall_timeout <= 600:
        raise UsageError(f"bad --recall-timeout {args.recall_timeout}: expected seconds, above 0")
    opts.lease_term, opts.recall_timeout = args.lease_term, args.recall_timeout
    opts.metrics = parse_hostport(args.metrics, "--metrics") if args.metrics else None
    opts.flush = flush_from_args(
        args, opts.volume_size * len(opts.pool) if opts.volume_size is not None else None
    )
    setup_logging(args.debug)
    try:
        return mds.run(opts)
    except mds.StartupError as exc:
        print(f"memfs: error: {exc}", file=sys.stderr)
        return 1


# -- burst buffer: talking to a mount daemon -------------------------------------------


def format_bytes(n: float) -> str:
    """``1.2 GiB``, ``512 B``: for people, not exact."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{int(n)} B"


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


def _unique(paths: list[str]) -> list[str]:
    return list(dict.fromkeys(paths))


def _client(mnt: str, timeout: float = CONTROL_TIMEOUT) -> ControlClient:
    """A client connected to the daemon of *mnt* (see :func:`control_sockets`)."""
    from memfs.control import ControlClient  # imports trio: only when needed

    errors: list[tuple[bool, UsageError]] = []
    for path in control_sockets(mnt):
        client = ControlClient(path, mnt, timeout=timeout)
        try:
            client.connect()
        except UsageError as exc:
            errors.append((os.path.lexists(path), exc))
            continue
        return client
    # Say why the socket that exists failed, rather than that another one is missing.
    raise next((e for there, e in errors if there), errors[0][1])


def draining_daemon(mnt: str) -> ControlClient | None:
    """A client connected to a daemon of *mnt* that still runs, or None.

    For a *mnt* that is not mounted: its daemon is then still writing back
    (``memfs umount`` was interrupted) or about to exit.
    """
    try:
        return _client(mnt, timeout=CONTROL_TIMEOUT)
    except UsageError:
        return None


def _call(client: ControlClient, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    try:
        result: dict[str, Any] = client.call(op, args)
    except ControlError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise UsageError(f"{client.name}: {exc.message}") from None
        raise
    return result


def _ticket(reply: dict[str, Any]) -> int:
    ticket = reply.get("ticket")
    if not isinstance(ticket, int):
        raise ControlError(errno.EPROTO, f"the daemon sent no ticket: {reply!r:.200}")
    return ticket


class ProgressLine:
    """One line on stderr redrawn in place (a terminal only; otherwise nothing)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.shown = False

    def update(self, text: str) -> None:
        if self.enabled:
            width = max(shutil.get_terminal_size().columns - 1, 20)
            sys.stderr.write(f"\r{text[:width]}\x1b[K")
            sys.stderr.flush()
            self.shown = True

    def note(self, text: str) -> None:
        """A line that stays (above the progress line)."""
        if self.enabled:
            sys.stderr.write(f"\r\x1b[K{text}\n")
            sys.stderr.flush()
            self.shown = False

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_text(verb: str, p: dict[str, Any], elapsed: float) -> str:
    """``flushing: 12/340 files, 1.2 GiB/4.0 GiB left, 350.0 MiB/s``."""
    files, total_files = int(p.get("files", 0)), int(p.get("total_files", 0))
    left, total = int(p.get("bytes", 0)), int(p.get("total_bytes", 0))
    text = (f"{verb}: {max(total_files - files, 0)}/{total_files} files, "
            f"{format_bytes(left)}/{format_bytes(total)} left")
    if elapsed >= 1 and total > left:
        text += f", {format_bytes((total - left) / elapsed)}/s"
    return text


def _error_note(what: str, err: dict[str, Any]) -> str:
    return f"memfs: {what} {err.get('path') or '/'}: {err.get('error')} (retrying)"


def path_batches(paths: list[str]) -> list[list[str]]:
    """*paths* cut into requests that fit the daemon's line limit (one empty batch: all)."""
    batches: list[list[str]] = []
    current: list[str] = []
    size = 0
    for p in paths:
        n = len(json.dumps(p)) + 2
        if current and size + n > REQUEST_BUDGET:
            batches.append(current)
            current, size = [], 0
        current.append(p)
        size += n
    return [*batches, current]


def start_tickets(client: ControlClient, op: str, paths: list[str]) -> list[int]:
    """Send *op* for *paths* (in as many requests as needed): the tickets."""
    tickets = []
    for batch in path_batches(paths):
        try:
            tickets.append(_ticket(_call(client, op, {"paths": batch})))
        except ControlError as exc:
            if exc.errno == errno.ENOENT:  # a name (from a manifest) not in the mount
                raise UsageError(f"in {client.name}: {exc.message}") from None
            raise
    return tickets


def wait_tickets(client: ControlClient, tickets: list[int], verb: str, what: str,
                 show: bool) -> list[dict[str, Any]]:
    """Poll "progress" until every ticket is done; a progress line (and the
    latest error, once) on the terminal when *show*.  The tickets' last progress."""
    start = time.monotonic()
    finished: dict[int, dict[str, Any]] = {}
    shown: tuple[Any, ...] | None = None
    with ProgressLine(show) as line:
        while True:
            total = {"files": 0, "bytes": 0, "total_files": 0, "total_bytes": 0}
            errors: list[dict[str, Any]] = []
            for t in tickets:
                p = finished.get(t) or _call(client, "progress", {"ticket": t})
                if p.get("done"):
                    finished[t] = p
                for field in total:
                    value = p.get(field, 0)
                    total[field] += value if isinstance(value, int) else 0
                errors += [e for e in p.get("errors") or [] if isinstance(e, dict)]
            if errors:
                latest = max(errors, key=lambda e: e.get("last") or 0)
                key = tuple(latest.get(k) for k in ("path", "error", "last"))
                if key != shown:
                    line.note(_error_note(what, latest))
                    shown = key
            if len(finished) == len(tickets):
                return [finished[t] for t in tickets]
            line.update(progress_text(verb, total, time.monotonic() - start))
            time.sleep(POLL_INTERVAL)


def _isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def cmd_flush(args: argparse.Namespace) -> int:
    mnt = memfs_mountpoint(args.mountpoint, draining=True)
    paths = _unique([user_path(mnt, p) for p in args.paths])
    with _client(mnt) as client:
        tickets = start_tickets(client, "flush", paths)
        if args.wait:
            wait_tickets(client, tickets, "flushing", "write-back of",
                         show=_isatty() and not args.quiet)
    return 0


#: ``memfs stage-in`` names at most this many files that failed, then counts the rest
FAILED_SHOWN = 10


def cmd_stage_in(args: argparse.Namespace) -> int:
    mnt = memfs_mountpoint(args.mountpoint)
    paths = [user_path(mnt, p) for p in args.paths]
    if args.manifest is not None:
        named = read_manifest(args.manifest, mnt)
        if not named and not paths:
            return 0  # an empty manifest names nothing (not "everything")
        paths += named
    with _client(mnt) as client:
        tickets = start_tickets(client, "stage_in", _unique(paths))
        if args.no_wait:
            progress = [_call(client, "progress", {"ticket": t}) for t in tickets]
            files, nbytes = _sum(progress, "total_files"), _sum(progress, "total_bytes")
            if files:
                print(f"staging in {files} files ({format_bytes(nbytes)}) in the background; "
                      f"`memfs status {mnt}` shows what is left")
            else:
                print("nothing to stage in: all of it is in memory already")
        else:
            progress = wait_tickets(client, tickets, "staging in", "stage-in of", show=_isatty())
        _warn_capacity(client, _sum(progress, "total_bytes"))
    failed: dict[str, str] = {}
    for p in progress:
        for f in p.get("failed") or []:
            if isinstance(f, dict) and isinstance(f.get("path"), str):
                failed.setdefault(f["path"], str(f.get("error")))
    if not failed:
        return 0
    for path, error in list(failed.items())[:FAILED_SHOWN]:
        print(f"memfs: error: stage-in of {os.path.join(mnt, path) if path else mnt}: {error}",
              file=sys.stderr)
    if len(failed) > FAILED_SHOWN:
        print(f"memfs: error: ... and {len(failed) - FAILED_SHOWN} more", file=sys.stderr)
    return EXIT_FAILED


def _sum(progress: list[dict[str, Any]], key: str) -> int:
    return sum(v for p in progress if isinstance(v := p.get(key, 0), int))


def _warn_capacity(client: ControlClient, staged: int) -> None:
    """Staging in more than the pool holds evicts the first part again."""
    try:
        capacity = client.call("status").get("capacity")
    except ControlError:
        return
    if isinstance(capacity, int) and 0 < capacity < staged:
        print(f"memfs: warning: staged {math.ceil(staged / (1 << 20))} MiB into a pool of "
              f"{capacity >> 20} MiB: only the most recently staged part stays in memory",
              file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    mnt = memfs_mountpoint(args.mountpoint, draining=True)
    with _client(mnt) as client:
        status = _call(client, "status")
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(format_status(mnt, status))
    return 0


def format_status(mnt: str, st: dict[str, Any]) -> str:
    """The "status" dict for people."""
    def n(key: str) -> int:
        value = st.get(key, 0)
        return int(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0

    capacity, used = n("capacity"), n("used")
    pct = f" ({100 * used / capacity:.0f}%)" if capacity else ""
    rate = st.get("flush_rate", 0.0)
    rate = float(rate) if isinstance(rate, (int, float)) and math.isfinite(rate) else 0.0
    lines = [
        f"mount:      {mnt}" + ("  (draining: writing everything back before exit)"
                                if st.get("draining") else ""),
        f"backing:    {st.get('backing', '?')}",
        f"pool:       {format_bytes(used)} used of {format_bytes(capacity)}{pct}",
        f"dirty:      {format_bytes(n('dirty_bytes'))} in {n('dirty_files')} files "
        f"(cap {format_bytes(n('dirty_max'))}); {format_bytes(n('pinned_bytes'))} pinned "
        "(excluded from write-back)",
        f"write-back: {n('queued_files')} files queued, {n('flushing_files')} in flight, "
        f"{n('namespace_ops')} namespace changes pending; {format_bytes(rate)}/s",
        f"            {format_bytes(n('flushed_bytes'))} in {n('flushed_files')} files since "
        f"mount (delay {st.get('flush_delay', '?')} s, {st.get('workers', '?')} workers)",
        f"files:      {n('resident_files')} in memory, {n('evicted_files')} only in the backing "
        f"directory ({format_bytes(n('evicted_bytes_total'))} evicted, "
        f"{format_bytes(n('fetched_bytes'))} fetched since mount)",
        "stage-in:   " + (f"{n('staging_files')} files, {format_bytes(n('staging_bytes'))} to go"
                           if n("staging_files") or n("staging_bytes") else "idle"),
        f"writers waiting on the dirty cap: {n('writers_waiting')}",
    ]
    errors = [e for e in st.get("errors") or [] if isinstance(e, dict)]
    if errors:
        lines.append(f"errors ({len(errors)}, newest last):")
        for e in errors:
            last = e.get("last")
            when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last))
                    if isinstance(last, (int, float)) and math.isfinite(last) else "?")
            count = e.get("count", 1)
            times = f" (x{count})" if isinstance(count, int) and count > 1 else ""
            lines.append(f"  {when}  {e.get('path') or '/'}: {e.get('error')}{times}")
    else:
        lines.append("errors:     none")
    return "\n".join(lines)


def cmd_stage_out(args: argparse.Namespace) -> int:
    src = canonical(args.path)
    mnt = memfs_mount_of(src)
    if mnt is None:
        raise UsageError(f"{args.path} is not inside a memfs mount")
    if not os.path.lexists(src):
        raise UsageError(f"{args.path} does not exist")
    if os.path.islink(src):
        raise UsageError(f"{args.path} is a symbolic link: name what it points to")
    if src == mnt:
        raise UsageError(f"{args.path} is the root of the memfs mount: stage-out would exclude "
                         "the whole filesystem from write-back; name a directory in it")
    archive = canonical(args.archive)
    if within(archive, mnt):
        raise UsageError(f"archive {args.archive} is inside the memfs mount {mnt} "
                         "(it belongs in the backing filesystem)")
    if within(archive, src):
        raise UsageError(f"archive {args.archive} is inside {args.path}")
    if not os.path.isdir(os.path.dirname(archive)):
        raise UsageError(f"directory {os.path.dirname(archive)} for the archive does not exist")
    if os.path.isdir(archive):
        raise UsageError(f"archive {args.archive} is a directory")
    try:
        was_excluded = os.getxattr(src, FLUSH_XATTR) == b"off"
    except OSError:
        was_excluded = False
    try:  # first, so the tree is not also written back file by file meanwhile
        os.setxattr(src, FLUSH_XATTR, b"off")
    except OSError as exc:
        raise OperationFailed(f"cannot exclude {args.path} from write-back "
                              f"({FLUSH_XATTR}): {exc.strerror}") from None
    show = _isatty()
    try:
        with ProgressLine(show) as line:
            write_archive(src, archive, line.update if show else None)
    except BaseException:
        # No archive: the tree must not stay excluded, or nothing would keep it.
        if not was_excluded:
            with contextlib.suppress(OSError):
                os.removexattr(src, FLUSH_XATTR)
        raise
    return 0


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
        if progress is not None and (force or now - last_shown >= POLL_INTERVAL):
            last_shown = now
            progress(progress_text("stage-out", {
                "files": total_files - done_files, "total_files": total_files,
                "bytes": max(total_bytes - done_bytes, 0), "total_bytes": total_bytes,
            }, now - start))

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


def _say(line: ProgressLine, text: str) -> None:
    """A message for stderr, terminal or not."""
    if line.enabled:
        line.note(text)
    else:
        print(text, file=sys.stderr, flush=True)


def _drain_left(st: dict[str, Any]) -> bool:
    return any(isinstance(st.get(k), int) and st[k] > 0
               for k in ("dirty_files", "dirty_bytes", "flushing_files", "namespace_ops"))


def wait_for_daemon(mnt: str, pid: int | None, client: ControlClient | None) -> None:
    """Until the daemon of the unmounted *mnt* has exited.

    A daemon with a backing directory writes everything back first, which can
    take long: while its control socket answers (*client*, or None) it is
    never given up on, and if it is still writing back after
    :data:`DRAIN_NOTICE_AFTER` seconds the user is told what it is doing (and,
    on a terminal, each new write-back error: why it takes so long).
    """
    start = time.monotonic()
    # Errors older than this are history, not the reason for this drain to take long.
    errors_since = time.time() - RECENT_ERROR
    next_poll = start
    announced = False
    shown: tuple[Any, ...] | None = None
    with ProgressLine(_isatty()) as line:
        while True:
            if pid is not None and not alive(pid):
                return
            if client is not None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + POLL_INTERVAL
                try:
                    st = client.call("status", timeout=5.0)
                except (ControlError, UsageError):
                    client.close()
                    client = None  # gone, or nothing to say (no backing directory)
                else:
                    if not announced and time.monotonic() - start >= DRAIN_NOTICE_AFTER \
                            and _drain_left(st):
                        _say(line, f"memfs: writing back "
                                   f"{math.ceil(st.get('dirty_bytes', 0) / (1 << 20))} MiB "
                                   f"({st.get('dirty_files', 0)} files) to "
                                   f"{st.get('backing', 'the backing directory')} before exit...")
                        announced = True
                    if announced:
                        latest = _latest_error(st.get("errors"), errors_since)
                        if latest is not None:
                            key = tuple(latest.get(k) for k in ("path", "error", "last"))
                            if key != shown:
                                line.note(_error_note("write-back of", latest))
                                shown = key
                        line.update(f"writing back: {st.get('dirty_files', 0)} files, "
                                    f"{format_bytes(st.get('dirty_bytes', 0))} left, "
                                    f"{format_bytes(st.get('flush_rate', 0.0))}/s")
            if client is None and pid is None:
                return
            time.sleep(0.05)


def _latest_error(errors: Any, since: float) -> dict[str, Any] | None:
    """The newest entry of a status "errors" list, if it happened after *since*."""
    if not isinstance(errors, list):
        return None
    dated = [e for e in errors if isinstance(e, dict) and isinstance(e.get("last"), (int, float))]
    if not dated:
        return None
    latest = max(dated, key=lambda e: e["last"])
    return latest if latest["last"] >= since else None


def _warn_pinned(client: ControlClient) -> None:
    """Say what an unmount loses: data excluded from write-back (stage-out trees)."""
    try:
        st = client.call("status", timeout=5.0)
    except (ControlError, UsageError):
        return  # no backing directory, or no answer: nothing to say
    files, nbytes = st.get("pinned_files"), st.get("pinned_bytes")
    files = files if isinstance(files, int) else 0
    nbytes = nbytes if isinstance(nbytes, int) else 0
    if files > 0 or nbytes > 0:
        print(f"memfs: {files} files ({math.ceil(nbytes / (1 << 20))} MiB) under "
              f"{FLUSH_XATTR}=off trees (stage-out) are not written back and are lost "
              "with the mount", file=sys.stderr, flush=True)


def cmd_umount(args: argparse.Namespace) -> int:
    path = canonical(args.mountpoint)
    if not is_mounted(path) and os.path.islink(path):
        path = os.path.realpath(path)  # a symlink to the mountpoint, as umount(8) takes it
    if not is_mounted(path):
        # Unmounted by an interrupted `memfs umount` (or fusermount3 -u): its daemon
        # may still be writing back; wait for it as if this had unmounted it.
        drain = draining_daemon(path)
        if drain is None:
            raise UsageError(f"{args.mountpoint} is not mounted")
        try:
            wait_for_daemon(path, daemon_pid(path), drain)
        finally:
            drain.close()
        return 0
    fstype = mount_type(path)
    if fstype is not None and fstype != "fuse.memfs":
        # fusermount3 -u run by root unmounts anything: never another filesystem.
        raise UsageError(f"{args.mountpoint} is a {fstype} mount, not memfs")
    pidf = pid_file(path)
    recorded = _read_pid(pidf)
    # A daemon killed by SIGKILL or the OOM killer leaves its pid file behind, and
    # the pid may belong to another process by now: wait only for a memfs daemon.
    pid = recorded if recorded is not None and _is_memfs(recorded) else None
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise UsageError("fusermount3 not found (apt-get install fuse3)")
    cmd = [tool, "-u"] + (["-z"] if args.lazy else []) + [path]
    # Connected before the unmount: the daemon may have much to write back after it.
    client: ControlClient | None = None
    try:
        client = _client(path, timeout=2.0)
    except UsageError:
        client = None
    try:
        if client is not None and mount_source(path) == "memfs":
            # Embedded pool: what is pinned dies with this daemon (in cluster
            # mode it stays in the shared pool).
            _warn_pinned(client)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise UsageError(res.stderr.strip() or f"{' '.join(cmd)} failed")
        wait_for_daemon(path, pid, client)
    finally:
        if client is not None:
            client.close()
    if recorded is not None and _read_pid(pidf) == recorded:
        pidf.unlink(missing_ok=True)  # the daemon was killed before it could remove it
    return 0


def _read_pid(pidf: Path) -> int | None:
    try:
        return int(pidf.read_text())
    except (OSError, ValueError):
        return None


def daemon_pid(mnt: str) -> int | None:
    """The pid of the running daemon of *mnt*, from its pid file, or None."""
    recorded = _read_pid(pid_file(mnt))
    # A daemon killed by SIGKILL or the OOM killer leaves its pid file behind, and
    # the pid may belong to another process by now: only a memfs process counts.
    return recorded if recorded is not None and alive(recorded) and _is_memfs(recorded) else None


def _is_memfs(pid: int) -> bool:
    """True unless /proc shows that *pid* is gone or is not a memfs process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"memfs" in f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True


def alive(pid: int) -> bool:
    """True while *pid* runs (all its threads: its /dev/fuse is open until then)."""
    return process_alive(pid)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {
        "mount": cmd_mount, "umount": cmd_umount, "memd": cmd_memd, "mds": cmd_mds,
        "flush": cmd_flush, "status": cmd_status, "stage-in": cmd_stage_in,
        "stage-out": cmd_stage_out,
    }
    try:
        return commands[args.command](args)
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


if __name__ == "__main__":
    sys.exit(main())
