"""RemoteMeta: the :class:`~memfs.meta.Meta` interface served by ``memfs mds``.

One TCP connection carries many outstanding calls (request ids); a writer task
sends, a reader task matches replies to callers, and a keepalive ping keeps an
idle connection provably alive (:mod:`memfs.meta.remote_conn`).
:func:`open_remote_meta` owns the nursery these tasks run in.  Chunk maps for
reads and writes: :mod:`memfs.meta.remote_maps`; truncates and punched holes:
:mod:`memfs.meta.remote_cut`; the lease token and the memory servers taken back:
:mod:`memfs.meta.remote_pool`; creates, unlinks, opens, setattrs and access times
made under a lease and told without waiting: :mod:`memfs.meta.remote_held`.

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
    check_xattr_name,
    clock,
    codec,
    set_ids_to_drop,
)
from memfs.meta.cache import READ_AT, ClientCache
from memfs.meta.conn import MAX_REPLY, FrameSocket
from memfs.meta.creates import AsyncCreates
from memfs.meta.lease_client import LeaseKeeper
from memfs.meta.lock_client import LockClient
from memfs.meta.remote_conn import (
    NOT_CACHEABLE,
    PING,
    REPLY_KINDS,
    MdsConnection,
    OnReply,
    handshake,
)
from memfs.meta.remote_cut import Cutter, ZeroTails
from memfs.meta.remote_held import HeldCalls
from memfs.meta.remote_maps import MapClient
from memfs.meta.remote_pool import PoolFollower, incarnations_from_wire
from memfs.net import connect
from memfs.wire import Kind, WireError

log = logging.getLogger(__name__)

#: at close, what is held or queued gets this long to reach the socket (the server may hang)
CLOSE_FLUSH = 1.0
RECONNECT_MIN = 0.05
RECONNECT_MAX = 2.0
#: what a failed connection attempt raises (FsError aside)
_CONNECT_ERRORS = (
    OSError, WireError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
)


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
    #: most creates and unlinks one ``made`` call may carry (0: the server takes none)
    made_max: int = 0
    #: the server places ``O_APPEND`` writes itself (``codec.append_offset``)
    appends: bool = False
    #: a ``made`` call may carry opens (``codec.HELD_CALLS``): see HeldCalls.open_here
    held_opens: bool = False
    #: and setattrs made under a write or create lease (``setattr_at``): see HeldCalls.setattr_here
    held_setattrs: bool = False
    #: and access times of reads from cached maps (``atime_at``): see MapClient.read
    held_atimes: bool = False

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
                incarnations=incarnations_from_wire(v.get("incarnations", {})),
                lease_term=_lease_term(v.get("lease_term", 0.0)),
                recall_timeout=_lease_term(v.get("recall_timeout", 0.0)),
                made_max=max(0, codec.check_int(v.get("made_max", 0), "made_max")),
                appends=v.get("appends") is True,
                held_opens=v.get("held_opens") is True,
                held_setattrs=v.get("held_setattrs") is True,
                held_atimes=v.get("held_atimes") is True,
            )
        except KeyError as exc:
            raise WireError(f"describe: missing {exc}") from None


class KnownAbsent(FsError):
    """An error the server says the client may cache under its lease (an absent name)."""


class FilesystemGone(FsError):
    """The server came back with another filesystem (it restarted without its journal)."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EIO, msg)


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
        self._conn: MdsConnection | None = None
        #: registrations that replayed setattrs the server closed in a row (_register)
        self._no_setattr_at = 0
        self._ready = trio.Event()
        self._closed = False
        self._scope = trio.CancelScope()
        self._first: MdsConnection | None = None
        self._gone: FilesystemGone | None = None
        #: what this client may serve without asking, under its lease
        self.cache = ClientCache()
        #: creates made under create leases (memfs.meta.creates)
        self.creates = AsyncCreates(self.cache)
        self.leases = LeaseKeeper(self.cache, self._call, self, self.creates)
        #: calls made under a lease and told without waiting (memfs.meta.remote_held)
        self.held = HeldCalls(self.cache, self.creates, self.leases, lambda: self._conn,
                              lambda: self.token, self._call, self.opens, self.write_errors,
                              self.count_open, self._gone_here)
        #: this client's cluster-wide file locks
        self.lock_client = LockClient(self.session, self._call)
        #: the chunk maps reads and writes go by (memfs.meta.remote_maps)
        self.maps = MapClient(self.cache, self.leases, self._call_kind, self.getattr,
                              self.opens, self._check_write_error)
        self.maps.touch = self.held.touch_atime
        #: truncates and punches (memfs.meta.remote_cut)
        self.cutter = Cutter(self.cache, self.leases, self.maps, self._call, timeout)
        self._last_open: tuple[int, bool] = (0, False)
        #: the lease token our memory-server connections name (from the registration);
        #: a new one means the server took our leases without our word, or restarted
        self.token = 0
        #: the token our memory-server connections name, and the servers the mds took
        #: back (memfs.meta.remote_pool)
        self.pool_follower = PoolFollower(self.leases)

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

    async def _connection_loop(self, conn: MdsConnection) -> None:
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

    async def _connect(self, first: bool) -> MdsConnection:
        with trio.fail_after(self.timeout):
            fs = FrameSocket(await connect(self.host, self.port), MAX_REPLY)
            try:
                await handshake(fs, self.secret, self.address)
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
        # (Also after a restart: the server may have been upgraded or downgraded.)
        self.maps.appends = desc.appends
        self.held.takes_opens = desc.held_opens
        self.held.takes_setattrs = desc.held_setattrs
        self.held.takes_atimes = desc.held_atimes
        # (Marks its writers without a lease only with leases: their writes wait without.)
        self.maps.posts_unleased = desc.lease_term > 0
        self._no_setattr_at = 0
        if first:
            self.pool = desc
            self.chunk_size, self.n_volumes = desc.chunk_size, desc.n_volumes
            self.maps.stripe_size = desc.stripe_size
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
        if self.token != self.held.inos_token:
            # A token other than the one our numbers came under: our session expired
            # (the numbers reserved for it went with it), our leases were taken, or the
            # server restarted; the server forgets them too (SessionClaims.claim).
            # Compared with the reservation's token, not the last attempt's: an attempt
            # that registered and then failed must not hide the change.
            self.creates.inos.clear()
        self.cache.dirty.clear()  # told with the registration
        self.cache.answered.clear()
        # A new token named (every transfer of our transport begun under the old one
        # has ended: _connection_loop waited before reconnecting), and the memory
        # servers the mds took back (restarted blank) told, now that our caches are
        # gone and our transfers ended; later ones come in POOL frames.
        self.pool_follower.registered(self.token, desc.incarnations, first=first)
        return MdsConnection(fs, self.timeout, self.cache, self.leases.on_recall,
                             self.lock_client.unlocked, self.pool_follower.heard_frame,
                             made_max=desc.made_max)

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

    async def _register(
        self, fs: FrameSocket, fence: int = 0,
    ) -> tuple[list[int], list[int], PoolDescription]:
        """Name our session with our open handles and the sizes we wrote; ask for the
        pool description.  Returns the inodes gone, those whose sizes were refused, and
        the description.  *fence*: the lease token transfers that may still run were
        made under (other processes'): the server fences it before the registration
        answers the recalls sent to us."""
        self.pool_follower.heard = {}  # (one heard in an attempt that failed: the describe says it)
        # Sizes written under write leases that the server has not heard yet (again on
        # a second pass: one applied is no longer larger than the known size, one
        # refused is refused again, and a refusal is only heard with an answer).
        told = {**self.cache.answered, **self.cache.dirty}
        settles = [[ino, size, mtime] for ino, (size, mtime) in told.items()]
        failed: list[int] = []
        # Creates and unlinks made under create leases (and setattrs under write
        # leases) and not answered: applied first, in order.
        ops = self.creates.unanswered()
        if self._no_setattr_at >= 2:
            # The server closed the last two registrations that carried some: an
            # older mds (a downgrade at a restart) takes none.  Failed here, not sent
            # again.  (One close may be a restart or a cut: they go again first.)
            for op, c in ops:
                if c[0] == "setattr_at" and self.creates.answered(op) is not None:
                    self.held.setattr_failed(c[1], errno.EOPNOTSUPP, "an older metadata server")
            ops = [(op, c) for op, c in ops if c[0] != "setattr_at"]
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
                    carried = any(c[0] == "setattr_at" for _, c in ops)
                    self._no_setattr_at = self._no_setattr_at + 1 if carried else 0
                    raise WireError("connection closed during registration")
                h = got[0]
                if h.kind is Kind.UNLOCKED:  # (a lock went while the server registered us)
                    self.lock_client.unlocked(codec.check_int(wire.decode(got[1])[0], "unlocked inode"))
                    continue
                if h.kind is Kind.POOL:  # (adopted once our new token is named, in _connect)
                    self.pool_follower.heard.update(incarnations_from_wire(wire.decode(got[1])))
                    continue
                if h.kind is Kind.RECALL:
                    # We hold nothing: every cache went before we registered, and
                    # transfers under old maps have ended.
                    await fs.send(wire.frame(Kind.RECALLED, h.req_id, wire.encode([])))
                    continue
                if h.kind not in REPLY_KINDS or h.req_id not in (1, 2):
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
                self.held.replay_refused(ops, refused_ops)
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
                if (p.recalls != conn.recalls or self.cache.cuts != cuts) and p.kind in NOT_CACHEABLE:
                    return NOT_CACHEABLE[p.kind], p.payload  # (callers cache with no await)
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
        payload = codec.call_payload(method, *args)
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

    def entry_ttl(self, parent: int, name: bytes, ino: int, listed: bool = False) -> float | None:
        return self.leases.entry_ttl(parent, name, ino, listed)

    def keep_cache(self, ino: int) -> bool | None:
        if not self.cache.term:
            return None
        last, cacheable = self._last_open
        return cacheable and last == ino and not self.cache.invalidating

    def follow_token(self, name: Callable[[int], None]) -> None:
        """Call *name* with our lease token now and after each registration that brings
        a new one (once the transfers begun under the old one have ended): the mount
        passes it to its transport, which drops connections that named an older one."""
        self.pool_follower.follow_token(name, self.token)

    def follow_pool(self, adopt: Callable[[dict[str, int]], None]) -> None:
        """Call *adopt* with the memory servers the mds takes back ("host:port" ->
        incarnation; memfs.meta.takeback) from now on: told on our session once it
        answered the recalls of their files, or when we register again (our caches
        dropped, our transfers ended), also after an mds restart."""
        self.pool_follower.follow(adopt)

    def locks(self) -> LockClient:
        return self.lock_client

    def order_sizes_after(self, barrier: Callable[[int], Awaitable[None]]) -> None:
        self.leases.barrier = barrier

    def zero_tails_with(self, zero: ZeroTails) -> None:
        self.cutter.zero_tails = zero

    def truncating(self, ino: int) -> bool:
        return ino in self.leases.truncating

    async def truncates_over(self, ino: int) -> None:
        await self.leases.truncates_over(ino)

    def sizes_change_elsewhere(self) -> bool:
        return True

    async def end_of_file(self, ino: int) -> int:
        # A truncate of ours under way ends first.  Then the cache has it, under our
        # lease; or the server is asked, once what we told it of our writes has
        # reached it: a recall dropped the cache, and the server ignores reports
        # that meet a recall, so before the recall's answer its size would be where
        # our last appends began, and the next one would go over them.
        await self.leases.truncates_over(ino)
        if self.cache.attr(ino) is None:
            await self.leases.reports_sent(ino)
            await self.leases.answer_known(ino)
        return (await self.getattr(ino)).size

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
        await self.held.wait_answered(ino, self.timeout * 2)
        cache = self.cache
        if ino in cache.dirty or ino in cache.spans or ino in cache.sending:
            await self.leases.settle(ino, trim=False, again=True)
        await self.leases.answer_known(ino)  # our size went in the answer to a recall
        if ino in cache.dirty or ino in cache.answered:
            # Not known to have arrived: the connection went.  The next registration
            # carries it; once a call goes through, the server has heard it (or said
            # that it was lost: write_errors).
            await self._roundtrip("ping", PING, retry=True)
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

    async def find(self, parent: int, name: bytes) -> Attr | None:
        if self.cache.term and self.cache.entry(parent, name) == 0:
            return None  # known absent under our lease: no exception (a create's lookup)
        return await super().find(parent, name)

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
        if (a := self.held.setattr_here(ino, changes)) is not None:
            return a
        if (w := self.leases.settled_first(ino)) is not None:
            await w
        if changes.mtime_ns is None:
            kind, a = await self._call_kind("setattr", ino, changes)
        else:
            # Our reports taken before go first; none is taken, and no recall answer
            # carries our writes' mtime, until the reply is in the cache.
            await self.leases.reports_sent(ino)  # (no await from here to the call's send)
            with self.leases.setting_mtime(ino):
                kind, a = await self._call_kind("setattr", ino, changes)
                self.cache.mtime_set(ino, a.mtime_ns)  # (before the reply is cached, or told)
        for t in (changes.atime_ns, changes.mtime_ns):
            if t is not None:
                clock.saw(t)  # (the stamps of our writes under a lease come after it)
        self.cache.changed(a, kind is Kind.OK_CACHE)
        return a

    async def drop_privileges(self, ino: int, set_ids: bool) -> bool:
        """One call that drops and says whether it did (never a read-modify-write a
        chmod elsewhere could slip into), and none when the attributes and the
        capability xattr, as this client caches them under its lease, show nothing to
        drop: after the first, the case of almost every write.

        Without the attributes cached the call itself, unless we hold the file's
        write lease (then a ``getattr`` recalls no one, and spares the calls of
        later writes): from another node's write lease a ``getattr`` would revoke
        it, and nodes writing one file in turn (IOR's shared file) revoked each
        other's lease at every write so.  (A map call of a write brings the
        attributes back.)"""
        cache = self.cache
        if cache.term and cache.attr(ino) is None and cache.is_writer(ino):
            await self.getattr(ino)
        if cache.term and cache.attr(ino) is not None:
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

    async def truncate(self, ino: int, size: int) -> list[tuple[int, int, int]]:
        """See :mod:`memfs.meta.remote_cut`."""
        return await self.cutter.cut(ino, "truncate", size)

    async def seek(self, ino: int, offset: int, whence: int) -> int:
        """The server's chunk map says, once it has our sizes (and, by recalling them,
        other writers')."""
        await self.cutter.sizes_told(ino)
        found: int = await self._call("seek", ino, offset, whence)
        return found

    async def punch(self, ino: int, offset: int, length: int) -> list[tuple[int, int, int]]:
        """As a truncate (see :mod:`memfs.meta.remote_cut`), the size kept."""
        return await self.cutter.cut(ino, "punch", offset, length)

    async def mknod(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int,
        rdev: int = 0, target: bytes | None = None,
    ) -> Attr:
        kind, a = await self._call_kind("mknod", parent, name, mode, uid, gid, rdev, target)
        self.cache.created(parent, name, a, kind is Kind.OK_CACHE)
        return a

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        if parent in self.cache.creators:
            a = await self.held.create_here(parent, name, mode, uid, gid)
            if a is not None:
                self._last_open = (a.ino, True)
                return a

        def counted(kind: Kind, payload: bytes) -> None:  # as the reply is read: no reconnection in between
            ino = wire.decode(payload)[0]
            self.count_open(ino)
            if kind is Kind.OK_WRITE:  # a create lease on the directory (before any recall of it)
                self.cache.creators.setdefault(parent, set())

        kind, a = await self._call_kind("create", parent, name, mode, uid, gid, on_ok=counted)
        if kind is Kind.OK_WRITE:
            kind = Kind.OK_CACHE
        self.cache.created(parent, name, a, kind is Kind.OK_CACHE)
        self._last_open = (a.ino, kind is Kind.OK_CACHE)
        return a

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        self.cache.named_elsewhere(ino)
        kind, a = await self._call_kind("link", ino, parent, name)
        self.cache.created(parent, name, a, kind is Kind.OK_CACHE, new=False)
        return a

    async def unlink(self, parent: int, name: bytes) -> None:
        if parent in self.cache.creators and self.held.unlink_here(parent, name):
            return
        kind, (child, t) = await self._call_kind("unlink", parent, name)
        self.cache.removed(parent, name, child, t, 0, kind is Kind.OK_CACHE)
        self._gone_here(child)

    def count_open(self, ino: int) -> None:
        """A handle of *ino* opened here: counted, and claimed by every registration."""
        self.opens[ino] = self.opens.get(ino, 0) + 1
        self._opens_version += 1

    def _gone_here(self, ino: int) -> None:
        """We unlinked (or renamed over) *ino*: its chunk map goes now, unless a handle
        here still reads by it (then at its last close): the mds may have destroyed
        the file, and then never recalls it."""
        if ino and not self.opens.get(ino):
            self.cache.files.pop(ino, None)

    async def rmdir(self, parent: int, name: bytes) -> None:
        kind, (child, t) = await self._call_kind("rmdir", parent, name)
        self.cache.removed(parent, name, child, t, -1, kind is Kind.OK_CACHE)
        self.cache.drop(child)

    async def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        # The kernel moves its dentry, with the entry timeout it had, to the new name:
        # counted from before the call, so a recall of that name read before our caller
        # runs again makes the kernel forget it.
        self.leases.kernel_named(new_parent, new_name)
        if flags & RENAME_EXCHANGE:
            self.leases.kernel_named(parent, name)
        # Named elsewhere (or replaced) from now on, even if the answer never comes.
        self.cache.named_elsewhere(self.cache.entry(parent, name))
        self.cache.named_elsewhere(self.cache.entry(new_parent, new_name))
        kind, (src, dst, _) = await self._call_kind("rename", parent, name, new_parent, new_name, flags)
        self.cache.named_elsewhere(src)
        self.cache.named_elsewhere(dst)
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
        if not flags & RENAME_EXCHANGE:
            if dst in cache.dirs:
                cache.drop(dst)  # a directory renamed over is gone (not recalled: ours)
            self._gone_here(dst)

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
            self.count_open(ino)

        if (w := self.leases.settled_first(ino)) is not None:
            await w
        if (a := self.held.open_here(ino)) is not None:
            self._last_open = (ino, True)
            return a
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
        unsure = self.opens[ino] == 1 and ino in self.maps.ahead_unsure
        if unsure:
            self.maps.ahead_unsure.discard(ino)
        if self.opens[ino] == 1 and (self.cache.is_writer(ino) or ino in self.cache.dirty or unsure):
            # The last handle here: our size goes to the server, our write lease and
            # the space it took ahead of need go back.
            f = self.cache.files.get(ino)
            read_here = f is not None and f.read_here
            await self.leases.settle(ino, trim=True)
            if read_here and (a := self.cache.attr(ino)) is not None:
                # Our reads under the lease moved the access time here only (once the
                # lease ends, the map we keep serves reads, and nothing would tell it).
                self.held.touch_atime(ino, a.atime_ns)
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
        elif a is None and self.opens[ino] == 1:
            self.cache.files.pop(ino, None)  # (unlinked here, maybe: see _gone_here)
        conn = self._conn
        if conn is not None and not conn.dead:
            # Sent without a reply (before our next call): it says nothing we need,
            # and calls after it on this connection run after it (held asynchronous
            # creates and unlinks go first: MdsConnection.release).  If the
            # connection drops first, the next re-registration states our counts
            # without it.
            conn.release(ino)
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
        check_xattr_name(name)  # (refused here: no call)
        self.cache.xattrs.pop(ino, None)
        await self._call("setxattr", ino, name, value)
        self.cache.mark(ino)
        self.cache.attrs.pop(ino, None)  # ctime
        self.cache.xattrs.pop(ino, None)

    async def listxattr(self, ino: int) -> list[bytes]:
        cache = self.cache
        if cache.term and (names := cache.xattr_names(ino)) is not None:
            return names
        sent = cache.seq
        kind, names = await self._call_kind("listxattr", ino)
        if kind is Kind.OK_CACHE and not cache.stale(ino, sent):
            cache.put_xattr_names(ino, names)  # (a getxattr of any other name: ENODATA)
        return names

    async def removexattr(self, ino: int, name: bytes) -> None:
        self.cache.xattrs.pop(ino, None)
        await self._call("removexattr", ino, name)
        self.cache.mark(ino)
        self.cache.attrs.pop(ino, None)
        self.cache.xattrs.pop(ino, None)

    async def statfs(self) -> StatFs:
        return await self._call("statfs")

    async def map_read(self, ino: int, offset: int, length: int) -> list[Extent]:
        return await self.maps.read(ino, offset, length)

    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        return await self.maps.write(ino, offset, length)

    async def map_append(self, ino: int, length: int) -> tuple[int, WritePlan]:
        if self.maps.appends:
            return await self.maps.append(ino, length)
        return await super().map_append(ino, length)  # an older server: end_of_file

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
