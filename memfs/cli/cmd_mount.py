"""``memfs mount``: check the mountpoint, fork the daemon, return once it is mounted.

The daemon (:mod:`memfs.mount`, which imports pyfuse3 and trio) is imported
only here, inside the command.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import sys
import time
from pathlib import Path

from memfs.cli.client import draining_daemon
from memfs.cli.common import EXIT_USAGE, setup_logging, within
from memfs.cli.mounts import is_mounted
from memfs.cli.parser import flush_from_args, pool_from_args, split_o
from memfs.cli.runtime import (
    control_socket,
    daemon_pid,
    default_log_file,
    make_control_dir,
    pid_file,
    read_pid,
)
from memfs.config import parse_hostport, parse_size
from memfs.errors import ControlError, UsageError

#: seconds the daemon has to say that the filesystem is mounted
READY_TIMEOUT = 120.0


#: seconds the kernel may cache attributes and names (present and absent) when it is
#: the only way in: an embedded pool without a backing directory
SOLE_KERNEL_TIMEOUT = 86400.0


def default_attr_timeout(args: argparse.Namespace) -> float:
    """How long the kernel may cache attributes and names, unless --attr-timeout says.

    Cluster: 0 (the metadata server's leases decide).  Embedded, every change goes
    through this kernel, which updates or drops what it caches itself (a write's
    size and times, a read's atime, the names it creates and removes): a day.
    With --backing the daemon changes what a stat shows on its own (eviction and
    fetches change a file's blocks): 1 s, as before.
    """
    if args.mds:
        return 0.0
    return 1.0 if args.backing is not None else SOLE_KERNEL_TIMEOUT


def run(args: argparse.Namespace) -> int:
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
        args.attr_timeout = default_attr_timeout(args)
    if not 0 <= args.attr_timeout < float("inf"):  # also refuses nan
        raise UsageError(f"bad --attr-timeout {args.attr_timeout}: expected seconds, 0 or more")
    if args.secret_file and not args.mds:
        raise UsageError("--secret-file goes with --mds (an embedded pool has no network)")
    options = split_o(args.options)
    if "direct_io" in options and "writeback_cache" in options:
        raise UsageError("-o direct_io and -o writeback_cache exclude each other: with "
                         "direct_io no file data is cached to write back")
    if args.mds and "writeback_cache" in options:
        # The kernel then trusts no size the daemon gives for a regular file: it would
        # never see another node's file grow (nor append after another node's lines).
        raise UsageError("-o writeback_cache goes with an embedded pool: with it the "
                         "kernel keeps its own file sizes, and would not see other "
                         "nodes' writes")
    if "passthrough" in options:
        check_passthrough(args, options)
    opts = mount.MountOptions(
        mountpoint=mountpoint,
        pool=pool_from_args(args),
        fuse_options=options,
        writeback_cache="writeback_cache" in options,
        direct_io="direct_io" in options,
        passthrough="passthrough" in options,
        local_locks="localflock" in options,
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
    return daemonize(opts, args)


def check_passthrough(args: argparse.Namespace, options: list[str]) -> None:
    """``-o passthrough`` (memfs.passthrough): what it cannot go with, said before mounting."""
    if args.mds:
        raise UsageError("-o passthrough goes with an embedded pool: a cluster mount's files "
                         "live on the memory servers, which the kernel cannot read itself")
    if args.backing is not None:
        raise UsageError("-o passthrough does not go with --backing (write-back reads files "
                         "from pool volumes)")
    for other in ("writeback_cache", "direct_io"):
        if other in options:
            raise UsageError(f"-o passthrough and -o {other} exclude each other (the kernel "
                             "reads and writes the backing files itself, through their own "
                             "page cache)")
    if os.geteuid() != 0:
        raise UsageError("-o passthrough needs root: the kernel takes backing files only "
                         "from a process with CAP_SYS_ADMIN")


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


def check_overlap(backing: str, mountpoint: str) -> None:
    """Refuse write-back into the mount itself: a flush worker would wait on its own daemon."""
    if within(backing, mountpoint):
        raise UsageError(f"backing directory {backing} is inside the mountpoint {mountpoint} "
                         "(writing back into the mount itself would deadlock)")
    if within(mountpoint, backing):
        raise UsageError(f"mountpoint {mountpoint} is inside the backing directory {backing} "
                         "(writing back into the mount itself would deadlock)")


def daemonize(opts: object, args: argparse.Namespace) -> int:
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
                if read_pid(pidf) == os.getpid():  # not a later daemon's
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
