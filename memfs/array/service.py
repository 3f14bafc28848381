"""The mount daemon's side of :mod:`memfs.array`: direct-access sessions.

A local process that may read every file of the mount (see :func:`may_access`)
opens a session on the daemon's control socket (one connection), learns how to
reach the pool itself (``array.hello``: the volumes' memfds, passed with
``SCM_RIGHTS``, or in cluster mode the memory servers and the mount's secret),
and then asks this daemon only for names and placement: it moves the bytes
between its arrays and volume memory itself, once.

Requests (``args`` of the control protocol; all but ``hello`` name a handle ``h``):

``array.hello``
    ``{"direct": true, "pool": {...}, "piece": n}`` (plus descriptors), or
    ``{"direct": false, "why": ...}``: then the caller uses ordinary file I/O.
``array.open {path, write}``
    an existing regular file; ``{"h", "ino", "size"}``.  Counted as an open
    handle, so an unlink leaves its data in place until ``close``.
``array.create {path, size, mode, allocate}``
    a new file of *size* bytes under a temporary name beside *path*; with
    *allocate* all of it is allocated now (ENOSPC here, all or nothing), else
    as it is mapped for writing.  ``commit`` renames it over *path* (readers see
    the old file or the new one, never a mix).
``array.map {h, offset, length, write}``
    where ``[offset, offset+length)`` lives: ``{"t": id, "extents": [[off, len,
    vol, voff], ...]}`` (``vol`` -1: a hole).  Opens transfer *id*: until its
    ``done``, nothing those extents name is freed and reused (the scrubber is
    held; in cluster mode a recall waits, as for this daemon's own transfers).
    At most :data:`PIECE` bytes.  Open at once per session: one for an embedded
    pool, :data:`MAX_TRANSFERS` in cluster mode (``hello`` says which), where a
    client asks where its next piece lives while it moves this one (a map is a
    metadata-server call there).  Embedded, a map waits its turn behind a
    scrubber round that is waiting for transfers to end (see :mod:`memfs.scrub`).
``array.done {h, t, publish}``
    transfer *t* ended.  A read answers ``{"stale": true}`` if the chunk map
    changed under it (cluster mode): the caller reads that piece again.  A write
    takes effect before what the transfer holds is let go: mtime, and for the
    burst buffer the file is dirty again (so neither a write-back that copied it
    mid-transfer nor an eviction loses the bytes).  With *publish* (the last piece
    of a slab) size and mtime are made exact on the metadata server and the
    kernel's cached pages and attributes of the file are dropped, so readers
    through the mount see it at once.  ``commit`` does the same for a created file.
``array.commit {h}`` / ``array.close {h}``
    publish a created file under its name / let go of a handle (an uncommitted
    file is removed).

Everything a session holds (handles, temporary files) is released when its
connection ends, however it ends, with one exception that safety demands: the
daemon cannot take back the descriptors it handed out, so a transfer the client
never ended (it died, or closed the connection, mid-copy) stays held until the
client *process* has exited (watched with a pidfd); only then can no more of its
bytes land in the memory that transfer named.  A transfer open longer than
:data:`HOLD_WARNING` is logged.  While a transfer is open the session answers
nothing but ``map``, ``done`` and ``close``.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from memfs.config import format_size
from memfs.errors import FsError, SpaceBusy
from memfs.host import Peer
from memfs.layout import LAYOUT_XATTR
from memfs.meta import MAP_TRIES, NAME_MAX, Attr, Extent, Meta, map_retry_delay

log = logging.getLogger(__name__)

#: the most bytes one transfer covers, embedded: long enough that asking costs
#: nothing next to moving the bytes (about 10 ms of copying)
PIECE = 64 << 20
#: cluster: a transfer must end well within the time a recall waits for this
#: daemon's transfers (1.5 s) before the metadata server may free the chunks it
#: names: this much per volume, so that every connection to every server has a
#: request in each piece, and at most :data:`PIECE` in all (64 MiB over one 1 GbE
#: link: 0.6 s; a pipelined client pins two pieces)
REMOTE_PIECE = 16 << 20
#: a transfer still open after this long is logged (it stays held: see above)
HOLD_WARNING = 10.0
#: most descriptors one message carries (the kernel's SCM_MAX_FD)
MAX_FDS = 253
#: transfers one cluster session may have open at once (a client pipelines two pieces)
MAX_TRANSFERS = 2
#: cleaning up a session that ended never takes longer than this
CLOSE_TIMEOUT = 10.0
#: what a temporary file's name carries (``.NAME.memfs-array-XXXXXXXX``)
TEMP_TAG = b".memfs-array-"
#: stripe units of array files: from 1 MiB up to this, at least 4 per volume (see
#: :func:`array_layout`); a cluster piece then spans every volume
MAX_STRIPE = REMOTE_PIECE
_ROOT = 1


@dataclass(frozen=True)
class PoolAccess:
    """How a local process reaches this mount's pool memory itself."""

    #: ``local``: volumes are this daemon's memfds; ``tcp``/``verbs``: memory servers
    kind: str
    #: local: each volume's memfd (owned by the transport) and size
    fds: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    #: cluster: the pool spec's volume URLs, in pool order, and what reaching them needs
    volumes: tuple[str, ...] = ()
    secret: bytes = b""
    incarnations: dict[str, int] = field(default_factory=dict)
    #: cluster: the filesystem's id, which the memory servers' volumes are claimed for
    fsid: bytes = b""
    #: cluster: the mount's lease token now (its transfers are made under the mount's
    #: leases; memory servers refuse the token once the mds fenced it)
    lease_token: Callable[[], int] | None = None
    #: why no process may have direct access (the pool holds no file's bytes), if so
    why_not: str | None = None

    def describe(self) -> dict[str, Any]:
        if self.kind == "local":
            return {"kind": "local", "sizes": list(self.sizes)}
        return {"kind": self.kind, "volumes": list(self.volumes), "secret": self.secret.hex(),
                "incarnations": self.incarnations, "token": self.token(),
                "fsid": self.fsid.hex()}

    def token(self) -> int:
        """The mount's lease token now; 0: none (embedded)."""
        return self.lease_token() if self.lease_token is not None else 0


class KernelCache(Protocol):
    """The FUSE layer's hold on the kernel's caches of this mount."""

    async def invalidate(self, inodes: list[int]) -> None: ...

    async def invalidate_entry(self, parent: int, name: bytes) -> None: ...


def may_access(peer: Peer, access: PoolAccess) -> str | None:
    """None if *peer* may reach the pool directly, else why not.

    Pool memory holds every file's bytes.  The control socket serves root, the
    daemon's user and the owner of the mount's root, all of whom can read every
    file of an embedded pool.  A cluster pool holds the files of every node, and
    its secret opens all of it: only root and the daemon's user (who started it
    with that secret) get it.
    """
    if access.why_not is not None:
        return access.why_not
    if access.kind == "local" or peer.uid in (0, os.geteuid()):
        return None
    return (f"uid {peer.uid} is not root or the user of this mount's daemon, who alone "
            "may hold the cluster's secret")


@dataclass(slots=True)
class _Handle:
    ino: int
    parent: int
    name: bytes
    size: int
    writable: bool
    #: a created file's temporary name, until commit
    temp: bytes | None = None


@dataclass(slots=True)
class _Transfer:
    handle: int
    offset: int
    length: int
    write: bool
    gen: int
    hold: ExitStack
    #: the extents handed out (a write checks them again if the map changed meanwhile)
    extents: list[list[int]]
    #: cancels the warning about a long transfer
    watch: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: called once the client says its bytes moved (see Meta.io), if the pin says so
    landed: Callable[[], None] | None = None


class ArrayService:
    """Serves the sessions of one mount (see the module docstring)."""

    def __init__(
        self, meta: Meta, access: PoolAccess, *,
        scrub_hold: Callable[[], AbstractContextManager[object]] | None = None,
        scrub_turn: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.meta = meta
        self.access = access
        self.scrub_hold = scrub_hold
        #: waits while a scrubber round waits for transfers to end (so it gets its turn)
        self.scrub_turn = scrub_turn
        #: set by the mount once the FUSE layer exists
        self.kernel: KernelCache | None = None
        #: set by the mount: until the mount's own posted writes of an inode are
        #: answered (memfs.data), which a transfer of ours could overtake
        self.wait_posted: Callable[[int], Awaitable[None]] | None = None
        self._nursery: trio.Nursery | None = None
        #: transfers whose connection ended first, held until their process exits
        self.orphans = 0

    def session(self, peer: Peer) -> ArraySession:
        return ArraySession(self, peer)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Where orphaned transfers wait for their process (until cancelled)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def spawn(self, fn: Callable[[_Transfer], Awaitable[None]], t: _Transfer,
              scope: trio.CancelScope) -> None:
        """Run ``fn(t)`` in the background under *scope* (nothing if not running)."""
        if self._nursery is None:
            return

        async def scoped() -> None:
            with scope:
                await fn(t)

        self._nursery.start_soon(scoped)

    def adopt(self, pid: int, hold: ExitStack, handles: list[_Handle], session: ArraySession) -> None:
        """Keep *hold* (and *handles*, whose memory it names) until process *pid* exits."""
        if self._nursery is None:  # not running (unit tests): the process is ours
            hold.close()
            return
        self.orphans += 1
        self._nursery.start_soon(self._outlive, pid, hold, handles, session)

    async def _outlive(self, pid: int, hold: ExitStack, handles: list[_Handle],
                       session: ArraySession) -> None:
        try:
            await wait_exit(pid)
        finally:
            hold.close()
            self.orphans -= 1
            log.info("array client pid %d has exited: its transfer is released", pid)
            await session.drop_all(handles)


class ArraySession:
    """One control connection's direct-access state."""

    def __init__(self, service: ArrayService, peer: Peer) -> None:
        self.service = service
        self.meta = service.meta
        self.peer = peer
        self._handles: dict[int, _Handle] = {}
        self._next = 1
        self._transfers: dict[int, _Transfer] = {}
        self._next_transfer = 1
        #: inode -> ended writes whose effects are still to be made (see _wrote)
        self._owed: dict[int, list[_Transfer]] = {}
        #: transfers open at once (see ``array.map``)
        self.depth = 1 if service.access.kind == "local" else MAX_TRANSFERS

    @property
    def busy(self) -> bool:
        """Files open or transfers under way: the connection is not idle, however long
        the client computes between calls."""
        return bool(self._handles or self._transfers)

    async def call(self, op: str, args: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Answer *op*; FsError (with a message naming the file) on failure."""
        if self._transfers and op not in ("array.map", "array.done", "array.close"):
            raise FsError(errno.EBUSY, "a transfer is open: end it first (array.done)")
        if op == "array.hello":
            return self._hello()
        handler = _OPS.get(op)
        if handler is None:
            raise FsError(errno.EINVAL, f"unknown request {op!r}")
        return await handler(self, args), []

    # -- requests ----------------------------------------------------------------------

    def _hello(self) -> tuple[dict[str, Any], list[int]]:
        access = self.service.access
        why = may_access(self.peer, access)
        if why is None and len(access.fds) > MAX_FDS:
            why = f"the pool has {len(access.fds)} volumes; one message passes at most {MAX_FDS}"
        if why is not None:
            return {"direct": False, "why": why}, []
        piece = PIECE if access.kind == "local" else min(PIECE, REMOTE_PIECE * len(access.volumes))
        return ({"direct": True, "pool": access.describe(), "piece": piece,
                 "transfers": self.depth, "chunk": self.meta.chunk_size}, list(access.fds))

    async def _open(self, args: dict[str, Any]) -> dict[str, Any]:
        path = _str(args, "path")
        write = bool(args.get("write", False))
        parent, name = await self._resolve_parent(path)
        a = await self.meta.lookup(parent, name) if name else await self.meta.getattr(parent)
        if stat.S_ISDIR(a.mode):
            raise FsError(errno.EISDIR, f"{path} is a directory")
        if not stat.S_ISREG(a.mode):
            raise FsError(errno.EINVAL, f"{path} is not a regular file")
        a = await self.meta.open(a.ino)
        return self._new_handle(_Handle(a.ino, parent, name, a.size, write), a)

    async def _create(self, args: dict[str, Any]) -> dict[str, Any]:
        path = _str(args, "path")
        size = _int(args, "size")
        mode = _int(args, "mode") & 0o7777
        parent, name = await self._resolve_parent(path)
        if not name:
            raise FsError(errno.EISDIR, f"{path} is a directory")
        try:
            old = await self.meta.lookup(parent, name)
        except FsError as exc:
            if exc.errno != errno.ENOENT:
                raise
        else:
            if stat.S_ISDIR(old.mode):
                raise FsError(errno.EISDIR, f"{path} is a directory")
            mode = old.mode & 0o777  # replacing keeps the permissions (not set-id bits)
        temp = _temp_name(name)
        a = await self.meta.create(parent, temp, stat.S_IFREG | mode, self.peer.uid, self.peer.gid)
        h = _Handle(a.ino, parent, name, size, True, temp)
        try:
            layout = array_layout(size, self.meta.n_volumes, self.meta.chunk_size)
            if layout is not None and not await self._has_layout(parent):
                await self.meta.setxattr(a.ino, LAYOUT_XATTR, layout)
            if args.get("allocate", True):
                for off in range(0, size, PIECE):
                    await self._map_write(a.ino, off, min(PIECE, size - off))
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                await self._drop(h)
            raise
        return self._new_handle(h, await self.meta.getattr(a.ino))

    async def _map(self, args: dict[str, Any]) -> dict[str, Any]:
        hid, h = self._handle(args)
        offset, length = _int(args, "offset"), _int(args, "length")
        write = bool(args.get("write", False))
        if length > PIECE:
            raise FsError(errno.EINVAL, f"a transfer covers at most {PIECE} bytes")
        if len(self._transfers) >= self.depth:
            raise FsError(errno.EBUSY, f"{self.depth} transfer(s) open: end one first")
        if write and not h.writable:
            raise FsError(errno.EBADF, "opened read-only")
        if write and offset + length > h.size:
            raise FsError(errno.EINVAL, f"a write past the end of the array file "
                                        f"({offset}+{length} > {h.size})")
        meta = self.meta
        for tries in range(MAP_TRIES):
            if (pause := map_retry_delay(tries)) > 0:
                await trio.sleep(pause)
            if self.service.scrub_turn is not None:
                await self.service.scrub_turn()
            if self.service.wait_posted is not None:
                await self.service.wait_posted(h.ino)
            gen = meta.generation(h.ino)
            if write:
                self._not_held_up(h.ino)
                extents = (await self._map_write(h.ino, offset, length)) if length else []
            else:
                extents = await meta.map_read(h.ino, offset, length)
            # No await from here until the hold is taken: in embedded mode nothing
            # can free these chunks in between (the generation never moves there).
            with ExitStack() as hold:
                if self.service.scrub_hold is not None:
                    hold.enter_context(self.service.scrub_hold())
                pin = hold.enter_context(meta.io(h.ino, here=False))
                if meta.generation(h.ino) != gen:
                    continue  # recalled while we asked: the map may name freed chunks
                if not write and callable(pin):
                    # A read moves nothing into the pool: a reconnection or a truncate
                    # need not wait for it (one the map changed under reads again).
                    pin()
                out = [[e.offset, e.length, e.volume, e.voffset] for e in extents]
                t = _Transfer(hid, offset, length, write, gen, hold.pop_all(), out,
                              landed=pin if callable(pin) else None)
                tid = self._next_transfer
                self._next_transfer += 1
                self._transfers[tid] = t
                self.service.spawn(self._warn_if_long, t, t.watch)
                access = self.service.access
                return {"t": tid, "extents": out, "token": access.token(),
                        "inc": access.incarnations}
        raise FsError(errno.EIO, "the file's chunk map keeps changing")

    async def _done(self, args: dict[str, Any]) -> dict[str, Any]:
        hid, h = self._handle(args)
        t = self._transfers.get(_int(args, "t"))
        if t is None or t.handle != hid:
            raise FsError(errno.EINVAL, "no such transfer open on this handle")
        del self._transfers[_int(args, "t")]
        t.watch.cancel()
        if t.landed is not None:
            # Its bytes are where they go: a reconnection need not wait for the calls
            # below (which wait for it).
            t.landed()
        with t.hold:  # let go of at the end, whatever happens
            moved = self.meta.generation(h.ino) != t.gen
            if not t.write:
                return {"stale": moved}
            await self._wrote(h, t)
        if args.get("publish") and h.temp is None:
            await self._publish(h)
        return {"stale": False}

    async def _wrote(self, h: _Handle, t: _Transfer) -> None:
        """A write's other effects, before its hold goes: if the map changed since, the
        check that the range is still where it was written (EIO: cut by a truncate,
        or its chunks freed); mtime, and for the burst buffer the file is dirty again
        (a write-back that copied it mid-transfer is redone; a clean file could be
        evicted).  Only within the size: a truncate meanwhile wins, as if it came
        after.

        A truncate of the file under way on this node waited for this piece to land
        and comes after it; it may also be waiting for the next piece this session
        has open, so nothing here waits for it then: the piece is owed, and made
        with a later piece of the file (after waiting for the truncate, which may
        fail: ETXTBSY).  On EIO the owed pieces go too: the slab write failed."""
        meta, ino = self.meta, h.ino
        pieces = [t]
        checked: set[int] = set()  # (ids of) pieces found where they were written
        for tries in range(MAP_TRIES):
            if (pause := map_retry_delay(tries)) > 0:
                await trio.sleep(pause)
            if meta.truncating(ino):
                if self._writing(ino):
                    self._owed.setdefault(ino, []).extend(pieces)
                    return
                await meta.truncates_over(ino)
                continue
            pieces += self._owed.pop(ino, ())
            gen = meta.generation(ino)
            moved = next((p for p in pieces if id(p) not in checked and p.gen != gen), None)
            if moved is not None:
                now = await meta.map_read(ino, moved.offset, moved.length)
                if [[e.offset, e.length, e.volume, e.voffset] for e in now] != moved.extents:
                    raise FsError(errno.EIO, "the file changed under the write (truncated, "
                                             "or its chunks moved): write it again")
                checked.add(id(moved))
                continue  # (the map_read awaited: the gate again)
            size = (await meta.getattr(ino)).size
            while pieces and not meta.truncating(ino) and meta.generation(ino) == gen:
                # (no await between these checks and the map_write's own: a truncate
                # of ours begun since would come after it, with a size read before)
                p = pieces[0]
                if (n := min(p.length, size - p.offset)) > 0:
                    try:
                        await self._map_write(ino, p.offset, n)
                    except FsError as exc:
                        if exc.errno != errno.EAGAIN:  # (a truncate began while we waited)
                            raise
                        self._owed.setdefault(ino, []).extend(pieces)
                        return
                pieces.pop(0)
            if not pieces:
                return
        raise FsError(errno.EIO, "the file's chunk map keeps changing")  # (pieces dropped)

    def _not_held_up(self, ino: int) -> None:
        """Before a map_write of *ino*, which waits for a truncate of it under way on
        this node: that truncate waits for our open pieces to land, so a client that
        asks for its next piece before it ends the last (pipelined) must end it
        first (EAGAIN)."""
        if self.meta.truncating(ino) and self._writing(ino):
            raise FsError(errno.EAGAIN, "a truncate of the file on this node waits for "
                          "the piece open here: end it, then ask again")

    def _writing(self, ino: int) -> bool:
        """This session has a write of *ino* open."""
        return any(t.write and (h := self._handles.get(t.handle)) is not None and h.ino == ino
                   for t in self._transfers.values())

    async def _commit(self, args: dict[str, Any]) -> dict[str, Any]:
        _, h = self._handle(args)
        if h.temp is None:
            raise FsError(errno.EINVAL, "not a created file, or committed already")
        kernel = self.service.kernel
        # The kernel may hold the name (the old file, or its absence) for a day.  The
        # old file stays open until the kernel has let go of the name, so that a reader
        # who found it there opens it (the old array: whole) rather than nothing.
        old = await self._open_existing(h.parent, h.name)
        try:
            await self.meta.rename(h.parent, h.temp, h.parent, h.name)
            temp, h.temp = h.temp, None
            if kernel is not None:
                await kernel.invalidate_entry(h.parent, h.name)
                await kernel.invalidate_entry(h.parent, temp)
                await kernel.invalidate([h.parent])
        finally:
            if old is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                    await self.meta.release(old)
        await self._publish(h)
        return {}

    async def _has_layout(self, directory: int) -> bool:
        """The directory asks for a layout (``user.memfs.layout``): its files follow it."""
        try:
            await self.meta.getxattr(directory, LAYOUT_XATTR)
        except FsError as exc:
            if exc.errno in (errno.ENODATA, errno.ENOTSUP):
                return False
            raise
        return True

    async def _open_existing(self, parent: int, name: bytes) -> int | None:
        try:
            a = await self.meta.lookup(parent, name)
            if not stat.S_ISREG(a.mode):
                return None
            await self.meta.open(a.ino)
        except FsError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        return a.ino

    async def _close(self, args: dict[str, Any]) -> dict[str, Any]:
        hid, h = self._handle(args)
        if any(t.handle == hid for t in self._transfers.values()):
            # Closed mid-transfer: whatever the client still copies must not land in
            # reused memory; it says done first when it can (see the module docstring).
            raise FsError(errno.EBUSY, "a transfer is open on this handle: end it first")
        del self._handles[hid]
        await self._drop(h)
        return {}

    # -- helpers -----------------------------------------------------------------------

    def _new_handle(self, h: _Handle, a: Attr) -> dict[str, Any]:
        hid = self._next
        self._next += 1
        self._handles[hid] = h
        return {"h": hid, "ino": h.ino, "size": a.size}

    def _handle(self, args: dict[str, Any]) -> tuple[int, _Handle]:
        hid = _int(args, "h")
        h = self._handles.get(hid)
        if h is None:
            raise FsError(errno.EBADF, f"no array handle {hid}")
        return hid, h

    async def _resolve_parent(self, path: str) -> tuple[int, bytes]:
        """The directory *path* (relative to the mount root) is in, and its last name
        (empty for the root itself)."""
        parts = [p for p in os.fsencode(path).split(b"/") if p]
        if any(p in (b".", b"..") for p in parts):
            raise FsError(errno.EINVAL, f"{path}: not a canonical path")
        ino = _ROOT
        for p in parts[:-1]:
            a = await self.meta.lookup(ino, p)
            if not stat.S_ISDIR(a.mode):
                raise FsError(errno.ENOTDIR, f"{path}: {os.fsdecode(p)} is not a directory")
            ino = a.ino
        return ino, parts[-1] if parts else b""

    async def _map_write(self, ino: int, offset: int, length: int) -> list[Extent]:
        try:
            return (await self.meta.map_write(ino, offset, length)).extents
        except SpaceBusy:  # only freed, not yet zeroed space is left: wait once
            await self.meta.reclaim()
            self._not_held_up(ino)
            try:
                return (await self.meta.map_write(ino, offset, length)).extents
            except SpaceBusy:
                raise FsError(errno.ENOSPC) from None

    async def _publish(self, h: _Handle) -> None:
        """Size and mtime exact where others ask (cluster), the kernel's copies gone."""
        await self.meta.sync(h.ino)
        kernel = self.service.kernel
        if kernel is not None:
            await kernel.invalidate([h.ino])

    async def _drop(self, h: _Handle) -> None:
        """Let go of *h*: its open count, and an uncommitted file."""
        try:
            await self.meta.release(h.ino)
        finally:
            if h.temp is not None:
                temp, h.temp = h.temp, None
                try:
                    await self.meta.unlink(h.parent, temp)
                except FsError as exc:
                    if exc.errno != errno.ENOENT:  # renamed or removed by someone: theirs now
                        raise

    async def aclose(self) -> None:
        """The connection ended: release everything (shielded, bounded); an open
        transfer and the files it names only once the client process has exited."""
        handles, self._handles = list(self._handles.values()), {}
        transfers, self._transfers = list(self._transfers.values()), {}
        if transfers:
            hold = ExitStack()
            for t in transfers:
                t.watch.cancel()
                hold.push(t.hold)
            log.warning("array client pid %d left with %d transfer(s) open (%d bytes): freed "
                        "memory is not reused until it exits", self.peer.pid, len(transfers),
                        sum(t.length for t in transfers))
            self.service.adopt(self.peer.pid, hold, handles, self)
            if self.service._nursery is not None:
                return
        await self.drop_all(handles)

    async def drop_all(self, handles: list[_Handle]) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT) as scope:
            for h in handles:
                try:
                    await self._drop(h)
                except Exception as exc:  # noqa: BLE001 - the others are still released
                    log.warning("array session of pid %d: cannot release inode %d: %s",
                                self.peer.pid, h.ino, exc)
        if scope.cancelled_caught:
            log.warning("array session of pid %d: gave up releasing its files after %.0f s",
                        self.peer.pid, CLOSE_TIMEOUT)

    async def _warn_if_long(self, t: _Transfer) -> None:
        await trio.sleep(HOLD_WARNING)
        if t in self._transfers.values():
            log.warning("array client pid %d has had a transfer open for %.0f s; freed memory "
                        "is not reused until it ends", self.peer.pid, HOLD_WARNING)


_OPS = {
    "array.open": ArraySession._open,
    "array.create": ArraySession._create,
    "array.map": ArraySession._map,
    "array.done": ArraySession._done,
    "array.commit": ArraySession._commit,
    "array.close": ArraySession._close,
}


def array_layout(size: int, n_volumes: int, chunk_size: int) -> bytes | None:
    """The layout of a new array file of *size* bytes: striped over every volume in
    units as large as leave at least 4 per volume (up to :data:`MAX_STRIPE`).  Large
    units mean few, large transfers: each one a single ``preadv`` or memory-server
    request, whose fixed cost (a request frame, a task, a wakeup) then stays small
    next to the copy.  None: the pool's default is as good (small arrays)."""
    stripe = 1 << 20
    while stripe < MAX_STRIPE and stripe * 2 * 4 * n_volumes <= size:
        stripe *= 2
    stripe = max(stripe, chunk_size)
    if stripe <= 1 << 20:
        return None
    return f"stripe_count=-1 stripe_size={format_size(stripe)}".encode()


async def wait_exit(pid: int) -> None:
    """Until process *pid* has exited (at once if it has already)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


def _temp_name(name: bytes) -> bytes:
    tag = TEMP_TAG + secrets.token_hex(4).encode()
    keep = NAME_MAX - len(tag) - 1
    return b"." + name[:keep] + tag


def _str(args: dict[str, Any], key: str) -> str:
    v = args.get(key)
    if not isinstance(v, str):
        raise FsError(errno.EINVAL, f"{key!r} must be a string")
    return v


def _int(args: dict[str, Any], key: str) -> int:
    v = args.get(key)
    if type(v) is not int or v < 0:
        raise FsError(errno.EINVAL, f"{key!r} must be a non-negative integer")
    return v
