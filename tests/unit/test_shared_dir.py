"""One directory worked in from several clients (mdtest's shared directory): another
client's change of a name leaves this client's kernel its other names, and this
client's cache the directory's completeness, so its own creates ask nothing about
names first."""

from __future__ import annotations

import collections
import errno
import stat

import pytest
import trio

from memfs.errors import FsError
from memfs.fs import Operations
from memfs.meta import cache as cache_mod
from tests.unit.test_leases import ROOT, F, _calls_seen, _leased_directory, cluster

D = stat.S_IFDIR | 0o755


async def test_a_recall_of_names_the_kernel_was_not_given_leaves_its_names() -> None:
    """The kernel forgets every name at once (the one lock-free way), so only a recall
    of a name it was given a timeout for makes it: another node's creates of names
    this node never looked up used to make its kernel look up even the directory
    itself again at each of its own creates."""
    async with cluster(2, kernel_names=True) as (server, (a, b), (_, kb)):
        d = await a.mknod(ROOT, b"d", D, 0, 0)
        assert (await b.lookup(ROOT, b"d")).ino == d.ino
        assert (b.entry_ttl(ROOT, b"d", d.ino) or 0) > 0  # the FUSE layer's reply
        mine = await b.create(d.ino, b"mine", F, 0, 0)
        await b.release(mine.ino)
        assert (b.entry_ttl(d.ino, b"mine", mine.ino) or 0) > 0
        for k in range(3):
            f = await a.create(d.ino, b"a%d" % k, F, 0, 0)  # recalls b: b"a<k>"
            await a.release(f.ino)
        assert kb.names_forgotten == 0, "b's kernel was never given those names"
        assert (b.entry_ttl(ROOT, b"d", d.ino) or 0) > 0
        assert (b.entry_ttl(d.ino, b"mine", mine.ino) or 0) > 0
        await a.unlink(d.ino, b"mine")  # a name b's kernel holds
        assert kb.names_forgotten == 1, "b's kernel forgot its names before a's unlink returned"
        with pytest.raises(FsError):
            await b.lookup(d.ino, b"mine")
        # An absent name given to the kernel counts too.
        with pytest.raises(FsError):
            await b.lookup(d.ino, b"later")
        assert (b.entry_ttl(d.ino, b"later", 0) or 0) > 0
        await a.create(d.ino, b"later", F, 0, 0)
        assert kb.names_forgotten == 2


async def test_a_name_the_kernel_moved_in_our_rename_counts_as_given() -> None:
    """A rename moves the kernel's dentry with the timeout it had: another node's
    change of the new name must make the kernel forget it."""
    async with cluster(2, kernel_names=True) as (server, (a, b), (_, kb)):
        f = await b.create(ROOT, b"x", F, 0, 0)
        await b.release(f.ino)
        assert (b.entry_ttl(ROOT, b"x", f.ino) or 0) > 0
        await b.rename(ROOT, b"x", ROOT, b"y")
        assert kb.names_forgotten == 0
        await a.unlink(ROOT, b"y")
        assert kb.names_forgotten == 1


async def test_past_the_names_kept_every_recall_of_names_forgets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_mod, "KERNEL_NAMES_KEPT", 2)
    async with cluster(2, kernel_names=True) as (server, (a, b), (_, kb)):
        d = await a.mknod(ROOT, b"d", D, 0, 0)
        for name in (b"n0", b"n1", b"n2"):  # the third is one too many
            with pytest.raises(FsError):
                await b.lookup(d.ino, name)
            b.entry_ttl(d.ino, name, 0)
        await a.mknod(d.ino, b"other", F, 0, 0)
        assert kb.names_forgotten == 1, "no longer known which names the kernel holds"
        await a.mknod(d.ino, b"other2", F, 0, 0)
        assert kb.names_forgotten == 1, "after forgetting, it holds none"


async def test_a_complete_directory_stays_complete_across_names_changed_elsewhere() -> None:
    """b made the directory (complete: every name known); a's creates and unlinks
    there make those names unknown to b, not all the others: b's lookups of names
    nobody made are answered without a call, those of a's names ask."""
    async with cluster(2) as (server, (a, b), _):
        d = await b.mknod(ROOT, b"d", D, 0, 0)
        mine = await b.create(d.ino, b"mine", F, 0, 0)
        await b.release(mine.ino)
        assert (await a.lookup(d.ino, b"mine")).ino == mine.ino  # a holds d now
        made = await a.create(d.ino, b"theirs", F, 0, 0)  # recalls b: b"theirs"
        await a.release(made.ino)
        await a.unlink(d.ino, b"mine")  # recalls b: b"mine"
        seen = _calls_seen(server)
        for name in (b"free0", b"free1"):
            with pytest.raises(FsError) as absent:
                await b.lookup(d.ino, name)
            assert absent.value.errno == errno.ENOENT
        assert seen == [], "b still knows every name of d but the two changed"
        assert (await b.lookup(d.ino, b"theirs")).ino == made.ino
        with pytest.raises(FsError):
            await b.lookup(d.ino, b"mine")
        assert [v[0] for v in seen] == ["lookup", "lookup"]
        seen.clear()
        assert (await b.lookup(d.ino, b"theirs")).ino == made.ino
        with pytest.raises(FsError):
            await b.lookup(d.ino, b"mine")
        assert seen == [], "what b asked is known again"
        # b's own create, then another node's create of the name b looked up.
        with pytest.raises(FsError):
            await b.lookup(d.ino, b"late")
        late = await a.create(d.ino, b"late", F, 0, 0)
        await a.release(late.ino)
        assert (await b.lookup(d.ino, b"late")).ino == late.ino


async def test_a_directory_with_too_many_unknown_names_is_no_longer_complete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cache_mod, "UNKNOWN_KEPT", 2)
    async with cluster(2) as (server, (a, b), _):
        d = await b.mknod(ROOT, b"d", D, 0, 0)
        await a.lookup(ROOT, b"d")
        with pytest.raises(FsError):
            await a.lookup(d.ino, b"x")  # a holds d
        for k in range(3):
            await a.mknod(d.ino, b"a%d" % k, F, 0, 0)
        assert not b.cache.dirs[d.ino].complete and not b.cache.dirs[d.ino].unknown
        seen = _calls_seen(server)
        with pytest.raises(FsError):
            await b.lookup(d.ino, b"free")
        assert [v[0] for v in seen] == ["lookup"]


async def test_an_entry_gets_a_timeout_only_for_the_inode_the_cache_holds() -> None:
    """A listing is taken, then sent entry by entry after other awaits (its "." and
    ".." are looked up): meanwhile another node unlinks a name and another call here
    caches it as absent.  The listing's inode under that name gets no timeout
    (found by a review: the kernel kept the unlinked inode under the name)."""
    async with cluster(2, kernel_names=True) as (server, (a, b), _):
        d = await a.mknod(ROOT, b"d", D, 0, 0)
        x = await a.create(d.ino, b"x", F, 0, 0)  # kept open: the inode lives on
        await b.lookup(ROOT, b"d")
        snapshot = dict(await b.readdirplus(d.ino))
        await a.unlink(d.ino, b"x")  # recalls b: b"x"
        with pytest.raises(FsError):
            await b.lookup(d.ino, b"x")  # absent, cached
        assert snapshot[b"x"].ino == x.ino
        assert b.entry_ttl(d.ino, b"x", x.ino) == 0
        assert (b.entry_ttl(d.ino, b"x", 0) or 0) > 0


async def test_a_directory_removed_under_our_create_lease_is_forgotten() -> None:
    """A create lease taken back keeps the directory's names, but not when the
    directory itself goes (an rmdir elsewhere): the mds never recalls a destroyed
    inode again (found by a review: its names were kept for good)."""
    async with cluster(2) as (server, (a, b), _):
        d, _, _ = await _leased_directory(a)
        await a.unlink(d.ino, b"f0")  # held: made here under the lease
        assert d.ino in a.cache.creators
        await b.rmdir(ROOT, b"d")
        assert d.ino not in server.store.inodes
        assert d.ino not in a.cache.dirs


async def test_a_cluster_listing_gives_its_names_no_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel dates a listing's names (readdirplus) with its name epoch when the
    lister reads the reply, not when it asked: a recall in between could not make
    it forget them.  A cluster client's listing gives names no timeout (its lookups
    do); an embedded mount's listing gives the mount's."""
    import pyfuse3

    from memfs.config import PoolConfig
    from memfs.data import DataEngine
    from memfs.fs import Operations
    from memfs.meta.store import MetaStore
    from memfs.transport.local import LocalTransport

    got: dict[bytes, float] = {}

    def reply(token: object, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        got[name] = attr.entry_timeout
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
    pool = PoolConfig(size=16 << 20, volumes=2)
    store = MetaStore(pool)
    volumes = LocalTransport(pool.volumes, pool.volume_size)
    ops = Operations(store, DataEngine(store, volumes))
    await store.create(ROOT, b"a", F, 0, 0)
    for leased in (False, True):
        if leased:  # what a cluster client's lease allows
            monkeypatch.setattr(store, "entry_ttl", lambda parent, name, ino, listed=False: 0.0 if listed else 3.0)
        got.clear()
        fh = await ops.opendir(ROOT, None)  # type: ignore[arg-type]
        await ops.readdir(fh, 0, None)  # type: ignore[arg-type]
        await ops.releasedir(fh)
        assert got[b"a"] == (0.0 if leased else ops.entry_timeout)
        assert (await ops.lookup(ROOT, b"a")).entry_timeout == (3.0 if leased else ops.entry_timeout)
    await volumes.aclose()


def _fuse_layer(meta: object) -> Operations:
    """Just enough of fs.Operations to call _entry as the FUSE layer does."""
    ops = Operations.__new__(Operations)
    ops.backing = None
    ops.meta = meta  # type: ignore[assignment]
    ops.attr_timeout = ops.entry_timeout = 1.0
    ops._lookups = collections.Counter()
    return ops


async def test_a_listing_given_no_timeout_does_not_count_as_kernel_names() -> None:
    """Names a listing gave the kernel with no timeout are not names it holds: another
    node's unlink of one leaves the kernel's names alone (found by a review)."""
    async with cluster(2, kernel_names=True) as (server, (a, b), (_, kb)):
        d = await a.mknod(ROOT, b"d", D, 0, 0)
        x = await a.create(d.ino, b"x", F, 0, 0)
        await a.release(x.ino)
        await b.lookup(ROOT, b"d")
        ops = _fuse_layer(b)
        for name, at in await b.readdirplus(d.ino):
            assert ops._entry(at, d.ino, name, listed=True).entry_timeout == 0.0
        assert not b.cache.kernel_names.any_of(d.ino, [b"x"])
        await a.unlink(d.ino, b"x")
        assert kb.names_forgotten == 0


async def test_rmdir_under_a_create_lease_held_without_the_parent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """a holds d's create lease but not ROOT (it registered again, then created in d
    by its inode: a working directory kept across the reconnection).  b's rmdir of d
    recalls a with d alone: the mds says the directory goes (b"."), and a forgets it
    (found by a review: kept for good, the mds never recalls a destroyed inode)."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with cluster(2) as (server, (a, b), _):
        d = await a.mknod(ROOT, b"d", D, 0, 0)
        assert a._conn is not None
        a._conn.kill("test: cut")
        await trio.sleep(0.5)
        with trio.fail_after(10):
            await a.getattr(d.ino)  # waits for the reconnection (holds d only)
        f = await a.create(d.ino, b"f", F, 0, 0)
        await a.release(f.ino)
        assert d.ino in a.cache.creators
        holder = server.sessions[a.session]
        assert holder not in server.leases.holders.get(ROOT, {}), "a does not hold ROOT"
        await a.unlink(d.ino, b"f")  # under the lease
        await b.rmdir(ROOT, b"d")
        assert d.ino not in server.store.inodes
        assert d.ino not in a.cache.dirs


async def test_a_directory_replaced_by_a_rename_is_forgotten_by_its_holders() -> None:
    """A rename over an empty directory z: z's holders forget it (b"."), not keep it
    complete for good as a moved directory's holders keep theirs (its ".." aside)."""
    async with cluster(2) as (server, (a, b), _):
        z = await b.mknod(ROOT, b"z", D, 0, 0)
        y = await a.mknod(ROOT, b"y", D, 0, 0)
        await b.lookup(ROOT, b"y")
        with pytest.raises(FsError):
            await b.lookup(y.ino, b"inside")  # b holds y's names
        await a.rename(ROOT, b"y", ROOT, b"z")
        assert z.ino not in server.store.inodes
        assert z.ino not in b.cache.dirs
        assert b.cache.entry(y.ino, b"inside") == 0, "the moved directory keeps its names"


async def test_a_directory_we_rename_over_is_forgotten_here_too() -> None:
    """Our own rename over a directory is not recalled from us: we forget the directory
    there, as at our rmdir (found by a review: its names were kept for good)."""
    async with cluster(2) as (server, (a, b), _):
        z, _, _ = await _leased_directory(a, name=b"z")
        await a.unlink(z.ino, b"f0")  # held: z empty
        await a.mknod(ROOT, b"y", D, 0, 0)
        await a.rename(ROOT, b"y", ROOT, b"z")
        assert z.ino not in server.store.inodes
        assert z.ino not in a.cache.creators and z.ino not in a.cache.dirs


async def test_renames_do_not_count_kernel_names_a_kernel_cannot_forget() -> None:
    """No way to make the kernel forget names (an older kernel, no kernel): nothing is
    counted, so nothing grows (found by a review)."""
    async with cluster(1) as (server, (a,), _):  # no names_invalidator
        await a.mknod(ROOT, b"f0", F, 0, 0)
        for k in range(50):
            await a.rename(ROOT, b"f%d" % k, ROOT, b"f%d" % (k + 1))
        assert not a.cache.kernel_names


def test_unknown_names_of_all_directories_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the budget, the directories with the most unknown names are no longer
    complete, until half the budget is left (found by a review: 100 directories
    listed here and filled elsewhere would have kept ~130 MB of names)."""
    monkeypatch.setattr(cache_mod, "UNKNOWN_BUDGET", 4)
    c = cache_mod.ClientCache(term=4.0)
    c.new_directory(1)
    c.new_directory(2)
    c.drop_names(1, [b"a", b"b", b"c"])
    c.drop_names(2, [b"d", b"e"])  # 5 > 4: the first directory goes incomplete
    assert not c.dirs[1].complete and not c.dirs[1].unknown
    assert c.dirs[2].complete and c.dirs[2].unknown == {b"d", b"e"}
    assert c.unknowns == 2
    c.drop_names(2, [b"d"])  # known unknown already: not counted again
    assert c.unknowns == 2
