"""ChunkSpace: a pool's chunks handed out clean, all or none, and back through the scrubber."""

from __future__ import annotations

import errno

import pytest
import trio

from memfs.config import PoolConfig
from memfs.errors import FsError, SpaceBusy
from memfs.meta.space import ChunkSpace

CS = 4096
POOL = PoolConfig(size=2 * 4 * CS, volumes=2, stripe_size=CS, chunk_size=CS)  # 4 chunks a volume


def test_take_is_all_or_none() -> None:
    space = ChunkSpace(POOL)
    assert space.take([0, 0, 0]) == [0, CS, 2 * CS]
    with pytest.raises(FsError) as e:
        space.take([1, 0, 0])  # volume 1 has room, volume 0 has one chunk left
    assert e.value.errno == errno.ENOSPC
    assert space.totals() == (8, 5)  # nothing of the refused call was taken
    assert space.take([1, 0]) == [0, 3 * CS]


def test_freed_chunks_wait_for_the_scrubber_then_go_out_lowest_first() -> None:
    space = ChunkSpace(POOL)
    dirtied: list[None] = []
    cleaned: list[list[tuple[int, int]]] = []
    space.on_dirty = lambda: dirtied.append(None)
    space.on_clean = cleaned.append
    space.take([0, 0, 0, 0])
    space.release([(0, 3 * CS), (0, CS)])
    assert len(dirtied) == 1 and space.dirty_chunks == 2
    assert space.totals() == (8, 6)  # dirty counts as free (statfs), but is not allocatable
    with pytest.raises(SpaceBusy):
        space.take([0])
    batch = space.take_dirty(10)
    assert sorted(batch) == [(0, CS), (0, 3 * CS)] and space.dirty_chunks == 0
    space.return_dirty(batch[:1])  # one could not be zeroed: dirty again
    space.put_clean(batch[1:])
    assert cleaned == [batch[1:]] and space.dirty_chunks == 1
    assert space.take([0]) == [batch[1][1]]
    with pytest.raises(SpaceBusy):
        space.take([0])
    space.put_clean(space.take_dirty(10))
    space.release([(0, 2 * CS), (0, 0)])
    space.recycle_unzeroed()
    assert space.take([0, 0, 0]) == [0, 2 * CS, batch[0][1]]  # lowest first


def test_take_dirty_skips_volumes_and_shares_out_the_rest() -> None:
    space = ChunkSpace(POOL)
    space.take([0, 0, 0, 1, 1, 1])
    space.release([(0, 0), (0, CS), (0, 2 * CS), (1, 0), (1, CS), (1, 2 * CS)])
    assert [v for v, _ in space.take_dirty(2)] == [0, 1]
    assert {v for v, _ in space.take_dirty(10, skip={0})} == {1}


async def test_reclaim_runs_the_attached_scrubber() -> None:
    space = ChunkSpace(POOL)
    await space.reclaim()  # none attached: nothing to wait for
    space.take([0, 0, 0, 0])
    space.release([(0, 0)])

    async def scrub() -> None:
        await trio.lowlevel.checkpoint()
        space.put_clean(space.take_dirty(64))

    space.reclaimer = scrub
    await space.reclaim()
    assert space.take([0]) == [0]
