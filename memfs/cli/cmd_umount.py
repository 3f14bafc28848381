"""``memfs umount MNT``: unmount, then wait for the daemon to write back and exit.

A daemon with a backing directory writes everything back after the unmount;
``memfs umount`` returns only when it is gone, saying what it waits for.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from memfs.backing.status import BackingError, BackingStatus
from memfs.cli.client import connect, draining_daemon
from memfs.cli.common import FLUSH_XATTR, canonical, format_bytes
from memfs.cli.mounts import MEMFS_TYPE, is_mounted, mount_source, mount_type
from memfs.cli.progress import ProgressLine, error_note, stderr_is_terminal
from memfs.cli.runtime import alive, daemon_pid, is_memfs, pid_file, read_pid
from memfs.errors import ControlError, UsageError

if TYPE_CHECKING:
    from memfs.control import ControlClient

#: ``memfs umount`` says what the daemon is writing back if it takes longer than this
DRAIN_NOTICE_AFTER = 2.0
#: ``memfs umount`` shows write-back errors of the last this many seconds (a failing
#: write-back is retried at least every 30 s)
RECENT_ERROR = 60.0
#: how often the status of a draining daemon is asked for
POLL_INTERVAL = 0.2


def run(args: argparse.Namespace) -> int:
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
    if fstype is not None and fstype != MEMFS_TYPE:
        # fusermount3 -u run by root unmounts anything: never another filesystem.
        raise UsageError(f"{args.mountpoint} is a {fstype} mount, not memfs")
    pidf = pid_file(path)
    recorded = read_pid(pidf)
    # A daemon killed by SIGKILL or the OOM killer leaves its pid file behind, and
    # the pid may belong to another process by now: wait only for a memfs daemon.
    pid = recorded if recorded is not None and is_memfs(recorded) else None
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise UsageError("fusermount3 not found (apt-get install fuse3)")
    cmd = [tool, "-u"] + (["-z"] if args.lazy else []) + [path]
    # Connected before the unmount: the daemon may have much to write back after it.
    client: ControlClient | None = None
    try:
        client = connect(path, timeout=2.0)
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
    if recorded is not None and read_pid(pidf) == recorded:
        pidf.unlink(missing_ok=True)  # the daemon was killed before it could remove it
    return 0


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
    shown: tuple[str, str, float] | None = None
    with ProgressLine(stderr_is_terminal()) as line:
        while True:
            if pid is not None and not alive(pid):
                return
            if client is not None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + POLL_INTERVAL
                try:
                    st = BackingStatus.from_json(client.call("status", timeout=5.0))
                except (ControlError, UsageError):
                    client.close()
                    client = None  # gone, or nothing to say (no backing directory)
                else:
                    if not announced and time.monotonic() - start >= DRAIN_NOTICE_AFTER \
                            and _drain_left(st):
                        backing = st.backing if st.backing != "?" else "the backing directory"
                        line.say(f"memfs: writing back {math.ceil(st.dirty_bytes / (1 << 20))} MiB "
                                 f"({st.dirty_files} files) to {backing} before exit...")
                        announced = True
                    if announced:
                        latest = _latest_error(st.errors, errors_since)
                        if latest is not None:
                            key = (latest.path, latest.error, latest.last)
                            if key != shown:
                                line.note(error_note("write-back of", latest))
                                shown = key
                        line.update(f"writing back: {st.dirty_files} files, "
                                    f"{format_bytes(st.dirty_bytes)} left, "
                                    f"{format_bytes(st.flush_rate)}/s")
            if client is None and pid is None:
                return
            time.sleep(0.05)


def _drain_left(st: BackingStatus) -> bool:
    return st.dirty_files > 0 or st.dirty_bytes > 0 or st.flushing_files > 0 \
        or st.namespace_ops > 0


def _latest_error(errors: tuple[BackingError, ...], since: float) -> BackingError | None:
    """The newest of a status's errors, if it happened after *since*."""
    latest = max(errors, key=lambda e: e.last, default=None)
    return latest if latest is not None and latest.last >= since else None


def _warn_pinned(client: ControlClient) -> None:
    """Say what an unmount loses: data excluded from write-back (stage-out trees)."""
    try:
        st = BackingStatus.from_json(client.call("status", timeout=5.0))
    except (ControlError, UsageError):
        return  # no backing directory, or no answer: nothing to say
    if st.pinned_files > 0 or st.pinned_bytes > 0:
        print(f"memfs: {st.pinned_files} files ({math.ceil(st.pinned_bytes / (1 << 20))} MiB) "
              f"under {FLUSH_XATTR}=off trees (stage-out) are not written back and are lost "
              "with the mount", file=sys.stderr, flush=True)
