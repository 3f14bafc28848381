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
"""

from __future__ import annotations

import errno
import logging
import os
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from memfs import wire
from memfs.errors import FsError, SpaceBusy
from memfs.meta import Attr, Extent, Meta, SetAttr, StatFs, WritePlan, codec
from memfs.meta.conn import MAX_REPLY, ROLE, FrameSocket
from memfs.net import connect
from memfs.wire import Kind, WireError

log = logging.getLogger(__name__)

#: an idle connection sends a ping this often; the server drops silent ones
KEEPALIVE = 5.0
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
            )
        except KeyError as exc:
            raise WireError(f"describe: missing {exc}") from None


class AuthRefused(FsError):
    """The server refused our secret (or we refused its proof)."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EACCES, msg)


class FilesystemGone(FsError):
    """The server came back with another filesystem (it restarted without its journal)."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EIO, msg)


class _Pending:
    __slots__ = ("event", "kind", "payload", "lost", "on_ok")

    def __init__(self, on_ok: Callable[[], None] | None) -> None:
        self.event = trio.Event()
        self.kind = Kind.ERROR
        self.payload = b""
        self.lost = False
        self.on_ok = on_ok


class _Connection:
    """One authenticated connection and the calls outstanding on it."""

    def __init__(self, fs: FrameSocket, timeout: float) -> None:
        self.fs = fs
        self.timeout = timeout
        self.pending: dict[int, _Pending] = {}
        self.dead = False
        self.reason = "closed"
        self._next_id = 1
        self._wake = trio.Event()
        self._scope = trio.CancelScope()
        self._last_send = trio.current_time()

    def request(self, payload: bytes, on_ok: Callable[[], None] | None = None) -> tuple[int, _Pending]:
        """Send a call (no await: callers do their bookkeeping atomically with it)."""
        rid = self._next_id
        self._next_id = rid % 0xFFFFFFFF + 1
        p = _Pending(on_ok)
        self.pending[rid] = p
        try:
            self.fs.send_now(wire.frame(Kind.CALL, rid, payload))
        except trio.BrokenResourceError as exc:
            self.kill(f"send failed: {exc}")
        else:
            if self.fs.pending():
                self._wake.set()
        self._last_send = trio.current_time()
        return rid, p

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
        limit = KEEPALIVE + self.timeout  # the server answers our pings well within this
        try:
            # One scope whose deadline moves: cheaper than a fail_after per frame.
            with trio.CancelScope() as silent:
                while True:
                    silent.deadline = trio.current_time() + limit
                    got = await self.fs.receive()
                    if got is None:
                        self.kill("closed by the server")
                        return
                    h, payload = got
                    if h.kind not in (Kind.OK, Kind.ERROR):
                        raise WireError(f"unexpected {h.kind.name} frame")
                    p = self.pending.pop(h.req_id, None)
                    if p is None:
                        continue  # the caller gave up on it (timeout, or a ping)
                    p.kind, p.payload = h.kind, payload
                    if p.on_ok is not None and h.kind is Kind.OK:
                        p.on_ok()
                    p.event.set()
            if silent.cancelled_caught:
                self.kill(f"silent for {limit:.0f} s")
        except WireError as exc:
            log.error("metadata server broke the protocol: %s", exc)
            self.kill(f"protocol error: {exc}")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.kill(f"receive failed: {exc}")

    async def _keepalive(self) -> None:
        while True:
            await trio.sleep_until(self._last_send + KEEPALIVE)
            if trio.current_time() >= self._last_send + KEEPALIVE:
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
        self._opens_version = 0
        self._conn: _Connection | None = None
        self._ready = trio.Event()
        self._closed = False
        self._scope = trio.CancelScope()
        self._first: _Connection | None = None
        self._gone: FilesystemGone | None = None

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
            backoff = RECONNECT_MIN
            while True:
                self._conn = conn
                self._ready.set()
                try:
                    await conn.run()
                finally:
                    self._conn = None
                    self._ready = trio.Event()
                down_since = trio.current_time()
                log.warning("lost the metadata server at %s (%s); reconnecting", self.address, conn.reason)
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
                lost, desc = await self._register(fs)
            except BaseException:
                fs.close()
                raise
        if first:
            self.pool = desc
            self.chunk_size, self.n_volumes = desc.chunk_size, desc.n_volumes
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
        return _Connection(fs, self.timeout)

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

    async def _register(self, fs: FrameSocket) -> tuple[list[int], PoolDescription]:
        """Name our session with our open handles; ask for the pool description."""
        while True:
            version = self._opens_version
            claimed = [[ino, n] for ino, n in self.opens.items() if n > 0]
            await fs.send(
                wire.frame(Kind.CALL, 1, wire.encode(["session", self.session, claimed]))
                + wire.frame(Kind.CALL, 2, wire.encode(["describe"]))
            )
            replies: dict[int, tuple[wire.Header, bytes]] = {}
            while len(replies) < 2:
                got = await fs.receive()
                if got is None:
                    raise WireError("connection closed during registration")
                replies[got[0].req_id] = got
            values = []
            for rid in (1, 2):
                h, payload = replies[rid]
                if h.kind is Kind.ERROR:
                    err, msg = wire.decode_error(payload)
                    raise FsError(err, f"metadata server refused registration: {msg}")
                values.append(wire.decode(payload))
            lost = [codec.check_int(x, "lost inode") for x in codec.check_list(values[0], "lost")]
            desc = PoolDescription.from_wire(values[1])
            # A release that could not reach the server changed our counts meanwhile.
            if version == self._opens_version:
                return lost, desc

    async def aclose(self) -> None:
        self._closed = True
        self._scope.cancel()
        self._ready.set()  # wake callers waiting for a connection: they fail now

    # -- calls ---------------------------------------------------------------------------------

    async def _roundtrip(
        self, method: str, payload: bytes, *, retry: bool,
        on_send: Callable[[], None] | None = None, on_ok: Callable[[], None] | None = None,
    ) -> tuple[Kind, bytes]:
        with trio.move_on_after(self.timeout):
            while True:
                conn = self._conn
                while conn is None or conn.dead:
                    if self._closed:
                        raise FsError(errno.EIO, "metadata client is closed")
                    if self._gone is not None:
                        raise FsError(errno.EIO, self._gone.args[1])
                    await self._ready.wait()
                    conn = self._conn
                if self._closed:
                    raise FsError(errno.EIO, "metadata client is closed")
                rid, p = conn.request(payload, on_ok)
                if on_send is not None:
                    on_send()
                    on_send = None
                try:
                    await p.event.wait()
                finally:
                    if not p.event.is_set() and conn.pending.pop(rid, None) is not None:
                        # Our deadline passed with the call on the wire: the server is
                        # hung or unreachable.  Start over on a fresh connection.
                        conn.kill(f"no reply to {method} within {self.timeout:.0f} s")
                if not p.lost:
                    return p.kind, p.payload
                if not retry:
                    raise FsError(
                        errno.EIO,
                        f"lost the metadata server during {method}: it may or may not have been applied",
                    )
        raise FsError(errno.EIO, f"metadata server {self.address} did not answer {method} "
                                 f"within {self.timeout:g} s")

    async def _call(self, method: str, *args: Any, on_ok: Callable[[], None] | None = None,
                    on_send: Callable[[], None] | None = None) -> Any:
        m = codec.METHODS[method]
        payload = wire.encode(codec.encode_call(method, *args))
        kind, body = await self._roundtrip(method, payload, retry=m.retry, on_ok=on_ok, on_send=on_send)
        if kind is Kind.ERROR:
            err, msg = wire.decode_error(body)
            if err == errno.EAGAIN and method == "map_write":
                # Only freed space is left: the data engine reclaims and retries on
                # SpaceBusy (a plain EAGAIN would reach the application).
                raise SpaceBusy()
            raise FsError(err, msg)
        try:
            return m.result_from_wire(wire.decode(body))
        except WireError as exc:
            log.error("bad %s reply from the metadata server: %s", method, exc)
            raise FsError(errno.EIO, f"bad {method} reply from the metadata server") from None

    async def describe(self) -> PoolDescription:
        kind, body = await self._roundtrip("describe", wire.encode(["describe"]), retry=True)
        if kind is Kind.ERROR:
            raise FsError(*wire.decode_error(body))
        return PoolDescription.from_wire(wire.decode(body))

    # -- Meta ------------------------------------------------------------------------------------

    async def lookup(self, parent: int, name: bytes) -> Attr:
        return await self._call("lookup", parent, name)

    async def getattr(self, ino: int) -> Attr:
        return await self._call("getattr", ino)

    async def setattr(self, ino: int, changes: SetAttr) -> Attr:
        return await self._call("setattr", ino, changes)

    async def truncate(self, ino: int, size: int) -> list[tuple[int, int, int]]:
        return await self._call("truncate", ino, size)

    async def mknod(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int,
        rdev: int = 0, target: bytes | None = None,
    ) -> Attr:
        return await self._call("mknod", parent, name, mode, uid, gid, rdev, target)

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        return await self._call("link", ino, parent, name)

    async def unlink(self, parent: int, name: bytes) -> None:
        await self._call("unlink", parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self._call("rmdir", parent, name)

    async def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        await self._call("rename", parent, name, new_parent, new_name, flags)

    async def readlink(self, ino: int) -> bytes:
        return await self._call("readlink", ino)

    async def readdir(self, ino: int) -> list[tuple[bytes, int]]:
        return await self._call("readdir", ino)

    async def open(self, ino: int) -> Attr:
        def counted() -> None:  # runs as the reply is read: no reconnection in between
            self.opens[ino] = self.opens.get(ino, 0) + 1
            self._opens_version += 1

        return await self._call("open", ino, on_ok=counted)

    async def release(self, ino: int) -> None:
        if self.opens.get(ino, 0) <= 0:
            log.debug("release of inode %d, which this client does not hold open", ino)
            return
        sent = False

        def uncount() -> None:  # runs as the request is queued, atomically with it
            nonlocal sent
            sent = True
            n = self.opens[ino] - 1
            if n:
                self.opens[ino] = n
            else:
                del self.opens[ino]
            self._opens_version += 1

        try:
            await self._call("release", ino, on_send=uncount)
        except FsError as exc:
            # The next re-registration tells the server; nothing is lost.
            log.debug("release of inode %d not confirmed (%s); settled at reconnection", ino, exc)
            if not sent:
                uncount()

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self._call("getxattr", ino, name)

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        await self._call("setxattr", ino, name, value)

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self._call("listxattr", ino)

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self._call("removexattr", ino, name)

    async def statfs(self) -> StatFs:
        return await self._call("statfs")

    async def map_read(self, ino: int, offset: int, length: int) -> list[Extent]:
        while True:
            try:
                return await self._call("map_read", ino, offset, length)
            except FsError as exc:
                # The server is still fetching from its backing directory.  Ask again.
                if exc.errno != errno.EINPROGRESS:
                    raise

    async def map_write(self, ino: int, offset: int, length: int) -> WritePlan:
        while True:
            try:
                return await self._call("map_write", ino, offset, length)
            except FsError as exc:
                # The server's write-back is behind (its dirty cap): it said so after
                # waiting a while, rather than let this call time out.  Ask again.
                if exc.errno != errno.EINPROGRESS:
                    raise

    async def control(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
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
