"""The burst buffer's background machinery, in-process (no mount), each test for a
fault the reading of flush.py found.

An unexpected exception in the write-back scheduler, the namespace mirror or
the stager used to end the mount's background nursery, and with it the mount,
without writing dirty data back: the first tests inject one such exception
each and check that the work is still done and the error reported.  Then:
stage-in opened a file's copy once per MiB (and closed it on the trio thread),
and another daemon's temporary directory was judged by hostname and pid.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from memfs.backing.dirside import TMP_LOCK
from memfs.backing.meta import STEP, TMP_DIR, BackedMeta
from memfs.config import FlushConfig, PoolConfig
from memfs.data import DataEngine
from memfs.meta.store import MetaStore
from memfs.transport.local import LocalTransport

K, M = 1 << 10, 1 << 20
POOL = PoolConfig(size=16 * M, volumes=2, stripe_size=256 * K, chunk_size=64 * K)
ROOT = 1


@asynccontextmanager
async def running(backing: Path) -> AsyncIterator[tuple[BackedMeta, DataEngine]]:
    backing.mkdir(exist_ok=True)  # noqa: ASYNC240 - a local mkdir
    transport = LocalTransport(POOL.volumes, POOL.size // POOL.volumes)
    b = BackedMeta(MetaStore(POOL), transport, FlushConfig(str(backing), delay=0.0, workers=1))
    await b.load()
    async with trio.open_nursery() as nursery:
        await nursery.start(b.run)
        yield b, DataEngine(b, transport)
        nursery.cancel_scope.cancel()
    await b.close(math.inf)


def fail_once(obj: Any, name: str) -> list[int]:
    """Make ``obj.name`` raise RuntimeError on its first call; returns a call counter."""
    real = getattr(obj, name)
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected bug")
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


async def until(what: Callable[[], bool], seconds: float = 10.0) -> None:
    """Poll: the background tasks signal nothing a test could wait on."""
    with trio.fail_after(seconds):
        while not what():  # noqa: ASYNC110
            await trio.sleep(0.02)


async def internal_errors(b: BackedMeta, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What status reports as internal errors; each was also logged as an ERROR."""
    logged = [r.getMessage() for r in caplog.get_records("call") if r.levelno == logging.ERROR]
    found = [e.path for e in (await b.status()).errors if e.path.startswith("(internal)")]
    for what in found:
        assert any(m.startswith(what.removeprefix("(internal) ")) for m in logged), logged
    return found


@pytest.fixture(autouse=True)
def _bugs_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]


async def test_namespace_mirror_survives_a_bug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(tmp_path / "dir") as (b, _):
        calls = fail_once(b.dirside, "_apply")
        await b.mknod(ROOT, b"d", stat.S_IFDIR | 0o755, 0, 0)
        b.mirror.retry_now()  # as `memfs flush` does: no need to wait for the back-off
        await until(lambda: (tmp_path / "dir" / "d").is_dir())
        assert calls[0] >= 2
        assert (await internal_errors(b, caplog)) == ["(internal) namespace mirror"]


async def test_scheduler_survives_a_bug(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with running(tmp_path / "dir") as (b, data):
        a = await b.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0)
        await until(lambda: (tmp_path / "dir" / "f").exists())
        calls = fail_once(b.writeback, "schedule_round")
        await b.open(a.ino)
        await data.write(a.ino, 0, b"x" * 100 * K)
        await b.release(a.ino)
        await until(lambda: (tmp_path / "dir" / "f").stat().st_size == 100 * K)
        assert (tmp_path / "dir" / "f").read_bytes() == b"x" * 100 * K
        assert calls[0] >= 2
        assert "(internal) write-back scheduler" in (await internal_errors(b, caplog))


async def test_stager_survives_a_bug(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    backing = tmp_path / "dir"
    backing.mkdir()
    (backing / "a").write_bytes(b"a" * 200 * K)
    (backing / "b").write_bytes(b"b" * 200 * K)
    async with running(backing) as (b, data):
        calls = fail_once(b.residency, "ensure_resident")
        tid = (await b.control("stage_in", {}))["ticket"]

        async def progress() -> dict[str, Any]:
            return await b.control("progress", {"ticket": tid})

        with trio.fail_after(10):
            while not (p := await progress())["done"]:  # noqa: ASYNC110
                await trio.sleep(0.02)
        assert calls[0] >= 2
        failed = p.get("failed") or []
        assert len(failed) == 1 and "internal error" in str(failed[0]), p
        # The stager went on: a second ticket stages what the first could not.
        tid = (await b.control("stage_in", {}))["ticket"]
        with trio.fail_after(10):
            while not (p := await progress())["done"]:  # noqa: ASYNC110
                await trio.sleep(0.02)
        assert not p.get("failed"), p
        ino = b.store.resolve(b"a").ino
        assert bytes(await data.read(ino, 0, 200 * K)) == b"a" * 200 * K


async def test_stage_in_opens_each_copy_once_and_closes_it_off_the_trio_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging a file of several STEPs opened DIR's copy (and took the namespace lock)
    once per STEP, and closed it on the trio thread, where a slow parallel filesystem
    blocks every FUSE request."""
    backing = tmp_path / "dir"
    backing.mkdir()
    payload = os.urandom(5 * STEP + 1000)
    (backing / "big").write_bytes(payload)
    async with running(backing) as (b, data):
        opened: list[int] = []
        real_open = b.residency.open_backing

        async def counting_open(ino: int, path: bytes | None) -> int:
            fd = await real_open(ino, path)
            opened.append(fd)
            return fd

        b.residency.open_backing = counting_open  # type: ignore[method-assign]
        closed_on: dict[int, bool] = {}
        real_close = os.close
        trio_thread = threading.get_ident()

        def recording_close(fd: int) -> None:
            if fd in opened:
                closed_on[fd] = threading.get_ident() == trio_thread
            real_close(fd)

        monkeypatch.setattr(os, "close", recording_close)
        tid = (await b.control("stage_in", {}))["ticket"]
        with trio.fail_after(10):
            while not (await b.control("progress", {"ticket": tid}))["done"]:  # noqa: ASYNC110
                await trio.sleep(0.02)
        await until(lambda: len(closed_on) == len(set(opened)))
        assert len(opened) == 1
        assert closed_on == {opened[0]: False}
        ino = b.store.resolve(b"big").ino
        assert bytes(await data.read(ino, 0, len(payload))) == payload


_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""


async def test_temporary_directory_of_a_live_daemon_is_kept(tmp_path: Path) -> None:
    """A daemon on this host whose pid we cannot see (another PID namespace) but which
    holds its directory's lock keeps its copies; one whose lock is free is gone."""
    backing = tmp_path / "dir"
    top = backing / os.fsdecode(TMP_DIR)
    host = socket.gethostname()
    live = top / f"{host}-999999999"  # no such pid here: it lives in another PID namespace
    dead = top / f"{host}-999999998-4567abcd"
    for d in (live, dead):
        d.mkdir(parents=True)
        (d / "7.1.feedf00d").write_bytes(b"a copy in progress")
        (d / os.fsdecode(TMP_LOCK)).touch()
    holder = subprocess.Popen(  # noqa: ASYNC220 - runs beside the test, killed at the end
        [sys.executable, "-c", _HOLD_LOCK, str(live / os.fsdecode(TMP_LOCK))],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        async with running(backing) as (b, _):
            assert (live / "7.1.feedf00d").exists(), "a live daemon's copy was removed"
            assert not dead.exists()
            ours = Path(os.fsdecode(b.dirside.tmp))
            assert ours.parent == top and (ours / os.fsdecode(TMP_LOCK)).exists()
        assert not ours.exists()  # noqa: ASYNC240 - a local stat
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()
    async with running(backing):
        assert not live.exists(), "its daemon died: its directory goes"


async def test_write_back_closes_its_copy_off_the_trio_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing the copy written to DIR (which on a parallel filesystem may flush) ran
    on the trio thread, in front of every FUSE request."""
    async with running(tmp_path / "dir") as (b, data):
        created: list[int] = []
        real_create = b.dirside.create_tmp

        def recording_create(tmp: bytes) -> int:
            fd = real_create(tmp)
            created.append(fd)
            return fd

        b.dirside.create_tmp = recording_create  # type: ignore[method-assign]
        closed_on: dict[int, bool] = {}
        real_close = os.close
        trio_thread = threading.get_ident()

        def recording_close(fd: int) -> None:
            if fd in created:
                closed_on[fd] = threading.get_ident() == trio_thread
            real_close(fd)

        monkeypatch.setattr(os, "close", recording_close)
        a = await b.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0)
        payload = os.urandom(3 * STEP)  # more than one step: written through an open fd
        await b.open(a.ino)
        await data.write(a.ino, 0, payload)
        await b.release(a.ino)
        await until(lambda: (tmp_path / "dir" / "f").exists()
                    and (tmp_path / "dir" / "f").stat().st_size == len(payload))
        assert (tmp_path / "dir" / "f").read_bytes() == payload
        assert created and set(closed_on) == set(created)
        assert not any(closed_on.values()), "closed on the trio thread"
