"""What a cluster client follows of the pool besides the namespace: the lease token
its memory-server connections name, and the memory servers the mds took back after
a blank restart (:mod:`memfs.meta.takeback`).  Part of
:class:`~memfs.meta.remote.RemoteMeta`.

Both change only at points where no transfer under the old state runs: a new
token is named after a registration (the transfers begun under the old one have
ended first), and a taken-back server is adopted once every recall read before
the POOL frame is answered (each answer waits for the transfers under the maps
it gives back), or at the next registration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from memfs import wire
from memfs.meta import codec
from memfs.meta.lease_client import LeaseKeeper
from memfs.wire import WireError

log = logging.getLogger(__name__)


def incarnations_from_wire(v: Any) -> dict[str, int]:
    """``{"host:port": incarnation}`` as the mds sends it (WireError if malformed)."""
    if type(v) is not dict or not all(type(k) is str for k in v):
        raise WireError("describe: malformed incarnations")
    return {k: codec.check_int(x, "incarnation") for k, x in v.items()}


class PoolFollower:
    """See the module docstring; *leases* answers our recalls."""

    def __init__(self, leases: LeaseKeeper) -> None:
        self.leases = leases
        #: told each registration's token, before any call under it (see follow_token)
        self._on_token: Callable[[int], None] | None = None
        #: the token _on_token was last told
        self._named_token = 0
        #: told the memory servers the mds took back (name -> incarnation; see follow)
        self._on_pool: Callable[[dict[str, int]], None] | None = None
        #: heard during a registration: told once the registration's token is named
        self.heard: dict[str, int] = {}
        #: changes told so far (a POOL frame held back for recalls is told only if none
        #: came after it: every later one says all the mds took back)
        self.told = 0
        #: memory server "host:port" -> the incarnation the pool's data lives in, as last
        #: heard (describe at each registration, POOL frames)
        self.incarnations: dict[str, int] = {}

    def follow_token(self, name: Callable[[int], None], token: int) -> None:
        """See :meth:`RemoteMeta.follow_token`; *token* is ours now."""
        name(token)
        self._named_token = token
        self._on_token = name

    def follow(self, adopt: Callable[[dict[str, int]], None]) -> None:
        """See :meth:`RemoteMeta.follow_pool`."""
        self._on_pool = adopt
        if self.incarnations:  # as heard so far (the follower ignores what it has)
            adopt(dict(self.incarnations))

    def registered(self, token: int, incarnations: dict[str, int], *, first: bool) -> None:
        """A registration brought *token* and the pool's *incarnations*: name the token
        if it is new (our transfers under the old one have ended), then adopt what
        the mds took back (our caches are gone, our transfers ended)."""
        if self._on_token is not None and token != self._named_token:
            if self._named_token:
                # Our leases were taken without our word (the old token is fenced:
                # transfers under it fail) or the server restarted (it knows no old
                # tokens).
                log.info("new lease token from the metadata server (it took our leases, "
                         "or restarted)")
            self._on_token(token)
            self._named_token = token
        if first:
            self.incarnations = dict(incarnations)
        else:  # (servers the mds met since are only noted: none of ours changed)
            self.tell(incarnations, known_only=True)
        heard, self.heard = self.heard, {}
        self.tell(heard)

    def heard_frame(self, payload: bytes) -> None:
        """A POOL frame on our connection (MdsConnection.on_pool; WireError if malformed).

        Adopted once every recall read before it is answered: the mds sent each
        client that held a map of the lost memory a recall before this frame, and
        our answer waits for the transfers under that map to end.  One we do not
        answer gets us evicted: then not at all (our next registration tells us,
        our transfers ended by then)."""
        heard = incarnations_from_wire(wire.decode(payload))
        pending = self.leases.open_recalls()
        if not pending:
            self.tell(heard)
            return
        assert self.leases.tasks is not None
        self.leases.tasks.start_soon(self._after_recalls, heard, pending, self.told)

    async def _after_recalls(
        self, heard: dict[str, int], pending: list[tuple[trio.Event, list[Any]]], told: int,
    ) -> None:
        if not await self.leases.after_recalls(pending):
            log.info("a recall was not answered: memory servers taken back (%s) are adopted "
                     "at the next registration", ", ".join(sorted(heard)))
        elif self.told == told:  # (else something newer was told meanwhile: it says all)
            self.tell(heard)

    def tell(self, heard: dict[str, int], *, known_only: bool = False) -> None:
        """Adopt what changed in *heard* (*known_only*: of servers we knew; others are
        noted, not told: the mds met them after us, nothing was taken back)."""
        changed = {k: v for k, v in heard.items() if self.incarnations.get(k) != v
                   and (not known_only or k in self.incarnations)}
        self.incarnations.update(heard)
        if not changed:
            return
        self.told += 1
        log.info("the metadata server took back memory server(s) %s", ", ".join(sorted(changed)))
        if self._on_pool is not None:
            self._on_pool(changed)
