"""The data engine over the real metadata store and local transport, in-process.

Pool memory is reused without clearing, so every test here starts from a pool
that a previous file filled with 0xFF and then gave back: any byte that is not
zeroed (freed chunks the scrubber must clear before reuse, truncated tails,
holes) shows up as 0xFF instead of passing by luck on never-used memory.
"""

from __future__ import annotations

import contextlib
import errno
import math
import random
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import trio
import trio.testing

from memfs.config import PoolConfig
from memfs.data import DataEngine
from memfs.errors import FsError, TransportError
from memfs.layout import LAYOUT_XATTR
from memfs.meta import Extent, Meta, WritePlan
from memfs.meta.store import MetaStore
from memfs.scrub import Scrubber
from memfs.transport import Buffer, Posted, Transport, VolumeInfo
from memfs.transport.local import LocalTransport

K = 1 << 10
ROOT = 1
# Small chunks and stripes so that modest files cross many chunks and all volumes.
POOL = PoolConfig(size=4 << 20, volumes=4, stripe_size=16 * K, chunk_size=4 * K)
POOL_BYTES = POOL.volume_size * POOL.volumes


async def create(meta: Meta, name: bytes) -> int:
    return (await meta.mknod(ROOT, name, stat.S_IFREG | 0o644, 0, 0)).ino


async def read(engine: DataEngine, ino: int, offset: int, length: int) -> bytes:
    # The engine may return a view of volume memory: copy before the next await.
    return bytes(await engine.read(ino, offset, length))


async def dirty_pool(engine: DataEngine) -> None:
    """Fill every chunk of the pool with 0xFF through a file, then free it all."""
    ino = await create(engine.meta, b"dirt")
    await engine.write(ino, 0, b"\xff" * POOL_BYTES)
    assert (await engine.meta.statfs()).blocks_free == 0
    assert await read(engine, ino, POOL_BYTES - 10, 10) == b"\xff" * 10
    await engine.meta.unlink(ROOT, b"dirt")
    s = await engine.meta.statfs()
    assert s.blocks_free == s.blocks


@pytest.fixture
async def engine() -> AsyncIterator[DataEngine]:
    meta = MetaStore(POOL)
    transport = LocalTransport(POOL.volumes, POOL.volume_size)
    Scrubber(meta, transport)  # on demand only (Meta.reclaim): no background task here
    eng = DataEngine(meta, transport)
    await dirty_pool(eng)
    try:
        yield eng
    finally:
        await meta.aclose()
        await transport.aclose()


async def test_random_ops_match_a_model(engine: DataEngine) -> None:
    rng = random.Random(20240611)
    ino = await create(engine.meta, b"f")
    model = bytearray()
    span = 96 * K  # ~24 chunks over 4 volumes: plenty of overlap, holes and re-use
    for step in range(600):
        op = rng.random()
        if op < 0.5:
            off = rng.randrange(span)
            n = rng.choice([1, rng.randrange(1, 100), rng.randrange(1, 20 * K)])
            data = rng.randbytes(n)
            assert await engine.write(ino, off, data) == n
            if off > len(model):
                model.extend(bytes(off - len(model)))
            model[off : off + n] = data
        elif op < 0.6:
            size = rng.randrange(span + 8 * K)
            await engine.truncate(ino, size)
            if size < len(model):
                del model[size:]
            else:
                model.extend(bytes(size - len(model)))
        else:
            off = rng.randrange(span + 4 * K)
            n = rng.randrange(1, 24 * K)
            assert await read(engine, ino, off, n) == bytes(model[off : off + n]), step
        assert (await engine.meta.getattr(ino)).size == len(model), step
    assert await read(engine, ino, 0, len(model) + 1) == bytes(model)


async def test_reads_across_holes_extents_and_eof(engine: DataEngine) -> None:
    cs = POOL.chunk_size
    ino = await create(engine.meta, b"f")
    a, b = random.Random(1).randbytes(5000), random.Random(2).randbytes(100)
    await engine.write(ino, 0, a)
    await engine.write(ino, 40 * K, b)
    size = 40 * K + 100
    expected = a + bytes(40 * K - 5000) + b
    assert await read(engine, ino, 0, 1 << 20) == expected
    assert await read(engine, ino, 4000, 2000) == expected[4000:6000]  # data then zeros
    assert await read(engine, ino, 3 * cs, 2 * cs) == bytes(2 * cs)  # only a hole
    assert await read(engine, ino, 10, 100) == a[10:110]  # one extent
    assert await read(engine, ino, 40 * K - 7, 50) == expected[-107:-57]  # hole then data
    assert await read(engine, ino, size - 1, 10) == b[-1:]
    assert await read(engine, ino, size, 10) == b""
    assert await read(engine, ino, size + 5 * cs, 10) == b""
    assert await read(engine, ino, 0, 0) == b""


async def test_truncate_shrink_then_extend_reads_zeros(engine: DataEngine) -> None:
    ino = await create(engine.meta, b"f")
    await engine.write(ino, 0, b"\xaa" * (20 * K))
    await engine.truncate(ino, 5000)
    await engine.truncate(ino, 20 * K)
    assert await read(engine, ino, 0, 20 * K) == b"\xaa" * 5000 + bytes(20 * K - 5000)

    # Shrink, then write past the new EOF inside the same chunk: the gap is zeros.
    await engine.truncate(ino, 4100)
    await engine.write(ino, 7000, b"z")
    assert await read(engine, ino, 0, 8 * K) == b"\xaa" * 4100 + bytes(2900) + b"z"


async def test_no_stale_bytes_in_new_files(engine: DataEngine) -> None:
    """Every allocation below reuses a chunk that held 0xFF; only written bytes may
    be non-zero."""
    rng = random.Random(7)
    files = {}
    for name in (b"a", b"b", b"c"):
        files[name] = (await create(engine.meta, name), bytearray())
    for _ in range(60):
        name = rng.choice(list(files))
        ino, model = files[name]
        off = rng.randrange(200 * K)
        data = bytes([rng.randrange(1, 255)]) * rng.randrange(1, 3000)
        await engine.write(ino, off, data)
        if off > len(model):
            model.extend(bytes(off - len(model)))
        model[off : off + len(data)] = data
    for ino, model in files.values():
        got = await read(engine, ino, 0, len(model))
        assert b"\xff" not in got
        assert got == bytes(model)

    # A file pinned to one volume, written in small unaligned pieces.
    ino = await create(engine.meta, b"pinned")
    await engine.meta.setxattr(ino, LAYOUT_XATTR, b"stripe_count=1 stripe_offset=2")
    for off in (5, 3 * POOL.chunk_size + 7, 70_000):
        await engine.write(ino, off, b"x")
    got = await read(engine, ino, 0, 70_001)
    assert got.count(b"x") == 3 and got.count(0) == 70_001 - 3


async def test_zero_length_write(engine: DataEngine) -> None:
    ino = await create(engine.meta, b"f")
    assert await engine.write(ino, 50 * K, b"") == 0
    assert (await engine.meta.getattr(ino)).size == 0


# -- concurrency across volumes ------------------------------------------------------


class SlowTransport(Transport):
    """In-memory volumes where every request takes one (virtual) second.

    Records when each request ran, so a test can tell requests issued together
    from requests issued one after another.
    """

    def __init__(self, n_volumes: int, volume_size: int, concurrent: bool) -> None:
        self.concurrent = concurrent
        self._info = [VolumeInfo(i, volume_size, f"slow:{i}") for i in range(n_volumes)]
        self.mem = [bytearray(volume_size) for _ in range(n_volumes)]  # volumes start zeroed
        self.calls: list[tuple[str, int, float, float]] = []

    @property
    def volumes(self) -> list[VolumeInfo]:
        return self._info

    def register(self, size: int) -> memoryview:
        return memoryview(bytearray(size))

    async def _delay(self, op: str, volume: int) -> None:
        start = trio.current_time()
        await trio.sleep(1)
        self.calls.append((op, volume, start, trio.current_time()))

    async def read(self, volume: int, offset: int, length: int) -> Buffer:
        self.check_range(volume, offset, length)
        await self._delay("read", volume)
        return bytes(self.mem[volume][offset : offset + length])

    async def readinto(self, volume: int, offset: int, buf: memoryview) -> None:
        self.check_range(volume, offset, len(buf))
        await self._delay("read", volume)
        buf[:] = self.mem[volume][offset : offset + len(buf)]

    async def write(self, volume: int, offset: int, data: Buffer) -> None:
        src = memoryview(data).cast("B")
        self.check_range(volume, offset, len(src))
        await self._delay("write", volume)
        self.mem[volume][offset : offset + len(src)] = src

    async def zero(self, volume: int, offset: int, length: int) -> None:
        self.check_range(volume, offset, length)
        await self._delay("zero", volume)
        self.mem[volume][offset : offset + length] = bytes(length)

    async def aclose(self) -> None:
        pass


def slow_engine(concurrent: bool) -> tuple[DataEngine, SlowTransport]:
    pool = PoolConfig(size=4 << 20, volumes=4, stripe_size=4 * K, chunk_size=4 * K)
    transport = SlowTransport(pool.volumes, pool.volume_size, concurrent)
    return DataEngine(MetaStore(pool), transport), transport


async def timed(aw: Awaitable[object]) -> float:
    start = trio.current_time()
    await aw
    return trio.current_time() - start


async def test_multi_volume_io_is_concurrent(autojump_clock: trio.abc.Clock) -> None:
    engine, transport = slow_engine(concurrent=True)
    ino = await create(engine.meta, b"f")
    data = random.Random(3).randbytes(4 * 4 * K)

    # Aligned: one write per volume, nothing to zero.
    assert await timed(engine.write(ino, 0, data)) == pytest.approx(1)
    assert sorted(v for op, v, _, _ in transport.calls) == [0, 1, 2, 3]

    transport.calls.clear()
    start = trio.current_time()
    got = bytes(await engine.read(ino, 0, len(data)))
    assert trio.current_time() - start == pytest.approx(1)
    assert got == data
    assert sorted(v for op, v, _, _ in transport.calls if op == "read") == [0, 1, 2, 3]

    # Unaligned into fresh chunks: fresh chunks are clean already (scrub-on-free),
    # so the write is data only, one round trip across all volumes.
    transport.calls.clear()
    g = await create(engine.meta, b"g")
    assert await timed(engine.write(g, 100, data)) == pytest.approx(1)
    ops = sorted(op for op, _, _, _ in transport.calls)
    assert ops.count("zero") == 0 and ops.count("write") == 5
    start = trio.current_time()
    got = bytes(await engine.read(g, 0, 100 + len(data) + 10))
    assert trio.current_time() - start == pytest.approx(1)
    assert got == bytes(100) + data


async def test_non_concurrent_transport_is_used_serially(autojump_clock: trio.abc.Clock) -> None:
    """``concurrent=False`` promises nothing about overlap, so the engine must not overlap."""
    engine, transport = slow_engine(concurrent=False)
    ino = await create(engine.meta, b"f")
    data = random.Random(4).randbytes(4 * 4 * K)
    assert await timed(engine.write(ino, 100, data)) == pytest.approx(5)
    assert bytes(await engine.read(ino, 0, 100 + len(data))) == bytes(100) + data
    spans = sorted((s, e) for _, _, s, e in transport.calls)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


async def test_a_dead_volume_in_a_striped_transfer_is_one_transport_error(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Concurrent transfers to several volumes, one of which fails: the caller gets that
    TransportError (EIO at the FUSE boundary), not an exception group (which the
    boundary would log as an internal error)."""
    engine, transport = slow_engine(concurrent=True)
    ino = await create(engine.meta, b"f")
    await engine.write(ino, 0, b"a" * 16 * K)  # 4 stripes over 4 volumes

    async def dead(op: str, volume: int) -> None:
        await trio.sleep(1)
        if volume == 2:
            raise TransportError("memory server slow:2 is gone")

    transport._delay = dead  # type: ignore[method-assign]
    with pytest.raises(TransportError, match="slow:2 is gone"):
        await engine.read(ino, 0, 16 * K)
    with pytest.raises(TransportError, match="slow:2 is gone"):
        await engine.write(ino, 0, b"b" * 16 * K)


async def test_allocate_reserves_zeroed_chunks_and_a_refusal_leaves_the_size(engine: DataEngine) -> None:
    """fallocate: the range's chunks are taken now (zero, on a pool whose memory held
    0xFF), the size covers it; past EOF with keep_size is refused; ENOSPC puts back
    the size and frees what went past it."""
    meta = engine.meta
    ino = await create(meta, b"f")
    await engine.write(ino, 0, b"abc")
    free = (await meta.statfs()).blocks_free
    await engine.allocate(ino, 10 * K, 100 * K, keep_size=False)
    assert (await meta.getattr(ino)).size == 110 * K
    cs = POOL.chunk_size
    assert free - (await meta.statfs()).blocks_free == len(range(10 * K // cs, (110 * K - 1) // cs + 1))
    assert await read(engine, ino, 0, 110 * K) == b"abc" + bytes(110 * K - 3)
    await engine.allocate(ino, 0, 50 * K, keep_size=True)  # within EOF: nothing changes
    assert (await meta.getattr(ino)).size == 110 * K
    with pytest.raises(FsError) as info:
        await engine.allocate(ino, 100 * K, 20 * K, keep_size=True)
    assert info.value.errno == errno.EOPNOTSUPP
    before = (await meta.statfs()).blocks_free
    with pytest.raises(FsError) as info:
        await engine.allocate(ino, 0, 2 * POOL_BYTES, keep_size=False)
    assert info.value.errno == errno.ENOSPC
    assert (await meta.getattr(ino)).size == 110 * K
    assert (await meta.statfs()).blocks_free == before
    assert await read(engine, ino, 0, 110 * K) == b"abc" + bytes(110 * K - 3)


class _Held(Posted):
    """A posted write of PostingTransport: applied (or failed) when the test says."""

    def __init__(self, transport: PostingTransport, apply: Callable[[], None],
                 done: Callable[[Exception | None], None]) -> None:
        self.transport, self.apply, self.done = transport, apply, done
        self.finished = trio.Event()

    @property
    def channel(self) -> object:
        return self.transport

    async def wait(self) -> None:
        await self.finished.wait()

    def finish(self, error: Exception | None) -> None:
        if error is None:
            self.apply()
        self.done(error)
        self.finished.set()


class PostingTransport(LocalTransport):
    """Local memory whose writes are posted: held until answer() or fail()."""

    posts_writes = True

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.held: list[_Held] = []
        #: set: posting waits for it (a socket that takes no more for a while)
        self.slow: trio.Event | None = None

    async def post_write(self, volume: int, offset: int, data: Buffer, key: int,
                         done: Callable[[Exception | None], None]) -> Posted | None:
        copy = bytes(data)
        await trio.lowlevel.checkpoint()
        if self.slow is not None:
            await self.slow.wait()

        def apply() -> None:
            self.volume_memory(volume)[offset : offset + len(copy)] = copy

        h = _Held(self, apply, done)
        self.held.append(h)
        return h

    def answer(self, error: Exception | None = None) -> None:
        for h in self.held:
            h.finish(error)
        self.held.clear()


class PinCounting(MetaStore):
    """The store, saying its writes are posted (as a write-lease holder's are) and
    counting the pins held on each inode (Meta.io)."""

    def __init__(self, pool: PoolConfig) -> None:
        super().__init__(pool)
        self.pins: dict[int, int] = {}
        self.barrier: Callable[[int], Awaitable[None]] | None = None

    def order_sizes_after(self, barrier: Callable[[int], Awaitable[None]]) -> None:
        self.barrier = barrier

    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        plan = await super().map_write(ino, offset, length)
        return WritePlan(plan.extents, posted=True)

    @contextlib.contextmanager
    def io(self, ino: int, *, here: bool = True) -> Iterator[object]:
        self.pins[ino] = self.pins.get(ino, 0) + 1
        try:
            yield None
        finally:
            self.pins[ino] -= 1


async def test_posted_writes_pin_their_file_and_report_failures_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A posted write returns before its transfer; the file stays pinned (a recall
    waits) until it is answered; this node's read waits for it; a failure fails the
    next write, or fsync/close (settle), once."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    meta = PinCounting(POOL)
    transport = PostingTransport(POOL.volumes, POOL.volume_size)
    engine = DataEngine(meta, transport)
    assert engine.posts_writes
    ino = await create(meta, b"f")
    await engine.write(ino, 0, b"a" * 32 * K)  # two stripe units, two volumes
    assert len(transport.held) == 2 and meta.pins[ino] == 1

    got: list[bytes] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _read_into(engine, ino, got))
        await trio.testing.wait_all_tasks_blocked()
        assert not got, "the read went out before the writes it could overtake"
        transport.answer()
    assert got == [b"a" * 32 * K] and meta.pins[ino] == 0
    await engine.settle(ino)  # nothing outstanding, nothing failed

    await engine.write(ino, 0, b"b" * 4 * K)
    transport.answer(TransportError("memory server m:1 is gone"))
    assert meta.pins[ino] == 0
    with pytest.raises(FsError) as info:
        await engine.write(ino, 4 * K, b"c")
    assert info.value.errno == errno.EIO and "m:1 is gone" in str(info.value)
    await engine.write(ino, 4 * K, b"c")  # reported once
    transport.answer()

    await engine.write(ino, 0, b"d")
    transport.answer(TransportError("memory server m:2 is gone"))
    with pytest.raises(FsError, match="m:2 is gone"):
        await engine.settle(ino)
    await engine.settle(ino)
    await meta.aclose()


async def test_sizes_are_reported_after_the_posted_writes_under_them() -> None:
    """An engine whose writes are posted gives the metadata client its barrier for
    size reports: it passes once the writes made so far are answered."""
    meta = PinCounting(POOL)
    engine = DataEngine(meta, PostingTransport(POOL.volumes, POOL.volume_size))
    transport = engine.transport
    assert isinstance(transport, PostingTransport) and meta.barrier is not None
    ino = await create(meta, b"f")
    await engine.write(ino, 0, b"a" * K)
    passed = trio.Event()

    async def report() -> None:
        assert meta.barrier is not None
        await meta.barrier(ino)
        passed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(report)
        await trio.testing.wait_all_tasks_blocked()
        assert not passed.is_set(), "a size would have gone ahead of its bytes"
        transport.answer()
    assert passed.is_set()

    # A write whose posting is still under way (its socket full) counts from its plan
    # on: the size it made is the client's already.
    transport.slow = trio.Event()
    passed = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.write, ino, K, b"b" * K)
        await trio.testing.wait_all_tasks_blocked()
        assert not transport.held, "the write is still being posted"
        nursery.start_soon(report)
        await trio.testing.wait_all_tasks_blocked()
        transport.slow.set()
        await trio.testing.wait_all_tasks_blocked()
        assert len(transport.held) == 1 and not passed.is_set()
        transport.answer()
    assert passed.is_set()
    await meta.aclose()


async def _read_into(engine: DataEngine, ino: int, out: list[bytes]) -> None:
    out.append(await read(engine, ino, 0, 32 * K))


class Recalling(MetaStore):
    """A store whose chunk maps are recalled as they are fetched while a change made
    elsewhere waits: that change recalls again every map fetched during its last
    round of recalls, so it goes ahead only once no map was fetched for *quiet*
    seconds.  Counts the fetches; the generation moves with each recall."""

    def __init__(self, pool: PoolConfig, quiet: float) -> None:
        super().__init__(pool)
        self.quiet = quiet
        self.recalling = False
        self.fetches = 0
        self._gen = 0
        self._last = -math.inf

    def generation(self, ino: int) -> int:
        return self._gen

    def _fetched(self) -> None:
        self.fetches += 1
        now = trio.current_time()
        if self.recalling:
            if now - self._last >= self.quiet:
                self.recalling = False  # the change went ahead: the next map is current
            else:
                self._gen += 1  # recalled again, right after this answer
        self._last = now

    async def map_read(self, ino: int, offset: int, length: int) -> list[Extent]:
        extents = await super().map_read(ino, offset, length)
        self._fetched()
        return extents

    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        plan = await super().map_write(ino, offset, length)
        self._fetched()
        return plan


@pytest.mark.parametrize("op", ["read", "write"])
async def test_a_map_recalled_as_it_comes_is_asked_for_again_after_a_pause(
    autojump_clock: trio.abc.Clock, op: str,
) -> None:
    """A change waiting for its recalls recalls every map fetched meanwhile (another
    node truncating, or stat'ing, a file written here): asking again at once, a
    writer kept it from going ahead until its own tries ran out (EIO).  The engine
    pauses between later tries, and the change gets its turn."""
    meta = Recalling(POOL, quiet=0.002)
    transport = LocalTransport(POOL.volumes, POOL.volume_size)
    eng = DataEngine(meta, transport)
    try:
        ino = await create(meta, b"f")
        await eng.write(ino, 0, b"x" * 4096)
        meta.recalling, meta.fetches = True, 0
        start = trio.current_time()
        if op == "read":
            assert await read(eng, ino, 0, 4096) == b"x" * 4096
        else:
            assert await eng.write(ino, 0, b"y" * 4096) == 4096
        assert not meta.recalling and meta.fetches <= 10, meta.fetches
        assert trio.current_time() - start < 0.1
    finally:
        await meta.aclose()
        await transport.aclose()
