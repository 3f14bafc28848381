"""The burst buffer in the mds journal (``memfs mds --backing DIR --journal J``).

A real :class:`MetaServer` with a :class:`Journal` serves a :class:`BackedMeta`
in this process; a client (:class:`RemoteMeta` + the data engine over the same
in-process volumes, which outlive the "mds") writes, renames, reads files staged
from DIR into a pool small enough to evict.  Then the server goes away and a
new one recovers from the journal: the store, the dirty files and the queue of
namespace changes must come back exactly, and write-back must finish the job.
(The SIGKILL tests with real processes are in tests/mount/test_cluster_backing.py.)
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from memfs.backing.dirside import BackingDir
from memfs.backing.meta import BackedMeta
from memfs.backing.ops import EXCHANGE_PLANS, NsKind
from memfs.backing.recovery import BackingJournal
from memfs.config import FlushConfig, PoolConfig
from memfs.data import DataEngine
from memfs.errors import FsError
from memfs.meta import Meta, SetAttr
from memfs.meta.journal import Journal, JournalError, dump_state
from memfs.meta.remote import open_remote_meta
from memfs.meta.server import MetaServer
from memfs.meta.store import RENAME_EXCHANGE, MetaStore
from memfs.transport.local import LocalTransport

K, M = 1 << 10, 1 << 20
POOL = PoolConfig(size=4 * M, volumes=2, stripe_size=128 * K, chunk_size=64 * K)
SECRET = b"backing-journal-secret-0123456789"
ROOT = 1
REG, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755


class Mds:
    def __init__(self, backed: BackedMeta, bj: BackingJournal, store: MetaStore,
                 meta: Meta, data: DataEngine) -> None:
        self.backed, self.bj, self.store, self.meta, self.data = backed, bj, store, meta, data


@asynccontextmanager
async def mds(jdir: Path, backing: Path, transport: LocalTransport, *, delay: float = 3600.0,
              hold_mirror: bool = False) -> AsyncIterator[Mds]:
    """An mds with --backing and --journal, in this process; leaving it is a crash
    (nothing drained; what was appended is written, as after a SIGKILL between two
    group commits at worst)."""
    journal = Journal(jdir, fsync=False)
    cfg = FlushConfig(str(backing), delay=delay, workers=1, fsync=False)
    bj = BackingJournal(cfg, journal)
    try:
        store = await journal.open(POOL, bj)

        async def recycle() -> None:  # no scrubber here: freed chunks reused as they are
            store.space.recycle_unzeroed()

        store.space.reclaimer = recycle
        async with trio.open_nursery() as nursery:
            server = MetaServer(store, SECRET, None, journal, session_grace=0.2)
            backed = BackedMeta(store, transport, cfg, recovered=bj)
            backed.before_evict = server.recall_inodes
            if bj.loaded:
                await backed.resume()
            else:
                await backed.load()
                bj.loaded = True
                await journal.snapshot_now()
            if hold_mirror:  # DIR fails: namespace changes stay queued, files dirty
                for name in ("apply", "publish", "exchange_plan", "exchange_step"):
                    setattr(backed.dirside, name, _broken)
            await nursery.start(backed.run)
            server.meta = backed
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            async with open_remote_meta("127.0.0.1", port, SECRET) as meta:
                yield Mds(backed, bj, store, meta, DataEngine(meta, transport))
            nursery.cancel_scope.cancel()
    finally:
        journal.close()


def _broken(*args: object) -> Any:
    raise OSError(errno.EIO, "Input/output error (test)")


@pytest.fixture(autouse=True)
def _dir_errors_are_expected(caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]


def state(store: MetaStore) -> dict[str, Any]:
    s = dump_state(store, 0, POOL)
    for key in ("seq", "backing", "sessions"):  # sessions: a restart changes them
        del s[key]
    return s


async def until(what: Any, seconds: float = 20.0) -> None:
    with trio.fail_after(seconds):
        while not what():  # noqa: ASYNC110 - the parts signal nothing a test can wait on
            await trio.sleep(0.01)


async def flushed(m: Mds) -> None:
    """``memfs flush --wait``."""
    ticket = (await m.backed.control("flush", {}))["ticket"]
    await until(lambda: m.backed.tickets.progress(ticket).done)


@pytest.fixture
def seeded(tmp_path: Path) -> Path:
    backing = tmp_path / "backing"
    (backing / "in").mkdir(parents=True)
    for n in range(4):  # 4 x 1 MiB in a 4 MiB pool: reading them all evicts
        (backing / "in" / f"f{n}").write_bytes(bytes([n + 1]) * M)
    (backing / "in" / "x").write_bytes(b"x" * 1000)
    (backing / "in" / "y").write_bytes(b"y" * 2000)
    return backing


async def workload(m: Mds) -> dict[str, bytes]:
    """Fetches, evictions, writes, namespace changes; returns path -> content."""
    meta, data = m.meta, m.data
    indir = (await meta.lookup(ROOT, b"in")).ino
    for n in range(4):
        ino = (await meta.lookup(indir, b"f%d" % n)).ino
        assert bytes(await data.read(ino, 0, M)) == bytes([n + 1]) * M
    out = (await meta.mknod(ROOT, b"out", DIR, 0, 0)).ino
    files = {}
    for n in range(3):
        a = await meta.mknod(out, b"r%d" % n, REG, 0, 0)
        payload = os.urandom(100 * K * (n + 1))
        await meta.open(a.ino)
        await data.write(a.ino, 0, payload)
        await meta.release(a.ino)
        files[f"out/r{n}"] = payload
    # a file whose data is only in DIR moves; another is renamed over
    await meta.rename(indir, b"f0", out, b"moved")
    files["out/moved"] = bytes([1]) * M
    await meta.rename(indir, b"x", indir, b"y", RENAME_EXCHANGE)
    files["in/y"], files["in/x"] = b"x" * 1000, b"y" * 2000
    await meta.unlink(out, b"r2")
    del files["out/r2"]
    return files


async def test_recovery_rebuilds_store_and_write_back_state_exactly(
    tmp_path: Path, seeded: Path
) -> None:
    transport = LocalTransport(POOL.volumes, POOL.size // POOL.volumes)
    jdir = tmp_path / "journal"
    async with mds(jdir, seeded, transport, hold_mirror=True) as m:
        await workload(m)
        assert m.backed.residency.evicted_bytes > 0  # the pool was too small: evicted
        assert m.backed.tracker.dirty and m.backed.mirror.ops
        await trio.sleep(0.1)  # let the group commit catch up
        live, live_bj = state(m.store), m.bj.dump()
    async with mds(jdir, seeded, transport, hold_mirror=True) as m2:
        assert state(m2.store) == live
        assert m2.bj.dump() == live_bj


async def test_recovered_write_back_finishes_the_job(tmp_path: Path, seeded: Path) -> None:
    transport = LocalTransport(POOL.volumes, POOL.size // POOL.volumes)
    jdir = tmp_path / "journal"
    async with mds(jdir, seeded, transport, hold_mirror=True) as m:
        files = await workload(m)
    async with mds(jdir, seeded, transport, delay=0.0) as m2:
        await flushed(m2)
        for path, payload in files.items():
            assert (seeded / path).read_bytes() == payload, path
            ino = m2.store.resolve(path.encode()).ino
            assert bytes(await m2.data.read(ino, 0, len(payload) + 1)) == payload
        assert not (seeded / "in" / "f0").exists() and not (seeded / "out" / "r2").exists()
        st = await m2.backed.status()
        assert (st.dirty_files, st.namespace_ops, st.errors) == (0, 0, ())
    # and again: nothing left to do, nothing lost
    async with mds(jdir, seeded, transport) as m3:
        assert not m3.backed.tracker.dirty and not m3.backed.mirror.ops


async def test_exchange_cut_short_resumes_instead_of_swapping_back(
    tmp_path: Path, seeded: Path
) -> None:
    """A RENAME_EXCHANGE applied to DIR in three renames, each recorded before the
    next: replayed from any step, it finishes the swap, never undoes it."""
    for done in range(len(EXCHANGE_PLANS[1]) + 1):
        transport = LocalTransport(POOL.volumes, POOL.size // POOL.volumes)
        back = tmp_path / f"b{done}"
        (back / "in").mkdir(parents=True)
        (back / "in" / "x").write_bytes(b"X")
        (back / "in" / "y").write_bytes(b"Y")
        jdir = tmp_path / f"j{done}"
        async with mds(jdir, back, transport, hold_mirror=True) as m:
            indir = (await m.meta.lookup(ROOT, b"in")).ino
            await m.meta.rename(indir, b"x", indir, b"y", RENAME_EXCHANGE)
            op = m.backed.mirror.ops[0]
            assert op.kind is NsKind.EXCHANGE
            # what a crash after `done` renames leaves (the last one maybe unrecorded)
            dirside = m.backed.dirside  # its methods fail while held: call the real ones
            op.plan = BackingDir.exchange_plan(dirside, op)
            m.bj.note("_nsstep", [op.plan, 0])
            swap_dir = m.backed.mirror.swap_dir
            for op.step in range(done):
                BackingDir.exchange_step(dirside, op, swap_dir)
            if done:
                m.bj.note("_nsstep", [op.plan, done - 1])  # the last step not recorded
            await trio.sleep(0.1)
        async with mds(jdir, back, transport, delay=0.0) as m2:
            await flushed(m2)
        assert (back / "in" / "x").read_bytes() == b"Y", done
        assert (back / "in" / "y").read_bytes() == b"X", done
        assert not list((back / ".memfs-tmp").glob("*/swap")), done


async def test_journal_and_backing_must_belong_together(tmp_path: Path, seeded: Path) -> None:
    transport = LocalTransport(POOL.volumes, POOL.size // POOL.volumes)
    jdir = tmp_path / "journal"
    async with mds(jdir, seeded, transport):
        pass
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(JournalError, match="belongs to backing directory"):
        async with mds(jdir, other, transport):
            pass
    plain = Journal(jdir)  # without --backing
    with pytest.raises(JournalError, match="with --backing"):
        await plain.open(POOL)
    plain.close()
    j2 = tmp_path / "j2"
    plain = Journal(j2)
    await plain.open(POOL)
    plain.close()
    with pytest.raises(JournalError, match="without --backing"):
        async with mds(j2, seeded, transport):
            pass




async def test_replay_of_a_pinned_file_queues_what_the_live_mds_queued(
    tmp_path: Path, seeded: Path
) -> None:
    """A file pinned by an exclusion is not recorded as such (found dirty after a
    restart): a change to it must queue the same namespace operations live and in
    replay, or replay pops the wrong ones."""
    transport = LocalTransport(POOL.volumes, POOL.size // POOL.volumes)
    jdir = tmp_path / "journal"
    async with mds(jdir, seeded, transport, delay=0.0) as m:
        meta, data = m.meta, m.data
        scratch = (await meta.mknod(ROOT, b"scratch", DIR, 0, 0)).ino
        await meta.setxattr(scratch, b"user.memfs.flush", b"off")
        keep = (await meta.mknod(ROOT, b"keep", DIR, 0, 0)).ino
        f = (await meta.mknod(scratch, b"f", REG, 0, 0)).ino
        await data.write(f, 0, b"pinned data")
        await until(lambda: f in m.backed.tracker.pinned)
        await meta.link(f, keep, b"f")
        await meta.unlink(scratch, b"f")  # no longer under the excluded tree
        await meta.setattr(f, SetAttr(mode=0o600))
        await flushed(m)
        assert (seeded / "keep" / "f").read_bytes() == b"pinned data"
        await trio.sleep(0.1)
        live = m.bj.dump()
    async with mds(jdir, seeded, transport) as m2:  # replays without a JournalError
        assert m2.bj.dump() == live


async def test_clients_cannot_create_the_reserved_name(tmp_path: Path, seeded: Path) -> None:
    """``.memfs-tmp`` at the root holds the mds's temporary copies in DIR: refused
    to clients, by create as by mknod."""
    transport = LocalTransport(POOL.volumes, POOL.size // POOL.volumes)
    async with mds(tmp_path / "journal", seeded, transport) as m:
        for call in (m.meta.create(ROOT, b".memfs-tmp", REG, 0, 0),
                     m.meta.mknod(ROOT, b".memfs-tmp", DIR, 0, 0)):
            with pytest.raises(FsError) as refused:
                await call
            assert refused.value.errno == errno.EPERM
