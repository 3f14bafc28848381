"""A simulated RDMA device, so the verbs transport's logic runs where no device exists.

:class:`SimDevice` implements :class:`memfs.transport.verbs.RdmaDevice` the way
an HCA behaves as seen through verbs: memory regions with keys, RC queue pairs
that must be connected to each other, one-sided READ/WRITE executed without the
remote side's CPU, in-order completion per queue pair, an error completion
moving a queue pair to the error state (later requests flush), and a destroyed
queue pair never touching memory again.  Requests are carried out when the
*requester* polls its completion queue (by ``ctypes.memmove`` between the
registered addresses, after the key and bounds checks a device would make):
the memory server's process does nothing for them.

What it cannot tell: whether :class:`~memfs.transport.verbs.PyverbsDevice`
drives real hardware correctly.  That needs a device.

Fault injection: ``device.frozen = True`` makes a device stop answering
requests (a hung server: requests to it stay outstanding); a queue pair whose
peer is gone fails its requests with a retry-exceeded error, as a real one
does after its retries.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
from dataclasses import dataclass

from memfs.transport.verbs import (
    Completion,
    MemoryRegion,
    QueuePair,
    RdmaDevice,
    RdmaError,
    buffer_address,
)
from memfs.wire import VerbsEndpoint

RETRY_EXCEEDED = "retry exceeded error"
FLUSHED = "WR flush error"


class SimFabric:
    """The network: queue pairs by number, so a requester finds its responder."""

    def __init__(self) -> None:
        self.qps: dict[int, SimQP] = {}
        self.qpn = itertools.count(0x100)
        self.key = itertools.count(0x1000)
        self.lid = itertools.count(1)


class SimRegion(MemoryRegion):
    def __init__(self, dev: SimDevice, buf: memoryview, remote: bool) -> None:
        self.dev = dev
        # Held like the pages a device pins: the memory cannot go away while registered.
        self.view: memoryview | None = buf
        self.addr = buffer_address(buf)
        self.length = buf.nbytes
        self.lkey = self.rkey = next(dev.fabric.key)
        self.remote = remote
        dev.regions[self.lkey] = self
        dev.registrations += 1

    def covers(self, addr: int, n: int) -> bool:
        return self.view is not None and self.addr <= addr and addr + n <= self.addr + self.length

    def close(self) -> None:
        self.dev.regions.pop(self.lkey, None)
        self.view = None


@dataclass
class SimWR:
    wr_id: int
    write: bool
    addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int


class SimQP(QueuePair):
    def __init__(self, dev: SimDevice, depth: int, remote_access: bool) -> None:
        self.dev = dev
        self.depth = depth
        self.remote_access = remote_access
        self.qpn = next(dev.fabric.qpn)
        self.state = "INIT"
        self.peer_qpn: int | None = None
        self.sq: collections.deque[SimWR] = collections.deque()
        self._endpoint = VerbsEndpoint(self.qpn, self.qpn * 7 % (1 << 24), dev.lid,
                                       bytes(15) + bytes([dev.lid]), 5, 16)
        dev.fabric.qps[self.qpn] = self
        dev.qps.add(self)

    @property
    def endpoint(self) -> VerbsEndpoint:
        return self._endpoint

    def connect(self, peer: VerbsEndpoint) -> None:
        if self.state != "INIT":
            raise RdmaError(f"queue pair {self.qpn} is {self.state}, not INIT")
        if peer.qpn not in self.dev.fabric.qps:
            raise RdmaError(f"no queue pair {peer.qpn} on the fabric")
        self.peer_qpn = peer.qpn
        self.state = "RTS"

    def post(self, wr_id: int, write: bool, addr: int, length: int, lkey: int,
             remote_addr: int, rkey: int) -> None:
        if self.state in ("GONE", "INIT"):
            raise RdmaError(f"post on a queue pair in state {self.state}")
        if len(self.sq) >= self.depth:
            raise RdmaError("send queue full")
        dev = self.dev
        if sum(len(q.sq) for q in dev.qps) + len(dev.cq) >= dev.cq_capacity:
            raise RdmaError("completion queue overrun: more outstanding than it holds")
        self.sq.append(SimWR(wr_id, write, addr, length, lkey, remote_addr, rkey))
        self.dev.posted.append((lkey, length, write))

    def close(self) -> None:
        """Destroyed: its requests are dropped without completions or memory access."""
        self.state = "GONE"
        self.sq.clear()
        self.dev.fabric.qps.pop(self.qpn, None)
        self.dev.qps.discard(self)


class SimDevice(RdmaDevice):
    def __init__(self, fabric: SimFabric, name: str = "sim0") -> None:
        self.fabric = fabric
        self.name = name
        self.lid = next(fabric.lid)
        self.regions: dict[int, SimRegion] = {}
        self.qps: set[SimQP] = set()
        self.cq: collections.deque[Completion] = collections.deque()
        self.frozen = False
        self.closed = False
        self.registrations = 0
        self.posted: list[tuple[int, int, bool]] = []  # (lkey, length, write) per request
        self.cq_capacity = 1 << 20

    def register(self, buf: memoryview, *, remote: bool) -> MemoryRegion:
        if self.closed:
            raise RdmaError("device closed")
        return SimRegion(self, buf, remote)

    def create_qp(self, depth: int, *, remote_access: bool) -> QueuePair:
        if self.closed:
            raise RdmaError("device closed")
        return SimQP(self, depth, remote_access)

    def poll(self, max_entries: int) -> list[Completion]:
        if self.closed:
            raise RdmaError("device closed")
        for qp in list(self.qps):
            while qp.sq:
                wr = qp.sq[0]
                if qp.state == "ERR":
                    error: str | None = FLUSHED
                else:
                    peer = self.fabric.qps.get(qp.peer_qpn) if qp.peer_qpn else None
                    if peer is not None and peer.dev.frozen:
                        break  # no answer (yet): this queue pair stalls, in order
                    error = self._execute(wr, peer, qp)
                    if error is not None:
                        qp.state = "ERR"
                qp.sq.popleft()
                self.cq.append((wr.wr_id, error))
        n = min(max_entries, len(self.cq))
        return [self.cq.popleft() for _ in range(n)]

    def _execute(self, wr: SimWR, peer: SimQP | None, qp: SimQP) -> str | None:
        if peer is None or peer.state != "RTS" or peer.peer_qpn != qp.qpn:
            return RETRY_EXCEEDED
        local = self.regions.get(wr.lkey)
        if local is None or not local.covers(wr.addr, wr.length):
            return "local protection error"
        remote = peer.dev.regions.get(wr.rkey)
        if (remote is None or not remote.remote or not peer.remote_access
                or not remote.covers(wr.remote_addr, wr.length)):
            return "remote access error"
        if wr.write:
            ctypes.memmove(wr.remote_addr, wr.addr, wr.length)
        else:
            ctypes.memmove(wr.addr, wr.remote_addr, wr.length)
        return None

    def close(self) -> None:
        for qp in list(self.qps):
            qp.close()
        for r in list(self.regions.values()):
            r.close()
        self.closed = True
