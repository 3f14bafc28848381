"""Direct array I/O: numpy arrays stored to and loaded from the pool, bytes moved once.

Files are standard ``.npy`` files in a memfs mount: ``numpy.load`` through the
mount reads what :func:`save` wrote, and :func:`load` reads what ``numpy.save``
wrote.  What differs is the path the bytes take::

    import numpy as np
    import memfs.array

    memfs.array.save("/mnt/memfs/run1/field.npy", field)        # atomic replace
    field = memfs.array.load("/mnt/memfs/run1/field.npy")
    memfs.array.load("/mnt/memfs/run1/field.npy", out=field)    # no allocation

    with memfs.array.open("/mnt/memfs/run1/big.npy", "w", shape=(n, 1024), dtype="f8") as af:
        pass                                                     # rank 0 creates ...
    with memfs.array.open("/mnt/memfs/run1/big.npy", "r+") as af:
        af[lo:hi] = my_block                                     # ... every rank writes a slab
    with memfs.array.open("/mnt/memfs/run1/big.npy") as af:
        slab = af[lo:hi]

A process that may read every file of the mount (root, the user of its daemon,
and in embedded mode the owner of the mount's root) gets the pool itself from
the mount daemon: embedded, the volumes' memory (memfds over the control
socket); cluster, the memory servers and the mount's secret (root and the
daemon's user only).  It then copies between the array's memory and volume
memory once, asking the daemon only for names and placement.  Anyone else, and
any path outside a memfs mount, goes through the filesystem: ``preadv`` into
the array, ``pwritev`` from it.  ``ArrayFile.direct`` says which.

The mount daemon's side is :mod:`memfs.array.service`; importing it does not
import numpy (the names below are loaded on first use).

Coherence: when :func:`save` or a slab write returns, readers through the
mount (on this node: the kernel's caches are dropped; on others: through the
metadata server) see the new size, mtime and content.  :func:`load` sees what
was written through the mount and closed.

Errors are ``OSError``s with the errno and the file's name (ENOSPC leaves no
partial file and the old one intact); ``ValueError`` for arrays and files that
cannot be stored or read as ``.npy`` without pickling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfs.array.api import ArrayFile, load, open, save

__all__ = ["ArrayFile", "load", "open", "save"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from memfs.array import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
