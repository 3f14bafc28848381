"""Calls a cluster client makes under a lease and tells the mds without waiting for
their answers: creates and unlinks under a directory's create lease, opens under
a file's lease, setattrs under a file's write lease (or a directory's create
lease), and the access times of reads from cached maps.  The client side of
:mod:`memfs.meta.creates`' held calls; part of
:class:`~memfs.meta.remote.RemoteMeta`.

Each is applied here, the kernel answered, and the call held on the connection
(``MdsConnection.hold``, ``hold_open``): it leaves with the next call, or within
``CREATE_HOLD``, and its answer is taken as it is read.  One the server refuses
(the lease ended without our word) is logged; a refused create or setattr fails
the file's writers, a refused unlink has the directory looked up again.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from memfs import wire
from memfs.errors import FsError
from memfs.meta import Attr, SetAttr, apply_setattr, clock, codec
from memfs.meta.cache import ClientCache
from memfs.meta.creates import RESERVE, AsyncCreates
from memfs.meta.lease_client import LeaseKeeper
from memfs.meta.remote_conn import MdsConnection
from memfs.wire import Kind

log = logging.getLogger(__name__)

#: the clock the metadata server stamps with too: timestamps stay in the kernel's order
_now_ns = clock.now_ns


def _no_answer(kind: Kind, payload: bytes) -> None:
    """A held call whose answer says nothing (an access time moved)."""


def _atime_refused(kind: Kind, payload: bytes) -> None:
    log.debug("access time refused: %s", wire.decode_error(payload)[1])


class HeldCalls:
    """See the module docstring.  *conn* gives the client's connection (None while
    it has none), *token* the lease token of its registration, *call* is its call;
    *opens* its open handles per inode, *write_errors* its open files whose writes
    were lost; *count_open* counts a handle opened here, *gone_here* drops what this
    node keeps of a file it unlinked."""

    def __init__(
        self, cache: ClientCache, creates: AsyncCreates, leases: LeaseKeeper,
        conn: Callable[[], MdsConnection | None], token: Callable[[], int],
        call: Callable[..., Awaitable[Any]], opens: dict[int, int], write_errors: set[int],
        count_open: Callable[[int], None], gone_here: Callable[[int], None],
    ) -> None:
        self.cache = cache
        self.creates = creates
        self.leases = leases
        self._conn = conn
        self._token = token
        self._call = call
        self.opens = opens
        self.write_errors = write_errors
        self._count_open = count_open
        self._gone_here = gone_here
        #: the server takes opens in made calls (PoolDescription.held_opens; set at
        #: every registration)
        self.takes_opens = False
        #: and setattrs (PoolDescription.held_setattrs)
        self.takes_setattrs = False
        #: and access times (PoolDescription.held_atimes)
        self.takes_atimes = False
        self._reserving: trio.Event | None = None
        #: the lease token of the registration our reserved inode numbers came under
        self.inos_token = 0

    def open_here(self, ino: int) -> Attr | None:
        """An open under our lease of file *ino*: counted here, the server told without
        waiting.  None: this one asks the server."""
        conn = self._conn()
        if (self.takes_opens and conn is not None and not conn.dead and not self.cache.invalidating
                and (a := self.cache.attr(ino)) is not None and a.nlink > 0):
            # Under our lease of the file: the server hears of this handle with our next
            # call (held, as creates are), and no one waits for its answer.  It counts
            # it before it reads our answer to any recall sent after it
            # (MdsConnection.hold_open), so an unlink elsewhere, which recalls us,
            # finds the file open here.  A connection lost first: the next
            # registration claims our handles.
            conn.hold_open(ino, self._held_open_refused)
            self._count_open(ino)
            return a
        return None

    @staticmethod
    def _held_open_refused(kind: Kind, payload: bytes) -> None:
        """A held open the server refused: the file is gone there, which it cannot be
        while our lease of it lasts (we lost it without knowing: an eviction).  The
        handle's next calls fail; its release is ignored there."""
        err, msg = wire.decode_error(payload)
        log.warning("the metadata server refused an open made under our lease: %s (%s)",
                    msg, errno.errorcode.get(err, err))

    def setattr_here(self, ino: int, changes: SetAttr) -> Attr | None:
        """A setattr under our write lease of regular file *ino*, or our create lease
        of directory *ino*: applied here, the server told without waiting (``tar x``
        sets times, owner and mode of every file it writes, and of every directory
        once its files are in).  No other node has the file's state then, and any call
        about it recalls us first; the ``setattr_at`` held goes before our answer,
        and the server runs it before the answer is applied (as creates: see
        memfs.meta.creates).  None: this one asks the server (no such lease, set-ID
        bits, or a report, recall answer, truncate or setattr of the file on its
        way, which the server must see in the order taken)."""
        conn = self._conn()
        cache = self.cache
        if (not self.takes_setattrs or conn is None or conn.dead or changes == SetAttr()
                or (a := cache.attr(ino)) is None or not self.leases.quiet(ino)
                or not (stat.S_ISREG(a.mode) and cache.is_writer(ino)
                        or stat.S_ISDIR(a.mode) and ino in cache.creators)):
            return None
        t = _now_ns()
        new = Attr(ino, a.mode, a.nlink, a.uid, a.gid, a.rdev, a.size, a.blocks, a.atime_ns,
                   a.mtime_ns, t)
        apply_setattr(new, changes)
        if new.mode & (stat.S_ISUID | stat.S_ISGID):
            # Another node's write must drop them, asking the server only if it sees
            # some (MetaServer: drop_privileges recalls no writer otherwise).
            return None
        if changes.mtime_ns is not None:
            cache.mtime_set(ino, changes.mtime_ns)  # (reports from now on carry it)
        call = ["setattr_at", ino, *codec.setattr_at_args(changes), t]
        op = self.creates.setattr_made(call)
        self._hold_made(conn, op, call, lambda err, msg: self.setattr_failed(ino, err, msg))
        for x in (changes.atime_ns, changes.mtime_ns, t):
            if x is not None:
                clock.saw(x)
        cache.changed(new, True)
        return new

    def touch_atime(self, ino: int, t: int) -> bool:
        """Hold a read's access time for the server (``MapClient.touch``)."""
        conn = self._conn()
        if not self.takes_atimes or conn is None or conn.dead:
            return False
        conn.hold(codec.call_payload("atime_at", ino, t), _no_answer, _atime_refused)
        return True

    def setattr_failed(self, ino: int, err: int, msg: str) -> None:
        """The server refused a setattr we made under a write (or create) lease: the lease ended
        without our word (evicted, or back after a restart to a file changed since),
        or an older server came back; the change is lost."""
        log.error("setattr of inode %d, made under a lease, was refused by the metadata "
                  "server: %s; its writers get EIO", ino, msg or os.strerror(err))
        if self.opens.get(ino):
            self.write_errors.add(ino)
        self.cache.drop(ino)
        self.leases.drop_kernel([ino])

    async def create_here(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr | None:
        """Create under our create lease on *parent* (memfs.meta.creates): answered
        here, the server told without waiting.  None: this one must ask the server."""
        creates = self.creates
        if not creates.inos:
            await self._reserve_inos()
        conn = self._conn()
        if conn is None or conn.dead:
            return None
        made = creates.make(parent, name, mode, uid, gid, _now_ns())
        if made is None:
            return None
        a, op, call = made
        ino = a.ino
        self._hold_made(conn, op, call, lambda err, msg: self.create_failed(ino, parent, name, err, msg))
        self._count_open(ino)
        self.cache.created(parent, name, a, True)
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
            self.inos_token = self._token()
            self.creates.inos.extend(range(first, first + RESERVE))
        except FsError as exc:
            log.debug("no inode numbers reserved: %s", exc)
            if exc.errno == errno.EOPNOTSUPP:
                self.cache.creators.clear()
        finally:
            self._reserving = None
            done.set()

    def unlink_here(self, parent: int, name: bytes) -> bool:
        """Unlink under our create lease on *parent* a file we made there (see
        memfs.meta.creates), the server told without waiting; False: ask the server."""
        conn = self._conn()
        if conn is None or conn.dead or not self.cache.valid():
            return False
        t = _now_ns()
        removed = self.creates.remove(parent, name, t)
        if removed is None:
            return False
        ino, op, call = removed
        self._hold_made(conn, op, call, lambda err, msg: self.unlink_failed(parent, name, err, msg))
        self.cache.removed(parent, name, ino, t, 0, True)
        self._gone_here(ino)
        return True

    async def wait_answered(self, ino: int, within: float) -> None:
        """Until the server has answered what we made under a lease about *ino* (for
        ``fsync``); EIO if it has not *within* seconds."""
        if self.creates.pending_about(ino):
            # A create made under a create lease (of this file, or in this directory),
            # or a setattr under a write lease, is durable once the server answered it.
            conn = self._conn()
            if conn is not None:
                conn.flush_held()
            with trio.move_on_after(within) as scope:
                await self.creates.wait([ino])
            if scope.cancelled_caught:
                raise FsError(errno.EIO, f"the metadata server has not confirmed the create of "
                                         f"inode {ino} (or of files in it), or a change to it")

    def _hold_made(
        self, conn: MdsConnection, op: int, call: list[Any], refused: Callable[[int, str], None],
    ) -> None:
        """Send *call* (operation *op* of :class:`AsyncCreates`) without waiting; its
        answer settles it, and *refused* hears of a refusal."""
        creates = self.creates

        def ok(kind: Kind, payload: bytes) -> None:
            creates.answered(op)

        def failed(kind: Kind, payload: bytes) -> None:
            if creates.answered(op) is not None:
                refused(*wire.decode_error(payload))

        conn.hold(codec.call_payload(*call), ok, failed)

    def replay_refused(self, ops: list[tuple[int, list[Any]]], refused_ops: dict[int, int]) -> None:
        """A registration replayed *ops* (``AsyncCreates.unanswered``) and refused
        *refused_ops* (position -> errno): each not answered since fails here."""
        for k, (op, c) in enumerate(ops):
            if self.creates.answered(op) is None or k not in refused_ops:
                continue
            if c[0] == "create_at":
                self.create_failed(c[6], c[1], c[2], refused_ops[k], "")
            elif c[0] == "setattr_at":
                self.setattr_failed(c[1], refused_ops[k], "")
            else:
                self.unlink_failed(c[1], c[2], refused_ops[k], "")

    def unlink_failed(self, parent: int, name: bytes, err: int, msg: str) -> None:
        """The server refused an unlink we made under a create lease (we lost the lease
        meanwhile, and another client renamed the file): ask about the directory again."""
        log.error("unlink of %r in inode %d, made under a create lease, was refused by the "
                  "metadata server: %s", name, parent, msg or os.strerror(err))
        self.cache.drop(parent)
        self.leases.drop_kernel([parent])
        self.leases.forget_kernel_names()

    def create_failed(self, ino: int, parent: int, name: bytes, err: int, msg: str) -> None:
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
        self.cache.dirs.pop(parent, None)  # (which names changed without us is not known)
        self.cache.attrs.pop(parent, None)
        self.leases.drop_kernel([ino, parent])
        self.leases.forget_kernel_names()
