"""The burst buffer's parts, each driven alone (no mount, no processes).

The tracker and the mirror run against a real in-memory store and a temporary
DIR; timing (the write-back delay, back-off, ticket expiry) runs on trio's
``autojump_clock`` with the clock injected, so a 5-second delay takes
milliseconds.  The mount-level behaviour is tested in tests/mount/.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from memfs.backing.dirside import BackingDir
from memfs.backing.meta import BackedMeta
from memfs.backing.mirror import NamespaceMirror
from memfs.backing.ops import ErrorLog, NsKind, NsOp
from memfs.backing.status import BackingError, BackingStatus, TicketProgress
from memfs.backing.tickets import TICKET_TTL, WALK_STEP
from memfs.backing.tracker import ChangeTracker
from memfs.backing.writeback import GLIMPSES
from memfs.config import FlushConfig, PoolConfig
from memfs.data import DataEngine
from memfs.errors import FsError
from memfs.meta.store import MetaStore
from memfs.scrub import Scrubber
from memfs.transport.local import LocalTransport

K, M = 1 << 10, 1 << 20
POOL = PoolConfig(size=8 * M, volumes=2, stripe_size=128 * K, chunk_size=64 * K)
ROOT = 1
REG, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755


# -- the tracker: versions, dirty chunks, namespace operations ------------------------


def tracked(clock: list[float] | None = None) -> tuple[MetaStore, ChangeTracker, list[NsOp]]:
    store = MetaStore(POOL)
    ops: list[NsOp] = []
    t = [0.0] if clock is None else clock
    tracker = ChangeTracker(store, dirty_max=4 * M, delay=5.0, queue=ops.append,
                            touch=lambda ino: None, forget=lambda ino: None, clock=lambda: t[0])
    store.watcher = tracker
    return store, tracker, ops


async def test_tracker_versions_and_chunks() -> None:
    now = [10.0]
    store, tracker, _ = tracked(now)
    a = await store.mknod(ROOT, b"f", REG, 0, 0)
    v1 = tracker.version(a.ino)
    assert v1 > 0 and tracker.dirty[a.ino].since == 10.0
    now[0] = 11.0
    await store.map_write(a.ino, 0, 3 * 64 * K)  # chunks 0..2
    d = tracker.dirty[a.ino]
    assert d.chunks == {0, 1, 2} and tracker.dirty_chunks == 3
    assert tracker.version(a.ino) > v1 and d.since == 11.0
    await store.truncate(a.ino, 64 * K + 1)  # keeps chunks 0 and 1
    assert d.chunks == {0, 1} and tracker.dirty_chunks == 2
    tracker.clean(a.ino, v1)  # an old version: stays dirty
    assert a.ino in tracker.dirty
    tracker.clean(a.ino, tracker.version(a.ino))
    assert a.ino not in tracker.dirty and tracker.dirty_chunks == 0


async def test_tracker_namespace_operations_in_order_with_paths_of_their_moment() -> None:
    store, tracker, ops = tracked()
    d = await store.mknod(ROOT, b"d", DIR, 0, 0)
    await store.mknod(d.ino, b"ln", stat.S_IFLNK | 0o777, 0, 0, target=b"x")
    f = await store.mknod(d.ino, b"f", REG, 0, 0)
    await store.rename(d.ino, b"f", ROOT, b"g")
    await store.rename(ROOT, b"d", ROOT, b"e")
    await store.unlink(d.ino, b"ln")
    await store.rmdir(ROOT, b"e")
    assert [(o.kind, o.path, o.path2) for o in ops] == [
        (NsKind.MKDIR, b"d", b""),
        (NsKind.SYMLINK, b"d/ln", b""),
        (NsKind.RENAME, b"d/f", b"g"),
        (NsKind.RENAME, b"d", b"e"),
        (NsKind.UNLINK, b"e/ln", b""),
        (NsKind.RMDIR, b"e", b""),
    ]
    assert f.ino in tracker.dirty  # a regular file is written back, not mirrored


async def test_tracker_is_called_after_the_change_unlink_and_rename_alike() -> None:
    """One rule: the watcher sees the namespace after the change, including the
    destruction the change caused (destroyed first, then removed/renamed)."""
    store, tracker, ops = tracked()
    calls: list[str] = []
    real_destroyed, real_removed = tracker.destroyed, tracker.removed

    def destroyed(ino: int) -> None:
        calls.append("destroyed")
        real_destroyed(ino)

    def removed(parent: int, name: bytes, ino: int, directory: bool) -> None:
        calls.append(f"removed nlink={store.inodes[ino].nlink if ino in store.inodes else 'gone'}")
        real_removed(parent, name, ino, directory)

    tracker.destroyed = destroyed  # type: ignore[method-assign]
    tracker.removed = removed  # type: ignore[method-assign]
    a = await store.mknod(ROOT, b"a", REG, 0, 0)
    await store.unlink(ROOT, b"a")
    assert calls == ["destroyed", "removed nlink=gone"]
    assert a.ino not in tracker.dirty
    b = await store.mknod(ROOT, b"b", REG, 0, 0)
    await store.open(b.ino)
    calls.clear()
    await store.unlink(ROOT, b"b")  # open: not destroyed, link count already dropped
    assert calls == ["removed nlink=0"]
    assert ops[-1].kind is NsKind.UNLINK and ops[-1].path == b"b"


async def test_tracker_pins_excluded_trees() -> None:
    store, tracker, _ = tracked()
    d = await store.mknod(ROOT, b"scratch", DIR, 0, 0)
    await store.setxattr(d.ino, b"user.memfs.flush", b"off")
    f = await store.mknod(d.ino, b"f", REG, 0, 0)
    assert tracker.excluded(f.ino)
    tracker.clean(f.ino, tracker.version(f.ino))
    tracker.pinned.add(f.ino)
    await store.map_write(f.ino, 0, 64 * K)
    assert f.ino not in tracker.dirty  # pinned: not written back
    await store.removexattr(d.ino, b"user.memfs.flush")
    tracker.unpin()
    assert f.ino in tracker.dirty and tracker.dirty[f.ino].chunks == {0}


# -- the mirror: order, skips, retries --------------------------------------------------


async def test_mirror_applies_in_order_and_skips_what_dir_contradicts(tmp_path: Path) -> None:
    dirside = BackingDir(str(tmp_path), fsync=False)
    dirside.scan()  # DIR's identity, our temporary directory
    errors = ErrorLog()
    mirror = NamespaceMirror(dirside, errors)
    mirror.queue(NsOp(NsKind.MKDIR, b"a", mode=DIR))
    mirror.queue(NsOp(NsKind.UNLINK, b"never-written"))  # ENOENT: skipped
    mirror.queue(NsOp(NsKind.RENAME, b"a", b"b"))
    async with mirror.lock:
        await mirror.apply_all()
    assert (tmp_path / "b").is_dir() and not (tmp_path / "a").exists()
    assert mirror.applied == mirror.queued == 3 and not errors


async def test_mirror_keeps_a_failing_operation_and_retries(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    dirside = BackingDir(str(tmp_path), fsync=False)
    dirside.scan()
    errors = ErrorLog(wallclock=trio.current_time)
    mirror = NamespaceMirror(dirside, errors)
    fails = [2]
    real = dirside.apply

    def flaky(op: NsOp) -> None:
        if fails[0]:
            fails[0] -= 1
            raise OSError(errno.EIO, "I/O error")
        real(op)

    dirside.apply = flaky  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(mirror.run)
        mirror.queue(NsOp(NsKind.MKDIR, b"x", mode=DIR))
        mirror.queue(NsOp(NsKind.MKDIR, b"x/y", mode=DIR))
        start = trio.current_time()
        while mirror.applied < 2:  # noqa: ASYNC110 - the mirror signals nothing
            await trio.sleep(0.1)
        # two failures: back-off 1 s then 2 s (virtual), order kept
        assert trio.current_time() - start >= 3.0
        assert (tmp_path / "x" / "y").is_dir()
        assert not errors.entries()  # cleared once it worked
        nursery.cancel_scope.cancel()


# -- the whole, on an injected clock ----------------------------------------------------


@asynccontextmanager
async def backed(
    tmp_path: Path, settle: float = 0.0, **cfg: object
) -> AsyncIterator[tuple[BackedMeta, DataEngine]]:
    """*settle*: as an mds's (cluster mode: a copy this soon after a change may miss
    bytes still on their way)."""
    backing = tmp_path / "dir"
    backing.mkdir(exist_ok=True)  # noqa: ASYNC240 - a local mkdir
    transport = LocalTransport(POOL.volumes, POOL.size // POOL.volumes)
    store = MetaStore(POOL)
    Scrubber(store, transport)  # zeroes freed chunks on demand (reclaim), as a mount's does
    b = BackedMeta(store, transport,
                   FlushConfig(str(backing), fsync=False, **cfg),  # type: ignore[arg-type]
                   clock=trio.current_time, wallclock=trio.current_time, settle=settle)
    await b.load()
    async with trio.open_nursery() as nursery:
        await nursery.start(b.run)
        yield b, DataEngine(b, transport)
        nursery.cancel_scope.cancel()
    await b.close(math.inf)


def record_starts(b: BackedMeta) -> list[float]:
    """Times (on the injected clock) at which a worker starts copying a file: taken in
    the trio thread, so worker threads cannot move them."""
    starts: list[float] = []
    real = b.writeback.flush_one

    async def flush_one(*args: object) -> None:
        starts.append(trio.current_time())
        await real(*args)  # type: ignore[arg-type]

    b.writeback.flush_one = flush_one  # type: ignore[method-assign,assignment]
    return starts


async def settle(b: BackedMeta) -> None:
    """Until nothing is pending.  Small steps: with an autojump clock every idle wait
    for a worker thread advances the clock by one step."""
    while b.pending[0]:  # noqa: ASYNC110
        await trio.sleep(0.001)


async def test_a_copy_waits_the_settle_time_only_for_writes_not_known_landed(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Cluster mode: a copy begun within the settle time of a change is copied again
    after it (a write placed just before may not have landed), unless the mds knows
    every write placed so far has landed (``WriteBack.landed``)."""
    for landed in (False, True):
        (tmp_path / str(landed)).mkdir()
        async with backed(tmp_path / str(landed), settle=2.0, delay=0.5, workers=1) as (b, data):
            b.writeback.landed = lambda ino: landed  # noqa: B023 - used within the iteration
            starts = record_starts(b)
            a = await b.mknod(ROOT, b"f", REG, 0, 0)
            await data.write(a.ino, 0, b"x" * 1000)
            t0 = trio.current_time()
            await settle(b)
            took = [round(t - t0, 1) for t in starts]
            # (thread trips move the autojump clock on: "at" is "not before")
            if landed:
                assert took == [0.5], took
            else:
                assert len(took) == 2 and took[0] == 0.5 and took[1] >= 2.0, took


async def test_writers_waiting_have_the_writers_asked_rather_than_the_settle_time(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Cluster mode: a copy that someone waits for (here the daemon's exit) first has
    the file's writers confirm their bytes (``WriteBack.glimpse``, a recall), then
    is clean at once; a writer given room meanwhile is asked again, a few times at
    most, then the settle time is waited as before."""
    for confirmed_after in (1, 2, 10):
        (tmp_path / str(confirmed_after)).mkdir()
        async with backed(tmp_path / str(confirmed_after), settle=2.0, delay=60.0,
                          workers=1) as (b, data):
            asked = 0

            async def glimpse(ino: int) -> None:
                nonlocal asked
                asked += 1
                await trio.sleep(0.01)

            b.writeback.glimpse = glimpse
            b.writeback.landed = lambda ino: asked >= confirmed_after  # noqa: B023
            starts = record_starts(b)
            a = await b.mknod(ROOT, b"f", REG, 0, 0)
            await data.write(a.ino, 0, b"x" * 1000)
            t0 = trio.current_time()
            b.writeback.draining = True
            b.tracker.wake()
            await settle(b)
            took = [round(t - t0, 1) for t in starts]
            if confirmed_after <= GLIMPSES:
                assert asked == confirmed_after and took == [0.0], (asked, took)
            else:  # (at the settle time the next copy may ask once more: float rounding)
                assert GLIMPSES <= asked <= GLIMPSES + 1, asked
                assert len(took) == 2 and took[0] == 0.0 and took[1] >= 2.0, took


async def test_written_back_after_the_delay_not_before(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with backed(tmp_path, delay=5.0, workers=1) as (b, data):
        starts = record_starts(b)
        a = await b.mknod(ROOT, b"f", REG, 0, 0)
        await data.write(a.ino, 0, b"x" * 1000)
        t0 = trio.current_time()
        await trio.sleep(4.9)
        assert not starts and not (tmp_path / "dir" / "f").exists()
        await settle(b)
        assert len(starts) == 1 and 5.0 <= starts[0] - t0 < 5.1, starts
        assert (tmp_path / "dir" / "f").read_bytes() == b"x" * 1000


async def test_flush_ticket_is_immediate_and_tickets_expire(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with backed(tmp_path, delay=3600.0, workers=1) as (b, data):
        starts = record_starts(b)
        a = await b.mknod(ROOT, b"f", REG, 0, 0)
        await data.write(a.ino, 0, b"y" * 100 * K)
        t0 = trio.current_time()
        ticket = (await b.control("flush", {"paths": ["f"]}))["ticket"]
        p = TicketProgress.from_json(await b.control("progress", {"ticket": ticket}))
        assert p.total_files == 1 and p.total_bytes == 2 * 64 * K
        while not p.done:
            await trio.sleep(0.05)
            p = TicketProgress.from_json(await b.control("progress", {"ticket": ticket}))
        assert starts and starts[0] - t0 < 0.1  # at once, not after the hour's delay
        assert (tmp_path / "dir" / "f").read_bytes() == b"y" * 100 * K
        await trio.sleep(TICKET_TTL + 1)
        with pytest.raises(Exception, match="no ticket"):
            await b.control("progress", {"ticket": ticket})


async def test_failed_copy_backs_off_and_is_shown(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with backed(tmp_path, delay=0.0, workers=1) as (b, data):
        starts = record_starts(b)
        real = b.dirside.publish
        fails = [3]

        def failing(*args: object) -> None:
            if fails[0]:
                fails[0] -= 1
                raise OSError(errno.ENOSPC, "No space left on device")
            real(*args)  # type: ignore[arg-type]

        b.dirside.publish = failing  # type: ignore[method-assign,assignment]
        a = await b.mknod(ROOT, b"f", REG, 0, 0)
        await data.write(a.ino, 0, b"z" * 10)
        while not (st := await b.status()).errors or st.errors[0].count < 2:  # noqa: ASYNC110
            await trio.sleep(0.001)
        assert st.dirty_files == 1
        assert [(e.path, e.error, e.count) for e in st.errors] == [
            ("f", "write back: No space left on device", 2)]
        await settle(b)
        # back-off between attempts: at least 1 s, 2 s, 4 s (0.5 * 2**failures), not a
        # spin (the autojump clock may add a little while worker threads run)
        gaps = [b2 - a2 for a2, b2 in zip(starts, starts[1:], strict=False)]
        # (less a rounding error: differences of clock readings, 1.9999999999999998)
        assert len(starts) == 4 and all(g >= want - 1e-9 for g, want in zip(gaps, (1, 2, 4), strict=True)), gaps
        assert (tmp_path / "dir" / "f").read_bytes() == b"z" * 10
        assert not (await b.status()).errors


async def test_small_files_go_back_in_batches_each_on_its_own(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Small files are written and published a batch per DIR thread trip, but each
    stays its own: one whose rename fails is retried alone, one changed after its
    copy was read is copied again, one unlinked meanwhile is not written, a large
    one goes on its own; every file in DIR ends up exactly as in the pool."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with backed(tmp_path, delay=1.0, workers=2) as (b, data):
        trips: list[int] = []
        real_each = b.dirside.publish_each

        def publish_each(pairs: list[tuple[bytes, list[bytes]]]) -> list[OSError | None]:
            trips.append(len(pairs))
            return real_each(pairs)

        real_publish = b.dirside.publish
        fails = [1]

        def publish(tmp: bytes, paths: list[bytes], dirs: object) -> None:
            if paths == [b"f7"] and fails[0]:
                fails[0] -= 1
                raise OSError(errno.EIO, "Input/output error")
            real_publish(tmp, paths, dirs)  # type: ignore[arg-type]

        b.dirside.publish_each = publish_each  # type: ignore[method-assign]
        b.dirside.publish = publish  # type: ignore[method-assign]
        real_write = b.dirside.write_whole
        changed = threading.Event()
        ino: dict[str, int] = {}

        def write_whole(tmp: bytes, *args: object) -> None:
            real_write(tmp, *args)  # type: ignore[arg-type]
            if os.path.basename(tmp).startswith(b"%d." % ino["f3"]):
                changed.set()

        b.dirside.write_whole = write_whole  # type: ignore[method-assign,assignment]
        want: dict[str, bytes] = {}
        for n in range(40):
            a = await b.mknod(ROOT, f"f{n}".encode(), REG, 0, 0)
            ino[f"f{n}"] = a.ino
            want[f"f{n}"] = bytes([n]) * (1000 + 97 * n)
            await data.write(a.ino, 0, want[f"f{n}"])
        big = await b.mknod(ROOT, b"big", REG, 0, 0)
        want["big"] = b"B" * (600 * K)
        await data.write(big.ino, 0, want["big"])
        await b.unlink(ROOT, b"f5")
        del want["f5"]
        await trio.sleep(1.0)  # all due now
        assert await trio.to_thread.run_sync(changed.wait, 60.0)  # real seconds
        want["f3"] = b"changed after its copy was written"
        await data.truncate(ino["f3"], 0)
        await data.write(ino["f3"], 0, want["f3"])
        await settle(b)
        found = {p.name: p.read_bytes() for p in (tmp_path / "dir").iterdir() if p.is_file()}
        assert found == want
        assert max(trips) > 1, trips  # batches did happen
        assert not fails[0]
        st = await b.status()
        assert st.dirty_files == 0 and not st.errors


async def test_eviction_least_recently_used_first_and_staged_spared(tmp_path: Path) -> None:
    backing = tmp_path / "dir"
    backing.mkdir()
    for name in ("old", "mid", "new"):
        (backing / name).write_bytes(name.encode() * (M // len(name)))
    async with backed(tmp_path, delay=0.0, workers=1) as (b, data):
        ino = {n: b.store.resolve(n.encode()).ino for n in ("old", "mid", "new")}
        for n in ("old", "mid", "new"):  # fetched in this order: LRU order
            assert await data.read(ino[n], 0, 3) == n.encode()[:3]
        tid = await b.tickets.stage_in([ino["old"]])  # staged: spared while others can go
        b.residency.touch(ino["mid"])
        assert await b.residency.evict(1)
        chunks = {n: len(b.store.inodes[i].chunks or ()) for n, i in ino.items()}
        assert chunks["new"] == 0 and chunks["old"] and chunks["mid"], chunks
        with trio.fail_after(30):
            while not b.tickets.progress(tid).done:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert not b.store.missing(ino["old"], 0, M)  # staged whole


async def test_files_in_use_by_a_transfer_are_not_evicted(tmp_path: Path) -> None:
    """meta.io() (held by memfs.array across a whole transfer, outside this process)
    keeps a file's chunks from being evicted under it."""
    backing = tmp_path / "dir"
    backing.mkdir()
    for name in ("a", "b"):
        (backing / name).write_bytes(name.encode() * M)
    async with backed(tmp_path, delay=0.0, workers=1) as (b, data):
        ino = {n: b.store.resolve(n.encode()).ino for n in ("a", "b")}
        for n in ("a", "b"):
            assert await data.read(ino[n], 0, 1) == n.encode()
        with b.io(ino["a"]):
            assert await b.residency.evict(1 << 20)  # everything it may: only b
            assert b.store.inodes[ino["a"]].chunks and not b.store.inodes[ino["b"]].chunks
        assert await b.residency.evict(1 << 20)
        assert not b.store.inodes[ino["a"]].chunks


async def pin_full(b: BackedMeta, data: DataEngine, chunks: int) -> None:
    """Fill *chunks* of the pool with data that can never be evicted: files in a tree
    excluded from write-back (``user.memfs.flush=off``), pinned."""
    d = await b.mknod(ROOT, b"scratch", DIR, 0, 0)
    await b.setxattr(d.ino, b"user.memfs.flush", b"off")
    inos = []
    for n in range(-(-chunks // 16)):
        f = await b.mknod(d.ino, b"p%d" % n, REG, 0, 0)
        await data.write(f.ino, 0, b"p" * min(M, (chunks - 16 * n) * 64 * K))
        inos.append(f.ino)
    with trio.fail_after(30):
        while not b.tracker.pinned.issuperset(inos):  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert not b.tracker.dirty


async def test_evictions_at_once_do_not_fail_each_other(tmp_path: Path) -> None:
    """Two fetches finding the pool full at once both get room.  They used to evict
    together: both chose the same least recently used files, the first freed them
    while the second waited for their readers to let go (cluster: a recall), and
    the second, finding them gone, answered ENOSPC to a read."""
    backing = tmp_path / "dir"
    backing.mkdir()
    names = [f"f{n}" for n in range(8)] + ["x", "y"]
    for name in names:  # 8 MiB: the pool's size
        (backing / name).write_bytes(name.encode() * (M // len(name)))
    async with backed(tmp_path, delay=0.0, workers=1) as (b, data):
        ino = {n: b.store.resolve(n.encode()).ino for n in names}
        for n in names[:8]:
            await data.read(ino[n], 0, M)  # the pool is full of clean data
        assert b.store.space.totals()[1] == 0

        async def recall(victims: list[int]) -> None:
            await trio.sleep(0.1)  # clients letting go of cached maps take a while

        b.residency.before_evict = recall
        got: dict[str, bytes] = {}

        async def read(n: str) -> None:
            got[n] = bytes(await data.read(ino[n], 0, M))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, "x")
            nursery.start_soon(read, "y")
        assert got == {"x": b"x" * M, "y": b"y" * M}


async def test_a_fetch_waits_for_room_another_fetch_is_about_to_make(tmp_path: Path) -> None:
    """Nothing is evictable while the only clean data is still being fetched (reserved,
    not installed): a second fetch waits for it instead of answering ENOSPC."""
    backing = tmp_path / "dir"
    backing.mkdir()
    for name in ("a", "b"):
        (backing / name).write_bytes(name.encode() * M)
    async with backed(tmp_path, delay=0.0, workers=1, dirty_max=8 * M) as (b, data):
        await pin_full(b, data, 128 - 16)  # room for one STEP of a fetch
        ino = {n: b.store.resolve(n.encode()).ino for n in ("a", "b")}
        gate = trio.Event()
        real = b.residency.transport.write

        async def slow_write(vol: int, voff: int, buf: memoryview) -> None:
            await gate.wait()  # "a" has reserved all the room, and is transferring
            await real(vol, voff, buf)

        b.residency.transport.write = slow_write  # type: ignore[method-assign,assignment]
        got: dict[str, bytes] = {}

        async def read(n: str) -> None:
            got[n] = bytes(await data.read(ino[n], 0, M))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, "a")
            with trio.fail_after(5):
                while not b.store.reserved:  # noqa: ASYNC110
                    await trio.sleep(0.001)
            nursery.start_soon(read, "b")
            await trio.sleep(1)  # "b" found no room, nothing to evict, and waits
            assert not got
            gate.set()
        assert got == {"a": b"a" * M, "b": b"b" * M}
        assert not b.store.inodes[ino["a"]].chunks  # evicted to make room for "b"


async def test_a_fetch_outlived_by_a_rewrite_and_eviction_installs_nothing(
    tmp_path: Path,
) -> None:
    """A fetch not held by a transfer (stage-in; a cluster mds fetching for a client)
    that waits between reading DIR and installing, while the file is truncated,
    rewritten, written back and evicted, must not install what it read: DIR has the
    new bytes by then, and the old ones would be served as the file's."""
    backing = tmp_path / "dir"
    backing.mkdir()
    (backing / "f").write_bytes(b"1" * 4 * 64 * K)
    async with backed(tmp_path, delay=0.0, workers=1) as (b, data):
        ino = b.store.resolve(b"f").ino
        gate = trio.Event()
        real = b.residency.transport.write

        async def slow_write(vol: int, voff: int, buf: memoryview) -> None:
            await gate.wait()  # the fetch has read DIR and reserved its chunks
            await real(vol, voff, buf)

        b.residency.transport.write = slow_write  # type: ignore[method-assign,assignment]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.residency.ensure_resident, ino, 0, 4 * 64 * K)
            with trio.fail_after(5):
                while not b.store.reserved:  # noqa: ASYNC110
                    await trio.sleep(0.001)
            b.residency.transport.write = real  # type: ignore[method-assign]
            await data.truncate(ino, 0)
            await data.write(ino, 0, b"2" * 4 * 64 * K)
            await settle(b)
            assert (backing / "f").read_bytes() == b"2" * 4 * 64 * K
            assert await b.residency.evict(1 << 20)
            assert not b.store.inodes[ino].chunks
            gate.set()
        assert bytes(await data.read(ino, 0, 4 * 64 * K)) == b"2" * 4 * 64 * K


async def test_a_pool_full_for_good_answers_enospc_at_once(tmp_path: Path) -> None:
    """Nothing evictable and nothing in flight: ENOSPC without waiting, nothing lost."""
    backing = tmp_path / "dir"
    backing.mkdir()
    (backing / "a").write_bytes(b"a" * M)
    async with backed(tmp_path, delay=0.0, workers=1, dirty_max=8 * M) as (b, data):
        await pin_full(b, data, 128)
        a = b.store.resolve(b"a").ino
        start = trio.current_time()
        with pytest.raises(FsError) as exc:
            await data.read(a, 0, M)
        assert exc.value.errno == errno.ENOSPC
        assert trio.current_time() - start < 1  # autojump: a wait would show as time
        assert (backing / "a").read_bytes() == b"a" * M


async def test_room_waited_for_in_vain_is_not_waited_for_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Room that write-back would make but does not (a hung DIR): the first call waits
    ``ROOM_WAIT``, and later ones, made while still nothing moved (a cluster client
    asking again), answer ENOSPC at once instead of waiting as long again."""
    monkeypatch.setattr("memfs.backing.residency.ROOM_WAIT", 1.0)
    backing = tmp_path / "dir"
    backing.mkdir()
    (backing / "a").write_bytes(b"a" * M)
    async with backed(tmp_path, delay=0.0, workers=1, dirty_max=8 * M) as (b, data):
        hung = trio.Event()

        async def flush_one(*args: object) -> None:
            await hung.wait()  # write-back stuck in DIR: never fails, never finishes

        b.writeback.flush_one = flush_one  # type: ignore[method-assign,assignment]
        f = await b.mknod(ROOT, b"f", REG, 0, 0)
        await data.write(f.ino, 0, b"f" * 8 * M)  # the whole pool, dirty
        a = b.store.resolve(b"a").ino
        start = trio.current_time()
        for _ in range(3):
            with pytest.raises(FsError) as exc:
                await data.read(a, 0, M)
            assert exc.value.errno == errno.ENOSPC
        assert 1.0 <= trio.current_time() - start < 1.5
        hung.set()


async def test_space_ahead_and_write_lease_reports_count_as_dirty(tmp_path: Path) -> None:
    """A cluster writer holding a write lease fills space given ahead, and overwrites
    its chunks, without asking: space ahead counts as dirty when given, and only as
    much as the dirty cap has room for beside the write; each report of the writer
    (``settle``) makes a new version of the file to write back, its size and mtime
    unchanged or not."""
    async with backed(tmp_path, delay=3600.0, workers=1, dirty_max=2 * M) as (b, data):
        f = await b.mknod(ROOT, b"f", REG, 0, 0)
        cs = 64 * K
        ahead = b.ahead_room(0, cs, 8 * M)
        assert ahead == 2 * M - cs
        await b.allocate_ahead(f.ino, 0, cs, ahead)
        assert b.tracker.dirty_chunks * cs == 2 * M
        assert len(b.store.inodes[f.ino].chunks or ()) == 2 * M // cs
        assert b.ahead_room(cs, cs, 8 * M) == 0  # the cap is full
        version = b.tracker.dirty[f.ino].version
        mtime = b.store.inodes[f.ino].mtime_ns
        b.store.settle_now(f.ino, cs, mtime, False, (0, 0))  # nothing written under it
        assert b.tracker.dirty[f.ino].version == version
        b.store.settle_now(f.ino, cs, mtime, False, (100, 200))  # an overwrite
        assert b.tracker.dirty[f.ino].version > version
        version = b.tracker.dirty[f.ino].version
        b.store.settle_now(f.ino, cs, mtime, False)  # a registration: not said where
        assert b.tracker.dirty[f.ino].version > version
        # At the end of the lease what was not written is freed, and counts no more.
        b.store.settle_now(f.ino, cs, 0, True)
        assert list(b.store.inodes[f.ino].chunks or ()) == [0]
        assert b.tracker.dirty_chunks == 1


async def test_a_small_rewrite_of_a_large_file_counts_what_it_wrote(tmp_path: Path) -> None:
    """A write lease's report says which bytes it covers: 4 KiB rewritten in a clean
    4 MiB file count one chunk against the dirty cap, not the file (which would hold
    every other writer at a small cap for as long as the rewriting goes on)."""
    async with backed(tmp_path, delay=0.0, workers=1, dirty_max=2 * M) as (b, data):
        f = await b.mknod(ROOT, b"f", REG, 0, 0)
        await data.write(f.ino, 0, b"f" * 4 * M)
        await settle(b)
        assert not b.tracker.dirty
        b.tracker.delay = 3600.0  # stays dirty now
        b.store.settle_now(f.ino, 4 * M, b.store.inodes[f.ino].mtime_ns, False, (0, 4096))
        assert b.tracker.dirty_chunks == 1


async def test_the_mirror_keeping_a_file_does_not_wait_for_write_back(tmp_path: Path) -> None:
    """The mirror fetches a file it must keep under its lock, which write-back needs to
    publish: waiting there for write-back to make room would only stall both."""
    backing = tmp_path / "dir"
    backing.mkdir()
    (backing / "a").write_bytes(b"a" * M)
    async with backed(tmp_path, delay=3600.0, workers=1, dirty_max=8 * M) as (b, data):
        f = await b.mknod(ROOT, b"f", REG, 0, 0)
        await data.write(f.ino, 0, b"f" * 8 * M)  # dirty (an hour's delay), the whole pool
        a = b.store.resolve(b"a").ino
        start = trio.current_time()
        async with b.mirror.lock:
            with pytest.raises(FsError) as exc:
                await b.residency.ensure_resident(a, 0, M, b"a")  # as keep() does
        assert exc.value.errno == errno.ENOSPC
        assert trio.current_time() - start < 1


async def test_dirty_cap_holds_writers_until_write_back(tmp_path: Path) -> None:
    """(Real clock: the write-back that makes room runs in worker threads, and an
    autojump clock would jump past any deadline while they work.)"""
    async with backed(tmp_path, delay=3600.0, workers=1, dirty_max=256 * K) as (b, data):
        a = await b.mknod(ROOT, b"f", REG, 0, 0)
        await data.write(a.ino, 0, b"a" * 256 * K)  # up to the cap
        assert b.tracker.dirty_chunks == 4
        done = trio.Event()

        async def writer() -> None:
            await data.write(a.ino, 256 * K, b"b" * 64 * K)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            # past the cap: written back at once (no hour's delay), then the writer goes on
            with trio.fail_after(30):
                await done.wait()
        assert (tmp_path / "dir" / "f").stat().st_size >= 256 * K


# -- the typed status -------------------------------------------------------------------


def test_status_round_trip_and_tolerance() -> None:
    st = BackingStatus(backing="/x", capacity=10, dirty_files=2, flush_rate=1.5, draining=True,
                       errors=(BackingError("p", "write back: EIO", 3, 12.0),))
    assert BackingStatus.from_json(st.to_json()) == st
    odd = {"capacity": "lots", "dirty_files": 2.0, "draining": 1, "errors": [{"path": 5}, "x"],
           "flush_rate": float("nan"), "unknown": 1}
    got = BackingStatus.from_json(odd)
    assert got.capacity == 0 and got.dirty_files == 2 and got.draining is False
    assert got.flush_rate == 0.0 and got.errors == (BackingError("5", ""),)
    assert BackingStatus.from_json(None) == BackingStatus()
    gauges = st.gauges("m")
    assert gauges["m_capacity"] == 10.0 and "m_draining" not in gauges and "m_backing" not in gauges


def test_progress_json_keys_are_those_the_cli_reads() -> None:
    p = TicketProgress(done=True, files=1, bytes=2, total_files=3, total_bytes=4,
                       failed=(BackingError("a", "why"),))
    j = p.to_json()
    assert j["failed"] == [{"path": "a", "error": "why"}] and j["errors"] == []
    assert TicketProgress.from_json(j) == p




async def test_whole_tree_walks_let_other_tasks_run(tmp_path: Path) -> None:
    """``memfs status`` and flush/stage-in tickets walk every inode of a tree: on a
    big tree they must let FUSE requests and client calls in between."""
    async with backed(tmp_path, delay=3600.0, workers=1) as (b, _):
        d = await b.mknod(ROOT, b"d", DIR, 0, 0)
        for n in range(3 * WALK_STEP):
            await b.mknod(d.ino, b"f%d" % n, REG, 0, 0)
        ran = 0

        async def other() -> None:
            nonlocal ran
            while True:
                ran += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.lowlevel.checkpoint()
            for call in (b.status(), b.control("flush", {"paths": ["d"]}),
                         b.control("stage_in", {"paths": ["d"]})):
                before = ran
                await call
                assert ran > before
            nursery.cancel_scope.cancel()


class GateRecorder:
    """A journal whose records become durable only when the test says so."""

    journaled = False

    def __init__(self) -> None:
        self.open = trio.Event()
        self.waiting = trio.Event()

    def note(self, kind: str, args: list[object]) -> None:
        pass

    async def durable(self) -> None:
        if not self.open.is_set():
            self.waiting.set()
            await self.open.wait()


async def test_copy_lands_at_the_path_the_file_has_after_the_durable_wait(tmp_path: Path) -> None:
    """A rename queued while a worker waits for the journal (holding the namespace
    lock) is applied before the copy is published: DIR must not get the new version
    at the new name and then the old version renamed over it."""
    async with backed(tmp_path, delay=3600.0, workers=1) as (b, data):
        a = await b.mknod(ROOT, b"a", REG, 0, 0)
        await data.write(a.ino, 0, b"old")
        ticket = (await b.control("flush", {}))["ticket"]
        with trio.fail_after(30):
            while not b.tickets.progress(ticket).done:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert (tmp_path / "dir" / "a").read_bytes() == b"old"
        gate = GateRecorder()
        b.mirror.recorder = gate
        await data.write(a.ino, 0, b"new")
        ticket = (await b.control("flush", {}))["ticket"]
        with trio.fail_after(30):
            await gate.waiting.wait()  # the worker holds the lock, copy made
        await b.rename(ROOT, b"a", ROOT, b"b")
        gate.open.set()
        with trio.fail_after(30):
            while not b.tickets.progress(ticket).done:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert not (tmp_path / "dir" / "a").exists()
        assert (tmp_path / "dir" / "b").read_bytes() == b"new"


async def test_a_dir_call_given_up_under_the_lock_is_not_made_twice(tmp_path: Path) -> None:
    """A client's call that applies the queue gives up (its deadline) while a
    RENAME_EXCHANGE runs in DIR: the next holder of the lock waits for that rename
    to end and does not apply it again (which would swap the files back)."""
    backing = tmp_path / "dir"
    backing.mkdir()
    (backing / "x").write_bytes(b"X")
    (backing / "y").write_bytes(b"Y")
    async with backed(tmp_path, delay=3600.0, workers=1) as (b, _):
        await b.rename(ROOT, b"x", ROOT, b"y", 2)  # RENAME_EXCHANGE
        release = threading.Event()
        calls = []
        real = b.dirside.apply

        def slow_apply(op: NsOp) -> None:
            calls.append(op.kind)
            release.wait(30)
            real(op)

        b.dirside.apply = slow_apply  # type: ignore[method-assign]
        with trio.move_on_after(0.2):  # a client's call past its deadline
            async with b.mirror.lock:
                await b.mirror.apply_all()
        assert calls == [NsKind.EXCHANGE] and len(b.mirror.ops) == 1

        async def next_holder() -> None:
            async with b.mirror.lock:
                await b.mirror.apply_all()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(next_holder)
            await trio.sleep(0.2)
            assert calls == [NsKind.EXCHANGE]  # waits: does not apply it again
            release.set()
        assert calls == [NsKind.EXCHANGE] and not b.mirror.ops
        assert (backing / "x").read_bytes() == b"Y" and (backing / "y").read_bytes() == b"X"


async def test_a_sparse_span_counts_only_chunks_that_exist(tmp_path: Path) -> None:
    """A write lease's span is the hull of its writes: two writes far apart (one at
    64 GiB) count the chunks they wrote, not the million between them."""
    async with backed(tmp_path, delay=3600.0, workers=1) as (b, data):
        f = await b.mknod(ROOT, b"f", REG, 0, 0)
        await data.write(f.ino, 0, b"a" * 4096)
        await data.write(f.ino, 64 << 30, b"b" * 4096)
        assert b.tracker.dirty_chunks == 2
        b.store.settle_now(f.ino, (64 << 30) + 4096, 0, False, (0, (64 << 30) + 4096))
        assert b.tracker.dirty_chunks == 2


async def test_a_hole_punched_over_data_only_in_dir(tmp_path: Path) -> None:
    """Below what DIR holds a missing chunk is read from DIR: a hole in the middle
    fetches its edges and gives the chunks inside clean ones (zeros); a hole that
    reaches the end of DIR's copy lowers that end instead, fetching nothing inside
    it, so a hole larger than the pool needs no room (found by a review: it
    fetched the whole range, for ever when it did not fit)."""
    backing = tmp_path / "dir"
    backing.mkdir()
    cs = POOL.chunk_size
    (backing / "f").write_bytes(b"1" * 8 * cs)
    (backing / "g").write_bytes(b"1" * 8 * cs)
    (backing / "big").write_bytes(b"x" * (POOL.size + 4 * M))
    async with backed(tmp_path, delay=0.0, workers=1) as (b, data):
        ino = b.store.resolve(b"f").ino
        await data.punch(ino, cs + 10, 4 * cs - 10)  # edge: chunk 1; inside: 2, 3, 4
        i = b.store.inodes[ino]
        assert sorted(i.chunks or {}) == [1, 2, 3, 4] and i.backed == 8 * cs
        want = b"1" * (cs + 10) + bytes(4 * cs - 10) + b"1" * 3 * cs
        assert bytes(await data.read(ino, 0, 8 * cs)) == want
        await settle(b)
        assert (backing / "f").read_bytes() == want
        g = b.store.resolve(b"g").ino
        await data.punch(g, 6 * cs + 5, 4 * cs)  # to the end: backed lowered, chunk 6 fetched
        assert b.store.inodes[g].backed == 6 * cs + 5 and sorted(b.store.inodes[g].chunks or {}) == [6]
        want = b"1" * (6 * cs + 5) + bytes(2 * cs - 5)
        assert bytes(await data.read(g, 0, 8 * cs)) == want
        await settle(b)
        assert (backing / "g").read_bytes() == want

        big = b.store.resolve(b"big").ino
        with trio.fail_after(10):
            await data.punch(big, 0, POOL.size + 4 * M)
        assert b.store.inodes[big].backed == 0 and not b.store.inodes[big].chunks
        await settle(b)
        assert os.stat(backing / "big").st_size == POOL.size + 4 * M
        assert (backing / "big").read_bytes() == bytes(POOL.size + 4 * M)


async def test_a_hole_in_a_file_read_whole_from_dir_frees_its_chunks(tmp_path: Path) -> None:
    """A file staged from DIR and read whole has nothing left to read there: a hole
    in its middle frees the chunks inside (``backed`` drops to 0) instead of
    zeroing them (found by a review)."""
    cs = POOL.chunk_size
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "f").write_bytes(b"1" * 8 * cs)
    async with backed(tmp_path, delay=0.0, workers=1) as (b, data):
        ino = b.store.resolve(b"f").ino
        assert bytes(await data.read(ino, 0, 8 * cs)) == b"1" * 8 * cs
        await data.punch(ino, cs, 2 * cs)
        i = b.store.inodes[ino]
        assert i.backed == 0 and sorted(i.chunks or {}) == [0, 3, 4, 5, 6, 7]
        assert bytes(await data.read(ino, 0, 8 * cs)) == b"1" * cs + bytes(2 * cs) + b"1" * 5 * cs


async def test_a_hole_whose_edge_is_sealed_meanwhile_changes_nothing(tmp_path: Path) -> None:
    """The clean chunks a hole over DIR-only data needs are installed with the punch,
    not before: an edge whose memory server is being taken back meanwhile (sealed)
    fails the punch with EIO and leaves no zeros where DIR has data (found by a
    review)."""
    cs = POOL.chunk_size
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "f").write_bytes(b"1" * 8 * cs)
    async with backed(tmp_path, delay=0.0, workers=1) as (b, data):
        ino = b.store.resolve(b"f").ino
        i = b.store.inodes[ino]
        real = b.residency.with_room

        async def with_room(fn: Any, protect: int = 0) -> Any:
            got = await real(fn, protect)
            if "_hole_ready" in fn.__qualname__:  # the inside's chunks: the edges are in
                assert i.layout is not None
                b.store.placement.sealed.add(i.layout.volume_of_chunk(1, cs))
            return got

        b.residency.with_room = with_room  # type: ignore[method-assign]
        before = b.store.space.totals()
        with pytest.raises(FsError) as info:
            await data.punch(ino, cs + 10, 4 * cs)  # edges 1 and 5; inside: 2, 3, 4
        assert info.value.errno == errno.EIO
        b.store.placement.sealed.clear()
        b.residency.with_room = real  # type: ignore[method-assign]
        # Only the edges were taken (fetched); the inside's clean chunks went back.
        assert sorted(i.chunks or {}) == [1, 5]
        assert b.store.space.totals() == (before[0], before[1] - 2)
        assert bytes(await data.read(ino, 0, 8 * cs)) == b"1" * 8 * cs
