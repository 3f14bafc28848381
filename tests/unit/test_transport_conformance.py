"""Conformance suite for the :class:`memfs.transport.Transport` interface.

Every transport (``local``; ``tcp`` against in-process memory servers; ``verbs``
against in-process memory servers with RDMA, on a real device where pyverbs
finds one, else skipped; and ``verbs-sim``, the same transport code on a
simulated device, see ``tests/verbs_sim.py``) runs this same suite through the
``transport`` fixture.  The data engine relies on
exactly these properties: bytes land where asked, the ends of a volume are
reachable, out-of-range requests are refused instead of touching a neighbour, and
concurrent requests from many trio tasks do not interfere.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest
import trio
import trio.lowlevel

from memfs.config import VolumeAddr
from memfs.errors import TransportError
from memfs.transport import Transport
from memfs.transport.local import LocalTransport
from memfs.transport.memd import MemoryServer
from memfs.transport.tcp import open_tcp_transport
from memfs.transport.verbs import RdmaDevice, open_rdma_device, open_verbs_transport, rdma_devices
from tests.verbs_sim import SimDevice, SimFabric

N_VOLUMES = 4
VOLUME_SIZE = 4 << 20  # bigger than internal buffers (LocalTransport zeroes 1 MiB per copy)

TransportFactory = Callable[[int, int], AbstractAsyncContextManager[Transport]]


@asynccontextmanager
async def local(n_volumes: int, volume_size: int) -> AsyncIterator[Transport]:
    t = LocalTransport(n_volumes, volume_size)
    try:
        yield t
    finally:
        await t.aclose()


@asynccontextmanager
async def tcp(n_volumes: int, volume_size: int) -> AsyncIterator[Transport]:
    """Two in-process memory servers on 127.0.0.1, pool volumes alternating between them."""
    secret = b"conformance-secret-0123456789"
    servers = [MemoryServer(n_volumes // 2, volume_size, secret) for _ in range(2)]
    try:
        async with trio.open_nursery() as nursery:
            ports = [await nursery.start(s.serve, "127.0.0.1", 0) for s in servers]
            pool = [VolumeAddr("tcp", "127.0.0.1", ports[i % 2], i // 2) for i in range(n_volumes)]
            async with open_tcp_transport(pool, secret, io_timeout=10.0) as t:
                yield t
            nursery.cancel_scope.cancel()
    finally:
        for s in servers:
            await s.aclose()


@asynccontextmanager
async def _verbs_pool(
    n_volumes: int, volume_size: int, devices: list[RdmaDevice], client: RdmaDevice
) -> AsyncIterator[Transport]:
    """Two in-process memory servers with RDMA on *devices*, a verbs client on *client*."""
    secret = b"conformance-secret-0123456789"
    servers = [MemoryServer(n_volumes // 2, volume_size, secret, rdma=d) for d in devices]
    try:
        async with trio.open_nursery() as nursery:
            ports = [await nursery.start(s.serve, "127.0.0.1", 0) for s in servers]
            pool = [VolumeAddr("verbs", "127.0.0.1", ports[i % 2], i // 2)
                    for i in range(n_volumes)]
            async with open_verbs_transport(pool, secret, device=client, io_timeout=10.0) as t:
                yield t
            nursery.cancel_scope.cancel()
    finally:
        for s in servers:
            await s.aclose()  # closes its device
        client.close()


@asynccontextmanager
async def verbs(n_volumes: int, volume_size: int) -> AsyncIterator[Transport]:
    """The real thing: pyverbs on this node's first RDMA device, looped back through it."""
    async with _verbs_pool(n_volumes, volume_size, [open_rdma_device() for _ in range(2)],
                           open_rdma_device()) as t:
        yield t


@asynccontextmanager
async def verbs_sim(n_volumes: int, volume_size: int) -> AsyncIterator[Transport]:
    """The verbs transport and memd's RDMA side on a simulated device (no pyverbs)."""
    fabric = SimFabric()
    async with _verbs_pool(n_volumes, volume_size,
                           [SimDevice(fabric, f"memd{i}") for i in range(2)],
                           SimDevice(fabric, "client")) as t:
        yield t


# One line per implementation.
IMPLEMENTATIONS = [
    pytest.param(local, id="local"),
    pytest.param(tcp, id="tcp"),
    pytest.param(verbs, id="verbs", marks=pytest.mark.skipif(
        not rdma_devices(), reason="no RDMA device: pyverbs finds none on this machine")),
    pytest.param(verbs_sim, id="verbs-sim"),
]


@pytest.fixture(params=IMPLEMENTATIONS)
async def transport(request: pytest.FixtureRequest) -> AsyncIterator[Transport]:
    factory: TransportFactory = request.param
    async with factory(N_VOLUMES, VOLUME_SIZE) as t:
        yield t


def pattern(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def read_bytes(t: Transport, volume: int, offset: int, length: int) -> bytes:
    # read() may alias transport memory until our next await: copy at once.
    return bytes(await t.read(volume, offset, length))


async def test_volumes(transport: Transport) -> None:
    vols = transport.volumes
    assert [v.index for v in vols] == list(range(N_VOLUMES))
    assert all(v.size == VOLUME_SIZE for v in vols)
    urls = [v.url for v in vols]
    assert all(isinstance(u, str) and u for u in urls)
    assert len(set(urls)) == N_VOLUMES, "each volume needs its own address"


async def test_volumes_start_zeroed(transport: Transport) -> None:
    """Never-used chunks are handed out without zeroing: fresh volumes must read as zeros."""
    for v in transport.volumes:
        for offset in (0, v.size // 2, v.size - 65536):
            assert bytes(await transport.read(v.index, offset, 65536)) == bytes(65536)


async def test_round_trip_at_volume_ends(transport: Transport) -> None:
    n = 4096
    for vol in range(N_VOLUMES):
        head, tail = pattern(vol, n), pattern(100 + vol, n)
        await transport.write(vol, 0, head)
        await transport.write(vol, VOLUME_SIZE - n, bytearray(tail))
        assert await read_bytes(transport, vol, 0, n) == head
        assert await read_bytes(transport, vol, VOLUME_SIZE - n, n) == tail
        assert await read_bytes(transport, vol, VOLUME_SIZE - 1, 1) == tail[-1:]
        buf = transport.register(n)
        await transport.readinto(vol, VOLUME_SIZE - n, buf)
        assert bytes(buf) == tail
        await transport.readinto(vol, 0, buf[:100])
        assert bytes(buf[:100]) == head[:100] and bytes(buf[100:]) == tail[100:]
    # Volumes are distinct memory: each still holds its own pattern.
    for vol in range(N_VOLUMES):
        assert await read_bytes(transport, vol, 0, n) == pattern(vol, n)


async def test_write_accepts_any_buffer(transport: Transport) -> None:
    data = pattern(7, 1000)
    await transport.write(1, 5000, memoryview(data)[100:600])
    assert await read_bytes(transport, 1, 5000, 500) == data[100:600]
    await transport.write(1, 5000, b"")
    assert await read_bytes(transport, 1, 5000, 500) == data[100:600]


async def test_post_write(transport: Transport) -> None:
    """post_write stores the data like write: done at once (None) or once its handle's
    wait returns, its completion called exactly once either way; the caller's buffer
    may be reused as soon as it returns; writes of one key land in order."""
    results: list[Exception | None] = []
    handles = []
    buf = bytearray(pattern(5, 3000))
    for i in range(20):
        buf[:4] = i.to_bytes(4, "little")
        h = await transport.post_write(1, 1000, buf, 42, results.append)
        buf[:] = b"\xee" * len(buf)  # reused at once: what was posted must not change
        buf[:] = pattern(5, 3000)
        if h is not None:
            handles.append(h)
    for h in handles:
        await h.wait()
    assert results == [None] * len(handles)  # (a write done at once calls nothing)
    assert transport.posts_writes or not handles
    assert await read_bytes(transport, 1, 1000, 4) == (19).to_bytes(4, "little")
    assert await read_bytes(transport, 1, 1004, 2996) == pattern(5, 3000)[4:]


async def test_whole_volume(transport: Transport) -> None:
    data = pattern(3, VOLUME_SIZE)
    await transport.write(2, 0, data)
    buf = transport.register(VOLUME_SIZE)
    await transport.readinto(2, 0, buf)
    assert bytes(buf) == data


async def test_zero(transport: Transport) -> None:
    data = pattern(9, 3 * 4096)
    await transport.write(3, VOLUME_SIZE - len(data), data)
    await transport.zero(3, VOLUME_SIZE - len(data) + 100, 5000)
    got = await read_bytes(transport, 3, VOLUME_SIZE - len(data), len(data))
    assert got == data[:100] + bytes(5000) + data[5100:]
    # Larger than any internal zero buffer, up to the very end of the volume.
    await transport.write(0, 0, b"\xff" * VOLUME_SIZE)
    await transport.zero(0, 1, VOLUME_SIZE - 1)
    assert await read_bytes(transport, 0, 0, VOLUME_SIZE) == b"\xff" + bytes(VOLUME_SIZE - 1)
    await transport.zero(0, 0, 0)
    assert await read_bytes(transport, 0, 0, 1) == b"\xff"


async def test_register(transport: Transport) -> None:
    for size in (2, 4096, 3 << 20):
        buf = transport.register(size)
        assert isinstance(buf, memoryview)
        assert len(buf) == size and buf.nbytes == size and not buf.readonly
        buf[0] = 0xAB
        buf[-1] = 0xCD
        assert (buf[0], buf[-1]) == (0xAB, 0xCD)
    a, b = transport.register(16), transport.register(16)
    a[:] = b"a" * 16
    assert bytes(b) != bytes(a), "each registration is its own memory"


@pytest.mark.parametrize(
    ("volume", "offset", "length"),
    [
        (-1, 0, 1),
        (N_VOLUMES, 0, 1),
        (0, -1, 1),
        (0, VOLUME_SIZE, 1),
        (0, VOLUME_SIZE - 1, 2),
        (1, 0, VOLUME_SIZE + 1),
        (0, 10 * VOLUME_SIZE, 1),
    ],
)
async def test_out_of_range(transport: Transport, volume: int, offset: int, length: int) -> None:
    """A caller bug must be refused, never wrap or spill into the next volume."""
    guard = pattern(11, 64)
    for vol in range(N_VOLUMES):
        await transport.write(vol, 0, guard)
        await transport.write(vol, VOLUME_SIZE - 64, guard)
    with pytest.raises(ValueError):
        await transport.read(volume, offset, length)
    with pytest.raises(ValueError):
        await transport.readinto(volume, offset, transport.register(length))
    with pytest.raises(ValueError):
        await transport.write(volume, offset, b"\x01" * length)
    with pytest.raises(ValueError):
        await transport.zero(volume, offset, length)
    for vol in range(N_VOLUMES):
        assert await read_bytes(transport, vol, 0, 64) == guard
        assert await read_bytes(transport, vol, VOLUME_SIZE - 64, 64) == guard


async def test_concurrent_tasks(transport: Transport) -> None:
    """Many tasks write and read different volumes (and disjoint ranges of one
    volume) at once; every byte must end up where its own task put it."""
    piece = 16 << 10
    tasks_per_volume = 4
    per_task = 8

    def data(vol: int, task: int, i: int) -> bytes:
        return pattern(vol * 1000 + task * 100 + i, piece)

    def where(task: int, i: int) -> int:
        return (task * per_task + i) * piece

    bad: list[tuple[int, int, int]] = []

    async def check(vol: int, task: int, i: int, buf: memoryview) -> None:
        if i % 2:
            await transport.readinto(vol, where(task, i), buf)
            got = bytes(buf)
        else:
            got = await read_bytes(transport, vol, where(task, i), piece)
        if got != data(vol, task, i):
            bad.append((vol, task, i))

    async def worker(vol: int, task: int) -> None:
        """Write a piece, let the others run, read back the previous piece."""
        buf = transport.register(piece)
        for i in range(per_task):
            await transport.write(vol, where(task, i), data(vol, task, i))
            await trio.lowlevel.checkpoint()
            if i:
                await check(vol, task, i - 1, buf)

    async def verifier(vol: int, task: int) -> None:
        buf = transport.register(piece)
        for i in reversed(range(per_task)):
            await check(vol, task, i, buf)
            await trio.lowlevel.checkpoint()

    for job in (worker, verifier):
        async with trio.open_nursery() as nursery:
            for vol in range(N_VOLUMES):
                for task in range(tasks_per_volume):
                    nursery.start_soon(job, vol, task)
    assert bad == []


async def test_aclose(transport: Transport) -> None:
    """Closing is idempotent (the fixture closes once more), and I/O after close is
    an I/O error (EIO to the application), not a crash on released memory."""
    await transport.write(0, 0, b"x")
    view = await transport.read(0, 0, 1)  # a FUSE reply may still hold a view at shutdown
    await transport.aclose()
    await transport.aclose()
    with pytest.raises(TransportError):
        await transport.read(0, 0, 1)
    with pytest.raises(TransportError):
        await transport.readinto(0, 0, transport.register(1))
    with pytest.raises(TransportError):
        await transport.write(0, 0, b"y")
    with pytest.raises(TransportError):
        await transport.zero(0, 0, 1)
    del view
