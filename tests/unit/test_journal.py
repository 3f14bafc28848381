"""The metadata journal: replay must rebuild the store exactly, damage must be caught.

Exactly means the whole internal state, free lists included: after a restart the
next allocation must pick the same chunk it would have picked, or two files end
up sharing memory in the still-running memory servers.  The workload runs
through a real :class:`MetaServer` and :class:`RemoteMeta`, so what is recorded
is what the server records in production.
"""

from __future__ import annotations

import logging
import os
import random
import stat
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from memfs.config import PoolConfig
from memfs.errors import FsError
from memfs.layout import LAYOUT_XATTR
from memfs.meta import Meta, SetAttr
from memfs.meta.journal import (
    DERIVED_FIELDS,
    INODE_FIELDS,
    SNAPSHOT_FORMAT,
    Journal,
    JournalError,
    dump_state,
    load_state,
    read_snapshot,
    write_snapshot,
)
from memfs.meta.remote import RemoteMeta, open_remote_meta
from memfs.meta.server import MetaServer
from memfs.meta.store import Inode, MetaStore

K, M = 1 << 10, 1 << 20
POOL = PoolConfig(size=16 * M, volumes=4, stripe_size=256 * K, chunk_size=64 * K)
SECRET = b"journal-test-secret-0123456789"
ROOT = 1


@asynccontextmanager
async def served(
    directory: Path, pool: PoolConfig = POOL, **journal_args: Any
) -> AsyncIterator[tuple[MetaServer, Meta]]:
    journal = Journal(directory, **journal_args)
    try:
        store = await journal.open(pool)
        async with trio.open_nursery() as nursery:
            server = MetaServer(store, SECRET, None, journal, session_grace=0.2)
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            async with open_remote_meta("127.0.0.1", port, SECRET) as meta:
                yield server, meta
            nursery.cancel_scope.cancel()
    finally:
        journal.close()


@asynccontextmanager
async def mds_only(directory: Path, grace: float) -> AsyncIterator[MetaServer]:
    """A journaled server with *grace* and no client of its own."""
    journal = Journal(directory)
    try:
        store = await journal.open(POOL)
        async with trio.open_nursery() as nursery:
            server = MetaServer(store, SECRET, None, journal, session_grace=grace)
            await nursery.start(server.serve, "127.0.0.1", 0)
            yield server
            nursery.cancel_scope.cancel()
    finally:
        journal.close()


@asynccontextmanager
async def writer_back(server: MetaServer, sid: bytes, ino: int, size: int) -> AsyncIterator[RemoteMeta]:
    """A client of session *sid* that holds *ino* open and wrote it to *size* under a
    write lease of an earlier run, without reporting that size: what it says when it
    registers."""
    meta = RemoteMeta("127.0.0.1", server.port, SECRET, timeout=5)
    meta.session = sid
    meta.opens[ino] = 1
    meta.cache.dirty[ino] = (size, 1)
    await meta.connect()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(meta.run)
        yield meta
        await meta.aclose()


async def leave(server: MetaServer, meta: Meta) -> None:
    """The client goes first: write leases it holds end as it leaves (journaled, with
    the mark that it did not say its sizes), so the state after is the final one."""
    await meta.aclose()
    for _ in range(500):  # the server notices the close
        if all(s.conn is None for s in server.sessions.values()):
            return
        await trio.sleep(0.01)
    raise AssertionError("the server did not notice the client leave")


async def recovered(directory: Path, pool: PoolConfig = POOL) -> MetaStore:
    journal = Journal(directory)
    try:
        return await journal.open(pool)
    finally:
        journal.close()


def only(directory: Path, kind: str) -> Path:
    (path,) = directory.glob(f"{kind}.*")
    return path


def kinds(directory: Path) -> list[str]:
    return sorted(p.name.split(".")[0] for p in directory.iterdir())


def rewrite(path: Path, change: Callable[[bytearray], bytes | bytearray]) -> None:
    path.write_bytes(bytes(change(bytearray(path.read_bytes()))))


def flip(data: bytearray, pos: int) -> bytearray:
    data[pos] ^= 0xFF
    return data


def state(store: MetaStore, sessions: bool = False) -> dict[str, Any]:
    """A store's snapshot content; without the client sessions of this and earlier
    runs unless *sessions* (a restart, or one more client, changes those by design)."""
    s = dump_state(store, 0, POOL)
    del s["seq"]
    if not sessions:
        del s["sessions"]
    return s


async def workload(meta: Meta, seed: int, steps: int) -> list[int]:
    """Random namespace and allocation changes; returns inodes left open."""
    rng = random.Random(seed)
    dirs, files, held = [ROOT], [], []
    for step in range(steps):
        op = rng.randrange(14)
        parent = rng.choice(dirs)
        name = b"n%d" % rng.randrange(40)
        try:
            if op == 0:
                dirs.append((await meta.mknod(parent, name, stat.S_IFDIR | 0o755, 1, 1)).ino)
            elif op in (1, 2):
                files.append((await meta.mknod(parent, name, stat.S_IFREG | 0o644, 1, 1)).ino)
            elif op in (3, 4) and files:
                await meta.map_write(rng.choice(files), rng.randrange(4 * M), rng.randrange(1, 300 * K))
            elif op == 5 and files:
                if step % 2:  # (the same draws either way: the seeds' workloads stay)
                    await meta.truncate(rng.choice(files), rng.randrange(2 * M))
                else:
                    await meta.punch(rng.choice(files), rng.randrange(2 * M), step * 7919 % M + 1)
            elif op == 6:
                await meta.rename(parent, name, rng.choice(dirs), b"n%d" % rng.randrange(40), rng.choice([0, 0, 1, 2]))
            elif op == 7 and files:
                await meta.link(rng.choice(files), parent, name)
            elif op == 8:
                await meta.unlink(parent, name)
            elif op == 9:
                await meta.rmdir(parent, name)
            elif op == 10:
                await meta.mknod(parent, name, stat.S_IFLNK | 0o777, 1, 1, target=b"t%d" % step)
            elif op == 11 and files:
                ino = rng.choice(files)
                if rng.random() < 0.5:
                    await meta.setxattr(ino, b"user.k%d" % rng.randrange(3), b"v%d" % step)
                else:
                    await meta.removexattr(ino, b"user.k%d" % rng.randrange(3))
            elif op == 12 and files:
                ino = rng.choice(files)
                await meta.setattr(ino, SetAttr(mode=rng.randrange(0o777), mtime_ns=step))
                await meta.map_read(ino, 0, 1)
            elif op == 13 and files:
                ino = rng.choice(files)
                if rng.random() < 0.6:
                    await meta.open(ino)
                    held.append(ino)
                elif held:
                    await meta.release(held.pop(rng.randrange(len(held))))
        except FsError:
            pass
    return held


def test_snapshot_keeps_every_inode_field() -> None:
    """A field added to Inode must be added to snapshots too (opens are not kept, nor
    cuts: the fetches that compare them die with the server; lost chunks are kept in
    a list of their own, ``lost``: few files ever have any)."""
    assert set(INODE_FIELDS) == set(Inode.__slots__) - {"opens", "cuts", "lost", *DERIVED_FIELDS}


async def test_snapshot_round_trip() -> None:
    store = MetaStore(POOL)
    a = await store.mknod(ROOT, b"a", stat.S_IFREG | 0o600, 5, 6)
    await store.map_write(a.ino, 100, 300 * K)
    d = await store.mknod(ROOT, b"d", stat.S_IFDIR | 0o755, 5, 6)
    await store.setxattr(d.ino, LAYOUT_XATTR, b"stripe_count=2")
    await store.setxattr(a.ino, b"user.x", b"\0\xff")
    await store.truncate(a.ino, 70 * K)  # frees chunks: the free lists must survive too
    assert state(load_state(dump_state(store, 0, POOL), POOL)) == state(store)


async def test_replay_rebuilds_the_exact_state(tmp_path: Path) -> None:
    async with served(tmp_path) as (server, meta):
        held = await workload(meta, seed=1, steps=1500)
        await leave(server, meta)
        before = state(server.store, sessions=True)
    after = await recovered(tmp_path)
    assert state(after, sessions=True) == before
    assert before["sessions"] == [[], [meta.session]]  # type: ignore[attr-defined]
    assert held, "the workload should leave some files open"
    assert before["unsaid"], "the client left with write leases: marked in the journal"
    # The same next step on both gives the same answer (allocation included).
    f = await after.mknod(ROOT, b"next", stat.S_IFREG | 0o644, 0, 0)
    assert f.ino == before["next_ino"]


async def test_replay_across_snapshots(tmp_path: Path) -> None:
    """Rotations every 100 records; two restarts; still exact, and old files pruned."""
    async with served(tmp_path, snapshot_every=100) as (server, meta):
        await workload(meta, seed=2, steps=700)
        await leave(server, meta)
        await trio.sleep(0.2)  # let the last background snapshot land
        first = state(server.store)
    assert state(await recovered(tmp_path)) == first
    async with served(tmp_path, snapshot_every=100) as (server, meta):
        assert state(server.store) == first
        await workload(meta, seed=3, steps=500)
        await leave(server, meta)
        second = state(server.store)
    assert state(await recovered(tmp_path)) == second
    assert kinds(tmp_path) == ["journal", "lock", "snapshot"], "older files are removed"


async def test_unlinked_open_file_survives_restart(tmp_path: Path) -> None:
    async with served(tmp_path) as (server, meta):
        f = await meta.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0)
        await meta.map_write(f.ino, 0, 200 * K)
        await meta.open(f.ino)
        await meta.unlink(ROOT, b"f")
        g = await meta.mknod(ROOT, b"g", stat.S_IFREG | 0o644, 0, 0)
        await meta.map_write(g.ino, 0, 100 * K)
        await meta.unlink(ROOT, b"g")  # not open: destroyed at once
        before = state(server.store)
    after = await recovered(tmp_path)
    assert state(after) == before
    assert after.inodes[f.ino].nlink == 0 and g.ino not in after.inodes


async def test_torn_tail_is_dropped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with served(tmp_path) as (server, meta):
        await workload(meta, seed=4, steps=200)
        await leave(server, meta)
        good = state(server.store)
        async with open_remote_meta("127.0.0.1", server.port, SECRET) as other:
            start = only(tmp_path, "journal").stat().st_size
            await other.mknod(ROOT, b"last", stat.S_IFREG | 0o644, 0, 0)
            assert only(tmp_path, "journal").stat().st_size > start  # durable before the reply
    # The first record after *start* cut short: the mknod's, or the new session's
    # registration if that was journaled after *start* (group commit: either order);
    # everything after it is gone too, the mknod with it.
    rewrite(only(tmp_path, "journal"), lambda data: data[:start + 5])
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, "memfs.meta.journal"):
        after = await recovered(tmp_path)
    assert "torn record" in caplog.text
    assert state(after) == good

    # Zeros after the last record (a crash after the file grew) are a torn tail too.
    async with served(tmp_path) as (server, meta):
        await meta.mknod(ROOT, b"more", stat.S_IFREG | 0o644, 0, 0)
        good = state(server.store)
    rewrite(only(tmp_path, "journal"), lambda data: data + bytes(100))
    assert state(await recovered(tmp_path)) == good


async def test_damage_before_the_end_refuses_to_start(tmp_path: Path) -> None:
    async with served(tmp_path) as (_, meta):
        await workload(meta, seed=5, steps=200)
    rewrite(only(tmp_path, "journal"), lambda data: flip(data, len(data) // 2))
    with pytest.raises(JournalError, match="damaged record|does not decode|does not replay"):
        await recovered(tmp_path)


async def test_damaged_snapshot_refuses_to_start(tmp_path: Path) -> None:
    async with served(tmp_path) as (_, meta):
        await workload(meta, seed=6, steps=50)
    await recovered(tmp_path)  # rewrites the snapshot: the state is in it now
    rewrite(only(tmp_path, "snapshot"), lambda data: flip(data, len(data) - 3))
    with pytest.raises(JournalError, match="damaged"):
        await recovered(tmp_path)


async def test_another_pool_refuses_to_start(tmp_path: Path) -> None:
    await recovered(tmp_path)
    other = PoolConfig(size=32 * M, volumes=4, stripe_size=256 * K, chunk_size=64 * K)
    with pytest.raises(JournalError, match="pool of 4 volumes x 4M"):
        await recovered(tmp_path, other)


async def test_directory_in_use_or_unwritable(tmp_path: Path) -> None:
    from memfs.errors import UsageError

    first = Journal(tmp_path)
    first.lock()
    try:
        with pytest.raises(UsageError, match="in use"):
            Journal(tmp_path).lock()
    finally:
        first.close()
    with pytest.raises(UsageError, match="journal directory"):
        Journal(tmp_path / "missing" / "deeper").lock()


async def test_replies_wait_for_durability(tmp_path: Path) -> None:
    """No reply leaves before the record of its call is on disk (group commit)."""
    async with served(tmp_path) as (server, meta):
        journal = server.journal
        assert journal is not None
        base = journal.seq  # the run's start and our registration

        async def creator(k: int) -> None:
            for i in range(20):
                before = journal.seq
                await meta.mknod(ROOT, b"w%d-%d" % (k, i), stat.S_IFREG | 0o644, 0, 0)
                assert journal.durable_seq > before

        async with trio.open_nursery() as nursery:
            for k in range(4):
                nursery.start_soon(creator, k)
        assert journal.durable_seq == journal.seq == base + 80
    assert len((await recovered(tmp_path)).inodes) == 1 + 80


async def test_scrubbed_chunks_replay_exactly(tmp_path: Path) -> None:
    """Chunks the scrubber cleaned are journaled: after a restart they are allocatable
    again in the same order, while chunks still dirty (or out with the scrubber when
    the server died) stay dirty and are zeroed again, never handed out as they are."""
    async with served(tmp_path) as (server, meta):
        await workload(meta, seed=7, steps=600)  # frees plenty of chunks
        await leave(server, meta)
        store = server.store
        assert store.space.dirty_chunks > 10
        store.space.put_clean(store.space.take_dirty(7))  # what the scrubber does, in part
        out_with_scrubber = store.space.take_dirty(3)  # and a batch in flight at the "crash"
        before = state(store)
        async with open_remote_meta("127.0.0.1", server.port, SECRET) as other:
            await other.getattr(ROOT)  # the reply waits until the CLEAN record is durable
    after = await recovered(tmp_path)
    assert state(after) == before
    # The in-flight batch came back dirty, not clean.
    dirty_after = {(v, i * POOL.chunk_size) for v, a in enumerate(after.space.allocators) for i in a.dirty}
    assert set(out_with_scrubber) <= dirty_after


async def test_freed_chunks_go_out_lowest_first() -> None:
    """A file rewritten after a delete gets ascending, adjacent chunks: one extent per
    stripe unit (last-in-first-out handed them back reversed, one extent per chunk)."""
    store = MetaStore(POOL)
    a = await store.mknod(ROOT, b"a", stat.S_IFREG | 0o600, 0, 0)
    await store.map_write(a.ino, 0, 2 * M)
    await store.unlink(ROOT, b"a")
    store.space.recycle_unzeroed()
    b = await store.mknod(ROOT, b"b", stat.S_IFREG | 0o600, 0, 0)
    await store.map_write(b.ino, 0, 2 * M)
    extents = await store.map_read(b.ino, 0, 2 * M)
    assert len(extents) == 2 * M // POOL.stripe_size
    assert all(e.length == POOL.stripe_size for e in extents)


async def test_old_journal_replays_last_in_first_out(tmp_path: Path) -> None:
    """A format-3 snapshot and its journal were written allocating freed chunks last in,
    first out: replay follows that rule (else two files would share chunks), and the
    server switches to lowest-first only with the new snapshot it writes."""
    async with served(tmp_path) as (server, meta):
        snap = read_snapshot(only(tmp_path, "snapshot"))
        snap["format"] = 3  # as the old code wrote it, and allocating as it did:
        write_snapshot(tmp_path, snap["seq"], snap)
        for a in server.store.space.allocators:
            a.lowest_first = False
        await workload(meta, seed=11, steps=400)
        server.store.space.recycle_unzeroed()
        await workload(meta, seed=12, steps=400)  # allocates from the freed lists
        await leave(server, meta)
        before = state(server.store)
    after = await recovered(tmp_path)
    got = state(after)
    assert {k: v for k, v in got.items() if k != "allocators"} == {
        k: v for k, v in before.items() if k != "allocators"
    }, "every inode keeps exactly the chunks it had"
    assert [(n, sorted(f), d) for n, f, d in got["allocators"]] == [
        (n, sorted(f), d) for n, f, d in before["allocators"]
    ]
    assert all(a.lowest_first for a in after.space.allocators)
    assert read_snapshot(only(tmp_path, "snapshot"))["format"] == SNAPSHOT_FORMAT


async def test_a_writer_of_the_run_before_is_heard_and_one_from_earlier_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Within --grace of a restart, a session of the run before that reports a size it
    wrote (chunks past EOF were kept) has it applied.  A session that was absent for a
    whole grace (two restarts back) is a stranger: its larger size is refused, never
    applied over the space that grace freed."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # the refusal
    a, b = os.urandom(16), os.urandom(16)
    async with mds_only(tmp_path, grace=30) as server:
        async with open_remote_meta("127.0.0.1", server.port, SECRET) as meta:
            f = await meta.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0)
            g = await meta.mknod(ROOT, b"g", stat.S_IFREG | 0o644, 0, 0)
            for ino in (f.ino, g.ino):
                await meta.map_write(ino, 0, 4096)
        for sid, ino in ((a, f.ino), (b, g.ino)):  # both register in this run
            async with writer_back(server, sid, ino, 4096):
                pass
    async with mds_only(tmp_path, grace=0.3) as server:  # a comes back in time, b does not
        async with writer_back(server, a, f.ino, 100_000) as wa:
            assert not wa.write_errors
            assert server.store.inodes[f.ino].size == 100_000
        await trio.sleep(0.6)  # the grace ends
    async with mds_only(tmp_path, grace=30) as server:
        async with writer_back(server, b, g.ino, 100_000) as wb:
            assert wb.write_errors == {g.ino}
        assert server.store.inodes[g.ino].size == 4096
    assert "not applied" in caplog.text

