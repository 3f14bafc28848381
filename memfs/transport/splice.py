"""Sending a caller's memory with one copy: ``vmsplice`` into a pipe, ``splice`` to the socket.

``sendall`` copies the bytes into the socket's buffers and the receiver's
``recv_into`` copies them out again: two copies of every byte, both on this
machine when the peer is a local memory server.  ``vmsplice`` instead hands the
pages of the caller's buffer to a pipe by reference, and ``splice`` hands them
on to TCP, so the only copy left is the receiver's (measured on loopback, 1 GiB
in 1 MiB pieces into ``recv_into``: 3.05 GiB/s with ``sendall``, 4.34 with
this; medians of 5, on 2026-11-25; the next day 2.3-2.9 against 1.3-1.9, so
:mod:`memfs.transport.bulk` uses it only with ``MEMFS_SPLICE_SAVES=1``).

The price is a promise: the pages are read when the peer receives them, not
when :meth:`SpliceSender.send` returns, so the caller must not change the
buffer until the peer has answered for it (a memory server answers a WRITE once
it has received the whole payload).  Bulk writes of :mod:`memfs.transport.bulk`
keep it: a transfer ends when its replies are in.  A transfer that fails
midway may leave its last bytes to be read later, by a connection that is being
closed: they land, if at all, in chunks of a write that failed.

Linux only (``vmsplice`` through ctypes); :func:`available` says whether it
works here, and senders fall back to ``sendall`` where it does not.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import select
import socket

import numpy as np

log = logging.getLogger(__name__)

#: bytes the pipe holds (and one vmsplice moves); the default pipe-max-size
PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = 1031
_SPLICE_F_NONBLOCK = 2


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_vmsplice() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).vmsplice
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_size_t, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    return fn


_vmsplice = _load_vmsplice()


def available() -> bool:
    """True if this system has ``vmsplice`` and ``os.splice``."""
    return _vmsplice is not None and hasattr(os, "splice")


def _address(view: memoryview) -> int:
    """Where *view*'s bytes start (read-only buffers too)."""
    arr: np.ndarray = np.frombuffer(view, dtype=np.uint8)
    return int(arr.ctypes.data)


class SpliceSender:
    """One pipe for sending buffers by reference to one socket (not thread-safe: a
    connection's thread owns it).  Close it with the connection."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            fcntl.fcntl(self._w, _F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass  # a smaller pipe only means more syscalls
        self._size = fcntl.fcntl(self._w, 1032)  # F_GETPIPE_SZ

    def send(self, sock: socket.socket, view: memoryview, timeout: float | None) -> None:
        """Send all of *view* on *sock* (blocking or with a timeout, as ``sendall``);
        the caller keeps *view* unchanged until the peer has answered for it."""
        base = _address(view)
        out = sock.fileno()
        total = len(view)
        done = 0
        assert _vmsplice is not None
        while done < total:
            iov = _IoVec(base + done, min(self._size, total - done))
            n = _vmsplice(self._w, ctypes.byref(iov), 1, _SPLICE_F_NONBLOCK)
            if n < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"vmsplice: {os.strerror(err)}")
            left = n
            while left:
                try:
                    left -= os.splice(self._r, out, left, flags=_SPLICE_F_NONBLOCK)
                except BlockingIOError:
                    _wait_writable(out, timeout)
            done += n

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


def _wait_writable(fd: int, timeout: float | None) -> None:
    p = select.poll()
    p.register(fd, select.POLLOUT)
    if not p.poll(None if timeout is None else int(timeout * 1000)):
        raise TimeoutError(errno.ETIMEDOUT, "send timed out")
