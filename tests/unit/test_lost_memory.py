"""A memory server that restarted blank: its files' chunks become lost (EIO) in the
store, the journal keeps that, and the mds takes the server back (memfs.meta.takeback):
clients let go of their maps first and hear the new incarnation after.

The store tests use a bare :class:`MetaStore`; the take-back runs in a real
:class:`MetaServer` with a journal and a :class:`RemoteMeta` client, with
memory-server names that no traffic is sent to (the mds only compares them).
"""

from __future__ import annotations

import contextlib
import errno
import stat
from pathlib import Path

import pytest
import trio

from memfs.config import VolumeAddr
from memfs.errors import FsError
from memfs.meta import Attr, Meta
from memfs.meta.journal import dump_state, load_state
from memfs.meta.store import MetaStore
from memfs.meta.takeback import TakeBack
from tests.unit.test_journal import POOL, ROOT, SECRET, leave, recovered, served, state

K, M = 1 << 10, 1 << 20
CS = POOL.chunk_size  # 64 KiB; stripes of 256 KiB over 4 volumes
#: volumes 0 and 2 on one memory server, 1 and 3 on another (names only)
ADDRS = [VolumeAddr("tcp", f"10.9.9.{1 + v % 2}", 7100, v // 2) for v in range(4)]
LOST = "10.9.9.1:7100"
#: a file's 256 KiB stripes on volumes 0, 1, 2, 3, 0, ...
WIDE = b"stripe_count=4 stripe_offset=0"


async def wide_file(meta: Meta, name: bytes = b"wide", *, keep_open: bool = True) -> Attr:
    """A 1 MiB file striped over the four volumes, written and closed (then open again:
    *keep_open*) through *meta*."""
    f = await meta.create(ROOT, name, stat.S_IFREG | 0o644, 0, 0)
    await meta.setxattr(f.ino, b"user.memfs.layout", WIDE)
    await meta.map_write(f.ino, 0, 1 * M)
    await meta.release(f.ino)
    if keep_open:
        await meta.open(f.ino)
    return f


def eio(exc: pytest.ExceptionInfo[FsError]) -> bool:
    return exc.value.errno == errno.EIO and "lost" in str(exc.value)


async def test_lost_chunks_read_and_write_eio_until_truncated() -> None:
    """Chunks below EOF on the lost volumes become lost; preallocation past EOF is only
    dropped; the rest of the file reads; a truncate cuts lost chunks off (to 0: the
    file is whole again); every chunk there goes to the scrubber."""
    store = MetaStore(POOL)
    a = await store.mknod(ROOT, b"a", stat.S_IFREG | 0o644, 0, 0)
    await store.setxattr(a.ino, b"user.memfs.layout", WIDE)
    await store.map_write(a.ino, 0, 1 * M)  # 16 chunks, 4 per volume
    await store.allocate_ahead(a.ino, 1 * M - 1, 1, 512 * K)  # 8 chunks past EOF
    other = await store.mknod(ROOT, b"b", stat.S_IFREG | 0o644, 0, 0)
    await store.setxattr(other.ino, b"user.memfs.layout", b"stripe_count=1 stripe_offset=1")
    await store.map_write(other.ino, 0, 300 * K)
    dirty = store.space.dirty_chunks
    inode = store.inodes[a.ino]
    held = len(inode.chunks or ())

    assert store.holding({0, 2}) == [a.ino]
    assert store.lose_memory({0, 2}) == [a.ino]
    assert inode.lost == {k for k in range(16) if (k // 4) % 4 in (0, 2)}
    assert len(inode.chunks or ()) == held // 2  # preallocation there dropped, not lost
    assert store.space.dirty_chunks == dirty + held // 2
    assert store.holding({0, 2}) == []

    with pytest.raises(FsError) as exc:
        await store.map_read(a.ino, 0, 4 * K)
    assert eio(exc)
    assert [e.volume for e in await store.map_read(a.ino, 256 * K, 256 * K)] == [1]
    with pytest.raises(FsError) as exc:
        await store.map_write(a.ino, 512 * K, 10)  # volume 2: lost
    assert eio(exc)
    await store.map_write(a.ino, 768 * K, 10)  # volume 3: fine
    assert (await store.map_read(other.ino, 0, 300 * K))[0].volume == 1

    await store.truncate(a.ino, 600 * K)  # cuts chunk 10 (lost) in two: it stays lost
    assert inode.lost == {0, 1, 2, 3, 8, 9}
    await store.truncate(a.ino, 0)
    assert inode.lost is None
    await store.map_write(a.ino, 0, 1 * M)  # lost chunks' places take new memory
    assert len(await store.map_read(a.ino, 0, 1 * M)) >= 1


async def test_a_fetch_into_lost_memory_installs_nothing() -> None:
    """A burst-buffer fetch reserved chunks on the lost volumes: they stay out of the
    free space while the fetch may still write there, and are freed when it ends
    (install or unreserve: once each), never installed; the chunk is still missing
    (fetched again).  Lost chunks are never fetched from the backing copy (older)."""
    store = MetaStore(POOL)
    a = await store.mknod(ROOT, b"a", stat.S_IFREG | 0o644, 0, 0)
    await store.setxattr(a.ino, b"user.memfs.layout", WIDE)
    inode = store.inodes[a.ino]
    inode.size = inode.backed = 1 * M  # all of it in the backing directory
    placed = store.reserve(a.ino, [0, 1, 4])  # chunk 4 is on volume 1
    dirty = store.space.dirty_chunks
    store.lose_memory({0})
    assert store.space.dirty_chunks == dirty  # (the fetch may still write there)
    assert store.reserved == {(1, placed[2][2])}
    assert [store.install(a.ino, k, vol, voff) for k, vol, voff in placed[1:]] == [False, True]
    assert store.space.dirty_chunks == dirty + 1
    store.unreserve(0, placed[0][2])  # the fetch of chunk 0 failed
    assert store.space.dirty_chunks == dirty + 2
    assert not store.placement.doomed
    assert store.missing(a.ino, 0, 2 * CS) == [0, 1]

    b = await store.mknod(ROOT, b"b", stat.S_IFREG | 0o644, 0, 0)
    await store.map_write(b.ino, 0, 300 * K)
    store.inodes[b.ino].backed = 300 * K  # (an older copy in DIR)
    store.lose_memory({0})
    assert store.missing(b.ino, 0, 300 * K) == []


async def test_lost_chunks_survive_snapshots_and_replay(tmp_path: Path) -> None:
    async with served(tmp_path) as (server, meta):
        f = await wide_file(meta, b"f", keep_open=False)
        await server.lease_policy.recall_inodes([f.ino])  # its size is the server's now
        server.journal_now("_memory_lost", [0, 2])
        server.store.lose_memory({0, 2})
        await server.durable()
        await leave(server, meta)
        before = state(server.store)
    assert before["lost"] == [[f.ino, [0, 1, 2, 3, 8, 9, 10, 11]]]
    assert state(await recovered(tmp_path)) == before
    assert state(load_state(dump_state(server.store, 0, POOL), POOL)) == before


async def test_the_mds_takes_a_restarted_server_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Found restarted: the clients' cached maps go first (a cached map would read the
    blank memory as data), the file's chunks there are lost, the new incarnation is
    saved, adopted by the mds's transports and told to the clients; a client that
    registers later hears it too; files elsewhere are untouched."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # "restarted", "taken back"
    saved: list[dict[str, int]] = []

    async def record(name: str, incarnation: int) -> None:
        server.incarnations[name] = incarnation
        saved.append(dict(server.incarnations))

    class Adopter:
        def __init__(self) -> None:
            self.told: list[dict[str, int]] = []

        def adopt(self, incarnations: dict[str, int]) -> None:
            self.told.append(dict(incarnations))

    async with served(tmp_path) as (server, meta):
        heard: list[dict[str, int]] = []
        meta.follow_pool(heard.append)  # type: ignore[attr-defined]
        server.incarnations = {LOST: 1, "10.9.9.2:7100": 2}
        f = await wide_file(meta)
        assert len(await meta.map_read(f.ino, 0, 1 * M)) == 4  # cached under its lease
        takeback = TakeBack(server, ADDRS, record)
        mine = Adopter()
        async with trio.open_nursery() as nursery, takeback.following(mine):  # type: ignore[arg-type]
            nursery.start_soon(takeback.run)
            takeback.restarted(LOST, 7)
            takeback.restarted(LOST, 7)  # (another transport finds it too: once)
            with trio.fail_after(10):
                while not heard:  # noqa: ASYNC110 - the client says nothing else
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert takeback.done == 1
        assert heard == [{LOST: 7}]
        assert mine.told == [{LOST: 1, "10.9.9.2:7100": 2}, {LOST: 7}]  # (on entry: the pool's)
        assert saved == [{LOST: 7, "10.9.9.2:7100": 2}]
        assert server.incarnations[LOST] == 7
        with pytest.raises(FsError) as exc:
            await meta.map_read(f.ino, 0, 1 * M)  # not from the map it had cached
        assert exc.value.errno == errno.EIO
        assert [e.volume for e in await meta.map_read(f.ino, 256 * K, 256 * K)] == [1]
        takeback.restarted(LOST, 7)  # what a stale transport says: nothing to do
        assert not takeback.pending
        await meta.release(f.ino)

        from memfs.meta.remote import open_remote_meta

        async with open_remote_meta("127.0.0.1", server.port, SECRET) as late:
            assert late.pool_follower.incarnations[LOST] == 7  # (its transport starts with these)
        await leave(server, meta)


async def test_a_reader_of_the_other_stripes_does_not_hold_the_take_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A client reading the healthy stripes of a file that lost some, in a loop, fetches
    its map again and again during the take-back's recall: the take-back ends all the
    same (what it fetches then names no chunk of the lost server), and the reads go
    on.  (Found by a review: the recall went round for as long as the reader read.)"""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # "restarted", "taken back"
    async with served(tmp_path) as (server, meta):
        server.incarnations = {LOST: 1, "10.9.9.2:7100": 2}
        f = await wide_file(meta)
        takeback = TakeBack(server, ADDRS)
        reads = 0
        done = trio.Event()

        async def reader() -> None:
            nonlocal reads
            while not done.is_set():
                assert [e.volume for e in await meta.map_read(f.ino, 256 * K, 256 * K)] == [1]
                reads += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(takeback.run)
            while reads < 10:  # noqa: ASYNC110 - the reader says nothing else
                await trio.sleep(0.01)
            takeback.restarted(LOST, 7)
            with trio.fail_after(10):
                while not takeback.done:  # noqa: ASYNC110 - nor does the take-back
                    await trio.sleep(0.01)
            started = reads
            while reads < started + 10:  # noqa: ASYNC110
                await trio.sleep(0.01)
            done.set()
            nursery.cancel_scope.cancel()
        await meta.release(f.ino)
        await leave(server, meta)


async def test_a_client_that_missed_the_take_back_hears_it_when_it_registers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A client whose connection was down when the take-back was told (or that comes
    back to a restarted mds, which tells nobody) hears it from the pool's
    incarnations at its next registration: what changed of what it knew."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # the client reconnects
    async with served(tmp_path) as (server, meta):
        told: list[dict[str, int]] = []
        meta.follow_pool(told.append)  # type: ignore[attr-defined]

        async def reconnect(n: int) -> None:
            sid = meta.session  # type: ignore[attr-defined]
            old = server.sessions[sid].conn
            server.sessions.evict(sid, "test: the client's connection is cut")
            with trio.fail_after(10):
                while server.sessions[sid].conn in (None, old):  # noqa: ASYNC110
                    with contextlib.suppress(FsError):
                        await meta.getattr(ROOT)  # it reconnects by itself at its next call
                    await trio.sleep(0.05)
            assert len(told) == n

        # Met by the mds after the client first registered: noted, not told (nothing
        # the client knew changed).
        server.incarnations = {LOST: 1, "10.9.9.2:7100": 2}
        await reconnect(0)
        server.incarnations[LOST] = 7  # taken back meanwhile (told to nobody here)
        await reconnect(1)
        await reconnect(1)  # nothing new: nothing told
        assert told == [{LOST: 7}]
        assert meta.pool_follower.incarnations == {LOST: 7, "10.9.9.2:7100": 2}  # type: ignore[attr-defined]
        await leave(server, meta)


async def test_a_call_meeting_a_sealed_volume_changes_nothing() -> None:
    """While a server is taken back its volumes are sealed: a write or truncate that
    would use a chunk there fails before it changes anything (a call that fails is
    not journaled: a replay must come out the same); space ahead of a writer is
    simply not given there."""
    store = MetaStore(POOL)
    a = await store.mknod(ROOT, b"a", stat.S_IFREG | 0o644, 0, 0)
    await store.setxattr(a.ino, b"user.memfs.layout", WIDE)
    await store.map_write(a.ino, 0, 256 * K)  # stripe 0: volume 0
    before = state(store)
    store.placement.sealed = {0}
    for call in (store.map_write(a.ino, 192 * K, 128 * K),  # into volume 1's stripe too
                 store.truncate(a.ino, 100 * K)):  # its tail on volume 0 would be zeroed
        with pytest.raises(FsError) as exc:
            await call
        assert exc.value.errno == errno.EIO
    assert state(store) == before
    await store.map_write(a.ino, 256 * K, 10)  # volume 1: fine
    plan, _ = await store.allocate_ahead(a.ino, 256 * K + 10, 10, 1 * M)
    assert {e.volume for e in plan.extents} == {1}  # nothing ahead on the sealed volume
    store.placement.sealed = set()


async def test_fetches_into_lost_memory_survive_a_snapshot() -> None:
    """A snapshot taken while such a fetch runs keeps its chunks apart: a replayed
    install does not put them in the file, and a restart frees them."""
    store = MetaStore(POOL)
    a = await store.mknod(ROOT, b"a", stat.S_IFREG | 0o644, 0, 0)
    await store.setxattr(a.ino, b"user.memfs.layout", WIDE)
    inode = store.inodes[a.ino]
    inode.size = inode.backed = 1 * M
    (k, vol, voff), = store.reserve(a.ino, [0])
    store.lose_memory({0})
    again = load_state(dump_state(store, 0, POOL), POOL)
    assert again.placement.doomed == {(vol, voff)} and not again.reserved
    dirty = again.space.dirty_chunks
    assert not again.install(a.ino, k, vol, voff)
    assert again.inodes[a.ino].chunks == {}
    assert again.space.dirty_chunks == dirty + 1
    restarted = load_state(dump_state(store, 0, POOL), POOL)
    restarted.placement.release_reserved()
    assert not restarted.placement.doomed
    assert restarted.space.dirty_chunks == dirty + 1


async def test_a_client_adopts_only_after_answering_the_recalls_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A POOL frame read while a recall is still being answered (a transfer under the
    old map still runs: the answer waits for it) is adopted only after that answer:
    until then that transfer could reach the server's new memory."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with served(tmp_path) as (server, meta):
        told: list[dict[str, int]] = []
        meta.follow_pool(told.append)  # type: ignore[attr-defined]
        f = await meta.create(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0)
        await meta.map_write(f.ino, 0, 100 * K)
        await meta.release(f.ino)
        await meta.open(f.ino)
        await meta.map_read(f.ino, 0, 100 * K)
        async with trio.open_nursery() as nursery:
            with meta.io(f.ino):  # a transfer under that map
                nursery.start_soon(server.lease_policy.recall_held, [f.ino])
                while not meta.leases.recalls_open:  # type: ignore[attr-defined]  # noqa: ASYNC110
                    await trio.sleep(0.01)
                server.sessions.tell_pool({LOST: 7})
                await trio.sleep(0.3)
                assert told == []
            with trio.fail_after(10):
                while not told:  # noqa: ASYNC110 - told once the answer is sent
                    await trio.sleep(0.01)
        assert told == [{LOST: 7}]
        await meta.release(f.ino)
        await leave(server, meta)


async def test_the_incarnations_file_keeps_a_take_back(tmp_path: Path) -> None:
    """The scrubber's servers met first never undo a take-back (each change is merged
    as the copy is when it is written); a take-back that cannot be written is not
    made at all."""
    from memfs.mds import IncarnationsFile, _load_incarnations

    incs: dict[str, int] = {}
    f = IncarnationsFile(str(tmp_path), incs)
    await f.met({"a": 1})
    await f.took_back("a", 2)
    await f.met({"a": 1, "b": 3})  # (a transport that met "a" before the take-back)
    assert incs == {"a": 2, "b": 3} == _load_incarnations(str(tmp_path))
    broken = IncarnationsFile(str(tmp_path / "gone"), incs)  # (a directory that went)
    with pytest.raises(OSError):
        await broken.took_back("b", 4)
    assert incs == {"a": 2, "b": 3}


async def test_a_pool_frame_held_back_is_told_only_if_still_news(tmp_path: Path) -> None:
    """A POOL frame held back for recalls: a recall not answered on a live connection
    (we are being evicted) drops it; one whose connection died does not (our
    registration since answered it); and it is told only if nothing was told after
    it (a later frame or registration says all the mds took back, newer)."""
    from types import SimpleNamespace

    from memfs.meta.lease_client import LeaseKeeper

    def ended_recall(answered: bool, dead: bool) -> list[tuple[trio.Event, list[object]]]:
        ev = trio.Event()
        ev.set()
        return [(ev, [answered, SimpleNamespace(dead=dead)])]

    assert await LeaseKeeper.after_recalls(ended_recall(False, dead=True))
    assert not await LeaseKeeper.after_recalls(ended_recall(False, dead=False))
    assert await LeaseKeeper.after_recalls(ended_recall(True, dead=False))
    async with served(tmp_path) as (server, meta):
        told: list[dict[str, int]] = []
        meta.follow_pool(told.append)  # type: ignore[attr-defined]
        answered = trio.Event()
        pending = [(answered, [True, SimpleNamespace(dead=False)])]
        async with trio.open_nursery() as nursery:
            pool = meta.pool_follower  # type: ignore[attr-defined]
            nursery.start_soon(pool._after_recalls, {LOST: 2}, pending, pool.told)
            pool.tell({LOST: 3})  # (newer, told first)
            answered.set()
        assert told == [{LOST: 3}]
        await leave(server, meta)
