"""The metadata server's journal and snapshots: what ``memfs mds --journal DIR`` keeps.

Why: file data lives in memory servers that outlive a metadata server restart.
If the namespace, the layouts and the chunk allocations come back exactly as
they were, every byte in the memory servers is found again; if allocation
diverged by one chunk, two files would share memory.  So replay must be exact.

What is recorded: every call that changes metadata, with its arguments in wire
form (:mod:`memfs.meta.codec`) and the one timestamp the store used for it (the
server gives the store a clock that is frozen per call), plus every destruction
of an inode (``_destroy``), a write lease that ended without its writer's
size (``_lost_write``: MetaStore.unsaid), which client sessions belong to which
run (``_run``, ``_registered``, ``_grace_end``, ``_gone``), the volumes whose
memory server restarted blank (``_memory_lost``: their chunks leave every file,
those below EOF marked lost; memfs.meta.takeback) and atime moves by
``map_read``.  Open counts are not
recorded: they belong to client sessions, which re-register them after a
restart.  That is also why destructions are explicit: whether ``unlink`` frees
a file at once depends on open counts, so replay never destroys implicitly
(``MetaStore.defer_destroy``) and applies the recorded destructions instead.

Files in DIR::

    snapshot.<seq>   whole store state after record <seq> (wire.encode'd), written to
                     snapshot.<seq>.tmp, fsynced, renamed, directory fsynced
    journal.<seq>    records <seq>+1, <seq>+2, ... appended after that snapshot
    lock             flock'ed while a server uses DIR

Record framing: ``length u32 | crc32 u32 | payload`` with payload
``wire.encode([seq, t, method, *args])``.  Records are numbered without gaps.

With a backing directory (``memfs mds --backing DIR``) the burst buffer's
changes outside calls are recorded too: the store's fetches and evictions
(``_reserve``, ``_install``, ``_unreserve``, ``_evict``, replayed by the store)
and the write-back state of an :class:`Extension` (files written back, namespace
changes applied to DIR), whose own state is kept in the snapshots beside the
store's.

Recovery: load the newest snapshot, replay the journals whose base is at or
after it, in order; seq numbers must continue without a gap.  A bad record at
the very end of the newest journal (a torn write: cut short, bad checksum, or
zeros) is dropped with a warning; any other damage is a :class:`JournalError`
and the server refuses to start.  Then a fresh snapshot is written and older
files are removed, so a torn tail is never appended to.

Durability: group commit.  Records are appended to a buffer in the event loop;
one committer task writes the buffer and ``fdatasync``s it in a worker thread,
and everything appended meanwhile goes out with the next write.  The server
sends no reply (to any call) before every record appended up to that call is
durable, so no client ever observes metadata a crash could take back.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any, Protocol

import trio

from memfs import wire
from memfs.config import PoolConfig, format_size
from memfs.errors import FsError, UsageError
from memfs.layout import Layout, LayoutSpec
from memfs.meta import codec
from memfs.meta.placement import BACKING_RECORDS
from memfs.meta.store import Inode, MetaStore, _now

log = logging.getLogger(__name__)

SNAP_MAGIC = b"MFSNAP01"
JOURNAL_MAGIC = b"MFJOUR01"
_SNAP_HEAD = struct.Struct("!8sQI")  # magic, payload length, crc32
_JOURNAL_HEAD = struct.Struct("!8sQ")  # magic, base seq
_REC = struct.Struct("!II")  # payload length, crc32
MAX_RECORD = 16 << 20
SNAPSHOT_FORMAT = 6  # 6: files' lost chunks (``lost``; older memfs must not read them
#: as holes); 5: chunks reserved by fetches, the extension's state;
#: 4: freed chunks are a min-heap, allocated lowest first;
#: 3: inodes gain ``backed``; formats 2 to 4 still load (2 and 3 replay under their
#: last-in-first-out allocation, then switch: see :meth:`Journal.open`)
DESTROY = "_destroy"
CLEAN = "_clean"  # chunks the scrubber zeroed: dirty -> allocatable
LOST_WRITE = "_lost_write"  # [ino, session id, 1|0]: MetaStore.lost_write
#: client sessions across runs (MetaStore.eligible, this_run): a server started, a
#: session registered for the first time in this run [sid], the grace ended, a
#: session expired [sid]
NEW_RUN, REGISTERED, GRACE_ENDED, SESSION_GONE = "_run", "_registered", "_grace_end", "_gone"
#: asynchronous creates: inode numbers reserved for a session [sid, first, count], and
#: a create with one of them [sid, parent, name, mode, uid, gid, ino] (MetaStore.create_at)
RESERVE_INOS, CREATE_AT = "_inos", "_create_at"
SESSION_RECORDS = (LOST_WRITE, NEW_RUN, REGISTERED, GRACE_ENDED, SESSION_GONE, RESERVE_INOS, CREATE_AT)
#: a memory server restarted blank [volume, ...]: MetaStore.lose_memory
MEMORY_LOST = "_memory_lost"

#: the Inode fields a snapshot keeps, in order; ``opens`` is deliberately absent
INODE_FIELDS = (
    "ino", "mode", "uid", "gid", "nlink", "size", "rdev", "atime_ns", "mtime_ns", "ctime_ns",
    "target", "xattrs", "children", "parent", "spec", "layout", "chunks", "backed",
)
#: Inode fields a snapshot does not hold: derived from the directories on load
DERIVED_FIELDS = ("name", "links")


class JournalError(Exception):
    """DIR cannot be used as it is: damaged, or written for another pool."""


class Extension(Protocol):
    """State beside the store that the journal keeps (the burst buffer's): restored
    from the snapshot, brought up to date by replaying its own records (whose names
    start with ``_``), and dumped into every snapshot."""

    def attach(self, store: MetaStore, state: Any, fresh: bool) -> None:
        """Before replay: *state* from the snapshot (None: the snapshot has none);
        *fresh*: no snapshot at all (a new filesystem).  JournalError if unusable."""

    def replay(self, method: str, args: list[Any]) -> bool:
        """Apply one of our records; False: not ours."""

    def dump(self) -> Any:
        """Our state now, as plain values (for a snapshot)."""


def _name(kind: str, seq: int) -> str:
    return f"{kind}.{seq:020d}"


def _parse_name(name: str) -> tuple[str, int] | None:
    kind, dot, num = name.partition(".")
    if dot and kind in ("snapshot", "journal") and len(num) == 20 and num.isdigit():
        return kind, int(num)
    return None


def pool_key(pool: PoolConfig) -> list[int]:
    return [pool.volumes, pool.volume_size, pool.chunk_size, pool.stripe_size]


def _describe_key(key: list[int]) -> str:
    vols, vsize, chunk, stripe = key
    return f"{vols} volumes x {format_size(vsize)}, chunk {format_size(chunk)}, stripe {format_size(stripe)}"


# -- snapshots: store state <-> plain values ------------------------------------------


def _spec_to(s: LayoutSpec | None) -> list[int | None] | None:
    return None if s is None else [s.stripe_count, s.stripe_size, s.stripe_offset]


def _spec_from(v: Any) -> LayoutSpec | None:
    return None if v is None else LayoutSpec(*v)


def dump_state(
    store: MetaStore, seq: int, pool: PoolConfig, fsid: bytes = b"", extension: Any = None,
) -> dict[str, Any]:
    """The whole state of *store* as plain values, copied (later changes do not leak in).

    Dict orders are kept on purpose: chunk order decides the order in which a
    truncate frees chunks, and so (with the free heaps' order) future allocations.
    """
    inodes = []
    for i in store.inodes.values():
        inodes.append([
            i.ino, i.mode, i.uid, i.gid, i.nlink, i.size, i.rdev,
            i.atime_ns, i.mtime_ns, i.ctime_ns,
            i.target,
            None if i.xattrs is None else dict(i.xattrs),
            None if i.children is None else dict(i.children),
            i.parent,
            _spec_to(i.spec),
            None if i.layout is None else [i.layout.stripe_size, list(i.layout.volumes)],
            None if i.chunks is None else dict(i.chunks),
            i.backed,
        ])
    return {
        "format": SNAPSHOT_FORMAT,
        "fsid": fsid,
        "seq": seq,
        "pool": pool_key(pool),
        "next_ino": store._next_ino,
        "default_spec": _spec_to(store.default_spec),
        # Chunks out with the scrubber count as dirty: zeroed again after a restart.
        # (Dirty order only decides scrub order; which chunks become clean, and in
        # what order, is journaled with each CLEAN record.)
        "allocators": [
            [a.next, list(a.freed), sorted([*a.dirty, *a.scrubbing])] for a in store.space.allocators
        ],
        "inodes": inodes,
        "reserved": sorted([vol, voff] for vol, voff in store.reserved),
        "doomed": sorted([vol, voff] for vol, voff in store.placement.doomed),
        "unsaid": [[ino, sorted(sids)] for ino, sids in sorted(store.unsaid.items())],
        "lost": [[i.ino, sorted(i.lost)] for i in store.inodes.values() if i.lost],
        "sessions": [sorted(store.eligible), sorted(store.this_run)],
        "delegated": [[sid, sorted(inos)] for sid, inos in sorted(store.delegated.items())],
        "backing": extension,
    }


def load_state(state: Any, pool: PoolConfig) -> MetaStore:
    """A store holding *state* (from :func:`dump_state`); open counts start at zero."""
    try:
        if state["format"] not in (2, 3, 4, 5, SNAPSHOT_FORMAT):
            raise JournalError(f"snapshot format {state['format']}, expected {SNAPSHOT_FORMAT}")
        if type(state["fsid"]) is not bytes:
            raise JournalError("snapshot has no filesystem id")
        if state["pool"] != pool_key(pool):
            raise JournalError(
                f"it holds a pool of {_describe_key(state['pool'])}, but this server was "
                f"started with {_describe_key(pool_key(pool))}"
            )
        store = MetaStore(pool)
        store.inodes.clear()
        store._next_ino = state["next_ino"]
        spec = _spec_from(state["default_spec"])
        assert spec is not None
        store.default_spec = spec
        if len(state["allocators"]) != len(store.space.allocators):
            raise JournalError("snapshot has the wrong number of volumes")
        for a, (nxt, freed, dirty) in zip(store.space.allocators, state["allocators"], strict=True):
            a.next = nxt
            a.freed = list(freed)  # format 4: a heap already
            # Older journals were written allocating last-in-first-out: replay them so.
            a.lowest_first = state["format"] >= 4
            a.dirty = dict.fromkeys(dirty)
        for v in state["inodes"]:
            if state["format"] == 2:
                v = [*v, 0]
            (ino, mode, uid, gid, nlink, size, rdev, atime, mtime, ctime,
             target, xattrs, children, parent, spec_v, layout, chunks, backed) = v
            i = Inode(ino, mode, uid, gid, 0)
            i.nlink, i.size, i.rdev = nlink, size, rdev
            i.atime_ns, i.mtime_ns, i.ctime_ns = atime, mtime, ctime
            i.target, i.xattrs, i.children, i.parent = target, xattrs, children, parent
            i.spec = _spec_from(spec_v)
            i.layout = None if layout is None else Layout(layout[0], tuple(layout[1]))
            i.chunks = chunks
            i.backed = backed
            store.inodes[ino] = i
        for ino, ks in state.get("lost", ()):
            store.inodes[ino].lost = {int(k) for k in ks}
        store.placement.doomed = {(vol, voff) for vol, voff in state.get("doomed", ())}
        store.placement.reserved = {(vol, voff) for vol, voff in state.get("reserved", ())}
        store.unsaid = {int(ino): {bytes(x) for x in sids} for ino, sids in state.get("unsaid", ())}
        eligible, this_run = state.get("sessions", ((), ()))
        store.eligible, store.this_run = {bytes(x) for x in eligible}, {bytes(x) for x in this_run}
        store.delegated = {bytes(sid): {int(x) for x in inos} for sid, inos in state.get("delegated", ())}
        store.rebuild_names()
        return store
    except (KeyError, TypeError, ValueError, AssertionError) as exc:
        raise JournalError(f"snapshot content is malformed: {exc!r}") from None


# -- file helpers (run in worker threads) ---------------------------------------------------


def fsync_dir(d: Path) -> None:
    """Make a rename or create in *d* durable (the entry lives in the directory)."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_snapshot(d: Path, seq: int, state: dict[str, Any], fsync: bool = True) -> Path:
    data = wire.encode(state)
    final = d / _name("snapshot", seq)
    tmp = d / (final.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, _SNAP_HEAD.pack(SNAP_MAGIC, len(data), zlib.crc32(data)))
        _write_all(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    if fsync:
        fsync_dir(d)
    return final


def read_snapshot(path: Path) -> Any:
    data = path.read_bytes()
    if len(data) < _SNAP_HEAD.size:
        raise JournalError(f"{path}: truncated snapshot")
    magic, n, crc = _SNAP_HEAD.unpack_from(data)
    body = data[_SNAP_HEAD.size :]
    if magic != SNAP_MAGIC:
        raise JournalError(f"{path}: not a memfs snapshot")
    if len(body) != n or zlib.crc32(body) != crc:
        raise JournalError(f"{path}: snapshot is damaged (length or checksum mismatch)")
    try:
        return wire.decode(body)
    except wire.WireError as exc:
        raise JournalError(f"{path}: snapshot does not decode: {exc}") from None


def encode_record(seq: int, t: int, method: str, args: list[Any]) -> bytes:
    payload = wire.encode([seq, t, method, *args])
    return _REC.pack(len(payload), zlib.crc32(payload)) + payload


def read_records(path: Path, base: int, last: bool) -> list[list[Any]]:
    """The records of one journal file, each ``[seq, t, method, *args]``.

    A damaged end is forgiven only in the newest file (*last*): a crash in the
    middle of a write leaves exactly that.
    """
    data = path.read_bytes()

    def damaged(pos: int, why: str, end: int) -> None:
        tail_is_torn = end >= len(data) or not data[pos:].strip(b"\0")
        if last and tail_is_torn:
            log.warning(
                "journal %s: ignoring a torn record at offset %d (%s; %d bytes): "
                "the server stopped in the middle of writing it", path, pos, why, len(data) - pos,
            )
            return
        raise JournalError(f"{path}: damaged record at offset {pos}: {why}")

    if len(data) < _JOURNAL_HEAD.size:
        damaged(0, "truncated file header", len(data))
        return []
    magic, file_base = _JOURNAL_HEAD.unpack_from(data)
    if magic != JOURNAL_MAGIC or file_base != base:
        raise JournalError(f"{path}: not a memfs journal for base {base}")
    out: list[list[Any]] = []
    pos = _JOURNAL_HEAD.size
    while pos < len(data):
        if len(data) - pos < _REC.size:
            damaged(pos, "truncated record header", len(data))
            break
        n, crc = _REC.unpack_from(data, pos)
        start, end = pos + _REC.size, pos + _REC.size + n
        if n == 0 or n > MAX_RECORD:
            damaged(pos, f"impossible length {n}", end)
            break
        if end > len(data):
            damaged(pos, f"record of {n} bytes cut short", end)
            break
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            damaged(pos, "checksum mismatch", end)
            break
        try:
            rec = wire.decode(payload)
        except wire.WireError as exc:
            raise JournalError(f"{path}: record at offset {pos} does not decode: {exc}") from None
        if not (isinstance(rec, list) and len(rec) >= 3 and type(rec[0]) is int
                and type(rec[1]) is int and type(rec[2]) is str):
            raise JournalError(f"{path}: record at offset {pos} is malformed")
        out.append(rec)
        pos = end
    return out


class _FrozenClock:
    """The store's clock during one call: the time recorded for it."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        return self.t


async def apply_record(
    store: MetaStore, clock: _FrozenClock, rec: list[Any], extension: Extension | None = None,
) -> None:
    """Replay one record on *store* (with ``defer_destroy`` set)."""
    seq, t, method, *raw = rec
    clock.t = t
    try:
        if method.startswith("_") and method not in (DESTROY, CLEAN, MEMORY_LOST, *SESSION_RECORDS):  # the burst buffer's
            if extension is None:
                raise JournalError(f"record {seq} ({method}) was written by an mds with "
                                   "--backing: start it with the same --backing")
            if method in BACKING_RECORDS:
                store.placement.replay_backing(method, [codec.check_int(x, "argument") for x in raw])
            elif not extension.replay(method, raw):
                raise JournalError(f"record {seq}: unknown record {method!r}")
            return
        if method == DESTROY:
            (ino,) = raw
            store.destroy(codec.check_int(ino, "inode"))
            return
        if method == LOST_WRITE:
            ino, sid, lost = raw
            store.lost_write(codec.check_int(ino, "inode"), codec.check_bytes(sid, "session"),
                             bool(codec.check_int(lost, "flag")))
            return
        if method == MEMORY_LOST:
            store.lose_memory({codec.check_int(x, "volume") for x in raw})
            return
        if method == NEW_RUN:
            store.new_run()
            return
        if method == GRACE_ENDED:
            store.grace_ended()
            return
        if method == RESERVE_INOS:
            sid, first, count = raw
            if store.reserve_inos(codec.check_bytes(sid, "session"), codec.check_int(count, "count")) \
                    != codec.check_int(first, "inode"):
                raise JournalError(f"record {seq}: reserved inode numbers do not match")
            return
        if method == CREATE_AT:
            sid, parent, name, mode, uid, gid, ino = raw
            store.create_at(codec.check_bytes(sid, "session"), codec.check_int(parent, "inode"),
                            codec.check_bytes(name, "name"), codec.check_int(mode, "mode"),
                            codec.check_int(uid, "uid"), codec.check_int(gid, "gid"),
                            codec.check_int(ino, "inode"))
            return
        if method in (REGISTERED, SESSION_GONE):
            (sid,) = raw
            sid = codec.check_bytes(sid, "session")
            if method == REGISTERED:
                store.registered(sid)
            else:
                store.session_gone(sid)
            return
        if method == CLEAN:
            flat = [codec.check_int(x, "chunk") for x in raw]
            store.space.put_clean(list(zip(flat[0::2], flat[1::2], strict=True)))
            return
        if method == "settle" and len(raw) == 4:
            raw = [*raw, -1, -1]  # written before settles said where: anywhere
        m = codec.METHODS.get(method)
        if m is None or not (m.mutates or method == "map_read"):
            raise JournalError(f"record {seq}: {method!r} is not a journaled call")
        args = codec.decode_args(m, raw)
        await codec.call_store(store, method, args)
    except (FsError, wire.WireError, ValueError) as exc:
        raise JournalError(f"record {seq} ({method}) does not replay: {exc}") from None


class Journal:
    """Appends metadata changes to DIR and keeps snapshots there (see module doc)."""

    def __init__(
        self, directory: str | os.PathLike[str], *,
        snapshot_every: int = 200_000, snapshot_bytes: int = 256 << 20, fsync: bool = True,
    ) -> None:
        self.dir = Path(directory)
        self.snapshot_every = snapshot_every
        self.snapshot_bytes = snapshot_bytes
        self.fsync = fsync
        #: last record appended / last record on stable storage
        self.seq = 0
        self.durable_seq = 0
        self.pool: PoolConfig | None = None
        #: names this filesystem for its whole life: set when DIR is first used, kept in
        #: every snapshot; clients refuse a server that comes back with another one
        self.fsid = b""
        self.store: MetaStore | None = None
        self._buf = bytearray()
        self._wake = trio.Event()
        self._durable = trio.Event()
        self._fd = -1
        self._lock_fd = -1
        self._base = 0
        self._since_snapshot = 0
        self._bytes_since_snapshot = 0
        self._snapshotting = False
        self._running = False
        #: the burst buffer's state, kept with the store (see :class:`Extension`)
        self.extension: Extension | None = None

    # -- start-up ----------------------------------------------------------------------

    def lock(self) -> None:
        """Create DIR if needed, check it is writable and that no other server uses it."""
        try:
            self.dir.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create journal directory {self.dir}: {exc.strerror}") from None
        if not self.dir.is_dir():
            raise UsageError(f"journal directory {self.dir} is not a directory")
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise UsageError(f"journal directory {self.dir} is not writable")
        try:
            fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise UsageError(f"journal directory {self.dir} is not writable: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UsageError(f"journal directory {self.dir} is in use by another memfs mds") from None
            raise UsageError(f"cannot lock journal directory {self.dir}: {exc.strerror}") from None
        self._lock_fd = fd

    async def open(self, pool: PoolConfig, extension: Extension | None = None) -> MetaStore:
        """Lock DIR, recover the store it holds (or a fresh one), start a new journal.

        Raises :class:`JournalError` for damage and :class:`UsageError` for an
        unusable directory.
        """
        if self._lock_fd < 0:
            self.lock()
        self.pool = pool
        self.extension = extension
        store, seq = await self._recover(pool)
        for a in store.space.allocators:  # the snapshot written below allocates lowest first
            a.use_lowest_first()
        self.seq = self.durable_seq = seq
        state = dump_state(store, seq, pool, self.fsid, self._extension_state())
        await trio.to_thread.run_sync(write_snapshot, self.dir, seq, state, self.fsync)
        self._fd = await trio.to_thread.run_sync(self._new_journal, seq)
        await trio.to_thread.run_sync(self._remove_before, seq)
        self.store = store
        return store

    def _scan(self) -> tuple[dict[int, Path], dict[int, Path]]:
        """Snapshots and journals in DIR by seq; leftover temporary snapshots go."""
        snapshots: dict[int, Path] = {}
        journals: dict[int, Path] = {}
        for p in self.dir.iterdir():
            if p.name.endswith(".tmp") and _parse_name(p.name[:-4]):
                p.unlink()  # a snapshot that was never renamed into place
                continue
            parsed = _parse_name(p.name)
            if parsed:
                (snapshots if parsed[0] == "snapshot" else journals)[parsed[1]] = p
        return snapshots, journals

    async def _recover(self, pool: PoolConfig) -> tuple[MetaStore, int]:
        snapshots, journals = await trio.to_thread.run_sync(self._scan)
        if not snapshots:
            if journals:
                raise JournalError(f"{self.dir} holds journals but no snapshot")
            log.info("journal %s is empty: starting a new filesystem", self.dir)
            self.fsid = os.urandom(16)
            store = MetaStore(pool)
            if self.extension is not None:
                self.extension.attach(store, None, True)
            return store, 0
        snap_seq = max(snapshots)
        state = await trio.to_thread.run_sync(read_snapshot, snapshots[snap_seq])
        if not isinstance(state, dict) or state.get("seq") != snap_seq:
            raise JournalError(f"{snapshots[snap_seq]}: snapshot does not match its name")
        try:
            store = load_state(state, pool)
            self.fsid = state["fsid"]
            ext_state = state.get("backing")
            if self.extension is not None:
                self.extension.attach(store, ext_state, False)
            elif ext_state is not None:
                raise JournalError("it was written by an mds with --backing: start it with "
                                   "the same --backing")
        except JournalError as exc:
            raise JournalError(f"journal {self.dir}: {exc}") from None
        seq = snap_seq
        bases = sorted(b for b in journals if b >= snap_seq)
        clock = _FrozenClock()
        store.now = clock
        store.defer_destroy = True
        replayed = 0
        for k, base in enumerate(bases):
            if base != seq:
                raise JournalError(
                    f"{journals[base]}: starts after record {base} but the journal before "
                    f"it ends at record {seq} (a journal file is missing)"
                )
            last = k == len(bases) - 1
            for rec in await trio.to_thread.run_sync(read_records, journals[base], base, last):
                if rec[0] != seq + 1:
                    raise JournalError(f"{journals[base]}: record {rec[0]} follows record {seq}")
                await apply_record(store, clock, rec, self.extension)
                seq += 1
                replayed += 1
        store.defer_destroy = False
        store.now = _now
        if store.reserved or store.placement.doomed:
            log.info("journal %s: %d chunks of interrupted fetches go to the scrubber",
                     self.dir, len(store.reserved) + len(store.placement.doomed))
            store.placement.release_reserved()
        log.info(
            "journal %s: loaded snapshot %d and replayed %d records: %d inodes",
            self.dir, snap_seq, replayed, len(store.inodes),
        )
        return store, seq

    def _new_journal(self, base: int) -> int:
        path = self.dir / _name("journal", base)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            _write_all(fd, _JOURNAL_HEAD.pack(JOURNAL_MAGIC, base))
            if self.fsync:
                os.fsync(fd)
                fsync_dir(self.dir)
        except BaseException:
            os.close(fd)
            raise
        self._base = base
        return fd

    def _remove_before(self, seq: int) -> None:
        """Drop snapshots and journals that the snapshot at *seq* makes redundant."""
        for p in self.dir.iterdir():
            parsed = _parse_name(p.name)
            if parsed and parsed[1] < seq:
                p.unlink()

    # -- appending ----------------------------------------------------------------------

    def append(self, t: int, method: str, args: list[Any]) -> int:
        """Record a change (in memory: :meth:`run` makes it durable).  Returns its seq."""
        self.seq += 1
        rec = encode_record(self.seq, t, method, args)
        self._buf += rec
        self._since_snapshot += 1
        self._bytes_since_snapshot += len(rec)
        self._wake.set()
        return self.seq

    def append_destroy(self, ino: int) -> int:
        return self.append(0, DESTROY, [ino])

    def append_clean(self, chunks: list[tuple[int, int]]) -> int:
        return self.append(0, CLEAN, [x for chunk in chunks for x in chunk])

    async def wait_durable(self, seq: int) -> None:
        while self.durable_seq < seq:
            await self._durable.wait()

    def _extension_state(self) -> Any:
        return None if self.extension is None else self.extension.dump()

    async def snapshot_now(self) -> None:
        """Write a snapshot of the state now (and start a new journal after it), for
        what no record describes: the backing directory's tree, entered at the first
        start.  Only before the committer runs (:meth:`run`)."""
        if self._running:
            raise RuntimeError("snapshot_now() goes between open() and run()")
        seq, state = await self._cut()
        await self._snapshot(seq, state)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The committer: write and fdatasync what was appended; snapshot now and then."""
        if self.store is None:
            raise RuntimeError("Journal.open() first")
        self._running = True
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    await self._flush()
                    if not self._snapshotting and (
                        self._since_snapshot >= self.snapshot_every
                        or self._bytes_since_snapshot >= self.snapshot_bytes
                    ):
                        await self._rotate(nursery)
        finally:
            # Cancelled (server stopping): what was appended is written before we go.
            with trio.CancelScope(shield=True):
                await self._flush()

    async def _flush(self) -> None:
        if not self._buf or self._fd < 0:
            return
        buf, upto, fd = self._buf, self.seq, self._fd
        self._buf = bytearray()
        try:
            # write() only copies to the page cache: cheaper inline than a thread hop.
            _write_all(fd, buf)
            if self.fsync:
                await trio.to_thread.run_sync(os.fdatasync, fd)
        except OSError as exc:
            raise self._failed(exc) from None
        self.durable_seq = upto
        self._durable.set()
        self._durable = trio.Event()

    async def _rotate(self, nursery: trio.Nursery) -> None:
        """Start a new journal at the current seq and snapshot the state there."""
        seq, state = await self._cut()
        self._snapshotting = True
        nursery.start_soon(self._snapshot, seq, state)

    async def _cut(self) -> tuple[int, dict[str, Any]]:
        """The state at the last record, and a new journal for the records after it
        (the old one gets exactly the records up to there)."""
        assert self.store is not None and self.pool is not None
        seq = self.seq
        # no await since reading self.seq
        state = dump_state(self.store, seq, self.pool, self.fsid, self._extension_state())
        await self._flush()
        old = self._fd
        try:
            self._fd = await trio.to_thread.run_sync(self._new_journal, seq)
        except OSError as exc:
            raise self._failed(exc) from None
        os.close(old)
        self._since_snapshot = self._bytes_since_snapshot = 0
        return seq, state

    def _failed(self, exc: OSError) -> JournalError:
        """Nothing more can be promised durable: the server must stop."""
        return JournalError(f"cannot write to journal {self.dir}: {exc}")

    async def _snapshot(self, seq: int, state: dict[str, Any]) -> None:
        try:
            await trio.to_thread.run_sync(write_snapshot, self.dir, seq, state, self.fsync)
            await trio.to_thread.run_sync(self._remove_before, seq)
        except OSError as exc:
            raise self._failed(exc) from None
        self._snapshotting = False
        log.info("journal %s: snapshot at record %d", self.dir, seq)

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._lock_fd = -1
