"""The wire protocol as pure functions: codec, framing, errors, handshake, fuzzing.

Servers feed whatever arrives on a socket into :func:`wire.parse_header` and
:func:`wire.decode`; the only acceptable reaction to garbage is
:class:`wire.WireError` (the connection is closed), never another exception
that could take a server task down, and never a hang or a huge allocation.
"""

from __future__ import annotations

import errno
import math
import os
import random
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from memfs import wire
from memfs.errors import UsageError
from memfs.wire import Kind, WireError


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["none", "bool", "int", "float", "bytes", "str"]
    if depth < 4:
        kinds += ["list", "dict"]
    k = rng.choice(kinds)
    if k == "none":
        return None
    if k == "bool":
        return rng.random() < 0.5
    if k == "int":
        return rng.choice([0, -1, 1, (1 << 63) - 1, -(1 << 63), rng.randint(-(1 << 63), (1 << 63) - 1)])
    if k == "float":
        return rng.choice([0.0, -0.0, math.inf, -math.inf, 1e308, rng.uniform(-1e9, 1e9)])
    if k == "bytes":
        return rng.randbytes(rng.randrange(0, 40))
    if k == "str":
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x100, 0xD7FF)]))
                       for _ in range(rng.randrange(0, 20)))
    if k == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    keys: list[Any] = [rng.randrange(-5, 1000), rng.randbytes(3), f"k{rng.random()}", None, True]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))}


def test_codec_round_trip_random_values() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        v = random_value(rng)
        assert wire.decode(wire.encode(v)) == v


def test_codec_specific_values() -> None:
    v: Any
    for v in [None, True, False, 0, -(1 << 63), (1 << 63) - 1, 1.5, b"", "", "héllo", [], {},
              {"a": [1, {"b": b"\0"}]}]:
        assert wire.decode(wire.encode(v)) == v
    # tuples and bytes-likes encode as lists and bytes
    assert wire.decode(wire.encode((1, 2))) == [1, 2]
    assert wire.decode(wire.encode(bytearray(b"xy"))) == b"xy"
    assert wire.decode(wire.encode(memoryview(b"xy"))) == b"xy"
    # bool stays bool, not int
    assert wire.decode(wire.encode([True, 1]))[0] is True
    nan = wire.decode(wire.encode(math.nan))
    assert math.isnan(nan)


def test_codec_refuses_what_it_cannot_carry() -> None:
    with pytest.raises(ValueError):
        wire.encode(1 << 63)
    with pytest.raises(ValueError):
        wire.encode(-(1 << 63) - 1)
    with pytest.raises(TypeError):
        wire.encode(object())
    with pytest.raises(TypeError):
        wire.encode({1, 2})
    deep: Any = []
    for _ in range(wire.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(ValueError):
        wire.encode(deep)


def test_encode_call_is_encode_of_the_list() -> None:
    """The codec's shortcut for calls of integers and names writes encode's bytes."""
    for name, args in (("statfs", ()), ("release", (5,)), ("lookup", (1, b"")),
                       ("create_at", (1, b"n" * 300, 0o100644, -1, 0, (1 << 63) - 1, -(1 << 63)))):
        assert wire.encode_call(wire.call_head(name, len(args)), args) == wire.encode([name, *args])
    with pytest.raises(ValueError, match="64 bits"):
        wire.encode_call(wire.call_head("getattr", 1), (1 << 63,))


def test_whatever_encodes_decodes_at_the_deepest_level() -> None:
    """Scalars in the innermost list the encoder allows decode too (a string there
    once went through the general path, one level deeper, and was refused)."""
    for leaf in ("s", b"b", 1, None):  # (the encoder inlines these; others go a level deeper)
        v: Any = leaf
        for _ in range(wire.MAX_DEPTH + 1):
            v = [v]
        assert wire.decode(wire.encode(v)) == v


@pytest.mark.parametrize(
    "data",
    [
        b"",  # no tag
        b"X",  # unknown tag
        b"i\0\0",  # truncated int
        b"f\0",  # truncated float
        b"s\0\0\0\x05abc",  # string past the end
        b"s\0\0\0\x02\xff\xfe",  # invalid utf-8
        b"l\0\0\0\x05N",  # list longer than the frame
        b"l\0\0\0\x02Ni\0\0",  # truncated int in a list
        b"l\0\0\0\x03Nb\0\0\0\x09ab",  # bytes in a list past the end
        b"l\0\0\0\x02Ns\0\0\0\x01\xff",  # invalid utf-8 in a list
        b"d\0\0\0\x01l\0\0\0\0N",  # a list as a key: unhashable
        b"d\0\0\0\x01N",  # dict value missing
        b"NN",  # trailing bytes
        b"l\0\0\0\x01" * (wire.MAX_DEPTH + 2) + b"N",  # too deep
        b"d\xff\xff\xff\xff",  # absurd count
    ],
)
def test_decode_malformed(data: bytes) -> None:
    with pytest.raises(WireError):
        wire.decode(data)


def test_header_round_trip() -> None:
    for kind in Kind:
        for req_id in (0, 1, 0xFFFFFFFF):
            h = wire.parse_header(wire.pack_header(kind, req_id, 77))
            assert (h.kind, h.req_id, h.length) == (kind, req_id, 77)
    f = wire.frame(Kind.OK, 9, b"abc")
    assert wire.parse_header(f[: wire.HEADER_SIZE]).length == 3 and f[wire.HEADER_SIZE:] == b"abc"
    # ids wrap to 32 bits
    assert wire.parse_header(wire.pack_header(Kind.OK, (1 << 32) + 5, 0)).req_id == 5


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"MF\x01", "header of 3 bytes"),
        (wire.pack_header(Kind.OK, 1, 0) + b"x", "header of 13 bytes"),
        (b"XX" + wire.pack_header(Kind.OK, 1, 0)[2:], "bad magic"),
        (wire.HEADER.pack(wire.MAGIC, 2, Kind.OK, 1, 0), "version 2"),
        (wire.HEADER.pack(wire.MAGIC, wire.VERSION, 99, 1, 0), "unknown frame kind 99"),
        (wire.HEADER.pack(wire.MAGIC, wire.VERSION, 0, 1, 0), "unknown frame kind 0"),
        (wire.pack_header(Kind.WRITE, 1, wire.MAX_PAYLOAD + 1), "exceeds the limit"),
    ],
)
def test_header_errors(header: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.parse_header(header)


def test_header_limit_is_the_receivers() -> None:
    h = wire.pack_header(Kind.AUTH, 0, 1000)
    assert wire.parse_header(h).length == 1000
    with pytest.raises(WireError):
        wire.parse_header(h, max_payload=512)


def test_error_payloads() -> None:
    assert wire.decode_error(wire.encode_error(errno.EINVAL, "bad range")) == (errno.EINVAL, "bad range")
    assert wire.decode_error(wire.encode_error(errno.ENOSPC)) == (errno.ENOSPC, "")
    # errno 0 is not "success": an error reply always means failure
    assert wire.decode_error(wire.encode_error(0, "x"))[0] == errno.EIO
    # messages are capped and survive invalid utf-8
    assert len(wire.encode_error(1, "x" * 5000)) == 4 + 1024
    assert wire.decode_error(struct.pack("!I", 5) + b"\xff")[1] == "\ufffd"
    with pytest.raises(WireError):
        wire.decode_error(b"\0\0")


def test_data_structs() -> None:
    payload = wire.READ.pack(3, 1 << 40, 4096)
    assert wire.unpack_exact(wire.READ, payload) == (3, 1 << 40, 4096)
    with pytest.raises(WireError):
        wire.unpack_exact(wire.READ, payload + b"\0")
    with pytest.raises(WireError):
        wire.unpack_exact(wire.ZERO, payload)


def shake(server_secret: bytes, client_secret: bytes, role: str = "tcp") -> str:
    server, client = wire.Handshake(server_secret), wire.Handshake(client_secret)
    auth = client.auth(server.hello(), role)
    got = server.check_auth(auth)
    client.check_welcome(server.welcome())
    return got


def test_handshake_success() -> None:
    assert shake(b"s" * 32, b"s" * 32, "memd-client") == "memd-client"
    assert shake(b"", b"") == "tcp"  # unauthenticated servers still run the exchange


def test_handshake_wrong_secret() -> None:
    with pytest.raises(WireError, match="authentication failed"):
        shake(b"s" * 32, b"t" * 32)
    with pytest.raises(WireError, match="authentication failed"):
        shake(b"s" * 32, b"")


def test_handshake_tampering() -> None:
    secret = b"k" * 32
    server, client = wire.Handshake(secret), wire.Handshake(secret)
    auth = bytearray(client.auth(server.hello(), "tcp"))
    for pos in (0, wire.NONCE_SIZE - 1, wire.NONCE_SIZE, len(auth) - 1):  # nonce, mac, role
        bad = bytearray(auth)
        bad[pos] ^= 1
        with pytest.raises(WireError):
            server.check_auth(bytes(bad))
    # a changed role length or a truncated AUTH
    with pytest.raises(WireError):
        server.check_auth(bytes(auth[:-1]))
    with pytest.raises(WireError):
        server.check_auth(bytes(auth[:10]))
    # a replayed AUTH does not fit another server nonce
    other = wire.Handshake(secret)
    other.hello()
    with pytest.raises(WireError):
        other.check_auth(bytes(auth))
    # the client detects a server that does not know the secret
    server.check_auth(bytes(auth))
    impostor = wire.Handshake(b"x" * 32)
    impostor.server_nonce, impostor.client_nonce = server.server_nonce, server.client_nonce
    with pytest.raises(WireError, match="prove"):
        client.check_welcome(impostor.welcome())
    with pytest.raises(WireError):
        client.auth(b"short", "tcp")


def test_load_secret(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_bytes(b"0123456789abcdef0123\n")
    f.chmod(0o600)
    assert wire.load_secret(f) == b"0123456789abcdef0123"
    f.chmod(0o644)
    with pytest.raises(UsageError, match="readable by others"):
        wire.load_secret(f)
    f.chmod(0o600)
    f.write_bytes(b"short")
    with pytest.raises(UsageError, match="fewer than 16"):
        wire.load_secret(f)
    with pytest.raises(UsageError, match="cannot read"):
        wire.load_secret(tmp_path / "missing")


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        else:
            pos = rng.randrange(len(b) + 1)
            b[pos:pos] = rng.choice([b"\xff\xff\xff\xff", b"\0\0\0\0", b"l", b"d", b"s"])
    return bytes(b)


@pytest.mark.timeout(60)
def test_fuzz_decode_and_parse_header() -> None:
    """20,000 random and mutated inputs: WireError or a value, nothing else, quickly."""
    rng = random.Random(20261121)
    seeds = [wire.encode(random_value(rng)) for _ in range(200)]
    headers = [wire.pack_header(k, rng.randrange(1 << 32), rng.randrange(1 << 16)) for k in Kind]
    t0 = time.monotonic()
    outcomes = {"ok": 0, "error": 0}
    for i in range(20_000):
        r = i % 4
        if r == 0:
            data = rng.randbytes(rng.randrange(0, 64))
        elif r == 1:
            data = mutate(rng, rng.choice(seeds))
        elif r == 2:
            data = mutate(rng, rng.choice(headers))
        else:
            data = os.urandom(wire.HEADER_SIZE)
        for fn in (wire.decode, wire.parse_header):
            try:
                fn(data)
            except WireError:
                outcomes["error"] += 1
            else:
                outcomes["ok"] += 1
    assert outcomes["error"] > 10_000 and outcomes["ok"] > 100, outcomes
    assert time.monotonic() - t0 < 30


# -- the RDMA (verbs) connection exchange -----------------------------------------------

EP = wire.VerbsEndpoint(qpn=0x1234, psn=0xABCDEF, lid=7, gid=bytes(range(16)), mtu=5, rd_atomic=16)


def test_verbs_endpoint_round_trip() -> None:
    payload = wire.encode_verbs_endpoint(EP)
    assert len(payload) == wire.VERBS_ENDPOINT.size == 28
    assert wire.decode_verbs_endpoint(payload) == EP
    # RoCE: no LID, a GID; InfiniBand: a LID, no GID
    for ep in (wire.VerbsEndpoint(1, 0, 0, b"\xfe\x80" + bytes(13) + b"\x01", 1, 1),
               wire.VerbsEndpoint((1 << 24) - 1, (1 << 24) - 1, 0xFFFF, bytes(16), 3, 255)):
        assert wire.decode_verbs_endpoint(wire.encode_verbs_endpoint(ep)) == ep


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"qpn": 0}, "queue pair number"),
        ({"qpn": 1 << 24}, "queue pair number"),
        ({"psn": 1 << 24}, "packet sequence"),
        ({"lid": 1 << 16}, "LID"),
        ({"gid": bytes(15)}, "GID of 15 bytes"),
        ({"lid": 0, "gid": bytes(16)}, "neither a LID nor a GID"),
        ({"mtu": 0}, "MTU"),
        ({"mtu": 6}, "MTU"),
        ({"rd_atomic": 0}, "read depth"),
    ],
)
def test_verbs_endpoint_refused(change: dict[str, Any], message: str) -> None:
    fields = {"qpn": EP.qpn, "psn": EP.psn, "lid": EP.lid, "gid": EP.gid, "mtu": EP.mtu,
              "rd_atomic": EP.rd_atomic, **change}
    bad = wire.VerbsEndpoint(**fields)
    with pytest.raises(ValueError, match=message):
        wire.encode_verbs_endpoint(bad)
    if len(bad.gid) == 16 and all(0 <= v < (1 << 32) for v in (bad.qpn, bad.psn)) \
            and bad.lid < (1 << 16):
        raw = wire.VERBS_ENDPOINT.pack(bad.qpn, bad.psn, bad.lid, bad.gid, bad.mtu, bad.rd_atomic)
        with pytest.raises(WireError, match=message):
            wire.decode_verbs_endpoint(raw)


def test_verbs_endpoint_wrong_size() -> None:
    payload = wire.encode_verbs_endpoint(EP)
    for bad in (b"", payload[:-1], payload + b"\0"):
        with pytest.raises(WireError):
            wire.decode_verbs_endpoint(bad)


def test_verbs_accept_round_trip() -> None:
    regions = [wire.VerbsRegion(0x7F00_0000_0000 + i * (1 << 30), 0x1000 + i, 1 << 30)
               for i in range(4)]
    payload = wire.encode_verbs_accept(EP, regions)
    assert len(payload) == 28 + 4 + 4 * 20
    assert wire.decode_verbs_accept(payload) == (EP, regions)
    assert wire.decode_verbs_accept(bytearray(wire.encode_verbs_accept(EP, []))) == (EP, [])
    # the largest pool memd serves fits the limit clients read
    many = [wire.VerbsRegion(4096 * i, i, 4096) for i in range(wire.MAX_VERBS_REGIONS)]
    big = wire.encode_verbs_accept(EP, many)
    assert len(big) == wire.VERBS_ACCEPT_MAX
    assert wire.decode_verbs_accept(memoryview(big))[1] == many


def test_verbs_accept_refused() -> None:
    good = wire.encode_verbs_accept(EP, [wire.VerbsRegion(4096, 5, 4096)])
    head = wire.VERBS_ENDPOINT.size
    for bad in (
        good[:-1],  # truncated region
        good + b"\0",  # trailing byte
        good[:head],  # no count
        good[:head] + struct.pack("!I", 2) + good[head + 4 :],  # count says 2, one follows
        good[:head] + struct.pack("!I", 1 << 31),  # absurd count, no allocation
        good[: head + 4] + wire.VERBS_REGION.pack(4096, 5, 0),  # empty region
        good[: head + 4] + wire.VERBS_REGION.pack((1 << 64) - 4096, 5, 8192),  # wraps
        wire.VERBS_ENDPOINT.pack(0, 0, 0, bytes(16), 0, 0) + good[head:],  # bad endpoint
    ):
        with pytest.raises(WireError):
            wire.decode_verbs_accept(bad)
    with pytest.raises(ValueError):
        wire.encode_verbs_accept(EP, [wire.VerbsRegion(0, 1, 0)])
    with pytest.raises(ValueError):
        wire.encode_verbs_accept(EP, [wire.VerbsRegion(0, 1, 1)] * (wire.MAX_VERBS_REGIONS + 1))


def test_verbs_connect_is_a_frame_kind() -> None:
    frame = wire.frame(Kind.VERBS_CONNECT, 9, wire.encode_verbs_endpoint(EP))
    h = wire.parse_header(frame[: wire.HEADER_SIZE])
    assert (h.kind, h.req_id, h.length) == (Kind.VERBS_CONNECT, 9, wire.VERBS_ENDPOINT.size)


@pytest.mark.timeout(60)
def test_fuzz_verbs_codec() -> None:
    """Random and mutated exchanges: WireError or a value, nothing else."""
    rng = random.Random(4404)
    seeds = [wire.encode_verbs_accept(EP, [wire.VerbsRegion(rng.randrange(1 << 40), i, 1 << 20)
                                          for i in range(rng.randrange(5))]) for _ in range(20)]
    seeds.append(wire.encode_verbs_endpoint(EP))
    outcomes = {"ok": 0, "error": 0}
    for i in range(10_000):
        data = rng.randbytes(rng.randrange(64)) if i % 3 == 0 else mutate(rng, rng.choice(seeds))
        for fn in (wire.decode_verbs_endpoint, wire.decode_verbs_accept):
            try:
                fn(data)
            except WireError:
                outcomes["error"] += 1
            else:
                outcomes["ok"] += 1
    assert outcomes["error"] > 5_000 and outcomes["ok"] > 50, outcomes
