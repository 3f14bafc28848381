"""Truncates and punched holes from a cluster client (``Meta.truncate`` and
``Meta.punch`` of :class:`~memfs.meta.remote.RemoteMeta`; a punch, too, frees
chunks and zeroes parts of others): what this node waits for before the mds
frees chunks, and what it keeps out until the cut is zeroed.

The server recalls nothing from the node that asks, and frees the chunks at
once: this node's own transfers of the file under maps from before (posted
writes above all, which may still be going out) end first, and no new map of
the file is handed out here until the call is applied and its cut in the chunks
that stay zeroed (``LeaseKeeper.truncating``, ``zero_tails_with``), so that none
begins meanwhile and nothing the server answers from the file's state before the
cut is cached after it.  memfs.array processes' writes of the file get as long as
a recall's answer would give them to land (their maps of the file are refused
meanwhile, ``truncating``, so that a pipelined one ends the piece it has open);
one still under way then (a stopped process; or one whose next map, asked before
the cut, waits for the server: a reconnection, the burst buffer's dirty cap)
makes the call fail with ETXTBSY rather than free chunks it may still write.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from memfs.errors import FsError
from memfs.meta.cache import ClientCache
from memfs.meta.lease_client import LeaseKeeper
from memfs.meta.remote_maps import MapClient

log = logging.getLogger(__name__)

#: zeroes a cut's ranges (inode, [(volume, offset, length)]) in chunks that stay
ZeroTails = Callable[[int, list[tuple[int, int, int]]], Awaitable[None]]


class Cutter:
    """See the module docstring.  *call* is the client's call; *timeout* its deadline
    for one wait, after which a warning is logged and the wait goes on."""

    def __init__(self, cache: ClientCache, leases: LeaseKeeper, maps: MapClient,
                 call: Callable[..., Awaitable[Any]], timeout: float) -> None:
        self.cache = cache
        self.leases = leases
        self.maps = maps
        self._call = call
        self.timeout = timeout
        #: zeroes a cut in chunks that stay (the data engine's: zero_tails_with)
        self.zero_tails: ZeroTails | None = None

    async def sizes_told(self, ino: int) -> None:
        """Until the server has every size of *ino* we took: unsent (sent now), in a
        report, or in a recall's answer on its way (the server keeps the size it
        has until then, and a punch or seek would stop short at it)."""
        if (w := self.leases.settled_first(ino)) is not None:
            await w
        await self.leases.reports_sent(ino)
        await self.leases.answer_known(ino)

    async def cut(self, ino: int, call: str, *args: int) -> list[tuple[int, int, int]]:
        """A ``truncate`` or ``punch`` of *ino* (*call*, its arguments after the inode).

        A punch keeps the size, so every size of ours reaches the server first (it
        punches up to the end of file it knows)."""
        truncating = self.leases.truncating
        await self.leases.truncates_over(ino)  # one at a time
        if call == "punch":
            # Before it counts as under way: a close's report waits for cuts under way
            # (LeaseKeeper.reports), and this waits for that report.
            while True:
                await self.sizes_told(ino)
                if ino not in truncating:
                    break
                await self.leases.truncates_over(ino)
        truncating[ino] = gate = trio.Event()
        try:
            ranges = await self._apply(ino, call, args)
            if ranges and self.zero_tails is not None:
                # Before any map of the file is handed out here again (no await before
                # its pin: a recall read right behind the reply waits for the zeroing).
                await self.zero_tails(ino, ranges)
                return []
            return ranges
        finally:
            del truncating[ino]
            gate.set()

    async def _apply(self, ino: int, call: str, args: tuple[int, ...]) -> list[tuple[int, int, int]]:
        if (w := self.leases.settled_first(ino)) is not None:
            await w
        if self.leases.barrier is not None and self.cache.pinned_here(ino):
            await self.leases.barrier(ino)  # posted writes confirmed now, not at the next look
        cache = self.cache
        arrays_by: float | None = None
        while True:
            with trio.move_on_after(self.timeout):
                await cache.wait_unpinned([ino], here=True)
                if not cache.moving(ino):
                    break
                if arrays_by is None:
                    arrays_by = trio.current_time() + self.leases.answer_within
                with trio.move_on_at(arrays_by):
                    await cache.wait_landed(ino)
                    continue  # our own transport's again: none began meanwhile
                raise FsError(errno.ETXTBSY, "a memfs.array write of it on this node did not "
                              f"end within {self.leases.answer_within:.1f} s")
            log.warning("%s of inode %d: transfers of it begun before still run", call, ino)
        # From here no await until the call is sent (when connected): the state
        # dropped now stays dropped.
        # Our chunk map past the new size is void, and so is any size we did not send
        # (a punch keeps the size: ours was sent first, and the kernel's lock on the
        # file keeps this node's writes out until it returns).
        if call == "truncate":
            cache.dirty.pop(ino, None)
            cache.answered.pop(ino, None)
        cache.cut(ino)
        try:
            while True:
                try:
                    ranges: list[tuple[int, int, int]] = await self._call(call, ino, *args)
                    if call == "truncate":
                        self.leases.truncated(ino)
                    return ranges
                except FsError as exc:
                    # Another client's change of the file waits on the server's backing
                    # directory (memfs.meta.gates): told after a while, ask again.
                    if exc.errno != errno.EINPROGRESS:
                        raise
        finally:
            # Again: what a call answered meanwhile (before the truncate was applied,
            # or before it was asked again) brought to the cache is from before it.
            # (A write lease taken meanwhile goes from the cache, not from the
            # server: its space ahead goes back at our last close all the same.)
            if cache.is_writer(ino):
                self.maps.ahead_unsure.add(ino)
            cache.cut(ino)
