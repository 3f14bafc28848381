"""The transport a pool spec names: ``tcp://`` volumes -> tcp, ``verbs://`` -> verbs (RDMA).

Every ``memfs memd`` answers both: a ``verbs://host:port/N`` volume is the
same memd and volume as ``tcp://host:port/N``, reached by RDMA after the
control exchange on that TCP port.  A pool uses one scheme for all volumes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from memfs.config import VolumeAddr
from memfs.errors import UsageError
from memfs.transport import Transport
from memfs.transport.tcp import DEFAULT_IO_TIMEOUT, open_tcp_transport

if TYPE_CHECKING:
    from memfs.transport.verbs import RdmaDevice


def as_tcp(volumes: Sequence[VolumeAddr]) -> list[VolumeAddr]:
    """The same volumes over TCP (the metadata server's INFO and scrubbing use that)."""
    return [dataclasses.replace(v, scheme="tcp") for v in volumes]


def pool_scheme(volumes: Sequence[VolumeAddr]) -> str:
    """The one scheme of *volumes*; :class:`UsageError` for an empty or mixed pool."""
    schemes = sorted({v.scheme for v in volumes})
    if not schemes:
        raise UsageError("the pool has no volumes")
    if len(schemes) > 1:
        raise UsageError(
            f"the pool mixes {' and '.join(s + '://' for s in schemes)} volumes: "
            "use one scheme for all of them"
        )
    return schemes[0]


@asynccontextmanager
async def open_pool_transport(
    volumes: Sequence[VolumeAddr],
    secret: bytes,
    *,
    io_timeout: float = DEFAULT_IO_TIMEOUT,
    verbs_device: RdmaDevice | str | None = None,
    incarnations: Mapping[str, int] | None = None,
    fsid: bytes | None = None,
    volume_size: int | None = None,
) -> AsyncIterator[Transport]:
    """Open the transport for *volumes* (tcp or verbs) and close it on exit.

    *fsid*: the filesystem these volumes belong to, claimed on every connection
    (a volume another filesystem holds: :class:`~memfs.errors.ClaimRefused`);
    None claims nothing.  *volume_size*: the pool's, known beforehand (from the
    mds): a tcp pool then opens without a server that cannot be reached now
    (its volumes give EIO until it answers); a verbs pool still needs them all.

    For ``verbs://`` volumes this node needs an RDMA device (*verbs_device*:
    an opened one, a name, or None for the first pyverbs finds); without one
    it raises :class:`memfs.transport.verbs.RdmaUnavailable` (a
    :class:`UsageError`), e.g. "no RDMA device found (pyverbs sees none)",
    before contacting any server.
    """
    scheme = pool_scheme(volumes)
    if scheme == "verbs":
        from memfs.transport.verbs import open_verbs_transport  # pyverbs only when used

        async with open_verbs_transport(volumes, secret, device=verbs_device,
                                        io_timeout=io_timeout, fsid=fsid) as vt:
            yield vt
    else:
        async with open_tcp_transport(volumes, secret, io_timeout=io_timeout,
                                      incarnations=incarnations, fsid=fsid,
                                      volume_size=volume_size) as tt:
            yield tt
