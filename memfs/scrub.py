"""The scrubber: zeroes freed chunks before they are allocated again.

Pool memory is reused without clearing.  Instead of making every writer zero
the parts of a fresh chunk it does not cover (which races when two clients
write disjoint parts of one chunk), freed chunks go to a dirty list in the
metadata store; this task zeroes them through the transport and hands them
back clean.  It runs next to the store: in the mount daemon for the embedded
pool, in ``memfs mds`` for a cluster.

Processes that move bytes to and from volume memory themselves
(:mod:`memfs.array`) take a :meth:`Scrubber.hold` around each transfer: while
one is held no freed chunk is zeroed or handed out again, so a transfer that
raced a truncate or unlink lands in memory that no other file owns yet.  A round
that had to wait for holds to end makes new transfers wait (:meth:`wait_turn`)
until it is over: transfers one after the other cannot starve it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import trio

from memfs.errors import TransportError
from memfs.meta.store import MetaStore
from memfs.transport import Transport

log = logging.getLogger(__name__)

BATCH = 64  # chunks per round (4 MiB at 64 KiB): bounds how long a round holds the loop
RETRY_DELAY = 1.0
#: a volume whose server does not zero a batch within this is skipped for the round:
#: well below the clients' 10 s call timeout, which a write waiting in reclaim() shares
ZERO_TIMEOUT = 3.0
#: how long a round waits for direct transfers (memfs.array) to let it run; then it
#: ends (a writer waiting for space gets ENOSPC) and a background round retries
HOLD_PATIENCE = 3.0


class Scrubber:
    def __init__(self, store: MetaStore, transport: Transport) -> None:
        self.store = store
        self.transport = transport
        self._lock = trio.Lock()
        self._wake = trio.Event()
        #: volumes the last round could not zero, with the reason (logged once)
        self._failing: dict[int, str] = {}
        #: transfers in progress outside this process (see :meth:`hold`)
        self._holds = 0
        self._unheld = trio.Event()
        #: a round waits for holds to end: new ones wait for the round (see wait_turn)
        self._wanting = False
        self._turn = trio.Event()
        #: waits until no reader still copies out of memory freed before the call;
        #: False if it gave up (the mount's FUSE layer sets it: its read replies
        #: are copied from pool memory after read() returned, see
        #: memfs.fs.replies_written)
        self.quiesce: Callable[[], Awaitable[bool]] | None = None
        store.space.reclaimer = self.drain
        store.space.on_dirty = self.poke

    @contextmanager
    def hold(self) -> Iterator[None]:
        """No freed chunk is zeroed or made allocatable again while this is held.

        Held by the mount daemon for a local process's direct transfer (one piece
        of at most :data:`memfs.array.service.PIECE` bytes, until the process says
        it is done or has exited); taken after :meth:`wait_turn`."""
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            if not self._holds:
                self._unheld.set()

    async def wait_turn(self) -> None:
        """Until no round is waiting for holds to end (call before taking a new one)."""
        while self._wanting:
            await self._turn.wait()

    async def _wait_unheld(self) -> None:
        if not self._holds:
            return
        self._wanting = True
        while self._holds:
            self._unheld = trio.Event()
            await self._unheld.wait()

    def poke(self) -> None:
        """Something was freed: start a round soon."""
        self._wake.set()

    async def drain(self) -> None:
        """Zero every dirty chunk now (what ``Meta.reclaim`` waits for).

        Volumes that failed in the last round are left to the background rounds,
        which retry them: a write waiting here must not wait for a dead or hung
        memory server (its chunks stay dirty), nor time out on it.
        """
        await self._drain(retry=False)

    async def _drain(self, *, retry: bool) -> None:
        """One round.  Volumes whose memory server fails are skipped for the rest of
        it: one dead server must not keep the others' freed space from being reused."""
        async with self._lock:
            try:
                await self._round(retry=retry)
            finally:
                if self._wanting:  # transfers held back for this round go on
                    self._wanting = False
                    turn, self._turn = self._turn, trio.Event()
                    turn.set()

    async def _round(self, *, retry: bool) -> None:
        failed: dict[int, str] = {} if retry else dict(self._failing)
        skipped = set(failed)
        while True:
            # Transfers are waited for only so long, under the lock a writer waiting
            # for space (reclaim) needs too: a stopped process may hold one for good;
            # that writer gets ENOSPC, not a hang, and background rounds try again.
            with trio.move_on_after(HOLD_PATIENCE) as waited:
                await self._wait_unheld()
            if waited.cancelled_caught:
                break
            batch = self.store.space.take_dirty(BATCH, skip=failed)
            if not batch:
                break
            try:
                if self.store.wait_durable is not None:
                    # The records that freed these chunks first (see MetaStore).
                    await self.store.wait_durable()
                if self.quiesce is not None and not await self.quiesce():
                    # Replies still copying out of them (the mount is going away):
                    # they stay dirty, for a later round (no volume is at fault).
                    self.store.space.return_dirty(batch)
                    log.warning("freed chunks not zeroed yet: read replies not written")
                    break
                bad = await self._zero(batch)
            except BaseException:
                # Cancelled (a waiting call gave up, its connection dropped):
                # the batch stays dirty, or it would be lost to every round
                # after (neither dirty nor allocatable).  Zeroed again later.
                self.store.space.return_dirty(batch)
                raise
            if bad:
                self.store.space.return_dirty([c for c in batch if c[0] in bad])
                batch = [c for c in batch if c[0] not in bad]
                failed.update(bad)
            self.store.space.put_clean(batch)
            await trio.lowlevel.checkpoint()  # let FUSE requests in between rounds
        for vol, msg in failed.items():
            if vol not in skipped and self._failing.get(vol) != msg:  # once, not every retry
                log.warning("cannot zero freed chunks of volume %d yet: %s", vol, msg)
        for vol in set(self._failing) - set(failed):
            if not self.store.space.allocators[vol].dirty:
                log.info("freed chunks of volume %d are being zeroed again", vol)
        self._failing = failed

    async def _zero(self, batch: list[tuple[int, int]]) -> dict[int, str]:
        """Zero *batch*; returns the volumes that failed, with the reason."""
        cs = self.store.chunk_size
        by_volume: dict[int, list[int]] = defaultdict(list)
        for vol, voff in batch:
            by_volume[vol].append(voff)
        failed: dict[int, str] = {}

        async def zero_volume(vol: int, offs: list[int]) -> None:
            offs.sort()
            runs: list[tuple[int, int]] = []
            start = prev = offs[0]
            for off in offs[1:]:
                if off != prev + cs:
                    runs.append((start, prev + cs - start))
                    start = off
                prev = off
            runs.append((start, prev + cs - start))
            try:
                with trio.move_on_after(ZERO_TIMEOUT) as scope:
                    for off, length in runs:
                        await self.transport.zero(vol, off, length)
                if scope.cancelled_caught:
                    failed[vol] = f"not zeroed within {ZERO_TIMEOUT:g} s"
            except TransportError as exc:
                failed[vol] = str(exc)

        if self.transport.concurrent and len(by_volume) > 1:
            async with trio.open_nursery() as nursery:
                for vol, offs in by_volume.items():
                    nursery.start_soon(zero_volume, vol, offs)
        else:
            for vol, offs in by_volume.items():
                await zero_volume(vol, offs)
        return failed

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Scrub in the background whenever chunks are freed."""
        task_status.started()
        while True:
            if not self.store.space.dirty_chunks:
                await self._wake.wait()
                self._wake = trio.Event()
            before = self.store.space.dirty_chunks
            await self._drain(retry=True)
            if self.store.space.dirty_chunks >= before:  # no progress: transport trouble
                await trio.sleep(RETRY_DELAY)
