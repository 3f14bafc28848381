"""The kernel-facing layer's invalidations of inodes the kernel may be instantiating.

An entry reply (lookup, create, a readdirplus entry) of an inode the kernel had
evicted makes it a new inode when the process that asked runs again, with the
reply's attributes and their timeout.  An invalidation that comes first finds no
inode (ENOENT) and is lost: the kernel then kept a file's old size for the whole
timeout after another node's rewrite (the full-pool churn test,
tests/mount/test_cluster_backing.py, read 0 bytes of 2 MiB).  memfs.fs counts the
kernel's lookups (entry replies, FORGETs) and tries such an invalidation again
until the inode is there.  pyfuse3's notification (and, for listings, its
reply buffer) is faked here; the rest is real.
"""

from __future__ import annotations

import errno
import stat
from collections.abc import Iterator

import pyfuse3
import pytest

from memfs.config import PoolConfig
from memfs.data import DataEngine
from memfs.errors import FsError
from memfs.fs import Operations
from memfs.meta import Attr
from memfs.meta.store import ROOT_INO, MetaStore
from memfs.transport.local import LocalTransport


class FakeKernel:
    """``pyfuse3.invalidate_inode``: ENOENT until the inode is "instantiated"."""

    def __init__(self) -> None:
        self.missing_for = 0  # calls that find no inode
        self.calls: list[int] = []

    def invalidate_inode(self, ino: int, attr_only: bool = False) -> None:
        self.calls.append(ino)
        if self.missing_for > 0:
            self.missing_for -= 1
            raise OSError(errno.ENOENT, "no such inode")


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKernel]:
    k = FakeKernel()
    monkeypatch.setattr(pyfuse3, "invalidate_inode", k.invalidate_inode)
    yield k


async def _ops_with_file() -> tuple[Operations, int, LocalTransport]:
    pool = PoolConfig(size=16 << 20, volumes=2)
    store = MetaStore(pool)
    volumes = LocalTransport(pool.volumes, pool.volume_size)
    ops = Operations(store, DataEngine(store, volumes))
    a = await store.create(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0)
    return ops, a.ino, volumes


async def test_an_invalidation_waits_for_an_inode_the_kernel_is_instantiating(
        kernel: FakeKernel) -> None:
    ops, ino, volumes = await _ops_with_file()
    await ops.lookup(ROOT_INO, b"f")  # an entry reply: the kernel counts one lookup
    kernel.missing_for = 3  # ...and has not made the inode yet
    await ops.invalidate([ino])
    assert kernel.calls == [ino] * 4, "the invalidation must land on the new inode"
    await volumes.aclose()


async def test_an_inode_the_kernel_forgot_is_not_waited_for(kernel: FakeKernel) -> None:
    ops, ino, volumes = await _ops_with_file()
    await ops.lookup(ROOT_INO, b"f")
    await ops.lookup(ROOT_INO, b"f")
    await ops.forget([(ino, 2)])  # evicted: no entry reply is on its way
    kernel.missing_for = 3
    await ops.invalidate([ino])
    assert kernel.calls == [ino]
    await volumes.aclose()


async def test_an_inode_never_handed_to_the_kernel_is_not_waited_for(kernel: FakeKernel) -> None:
    ops, ino, volumes = await _ops_with_file()
    await ops.getattr(ino)  # attributes of an inode the kernel has: no lookup counted
    kernel.missing_for = 3
    await ops.invalidate([ino])
    assert kernel.calls == [ino]
    await volumes.aclose()


class FakeListing:
    """``pyfuse3.readdir_reply``: room for *room* entries, then the buffer is full."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.names: list[bytes] = []

    def reply(self, token: object, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        if len(self.names) >= self.room:
            return False
        self.names.append(name)
        return True


async def _ops_with_files(monkeypatch: pytest.MonkeyPatch, room: int) -> tuple[
        Operations, MetaStore, list[int], FakeListing, LocalTransport]:
    pool = PoolConfig(size=16 << 20, volumes=2)
    store = MetaStore(pool)
    volumes = LocalTransport(pool.volumes, pool.volume_size)
    ops = Operations(store, DataEngine(store, volumes))
    inos = [(await store.create(ROOT_INO, n, stat.S_IFREG | 0o644, 0, 0)).ino for n in (b"a", b"b", b"c")]
    listing = FakeListing(room)
    monkeypatch.setattr(pyfuse3, "readdir_reply", listing.reply)
    return ops, store, inos, listing, volumes


async def _waited_for(ops: Operations, kernel: FakeKernel, ino: int) -> bool:
    """Does an invalidation of *ino* that finds no inode wait (the kernel counts it)?"""
    kernel.calls.clear()
    kernel.missing_for = 1
    await ops.invalidate([ino])
    kernel.missing_for = 0
    return len(kernel.calls) > 1


async def test_a_listing_counts_what_the_kernel_got(
        kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    ops, _, inos, listing, volumes = await _ops_with_files(monkeypatch, room=4)
    fh = await ops.opendir(ROOT_INO, None)  # type: ignore[arg-type]
    await ops.readdir(fh, 0, None)  # type: ignore[arg-type]
    assert listing.names == [b".", b"..", b"a", b"b"], "the buffer holds four"
    assert not await _waited_for(ops, kernel, ROOT_INO), ". and .. are not counted"
    assert await _waited_for(ops, kernel, inos[0])
    assert await _waited_for(ops, kernel, inos[1])
    assert not await _waited_for(ops, kernel, inos[2]), "c did not fit: not sent"
    await volumes.aclose()


async def test_a_listing_that_fails_counts_nothing(
        kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    ops, store, inos, listing, volumes = await _ops_with_files(monkeypatch, room=3)
    fh = await ops.opendir(ROOT_INO, None)  # type: ignore[arg-type]
    await ops.readdir(fh, 0, None)  # type: ignore[arg-type]  # ., .., a
    assert listing.names == [b".", b"..", b"a"]
    lookup = store.lookup

    async def failing(parent: int, name: bytes) -> Attr:
        if name == b"c":
            raise FsError(errno.EIO, "the metadata server is gone")
        return await lookup(parent, name)

    monkeypatch.setattr(store, "lookup", failing)
    listing.room = 10
    with pytest.raises(pyfuse3.FUSEError):  # the next page: b is in the reply, then c fails
        await ops.readdir(fh, 3, None)  # type: ignore[arg-type]
    assert listing.names[3:] == [b"b"]
    assert not await _waited_for(ops, kernel, inos[1]), "the kernel got an error, not b"
    assert await _waited_for(ops, kernel, inos[0]), "a was in the first page"
    await volumes.aclose()


async def test_a_punch_an_old_mds_does_not_know_is_eopnotsupp() -> None:
    """ENOSYS from the metadata service (an mds without punch) reaches the kernel as
    EOPNOTSUPP: ENOSYS would make it stop forwarding every fallocate, reservations
    included, until unmounted."""
    ops, ino, volumes = await _ops_with_file()

    async def no_punch(ino: int, offset: int, length: int) -> None:
        raise FsError(errno.ENOSYS, "unknown call punch")

    ops.data.punch = no_punch  # type: ignore[method-assign]
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.fallocate(ino, 0x03, 0, 4096)  # FALLOC_FL_PUNCH_HOLE | KEEP_SIZE
    assert info.value.errno == errno.EOPNOTSUPP
    await ops.fallocate(ino, 0, 0, 4096)  # a reservation still reaches the data engine
    await volumes.aclose()
