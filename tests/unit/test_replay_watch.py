"""Setattrs a registration replays (memfs.meta.server_claims) against what other
sessions do while it waits: the fields they set stay theirs, the rest is applied,
and the replaying session's writes keep their mtime.  Registrations are driven
here by hand, on connections with no client behind them (after a restart: the
store told which sessions were of the run before)."""

from __future__ import annotations

import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from memfs import wire
from memfs.meta import SetAttr, codec
from memfs.meta.server import MetaServer
from memfs.meta.server_conn import Connection, parse_call
from memfs.meta.store import ROOT_INO as ROOT
from tests.unit.test_leases import POOL, SECRET
from tests.unit.test_meta_conformance import metadata_only

F = stat.S_IFREG | 0o644
SA, SB = b"A" * 16, b"B" * 16


def _conn(server: MetaServer, peer: str) -> Connection:
    c = Connection(peer, server.sessions.new(), server)
    c.session.conn = c
    return c


async def _run(conn: Connection, *value: Any) -> Any:
    kind, body = await conn._execute(list(value), parse_call(list(value)))
    return kind, wire.decode(body) if kind.name.startswith("OK") else wire.decode_error(body)


def _setattr_at(ino: int, changes: SetAttr, t: int) -> tuple[str, list[Any]]:
    return ("setattr_at", [ino, *codec.setattr_at_args(changes), t])


def _replayed(g: int, ino: int, changes: SetAttr, c0: int) -> list[tuple[str, list[Any]]]:
    """a's held setattrs as its registration replays them: a chmod of *g* first (what
    another session does meanwhile runs while its recall waits: _while_replaying),
    then *changes* of *ino*, both made at ``c0 + 10``."""
    return [_setattr_at(g, SetAttr(mode=0o600), c0 + 10), _setattr_at(ino, changes, c0 + 10)]


@asynccontextmanager
async def _server() -> AsyncIterator[tuple[MetaServer, trio.Nursery]]:
    """A metadata server with short leases (a recall of a connection with no client
    behind it ends in an eviction soon), and a nursery cancelled at the end."""
    async with trio.open_nursery() as nursery:
        yield MetaServer(metadata_only(POOL), SECRET, lease_term=1.0, recall_timeout=0.3), nursery
        nursery.cancel_scope.cancel()


def _before_recalls(
    monkeypatch: pytest.MonkeyPatch, server: MetaServer,
    meanwhile: Callable[[Any, str, list[Any]], Awaitable[None]],
) -> None:
    """*meanwhile* runs before each recall the server makes for a call (a replayed
    one's included), with its arguments: what other sessions do while it waits."""
    policy = server.lease_policy
    recall_for = policy.recall_for

    async def first(session: Any, name: str, args: list[Any]) -> None:
        await meanwhile(session, name, args)
        await recall_for(session, name, args)

    monkeypatch.setattr(policy, "recall_for", first)


def _while_replaying(
    monkeypatch: pytest.MonkeyPatch, server: MetaServer, ino: int,
    call: Callable[[], Awaitable[Any]],
) -> list[Any]:
    """*call* runs once while a's registration waits for the recall of its replayed
    setattr of *ino*; what it returned (empty if it never ran)."""
    done: list[Any] = []

    async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
        if session.sid == SA and name == "setattr" and args[0] == ino and not done:
            done.append(await call())

    _before_recalls(monkeypatch, server, meanwhile)
    return done


async def _files(server: MetaServer, nursery: trio.Nursery, *, ahead: int = 0) -> tuple[int, int]:
    """Files f and g, made by a session that then holds nothing (no recalls of it);
    *ahead*: each written under a write lease with that much space ahead, which it
    keeps (as a restart within --grace does)."""
    server.nursery = nursery
    c = _conn(server, "maker")
    await server.claims.claim(c, b"C" * 16, {})
    inos = []
    for name in (b"f", b"g"):
        _, (ino, *_) = await _run(c, "create", ROOT, name, F, 0, 0)
        if ahead:
            kind, _ = await _run(c, "allocate_ahead", ino, 0, 100, ahead)
            assert kind.name == "OK_WRITE"
        await _run(c, "release", ino)
        inos.append(ino)
    settle, server.leases.settle = server.leases.settle, None
    server.leases.forget(c.session, said=True)  # (no leases, space ahead kept)
    server.leases.settle = settle
    return inos[0], inos[1]


async def _restarted_with_files(
    server: MetaServer, nursery: trio.Nursery,
) -> tuple[int, int, int, Connection, Connection]:
    """Files f and g, then an mds restart with sessions a and b of the run before
    (b registered again, a not yet): f, g, the files' last ctime, a's and b's
    connections."""
    f, g = await _files(server, nursery)
    c0 = max(server.store.inodes[x].ctime_ns for x in (f, g))
    _restarted(server, SA, SB)
    a, b = _conn(server, "a"), _conn(server, "b")
    await server.claims.claim(b, SB, {})
    return f, g, c0, a, b


async def _two_leased(server: MetaServer, nursery: trio.Nursery) -> list[int]:
    """Files f and g made by session a (SA), each under its write lease."""
    server.nursery = nursery
    a1 = _conn(server, "a1")
    await server.claims.claim(a1, SA, {})
    inos = []
    for name in (b"f", b"g"):
        _, (ino, *_) = await _run(a1, "create", ROOT, name, F, 0, 0)
        kind, _ = await _run(a1, "allocate_ahead", ino, 0, 65536, 1 << 20)
        assert kind.name == "OK_WRITE"
        inos.append(ino)
    return inos


def _restarted(server: MetaServer, *sids: bytes) -> None:
    """As after an mds restart: *sids* are sessions of the run before, within --grace."""
    server.store.this_run = set()
    server.store.eligible = set(sids)
    server.recovering = True


async def test_a_setattr_another_registration_replays_meanwhile_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a restart a and b both replay a chmod of f: a's (older, t1) and b's
    (newer, t2).  b registers while a's registration waits (a recall of its replay):
    b's mode stays, and a's setattr, with nothing left to set, is done."""
    async with _server() as (server, nursery):
        f, g = await _files(server, nursery)
        c0 = server.store.inodes[f].ctime_ns
        t1, t2 = c0 + 10, c0 + 20
        _restarted(server, SA, SB)
        a, b = _conn(server, "a"), _conn(server, "b")
        done: list[Any] = []

        async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
            if session.sid == SA and name == "setattr" and args[0] == f and not done:
                done.append(await server.claims.claim(
                    b, SB, {}, [], [_setattr_at(f, SetAttr(mode=0o640), t2)]))

        _before_recalls(monkeypatch, server, meanwhile)
        answer = await server.claims.claim(a, SA, {}, [], [_setattr_at(f, SetAttr(mode=0o600), t1)])
        assert done and done[0][3] == []  # b's applied
        # b's chmod (t2) came after a's (t1): it stays, and a's is not refused
        assert server.store.inodes[f].mode == stat.S_IFREG | 0o640, answer
        assert answer[3] == []


async def test_a_replayed_touch_gives_way_to_the_mtime_of_writes_made_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a restart: a touched f to an old mtime, then wrote (its report's mtime is
    that write's); its registration settles f, replays the touch, and gives f its
    write's mtime again, also when b chmods f while a later replayed call of a's
    waits (b's chmod sets no mtime)."""
    async with _server() as (server, nursery):
        f, g = await _files(server, nursery)
        c0 = server.store.inodes[f].ctime_ns
        old = 1_000_000_000
        t_touch, t_write, t_g = c0 + 10, c0 + 20, c0 + 30
        _restarted(server, SA, SB)
        a, b = _conn(server, "a"), _conn(server, "b")
        await server.claims.claim(b, SB, {})
        done = _while_replaying(monkeypatch, server, g, lambda: _run(b, "setattr", f, [0o640, None, None, None, None]))
        await server.claims.claim(
            a, SA, {}, [(f, 100, t_write, (0, 100))],
            [_setattr_at(f, SetAttr(mtime_ns=old), t_touch),
             _setattr_at(g, SetAttr(mode=0o600), t_g)])
        assert done and done[0][0].name.startswith("OK")
        i = server.store.inodes[f]
        assert i.mode == stat.S_IFREG | 0o640 and i.size == 100
        assert i.mtime_ns == t_write  # a wrote after its touch


async def test_a_replayed_touch_gives_way_to_later_writes_without_a_restart_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, a holding the write leases of f and g (its connection given up,
    registering on a new one)."""
    async with _server() as (server, nursery):
        f, g = await _two_leased(server, nursery)
        c0 = max(server.store.inodes[x].ctime_ns for x in (f, g))
        old = 1_000_000_000
        t_touch, t_write, t_g = c0 + 10, c0 + 20, c0 + 30
        b = _conn(server, "b")
        await server.claims.claim(b, SB, {})
        done = _while_replaying(monkeypatch, server, g, lambda: _run(b, "setattr", f, [0o640, None, None, None, None]))
        a2 = _conn(server, "a2")
        answer = await server.claims.claim(
            a2, SA, {f: 1, g: 1}, [(f, 65536, t_write, (0, 65536)), (g, 65536, t_g, (0, 65536))],
            [_setattr_at(f, SetAttr(mtime_ns=old), t_touch),
             _setattr_at(g, SetAttr(mode=0o600), t_g)])
        assert done and done[0][0].name.startswith("OK")
        assert answer[1] == [] and answer[3] == [], answer
        i = server.store.inodes[f]
        assert i.mode == stat.S_IFREG | 0o640 and i.size == 65536
        assert server.store.inodes[g].mode == stat.S_IFREG | 0o600
        assert i.mtime_ns == t_write  # a wrote after its touch


async def test_a_truncate_elsewhere_leaves_a_replayed_chmod_to_apply(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """b truncates f (its call was waiting for a's lease) while a's registration
    waits: b set no mode, so a's replayed chmod of f (made before) is applied, as
    the serial order (a's chmod, then b's truncate) gives, and a's size does not
    grow f back."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # b answers no recall here
    async with _server() as (server, nursery):
        f, g = await _two_leased(server, nursery)
        c0 = max(server.store.inodes[x].ctime_ns for x in (f, g))
        b = _conn(server, "b")
        await server.claims.claim(b, SB, {})
        done = _while_replaying(monkeypatch, server, g, lambda: _run(b, "truncate", f, 100))
        a2 = _conn(server, "a2")
        answer = await server.claims.claim(
            a2, SA, {f: 1, g: 1}, [(f, 65536, c0 + 5, (0, 65536)), (g, 65536, c0 + 5, (0, 65536))],
            _replayed(g, f, SetAttr(mode=0o600), c0))
        assert done and done[0][0].name.startswith("OK")
        assert server.store.inodes[f].size == 100
        assert answer[3] == [], answer
        assert server.store.inodes[f].mode == stat.S_IFREG | 0o600


D = stat.S_IFDIR | 0o755


async def test_a_setattr_made_elsewhere_under_a_new_lease_stays(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """a's chmod 600 of f (t1, under its lease) is replayed; meanwhile b takes f's
    write lease and chmods f to 640 under it (a setattr_at, t2 > t1): 640 stays, as
    in the serial order."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # b answers no recall
    async with _server() as (server, nursery):
        f, g = await _two_leased(server, nursery)
        c0 = max(server.store.inodes[x].ctime_ns for x in (f, g))
        b = _conn(server, "b")
        await server.claims.claim(b, SB, {})
        done: list[Any] = []

        async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
            if session.sid == SA and name == "setattr" and args[0] == g and not done:
                k, _ = await _run(b, "allocate_ahead", f, 0, 100, 0)
                done.append(k)
                fields, *vals = codec.setattr_at_args(SetAttr(mode=0o640))
                done.append(await _run(b, "setattr_at", f, fields, *vals, c0 + 20))
                server.leases.forget(b.session, said=True)  # (b answers a recall)

        _before_recalls(monkeypatch, server, meanwhile)
        a2 = _conn(server, "a2")
        answer = await server.claims.claim(
            a2, SA, {}, [],
            _replayed(g, f, SetAttr(mode=0o600), c0))
        assert done and done[0].name == "OK_WRITE", done
        assert done[1][0].name.startswith("OK"), done
        assert answer[3] == [], answer
        assert stat.S_IMODE(server.store.inodes[f].mode) == 0o640, oct(server.store.inodes[f].mode)


async def test_a_create_elsewhere_keeps_its_directorys_mtime_over_a_replayed_touch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """After a restart a replays a touch of directory d (t1, an old mtime); meanwhile
    b creates d/x: d keeps the create's mtime, as in the serial order (also within
    one tick of the coarse clock, where the mtime's value does not move)."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # b answers no recall
    async with _server() as (server, nursery):
        f, g = await _files(server, nursery)
        c = _conn(server, "maker2")
        await server.claims.claim(c, b"M" * 16, {})
        _, (d, *_) = await _run(c, "mknod", ROOT, b"d", D, 0, 0, 0, None)
        server.leases.forget(c.session, said=True)
        c0 = max(server.store.inodes[x].ctime_ns for x in (d, g))
        _restarted(server, SA, SB)
        a, b = _conn(server, "a"), _conn(server, "b")
        await server.claims.claim(b, SB, {})
        done = _while_replaying(monkeypatch, server, g, lambda: _run(b, "create", d, b"x", F, 0, 0))
        old = 1_000_000_000
        answer = await server.claims.claim(
            a, SA, {}, [],
            _replayed(g, d, SetAttr(mtime_ns=old), c0))
        assert done and done[0][0].name.startswith("OK"), done
        assert answer[3] == [], answer
        assert server.store.inodes[d].mtime_ns != old, "b's create's mtime was undone"


async def test_a_chown_elsewhere_leaves_a_replayed_chmod_to_apply(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """After a restart a replays chmod 600 of f (t1); meanwhile b chowns f (the
    store's chown leaves the mode): mode 600 and b's owner, as in the serial order."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # b answers no recall
    async with _server() as (server, nursery):
        f, g, c0, a, b = await _restarted_with_files(server, nursery)
        done = _while_replaying(monkeypatch, server, g, lambda: _run(b, "setattr", f, [None, 1000, None, None, None]))
        answer = await server.claims.claim(
            a, SA, {}, [],
            _replayed(g, f, SetAttr(mode=0o600), c0))
        assert done and done[0][0].name.startswith("OK"), done
        assert answer[3] == [], answer
        i = server.store.inodes[f]
        assert i.uid == 1000
        assert stat.S_IMODE(i.mode) == 0o600, oct(i.mode)


async def test_a_read_elsewhere_keeps_the_access_time_it_moved(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """After a restart a replays a utime of f (an old atime, t1); meanwhile b reads f
    (relatime moves the atime, as it would after a's utime in the serial order):
    the read's atime stays."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # b answers no recall
    async with _server() as (server, nursery):
        f, g, c0, a, b = await _restarted_with_files(server, nursery)
        done: list[Any] = []

        async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
            if session.sid == SA and name == "setattr" and args[0] == g and not done:
                await trio.sleep(0.05)  # (the coarse clock)
                before = server.store.inodes[f].atime_ns
                done.append(await _run(b, "map_read", f, 0, 10))
                done.append(server.store.inodes[f].atime_ns != before)

        _before_recalls(monkeypatch, server, meanwhile)
        old = 1_000_000_000
        await server.claims.claim(
            a, SA, {}, [],
            _replayed(g, f, SetAttr(atime_ns=old), c0))
        assert done and done[0][0].name.startswith("OK") and done[1], done
        assert server.store.inodes[f].atime_ns != old, "b's read's atime was undone"


async def test_a_stale_report_of_another_registration_leaves_a_replayed_touch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """After a restart (the preallocation of the run before kept within grace) a
    replays a touch of f; meanwhile b (also of the run before) registers with a stale
    report of f (an older mtime, no larger size), whose settle only trims: a's touch
    is applied."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with _server() as (server, nursery):
        f, g = await _files(server, nursery, ahead=1 << 20)
        assert len(server.store.inodes[f].chunks or {}) > 1  # preallocated past EOF
        i = server.store.inodes[f]
        m0, c0 = i.mtime_ns, max(server.store.inodes[x].ctime_ns for x in (f, g))
        _restarted(server, SA, SB)
        a, b = _conn(server, "a"), _conn(server, "b")
        done: list[Any] = []

        async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
            if session.sid == SA and name == "setattr" and args[0] == g and not done:
                n = len(server.store.inodes[f].chunks or {})
                done.append(await server.claims.claim(b, SB, {}, [(f, 50, m0 - 5, (0, 50))], []))
                done.append(len(server.store.inodes[f].chunks or {}) < n)  # trimmed only

        _before_recalls(monkeypatch, server, meanwhile)
        touch = c0 + 1_000_000
        await server.claims.claim(
            a, SA, {}, [],
            _replayed(g, f, SetAttr(mtime_ns=touch), c0))
        assert done and done[1], done
        assert server.store.inodes[f].mtime_ns == touch, (server.store.inodes[f].mtime_ns, m0)


async def test_a_setattr_left_with_nothing_to_set_is_done_also_when_sent_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """a's chmod of f has nothing left to set (b chmodded f while a's registration
    waited) and is answered as done; that answer is lost, and a registers again with
    the same calls: done again, not refused."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with _server() as (server, nursery):
        f, g, c0, a, b = await _restarted_with_files(server, nursery)
        done: list[Any] = []

        async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
            if session.sid == SA and name == "setattr" and args[0] == g and not done:
                done.append(await _run(b, "setattr", f, [0o640, None, None, None, None]))
                server.leases.forget(b.session, said=True)  # (b answers a recall)

        _before_recalls(monkeypatch, server, meanwhile)
        ops = _replayed(g, f, SetAttr(mode=0o600), c0)
        first = await server.claims.claim(a, SA, {}, [], ops)
        assert first[3] == [], first
        assert stat.S_IMODE(server.store.inodes[f].mode) == 0o640
        a2 = _conn(server, "a2")  # (the first answer was lost)
        again = await server.claims.claim(a2, SA, {}, [], ops)
        assert again[3] == [], again


def _slow_truncate(
    server: MetaServer, monkeypatch: pytest.MonkeyPatch,
) -> tuple[trio.Event, trio.Event]:
    """A truncate waits (as through a backing directory, for the fetch of the last
    chunk) before it applies: set once it waits, and what lets it go on."""
    entered, gate = trio.Event(), trio.Event()
    orig = server.store.truncate

    async def truncate(ino: int, size: int) -> Any:
        entered.set()
        await gate.wait()
        return await orig(ino, size)

    monkeypatch.setattr(server.store, "truncate", truncate)
    return entered, gate


async def test_a_replayed_change_is_not_taken_for_anothers_change_under_way(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """a replays chmod 600 then chmod 640 of f; b's truncate of f (which sets no
    mode) waits, as through a backing directory, while a's first chmod applies: the
    mode that moved meanwhile is a's own, and a's second chmod still sets it (640,
    as in the serial order)."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with _server() as (server, nursery):
        f, g = await _files(server, nursery)
        c0 = server.store.inodes[f].ctime_ns
        _restarted(server, SA, SB)
        a, b = _conn(server, "a"), _conn(server, "b")
        await server.claims.claim(b, SB, {})
        entered, gate = _slow_truncate(server, monkeypatch)
        b_done = trio.Event()

        async def b_truncate() -> None:
            await _run(b, "truncate", f, 0)
            b_done.set()

        async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
            if session.sid == SA and args[0] == f and args[-1] == c0 + 10:
                nursery.start_soon(b_truncate)
                await entered.wait()  # b's call snapshotted f, and waits
            if session.sid == SA and args[0] == f and args[-1] == c0 + 20:
                gate.set()
                await b_done.wait()

        _before_recalls(monkeypatch, server, meanwhile)
        answer = await server.claims.claim(
            a, SA, {}, [],
            [_setattr_at(f, SetAttr(mode=0o600), c0 + 10),
             _setattr_at(f, SetAttr(mode=0o640), c0 + 20)])
        assert answer[3] == [], answer
        assert stat.S_IMODE(server.store.inodes[f].mode) == 0o640, oct(server.store.inodes[f].mode)
