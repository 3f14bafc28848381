"""The memory server's data path: every authenticated connection, served on one
thread of memd's own by a plain ``epoll`` loop.

Why not a trio task per connection (as before 2026-11-26): each wait for the
next request cost a trio scheduling pass and an epoll registration, more than
serving a small request; and why not a thread per connection (tried the same
day): a wake-up and a GIL hand-over per request, which lost to trio once many
connections were busy.  One loop with level-triggered epoll serves every
socket that one ``epoll_wait`` found ready, with two system calls per small
request (``recv``, ``sendmsg``) and no scheduler in between (measured:
docs/ARCHITECTURE.md, "Memory servers").

Each connection is a :class:`Link`, a small state machine: it parses frames
out of its :class:`~memfs.transport.sockio.RecvBuffer`; a WRITE whose bulk has
not arrived receives it straight into volume memory as it comes; a refused
WRITE's payload is skipped; a reply the socket does not take waits for
``EPOLLOUT`` (and the connection reads no further request meanwhile: replies
stay in order).  A frame that has started must be complete and answered within
the server's ``frame_timeout`` (a heap of deadlines sets the ``epoll_wait``
timeout); an idle connection may stay idle forever.  A connection that keeps
sending gets a share of work per turn, then the others get theirs.

Only this thread touches the links, the lease tokens they named, the volumes
they claimed and the fenced set once serving started: FENCE, served here like any request, closes the
fenced links before it is answered, so no byte of theirs lands after it (a
call from another thread runs here too, :meth:`DataLoop.call`).  trio keeps
the listening socket and the handshakes; an authenticated socket is handed
over with :meth:`DataLoop.adopt`.
"""

from __future__ import annotations

import collections
import errno
import heapq
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from memfs import wire
from memfs.transport.sockio import Buf, PeerClosed, RecvBuffer, send_now, set_rcvlowat
from memfs.wire import Kind

if TYPE_CHECKING:
    from memfs.transport.memd import MemoryServer, _ConnState

log = logging.getLogger(__name__)

#: a small WRITE (64 KiB of data with its header and struct) arrives in one recv
RECV_BUFFER = (64 << 10) + 64
#: a connection that keeps sending yields to the others after this much work in
#: a turn (a frame counts as FRAME_WORK bytes besides its data)
WORK_PER_TURN = 256 << 10
FRAME_WORK = 16 << 10
#: the fixed payload of each request kind but WRITE (whose data follows its struct)
REQUEST_SIZES = {
    Kind.READ: wire.READ.size,
    Kind.ZERO: wire.ZERO.size,
    Kind.INFO: 0,
    Kind.VERBS_CONNECT: wire.VERBS_ENDPOINT.size,
    Kind.SESSION: wire.TOKEN.size,
    Kind.FENCE: wire.TOKEN.size,
    Kind.SYNC: 0,
}
#: request kind -> operation in --metrics (a quiet write is a write there)
OP_NAMES = {k: k.name.lower() for k in Kind} | {Kind.WRITE_QUIET: "write"}

_IN, _OUT = select.EPOLLIN, select.EPOLLOUT


class Drop(Exception):
    """End this connection, logging the reason as a warning."""


class _Ended(Exception):
    """The client closed the connection between frames."""


def fixed_payload(h: wire.Header) -> int:
    """The payload bytes of request *h* that must be here before serving it (a
    WRITE's data may follow later); :class:`~memfs.wire.WireError` if *h* is no
    well-formed request."""
    kind = h.kind
    if kind is Kind.WRITE or kind is Kind.WRITE_QUIET:
        if h.length < wire.WRITE.size:
            raise wire.WireError(f"{kind.name} payload of {h.length} bytes")
        return wire.WRITE.size
    if kind is Kind.CLAIM:  # variable, small (at most wire.CLAIM_MAX): all of it
        if not wire.claim_size_ok(h.length):
            raise wire.WireError(f"CLAIM payload of {h.length} bytes")
        return h.length
    size = REQUEST_SIZES.get(kind)
    if size is None:
        raise wire.WireError(f"unexpected {kind.name} frame")
    if h.length != size:
        raise wire.WireError(f"{kind.name} payload of {h.length} bytes")
    return size


class Link:
    """One authenticated connection and where it is in its current frame."""

    __slots__ = ("sock", "fd", "state", "peer", "rx", "bulk", "got", "answer", "skip",
                 "after_skip", "rest", "deadline", "events", "lowat", "started", "op", "open",
                 "queued")

    def __init__(self, sock: socket.socket, state: _ConnState, peer: str) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.state = state
        self.peer = peer
        self.rx = RecvBuffer(sock, RECV_BUFFER)
        #: the part of volume memory a WRITE's bulk still goes to, and how much came
        self.bulk: memoryview | None = None
        self.got = 0
        #: that WRITE's request id to answer when it is in (-1: a quiet write)
        self.answer = -1
        #: payload bytes of a refused WRITE still to drop, and its ERROR frame
        self.skip = 0
        self.after_skip = b""
        #: the part of a reply the socket did not take yet
        self.rest: list[memoryview] = []
        #: the current frame's deadline (``time.monotonic()``; inf: none running)
        self.deadline = math.inf
        self.events = _IN
        self.lowat = 1
        #: ``--metrics``: when the request being finished began, and its operation
        self.started = 0.0
        self.op = ""
        self.open = True
        #: in the loop's list of links to serve again next turn
        self.queued = False

    def mid_frame(self) -> bool:
        return bool(self.rest or self.bulk is not None or self.skip or len(self.rx))


class _Call:
    """A function for the loop's thread, and how it went."""

    __slots__ = ("fn", "done", "error")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # raised again in the caller's thread
            self.error = exc
        finally:
            self.done.set()


class DataLoop:
    """The data connections of *server*: :meth:`run` on a thread of its own."""

    def __init__(self, server: MemoryServer) -> None:
        self.server = server
        self._ep = select.epoll()
        self._links: dict[int, Link] = {}
        #: handed over by other threads, taken by the loop
        self._incoming: collections.deque[Link] = collections.deque()
        #: calls for the loop's thread: (function, done, its exception once done)
        self._calls: collections.deque[_Call] = collections.deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ep.register(self._wake_r, _IN)
        #: (deadline, tie-breaker, link); stale entries are skipped when they come up
        self._deadlines: list[tuple[float, int, Link]] = []
        self._seq = 0
        #: links that stopped with work left (their share used up): served next turn
        self._again: list[Link] = []
        #: guards _thread, _incoming, _calls, _stopping, _closed and the wake-up pipe;
        #: re-entrant: a call that runs in place (no loop running) holds it throughout
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        #: set once run() has ended (or never will)
        self._ended = threading.Event()
        self.used = False

    def __len__(self) -> int:
        return len(self._links) + len(self._incoming)

    # -- from other threads -------------------------------------------------------------

    def adopt(self, sock: socket.socket, state: _ConnState, peer: str) -> bool:
        """Serve authenticated *sock* (non-blocking) from now on; the loop owns it.
        False if serving has stopped (the caller keeps it)."""
        with self._lock:
            if self._stopping:
                return False
            self._incoming.append(Link(sock, state, peer))
            self._wake()
        return True

    def call(self, fn: Callable[[], None]) -> None:
        """Run *fn* on the loop's thread and wait for it; in place if this is that
        thread or no loop runs.  Its exception is raised here."""
        with self._lock:
            if self._thread is None or threading.current_thread() is self._thread:
                fn()  # (holding the lock: a loop cannot start meanwhile)
                return
            call = _Call(fn)
            self._calls.append(call)
            self._wake()
        call.done.wait()
        if call.error is not None:
            raise call.error

    def stop(self) -> None:
        """End :meth:`run` (it closes every connection); from any thread."""
        with self._lock:
            self._stopping = True
            self._wake()

    def dispose(self) -> None:
        """Stop, wait for :meth:`run` to end if it runs, give back the descriptors."""
        with self._lock:
            self._stopping = True
            running = self._thread is not None
            if not running:
                self._close_fds()
            self._wake()
        if running:
            self._ended.wait(30)

    def _close_fds(self) -> None:
        """(under _lock) Close the loop's descriptors and any connection not served yet."""
        if self._closed:
            return
        self._closed = True
        self._ended.set()
        while self._incoming:
            link = self._incoming.popleft()
            self.server.ended(link.state)
            link.sock.close()
        self._ep.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        """(under _lock: never a write to a descriptor closed, and maybe reused, since)"""
        if self._closed:
            return
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # full: it will wake anyway

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`; then close every connection.  Once per loop."""
        with self._lock:
            if self.used:
                raise RuntimeError("a memory server's data loop runs once")
            self.used = True
            if self._closed:  # disposed of before it started
                return
            self._thread = threading.current_thread()
        try:
            while not self._stopping:
                events = self._ep.poll(self._timeout())
                again, self._again = self._again, []
                for fd, _ in events:
                    if fd == self._wake_r:
                        self._woken()
                        continue
                    link = self._links.get(fd)
                    if link is not None and not link.queued:  # (queued: its turn is below)
                        self._turn(link)
                for link in again:
                    link.queued = False
                    if link.open:
                        self._turn(link)
                self._expire()
        finally:
            for link in list(self._links.values()):
                self.close(link, "the server stops", logging.DEBUG)
            self._deadlines.clear()
            self._again.clear()
            with self._lock:  # from now on adopt refuses, a call runs in place
                self._stopping = True
                self._thread = None
                calls, self._calls = self._calls, collections.deque()
                for call in calls:
                    call.run()
                self._close_fds()

    def _timeout(self) -> float:
        if self._again:
            return 0.0
        if not self._deadlines:
            return -1.0
        return max(0.0, self._deadlines[0][0] - time.monotonic())

    def _woken(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            incoming, self._incoming = self._incoming, collections.deque()
            calls, self._calls = self._calls, collections.deque()
        for link in incoming:
            try:
                self._ep.register(link.fd, _IN)
            except OSError as exc:
                log.warning("connection from %s: cannot watch it: %s", link.peer, exc)
                self.server.ended(link.state)
                link.sock.close()
                continue
            self._links[link.fd] = link
            link.state.link = link
        for call in calls:
            call.run()

    def _expire(self) -> None:
        now = time.monotonic()
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, link = heapq.heappop(heap)
            if link.open and link.deadline == deadline:
                what = "a reply was not taken" if link.rest else "a frame was not completed"
                self.close(link, f"{what} within {self.server.frame_timeout:g}s", logging.WARNING,
                           drop=True)

    def _turn(self, link: Link) -> None:
        """Serve what *link* has, up to its share; every failure ends this link only."""
        try:
            self._pump(link)
        except Drop as exc:
            self.close(link, str(exc), logging.WARNING, drop=True)
        except wire.WireError as exc:
            self.close(link, str(exc), logging.WARNING, drop=True)
        except _Ended:
            self.close(link, "", logging.DEBUG)
        except PeerClosed as exc:
            self.close(link, f"closed in the middle of a frame ({exc})", logging.WARNING)
        except OSError as exc:
            self.close(link, f"failed: {exc}", logging.INFO)
        except Exception:
            log.exception("connection from %s: unexpected error", link.peer)
            self.close(link, "", logging.DEBUG)

    def close(self, link: Link, why: str, level: int, *, drop: bool = False) -> None:
        """End *link*: its socket, its lease token's entry and its queue pair go."""
        if not link.open:
            return
        link.open = False
        if link.state.fenced:
            log.info("connection from %s closed: its lease token was fenced", link.peer)
        elif drop:
            log.log(level, "closing connection from %s: %s", link.peer, why)
        elif why:
            log.log(level, "connection from %s %s", link.peer, why)
        else:
            log.debug("%s disconnected", link.peer)
        del self._links[link.fd]
        self._ep.unregister(link.fd)
        link.sock.close()
        link.bulk = None  # (its deadline entry may stay a while: no view of volume memory)
        link.rest = []
        self.server.ended(link.state)

    def _wait(self, link: Link, events: int) -> None:
        """*link* waits for *events*; mid-frame, under the frame's deadline."""
        if link.deadline == math.inf and link.mid_frame():
            link.deadline = time.monotonic() + self.server.frame_timeout
            self._seq += 1
            heap = self._deadlines
            heapq.heappush(heap, (link.deadline, self._seq, link))
            if len(heap) > 2 * len(self._links) + 64:  # mostly frames long done: rebuild
                heap[:] = [e for e in heap if e[2].open and e[2].deadline == e[0]]
                heapq.heapify(heap)
        self._want(link, events)

    def _want(self, link: Link, events: int) -> None:
        if link.events != events:
            self._ep.modify(link.fd, events)
            link.events = events

    # -- one connection's requests -----------------------------------------------------

    def _pump(self, link: Link) -> None:
        rx = link.rx
        rx.drained = False  # woken: the socket may have something
        server = self.server
        limit = server.max_payload
        work = 0
        while work < WORK_PER_TURN:
            if link.rest:  # a reply still going out: nothing else until it is
                link.rest = send_now(link.sock, link.rest)
                if link.rest:
                    return self._wait(link, _OUT)
                self._finish(link)
                self._want(link, _IN)
                continue
            if link.bulk is not None:
                k = self._receive_bulk(link)
                if k is None:
                    return self._wait(link, _IN)
                work += k
                continue
            if link.skip:
                if not len(rx) and not self._receive(link, 1):
                    return self._wait(link, _IN)
                k = min(link.skip, len(rx))
                rx.consume(k)
                link.skip -= k
                work += k
                if not link.skip:
                    self._reply(link, [link.after_skip])
                continue
            if len(rx) < wire.HEADER_SIZE:
                if not self._receive(link, wire.HEADER_SIZE):
                    return self._wait(link, _IN)
                continue
            h = wire.parse_header(rx.view(wire.HEADER_SIZE), limit)
            fixed = wire.HEADER_SIZE + fixed_payload(h)
            if len(rx) < fixed:
                if not self._receive(link, fixed):
                    return self._wait(link, _IN)
                continue
            work += self._serve(link, h, fixed) + FRAME_WORK
        link.queued = True
        self._again.append(link)

    def _receive(self, link: Link, n: int) -> bool:
        """One receive toward *n* buffered bytes: False if the socket had nothing."""
        k = link.rx.receive_now(n)
        if k is None:
            return False
        if k == 0:
            if len(link.rx) or link.skip:
                raise PeerClosed(f"connection closed after {len(link.rx)} of {n} bytes")
            raise _Ended
        return True

    def _receive_bulk(self, link: Link) -> int | None:
        """Receive what came of a WRITE's bulk straight into volume memory: how
        much, None if nothing had come.

        Then, past 64 KiB still to come, the socket wakes us once 256 KiB (or
        the rest) is in (``SO_RCVLOWAT``, set to what is left each time), not for
        every segment."""
        dest = link.bulk
        assert dest is not None
        n = len(dest)
        k = link.rx.receive_into_now(dest[link.got :])
        if k is None:
            link.lowat = set_rcvlowat(link.sock, link.lowat, n, link.got)
            return None
        if k == 0:
            raise PeerClosed(f"connection closed after {link.got} of {n} bytes")
        link.got += k
        if link.got == n:
            link.bulk = None
            link.lowat = set_rcvlowat(link.sock, link.lowat, 0, 0)
            if link.answer >= 0:
                self._reply(link, [wire.pack_header(Kind.OK, link.answer, 0)])
            else:
                self._finish(link)
        return k

    def _reply(self, link: Link, bufs: list[Buf]) -> None:
        """Answer the request being served: at once if the socket takes it all."""
        link.rest = send_now(link.sock, bufs)
        if not link.rest:
            self._finish(link)

    def _error(self, link: Link, req_id: int, err: int, message: str) -> None:
        link.state.err = err
        link.state.moved = 0
        self._reply(link, [wire.frame(Kind.ERROR, req_id, wire.encode_error(err, message))])

    def _finish(self, link: Link) -> None:
        """The request being served is answered (or needs no answer): counted, timed."""
        link.deadline = math.inf
        obs = self.server.metrics
        if obs is not None and link.op:
            state = link.state
            obs.observe(link.op, link.started, state.err)
            if state.moved:
                obs.moved(link.op, state.moved)
        link.op = ""

    def _serve(self, link: Link, h: wire.Header, fixed: int) -> int:
        """Serve request *h*, whose fixed part is buffered; the data bytes it moved."""
        server = self.server
        state = link.state
        rx = link.rx
        if server.metrics is not None:
            link.started = time.perf_counter()
            link.op = OP_NAMES[h.kind]
            state.err = None
            state.moved = 0
        kind = h.kind
        args = rx.view(fixed)[wire.HEADER_SIZE :]
        if kind is Kind.WRITE or kind is Kind.WRITE_QUIET:
            volume, offset = wire.WRITE.unpack(args)
            rx.consume(fixed)
            n = h.length - wire.WRITE.size
            bad = server._check(volume, offset, n)
            if bad:
                state.err = errno.EINVAL
                link.skip = n
                link.after_skip = wire.frame(Kind.ERROR, h.req_id,
                                             wire.encode_error(errno.EINVAL, bad))
                if not n:
                    self._reply(link, [link.after_skip])
                return 0
            state.moved = n
            dest = server._views[volume][offset : offset + n]
            got = rx.take_into(dest)
            link.answer = h.req_id if kind is Kind.WRITE else -1
            if got < n:  # the bulk of a large write: straight into the volume as it comes
                link.bulk = dest
                link.got = got
                return got
            if kind is Kind.WRITE:
                self._reply(link, [wire.pack_header(Kind.OK, h.req_id, 0)])
            else:
                self._finish(link)
            return n
        if kind is Kind.READ:
            volume, offset, n = wire.READ.unpack(args)
            rx.consume(fixed)
            bad = server._check(volume, offset, n)
            if not bad and n > server.max_payload:
                bad = f"read of {n} bytes exceeds the limit of {server.max_payload}"
            if bad:
                self._error(link, h.req_id, errno.EINVAL, bad)
                return 0
            state.moved = n
            self._reply(link, [wire.pack_header(Kind.OK, h.req_id, n),
                               server._views[volume][offset : offset + n]])
            return n
        if kind is Kind.ZERO:
            volume, offset, n = wire.ZERO.unpack(args)
            rx.consume(fixed)
            bad = server._check(volume, offset, n)
            if bad:
                self._error(link, h.req_id, errno.EINVAL, bad)
                return 0
            server.memory.zero_now(volume, offset, n)
            self._reply(link, [wire.pack_header(Kind.OK, h.req_id, 0)])
            return n
        if kind is Kind.SYNC:  # every frame before it was served: a connection is in order
            rx.consume(fixed)
            self._reply(link, [wire.pack_header(Kind.OK, h.req_id, 0)])
        elif kind is Kind.INFO:
            rx.consume(fixed)
            self._reply(link, [wire.frame(Kind.OK, h.req_id, server._info)])
        elif kind is Kind.SESSION:
            (token,) = wire.TOKEN.unpack(args)
            rx.consume(fixed)
            if token in server.fenced:
                self._error(link, h.req_id, errno.ESTALE, "this client's lease was taken "
                            "by the metadata server (evicted): register again")
                raise Drop("it named a fenced lease token")
            if state.token or not token:
                raise wire.WireError("SESSION: a second token, or token 0")
            state.token = token
            server._by_token.setdefault(token, set()).add(state)
            self._reply(link, [wire.pack_header(Kind.OK, h.req_id, 0)])
        elif kind is Kind.FENCE:
            (token,) = wire.TOKEN.unpack(args)
            rx.consume(fixed)
            server.fence(token)
            self._reply(link, [wire.pack_header(Kind.OK, h.req_id, 0)])
        elif kind is Kind.CLAIM:
            payload = bytes(args)
            rx.consume(fixed)
            err, why = server._claim(state, payload)
            if err:
                self._error(link, h.req_id, err, why)
            else:
                self._reply(link, [wire.pack_header(Kind.OK, h.req_id, 0)])
        else:
            assert kind is Kind.VERBS_CONNECT
            peer = wire.decode_verbs_endpoint(bytes(args))
            rx.consume(fixed)
            err, reply = server._verbs_connect(link.sock, peer, state)
            if err:
                self._error(link, h.req_id, err, reply.decode())
            else:
                self._reply(link, [wire.frame(Kind.OK, h.req_id, reply)])
        return 0
