"""Fences on the memory servers: a lease token whose leases were taken without the
client's word is shut out everywhere before memory it could still write is reused.

The mds hands tokens to :class:`~memfs.transport.tcp.Fences` (which its transports
deliver to every memory server before anything else they send); this keeps, per
fence begun, whether every server has confirmed it (or it was given up on after
:data:`FENCE_TIMEOUT`), so that a call granting chunks to write waits for the fences
begun before it and not for later ones.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from memfs.transport.tcp import Fences

log = logging.getLogger(__name__)

#: how long a change waits for memory servers to confirm a fence (then it goes ahead;
#: a server that has not confirmed gets the fence before anything else is sent to it)
FENCE_TIMEOUT = 3.0


class Fencing:
    """The fences a metadata server has begun, and waits for them."""

    def __init__(self) -> None:
        #: tokens to fence on the memory servers (set by memfs.mds: shared by its
        #: transports, which send a server its pending fences before anything else);
        #: None: no memory servers to fence on (tests, embedded pools)
        self.fences: Fences | None = None
        #: fences begun so far (their sequence numbers)
        self.seq = 0
        #: fences not yet answered by every server (nor given up on), by sequence number
        self._waits: dict[int, trio.Event] = {}

    @property
    def busy(self) -> bool:
        """Some fence is not confirmed yet."""
        return bool(self._waits)

    def unconfirmed(self) -> int:
        """Tokens some memory server has not confirmed (memory there is not reused)."""
        if self.fences is None:
            return 0
        return len({t for ts in self.fences.pending.values() for t in ts})

    def begin(self, nursery: trio.Nursery, token: int) -> None:
        """Fence *token* on every memory server (in the background, see :meth:`wait_begun`)."""
        if self.fences is None:
            return
        self.fences.add(token)
        self.seq += 1
        self._waits[self.seq] = trio.Event()
        nursery.start_soon(self._confirm, token, self.seq)

    async def _confirm(self, token: int, seq: int) -> None:
        """Have every memory server confirm the fence of *token*, for up to
        FENCE_TIMEOUT: through the courier (memfs.mds), or any other transport of
        ours that sends a server something (each delivers pending fences first)."""
        assert self.fences is not None
        fences = self.fences
        try:
            with trio.move_on_after(FENCE_TIMEOUT):
                while fences.waiting(token):
                    if fences.courier is not None:
                        await fences.courier.deliver_fences()
                    if fences.waiting(token):
                        await trio.sleep(0.1)  # no transport yet, or a server down
            waiting = fences.waiting(token)
            if waiting:
                log.warning("lease token %x: memory servers %s have not confirmed its fence "
                            "within %g s: writes go ahead (those servers get it before "
                            "anything else, and no memory is reused there until they do)",
                            token, ", ".join(waiting), FENCE_TIMEOUT)
            else:
                log.info("lease token %x fenced on every memory server", token)
        finally:
            self._waits.pop(seq).set()

    async def wait_begun(self, upto: int) -> bool:
        """Wait for the fences begun up to number *upto* (not later ones) to be answered
        or given up on; False if there were none.  A client granted chunks to write must
        not have its bytes overwritten by a transfer of one whose leases were taken
        before."""
        started = [ev for seq, ev in self._waits.items() if seq <= upto]
        for ev in started:
            await ev.wait()
        return bool(started)
