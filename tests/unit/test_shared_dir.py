"""One directory worked in from several clients (mdtest's shared directory): another
client's change of a name leaves this client's kernel its other names, and this
client's cache the directory's completeness, so its own creates ask nothing about
names first."""

from __future__ import annotations

import errno
import stat

import pytest

from memfs.errors import FsError
from memfs.meta import cache as cache_mod
from tests.unit.test_leases import ROOT, F, _calls_seen, cluster

D = stat.S_IFDIR | 0o755


async def test_a_recall_of_names_the_kernel_was_not_given_leaves_its_names() -> None:
    """The kernel forgets every name at once (the one lock-free way), so only a recall
    of a name it was given a timeout for makes it: another node's creates of names
    this node never looked up used to make its kernel look up even the directory
    itself again at each of its own creates."""
    async with cluster(2, kernel_names=True) as (server, (a, b), (_, kb)):
        d = await a.mknod(ROOT, b"d", D, 0, 0)
        assert (await b.lookup(ROOT, b"d")).ino == d.ino
        assert (b.entry_ttl(ROOT, b"d") or 0) > 0  # the FUSE layer's reply
        mine = await b.create(d.ino, b"mine", F, 0, 0)
        await b.release(mine.ino)
        assert (b.entry_ttl(d.ino, b"mine") or 0) > 0
        for k in range(3):
            f = await a.create(d.ino, b"a%d" % k, F, 0, 0)  # recalls b: b"a<k>"
            await a.release(f.ino)
        assert kb.names_forgotten == 0, "b's kernel was never given those names"
        assert (b.entry_ttl(ROOT, b"d") or 0) > 0 and (b.entry_ttl(d.ino, b"mine") or 0) > 0
        await a.unlink(d.ino, b"mine")  # a name b's kernel holds
        assert kb.names_forgotten == 1, "b's kernel forgot its names before a's unlink returned"
        with pytest.raises(FsError):
            await b.lookup(d.ino, b"mine")
        # An absent name given to the kernel counts too.
        with pytest.raises(FsError):
            await b.lookup(d.ino, b"later")
        assert (b.entry_ttl(d.ino, b"later") or 0) > 0
        await a.create(d.ino, b"later", F, 0, 0)
        assert kb.names_forgotten == 2


async def test_a_name_the_kernel_moved_in_our_rename_counts_as_given() -> None:
    """A rename moves the kernel's dentry with the timeout it had: another node's
    change of the new name must make the kernel forget it."""
    async with cluster(2, kernel_names=True) as (server, (a, b), (_, kb)):
        f = await b.create(ROOT, b"x", F, 0, 0)
        await b.release(f.ino)
        assert (b.entry_ttl(ROOT, b"x") or 0) > 0
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
            b.entry_ttl(d.ino, name)
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
