"""Metadata values <-> plain wire values, and the table of remote-callable methods.

Pure functions, no I/O: the metadata server, its client and the journal all use
them, so a value means the same on the wire and in the journal.  Dataclasses
travel as fixed-length lists of their fields (in declaration order), which
:func:`memfs.wire.encode` turns into bytes.

Every decoder checks shapes and types strictly and raises
:class:`memfs.wire.WireError` on anything else: the server treats that as a
broken peer and closes the connection, and journal replay as corruption.

:data:`METHODS` is the allow-list of :class:`memfs.meta.Meta` methods a client
may call (the server never looks a name up with ``getattr``), with the type of
each argument, how the result travels, whether the call changes metadata (the
journal records it) and whether a client may safely send it again after a lost
connection (only calls that change nothing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from memfs import wire
from memfs.meta import Attr, Extent, Meta, SetAttr, StatFs, WritePlan
from memfs.wire import WireError

ZeroRanges = list[tuple[int, int, int]]

#: a cacheable chunk map (``OK_CACHE``) of a file not in a backing directory covers the
#: aligned window of this size around what was asked (clipped at the file's size): a
#: client waits for such a call on its way rather than ask for the window again
MAP_WINDOW = 8 << 20


def check_int(v: Any, what: str) -> int:
    # bool is an int subclass; a bool where an int belongs is a malformed value.
    if type(v) is not int:
        raise WireError(f"{what}: expected an integer, got {type(v).__name__}")
    return v



def _opt_int(v: Any, what: str) -> int | None:
    return None if v is None else check_int(v, what)


def check_bytes(v: Any, what: str) -> bytes:
    if type(v) is not bytes:
        raise WireError(f"{what}: expected bytes, got {type(v).__name__}")
    return v


def _opt_bytes(v: Any, what: str) -> bytes | None:
    return None if v is None else check_bytes(v, what)



def check_list(v: Any, what: str, n: int | None = None) -> list[Any]:
    if type(v) is not list:
        raise WireError(f"{what}: expected a list, got {type(v).__name__}")
    if n is not None and len(v) != n:
        raise WireError(f"{what}: expected {n} items, got {len(v)}")
    return v


def _ints(v: Any, what: str, n: int) -> list[int]:
    return [check_int(x, what) for x in check_list(v, what, n)]


#: most inode numbers one ``releases`` call names
MAX_RELEASES = 4096


def _inode_list(v: Any, what: str) -> list[int]:
    items = check_list(v, what)
    if not 0 < len(items) <= MAX_RELEASES:
        raise WireError(f"{what}: expected 1 to {MAX_RELEASES} inode numbers, got {len(items)}")
    return [check_int(x, what) for x in items]


#: most held calls (creates, unlinks, setattrs, opens, access times) one ``made`` call
#: carries (the mds runs them without serving other clients meanwhile: about 4 ms of
#: its time at most)
MAX_MADE = 128
#: the creates and unlinks a client makes itself under a create lease, and the setattrs
#: it makes under a file's write lease (a ``made`` call carries them; a registration
#: replays those not answered)
MADE_CALLS = ("create_at", "unlink_at", "setattr_at")
#: a ``setattr_at`` call's field bits: which of mode, uid, gid, atime, mtime it sets
SET_MODE, SET_UID, SET_GID, SET_ATIME, SET_MTIME = 1, 2, 4, 8, 16
#: the calls a ``made`` call carries: those above, opens a client made under its
#: lease of the file (answered by no one: only counted; see RemoteMeta.open), and
#: the access times of reads it served from its cached chunk map (MapClient.read)
HELD_CALLS = (*MADE_CALLS, "open", "atime_at")


def append_offset(floor: int) -> int:
    """The offset of an ``allocate_ahead`` call that appends (``O_APPEND`` on a cluster
    client): the mds places the write at the end of file as it grants it, at least
    at *floor* (the caller's own size, when it holds the write lease: the mds may
    not have heard of its last writes yet).  Negative: no write asks for it else."""
    return -1 - floor


def append_floor(offset: int) -> int | None:
    """The floor of an appending ``allocate_ahead`` (see :func:`append_offset`), None
    for one at an offset of its own."""
    return -1 - offset if offset < 0 else None


def _made_list(v: Any, what: str) -> list[list[Any]]:
    """Calls of :data:`HELD_CALLS`, checked (as sent: their arguments need no decoding)."""
    items = check_list(v, what)
    if not 0 < len(items) <= MAX_MADE:
        raise WireError(f"{what}: expected 1 to {MAX_MADE} calls, got {len(items)}")
    for x in items:
        try:
            m, _ = decode_call(x)
        except UnknownMethod as exc:
            raise WireError(f"{what}: {exc.args[0]!r} is not made by a client") from None
        except WireError as exc:
            raise WireError(f"{what}: {exc}") from None
        if m.name not in HELD_CALLS:
            raise WireError(f"{what}: {m.name} is not made by a client")
    return items


def _refusals_from_wire(v: Any) -> list[tuple[int, int, str]]:
    out = []
    for x in check_list(v, "refused calls"):
        k, err, msg = check_list(x, "refused call", 3)
        if type(msg) is not str:
            raise WireError("refused call: expected a message")
        out.append((check_int(k, "refused call"), check_int(err, "errno"), msg))
    return out


# -- dataclasses ---------------------------------------------------------------------


def attr_to_wire(a: Attr) -> list[int]:
    return [a.ino, a.mode, a.nlink, a.uid, a.gid, a.rdev, a.size, a.blocks,
            a.atime_ns, a.mtime_ns, a.ctime_ns]


def attr_from_wire(v: Any) -> Attr:
    return Attr(*_ints(v, "attr", 11))


def extent_to_wire(e: Extent) -> list[int]:
    return [e.offset, e.length, e.volume, e.voffset]


def extent_from_wire(v: Any) -> Extent:
    return Extent(*_ints(v, "extent", 4))


def extents_to_wire(es: list[Extent]) -> list[list[int]]:
    return [[e.offset, e.length, e.volume, e.voffset] for e in es]


def extents_from_wire(v: Any) -> list[Extent]:
    return [extent_from_wire(x) for x in check_list(v, "extents")]


def zero_to_wire(z: ZeroRanges) -> list[list[int]]:
    return [[vol, off, n] for vol, off, n in z]


def zero_from_wire(v: Any) -> ZeroRanges:
    out = []
    for x in check_list(v, "zero ranges"):
        vol, off, n = _ints(x, "zero range", 3)
        out.append((vol, off, n))
    return out


def plan_to_wire(p: WritePlan) -> list[Any]:
    return [extents_to_wire(p.extents)]


def plan_from_wire(v: Any) -> WritePlan:
    (extents,) = check_list(v, "write plan", 1)
    return WritePlan(extents_from_wire(extents))


def statfs_to_wire(s: StatFs) -> list[int]:
    return [s.block_size, s.blocks, s.blocks_free, s.files, s.files_free, s.name_max]


def statfs_from_wire(v: Any) -> StatFs:
    return StatFs(*_ints(v, "statfs", 6))


def setattr_to_wire(s: SetAttr) -> list[int | None]:
    return [s.mode, s.uid, s.gid, s.atime_ns, s.mtime_ns]


def setattr_from_wire(v: Any) -> SetAttr:
    return SetAttr(*[_opt_int(x, "setattr") for x in check_list(v, "setattr", 5)])


_SET_BITS = (SET_MODE, SET_UID, SET_GID, SET_ATIME, SET_MTIME)


def setattr_at_args(s: SetAttr) -> list[int]:
    """A ``setattr_at`` call's ``fields, mode, uid, gid, atime_ns, mtime_ns`` for *s*
    (a bit per field set: times before 1970 are negative)."""
    values = setattr_to_wire(s)
    fields = sum(bit for bit, v in zip(_SET_BITS, values, strict=True) if v is not None)
    return [fields, *(0 if v is None else v for v in values)]


def setattr_at_changes(fields: int, *values: int) -> SetAttr:
    """The :class:`SetAttr` of a ``setattr_at`` call's fields and values."""
    return SetAttr(*(v if fields & bit else None for bit, v in zip(_SET_BITS, values, strict=True)))


def entries_to_wire(entries: list[tuple[bytes, int]]) -> list[list[Any]]:
    return [[name, ino] for name, ino in entries]


def entries_from_wire(v: Any) -> list[tuple[bytes, int]]:
    out = []
    for x in check_list(v, "directory entries"):
        name, ino = check_list(x, "directory entry", 2)
        out.append((check_bytes(name, "entry name"), check_int(ino, "entry inode")))
    return out


def plus_to_wire(entries: list[tuple[bytes, Attr]]) -> list[list[Any]]:
    return [[name, attr_to_wire(a)] for name, a in entries]


def plus_from_wire(v: Any) -> list[tuple[bytes, Attr]]:
    out = []
    for x in check_list(v, "directory entries"):
        name, a = check_list(x, "directory entry", 2)
        out.append((check_bytes(name, "entry name"), attr_from_wire(a)))
    return out


def ahead_to_wire(r: tuple[WritePlan, Attr]) -> list[Any]:
    return [plan_to_wire(r[0]), attr_to_wire(r[1])]


def ahead_from_wire(v: Any) -> tuple[WritePlan, Attr]:
    plan, a = check_list(v, "write plan and attributes", 2)
    return plan_from_wire(plan), attr_from_wire(a)


def names_from_wire(v: Any) -> list[bytes]:
    return [check_bytes(x, "xattr name") for x in check_list(v, "xattr names")]


def _none_from_wire(v: Any) -> None:
    if v is not None:
        raise WireError(f"expected no result, got {type(v).__name__}")


def _same(v: Any) -> Any:
    return v


def _two_ints(v: Any) -> tuple[int, int]:
    a, b = _ints(v, "inode and time", 2)
    return a, b


def _three_ints(v: Any) -> tuple[int, int, int]:
    a, b, c = _ints(v, "inodes and time", 3)
    return a, b, c


# -- the method table -----------------------------------------------------------------

#: argument kinds: how each argument is checked and decoded (``to_wire`` is the inverse)
_ARG_FROM: dict[str, Callable[[Any, str], Any]] = {
    "int": check_int,
    "bytes": check_bytes,
    "bytes?": _opt_bytes,
    "setattr": lambda v, what: setattr_from_wire(v),
    "inos": _inode_list,
    "made": _made_list,
}
_ARG_TO: dict[str, Callable[[Any], Any]] = {
    "int": _same, "bytes": _same, "bytes?": _same, "setattr": setattr_to_wire, "inos": list,
    "made": list,
}


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    args: tuple[str, ...]
    result_to_wire: Callable[[Any], Any]
    result_from_wire: Callable[[Any], Any]
    #: the Meta method itself, for a given implementation (explicit, never by name)
    bind: Callable[[Meta], Callable[..., Awaitable[Any]]]
    #: changes metadata: the journal records it
    mutates: bool = False
    #: changes nothing (atime aside): a client may send it again after a lost connection
    retry: bool = False


def _m(
    name: str, args: str, to: Callable[[Any], Any], frm: Callable[[Any], Any], kind: str,
    bind: Callable[[Meta], Callable[..., Awaitable[Any]]],
) -> Method:
    return Method(
        name, tuple(args.split()), to, frm, bind, mutates=kind == "mutates", retry=kind == "read"
    )


def _none_to_wire(v: None) -> None:
    return None


def _server_only(m: Meta) -> Callable[..., Awaitable[Any]]:
    """A call the metadata server serves itself (it needs the caller's session)."""
    raise TypeError("served by memfs.meta.server, not by a Meta")


# kind: "read" (no change, retried), "mutates" (journaled, never retried), "session" (open
# counts: per client session on the server, never journaled, never retried)
METHODS: dict[str, Method] = {m.name: m for m in [
    _m("lookup", "int bytes", attr_to_wire, attr_from_wire, "read", lambda m: m.lookup),
    _m("getattr", "int", attr_to_wire, attr_from_wire, "read", lambda m: m.getattr),
    _m("setattr", "int setattr", attr_to_wire, attr_from_wire, "mutates", lambda m: m.setattr),
    _m("truncate", "int int", zero_to_wire, zero_from_wire, "mutates", lambda m: m.truncate),
    _m("punch", "int int int", zero_to_wire, zero_from_wire, "mutates", lambda m: m.punch),
    _m("seek", "int int int", _same, lambda v: check_int(v, "offset"), "read", lambda m: m.seek),
    _m("mknod", "int bytes int int int int bytes?", attr_to_wire, attr_from_wire, "mutates", lambda m: m.mknod),
    _m("link", "int int bytes", attr_to_wire, attr_from_wire, "mutates", lambda m: m.link),
    # the server answers with the inode(s) the names named and the directories' new
    # mtime, so the client can update what it caches
    _m("unlink", "int bytes", _same, _two_ints, "mutates", lambda m: m.unlink),
    _m("rmdir", "int bytes", _same, _two_ints, "mutates", lambda m: m.rmdir),
    _m("rename", "int bytes int bytes int", _same, _three_ints, "mutates", lambda m: m.rename),
    _m("readlink", "int", _same, lambda v: check_bytes(v, "link target"), "read", lambda m: m.readlink),
    _m("readdir", "int", entries_to_wire, entries_from_wire, "read", lambda m: m.readdir),
    _m("readdirplus", "int", plus_to_wire, plus_from_wire, "read", lambda m: m.readdirplus),
    _m("open", "int", attr_to_wire, attr_from_wire, "session", lambda m: m.open),
    # mknod + open: journaled as the mknod it is (open counts are the session's)
    _m("create", "int bytes int int int", attr_to_wire, attr_from_wire, "session", lambda m: m.create),
    _m("release", "int", _none_to_wire, _none_from_wire, "session", lambda m: m.release),
    # one release of each inode listed, in order: a client's releases since its last
    # call, sent without reply in one frame (the server's cost is mostly per frame)
    _m("releases", "inos", _none_to_wire, _none_from_wire, "session", _server_only),
    _m("getxattr", "int bytes", _same, lambda v: check_bytes(v, "xattr value"), "read", lambda m: m.getxattr),
    _m("setxattr", "int bytes bytes", _none_to_wire, _none_from_wire, "mutates", lambda m: m.setxattr),
    _m("listxattr", "int", _same, names_from_wire, "read", lambda m: m.listxattr),
    _m("removexattr", "int bytes", _none_to_wire, _none_from_wire, "mutates", lambda m: m.removexattr),
    # what a write, truncate or chown takes away (set_ids: 0 or 1), in one step
    _m("drop_privileges", "int int", int, lambda v: bool(check_int(v, "dropped")), "mutates",
       lambda m: m.drop_privileges),
    _m("statfs", "", statfs_to_wire, statfs_from_wire, "read", lambda m: m.statfs),
    # map_read may move atime (relatime); the server journals that when it happens,
    # but sending it twice is harmless.
    _m("map_read", "int int int", extents_to_wire, extents_from_wire, "read", lambda m: m.map_read),
    _m("map_write", "int int int", plan_to_wire, plan_from_wire, "mutates", lambda m: m.map_write),
    # a write lease's preallocation and its coalesced size/mtime (memfs.meta.leases)
    _m("allocate_ahead", "int int int int", ahead_to_wire, ahead_from_wire, "mutates",
       lambda m: m.allocate_ahead),
    _m("settle", "int int int int int int", _none_to_wire, _none_from_wire, "mutates", lambda m: m.settle_write),
    # waits for the server's scrubber; the chunks it cleans are journaled as they go
    _m("reclaim", "", _none_to_wire, _none_from_wire, "session", lambda m: m.reclaim),
    # asynchronous creates under a create lease (memfs.meta.creates): inode numbers reserved
    # for the session (count -> first), and a create with one of them at the client's time
    # (parent, name, mode, uid, gid, ino, time_ns); both journaled by the server itself
    _m("reserve_inos", "int", _same, lambda v: check_int(v, "first reserved inode"), "session",
       _server_only),
    # (answered with nothing: the client made the attributes, and nobody waits for it)
    _m("create_at", "int bytes int int int int int", _none_to_wire, _none_from_wire, "session",
       _server_only),
    # an unlink of a file made so (parent, name, ino, time_ns): journaled as the unlink it is
    _m("unlink_at", "int bytes int int", _same, _two_ints, "session", _server_only),
    # a setattr made under the file's write lease (memfs.meta.leases), at the client's
    # time: (ino, fields, mode, uid, gid, atime_ns, mtime_ns, time_ns), *fields* the
    # SET_* bits of those it sets; journaled as the setattr it is
    _m("setattr_at", "int int int int int int int int", _none_to_wire, _none_from_wire, "session",
       _server_only),
    # a read's access time (relatime), moved by a client that read from the chunk map
    # it caches (ino, time_ns): journaled as the map_read that moves it
    _m("atime_at", "int int", _none_to_wire, _none_from_wire, "session", _server_only),
    # several of those in one call, run in order (the server's cost is mostly per
    # call): answered with [position, errno, message] of each refused
    _m("made", "made", _same, _refusals_from_wire, "session", _server_only),
    # cluster-wide locks (memfs.meta.locks), kept by the server per session, never
    # journaled: a POSIX lock test (ino, owner, type, start, length, pid -> the lock in
    # the way as [type, start, length, pid], type F_UNLCK if none), a POSIX lock set
    # (..., wait: 1 to be told when a lock on the file goes) and a flock (ino, owner,
    # type, wait); EAGAIN if another owner's lock is in the way.  unlock drops all of
    # an owner's locks on the file (its open file was released).  Sent again after a
    # lost connection ("read"): the same lock taken, tested or dropped twice by one
    # owner is the same as once.
    _m("getlk", "int int int int int int", _same, lambda v: _ints(v, "lock", 4), "read",
       _server_only),
    _m("setlk", "int int int int int int int", _none_to_wire, _none_from_wire, "read",
       _server_only),
    _m("flock", "int int int int", _none_to_wire, _none_from_wire, "read", _server_only),
    _m("unlock", "int int", _none_to_wire, _none_from_wire, "read", _server_only),
    # the owner no longer waits for a lock on the file (its wait was interrupted):
    # deadlock detection forgets it
    _m("unwait", "int int", _none_to_wire, _none_from_wire, "read", _server_only),
]}


class UnknownMethod(Exception):
    """A well-formed call to a method that is not on the allow-list."""


#: method -> the exact type of each argument, for methods whose arguments are all
#: integers and byte strings (most calls): checked at once, not one call per argument
_PLAIN: dict[str, tuple[type, ...]] = {
    m.name: tuple(int if k == "int" else bytes for k in m.args)
    for m in METHODS.values() if all(k in ("int", "bytes") for k in m.args)
}
_HEADS = {name: wire.call_head(name, len(types)) for name, types in _PLAIN.items()}


def encode_call(method: str, *args: Any) -> list[Any]:
    """The wire value of a call: ``[method, *args]``."""
    m = METHODS[method]
    if len(args) != len(m.args):
        raise TypeError(f"{method} takes {len(m.args)} arguments, got {len(args)}")
    return [method, *(_ARG_TO[k](a) for k, a in zip(m.args, args, strict=True))]


def call_payload(method: str, *args: Any) -> bytes:
    """``wire.encode(encode_call(method, *args))``, the same bytes: a client's calls
    are mostly integers and names, encoded here without the general encoder's walk
    (about a third of its time, measured)."""
    plain = _PLAIN.get(method)
    if plain is not None and tuple(map(type, args)) == plain:
        return wire.encode_call(_HEADS[method], args)
    return wire.encode(encode_call(method, *args))


# A made call's calls are run as sent (_made_list checks them, and their decoded
# arguments are the values on the wire): integers and names only.
assert all(name in _PLAIN for name in HELD_CALLS)
_MADE_HEAD = wire.call_head("made", 1)


def opens_only(parsed: Any) -> bool:
    """Is a parsed call (``decode_call``'s) an ``open``, or a ``made`` call of opens only?"""
    if not isinstance(parsed, tuple):
        return False
    m, args = parsed
    return m.name == "open" or (m.name == "made" and all(call[0] == "open" for call in args[0]))


def calls_in(parsed: Any) -> int:
    """How many calls a parsed call (``decode_call``'s, or None for a control call)
    runs: a ``made`` call's count, else 1."""
    if type(parsed) is tuple and parsed[0].name == "made":
        return len(parsed[1][0])
    return 1


def made_payload(calls: list[bytes]) -> bytes:
    """The payload of a ``made`` call of *calls*, each a :data:`HELD_CALLS` payload
    (:func:`call_payload`): the same bytes as ``call_payload("made", [...])``."""
    return _MADE_HEAD + wire.encode_list(calls)


def decode_call(value: Any) -> tuple[Method, list[Any]]:
    """Check a call value and decode its arguments.

    :class:`UnknownMethod` for a name off the allow-list (the caller answers ENOSYS);
    :class:`WireError` for anything malformed.
    """
    items = check_list(value, "call")
    if not items or type(items[0]) is not str:
        raise WireError("call: expected [method, args...]")
    m = METHODS.get(items[0])
    if m is None:
        raise UnknownMethod(items[0])
    return m, decode_args(m, items[1:])


def decode_args(m: Method, raw: list[Any]) -> list[Any]:
    plain = _PLAIN.get(m.name)
    if plain is not None and tuple(map(type, raw)) == plain:
        return list(raw)  # (bool is not int here either: type, not isinstance)
    if len(raw) != len(m.args):
        raise WireError(f"{m.name}: expected {len(m.args)} arguments, got {len(raw)}")
    return [_ARG_FROM[k](v, f"{m.name} argument {i}") for i, (k, v) in enumerate(zip(m.args, raw, strict=True))]


async def call_store(meta: Meta, method: str, args: list[Any]) -> Any:
    """Call allow-listed *method* of *meta* with decoded *args*."""
    return await METHODS[method].bind(meta)(*args)
