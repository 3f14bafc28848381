"""Taking back a memory server that restarted blank (``memfs mds``).

A memd keeps nothing across a restart: the memory behind a new incarnation is
blank.  Clients tell that by the incarnation and report the data there as lost
(EIO) instead of reading zeros; but the chunks stayed in the files' maps and
the mds went on placing new data there, which every client then refused too,
so the pool was never whole again without a new filesystem.

Now, when one of the mds's own connections finds a server at an incarnation
other than the pool's (its transports call :meth:`TakeBack.restarted`; the
fence courier's transport probes every server without a connection every
``PROBE_INTERVAL`` seconds, so a restart is found with nothing to send there),
:meth:`TakeBack.run`:

1. waits until calls run and evictions may (after the mds's own restart, the
   writers of the run before must have reported first: ``evictions_held``);
2. recalls everything clients cache of the files with chunks on that server's
   volumes (their maps, their write leases: writers report their sizes);
3. with a backing directory, evicts those files that are clean: their data is
   in DIR and is fetched again when read (``evict_clean``);
4. drops the chunks there from every file, those below EOF marked lost (EIO
   until a truncate cuts them off, see :meth:`MetaStore.lose_memory`), and
   journals that (``_memory_lost``) and waits for it to be durable;
5. records the new incarnation as the pool's (``save``: the journal
   directory's ``incarnations``), adopts it on the mds's own transports and
   tells every client (a POOL frame; each registration after it hears it too).

Steps 3 and 4 run with no await between them and the end of the recall, so no
client holds a map of those chunks when they are freed.  Clients adopt the new
incarnation only from the mds, on a session that answered the recall (a
fenced one hears it only when it registers again, with every cache dropped),
so no transfer under an old map reaches the server's new memory.
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
from memfs.transport.tcp import server_name

if TYPE_CHECKING:  # the server imports this module's users
    from memfs.meta.server import MetaServer

log = logging.getLogger(__name__)

#: how often the mds connects to each memory server it has no connection to
PROBE_INTERVAL = 2.0
#: how often a take-back waiting for the mds's own restart recovery looks again
HELD_POLL = 0.25
#: how long a take-back that could not save waits before it tries again
RETRY_DELAY = 5.0
#: files named in the log line of a take-back (the rest are counted)
SHOWN = 20


class TakeBack:
    """Memory servers found restarted, and their way back into the pool."""

    def __init__(
        self, server: MetaServer, pool: list[VolumeAddr],
        save: Callable[[dict[str, int]], Awaitable[None]] | None = None,
    ) -> None:
        self.server = server
        self.pool = pool
        #: keeps the pool's incarnations across mds restarts (None: no journal)
        self.save = save
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
        """*transport* (one of the mds's) adopts each server taken back while this is held."""
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
                try:
                    await self._take_back(name, incarnation)
                except OSError as exc:  # the incarnations file (a full disk): again later
                    log.error("cannot take memory server %s back: %s; trying again in %g s",
                              name, exc, RETRY_DELAY)
                    await trio.sleep(RETRY_DELAY)
                    continue
                if self.pending.get(name) == incarnation:
                    del self.pending[name]

    async def _take_back(self, name: str, incarnation: int) -> None:
        server = self.server
        store = server.store
        volumes = {k for k, v in enumerate(self.pool) if server_name(v.host, v.port) == name}
        while server.evictions_held():  # noqa: ASYNC110 - no event says when it ends
            await trio.sleep(HELD_POLL)
        # Files given chunks there during a recall are recalled too: until no client
        # holds a map of any (then nothing awaits up to the journal record).
        while server.lease_policy.cached(affected := store.holding(volumes)):
            await server.recall_inodes(affected)
        evicted = [ino for ino in affected
                   if self.evict_clean is not None and self.evict_clean(ino)]
        lost = store.lose_memory(volumes)
        names = [os.fsdecode(store.path(ino) or b"(unlinked)") for ino in lost[:SHOWN]]
        server.journal_now(MEMORY_LOST, sorted(volumes))
        await server.durable()
        if self.save is not None:
            await self.save({**server.incarnations, name: incarnation})
        server.incarnations[name] = incarnation
        server.adopted[name] = incarnation
        for t in self._transports:
            t.adopt({name: incarnation})
        server.sessions.tell_pool(dict(server.adopted))
        self.done += 1
        log.warning("memory server %s taken back at incarnation %x: %d file(s) lost data there "
                    "(EIO until truncated or removed)%s%s", name, incarnation, len(lost),
                    f": {', '.join(names)}{' ...' if len(lost) > SHOWN else ''}" if lost else "",
                    f"; {len(evicted)} clean one(s) will be read again from the backing "
                    "directory" if evicted else "")
