"""The memory server (``memfs memd``): volumes of this node's memory, served over TCP.

A :class:`MemoryServer` allocates and touches its volumes up front (a
:class:`~memfs.transport.local.LocalTransport` holds them), picks a random
*incarnation* and serves the ``memd`` requests of :mod:`memfs.wire` to any
number of clients:

* every connection starts with the HMAC handshake (HELLO, AUTH, WELCOME); a
  client that fails it is dropped before a single request is read;
* then the connection is handed to the data loop (:mod:`memfs.transport.memd_loop`):
  one thread of memd's own serves every authenticated connection with a plain
  epoll loop, no trio scheduling per request;
* requests (INFO, READ, WRITE, WRITE_QUIET, SYNC, ZERO, VERBS_CONNECT, SESSION,
  FENCE, CLAIM) are served in order, one at a time per connection; a client may
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
  from then on.  The loop's one thread serves the FENCE too, between two requests
  of the others: a transfer the client started under the lost lease cannot land
  after the FENCE is answered (see "Fencing" in docs/ARCHITECTURE.md);
* a volume belongs to one memfs filesystem at a time: every cluster client
  (an mds, its mounts, memfs.array) names its filesystem's fsid and the
  volumes it uses (CLAIM) on each connection.  A claim of a volume that
  connections of another fsid hold is refused (EBUSY, saying so), so a second
  mds pointed at a live memd by mistake, or the mounts of an mds restarted
  without its journal, cannot overwrite the other filesystem's bytes.  Claims
  go with the connections that made them (:class:`Claims`); nothing is kept
  across a restart (the memory is blank then anyway).  A connection that
  claims nothing is served as before (embedded pools, tools);
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
import functools
import logging
import secrets
import signal
import socket
from typing import TYPE_CHECKING, Any

import trio
import trio.lowlevel

from memfs import wire
from memfs.config import format_size
from memfs.errors import UsageError, reporting_sole_cause
from memfs.host import mem_available, sd_notify
from memfs.net import accept_connections, set_keepalive
from memfs.transport.local import LocalTransport
from memfs.transport.memd_loop import DataLoop, Drop, Link
from memfs.transport.sockio import (
    PeerClosed,
    close_socket,
    recv_exactly_into,
    recv_some_into,
    send_all,
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
#: what INFO says this server does beyond the basic requests (see memfs.wire)
FEATURES = ["quiet-writes", "claims"]
#: fenced tokens remembered (the oldest forgotten first; a token is 63 random bits,
#: and a client that meets a forgotten one has long since re-registered)
FENCED_KEPT = 1 << 16


class _ConnState:
    """What one connection owns beyond its socket."""

    __slots__ = ("qp", "err", "moved", "token", "fenced", "link", "fsid", "claimed")

    def __init__(self) -> None:
        #: where the data loop serves it (once authenticated)
        self.link: Link | None = None
        self.qp: QueuePair | None = None
        #: the lease token the client named (SESSION), 0: none
        self.token = 0
        #: set by FENCE: nothing more of this connection reaches volume memory
        self.fenced = False
        #: the errno the last request was answered with (for --metrics), else None
        self.err: int | None = None
        #: bytes the last READ or WRITE moved (for --metrics)
        self.moved = 0
        #: the filesystem this connection claimed volumes for (CLAIM), b"": none yet
        self.fsid = b""
        #: the volumes it holds for that filesystem
        self.claimed: set[int] = set()


class Claims:
    """Which filesystem each volume belongs to now: the fsid its live claiming
    connections named.  The data loop's thread only (CLAIM and ``ended``)."""

    def __init__(self) -> None:
        #: volume -> (owner fsid, the connections holding it for that fsid)
        self._held: dict[int, tuple[bytes, set[_ConnState]]] = {}

    def owner(self, volume: int) -> bytes | None:
        held = self._held.get(volume)
        return held[0] if held is not None else None

    def claim(self, state: _ConnState, fsid: bytes, volumes: list[int]) -> str | None:
        """Make *state* a holder of *volumes* for *fsid*: None, or why not (then
        nothing was claimed).  All or none: a claim either holds every volume it
        names or none of them."""
        if state.fsid and state.fsid != fsid:
            return "this connection claimed volumes for another filesystem already"
        for v in volumes:
            held = self._held.get(v)
            if held is not None and held[0] != fsid:
                n = len(held[1])
                peers = sorted({st.link.peer for st in held[1] if st.link is not None})
                shown = ", ".join(peers[:3]) + (", ..." if len(peers) > 3 else "")
                return (f"volume {v} belongs to another memfs filesystem, in use by {n} "
                        f"connection{'s' if n != 1 else ''}{f' from {shown}' if shown else ''} "
                        "(e.g. a second mds pointed at this memory server, or the mounts of an "
                        "mds restarted without its journal)")
        state.fsid = fsid
        for v in volumes:
            self._held.setdefault(v, (fsid, set()))[1].add(state)
            state.claimed.add(v)
        return None

    def release(self, state: _ConnState) -> None:
        """*state*'s connection ended: its claims go; a volume no one holds is free."""
        for v in state.claimed:
            held = self._held.get(v)
            if held is not None:
                held[1].discard(state)
                if not held[1]:
                    del self._held[v]
        state.claimed.clear()


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
        #: connections in their handshake (trio's); the authenticated ones are the loop's
        self._handshaking = 0
        #: serves every authenticated connection, on a thread of its own (memd_loop)
        self._loop = DataLoop(self)
        #: connections by the lease token they named (the data loop's thread only)
        self._by_token: dict[int, set[_ConnState]] = {}
        #: tokens fenced, oldest first (a dict as an ordered set)
        self.fenced: dict[int, None] = {}
        #: which filesystem holds each volume (the data loop's thread only)
        self.claims = Claims()
        #: request counters (``memfs memd --metrics``); None: not kept
        self.metrics: Metrics | None = None

    @property
    def connections(self) -> int:
        """Clients connected now."""
        return self._handshaking + len(self._loop)

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
        self._loop.dispose()
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
            if self._loop.used:  # served before: a new loop (one that runs now: an error)
                self._loop = DataLoop(self)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(
                    trio.to_thread.run_sync, self._loop.run, limiter=trio.CapacityLimiter(1)))
                task_status.started(sock.getsockname()[1])
                try:
                    await self._accept(sock, nursery)
                finally:  # the loop's thread closes every connection and returns
                    self._loop.stop()
        finally:
            close_socket(sock)

    async def _accept(self, sock: socket.socket, nursery: trio.Nursery) -> None:
        def serve(conn: socket.socket, addr: tuple[Any, ...]) -> None:
            nursery.start_soon(self._connection, conn, format_addr(*addr[:2]))

        await accept_connections(sock, serve)

    # -- one connection ------------------------------------------------------------

    async def _connection(self, sock: socket.socket, peer: str) -> None:
        """Authenticate one client, then hand it to the data loop; whatever it
        sends, only this connection ends."""
        self._handshaking += 1
        adopted = False
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            role: str | None = None
            with trio.move_on_after(self.handshake_timeout) as scope:
                role = await self._handshake(sock)
            if scope.cancelled_caught:
                raise Drop(f"no authentication within {self.handshake_timeout:g}s")
            if role is None:
                log.info("%s connected and left without a word", peer)  # a port probe
                return
            log.debug("%s authenticated (%s)", peer, role)
            # A vanished client's connection must end: its RDMA queue pair and its
            # volume claims go with it (CLAIM; an idle connection has no deadline).
            set_keepalive(sock)
            adopted = self._loop.adopt(sock, _ConnState(), peer)
        except (wire.WireError, Drop) as exc:
            log.warning("closing connection from %s: %s", peer, exc)
        except PeerClosed as exc:
            log.warning("connection from %s closed in the middle of a frame (%s)", peer, exc)
        except (OSError, trio.ClosedResourceError) as exc:
            log.info("connection from %s failed: %s", peer, exc)
        except Exception:
            log.exception("connection from %s: unexpected error", peer)
        finally:
            self._handshaking -= 1
            if not adopted:
                close_socket(sock)

    def ended(self, state: _ConnState) -> None:
        """A connection the data loop served has ended (on the loop's thread): its
        lease token's entry, its claims and its queue pair go."""
        if state.claimed:
            self.claims.release(state)
        if state.token:
            mine = self._by_token.get(state.token)
            if mine is not None:
                mine.discard(state)
                if not mine:
                    del self._by_token[state.token]
        if state.qp is not None:
            log.debug("destroying the RDMA queue pair of a connection that ended")
            self._close_qp(state.qp)
            state.qp = None

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

    def fence(self, token: int) -> None:
        """Close every connection that named *token* and refuse it from now on.

        From any thread (it runs on the data loop's).  When this returns, none
        of those connections can move another byte into volume memory: their
        sockets are closed by the one thread that serves them, between two of
        its requests, and their queue pairs destroyed."""
        self._loop.call(lambda: self._fence_now(token))

    def _fence_now(self, token: int) -> None:
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
            if st.link is not None:
                self._loop.close(st.link, "", logging.INFO)
        log.info("lease token %x fenced: %d connections closed", token, len(conns))

    def _verbs_connect(
        self, sock: socket.socket, peer: wire.VerbsEndpoint, state: _ConnState
    ) -> tuple[int, bytes]:
        """A queue pair for this (authenticated) connection: (0, accept) or (errno, message)."""
        from memfs.transport.verbs import RdmaError

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
        log.debug("RDMA queue pair %d connected to %d", qp.endpoint.qpn, peer.qpn)
        return 0, wire.encode_verbs_accept(qp.endpoint, self._verbs_regions)

    def _claim(self, state: _ConnState, payload: bytes) -> tuple[int, str]:
        """Serve CLAIM: (0, "") or (errno, why)."""
        fsid, volumes = wire.decode_claim(payload)
        bad = [v for v in volumes if v >= len(self._views)]
        if bad:
            return errno.EINVAL, (f"CLAIM of volume {bad[0]}: this memory server has "
                                  f"{len(self._views)} volumes")
        why = self.claims.claim(state, fsid, volumes)
        if why is not None:
            log.warning("refused a claim of volumes %s for filesystem %s: %s",
                        ",".join(map(str, volumes)), fsid.hex(), why)
            return errno.EBUSY, why
        log.debug("volumes %s claimed for filesystem %s", ",".join(map(str, volumes)), fsid.hex())
        return 0, ""

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
    # A user error raised inside the nursery (a busy --metrics port): one line.
    with reporting_sole_cause((trio.Cancelled,)):
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
