"""BackingFiles (memfs.passthrough) without FUSE: the backing files on a private tmpfs,
what they cost while files are closed, and the daemon-side I/O.  Needs CAP_SYS_ADMIN
(fsopen); the kernel's side is tested on real mounts (tests/mount/test_passthrough.py)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator

import pytest

from memfs.errors import FsError
from memfs.meta import Attr
from memfs.passthrough import BackingFiles


class _Meta:
    def __init__(self) -> None:
        self.truncated: list[tuple[int, int]] = []

    async def truncate(self, ino: int, size: int) -> list[tuple[int, int, int]]:
        self.truncated.append((ino, size))
        return []


@pytest.fixture
def files() -> Iterator[BackingFiles]:
    try:
        b = BackingFiles(1 << 20)
    except OSError as exc:
        pytest.skip(f"no private tmpfs here: {exc}")
    b.meta = _Meta()  # type: ignore[assignment]
    try:
        yield b
    finally:
        b.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _attr(ino: int, mode: int = stat.S_IFREG | 0o644) -> Attr:
    return Attr(ino, mode, 1, 0, 0, 0, 0, 0, 1, 2, 3)


async def test_closed_files_hold_no_descriptors(files: BackingFiles) -> None:
    before = _fds()
    for ino in range(10, 110):
        files.opened(ino)
        await files.write(ino, 0, b"x" * ino)
    assert _fds() == before + 100
    files.opened(10)  # a second open of one file shares its descriptor
    assert _fds() == before + 100
    for ino in range(10, 110):
        files.released(ino)
    assert _fds() == before + 1
    files.released(10)
    assert _fds() == before
    # the bytes stay, reached by name
    assert await files.read(57, 0, 100) == b"x" * 57
    assert files.overlay(_attr(57)).size == 57
    assert _fds() == before


async def test_overlay_takes_size_blocks_and_times_from_the_backing_file(files: BackingFiles) -> None:
    a = _attr(5)
    assert files.overlay(a) == a  # no backing file yet
    await files.write(5, 8191, b"z")
    got = files.overlay(a)
    assert got.size == 8192 and got.blocks == 8  # one page of two allocated
    assert got.mode == a.mode and got.nlink == a.nlink
    files.set_times(5, 10**18, 2 * 10**18)
    got = files.overlay(a)
    assert (got.atime_ns, got.mtime_ns) == (10**18, 2 * 10**18)
    assert got.ctime_ns > a.ctime_ns
    directory = _attr(5, stat.S_IFDIR | 0o755)
    assert files.overlay(directory) == directory


async def test_truncate_allocate_and_forget(files: BackingFiles) -> None:
    await files.truncate(7, 100_000)
    assert files.overlay(_attr(7)).size == 100_000
    assert files.meta.truncated == [(7, 100_000)]  # type: ignore[union-attr]
    await files.allocate(7, 0, 200_000, keep_size=True)
    a = files.overlay(_attr(7))
    assert a.size == 100_000 and a.blocks * 512 >= 200_000
    files.forget(7)
    assert files.overlay(_attr(7)) == _attr(7)
    files.forget(8)  # never had a file: nothing to do


async def test_the_pool_is_the_tmpfs(files: BackingFiles) -> None:
    bsize, blocks, free = files.space()
    assert bsize * blocks == 1 << 20 and free == blocks
    n = await files.write(3, 0, b"y" * (2 << 20))  # what fits
    assert 0 < n <= 1 << 20
    with pytest.raises(FsError) as full:
        await files.write(3, n, b"y" * 4096)
    assert full.value.errno == errno.ENOSPC
    files.forget(3)
    assert files.space()[2] == blocks


def test_no_id_without_passthrough(files: BackingFiles) -> None:
    files.opened(4)
    assert not files.active and files.backing_id(4) is None
    files.released(4)
