"""Wires the metadata server daemon (``memfs mds``) together and runs it.

The pool's geometry comes from the command line and, unless ``--volume-size``
is given, from the memory servers themselves (their INFO, through the tcp
transport: this module sits above both ``meta`` and ``transport``).  Then the
journal is recovered (if any), which gives the filesystem its id; the pool's
volumes are claimed for it on the memory servers (a volume another filesystem
holds: a one-line error, no serving on someone else's memory; see CLAIM in
:mod:`memfs.transport.memd`), :class:`~memfs.meta.server.MetaServer` listens,
one ready line goes to stdout and ``READY=1`` to systemd, and SIGTERM/SIGINT
stop it with status 0.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import trio

from memfs import wire
from memfs.backing.meta import BackedMeta
from memfs.backing.recovery import BackingJournal
from memfs.config import FlushConfig, PoolConfig, VolumeAddr, format_size
from memfs.errors import ClaimRefused, FsError, UsageError, reporting_sole_cause
from memfs.host import sd_notify
from memfs.meta.journal import Journal, JournalError, fsync_dir
from memfs.meta.server import MetaServer
from memfs.meta.store import MetaStore
from memfs.meta.takeback import PROBE_INTERVAL, TakeBack
from memfs.scrub import Scrubber

log = logging.getLogger(__name__)

INFO_TIMEOUT = 10.0
#: write-back: how long after the mds places a write its bytes may still be on the way
#: from the client to a memory server (memfs.flush.BackedMeta.settle)
SETTLE = 2.0


@dataclass
class MdsOptions:
    host: str
    port: int
    pool: list[VolumeAddr]
    secret: bytes
    chunk_size: int
    stripe_size: int
    #: bytes per volume; None: ask the memory servers
    volume_size: int | None = None
    journal_dir: str | None = None
    #: seconds a vanished client's open files are kept for it (MetaServer.session_grace)
    grace: float = 60.0
    #: how long clients may trust their caches (memfs.meta.leases); 0: no caching
    lease_term: float = 4.0
    recall_timeout: float = 2.0
    #: grant create leases (asynchronous creates); ``--sync-creates``: never
    async_creates: bool = True
    #: with ``flush``: write leases through the backing directory too
    #: (``--no-backing-write-leases``: every write is a call)
    backing_write_leases: bool = True
    #: burst buffer: this server writes the pool back to (and stages in from) a directory
    flush: FlushConfig | None = None
    #: serve Prometheus metrics here (``--metrics``)
    metrics: tuple[str, int] | None = None


class StartupError(Exception):
    """The daemon cannot start for a reason that is not a command-line mistake."""


def run(opts: MdsOptions) -> int:
    """Serve in the foreground until SIGTERM/SIGINT.  Returns the exit status.

    Raises :class:`UsageError` (bad arguments, unusable journal directory, address
    in use) and :class:`StartupError` (damaged journal, memory servers unreachable).
    """
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Check the pool geometry and lock the journal before anything listens.
    if opts.volume_size is not None:
        pool_config(opts, opts.volume_size)
    journal = Journal(opts.journal_dir) if opts.journal_dir else None
    try:
        if journal is not None:
            journal.lock()
        # Our tasks raise only to stop: report the one reason, however nested.
        with reporting_sole_cause((trio.Cancelled,)):
            return trio.run(_main, opts, journal)
    except JournalError as exc:  # while serving: the journal cannot be written
        log.error("stopping: %s", exc)
        return 1
    finally:
        if journal is not None:
            journal.close()


def pool_config(opts: MdsOptions, volume_size: int) -> PoolConfig:
    return PoolConfig(
        size=volume_size * len(opts.pool), volumes=len(opts.pool),
        stripe_size=opts.stripe_size, chunk_size=opts.chunk_size,
    )


async def query_volume_size(pool: list[VolumeAddr], secret: bytes) -> int:
    """The size of the pool's volumes, from the memory servers' INFO.

    Over TCP whatever the scheme: every memd answers INFO there, ``verbs://``
    volumes included.
    """
    try:
        from memfs.transport.pool import as_tcp
        from memfs.transport.tcp import open_tcp_transport
    except ImportError:  # pragma: no cover - the tcp transport is part of memfs
        raise UsageError("no tcp transport to ask the memory servers: pass --volume-size") from None
    try:
        async with open_tcp_transport(as_tcp(pool), secret, io_timeout=INFO_TIMEOUT) as t:
            sizes = [v.size for v in t.volumes]
    except FsError as exc:
        raise StartupError(
            f"cannot ask the memory servers for their volume sizes: {exc.args[1]} "
            "(start them first, or pass --volume-size)"
        ) from None
    size = min(sizes)
    if size != max(sizes):
        log.warning("pool volumes differ in size (%s .. %s): using %s of each",
                    format_size(size), format_size(max(sizes)), format_size(size))
    return size


def _load_incarnations(journal_dir: str | None) -> dict[str, int]:
    if not journal_dir:
        return {}
    try:
        value = wire.decode(Path(journal_dir, INCARNATIONS).read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, wire.WireError) as exc:
        raise StartupError(f"cannot read {INCARNATIONS} in {journal_dir}: {exc}") from None
    if type(value) is not dict:
        raise StartupError(f"{INCARNATIONS} in {journal_dir} is malformed")
    return {str(k): int(v) for k, v in value.items()}


def _save_incarnations(journal_dir: str, incarnations: dict[str, int]) -> None:
    """Atomically and durably: a crash leaves the old file or the new one, and once
    this returns, the new one (the rename is fsynced in the directory too)."""
    path = Path(journal_dir, INCARNATIONS)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(wire.encode(incarnations))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class IncarnationsFile:
    """``DIR/incarnations`` of the journal directory (none: nothing kept) and the
    server's own copy, written by the scrubber (servers met for the first time) and
    the take-back (a server restarted blank): one change at a time, each merged
    into the copy as it is then."""

    def __init__(self, journal_dir: str | None, incarnations: dict[str, int]) -> None:
        self.dir = journal_dir
        #: the server's (MetaServer.incarnations): what describe hands out
        self.incarnations = incarnations
        self._lock = trio.Lock()

    async def met(self, found: dict[str, int]) -> None:
        """Servers met for the first time (those known keep theirs).  Kept in memory
        even if the file cannot be written (OSError): saved with the next change."""
        async with self._lock:
            new = {k: v for k, v in found.items() if k not in self.incarnations}
            if new:
                self.incarnations.update(new)
                await self._write(dict(self.incarnations))

    async def took_back(self, name: str, incarnation: int) -> None:
        """Server *name* taken back at *incarnation*: in the file first (OSError: not
        at all; a restarted mds must never take the old one for the pool's)."""
        async with self._lock:
            await self._write({**self.incarnations, name: incarnation})
            self.incarnations[name] = incarnation

    async def _write(self, incarnations: dict[str, int]) -> None:
        if self.dir:
            await trio.to_thread.run_sync(_save_incarnations, self.dir, incarnations)


def claim_refused(exc: ClaimRefused) -> UsageError:
    """The user error for a pool whose memory belongs to another filesystem."""
    return UsageError(f"{exc.args[1]}: not serving this filesystem on another one's memory "
                      "(check --pool; if this mds ran before without --journal, unmount the "
                      "old filesystem's mounts and stop its memfs.array programs first, or "
                      "restart the memory server if their nodes are gone)")


async def _scrub(
    store: MetaStore, pool: list[VolumeAddr], secret: bytes, server: MetaServer,
    saved: IncarnationsFile, takeback: TakeBack,
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Zero freed chunks through the memory servers, for as long as we run.

    Until they are reachable, freed space stays dirty (unusable, never exposed).
    Over TCP whatever the scheme (every memd serves its ``verbs://`` volumes
    there too): zeroing is not on the clients' data path.

    Its connections hold the pool's claims for this filesystem (``server.fsid``)
    while the mds runs.  Started once the first attempt is over: if a memory
    server says a volume belongs to another filesystem then, the mds stops with
    that (:class:`UsageError`) before it listens; said later (the mds was cut
    off and another filesystem took the volume meanwhile), it is logged and
    nothing is zeroed there.
    """
    from memfs.transport.pool import as_tcp
    from memfs.transport.tcp import open_tcp_transport

    delay = 1.0
    first = True
    while True:
        try:
            async with open_tcp_transport(as_tcp(pool), secret, io_timeout=INFO_TIMEOUT,
                                          incarnations=server.incarnations,
                                          fences=server.fencing.fences, fsid=server.fsid,
                                          on_restart=takeback.restarted) as t, \
                    takeback.following(t):
                delay = 1.0
                # The memory this pool's data lives in: remembered (with the journal)
                # so that a memory server restarted blank is never taken for it.
                # Before the fence courier starts: its transport, which probes for
                # restarts, compares with these.
                try:
                    await saved.met(t.incarnations())
                except OSError as exc:  # kept in memory: saved with the next change
                    log.error("cannot save %s in %s: %s", INCARNATIONS, saved.dir, exc)
                if first:
                    first = False
                    task_status.started()
                await Scrubber(store, t).run()
        except ClaimRefused as exc:
            store.space.reclaimer = None
            if first:
                raise claim_refused(exc) from None
            log.error("%s; freed space waits", exc.args[1])
        except FsError as exc:
            store.space.reclaimer = None
            log.warning("memory servers unreachable, freed space waits: %s", exc.args[1])
        if first:  # unreachable: the mds serves meanwhile, as it did before claims
            first = False
            task_status.started()
        await trio.sleep(delay)
        delay = min(delay * 2, 30.0)


async def _fence_courier(
    opts: MdsOptions, server: MetaServer, takeback: TakeBack,
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Connections of their own, each made when needed, that take the mds's fences to
    every memory server it can reach, whichever others are down (the scrubber's and
    write-back's transports need all of them, and send pending fences before their
    own requests).  They also look for memory servers that restarted: every
    ``PROBE_INTERVAL`` seconds, one that has no connection is connected to."""
    from memfs.transport.pool import as_tcp
    from memfs.transport.tcp import open_tcp_transport

    assert server.fencing.fences is not None
    async with open_tcp_transport(as_tcp(opts.pool), opts.secret, io_timeout=INFO_TIMEOUT,
                                  incarnations=server.incarnations, fences=server.fencing.fences,
                                  connections_per_server=1, lazy=True, fsid=server.fsid,
                                  on_restart=takeback.restarted) as t:
        async with takeback.following(t):
            with server.fencing.fences.delivering(t):
                task_status.started()
                while True:
                    await trio.sleep(PROBE_INTERVAL)
                    await t.probe()


INCARNATIONS = "incarnations"


async def _write_back(
    store: MetaStore, opts: MdsOptions, server: MetaServer, recovered: BackingJournal | None,
    takeback: TakeBack, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Burst buffer: enter the backing tree (or, restarted from the journal, go on
    from where it was), then write back and stage in for the pool.

    Data moves between the backing directory and the memory servers over TCP (the
    servers answer there for ``verbs://`` volumes too).
    """
    from memfs.transport.pool import as_tcp
    from memfs.transport.tcp import open_tcp_transport

    assert opts.flush is not None
    try:
        async with open_tcp_transport(as_tcp(opts.pool), opts.secret, io_timeout=INFO_TIMEOUT,
                                      incarnations=server.incarnations,
                                      fences=server.fencing.fences, fsid=server.fsid,
                                      on_restart=takeback.restarted) as t, \
                takeback.following(t):
            backed = BackedMeta(store, t, opts.flush, settle=SETTLE, recovered=recovered)
            takeback.evict_clean = backed.residency.evict_clean
            backed.before_evict = server.recall_inodes
            backed.writeback.landed = server.writes_landed
            backed.writeback.glimpse = server.glimpse_writers_of
            backed.residency.evictions_held = server.evictions_held
            try:
                if recovered is not None and recovered.loaded:
                    await backed.resume()
                else:
                    await backed.load()
                    if recovered is not None:  # the tree is in no record: snapshot it
                        recovered.loaded = True
                        await recovered.journal.snapshot_now()
            except OSError as exc:
                raise UsageError(f"cannot use backing directory {opts.flush.backing}: {exc}") from None
            async with trio.open_nursery() as nursery:
                await nursery.start(backed.run)
                server.meta = backed
                log.info("writing back to %s (delay %g s, dirty cap %s)", opts.flush.backing,
                         opts.flush.delay, format_size(backed.dirty_max))
                task_status.started()
    except ClaimRefused as exc:
        raise claim_refused(exc) from None
    except FsError as exc:
        raise StartupError(f"cannot reach the memory servers for write-back: {exc.args[1]}") from None


def _start_metrics(
    where: tuple[str, int], store: MetaStore, server: MetaServer, nursery: trio.Nursery
) -> None:
    """``--metrics``: calls counted per method, pool and lease numbers refreshed in the
    background; the HTTP thread stops with the process."""
    from memfs.metrics import Metrics

    m = Metrics("mds")
    m.serve(*where)

    async def fill() -> dict[str, float]:
        st = await store.statfs()
        out = {
            "memfs_pool_bytes": float(st.blocks * st.block_size),
            "memfs_pool_free_bytes": float(st.blocks_free * st.block_size),
            "memfs_files": float(st.files - st.files_free),
            **server.gauges(),
        }
        if isinstance(server.meta, BackedMeta):
            out.update((await server.meta.status()).gauges("memfs_backing"))
        return out

    server.metrics = m
    nursery.start_soon(m.refresh, fill)


async def _main(opts: MdsOptions, journal: Journal | None) -> int:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        volume_size = opts.volume_size or await query_volume_size(opts.pool, opts.secret)
        config = pool_config(opts, volume_size)
        recovered = (BackingJournal(opts.flush, journal)
                     if journal is not None and opts.flush is not None else None)
        try:
            store = await journal.open(config, recovered) if journal else MetaStore(config)
        except JournalError as exc:
            raise StartupError(str(exc)) from None
        server = MetaServer(
            store, opts.secret, opts.pool, journal, session_grace=opts.grace,
            lease_term=opts.lease_term, recall_timeout=opts.recall_timeout,
        )
        server.async_creates = opts.async_creates
        server.backing_write_leases = opts.backing_write_leases
        from memfs.transport.pool import as_tcp
        from memfs.transport.tcp import Fences, server_name

        server.fencing.fences = Fences([server_name(a.host, a.port) for a in as_tcp(opts.pool)])
        saved = IncarnationsFile(opts.journal_dir, server.incarnations)
        takeback = TakeBack(server, opts.pool, saved.took_back)
        async with trio.open_nursery() as nursery:
            server.incarnations.update(_load_incarnations(opts.journal_dir))
            # The pool claimed for this filesystem (its id known now), before listening.
            await nursery.start(_scrub, store, opts.pool, opts.secret, server, saved, takeback)
            await nursery.start(_fence_courier, opts, server, takeback)
            if opts.flush is not None:
                # Before serving: a call answered by the bare store would not be
                # written back (no watcher yet), and a client would get write
                # leases, whose writes never reach the burst buffer at all.
                await nursery.start(_write_back, store, opts, server, recovered, takeback)
            try:
                port = await nursery.start(server.serve, opts.host, opts.port)
            except OSError as exc:
                raise UsageError(
                    f"cannot listen on {opts.host}:{opts.port}: {exc.strerror or exc}"
                ) from None
            # (Once serving: after a restart of ours, its recovery comes first.)
            nursery.start_soon(takeback.run)
            host = f"[{opts.host}]" if ":" in opts.host else opts.host
            print(f"mds listening on {host}:{port}", flush=True)
            log.info(
                "pool of %d volumes x %s (chunk %s, stripe %s)%s", config.volumes,
                format_size(config.volume_size), format_size(config.chunk_size),
                format_size(config.stripe_size),
                f", journal {opts.journal_dir}" if journal else "; no journal: nothing survives a restart",
            )
            if not opts.secret:
                log.warning("no --secret-file: anyone who can reach %s:%d may change metadata",
                            host, port)
            if opts.metrics is not None:
                _start_metrics(opts.metrics, store, server, nursery)
            sd_notify("READY=1")
            async for signum in signals:
                log.info("received %s, stopping", signal.Signals(signum).name)
                sd_notify("STOPPING=1")
                if isinstance(server.meta, BackedMeta):  # another signal gives up
                    await server.meta.drain(give_up_on=signals)
                    await server.meta.close()
                nursery.cancel_scope.cancel()
                break
    sys.stdout.flush()
    return 0
