"""Talking to a mount daemon (or ``memfs mds``) over its control socket.

:mod:`memfs.control` imports trio, so it is imported only when a command
connects: ``memfs --help`` and ``memfs mount`` start without it.
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Any

from memfs.cli.runtime import control_sockets
from memfs.errors import ControlError, UsageError

if TYPE_CHECKING:
    from memfs.control import ControlClient

#: seconds to wait for any one control request (the daemon answers at once)
CONTROL_TIMEOUT = 30.0


def connect(mnt: str, timeout: float = CONTROL_TIMEOUT) -> ControlClient:
    """A client connected to the daemon of *mnt* (see :func:`.runtime.control_sockets`)."""
    from memfs.control import ControlClient  # imports trio: only when needed

    errors: list[tuple[bool, UsageError]] = []
    for path in control_sockets(mnt):
        client = ControlClient(path, mnt, timeout=timeout)
        try:
            client.connect()
        except UsageError as exc:
            errors.append((os.path.lexists(path), exc))
            continue
        return client
    # Say why the socket that exists failed, rather than that another one is missing.
    raise next((e for there, e in errors if there), errors[0][1])


def draining_daemon(mnt: str) -> ControlClient | None:
    """A client connected to a daemon of *mnt* that still runs, or None.

    For a *mnt* that is not mounted: its daemon is then still writing back
    (``memfs umount`` was interrupted) or about to exit.
    """
    try:
        return connect(mnt, timeout=CONTROL_TIMEOUT)
    except UsageError:
        return None


def request(client: ControlClient, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """*op*'s reply; a daemon that does not do *op* (no backing directory) is a usage error."""
    try:
        result: dict[str, Any] = client.call(op, args)
    except ControlError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise UsageError(f"{client.name}: {exc.message}") from None
        raise
    return result
