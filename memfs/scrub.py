"""The scrubber: zeroes freed chunks before they are allocated again.

Pool memory is reused without clearing.  Instead of making every writer zero
the parts of a fresh chunk it does not cover (which races when two clients
write disjoint parts of one chunk), freed chunks go to a dirty list in the
metadata store; this task zeroes them through the transport and hands them
back clean.  It runs next to the store: in the mount daemon for the embedded
pool, in ``memfs mds`` for a cluster.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import trio

from memfs.errors import TransportError
from memfs.meta.store import MetaStore
from memfs.transport import Transport

log = logging.getLogger(__name__)

BATCH = 64  # chunks per round (4 MiB at 64 KiB): bounds how long a round holds the loop
RETRY_DELAY = 1.0


class Scrubber:
    def __init__(self, store: MetaStore, transport: Transport) -> None:
        self.store = store
        self.transport = transport
        self._lock = trio.Lock()
        self._wake = trio.Event()
        store.reclaimer = self.drain
        store.on_dirty = self.poke

    def poke(self) -> None:
        """Something was freed: start a round soon."""
        self._wake.set()

    async def drain(self) -> None:
        """Zero every dirty chunk now (what ``Meta.reclaim`` waits for)."""
        async with self._lock:
            while self.store.dirty_chunks:
                batch = self.store.take_dirty(BATCH)
                try:
                    await self._zero(batch)
                except TransportError as exc:
                    self.store.return_dirty(batch)
                    log.warning("cannot zero %d freed chunks yet: %s", len(batch), exc)
                    return
                self.store.put_clean(batch)
                await trio.lowlevel.checkpoint()  # let FUSE requests in between rounds

    async def _zero(self, batch: list[tuple[int, int]]) -> None:
        cs = self.store.chunk_size
        by_volume: dict[int, list[int]] = defaultdict(list)
        for vol, voff in batch:
            by_volume[vol].append(voff)
        runs: list[tuple[int, int, int]] = []
        for vol, offs in by_volume.items():
            offs.sort()
            start = prev = offs[0]
            for off in offs[1:]:
                if off != prev + cs:
                    runs.append((vol, start, prev + cs - start))
                    start = off
                prev = off
            runs.append((vol, start, prev + cs - start))
        if self.transport.concurrent and len(by_volume) > 1:
            async with trio.open_nursery() as nursery:
                for run in runs:
                    nursery.start_soon(self.transport.zero, *run)
        else:
            for run in runs:
                await self.transport.zero(*run)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Scrub in the background whenever chunks are freed."""
        task_status.started()
        while True:
            if not self.store.dirty_chunks:
                await self._wake.wait()
                self._wake = trio.Event()
            before = self.store.dirty_chunks
            await self.drain()
            if self.store.dirty_chunks >= before:  # no progress: transport trouble
                await trio.sleep(RETRY_DELAY)
