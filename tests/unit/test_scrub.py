"""The scrubber: freed chunks are zeroed before anyone can be given them again."""

from __future__ import annotations

import errno
import stat

import pytest
import trio
import trio.testing

from memfs.config import PoolConfig
from memfs.data import DataEngine
from memfs.errors import FsError, TransportError
from memfs.layout import LAYOUT_XATTR
from memfs.meta.store import MetaStore
from memfs.scrub import Scrubber
from memfs.transport.local import LocalTransport

K = 1 << 10
POOL = PoolConfig(size=1 << 20, volumes=2, stripe_size=16 * K, chunk_size=4 * K)
ROOT = 1


async def filled_then_freed(store: MetaStore, engine: DataEngine) -> list[tuple[int, int]]:
    """Fill the whole pool with 0xFF through a file, unlink it; return its chunks."""
    ino = (await store.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0)).ino
    await engine.write(ino, 0, b"\xff" * POOL.volume_size * POOL.volumes)
    extents = await store.map_read(ino, 0, POOL.volume_size * POOL.volumes)
    await store.unlink(ROOT, b"f")
    return [(e.volume, e.voffset) for e in extents]


async def test_background_scrub_zeroes_freed_chunks() -> None:
    store = MetaStore(POOL)
    transport = LocalTransport(POOL.volumes, POOL.volume_size)
    engine = DataEngine(store, transport)
    async with trio.open_nursery() as nursery:
        await nursery.start(Scrubber(store, transport).run)
        extents = await filled_then_freed(store, engine)
        assert store.space.dirty_chunks or all(a.free for a in store.space.allocators)
        with trio.fail_after(5):
            await trio.testing.wait_all_tasks_blocked()  # the scrubber went back to waiting
        assert store.space.dirty_chunks == 0 and not any(a.scrubbing for a in store.space.allocators)
        nursery.cancel_scope.cancel()
    for vol in range(POOL.volumes):
        assert bytes(await transport.read(vol, 0, POOL.volume_size)) == bytes(POOL.volume_size)
    assert extents  # the file really covered the pool
    s = await store.statfs()
    assert s.blocks_free == s.blocks
    await transport.aclose()


async def test_write_waits_for_scrub_when_only_freed_space_is_left() -> None:
    store = MetaStore(POOL)
    transport = LocalTransport(POOL.volumes, POOL.volume_size)
    Scrubber(store, transport)  # on demand only
    engine = DataEngine(store, transport)
    await filled_then_freed(store, engine)
    assert all(a.free == 0 for a in store.space.allocators)
    g = (await store.mknod(ROOT, b"g", stat.S_IFREG | 0o644, 0, 0)).ino
    await engine.write(g, 100, b"x")  # SpaceBusy -> reclaim -> retry
    await engine.truncate(g, 4 * K)  # extend: the rest of the chunk must read as zeros
    assert bytes(await engine.read(g, 0, 4 * K)) == bytes(100) + b"x" + bytes(4 * K - 101)
    await transport.aclose()


class BrokenZero(LocalTransport):
    async def zero(self, volume: int, offset: int, length: int) -> None:
        raise TransportError("memory server gone")


async def test_unzeroable_chunks_stay_dirty_and_are_never_handed_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    store = MetaStore(POOL)
    transport = BrokenZero(POOL.volumes, POOL.volume_size)
    Scrubber(store, transport)
    engine = DataEngine(store, transport)
    await filled_then_freed(store, engine)
    dirty = store.space.dirty_chunks
    g = (await store.mknod(ROOT, b"g", stat.S_IFREG | 0o644, 0, 0)).ino
    with pytest.raises(FsError) as info:
        await engine.write(g, 0, b"x")
    assert info.value.errno == errno.ENOSPC
    assert store.space.dirty_chunks == dirty  # returned, not lost, not recycled
    assert "cannot zero" in caplog.text
    await transport.aclose()


class GatedZero(LocalTransport):
    """Zeroing waits until the gate opens (a slow memory server)."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.gate = trio.Event()

    async def zero(self, volume: int, offset: int, length: int) -> None:
        await self.gate.wait()
        await super().zero(volume, offset, length)


async def test_a_cancelled_round_returns_its_batch(autojump_clock: trio.testing.MockClock) -> None:
    """A drain whose caller gives up (the mds's call deadline, a dropped connection)
    leaves the chunks it took dirty, not stuck between dirty and allocatable."""
    store = MetaStore(POOL)
    transport = GatedZero(POOL.volumes, POOL.volume_size)
    scrubber = Scrubber(store, transport)
    engine = DataEngine(store, transport)
    await filled_then_freed(store, engine)
    dirty = store.space.dirty_chunks
    assert dirty
    with trio.move_on_after(1):
        await scrubber.drain()
    assert not any(a.scrubbing for a in store.space.allocators), "the taken batch was lost"
    assert store.space.dirty_chunks == dirty
    transport.gate.set()
    await scrubber.drain()
    s = await store.statfs()
    assert store.space.dirty_chunks == 0 and s.blocks_free == s.blocks
    await transport.aclose()


class DeadVolume(LocalTransport):
    """Volume 0's memory server is gone; the others work."""

    async def zero(self, volume: int, offset: int, length: int) -> None:
        if volume == 0:
            raise TransportError("memory server of volume 0 gone")
        await super().zero(volume, offset, length)


class ConcurrentDeadVolume(DeadVolume):
    concurrent = True  # like the tcp transport: volumes are zeroed in parallel


class HungVolume(LocalTransport):
    """Volume 0's memory server is stopped (SIGSTOP): its requests never finish."""

    concurrent = True

    async def zero(self, volume: int, offset: int, length: int) -> None:
        if volume == 0:
            await trio.sleep_forever()
        await super().zero(volume, offset, length)


@pytest.mark.parametrize("transport_class", [DeadVolume, ConcurrentDeadVolume, HungVolume])
async def test_one_dead_volume_does_not_keep_the_others_dirty(
    transport_class: type[LocalTransport], caplog: pytest.LogCaptureFixture,
) -> None:
    """Freed chunks of healthy volumes are reused although volume 0 cannot be zeroed
    (they used to wait behind it forever: ENOSPC on a nearly empty pool), and
    the background scrubber survives the failure and warns once, not every round."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    store = MetaStore(POOL)
    transport = transport_class(POOL.volumes, POOL.volume_size)
    engine = DataEngine(store, transport)
    async with trio.open_nursery() as nursery:
        await nursery.start(Scrubber(store, transport).run)
        await filled_then_freed(store, engine)
        g = (await store.mknod(ROOT, b"g", stat.S_IFREG | 0o644, 0, 0)).ino
        await store.setxattr(g, LAYOUT_XATTR, b"stripe_count=1 stripe_offset=1")
        with trio.fail_after(8):  # a client's call to the mds gives up after 10 s
            await engine.write(g, 0, b"y" * POOL.volume_size)  # all of volume 1 again
        await trio.sleep(2.5)  # a few retry rounds of the background scrubber
        assert bytes(await engine.read(g, 0, POOL.volume_size)) == b"y" * POOL.volume_size
        assert store.space.allocators[0].reclaimable == POOL.volume_size // POOL.chunk_size
        nursery.cancel_scope.cancel()
    assert caplog.text.count("cannot zero freed chunks of volume 0") == 1, caplog.text
    await transport.aclose()


class RecordingZero(LocalTransport):
    """Records every zeroing (what a reply still copying out of the memory would see)."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.zeroed: list[tuple[int, int, int]] = []

    async def zero(self, volume: int, offset: int, length: int) -> None:
        self.zeroed.append((volume, offset, length))
        await super().zero(volume, offset, length)


async def test_freed_memory_is_zeroed_only_after_read_replies_are_written(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """A FUSE read's reply is copied out of pool memory by a pyfuse3 thread after
    read() returned (memfs.fs.replies_written): freed memory stays as it was, and
    is handed to no one, until the replies submitted before are written; replies
    that are never written (the mount going away) leave it dirty."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    store = MetaStore(POOL)
    transport = RecordingZero(POOL.volumes, POOL.volume_size)
    scrubber = Scrubber(store, transport)
    engine = DataEngine(store, transport)
    written = trio.Event()
    answers: list[bool] = []

    async def quiesce() -> bool:
        with trio.move_on_after(5):
            await written.wait()
        answers.append(written.is_set())
        return written.is_set()

    scrubber.quiesce = quiesce
    await filled_then_freed(store, engine)
    dirty = store.space.dirty_chunks
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scrubber.drain)
        await trio.sleep(1)
        # taken for the round, but neither zeroed nor allocatable
        assert transport.zeroed == [] and all(a.free == 0 for a in store.space.allocators)
        written.set()
    assert answers and all(answers) and transport.zeroed and store.space.dirty_chunks == 0

    written = trio.Event()  # never written this time
    await filled_then_freed(store, engine)
    await scrubber.drain()
    assert answers[-1] is False
    assert store.space.dirty_chunks == dirty  # kept, not zeroed, not lost
    assert "read replies not written" in caplog.text
    assert not scrubber._failing  # no volume is at fault: the next round tries them all
    await transport.aclose()


async def test_a_truncate_zeroes_the_tail_after_read_replies_are_written() -> None:
    store = MetaStore(POOL)
    transport = RecordingZero(POOL.volumes, POOL.volume_size)
    engine = DataEngine(store, transport)
    events: list[str] = []

    def quiesce() -> bool:  # no await: nothing may free and reuse the chunk meanwhile
        events.append(f"quiesce with {len(transport.zeroed)} zeroed")
        return False  # gave up: the tail is zeroed all the same

    engine.quiesce = quiesce
    ino = (await store.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0)).ino
    await engine.write(ino, 0, b"\xff" * 8 * K)
    await engine.truncate(ino, 100)
    assert events == ["quiesce with 0 zeroed"] and transport.zeroed
    await engine.truncate(ino, 8 * K)
    assert bytes(await engine.read(ino, 0, 8 * K)) == b"\xff" * 100 + bytes(8 * K - 100)
    await transport.aclose()
