"""Setattrs a registration replays (memfs.meta.server_claims) against what other
sessions do while it waits: the fields they set stay theirs, the rest is applied,
and the replaying session's writes keep their mtime.  Registrations are driven
here by hand, on connections with no client behind them (after a restart: the
store told which sessions were of the run before)."""

from __future__ import annotations

import stat
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


async def _files(server: MetaServer, nursery: trio.Nursery) -> tuple[int, int]:
    server.nursery = nursery
    c = _conn(server, "maker")
    await server.claims.claim(c, b"C" * 16, {})
    inos = []
    for name in (b"f", b"g"):
        _, (ino, *_) = await _run(c, "create", ROOT, name, F, 0, 0)
        await _run(c, "release", ino)
        inos.append(ino)
    server.leases.forget(c.session, said=True)  # (the maker holds nothing: no recalls)
    return inos[0], inos[1]


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
    async with trio.open_nursery() as nursery:
        server = MetaServer(metadata_only(POOL), SECRET, lease_term=4.0, recall_timeout=2.0)
        f, g = await _files(server, nursery)
        c0 = server.store.inodes[f].ctime_ns
        t1, t2 = c0 + 10, c0 + 20
        _restarted(server, SA, SB)
        a, b = _conn(server, "a"), _conn(server, "b")
        policy = server.lease_policy
        recall_for = policy.recall_for
        done: list[Any] = []

        async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
            if session.sid == SA and name == "setattr" and args[0] == f and not done:
                done.append(await server.claims.claim(
                    b, SB, {}, [], [_setattr_at(f, SetAttr(mode=0o640), t2)]))
            await recall_for(session, name, args)

        monkeypatch.setattr(policy, "recall_for", meanwhile)
        answer = await server.claims.claim(a, SA, {}, [], [_setattr_at(f, SetAttr(mode=0o600), t1)])
        assert done and done[0][3] == []  # b's applied
        # b's chmod (t2) came after a's (t1): it stays, and a's is not refused
        assert server.store.inodes[f].mode == stat.S_IFREG | 0o640, answer
        assert answer[3] == []
        nursery.cancel_scope.cancel()


async def test_a_replayed_touch_gives_way_to_the_mtime_of_writes_made_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a restart: a touched f to an old mtime, then wrote (its report's mtime is
    that write's); its registration settles f, replays the touch, and gives f its
    write's mtime again, also when b chmods f while a later replayed call of a's
    waits (b's chmod sets no mtime)."""
    async with trio.open_nursery() as nursery:
        server = MetaServer(metadata_only(POOL), SECRET, lease_term=4.0, recall_timeout=2.0)
        f, g = await _files(server, nursery)
        c0 = server.store.inodes[f].ctime_ns
        old = 1_000_000_000
        t_touch, t_write, t_g = c0 + 10, c0 + 20, c0 + 30
        _restarted(server, SA, SB)
        a, b = _conn(server, "a"), _conn(server, "b")
        await server.claims.claim(b, SB, {})
        policy = server.lease_policy
        recall_for = policy.recall_for
        done: list[Any] = []

        async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
            if session.sid == SA and name == "setattr" and args[0] == g and not done:
                done.append(await _run(b, "setattr", f, [0o640, None, None, None, None]))
            await recall_for(session, name, args)

        monkeypatch.setattr(policy, "recall_for", meanwhile)
        await server.claims.claim(
            a, SA, {}, [(f, 100, t_write, (0, 100))],
            [_setattr_at(f, SetAttr(mtime_ns=old), t_touch),
             _setattr_at(g, SetAttr(mode=0o600), t_g)])
        assert done and done[0][0].name.startswith("OK")
        i = server.store.inodes[f]
        assert i.mode == stat.S_IFREG | 0o640 and i.size == 100
        assert i.mtime_ns == t_write  # a wrote after its touch
        nursery.cancel_scope.cancel()


async def test_a_replayed_touch_gives_way_to_later_writes_without_a_restart_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, a holding the write leases of f and g (its connection given up,
    registering on a new one)."""
    async with trio.open_nursery() as nursery:
        server = MetaServer(metadata_only(POOL), SECRET, lease_term=4.0, recall_timeout=2.0)
        server.nursery = nursery
        a1 = _conn(server, "a1")
        await server.claims.claim(a1, SA, {})
        inos = []
        for name in (b"f", b"g"):
            _, (ino, *_) = await _run(a1, "create", ROOT, name, F, 0, 0)
            kind, _ = await _run(a1, "allocate_ahead", ino, 0, 65536, 1 << 20)
            assert kind.name == "OK_WRITE"
            inos.append(ino)
        f, g = inos
        c0 = max(server.store.inodes[x].ctime_ns for x in inos)
        old = 1_000_000_000
        t_touch, t_write, t_g = c0 + 10, c0 + 20, c0 + 30
        b = _conn(server, "b")
        await server.claims.claim(b, SB, {})
        policy = server.lease_policy
        recall_for = policy.recall_for
        done: list[Any] = []

        async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
            if session.sid == SA and name == "setattr" and args[0] == g and not done:
                done.append(await _run(b, "setattr", f, [0o640, None, None, None, None]))
            await recall_for(session, name, args)

        monkeypatch.setattr(policy, "recall_for", meanwhile)
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
        nursery.cancel_scope.cancel()


async def test_a_truncate_elsewhere_leaves_a_replayed_chmod_to_apply(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """b truncates f (its call was waiting for a's lease) while a's registration
    waits: b set no mode, so a's replayed chmod of f (made before) is applied, as
    the serial order (a's chmod, then b's truncate) gives, and a's size does not
    grow f back."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # b answers no recall here
    async with trio.open_nursery() as nursery:
        server = MetaServer(metadata_only(POOL), SECRET, lease_term=4.0, recall_timeout=2.0)
        server.nursery = nursery
        a1 = _conn(server, "a1")
        await server.claims.claim(a1, SA, {})
        inos = []
        for name in (b"f", b"g"):
            _, (ino, *_) = await _run(a1, "create", ROOT, name, F, 0, 0)
            kind, _ = await _run(a1, "allocate_ahead", ino, 0, 65536, 1 << 20)
            assert kind.name == "OK_WRITE"
            inos.append(ino)
        f, g = inos
        c0 = max(server.store.inodes[x].ctime_ns for x in inos)
        b = _conn(server, "b")
        await server.claims.claim(b, SB, {})
        policy = server.lease_policy
        recall_for = policy.recall_for
        done: list[Any] = []

        async def meanwhile(session: Any, name: str, args: list[Any]) -> None:
            if session.sid == SA and name == "setattr" and args[0] == g and not done:
                done.append(await _run(b, "truncate", f, 100))
            await recall_for(session, name, args)

        monkeypatch.setattr(policy, "recall_for", meanwhile)
        a2 = _conn(server, "a2")
        answer = await server.claims.claim(
            a2, SA, {f: 1, g: 1}, [(f, 65536, c0 + 5, (0, 65536)), (g, 65536, c0 + 5, (0, 65536))],
            [_setattr_at(g, SetAttr(mode=0o600), c0 + 10),
             _setattr_at(f, SetAttr(mode=0o600), c0 + 10)])
        assert done and done[0][0].name.startswith("OK")
        assert server.store.inodes[f].size == 100
        assert answer[3] == [], answer
        assert server.store.inodes[f].mode == stat.S_IFREG | 0o600
        nursery.cancel_scope.cancel()
