"""The ``.npy`` format as memfs.array needs it: pure functions, no I/O.

A file written by :func:`memfs.array.save` is exactly what ``numpy.save`` writes
(numpy's own header writer), so ``numpy.load`` and every other tool read it.
The header is padded by numpy to a multiple of 64 bytes, so the data that
follows it is aligned in the file; where that lands in volume memory is the
chunk map's business.

The array side: :func:`data_view` gives the bytes of an array as they go into
the file (its own memory when it is C- or Fortran-contiguous: no copy), and
:func:`empty_for` allocates an array whose memory the file's bytes fill as
they are.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import numpy.lib.format as npformat

#: every .npy file starts with this
MAGIC = b"\x93NUMPY"
#: enough of a file to hold the header of any ordinary array (longer ones are read again)
PREFIX = 4096
#: the longest header load accepts (numpy.load's default, 10,000, refuses headers of
#: wide structured dtypes that numpy.save itself writes)
MAX_HEADER = 1 << 20


@dataclass(frozen=True, slots=True)
class Header:
    """What a ``.npy`` header says."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    #: where the data starts in the file
    data_offset: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def file_size(self) -> int:
        return self.data_offset + self.nbytes


def check_dtype(dtype: np.dtype) -> None:
    """Object arrays need pickling, which memfs.array does not do (it would run code
    from the file on load)."""
    if dtype.hasobject:
        raise ValueError(f"dtype {dtype} holds Python objects: .npy can store it only "
                         "pickled, which memfs.array does not do")


def encode_header(shape: tuple[int, ...], dtype: np.dtype, fortran_order: bool) -> bytes:
    """The header ``numpy.save`` writes for such an array (format version 1.0 unless
    it is longer than 1.0 allows: 2.0).  Field names that need 3.0 (UTF-8) are refused."""
    check_dtype(dtype)
    d = {"descr": npformat.dtype_to_descr(dtype), "fortran_order": fortran_order,
         "shape": tuple(int(x) for x in shape)}
    for write in (npformat.write_array_header_1_0, npformat.write_array_header_2_0):
        buf = io.BytesIO()
        try:
            write(buf, d)
        except UnicodeEncodeError:
            raise ValueError(f"dtype {dtype} has non-Latin-1 field names (.npy format 3.0), "
                             "which memfs.array does not write") from None
        except ValueError:  # longer than 64 KiB: version 2.0
            continue
        return buf.getvalue()
    raise ValueError(f"the .npy header of dtype {dtype} is too long")


def header_length(prefix: bytes) -> int:
    """How many bytes the header needs, from the first 12 (ValueError: not .npy)."""
    if len(prefix) < 10 or prefix[:6] != MAGIC:
        raise ValueError("not a .npy file (no \\x93NUMPY magic)")
    major = prefix[6]
    if major == 1:
        return 10 + int.from_bytes(prefix[8:10], "little")
    if major == 2:
        if len(prefix) < 12:
            raise ValueError("truncated .npy header")
        return 12 + int.from_bytes(prefix[8:12], "little")
    raise ValueError(f".npy format version {major}.{prefix[7]} is not known")


def decode_header(data: bytes) -> Header:
    """Parse a header; *data* holds at least :func:`header_length` bytes (ValueError
    if it is not a .npy header, or describes an object array)."""
    need = header_length(data)
    if need > MAX_HEADER:
        raise ValueError(f".npy header of {need} bytes is longer than {MAX_HEADER}")
    if len(data) < need:
        raise ValueError("truncated .npy header")
    f = io.BytesIO(data[:need])
    version = npformat.read_magic(f)
    read = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
    shape, fortran, dtype = read(f, max_header_size=MAX_HEADER)
    check_dtype(dtype)
    return Header(tuple(shape), dtype, bool(fortran), need)


def data_view(arr: np.ndarray) -> tuple[np.ndarray, memoryview]:
    """*arr* as it is stored (C order unless it is only Fortran-contiguous) and its
    bytes, for writing into a file.  A non-contiguous array is copied once here."""
    check_dtype(arr.dtype)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        arr = np.ascontiguousarray(arr)
    return arr, byte_view(arr)


def is_fortran(arr: np.ndarray) -> bool:
    """Stored in Fortran order: contiguous that way and not in C order (as numpy.save)."""
    return bool(arr.flags.f_contiguous and not arr.flags.c_contiguous)


def byte_view(arr: np.ndarray) -> memoryview:
    """The memory of contiguous *arr* as flat bytes (writable if *arr* is), in its
    storage order."""
    if arr.nbytes == 0:
        return memoryview(b"")
    flat = arr.ravel(order="K")  # a view: contiguous either way
    if not np.may_share_memory(flat, arr):
        raise ValueError("array memory is not contiguous")
    return memoryview(np.asarray(flat).view(np.uint8)).cast("B")  # type: ignore[arg-type]


def empty_for(h: Header) -> np.ndarray:
    """An array for the data of *h*, in the file's order (its bytes are the file's)."""
    return np.empty(h.shape, dtype=h.dtype, order="F" if h.fortran_order else "C")


def check_out(out: np.ndarray, h: Header, path: str) -> None:
    """*out* can receive the data of *h* as it is (ValueError saying why not)."""
    if out.shape != h.shape or out.dtype != h.dtype:
        raise ValueError(f"{path}: out= is {out.dtype} {out.shape}, the file holds "
                         f"{h.dtype} {h.shape}")
    if not out.flags.writeable:
        raise ValueError(f"{path}: out= is read-only")
    ok = out.flags.f_contiguous if h.fortran_order else out.flags.c_contiguous
    if not ok and out.nbytes:
        order = "Fortran" if h.fortran_order else "C"
        raise ValueError(f"{path}: the file is in {order} order; out= must be "
                         f"{order}-contiguous")
