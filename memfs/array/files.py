"""Array files, reached directly through the mount daemon or through the mount itself.

Both kinds offer the same few calls (:class:`ArrayTarget`), so that
:mod:`memfs.array` is written once:

* :class:`DirectFile`: a handle in a direct-access session with the mount
  daemon (:mod:`memfs.array.service`).  Each transfer asks the daemon where a
  piece of the file lives, moves its bytes with a mover
  (:mod:`memfs.array.movers`) and tells the daemon it is done;
* :class:`MountFile`: an ordinary descriptor on the mount (``preadv`` into the
  array, ``pwritev`` from it: one copy in the kernel, then FUSE), for a
  process that may not reach the pool itself, or a path outside any memfs mount.

A new file (:func:`create_file`) is written under a temporary name beside its
path and renamed over it by ``commit``: readers see the old file or the new
one, never a mix, and a failure leaves no partial file behind.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from memfs.array.movers import (
    LocalMover,
    Mover,
    Pending,
    RemoteMover,
    TcpMover,
    populate,
    settle,
)
from memfs.errors import ControlError, FsError, UsageError
from memfs.meta import map_retry_delay

log = logging.getLogger(__name__)

#: a read piece whose chunk map changed under it is read again, this often
_MAX_TRIES = 20


class ArrayTarget(Protocol):
    """An open array file."""

    path: str
    size: int
    direct: bool

    def read(self, offset: int, view: memoryview) -> None: ...

    def write(self, offset: int, view: memoryview, *, publish: bool = True) -> None: ...

    def commit(self) -> None: ...

    def close(self) -> None: ...


def _os_error(exc: ControlError, path: str) -> OSError:
    return OSError(exc.errno, exc.message, path)


class DirectSession:
    """A direct-access session with the daemon of one mount (one control connection)."""

    def __init__(self, client: Any, mover: Mover, piece: int, depth: int = 1) -> None:
        self.client = client
        self.mover = mover
        self.piece = piece
        #: transfers the daemon lets this session have open at once (2: pipelined)
        self.depth = depth
        self._helper: ThreadPoolExecutor | None = None

    @classmethod
    def connect(cls, mnt: str) -> DirectSession | None:
        """A session with the daemon of *mnt*, or None if this process may not (or cannot)
        reach the pool itself: then it uses the mount."""
        from memfs.cli.client import connect

        try:
            client = connect(mnt)
        except UsageError as exc:  # no daemon socket we can reach
            log.debug("%s: no direct access: %s", mnt, exc)
            return None
        return cls.over(client, mnt)

    @classmethod
    def over(cls, client: Any, mnt: str) -> DirectSession | None:
        """A session on *client* (a connected :class:`memfs.control.ControlClient`), or
        None (the client is closed) if there is no direct access."""
        fds: list[int] = []
        try:
            reply = client.call("array.hello", {}, fds=fds)
            if not reply.get("direct"):
                log.debug("%s: no direct access: %s", mnt, reply.get("why"))
                raise _NoDirect
            pool = reply["pool"]
            mover: Mover
            if pool.get("kind") == "local":
                mover = LocalMover(fds, [int(x) for x in pool["sizes"]])
                fds = []
            elif pool.get("kind") == "tcp":
                mover = TcpMover(pool)
            else:
                mover = RemoteMover(pool)
            return cls(client, mover, int(reply["piece"]), int(reply.get("transfers", 1)))
        except (_NoDirect, UsageError) as exc:  # refused for who we are
            if isinstance(exc, UsageError):
                log.debug("%s: no direct access: %s", mnt, exc)
        except ControlError as exc:
            # EBUSY: the daemon's connections are all taken (the mount still works)
            if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL, errno.EBUSY):
                raise _os_error(exc, mnt) from None
            log.debug("%s: no direct access: %s", mnt, exc.message)
        except Exception as exc:  # noqa: BLE001 - e.g. a verbs pool and no RDMA device here
            log.info("%s: cannot reach the pool directly (%s); using the mount", mnt, exc)
        for fd in fds:
            os.close(fd)
        client.close()
        return None

    def call(self, where: str, op: str, /, **args: Any) -> dict[str, Any]:
        """*op*'s answer; an error is an OSError naming *where* (the user's path)."""
        self.check(where)
        try:
            result: dict[str, Any] = self.client.call(op, args)
        except ControlError as exc:
            raise _os_error(exc, where) from None
        return result

    def check(self, where: str) -> None:
        """ENOTCONN once the connection is gone: a new one would be a new session,
        without this one's handles."""
        if not self.client.connected:
            raise OSError(errno.ENOTCONN, f"lost the daemon of {self.client.name} "
                                          "(unmounted?)", where)

    def transfer(self, path: str, h: int, offset: int, view: memoryview, *,
                 write: bool, publish: bool = False) -> None:
        """Move *view* to (*write*) or from ``[offset, offset+len(view))`` of handle *h*."""
        ahead = None
        if not write and self.mover.populate_ahead and len(view) >= self.piece:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="memfs-populate")
            ahead = self._helper.submit(populate, view)
        try:
            self._transfer(path, h, offset, view, write=write, publish=publish)
        finally:
            if ahead is not None:
                settle(ahead.result)

    def _transfer(self, path: str, h: int, offset: int, view: memoryview, *,
                  write: bool, publish: bool) -> None:
        """Piece by piece.  Embedded, one piece after the other (asking costs nothing
        there, and the scrubber gets its turn between pieces).  Pipelined (cluster:
        the daemon's map is a metadata-server call), where piece *i+1* lives is asked
        while piece *i* moves: see :meth:`_overlapped` and :meth:`_in_turn`."""
        total = len(view)
        pieces = [(pos, min(self.piece, total - pos)) for pos in range(0, total, self.piece)]
        if not pieces:
            return
        p = _Pipeline(self, path, h, write)
        try:
            if self.depth > 1 and self.mover.overlaps:
                self._overlapped(p, offset, view, pieces, publish)
            else:
                self._in_turn(p, offset, view, pieces, publish)
        except BaseException:
            p.abandon()
            raise

    def _in_turn(self, p: _Pipeline, offset: int, view: memoryview,
                 pieces: list[tuple[int, int]], publish: bool) -> None:
        """One copy after the other; pipelined, piece *i+1* is asked for (and piece
        *i-1*'s done answered) before piece *i* moves."""
        pipelined = self.depth > 1
        p.ask(offset, pieces[0][1])
        for i, (pos, n) in enumerate(pieces):
            answered = not (i and pipelined)  # piece i-1's done (sent after this map)
            while True:
                try:
                    tid, extents = p.answer_map(offset + pos, n)
                    break
                except OSError as exc:
                    if exc.errno != errno.EAGAIN or answered:
                        raise
                # Piece i-1 was open when the map was asked for: a truncate of the
                # file on this node waited for it.  Its done has gone since.
                p.answer_done(offset + pieces[i - 1][0], view[slice(*_span(pieces[i - 1]))])
                answered = True
                p.ask(offset + pos, n)
            if not answered:
                p.answer_done(offset + pieces[i - 1][0], view[slice(*_span(pieces[i - 1]))])
            if pipelined and i + 1 < len(pieces):
                p.ask(offset + pieces[i + 1][0], pieces[i + 1][1])
            p.finish(p.begin(extents, offset + pos, view[pos : pos + n]))
            p.done(tid, publish=publish and i + 1 == len(pieces))
            if not pipelined:
                p.answer_done(offset + pos, view[pos : pos + n])
                if i + 1 < len(pieces):
                    p.ask(offset + pieces[i + 1][0], pieces[i + 1][1])
        if pipelined:
            p.answer_done(offset + pieces[-1][0], view[slice(*_span(pieces[-1]))])

    def _overlapped(self, p: _Pipeline, offset: int, view: memoryview,
                    pieces: list[tuple[int, int]], publish: bool) -> None:
        """Copies that overlap (a mover that queues them per connection): piece *i+1*
        begins moving as soon as its map is in, behind piece *i* on each memory-server
        connection, so that none idles between pieces; then piece *i* is waited for
        and told done, and piece *i+2* asked for (two transfers open at most)."""
        begun: list[tuple[int, int, int, Pending]] = []  # (pos, n, transfer, copy)
        try:
            p.ask(offset, pieces[0][1])
            for i, (pos, n) in enumerate(pieces):
                while True:
                    try:
                        tid, extents = p.answer_map(offset + pos, n)
                        break
                    except OSError as exc:
                        if exc.errno != errno.EAGAIN or not begun:
                            raise
                    # A truncate of the file on this node waits for the piece we
                    # have open, and held this map: end that piece, then ask again.
                    self._ended(p, offset, view, begun.pop(0), publish=False)
                    p.ask(offset + pos, n)
                begun.append((pos, n, tid, p.begin(extents, offset + pos, view[pos : pos + n])))
                if len(begun) > 1:
                    self._ended(p, offset, view, begun[0], publish=False)
                    del begun[0]
                if i + 1 < len(pieces):
                    p.ask(offset + pieces[i + 1][0], pieces[i + 1][1])
            self._ended(p, offset, view, begun[0], publish=publish)
        except BaseException:
            for *_, copy in begun:  # nothing of ours may move once the transfers end
                settle(copy.cancel)
            raise

    @staticmethod
    def _ended(p: _Pipeline, offset: int, view: memoryview,
               piece: tuple[int, int, int, Pending], *, publish: bool) -> None:
        """Wait for *piece*'s copies, then tell the daemon it is done."""
        pos, n, tid, copy = piece
        p.finish(copy)
        p.done(tid, publish=publish)
        p.answer_done(offset + pos, view[pos : pos + n])

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown()
        self.mover.close()
        self.client.close()


class _NoDirect(Exception):
    pass


def _span(piece: tuple[int, int]) -> tuple[int, int]:
    return piece[0], piece[0] + piece[1]


class _Pipeline:
    """The requests of one transfer loop and their replies, which come in the order
    the requests went (see :meth:`DirectSession._transfer`)."""

    def __init__(self, session: DirectSession, path: str, h: int, write: bool) -> None:
        self.s = session
        self.path = path
        self.h = h
        self.write = write
        #: requests sent and not answered yet, oldest first: "map" or "done"
        self.waiting: collections.deque[str] = collections.deque()
        #: transfers opened and not told done
        self.open: set[int] = set()

    def _send(self, kind: str, **args: Any) -> None:
        self.s.check(self.path)
        try:
            self.s.client.send(f"array.{kind}", {"h": self.h, **args})
        except ControlError as exc:
            raise _os_error(exc, self.path) from None
        except BaseException:
            # Interrupted mid-request: the stream may hold half of it.  The daemon
            # releases what the session holds once this process has exited.
            self.s.client.close()
            raise
        self.waiting.append(kind)

    def _receive(self) -> dict[str, Any]:
        kind = self.waiting[0]
        try:
            reply: dict[str, Any] = self.s.client.receive()
        except ControlError as exc:
            self.waiting.popleft()
            raise _os_error(exc, self.path) from None
        except BaseException:
            # Interrupted before the reply was read: it would be taken for the next
            # request's.  Give up the connection instead (see _send).
            self.s.client.close()
            raise
        self.waiting.popleft()
        if kind == "map":
            self.open.add(int(reply["t"]))
        return reply

    def ask(self, offset: int, length: int) -> None:
        self._send("map", offset=offset, length=length, write=self.write)

    def answer_map(self, offset: int, length: int) -> tuple[int, list[list[int]]]:
        """The reply to the oldest map: (transfer id, extents), which must cover
        ``[offset, offset+length)`` exactly (a read stops short at EOF: an error)."""
        r = self._receive()
        extents: list[list[int]] = r["extents"]
        if r.get("token"):  # cluster: these extents were mapped under this lease token
            self.s.mover.set_token(int(r["token"]))
        if r.get("inc"):  # cluster: the memory-server incarnations the mount adopted
            self.s.mover.adopt({str(k): int(v) for k, v in dict(r["inc"]).items()})
        pos = offset
        for e in extents:
            if e[0] != pos or e[1] <= 0:
                raise OSError(errno.EPROTO, f"the daemon mapped {e[0]}+{e[1]} where "
                              f"{pos} was next", self.path)
            pos += e[1]
        if pos > offset + length:
            raise OSError(errno.EPROTO, "the daemon mapped past the piece", self.path)
        if pos < offset + length:
            raise OSError(errno.EIO, f"the file ends at {pos}, before the array does "
                          "(truncated?)", self.path)
        return int(r["t"]), extents

    def begin(self, extents: list[list[int]], base: int, part: memoryview) -> Pending:
        try:
            return self.s.mover.begin(extents, base, part, write=self.write)
        except FsError as exc:  # a memory server died, a descriptor failed: EIO
            raise OSError(exc.errno, exc.args[1], self.path) from None

    def finish(self, copy: Pending) -> None:
        try:
            copy.wait()
        except FsError as exc:
            raise OSError(exc.errno, exc.args[1], self.path) from None

    def done(self, tid: int, *, publish: bool = False) -> None:
        self.open.discard(tid)
        self._send("done", t=tid, publish=publish)

    def answer_done(self, offset: int, part: memoryview) -> None:
        """The reply to the oldest done; a read whose chunk map moved under it (cluster)
        is read again (*offset*, *part*: that piece), at once and alone."""
        while self.waiting and self.waiting[0] == "done":
            if not self._receive().get("stale"):
                return
            for tries in range(_MAX_TRIES):
                time.sleep(map_retry_delay(tries))  # (see there: a change may wait on us)
                self.ask(offset, len(part))
                tid, extents = self.answer_map(offset, len(part))
                self.finish(self.begin(extents, offset, part))
                self.done(tid)
                if not self._receive().get("stale"):
                    return
            raise OSError(errno.EIO, "its chunk map keeps changing", self.path)

    def abandon(self) -> None:
        """After a failure (the copies have stopped): end every transfer this loop
        opened, so the daemon holds nothing for it.  A lost connection needs nothing
        (the daemon releases the transfers when this process exits)."""
        while (self.waiting or self.open) and self.s.client.connected:
            try:
                if self.waiting:
                    self._receive()
                for tid in list(self.open):
                    self.done(tid)
            except OSError:
                continue  # an error reply: the next one, or the connection is gone


class DirectFile:
    """A file in a direct session (the session is this file's own: closed with it)."""

    direct = True

    def __init__(self, session: DirectSession, path: str, h: int, size: int) -> None:
        self.session = session
        self.path = path
        self.h = h
        self.size = size

    def read(self, offset: int, view: memoryview) -> None:
        self.session.transfer(self.path, self.h, offset, view, write=False)

    def write(self, offset: int, view: memoryview, *, publish: bool = True) -> None:
        self.session.transfer(self.path, self.h, offset, view, write=True, publish=publish)

    def commit(self) -> None:
        self.session.call(self.path, "array.commit", h=self.h)

    def close(self) -> None:
        try:
            self.session.call(self.path, "array.close", h=self.h)
        except OSError:
            pass  # the daemon is gone (it released everything) or will on disconnect
        finally:
            self.session.close()


class MountFile:
    """A file opened through the mount (or any filesystem)."""

    direct = False

    def __init__(self, path: str, fd: int, size: int, temp: str | None = None,
                 dest: str | None = None) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        #: a created file's temporary name, renamed to *dest* by commit
        self.temp = temp
        self.dest = dest or path

    def read(self, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"the file ends at {offset + done}, before the "
                              "array does (truncated?)", self.path)
            done += n

    def write(self, offset: int, view: memoryview, *, publish: bool = True) -> None:
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)

    def commit(self) -> None:
        assert self.temp is not None
        os.rename(self.temp, self.dest)
        self.temp = None

    def close(self) -> None:
        try:
            os.close(self.fd)
        finally:
            if self.temp is not None:
                try:
                    os.unlink(self.temp)
                except OSError as exc:
                    log.debug("cannot remove %s: %s", self.temp, exc)


def umask() -> int:
    """This process's umask, without changing it (which is not thread-safe)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def locate(path: str) -> tuple[str, str] | None:
    """(mountpoint, path relative to it) if *path* is in a memfs mount, else None."""
    from memfs.cli.mounts import memfs_mount_of

    real = os.path.realpath(path)
    mnt = memfs_mount_of(real)
    if mnt is None:
        return None
    return mnt, "" if real == mnt else os.path.relpath(real, mnt)


def _session(path: str) -> tuple[DirectSession, str] | None:
    where = locate(path)
    if where is None:
        return None
    session = DirectSession.connect(where[0])
    return None if session is None else (session, where[1])


def open_file(path: str, *, write: bool) -> ArrayTarget:
    """An existing file, directly if this process may, else through the mount."""
    found = _session(path)
    if found is not None:
        session, rel = found
        try:
            r = session.call(path, "array.open", path=rel, write=write)
        except BaseException:
            session.close()
            raise
        return DirectFile(session, path, int(r["h"]), int(r["size"]))
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        return MountFile(path, fd, os.fstat(fd).st_size)
    except BaseException:
        os.close(fd)
        raise


def create_file(path: str, size: int, *, allocate: bool) -> ArrayTarget:
    """A new file of *size* bytes under a temporary name until ``commit``; *allocate*:
    all its space now where the pool is direct (else as it is written: ENOSPC then
    comes from a write, and the caller closes the file, which removes it).
    Replacing a file keeps its permissions."""
    mode = 0o666 & ~umask()
    found = _session(path)
    if found is not None:
        session, rel = found
        try:
            r = session.call(path, "array.create", path=rel, size=size, mode=mode,
                             allocate=allocate)
        except BaseException:
            session.close()
            raise
        return DirectFile(session, path, int(r["h"]), size)
    real = os.path.realpath(path)
    directory, name = os.path.split(real)
    short = os.fsdecode(os.fsencode(name)[:200])  # a name is at most 255 bytes
    temp = os.path.join(directory, f".{short}.memfs-array-{secrets.token_hex(4)}")
    keep: int | None = None
    try:
        keep = os.stat(real).st_mode & 0o7777
    except FileNotFoundError:
        pass
    try:
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except OSError as exc:  # the caller named the file, not our temporary one
        raise OSError(exc.errno, f"{exc.strerror} (creating it beside the file, to "
                      "rename it over the file)", path) from None
    f = MountFile(path, fd, size, temp, real)
    try:
        if keep is not None:
            os.fchmod(fd, keep)
        os.ftruncate(fd, size)
    except BaseException:
        f.close()
        raise
    return f
