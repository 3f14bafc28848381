"""RemoteMeta: the :class:`~memfs.meta.Meta` interface served by ``memfs mds``.

One TCP connection carries many outstanding calls (request ids); a writer task
sends, a reader task matches replies to callers, and a keepalive ping keeps an
idle connection provably alive.  :func:`open_remote_meta` owns the nursery these
tasks run in.

Deadlines: every call finishes within ``timeout`` seconds, counting any wait for
a reconnection; otherwise it fails with ``FsError(EIO)``.  A call that times
out on a live connection closes it (the server is hung or the path is broken)
so the next call starts from a fresh one.

Reconnection: when the connection drops (the server restarts, the network
breaks), the client reconnects in the background with exponential backoff.
Calls that were not yet sent wait for the new connection.  Calls that were sent
and not answered are

* sent again if they change nothing (``lookup``, ``getattr``, ``readlink``,
  ``readdir``, ``getxattr``, ``listxattr``, ``statfs``, ``map_read``);
* failed with EIO otherwise: the server may or may not have applied them, and
  applying some twice is wrong (a second ``rename`` or ``unlink`` answers
  ENOENT for what the first one did).

Open handles: the client counts the inodes it holds open.  On every
(re)connection it names its session (a random id) and states those counts; the
server makes the session's counts exactly that.  So an unlinked file held open
here survives a server restart, and counts cannot drift across lost replies.
``release`` therefore never fails: when the server cannot be told now, it is
told by the next re-registration.

Caching: under the server's leases (:mod:`memfs.meta.leases`) the client
answers what it may from its :class:`~memfs.meta.cache.ClientCache` without a
call (attributes, names, xattrs, chunk maps; writes under a write lease), and
:class:`~memfs.meta.lease_client.LeaseKeeper` answers recalls, drops
everything when the lease is lost, and sends sizes written meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from memfs import wire
from memfs.errors import FsError, SpaceBusy
from memfs.meta import (
    CAPABILITY_XATTR,
    RENAME_EXCHANGE,
    Attr,
    Extent,
    Meta,
    SetAttr,
    StatFs,
    WritePlan,
    clock,
    codec,
    set_ids_to_drop,
)
from memfs.meta.cache import READ_AT, ClientCache
from memfs.meta.conn import MAX_REPLY, ROLE, FrameSocket
from memfs.meta.creates import CREATE_HOLD, RESERVE, AsyncCreates
from memfs.meta.lease_client import LeaseKeeper
from memfs.meta.lock_client import LockClient
from memfs.net import connect
from memfs.wire import Kind, WireError

log = logging.getLogger(__name__)

#: an idle connection sends a ping this often; the server drops silent ones
KEEPALIVE = 5.0
#: calls without reply (releases) wait at most this long for a call to go with
HOLD_MAX = 0.25
#: at close, what is held or queued gets this long to reach the socket (the server may hang)
CLOSE_FLUSH = 1.0
#: most space a sequential writer asks for ahead of its writes (the server caps it too)
MAX_AHEAD = 64 << 20
RECONNECT_MIN = 0.05
RECONNECT_MAX = 2.0
_PING = wire.encode(["ping"])
#: what a failed connection attempt raises (FsError aside)
_CONNECT_ERRORS = (
    OSError, WireError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
)


def _incarnations(v: Any) -> dict[str, int]:
    if type(v) is not dict or not all(type(k) is str for k in v):
        raise WireError("describe: malformed incarnations")
    return {k: codec.check_int(x, "incarnation") for k, x in v.items()}


def _lease_term(v: Any) -> float:
    if type(v) not in (int, float) or not 0 <= v <= 3600:
        raise WireError("describe: malformed lease term")
    return float(v)


@dataclass(frozen=True, slots=True)
class PoolDescription:
    """What the server says a client needs to reach the data (``describe``)."""

    volumes: list[str]  # volume URLs in pool order (empty when the server has no pool)
    n_volumes: int
    volume_size: int
    chunk_size: int
    stripe_size: int
    fsid: bytes  # the filesystem's identity: changes only if the server lost its metadata
    #: memory server "host:port" -> incarnation holding the pool's data (may be empty)
    incarnations: dict[str, int] = field(default_factory=dict)
    #: how long a client may trust what it caches (0: it caches nothing)
    lease_term: float = 0.0
    #: how long the server waits for a recall's answer before it evicts the client
    recall_timeout: float = 0.0

    @classmethod
    def from_wire(cls, v: Any) -> PoolDescription:
        if type(v) is not dict:
            raise WireError("describe: expected a dict")
        try:
            return cls(
                volumes=[str(x) for x in codec.check_list(v["volumes"], "volumes")],
                n_volumes=codec.check_int(v["n_volumes"], "n_volumes"),
                volume_size=codec.check_int(v["volume_size"], "volume_size"),
                chunk_size=codec.check_int(v["chunk_size"], "chunk_size"),
                stripe_size=codec.check_int(v["stripe_size"], "stripe_size"),
                fsid=codec.check_bytes(v["fsid"], "fsid"),
                incarnations=_incarnations(v.get("incarnations", {})),
                lease_term=_lease_term(v.get("lease_term", 0.0)),
                recall_timeout=_lease_term(v.get("recall_timeout", 0.0)),
            )
        except KeyError as exc:
            raise WireError(f"describe: missing {exc}") from None


class AuthRefused(FsError):
    """The server refused our secret (or we refused its proof)."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EACCES, msg)


class KnownAbsent(FsError):
    """An error the server says the client may cache under its lease (an absent name)."""


class FilesystemGone(FsError):
    """The server came back with another filesystem (it restarted without its journal)."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EIO, msg)


#: run by the reader as a reply is read (no reconnection in between): (kind, payload)
OnReply = Callable[[Kind, bytes], None]


class _Pending:
    __slots__ = ("event", "kind", "payload", "lost", "on_ok", "on_fail", "sent", "recalls", "read_at")

    def __init__(self, on_ok: OnReply | None, sent: float, on_fail: OnReply | None = None) -> None:
        self.event = trio.Event()
        self.kind = Kind.ERROR
        self.payload = b""
        self.lost = False
        self.on_ok = on_ok
        self.on_fail = on_fail
        self.sent = sent
        #: the connection's count of recalls handled when the reply was read
        self.recalls = 0
        #: the cache's count of our reports' replies read before this one (cache.READ_AT)
        self.read_at = -1


#: reply kinds of a call that succeeded
_OK_KINDS = frozenset({Kind.OK, Kind.OK_CACHE, Kind.OK_WRITE})
_REPLY_KINDS = _OK_KINDS | {Kind.ERROR, Kind.ERROR_CACHE}
#: what a cacheable reply kind becomes when a recall came between reading the reply
#: and its caller's turn (see _Connection.recalls)
_NOT_CACHEABLE = {Kind.OK_CACHE: Kind.OK, Kind.OK_WRITE: Kind.OK, Kind.ERROR_CACHE: Kind.ERROR}


class _Connection:
    """One authenticated connection and the calls outstanding on it."""

    def __init__(
        self, fs: FrameSocket, timeout: float, cache: ClientCache,
        on_recall: Callable[[_Connection, int, bytes], None],
        on_unlocked: Callable[[int], None],
    ) -> None:
        self.fs = fs
        self.timeout = timeout
        self.cache = cache
        self.on_recall = on_recall
        self.on_unlocked = on_unlocked
        #: idle pings this often keep the lease (and the connection) alive
        self.keepalive = min(KEEPALIVE, cache.term / 4) if cache.term else KEEPALIVE
        self.pending: dict[int, _Pending] = {}
        #: RECALL frames handled so far.  The reader hands a reply to its caller and
        #: goes on reading: a RECALL right behind the reply (the server granted, then
        #: took back) is handled before the caller runs, and the caller would then
        #: cache what the recall has just dropped, where the server no longer thinks
        #: it is held (never recalled again: stale for good; a write lease whose
        #: preallocated chunks were freed).  A reply read before a recall that its
        #: caller sees after it is therefore not cacheable (_roundtrip).
        self.recalls = 0
        self.dead = False
        self.reason = "closed"
        self._next_id = 1
        self._wake = trio.Event()
        self._scope = trio.CancelScope()
        self._last_send = trio.current_time()
        #: calls without reply not sent yet: they go with the next call (or ping)
        self._held = bytearray()
        #: set when an asynchronous create is held: it leaves within CREATE_HOLD
        self._flush_soon = trio.Event()

    def request(self, payload: bytes, on_ok: OnReply | None = None) -> tuple[int, _Pending]:
        """Send a call (no await: callers do their bookkeeping atomically with it)."""
        rid = self._next_id
        self._next_id = rid % 0xFFFFFFFF + 1
        now = trio.current_time()
        p = _Pending(on_ok, now)
        self.pending[rid] = p
        frame = wire.frame(Kind.CALL, rid, payload)
        if self._held:
            self._held += frame
            frame = bytes(self._held)
            self._held.clear()
        self._send(frame, now)
        return rid, p

    def _send(self, frame: bytes, now: float) -> None:
        try:
            self.fs.send_now(frame)
        except trio.BrokenResourceError as exc:
            self.kill(f"send failed: {exc}")
        else:
            if self.fs.pending():
                self._wake.set()
        self._last_send = now

    def hold(self, payload: bytes, on_ok: OnReply, on_fail: OnReply) -> None:
        """A call whose answer nobody waits for (an asynchronous create): it leaves with
        the next call, or at most ``CREATE_HOLD`` later with the others held meanwhile;
        the reader hands its answer to *on_ok* or *on_fail* (a lost connection: neither)."""
        rid = self._next_id
        self._next_id = rid % 0xFFFFFFFF + 1
        self.pending[rid] = _Pending(on_ok, trio.current_time(), on_fail)
        self._held += wire.frame(Kind.CALL, rid, payload)
        if not self._flush_soon.is_set():
            self._flush_soon.set()

    def flush_held(self) -> None:
        """Send the held calls now."""
        if self._held and not self.dead:
            frame = bytes(self._held)
            self._held.clear()
            self._send(frame, trio.current_time())

    async def _flusher(self) -> None:
        while True:
            await self._flush_soon.wait()
            await trio.sleep(CREATE_HOLD)
            self._flush_soon = trio.Event()
            self.flush_held()

    def cast(self, payload: bytes) -> None:
        """A call that wants no reply (request id 0): the server runs it in order with
        the others and answers nothing.  It leaves with our next call, in the same
        send, or with a ping at most ``HOLD_MAX`` later."""
        self._held += wire.frame(Kind.CALL, 0, payload)

    def send_recalled(self, rid: int, payload: bytes) -> None:
        """Acknowledge recall *rid* (no await: the reader must not wait on the socket)."""
        if self.dead:
            return
        try:
            self.fs.send_now(wire.frame(Kind.RECALLED, rid, payload))
        except trio.BrokenResourceError as exc:
            self.kill(f"send failed: {exc}")
        else:
            if self.fs.pending():
                self._wake.set()

    async def delivered(self) -> bool:
        """A ping's reply: the server has read every frame sent before it (in order)."""
        if self.dead:
            return False
        _, p = self.request(_PING)
        await p.event.wait()  # bounded by the watchdog, like every call
        return not p.lost

    def kill(self, reason: str) -> None:
        if not self.dead and not self._scope.cancel_called:
            self.reason = reason
        self._scope.cancel()

    async def run(self) -> None:
        """Serve this connection until it breaks; then every outstanding call is lost."""
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer)
                    nursery.start_soon(self._reader)
                    nursery.start_soon(self._keepalive)
                    nursery.start_soon(self._watchdog)
                    nursery.start_soon(self._flusher)
        finally:
            self.dead = True
            self.fs.close()
            for p in self.pending.values():
                p.lost = True
                p.event.set()
            self.pending.clear()

    async def _writer(self) -> None:
        """Send what the socket did not take at once."""
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                with trio.fail_after(self.timeout):
                    await self.fs.flush()
        except trio.TooSlowError:
            self.kill(f"could not send for {self.timeout:.0f} s")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.kill(f"send failed: {exc}")

    async def _reader(self) -> None:
        limit = self.keepalive + self.timeout  # the server answers our pings well within this
        cache = self.cache
        try:
            # One scope whose deadline moves (in steps: setting a deadline is not
            # free): cheaper than a fail_after per frame.
            step = min(0.1, limit / 8)
            with trio.CancelScope(deadline=trio.current_time() + limit) as silent:
                while True:
                    now = trio.current_time()
                    if now + limit - silent.deadline > step:
                        silent.deadline = now + limit
                    got = await self.fs.receive()
                    if got is None:
                        self.kill("closed by the server")
                        return
                    h, payload = got
                    if h.kind is Kind.RECALL:
                        self.recalls += 1
                        self.on_recall(self, h.req_id, payload)
                        continue
                    if h.kind is Kind.UNLOCKED:
                        self.on_unlocked(codec.check_int(wire.decode(payload)[0], "unlocked inode"))
                        continue
                    if h.kind not in _REPLY_KINDS:
                        raise WireError(f"unexpected {h.kind.name} frame")
                    p = self.pending.pop(h.req_id, None)
                    if p is None:
                        continue  # the caller gave up on it (timeout, or a ping)
                    if cache.term:
                        cache.renew(p.sent)
                    p.kind, p.payload, p.recalls, p.read_at = h.kind, payload, self.recalls, cache.landings
                    if h.kind in _OK_KINDS:
                        if p.on_ok is not None:
                            p.on_ok(h.kind, payload)
                    elif p.on_fail is not None:
                        p.on_fail(h.kind, payload)
                    p.event.set()
            if silent.cancelled_caught:
                self.kill(f"silent for {limit:.0f} s")
        except WireError as exc:
            log.error("metadata server broke the protocol: %s", exc)
            self.kill(f"protocol error: {exc}")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.kill(f"receive failed: {exc}")

    async def _watchdog(self) -> None:
        """End the connection when its oldest call has waited ``timeout`` for a reply
        (the server is hung or unreachable): its calls are lost, callers start over on
        a fresh connection or fail.  Checked a few times per timeout."""
        every = min(0.25, self.timeout / 8)
        while True:
            await trio.sleep(every)
            for p in self.pending.values():  # insertion order: the oldest first
                if trio.current_time() - p.sent >= self.timeout:
                    self.kill(f"no reply within {self.timeout:g} s")
                break

    async def _keepalive(self) -> None:
        """Ping when idle (keeps the lease), or when calls were held for a while."""
        while True:
            await trio.sleep_until(min(self._last_send + self.keepalive, trio.current_time() + HOLD_MAX))
            if self._held or trio.current_time() >= self._last_send + self.keepalive:
                self.request(_PING)


class RemoteMeta(Meta):
    """A client of ``memfs mds``; build it with :func:`open_remote_meta`."""

    def __init__(self, host: str, port: int, secret: bytes, *, timeout: float = 10.0) -> None:
        self.host = host
        self.port = port
        self.secret = secret
        self.timeout = timeout
        self.chunk_size = 0
        self.n_volumes = 0
        self.pool: PoolDescription | None = None
        self.session = os.urandom(16)
        #: inode -> open handles this client holds (re-registered on every connection)
        self.opens: dict[int, int] = {}
        #: open inodes whose writes were lost (the server refused our size): their
        #: writes and fsyncs fail with EIO until the last handle here closes
        self.write_errors: set[int] = set()
        self._opens_version = 0
        self._conn: _Connection | None = None
        self._ready = trio.Event()
        self._closed = False
        self._scope = trio.CancelScope()
        self._first: _Connection | None = None
        self._gone: FilesystemGone | None = None
        #: what this client may serve without asking, under its lease
        self.cache = ClientCache()
        #: creates made under create leases (memfs.meta.creates)
        self.creates = AsyncCreates(self.cache)
        self._reserving: trio.Event | None = None
        #: the lease token of the registration our reserved inode numbers came under
        self._inos_token = 0
        self.leases = LeaseKeeper(self.cache, self._call, self, self.creates)
        #: zeroes a truncate's cut in chunks that stay (the data engine's: zero_tails_with)
        self._zero_tails: Callable[[int, list[tuple[int, int, int]]], Awaitable[None]] | None = None
        #: this client's cluster-wide file locks
        self.lock_client = LockClient(self.session, self._call)
        #: (inode, map window) -> set once the map_read that will bring it has ended
        self._maps_asked: dict[tuple[int, int], trio.Event] = {}
        #: inodes whose last map_read answer was not cacheable (reads do not wait)
        self._maps_plain: set[int] = set()
        #: files whose space ahead of need the server may hold for us although the reply
        #: that gave it was not cacheable here (a recall or a change of ours came
        #: meanwhile): their last close gives it back all the same
        self._ahead_unsure: set[int] = set()
        self._last_open: tuple[int, bool] = (0, False)
        self.stripe_size = 0
        #: the lease token our memory-server connections name (from the registration);
        #: a new one means the server took our leases without our word, or restarted
        self.token = 0
        #: told each registration's token, before any call under it (see follow_token)
        self._on_token: Callable[[int], None] | None = None
        #: the token _on_token was last told
        self._named_token = 0

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # -- connection management --------------------------------------------------------------

    async def connect(self) -> None:
        """Make the first connection: ``FsError`` EIO if the server cannot be reached,
        EACCES if it refuses our secret."""
        try:
            self._first = await self._connect(True)
        except _CONNECT_ERRORS as exc:
            why: object = exc
            if isinstance(exc, OSError) and exc.errno:  # not the errno and address again
                why = os.strerror(exc.errno) if exc.errno > 0 else exc.strerror
            raise FsError(
                errno.EIO, f"cannot reach the metadata server at {self.address}: {why or 'timed out'}"
            ) from None

    async def run(self) -> None:
        """Keep a connection up until :meth:`aclose` (after :meth:`connect`)."""
        conn = self._first
        assert conn is not None, "connect() first"
        self._first = None
        with self._scope:
            async with trio.open_nursery() as tasks:
                self.leases.tasks = tasks
                if self.cache.term:
                    tasks.start_soon(self.leases.watch)
                    tasks.start_soon(self.leases.settle_dirty)
                await self._connection_loop(conn)

    async def _connection_loop(self, conn: _Connection) -> None:
        backoff = RECONNECT_MIN
        while True:
            self._conn = conn
            self._ready.set()
            try:
                await conn.run()
            finally:
                self._conn = None
                self._ready = trio.Event()
                # Whatever the server thinks, nothing cached may be trusted now.
                self.leases.lost("lost the connection")
            down_since = trio.current_time()
            log.warning("lost the metadata server at %s (%s); reconnecting", self.address, conn.reason)
            # Our registration answers every recall the server sent us (it forgets
            # what we held), so, as for an answer, the transfers our transport began
            # under maps we held end first (each within the transport's deadlines):
            # a truncate it lets go ahead then may free their chunks.  No transfer
            # begins meanwhile (every map went with the caches), so none runs under
            # the old lease token when we name a new one either.  memfs.array's, made
            # by other processes under our maps, get as long as a recall's answer
            # would; for any still running then the registration has the server
            # fence the token they were made under (_others_ended, _connect).
            await self._transfers_ended()
            if self.cache.term:  # (without leases nothing waits for our answer)
                await self._others_ended()
            while True:
                try:
                    conn = await self._connect(False)
                    break
                except FilesystemGone as exc:
                    log.error("%s", exc.args[1])
                    self._gone = exc
                    self._ready.set()  # wake waiting callers: they fail now
                    return
                except (*_CONNECT_ERRORS, FsError) as exc:
                    log.debug("reconnecting to %s failed: %s", self.address, exc)
                    await trio.sleep(backoff * random.uniform(0.5, 1.0))
                    backoff = min(backoff * 2, RECONNECT_MAX)
            backoff = RECONNECT_MIN
            log.warning("reconnected to the metadata server at %s after %.1f s",
                        self.address, trio.current_time() - down_since)

    async def _connect(self, first: bool) -> _Connection:
        with trio.fail_after(self.timeout):
            fs = FrameSocket(await connect(self.host, self.port), MAX_REPLY)
            try:
                await self._handshake(fs)
                # Transfers still running now began under the old connection's maps
                # (no map is handed out without a connection): memfs.array's, which
                # _others_ended gave up waiting for (or ours: see _transfers_ended).
                # (Made under the token of our last registration: maps are handed out
                # only while it stands.)
                fence = self.token if self.cache.term and self.cache.any_transfer() else 0
                lost, failed, desc = await self._register(fs, fence)
            except BaseException:
                fs.close()
                raise
        if first:
            self.pool = desc
            self.chunk_size, self.n_volumes = desc.chunk_size, desc.n_volumes
            self.stripe_size = desc.stripe_size
            self.cache.chunk_size = desc.chunk_size
            self.cache.term = desc.lease_term
            self.leases.server_patience(desc.recall_timeout)
        elif self.pool is not None and desc.fsid != self.pool.fsid:
            # Inode numbers we hold now name other files, or nothing: never carry on.
            fs.close()
            raise FilesystemGone(
                f"the metadata server at {self.address} came back with another filesystem "
                "(restarted without its journal?): this client's files are gone"
            )
        elif self.pool is not None and (desc.n_volumes, desc.volume_size, desc.chunk_size) != (
            self.pool.n_volumes, self.pool.volume_size, self.pool.chunk_size
        ):
            fs.close()
            log.error("the metadata server at %s now serves a different pool: %s (was %s)",
                      self.address, desc, self.pool)
            raise FsError(errno.EIO, "metadata server serves a different pool")
        for ino in lost:
            log.warning("open inode %d is gone from the metadata server: its handles are lost", ino)
            if self.opens.pop(ino, None):
                self._opens_version += 1
        self.write_lost(failed)
        if self.token != self._inos_token:
            # A token other than the one our numbers came under: our session expired
            # (the numbers reserved for it went with it), our leases were taken, or the
            # server restarted; the server forgets them too (MetaServer._register).
            # Compared with the reservation's token, not the last attempt's: an attempt
            # that registered and then failed must not hide the change.
            self.creates.inos.clear()
        self.cache.dirty.clear()  # told with the registration
        self.cache.answered.clear()
        if self._on_token is not None and self.token != self._named_token:
            if self._named_token:
                # Our leases were taken without our word (the old token is fenced:
                # transfers under it fail) or the server restarted (it knows no old
                # tokens).  Every transfer of our transport begun under the old one
                # has ended (_connection_loop waited before reconnecting).
                log.info("new lease token from the metadata server (it took our leases, "
                         "or restarted)")
            self._on_token(self.token)
            self._named_token = self.token
        return _Connection(fs, self.timeout, self.cache, self.leases.on_recall,
                           self.lock_client.unlocked)

    async def _transfers_ended(self) -> None:
        """Until no transfer of this process's transport holds a map (each ends within
        the transport's deadlines); a warning every ``timeout`` meanwhile."""
        # A reply read just before the connection broke woke its caller in the same
        # step: let it run first (a truncate pins its file for zeroing the tail).
        await trio.lowlevel.checkpoint()
        while True:
            with trio.move_on_after(self.timeout):
                await self.cache.wait_unpinned(None)
                return
            log.warning("transfers begun before the connection was lost still run")

    async def _others_ended(self) -> None:
        """Until memfs.array's transfers under our maps have ended, for as long as we
        would wait for them before answering a recall: those are other processes'
        (stopped, say), whose connections we cannot close.  Any still running then
        make the registration fence our lease token (``_register``), as an eviction
        would: the memory servers refuse their late frames."""
        with trio.move_on_after(self.leases.answer_within):
            await self.cache.wait_unpinned(None, everyone=True)
            return
        log.warning("memfs.array transfers begun before the connection was lost still run "
                    "after %.1f s: registering with a new lease token (they will fail)",
                    self.leases.answer_within)

    async def _handshake(self, fs: FrameSocket) -> None:
        hs = wire.Handshake(self.secret)
        got = await fs.receive()
        if got is None:
            raise AuthRefused(f"{self.address} closed the connection before greeting")
        h, payload = got
        if h.kind is Kind.ERROR:
            raise AuthRefused(f"{self.address} refused: {wire.decode_error(payload)[1]}")
        if h.kind is not Kind.HELLO:
            raise WireError(f"expected HELLO, got {h.kind.name}")
        await fs.send(wire.frame(Kind.AUTH, 0, hs.auth(payload, ROLE)))
        try:
            got = await fs.receive()
        except trio.BrokenResourceError:  # reset: e.g. a memory server refusing our role
            got = None
        if got is None:
            raise AuthRefused(
                f"{self.address} refused authentication (wrong secret, or not a metadata server?)"
            )
        h, payload = got
        if h.kind is Kind.ERROR:
            raise AuthRefused(f"{self.address} refused authentication: {wire.decode_error(payload)[1]}")
        if h.kind is not Kind.WELCOME:
            raise WireError(f"expected WELCOME, got {h.kind.name}")
        try:
            hs.check_welcome(payload)
        except WireError as exc:
            raise AuthRefused(f"{self.address}: {exc}") from None

    async def _register(
        self, fs: FrameSocket, fence: int = 0,
    ) -> tuple[list[int], list[int], PoolDescription]:
        """Name our session with our open handles and the sizes we wrote; ask for the
        pool description.  Returns the inodes gone, those whose sizes were refused, and
        the description.  *fence*: the lease token transfers that may still run were
        made under (other processes'): the server fences it before the registration
        answers the recalls sent to us."""
        # Sizes written under write leases that the server has not heard yet (again on
        # a second pass: one applied is no longer larger than the known size, one
        # refused is refused again, and a refusal is only heard with an answer).
        told = {**self.cache.answered, **self.cache.dirty}
        settles = [[ino, size, mtime] for ino, (size, mtime) in told.items()]
        failed: list[int] = []
        # Creates and unlinks made under create leases and not answered: applied
        # first, in order.
        ops = self.creates.unanswered()
        while True:
            version = self._opens_version
            claimed = [[ino, n] for ino, n in self.opens.items() if n > 0]
            # The locks we hold, after the handles (memfs.meta.lock_client).
            locks = self.lock_client.claims()
            call: list[Any] = ["session", self.session, claimed, settles,
                               [c for _, c in ops], locks]
            if fence:
                call.append(fence)
                fence = 0  # (done, if a second pass comes)
            await fs.send(
                wire.frame(Kind.CALL, 1, wire.encode(call))
                + wire.frame(Kind.CALL, 2, wire.encode(["describe"]))
            )
            replies: dict[int, tuple[wire.Header, bytes]] = {}
            while len(replies) < 2:
                got = await fs.receive()
                if got is None:
                    raise WireError("connection closed during registration")
                h = got[0]
                if h.kind is Kind.UNLOCKED:  # (a lock went while the server registered us)
                    self.lock_client.unlocked(codec.check_int(wire.decode(got[1])[0], "unlocked inode"))
                    continue
                if h.kind is Kind.RECALL:
                    # We hold nothing: every cache went before we registered, and
                    # transfers under old maps have ended.
                    await fs.send(wire.frame(Kind.RECALLED, h.req_id, wire.encode([])))
                    continue
                if h.kind not in _REPLY_KINDS or h.req_id not in (1, 2):
                    raise WireError(f"unexpected {h.kind.name} frame {h.req_id} during registration")
                replies[h.req_id] = got
            values = []
            for rid in (1, 2):
                h, payload = replies[rid]
                if h.kind is Kind.ERROR:
                    err, msg = wire.decode_error(payload)
                    raise FsError(err, f"metadata server refused registration: {msg}")
                values.append(wire.decode(payload))
            answer = codec.check_list(values[0], "registration", 5)
            gone, refused, token = answer[:3]
            self.token = codec.check_int(token, "lease token")
            self.lock_client.refused(
                [codec.check_int(k, "refused lock") for k in codec.check_list(answer[4], "locks")],
                locks)
            if ops:
                # [position, errno] of each one refused
                refused_ops = {codec.check_int(k, "operation"): codec.check_int(err, "errno")
                               for k, err in (codec.check_list(x, "refused", 2)
                                              for x in codec.check_list(answer[3], "refused"))}
                for k, (op, c) in enumerate(ops):
                    if self.creates.answered(op) is None or k not in refused_ops:
                        continue
                    if c[0] == "create_at":
                        self._create_failed(c[6], c[1], c[2], refused_ops[k], "")
                    else:
                        self._unlink_failed(c[1], c[2], refused_ops[k], "")
                ops = []
            lost = [codec.check_int(x, "lost inode") for x in codec.check_list(gone, "lost")]
            failed += [codec.check_int(x, "failed inode") for x in codec.check_list(refused, "failed")
                       if x not in failed]
            desc = PoolDescription.from_wire(values[1])
            # A release that could not reach the server changed our counts meanwhile.
            if version == self._opens_version:
                return lost, failed, desc

    async def aclose(self) -> None:
        conn = self._conn
        if conn is not None and not conn.dead:
            # Releases sent without a reply leave with the next call, and there is
            # none now: without them the server holds those files open for this
            # session's grace (an unlinked file's space comes back that much later).
            # What the socket does not take at once is the connection's writer task's
            # to send (a second task waiting on the socket would be an error).
            conn.flush_held()
            with trio.move_on_after(CLOSE_FLUSH):
                while conn.fs.pending() and not conn.dead:  # noqa: ASYNC110 - no drained signal
                    await trio.sleep(0.01)
        self._closed = True
        self._scope.cancel()
        self._ready.set()  # wake callers waiting for a connection: they fail now

    # -- calls ---------------------------------------------------------------------------------

    async def _roundtrip(
        self, method: str, payload: bytes, *, retry: bool,
        on_send: Callable[[], None] | None = None, on_ok: OnReply | None = None,
    ) -> tuple[Kind, bytes]:
        # No cancel scope per call (it showed in profiles): a call on the wire is
        # bounded by its connection's watchdog, which ends a connection whose oldest
        # call is unanswered after ``timeout``; only waiting for a connection has a scope.
        deadline = trio.current_time() + self.timeout
        cuts = self.cache.cuts
        while True:
            conn = self._conn
            if conn is None or conn.dead:
                with trio.move_on_at(deadline):
                    while conn is None or conn.dead:
                        if self._closed:
                            raise FsError(errno.EIO, "metadata client is closed")
                        if self._gone is not None:
                            raise FsError(errno.EIO, self._gone.args[1])
                        await self._ready.wait()
                        conn = self._conn
                if conn is None or conn.dead:
                    break
            if self._closed:
                raise FsError(errno.EIO, "metadata client is closed")
            rid, p = conn.request(payload, on_ok)
            if on_send is not None:
                on_send()
                on_send = None
            try:
                await p.event.wait()
            finally:
                if not p.event.is_set():  # cancelled from outside: the reply is not wanted
                    conn.pending.pop(rid, None)
            if not p.lost:
                READ_AT.set(p.read_at)  # for what the caller does with the reply (cache.newest)
                if (p.recalls != conn.recalls or self.cache.cuts != cuts) and p.kind in _NOT_CACHEABLE:
                    return _NOT_CACHEABLE[p.kind], p.payload  # (callers cache with no await)
                return p.kind, p.payload
            if trio.current_time() >= deadline:
                break
            if not retry:
                raise FsError(
                    errno.EIO,
                    f"lost the metadata server during {method}: it may or may not have been applied",
                )
        raise FsError(errno.EIO, f"metadata server {self.address} did not answer {method} "
                                 f"within {self.timeout:g} s")

    async def _call_kind(
        self, method: str, *args: Any, on_ok: OnReply | None = None,
        on_send: Callable[[], None] | None = None,
    ) -> tuple[Kind, Any]:
        """A call's reply kind (OK, OK_CACHE, OK_WRITE) and result."""
        m = codec.METHODS[method]
        payload = wire.encode(codec.encode_call(method, *args))
        sent = self.cache.seq
        kind, body = await self._roundtrip(method, payload, retry=m.retry, on_ok=on_ok, on_send=on_send)
        if kind is Kind.ERROR or kind is Kind.ERROR_CACHE:
            err, msg = wire.decode_error(body)
            if err == errno.EAGAIN and method in ("map_write", "allocate_ahead"):
                # Only freed space is left: the data engine reclaims and retries on
                # SpaceBusy (a plain EAGAIN would reach the application).
                raise SpaceBusy()
            if kind is Kind.ERROR_CACHE and err == errno.ENOENT and method == "lookup":
                if not self.cache.stale(("names", args[0]), sent):  # (our create since?)
                    self.cache.put_entry(args[0], args[1], 0)
            raise (KnownAbsent if kind is Kind.ERROR_CACHE else FsError)(err, msg)
        try:
            return kind, m.result_from_wire(wire.decode(body))
        except WireError as exc:
            log.error("bad %s reply from the metadata server: %s", method, exc)
            raise FsError(errno.EIO, f"bad {method} reply from the metadata server") from None

    async def _call(self, method: str, *args: Any, on_ok: OnReply | None = None,
                    on_send: Callable[[], None] | None = None) -> Any:
        return (await self._call_kind(method, *args, on_ok=on_ok, on_send=on_send))[1]

    async def describe(self) -> PoolDescription:
        kind, body = await self._roundtrip("describe", wire.encode(["describe"]), retry=True)
        if kind is Kind.ERROR:
            raise FsError(*wire.decode_error(body))
        return PoolDescription.from_wire(wire.decode(body))

    # -- leases (memfs.meta.leases, memfs.meta.cache, memfs.meta.lease_client) -------------

    def attr_ttl(self, ino: int, returned: Attr | None = None) -> float | None:
        return self.leases.attr_ttl(ino, returned)

    def entry_ttl(self, parent: int, name: bytes) -> float | None:
        return self.leases.entry_ttl(parent, name)

    def keep_cache(self, ino: int) -> bool | None:
        if not self.cache.term:
            return None
        last, cacheable = self._last_open
        return cacheable and last == ino and not self.cache.invalidating

    def follow_token(self, name: Callable[[int], None]) -> None:
        """Call *name* with our lease token now and after each registration that brings
        a new one (once the transfers begun under the old one have ended): the mount
        passes it to its transport, which drops connections that named an older one."""
        name(self.token)
        self._named_token = self.token
        self._on_token = name

    def locks(self) -> LockClient:
        return self.lock_client

    def order_sizes_after(self, barrier: Callable[[int], Awaitable[None]]) -> None:
        self.leases.barrier = barrier

    def zero_tails_with(
        self, zero: Callable[[int, list[tuple[int, int, int]]], Awaitable[None]],
    ) -> None:
        self._zero_tails = zero

    def truncating(self, ino: int) -> bool:
        return ino in self.leases.truncating

    async def truncates_over(self, ino: int) -> None:
        await self.leases.truncates_over(ino)

    def recalls_drop_pages(self) -> bool:
        # Under leases every change to a file by another client (map_write,
        # allocate_ahead, truncate, ...) recalls us first, and the recall drops the
        # kernel's pages of it; so does losing the lease.  Without them (--lease-term
        # 0) the kernel's own check on a new mtime stays.  (An mds restarted with
        # another term: see docs/ARCHITECTURE.md.)
        return bool(self.cache.term)

    def io(self, ino: int, *, here: bool = True) -> contextlib.AbstractContextManager[object]:
        return self.cache.pinned(ino, here=here)

    def generation(self, ino: int) -> int:
        return self.cache.generation(ino)

    def write_lost(self, inos: list[int]) -> None:
        """Our write lease on *inos* was taken without our word (we were evicted, or
        came back after the restarted server's --grace): what we wrote since our last
        report is gone.  Like a local disk's write-back error, the file's writers hear
        it (EIO) from write and fsync until its last handle here closes; its pages and
        attributes here are dropped."""
        for ino in inos:
            log.error("writes to inode %d since its size was last reported are lost: "
                      "the metadata server took our write lease without our answer", ino)
            if self.opens.get(ino):
                self.write_errors.add(ino)
            self.cache.drop(ino)
        if inos:
            self.leases.drop_kernel(inos)

    def _check_write_error(self, ino: int) -> None:
        if ino in self.write_errors:
            raise FsError(errno.EIO, f"writes to inode {ino} were lost: this client was evicted "
                                     "by the metadata server (or came back after its --grace)")

    async def sync_all(self) -> None:
        # Sizes held back (coalesced, or waiting for their bytes to land) would
        # otherwise be lost with the session.  Bounded: the server may be gone.
        with trio.move_on_after(self.timeout) as scope:
            for ino in self.cache.unreported(sending=True):
                await self.leases.settle(ino, trim=False, again=True)
        left = self.cache.unreported()
        if scope.cancelled_caught and left:
            log.warning("the sizes of %d file(s) written here did not reach the metadata "
                        "server within %.0f s", len(left), self.timeout)

    async def sync(self, ino: int) -> None:
        self._check_write_error(ino)
        if self.creates.pending_under(ino):
            # A create made under a create lease (of this file, or in this directory)
            # is durable once the server has answered it.
            conn = self._conn
            if conn is not None:
                conn.flush_held()
            with trio.move_on_after(self.timeout * 2) as scope:
                await self.creates.wait([ino])
            if scope.cancelled_caught:
                raise FsError(errno.EIO, f"the metadata server has not confirmed the create of "
                                         f"inode {ino} (or of files in it)")
        cache = self.cache
        if ino in cache.dirty or ino in cache.spans or ino in cache.sending:
            await self.leases.settle(ino, trim=False, again=True)
        await self.leases.answer_known(ino)  # our size went in the answer to a recall
        if ino in cache.dirty or ino in cache.answered:
            # Not known to have arrived: the connection went.  The next registration
            # carries it; once a call goes through, the server has heard it (or said
            # that it was lost: write_errors).
            await self._roundtrip("ping", _PING, retry=True)
        self._check_write_error(ino)

    # -- Meta ------------------------------------------------------------------------------------

    async def lookup(self, parent: int, name: bytes) -> Attr:
        cache = self.cache
        if cache.term:
            ino = cache.entry(parent, name)
            if ino == 0:
                raise FsError(errno.ENOENT)
            if ino is not None:
                a = cache.attr(ino)
                if a is not None:
                    return a
        sent = cache.seq
        kind, a = await self._call_kind("lookup", parent, name)
        if kind is Kind.OK_CACHE and not cache.stale(("names", parent), sent):
            cache.put_entry(parent, name, a.ino)
        if kind is Kind.OK_CACHE and not cache.stale(a.ino, sent):
            cache.put_attr(a)
        else:
            cache.newest(a)
        return a

    async def getattr(self, ino: int) -> Attr:
        cache = self.cache
        if cache.term:
            a = cache.attr(ino)
            if a is not None:
                return a
            if (w := self.leases.settled_first(ino)) is not None:
                await w
        sent = cache.seq
        kind, a = await self._call_kind("getattr", ino)
        if kind is Kind.OK_CACHE and not cache.stale(ino, sent):
            cache.put_attr(a)
        else:
            cache.newest(a)
        return a

    async def setattr(self, ino: int, changes: SetAttr) -> Attr:
        if (w := self.leases.settled_first(ino)) is not None:
            await w
        kind, a = await self._call_kind("setattr", ino, changes)
        for t in (changes.atime_ns, changes.mtime_ns):
            if t is not None:
                clock.saw(t)  # (the stamps of our writes under a lease come after it)
        self._after_change(kind, a)
        return a

    async def drop_privileges(self, ino: int, set_ids: bool) -> bool:
        """One call that drops and says whether it did (never a read-modify-write a
        chmod elsewhere could slip into), and none when the attributes and the
        capability xattr, as this client caches them under its lease, show nothing to
        drop: after the first, the case of almost every write."""
        cache = self.cache
        if cache.term:
            if cache.attr(ino) is None:
                await self.getattr(ino)
            if not cache.xattr(ino, CAPABILITY_XATTR)[0]:  # no exception per write
                try:
                    await self.getxattr(ino, CAPABILITY_XATTR)
                except FsError as exc:
                    if exc.errno != errno.ENODATA:
                        raise
            # Decided from the cache only, after the awaits: a change by another node
            # meanwhile (a chmod u+s) recalled what we had; without both under our
            # lease the server decides.
            a = cache.attr(ino)
            known, cap = cache.xattr(ino, CAPABILITY_XATTR)
            if a is not None and stat.S_ISDIR(a.mode):
                return False
            if a is not None and known and cap is None and not (set_ids and set_ids_to_drop(a.mode)):
                return False
        dropped = bool(await self._call("drop_privileges", ino, int(set_ids)))
        if dropped:
            self.cache.mark(ino)
            self.cache.attrs.pop(ino, None)
            self.cache.xattrs.pop(ino, None)
        return dropped

    def _after_change(self, kind: Kind, a: Attr) -> None:
        self.cache.mark(a.ino)
        if kind is Kind.OK_CACHE:
            self.cache.put_attr(a)
        else:
            self.cache.attrs.pop(a.ino, None)

    async def truncate(self, ino: int, size: int) -> list[tuple[int, int, int]]:
        """The server recalls nothing from the node that asks, and frees the chunks
        past the new end at once: this node's own transfers of the file under maps
        from before (posted writes above all, which may still be going out) end
        first, and no new map of the file is handed out here until the truncate is
        applied and its cut in the chunk that stays zeroed (``LeaseKeeper.truncating``,
        ``zero_tails_with``), so that none begins meanwhile and nothing the
        server answers from the file's state before the truncate is cached after it.
        memfs.array processes' writes of the file get as long as a recall's answer
        would give them to land (their maps of the file are refused meanwhile,
        ``truncating``, so that a pipelined one ends the piece it has open); one still
        under way then (a stopped process; or one whose next map, asked before the
        truncate, waits for the server: a reconnection, the burst buffer's dirty cap)
        makes the truncate fail with ETXTBSY rather than free chunks it may still
        write."""
        truncating = self.leases.truncating
        await self.leases.truncates_over(ino)  # one at a time
        truncating[ino] = gate = trio.Event()
        try:
            ranges = await self._truncate(ino, size)
            if ranges and self._zero_tails is not None:
                # Before any map of the file is handed out here again (no await before
                # its pin: a recall read right behind the reply waits for the zeroing).
                await self._zero_tails(ino, ranges)
                return []
            return ranges
        finally:
            del truncating[ino]
            gate.set()

    async def _truncate(self, ino: int, size: int) -> list[tuple[int, int, int]]:
        if (w := self.leases.settled_first(ino)) is not None:
            await w
        if self.leases.barrier is not None and self.cache.pinned_here(ino):
            await self.leases.barrier(ino)  # posted writes confirmed now, not at the next look
        cache = self.cache
        arrays_by: float | None = None
        while True:
            with trio.move_on_after(self.timeout):
                await cache.wait_unpinned([ino], here=True)
                if not cache.moving(ino):
                    break
                if arrays_by is None:
                    arrays_by = trio.current_time() + self.leases.answer_within
                with trio.move_on_at(arrays_by):
                    await cache.wait_landed(ino)
                    continue  # our own transport's again: none began meanwhile
                raise FsError(errno.ETXTBSY, "a memfs.array write of it on this node did not "
                              f"end within {self.leases.answer_within:.1f} s")
            log.warning("truncating inode %d: transfers of it begun before still run", ino)
        # From here no await until the call is sent (when connected): the state
        # dropped now stays dropped.
        # Our chunk map past the new size is void, and so is any size we did not send.
        cache.dirty.pop(ino, None)
        cache.answered.pop(ino, None)
        cache.cut(ino)
        try:
            while True:
                try:
                    ranges: list[tuple[int, int, int]] = await self._call("truncate", ino, size)
                    self.leases.truncated(ino)
                    return ranges
                except FsError as exc:
                    # Another client's change of the file waits on the server's backing
                    # directory (memfs.meta.gates): told after a while, ask again.
                    if exc.errno != errno.EINPROGRESS:
                        raise
        finally:
            # Again: what a call answered meanwhile (before the truncate was applied,
            # or before it was asked again) brought to the cache is from before it.
            # (A write lease taken meanwhile goes from the cache, not from the
            # server: its space ahead goes back at our last close all the same.)
            if cache.is_writer(ino):
                self._ahead_unsure.add(ino)
            cache.cut(ino)

    def _touched(self, kind: Kind, parent: int, t: int, links: int = 0) -> None:
        """Our change of directory *parent* at time *t* (its mtime and ctime now), which
        gained *links* subdirectories."""
        a = self.cache.attrs.get(parent)
        if a is None:
            return
        if kind is Kind.OK_CACHE:
            a.mtime_ns = a.ctime_ns = t
            a.nlink += links
        else:
            del self.cache.attrs[parent]

    def _created(self, kind: Kind, parent: int, name: bytes, a: Attr, *, new: bool = True) -> None:
        cache = self.cache
        cache.mark(a.ino, parent, ("names", parent))
        # The directory's mtime is the new entry's ctime (one timestamp per call).
        self._touched(kind, parent, a.ctime_ns, 1 if stat.S_ISDIR(a.mode) and a.nlink == 2 else 0)
        if kind is Kind.OK_CACHE:
            cache.put_entry(parent, name, a.ino)
            cache.put_attr(a)
            if new:
                # A new inode has no file capabilities: the kernel's look before the
                # first write, and drop_privileges, need not ask.
                cache.put_xattr(a.ino, CAPABILITY_XATTR, None)
            if stat.S_ISDIR(a.mode):
                cache.new_directory(a.ino)
        else:
            cache.drop_entry(parent, name)

    async def mknod(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int,
        rdev: int = 0, target: bytes | None = None,
    ) -> Attr:
        kind, a = await self._call_kind("mknod", parent, name, mode, uid, gid, rdev, target)
        self._created(kind, parent, name, a)
        return a

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        if parent in self.cache.creators:
            a = await self._create_here(parent, name, mode, uid, gid)
            if a is not None:
                return a

        def counted(kind: Kind, payload: bytes) -> None:  # as the reply is read: no reconnection in between
            ino = wire.decode(payload)[0]
            self.opens[ino] = self.opens.get(ino, 0) + 1
            self._opens_version += 1
            if kind is Kind.OK_WRITE:  # a create lease on the directory (before any recall of it)
                self.cache.creators.setdefault(parent, set())

        kind, a = await self._call_kind("create", parent, name, mode, uid, gid, on_ok=counted)
        if kind is Kind.OK_WRITE:
            kind = Kind.OK_CACHE
        self._created(kind, parent, name, a)
        self._last_open = (a.ino, kind is Kind.OK_CACHE)
        return a

    async def _create_here(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr | None:
        """Create under our create lease on *parent* (memfs.meta.creates): answered
        here, the server told without waiting.  None: this one must ask the server."""
        creates = self.creates
        if not creates.inos:
            await self._reserve_inos()
        conn = self._conn
        if conn is None or conn.dead:
            return None
        made = creates.make(parent, name, mode, uid, gid, _now_ns())
        if made is None:
            return None
        a, op, call = made
        ino = a.ino
        self._hold_made(conn, op, call, lambda err, msg: self._create_failed(ino, parent, name, err, msg))
        self.opens[ino] = self.opens.get(ino, 0) + 1
        self._opens_version += 1
        self._created(Kind.OK_CACHE, parent, name, a)
        self._last_open = (ino, True)
        return a

    async def _reserve_inos(self) -> None:
        """Ask for inode numbers for our creates (once at a time)."""
        if self._reserving is not None:
            await self._reserving.wait()
            return
        self._reserving = done = trio.Event()
        try:
            first = await self._call("reserve_inos", RESERVE)
            # Not retried: answered on the connection whose registration named this token.
            self._inos_token = self.token
            self.creates.inos.extend(range(first, first + RESERVE))
        except FsError as exc:
            log.debug("no inode numbers reserved: %s", exc)
            if exc.errno == errno.EOPNOTSUPP:
                self.cache.creators.clear()
        finally:
            self._reserving = None
            done.set()

    def _unlink_here(self, parent: int, name: bytes) -> bool:
        """Unlink under our create lease on *parent* a file we made there (see
        memfs.meta.creates), the server told without waiting; False: ask the server."""
        conn = self._conn
        if conn is None or conn.dead or not self.cache.valid():
            return False
        t = _now_ns()
        removed = self.creates.remove(parent, name, t)
        if removed is None:
            return False
        ino, op, call = removed
        self._hold_made(conn, op, call, lambda err, msg: self._unlink_failed(parent, name, err, msg))
        self._removed(Kind.OK_CACHE, parent, name, ino, t, 0)
        return True

    def _hold_made(
        self, conn: _Connection, op: int, call: list[Any], refused: Callable[[int, str], None],
    ) -> None:
        """Send *call* (operation *op* of :class:`AsyncCreates`) without waiting; its
        answer settles it, and *refused* hears of a refusal."""
        creates = self.creates

        def ok(kind: Kind, payload: bytes) -> None:
            creates.answered(op)

        def failed(kind: Kind, payload: bytes) -> None:
            if creates.answered(op) is not None:
                refused(*wire.decode_error(payload))

        conn.hold(wire.encode(codec.encode_call(*call)), ok, failed)

    def _unlink_failed(self, parent: int, name: bytes, err: int, msg: str) -> None:
        """The server refused an unlink we made under a create lease (we lost the lease
        meanwhile, and another client renamed the file): ask about the directory again."""
        log.error("unlink of %r in inode %d, made under a create lease, was refused by the "
                  "metadata server: %s", name, parent, msg or os.strerror(err))
        self.cache.drop(parent)
        self.leases.drop_kernel([parent])
        self.leases.forget_kernel_names()

    def _create_failed(self, ino: int, parent: int, name: bytes, err: int, msg: str) -> None:
        """The server refused a create we made under a create lease (we lost the lease
        meanwhile, and the name or our numbers with it): the file is gone."""
        log.error("create of %r in inode %d (inode %d), made under a create lease, was refused "
                  "by the metadata server: %s; its writers get EIO", name, parent, ino,
                  msg or os.strerror(err))
        if err == errno.EINVAL:  # our reserved numbers are not ours any more
            self.creates.inos.clear()
        if self.opens.get(ino):
            self.write_errors.add(ino)
        self.cache.drop(ino)
        self.cache.drop_entry(parent, name)
        self.cache.attrs.pop(parent, None)
        self.leases.drop_kernel([ino, parent])
        self.leases.forget_kernel_names()

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        self._named_elsewhere(ino)
        kind, a = await self._call_kind("link", ino, parent, name)
        self._created(kind, parent, name, a, new=False)
        return a

    def _named_elsewhere(self, ino: int | None) -> None:
        """*ino* gets (or loses) a name the server knows: others may learn of it there,
        so it is no longer ours alone to unlink without asking."""
        if ino:
            for born in self.cache.creators.values():
                born.discard(ino)

    def _removed(self, kind: Kind, parent: int, name: bytes, child: int, t: int, links: int) -> None:
        cache = self.cache
        cache.mark(child, parent, ("names", parent))
        self._touched(kind, parent, t, links)
        cache.attrs.pop(child, None)  # nlink and ctime moved
        if kind is Kind.OK_CACHE:
            cache.put_entry(parent, name, 0)
        else:
            cache.drop_entry(parent, name)

    async def unlink(self, parent: int, name: bytes) -> None:
        if parent in self.cache.creators and self._unlink_here(parent, name):
            return
        kind, (child, t) = await self._call_kind("unlink", parent, name)
        self._removed(kind, parent, name, child, t, 0)

    async def rmdir(self, parent: int, name: bytes) -> None:
        kind, (child, t) = await self._call_kind("rmdir", parent, name)
        self._removed(kind, parent, name, child, t, -1)
        self.cache.drop(child)

    async def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        # Named elsewhere (or replaced) from now on, even if the answer never comes.
        self._named_elsewhere(self.cache.entry(parent, name))
        self._named_elsewhere(self.cache.entry(new_parent, new_name))
        kind, (src, dst, _) = await self._call_kind("rename", parent, name, new_parent, new_name, flags)
        self._named_elsewhere(src)
        self._named_elsewhere(dst)
        cache = self.cache
        cache.mark(*(i for i in (parent, new_parent, src, dst) if i),
                   ("names", parent), ("names", new_parent))
        for ino in (parent, new_parent, src, dst):
            cache.attrs.pop(ino, None)
        cache.drop_entry(parent, name)
        cache.drop_entry(new_parent, new_name)
        if kind is Kind.OK_CACHE:
            cache.put_entry(new_parent, new_name, src)
            cache.put_entry(parent, name, dst if flags & RENAME_EXCHANGE else 0)
        if src:
            cache.dirs.pop(src, None)  # its ".."

    async def readlink(self, ino: int) -> bytes:
        return await self._call("readlink", ino)

    async def readdir(self, ino: int) -> list[tuple[bytes, int]]:
        return await self._call("readdir", ino)

    async def readdirplus(self, ino: int) -> list[tuple[bytes, Attr]]:
        sent = self.cache.seq
        kind, entries = await self._call_kind("readdirplus", ino)
        if kind is Kind.OK_CACHE:
            self.cache.put_listing(ino, entries, sent)
        else:
            for _, a in entries:
                self.cache.newest(a)
        return entries

    async def open(self, ino: int) -> Attr:
        def counted(kind: Kind, payload: bytes) -> None:  # as the reply is read: no reconnection in between
            self.opens[ino] = self.opens.get(ino, 0) + 1
            self._opens_version += 1

        if (w := self.leases.settled_first(ino)) is not None:
            await w
        sent = self.cache.seq
        kind, a = await self._call_kind("open", ino, on_ok=counted)
        cacheable = kind is Kind.OK_CACHE and not self.cache.stale(ino, sent)
        if cacheable:
            self.cache.put_attr(a)
        self._last_open = (ino, cacheable)
        return a

    async def release(self, ino: int) -> None:
        if self.opens.get(ino, 0) <= 0:
            log.debug("release of inode %d, which this client does not hold open", ino)
            return
        unsure = self.opens[ino] == 1 and ino in self._ahead_unsure
        if unsure:
            self._ahead_unsure.discard(ino)
        if self.opens[ino] == 1 and (self.cache.is_writer(ino) or ino in self.cache.dirty or unsure):
            # The last handle here: our size goes to the server, our write lease and
            # the space it took ahead of need go back.
            await self.leases.settle(ino, trim=True)
        def uncount() -> None:
            n = self.opens[ino] - 1
            if n:
                self.opens[ino] = n
            else:
                del self.opens[ino]
                self.write_errors.discard(ino)
            self._opens_version += 1

        a = self.cache.attrs.get(ino)
        if a is not None and a.nlink <= 0 and self.opens[ino] == 1:
            self.cache.drop(ino)  # our last handle of an unlinked file: it is gone now
        conn = self._conn
        if conn is not None and not conn.dead:
            # Sent without a reply (with our next call): it says nothing we need, and
            # calls after it on this connection run after it.  If the connection drops
            # first, the next re-registration states our counts without it.
            conn.cast(wire.encode(codec.encode_call("release", ino)))
        uncount()

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        cache = self.cache
        if cache.term:
            known, value = cache.xattr(ino, name)
            if known:
                if value is None:
                    raise FsError(errno.ENODATA)
                return value
        sent = cache.seq
        try:
            kind, value = await self._call_kind("getxattr", ino, name)
        except FsError as exc:
            if isinstance(exc, KnownAbsent) and exc.errno == errno.ENODATA and not cache.stale(ino, sent):
                cache.put_xattr(ino, name, None)
            raise
        if kind is Kind.OK_CACHE and not cache.stale(ino, sent):
            cache.put_xattr(ino, name, value)
        return value

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        self.cache.xattrs.pop(ino, None)
        await self._call("setxattr", ino, name, value)
        self.cache.mark(ino)
        self.cache.attrs.pop(ino, None)  # ctime
        self.cache.xattrs.pop(ino, None)

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self._call("listxattr", ino)

    async def removexattr(self, ino: int, name: bytes) -> None:
        self.cache.xattrs.pop(ino, None)
        await self._call("removexattr", ino, name)
        self.cache.mark(ino)
        self.cache.attrs.pop(ino, None)
        self.cache.xattrs.pop(ino, None)

    async def statfs(self) -> StatFs:
        return await self._call("statfs")

    async def map_read(self, ino: int, offset: int, length: int) -> list[Extent]:
        if self.leases.truncating:
            await self.leases.truncates_over(ino)
        extents = await self._map_read(ino, offset, length)
        self._pages_here(ino)
        return extents

    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        if self.leases.truncating:
            await self.leases.truncates_over(ino)
        plan = await self._map_write(ino, offset, length)
        self._pages_here(ino)
        return plan

    def _pages_here(self, ino: int) -> None:
        """The kernel may keep the pages of what is read or written here (also of a
        file it was given no attributes to keep): a lost lease drops them
        (LeaseKeeper.lost).  Counted once the map is ours, under a valid lease (the
        loss of an expired one is being handled, and a read that waited for the
        connection counts once it got its map)."""
        cache = self.cache
        if cache.term and cache.valid():
            cache.kernel_inodes.add(ino)

    async def _map_read(self, ino: int, offset: int, length: int) -> list[Extent]:
        """From the cache when it knows; else, at most one call per map window on its
        way: the kernel's readahead sends several reads of one window at once, and
        they wait for the first one's answer (a cacheable map of the window around
        it) instead of each asking the mds.  A read waits once; what the answer did
        not bring to the cache it then asks for itself.  Files whose answers are not
        cacheable (still in the backing directory, recalled) are not waited for."""
        if not self.cache.term or ino in self._maps_plain:
            return await self._map_read_call(ino, offset, length)
        key = (ino, offset // codec.MAP_WINDOW)
        extents = await self._map_read_cached(ino, offset, length)
        if extents is not None:
            return extents
        asked = self._maps_asked.get(key)
        if asked is not None:
            await asked.wait()
            extents = await self._map_read_cached(ino, offset, length)
            if extents is not None:
                return extents
            return await self._map_read_call(ino, offset, length)
        self._maps_asked[key] = asked = trio.Event()
        try:
            return await self._map_read_call(ino, offset, length)
        finally:
            del self._maps_asked[key]
            asked.set()

    async def _map_read_cached(self, ino: int, offset: int, length: int) -> list[Extent] | None:
        """The map from the cache, or None: ask the mds."""
        cache = self.cache
        a = cache.attr(ino)
        if a is None and cache.files.get(ino) is not None and cache.valid():
            # A map but no size (a recall of another kind dropped it): one call
            # for the attributes, then reads go on without the mds.
            await self.getattr(ino)
            a = cache.attr(ino)
        stale_atime = a is not None and (a.atime_ns <= a.mtime_ns or a.atime_ns <= a.ctime_ns)
        if a is not None and stale_atime and cache.is_writer(ino):
            a.atime_ns = _now_ns()  # relatime, kept here: our own writes are not news
            stale_atime = False
        if a is not None and not stale_atime:
            end = min(offset + length, a.size)
            if end <= offset:
                return []
            extents = cache.extents(ino, offset, end)
            if extents is not None:
                return extents
        if stale_atime:
            cache.attrs.pop(ino, None)  # the server moves atime (relatime): ask it next time
        if (w := self.leases.settled_first(ino)) is not None:
            await w  # the server clips at the size it knows
        return None

    async def _map_read_call(self, ino: int, offset: int, length: int) -> list[Extent]:
        cache = self.cache
        while True:
            try:
                kind, extents = await self._call_kind("map_read", ino, offset, length)
            except FsError as exc:
                # The server is still fetching from its backing directory.  Ask again.
                if exc.errno != errno.EINPROGRESS:
                    raise
                continue
            if kind is Kind.OK_CACHE:
                cache.put_extents(ino, extents)
                self._maps_plain.discard(ino)
            elif cache.term:
                self._maps_plain.add(ino)  # nothing to wait for: see map_read
            # A wider window than asked comes with a lease, and stays wider when the
            # lease went with a recall before we ran (_roundtrip answers OK then).
            return _clip(extents, offset, offset + length)

    async def _map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        self._check_write_error(ino)
        cache = self.cache
        end = offset + length
        if cache.term and self.opens.get(ino):  # write leases end at close: only with a handle
            if cache.is_writer(ino) and cache.valid() and length:
                extents = cache.extents(ino, offset, end, allocated=True)
                if extents is not None:
                    cache.wrote(ino, offset, end, _now_ns())
                    self.leases.dirty_wake.set()
                    return WritePlan(extents, posted=True)
            f = cache.files.get(ino)
            sequential = offset == 0 or (f is not None and f.last_end == offset)
            ahead = 0
            if sequential and length:
                # Like readahead: a stream that keeps going gets more each time.
                ahead = min(MAX_AHEAD, max(self.stripe_size, length, 2 * f.ahead if f is not None else 0))
            method, args = "allocate_ahead", [ino, offset, length, ahead]
        else:
            method, args = "map_write", [ino, offset, length]
        if method == "allocate_ahead":
            # A close of ours reporting the end of our last lease on it goes first:
            # after a new grant the server would take it as the end of that one.
            await self.leases.lease_ended(ino)
        granted: list[Kind] = []  # the reply's kind as read (before _roundtrip's downgrade)
        sent = cache.seq
        while True:
            try:
                kind, result = await self._call_kind(method, *args, on_ok=lambda k, _: granted.append(k))
            except FsError as exc:
                # The server's write-back is behind (its dirty cap): it said so after
                # waiting a while, rather than let this call time out.  Ask again.
                if exc.errno != errno.EINPROGRESS:
                    raise
                continue
            if method == "map_write":
                plan = result
                kind = Kind.OK
            else:
                plan, a = result
            if granted and granted[-1] is Kind.OK_WRITE and length:
                # The server counted these chunks written as it answered, and holds
                # us as their writer (also when the reply came back not cacheable,
                # our generation unmoved: the write goes ahead with this plan); it
                # hears of the bytes (the span) once they have landed.
                cache.written(ino, offset, end)
                self.leases.dirty_wake.set()
            if kind is Kind.OK_WRITE or kind is Kind.OK_CACHE:
                cache.put_extents(ino, plan.extents, writer=kind is Kind.OK_WRITE)
                if cache.stale(ino, sent):  # a chmod of ours since: not those attributes
                    cache.attrs.pop(ino, None)
                else:
                    cache.put_attr(a)
                f = cache.files.get(ino)
                if f is not None:
                    f.last_end = end
                    f.ahead = args[3] if method == "allocate_ahead" else 0
            else:
                # Size, blocks, mtime moved and holes may be data now.  (Our own change:
                # maps taken before stay usable, so the generation stays.)
                cache.attrs.pop(ino, None)
                cache.files.pop(ino, None)
                if granted and granted[-1] is Kind.OK_WRITE:
                    self._ahead_unsure.add(ino)  # the server holds the lease and space for us
            return WritePlan(_clip(plan.extents, offset, end), posted=kind is Kind.OK_WRITE)

    async def control(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "flush":
            # What this node wrote under write leases is the server's to write back
            # only once it has heard of it.
            await self.sync_all()
        kind, body = await self._roundtrip(
            "control", wire.encode(["control", op, args]), retry=op in ("status", "progress")
        )
        if kind is Kind.ERROR:
            raise FsError(*wire.decode_error(body))
        result = wire.decode(body)
        if type(result) is not dict:
            raise FsError(errno.EIO, f"bad {op} reply from the metadata server")
        return result

    async def reclaim(self) -> None:
        await self._call("reclaim")


def _clip(extents: list[Extent], start: int, end: int) -> list[Extent]:
    """*extents* within ``[start, end)`` (the server answers with a wider window)."""
    out = []
    for e in extents:
        e_end = e.offset + e.length
        if e_end <= start:
            continue
        if e.offset >= end:
            break
        lo, hi = max(e.offset, start), min(e_end, end)
        if hi <= lo:
            continue
        if (lo, hi) != (e.offset, e_end):
            e = Extent(lo, hi - lo, e.volume, e.voffset + (lo - e.offset) if e.volume >= 0 else e.voffset)
        out.append(e)
    return out


#: the clock the metadata server stamps with too: timestamps stay in the kernel's order
_now_ns = clock.now_ns


@asynccontextmanager
async def open_remote_meta(
    # Not this function's deadline (ASYNC109): every later call's, for the client's life.
    host: str, port: int, secret: bytes, *, timeout: float = 10.0,  # noqa: ASYNC109
) -> AsyncIterator[RemoteMeta]:
    """A connected :class:`RemoteMeta`; its background tasks live until the block ends.

    ``FsError`` (EIO, or EACCES for a refused secret) if the first connection fails.
    """
    meta = RemoteMeta(host, port, secret, timeout=timeout)
    await meta.connect()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(meta.run)
            try:
                yield meta
            finally:
                await meta.aclose()
    except BaseExceptionGroup as group:
        # Our own tasks never raise, so a lone exception is the caller's: give it back
        # as it was raised rather than wrapped by the nursery.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
