"""Taking back a memory server that restarted blank (``memfs mds``).

A memd keeps nothing across a restart: the memory behind a new incarnation is
blank.  Clients tell that by the incarnation and report the data there as lost
(EIO) instead of reading zeros; but the chunks stayed in the files' maps and
the mds went on placing new data there, which every client then refused too,
so the pool was never whole again without a new filesystem.

Now, when one of the mds's own connections finds a server at an incarnation
other than the pool's (its transports call :meth:`TakeBack.restarted`; the
fence courier's transport probes every server without a usable connection
every ``PROBE_INTERVAL`` seconds, so a restart is found with nothing to send
there), :meth:`TakeBack.run`:

1. waits until evictions may run (after the mds's own restart, the writers of
   the run before must have reported first: ``evictions_held``);
2. seals that server's volumes (``Placement.sealed``): no map handed out from
   then on names a chunk there (EIO), and none is allocated there;
3. recalls, once, what clients hold of the files with chunks there (their
   maps, their write leases: writers report their sizes, so what they wrote
   there is below EOF and counts as lost).  Once is enough: what a client
   fetches after the seal names nothing there, so a reader of the files'
   other stripes cannot keep the recall going.  Without leases
   (``--lease-term 0``) it waits the clients' I/O timeout instead;
4. with no await from here to the journal record: with a backing directory,
   evicts those files that are clean (their data is in DIR and is fetched
   again when read: ``evict_clean``); drops the chunks there from every file,
   those below EOF marked lost (EIO until a truncate cuts them off, see
   :meth:`MetaStore.lose_memory`); journals that (``_memory_lost``);
5. once that is durable, records the new incarnation as the pool's (``record``:
   the journal directory's ``incarnations``; a full disk: again every
   ``RETRY_DELAY`` seconds, still sealed), adopts it on the mds's own
   transports, unseals, and tells every client (a POOL frame; each
   registration after it hears it too, and every registration's ``describe``
   carries the pool's incarnations, also after an mds restart).

Clients adopt the new incarnation only from the mds, on a session that
answered the recall (a fenced one hears it only when it registers again, with
every cache dropped and its transfers ended), so no transfer under an old map
reaches the server's new memory.  A burst-buffer fetch that had reserved
chunks there may still write into them: they are freed only when it ends
(``Placement.doomed``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from memfs.config import VolumeAddr
from memfs.meta.journal import MEMORY_LOST
from memfs.transport import Transport
from memfs.transport.tcp import DEFAULT_IO_TIMEOUT, server_name

if TYPE_CHECKING:  # the server imports this module's users
    from memfs.meta.server import MetaServer

log = logging.getLogger(__name__)

#: how often the mds connects to each memory server it has no connection to
PROBE_INTERVAL = 2.0
#: how often a take-back waiting for the mds's own restart recovery looks again
HELD_POLL = 0.25
#: how long a take-back that could not record the new incarnation waits to try again
RETRY_DELAY = 5.0
#: with no leases (``--lease-term 0``), how long a take-back waits before it frees
#: anything: what clients' transfers under maps taken before it need to end
NO_LEASE_WAIT = DEFAULT_IO_TIMEOUT
#: files named in the log line of a take-back (the rest are counted)
SHOWN = 20


class TakeBack:
    """Memory servers found restarted, and their way back into the pool."""

    def __init__(
        self, server: MetaServer, pool: list[VolumeAddr],
        record: Callable[[str, int], Awaitable[None]] | None = None,
    ) -> None:
        self.server = server
        self.pool = pool
        #: makes an incarnation the pool's, kept across mds restarts (memfs.mds's
        #: IncarnationsFile.took_back; OSError: not done); None: in memory only
        self.record = record
        #: burst buffer: evicts a clean file now (its data is in DIR); False if it is not clean
        self.evict_clean: Callable[[int], bool] | None = None
        #: servers found at another incarnation, waiting to be taken back
        self.pending: dict[str, int] = {}
        self._wake = trio.Event()
        self._transports: list[Transport] = []
        #: takes back done (tests and metrics)
        self.done = 0

    def restarted(self, name: str, incarnation: int) -> None:
        """A connection of the mds found server *name* at *incarnation*, not the pool's."""
        if self.server.incarnations.get(name) == incarnation:
            return  # taken back already (a transport not told yet)
        if self.pending.get(name) != incarnation:
            log.warning("memory server %s restarted (incarnation %x): its data is lost; "
                        "taking it back", name, incarnation)
        self.pending[name] = incarnation
        self._wake.set()

    @asynccontextmanager
    async def following(self, transport: Transport) -> AsyncIterator[None]:
        """*transport* (one of the mds's) adopts each server taken back while this is held
        (and, at once, any taken back while it opened)."""
        transport.adopt(dict(self.server.incarnations))
        self._transports.append(transport)
        try:
            yield
        finally:
            self._transports.remove(transport)

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self.pending:
                name, incarnation = next(iter(self.pending.items()))
                await self._take_back(name, incarnation)
                if self.pending.get(name) == incarnation:
                    del self.pending[name]

    async def _take_back(self, name: str, incarnation: int) -> None:
        server = self.server
        store = server.store
        volumes = {k for k, v in enumerate(self.pool) if server_name(v.host, v.port) == name}
        while server.evictions_held():  # noqa: ASYNC110 - no event says when it ends
            await trio.sleep(HELD_POLL)
        placement = store.placement
        placement.sealed |= volumes
        try:
            # Sealed: no map handed out from now on names a chunk there (EIO), so a
            # client that fetches one again during the recall holds nothing to take
            # back; those that held one before are recalled once (the readers of
            # the file's other stripes cannot keep the recall going).
            affected = store.holding(volumes)  # (sealed: no file gets chunks there now)
            await server.lease_policy.recall_held(affected)
            if server.leases.term <= 0:
                # No leases, no recall: a map taken just before the seal is used at
                # once; give such transfers the clients' I/O timeout to end.
                await trio.sleep(NO_LEASE_WAIT)
            # Nothing awaits from here to the journal record.
            evicted = [ino for ino in affected
                       if self.evict_clean is not None and self.evict_clean(ino)]
            lost = store.lose_memory(volumes)
            names = [os.fsdecode(store.path(ino) or b"(unlinked)") for ino in lost[:SHOWN]]
            server.journal_now(MEMORY_LOST, sorted(volumes))
            await server.durable()
            if self.record is None:
                server.incarnations[name] = incarnation
            else:
                while True:
                    try:
                        await self.record(name, incarnation)
                        break
                    except OSError as exc:  # (a full disk) still sealed: no writes there
                        log.error("cannot take memory server %s back: %s; trying again in "
                                  "%g s", name, exc, RETRY_DELAY)
                        await trio.sleep(RETRY_DELAY)
            server.adopted[name] = incarnation
            for t in self._transports:
                t.adopt({name: incarnation})
        finally:
            placement.sealed -= volumes
        server.sessions.tell_pool(dict(server.adopted))
        self.done += 1
        log.warning("memory server %s taken back at incarnation %x: %d file(s) lost data there "
                    "(EIO until truncated or removed)%s%s", name, incarnation, len(lost),
                    f": {', '.join(names)}{' ...' if len(lost) > SHOWN else ''}" if lost else "",
                    f"; {len(evicted)} clean one(s) will be read again from the backing "
                    "directory" if evicted else "")
