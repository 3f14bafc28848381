"""Chunk maps read as runs: what the metadata store's and the client cache's
``extents`` answer is what the plain per-chunk reading of the map says (runs
merged), for random maps, layouts and ranges; ``put_extents`` records what extents
say chunk by chunk."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from memfs.layout import Layout
from memfs.meta import NOT_RESIDENT, Extent, add_run
from memfs.meta.cache import HOLE, ClientCache
from memfs.meta.placement import Placement

CS = 64 << 10


def per_chunk(cache: ClientCache, ino: int, offset: int, end: int,
              allocated: bool = False) -> list[Extent] | None:
    """The reference: one chunk at a time."""
    f = cache.files.get(ino)
    if f is None:
        return None
    out: list[Extent] = []
    pos = offset
    while pos < end:
        k, within = divmod(pos, CS)
        c = f.chunks.get(k)
        if c is None or (allocated and c[0] < 0):
            return None
        n = min(CS - within, end - pos)
        add_run(out, pos, n, c[0], c[1] + within if c[0] >= 0 else 0)
        pos += n
    return out


def random_map(rng: random.Random, chunks: int) -> list[Extent]:
    """Extents over *chunks* chunks: runs of contiguous memory in 3 volumes, holes,
    runs that restart elsewhere in the same volume, runs whose memory carries on
    from the one before but in another volume, unknown stretches (left out)."""
    out: list[Extent] = []
    k = 0
    while k < chunks:
        n = rng.randint(1, 40)
        kind = rng.random()
        if kind < 0.15:
            out.append(Extent(k * CS, n * CS, -1, 0))
        elif kind > 0.9:
            pass  # not known to this client
        elif kind > 0.7 and out and out[-1].volume >= 0 and out[-1].offset + out[-1].length == k * CS:
            last = out[-1]  # the same memory further on, another volume
            out.append(Extent(k * CS, n * CS, (last.volume + 1) % 3, last.voffset + last.length))
        else:
            out.append(Extent(k * CS, n * CS, rng.randrange(3), rng.randrange(1000) * CS))
        k += n
    return out


@pytest.mark.parametrize("seed", range(20))
def test_runs_are_read_as_chunk_by_chunk(seed: int) -> None:
    rng = random.Random(seed)
    cache = ClientCache(CS, term=30.0)
    cache.put_extents(7, random_map(rng, 600))
    for _ in range(300):
        a = rng.randrange(600 * CS)
        b = min(600 * CS, a + rng.choice([1, 100, CS, 3 * CS + 5, rng.randrange(200 * CS)]))
        for allocated in (False, True):
            want = per_chunk(cache, 7, a, b, allocated)
            got = cache.extents(7, a, b, allocated=allocated)
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert [(e.offset, e.length, e.volume, e.voffset) for e in got] == \
                       [(e.offset, e.length, e.volume, e.voffset) for e in want]


def put_per_chunk(chunks: dict[int, tuple[int, int]], extents: list[Extent]) -> None:
    """The reference for put_extents: one chunk at a time."""
    for e in extents:
        if e.volume < -1:
            continue
        pos, end = e.offset, e.offset + e.length
        while pos < end:
            k, within = divmod(pos, CS)
            chunks[k] = HOLE if e.volume < 0 else (e.volume, e.voffset + (pos - e.offset) - within)
            pos += CS - within


@pytest.mark.parametrize("seed", range(10))
def test_put_extents_records_what_each_chunk_says(seed: int) -> None:
    """Unaligned and empty extents, holes, NOT_RESIDENT ones (not recorded)."""
    rng = random.Random(seed)
    cache = ClientCache(CS, term=30.0)
    want: dict[int, tuple[int, int]] = {}
    for _ in range(20):
        extents = []
        pos = rng.randrange(50 * CS)
        for _ in range(rng.randint(1, 6)):
            n = rng.choice([0, 1, 100, CS - 1, CS, 3 * CS + 7, rng.randrange(20 * CS)])
            vol = rng.choice([-1, NOT_RESIDENT, 0, 1, 2])
            extents.append(Extent(pos, n, vol, rng.randrange(1000) * 4096 if vol >= 0 else 0))
            pos += n
        cache.put_extents(4, extents)
        put_per_chunk(want, extents)
        assert cache.files[4].chunks == want


def test_put_extents_records_each_chunk() -> None:
    cache = ClientCache(CS, term=30.0)
    # an extent that starts and ends inside chunks: the chunks it touches, by their start
    cache.put_extents(3, [Extent(CS + 100, 2 * CS, 1, 5 * CS + 100), Extent(3 * CS + 100, CS, -1, 0)])
    assert cache.files[3].chunks == {1: (1, 5 * CS), 2: (1, 6 * CS), 3: HOLE, 4: HOLE}
    assert cache.extents(3, CS, 3 * CS) == [Extent(CS, 2 * CS, 1, 5 * CS)]
    assert cache.extents(3, 0, CS) is None


def store_per_chunk(i: SimpleNamespace, offset: int, end: int) -> list[Extent]:
    """The reference for the store: one chunk at a time."""
    out: list[Extent] = []
    pos = offset
    while pos < end:
        k, within = divmod(pos, CS)
        n = min(CS - within, end - pos)
        base = i.chunks.get(k)
        if base is None:
            vol, voff = (NOT_RESIDENT if pos < i.backed else -1), 0
        else:
            vol, voff = i.layout.volume_of_chunk(k, CS), base + within
        add_run(out, pos, n, vol, voff)
        pos += n
    return out


@pytest.mark.parametrize("seed", range(20))
def test_store_runs_are_read_as_chunk_by_chunk(seed: int) -> None:
    rng = random.Random(seed)
    count = rng.choice([1, 2, 4])
    layout = Layout(rng.choice([1, 2, 16]) * CS, tuple(rng.sample(range(6), count)))
    chunks: dict[int, int] = {}
    k = 0
    while k < 600:  # runs contiguous in memory, restarts, holes
        n = rng.randint(1, 40)
        if rng.random() > 0.2:
            base = rng.randrange(1000) * CS
            chunks.update({k + j: base + j * CS for j in range(n)})
        k += n
    i = SimpleNamespace(chunks=chunks, layout=layout, backed=rng.randrange(600 * CS), lost=None)
    placement = SimpleNamespace(chunk_size=CS, sealed=set())
    for _ in range(300):
        a = rng.randrange(600 * CS)
        b = min(600 * CS, a + rng.choice([1, 100, CS, 3 * CS + 5, rng.randrange(200 * CS)]))
        got = Placement.extents_of(placement, i, a, b)  # type: ignore[arg-type]
        want = store_per_chunk(i, a, b)
        assert [(e.offset, e.length, e.volume, e.voffset) for e in got] == \
               [(e.offset, e.length, e.volume, e.voffset) for e in want]
