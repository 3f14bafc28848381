"""Fault injection for crash tests: ``MEMFS_TEST_FAULT`` (comma-separated words).

* ``hold``: apply no namespace change to DIR and write nothing back, so a test
  can kill the daemon with work pending;
* ``kill-mid-publish``: SIGKILL this process while a copy is put in place (after
  the first of a hard-linked file's renames; a single name: after the rename,
  before the file is recorded clean);
* ``kill-after-ns:KIND``: SIGKILL right after a namespace operation of KIND was
  applied to DIR, before it is recorded as applied.

Read once at import; without the variable every check is one set lookup.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

FAULTS = frozenset(w.strip() for w in os.environ.get("MEMFS_TEST_FAULT", "").split(",") if w.strip())
if FAULTS:
    log.warning("test faults armed: %s", ", ".join(sorted(FAULTS)))

HOLD = "hold" in FAULTS


def kill_at(point: str) -> None:
    """Die here, as a crash would, if the test armed *point*."""
    if point in FAULTS:
        log.warning("test fault %s: killing myself", point)
        os.kill(os.getpid(), signal.SIGKILL)
