"""The ``verbs`` transport: pool volumes held by ``memfs memd`` servers, reached by RDMA.

**Status: written against Debian 12's pyverbs (rdma-core 44) but never run on
RDMA hardware.**  The machine it was developed on has no RDMA device (and no
kernel RDMA support), so no queue pair was ever connected and no byte ever
moved through this module's pyverbs code.  What was tested there (see
``tests/test_verbs.py``): the wire codec of the connection exchange, the
control path against a real memd over TCP (ENODEV when memd has no device,
no RDMA keys before authentication), the choice of this transport for
``verbs://`` pools and its "no RDMA device" error, the construction of the
pyverbs attribute and work-request objects (which needs no device), and all of
the transport logic below (bounce buffers, completions, deadlines, resets,
restarts) against a simulated device (``tests/verbs_sim.py``) that stands in
for :class:`PyverbsDevice`.  The conformance suite also runs against real
pyverbs wherever a device exists; here it skips.

Design:

* **Control over TCP, data over RDMA.**  The client opens an ordinary memd
  connection (HMAC handshake, role ``verbs``, INFO) and, once authenticated,
  sends VERBS_CONNECT with its reliable-connected (RC) queue pair; memd creates
  a queue pair for it and answers with its own plus, per volume, the address,
  rkey and size of the volume's memory region (:mod:`memfs.wire`).  A memd
  without RDMA answers ENODEV.  The TCP connection stays open as long as the
  queue pair lives: when it closes, memd destroys the queue pair, and the
  client treats a closed control connection as a dead server.
* **Memory registered once.**  memd registers every volume at start (remote
  read and write, local write).  The client registers, once at open, a pool
  of bounce buffers and a zero buffer; :meth:`VerbsTransport.register` hands
  out buffers registered once each.  A read into (or write from) a buffer
  that lies inside a registered buffer goes straight to/from it; any other
  buffer is staged through the bounce pool (one copy on the client).
* **One-sided.**  Reads are RDMA READs and writes and zeroing RDMA WRITEs
  straight into the server's registered volumes: the server's CPU is not on
  the data path.
* **Completions.**  All queue pairs share one completion queue, polled by one
  task.  pyverbs 44's completion channel does not expose its file descriptor,
  so the poller cannot ``trio.lowlevel.wait_readable`` on it: while work
  requests are outstanding it polls with a trio checkpoint between empty polls
  (then short sleeps), and when none are it sleeps on an event.
* **Deadlines.**  Every request, with any connect it needs, must make progress
  within ``io_timeout`` or fails with :class:`~memfs.errors.TransportError`
  (EIO); the server's queue pair is then reset (destroyed: the device no
  longer touches our memory once that returns) and reconnected on the next
  request.  The RC transport's own retries (about 0.5 s) turn a dead server
  into an error completion sooner.
* **Cancellation.**  A caller that gives up never gets bytes in its buffer
  afterwards: bounce buffers stay owned by the work request until the device
  completes it; a cancelled read *straight into* a registered buffer resets
  the queue pair before the call returns.
* **Restarts.**  As for tcp: a reconnect that finds another incarnation means
  the server's memory is blank; its volumes fail from then on.

Nothing here imports pyverbs at module import time: memfs without
python3-pyverbs imports, installs and runs; only opening a device needs it.
"""

from __future__ import annotations

import abc
import bisect
import collections
import ctypes
import importlib
import itertools
import logging
import mmap
import os
import secrets
import socket
import types
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.lowlevel

from memfs import wire
from memfs.config import VolumeAddr
from memfs.errors import ClaimRefused, TransportError, UsageError
from memfs.net import set_keepalive
from memfs.transport import Buffer, Transport, VolumeInfo
from memfs.transport.sockio import close_socket, connect, recv_frame, send_all
from memfs.transport.tcp import memd_handshake, taken_back, volume_infos
from memfs.wire import Kind, VerbsEndpoint, VerbsRegion

log = logging.getLogger(__name__)

DEFAULT_IO_TIMEOUT = 10.0
ROLE = "verbs"
#: outstanding work requests per queue pair
QUEUE_DEPTH = 64
#: bounce buffers: size of each and how many (registered once, as one region)
BOUNCE_SIZE = 1 << 20
BOUNCE_COUNT = 16
#: bounce buffers one call may hold at once (leaves some for the others)
_BOUNCE_PER_CALL = 8
#: bytes per work request straight from/to a registered buffer
MAX_WR = 16 << 20
ZERO_SIZE = 1 << 20
#: empty polls answered with a bare checkpoint before the poller sleeps between polls
_SPIN = 64
_POLL_SLEEP = 0.0005
_POLL_BATCH = 32
_CONNECT_ID = 2
#: completion queue entries (capped by the device)
CQ_SIZE = 4096
#: RC parameters: ack timeout 4.096 us * 2^14 = 67 ms, 7 retries (~0.5 s to an error)
_ACK_TIMEOUT = 14
_RETRY_COUNT = 7
_RNR_RETRY = 7
_MIN_RNR_TIMER = 12
_MAX_RD_ATOMIC = 16

NO_DEVICE = "no RDMA device found (pyverbs sees none)"
NO_PYVERBS = (
    "no RDMA support: pyverbs is not importable (apt-get install python3-pyverbs, "
    "then make install links it into the virtual environment)"
)


class RdmaUnavailable(UsageError):
    """This node cannot do RDMA: no pyverbs, no device, or not the device asked for."""


class RdmaError(Exception):
    """A verbs call failed (resource creation, a state change, a post)."""


# -- pyverbs, imported lazily ----------------------------------------------------------------

_pv: types.SimpleNamespace | None = None


def load_pyverbs() -> types.SimpleNamespace:
    """The pyverbs modules this transport uses; :class:`RdmaUnavailable` without pyverbs."""
    global _pv
    if _pv is None:
        names = ("device", "pd", "mr", "cq", "qp", "wr", "addr", "enums", "fork",
                 "pyverbs_error")
        try:
            mods = {n: importlib.import_module(f"pyverbs.{n}") for n in names}
        except ImportError as exc:
            raise RdmaUnavailable(f"{NO_PYVERBS}: {exc}") from None
        _pv = types.SimpleNamespace(**mods)
    return _pv


def _device_names() -> list[str]:
    """RDMA devices pyverbs sees.

    With no RDMA support in the kernel at all, libibverbs fails to list devices
    instead of returning none: that is "none" too.
    """
    pv = load_pyverbs()
    try:
        devices = pv.device.get_device_list()
    except pv.pyverbs_error.PyverbsError as exc:
        log.debug("pyverbs cannot list RDMA devices: %s", exc)
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


def rdma_devices() -> list[str]:
    """Names of the RDMA devices on this node; [] without any (or without pyverbs)."""
    try:
        return _device_names()
    except RdmaUnavailable:
        return []


def rdma_available() -> bool:
    """True if pyverbs imports and sees at least one device (for skips and autodetection)."""
    return bool(rdma_devices())


def buffer_address(buf: memoryview) -> int:
    """The address of the first byte of a writable, contiguous, non-empty buffer."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _gid_bytes(text: str) -> bytes:
    """'fe80:0000:...' (pyverbs' GID string) -> 16 bytes."""
    raw = bytes.fromhex(text.replace(":", ""))
    if len(raw) != 16:
        raise RdmaError(f"bad GID {text!r}")
    return raw


def _gid_text(raw: bytes) -> str:
    return ":".join(raw[i : i + 2].hex() for i in range(0, 16, 2))


# -- the device interface ------------------------------------------------------------------

#: a work completion: (work request id, None on success or what went wrong)
Completion = tuple[int, str | None]


class MemoryRegion(abc.ABC):
    """Memory registered with a device (``ibv_mr``)."""

    addr: int
    length: int
    lkey: int
    rkey: int

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister; the memory itself stays its owner's."""


class QueuePair(abc.ABC):
    """A reliable-connected queue pair (``ibv_qp``), created in the INIT state."""

    @property
    @abc.abstractmethod
    def endpoint(self) -> VerbsEndpoint:
        """What the peer needs to connect to this queue pair."""

    @abc.abstractmethod
    def connect(self, peer: VerbsEndpoint) -> None:
        """INIT -> RTR -> RTS towards *peer*."""

    @abc.abstractmethod
    def post(self, wr_id: int, write: bool, addr: int, length: int, lkey: int,
             remote_addr: int, rkey: int) -> None:
        """Post one signalled RDMA WRITE (or READ) of *length* bytes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy; once this returns the device no longer touches its memory."""


class RdmaDevice(abc.ABC):
    """An opened RDMA device: one port, one protection domain, one completion queue.

    :class:`PyverbsDevice` is the real one; the tests have a simulated one.
    Failures of its calls raise :class:`RdmaError`.  Its completion queue
    serves one transport at a time.
    """

    name: str
    #: completion queue entries
    cq_capacity: int = 1 << 20
    #: a transport polls its completion queue
    in_use: bool = False

    @abc.abstractmethod
    def register(self, buf: memoryview, *, remote: bool) -> MemoryRegion:
        """Register *buf* (writable, contiguous) for local writes, and remote reads
        and writes if *remote*."""

    @abc.abstractmethod
    def create_qp(self, depth: int, *, remote_access: bool) -> QueuePair:
        """A new RC queue pair on the shared completion queue, in INIT."""

    @abc.abstractmethod
    def poll(self, max_entries: int) -> list[Completion]:
        """Completions ready now (never blocks)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything created on the device."""


# -- pyverbs ----------------------------------------------------------------------------


def _fork_safety(pv: types.SimpleNamespace) -> None:
    """Registered memory and fork(2): libfuse forks fusermount3 after we register.

    Kernels from 5.13 copy pinned pages for the child themselves
    (``IBV_FORK_UNNEEDED``); on older ones ask libibverbs to protect them.
    """
    e = pv.enums
    try:
        if pv.fork.is_fork_initialized() == e.IBV_FORK_DISABLED:
            pv.fork.fork_init()
    except pv.pyverbs_error.PyverbsError as exc:  # resources exist already: too late
        log.debug("ibv_fork_init: %s", exc)


def rtr_attr(pv: types.SimpleNamespace, *, port: int, mtu: int, rd_atomic: int, gid_index: int,
             use_grh: bool, peer: VerbsEndpoint) -> Any:
    """The ``QPAttr`` for INIT -> RTR towards *peer* (and on to RTS: see :func:`rts_attr`)."""
    e = pv.enums
    attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT, port_num=port,
                        path_mtu=min(mtu, peer.mtu))
    attr.dest_qp_num = peer.qpn
    attr.rq_psn = peer.psn
    attr.max_dest_rd_atomic = rd_atomic  # RDMA READs we answer at once
    attr.min_rnr_timer = _MIN_RNR_TIMER
    if use_grh:
        gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(_gid_text(peer.gid)), sgid_index=gid_index,
                                 hop_limit=64)
        attr.ah_attr = pv.addr.AHAttr(dlid=peer.lid, port_num=port, is_global=1, gr=gr)
    else:
        attr.ah_attr = pv.addr.AHAttr(dlid=peer.lid, port_num=port)
    return attr


def rts_attr(attr: Any, *, psn: int, rd_atomic: int, peer: VerbsEndpoint) -> Any:
    """Complete *attr* (from :func:`rtr_attr`) for RTR -> RTS."""
    attr.timeout = _ACK_TIMEOUT
    attr.retry_cnt = _RETRY_COUNT
    attr.rnr_retry = _RNR_RETRY
    attr.sq_psn = psn
    attr.max_rd_atomic = min(rd_atomic, peer.rd_atomic)  # RDMA READs we have outstanding
    return attr


def send_wr(pv: types.SimpleNamespace, wr_id: int, write: bool, addr: int, length: int,
            lkey: int, remote_addr: int, rkey: int) -> Any:
    """One signalled RDMA READ/WRITE work request with one scatter/gather element."""
    e = pv.enums
    sge = pv.wr.SGE(addr, length, lkey)
    wr = pv.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ,
                      num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, remote_addr)
    return wr


class _PyverbsRegion(MemoryRegion):
    def __init__(self, mr: Any, addr: int, length: int) -> None:
        self._mr = mr
        self.addr, self.length = addr, length
        self.lkey, self.rkey = mr.lkey, mr.rkey

    def close(self) -> None:
        mr, self._mr = self._mr, None
        if mr is not None:
            try:
                mr.close()
            except Exception as exc:
                log.error("deregistering %d bytes at %#x failed: %s", self.length, self.addr, exc)


class _PyverbsQP(QueuePair):
    def __init__(self, dev: PyverbsDevice, depth: int, remote_access: bool) -> None:
        pv, e = dev.pv, dev.pv.enums
        self._dev = dev
        cap = pv.qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=dev.cq, rcq=dev.cq, cap=cap,
                                sq_sig_all=1)
        self._qp: Any = pv.qp.QP(dev.pd, init)
        try:
            attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET,
                                port_num=dev.port)
            attr.pkey_index = 0
            attr.qp_access_flags = (
                e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE if remote_access else 0
            )
            self._qp.to_init(attr)
        except BaseException:
            self._qp.close()
            raise
        self._psn = secrets.randbits(24)
        self._endpoint = VerbsEndpoint(self._qp.qp_num, self._psn, dev.lid, dev.gid, dev.mtu,
                                       dev.rd_atomic)

    @property
    def endpoint(self) -> VerbsEndpoint:
        return self._endpoint

    def connect(self, peer: VerbsEndpoint) -> None:
        dev = self._dev
        use_grh = dev.ethernet or dev.lid == 0 or peer.lid == 0
        if use_grh and not any(peer.gid):
            raise RdmaError("the peer has no GID, and this port needs global routing")
        try:
            attr = rtr_attr(dev.pv, port=dev.port, mtu=dev.mtu, rd_atomic=dev.rd_atomic,
                            gid_index=dev.gid_index, use_grh=use_grh, peer=peer)
            self._qp.to_rtr(attr)
            self._qp.to_rts(rts_attr(attr, psn=self._psn, rd_atomic=dev.rd_atomic, peer=peer))
        except dev.pv.pyverbs_error.PyverbsError as exc:
            raise RdmaError(f"connecting queue pair {self._endpoint.qpn} to {peer.qpn}: "
                            f"{exc}") from None

    def post(self, wr_id: int, write: bool, addr: int, length: int, lkey: int,
             remote_addr: int, rkey: int) -> None:
        pv = self._dev.pv
        try:
            self._qp.post_send(send_wr(pv, wr_id, write, addr, length, lkey, remote_addr, rkey))
        except pv.pyverbs_error.PyverbsError as exc:
            raise RdmaError(f"posting an RDMA {'WRITE' if write else 'READ'}: {exc}") from None

    def close(self) -> None:
        qp, self._qp = self._qp, None
        if qp is not None:
            try:
                qp.close()
            except Exception as exc:
                raise RdmaError(f"destroying queue pair {self._endpoint.qpn}: {exc}") from None


class PyverbsDevice(RdmaDevice):
    """A device opened with pyverbs: port *port*, its PD and one completion queue.

    *name* None picks the first device whose port is active.  The GID (for
    RoCE, where routing is by GID) is *gid_index*, or else the port's first
    RoCE v2 GID (an IPv4-mapped one if any).
    """

    def __init__(self, name: str | None = None, *, port: int = 1,
                 gid_index: int | None = None) -> None:
        pv = self.pv = load_pyverbs()
        _fork_safety(pv)
        names = _device_names()
        if not names:
            raise RdmaUnavailable(NO_DEVICE)
        if name is not None and name not in names:
            raise RdmaUnavailable(f"no RDMA device {name!r} (pyverbs sees {', '.join(names)})")
        problems = []
        for candidate in [name] if name is not None else names:
            try:
                self._open(candidate, port, gid_index)
                break
            except (RdmaError, pv.pyverbs_error.PyverbsError) as exc:
                problems.append(f"{candidate}: {exc}")
                self.close()
        else:
            raise RdmaUnavailable(f"no usable RDMA device ({'; '.join(problems)})")
        log.info("RDMA device %s port %d: lid %d, gid %s (index %d), %s, mtu code %d",
                 self.name, port, self.lid, _gid_text(self.gid), self.gid_index,
                 "RoCE" if self.ethernet else "InfiniBand", self.mtu)

    def _open(self, name: str, port: int, gid_index: int | None) -> None:
        pv, e = self.pv, self.pv.enums
        self.name, self.port = name, port
        self.ctx: Any = pv.device.Context(name=name)
        dattr = self.ctx.query_device()
        pattr = self.ctx.query_port(port)
        if pattr.state != e.IBV_PORT_ACTIVE:
            raise RdmaError(f"port {port} is not active (state {pattr.state})")
        self.ethernet = pattr.link_layer == e.IBV_LINK_LAYER_ETHERNET
        self.lid = pattr.lid
        self.mtu = pattr.active_mtu
        self.rd_atomic = max(1, min(dattr.max_qp_rd_atom, dattr.max_qp_init_rd_atom,
                                    _MAX_RD_ATOMIC))
        self.gid_index, self.gid = self._pick_gid(gid_index, pattr.gid_tbl_len)
        self.pd: Any = pv.pd.PD(self.ctx)
        self.cq_capacity = min(CQ_SIZE, dattr.max_cqe)
        self.cq: Any = pv.cq.CQ(self.ctx, self.cq_capacity)

    def _pick_gid(self, wanted: int | None, table_len: int) -> tuple[int, bytes]:
        pv, e = self.pv, self.pv.enums
        if wanted is not None:
            return wanted, _gid_bytes(self.ctx.query_gid(self.port, wanted).gid)
        best: tuple[int, int, bytes] | None = None  # (rank, index, gid): lower rank is better
        for i in range(min(table_len, 128)):
            try:
                raw = _gid_bytes(self.ctx.query_gid(self.port, i).gid)
            except (RdmaError, pv.pyverbs_error.PyverbsError):
                continue
            if not any(raw):
                continue
            rank = 3
            if self.ethernet:
                try:
                    v2 = self.ctx.query_gid_type(self.port, i) == e.IBV_GID_TYPE_SYSFS_ROCE_V2
                except (AttributeError, pv.pyverbs_error.PyverbsError):
                    v2 = False
                ipv4 = raw[:12] == b"\0" * 10 + b"\xff\xff"
                rank = 0 if v2 and ipv4 else 1 if v2 else 2
            else:
                rank = 0
            if best is None or rank < best[0]:
                best = (rank, i, raw)
            if rank == 0:
                break
        if best is None:
            if self.ethernet:
                raise RdmaError(f"port {self.port} has no GID (RoCE needs one)")
            return 0, bytes(16)  # InfiniBand without a GID: routed by LID
        return best[1], best[2]

    def register(self, buf: memoryview, *, remote: bool) -> MemoryRegion:
        e = self.pv.enums
        access = e.IBV_ACCESS_LOCAL_WRITE
        if remote:
            access |= e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        addr, n = buffer_address(buf), buf.nbytes
        try:
            mr = self.pv.mr.MR(self.pd, n, access, address=addr)
        except self.pv.pyverbs_error.PyverbsError as exc:
            raise RdmaError(f"registering {n} bytes with {self.name}: {exc} (is RLIMIT_MEMLOCK "
                            "large enough? systemd: LimitMEMLOCK=infinity)") from None
        return _PyverbsRegion(mr, addr, n)

    def create_qp(self, depth: int, *, remote_access: bool) -> QueuePair:
        try:
            return _PyverbsQP(self, depth, remote_access)
        except self.pv.pyverbs_error.PyverbsError as exc:
            raise RdmaError(f"creating a queue pair on {self.name}: {exc}") from None

    def poll(self, max_entries: int) -> list[Completion]:
        pv = self.pv
        try:
            _, wcs = self.cq.poll(max_entries)
        except pv.pyverbs_error.PyverbsError as exc:
            raise RdmaError(f"polling the completion queue of {self.name}: {exc}") from None
        ok = pv.enums.IBV_WC_SUCCESS
        return [
            (wc.wr_id, None if wc.status == ok else
             f"{pv.cq.cqe_status_to_str(wc.status)} (status {wc.status}, "
             f"vendor error {wc.vendor_err:#x})")
            for wc in wcs
        ]

    def close(self) -> None:
        ctx = getattr(self, "ctx", None)
        self.ctx = None
        if ctx is not None:
            try:
                ctx.close()  # destroys what was created on it: QPs, CQ, MRs, PD
            except Exception as exc:
                log.error("closing RDMA device %s: %s", getattr(self, "name", "?"), exc)


def open_rdma_device(name: str | None = None) -> PyverbsDevice:
    """Open *name* (None: the first usable device); :class:`RdmaUnavailable` if none."""
    return PyverbsDevice(name)


def server_device(spec: str) -> tuple[RdmaDevice | None, str]:
    """memd's device for ``--rdma-device SPEC``: (device, "") or (None, why there is none).

    ``auto`` uses a device if pyverbs sees one; ``off`` none; a name that
    device or a :class:`RdmaUnavailable` (a user error: it was asked for).
    """
    if spec == "off":
        return None, "RDMA is off on this memory server (--rdma-device off)"
    try:
        return open_rdma_device(None if spec == "auto" else spec), ""
    except RdmaUnavailable as exc:
        if spec != "auto":
            raise
        return None, str(exc)


# -- registered client memory --------------------------------------------------------------


def _anonymous(size: int) -> mmap.mmap:
    """Page-aligned zeroed memory of at least one page."""
    page = mmap.PAGESIZE
    return mmap.mmap(-1, max(page, (size + page - 1) // page * page),
                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class _BouncePool:
    """*count* buffers of *size* bytes, registered as one region."""

    def __init__(self, device: RdmaDevice, size: int, count: int) -> None:
        self.size = size
        self._map = _anonymous(size * count)
        self.view = memoryview(self._map)
        self.region = device.register(self.view[: size * count], remote=False)
        self._free = list(range(count))
        self._lot = trio.lowlevel.ParkingLot()

    def available(self) -> bool:
        return bool(self._free)

    async def acquire(self) -> int:
        while not self._free:
            await self._lot.park()
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)
        self._lot.unpark()

    def addr(self, slot: int) -> int:
        return self.region.addr + slot * self.size

    def buf(self, slot: int, n: int) -> memoryview:
        return self.view[slot * self.size : slot * self.size + n]


# -- the transport -------------------------------------------------------------------------


class _Op:
    """One posted work request."""

    __slots__ = ("wr_id", "conn", "slot", "event", "error", "done", "abandoned")

    def __init__(self, wr_id: int, conn: _Conn, slot: int | None) -> None:
        self.wr_id, self.conn, self.slot = wr_id, conn, slot
        self.event = trio.Event()
        self.error: str | None = None
        self.done = False  # the device is finished with it (or its queue pair is gone)
        self.abandoned = False  # its caller left: whoever completes it frees its slot


class _Conn:
    """One queue pair to a memory server and the authenticated TCP connection it lives on."""

    def __init__(self, server: _Server, sock: socket.socket, qp: QueuePair,
                 regions: list[VerbsRegion], depth: int) -> None:
        self.server, self.sock, self.qp, self.regions = server, sock, qp, regions
        self.slots = trio.Semaphore(depth)
        self.pending: dict[int, _Op] = {}
        self.closed = False
        self.reason = ""


class _Server:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.conn: _Conn | None = None
        self.connecting = trio.Lock()
        self.incarnation: int | None = None
        self.sizes: list[int] = []
        self.lost: str | None = None


@asynccontextmanager
async def open_verbs_transport(
    volumes: Sequence[VolumeAddr],
    secret: bytes,
    *,
    device: RdmaDevice | str | None = None,
    io_timeout: float = DEFAULT_IO_TIMEOUT,
    queue_depth: int = QUEUE_DEPTH,
    bounce_size: int = BOUNCE_SIZE,
    bounce_count: int = BOUNCE_COUNT,
    fsid: bytes | None = None,
) -> AsyncIterator[VerbsTransport]:
    """Connect to the servers of *volumes* over RDMA and yield the transport; close on exit.

    *device*: an opened :class:`RdmaDevice` (not closed here), a device name,
    or None for the first usable one.  Raises :class:`RdmaUnavailable` without
    a device, :class:`TransportError` if a server cannot be reached, refuses
    us or has no RDMA (:class:`ClaimRefused`: a volume belongs to another
    filesystem than *fsid*, claimed on each control connection; None: no
    claim), :class:`UsageError` if a volume does not exist there.
    """
    owned = not isinstance(device, RdmaDevice)
    dev = open_rdma_device(device) if not isinstance(device, RdmaDevice) else device
    error: BaseException | None = None
    try:
        t = VerbsTransport(volumes, secret, dev, io_timeout=io_timeout, queue_depth=queue_depth,
                           bounce_size=bounce_size, bounce_count=bounce_count, fsid=fsid)
        try:
            async with trio.open_nursery() as nursery:
                t._nursery = nursery
                try:
                    nursery.start_soon(t._poller)
                    await t._open()
                    yield t
                finally:
                    t._close()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The poller and watchers never raise: a group only wraps the
            # opening's or the body's one exception.
            if len(group.exceptions) != 1:
                raise
            error = group.exceptions[0]
    finally:
        if owned:
            dev.close()
    if error is not None:
        raise error


class VerbsTransport(Transport):
    concurrent = True  # work requests to all servers are outstanding at once

    def __init__(
        self,
        volumes: Sequence[VolumeAddr],
        secret: bytes,
        device: RdmaDevice,
        *,
        io_timeout: float = DEFAULT_IO_TIMEOUT,
        queue_depth: int = QUEUE_DEPTH,
        bounce_size: int = BOUNCE_SIZE,
        bounce_count: int = BOUNCE_COUNT,
        fsid: bytes | None = None,
    ) -> None:
        if not volumes:
            raise UsageError("a verbs pool needs at least one volume")
        if queue_depth < 1 or bounce_size < 1 or bounce_count < 1:
            raise UsageError("queue_depth, bounce_size and bounce_count must be at least 1")
        if device.in_use:
            raise UsageError(f"RDMA device {device.name} serves another verbs transport")
        self._secret = secret
        self._device = device
        self.io_timeout = io_timeout
        self._depth = queue_depth
        self._servers: dict[tuple[str, int], _Server] = {}
        self._map: list[tuple[_Server, int]] = []
        for v in volumes:
            if v.scheme != "verbs":
                raise UsageError(f"volume {v}: the verbs transport serves verbs:// volumes only")
            server = self._servers.get(v.server)
            if server is None:
                server = self._servers[v.server] = _Server(v.host, v.port)
            self._map.append((server, v.volume))
        #: the filesystem whose volumes these are (CLAIM on each control connection)
        self._fsid = fsid
        self._addrs = list(volumes)
        self._info: list[VolumeInfo] = []
        self._nursery: trio.Nursery | None = None
        self._closed = False
        #: the lease token the control connections name (see set_session)
        self._token = 0
        self._ids = itertools.count(1)
        self._ops: dict[int, _Op] = {}  # posted, not yet completed
        # All queue pairs share one completion queue: never more outstanding than
        # it holds (with room for stale entries of queue pairs reset meanwhile).
        self._cq_room = trio.Semaphore(max(1, device.cq_capacity // 2))
        self._wake = trio.Event()
        # registered memory: (start address, end address, region), sorted
        self._registered: list[tuple[int, int, MemoryRegion]] = []
        self._keep: list[mmap.mmap] = []
        try:
            self._pool = _BouncePool(device, bounce_size, bounce_count)
        except RdmaError as exc:
            raise TransportError(f"bounce buffers: {exc}") from None
        self._zero_map = _anonymous(ZERO_SIZE)
        try:
            self._zero = device.register(memoryview(self._zero_map)[:ZERO_SIZE], remote=False)
        except RdmaError as exc:
            self._pool.region.close()
            raise TransportError(f"zero buffer: {exc}") from None
        device.in_use = True

    # -- opening and closing ----------------------------------------------------------

    async def _open(self) -> None:
        for server in self._servers.values():
            with trio.move_on_after(self.io_timeout) as scope:
                await self._connect(server)
            if scope.cancelled_caught:
                raise TransportError(
                    f"memory server {server.name} did not answer within {self.io_timeout:g}s"
                )
        self._info.extend(volume_infos(self._map, self._addrs))

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for server in self._servers.values():
            if server.conn is not None:
                self._fail(server.conn, "the verbs transport is closed")
        self._wake.set()
        # Queue pairs are gone: nothing can touch registered memory any more.
        # The memory itself stays alive for whoever still holds a view of it.
        for _, _, region in self._registered:
            region.close()
        self._registered.clear()
        self._keep.clear()
        self._pool.region.close()
        self._zero.close()
        self._device.in_use = False

    async def aclose(self) -> None:
        self._close()
        await trio.lowlevel.checkpoint()

    def set_session(self, token: int) -> None:
        """As the tcp transport's: connections (and their queue pairs) that named an
        older lease token are dropped; new ones name *token*.  (Not run on RDMA
        hardware: the memory server's side destroys a fenced client's queue pair
        with its control connection.)"""
        if token == self._token:
            return
        self._token = token
        for server in self._servers.values():
            if server.conn is not None:
                self._fail(server.conn, "the lease token this client worked under was replaced")

    async def _connect(self, server: _Server) -> _Conn:
        """Control connection (handshake, INFO), then queue pairs exchanged and connected."""
        try:
            sock = await connect(server.host, server.port)
        except OSError as exc:
            raise TransportError(
                f"cannot connect to memory server {server.name}: {exc.strerror or exc}"
            ) from None
        qp: QueuePair | None = None
        knew = server.incarnation
        try:
            token = self._token
            mine = [remote for s, remote in self._map if s is server]
            incarnation, sizes, _ = await memd_handshake(sock, self._secret, ROLE, token,
                                                         self._fsid, mine, server.incarnation)
            if token != self._token:
                raise wire.WireError("the lease token changed while connecting")
            qp = self._device.create_qp(self._depth, remote_access=False)
            request = wire.encode_verbs_endpoint(qp.endpoint)
            await send_all(sock, [wire.frame(Kind.VERBS_CONNECT, _CONNECT_ID, request)])
            h, payload = await recv_frame(sock, wire.VERBS_ACCEPT_MAX)
            if h.req_id != _CONNECT_ID or h.kind not in (Kind.OK, Kind.ERROR):
                raise wire.WireError(f"unexpected {h.kind.name} reply to VERBS_CONNECT")
            if h.kind is Kind.ERROR:
                err, msg = wire.decode_error(payload)
                raise TransportError(
                    f"memory server {server.name} offers no RDMA: {msg or os.strerror(err)}"
                )
            peer, regions = wire.decode_verbs_accept(payload)
            if len(regions) != len(sizes) or any(
                r.size < s for r, s in zip(regions, sizes, strict=True)
            ):
                raise wire.WireError("its RDMA regions do not match its volumes")
            qp.connect(peer)
        except ClaimRefused as exc:
            self._discard(sock, qp)
            raise ClaimRefused(f"memory server {server.name}: {exc.args[1]}") from None
        except (OSError, wire.WireError, RdmaError) as exc:
            self._discard(sock, qp)
            raise TransportError(f"memory server {server.name}: {exc}") from None
        except BaseException:
            self._discard(sock, qp)
            raise
        if self._closed:
            self._discard(sock, qp)
            raise TransportError("the verbs transport is closed")
        if knew is not None and server.incarnation != knew:  # adopted meanwhile (as tcp's)
            self._discard(sock, qp)
            raise TransportError(f"memory server {server.name} was taken back while we "
                                 "connected: try again")
        if server.incarnation is None:
            server.incarnation, server.sizes = incarnation, sizes
        elif incarnation != server.incarnation or server.lost:
            self._discard(sock, qp)
            if not server.lost:
                server.lost = f"memory server {server.name} restarted; its data is lost"
                log.error("%s (incarnation %x, was %x)", server.lost, incarnation,
                          server.incarnation)
            raise TransportError(server.lost)
        set_keepalive(sock)
        conn = _Conn(server, sock, qp, regions, self._depth)
        server.conn = conn
        assert self._nursery is not None
        self._nursery.start_soon(self._watch, conn)
        log.debug("connected to memory server %s over RDMA (queue pair %d -> %d)",
                  server.name, qp.endpoint.qpn, peer.qpn)
        return conn

    @staticmethod
    def _discard(sock: socket.socket, qp: QueuePair | None) -> None:
        if qp is not None:
            try:
                qp.close()
            except RdmaError as exc:
                log.error("%s", exc)
        close_socket(sock)

    async def _watch(self, conn: _Conn) -> None:
        """The control connection carries nothing more: its end is the server's end."""
        reason = "closed the connection"
        try:
            while not conn.closed:
                await trio.lowlevel.wait_readable(conn.sock)
                try:
                    data = conn.sock.recv(64)
                except BlockingIOError:
                    continue
                if data:
                    reason = "sent something unexpected on the control connection"
                break
        except (OSError, ValueError, trio.ClosedResourceError) as exc:
            if conn.closed:  # we closed the socket (reset, close)
                return
            reason = str(exc)
        if not conn.closed:
            msg = f"lost memory server {conn.server.name}: {reason}"
            log.warning("%s", msg)
            self._fail(conn, msg)

    def _fail(self, conn: _Conn, reason: str) -> None:
        """Reset: destroy the queue pair, close the control connection, fail its requests."""
        if conn.closed:
            return
        conn.closed = True
        conn.reason = reason
        try:
            conn.qp.close()
        except RdmaError as exc:  # the device may still complete (and touch) its requests
            log.error("%s", exc)
        close_socket(conn.sock)
        if conn.server.conn is conn:
            conn.server.conn = None
        for op in list(conn.pending.values()):
            self._complete(op, reason)

    def _complete(self, op: _Op, error: str | None) -> None:
        if op.done:
            return
        op.done = True
        op.error = error
        self._ops.pop(op.wr_id, None)
        op.conn.pending.pop(op.wr_id, None)
        op.conn.slots.release()
        self._cq_room.release()
        if op.abandoned and op.slot is not None:
            self._pool.release(op.slot)
        op.event.set()

    async def _poller(self) -> None:
        """Deliver completions of the shared completion queue to their requests."""
        spins = 0
        while not self._closed:
            if not self._ops:
                self._wake = trio.Event()
                await self._wake.wait()
                spins = 0
                continue
            try:
                done = self._device.poll(_POLL_BATCH)
            except RdmaError as exc:
                log.error("%s: resetting every queue pair", exc)
                for server in self._servers.values():
                    if server.conn is not None:
                        self._fail(server.conn, str(exc))
                done = []
            for wr_id, error in done:
                op = self._ops.get(wr_id)
                if op is None:
                    continue  # its queue pair was reset meanwhile
                conn = op.conn
                if error is not None:
                    error = f"memory server {conn.server.name}: RDMA request failed: {error}"
                self._complete(op, error)
                if error is not None and not conn.closed:
                    log.warning("%s; resetting the queue pair", error)
                    self._fail(conn, error)  # the queue pair is in the error state
            if done:
                spins = 0
                await trio.lowlevel.checkpoint()
            elif spins < _SPIN:
                spins += 1
                await trio.lowlevel.checkpoint()
            else:
                await trio.sleep(_POLL_SLEEP)

    async def _conn_for(self, server: _Server) -> _Conn:
        if server.lost:
            raise TransportError(server.lost)
        conn = server.conn
        if conn is not None:
            return conn
        async with server.connecting:
            conn = server.conn
            if conn is None:
                conn = await self._connect(server)
            return conn

    # -- requests -------------------------------------------------------------------

    async def _post(self, conn: _Conn, write: bool, addr: int, length: int, lkey: int,
                    remote_addr: int, rkey: int, slot: int | None) -> _Op:
        await conn.slots.acquire()
        try:
            await self._cq_room.acquire()
        except BaseException:
            conn.slots.release()
            raise
        if conn.closed:
            conn.slots.release()
            self._cq_room.release()
            raise TransportError(conn.reason)
        wr_id = next(self._ids)
        try:
            conn.qp.post(wr_id, write, addr, length, lkey, remote_addr, rkey)
        except RdmaError as exc:
            conn.slots.release()
            self._cq_room.release()
            reason = f"memory server {conn.server.name}: {exc}"
            self._fail(conn, reason)
            raise TransportError(reason) from None
        op = _Op(wr_id, conn, slot)
        self._ops[wr_id] = op
        conn.pending[wr_id] = op
        self._wake.set()
        return op

    def _leave(self, op: _Op, direct_read: bool) -> None:
        """The caller stops waiting for *op* (error, cancellation, deadline)."""
        if op.done:
            if op.slot is not None:
                self._pool.release(op.slot)
        elif direct_read:
            # The device would write into memory the caller takes back: make
            # sure it cannot, before the caller's call returns.
            log.warning("a read from memory server %s into a registered buffer was abandoned; "
                        "resetting its queue pair", op.conn.server.name)
            self._fail(op.conn, f"memory server {op.conn.server.name}: a read was abandoned")
        else:
            op.abandoned = True  # whoever completes it frees its bounce buffer

    async def _transfer(self, volume: int, offset: int, n: int, write: bool,
                        view: memoryview | None, region: tuple[int, int] | None) -> None:
        """Move *n* bytes between *volume* at *offset* and the caller.

        *region* ``(address, lkey)``: registered memory to use directly (the
        caller's buffer, or the zero buffer, which is then reused for every
        piece); otherwise *view* is staged through bounce buffers.  The whole
        call must progress every ``io_timeout``.
        """
        server, remote = self._map[volume]
        mine: collections.deque[tuple[_Op, memoryview | None]] = collections.deque()
        direct_read = region is not None and not write
        conn: _Conn | None = None
        with trio.CancelScope(deadline=trio.current_time() + self.io_timeout) as scope:
            try:
                conn = await self._conn_for(server)
                rr = conn.regions[remote]
                if region is not None:
                    addr, lkey = region
                    step = ZERO_SIZE if view is None else MAX_WR
                    for pos in range(0, n, step):
                        k = min(step, n - pos)
                        src = addr if view is None else addr + pos
                        op = await self._post(conn, write, src, k, lkey, rr.addr + offset + pos,
                                              rr.rkey, None)
                        mine.append((op, None))
                else:
                    assert view is not None
                    pool = self._pool
                    for pos in range(0, n, pool.size):
                        k = min(pool.size, n - pos)
                        while mine and (len(mine) >= _BOUNCE_PER_CALL or not pool.available()):
                            await self._finish(mine, scope)
                        slot = await pool.acquire()
                        try:
                            if write:
                                pool.buf(slot, k)[:] = view[pos : pos + k]
                            op = await self._post(conn, write, pool.addr(slot), k,
                                                  pool.region.lkey, rr.addr + offset + pos,
                                                  rr.rkey, slot)
                        except BaseException:
                            pool.release(slot)
                            raise
                        mine.append((op, None if write else view[pos : pos + k]))
                while mine:
                    await self._finish(mine, scope)
            finally:
                for op, _ in mine:
                    self._leave(op, direct_read)
        if scope.cancelled_caught:
            reason = (f"memory server {server.name} did not complete an RDMA request within "
                      f"{self.io_timeout:g}s")
            if conn is not None and not conn.closed:
                log.warning("%s; resetting the queue pair", reason)
                self._fail(conn, reason)
            raise TransportError(reason)

    async def _finish(self, mine: collections.deque[tuple[_Op, memoryview | None]],
                      scope: trio.CancelScope) -> None:
        """Wait for the oldest of the caller's requests and hand over its data."""
        op, dest = mine[0]
        await op.event.wait()
        mine.popleft()
        try:
            if op.error is not None:
                raise TransportError(op.error)
            if dest is not None:
                assert op.slot is not None
                dest[:] = self._pool.buf(op.slot, len(dest))
        finally:
            if op.slot is not None:
                self._pool.release(op.slot)
        scope.deadline = trio.current_time() + self.io_timeout  # progress

    def _lookup(self, view: memoryview) -> tuple[int, int] | None:
        """``(address, lkey)`` if *view* lies inside memory from :meth:`register`."""
        if view.readonly or not self._registered or not view.nbytes:
            return None
        addr = buffer_address(view)
        i = bisect.bisect_right(self._registered, addr, key=lambda r: r[0]) - 1
        if i >= 0:
            start, end, region = self._registered[i]
            if start <= addr and addr + view.nbytes <= end:
                return addr, region.lkey
        return None

    def adopt(self, incarnations: Mapping[str, int]) -> None:
        # As TcpTransport.adopt (not run on RDMA hardware: see the module doc).
        for server, want in taken_back(self._servers.values(), incarnations):
            if server.conn is not None:
                self._fail(server.conn, "taken back at another incarnation")
            server.incarnation, server.lost = want, None

    def servers_up(self) -> dict[str, bool]:
        return {
            server.name: not server.lost and server.conn is not None and not server.conn.closed
            for server in self._servers.values()
        }

    def check_range(self, volume: int, offset: int, length: int) -> None:
        if self._closed:  # EIO for late requests
            raise TransportError("the verbs transport is closed")
        super().check_range(volume, offset, length)

    @property
    def volumes(self) -> list[VolumeInfo]:
        return self._info

    def register(self, size: int) -> memoryview:
        """*size* bytes of memory registered with the device, once.

        Reads into it and writes from it skip the bounce buffers.  It stays
        registered until the transport closes (reuse it rather than asking
        for more).
        """
        m = _anonymous(size)
        view = memoryview(m)[:size]
        if self._closed:
            return view
        try:
            region = self._device.register(memoryview(m), remote=False)
        except RdmaError as exc:
            raise TransportError(str(exc)) from None
        self._keep.append(m)
        bisect.insort(self._registered, (region.addr, region.addr + region.length, region),
                      key=lambda r: r[0])
        return view

    async def read(self, volume: int, offset: int, length: int) -> Buffer:
        buf = memoryview(bytearray(length))
        await self.readinto(volume, offset, buf)
        return buf

    async def readinto(self, volume: int, offset: int, buf: memoryview) -> None:
        dest = memoryview(buf).cast("B")
        if dest.readonly:
            raise ValueError("readinto needs a writable buffer")
        n = len(dest)
        self.check_range(volume, offset, n)
        if n:
            await self._transfer(volume, offset, n, False, dest, self._lookup(dest))

    async def write(self, volume: int, offset: int, data: Buffer) -> None:
        src = memoryview(data).cast("B")
        n = len(src)
        self.check_range(volume, offset, n)
        if n:
            await self._transfer(volume, offset, n, True, src, self._lookup(src))

    async def zero(self, volume: int, offset: int, length: int) -> None:
        self.check_range(volume, offset, length)
        if length:
            await self._transfer(volume, offset, length, True, None,
                                 (self._zero.addr, self._zero.lkey))


