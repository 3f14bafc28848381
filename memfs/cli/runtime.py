"""Where a mount daemon keeps its pid file, log and control socket, and whether it runs.

``memfs mount`` creates them, ``memfs umount`` and the control commands find
the daemon by them; the names derive from the mountpoint (:func:`instance_name`).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from memfs.cli.common import canonical
from memfs.errors import UsageError
from memfs.host import process_alive

#: root's daemons: pid and log files (mode 0700: nobody else's business)
ROOT_RUNTIME_DIR = Path("/run/memfs")
#: root's daemons: control sockets only (mode 0755, sockets 0666), so that the
#: owner of a mount's root directory can reach its daemon; the daemon itself
#: decides who may use it (SO_PEERCRED), see :mod:`memfs.control`
ROOT_CONTROL_DIR = Path("/run/memfs-ctl")
#: longest Unix socket path (sun_path is 108 bytes with its NUL)
SUN_PATH_MAX = 107


def runtime_dir() -> Path:
    """Where daemons keep their pid and log files."""
    if os.geteuid() == 0:
        return ROOT_RUNTIME_DIR
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/memfs-{os.getuid()}"
    return Path(base) / "memfs" if "XDG_RUNTIME_DIR" in os.environ else Path(base)


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


def read_pid(pidf: Path) -> int | None:
    try:
        return int(pidf.read_text())
    except (OSError, ValueError):
        return None


def daemon_pid(mnt: str) -> int | None:
    """The pid of the running daemon of *mnt*, from its pid file, or None."""
    recorded = read_pid(pid_file(mnt))
    # A daemon killed by SIGKILL or the OOM killer leaves its pid file behind, and
    # the pid may belong to another process by now: only a memfs process counts.
    return recorded if recorded is not None and alive(recorded) and is_memfs(recorded) else None


def is_memfs(pid: int) -> bool:
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
