"""The API of :mod:`memfs.array` (imported from there; see its docstring)."""

from __future__ import annotations

import errno
import os
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from memfs.array import npy
from memfs.array.files import ArrayTarget, create_file, open_file

__all__ = ["ArrayFile", "load", "open", "save"]

PathLike = str | os.PathLike[str]


def save(path: PathLike, arr: npt.ArrayLike) -> None:
    """Store *arr* at *path* as a ``.npy`` file, replacing any file there atomically.

    C- and Fortran-contiguous arrays are written from their own memory; other
    arrays are made contiguous first (one copy)."""
    p = os.fspath(path)
    a, data = npy.data_view(np.asarray(arr))  # subclasses (matrix, masked) as plain arrays
    header = npy.encode_header(a.shape, a.dtype, npy.is_fortran(a))
    # Space is allocated piece by piece as the data goes in (a failure removes the file)
    f = create_file(p, len(header) + len(data), allocate=False)
    try:
        f.write(0, memoryview(header), publish=False)
        f.write(len(header), data)
        f.commit()
    finally:
        f.close()


def load(path: PathLike, *, out: np.ndarray | None = None) -> np.ndarray:
    """The array in the ``.npy`` file at *path*; with *out*, read into it (same shape and
    dtype, contiguous in the file's order) and return it."""
    p = os.fspath(path)
    f = open_file(p, write=False)
    try:
        h = _read_header(f)
        if out is None:
            out = npy.empty_for(h)
        else:
            npy.check_out(out, h, p)
        f.read(h.data_offset, npy.byte_view(out))
        return out
    finally:
        f.close()


def open(path: PathLike, mode: str = "r", shape: tuple[int, ...] | int | None = None,
         dtype: npt.DTypeLike | None = None) -> ArrayFile:
    """An :class:`ArrayFile` on *path*.

    ``"r"``: read; ``"r+"``: read and write slabs of an existing file; ``"w"``:
    create (or atomically replace) a file of *shape* and *dtype* in C order, all
    zeros, published at once so that other processes can open it ``"r+"`` and
    fill their slabs (space is allocated now: ENOSPC here, not mid-way)."""
    return ArrayFile(os.fspath(path), mode, shape, dtype)


class ArrayFile:
    """A ``.npy`` file open for slab access along its first axis.

    ``af[i:j]`` reads rows ``i`` to ``j`` (``af[i]`` one row, ``af[...]`` all of it);
    ``af[i:j] = block`` writes them.  :meth:`read` takes ``out=``.  Slabs need a
    C-ordered file (a Fortran-ordered one is read or written whole).  Not for
    use by several threads at once; open one per thread or process.
    """

    def __init__(self, path: str, mode: str, shape: tuple[int, ...] | int | None,
                 dtype: npt.DTypeLike | None) -> None:
        if mode not in ("r", "r+", "w"):
            raise ValueError(f"mode must be 'r', 'r+' or 'w', not {mode!r}")
        self.path = path
        self.mode = mode
        self._f: ArrayTarget | None = None
        if mode == "w":
            if shape is None or dtype is None:
                raise ValueError("mode 'w' needs shape= and dtype=")
            shp = (shape,) if isinstance(shape, int) else tuple(int(x) for x in shape)
            h = npy.decode_header(npy.encode_header(shp, np.dtype(dtype), False))
            f = create_file(path, h.file_size, allocate=True)
            try:
                f.write(0, memoryview(npy.encode_header(h.shape, h.dtype, False)), publish=False)
                f.commit()
            except BaseException:
                f.close()
                raise
        else:
            if shape is not None or dtype is not None:
                raise ValueError(f"mode {mode!r} takes shape and dtype from the file")
            f = open_file(path, write=mode == "r+")
            try:
                h = _read_header(f)
            except BaseException:
                f.close()
                raise
        self._f = f
        self.header = h

    # -- what it holds -----------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return self.header.shape

    @property
    def dtype(self) -> np.dtype:
        return self.header.dtype

    @property
    def fortran_order(self) -> bool:
        return self.header.fortran_order

    @property
    def direct(self) -> bool:
        """True if bytes go straight between arrays and pool memory; False: through the mount."""
        return self._file().direct

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array file")
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"<ArrayFile {self.path!r} mode={self.mode!r} {self.dtype} {self.shape}"
                f"{' (closed)' if self._f is None else ''}>")

    # -- slabs -------------------------------------------------------------------------

    def read(self, start: int = 0, stop: int | None = None, *,
             out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` (all of them by default), into *out* if given."""
        start, stop = self._rows(start, stop)
        shape = self._slab_shape(start, stop)
        if out is None:
            out = np.empty(shape, dtype=self.dtype, order="F" if self.fortran_order else "C")
        else:
            npy.check_out(out, npy.Header(shape, self.dtype, self.fortran_order, 0), self.path)
        self._file().read(self._offset(start), npy.byte_view(out))
        return out

    def write(self, start: int, block: npt.ArrayLike) -> None:
        """Store *block* as rows ``start, start+1, ...`` (broadcast to their shape)."""
        if self.mode == "r":
            raise OSError(errno.EBADF, "opened read-only", self.path)  # as write(2) says
        b = np.asarray(block, dtype=self.dtype)
        if self.shape and b.ndim == len(self.shape) - 1:
            b = b[np.newaxis]  # one row
        n = b.shape[0] if self.shape and b.ndim else 1
        start, stop = self._rows(start, start + n if self.shape else None)
        shape = self._slab_shape(start, stop)
        if b.shape != shape:
            b = np.broadcast_to(b, shape)
        b = np.asfortranarray(b) if self.fortran_order else np.ascontiguousarray(b)
        self._file().write(self._offset(start), npy.byte_view(b))

    def __getitem__(self, key: Any) -> np.ndarray:
        start, stop, squeeze = self._key(key)
        out = self.read(start, stop)
        return out[0] if squeeze else out

    def __setitem__(self, key: Any, value: npt.ArrayLike) -> None:
        start, stop, _ = self._key(key)
        shape = self._slab_shape(start, stop)
        v = np.asarray(value, dtype=self.dtype)
        self.write(start, np.broadcast_to(v, shape) if v.shape != shape else v)

    def _key(self, key: Any) -> tuple[int, int, bool]:
        """Rows ``[start, stop)`` that *key* names, and whether it named one row."""
        if key is Ellipsis or (isinstance(key, tuple) and not key) or (
                isinstance(key, slice) and key == slice(None)):
            return 0, self.shape[0] if self.shape else 1, False
        if not self.shape:
            raise IndexError("a 0-d array file is read whole: af[...] or af[()]")
        if isinstance(key, (int, np.integer)):
            i = int(key)
            if i < 0:
                i += self.shape[0]
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"row {key} of {self.shape[0]}")
            return i, i + 1, True
        if isinstance(key, slice):
            if key.step not in (None, 1):
                raise IndexError("slabs are contiguous: no step")
            start, stop, _ = key.indices(self.shape[0])
            return start, max(start, stop), False
        raise IndexError("index an array file with one row or a slice of rows along its "
                         "first axis")

    def _rows(self, start: int, stop: int | None) -> tuple[int, int]:
        if not self.shape:
            if start or stop not in (None, 1):
                raise IndexError("a 0-d array file is read whole")
            return 0, 1
        n = self.shape[0]
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise IndexError(f"rows {start}:{stop} outside 0:{n}")
        if self.fortran_order and (start, stop) != (0, n) and len(self.shape) > 1:
            raise ValueError(f"{self.path} is in Fortran order: its rows are not contiguous, "
                             "read or write it whole")
        return start, stop

    def _slab_shape(self, start: int, stop: int) -> tuple[int, ...]:
        return (stop - start, *self.shape[1:]) if self.shape else ()

    def _offset(self, row: int) -> int:
        itemsize = self.dtype.itemsize
        for d in self.shape[1:]:
            itemsize *= d
        return self.header.data_offset + row * itemsize

    # -- lifetime ----------------------------------------------------------------------

    def _file(self) -> ArrayTarget:
        if self._f is None:
            raise ValueError(f"{self.path}: I/O on a closed array file")
        return self._f

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            f.close()

    def __enter__(self) -> ArrayFile:
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - at exit the daemon may be gone already
            pass


def _read_header(f: ArrayTarget) -> npy.Header:
    prefix = bytearray(min(npy.PREFIX, f.size))
    f.read(0, memoryview(prefix))
    try:
        need = npy.header_length(bytes(prefix))
        if need > len(prefix) and need <= min(npy.MAX_HEADER, f.size):
            prefix = bytearray(need)
            f.read(0, memoryview(prefix))
        h = npy.decode_header(bytes(prefix))
    except ValueError as exc:
        raise ValueError(f"{f.path}: {exc}") from None
    if h.file_size > f.size:
        raise ValueError(f"{f.path}: holds {f.size} bytes; its header says {h.file_size}")
    return h

