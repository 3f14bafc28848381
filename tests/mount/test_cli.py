"""The ``memfs`` command and the ``mount.fuse.memfs`` helper, run as real processes.

Users meet memfs through these: a mistake must cost them one readable line, not
a traceback; ``memfs mount`` must not return before the mount works; every way
of stopping a daemon (``memfs umount``, ``umount(8)``, SIGTERM) must unmount
and end it with status 0.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from memfs import cli
from memfs.cli import cmd_mount, common, parser, runtime
from memfs.cli.mounts import is_mounted
from memfs.cli.runtime import pid_file
from memfs.config import FlushConfig
from memfs.errors import UsageError
from tests.conftest import MEMFS, MOUNT_SKIP, Mounted, wait_gone

TIMEOUT = 30
F = TypeVar("F", bound=Callable[..., Any])
PR_SET_CHILD_SUBREAPER = 36
NOBODY = 65534


def memfs(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMFS, *args], capture_output=True, text=True, timeout=timeout)


def assert_one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    """The CLI contract for user errors: non-zero, one ``memfs: error:`` line, no traceback."""
    assert res.returncode != 0, res
    assert "Traceback" not in res.stderr, res.stderr
    assert "ExceptionGroup" not in res.stderr, res.stderr  # the error itself, unwrapped
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("memfs: error: "), res.stderr
    assert res.stdout == ""
    return lines[0]


def exit_status(pid: int, timeout: float) -> int | None:
    """Reap our child *pid*; None if it is still running after *timeout*."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None


def force_cleanup(mnt: Path, pid: int | None) -> None:
    """Whatever a failed test left: a live daemon, a mount."""
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        else:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # not ours to reap
    if is_mounted(str(mnt)):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def usable(mnt: Path, size: int) -> None:
    """The mount is memfs (not the directory below it) and stores data."""
    st = os.statvfs(mnt)
    assert st.f_blocks * st.f_frsize == size
    data = os.urandom(100_000)
    (mnt / "probe").write_bytes(data)
    assert (mnt / "probe").read_bytes() == data


def log_is_clean(log: Path) -> None:
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text


def needs_mount(fn: F) -> F:
    """Tests that mount for real: marked, and skipped where mounting cannot work."""
    return pytest.mark.mount(pytest.mark.skipif(MOUNT_SKIP is not None, reason=MOUNT_SKIP or "")(fn))


@pytest.fixture
def mountpoint(tmp_path: Path) -> Iterator[Path]:
    """An empty directory; unmounted afterwards whatever the test did to it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    yield mnt
    if is_mounted(str(mnt)):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        pytest.fail(f"{mnt} was left mounted")


@pytest.fixture
def subreaper() -> Iterator[Callable[[], None]]:
    """Make daemons forked by ``memfs mount`` our children, to see their exit status.

    Call the returned function once the daemon exists: from then on we are an
    ordinary process again (orphans of later tests go to init as usual), but
    the daemon stays our child, and stays a zombie until we reap it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, ctypes.get_errno()
    done = False

    def stop() -> None:
        nonlocal done
        if not done:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
            done = True

    try:
        yield stop
    finally:
        stop()


# -- user errors ---------------------------------------------------------------------


def _avail_gib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) >> 20
    raise AssertionError("no MemAvailable")


BAD_ARGS = {
    "size_unit": (["--size", "4Q"], "--size"),
    "size_negative": (["--size", "-1"], "--size"),
    "size_zero": (["--size", "0"], "--size"),
    "volumes_word": (["--volumes", "four"], "--volumes"),
    "volumes_zero": (["--volumes", "0"], "--volumes"),
    "volumes_huge": (["--volumes", "5000"], "--volumes"),
    "stripe_not_chunk_multiple": (["--stripe-size", "96K"], "--stripe-size"),
    "stripe_smaller_than_chunk": (["--stripe-size", "16K"], "--stripe-size"),
    "chunk_not_power_of_two": (["--chunk-size", "48K"], "--chunk-size"),
    # The kernel would make a negative timeout 0 and a nan anything at all.
    "attr_timeout_negative": (["--attr-timeout", "-1"], "--attr-timeout"),
    "attr_timeout_nan": (["--attr-timeout", "nan"], "--attr-timeout"),
    "attr_timeout_inf": (["--attr-timeout", "inf"], "--attr-timeout"),
    # Opened by the parent, not the daemon: no traceback on the terminal.
    "log_is_a_directory": (["--log", "/"], "log file"),
    "log_unwritable": (["--log", "/proc/no/such.log"], "log file"),
    "log_is_a_directory_foreground": (["--log", "/", "--foreground"], "log file"),
}


@needs_mount
@pytest.mark.parametrize("args, mentions", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_bad_arguments(mountpoint: Path, args: list[str], mentions: str) -> None:
    line = assert_one_error_line(memfs("mount", str(mountpoint), *args))
    assert mentions in line
    assert not is_mounted(str(mountpoint))


@needs_mount
@pytest.mark.parametrize("foreground", [False, True], ids=["background", "foreground"])
def test_size_beyond_memory(mountpoint: Path, foreground: bool) -> None:
    """Refused before any memory is allocated or a daemon forked."""
    size = f"{2 * _avail_gib() + 1}G"
    line = assert_one_error_line(
        memfs("mount", str(mountpoint), "--size", size, *(["-f"] if foreground else []))
    )
    assert "exceeds the memory available" in line
    assert not is_mounted(str(mountpoint))


def test_mountpoint_missing(tmp_path: Path) -> None:
    line = assert_one_error_line(memfs("mount", str(tmp_path / "nope")))
    assert "does not exist" in line


def test_mountpoint_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    line = assert_one_error_line(memfs("mount", str(tmp_path / "file")))
    assert "not a directory" in line


@pytest.mark.mount
def test_already_mounted(memfs_mount: Callable[..., Mounted]) -> None:
    m = memfs_mount("--size", "16M")
    line = assert_one_error_line(memfs("mount", str(m.path), "--size", "16M"))
    assert "already" in line
    usable(m.path, 16 << 20)  # the failed attempt left the first mount alone


def test_dev_fuse_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Removing /dev/fuse for real would break every other mount: fake its absence."""
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p != "/dev/fuse" and real_exists(p))
    with pytest.raises(UsageError, match="modprobe fuse"):
        cmd_mount.check_mountpoint(str(tmp_path))
    assert cli.main(["mount", str(tmp_path), "--size", "16M"]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("memfs: error: /dev/fuse"), err


def test_umount_not_mounted(tmp_path: Path) -> None:
    line = assert_one_error_line(memfs("umount", str(tmp_path)))
    assert "not mounted" in line


@pytest.mark.parametrize(("command", "args"), [
    ("mount", ["x"]), ("status", ["x"]), ("flush", ["x", "--wait"]),
    ("memd", ["--listen", "127.0.0.1:0"]),
    ("mds", ["--listen", "127.0.0.1:0", "--pool", "tcp://127.0.0.1:1/0"]),
])
def test_unknown_option_shows_the_commands_usage(command: str, args: list[str]) -> None:
    """Not the top-level ``memfs [-h] COMMAND ...``: the command's own options."""
    res = memfs(command, *args, "--no-such-option")
    assert res.returncode == cli.EXIT_USAGE, res
    assert f"usage: memfs {command} " in res.stderr, res.stderr
    assert f"memfs {command}: error: unrecognized arguments: --no-such-option" in res.stderr


def test_help() -> None:
    for args, words in (
        (["--help"], ["mount", "umount", "flush", "status", "stage-in", "stage-out"]),
        (["flush", "--help"], ["--wait", "--quiet"]),
        (["stage-in", "--help"], ["--manifest", "--no-wait"]),
        (["stage-out", "--help"], ["--archive"]),
        (["status", "--help"], ["--json"]),
        (["mount", "--help"], ["--size", "--volumes", "--stripe-size", "--foreground", "--backing",
                               "--flush-delay", "--dirty-max", "--flush-workers",
                               "--no-backing-fsync", "--discard-on-unmount"]),
        (["umount", "--help"], ["--lazy"]),
    ):
        res = memfs(*args)
        assert res.returncode == 0, res
        assert res.stderr == ""
        for w in words:
            assert w in res.stdout, (args, w)
    res = memfs("--version")
    assert res.returncode == 0 and res.stdout.startswith("memfs "), res


# -- the daemon's life -----------------------------------------------------------------


@needs_mount
def test_background_mount_and_umount(
    mountpoint: Path, tmp_path: Path, subreaper: Callable[[], None]
) -> None:
    """``memfs mount`` returns with the mount usable; ``memfs umount`` returns with it gone."""
    log = tmp_path / "daemon.log"
    res = memfs("mount", str(mountpoint), "--size", "32M", "--volumes", "2", "--log", str(log))
    subreaper()
    pid = int(pid_file(str(mountpoint)).read_text()) if res.returncode == 0 else None
    try:
        assert res.returncode == 0, res.stderr
        assert res.stdout == res.stderr == ""
        assert pid is not None
        usable(mountpoint, 32 << 20)  # right away: no sleep, no retry
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the daemon should be our running child"
        # The daemon has exited by the time umount returns, even though nobody
        # has reaped it yet (a zombie is not a running daemon).
        res = memfs("umount", str(mountpoint), timeout=15)
        assert res.returncode == 0, res.stderr
        assert res.stdout == res.stderr == ""
        assert not is_mounted(str(mountpoint))
        assert exit_status(pid, 1) == 0
        pid = None
        assert not pid_file(str(mountpoint)).exists()
        log_is_clean(log)
    finally:
        force_cleanup(mountpoint, pid)


@needs_mount
def test_background_sigterm(mountpoint: Path, tmp_path: Path, subreaper: Callable[[], None]) -> None:
    """SIGTERM to the daemon (what systemd sends) unmounts and exits 0."""
    log = tmp_path / "daemon.log"
    # --attr-timeout 0: nothing about the mount is cached in the kernel, as in
    # a daemon that has been idle for longer than the attribute timeout.
    res = memfs("mount", str(mountpoint), "--size", "16M", "--attr-timeout", "0", "--log", str(log))
    subreaper()
    assert res.returncode == 0, res.stderr
    pid: int | None = int(pid_file(str(mountpoint)).read_text())
    assert pid is not None
    try:
        usable(mountpoint, 16 << 20)
        os.kill(pid, signal.SIGTERM)
        assert exit_status(pid, 5) == 0, "daemon did not exit on SIGTERM"
        pid = None
        assert not is_mounted(str(mountpoint))
        assert not pid_file(str(mountpoint)).exists()
        log_is_clean(log)
    finally:
        force_cleanup(mountpoint, pid)


def _start_foreground(mnt: Path, log: Path, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*MEMFS, "mount", str(mnt), "--foreground", "--size", "16M", "--log", str(log), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + TIMEOUT
    while not is_mounted(str(mnt)):
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"foreground daemon exited with {proc.returncode}: {err}")
        assert time.monotonic() < deadline, "foreground daemon never mounted"
        time.sleep(0.02)
    return proc


def _stop_foreground(proc: subprocess.Popen[str], mnt: Path) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()
    if is_mounted(str(mnt)):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


@needs_mount
def test_foreground_umount_command(mountpoint: Path, tmp_path: Path) -> None:
    """``memfs mount -f`` serves in the foreground; umount(8) ends it with status 0."""
    log = tmp_path / "fg.log"
    proc = _start_foreground(mountpoint, log)
    try:
        usable(mountpoint, 16 << 20)
        assert proc.poll() is None
        res = subprocess.run(["umount", str(mountpoint)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert proc.wait(timeout=10) == 0
        assert not is_mounted(str(mountpoint))
        log_is_clean(log)
    finally:
        _stop_foreground(proc, mountpoint)


@needs_mount
def test_foreground_sigterm(mountpoint: Path, tmp_path: Path) -> None:
    """SIGTERM (Ctrl-C's sibling, and what a supervisor sends) unmounts and exits 0."""
    log = tmp_path / "fg.log"
    proc = _start_foreground(mountpoint, log, "--attr-timeout", "0")  # see test_background_sigterm
    try:
        usable(mountpoint, 16 << 20)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail("foreground daemon did not exit on SIGTERM")
        assert code == 0
        assert not is_mounted(str(mountpoint))
        log_is_clean(log)
    finally:
        _stop_foreground(proc, mountpoint)


@needs_mount
def test_mount_helper(mountpoint: Path, tmp_path: Path) -> None:
    """What ``mount -t fuse.memfs memfs MNT -o ...`` (and fstab) runs, called directly."""
    helper = Path(sys.executable).with_name("mount.fuse.memfs")
    if not helper.exists():
        pytest.skip(f"{helper} not installed (pip install -e .)")
    log = tmp_path / "helper.log"
    res = subprocess.run(
        [str(helper), "memfs", str(mountpoint),
         "-o", f"rw,size=64M,volumes=2,_netdev,nofail,log={log}"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )
    try:
        assert res.returncode == 0, res.stderr
        assert is_mounted(str(mountpoint))
        usable(mountpoint, 64 << 20)
        assert "2 volumes x 32 MiB" in log.read_text()
        res = memfs("umount", str(mountpoint), timeout=15)
        assert res.returncode == 0, res.stderr
        assert not is_mounted(str(mountpoint))
        log_is_clean(log)
    finally:
        force_cleanup(mountpoint, None)  # the daemon exits once its mount is gone


@needs_mount
def test_mount_helper_bad_option(mountpoint: Path) -> None:
    helper = Path(sys.executable).with_name("mount.fuse.memfs")
    if not helper.exists():
        pytest.skip(f"{helper} not installed (pip install -e .)")
    res = subprocess.run(
        [str(helper), "memfs", str(mountpoint), "-o", "size=lots"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert "--size" in assert_one_error_line(res)


# -- review findings: what the user meets around crashes and other mounts ------------


@needs_mount
def test_mount_failure_says_why(mountpoint: Path) -> None:
    """libfuse's and fusermount3's reason reaches the user, not only the daemon log."""
    res = memfs("mount", str(mountpoint), "--size", "16M", "-o", "no_such_opt")
    line = assert_one_error_line(res)
    assert "unknown option" in line and "no_such_opt" in line, line
    assert res.returncode == 2, res
    assert not is_mounted(str(mountpoint))


@needs_mount
def test_umount_refuses_other_filesystems(mountpoint: Path) -> None:
    """As root, fusermount3 -u unmounts anything; ``memfs umount`` must not."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "review-tmpfs", str(mountpoint)], check=True)
    try:
        line = assert_one_error_line(memfs("umount", str(mountpoint)))
        assert "tmpfs" in line and "not memfs" in line, line
        assert is_mounted(str(mountpoint))
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


@needs_mount
def test_daemon_leaves_the_callers_directory(mountpoint: Path, tmp_path: Path) -> None:
    """A daemon started from inside another filesystem must not keep it busy."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = subprocess.run(
        [*MEMFS, "mount", str(mountpoint), "--size", "16M", "--log", str(tmp_path / "d.log")],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=elsewhere,
    )
    assert res.returncode == 0, res.stderr
    pid = int(pid_file(str(mountpoint)).read_text())
    try:
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
    finally:
        assert memfs("umount", str(mountpoint)).returncode == 0


@pytest.mark.mount
def test_mount_through_symlink_does_not_stack(memfs_mount: Callable[..., Mounted], tmp_path: Path) -> None:
    m = memfs_mount("--size", "16M")
    link = tmp_path / "link"
    link.symlink_to(m.path)
    assert "already" in assert_one_error_line(memfs("mount", str(link), "--size", "16M"))
    res = memfs("umount", str(link))  # umount(8) takes a symlink to the mountpoint too
    assert res.returncode == 0, res.stderr
    assert not is_mounted(str(m.path))


@pytest.mark.mount
def test_after_sigkill(memfs_mount: Callable[..., Mounted]) -> None:
    """A killed daemon (SIGKILL, the OOM killer): the mount answers ENOTCONN.

    ``memfs mount`` says it is still mounted (not "does not exist"), and ``memfs
    umount`` cleans up without waiting for whatever process has the dead
    daemon's pid by now, and removes the stale pid file.
    """
    m = memfs_mount("--size", "16M")
    os.kill(m.pid, signal.SIGKILL)
    deadline = time.monotonic() + TIMEOUT
    while runtime.alive(m.pid):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(OSError) as info:
        os.stat(m.path)
    # ECONNABORTED: the kernel had taken this request in before it aborted the
    # connection (seen once in ~1,000 runs); every later one is ENOTCONN.
    assert info.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    with pytest.raises(OSError) as info:
        os.stat(m.path)
    assert info.value.errno == errno.ENOTCONN
    line = assert_one_error_line(memfs("mount", str(m.path), "--size", "16M"))
    assert "already a mountpoint" in line, line
    pidf = pid_file(str(m.path))
    with subprocess.Popen(["sleep", "60"]) as other:  # the pid, recycled
        try:
            pidf.write_text(f"{other.pid}\n")
            res = memfs("umount", str(m.path), timeout=10)
            assert res.returncode == 0, res.stderr
        finally:
            other.kill()
    assert not is_mounted(str(m.path))
    assert not pidf.exists()
    usable_again = memfs("mount", str(m.path), "--size", "16M", "--log", str(m.log))
    assert usable_again.returncode == 0, usable_again.stderr
    m.pid = int(pidf.read_text())  # the fixture unmounts this one
    usable(m.path, 16 << 20)


@needs_mount
def test_non_root_mount_belongs_to_the_user() -> None:
    """A user's own mount: its root directory is theirs (chmod works), and a
    mount they may not make fails with fusermount3's reason."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv missing (util-linux)")
    base = Path(tempfile.mkdtemp(prefix="memfs-user-", dir="/tmp"))
    mnt = base / "mnt"
    mnt.mkdir()
    os.chown(base, NOBODY, NOBODY)
    os.chown(mnt, NOBODY, NOBODY)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(base)}  # pid and log files go there

    def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *args],
            capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd="/",
        )

    try:
        theirs = base / "root-owned"
        theirs.mkdir(mode=0o755)
        line = assert_one_error_line(as_nobody(sys.executable, "-m", "memfs", "mount", str(theirs)))
        assert "fusermount3: user has no write access" in line, line
        # --log elsewhere: the runtime directory for the pid file does not exist yet.
        log = base / "user.log"
        res = as_nobody(sys.executable, "-m", "memfs", "mount", str(mnt), "--size", "16M", "--log", str(log))
        assert res.returncode == 0, res.stderr
        assert (base / "memfs").is_dir() and "mounted" in log.read_text()
        probe = f"import os; os.chmod({str(mnt)!r}, 0o700); st = os.stat({str(mnt)!r}); " \
                "print(st.st_uid, st.st_gid, oct(st.st_mode & 0o7777))"
        res = as_nobody(sys.executable, "-c", probe)
        assert res.stdout.split() == [str(NOBODY), str(NOBODY), "0o700"], res
        res = as_nobody(sys.executable, "-m", "memfs", "umount", str(mnt))
        assert res.returncode == 0, res.stderr
        assert not is_mounted(str(mnt))
    finally:
        if is_mounted(str(mnt)):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        shutil.rmtree(base)


def test_instance_names_are_unique() -> None:
    """Pid and log file names: escaped like ``systemd-escape -p``, so never shared."""
    assert runtime.instance_name("/mnt/memfs") == "mnt-memfs"
    assert runtime.instance_name("/mnt/a-b") != runtime.instance_name("/mnt/a/b")
    assert runtime.instance_name("/mnt/a b") != runtime.instance_name("/mnt/a/b")
    assert runtime.instance_name("/root") != runtime.instance_name("/")


@needs_mount
def test_umount_of_one_of_two_similar_names(tmp_path: Path) -> None:
    """``/x/a/b`` and ``/x/a-b`` once shared a pid file: umount of the first waited
    for the daemon of the second, forever."""
    one, two = tmp_path / "a" / "b", tmp_path / "a-b"
    one.mkdir(parents=True)
    two.mkdir()
    try:
        for mnt in (one, two):
            res = memfs("mount", str(mnt), "--size", "16M", "--log", str(tmp_path / f"{mnt.name}.log"))
            assert res.returncode == 0, res.stderr
        res = memfs("umount", str(one), timeout=15)
        assert res.returncode == 0, res.stderr
        assert not is_mounted(str(one))
        usable(two, 16 << 20)
        res = memfs("umount", str(two), timeout=15)
        assert res.returncode == 0, res.stderr
    finally:
        for mnt in (one, two):
            if is_mounted(str(mnt)):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


@needs_mount
def test_cluster_mount_mistakes_are_one_line(mountpoint: Path, tmp_path: Path) -> None:
    """No metadata server there, a malformed address, a bad secret file: one line
    each, exit 2, nothing mounted (and the line says it once, not three times)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o644)
    cases = {
        (f"127.0.0.1:{port}", None): f"cannot reach the metadata server at 127.0.0.1:{port}: "
                                     "Connection refused (log: ",
        ("127.0.0.1", None): "bad --mds '127.0.0.1'",
        ("127.0.0.1:99999", None): "bad --mds",
        (f"127.0.0.1:{port}", str(secret)): "readable by others",
        (f"127.0.0.1:{port}", str(tmp_path / "none")): "cannot read secret file",
    }
    for (mds, secret_file), mentions in cases.items():
        args = ["mount", str(mountpoint), "--mds", mds, "--log", str(tmp_path / "mount.log")]
        if secret_file:
            args += ["--secret-file", secret_file]
        res = memfs(*args)
        line = assert_one_error_line(res)
        assert res.returncode == cli.EXIT_USAGE, res
        assert mentions in line, line
        assert line.count("metadata server") <= 1, line
        assert not is_mounted(str(mountpoint))
    # The kernel's writeback cache keeps its own sizes: other nodes' writes unseen.
    res = memfs("mount", str(mountpoint), "--mds", f"127.0.0.1:{port}", "-o", "writeback_cache")
    assert "-o writeback_cache goes with an embedded pool" in assert_one_error_line(res)


# -- burst buffer: argument mistakes (refused before anything is mounted) -------------


def _flush_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    backing = tmp_path / "backing"
    backing.mkdir(exist_ok=True)
    (tmp_path / "file").write_text("x")
    b = ["--backing", str(backing)]
    return {
        "backing_missing": (["--backing", str(tmp_path / "none")],
                            f"backing directory {tmp_path / 'none'} does not exist"),
        "backing_not_a_directory": (["--backing", str(tmp_path / "file")], "is not a directory"),
        "delay_without_backing": (["--flush-delay", "1"], "--flush-delay goes with --backing DIR"),
        "dirty_max_without_backing": (["--dirty-max", "1G"], "--dirty-max goes with --backing"),
        "workers_without_backing": (["--flush-workers", "2"], "--flush-workers goes with --backing"),
        "no_fsync_without_backing": (["--no-backing-fsync"], "--no-backing-fsync goes with --backing"),
        "delay_word": ([*b, "--flush-delay", "soon"], "bad --flush-delay 'soon'"),
        "delay_negative": ([*b, "--flush-delay", "-1"], "bad --flush-delay"),
        "delay_nan": ([*b, "--flush-delay", "nan"], "bad --flush-delay"),
        "workers_zero": ([*b, "--flush-workers", "0"], "bad --flush-workers 0"),
        "workers_word": ([*b, "--flush-workers", "many"], "bad --flush-workers 'many'"),
        "dirty_max_unit": ([*b, "--dirty-max", "3Q"], "bad --dirty-max '3Q'"),
    }


def test_mount_backing_mistakes(tmp_path: Path) -> None:
    """One line each, exit 2; the mountpoint does not even exist, so a check that
    failed to fire would end in "does not exist" instead of mounting."""
    mnt = str(tmp_path / "mnt")
    cases = {
        **_flush_cases(tmp_path),
        "discard_without_backing": (["--discard-on-unmount"], "--discard-on-unmount goes with --backing"),
        "with_mds": (["--backing", str(tmp_path), "--mds", "127.0.0.1:7000"],
                     "with --mds the metadata server writes back (start `memfs mds` with --backing)"),
        "knob_with_mds": (["--mds", "127.0.0.1:7000", "--flush-delay", "1"], "goes with --backing"),
        "dirty_max_above_pool": (["--backing", str(tmp_path / "backing"), "--size", "64M",
                                  "--dirty-max", "65M"],
                                 "--dirty-max 65M is larger than the pool (64.0 MiB)"),
    }
    for name, (args, mentions) in cases.items():
        res = memfs("mount", mnt, *args)
        line = assert_one_error_line(res)
        assert res.returncode == cli.EXIT_USAGE, (name, res)
        assert mentions in line, (name, line)


def test_mds_backing_mistakes(tmp_path: Path) -> None:
    """The same checks for ``memfs mds``, before it listens (or asks any memory server)."""
    base = ["mds", "--listen", "127.0.0.1:0", "--pool", "tcp://127.0.0.1:1/0", "--volume-size", "64M"]
    cases = {
        **_flush_cases(tmp_path),
        "dirty_max_above_pool": (["--backing", str(tmp_path / "backing"), "--dirty-max", "65M"],
                                 "--dirty-max 65M is larger than the pool"),
        "write_leases_without_backing": (["--no-backing-write-leases"],
                                         "--no-backing-write-leases goes with --backing"),
    }
    for name, (args, mentions) in cases.items():
        res = memfs(*base, *args, timeout=10)
        line = assert_one_error_line(res)
        assert res.returncode == cli.EXIT_USAGE, (name, res)
        assert mentions in line, (name, line)
    res = memfs(*base, "--discard-on-unmount", timeout=10)  # a mount's choice, not the mds's
    assert res.returncode == cli.EXIT_USAGE and "unrecognized arguments" in res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
def test_backing_not_writable(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1M", "memfs-test-ro", str(ro)], check=True)
    try:
        line = assert_one_error_line(memfs("mount", str(tmp_path / "mnt"), "--backing", str(ro)))
        assert f"backing directory {ro} is not writable" in line
    finally:
        subprocess.run(["umount", str(ro)], check=True)


FUSE_SKIP = None if os.access("/dev/fuse", os.R_OK | os.W_OK) else "no usable /dev/fuse"


@pytest.mark.skipif(FUSE_SKIP is not None, reason=FUSE_SKIP or "")
def test_backing_and_mountpoint_must_not_overlap(mountpoint: Path, tmp_path: Path) -> None:
    """Write-back into the mount itself would wait on its own daemon: refused both ways,
    also when a symlink hides it."""
    (mountpoint / "sub").mkdir()
    (tmp_path / "link").symlink_to(mountpoint / "sub")
    for backing, mentions in (
        (mountpoint / "sub", f"backing directory {mountpoint}/sub is inside the mountpoint {mountpoint}"),
        (mountpoint, "is inside the mountpoint"),
        (tmp_path / "link", f"backing directory {mountpoint}/sub is inside the mountpoint"),
        (tmp_path, f"mountpoint {mountpoint} is inside the backing directory {tmp_path}"),
    ):
        res = memfs("mount", str(mountpoint), "--size", "16M", "--backing", str(backing))
        line = assert_one_error_line(res)
        assert res.returncode == cli.EXIT_USAGE
        assert mentions in line, line
        assert "deadlock" in line
        assert not is_mounted(str(mountpoint))


def test_mount_helper_flush_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``-o backing=DIR,flush_delay=S,...`` become memfs arguments (seen by the errors they cause)."""
    mnt = str(tmp_path / "mnt")
    for opts, mentions in (
        (f"backing={tmp_path / 'none'},flush_delay=1", f"backing directory {tmp_path / 'none'} does not exist"),
        (f"backing={tmp_path},flush_workers=0", "bad --flush-workers 0"),
        (f"backing={tmp_path},dirty_max=lots", "bad --dirty-max 'lots'"),
        (f"backing={tmp_path},flush_delay=-3", "bad --flush-delay -3.0"),
        ("rw,_netdev,discard_on_unmount", "--discard-on-unmount goes with --backing"),
        ("no_backing_fsync", "--no-backing-fsync goes with --backing"),
    ):
        assert cli.mount_helper(["memfs", mnt, "-o", opts]) == cli.EXIT_USAGE
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1, err
        assert mentions in err, (opts, err)


def test_burst_buffer_commands_need_a_memfs_mount(tmp_path: Path) -> None:
    """flush/status/stage-in/stage-out on something that is not memfs: one line, exit 2."""
    for args, mentions in (
        (["flush", str(tmp_path), "--wait"], f"{tmp_path} is not a memfs mount"),
        (["status", str(tmp_path)], f"{tmp_path} is not a memfs mount"),
        (["status", "/proc", "--json"], "/proc is a proc mount, not memfs"),
        (["stage-in", str(tmp_path), "--manifest", str(tmp_path / "m")], "is not a memfs mount"),
        (["stage-out", str(tmp_path), "--archive", str(tmp_path / "a.tar")],
         f"{tmp_path} is not inside a memfs mount"),
    ):
        res = memfs(*args)
        assert res.returncode == cli.EXIT_USAGE, res
        assert mentions in assert_one_error_line(res), (args, res.stderr)
    assert not (tmp_path / "a.tar").exists()


def test_flush_config_from_arguments(tmp_path: Path) -> None:
    """What ``memfs mount`` hands the engine: canonical backing path, defaults, knobs."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    args = parser.build_parser().parse_args(["mount", "/mnt/x", "--backing", str(tmp_path / "link")])
    config = parser.flush_from_args(args, 1 << 30)
    assert config == FlushConfig(backing=str(tmp_path / "real"), delay=5.0, dirty_max=None,
                                 workers=4, fsync=True, discard_on_unmount=False)
    args = parser.build_parser().parse_args([
        "mount", "/mnt/x", "--backing", str(tmp_path / "real"), "--flush-delay", "0.5",
        "--dirty-max", "1G", "--flush-workers", "16", "--no-backing-fsync", "--discard-on-unmount",
    ])
    assert parser.flush_from_args(args, 1 << 30) == FlushConfig(
        backing=str(tmp_path / "real"), delay=0.5, dirty_max=1 << 30, workers=16, fsync=False,
        discard_on_unmount=True,
    )
    assert parser.flush_from_args(parser.build_parser().parse_args(["mount", "/mnt/x"]), None) is None


# -- burst buffer commands against real daemons --------------------------------------


def _wait_until(cond: Callable[[], bool], timeout: float = TIMEOUT, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _status(mnt: Path) -> dict[str, Any]:
    res = memfs("status", str(mnt), "--json")
    assert res.returncode == 0, res.stderr
    st: dict[str, Any] = json.loads(res.stdout)
    return st


@pytest.mark.mount
def test_umount_says_what_stage_out_trees_lose(
    memfs_mount: Callable[..., Mounted], tmp_path: Path
) -> None:
    """Data under user.memfs.flush=off is never written back: unmounting loses it,
    and ``memfs umount`` says so (and unmounts all the same); nothing pinned, nothing said."""
    backing = tmp_path / "backing"
    backing.mkdir()
    m = memfs_mount("--size", "64M", "--backing", str(backing), "--flush-delay", "0.2")
    (m / "kept.txt").write_bytes(b"kept\n")
    (m / "tree" / "sub").mkdir(parents=True)
    os.setxattr(m / "tree", common.FLUSH_XATTR, b"off")
    (m / "tree" / "a.bin").write_bytes(os.urandom(3 << 20))
    (m / "tree" / "sub" / "b.bin").write_bytes(os.urandom(100_000))
    _wait_until(lambda: _status(m.path).get("pinned_files") == 2, what="two pinned files")
    res = memfs("umount", str(m.path))
    assert res.returncode == 0, res.stderr
    assert res.stderr == ("memfs: 2 files (4 MiB) under user.memfs.flush=off trees (stage-out) "
                          "are not written back and are lost with the mount\n")
    assert not is_mounted(str(m.path)) and wait_gone(m.pid, TIMEOUT)
    assert (backing / "kept.txt").read_bytes() == b"kept\n"
    assert not (backing / "tree" / "a.bin").exists()

    m2 = memfs_mount("--size", "64M", "--backing", str(backing))
    (m2 / "more.txt").write_bytes(b"more\n")
    res = memfs("umount", str(m2.path))
    assert (res.returncode, res.stderr) == (0, "")


@pytest.mark.mount
def test_umount_says_what_stage_out_trees_lose_before_the_flush_delay(
    memfs_mount: Callable[..., Mounted], tmp_path: Path
) -> None:
    """Files changed in a flush=off tree count as pinned at once, not as dirty until
    write-back first looks at them: an unmount right after writing them warns too
    (found by a new user: `memfs status` called them dirty, `memfs umount` said nothing)."""
    backing = tmp_path / "backing"
    backing.mkdir()
    m = memfs_mount("--size", "64M", "--backing", str(backing), "--flush-delay", "60")
    (m / "tree").mkdir()
    os.setxattr(m / "tree", common.FLUSH_XATTR, b"off")
    (m / "tree" / "a.bin").write_bytes(os.urandom(3 << 20))
    (m / "tree" / "b.bin").write_bytes(os.urandom(100_000))
    (m / "kept.txt").write_bytes(b"kept\n")
    st = _status(m.path)
    assert (st["pinned_files"], st["dirty_files"]) == (2, 1), st
    res = memfs("umount", str(m.path))
    assert res.returncode == 0, res.stderr
    assert res.stderr == ("memfs: 2 files (4 MiB) under user.memfs.flush=off trees (stage-out) "
                          "are not written back and are lost with the mount\n")
    assert (backing / "kept.txt").read_bytes() == b"kept\n"
    assert not (backing / "tree" / "a.bin").exists()


@needs_mount
def test_interrupted_umount_leaves_a_daemon_that_can_still_be_reached(tmp_path: Path) -> None:
    """Ctrl-C on a ``memfs umount`` that waits for a drain: the daemon keeps writing
    back.  A new mount at MNT is refused while it runs; ``memfs status`` and
    ``memfs flush --wait`` reach it through its control socket though MNT is no
    longer mounted; ``memfs umount MNT`` waits for it to finish, as before."""
    small, mnt = tmp_path / "small", tmp_path / "mnt"
    small.mkdir()
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "memfs-test-small", str(small)],
                   check=True, timeout=TIMEOUT)
    pid = None
    try:
        res = memfs("mount", str(mnt), "--size", "64M", "--backing", str(small),
                    "--log", str(tmp_path / "log"))
        assert res.returncode == 0, res.stderr
        pid = int(pid_file(str(mnt)).read_text())
        data = os.urandom(4 << 20)  # does not fit: write-back fails with ENOSPC, retried
        (mnt / "big.bin").write_bytes(data)

        # SIGINT as at a terminal, even if this suite was started with it ignored
        # (a background job of a shell without job control: `(make test &)`)
        umount = subprocess.Popen([*MEMFS, "umount", str(mnt)], stderr=subprocess.PIPE, text=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        _wait_until(lambda: not is_mounted(str(mnt)), what="the FUSE unmount")
        time.sleep(0.3)
        umount.send_signal(signal.SIGINT)  # Ctrl-C
        assert umount.wait(TIMEOUT) == 130
        assert umount.stderr is not None
        umount.stderr.close()
        assert runtime.alive(pid)  # still writing back

        line = assert_one_error_line(memfs("mount", str(mnt), "--size", "16M"))
        assert line == (f"memfs: error: a memfs daemon (pid {pid}) for {mnt} is still writing "
                        f"back to its backing directory; wait with `memfs umount {mnt}`")
        st = _status(mnt)
        assert st["draining"] is True and st["dirty_files"] == 1, st
        res = memfs("status", str(mnt))
        assert res.returncode == 0 and "(draining: writing everything back before exit)" in res.stdout
        assert assert_one_error_line(memfs("stage-in", str(mnt))).endswith("is not a memfs mount (not mounted)")
        flush = subprocess.Popen([*MEMFS, "flush", str(mnt), "--wait"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # Waiting (write-back keeps failing), not refused as "not mounted".
            with pytest.raises(subprocess.TimeoutExpired):
                flush.wait(1.5)
        finally:
            flush.kill()
            flush.communicate()

        waiter = subprocess.Popen([*MEMFS, "umount", str(mnt)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                waiter.wait(4)  # waits for the daemon, which cannot finish yet
            subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True,
                           timeout=TIMEOUT)
            out, err = waiter.communicate(timeout=90)
        finally:
            waiter.kill()
        assert waiter.returncode == 0, err
        assert f"memfs: writing back 4 MiB (1 files) to {small} before exit..." in err
        assert not runtime.alive(pid)
        pid = None
        assert (small / "big.bin").read_bytes() == data
        assert not pid_file(str(mnt)).exists()
        assert assert_one_error_line(memfs("umount", str(mnt))).endswith("is not mounted")
        res = memfs("mount", str(mnt), "--size", "16M", "--log", str(tmp_path / "log"))
        assert res.returncode == 0, res.stderr
        pid = int(pid_file(str(mnt)).read_text())
        assert memfs("umount", str(mnt)).returncode == 0
    finally:
        force_cleanup(mnt, pid)
        if pid is not None:
            wait_gone(pid, 10)
        subprocess.run(["umount", str(small)], capture_output=True, timeout=TIMEOUT)


@needs_mount
def test_the_mount_roots_owner_may_use_the_control_socket() -> None:
    """The Slurm prolog mounts as root and chowns the mount root to the job's user:
    that user may then use flush/status/stage-in; before, they are told who may."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv missing (util-linux)")
    base = Path(tempfile.mkdtemp(prefix="memfs-owner-", dir="/tmp"))
    base.chmod(0o755)
    mnt, backing = base / "mnt", base / "backing"
    mnt.mkdir()
    (backing / "in").mkdir(parents=True)
    (backing / "in" / "data.bin").write_bytes(os.urandom(1 << 20))
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}

    def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             sys.executable, "-m", "memfs", *args],
            capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd="/",
        )

    try:
        res = memfs("mount", str(mnt), "--size", "64M", "--backing", str(backing),
                    "--log", str(base / "log"))
        assert res.returncode == 0, res.stderr
        sock = runtime.control_socket(str(mnt))
        assert sock.parent == Path("/run/memfs-ctl")
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o755
        assert stat.S_IMODE(sock.stat().st_mode) == 0o666
        assert stat.S_IMODE(runtime.runtime_dir().stat().st_mode) == 0o700  # pid and log files

        res = as_nobody("status", str(mnt))
        assert res.returncode == cli.EXIT_USAGE, res
        assert assert_one_error_line(res) == (
            f"memfs: error: only root and the owner of {mnt} (uid 0) may control this mount "
            f"(you are uid {NOBODY})")
        os.chown(mnt, NOBODY, NOBODY)  # what the prolog does
        res = as_nobody("status", str(mnt), "--json")
        assert res.returncode == 0, res.stderr
        (mnt / "out.txt").write_bytes(b"out\n")
        res = as_nobody("flush", str(mnt), "--wait")
        assert res.returncode == 0, res.stderr
        assert (backing / "out.txt").read_bytes() == b"out\n"
        res = as_nobody("stage-in", str(mnt), "in")
        assert res.returncode == 0, res.stderr
        assert _status(mnt)["evicted_files"] == 0
        os.chown(mnt, 0, 0)
        assert as_nobody("status", str(mnt)).returncode == cli.EXIT_USAGE
        res = memfs("umount", str(mnt))
        assert res.returncode == 0, res.stderr
        log_is_clean(base / "log")
    finally:
        force_cleanup(mnt, None)
        shutil.rmtree(base)


@pytest.mark.mount
def test_stage_in_of_files_gone_from_the_backing_directory(
    memfs_mount: Callable[..., Mounted], tmp_path: Path
) -> None:
    """A file removed from DIR after the mount still shows (its entry was loaded), but
    cannot be fetched: stage-in exits 1 naming it; staging more than the pool warns."""
    backing = tmp_path / "backing"
    (backing / "in").mkdir(parents=True)
    for name in ("a.bin", "b.bin"):
        (backing / "in" / name).write_bytes(os.urandom(3 << 20))
    m = memfs_mount("--size", "4M", "--backing", str(backing))
    (backing / "in" / "b.bin").unlink()
    res = memfs("stage-in", str(m.path), "in")
    assert res.returncode == cli.EXIT_FAILED, res
    lines = res.stderr.splitlines()
    assert lines[0] == ("memfs: warning: staged 6 MiB into a pool of 4 MiB: only the most "
                        "recently staged part stays in memory")
    assert lines[1].startswith(f"memfs: error: stage-in of {m.path}/in/b.bin: ")
    assert "No such file or directory" in lines[1] and len(lines) == 2
