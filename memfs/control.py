"""The mount daemon's control socket, and the blocking client the CLI uses.

``memfs flush``, ``status``, ``stage-in`` and ``umount`` talk to a running
mount daemon through a Unix stream socket (``cli.control_socket(MNT)``), which
hands each request to :meth:`memfs.meta.Meta.control` (the burst-buffer engine,
:mod:`memfs.flush`, or in cluster mode the metadata server behind it).

Protocol: newline-delimited JSON, any number of requests per connection,
answered in order.  A request is ``{"op": str, "args": {...}}``; the reply is
``{"ok": result}`` or ``{"error": message, "errno": n}``.  A line longer than
:data:`MAX_LINE`, or one that is not such an object, is answered EINVAL and the
connection is closed.  A connection idle for :data:`IDLE_TIMEOUT` is closed
(not one whose array session holds files: a program may compute for hours
between slab writes).
Nothing a client does stops the daemon or logs more than a warning.

Requests named ``array.*`` belong to a direct-access session of
:mod:`memfs.array` (one per connection, made on the first such request by the
*sessions* factory; see :mod:`memfs.array.service`).  Their replies may carry
file descriptors (``SCM_RIGHTS``); when the connection ends, however it ends,
the session is closed.

Who may use it: root, the daemon's own user, and the owner of the mount's root
directory (a Slurm prolog mounts as root and gives the mount to the job's
user), checked with ``SO_PEERCRED`` at each connection before anything else.
The socket file itself is mode 0666: the directory it is in decides who can
reach it (root's daemons: ``/run/memfs-ctl``, mode 0755; a user's: their own
0700 runtime directory).  Refused peers do not count against
:data:`MAX_CONNECTIONS`, and their refusal is sent without waiting long for
them, so other users cannot crowd out the owner.
"""

from __future__ import annotations

import array
import errno
import json
import logging
import math
import os
import socket
import stat
import struct
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

import trio

from memfs.errors import ControlError, FsError, UsageError
from memfs.host import Peer
from memfs.meta import Meta

log = logging.getLogger(__name__)

__all__ = ["ControlClient", "ControlError", "serve_control"]

#: longest request line (a flush or stage-in names paths: thousands fit)
MAX_LINE = 1 << 20
#: longest reply line the client accepts (status with 20 errors is a few KiB)
MAX_REPLY = 16 << 20
#: a connection with no complete request for this long is closed
IDLE_TIMEOUT = 300.0
#: a reply the client does not take within this is dropped with its connection
SEND_TIMEOUT = 10.0
#: the engine answers at once (work is started, not waited for); in cluster mode
#: this covers the metadata server's RPC deadline with room to spare
CALL_TIMEOUT = 60.0
#: connections served at once; more are answered EBUSY and closed
MAX_CONNECTIONS = 64
#: after an error that ends a connection, input is read and dropped for this long
#: (at most :data:`LINGER_BYTES`) so the client can finish sending and read the reply
#: instead of meeting ECONNRESET
LINGER = 1.0
LINGER_BYTES = 4 * MAX_LINE
#: refused peers being answered at once; more are closed without a word
MAX_REFUSALS = 16
#: how long a refused peer is given to take its answer
REFUSE_TIMEOUT = 1.0
#: how long to wait for the mount root's owner (cluster mode asks the metadata server)
OWNER_TIMEOUT = 10.0
#: a refused uid is logged at most once per this many seconds
REFUSAL_LOG_INTERVAL = 60.0
#: the mount's root directory
ROOT_INO = 1
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


#: most descriptors a reply carries (the kernel's SCM_MAX_FD)
MAX_FDS = 253


class _BadRequest(Exception):
    """The request cannot be understood: reply EINVAL and close the connection."""


class ControlSession(Protocol):
    """Per-connection state for ``array.*`` requests (:class:`memfs.array.service.ArraySession`)."""

    @property
    def busy(self) -> bool:
        """Holds files or transfers: the connection is not closed for being idle."""

    async def call(self, op: str, args: dict[str, Any]) -> tuple[dict[str, Any], list[int]]: ...

    async def aclose(self) -> None: ...


SessionFactory = Callable[[Peer], ControlSession]


# -- server ------------------------------------------------------------------------------


async def serve_control(
    path: str,
    meta: Meta,
    *,
    sessions: SessionFactory | None = None,
    idle_timeout: float = IDLE_TIMEOUT,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve control requests for *meta* on the Unix socket *path* until cancelled.

    A stale socket left at *path* by a dead daemon is replaced (anything else
    there is an error: ``FileExistsError``).  Reports readiness through
    *task_status* once connections are accepted; removes the socket file when
    it stops.  Binding errors (a missing directory, a path longer than
    ``sun_path``) are raised before readiness.
    """
    _remove_stale(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ident: tuple[int, int] | None = None
    try:
        await sock.bind(path)
        st = os.stat(path)
        ident = (st.st_dev, st.st_ino)
        # Reachable by whoever can enter the directory; the peer check decides
        # who is served (between bind and chmod the umask decides: the same).
        os.chmod(path, 0o666)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        server = _Server(meta, idle_timeout, sessions)
        async with trio.open_nursery() as nursery:
            task_status.started()
            log.debug("control socket %s ready", path)
            await server.accept_loop(listener, nursery)
    finally:
        sock.close()
        if ident is not None:
            _remove_ours(path, ident)


def _remove_stale(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, f"{path} exists and is not a socket")
    os.unlink(path)


def _remove_ours(path: str, ident: tuple[int, int]) -> None:
    """Unlink *path* unless it has been replaced by someone else's socket meanwhile."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)
    except OSError:
        pass


class _Server:
    def __init__(self, meta: Meta, idle_timeout: float, sessions: SessionFactory | None) -> None:
        self.meta = meta
        self.idle_timeout = idle_timeout
        self.sessions = sessions
        self.connections = 0
        self.refusals = 0
        self.refused_logged: dict[int, float] = {}

    async def accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE, ENOBUFS, ...: wait for resources, keep serving
                log.warning("control socket: accept failed: %s", exc)
                await trio.sleep(1.0)
                continue
            nursery.start_soon(self.serve_connection, stream)

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                peer = _peer(stream.socket)
                owner = await self._allowed(peer.uid)
                if owner is not None:
                    await self._refuse_peer(stream, peer.uid, owner)
                    return
                self.connections += 1
                try:
                    await self._converse(stream, peer)
                finally:
                    self.connections -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("control connection ended: %s", exc)

    async def _allowed(self, uid: int) -> int | None:
        """None if *uid* may use the socket; else the mount root's owner (-1: unknown)."""
        if uid in (0, os.geteuid()):
            return None
        owner = -1
        with trio.move_on_after(OWNER_TIMEOUT):
            try:
                owner = (await self.meta.getattr(ROOT_INO)).uid
            except Exception as exc:  # noqa: BLE001 - then only root and the daemon's user
                log.debug("control socket: no owner of the mount root: %s", exc)
        return None if owner == uid else owner

    async def _refuse_peer(self, stream: trio.SocketStream, uid: int, owner: int) -> None:
        now = time.monotonic()
        if now - self.refused_logged.get(uid, -REFUSAL_LOG_INTERVAL) >= REFUSAL_LOG_INTERVAL:
            if len(self.refused_logged) > 1000:
                self.refused_logged.clear()
            self.refused_logged[uid] = now
            log.warning("control socket: refused a connection from uid %d", uid)
        if self.refusals >= MAX_REFUSALS:
            return  # a flood: closed without a word
        self.refusals += 1
        try:
            who = f"the owner of the mount (uid {owner})" if owner >= 0 else "the daemon's user"
            await self._refuse(stream, errno.EACCES,
                               f"uid {uid} may not control this mount: only root and {who} may",
                               patience=REFUSE_TIMEOUT, owner=owner)
        finally:
            self.refusals -= 1

    async def _converse(self, stream: trio.SocketStream, peer: Peer) -> None:
        if self.connections > MAX_CONNECTIONS:
            log.warning("control socket: more than %d connections, refusing one", MAX_CONNECTIONS)
            await self._refuse(stream, errno.EBUSY, "too many control connections")
            return
        buf = bytearray()
        session: ControlSession | None = None
        try:
            while True:
                try:
                    busy = session is not None and session.busy
                    line = await self._read_line(stream, buf,
                                                 math.inf if busy else self.idle_timeout)
                    if line is None:
                        return
                    op, args = _parse_request(line)
                except _BadRequest as exc:
                    log.warning("control socket: %s; closing the connection", exc)
                    await self._refuse(stream, errno.EINVAL, str(exc))
                    return
                if not op.startswith("array."):
                    if not await self._send(stream, await self._call(op, args)):
                        return
                    continue
                fds: list[int] = []
                if self.sessions is None:
                    reply = _error(errno.ENOTSUP, "this daemon serves no direct array "
                                                  "access")
                else:
                    if session is None:
                        session = self.sessions(peer)
                    reply, fds = await self._session_call(session, op, args)
                if not await self._send(stream, reply, fds=fds):
                    return
        finally:
            if session is not None:
                await session.aclose()

    async def _session_call(
        self, session: ControlSession, op: str, args: dict[str, Any]
    ) -> tuple[bytes, list[int]]:
        try:
            with trio.fail_after(CALL_TIMEOUT):
                result, fds = await session.call(op, args)
            return _encode({"ok": result}), fds
        except FsError as exc:
            return _error(exc.errno, exc.args[1]), []
        except trio.TooSlowError:
            log.warning("control %s: no answer within %.0f s", op, CALL_TIMEOUT)
            return _error(errno.ETIMEDOUT, f"{op}: no answer within {CALL_TIMEOUT:.0f} s"), []
        except Exception as exc:
            log.exception("control %s failed", op)
            return _error(errno.EIO, f"{op} failed in the daemon ({type(exc).__name__}: "
                                     f"{exc}); see its log"), []

    async def _refuse(self, stream: trio.SocketStream, err: int, message: str, *,
                      patience: float = SEND_TIMEOUT, **extra: Any) -> None:
        """Answer with an error, then close gracefully (see :data:`LINGER`)."""
        if not await self._send(stream, _error(err, message, **extra), patience):
            return
        with trio.move_on_after(LINGER):
            await stream.send_eof()
            dropped = 0
            while dropped < LINGER_BYTES and (data := await stream.receive_some(65536)):
                dropped += len(data)

    async def _read_line(
        self, stream: trio.SocketStream, buf: bytearray, wait: float
    ) -> bytes | None:
        """The next request line, without its newline; None at EOF or after *wait* seconds."""
        with trio.move_on_after(wait):
            while True:
                end = buf.find(b"\n")
                if end > MAX_LINE or (end < 0 and len(buf) > MAX_LINE):
                    raise _BadRequest(f"request longer than {MAX_LINE >> 20} MiB")
                if end >= 0:
                    line = bytes(buf[:end])
                    del buf[: end + 1]
                    return line
                data = await stream.receive_some(65536)
                if not data:
                    if buf.strip():
                        raise _BadRequest("request not terminated by a newline")
                    return None
                buf += data
        log.debug("control connection idle for %.0f s, closing it", wait)
        return None

    async def _call(self, op: str, args: dict[str, Any]) -> bytes:
        try:
            with trio.fail_after(CALL_TIMEOUT):
                result = await self.meta.control(op, args)
            return _encode({"ok": result})
        except FsError as exc:
            return _error(exc.errno, exc.args[1])
        except trio.TooSlowError:
            log.warning("control %s: no answer within %.0f s", op, CALL_TIMEOUT)
            return _error(errno.ETIMEDOUT, f"{op}: no answer within {CALL_TIMEOUT:.0f} s")
        except Exception as exc:
            log.exception("control %s failed", op)
            return _error(errno.EIO, f"{op} failed in the daemon ({type(exc).__name__}: {exc}); "
                                     "see its log")

    async def _send(self, stream: trio.SocketStream, data: bytes,
                    patience: float = SEND_TIMEOUT, fds: list[int] | None = None) -> bool:
        """Send one reply (with *fds* attached to its first byte); False (connection to
        be closed) if the client will not take it within *patience* seconds."""
        with trio.move_on_after(patience):
            if fds:
                sent = await stream.socket.sendmsg(
                    [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                data = data[sent:]
            if data:
                await stream.send_all(data)
            return True
        if patience >= SEND_TIMEOUT:
            log.warning("control socket: client took no reply for %.0f s, closing", patience)
        return False


def _peer(sock: trio.socket.SocketType) -> Peer:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(creds)
    return Peer(pid, uid, gid)


def _parse_request(line: bytes) -> tuple[str, dict[str, Any]]:
    try:
        req = json.loads(line)
    except (ValueError, RecursionError):  # also bad UTF-8; RecursionError: [[[[...]]]]
        raise _BadRequest("request is not JSON") from None
    if not isinstance(req, dict) or not set(req) <= {"op", "args"}:
        raise _BadRequest('request is not an object {"op": ..., "args": {...}}')
    op = req.get("op")
    args = req.get("args", {})
    if not isinstance(op, str) or not op or len(op) > 64:
        raise _BadRequest('request has no "op" string')
    if not isinstance(args, dict):
        raise _BadRequest('request "args" is not an object')
    return op, args


def _encode(reply: dict[str, Any]) -> bytes:
    return json.dumps(reply, separators=(",", ":")).encode() + b"\n"


def _error(err: int, message: str, **extra: Any) -> bytes:
    return _encode({"error": message, "errno": err, **extra})


# -- client ------------------------------------------------------------------------------


class ControlClient:
    """A blocking connection to a mount daemon's control socket (for the CLI).

    *name* is what error messages call the mount (its mountpoint).  Failing to
    connect, or being refused for who we are, is a :class:`UsageError`; an
    error reply, a timeout or a dropped connection is :class:`ControlError`.
    """

    def __init__(self, path: str | os.PathLike[str], name: str, *, timeout: float = 10.0) -> None:
        self.path = os.fspath(path)
        self.name = name
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = bytearray()

    def __enter__(self) -> ControlClient:
        if self._sock is None:
            self.connect()
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise UsageError(
                f"no control socket {self.path}: is the memfs daemon of {self.name} running?"
            ) from None
        except PermissionError:
            sock.close()
            raise UsageError(f"no permission to use {self.path}: the daemon of {self.name} "
                             "belongs to another user") from None
        except OSError as exc:
            sock.close()
            raise UsageError(f"cannot reach the daemon of {self.name} at {self.path}: "
                             f"{exc.strerror or exc}") from None
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def connected(self) -> bool:
        """False once closed, or after an error that ended the connection."""
        return self._sock is not None

    def call(self, op: str, args: dict[str, Any] | None = None,
             timeout: float | None = None, *, fds: list[int] | None = None) -> dict[str, Any]:
        """Send one request and return the ``ok`` result; raises :class:`ControlError`.

        Descriptors that come with the reply are appended to *fds* if given (and
        closed if not)."""
        self.send(op, args, timeout)
        return self.receive(timeout, fds=fds)

    def send(self, op: str, args: dict[str, Any] | None = None,
             timeout: float | None = None) -> None:
        """Send a request without waiting for its reply: :meth:`receive` takes the
        replies in the order of the requests (several may be under way)."""
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        line = json.dumps({"op": op, "args": args or {}}, separators=(",", ":")).encode() + b"\n"
        try:
            self._sock.settimeout(self.timeout if timeout is None else timeout)
            self._sock.sendall(line)
        except OSError as exc:
            raise self._lost(exc) from None

    def receive(self, timeout: float | None = None, *,
                fds: list[int] | None = None) -> dict[str, Any]:
        """The reply to the oldest request sent and not yet answered (see :meth:`call`)."""
        if self._sock is None:
            raise ControlError(errno.EIO, f"lost the connection to the daemon of {self.name}")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            reply = self._read_line(deadline, fds)
        except OSError as exc:
            raise self._lost(exc) from None
        except ControlError:
            self.close()
            raise
        try:
            value = json.loads(reply)
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, dict) and isinstance(value.get("ok"), dict):
            return value["ok"]
        if isinstance(value, dict) and isinstance(value.get("errno"), int):
            if value["errno"] == errno.EACCES and isinstance(value.get("owner"), int):
                # Refused for who we are: as if we could not connect.
                self.close()
                owner = value["owner"]
                who = f"the owner of {self.name} (uid {owner})" if owner >= 0 \
                    else "the user of its daemon"
                raise UsageError(f"only root and {who} may control this mount "
                                 f"(you are uid {os.getuid()})")
            raise ControlError(value["errno"], str(value.get("error") or os.strerror(value["errno"])))
        self.close()
        raise ControlError(errno.EPROTO, f"the daemon of {self.name} sent a malformed reply")

    def _lost(self, exc: OSError) -> ControlError:
        """The connection is unusable after *exc* (a late reply must not be taken for
        the next request's): closed, and the error to raise."""
        self.close()
        if isinstance(exc, TimeoutError):
            return ControlError(errno.ETIMEDOUT, f"no answer from the daemon of {self.name} in time")
        return ControlError(errno.EIO, f"lost the connection to the daemon of {self.name}: "
                                       f"{exc.strerror or exc}")

    def _read_line(self, deadline: float, fds: list[int] | None = None) -> bytes:
        assert self._sock is not None
        while (end := self._buf.find(b"\n")) < 0:
            if len(self._buf) > MAX_REPLY:
                raise ControlError(errno.EPROTO, f"the daemon of {self.name} sent an oversized reply")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._sock.settimeout(left)
            data, got, flags, _ = socket.recv_fds(self._sock, 1 << 16, MAX_FDS,
                                                  socket.MSG_CMSG_CLOEXEC)
            if fds is not None:
                fds.extend(got)
            else:
                for fd in got:
                    os.close(fd)
            if flags & socket.MSG_CTRUNC:
                raise ControlError(errno.EPROTO, f"the daemon of {self.name} sent more "
                                                 "descriptors than one message holds")
            if not data:
                raise ConnectionResetError(errno.ECONNRESET, "the daemon closed the connection")
            self._buf += data
        line = bytes(self._buf[:end])
        del self._buf[: end + 1]
        return line
