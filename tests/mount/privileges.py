"""What a write, truncate or chown takes away: set-ID bits and file capabilities.

memfs negotiates FUSE_HANDLE_KILLPRIV_V2, so the kernel leaves this to the
filesystem (see memfs.fs.Operations.init_connection).  One scenario, run on an
embedded mount (tests/mount/test_posix.py) and across two cluster clients
(tests/mount/test_cluster.py): changes are made through *here*, and the mode
must show at once through *there* (the same mount, or another node's).  The
expected modes are Linux's on tmpfs, except the one difference memfs documents:
it takes uid 0 for the kernel's CAP_FSETID test.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path

from tests.mount.test_posix import NOBODY, in_child

#: a version-2 file capability (linux/capability.h: vfs_cap_data), CAP_NET_RAW effective
CAPABILITY = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)
CAP_XATTR = "security.capability"


def _by_nobody(here: Path, fn: Callable[[], object]) -> None:
    assert in_child(fn, cwd=here, uid=NOBODY) == 0


def _append(path: str) -> Callable[[], object]:
    def fn() -> None:
        with open(path, "ab") as f:
            f.write(b"more")

    return fn


def _ftruncate(path: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, 2)
    finally:
        os.close(fd)


def check_privileges_dropped(here: Path, there: Path) -> None:
    """Every case: a fresh file owned by nobody, *mode* set by root, one action, then
    the mode seen through *there* right away."""

    def case(name: str, mode: int, action: Callable[[str], object], expect: int) -> None:
        f = here / name
        f.write_bytes(b"data")
        os.chown(f, NOBODY, NOBODY)
        os.chmod(f, mode)
        assert stat.S_IMODE(os.stat(there / name).st_mode) == mode
        action(name)
        got = stat.S_IMODE(os.stat(there / name).st_mode)
        assert got == expect, f"{name}: {oct(mode)} became {oct(got)}, not {oct(expect)}"
        assert stat.S_IMODE(os.stat(f).st_mode) == expect

    # A write by anyone but root: set-user-ID goes, set-group-ID only with group execute.
    case("w1", 0o6775, lambda n: _by_nobody(here, _append(n)), 0o775)
    case("w2", 0o6765, lambda n: _by_nobody(here, _append(n)), 0o2765)
    case("w3", 0o6775, lambda n: _append(str(here / n))(), 0o6775)  # root keeps them
    # Truncate, and open(O_TRUNC) (libfuse asks for atomic_o_trunc: that is OPEN).
    case("t1", 0o6775, lambda n: _by_nobody(here, lambda: os.truncate(n, 1)), 0o775)
    case("t2", 0o6775, lambda n: os.truncate(here / n, 1), 0o6775)
    case("t3", 0o4775, lambda n: _by_nobody(here, lambda: os.close(
        os.open(n, os.O_WRONLY | os.O_TRUNC))), 0o775)
    case("t4", 0o6775, lambda n: _by_nobody(here, lambda: _ftruncate(n)), 0o775)
    # chown, by root too; also "to the same owner" by the owner.
    case("c1", 0o6775, lambda n: os.chown(here / n, NOBODY, 0), 0o775)
    case("c2", 0o6765, lambda n: os.chown(here / n, 0, -1), 0o2765)
    case("c3", 0o6775, lambda n: _by_nobody(here, lambda: os.chown(n, NOBODY, NOBODY)), 0o775)
    # File capabilities go with any write (root's too), truncate, open(O_TRUNC) or
    # chown.  Set through *there* after a write through *here*.  The kernel removes
    # them itself (REMOVEXATTR) as long as it has not marked the inode as having
    # nothing to drop (S_NOSEC), and in these cases (found by taking memfs's removal
    # out) it had not, the other node's setxattr included: so this checks the
    # outcome, and memfs's own removal, its backstop, is checked in
    # tests/unit/test_meta_conformance.py::test_drop_privileges.
    for name, action in [
        ("k1", lambda p: _append(str(p))()),
        ("k2", lambda p: _by_nobody(here, _append(p.name))),
        ("k3", lambda p: os.truncate(p, 0)),
        ("k4", lambda p: os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))),
        ("k5", lambda p: os.chown(p, 0, 0)),
    ]:
        p = here / name
        p.write_bytes(b"data")
        os.chmod(p, 0o777)
        _append(str(p))()
        os.setxattr(there / name, CAP_XATTR, CAPABILITY)
        assert os.getxattr(p, CAP_XATTR) == CAPABILITY
        action(p)
        try:
            left = os.getxattr(there / name, CAP_XATTR)
        except OSError as exc:
            assert exc.errno == errno.ENODATA, exc
        else:
            raise AssertionError(f"{name}: capability {left!r} kept")
