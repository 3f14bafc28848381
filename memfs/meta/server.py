"""The metadata server (``memfs mds``): one :class:`MetaStore` served to many mounts.

Protocol (frames from :mod:`memfs.wire`):

* The server sends HELLO; the client must answer AUTH (role ``"meta"``) within
  ``handshake_timeout``; the server checks the HMAC and sends WELCOME.  On any
  failure the server logs it, sends ERROR(EACCES) and closes: nothing is served
  before authentication, and payloads above 4 KiB are refused until then.
* Then CALL frames whose value is ``[method, *args]`` (:mod:`memfs.meta.codec`
  holds the allow-list and the argument types).  Replies carry the request id:
  OK(encoded result) or ERROR(errno, message) for :class:`FsError`; a method
  off the allow-list gets ERROR(ENOSYS).  A frame or value that does not parse
  closes that connection only (logged as a warning).  Calls of one connection
  are executed in the order they arrive (a client may pipeline them); each is
  atomic, because store methods never await.
* Control calls: ``["describe"]`` (pool volume URLs in order, volume size, chunk
  and stripe size: what a client needs to build its data path),
  ``["session", id, [[ino, count], ...]]`` and ``["ping"]``.

Open counts belong to client *sessions*, not connections: a client names its
session (a random id) on every connection and states the handles it holds; the
server sets that session's counts to exactly that (so saying it twice is
harmless).  This is how handles survive a dropped connection and a server
restart.  A session whose client is gone for ``session_grace`` seconds is
released, and after a restart the unlinked-but-open inodes found in the journal
are held for the same time so their clients can reconnect and claim them.

With a :class:`~memfs.meta.journal.Journal`, every change is recorded (with
the one timestamp the store used for it), and no reply leaves before the
records it could depend on are durable.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.lowlevel

from memfs import net, wire
from memfs.config import VolumeAddr
from memfs.errors import FsError, UsageError
from memfs.meta import Meta, codec
from memfs.meta.conn import MAX_REPLY, ROLE, FrameSocket
from memfs.meta.journal import Journal
from memfs.meta.store import MetaStore
from memfs.wire import Kind, WireError

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
#: clients ping every few seconds when idle; a silent connection is a dead client
IDLE_TIMEOUT = 120.0
SEND_TIMEOUT = 30.0
SESSION_GRACE = 60.0
HANDSHAKE_MAX_PAYLOAD = 4096
#: largest map_read/map_write range per call (FUSE sends at most a few MiB)
MAX_RANGE = 16 << 30
#: most handles one client may claim on one inode when it re-registers
MAX_HANDLES = 1 << 20
REPLY_QUEUE = 64
#: longest a map_read/map_write waits on the backing directory (a fetch, the dirty cap)
#: before the client is told to ask again
CALL_WAIT = 3.0


@dataclass(eq=False)
class _Session:
    sid: bytes
    opens: dict[int, int] = field(default_factory=dict)
    conn: _Conn | None = None
    generation: int = 0


@dataclass(eq=False)
class _Conn:
    peer: str
    session: _Session
    #: replies waiting for the journal, as (frame, seq that must be durable first)
    outbox: collections.deque[tuple[bytes, int]] = field(default_factory=collections.deque)
    wake: trio.Event = field(default_factory=trio.Event)
    closing: bool = False


class _CloseConnection(Exception):
    """This connection must end (already logged)."""


class MetaServer:
    """Serves *store* to authenticated clients; see the module docstring."""

    def __init__(
        self, store: MetaStore, secret: bytes, pool: list[VolumeAddr] | None = None,
        journal: Journal | None = None, *,
        session_grace: float = SESSION_GRACE, idle_timeout: float = IDLE_TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        #: what calls are served by: the store, or (``--backing``) memfs.flush.BackedMeta
        #: wrapped around it, which may wait (fetches, the dirty cap)
        self.meta: Meta = store
        if pool is not None and len(pool) != store.n_volumes:
            raise UsageError(f"pool lists {len(pool)} volumes, the store has {store.n_volumes}")
        self.store = store
        self.secret = secret
        self.pool = pool
        self.journal = journal
        self.session_grace = session_grace
        self.idle_timeout = idle_timeout
        self.handshake_timeout = handshake_timeout
        self.port = 0
        #: this filesystem's id (``describe``): kept by the journal across restarts; without
        #: one, a restarted server is a new filesystem and clients must not carry on
        self.fsid = journal.fsid if journal is not None and journal.fsid else os.urandom(16)
        #: memory server "host:port" -> the incarnation holding this pool's data (set by
        #: memfs.mds once known); clients treat any other incarnation as lost memory
        self.incarnations: dict[str, int] = {}
        # One timestamp per call, recorded in the journal, so replay stamps the same.
        self._real_now = store.now
        self._t = self._real_now()
        store.now = self._clock
        self._destroyed: list[int] = []
        store.on_destroy = self._destroyed.append
        if journal is not None:
            store.on_clean = self._cleaned
        self._sessions: dict[bytes, _Session] = {}
        self._nursery: trio.Nursery | None = None

    def _cleaned(self, chunks: list[tuple[int, int]]) -> None:
        assert self.journal is not None
        self.journal.append_clean(chunks)

    def _clock(self) -> int:
        return self._t

    # -- lifecycle -----------------------------------------------------------------------

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on *host*:*port* (0: any free port) and serve until cancelled.

        Reports the bound port through *task_status* once connections are accepted.
        """
        listeners = net.listen(host, port)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.journal is not None:
                    await nursery.start(self.journal.run)
                await self._hold_orphans()
                self.port = listeners[0].getsockname()[1]
                for sock in listeners:
                    nursery.start_soon(self._accept, sock)
                log.info("metadata server listening on %s:%d", host, self.port)
                task_status.started(self.port)
        finally:
            for sock in listeners:
                net.close_socket(sock)

    async def _accept(self, listener: socket.socket) -> None:
        assert self._nursery is not None
        while True:
            try:
                sock, addr = listener.accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(listener)
                continue
            except OSError as exc:  # EMFILE and friends: let the pressure pass
                log.error("accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._nursery.start_soon(self._handle, sock, f"{addr[0]}:{addr[1]}")
            await trio.lowlevel.checkpoint()

    async def _hold_orphans(self) -> None:
        """After a restart: keep unlinked inodes that clients may still hold open."""
        orphans = [i.ino for i in self.store.inodes.values() if i.nlink <= 0]
        if not orphans:
            return
        for ino in orphans:
            await self.store.open(ino)
        log.info(
            "holding %d unlinked inodes for %.0f s for their clients to reclaim",
            len(orphans), self.session_grace,
        )
        assert self._nursery is not None
        self._nursery.start_soon(self._drop_orphans, orphans)

    async def _drop_orphans(self, orphans: list[int]) -> None:
        await trio.sleep(self.session_grace)
        for ino in orphans:
            await self._release_ino(ino)

    # -- one connection --------------------------------------------------------------------

    async def _handle(self, sock: socket.socket, peer: str) -> None:
        conn = _Conn(peer, self._new_session())
        conn.session.conn = conn
        fs = FrameSocket(sock, HANDSHAKE_MAX_PAYLOAD)
        try:
            await self._handshake(fs, peer)
            fs.max_payload = wire.MAX_PAYLOAD
            log.debug("%s: client authenticated", peer)
            await self._serve_conn(conn, fs)
        except _CloseConnection:
            pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("%s: connection lost: %s", peer, exc)
        except Exception:
            log.exception("%s: connection failed", peer)
        finally:
            fs.close()
            self._detach(conn)

    async def _handshake(self, fs: FrameSocket, peer: str) -> None:
        hs = wire.Handshake(self.secret)
        try:
            with trio.fail_after(self.handshake_timeout):
                await fs.send(wire.frame(Kind.HELLO, 0, hs.hello()))
                got = await fs.receive()
                if got is None:
                    raise WireError("connection closed before AUTH")
                h, payload = got
                if h.kind is not Kind.AUTH:
                    raise WireError(f"expected AUTH, got {h.kind.name}")
                role = hs.check_auth(payload)
                if role != ROLE:
                    raise WireError(f"role {role!r} is not served here (expected {ROLE!r})")
                await fs.send(wire.frame(Kind.WELCOME, h.req_id, hs.welcome()))
        except trio.TooSlowError:
            log.warning("%s: refused: no authentication within %.0f s", peer, self.handshake_timeout)
            raise _CloseConnection from None
        except WireError as exc:
            log.warning("%s: refused: %s", peer, exc)
            with trio.move_on_after(1):
                try:
                    await fs.send(wire.frame(Kind.ERROR, 0, wire.encode_error(errno.EACCES, str(exc))))
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
            raise _CloseConnection from None

    async def _serve_conn(self, conn: _Conn, fs: FrameSocket) -> None:
        """Execute calls in arrival order; reply at once unless a reply must wait.

        Replies wait (in ``conn.outbox``, sent by :meth:`_send_replies`) while the
        journal records they may reflect are not durable yet, or while the socket
        does not take them.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_replies, conn, fs, nursery.cancel_scope)
            journal = self.journal
            n = 0
            try:
                # One scope whose deadline moves: cheaper than a fail_after per frame.
                with trio.CancelScope() as idle:
                    while True:
                        n += 1
                        if n % 32 == 0:
                            await trio.lowlevel.checkpoint()  # a pipelining client must not starve others
                        idle.deadline = trio.current_time() + self.idle_timeout
                        got = await fs.receive()
                        if got is None:
                            log.debug("%s: client closed the connection", conn.peer)
                            break
                        h, payload = got
                        if h.kind is not Kind.CALL:
                            raise WireError(f"unexpected {h.kind.name} frame")
                        kind, body = await self._execute(conn, payload)
                        frame = wire.frame(kind, h.req_id, body)
                        needed = journal.seq if journal is not None else 0
                        if conn.outbox or (journal is not None and needed > journal.durable_seq):
                            conn.outbox.append((frame, needed))
                            conn.wake.set()
                        else:
                            fs.send_now(frame)
                            if fs.pending():
                                conn.wake.set()
                if idle.cancelled_caught:
                    log.info("%s: silent for %.0f s, closing", conn.peer, self.idle_timeout)
                    raise _CloseConnection
                # The client is done sending: let the last replies go out.
                conn.closing = True
                conn.wake.set()
            except WireError as exc:
                log.warning("%s: protocol error, closing the connection: %s", conn.peer, exc)
                nursery.cancel_scope.cancel()
            except _CloseConnection:
                nursery.cancel_scope.cancel()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                # The client went away (killed, or gave up on us): not an error.  Caught
                # here, or the nursery would wrap it in a group that _handle logs as one.
                log.info("%s: connection lost: %s", conn.peer, exc)
                nursery.cancel_scope.cancel()

    async def _send_replies(self, conn: _Conn, fs: FrameSocket, scope: trio.CancelScope) -> None:
        """Send replies in order, each only once the changes it may reflect are durable."""
        journal = self.journal
        try:
            while True:
                if conn.outbox:
                    if journal is not None:
                        await journal.wait_durable(conn.outbox[0][1])
                    while conn.outbox and (journal is None or conn.outbox[0][1] <= journal.durable_seq):
                        fs.send_now(conn.outbox.popleft()[0])
                if fs.pending():
                    with trio.fail_after(SEND_TIMEOUT):
                        await fs.flush()
                    continue
                if conn.outbox:
                    continue
                if conn.closing:
                    return
                await conn.wake.wait()
                conn.wake = trio.Event()
        except trio.TooSlowError:
            log.warning("%s: client does not read its replies, closing", conn.peer)
            scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("%s: connection lost: %s", conn.peer, exc)
            scope.cancel()

    # -- calls ---------------------------------------------------------------------------

    async def _execute(self, conn: _Conn, payload: bytes) -> tuple[Kind, bytes]:
        """Run one call; WireError for a malformed one (the connection closes)."""
        value = wire.decode(payload)
        if type(value) is list and value and value[0] in ("describe", "session", "ping", "control"):
            try:
                return Kind.OK, wire.encode(await self._control(conn, value))
            except FsError as exc:
                return Kind.ERROR, wire.encode_error(exc.errno, exc.args[1])
        try:
            m, args = codec.decode_call(value)
        except codec.UnknownMethod as exc:
            log.warning("%s: refused a call of %r: not a metadata method", conn.peer, exc.args[0])
            return Kind.ERROR, wire.encode_error(errno.ENOSYS, f"no method {exc.args[0]!r}")
        if m.name in ("map_read", "map_write") and not (
            args[1] >= 0 and 0 <= args[2] <= MAX_RANGE
        ):
            # FUSE never asks this; the store would walk (or list) every chunk of the range.
            return Kind.ERROR, wire.encode_error(errno.EINVAL, "offset or length out of range")
        self._t = self._real_now()
        atime = self._atime(args[0]) if m.name == "map_read" and self.journal else None
        try:
            if m.name == "open":
                result: Any = await self._open(conn.session, args[0])
            elif m.name == "release":
                await self._release(conn.session, args[0])
                result = None
            else:
                result = await self._call(m, args)
        except FsError as exc:
            self._journal_destroys()
            return Kind.ERROR, wire.encode_error(exc.errno, exc.args[1])
        except Exception:
            log.exception("%s: %s failed", conn.peer, m.name)
            return Kind.ERROR, wire.encode_error(errno.EIO, "internal error in the metadata server")
        if self.journal is not None:
            if m.mutates:
                self.journal.append(self._t, m.name, value[1:])
            elif atime is not None and self._atime(args[0]) != atime:
                self.journal.append(self._t, "map_read", [args[0], 0, 0])
        self._journal_destroys()
        body = wire.encode(m.result_to_wire(result))
        if len(body) > MAX_REPLY:
            log.error("%s: %s reply of %d bytes is too large", conn.peer, m.name, len(body))
            return Kind.ERROR, wire.encode_error(errno.EOVERFLOW, "reply too large")
        return Kind.OK, body

    async def _call(self, m: codec.Method, args: list[Any]) -> Any:
        if m.name not in ("map_read", "map_write") or self.meta is self.store:
            return await m.bind(self.meta)(*args)
        # With a backing directory a write may wait for write-back (the dirty cap)
        # and a read for data fetched from DIR: answer "not yet" well before the
        # client's call timeout, and it asks again (RemoteMeta.map_read/map_write).
        # What a fetch brought in so far stays; the next call goes on from there.
        with trio.move_on_after(CALL_WAIT):
            return await m.bind(self.meta)(*args)
        raise FsError(errno.EINPROGRESS, "waiting for the backing directory")

    def _atime(self, ino: int) -> int | None:
        i = self.store.inodes.get(ino)
        return None if i is None else i.atime_ns

    def _journal_destroys(self) -> None:
        if self._destroyed:
            if self.journal is not None:
                for ino in self._destroyed:
                    self.journal.append_destroy(ino)
            self._destroyed.clear()

    async def _control(self, conn: _Conn, value: list[Any]) -> Any:
        name, *raw = value
        if name == "ping" and not raw:
            return None
        if name == "describe" and not raw:
            s = self.store
            return {
                "fsid": self.fsid,
                "volumes": [str(v) for v in self.pool] if self.pool else [],
                "n_volumes": s.n_volumes,
                "volume_size": s.allocators[0].n_chunks * s.chunk_size,
                "chunk_size": s.chunk_size,
                "stripe_size": s.default_spec.stripe_size,
                # memory server "host:port" -> incarnation the pool's data lives in
                "incarnations": dict(self.incarnations),
            }
        if name == "control" and len(raw) == 2:
            op, args = raw
            if type(op) is not str or type(args) is not dict:
                raise WireError("malformed control call")
            try:
                return await self.meta.control(op, args)
            except FsError:
                raise
            except Exception:
                log.exception("%s: control %s failed", conn.peer, op)
                raise FsError(errno.EIO, "internal error in the metadata server") from None
        if name == "session" and len(raw) == 2:
            sid = codec.check_bytes(raw[0], "session id")
            if not 8 <= len(sid) <= 64:
                raise WireError("session id of a bad length")
            claimed: dict[int, int] = {}
            for item in codec.check_list(raw[1], "open handles"):
                ino, count = (codec.check_int(x, "open handle") for x in codec.check_list(item, "open handle", 2))
                if not 0 < count <= MAX_HANDLES:
                    raise WireError(f"open handle count {count} out of range")
                claimed[ino] = claimed.get(ino, 0) + count
            return await self._claim_session(conn, sid, claimed)
        raise WireError(f"malformed {name} call")

    # -- sessions and open counts -----------------------------------------------------------

    def _new_session(self) -> _Session:
        s = _Session(os.urandom(16))
        self._sessions[s.sid] = s
        return s

    async def _claim_session(self, conn: _Conn, sid: bytes, claimed: dict[int, int]) -> list[int]:
        """Attach *conn* to session *sid* and make its open counts exactly *claimed*.

        Returns the inodes that no longer exist (the client drops those handles).
        """
        old = conn.session
        if old.sid != sid:
            if old.opens:
                raise FsError(errno.EINVAL, "session must be named before opening files")
            self._sessions.pop(old.sid, None)
            s = self._sessions.get(sid)
            if s is None:
                s = self._sessions[sid] = _Session(sid)
            elif s.conn is not None:
                log.info("%s: session moves here from %s", conn.peer, s.conn.peer)
            s.conn = conn
            s.generation += 1
            conn.session = s
        s = conn.session
        self._t = self._real_now()
        lost = []
        for ino in set(claimed) | set(s.opens):
            want, have = claimed.get(ino, 0), s.opens.get(ino, 0)
            try:
                while have < want:
                    await self.store.open(ino)
                    have += 1
            except FsError:
                lost.append(ino)
            while have > want:
                await self.store.release(ino)
                have -= 1
            if have:
                s.opens[ino] = have
            else:
                s.opens.pop(ino, None)
        self._journal_destroys()
        if claimed:
            log.info("%s: session re-registered %d open inodes (%d gone)", conn.peer, len(claimed), len(lost))
        return sorted(lost)

    async def _open(self, s: _Session, ino: int) -> Any:
        attr = await self.store.open(ino)
        s.opens[ino] = s.opens.get(ino, 0) + 1
        return attr

    async def _release(self, s: _Session, ino: int) -> None:
        n = s.opens.get(ino, 0)
        if n <= 0:
            # Never let one client drop another's counts; a re-registration may have
            # already settled this one.
            log.debug("release of inode %d that this session does not hold: ignored", ino)
            return
        if n == 1:
            del s.opens[ino]
        else:
            s.opens[ino] = n - 1
        await self.store.release(ino)

    async def _release_ino(self, ino: int) -> None:
        self._t = self._real_now()
        await self.store.release(ino)
        self._journal_destroys()

    def _detach(self, conn: _Conn) -> None:
        s = conn.session
        if s.conn is not conn:
            return  # taken over by a newer connection
        s.conn = None
        if not s.opens:
            self._sessions.pop(s.sid, None)
            return
        s.generation += 1
        log.info("%s: client gone with %d open inodes; holding them for %.0f s",
                 conn.peer, len(s.opens), self.session_grace)
        assert self._nursery is not None
        self._nursery.start_soon(self._expire, s, s.generation)

    async def _expire(self, s: _Session, generation: int) -> None:
        await trio.sleep(self.session_grace)
        if s.conn is not None or s.generation != generation or self._sessions.get(s.sid) is not s:
            return
        del self._sessions[s.sid]
        log.info("session expired: releasing %d open inodes", len(s.opens))
        for ino, n in s.opens.items():
            for _ in range(n):
                await self._release_ino(ino)
        s.opens.clear()
