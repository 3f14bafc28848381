"""Shared fixtures: real memfs mounts that are always cleaned up.

``memfs_mount`` starts the daemon the way a user does (``memfs mount``, which
forks and returns when ready), and on teardown unmounts, waits for the daemon to
exit, kills it if it will not, and asserts the mount is gone and the daemon log
holds no errors.  A session finalizer sweeps any memfs mount under the test
temporary directory, so a crashed test cannot leave one behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from memfs.cli.mounts import is_mounted
from memfs.cli.runtime import alive

MEMFS = [sys.executable, "-m", "memfs"]


def _can_mount() -> str | None:
    if os.geteuid() != 0:
        return "real mounts need root (allow_other, non-root users in tests)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "fusermount3 missing (apt-get install fuse3)"
    return None


MOUNT_SKIP = _can_mount()


@dataclass
class Mounted:
    path: Path
    log: Path
    pid: int
    expect_errors: bool = False

    def __truediv__(self, other: str) -> Path:
        return self.path / other


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # The daemon is not our child (it forked away): init reaps it, maybe
        # late, and kill(pid, 0) succeeds on the zombie until then.
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def stop_server(*procs: subprocess.Popen[bytes]) -> None:
    """Stop `memfs memd`/`memfs mds` processes started with a stdout pipe, all at once:
    SIGTERM, then SIGKILL for any still running 10 s later."""
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def unmount(m: Mounted) -> None:
    if is_mounted(str(m.path)):
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)
    if not wait_gone(m.pid, 30):
        os.kill(m.pid, signal.SIGKILL)
        wait_gone(m.pid, 10)
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)
        raise AssertionError(f"memfs daemon {m.pid} did not exit after unmount")
    assert not is_mounted(str(m.path)), f"{m.path} still mounted"


def _mount(
    base: Path, name: str, args: list[str], extra_cleanup: list[Mounted]
) -> Mounted:
    mnt = base / name
    mnt.mkdir(parents=True, exist_ok=True)
    log = base / f"{name}.log"
    res = subprocess.run(
        [*MEMFS, "mount", str(mnt), "--log", str(log), *args],
        capture_output=True, text=True, timeout=120,
    )
    if res.returncode != 0:
        raise AssertionError(f"memfs mount failed ({res.returncode}): {res.stderr}")
    from memfs.cli.runtime import pid_file

    pid = int(pid_file(str(mnt)).read_text())
    m = Mounted(mnt, log, pid)
    extra_cleanup.append(m)
    return m


@pytest.fixture
def memfs_mount(tmp_path: Path) -> Iterator[Callable[..., Mounted]]:
    """A factory: ``memfs_mount("--size", "64M")`` mounts and returns a :class:`Mounted`."""
    if MOUNT_SKIP:
        pytest.skip(MOUNT_SKIP)
    made: list[Mounted] = []
    counter = iter(range(1000))

    def factory(*args: str) -> Mounted:
        return _mount(tmp_path, f"mnt{next(counter)}", list(args), made)

    try:
        yield factory
    finally:
        failures = []
        for m in made:
            try:
                unmount(m)
            except AssertionError as exc:
                failures.append(str(exc))
            text = m.log.read_text() if m.log.exists() else ""
            if not m.expect_errors and ("Traceback" in text or " ERROR " in text):
                failures.append(f"daemon log {m.log} has errors:\n{text[-3000:]}")
        if failures:
            pytest.fail("\n".join(failures))


@pytest.fixture
def mnt(memfs_mount: Callable[..., Mounted]) -> Mounted:
    """A fresh 512 MiB memfs mount with the default layout (4 volumes, 1 MiB stripes)."""
    return memfs_mount("--size", "512M")


@pytest.fixture(autouse=True)
def _no_unexpected_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """In-process code must not log warnings a test did not ask for."""
    yield
    bad = [
        r for r in caplog.get_records("call")
        if r.levelno >= logging.WARNING and r.name.startswith("memfs")
        and not getattr(caplog, "expected_warnings", False)
    ]
    assert not bad, f"unexpected log records: {[r.getMessage() for r in bad]}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Last line of defence: no memfs mount from this run may survive it."""
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    base = str(factory.getbasetemp().resolve())
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "fuse.memfs" and fields[1].startswith(base + "/"):
            subprocess.run(["fusermount3", "-u", "-z", fields[1]], capture_output=True)
    # Pid files, logs and control sockets of this run's mounts: a daemon a test
    # killed leaves its own behind (they piled up by the thousand in /run/memfs).
    from memfs.cli.runtime import control_dir, instance_name, runtime_dir

    prefix = instance_name(base) + "-"
    for directory in {runtime_dir(), control_dir()}:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(directory / name)
