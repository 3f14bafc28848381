"""The memfs wire protocol: framing, codecs and authentication, with no I/O.

Every message on a memfs connection (memory server or metadata server) is a
frame: a fixed 12-byte header followed by ``length`` payload bytes::

    magic "MF" | version u8 | kind u8 | request id u32 | payload length u32

(network byte order).  Requests carry a client-chosen id; the reply to a request
carries the same id, so several requests can be outstanding on one connection
and replies matched as they come.  A frame whose header is wrong in any way
(magic, version, unknown kind, length above the receiver's limit) is a protocol
error: the receiver closes that connection.

Payloads:

* data requests to ``memfs memd`` use fixed structs (:data:`READ`,
  :data:`WRITE`, :data:`ZERO`; :data:`TOKEN` for SESSION and FENCE); WRITE's
  data follows its struct, READ's reply payload is the raw bytes, so a
  receiver can ``recv_into`` the destination; WRITE_QUIET is a WRITE that is
  not answered unless refused, and SYNC's answer says that every frame before
  it on that connection was served (a server serves a connection's frames in
  order), so a client confirms many writes with one answer (a server offers
  this in its INFO: ``"features": ["quiet-writes"]``);
* CLAIM (:func:`encode_claim`: a filesystem's 16-byte fsid, then the u32
  indices of the volumes the connection will use) makes this connection a
  holder of those volumes for that filesystem.  A volume belongs to one
  filesystem at a time: claiming one that another fsid holds is refused
  (ERROR, EBUSY); a volume whose last holder's connection ended is free again.
  Claims live in the server's memory only (INFO's ``"features"`` has
  ``"claims"`` where a server understands them);
* control and metadata messages carry one value in a small tagged binary
  encoding (:func:`encode` / :func:`decode`: None, bool, int64, float, bytes,
  str, list, dict);
* errors carry an errno and a message (:func:`encode_error`);
* the RDMA (``verbs``) connection exchange has fixed structs too: a
  VERBS_CONNECT request carries the client's queue pair
  (:func:`encode_verbs_endpoint`), its OK reply the server's queue pair and
  the ``(address, rkey, size)`` of every volume (:func:`encode_verbs_accept`).
  Like every request it is only read after the handshake, so RDMA keys only
  ever go to authenticated clients.

Authentication (:class:`Handshake`): the server sends a random nonce; the
client answers with its own nonce and ``HMAC-SHA256(secret, "memfs-client" |
role | server nonce | client nonce)``; the server checks it and proves itself
with ``HMAC(secret, "memfs-server" | client nonce | server nonce)``.  The secret
never crosses the wire; a server refuses every other frame before this
succeeds.
"""

from __future__ import annotations

import enum
import errno as errno_mod
import hashlib
import hmac
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from memfs.errors import UsageError

MAGIC = b"MF"
VERSION = 1
HEADER = struct.Struct("!2sBBII")
HEADER_SIZE = HEADER.size  # 12
#: default largest payload a receiver accepts: a 16 MiB write plus its struct
MAX_PAYLOAD = (16 << 20) + 64
NONCE_SIZE = 32
MAC_SIZE = 32


class Kind(enum.IntEnum):
    # handshake
    HELLO = 1  # server -> client: server nonce
    AUTH = 2  # client -> server: role, client nonce, client proof
    WELCOME = 3  # server -> client: server proof
    # replies
    OK = 10  # payload depends on the request
    ERROR = 11  # errno u32 + utf-8 message
    OK_CACHE = 12  # metadata OK whose content the client may cache under its lease
    OK_WRITE = 13  # metadata OK that also grants the file's write lease
    ERROR_CACHE = 14  # metadata ERROR the client may cache under its lease (a name known absent)
    # memory server
    INFO = 20  # -> OK(value: pool description)
    READ = 21  # READ struct -> OK(raw bytes)
    WRITE = 22  # WRITE struct + data -> OK(empty)
    ZERO = 23  # ZERO struct -> OK(empty)
    VERBS_CONNECT = 24  # VERBS_ENDPOINT struct -> OK(verbs accept) or ERROR(ENODEV)
    SESSION = 25  # TOKEN struct: this connection works under that lease token -> OK or ERROR(ESTALE)
    FENCE = 26  # TOKEN struct: close that token's connections, refuse it from now on -> OK
    WRITE_QUIET = 27  # WRITE struct + data -> no answer; ERROR only if refused
    SYNC = 28  # -> OK(empty), after every frame sent before it on this connection is served
    CLAIM = 29  # fsid + volumes (encode_claim): held by this connection -> OK or ERROR(EBUSY)
    # metadata server
    CALL = 30  # value [method, args...] -> OK(value)
    RECALL = 31  # server -> client: value [[ino, [names], revoke_write], ...] (req id: recall id)
    RECALLED = 32  # client -> server: value [[ino, size, mtime_ns], ...] (settled write leases)
    UNLOCKED = 33  # server -> client: value [ino]: a lock on it went (its waiters try again)
    POOL = 34  # server -> client: value {"host:port": incarnation}: memory servers taken back



READ = struct.Struct("!IQI")  # volume, offset, length
WRITE = struct.Struct("!IQ")  # volume, offset; data follows
ZERO = struct.Struct("!IQQ")  # volume, offset, length
TOKEN = struct.Struct("!Q")  # a client session's lease token (memfs.meta.server)
_ERRNO = struct.Struct("!I")


#: a filesystem's identity (memfs.meta.server.MetaServer.fsid)
FSID_SIZE = 16
_VOLUME = struct.Struct("!I")
#: the most volumes one memd serves (and so one CLAIM names)
MAX_VOLUMES = 1024
CLAIM_MAX = FSID_SIZE + MAX_VOLUMES * _VOLUME.size


class WireError(Exception):
    """The peer broke the protocol; the connection must be closed."""


class Header(NamedTuple):
    """A parsed frame header (a tuple: one is made for every frame received)."""

    kind: Kind
    req_id: int
    length: int


#: frame kind number -> Kind, without the enum's own (slower) lookup
_KIND_OF = {int(k): k for k in Kind}


def pack_header(kind: Kind, req_id: int, length: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, req_id & 0xFFFFFFFF, length)


def parse_header(data: bytes | bytearray | memoryview, max_payload: int = MAX_PAYLOAD) -> Header:
    """Validate and decode a 12-byte header."""
    if len(data) != HEADER_SIZE:
        raise WireError(f"header of {len(data)} bytes")
    magic, version, kind, req_id, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise WireError(f"protocol version {version}, expected {VERSION}")
    k = _KIND_OF.get(kind)
    if k is None:
        raise WireError(f"unknown frame kind {kind}")
    if length > max_payload:
        raise WireError(f"payload of {length} bytes exceeds the limit of {max_payload}")
    return Header(k, req_id, length)


def frame(kind: Kind, req_id: int, payload: bytes = b"") -> bytes:
    return pack_header(kind, req_id, len(payload)) + payload


# -- errors -------------------------------------------------------------------------


def encode_error(err: int, message: str = "") -> bytes:
    return _ERRNO.pack(err) + message.encode("utf-8", "replace")[:1024]


def decode_error(payload: bytes | bytearray | memoryview) -> tuple[int, str]:
    if len(payload) < _ERRNO.size:
        raise WireError("truncated error payload")
    (err,) = _ERRNO.unpack_from(payload)
    return err or errno_mod.EIO, bytes(payload[_ERRNO.size :]).decode("utf-8", "replace")


# -- data request structs --------------------------------------------------------------


def unpack_exact(st: struct.Struct, payload: bytes | bytearray | memoryview) -> tuple[Any, ...]:
    """Unpack a fixed struct that must be the whole payload."""
    if len(payload) != st.size:
        raise WireError(f"payload of {len(payload)} bytes, expected {st.size}")
    return st.unpack(payload)


def encode_claim(fsid: bytes, volumes: list[int] | tuple[int, ...]) -> bytes:
    """The CLAIM payload: *fsid*, then each volume index (u32); ``ValueError`` if
    they do not fit."""
    if len(fsid) != FSID_SIZE:
        raise ValueError(f"fsid of {len(fsid)} bytes, expected {FSID_SIZE}")
    if not 0 < len(volumes) <= MAX_VOLUMES:
        raise ValueError(f"a claim of {len(volumes)} volumes (1..{MAX_VOLUMES})")
    return bytes(fsid) + struct.pack(f"!{len(volumes)}I", *volumes)


def claim_size_ok(length: int) -> bool:
    """Whether *length* bytes can be a CLAIM payload (checked before receiving it)."""
    return FSID_SIZE < length <= CLAIM_MAX and (length - FSID_SIZE) % _VOLUME.size == 0


def decode_claim(payload: bytes | bytearray | memoryview) -> tuple[bytes, list[int]]:
    """Inverse of :func:`encode_claim`; anything malformed is :class:`WireError`."""
    if not claim_size_ok(len(payload)):
        raise WireError(f"CLAIM payload of {len(payload)} bytes")
    view = memoryview(payload).cast("B")
    n = (len(view) - FSID_SIZE) // _VOLUME.size
    return bytes(view[:FSID_SIZE]), list(struct.unpack_from(f"!{n}I", view, FSID_SIZE))


# -- RDMA (verbs) connection exchange ---------------------------------------------------

#: one RC queue pair: number, first packet sequence number, port LID, port GID,
#: path MTU (``ibv_mtu``: 1 = 256 .. 5 = 4096 bytes), and how many RDMA READs it
#: takes at once (as a responder) or wants outstanding (as a requester)
VERBS_ENDPOINT = struct.Struct("!IIH16sBB")
#: one registered volume: virtual address, remote key, size in bytes
VERBS_REGION = struct.Struct("!QIQ")
_COUNT = struct.Struct("!I")
#: memd serves at most 1024 volumes
MAX_VERBS_REGIONS = MAX_VOLUMES
VERBS_ACCEPT_MAX = VERBS_ENDPOINT.size + _COUNT.size + MAX_VERBS_REGIONS * VERBS_REGION.size
_U24 = 1 << 24
_U64 = 1 << 64


@dataclass(frozen=True, slots=True)
class VerbsEndpoint:
    """One side of a reliable-connected queue pair, as its peer needs to know it."""

    qpn: int
    psn: int
    lid: int
    gid: bytes
    mtu: int
    rd_atomic: int


@dataclass(frozen=True, slots=True)
class VerbsRegion:
    """A volume registered for remote access: where it is, its key, its size."""

    addr: int
    rkey: int
    size: int


def _endpoint_problem(ep: VerbsEndpoint) -> str | None:
    if not 0 < ep.qpn < _U24:
        return f"queue pair number {ep.qpn} is not a 24-bit number above 0"
    if not 0 <= ep.psn < _U24:
        return f"packet sequence number {ep.psn} is not a 24-bit number"
    if not 0 <= ep.lid < (1 << 16):
        return f"LID {ep.lid} is not a 16-bit number"
    if len(ep.gid) != 16:
        return f"GID of {len(ep.gid)} bytes, expected 16"
    if ep.lid == 0 and not any(ep.gid):
        return "neither a LID nor a GID: the queue pair cannot be reached"
    if not 1 <= ep.mtu <= 5:
        return f"path MTU code {ep.mtu} (expected 1..5, 256..4096 bytes)"
    if not 1 <= ep.rd_atomic <= 255:
        return f"RDMA read depth {ep.rd_atomic} (expected 1..255)"
    return None


def encode_verbs_endpoint(ep: VerbsEndpoint) -> bytes:
    """The VERBS_CONNECT payload; ``ValueError`` for values that do not fit."""
    problem = _endpoint_problem(ep)
    if problem:
        raise ValueError(problem)
    return VERBS_ENDPOINT.pack(ep.qpn, ep.psn, ep.lid, bytes(ep.gid), ep.mtu, ep.rd_atomic)


def decode_verbs_endpoint(payload: bytes | bytearray | memoryview) -> VerbsEndpoint:
    """Inverse of :func:`encode_verbs_endpoint`; anything malformed is :class:`WireError`."""
    qpn, psn, lid, gid, mtu, rd_atomic = unpack_exact(VERBS_ENDPOINT, payload)
    ep = VerbsEndpoint(qpn, psn, lid, bytes(gid), mtu, rd_atomic)
    problem = _endpoint_problem(ep)
    if problem:
        raise WireError(f"bad queue pair: {problem}")
    return ep


def encode_verbs_accept(ep: VerbsEndpoint, regions: list[VerbsRegion]) -> bytes:
    """The OK payload answering VERBS_CONNECT: the server's queue pair, then its volumes."""
    if len(regions) > MAX_VERBS_REGIONS:
        raise ValueError(f"{len(regions)} regions (at most {MAX_VERBS_REGIONS})")
    out = bytearray(encode_verbs_endpoint(ep))
    out += _COUNT.pack(len(regions))
    for r in regions:
        if not (0 < r.size and 0 <= r.addr and r.addr + r.size <= _U64 and 0 <= r.rkey < (1 << 32)):
            raise ValueError(f"bad region {r}")
        out += VERBS_REGION.pack(r.addr, r.rkey, r.size)
    return bytes(out)


def decode_verbs_accept(
    payload: bytes | bytearray | memoryview,
) -> tuple[VerbsEndpoint, list[VerbsRegion]]:
    """Inverse of :func:`encode_verbs_accept`; anything malformed is :class:`WireError`."""
    view = memoryview(payload).cast("B")
    head = VERBS_ENDPOINT.size + _COUNT.size
    if len(view) < head:
        raise WireError(f"verbs accept of {len(view)} bytes")
    ep = decode_verbs_endpoint(view[: VERBS_ENDPOINT.size])
    (n,) = _COUNT.unpack_from(view, VERBS_ENDPOINT.size)
    if n > MAX_VERBS_REGIONS or len(view) != head + n * VERBS_REGION.size:
        raise WireError(f"verbs accept of {len(view)} bytes announces {n} regions")
    regions = []
    for i in range(n):
        addr, rkey, size = VERBS_REGION.unpack_from(view, head + i * VERBS_REGION.size)
        if size == 0 or addr + size > _U64:
            raise WireError(f"bad region {i}: {size} bytes at {addr:#x}")
        regions.append(VerbsRegion(addr, rkey, size))
    return ep, regions


# -- value codec -----------------------------------------------------------------------

_I64 = struct.Struct("!q")
_F64 = struct.Struct("!d")
_LEN = struct.Struct("!I")
#: a tag and an integer, a tag and a length: one struct call per scalar in a list
_TAGGED_I64 = struct.Struct("!cq")
_TAGGED_LEN = struct.Struct("!cI")
MAX_DEPTH = 32
#: lists of up to this many integers are encoded and decoded by one struct each
_FAST_MAX = 64
_TAGS_I = b"i" * _FAST_MAX
_INT_LISTS: dict[int, tuple[struct.Struct, struct.Struct]] = {}


def _int_list(n: int) -> tuple[struct.Struct, struct.Struct]:
    """Structs for *n* tagged integers: (with the tags, for packing; skipping them)."""
    st = _INT_LISTS.get(n)
    if st is None:
        st = _INT_LISTS[n] = (struct.Struct("!" + "cq" * n), struct.Struct("!" + "xq" * n))
    return st


def encode(value: Any) -> bytes:
    """Encode None, bool, int (64-bit), float, bytes, str, list/tuple, dict."""
    out = bytearray()
    _enc(value, out, 0)
    return bytes(out)


def call_head(name: str, n_args: int) -> bytes:
    """The start of ``encode([name, *args])`` for *n_args* arguments (for
    :func:`encode_call`)."""
    b = name.encode("utf-8")
    return b"l" + _LEN.pack(n_args + 1) + _TAGGED_LEN.pack(b"s", len(b)) + b


def encode_list(encoded: list[bytes]) -> bytes:
    """``encode(values)``, given each value's own encoding (calls encoded as they
    were made, sent later as one list)."""
    return b"l" + _LEN.pack(len(encoded)) + b"".join(encoded)


def encode_call(head: bytes, args: tuple[int | bytes, ...]) -> bytes:
    """``encode([name, *args])``, *head* being :func:`call_head`'s for them, for
    *args* that are all ``int`` (64-bit) and ``bytes``, checked by the caller (the
    codec's calls of integers and names, a client's hot path): the same bytes
    without the walk through :func:`_enc`.  ValueError for an integer past 64 bits."""
    parts = [head]
    add = parts.append
    try:
        for a in args:
            if isinstance(a, bytes):
                add(_TAGGED_LEN.pack(b"b", len(a)))
                add(a)
            else:
                add(_TAGGED_I64.pack(b"i", a))
    except struct.error:
        raise ValueError("integer does not fit in 64 bits") from None
    return b"".join(parts)


def _enc(v: Any, out: bytearray, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if v is None:
        out += b"N"
    elif v is True:
        out += b"T"
    elif v is False:
        out += b"F"
    elif isinstance(v, int):
        if not -(1 << 63) <= v < (1 << 63):
            raise ValueError(f"integer {v} does not fit in 64 bits")
        out += b"i" + _I64.pack(v)
    elif isinstance(v, float):
        out += b"f" + _F64.pack(v)
    elif isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        out += b"b" + _LEN.pack(len(b)) + b
    elif isinstance(v, str):
        b = v.encode("utf-8")
        out += b"s" + _LEN.pack(len(b)) + b
    elif isinstance(v, (list, tuple)):
        n = len(v)
        out += b"l" + _LEN.pack(n)
        if 0 < n <= _FAST_MAX and type(v[0]) is int and all(type(x) is int for x in v):
            # Lists of integers (attributes, extents) are most of the metadata traffic:
            # one struct call instead of a Python call per item.  Same bytes.
            args: list[Any] = [b"i"] * (2 * n)
            args[1::2] = v
            try:
                out += _int_list(n)[0].pack(*args)
            except struct.error:
                raise ValueError("integer does not fit in 64 bits") from None
            return
        for item in v:
            # Scalars inline (a call's arguments, a journal record): no call per item.
            t = type(item)
            if t is int and -(1 << 63) <= item < (1 << 63):
                out += _TAGGED_I64.pack(b"i", item)
            elif t is bytes:
                out += _TAGGED_LEN.pack(b"b", len(item))
                out += item
            elif t is str:
                b = item.encode("utf-8")
                out += _TAGGED_LEN.pack(b"s", len(b))
                out += b
            elif item is None:
                out += b"N"
            else:
                _enc(item, out, depth + 1)
    elif isinstance(v, dict):
        out += b"d" + _LEN.pack(len(v))
        for key, item in v.items():
            _enc(key, out, depth + 1)
            _enc(item, out, depth + 1)
    else:
        raise TypeError(f"cannot encode {type(v).__name__}")


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Inverse of :func:`encode`; any malformed input raises :class:`WireError`."""
    view = memoryview(data).cast("B")
    try:
        value, pos = _dec(view, 0, 0)
    except (struct.error, IndexError, UnicodeDecodeError, TypeError) as exc:
        raise WireError(f"malformed value: {exc}") from None
    if pos != len(view):
        raise WireError(f"{len(view) - pos} trailing bytes after value")
    return value


def _dec(v: memoryview, pos: int, depth: int) -> tuple[Any, int]:
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    tag = v[pos]
    pos += 1
    if tag == 0x4E:  # N
        return None, pos
    if tag == 0x54:  # T
        return True, pos
    if tag == 0x46:  # F
        return False, pos
    if tag == 0x69:  # i
        return _I64.unpack_from(v, pos)[0], pos + 8
    if tag == 0x66:  # f
        return _F64.unpack_from(v, pos)[0], pos + 8
    if tag in (0x62, 0x73):  # b, s
        (n,) = _LEN.unpack_from(v, pos)
        pos += 4
        if pos + n > len(v):
            raise WireError("string runs past the end")
        raw = bytes(v[pos : pos + n])
        return (raw if tag == 0x62 else raw.decode("utf-8")), pos + n
    if tag == 0x6C:  # l
        (n,) = _LEN.unpack_from(v, pos)
        pos += 4
        if n > len(v) - pos:  # every item takes at least one byte
            raise WireError("list longer than its frame")
        if 0 < n <= _FAST_MAX and 9 * n <= len(v) - pos and v[pos : pos + 9 * n : 9] == _TAGS_I[:n]:
            return list(_int_list(n)[1].unpack_from(v, pos)), pos + 9 * n
        items: list[Any] = []
        append = items.append
        end = len(v)
        for _ in range(n):
            # Scalars inline, as in _enc (past-the-end reads raise, caught in decode()).
            tag = v[pos]
            if tag == 0x69:  # i
                append(_I64.unpack_from(v, pos + 1)[0])
                pos += 9
            elif tag == 0x62:  # b
                (m,) = _LEN.unpack_from(v, pos + 1)
                start = pos + 5
                if start + m > end:
                    raise WireError("string runs past the end")
                append(bytes(v[start : start + m]))
                pos = start + m
            elif tag == 0x4E:  # N
                append(None)
                pos += 1
            elif tag == 0x73:  # s (a call's method name)
                (m,) = _LEN.unpack_from(v, pos + 1)
                start = pos + 5
                if start + m > end:
                    raise WireError("string runs past the end")
                append(str(v[start : start + m], "utf-8"))
                pos = start + m
            else:
                item, pos = _dec(v, pos, depth + 1)
                append(item)
        return items, pos
    if tag == 0x64:  # d
        (n,) = _LEN.unpack_from(v, pos)
        pos += 4
        if 2 * n > len(v) - pos:
            raise WireError("dict longer than its frame")
        d: dict[Any, Any] = {}
        for _ in range(n):
            key, pos = _dec(v, pos, depth + 1)
            if isinstance(key, (list, dict)):
                raise WireError("unhashable dict key")
            d[key], pos = _dec(v, pos, depth + 1)
        return d, pos
    raise WireError(f"unknown value tag {tag:#x}")


# -- authentication ------------------------------------------------------------------------


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read a shared secret file; it must be private (no group/other access) and non-empty."""
    p = Path(path)
    try:
        st = p.stat()
        data = p.read_bytes().strip()
    except OSError as exc:
        raise UsageError(f"cannot read secret file {p}: {exc.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"secret file {p} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    if len(data) < 16:
        raise UsageError(f"secret file {p} holds fewer than 16 bytes")
    return data


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


_AUTH_HEAD = struct.Struct(f"!{NONCE_SIZE}s{MAC_SIZE}sB")


class Handshake:
    """The challenge-response exchange for one connection, for either side.

    Server: ``hello()`` -> send; ``check_auth(payload)`` -> role or WireError;
    then send ``welcome()``.  Client: ``auth(hello_payload, role)`` -> send;
    ``check_welcome(payload)``.  An empty secret means "no authentication
    configured": both sides still run the exchange, with an empty key.
    """

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.server_nonce = b""
        self.client_nonce = b""

    # server side
    def hello(self) -> bytes:
        self.server_nonce = os.urandom(NONCE_SIZE)
        return self.server_nonce

    def check_auth(self, payload: bytes | bytearray | memoryview) -> str:
        if len(payload) < _AUTH_HEAD.size:
            raise WireError("truncated AUTH")
        nonce, mac, role_len = _AUTH_HEAD.unpack_from(payload)
        role_raw = bytes(payload[_AUTH_HEAD.size :])
        if len(role_raw) != role_len:
            raise WireError("bad AUTH role length")
        expected = _mac(self.secret, b"memfs-client\0", role_raw, self.server_nonce, nonce)
        if not hmac.compare_digest(mac, expected):
            raise WireError("authentication failed")
        self.client_nonce = nonce
        return role_raw.decode("ascii", "replace")

    def welcome(self) -> bytes:
        return _mac(self.secret, b"memfs-server\0", self.client_nonce, self.server_nonce)

    # client side
    def auth(self, hello: bytes | bytearray | memoryview, role: str) -> bytes:
        if len(hello) != NONCE_SIZE:
            raise WireError("bad HELLO")
        self.server_nonce = bytes(hello)
        self.client_nonce = os.urandom(NONCE_SIZE)
        role_raw = role.encode("ascii")
        mac = _mac(self.secret, b"memfs-client\0", role_raw, self.server_nonce, self.client_nonce)
        return _AUTH_HEAD.pack(self.client_nonce, mac, len(role_raw)) + role_raw

    def check_welcome(self, payload: bytes | bytearray | memoryview) -> None:
        if not hmac.compare_digest(bytes(payload), self.welcome()):
            raise WireError("server failed to prove it knows the secret")
