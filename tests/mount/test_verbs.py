"""The verbs (RDMA) transport and memd's RDMA side, as far as a machine without RDMA allows.

Nothing here touches RDMA hardware; the shared conformance suite runs the
transport on a real device where pyverbs finds one.  Here:

* pyverbs is optional: memfs imports without it, and says clearly why it
  cannot do RDMA (no pyverbs, no device);
* a ``verbs://`` pool picks the verbs transport, which fails with "no RDMA
  device found (pyverbs sees none)" on such a machine before contacting anyone;
* memd answers VERBS_CONNECT over a real TCP connection: ENODEV without a
  device (in-process and the real ``memfs memd``), and never to a client that
  has not authenticated;
* the pyverbs objects the transport builds (queue pair attributes, work
  requests) are constructed for real, which needs pyverbs but no device;
* the transport's own logic (registered vs. bounce buffers, deadlines, resets,
  cancellation, restarts, memd's queue pairs) against the simulated device of
  ``tests/verbs_sim.py``.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from memfs import wire
from memfs.config import VolumeAddr, parse_pool_spec
from memfs.errors import TransportError, UsageError
from memfs.transport import verbs
from memfs.transport.memd import MemoryServer
from memfs.transport.memd_loop import DataLoop
from memfs.transport.pool import open_pool_transport, pool_scheme
from memfs.transport.tcp import TcpTransport
from memfs.transport.verbs import (
    NO_DEVICE,
    RdmaUnavailable,
    VerbsTransport,
    open_verbs_transport,
)
from memfs.wire import Kind
from tests.conftest import MOUNT_SKIP
from tests.verbs_sim import SimDevice, SimFabric

SECRET = b"verbs-test-secret-0123456789"
SIZE = 1 << 20
SLACK = 1.0  # scheduling slack on a loaded 2-CPU test machine
EP = wire.VerbsEndpoint(qpn=0x42, psn=7, lid=3, gid=bytes(16), mtu=5, rd_atomic=4)
PYVERBS_IMPORTS = importlib.util.find_spec("pyverbs") is not None


def expect_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]


async def eventually(predicate: Any) -> None:
    """Wait (up to 5 s) for state that other tasks change (there is no event to wait on)."""
    with trio.fail_after(5):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.01)


def has_pyverbs() -> bool:
    try:
        verbs.load_pyverbs()
    except RdmaUnavailable:
        return False
    return True


# -- pyverbs is optional ------------------------------------------------------------------


def test_memfs_imports_without_pyverbs() -> None:
    """No pyverbs at all: memfs imports and runs; the verbs module says why RDMA is off."""
    code = (
        "import sys; sys.modules['pyverbs'] = None\n"  # any import of pyverbs fails
        "import memfs.cli, memfs.mount, memfs.mds, memfs.transport.memd, memfs.transport.pool\n"
        "import memfs.transport.verbs as v\n"
        "assert v.rdma_devices() == [] and not v.rdma_available()\n"
        "dev, why = v.server_device('auto')\n"
        "assert dev is None and 'pyverbs is not importable' in why, why\n"
        "try:\n"
        "    v.open_rdma_device()\n"
        "except v.RdmaUnavailable as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("no RDMA support: pyverbs is not importable")


def test_importing_memfs_does_not_import_pyverbs() -> None:
    code = ("import sys, memfs.cli, memfs.transport.memd, memfs.transport.verbs, "
            "memfs.transport.pool; print(sorted(m for m in sys.modules if 'pyverbs' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_device_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verbs, "load_pyverbs", lambda: object())
    monkeypatch.setattr(verbs, "_fork_safety", lambda pv: None)
    monkeypatch.setattr(verbs, "_device_names", lambda: [])
    with pytest.raises(RdmaUnavailable) as info:
        verbs.open_rdma_device()
    assert str(info.value) == "no RDMA device found (pyverbs sees none)" == NO_DEVICE
    assert isinstance(info.value, UsageError)  # one line from the CLI, exit status 2
    assert verbs.server_device("auto") == (None, NO_DEVICE)
    with pytest.raises(RdmaUnavailable, match=re.escape(NO_DEVICE)):
        verbs.server_device("mlx5_0")  # asked for by name: an error, not a fallback
    device, why = verbs.server_device("off")
    assert device is None and "--rdma-device off" in why


def test_named_device_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verbs, "load_pyverbs", lambda: object())
    monkeypatch.setattr(verbs, "_fork_safety", lambda pv: None)
    monkeypatch.setattr(verbs, "_device_names", lambda: ["mlx5_0", "mlx5_1"])
    with pytest.raises(RdmaUnavailable, match=r"no RDMA device 'rxe0' \(pyverbs sees mlx5_0, mlx5_1\)"):
        verbs.open_rdma_device("rxe0")


@pytest.mark.skipif(verbs.rdma_available(), reason="this machine has an RDMA device")
@pytest.mark.skipif(not PYVERBS_IMPORTS, reason="pyverbs is not importable here (make install)")
def test_this_machine_has_no_device() -> None:
    """The real pyverbs on a machine without RDMA: it lists no device (or fails to: no
    kernel support at all), and opening one is the clear error."""
    assert verbs.rdma_devices() == []
    with pytest.raises(RdmaUnavailable, match=re.escape(NO_DEVICE)):
        verbs.open_rdma_device()


# -- pool specs -------------------------------------------------------------------------


def test_pool_scheme() -> None:
    assert pool_scheme(parse_pool_spec("tcp://a:1/0+tcp://b:1/0")) == "tcp"
    assert pool_scheme(parse_pool_spec("verbs://a:1/0+verbs://b:1/3")) == "verbs"
    with pytest.raises(UsageError, match=r"mixes tcp:// and verbs://"):
        pool_scheme(parse_pool_spec("tcp://a:1/0+verbs://b:1/0"))
    with pytest.raises(UsageError):
        pool_scheme([])


async def test_verbs_pool_without_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verbs:// pool on a node without RDMA: the clear error, before any connection."""
    monkeypatch.setattr(verbs, "load_pyverbs", lambda: object())
    monkeypatch.setattr(verbs, "_fork_safety", lambda pv: None)
    monkeypatch.setattr(verbs, "_device_names", lambda: [])
    with trio.fail_after(5):
        with pytest.raises(UsageError, match=re.escape(NO_DEVICE)):
            # port 9 (discard) is never contacted: the device is looked for first
            async with open_pool_transport(parse_pool_spec("verbs://127.0.0.1:9/0"), SECRET):
                pass  # pragma: no cover


@pytest.mark.skipif(verbs.rdma_available(), reason="this machine has an RDMA device")
async def test_verbs_pool_on_this_machine() -> None:
    with pytest.raises(RdmaUnavailable, match="no RDMA"):
        async with open_pool_transport(parse_pool_spec("verbs://127.0.0.1:9/0"), SECRET):
            pass  # pragma: no cover


async def test_pool_spec_picks_the_transport() -> None:
    fabric = SimFabric()
    server = MemoryServer(2, SIZE, SECRET, rdma=SimDevice(fabric, "memd"))
    client = SimDevice(fabric, "client")
    try:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            for scheme, cls in (("tcp", TcpTransport), ("verbs", VerbsTransport)):
                spec = f"{scheme}://127.0.0.1:{port}/1+{scheme}://127.0.0.1:{port}/0"
                async with open_pool_transport(parse_pool_spec(spec), SECRET,
                                               verbs_device=client) as t:
                    assert type(t) is cls
                    assert [v.url for v in t.volumes] == spec.split("+")
                    await t.write(0, 100, b"via " + scheme.encode())
            # the same memory, whichever way it is reached
            async with open_pool_transport(parse_pool_spec(f"tcp://127.0.0.1:{port}/1"),
                                           SECRET) as t:
                assert bytes(await t.read(0, 100, 9)) == b"via verbs"
            nursery.cancel_scope.cancel()
    finally:
        await server.aclose()
        client.close()


# -- memd's control request ------------------------------------------------------------------


class Raw:
    """A blocking client speaking exact frames to a memd."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def recv_exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError(f"closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def frame(self) -> tuple[wire.Header, bytes]:
        h = wire.parse_header(self.recv_exactly(wire.HEADER_SIZE), wire.VERBS_ACCEPT_MAX)
        return h, self.recv_exactly(h.length)

    def authenticate(self, secret: bytes = SECRET) -> None:
        h, hello = self.frame()
        assert h.kind is Kind.HELLO
        hs = wire.Handshake(secret)
        self.sock.sendall(wire.frame(Kind.AUTH, 0, hs.auth(hello, "verbs")))
        h, welcome = self.frame()
        assert h.kind is Kind.WELCOME
        hs.check_welcome(welcome)

    def verbs_connect(self, ep: wire.VerbsEndpoint = EP, req_id: int = 5) -> tuple[wire.Header, bytes]:
        self.sock.sendall(wire.frame(Kind.VERBS_CONNECT, req_id, wire.encode_verbs_endpoint(ep)))
        h, reply = self.frame()
        assert h.req_id == req_id
        return h, reply

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return True


@asynccontextmanager
async def memd(n_volumes: int = 2, rdma: SimDevice | None = None) -> AsyncIterator[tuple[MemoryServer, int]]:
    server = MemoryServer(n_volumes, SIZE, SECRET, rdma=rdma)
    try:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            yield server, port
            nursery.cancel_scope.cancel()
    finally:
        await server.aclose()


async def test_memd_without_rdma_answers_enodev() -> None:
    async with memd() as (server, port):
        def talk() -> tuple[int, str, bytes]:
            with Raw(port) as c:
                c.authenticate()
                h, reply = c.verbs_connect()
                assert h.kind is Kind.ERROR
                err, msg = wire.decode_error(reply)
                # the connection goes on: INFO still works
                c.sock.sendall(wire.frame(Kind.INFO, 6))
                h, info = c.frame()
                assert h.kind is Kind.OK
                return err, msg, info
        err, msg, _ = await trio.to_thread.run_sync(talk)
    assert err == errno.ENODEV
    assert msg == "no RDMA on this memory server: this memory server has no RDMA device"


async def test_verbs_client_against_memd_without_rdma() -> None:
    fabric = SimFabric()
    client = SimDevice(fabric, "client")
    async with memd() as (server, port):
        server.rdma_absent = NO_DEVICE
        with pytest.raises(TransportError, match=r"offers no RDMA: no RDMA on this memory server: "
                                                 r"no RDMA device found \(pyverbs sees none\)"):
            async with open_verbs_transport([VolumeAddr("verbs", "127.0.0.1", port, 0)],
                                            SECRET, device=client, io_timeout=5):
                pass  # pragma: no cover
    assert not client.qps, "the client's queue pair must be destroyed"
    client.close()


async def test_rdma_keys_only_after_authentication(caplog: pytest.LogCaptureFixture) -> None:
    expect_warnings(caplog)
    fabric = SimFabric()
    async with memd(rdma=SimDevice(fabric, "memd")) as (server, port):
        def unauthenticated() -> bool:
            with Raw(port) as c:
                h, _ = c.frame()
                assert h.kind is Kind.HELLO
                # VERBS_CONNECT instead of AUTH: no reply, the connection is closed
                c.sock.sendall(wire.frame(Kind.VERBS_CONNECT, 1, wire.encode_verbs_endpoint(EP)))
                return c.closed()

        def wrong_secret() -> bool:
            with Raw(port) as c:
                h, hello = c.frame()
                hs = wire.Handshake(b"wrong secret")
                c.sock.sendall(wire.frame(Kind.AUTH, 0, hs.auth(hello, "verbs")))
                c.sock.sendall(wire.frame(Kind.VERBS_CONNECT, 1, wire.encode_verbs_endpoint(EP)))
                return c.closed()

        assert await trio.to_thread.run_sync(unauthenticated)
        assert await trio.to_thread.run_sync(wrong_secret)
        assert not server._qps, "no queue pair for unauthenticated clients"


async def test_memd_verbs_connect_with_rdma(caplog: pytest.LogCaptureFixture) -> None:
    """An authenticated VERBS_CONNECT: a queue pair and every volume's region; one per
    connection; malformed ones close that connection only; the queue pair goes with it."""
    expect_warnings(caplog)
    fabric = SimFabric()
    device = SimDevice(fabric, "memd")
    client_dev = SimDevice(fabric, "client")
    async with memd(3, rdma=device) as (server, port):
        assert device.registrations == 3  # every volume, once, at start
        qp = client_dev.create_qp(4, remote_access=False)

        def talk() -> tuple[wire.VerbsEndpoint, list[wire.VerbsRegion], tuple[int, str]]:
            with Raw(port) as c:
                c.authenticate()
                h, reply = c.verbs_connect(qp.endpoint)
                assert h.kind is Kind.OK, wire.decode_error(reply)
                peer, regions = wire.decode_verbs_accept(reply)
                h, again = c.verbs_connect(qp.endpoint, req_id=6)
                assert h.kind is Kind.ERROR
            # malformed payload: that connection is closed
            with Raw(port) as d:
                d.authenticate()
                d.sock.sendall(wire.frame(Kind.VERBS_CONNECT, 1, b"\0" * wire.VERBS_ENDPOINT.size))
                assert d.closed()
            return peer, regions, wire.decode_error(again)

        peer, regions, again = await trio.to_thread.run_sync(talk)
        assert again[0] == errno.EBUSY
        assert [r.size for r in regions] == [SIZE] * 3
        assert {r.rkey for r in regions} == {r.lkey for r in device.regions.values()}
        # the queue pair is destroyed once its connection closes
        await eventually(lambda: not server._qps)
        assert peer.qpn not in fabric.qps
        assert device.registrations == 3
    client_dev.close()


# -- the real memfs memd (autodetection finds no device here) ---------------------------------

READY_RE = re.compile(r"^memd listening on 127\.0\.0\.1:(\d+) ")


@dataclass
class Proc:
    proc: subprocess.Popen[str]
    port: int
    log: Path


@pytest.fixture
def run_memd(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)

    def start(*extra: str) -> Proc:
        log = tmp_path / f"memd{len(procs)}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "memfs", "memd", "--listen", "127.0.0.1:0",
                 "--size", "1M", "--secret-file", str(secret), *extra],
                stdout=subprocess.PIPE, stderr=err, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        line = proc.stdout.readline().strip() if ready else ""
        m = READY_RE.match(line)
        assert m, f"memd not ready: {line!r}\n{log.read_text()}"
        return Proc(proc, int(m[1]), log)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def enodev_from(port: int) -> str:
    with Raw(port) as c:
        c.authenticate()
        h, reply = c.verbs_connect()
    assert h.kind is Kind.ERROR
    err, msg = wire.decode_error(reply)
    assert err == errno.ENODEV
    return msg


@pytest.mark.skipif(verbs.rdma_available(), reason="this machine has an RDMA device")
def test_cli_memd_without_device(run_memd: Any) -> None:
    m = run_memd()
    msg = enodev_from(m.port)
    if PYVERBS_IMPORTS:
        assert msg == "no RDMA on this memory server: no RDMA device found (pyverbs sees none)"
    else:
        assert msg.startswith("no RDMA on this memory server: no RDMA support: pyverbs is not "
                              "importable"), msg
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=10) == 0
    log = m.log.read_text()
    assert "RDMA off:" in log and "Traceback" not in log


def test_cli_memd_rdma_off(run_memd: Any) -> None:
    m = run_memd("--rdma-device", "off")
    assert enodev_from(m.port) == ("no RDMA on this memory server: RDMA is off on this memory "
                                   "server (--rdma-device off)")


@pytest.mark.skipif(verbs.rdma_available(), reason="this machine has an RDMA device")
def test_cli_memd_named_device_missing() -> None:
    out = subprocess.run([sys.executable, "-m", "memfs", "memd", "--listen", "127.0.0.1:0",
                          "--size", "1M", "--rdma-device", "mlx5_0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith("memfs: error: no RDMA"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(verbs.rdma_available(), reason="this machine has an RDMA device")
@pytest.mark.skipif(MOUNT_SKIP is not None, reason=str(MOUNT_SKIP))
def test_cluster_mount_of_a_verbs_pool_without_device(run_memd: Any, tmp_path: Path) -> None:
    """memd + mds with a verbs:// pool (the mds reaches memd over TCP): a client mount
    on a node without RDMA picks the verbs transport and fails with the clear error."""
    m = run_memd()
    secret = tmp_path / "secret"
    mds = subprocess.Popen(
        [sys.executable, "-m", "memfs", "mds", "--listen", "127.0.0.1:0", "--secret-file",
         str(secret), "--pool", f"verbs://127.0.0.1:{m.port}/0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert mds.stdout is not None
        ready, _, _ = select.select([mds.stdout], [], [], 20)
        line = mds.stdout.readline() if ready else ""
        found = re.fullmatch(r"mds listening on 127\.0\.0\.1:(\d+)\n", line)
        assert found, line
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        out = subprocess.run(
            [sys.executable, "-m", "memfs", "mount", str(mnt), "--mds",
             f"127.0.0.1:{found[1]}", "--secret-file", str(secret),
             "--log", str(tmp_path / "mount.log")],
            capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (out.stdout, out.stderr)
        assert "no RDMA" in out.stderr, out.stderr
        if PYVERBS_IMPORTS:
            assert out.stderr.startswith(
                "memfs: error: no RDMA device found (pyverbs sees none) (log: "), out.stderr
        assert not os.path.ismount(mnt)
    finally:
        mds.send_signal(signal.SIGTERM)
        try:
            mds.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            mds.kill()
            mds.communicate()


# -- pyverbs objects (need pyverbs, not a device) -------------------------------------------


@pytest.mark.skipif(not has_pyverbs(), reason="pyverbs is not importable here (make install)")
def test_pyverbs_objects() -> None:
    pv = verbs.load_pyverbs()
    e = pv.enums
    peer = wire.VerbsEndpoint(qpn=0x1A2B, psn=0x123456, lid=0, gid=bytes.fromhex(
        "00000000000000000000ffff0a000002"), mtu=3, rd_atomic=4)
    attr = verbs.rtr_attr(pv, port=1, mtu=5, rd_atomic=16, gid_index=3, use_grh=True, peer=peer)
    assert (attr.dest_qp_num, attr.rq_psn, attr.path_mtu) == (0x1A2B, 0x123456, 3)
    assert (attr.max_dest_rd_atomic, attr.port_num, attr.qp_state) == (16, 1, e.IBV_QPS_RTR)
    ah = attr.ah_attr
    assert ah.is_global == 1 and ah.sgid_index == 3 and ah.dlid == 0
    assert ah.dgid == "0000:0000:0000:0000:0000:ffff:0a00:0002"
    attr = verbs.rts_attr(attr, psn=0x654321, rd_atomic=16, peer=peer)
    assert (attr.sq_psn, attr.max_rd_atomic, attr.retry_cnt, attr.timeout) == (0x654321, 4, 7, 14)
    ib = verbs.rtr_attr(pv, port=2, mtu=4, rd_atomic=8, gid_index=0, use_grh=False,
                        peer=wire.VerbsEndpoint(9, 1, 17, bytes(16), 5, 8))
    assert ib.ah_attr.is_global == 0 and ib.ah_attr.dlid == 17 and ib.path_mtu == 4
    wr = verbs.send_wr(pv, 77, False, 0x10000, 4096, 0x55, 0x7F0000000000, 0x66)
    assert (wr.wr_id, wr.opcode, wr.num_sge) == (77, e.IBV_WR_RDMA_READ, 1)
    assert wr.send_flags == e.IBV_SEND_SIGNALED
    assert verbs.send_wr(pv, 78, True, 0x10000, 1, 1, 1, 1).opcode == e.IBV_WR_RDMA_WRITE
    assert verbs._gid_text(verbs._gid_bytes(ah.dgid)) == ah.dgid


# -- the transport on the simulated device ------------------------------------------------


@dataclass
class SimPool:
    t: VerbsTransport
    servers: list[MemoryServer]
    devices: list[SimDevice]
    client: SimDevice
    ports: list[int]
    nursery: trio.Nursery


@asynccontextmanager
async def sim_pool(n_servers: int = 2, *, io_timeout: float = 5.0, **kw: Any) -> AsyncIterator[SimPool]:
    """*n_servers* in-process memds with simulated RDMA, one volume each, and a client."""
    fabric = SimFabric()
    devices = [SimDevice(fabric, f"memd{i}") for i in range(n_servers)]
    servers = [MemoryServer(1, SIZE, SECRET, rdma=d) for d in devices]
    client = SimDevice(fabric, "client")
    try:
        async with trio.open_nursery() as nursery:
            ports = [await nursery.start(s.serve, "127.0.0.1", 0) for s in servers]
            pool = [VolumeAddr("verbs", "127.0.0.1", p, 0) for p in ports]
            async with open_verbs_transport(pool, SECRET, device=client, io_timeout=io_timeout,
                                            **kw) as t:
                yield SimPool(t, servers, devices, client, ports, nursery)
            nursery.cancel_scope.cancel()
    finally:
        for s in servers:
            await s.aclose()
        client.close()


def data(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def test_data_bypasses_memd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads, writes and zeroing never reach memd's request loop: the device does them."""
    seen: list[Kind] = []
    orig = DataLoop._serve

    def spy(self: DataLoop, link: Any, h: wire.Header, fixed: int) -> int:
        seen.append(h.kind)
        return orig(self, link, h, fixed)

    monkeypatch.setattr(DataLoop, "_serve", spy)
    async with sim_pool(bounce_size=64 << 10) as p:
        blob = data(1, 3 * (64 << 10) + 5)
        await p.t.write(1, 7, blob)
        assert bytes(await p.t.read(1, 7, len(blob))) == blob
        await p.t.zero(1, 8, len(blob) - 2)
        assert bytes(await p.t.read(1, 6, 3)) == b"\0" + blob[:1] + b"\0"
        # what the memory server holds is what we wrote, at the right place
        assert bytes(p.servers[1].memory.volume_memory(0)[7:8]) == blob[:1]
    assert sorted(set(seen)) == [Kind.INFO, Kind.VERBS_CONNECT]


async def test_registered_buffers_go_direct_others_bounce() -> None:
    async with sim_pool() as p:
        c = p.client
        regs = c.registrations  # bounce pool + zero buffer, once
        assert regs == 2
        buf = p.t.register(SIZE // 2)
        assert c.registrations == regs + 1
        region = max(c.regions.values(), key=lambda r: r.lkey)
        buf[:] = data(2, len(buf))
        c.posted.clear()
        await p.t.write(0, 0, buf[1:])  # a slice of registered memory: direct
        out = p.t.register(SIZE // 2)
        await p.t.readinto(0, 0, out[: len(buf) - 1])
        assert bytes(out[: len(buf) - 1]) == bytes(buf[1:])
        pool_key = p.t._pool.region.lkey
        assert [k for k, _, _ in c.posted] == [region.lkey, region.lkey + 1]  # no bounce
        c.posted.clear()
        await p.t.write(0, 0, bytes(buf[:5000]))  # plain memory: through a bounce buffer
        assert [(k, n) for k, n, _ in c.posted] == [(pool_key, 5000)]
        # many requests later, nothing was registered again
        for i in range(50):
            await p.t.write(i % 2, i * 100, b"x" * 100)
            await p.t.read(i % 2, i * 100, 100)
        assert c.registrations == regs + 2
        assert all(d.registrations == 1 for d in p.devices)


async def test_more_tasks_than_bounce_buffers_and_queue_slots() -> None:
    """Tiny pool and queues, many tasks, big requests: no deadlock, every byte in place."""
    async with sim_pool(bounce_size=4096, bounce_count=3, queue_depth=2) as p:
        bad = []

        async def worker(k: int) -> None:
            blob = data(k, 3 * 4096 + k)
            vol, off = k % 2, k * 20_000
            for _ in range(3):
                await p.t.write(vol, off, blob)
                if bytes(await p.t.read(vol, off, len(blob))) != blob:
                    bad.append(k)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for k in range(12):
                    nursery.start_soon(worker, k)
        assert bad == []
        assert len(p.t._pool._free) == 3 and not p.t._ops


async def test_shared_completion_queue_never_overflows() -> None:
    """Deep queue pairs, a small completion queue: outstanding requests stay within it."""
    fabric = SimFabric()
    devices = [SimDevice(fabric, f"memd{i}") for i in range(2)]
    servers = [MemoryServer(1, SIZE, SECRET, rdma=d) for d in devices]
    client = SimDevice(fabric, "client")
    client.cq_capacity = 8  # room for 4 outstanding, queue pairs take 64 each
    try:
        async with trio.open_nursery() as nursery:
            ports = [await nursery.start(s.serve, "127.0.0.1", 0) for s in servers]
            pool = [VolumeAddr("verbs", "127.0.0.1", p, 0) for p in ports]
            async with open_verbs_transport(pool, SECRET, device=client, io_timeout=5,
                                            bounce_size=4096) as t:
                with pytest.raises(UsageError, match="serves another verbs transport"):
                    async with open_verbs_transport(pool, SECRET, device=client):
                        pass  # pragma: no cover

                async def worker(k: int) -> None:
                    blob = data(k, 5 * 4096)
                    await t.write(k % 2, k * 30_000, blob)
                    assert bytes(await t.read(k % 2, k * 30_000, len(blob))) == blob

                with trio.fail_after(20):
                    async with trio.open_nursery() as workers:
                        for k in range(16):
                            workers.start_soon(worker, k)
            nursery.cancel_scope.cancel()
    finally:
        for s in servers:
            await s.aclose()
        client.close()


async def test_hung_server_costs_io_timeout_then_recovers(caplog: pytest.LogCaptureFixture) -> None:
    expect_warnings(caplog)
    async with sim_pool(io_timeout=1.0) as p:
        await p.t.write(0, 0, b"before")
        p.devices[0].frozen = True  # the server stops answering (SIGSTOP, a hung HCA)
        t0 = trio.current_time()
        with pytest.raises(TransportError, match="did not complete an RDMA request within 1s"):
            await p.t.read(0, 0, 6)
        assert 1.0 <= trio.current_time() - t0 < 1.0 + SLACK
        # the other server is not affected meanwhile
        await p.t.write(1, 0, b"other")
        assert bytes(await p.t.read(1, 0, 5)) == b"other"
        # memd destroys the old queue pair when its control connection closes
        await eventually(lambda: not p.servers[0]._qps)
        p.devices[0].frozen = False
        assert bytes(await p.t.read(0, 0, 6)) == b"before"  # reconnected
        assert len(p.servers[0]._qps) == 1


async def test_dead_server_queue_pair_fails_fast(caplog: pytest.LogCaptureFixture) -> None:
    """The server's queue pair is gone (memd died): the RC retries end in an error
    completion, EIO, well before the deadline; its TCP end closes the connection too."""
    expect_warnings(caplog)
    async with sim_pool(io_timeout=5.0) as p:
        await p.t.write(0, 0, b"x")
        for qp in list(p.devices[0].qps):
            qp.close()
        t0 = trio.current_time()
        with pytest.raises(TransportError, match="retry exceeded"):
            await p.t.write(0, 0, b"y")
        assert trio.current_time() - t0 < 1.0
        assert bytes(await p.t.read(0, 0, 1)) == b"x"  # a new queue pair works


async def test_server_gone_for_good(caplog: pytest.LogCaptureFixture) -> None:
    expect_warnings(caplog)
    async with sim_pool(io_timeout=2.0) as p:
        await p.t.write(0, 0, b"x")
        await p.servers[0].aclose()  # queue pairs destroyed, volumes deregistered and freed
        p.servers[0] = MemoryServer(1, SIZE, SECRET)  # (for the fixture's aclose)
        with trio.fail_after(2.0 + SLACK):
            with pytest.raises(TransportError):
                await p.t.read(0, 0, 1)
        await p.t.write(1, 0, b"fine")  # the other server still works


async def test_restarted_server_is_lost_data(caplog: pytest.LogCaptureFixture) -> None:
    """A memd that comes back on the same port is blank: its volumes fail, never read
    zeros, until the transport adopts its new incarnation (the mds took it back)."""
    expect_warnings(caplog)
    fabric = SimFabric()
    client = SimDevice(fabric, "client")
    first = MemoryServer(1, SIZE, SECRET, rdma=SimDevice(fabric, "memd"))
    second = MemoryServer(1, SIZE, SECRET, rdma=SimDevice(fabric, "memd-again"))
    first_scope = trio.CancelScope()
    first_done = trio.Event()

    async def serve_first(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        with first_scope:
            await first.serve("127.0.0.1", 0, task_status=task_status)
        first_done.set()

    try:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_first)
            pool = [VolumeAddr("verbs", "127.0.0.1", port, 0)]
            async with open_verbs_transport(pool, SECRET, device=client, io_timeout=2.0) as t:
                await t.write(0, 0, b"precious")
                first_scope.cancel()  # memd stops: its connections and queue pairs end
                await first_done.wait()
                await first.aclose()
                await nursery.start(second.serve, "127.0.0.1", port)
                with trio.fail_after(5):
                    with pytest.raises(TransportError, match="restarted; its data is lost"):
                        await t.read(0, 0, 8)
                    with pytest.raises(TransportError, match="restarted; its data is lost"):
                        await t.write(0, 0, b"again")
                # Taken back (the mds marked what was there lost): served again.
                t.adopt({f"127.0.0.1:{port}": second.incarnation})
                with trio.fail_after(5):
                    assert bytes(await t.read(0, 0, 8)) == bytes(8)
                    await t.write(0, 0, b"again")
                    assert bytes(await t.read(0, 0, 5)) == b"again"
            nursery.cancel_scope.cancel()
    finally:
        await first.aclose()
        await second.aclose()
        client.close()


async def test_cancelled_direct_read_never_lands(caplog: pytest.LogCaptureFixture) -> None:
    """A read straight into a registered buffer whose caller gives up: the queue pair
    is reset before the call returns, so the device never writes there afterwards."""
    expect_warnings(caplog)
    async with sim_pool() as p:
        await p.t.write(0, 0, b"\x11" * 4096)
        buf = p.t.register(4096)
        p.devices[0].frozen = True
        with trio.move_on_after(0.2):
            await p.t.readinto(0, 0, buf)
        p.devices[0].frozen = False
        await trio.sleep(0.1)  # the poller runs; nothing may arrive
        assert bytes(buf) == bytes(4096)
        await p.t.readinto(0, 0, buf)  # and the transport goes on
        assert bytes(buf) == b"\x11" * 4096


async def test_cancelled_bounce_read_never_lands() -> None:
    """Through bounce buffers: the late data lands in the bounce buffer, which only
    returns to the pool once the device is done with it; no reset is needed."""
    async with sim_pool(bounce_count=2) as p:
        await p.t.write(0, 0, b"\x22" * 10_000)
        buf = memoryview(bytearray(10_000))
        p.devices[0].frozen = True
        with trio.move_on_after(0.2):
            await p.t.readinto(0, 0, buf)
        assert len(p.t._pool._free) == 1  # still owned by the outstanding request
        conn = p.t._map[0][0].conn
        p.devices[0].frozen = False
        await eventually(lambda: len(p.t._pool._free) == 2)
        assert bytes(buf) == bytes(10_000)
        assert p.t._map[0][0].conn is conn  # the queue pair was kept
        assert bytes(await p.t.read(0, 0, 10_000)) == b"\x22" * 10_000


async def test_out_of_range_never_posts() -> None:
    async with sim_pool() as p:
        p.client.posted.clear()
        for args in ((0, SIZE, 1), (0, SIZE - 1, 2), (2, 0, 1), (0, -1, 1)):
            with pytest.raises(ValueError):
                await p.t.read(*args)
            with pytest.raises(ValueError):
                await p.t.zero(*args)
        assert p.client.posted == []
        await p.t.write(0, SIZE - 1, b"e")
        assert bytes(await p.t.read(0, SIZE - 1, 1)) == b"e"


async def test_wrong_secret(caplog: pytest.LogCaptureFixture) -> None:
    expect_warnings(caplog)
    fabric = SimFabric()
    client = SimDevice(fabric, "client")
    async with memd(rdma=SimDevice(fabric, "memd")) as (server, port):
        with pytest.raises(TransportError, match="authentication refused"):
            async with open_verbs_transport([VolumeAddr("verbs", "127.0.0.1", port, 0)],
                                            b"not the secret", device=client, io_timeout=5):
                pass  # pragma: no cover
        assert not server._qps
    client.close()


async def test_missing_volume_is_a_usage_error() -> None:
    fabric = SimFabric()
    client = SimDevice(fabric, "client")
    async with memd(rdma=SimDevice(fabric, "memd")) as (_, port):
        with pytest.raises(UsageError, match="has 2 volumes"):
            async with open_verbs_transport([VolumeAddr("verbs", "127.0.0.1", port, 2)],
                                            SECRET, device=client, io_timeout=5):
                pass  # pragma: no cover
    client.close()
