"""Domain exceptions.

Everything below the FUSE layer raises :class:`FsError` (carrying an errno);
only ``memfs.fs`` turns it into ``pyfuse3.FUSEError``.  :class:`UsageError` is a
user mistake on the command line or in a configuration string; the CLI prints
it as one line and exits non-zero.
"""

from __future__ import annotations

import errno
import os


class FsError(Exception):
    """A filesystem operation failed with *errno*."""

    def __init__(self, err: int, msg: str = "") -> None:
        super().__init__(err, msg or os.strerror(err))
        self.errno = err

    def __str__(self) -> str:
        return f"[{errno.errorcode.get(self.errno, self.errno)}] {self.args[1]}"


class SpaceBusy(FsError):
    """No clean chunk is free, but freed ones are waiting to be zeroed.

    Internal: the data engine answers it with ``Meta.reclaim()`` and one retry,
    so applications only ever see ENOSPC.
    """

    def __init__(self) -> None:
        super().__init__(errno.EAGAIN, "freed space is still being zeroed")


class TransportError(FsError):
    """Volume memory could not be read or written: always EIO to the application."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EIO, msg)


class ClaimRefused(TransportError):
    """A memory server's volume belongs to another memfs filesystem (the server said
    EBUSY to our CLAIM).  EIO to applications like any unreachable memory; the
    daemons catch it to stop with the server's message instead of going on."""


class UsageError(ValueError):
    """A bad command-line argument or configuration value."""


class ControlError(Exception):
    """A mount daemon answered a control request (``memfs flush`` ...) with an error.

    Also raised by the client when the daemon does not answer in time or drops
    the connection.  Defined here, not in :mod:`memfs.control`, so the CLI can
    catch it without importing trio.
    """

    def __init__(self, err: int, message: str) -> None:
        super().__init__(err, message)
        self.errno = err
        self.message = message

    def __str__(self) -> str:
        return self.message
