"""Wires one mount daemon together and runs it.

``pyfuse3.init`` mounts, readiness is reported (to the parent ``memfs mount``
process through a pipe, and to systemd through ``NOTIFY_SOCKET``), then
``pyfuse3.main`` serves until ``umount`` or a signal.  ``pyfuse3.close`` always
runs, so a daemon that fails never leaves a dead mount behind.
"""

from __future__ import annotations

import dataclasses
import errno
import faulthandler
import functools
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyfuse3
import trio
import trio.lowlevel

from memfs import fs
from memfs.array.service import ArrayService, PoolAccess
from memfs.config import FlushConfig, PoolConfig, format_size, parse_pool_spec
from memfs.data import DataEngine
from memfs.errors import FsError, UsageError, reporting_sole_cause
from memfs.fs import Operations
from memfs.host import mem_available, sd_notify, tune_malloc
from memfs.meta import Meta
from memfs.meta.store import MetaStore
from memfs.passthrough import BackingFiles, raise_fd_limit
from memfs.scrub import Scrubber
from memfs.transport import Transport
from memfs.transport.local import LocalTransport

if TYPE_CHECKING:
    from memfs.backing.meta import BackedMeta
    from memfs.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class MountOptions:
    mountpoint: str
    pool: PoolConfig
    fuse_options: list[str] = field(default_factory=list)
    writeback_cache: bool = False
    #: ``-o direct_io``: file data bypasses the kernel's page cache (see fs.Operations)
    direct_io: bool = False
    #: ``-o passthrough``: files' bytes in backing files the kernel reads and writes
    #: itself (embedded only; memfs.passthrough)
    passthrough: bool = False
    #: ``-o localflock``: a cluster client leaves locks to its kernel (per node, as on
    #: an embedded mount; Lustre's option of that name) instead of the mds
    local_locks: bool = False
    attr_timeout: float = 1.0
    # Every embedded operation completes without waiting (memory in this
    # process), so one worker serves requests with the least scheduling per
    # request; remote transports need many to overlap network waits.
    max_tasks: int = 1
    readahead_kib: int = 4096
    #: cluster mode: the metadata server to use instead of an embedded pool
    mds: tuple[str, int] | None = None
    secret: bytes = b""
    #: burst buffer: write back to (and stage in from) a backing directory
    flush: FlushConfig | None = None
    #: where ``memfs flush/status/stage-in`` reach this daemon (a Unix socket)
    control_path: str | None = None
    #: serve Prometheus metrics here (``--metrics``)
    metrics: tuple[str, int] | None = None


# Options that mount(8) and fstab pass but that mean nothing to FUSE.
IGNORED_FUSE_OPTIONS = {"_netdev", "nofail", "noauto", "auto", "defaults", "user", "users", "rw"}


def fuse_options(opts: MountOptions) -> set[str]:
    out = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    # The mount table's source: what an fstab line names (``memfs``, or the mds's
    # HOST:PORT), so that ``mount -a`` sees the line is mounted already.
    if opts.mds is None:
        fsname = "memfs"
    else:
        host, port = opts.mds
        fsname = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    out |= {f"fsname={fsname}", "subtype=memfs"}
    if os.geteuid() == 0:
        out.add("allow_other")  # a shared scratch filesystem, like tmpfs
    for o in opts.fuse_options:
        if o in IGNORED_FUSE_OPTIONS or not o:
            continue
        if o in ("writeback_cache", "no_writeback_cache", "direct_io", "localflock", "passthrough"):
            continue  # memfs's own (see MountOptions); not libfuse mount options
        out.add(o)
    return out


def check_memory(pool: PoolConfig) -> None:
    """Refuse a pool this node cannot hold, before anything is allocated."""
    avail = mem_available()
    if avail is not None and pool.size > avail:
        raise UsageError(
            f"--size {format_size(pool.size)} exceeds the memory available "
            f"on this node ({avail >> 20} MiB)"
        )


@dataclass
class Backend:
    """What one mount stores through."""

    meta: Meta
    transport: Transport
    #: how a local process reaches the same pool itself (memfs.array)
    access: PoolAccess
    #: held around such a process's transfers, if freed chunks are zeroed here
    scrub_hold: Callable[[], AbstractContextManager[object]] | None = None
    #: waited for before taking such a hold (a scrubber round that waits goes first)
    scrub_turn: Callable[[], Awaitable[None]] | None = None


@asynccontextmanager
async def open_backend(opts: MountOptions) -> AsyncIterator[Backend]:
    """The metadata service and transport this mount uses, closed on exit.

    Embedded: both live in this process.  Cluster (``opts.mds``): the metadata
    server says which memory servers hold the pool; data goes to them directly.
    """
    if opts.mds is not None:
        async with _open_remote(opts, *opts.mds) as backend:
            yield backend
        return
    check_memory(opts.pool)
    # -o passthrough: files live in backing files; the volumes stay untouched (no memory)
    transport = LocalTransport(opts.pool.volumes, opts.pool.volume_size,
                               populate=not opts.passthrough)
    try:
        # The root directory belongs to whoever mounts (root: 0/0, as before), so a
        # user's own mount is theirs to chmod and chown, like a tmpfs they mounted.
        store = MetaStore(opts.pool, root_uid=os.getuid(), root_gid=os.getgid())
        access = PoolAccess("local", fds=tuple(transport.volume_fds()),
                            sizes=tuple(v.size for v in transport.volumes))
        scrubber = Scrubber(store, transport)
        scrubber.quiesce = fs.replies_written  # read() returns views of this pool
        async with trio.open_nursery() as nursery:
            await nursery.start(scrubber.run)
            yield Backend(store, transport, access, scrubber.hold, scrubber.wait_turn)
            nursery.cancel_scope.cancel()
    finally:
        await transport.aclose()


@asynccontextmanager
async def _open_remote(opts: MountOptions, host: str, port: int) -> AsyncIterator[Backend]:
    # Imported here: an embedded mount (most of the test suite's, and a job's
    # node-local one) starts without the cluster client's and tcp's modules.
    from memfs.meta.remote import open_remote_meta
    from memfs.transport.pool import open_pool_transport, pool_scheme

    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        async with open_remote_meta(host, port, opts.secret) as meta:
            desc = await meta.describe()
            if not desc.volumes:
                raise UsageError(f"the metadata server at {where} has no pool of memory servers")
            volumes = parse_pool_spec("+".join(desc.volumes))
            access = PoolAccess(pool_scheme(volumes), volumes=tuple(desc.volumes),
                                secret=opts.secret, incarnations=dict(desc.incarnations),
                                fsid=desc.fsid, lease_token=lambda: meta.token)
            # The volumes are claimed for this filesystem: a memory server whose
            # volume another one holds refuses (ClaimRefused: the mount fails).
            # A memory server down now leaves its files EIO, not this node unmounted
            # (the pool's volume size comes from the mds; tcp pools).
            async with open_pool_transport(volumes, opts.secret, incarnations=desc.incarnations,
                                           fsid=desc.fsid, volume_size=desc.volume_size
                                           ) as transport:
                # Memory servers shut out a token the mds fenced (our lease taken).
                meta.follow_token(transport.set_session)

                def adopt(incarnations: dict[str, int]) -> None:
                    # A memory server the mds took back: ours and memfs.array's use it again.
                    transport.adopt(incarnations)
                    access.incarnations.update(incarnations)

                meta.follow_pool(adopt)
                log.info("pool of %d volumes from the metadata server at %s", len(volumes), where)
                yield Backend(meta, transport, access)
    except FsError as exc:
        msg = exc.args[1]
        if exc.errno == errno.EACCES:  # refused our secret: what a user would check first
            msg += " (is --secret-file the secret the mds and memory servers were started with?)"
        raise UsageError(msg if where in msg else f"cannot mount from {where}: {msg}") from None


def set_readahead(mountpoint: str, kib: int) -> None:
    """Raise the kernel readahead of our FUSE connection (default 128 KiB).

    Sequential reads reach the daemon in readahead-sized requests, so 128 KiB
    means eight round trips per MiB.  Found via mountinfo, not stat(): the
    mount cannot answer requests before the main loop runs.  Called after the
    kernel has processed our INIT reply, which resets the value.
    """
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4] == mountpoint:
                    dev = fields[2]
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(kib))
        log.debug("readahead of %s (%s) set to %d KiB", mountpoint, dev, kib)
    except (OSError, UnboundLocalError) as exc:
        log.info("cannot set readahead for %s: %s", mountpoint, exc)


async def _tune_after_init(ops: Operations, opts: MountOptions) -> None:
    await ops.initialized.wait()
    await trio.lowlevel.checkpoint()  # the worker that ran init() has sent the reply by now
    set_readahead(opts.mountpoint, opts.readahead_kib)


async def _watch_signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s, unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


def run(opts: MountOptions, ready: Callable[[], None] | None = None) -> int:
    """Mount, serve until unmounted, clean up.  Returns the exit status."""
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    tune_malloc()
    # A user error raised inside a nursery (libfuse refusing an option, a busy
    # --metrics port): the user reads it, not the nursery's group.
    with reporting_sole_cause((trio.Cancelled,)):
        trio.run(_main, opts, ready)
    return 0


async def _main(opts: MountOptions, ready: Callable[[], None] | None) -> None:
    backing = None
    if opts.passthrough:  # before any nursery: its UsageError is what the user reads
        try:
            backing = BackingFiles(opts.pool.size)
        except OSError as exc:
            needs = " (it needs CAP_SYS_ADMIN)" if exc.errno == errno.EPERM else ""
            raise UsageError(f"-o passthrough: cannot make the backing files' tmpfs{needs}: "
                             f"{exc.strerror}") from None
        raise_fd_limit()  # a descriptor per file open on the mount
    try:
        await _run_backend(opts, ready, backing)
    finally:
        if backing is not None:
            backing.close()


async def _run_backend(
    opts: MountOptions, ready: Callable[[], None] | None, backing: BackingFiles | None,
) -> None:
    async with open_backend(opts) as backend, trio.open_nursery() as background:
        meta, transport = backend.meta, backend.transport
        backed: BackedMeta | None = None
        if opts.flush is not None:
            assert isinstance(meta, MetaStore), "cluster mounts write back in the mds"
            from memfs.backing.meta import BackedMeta  # (only with --backing)

            backed = BackedMeta(meta, transport, opts.flush)
            try:
                await backed.load()
            except OSError as exc:
                raise UsageError(f"cannot use backing directory {opts.flush.backing}: {exc}") from None
            await background.start(backed.run)
            meta = backed
            # Writers may wait for write-back (the dirty cap) and reads for the backing
            # directory: other requests must not queue behind them.
            opts.max_tasks = max(opts.max_tasks, 16)
        access = backend.access
        if opts.passthrough:  # the pool's volumes hold no file's bytes
            access = dataclasses.replace(access, why_not=(
                "files live in backing files (-o passthrough): the mount's file I/O is the "
                "way to them"))
        arrays = ArrayService(meta, access, scrub_hold=backend.scrub_hold,
                              scrub_turn=backend.scrub_turn)
        await background.start(arrays.run)
        if opts.control_path is not None:
            from memfs.control import serve_control

            await background.start(
                functools.partial(serve_control, opts.control_path, meta, sessions=arrays.session))
        if backing is not None:
            assert isinstance(meta, MetaStore), "passthrough is embedded, without --backing"
            backing.meta = meta
            meta.on_destroy = backing.forget
        metrics = _start_metrics(opts, meta, transport, backed, backing, background)
        try:
            await _serve(opts, meta, transport, ready, arrays, backing)
        finally:
            if metrics is not None:
                fs.OBSERVER = None
                metrics.close()
        if backed is not None:
            if opts.flush is not None and opts.flush.discard_on_unmount:
                files, nbytes = backed.pending
                if files:
                    log.warning("discarding %d MiB (%d files) not written back, as asked "
                                "(--discard-on-unmount)", nbytes >> 20, files)
            else:
                # A SIGTERM/SIGINT during the write-back gives up (logging what is lost).
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    await backed.drain(give_up_on=signals)
            await backed.close()
        background.cancel_scope.cancel()


def _start_metrics(
    opts: MountOptions, meta: Meta, transport: Transport, backed: BackedMeta | None,
    backing: BackingFiles | None, nursery: trio.Nursery,
) -> Metrics | None:
    """``--metrics``: requests counted at the FUSE boundary, pool and burst-buffer
    numbers refreshed in the background."""
    if opts.metrics is None:
        return None
    from memfs.metrics import Metrics

    m = Metrics("mount")
    m.serve(*opts.metrics)

    async def fill() -> dict[str, float]:
        st = await meta.statfs()
        block_size, blocks, blocks_free = st.block_size, st.blocks, st.blocks_free
        if backing is not None:
            block_size, blocks, blocks_free = backing.space()
        out = {
            "memfs_pool_bytes": float(blocks * block_size),
            "memfs_pool_free_bytes": float(blocks_free * block_size),
            "memfs_files": float(st.files - st.files_free),
        }
        if backed is not None:
            out.update((await backed.status()).gauges("memfs_backing"))
        up = transport.servers_up()
        if up:
            m.set_labeled("memfs_memory_server_up", "server",
                          {name: float(ok) for name, ok in up.items()})
        return out

    fs.OBSERVER = m
    nursery.start_soon(m.refresh, fill)
    return m


async def _serve(
    opts: MountOptions, meta: Meta, transport: Transport, ready: Callable[[], None] | None,
    arrays: ArrayService, backing: BackingFiles | None,
) -> None:
    data: DataEngine | BackingFiles
    if backing is not None:
        data = backing
    else:
        data = DataEngine(meta, transport)
        if opts.mds is None:  # read() returns views of pool memory (remote reads: new buffers)
            data.quiesce = fs.replies_written_now
    ops = Operations(
        meta,
        data,
        writeback_cache=opts.writeback_cache,
        direct_io=opts.direct_io,
        # Other nodes change files too: without leases, drop cached pages at every
        # open (close-to-open), and let attributes expire per --attr-timeout.
        keep_cache=opts.mds is None,
        pages_follow_changes=meta.recalls_drop_pages(),
        attr_timeout=opts.attr_timeout,
        entry_timeout=opts.attr_timeout,
        negative_timeout=opts.attr_timeout,
        cluster_locks=not opts.local_locks,
    )
    arrays.kernel = ops
    arrays.wait_posted = data.wait_posted
    try:
        pyfuse3.init(ops, opts.mountpoint, fuse_options(opts))
    except RuntimeError as exc:  # libfuse printed its reason on stderr already
        raise UsageError(f"cannot mount {opts.mountpoint}: {exc}") from None
    try:
        if opts.mds is None:
            log.info(
                "mounted %s: %d volumes x %d MiB, stripe %d KiB, chunk %d KiB",
                opts.mountpoint, opts.pool.volumes, opts.pool.volume_size >> 20,
                opts.pool.stripe_size >> 10, opts.pool.chunk_size >> 10,
            )
        else:
            log.info("mounted %s from the metadata server at %s:%d", opts.mountpoint, *opts.mds)
        if ready is not None:
            ready()
        sd_notify("READY=1")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals)
            if opts.readahead_kib:
                nursery.start_soon(_tune_after_init, ops, opts)
            fs.tune_request_loop(opts.max_tasks, cluster=opts.mds is not None,
                                 direct_io=opts.direct_io)
            try:
                await pyfuse3.main(min_tasks=min(fs.IDLE_WORKERS, opts.max_tasks),
                                   max_tasks=opts.max_tasks)
            except* ConnectionAbortedError:
                # Not a failure of ours: the kernel ended the connection with
                # ECONNABORTED (seen once in the suite, on an unmount right after the
                # daemon was continued from SIGSTOP; not reproduced: fusectl's abort
                # here ends the reads with ENODEV, which libfuse takes as the end).
                log.warning("the kernel aborted the FUSE connection of %s: stopping",
                            opts.mountpoint)
            nursery.cancel_scope.cancel()
        # Posted writes (a cluster client's) reach the memory servers before the
        # transport closes; each is answered or failed within the transport's deadline.
        await data.drain()
        await meta.sync_all()  # and the sizes this client holds, now that their bytes landed
        sd_notify("STOPPING=1")
    finally:
        # Always unmount: libfuse closes /dev/fuse first (so nothing can wait
        # on us any more) and skips the umount if the kernel already dropped
        # it.  Never stat the mountpoint here: no one is left to answer.
        if backing is not None:
            backing.dev_fd = None  # closed with the session: the kernel drops the ids
        pyfuse3.close(unmount=True)
        log.info("unmounted %s", opts.mountpoint)
