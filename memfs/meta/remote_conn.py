"""One client connection to ``memfs mds``: calls outstanding on it, and the tasks
that serve it (see :mod:`memfs.meta.remote` for reconnection and deadlines).

A writer task sends what the socket did not take at once, a reader task matches
replies to callers (and hands recalls and unlock notices on, without waiting), a
watchdog ends a connection whose oldest call waited too long, and a keepalive
ping keeps an idle one (and the client's lease) provably alive.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

import trio

from memfs import wire
from memfs.errors import FsError
from memfs.meta import codec
from memfs.meta.cache import ClientCache
from memfs.meta.conn import ROLE, FrameSocket
from memfs.meta.creates import CREATE_HOLD
from memfs.wire import Kind, WireError

log = logging.getLogger(__name__)

#: an idle connection sends a ping this often; the server drops silent ones
KEEPALIVE = 5.0
#: calls without reply (releases) wait at most this long for a call to go with
HOLD_MAX = 0.25
PING = wire.encode(["ping"])
_MADE = codec.METHODS["made"]


class AuthRefused(FsError):
    """The server refused our secret (or we refused its proof)."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EACCES, msg)


async def handshake(fs: FrameSocket, secret: bytes, address: str) -> None:
    """Authenticate on a new connection to ``memfs mds`` (as a metadata client):
    :class:`AuthRefused` if either side refuses."""
    hs = wire.Handshake(secret)
    got = await fs.receive()
    if got is None:
        raise AuthRefused(f"{address} closed the connection before greeting")
    h, payload = got
    if h.kind is Kind.ERROR:
        raise AuthRefused(f"{address} refused: {wire.decode_error(payload)[1]}")
    if h.kind is not Kind.HELLO:
        raise WireError(f"expected HELLO, got {h.kind.name}")
    await fs.send(wire.frame(Kind.AUTH, 0, hs.auth(payload, ROLE)))
    try:
        got = await fs.receive()
    except trio.BrokenResourceError:  # reset: e.g. a memory server refusing our role
        got = None
    if got is None:
        raise AuthRefused(
            f"{address} refused authentication (wrong secret, or not a metadata server?)"
        )
    h, payload = got
    if h.kind is Kind.ERROR:
        raise AuthRefused(f"{address} refused authentication: {wire.decode_error(payload)[1]}")
    if h.kind is not Kind.WELCOME:
        raise WireError(f"expected WELCOME, got {h.kind.name}")
    try:
        hs.check_welcome(payload)
    except WireError as exc:
        raise AuthRefused(f"{address}: {exc}") from None


#: run by the reader as a reply is read (no reconnection in between): (kind, payload)
OnReply = Callable[[Kind, bytes], None]


class Pending:
    """A call sent on a connection, until its reply is read (or the connection lost)."""

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
OK_KINDS = frozenset({Kind.OK, Kind.OK_CACHE, Kind.OK_WRITE})
REPLY_KINDS = OK_KINDS | {Kind.ERROR, Kind.ERROR_CACHE}
#: what a cacheable reply kind becomes when a recall came between reading the reply
#: and its caller's turn (see MdsConnection.recalls)
NOT_CACHEABLE = {Kind.OK_CACHE: Kind.OK, Kind.OK_WRITE: Kind.OK, Kind.ERROR_CACHE: Kind.ERROR}


def _counted(kind: Kind, payload: bytes) -> None:
    """A held open's answer: nothing to do."""


class MdsConnection:
    """One authenticated connection and the calls outstanding on it."""

    def __init__(
        self, fs: FrameSocket, timeout: float, cache: ClientCache,
        on_recall: Callable[[MdsConnection, int, bytes], None],
        on_unlocked: Callable[[int], None],
        on_pool: Callable[[bytes], None] = lambda payload: None, *, made_max: int = 0,
    ) -> None:
        self.fs = fs
        self.timeout = timeout
        self.cache = cache
        self.on_recall = on_recall
        self.on_unlocked = on_unlocked
        #: a POOL frame's payload: memory servers the mds took back (PoolFollower.heard_frame)
        self.on_pool = on_pool
        #: idle pings this often keep the lease (and the connection) alive
        self.keepalive = min(KEEPALIVE, cache.term / 4) if cache.term else KEEPALIVE
        self.pending: dict[int, Pending] = {}
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
        #: frames not sent yet (of the calls below): they go with the next call, the
        #: create hold's flush, or a ping
        self._held = bytearray()
        #: asynchronous creates and unlinks held (payload, on_ok, on_fail): one ``made``
        #: call of at most :attr:`made_max`, placed before the next call (each on its
        #: own if the server takes none: an older one)
        self._made: list[tuple[bytes, OnReply, OnReply]] = []
        #: what :attr:`_made` holds: opens, or the other held calls (never both)
        self._made_opens = False
        #: inodes released since: one ``releases`` call, placed before the next call
        #: after the creates and unlinks held (:meth:`release`)
        self._releases: list[int] = []
        self.made_max = min(made_max, codec.MAX_MADE)
        #: set when an asynchronous create is held: it leaves within CREATE_HOLD
        self._flush_soon = trio.Event()
        self._killing = False

    def request(self, payload: bytes, on_ok: OnReply | None = None) -> tuple[int, Pending]:
        """Send a call (no await: callers do their bookkeeping atomically with it)."""
        rid = self._next_id
        self._next_id = rid % 0xFFFFFFFF + 1
        now = trio.current_time()
        p = Pending(on_ok, now)
        self.pending[rid] = p
        frame = wire.frame(Kind.CALL, rid, payload)
        self._hold_queued()
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
        """A call whose answer nobody waits for (an asynchronous create or unlink; opens:
        :meth:`hold_open`): it leaves with the next call, or at most ``CREATE_HOLD``
        later, in one ``made`` call with the others held meanwhile (at most
        :attr:`made_max` a call; each alone to an older server); the reader hands
        its answer to *on_ok* or *on_fail* (a lost connection: neither)."""
        self._hold(payload, on_ok, on_fail, opens=False)

    def _hold(self, payload: bytes, on_ok: OnReply, on_fail: OnReply, *, opens: bool) -> None:
        # Opens go in made calls of their own: the server runs a call of opens only
        # as it reads it, before calls of ours queued ahead of it (a recall's answer
        # must find the handle counted), not one that carries a create
        # (Connection.serve, MetaServer.early_open).
        if self._made and self._made_opens != opens:
            self._frame_made()
        self._made_opens = opens
        self._made.append((payload, on_ok, on_fail))
        if len(self._made) >= self.made_max:
            self._frame_made()
        if not self._flush_soon.is_set():
            self._flush_soon.set()

    def hold_open(self, ino: int, on_fail: OnReply) -> None:
        """An open made under our lease of *ino* (``RemoteMeta.open``), held as a made
        call of opens only: the server runs such a call as it reads it, even behind
        calls of ours that wait (``Connection.serve``), so it is counted before
        our answer to any recall sent after it (:meth:`send_recalled`)."""
        self._hold(codec.call_payload("open", ino), _counted, on_fail, opens=True)

    def _frame_made(self) -> None:
        """The calls held (creates, unlinks, opens), as one call in :attr:`_held`."""
        made, self._made = self._made, []
        rid = self._next_id
        self._next_id = rid % 0xFFFFFFFF + 1
        if len(made) == 1:
            payload, on_ok, on_fail = made[0]
            self.pending[rid] = Pending(on_ok, trio.current_time(), on_fail)
            self._held += wire.frame(Kind.CALL, rid, payload)
            return

        def answered(kind: Kind, payload: bytes) -> None:
            refused = {k: (err, msg) for k, err, msg in _MADE.result_from_wire(wire.decode(payload))}
            for k, (_, on_ok, on_fail) in enumerate(made):
                if k in refused:
                    on_fail(Kind.ERROR, wire.encode_error(*refused[k]))
                else:
                    on_ok(Kind.OK, b"")

        def failed(kind: Kind, payload: bytes) -> None:  # (all of them, as one)
            for _, _, on_fail in made:
                on_fail(kind, payload)

        self.pending[rid] = Pending(answered, trio.current_time(), failed)
        self._held += wire.frame(Kind.CALL, rid, codec.made_payload([p for p, _, _ in made]))

    def flush_held(self) -> None:
        """Send the held calls now."""
        self._hold_queued()
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

    def release(self, ino: int) -> None:
        """Tell the server that one of our handles of *ino* is closed, without reply
        (request id 0: the server runs it in order and answers nothing).  With the
        other releases since, in one ``releases`` call (the server's cost is mostly
        per call), which leaves before our next call, in the same send, or with a
        ping at most ``HOLD_MAX`` later: whatever we ask after it runs after it.

        Asynchronous creates and unlinks held meanwhile (:meth:`hold`) go first: one
        may create this file.  The others make or unlink other files, or unlink this
        one (the server then holds the nameless file open until the release, a
        moment later): none depends on the release.
        """
        self._releases.append(ino)
        if len(self._releases) >= codec.MAX_RELEASES:
            self._hold_queued()

    def _hold_queued(self) -> None:
        """The calls held (creates, unlinks, opens), then the releases, as frames in
        :attr:`_held` (in that order: a create held may make a file released, and a
        handle's open must be counted before an earlier handle's release)."""
        if self._made:
            self._frame_made()
        if self._releases:
            self._held += wire.frame(Kind.CALL, 0, codec.call_payload("releases", self._releases))
            self._releases = []

    def send_recalled(self, rid: int, payload: bytes) -> None:
        """Acknowledge recall *rid* (no await: the reader must not wait on the socket),
        after the calls held so far: an open held under our lease of a recalled file
        must be counted before the change that recalled us is applied."""
        if self.dead:
            return
        self._hold_queued()
        frame = wire.frame(Kind.RECALLED, rid, payload)
        if self._held:
            self._held += frame
            frame = bytes(self._held)
            self._held.clear()
        try:
            self.fs.send_now(frame)
        except trio.BrokenResourceError as exc:
            self.kill(f"send failed: {exc}")
        else:
            if self.fs.pending():
                self._wake.set()

    async def delivered(self) -> bool:
        """A ping's reply: the server has read every frame sent before it (in order)."""
        if self.dead:
            return False
        _, p = self.request(PING)
        await p.event.wait()  # bounded by the watchdog, like every call
        return not p.lost

    def kill(self, reason: str) -> None:
        if not self.dead and not self._scope.cancel_called and not self._killing:
            self.reason = reason
            # Given up (a call unanswered too long, say): what is held goes into the
            # socket first if it takes it, for a server that is only slow then reads
            # it before our close, which ends our session there at once, and with it
            # the recalls waiting for our answer: a handle opened here under our
            # lease is counted before another node's unlink goes ahead.
            self._killing = True
            self.flush_held()
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
                    if h.kind is Kind.POOL:
                        self.on_pool(payload)
                        continue
                    if h.kind not in REPLY_KINDS:
                        raise WireError(f"unexpected {h.kind.name} frame")
                    p = self.pending.pop(h.req_id, None)
                    if p is None:
                        continue  # the caller gave up on it (timeout, or a ping)
                    if cache.term:
                        cache.renew(p.sent)
                    p.kind, p.payload, p.recalls, p.read_at = h.kind, payload, self.recalls, cache.landings
                    if h.kind in OK_KINDS:
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
            if self._held or self._made or self._releases or trio.current_time() >= self._last_send + self.keepalive:
                self.request(PING)
