"""Domain exceptions.

Everything below the FUSE layer raises :class:`FsError` (carrying an errno);
only ``memfs.fs`` turns it into ``pyfuse3.FUSEError``.  :class:`UsageError` is a
user mistake on the command line or in a configuration string; the CLI prints
it as one line and exits non-zero.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator


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


def sole_cause(
    group: BaseExceptionGroup, ignore: tuple[type[BaseException], ...] = (),
) -> BaseException | None:
    """The one exception in *group* that is not one of *ignore* (``trio.Cancelled``),
    however nested, or None.

    A daemon's tasks raise only to stop it: when one of them fails (a user error
    raised inside a nursery, say) that exception, not the nursery's group, is
    what the user must read."""
    leaves = [e for e in _leaves(group) if not isinstance(e, ignore)]
    return leaves[0] if len(leaves) == 1 else None


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


@contextlib.contextmanager
def reporting_sole_cause(ignore: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Raise the :func:`sole_cause` of an exception group leaving the block, if any:
    around ``trio.run`` of a daemon, whose tasks raise only to stop it."""
    try:
        yield
    except BaseExceptionGroup as group:
        cause = sole_cause(group, ignore)
        if cause is not None:
            raise cause from None
        raise
