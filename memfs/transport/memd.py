"""The memory server (``memfs memd``): volumes of this node's memory, served over TCP.

A :class:`MemoryServer` allocates and touches its volumes up front (a
:class:`~memfs.transport.local.LocalTransport` holds them), picks a random
*incarnation* and serves the ``memd`` requests of :mod:`memfs.wire` to any
number of clients:

* every connection starts with the HMAC handshake (HELLO, AUTH, WELCOME); a
  client that fails it is dropped before a single request is read;
* then requests (INFO, READ, WRITE, WRITE_QUIET, SYNC, ZERO, VERBS_CONNECT, SESSION,
  FENCE) are served in order, one at a time per connection; a client may
  pipeline them, and each reply carries its request's id.  WRITE_QUIET is not
  answered unless refused, and SYNC is answered at once: being served in
  order, its answer confirms every write sent before it (a client's posted
  writes, confirmed a batch at a time instead of one answer each);
* with an RDMA device (:mod:`memfs.transport.verbs`; ``memfs memd
  --rdma-device``, by default the first one pyverbs finds) every volume is
  registered once at start for remote reads and writes, and VERBS_CONNECT
  gives an authenticated client an RC queue pair plus each volume's address
  and rkey: its reads and writes then bypass this process entirely.  The
  queue pair lives as long as the connection that asked for it.  Without a
  device VERBS_CONNECT is answered ENODEV with the reason;
* data moves between the socket and volume memory with no copy in Python:
  WRITE payloads are received straight into the volume (after the range is
  checked), READ replies are sent straight from it with ``sendmsg``.  Only
  what the connection's 64 KiB receive buffer caught of a WRITE is copied
  from there: one ``recv`` brings a small WRITE whole, with its header;
* a client that works under a metadata server's lease names its lease token
  (SESSION) first; when the mds takes that lease without the client's word
  (evicted, cut off) it sends FENCE with the token: every connection that named
  it is closed at once (its RDMA queue pair destroyed), and the token is refused
  from then on.  So a transfer the client started under the lost lease cannot
  land after the FENCE is answered (see "Fencing" in docs/ARCHITECTURE.md);
* a request that arrived whole is served and answered without a wait or a
  timer; a connection may sit idle between frames forever, but a frame that
  has started must be received, served and answered within ``frame_timeout``;
* anything malformed (bad header, wrong payload size, a frame kind that is not
  a request) is logged and closes that connection only.  A WRITE whose range
  lies outside the volume is answered EINVAL and its payload discarded.

Clients tell a restarted server by its incarnation: the memory behind a new
incarnation is blank, whatever was written to the old one is gone.

Consistency: requests on different connections run interleaved; a READ that
overlaps a concurrent WRITE may see part of it (like the local transport).
A WRITE whose sender disappears mid-payload may leave part of its data in the
volume; the client reports that write failed.
"""

from __future__ import annotations

import errno
import faulthandler
import logging
import math
import secrets
import signal
import socket
import time
from typing import TYPE_CHECKING

import trio
import trio.lowlevel

from memfs import wire
from memfs.config import format_size
from memfs.errors import UsageError
from memfs.host import mem_available, sd_notify
from memfs.transport.local import LocalTransport
from memfs.transport.sockio import (
    Buf,
    PeerClosed,
    RecvBuffer,
    close_socket,
    recv_exactly_into,
    recv_some_into,
    send_all,
    send_now,
)
from memfs.wire import Kind

if TYPE_CHECKING:
    from memfs.metrics import Metrics
    from memfs.transport.verbs import MemoryRegion, QueuePair, RdmaDevice

log = logging.getLogger(__name__)

#: a started frame must be completely received, served and answered within this
FRAME_TIMEOUT = 30.0
#: from accept to a completed AUTH
HANDSHAKE_TIMEOUT = 10.0
#: the client roles a memory server serves (the tcp and verbs transports)
SERVED_ROLES = ("tcp", "verbs")
#: AUTH is 65 bytes plus a short role name; nothing larger is read before it
_AUTH_MAX = 512
#: a small WRITE (64 KiB of data with its header and struct) arrives in one recv
_RECV_BUFFER = (64 << 10) + 64
#: serving a frame costs about as much as moving this many data bytes; a
#: connection yields to the others after _WORK_PER_CHECKPOINT of work
_FRAME_WORK = 16 << 10
_WORK_PER_CHECKPOINT = 256 << 10
#: the fixed payload of each request kind but WRITE (whose data follows its struct)
_REQUEST_SIZES = {
    Kind.READ: wire.READ.size,
    Kind.ZERO: wire.ZERO.size,
    Kind.INFO: 0,
    Kind.VERBS_CONNECT: wire.VERBS_ENDPOINT.size,
    Kind.SESSION: wire.TOKEN.size,
    Kind.FENCE: wire.TOKEN.size,
    Kind.SYNC: 0,
}
#: what INFO says this server does beyond the basic requests (see memfs.wire)
FEATURES = ["quiet-writes"]
#: request kind -> operation in --metrics (a quiet write is a write there)
_OP_NAMES = {k: k.name.lower() for k in Kind} | {Kind.WRITE_QUIET: "write"}
#: fenced tokens remembered (the oldest forgotten first; a token is 63 random bits,
#: and a client that meets a forgotten one has long since re-registered)
FENCED_KEPT = 1 << 16


class _Drop(Exception):
    """End this connection, logging the reason as a warning."""


class _ConnState:
    """What one connection owns beyond its socket."""

    __slots__ = ("qp", "deadline", "work", "err", "moved", "token", "fenced", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.qp: QueuePair | None = None
        #: the lease token the client named (SESSION), 0: none
        self.token = 0
        #: set by FENCE: nothing more of this connection reaches volume memory
        self.fenced = False
        #: the errno the last request was answered with (for --metrics), else None
        self.err: int | None = None
        #: bytes the last READ or WRITE moved (for --metrics)
        self.moved = 0
        #: the current frame's deadline (inf while it needed no wait)
        self.deadline = math.inf
        #: about how many bytes were served since this connection last let others run
        self.work = 0


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MemoryServer:
    """*n_volumes* volumes of *volume_size* bytes, served to clients that know *secret*.

    An empty *secret* still runs the handshake, with an empty key: anyone who
    can reach the port can read and write the memory.
    """

    def __init__(
        self,
        n_volumes: int,
        volume_size: int,
        secret: bytes = b"",
        *,
        frame_timeout: float = FRAME_TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_payload: int = wire.MAX_PAYLOAD,
        rdma: RdmaDevice | None = None,
    ) -> None:
        self.memory = LocalTransport(n_volumes, volume_size)
        # A random 63-bit number: the value codec carries signed 64-bit integers.
        self.incarnation = secrets.randbits(63)
        self.secret = secret
        self.frame_timeout = frame_timeout
        self.handshake_timeout = handshake_timeout
        self.max_payload = max_payload
        self._info = wire.encode(
            {"incarnation": self.incarnation, "volumes": [v.size for v in self.memory.volumes],
             "features": FEATURES}
        )
        self._views = [self.memory.volume_memory(i) for i in range(n_volumes)]
        #: the RDMA device, once the volumes are registered with it
        self.rdma: RdmaDevice | None = None
        #: why VERBS_CONNECT is answered ENODEV
        self.rdma_absent = "this memory server has no RDMA device"
        self._regions: list[MemoryRegion] = []
        self._verbs_regions: list[wire.VerbsRegion] = []
        self._qps: set[QueuePair] = set()
        if rdma is not None:
            self.enable_rdma(rdma)
        #: clients connected now
        self.connections = 0
        #: connections by the lease token they named
        self._by_token: dict[int, set[_ConnState]] = {}
        #: tokens fenced, oldest first (a dict as an ordered set)
        self.fenced: dict[int, None] = {}
        #: request counters (``memfs memd --metrics``); None: not kept
        self.metrics: Metrics | None = None

    def enable_rdma(self, device: RdmaDevice) -> None:
        """Register every volume with *device* (which this server then owns and closes).

        Raises :class:`memfs.transport.verbs.RdmaError` (leaving RDMA off) if
        the device refuses a volume.
        """
        regions = []
        try:
            for view in self._views:
                regions.append(device.register(view, remote=True))
        except BaseException:
            for r in regions:
                r.close()
            raise
        self.rdma = device
        self._regions = regions
        self._verbs_regions = [wire.VerbsRegion(r.addr, r.rkey, r.length) for r in regions]
        log.info("RDMA: %d volumes registered with %s", len(regions), device.name)

    async def aclose(self) -> None:
        """Give the volumes back (after serving has stopped)."""
        for qp in list(self._qps):
            self._close_qp(qp)
        for r in self._regions:
            r.close()
        self._regions.clear()
        if self.rdma is not None:
            self.rdma.close()
            self.rdma = None
        self._views.clear()
        await self.memory.aclose()

    def _close_qp(self, qp: QueuePair) -> None:
        self._qps.discard(qp)
        try:
            qp.close()
        except Exception as exc:
            log.error("%s", exc)

    # -- listening -----------------------------------------------------------------

    @staticmethod
    async def listen(host: str, port: int) -> socket.socket:
        """A listening socket on *host*:*port* (port 0: any free port).

        Separate from :meth:`serve` so that a daemon can report a bind failure
        as a user error before it starts any task.
        """
        infos = await trio.socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on *host*:*port* and serve until cancelled; reports the bound port."""
        sock = await self.listen(host, port)
        await self.serve_socket(sock, task_status=task_status)

    async def serve_socket(
        self, sock: socket.socket, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept and serve connections on listening *sock* until cancelled; closes it."""
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(sock.getsockname()[1])
                while True:
                    try:
                        conn, addr = sock.accept()
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(sock)
                        continue
                    except OSError as exc:
                        # Out of descriptors or buffers: let connections drain and retry.
                        log.warning("accept failed: %s", exc)
                        await trio.sleep(0.1)
                        continue
                    nursery.start_soon(self._connection, conn, format_addr(*addr[:2]))
                    await trio.lowlevel.checkpoint()
        finally:
            close_socket(sock)

    # -- one connection ------------------------------------------------------------

    async def _connection(self, sock: socket.socket, peer: str) -> None:
        """Serve one client; whatever it sends, only this connection ends."""
        state = _ConnState(sock)
        self.connections += 1
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            role: str | None = None
            with trio.move_on_after(self.handshake_timeout) as scope:
                role = await self._handshake(sock)
            if scope.cancelled_caught:
                raise _Drop(f"no authentication within {self.handshake_timeout:g}s")
            if role is None:
                log.info("%s connected and left without a word", peer)  # a port probe
                return
            log.debug("%s authenticated (%s)", peer, role)
            await self._serve_requests(sock, state)
            log.debug("%s disconnected", peer)
        except (wire.WireError, _Drop) as exc:
            log.warning("closing connection from %s: %s", peer, exc)
        except PeerClosed as exc:
            log.warning("connection from %s closed in the middle of a frame (%s)", peer, exc)
        except (OSError, trio.ClosedResourceError) as exc:
            if state.fenced:
                log.info("connection from %s closed: its lease token was fenced", peer)
            else:
                log.info("connection from %s failed: %s", peer, exc)
        except Exception:
            log.exception("connection from %s: unexpected error", peer)
        finally:
            self.connections -= 1
            if state.token:
                mine = self._by_token.get(state.token)
                if mine is not None:
                    mine.discard(state)
                    if not mine:
                        del self._by_token[state.token]
            if state.qp is not None:
                log.debug("%s: destroying its RDMA queue pair", peer)
                self._close_qp(state.qp)
            close_socket(sock)

    async def _handshake(self, sock: socket.socket) -> str | None:
        """The client's role once authenticated; None if it left before sending anything."""
        hs = wire.Handshake(self.secret)
        await send_all(sock, [wire.frame(Kind.HELLO, 0, hs.hello())])
        head = bytearray(wire.HEADER_SIZE)
        n = await recv_some_into(sock, memoryview(head))
        if n == 0:
            return None
        await recv_exactly_into(sock, memoryview(head)[n:])
        h = wire.parse_header(head, _AUTH_MAX)
        payload = bytearray(h.length)
        await recv_exactly_into(sock, memoryview(payload))
        if h.kind is not Kind.AUTH:
            raise wire.WireError(f"expected AUTH, got {h.kind.name}")
        role = hs.check_auth(payload)
        if role not in SERVED_ROLES:
            # e.g. `memfs mount --mds` pointed at a memd: say so instead of a reset
            why = f"this is a memory server (memd); it does not serve {role!r} clients"
            await send_all(sock, [wire.frame(Kind.ERROR, h.req_id, wire.encode_error(errno.EACCES, why))])
            raise wire.WireError(why)
        await send_all(sock, [wire.frame(Kind.WELCOME, h.req_id, hs.welcome())])
        return role

    async def _serve_requests(self, sock: socket.socket, state: _ConnState) -> None:
        """Serve requests in order until the client leaves.

        The common case costs no wait and no timer: a request that has arrived
        whole (a READ, a small WRITE with its data) is served from the receive
        buffer and its reply handed to the socket at once.  Only a frame that is
        still arriving, or a reply the socket does not take, waits, under the
        frame deadline.
        """
        rx = RecvBuffer(sock, _RECV_BUFFER)
        limit = self.max_payload
        waits = rx.waits
        while True:
            if not len(rx) and not await rx.wait_some():  # idle between frames: no deadline
                return
            if rx.waits != waits:  # it waited (and so let others run) since the last checkpoint
                waits = rx.waits
                state.work = 0
            h = None
            if len(rx) >= wire.HEADER_SIZE:
                h = wire.parse_header(rx.view(wire.HEADER_SIZE), limit)
            if h is not None and len(rx) >= wire.HEADER_SIZE + h.length:
                state.deadline = math.inf  # all here: only a reply the socket refuses waits
                await self._request(sock, h, rx, state)
            else:
                state.deadline = trio.current_time() + self.frame_timeout
                with trio.move_on_at(state.deadline) as scope:
                    if h is None:
                        await rx.fill(wire.HEADER_SIZE)
                        h = wire.parse_header(rx.view(wire.HEADER_SIZE), limit)
                    await self._request(sock, h, rx, state)
                if scope.cancelled_caught:
                    raise _Drop(f"a frame was not completed within {self.frame_timeout:g}s")
            # A client that pipelines without pause must not starve the others, but a
            # checkpoint per small frame would cost more than serving it.
            state.work += _FRAME_WORK
            if state.work >= _WORK_PER_CHECKPOINT:
                state.work = 0
                await trio.lowlevel.checkpoint()

    async def _request(
        self, sock: socket.socket, h: wire.Header, rx: RecvBuffer, state: _ConnState
    ) -> None:
        """Serve request *h*; counted, timed and its bytes added up with ``--metrics``."""
        obs = self.metrics
        if obs is None:
            return await self._serve_one(sock, h, rx, state)
        started = time.perf_counter()
        state.err = None
        state.moved = 0
        await self._serve_one(sock, h, rx, state)
        op = _OP_NAMES[h.kind]
        obs.observe(op, started, state.err)
        if state.moved:
            obs.moved(op, state.moved)

    async def _serve_one(
        self, sock: socket.socket, h: wire.Header, rx: RecvBuffer, state: _ConnState
    ) -> None:
        """Serve request *h* at the head of *rx* and answer it.

        Waits only for bytes not received yet (with the whole frame buffered,
        none) and for a reply the socket does not take at once.
        """
        kind = h.kind
        fixed = wire.HEADER_SIZE + _fixed_payload(h)
        if len(rx) < fixed:
            await rx.fill(fixed)
        args = rx.view(fixed)[wire.HEADER_SIZE :]
        if kind is Kind.WRITE or kind is Kind.WRITE_QUIET:
            volume, offset = wire.WRITE.unpack(args)
            rx.consume(fixed)
            n = h.length - wire.WRITE.size
            if state.fenced:  # woken before its FENCE, served after it: not a byte more
                raise _Drop("its lease token was fenced")
            bad = self._check(volume, offset, n)
            if bad:
                await rx.skip(n)
                await self._error(sock, h.req_id, errno.EINVAL, bad, state)
                return
            state.work += n
            state.moved = n
            dest = self._views[volume][offset : offset + n]
            got = rx.take_into(dest)
            if got < n:  # the bulk of a large write: straight into the volume
                await recv_exactly_into(sock, dest[got:])
            if kind is Kind.WRITE:
                await self._reply(sock, [wire.pack_header(Kind.OK, h.req_id, 0)], state)
        elif kind is Kind.READ:
            volume, offset, n = wire.READ.unpack(args)
            rx.consume(fixed)
            bad = self._check(volume, offset, n)
            if not bad and n > self.max_payload:
                bad = f"read of {n} bytes exceeds the limit of {self.max_payload}"
            if bad:
                await self._error(sock, h.req_id, errno.EINVAL, bad, state)
                return
            state.work += n
            state.moved = n
            await self._reply(
                sock,
                [wire.pack_header(Kind.OK, h.req_id, n), self._views[volume][offset : offset + n]],
                state,
            )
        elif kind is Kind.ZERO:
            volume, offset, n = wire.ZERO.unpack(args)
            rx.consume(fixed)
            bad = self._check(volume, offset, n)
            if bad:
                await self._error(sock, h.req_id, errno.EINVAL, bad, state)
                return
            if state.fenced:
                raise _Drop("its lease token was fenced")
            await self.memory.zero(volume, offset, n)
            await self._reply(sock, [wire.pack_header(Kind.OK, h.req_id, 0)], state)
        elif kind is Kind.SYNC:  # every frame before it is served: this connection is in order
            rx.consume(fixed)
            await self._reply(sock, [wire.pack_header(Kind.OK, h.req_id, 0)], state)
        elif kind is Kind.INFO:
            rx.consume(fixed)
            await self._reply(sock, [wire.frame(Kind.OK, h.req_id, self._info)], state)
        elif kind is Kind.SESSION:
            (token,) = wire.TOKEN.unpack(args)
            rx.consume(fixed)
            if token in self.fenced:
                await self._error(sock, h.req_id, errno.ESTALE, "this client's lease was taken "
                                  "by the metadata server (evicted): register again", state)
                raise _Drop("it named a fenced lease token")
            if state.token or not token:
                raise wire.WireError("SESSION: a second token, or token 0")
            state.token = token
            self._by_token.setdefault(token, set()).add(state)
            await self._reply(sock, [wire.pack_header(Kind.OK, h.req_id, 0)], state)
        elif kind is Kind.FENCE:
            (token,) = wire.TOKEN.unpack(args)
            rx.consume(fixed)
            self.fence(token)
            await self._reply(sock, [wire.pack_header(Kind.OK, h.req_id, 0)], state)
        else:
            assert kind is Kind.VERBS_CONNECT
            peer = wire.decode_verbs_endpoint(bytes(args))
            rx.consume(fixed)
            err, reply = self._verbs_connect(sock, peer, state)
            if err:
                await self._error(sock, h.req_id, err, reply.decode(), state)
            else:
                await self._reply(sock, [wire.frame(Kind.OK, h.req_id, reply)], state)

    def fence(self, token: int) -> None:
        """Close every connection that named *token* and refuse it from now on.

        No await: when this returns, none of those connections can move another
        byte into volume memory (sockets closed, queue pairs destroyed; a task
        already woken with a frame in its buffer checks ``fenced`` first)."""
        if token in self.fenced:
            return
        self.fenced[token] = None
        while len(self.fenced) > FENCED_KEPT:
            del self.fenced[next(iter(self.fenced))]
        conns = self._by_token.pop(token, set())
        for st in conns:
            st.fenced = True
            if st.qp is not None:
                self._close_qp(st.qp)
                st.qp = None
            close_socket(st.sock)
        log.info("lease token %x fenced: %d connections closed", token, len(conns))

    async def _reply(self, sock: socket.socket, bufs: list[Buf], state: _ConnState) -> None:
        """Send a reply: at once if the socket takes it, else within the frame deadline."""
        rest = send_now(sock, bufs)
        if not rest:
            return
        if state.deadline == math.inf:
            state.deadline = trio.current_time() + self.frame_timeout
        with trio.move_on_at(state.deadline) as scope:
            await send_all(sock, rest)
        if scope.cancelled_caught:
            raise _Drop(f"a reply was not taken within {self.frame_timeout:g}s")

    async def _error(
        self, sock: socket.socket, req_id: int, err: int, message: str, state: _ConnState
    ) -> None:
        state.err = err
        state.moved = 0
        await self._reply(sock, [wire.frame(Kind.ERROR, req_id, wire.encode_error(err, message))],
                          state)

    def _verbs_connect(
        self, sock: socket.socket, peer: wire.VerbsEndpoint, state: _ConnState
    ) -> tuple[int, bytes]:
        """A queue pair for this (authenticated) connection: (0, accept) or (errno, message)."""
        from memfs.transport.verbs import RdmaError, set_keepalive

        if self.rdma is None:
            return errno.ENODEV, f"no RDMA on this memory server: {self.rdma_absent}".encode()
        if state.qp is not None:
            return errno.EBUSY, b"this connection has a queue pair already"
        try:
            qp = self.rdma.create_qp(1, remote_access=True)  # it never sends: one WR is plenty
        except RdmaError as exc:
            log.warning("VERBS_CONNECT: %s", exc)
            return errno.EAGAIN, str(exc).encode()
        try:
            qp.connect(peer)
        except RdmaError as exc:
            log.warning("VERBS_CONNECT: %s", exc)
            self._close_qp(qp)
            return errno.EIO, str(exc).encode()
        state.qp = qp
        self._qps.add(qp)
        set_keepalive(sock)  # a vanished client's queue pair goes with its connection
        log.debug("RDMA queue pair %d connected to %d", qp.endpoint.qpn, peer.qpn)
        return 0, wire.encode_verbs_accept(qp.endpoint, self._verbs_regions)

    def _check(self, volume: int, offset: int, length: int) -> str | None:
        """Why (volume, offset, length) is refused, or None (length and offset are unsigned)."""
        views = self._views
        if volume < len(views) and offset + length <= len(views[volume]):
            return None  # the common case, in two comparisons
        try:
            self.memory.check_range(volume, offset, length)
        except ValueError as exc:
            return str(exc)
        return None


def _fixed_payload(h: wire.Header) -> int:
    """The payload bytes of request *h* that must be here before serving it (a
    WRITE's data may follow later); :class:`~memfs.wire.WireError` if *h* is no
    well-formed request."""
    kind = h.kind
    if kind is Kind.WRITE or kind is Kind.WRITE_QUIET:
        if h.length < wire.WRITE.size:
            raise wire.WireError(f"{kind.name} payload of {h.length} bytes")
        return wire.WRITE.size
    size = _REQUEST_SIZES.get(kind)
    if size is None:
        raise wire.WireError(f"unexpected {kind.name} frame")
    if h.length != size:
        raise wire.WireError(f"{kind.name} payload of {h.length} bytes")
    return size


# -- the daemon -------------------------------------------------------------------------


def run(n_volumes: int, volume_size: int, host: str, port: int, secret: bytes,
        rdma_device: str = "auto", metrics: tuple[str, int] | None = None) -> int:
    """``memfs memd``: serve in the foreground until SIGTERM/SIGINT; the exit status.

    *rdma_device*: ``auto`` (the first device pyverbs finds, if any), ``off``,
    or a device name (a user error if it cannot be used).
    """
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    total = n_volumes * volume_size
    avail = mem_available()
    if avail is not None and total > avail:
        raise UsageError(
            f"{n_volumes} volumes x {format_size(volume_size)} = {total >> 20} MiB exceeds "
            f"the memory available on this node ({avail >> 20} MiB)"
        )
    try:
        server = MemoryServer(n_volumes, volume_size, secret)
    except MemoryError as exc:
        raise UsageError(str(exc)) from None
    trio.run(_serve_until_signalled, server, host, port, rdma_device, metrics)
    return 0


def _setup_rdma(server: MemoryServer, spec: str) -> None:
    """Register the volumes with the RDMA device *spec* names, or say why there is none."""
    from memfs.transport.verbs import RdmaError, server_device

    device, why = server_device(spec)
    if device is not None:
        try:
            server.enable_rdma(device)
        except RdmaError as exc:
            device.close()
            if spec != "auto":
                raise UsageError(f"--rdma-device {spec}: {exc}") from None
            why = f"registering the volumes with {device.name} failed: {exc}"
            log.warning("RDMA off: %s", why)
    if server.rdma is None:
        server.rdma_absent = why
        if spec == "auto":
            log.info("RDMA off: %s", why)


def _start_metrics(server: MemoryServer, where: tuple[str, int], nursery: trio.Nursery) -> None:
    """``--metrics``: requests and bytes per kind, volumes, clients, RDMA."""
    from memfs.metrics import Metrics

    m = Metrics("memd")
    m.serve(*where)
    vols = server.memory.volumes

    async def fill() -> dict[str, float]:
        return {
            "memfs_memd_volumes": float(len(vols)),
            "memfs_memd_volume_bytes": float(sum(v.size for v in vols)),
            "memfs_memd_connections": float(server.connections),
            "memfs_memd_rdma": 1.0 if server.rdma is not None else 0.0,
        }

    server.metrics = m
    nursery.start_soon(m.refresh, fill)


async def _serve_until_signalled(
    server: MemoryServer, host: str, port: int, rdma_device: str = "off",
    metrics: tuple[str, int] | None = None,
) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        try:
            sock = await server.listen(host, port)
        except OSError as exc:
            raise UsageError(
                f"cannot listen on {format_addr(host, port)}: {exc.strerror or exc}"
            ) from None
        try:
            _setup_rdma(server, rdma_device)  # once the port is ours: errors come in order
        except BaseException:
            sock.close()
            raise
        async with trio.open_nursery() as nursery:
            if metrics is not None:
                _start_metrics(server, metrics, nursery)
            bound = await nursery.start(server.serve_socket, sock)
            if not server.secret:
                log.warning(
                    "no --secret-file: memd runs unauthenticated; anyone who can reach %s "
                    "can read and write its memory", format_addr(host, bound),
                )
            vols = server.memory.volumes
            log.info(
                "serving %d volumes x %s on %s, incarnation %x",
                len(vols), format_size(vols[0].size), format_addr(host, bound), server.incarnation,
            )
            print(
                f"memd listening on {format_addr(host, bound)} ({len(vols)} "
                f"volume{'s' if len(vols) > 1 else ''} x {format_size(vols[0].size)})",
                flush=True,
            )
            sd_notify("READY=1")
            async for signum in signals:
                log.info("received %s, stopping", signal.Signals(signum).name)
                break
            sd_notify("STOPPING=1")
            nursery.cancel_scope.cancel()
    await server.aclose()
