"""Transports: one-sided access to (volume, offset) in a memory pool.

A transport knows nothing about files.  It exposes the pool's volumes and moves
bytes between them and client memory.  Every implementation (``local`` now,
``tcp`` and ``verbs`` against ``memfs memd`` servers) passes the same conformance
suite in ``tests/test_transport_conformance.py``.

Volumes start zero-filled (fresh anonymous memory): the metadata store hands out
never-used chunks without zeroing them, and freed ones only after the scrubber
has zeroed them (see :mod:`memfs.scrub`).

Buffers that the transport reads into should come from :meth:`Transport.register`:
for RDMA that is where memory registration happens, once, instead of per I/O.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass

Buffer = bytes | bytearray | memoryview  # collections.abc.Buffer is 3.12+


@dataclass(frozen=True, slots=True)
class VolumeInfo:
    """One volume of the pool as the transport sees it."""

    index: int
    size: int
    url: str


class Posted(abc.ABC):
    """A write handed to a transport whose server has not answered yet (post_write)."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def channel(self) -> object:
        """Writes posted on one channel are answered in the order posted: waiting for
        the last one waits for all."""

    @abc.abstractmethod
    async def wait(self) -> None:
        """Until the write's completion callback has run (success or not); never raises
        but Cancelled."""


class Transport(abc.ABC):
    """One-sided reads and writes of pool memory.

    Errors: :class:`memfs.errors.TransportError` (EIO) for unreachable or failed
    memory; ``ValueError`` for out-of-range requests (a caller bug).
    """

    #: True if requests to different volumes proceed in parallel when issued
    #: concurrently; the data engine only opens a nursery when this is set.
    concurrent: bool = False
    #: True if post_write can return before the server has the data
    posts_writes: bool = False

    @property
    @abc.abstractmethod
    def volumes(self) -> list[VolumeInfo]:
        """The volumes of the pool, indexed by ``VolumeInfo.index``."""

    @abc.abstractmethod
    def register(self, size: int) -> memoryview:
        """A buffer of *size* bytes usable as a read target, registered once."""

    @abc.abstractmethod
    async def read(self, volume: int, offset: int, length: int) -> Buffer:
        """*length* bytes at *offset* of *volume*.

        The result may alias transport memory and is only valid until the next
        await by the caller; copy it if it must live longer.
        """

    @abc.abstractmethod
    async def readinto(self, volume: int, offset: int, buf: memoryview) -> None:
        """Fill *buf* from *offset* of *volume*."""

    @abc.abstractmethod
    async def write(self, volume: int, offset: int, data: Buffer) -> None:
        """Store *data* at *offset* of *volume*."""

    async def post_write(
        self, volume: int, offset: int, data: Buffer, key: int,
        done: Callable[[Exception | None], None],
    ) -> Posted | None:
        """Store *data* at *offset* of *volume*, perhaps after returning: None if it is
        done (or a failure raised; *done* is not called), else a handle, and *done*
        is called once when the server has it (None) or it failed (a TransportError).  *data* may be
        reused once this returns (``bytes`` cannot be: a transport may hold on to
        those until the write is done).  Writes with one *key* to one volume are applied
        in the order posted.  Here: written before returning."""
        await self.write(volume, offset, data)
        return None

    @abc.abstractmethod
    async def zero(self, volume: int, offset: int, length: int) -> None:
        """Clear *length* bytes at *offset*: freed memory is reused, never exposed."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release volumes and connections."""

    def set_session(self, token: int) -> None:  # noqa: B027 (memory servers only)
        """Work under the metadata server's lease *token* (a cluster client): memory
        servers refuse a token the mds fenced.  Nothing to do for local memory."""

    def adopt(self, incarnations: Mapping[str, int]) -> None:  # noqa: B027 (memory servers only)
        """The pool's data lives in these memory-server incarnations now ("host:port"
        -> number): a server that restarted blank was taken back by the mds, after
        the files' data there was marked lost.  Nothing to do for local memory."""

    def servers_up(self) -> dict[str, bool]:
        """Memory servers by name: reachable now (a connection open, not restarted)?
        Empty for memory in this process."""
        return {}

    def check_range(self, volume: int, offset: int, length: int) -> None:
        vols = self.volumes
        if not 0 <= volume < len(vols):
            raise ValueError(f"no volume {volume} in a pool of {len(vols)}")
        if offset < 0 or length < 0 or offset + length > vols[volume].size:
            raise ValueError(
                f"range {offset}+{length} outside volume {volume} of {vols[volume].size} bytes"
            )
