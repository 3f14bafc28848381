"""The ``memfs`` command and the ``mount.fuse.memfs`` helper.

User errors print one line (``memfs: error: ...``) and exit 2 without a
traceback.  ``memfs mount`` returns once the filesystem is mounted and ready;
the daemon it forks keeps serving until ``umount``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from memfs import __version__
from memfs.config import PoolConfig, parse_hostport, parse_size
from memfs.errors import UsageError

log = logging.getLogger(__name__)

EXIT_USAGE = 2
READY_TIMEOUT = 120.0


def runtime_dir() -> Path:
    """Where daemons keep their pid and log files."""
    if os.geteuid() == 0:
        return Path("/run/memfs")
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memfs", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"memfs {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
                   help="seconds the kernel may cache attributes and names "
                        "(default 1; 0 with --mds, so other nodes' changes show at once)")
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
    ms.add_argument("--debug", "-d", action="store_true", help="log at debug level")
    return p


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

    mountpoint = check_mountpoint(args.mountpoint)
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
    if args.foreground:
        try:
            setup_logging(args.debug, args.log)
        except OSError as exc:
            raise UsageError(f"cannot open log file {args.log}: {exc.strerror}") from None
        return mount.run(opts)
    return _daemonize(opts, args)


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
    return memd.run(volumes, size, host, port, secret, rdma_device=args.rdma_device)


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
    setup_logging(args.debug)
    try:
        return mds.run(opts)
    except mds.StartupError as exc:
        print(f"memfs: error: {exc}", file=sys.stderr)
        return 1


def cmd_umount(args: argparse.Namespace) -> int:
    path = canonical(args.mountpoint)
    if not is_mounted(path) and os.path.islink(path):
        path = os.path.realpath(path)  # a symlink to the mountpoint, as umount(8) takes it
    if not is_mounted(path):
        raise UsageError(f"{args.mountpoint} is not mounted")
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
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise UsageError(res.stderr.strip() or f"{' '.join(cmd)} failed")
    while pid is not None and alive(pid):
        time.sleep(0.05)
    if recorded is not None and _read_pid(pidf) == recorded:
        pidf.unlink(missing_ok=True)  # the daemon was killed before it could remove it
    return 0


def _read_pid(pidf: Path) -> int | None:
    try:
        return int(pidf.read_text())
    except (OSError, ValueError):
        return None


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
    """True while *pid* runs.

    An exited daemon stays a zombie until its parent (init, or a subreaper such
    as a container's PID 1 or systemd) reaps it, which may be late or never:
    kill(pid, 0) still succeeds then, so ask /proc for the state.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) S ...": comm may hold spaces and parentheses.
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass  # no procfs: fall back to signalling it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mount":
            return cmd_mount(args)
        if args.command == "umount":
            return cmd_umount(args)
        if args.command == "memd":
            return cmd_memd(args)
        if args.command == "mds":
            return cmd_mds(args)
    except UsageError as exc:
        print(f"memfs: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    raise AssertionError(args.command)


def mount_helper(argv: Sequence[str] | None = None) -> int:
    """``mount.fuse.memfs SOURCE MOUNTPOINT [-o opts]``, as called by mount(8).

    SOURCE ``HOST:PORT`` mounts from that metadata server (``--mds``); any
    other SOURCE (e.g. ``memfs``) mounts an embedded pool.  Options of the form
    ``size=4G``, ``volumes=4``, ``stripe_size=1M``, ``chunk_size=64K``,
    ``secret_file=F`` become memfs arguments; the rest are FUSE options.
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
             "readahead": "--readahead", "secret_file": "--secret-file"}
    for o in opts:
        key, sep, value = o.partition("=")
        if sep and key in named:
            args += [named[key], value]
        elif o == "debug":
            args.append("--debug")
        else:
            fuse.append(o)
    if fuse:
        args += ["-o", ",".join(fuse)]
    return main(args)


if __name__ == "__main__":
    sys.exit(main())
