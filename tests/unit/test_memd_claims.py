"""A memory server's volumes belong to one memfs filesystem at a time (CLAIM).

Two metadata servers whose pools name the same memd volume would overwrite each
other's files; the memd refuses a claim of a volume that live connections hold
for another filesystem's id (EBUSY, saying so), and forgets a claim when the
last connection holding it ends.  Raw frames first (the rule), then the tcp and
bulk transports (what a client makes of a refusal).
"""

from __future__ import annotations

import errno
import os
import socket

import pytest
import trio

from memfs import wire
from memfs.config import VolumeAddr
from memfs.errors import ClaimRefused, TransportError, UsageError
from memfs.transport.bulk import BulkTcp
from memfs.transport.memd import FEATURES, MemoryServer
from memfs.transport.tcp import open_tcp_transport
from memfs.wire import Kind
from tests.unit.test_memd_frames import SECRET, Client, serving

FS_A = b"A" * 16
FS_B = b"B" * 16


async def claim(c: Client, fsid: bytes, volumes: list[int], req_id: int = 5) -> tuple[Kind, bytes]:
    await c.stream.send_all(wire.frame(Kind.CLAIM, req_id, wire.encode_claim(fsid, volumes)))
    with trio.fail_after(10):
        h, payload = await c.frame()
    assert h.req_id == req_id
    return h.kind, payload


async def wait_released(server: MemoryServer, volume: int) -> None:
    """Until the server saw the connection end (its data loop's thread notices,
    another thread than ours: polled)."""
    with trio.fail_after(10):
        while server.claims.owner(volume) is not None:  # noqa: ASYNC110
            await trio.sleep(0.01)


def test_claim_payload_codec() -> None:
    payload = wire.encode_claim(FS_A, [0, 3, 1023])
    assert wire.decode_claim(payload) == (FS_A, [0, 3, 1023])
    for bad in (b"", FS_A, FS_A + b"\0\0\0", payload + b"\0"):
        with pytest.raises(wire.WireError):
            wire.decode_claim(bad)
    with pytest.raises(ValueError):
        wire.encode_claim(b"short", [0])
    with pytest.raises(ValueError):
        wire.encode_claim(FS_A, [])
    assert "claims" in FEATURES


async def test_one_filesystem_per_volume(caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # the refusal is logged
    async with serving() as (server, port):
        a1 = await Client.connect(port)
        a2 = await Client.connect(port)
        b = await Client.connect(port)
        assert (await claim(a1, FS_A, [0]))[0] is Kind.OK
        assert (await claim(a2, FS_A, [0, 1]))[0] is Kind.OK  # same filesystem: shared
        kind, payload = await claim(b, FS_B, [1])
        assert kind is Kind.ERROR
        err, msg = wire.decode_error(payload)
        assert err == errno.EBUSY
        assert "volume 1 belongs to another memfs filesystem, in use by 1 connection " in msg
        assert "second mds" in msg
        kind, payload = await claim(b, FS_B, [0])
        err, msg = wire.decode_error(payload)
        assert (kind, err) == (Kind.ERROR, errno.EBUSY) and "in use by 2 connections" in msg
        # A refused claim takes nothing, and the connection carries on
        assert server.claims.owner(0) == FS_A and server.claims.owner(1) == FS_A
        await b.stream.send_all(wire.frame(Kind.INFO, 9))
        assert (await b.frame())[0].kind is Kind.OK
        # Once every holder of a volume is gone, another filesystem may have it
        await a2.stream.aclose()
        await wait_released(server, 1)
        assert server.claims.owner(0) == FS_A  # a1 still holds volume 0
        assert (await claim(b, FS_B, [1]))[0] is Kind.OK  # volumes of one memd: two filesystems
        kind, _ = await claim(a1, FS_A, [1])
        assert kind is Kind.ERROR
        await a1.stream.aclose()
        await wait_released(server, 0)
        assert (await claim(b, FS_B, [0]))[0] is Kind.OK
        # One connection works for one filesystem
        kind, payload = await claim(b, FS_A, [0])
        assert kind is Kind.ERROR and wire.decode_error(payload)[0] == errno.EBUSY
        await b.stream.aclose()


async def test_bad_claims(caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]  # the malformed frame
    async with serving() as (_server, port):
        c = await Client.connect(port)
        kind, payload = await claim(c, FS_A, [2])  # the server has 2 volumes
        assert kind is Kind.ERROR and wire.decode_error(payload)[0] == errno.EINVAL
        await c.stream.send_all(wire.frame(Kind.CLAIM, 6, FS_A + b"\0"))  # malformed
        with trio.fail_after(10):
            await c.wait_closed()
        await c.stream.aclose()


async def test_transports_claim_for_their_filesystem(caplog: pytest.LogCaptureFixture) -> None:
    """The tcp transport claims its volumes on every connection; another
    filesystem's transport (or bulk mover) fails to open, naming server and volume;
    ``fsid=None`` claims nothing and is served as before."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with serving() as (server, port):
        vols = [VolumeAddr("tcp", "127.0.0.1", port, 0), VolumeAddr("tcp", "127.0.0.1", port, 1)]
        fs_a, fs_b = os.urandom(16), os.urandom(16)
        async with open_tcp_transport(vols, SECRET, io_timeout=10, fsid=fs_a) as ta:
            await ta.write(0, 0, b"of filesystem A")
            assert server.claims.owner(0) == fs_a and server.claims.owner(1) == fs_a
            with pytest.raises(ClaimRefused) as info:
                async with open_tcp_transport(vols[1:], SECRET, io_timeout=10, fsid=fs_b):
                    pass
            msg = str(info.value)
            assert f"memory server 127.0.0.1:{port}: volume 1 belongs to another memfs " \
                   "filesystem" in msg, msg
            with pytest.raises(ClaimRefused, match="belongs to another memfs filesystem"):
                await trio.to_thread.run_sync(
                    lambda: BulkTcp(vols, SECRET, io_timeout=10, fsid=fs_b))
            bulk = await trio.to_thread.run_sync(lambda: BulkTcp(vols, SECRET, io_timeout=10,
                                                                 fsid=fs_a))
            bulk.close()
            async with open_tcp_transport(vols, SECRET, io_timeout=10) as anon:  # no claim
                assert bytes(await anon.read(0, 0, 15)) == b"of filesystem A"
        await wait_released(server, 0)
        await wait_released(server, 1)
        async with open_tcp_transport(vols, SECRET, io_timeout=10, fsid=fs_b) as tb:
            assert bytes(await tb.read(0, 0, 15)) == b"of filesystem A"


async def test_a_client_claims_only_where_it_may(caplog: pytest.LogCaptureFixture) -> None:
    """No claim on a server that restarted since the client knew it (its data there
    is lost: said as such, not as another filesystem's volume), nor of volumes the
    server does not have (a wrong pool: said as such); and every connection the
    memd keeps has TCP keepalive (a vanished peer's claims must not stay)."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with serving() as (server, port):
        vols = [VolumeAddr("tcp", "127.0.0.1", port, 0), VolumeAddr("tcp", "127.0.0.1", port, 1)]
        fs_a, fs_b = os.urandom(16), os.urandom(16)
        name = f"127.0.0.1:{port}"
        async with open_tcp_transport(vols, SECRET, io_timeout=10, fsid=fs_a):
            restarted = {name: server.incarnation ^ 1}
            async with open_tcp_transport(vols, SECRET, io_timeout=10, fsid=fs_b,
                                          incarnations=restarted) as tb:
                with pytest.raises(TransportError) as info:
                    await tb.read(0, 0, 15)
            assert not isinstance(info.value, ClaimRefused)
            assert "restarted; its data is lost" in str(info.value), info.value
            with pytest.raises(UsageError, match="volumes"):
                async with open_tcp_transport([VolumeAddr("tcp", "127.0.0.1", port, 5)],
                                              SECRET, io_timeout=10, fsid=fs_b):
                    pass
            assert server.claims.owner(0) == fs_a
            links = list(server._loop._links.values())  # (a read of the loop's table)
            assert links and all(
                link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) for link in links
            ), links


async def test_a_refused_client_backs_off(caplog: pytest.LogCaptureFixture) -> None:
    """A client refused on a reconnect (another filesystem took the volume meanwhile)
    does not ask again at every request: until its back-off ends (1 s, doubling)
    requests fail with the same refusal and no handshake."""
    caplog.expected_warnings = True  # type: ignore[attr-defined]
    async with serving() as (server, port):
        vols = [VolumeAddr("tcp", "127.0.0.1", port, 0)]
        async with open_tcp_transport(vols, SECRET, io_timeout=10, fsid=FS_B) as tb:
            for s in tb._servers.values():  # B's connections end: the volume is free
                s.close_all("test: cut off")
            await wait_released(server, 0)
            handshakes = 0
            real = tb._handshake

            async def counted(*args: object) -> object:
                nonlocal handshakes
                handshakes += 1
                return await real(*args)  # type: ignore[arg-type]

            tb._handshake = counted  # type: ignore[method-assign, assignment]
            async with open_tcp_transport(vols, SECRET, io_timeout=10, fsid=FS_A) as ta:
                await ta.write(0, 0, b"A's")
                for _ in range(5):
                    with pytest.raises(ClaimRefused, match="belongs to another memfs filesystem"):
                        await tb.read(0, 0, 3)
                assert handshakes == 1
                await trio.sleep(1.2)  # the back-off ends
                for _ in range(3):
                    with pytest.raises(ClaimRefused):
                        await tb.read(0, 0, 3)
                assert handshakes == 2  # (and the next is 2 s away)
