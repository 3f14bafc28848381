"""The ``local`` transport: volumes are shared memory of this process.

This is the embedded default.  Each volume is a memfd mapped once and populated
at start (``MAP_POPULATE``), the analogue of memory registered with an HCA
once: no page faults or allocation on the I/O path.  Copies are single memcpys
through ``memoryview`` slices.

A memfd rather than private anonymous memory so that the mount daemon can hand
a volume to an authorised local process (:mod:`memfs.array`, over the control
socket with ``SCM_RIGHTS``), which then moves array bytes to and from it with
one ``preadv``/``pwritev``: no mapping to build, no copy through the daemon.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os

from memfs.errors import TransportError
from memfs.transport import Buffer, Transport, VolumeInfo

log = logging.getLogger(__name__)

_ZEROS = memoryview(bytes(1 << 20))


class LocalTransport(Transport):
    concurrent = False  # memcpy in this thread: nothing to overlap

    def __init__(self, n_volumes: int, volume_size: int, *, populate: bool = True) -> None:
        """*populate* False: pages are allocated when first touched (a pool that holds
        no file's bytes, ``-o passthrough``, then costs no memory)."""
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        try:
            for i in range(n_volumes):
                fd = os.memfd_create(f"memfs-volume-{i}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                self._fds.append(fd)
                os.ftruncate(fd, volume_size)
                # A process it is handed to cannot resize it under our mapping (SIGBUS).
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                m = mmap.mmap(fd, volume_size, flags=flags)
                self._maps.append(m)
                self._views.append(memoryview(m))
        except OSError as exc:
            self._release()
            raise MemoryError(
                f"cannot allocate {n_volumes} volumes of {volume_size} bytes: {exc}"
            ) from exc
        self._info = [
            VolumeInfo(i, volume_size, f"local:{i}") for i in range(n_volumes)
        ]
        log.debug("allocated %d local volumes of %d bytes", n_volumes, volume_size)

    @property
    def volumes(self) -> list[VolumeInfo]:
        return self._info

    def check_range(self, volume: int, offset: int, length: int) -> None:
        if not self._views:  # after aclose: EIO for late requests, not an IndexError
            raise TransportError("local volumes are closed")
        super().check_range(volume, offset, length)

    def volume_memory(self, volume: int) -> memoryview:
        """The memory of *volume* itself.

        For the memory server, which moves bytes between sockets and volumes
        with ``recv_into``/``sendmsg`` and no copy in between.
        """
        if not self._views:
            raise TransportError("local volumes are closed")
        return self._views[volume]

    def volume_fds(self) -> list[int]:
        """The memfd of each volume, in pool order (owned by this transport: callers
        pass them on, never close them)."""
        if not self._views:
            raise TransportError("local volumes are closed")
        return list(self._fds)

    def register(self, size: int) -> memoryview:
        return memoryview(bytearray(size))

    async def read(self, volume: int, offset: int, length: int) -> Buffer:
        self.check_range(volume, offset, length)
        return self._views[volume][offset : offset + length]

    async def readinto(self, volume: int, offset: int, buf: memoryview) -> None:
        self.check_range(volume, offset, len(buf))
        buf[:] = self._views[volume][offset : offset + len(buf)]

    async def write(self, volume: int, offset: int, data: Buffer) -> None:
        src = memoryview(data).cast("B")
        self.check_range(volume, offset, len(src))
        self._views[volume][offset : offset + len(src)] = src

    async def zero(self, volume: int, offset: int, length: int) -> None:
        self.zero_now(volume, offset, length)

    def zero_now(self, volume: int, offset: int, length: int) -> None:
        """:meth:`zero` without an event loop (the memory server's data loop)."""
        self.check_range(volume, offset, length)
        view = self._views[volume]
        end = offset + length
        while offset < end:
            n = min(end - offset, len(_ZEROS))
            view[offset : offset + n] = _ZEROS[:n]
            offset += n

    async def aclose(self) -> None:
        self._release()

    def _release(self) -> None:
        for v in self._views:
            try:
                v.release()
            except BufferError:
                log.debug("volume view still exported at close")
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a reply still holds a view; the OS frees it at exit
                log.debug("volume still referenced at close")
        for fd in self._fds:
            os.close(fd)  # the memory goes with the last mapping or descriptor elsewhere
        self._views.clear()
        self._maps.clear()
        self._fds.clear()
