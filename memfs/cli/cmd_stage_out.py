"""``memfs stage-out MNT/PATH --archive FILE``: write a tree as one tar archive
instead of file by file, and exclude it from write-back (``user.memfs.flush=off``)."""

from __future__ import annotations

import argparse
import contextlib
import os

from memfs.cli.common import FLUSH_XATTR, OperationFailed, canonical, within
from memfs.cli.mounts import memfs_mount_of
from memfs.cli.progress import ProgressLine, stderr_is_terminal
from memfs.cli.tar import write_archive
from memfs.errors import UsageError


def run(args: argparse.Namespace) -> int:
    src = canonical(args.path)
    mnt = memfs_mount_of(src)
    if mnt is None:
        raise UsageError(f"{args.path} is not inside a memfs mount")
    if not os.path.lexists(src):
        raise UsageError(f"{args.path} does not exist")
    if os.path.islink(src):
        raise UsageError(f"{args.path} is a symbolic link: name what it points to")
    if src == mnt:
        raise UsageError(f"{args.path} is the root of the memfs mount: stage-out would exclude "
                         "the whole filesystem from write-back; name a directory in it")
    archive = canonical(args.archive)
    if within(archive, mnt):
        raise UsageError(f"archive {args.archive} is inside the memfs mount {mnt} "
                         "(it belongs in the backing filesystem)")
    if within(archive, src):
        raise UsageError(f"archive {args.archive} is inside {args.path}")
    if not os.path.isdir(os.path.dirname(archive)):
        raise UsageError(f"directory {os.path.dirname(archive)} for the archive does not exist")
    if os.path.isdir(archive):
        raise UsageError(f"archive {args.archive} is a directory")
    try:
        was_excluded = os.getxattr(src, FLUSH_XATTR) == b"off"
    except OSError:
        was_excluded = False
    try:  # first, so the tree is not also written back file by file meanwhile
        os.setxattr(src, FLUSH_XATTR, b"off")
    except OSError as exc:
        raise OperationFailed(f"cannot exclude {args.path} from write-back "
                              f"({FLUSH_XATTR}): {exc.strerror}") from None
    show = stderr_is_terminal()
    try:
        with ProgressLine(show) as line:
            write_archive(src, archive, line.update if show else None)
    except BaseException:
        # No archive: the tree must not stay excluded, or nothing would keep it.
        if not was_excluded:
            with contextlib.suppress(OSError):
                os.removexattr(src, FLUSH_XATTR)
        raise
    return 0
