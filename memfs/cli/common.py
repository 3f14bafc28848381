"""What every ``memfs`` subcommand shares: exit codes, errors, logging, paths, sizes.

No trio and nothing of the daemon here (``memfs --help`` must start fast).
"""

from __future__ import annotations

import logging
import os

EXIT_USAGE = 2
#: the daemon or the backing filesystem failed (not the user's mistake)
EXIT_FAILED = 1
#: the extended attribute that excludes a tree from write-back (``off``)
FLUSH_XATTR = "user.memfs.flush"


class OperationFailed(Exception):
    """A command failed for a reason that is not a usage mistake (exit 1, one line)."""


def setup_logging(debug: bool, log_file: str | None = None) -> None:
    handler: logging.Handler
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    if not debug:
        logging.getLogger("pyfuse3").setLevel(logging.WARNING)


def canonical(path: str) -> str:
    """Absolute path with symlinks resolved in the parent only.

    ``realpath`` would stat the mountpoint itself, which hangs if its daemon is
    stuck; mount tables list canonical paths, so the parent is enough.
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    return os.path.join(os.path.realpath(parent), name) if name else path


def within(path: str, top: str) -> bool:
    """True if canonical *path* is *top* or lies below it."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def format_bytes(n: float) -> str:
    """``1.2 GiB``, ``512 B``: for people, not exact."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{int(n)} B"
