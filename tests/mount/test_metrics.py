"""Prometheus metrics (``--metrics HOST:PORT``): scraped from a real mount daemon and a
real ``memfs mds`` (in network namespaces), and the CLI's errors."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from memfs.metrics import REFRESH
from tests.conftest import Mounted

MEMFS = [sys.executable, "-m", "memfs"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """``{(sample name, sorted labels): value}`` of an exposition."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape_until(get: Callable[[], str], ready: Callable[[Samples], bool]) -> Samples:
    """Scrape until *ready* (gauges are refreshed every REFRESH seconds)."""
    deadline = time.monotonic() + 5 * REFRESH + 10
    while True:
        got = samples(get())
        if ready(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def http_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback only
        return str(r.read().decode())


@pytest.mark.mount
def test_mount_metrics(memfs_mount: Callable[..., Mounted], tmp_path: Path) -> None:
    port = free_port()
    backing = tmp_path / "backing"
    backing.mkdir()
    m = memfs_mount("--size", "64M", "--metrics", f"127.0.0.1:{port}",
                    "--backing", str(backing), "--flush-delay", "60")
    for i in range(5):
        (m / f"f{i}").write_bytes(b"x" * 100_000)
    with pytest.raises(OSError) as refused:  # the daemon refuses: counted as an error
        os.setxattr(m / "f0", "user.memfs.layout", b"stripe_count=nonsense")
    assert refused.value.errno is not None
    code = errno.errorcode[refused.value.errno]
    got = scrape_until(lambda: http_get(f"http://127.0.0.1:{port}/metrics"),
                       lambda g: g.get(("memfs_backing_dirty_files", ())) == 5)
    assert got[("memfs_up", (("role", "mount"),))] == 1
    assert got[("memfs_requests_total", (("op", "create"),))] >= 5
    assert got[("memfs_requests_total", (("op", "write"),))] >= 5
    assert got[("memfs_request_errors_total", (("errno", code), ("op", "setxattr")))] == 1
    creates = got[("memfs_request_seconds_count", (("op", "create"),))]
    assert creates == got[("memfs_requests_total", (("op", "create"),))]
    assert got[("memfs_pool_bytes", ())] == 64 << 20
    assert got[("memfs_pool_free_bytes", ())] < 64 << 20
    assert got[("memfs_backing_dirty_files", ())] == 5  # --flush-delay 60: not written back yet


@pytest.mark.mount
def test_bad_metrics_address(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([*MEMFS, "mount", str(mnt), "--metrics", "nowhere"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--metrics" in r.stderr, r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([*MEMFS, "mount", str(mnt), "--size", "16M", "--metrics",
                            f"127.0.0.1:{port}", "--log", str(tmp_path / "log")],
                           capture_output=True, text=True, timeout=60)
    # One line, the error itself (it is raised inside the daemon's nursery).
    assert r.returncode == 2 and "cannot serve metrics" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and "ExceptionGroup" not in r.stderr, r.stderr
    assert not os.path.ismount(mnt)
