"""What a cluster client caches under its leases (see :mod:`memfs.meta.leases`).

Attributes, directory entries (names known present or absent; a directory is
*complete* when every name is known, so any other name is absent without
asking), and chunk maps (file chunk -> volume, offset; or a hole).  A write
lease adds the right to write allocated chunks and to keep the file's size and
mtime here (``dirty``) until they are sent (``settle``).

Everything here is plain data, used from the client's trio loop: methods never
await, so each is atomic.  The cache is trusted only while the lease is valid
(``until``, on the trio clock): a client that cannot renew it (server silent,
process stopped) falls back to asking the server, never to old state.

Chunk maps and transfers: a read or write takes a chunk map, then moves bytes
to or from the memory servers.  A recall must not be acknowledged while a
transfer that used the old map is still running (the chunks may be freed and
reused as soon as it is), so transfers *pin* their inode, and a map is used
only if the inode's *generation* did not move while the map was fetched.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import trio

from memfs.layout import LAYOUT_XATTR
from memfs.meta import CAPABILITY_XATTR, Attr, Extent, add_run

#: chunk map value of a hole (reads as zeros)
HOLE = (-1, 0)
#: generation step at a lease loss: above any per-inode count
_EPOCH = 1 << 40


def _nothing() -> None:
    pass


@dataclass(slots=True)
class FileState:
    """Chunk map and write-lease state of one regular file."""

    #: chunk index -> (volume, offset of the chunk's first byte) or HOLE
    chunks: dict[int, tuple[int, int]] = field(default_factory=dict)
    writer: bool = False
    #: where this client's last write ended (a sequential writer gets space ahead)
    last_end: int = -1
    #: space asked ahead last time (it doubles while the writer stays sequential)
    ahead: int = 0
    #: a read under our write lease moved the access time here only (told at our
    #: last close: RemoteMeta.release)
    read_here: bool = False


@dataclass(slots=True)
class DirState:
    #: name -> inode, 0 for a name known absent
    names: dict[bytes, int] = field(default_factory=dict)
    #: every name is in *names* but those in *unknown*: any other is absent
    complete: bool = False
    #: names of a complete directory that a recall (or a reply of ours not cacheable)
    #: left unknown: asked for, not taken as absent
    unknown: set[bytes] = field(default_factory=set)

    def forget(self, name: bytes) -> bool:
        """*name* is unknown now; the others stay as they were.  True if it was added to
        :attr:`unknown`."""
        self.names.pop(name, None)
        if self.complete:
            if len(self.unknown) >= UNKNOWN_KEPT:
                self.complete = False
                self.unknown.clear()
            elif name not in self.unknown:
                self.unknown.add(name)
                return True
        return False


class KernelNames:
    """The names the kernel was told it may cache (an entry timeout), present or
    absent, since it last forgot them all (``FUSE_NOTIFY_INC_EPOCH``, the one way to
    make it forget a name without the directory's lock): a recall of other names
    need not make it forget (every name it holds would be looked up again: two
    nodes creating in one directory looked up the directory itself at each create).
    Past KERNEL_NAMES_KEPT, every name counts as held."""

    __slots__ = ("by_dir", "count", "every")

    def __init__(self) -> None:
        self.by_dir: dict[int, set[bytes]] = {}
        self.count = 0
        self.every = False

    def __bool__(self) -> bool:
        return self.every or self.count > 0

    def add(self, parent: int, name: bytes) -> None:
        if self.every:
            return
        names = self.by_dir.get(parent)
        if names is None:
            names = self.by_dir[parent] = set()
        elif name in names:
            return
        if self.count >= KERNEL_NAMES_KEPT:
            self.by_dir.clear()
            self.count = 0
            self.every = True
            return
        names.add(name)
        self.count += 1

    def any_of(self, parent: int, names: list[bytes]) -> bool:
        if self.every:
            return True
        held = self.by_dir.get(parent)
        return held is not None and any(n in held for n in names)

    def clear(self) -> None:
        self.by_dir.clear()
        self.count = 0
        self.every = False


#: names KernelNames keeps apart (80-320 bytes each: ~80 with many per directory,
#: a set's cost with one)
KERNEL_NAMES_KEPT = 1 << 16

#: names a complete directory keeps as unknown (DirState.forget; ~80 bytes each);
#: beyond, it is no longer complete (a node that another node's creates outnumber
#: asks the mds again, as for a directory it never knew whole)
UNKNOWN_KEPT = 16384
#: unknown names all directories keep: beyond, the directories with the most are
#: no longer complete until half of it is left (ClientCache.trim_unknown)
UNKNOWN_BUDGET = 1 << 18


#: own changes remembered one by one (ClientCache.mark); beyond, all are forgotten at once
MARKS_KEPT = 4096
#: where in the reply stream the current task's last reply was read: ``landings``
#: then (set by RemoteMeta as the call returns; -1, unknown: read before everything)
READ_AT: ContextVar[int] = ContextVar("READ_AT", default=-1)
#: most byte ranges a write lease's report keeps apart (more: the closest merge)
MAX_RANGES = 4


def add_range(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """*ranges* (sorted, apart) with ``[lo, hi)`` added: ranges that overlap or touch
    it merge with it, and past MAX_RANGES the two with the smallest gap merge."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if b < lo or a > hi:
            out.append((a, b))
        else:
            lo, hi = min(lo, a), max(hi, b)
    out.append((lo, hi))
    out.sort()
    while len(out) > MAX_RANGES:
        k = min(range(len(out) - 1), key=lambda k: out[k + 1][0] - out[k][1])
        out[k : k + 2] = [(out[k][0], out[k + 1][1])]
    return out


def hull(ranges: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest range holding every one of *ranges* (``(0, 0)``: none)."""
    if not ranges:
        return (0, 0)
    return (min(lo for lo, _ in ranges), max(hi for _, hi in ranges))


#: the key under which an inode's xattr cache keeps the names of all its xattrs, each
#: followed by a NUL (``listxattr``): no xattr is named by the empty string (the
#: kernel refuses it), and no name holds a NUL
_ALL_NAMES = b""


class ClientCache:
    """The state one client may serve without asking; see the module docstring."""

    def __init__(self, chunk_size: int = 0, term: float = 0.0) -> None:
        self.chunk_size = chunk_size
        #: lease term the server grants (0: cache nothing)
        self.term = term
        #: the lease is valid before this time (trio clock)
        self.until = 0.0
        self.attrs: dict[int, Attr] = {}
        self.dirs: dict[int, DirState] = {}
        self.files: dict[int, FileState] = {}
        #: ino -> xattr name -> value, None: known absent (the kernel asks for
        #: security.capability before every write)
        self.xattrs: dict[int, dict[bytes, bytes | None]] = {}
        #: size and mtime of files written under a write lease that the server does not
        #: know yet; kept across lease losses until sent (they are the application's data)
        self.dirty: dict[int, tuple[int, int]] = {}
        #: sizes and mtimes sent in the answer to a recall that may not have arrived
        #: (the server evicts a client it did not hear from): kept until a reply after
        #: it shows it did, and sent with the next registration otherwise
        self.answered: dict[int, tuple[int, int]] = {}
        #: size and mtime of the last report of our writes that the server answered,
        #: while our write lease lasts: a reply read after that answer may have been
        #: answered before the report (trio wakes the two callers in either order), and
        #: cached as it came it would take our size back (see newest)
        self.reported: dict[int, tuple[int, int]] = {}
        #: reports of ours whose replies were read (``landings`` counts them): size,
        #: mtime and the count at that reply.  The server runs a connection's calls
        #: in order, so a reply read after a report's reply reflects that report (or
        #: what others changed since: another node's truncate), and one read before
        #: it may not, whenever its caller runs (see newest)
        self.landed: dict[int, tuple[int, int, int]] = {}
        self.landings = 0
        #: the byte ranges ``[lo, hi)`` written under the current write lease since the
        #: last report took them (sorted, apart, at most MAX_RANGES: a header rewritten
        #: beside appends far away must not count the chunks between); gone when the
        #: lease ends
        self.spans: dict[int, list[tuple[int, int]]] = {}
        #: spans taken by reports on their way (``take_span``): writes made meanwhile,
        #: inside them or not, start a new span in ``spans`` (their bytes may land
        #: after the server applied the report); a recall's answer carries these too
        self.sending: dict[int, list[list[tuple[int, int]]]] = {}
        self._gens: dict[int, int] = {}
        self._epoch = 0
        #: our truncates and lost leases so far: a reply to a call sent before one is not
        #: cacheable at all (RemoteMeta._roundtrip): a chunk map from before our truncate
        #: names chunks it freed (our next writes under the lease would go there)
        self.cuts = 0
        #: our other changes, numbered: key -> number of the last change of it (an
        #: inode's attributes and xattrs: the inode; a directory's names: ("names",
        #: dir)).  A reply to a call sent before (``seq`` then) is no news about that
        #: key (:meth:`stale`): the server may have answered it before the change.
        self.seq = 0
        self.changed_at: dict[int | tuple[str, int], int] = {}
        #: replies to calls sent before this number are no news about anything
        #: (``changed_at`` is forgotten when it grows large)
        self.floor = 0
        self._pins: dict[int, int] = {}
        #: transfers of this process's transport (see pinned) in progress
        self._here = 0
        #: inode -> memfs.array transfers holding one of its maps
        self._arrays: dict[int, int] = {}
        #: inode -> those among them whose process has not said its bytes moved, and
        #: their number
        self._moving: dict[int, int] = {}
        self._flying = 0
        self._unpinned = trio.Event()
        #: the kernel's caches are being dropped after a lost lease: until that is done,
        #: pages it holds must not be kept at open, nor anything new cached
        self.invalidating = 0
        #: inodes whose attributes the kernel was told it may cache (see fs.Operations)
        self.kernel_inodes: set[int] = set()
        #: the names the kernel was told it may cache (see LeaseKeeper.entry_ttl)
        self.kernel_names = KernelNames()
        #: unknown names of complete directories added since the last count
        #: (:meth:`trim_unknown`)
        self.unknowns = 0
        #: directories whose create lease we hold -> the files made there under it
        #: (memfs.meta.creates)
        self.creators: dict[int, set[int]] = {}

    # -- the lease -------------------------------------------------------------------------

    def valid(self) -> bool:
        return trio.current_time() < self.until

    def renew(self, sent: float) -> None:
        """A reply to a request sent at *sent* arrived: the lease runs from then."""
        until = sent + self.term
        if until > self.until:
            self.until = until

    def ttl(self) -> float:
        """How long the kernel may cache what is cached here now."""
        if self.invalidating:
            return 0.0
        return max(0.0, self.until - trio.current_time())

    # -- lookups (None: not known here) -----------------------------------------------------

    def attr(self, ino: int) -> Attr | None:
        a = self.attrs.get(ino)
        if a is None or not self.valid():
            return None
        return a

    def entry(self, parent: int, name: bytes) -> int | None:
        """The inode *name* in *parent* names, 0 if known absent, None if unknown."""
        d = self.dirs.get(parent)
        if d is None or not self.valid():
            return None
        ino = d.names.get(name)
        if ino is None and d.complete and name not in d.unknown and name not in (b".", b".."):
            return 0
        return ino

    # -- filling ---------------------------------------------------------------------------

    def xattr(self, ino: int, name: bytes) -> tuple[bool, bytes | None]:
        """(known, value); value None: known absent (also when the names of all the
        inode's xattrs are known and *name* is not one; but the layout, which
        ``listxattr`` does not list: memfs.meta.store)."""
        x = self.xattrs.get(ino)
        if x is None or not self.valid():
            return False, None
        if name in x and name != _ALL_NAMES:
            return True, x[name]
        names = x.get(_ALL_NAMES)
        if (names is not None and name != LAYOUT_XATTR
                and b"\0" + name + b"\0" not in b"\0" + names):
            return True, None
        return False, None

    def put_xattr(self, ino: int, name: bytes, value: bytes | None) -> None:
        self.xattrs.setdefault(ino, {})[name] = value

    def xattr_names(self, ino: int) -> list[bytes] | None:
        """The names of all the inode's xattrs, None if not known (``listxattr``)."""
        x = self.xattrs.get(ino)
        if x is None or not self.valid():
            return None
        names = x.get(_ALL_NAMES)
        return None if names is None else names.split(b"\0")[:-1]

    def put_xattr_names(self, ino: int, names: list[bytes]) -> None:
        """Kept with the values, and dropped with them (a change of any xattr drops
        them all)."""
        self.xattrs.setdefault(ino, {})[_ALL_NAMES] = b"".join(n + b"\0" for n in names)

    def put_attr(self, a: Attr) -> None:
        if self.is_writer(a.ino) or a.ino in self.dirty or a.ino in self.landed:
            self.newest(a)
        self.attrs[a.ino] = a

    def newest(self, a: Attr) -> Attr:
        """*a* with what we wrote under our write lease: the server knows no more of
        it than our reports, and its reply may be from before the last (or, unsent,
        from before our writes).  Sizes only grow under the lease: our own truncate
        drops it (:meth:`drop`), another node's recalls it first.  A report whose
        reply was read before *a*'s (:data:`READ_AT`) is in *a* already, or was
        followed by another node's change (after our close, a truncate that needed
        no recall): not laid over it."""
        landed = self.landed.get(a.ino)
        if landed is not None and landed[2] <= READ_AT.get():
            landed = None
        for d in (self.dirty.get(a.ino), self.reported.get(a.ino) if self.is_writer(a.ino) else None,
                  landed):
            if d is not None and (d[0] > a.size or d[1] > a.mtime_ns):
                a.size = max(a.size, d[0])
                a.mtime_ns = max(a.mtime_ns, d[1])
                a.ctime_ns = max(a.ctime_ns, d[1])
        return a

    def mtime_set(self, ino: int, mtime_ns: int) -> None:
        """Our setattr set *ino*'s mtime to *mtime_ns* (older than our writes', maybe:
        ``touch -d``, tar, ``cp -a``), after every report of ours (``reports_sent``):
        what we know of our writes' mtimes is not newer any more, or :meth:`newest`
        would lay it over the time set (and a close's report send it back)."""
        d = self.dirty.get(ino)
        if d is not None:
            self.dirty[ino] = (d[0], mtime_ns)
        r = self.reported.get(ino)
        if r is not None:
            self.reported[ino] = (r[0], mtime_ns)
        landed = self.landed.get(ino)
        if landed is not None:
            self.landed[ino] = (landed[0], mtime_ns, landed[2])

    def put_entry(self, parent: int, name: bytes, ino: int) -> None:
        d = self.dirs.get(parent)
        if d is None:
            d = self.dirs[parent] = DirState()
        d.names[name] = ino
        d.unknown.discard(name)

    def put_listing(self, parent: int, entries: list[tuple[bytes, Attr]], sent: int) -> None:
        """*sent*: ``seq`` when the listing was asked for (see :meth:`stale`)."""
        if not self.stale(("names", parent), sent):
            self.dirs[parent] = DirState({name: a.ino for name, a in entries}, complete=True)
        for _, a in entries:
            if not self.stale(a.ino, sent):
                self.put_attr(a)
            else:
                self.newest(a)

    def new_directory(self, ino: int) -> None:
        """We just made directory *ino*: it is empty, every name is known absent."""
        self.dirs[ino] = DirState(complete=True)

    def put_extents(self, ino: int, extents: list[Extent], *, writer: bool = False) -> None:
        """Record what *extents* say of whole chunks (data in the backing directory is not
        cached: it is fetched by the server on each read until resident)."""
        cs = self.chunk_size
        f = self.files.get(ino)
        if f is None:
            f = self.files[ino] = FileState()
        if writer:
            f.writer = True
        chunks = f.chunks
        for e in extents:
            if e.volume < -1 or e.length <= 0:
                continue
            first, within = divmod(e.offset, cs)
            last = (e.offset + e.length - 1) // cs
            if e.volume < 0:
                chunks.update(dict.fromkeys(range(first, last + 1), HOLE))
            else:  # chunk k starts (k - first) chunks after the first's start
                vol, start = e.volume, e.voffset - within - first * cs
                chunks.update({k: (vol, start + k * cs) for k in range(first, last + 1)})

    # -- using chunk maps --------------------------------------------------------------------

    def is_writer(self, ino: int) -> bool:
        f = self.files.get(ino)
        return f is not None and f.writer

    def extents(self, ino: int, offset: int, end: int, *, allocated: bool = False) -> list[Extent] | None:
        """Extents of ``[offset, end)`` from the chunk map, None if any chunk is unknown
        (or, *allocated*, a hole)."""
        f = self.files.get(ino)
        if f is None:
            return None
        cs = self.chunk_size
        get = f.chunks.get
        out: list[Extent] = []
        pos = offset
        k = pos // cs
        while pos < end:
            c = get(k)
            if c is None or (allocated and c[0] < 0):
                return None
            # the run of chunks that continue this one (a 1 GiB array file's piece is a
            # thousand chunks in four runs: one lookup each, no extent per chunk)
            vol, nxt = c[0], c[1] + cs
            k += 1
            while k * cs < end:
                c = get(k)
                if c is None or c[0] != vol or (vol >= 0 and c[1] != nxt):
                    break
                k += 1
                nxt += cs
            stop = min(k * cs, end)
            add_run(out, pos, stop - pos, vol, nxt - (k * cs - pos) if vol >= 0 else 0)
            pos = stop
        return out

    def wrote(self, ino: int, offset: int, end: int, now_ns: int) -> None:
        """A write under our write lease: size and mtime are ours to keep until settled."""
        self.written(ino, offset, end)
        a = self.attrs.get(ino)
        old = self.dirty.get(ino)
        size = max(end, old[0] if old else 0, a.size if a is not None else 0)
        self.dirty[ino] = (size, now_ns)
        if a is not None:
            a.size = size
            a.mtime_ns = a.ctime_ns = now_ns
        f = self.files.get(ino)
        if f is not None:
            f.last_end = end

    # -- generations and pins --------------------------------------------------------------

    def generation(self, ino: int) -> int:
        return self._epoch + self._gens.get(ino, 0)

    @contextmanager
    def pinned(self, ino: int, *, here: bool = True) -> Iterator[Callable[[], None]]:
        """Held around a transfer that uses a map of *ino*; *here*: by this process's
        transport (memfs.array processes move bytes on connections of their own).
        Yields what to call once such a process says its bytes have moved: a
        reconnection, and a truncate of *ino* made here, stop waiting for the
        transfer then (the pin stays, and a recall still waits for it)."""
        self._pins[ino] = self._pins.get(ino, 0) + 1
        self._here += here
        landed = _nothing
        if not here:
            self._arrays[ino] = self._arrays.get(ino, 0) + 1
            self._moving[ino] = self._moving.get(ino, 0) + 1
            self._flying += 1
            flying = True

            def landed() -> None:
                nonlocal flying
                if flying:
                    flying = False
                    self._flying -= 1
                    _drop_one(self._moving, ino)
                    self._unpinned.set()
        try:
            yield landed
        finally:
            landed()
            self._here -= here
            if not here:
                _drop_one(self._arrays, ino)
            n = _drop_one(self._pins, ino)
            if not n or (here and (not self._here or n == self._arrays.get(ino, 0))):
                self._unpinned.set()  # (no pin of ino, none of ours, or none of ours of ino)

    def any_pinned(self, inos: list[int]) -> bool:
        return any(ino in self._pins for ino in inos)

    def pinned_here(self, ino: int) -> bool:
        """A transfer of this process's transport holds a map of *ino*."""
        return self._pins.get(ino, 0) > self._arrays.get(ino, 0)

    def moving(self, ino: int) -> bool:
        """A transfer under a map of *ino* may still move bytes: one of this process's
        transport, or a memfs.array process's that has not said its bytes moved."""
        return ino in self._moving or self.pinned_here(ino)

    def any_transfer(self) -> bool:
        """Some transfer under our maps may still move bytes (this process's, or a
        memfs.array process's that has not said it is done)."""
        return bool(self._here or self._flying)

    def _busy(self, inos: list[int] | None, everyone: bool, here: bool) -> bool:
        if inos is None:
            return bool(self._here or (everyone and self._flying))
        if here:
            return any(self.pinned_here(ino) for ino in inos)
        return any(ino in self._pins for ino in inos)

    async def wait_unpinned(self, inos: list[int] | None, *, everyone: bool = False,
                            here: bool = False) -> None:
        """Until no transfer holds a map of *inos* (*here*: no transfer of this process's
        transport; None: no transfer of this process's transport runs; with *everyone*,
        no memfs.array process's still moves bytes)."""
        await self._until(lambda: not self._busy(inos, everyone, here))

    async def wait_landed(self, ino: int) -> None:
        """Until every memfs.array transfer of *ino* has said its bytes moved."""
        await self._until(lambda: ino not in self._moving)

    async def _until(self, done: Callable[[], bool]) -> None:
        while not done():
            if self._unpinned.is_set():  # other waiters may be parked on the current one
                self._unpinned = trio.Event()
            await self._unpinned.wait()

    # -- dropping --------------------------------------------------------------------------

    def drop(self, ino: int) -> None:
        """Forget everything about *ino* (a recall): its maps may no longer be used."""
        self.creators.pop(ino, None)
        self.attrs.pop(ino, None)
        self.dirs.pop(ino, None)
        self.files.pop(ino, None)
        self.xattrs.pop(ino, None)
        self.reported.pop(ino, None)
        self.landed.pop(ino, None)
        self._gens[ino] = self._gens.get(ino, 0) + 1

    def drop_names(self, ino: int, names: list[bytes]) -> None:
        """A recall of *names* in directory *ino* (another client changed them): those
        names become unknown, and the directory's attributes and xattrs go.  Its
        other names stay, and so does its completeness (any name neither known nor
        unknown is absent): a directory's holders are recalled at every change of a
        name in it, even those that fetched nothing since (``LeaseTable.recall``),
        replies sent meanwhile are not cacheable, and replies read before the
        recall are not cached after it (``MdsConnection.recalls``), so what is
        left is still right.  Nothing else stays: the recall leaves us untouched,
        and other changes of the directory (its xattrs, its mode) recall only
        touched holders.  (Dropping all names made two nodes creating in one
        directory ask the server for every name they had cached; dropping
        completeness made each node ask it whether each name it then created was
        free.)"""
        self.attrs.pop(ino, None)
        self.xattrs.pop(ino, None)
        d = self.dirs.get(ino)
        if d is not None:
            for name in names:
                self.unknowns += d.forget(name)
            if self.unknowns > UNKNOWN_BUDGET:
                self.trim_unknown()
        self._gens[ino] = self._gens.get(ino, 0) + 1

    def cut(self, ino: int) -> None:
        """Our truncate of *ino*: its cache goes, and nothing answered before is cached."""
        self.drop(ino)
        self.mark(ino)
        self.cuts += 1

    def mark(self, *keys: int | tuple[str, int]) -> None:
        """We changed *keys* (inodes' attributes, ``("names", dir)``): replies to calls
        sent before may show them as they were, and are not cached (:meth:`stale`).
        Scoped, not global: a node creating files in one directory keeps caching what
        it is told about others (and its own creates' replies, which a global rule
        made uncacheable under concurrency, and with them its create lease's use)."""
        self.seq += 1
        if len(self.changed_at) >= MARKS_KEPT:
            self.changed_at.clear()
            self.floor = self.seq
        for k in keys:
            self.changed_at[k] = self.seq

    def stale(self, key: int | tuple[str, int], sent: int) -> bool:
        """Did we change *key* after a call was sent when ``seq`` was *sent*?"""
        return sent < self.floor or self.changed_at.get(key, 0) > sent

    def drop_entry(self, parent: int, name: bytes) -> None:
        d = self.dirs.get(parent)
        if d is not None:
            self.unknowns += d.forget(name)
            if self.unknowns > UNKNOWN_BUDGET:
                self.trim_unknown()

    def trim_unknown(self) -> None:
        """Past UNKNOWN_BUDGET unknown names counted since the last trim (directories
        listed again or dropped since took theirs away uncounted): count them, and
        make the directories with the most no longer complete until at most half
        the budget is left."""
        dirs = sorted(self.dirs.values(), key=lambda d: len(d.unknown), reverse=True)
        total = sum(len(d.unknown) for d in dirs)
        for d in dirs:
            if total <= UNKNOWN_BUDGET // 2 or not d.unknown:
                break
            total -= len(d.unknown)
            d.complete = False
            d.unknown.clear()
        self.unknowns = total

    # -- our own changes, as the server answered them (cacheable: under our lease) ------

    def changed(self, a: Attr, cacheable: bool) -> None:
        """We changed *a*'s inode (setattr): its new attributes."""
        self.mark(a.ino)
        if cacheable:
            self.put_attr(a)
        else:
            self.attrs.pop(a.ino, None)

    def touched(self, parent: int, t: int, links: int, cacheable: bool) -> None:
        """Our change of directory *parent* at time *t* (its mtime and ctime now), which
        gained *links* subdirectories."""
        a = self.attrs.get(parent)
        if a is None:
            return
        if cacheable:
            a.mtime_ns = a.ctime_ns = t
            a.nlink += links
        else:
            del self.attrs[parent]

    def created(self, parent: int, name: bytes, a: Attr, cacheable: bool, *, new: bool = True) -> None:
        """We named *a* *name* in *parent* (*new*: a new inode, not a link)."""
        self.mark(a.ino, parent, ("names", parent))
        # The directory's mtime is the new entry's ctime (one timestamp per call).
        self.touched(parent, a.ctime_ns, 1 if stat.S_ISDIR(a.mode) and a.nlink == 2 else 0, cacheable)
        if cacheable:
            self.put_entry(parent, name, a.ino)
            self.put_attr(a)
            if new:
                # A new inode has no file capabilities: the kernel's look before the
                # first write, and drop_privileges, need not ask.
                self.put_xattr(a.ino, CAPABILITY_XATTR, None)
            if stat.S_ISDIR(a.mode):
                self.new_directory(a.ino)
        else:
            self.drop_entry(parent, name)

    def removed(self, parent: int, name: bytes, child: int, t: int, links: int, cacheable: bool) -> None:
        """We removed *name* (inode *child*) from *parent* at time *t*."""
        self.mark(child, parent, ("names", parent))
        self.touched(parent, t, links, cacheable)
        self.attrs.pop(child, None)  # nlink and ctime moved
        if cacheable:
            self.put_entry(parent, name, 0)
        else:
            self.drop_entry(parent, name)

    def named_elsewhere(self, ino: int | None) -> None:
        """*ino* gets (or loses) a name the server knows: others may learn of it there,
        so it is no longer ours alone to unlink without asking."""
        if ino:
            for born in self.creators.values():
                born.discard(ino)

    def land(self, ino: int, d: tuple[int, int], applied: bool = True) -> None:
        """The reply to our report of *d* (size, mtime) was just read: what the server
        tells us from now on includes it; what it told us before, read or not, may not.
        Not *applied*: the file was recalled (or cut) since the report was taken, so
        the server ignored it (the recall's answer carried the size), and a reply read
        before may show another node's change since: nothing to lay over it."""
        if self.dirty.get(ino) == d:
            del self.dirty[ino]
        self.landings += 1
        if d[0] >= 0 and applied:
            self.landed.pop(ino, None)  # (kept in the order they landed)
            self.landed[ino] = (d[0], d[1], self.landings)
            if len(self.landed) > MARKS_KEPT:
                # The oldest: a reply read before it and not used yet is long gone.
                del self.landed[next(iter(self.landed))]

    def take_write(self, ino: int) -> tuple[int, int] | None:
        """Our write lease on *ino* ends: what the server must learn (size, mtime), if anything."""
        f = self.files.get(ino)
        if f is not None:
            f.writer = False
        self.reported.pop(ino, None)
        return self.dirty.pop(ino, None)

    def written(self, ino: int, offset: int, end: int) -> None:
        """Bytes ``[offset, end)`` were written under our write lease (or the call that
        granted it: posted, they may land after the server marked them)."""
        self.spans[ino] = add_range(self.spans.get(ino, []), offset, end)

    def span(self, ino: int) -> tuple[int, int]:
        """The hull of what was written under the current write lease on *ino* and not
        taken by a report yet (``(0, 0)``: nothing)."""
        return hull(self.spans.get(ino, []))

    def unreported(self, *, sending: bool = False) -> list[int]:
        """Files written under our write leases that the server has not heard all of:
        a size or mtime of ours, or a span (a write the granting call placed moves
        neither, but the server must hear once its bytes landed); with *sending*,
        also those with reports on their way."""
        out = self.dirty.keys() | self.spans.keys()
        return list(out | self.sending.keys() if sending else out)

    def take_span(self, ino: int, *, again: bool = False) -> list[tuple[int, int]]:
        """A report takes what was written since the last one (kept in ``sending``
        until :meth:`span_sent`); later writes start a new span.  *again*: the spans
        of reports still on their way too (the report that ends the lease: the
        server ignores those after it; fsync and ``memfs flush``: they must not
        return before the server has them)."""
        ranges = self.spans.pop(ino, [])
        if again:
            for taken in self.sending.get(ino, ()):
                for lo, hi in taken:
                    ranges = add_range(ranges, lo, hi)
        if ranges:
            self.sending.setdefault(ino, []).append(ranges)
        return ranges

    def span_sent(self, ino: int, ranges: list[tuple[int, int]], *, heard: bool) -> None:
        """The report that took *ranges* is over: the server has them (*heard*), or they
        go back for the next report.  (Gone already if a recall's answer carried them.)"""
        taken = self.sending.get(ino)
        if taken is None or not any(t is ranges for t in taken):
            return
        taken[:] = [t for t in taken if t is not ranges]
        if not taken:
            del self.sending[ino]
        if not heard:
            for lo, hi in ranges:
                self.written(ino, lo, hi)

    def end_span(self, ino: int) -> tuple[int, int]:
        """Our write lease on *ino* ends (a recall): the hull of everything written
        under it that the server may not have, reports on their way included
        (``(0, 0)``: nothing)."""
        ranges = self.spans.pop(ino, [])
        for taken in self.sending.pop(ino, ()):  # (their reports arrive after the answer)
            ranges = ranges + taken
        return hull(ranges)

    def clear(self) -> None:
        """The lease is lost: nothing cached may be used any more (dirty sizes stay,
        and are sent with the next registration, which does not say where; so do
        spans: the server may still hold the lease, its term running out there
        later, and take them)."""
        self.reported.clear()
        self.attrs.clear()
        self.dirs.clear()
        self.files.clear()
        self.xattrs.clear()
        self.creators.clear()
        self._gens.clear()
        self.unknowns = 0
        self._epoch += _EPOCH
        self.cuts += 1
        self.until = 0.0


def _drop_one(counts: dict[int, int], key: int) -> int:
    """One fewer of *key* in *counts* (forgotten at 0); how many are left."""
    n = counts[key] - 1
    if n:
        counts[key] = n
    else:
        del counts[key]
    return n
