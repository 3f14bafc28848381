"""The metadata value codec: every shape survives the wire, nothing else gets through.

The server decodes whatever an authenticated peer sends with these functions,
and journal replay trusts what they accept, so the refusals matter as much as
the round trips.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from memfs import wire
from memfs.meta import Attr, Extent, SetAttr, StatFs, WritePlan, codec
from memfs.wire import WireError

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


def through_wire(v: Any) -> Any:
    return wire.decode(wire.encode(v))


ATTRS = [
    Attr(1, 0o40755, 2, 0, 0, 0, 4096, 0, 0, 0, 0),
    Attr(2, 0o100644, 1, 1000, 1000, 0, 12345, 24, 1, 2, 3),
    Attr(I64_MAX, 0o20600, 0, 65534, 65534, (1 << 32) - 1, I64_MAX, I64_MAX,
         -1_000_000_000, I64_MIN, I64_MAX),  # pre-1970 and extreme times
]
EXTENTS = [Extent(0, 1, 0, 0), Extent(1 << 40, 1 << 20, 3, 1 << 33), Extent(5, 7, -1, 0)]
PLANS = [
    WritePlan([]),
    WritePlan([Extent(0, 4096, 1, 65536)]),
    WritePlan(EXTENTS),
]
STATFS = [StatFs(4096, 0, 0, 0, 0, 255), StatFs(4096, 1 << 40, 1 << 39, 1 << 20, 17, 255)]
SETATTRS = [
    SetAttr(),
    SetAttr(mode=0o7777),
    SetAttr(uid=0, gid=0),
    SetAttr(atime_ns=-5, mtime_ns=I64_MAX),
    SetAttr(0o644, 1, 2, 3, 4),
]


@pytest.mark.parametrize("a", ATTRS)
def test_attr(a: Attr) -> None:
    assert codec.attr_from_wire(through_wire(codec.attr_to_wire(a))) == a


@pytest.mark.parametrize("e", EXTENTS)
def test_extent(e: Extent) -> None:
    assert codec.extent_from_wire(through_wire(codec.extent_to_wire(e))) == e
    assert codec.extents_from_wire(through_wire(codec.extents_to_wire([e, e]))) == [e, e]


@pytest.mark.parametrize("p", PLANS)
def test_write_plan(p: WritePlan) -> None:
    assert codec.plan_from_wire(through_wire(codec.plan_to_wire(p))) == p


@pytest.mark.parametrize("s", STATFS)
def test_statfs(s: StatFs) -> None:
    assert codec.statfs_from_wire(through_wire(codec.statfs_to_wire(s))) == s


@pytest.mark.parametrize("s", SETATTRS)
def test_setattr(s: SetAttr) -> None:
    assert codec.setattr_from_wire(through_wire(codec.setattr_to_wire(s))) == s


def test_other_results() -> None:
    entries = [(b"a", 2), (b"\xff\x00name", 1 << 40)]
    assert codec.entries_from_wire(through_wire(codec.entries_to_wire(entries))) == entries
    assert codec.entries_from_wire(through_wire(codec.entries_to_wire([]))) == []
    zero = [(0, 0, 1), (2, 1 << 33, 65535)]
    assert codec.zero_from_wire(through_wire(codec.zero_to_wire(zero))) == zero
    assert codec.names_from_wire(through_wire([b"user.a", b""])) == [b"user.a", b""]


@pytest.mark.parametrize(
    "decoder, bad",
    [
        (codec.attr_from_wire, [1] * 10),  # too short
        (codec.attr_from_wire, [1] * 12),
        (codec.attr_from_wire, [True] + [1] * 10),  # a bool is not an int
        (codec.attr_from_wire, [1.0] + [1] * 10),
        (codec.attr_from_wire, {"ino": 1}),
        (codec.extent_from_wire, [0, 1, 2, None]),
        (codec.extents_from_wire, [[0, 1, 2, 3], "x"]),
        (codec.plan_from_wire, [[], []] + [[]]),
        (codec.plan_from_wire, [[], [[0, 0]]]),  # a zero range has three fields
        (codec.statfs_from_wire, [4096] * 5),
        (codec.setattr_from_wire, [None] * 4),
        (codec.setattr_from_wire, [None, None, b"0", None, None]),
        (codec.entries_from_wire, [["name", 1]]),  # names are bytes
        (codec.entries_from_wire, [[b"name"]]),
        (codec.names_from_wire, [b"ok", 1]),
    ],
)
def test_malformed_values_are_refused(decoder: Any, bad: Any) -> None:
    with pytest.raises(WireError):
        decoder(bad)


SAMPLE_ARGS: dict[str, tuple[Any, ...]] = {
    "lookup": (1, b"name"),
    "getattr": (7,),
    "setattr": (7, SetAttr(mode=0o600, mtime_ns=5)),
    "truncate": (7, 1 << 40),
    "punch": (7, 1 << 33, 1 << 40),
    "seek": (7, 1 << 33, 4),
    "mknod": (1, b"n", 0o100644, 1, 2, 0, None),
    "link": (7, 1, b"l"),
    "unlink": (1, b"n"),
    "rmdir": (1, b"d"),
    "rename": (1, b"a", 2, b"b", 1),
    "readlink": (7,),
    "readdir": (1,),
    "open": (7,),
    "release": (7,),
    "releases": ([7, 8, 7],),
    "made": ([["create_at", 1, b"n", 0o100644, 1, 2, 9, 5], ["unlink_at", 1, b"n", 9, 6],
              ["setattr_at", 9, codec.SET_UID, 0, 7, 0, 0, 0, 6]],),
    "getxattr": (7, b"user.a"),
    "setxattr": (7, b"user.a", b"\0v"),
    "listxattr": (7,),
    "removexattr": (7, b"user.a"),
    "drop_privileges": (7, 1),
    "statfs": (),
    "reclaim": (),
    "map_read": (7, 0, 1 << 20),
    "map_write": (7, 4096, 100),
    "readdirplus": (1,),
    "create": (1, b"n", 0o100644, 1, 2),
    "allocate_ahead": (7, 0, 1 << 20, 1 << 20),
    "settle": (7, 12345, 99, 1, 0, 12345),
    "reserve_inos": (1024,),
    "create_at": (1, b"n", 0o100644, 1, 2, 1000, 1_700_000_000_000_000_000),
    "unlink_at": (1, b"n", 1000, 1_700_000_000_000_000_000),
    "atime_at": (1000, 1_700_000_000_000_000_000),
    "setattr_at": (1000, codec.SET_MODE | codec.SET_MTIME, 0o600, 0, 0, 0, -5, 1_700_000_000_000_000_000),
    "getlk": (7, -(1 << 62), 1, 0, 0, 4242),
    "setlk": (7, 1 << 62, 0, 10, 20, 4242, 1),
    "flock": (7, 5, 1, 0),
    "unlock": (7, 5),
    "unwait": (7, 5),
}


def test_every_method_has_a_sample() -> None:
    assert set(SAMPLE_ARGS) == set(codec.METHODS)
    assert "aclose" not in codec.METHODS


@pytest.mark.parametrize("method", sorted(SAMPLE_ARGS))
def test_calls_round_trip(method: str) -> None:
    args = SAMPLE_ARGS[method]
    m, decoded = codec.decode_call(through_wire(codec.encode_call(method, *args)))
    assert m.name == method and decoded == list(args)
    assert not (m.mutates and m.retry), "a call that changes metadata is never resent"
    # The client's encoder for its hot path writes the very same bytes.
    assert codec.call_payload(method, *args) == wire.encode(codec.encode_call(method, *args))


def test_setattr_at_says_which_fields_it_sets_times_before_1970_too() -> None:
    for changes in (SetAttr(mode=0o600), SetAttr(uid=0, gid=0), SetAttr(atime_ns=-1, mtime_ns=0),
                    SetAttr(0o644, 1, 2, 3, 4)):
        args = codec.setattr_at_args(changes)
        assert codec.setattr_at_changes(*args) == changes
    assert codec.setattr_at_args(SetAttr(mtime_ns=-7))[0] == codec.SET_MTIME


def test_call_payload_falls_back_for_what_it_does_not_encode_itself() -> None:
    """Booleans, integers past 64 bits and wrong types take the general path: the same
    bytes, or the same error, as before."""
    for method, args in (("getattr", (True,)), ("lookup", (1, bytearray(b"n"))),
                         ("lookup", (1, "n")), ("create_at", (1, b"f", 1, 2, 3, 4, True))):
        assert codec.call_payload(method, *args) == wire.encode(codec.encode_call(method, *args))
    with pytest.raises(ValueError, match="64 bits"):
        codec.call_payload("getattr", 1 << 63)
    with pytest.raises(TypeError):
        codec.call_payload("getattr", 1, 2)


@pytest.mark.parametrize("inos", [[], [1] * (codec.MAX_RELEASES + 1), [1, True], [1, b"2"], 7])
def test_releases_takes_a_bounded_list_of_inode_numbers(inos: Any) -> None:
    with pytest.raises(WireError, match="releases"):
        codec.decode_call(through_wire(["releases", inos]))


@pytest.mark.parametrize("calls", [
    [], [["unlink_at", 1, b"n", 9, 6]] * (codec.MAX_MADE + 1), [["create", 1, b"n", 0o100644, 1, 2]],
    [["no_such_call", 1]], [["unlink_at", 1, b"n", 9]], [["unlink_at", 1, b"n", 9, True]], 7,
])
def test_made_takes_a_bounded_list_of_creates_and_unlinks(calls: Any) -> None:
    with pytest.raises(WireError, match="made"):
        codec.decode_call(through_wire(["made", calls]))


def test_made_payload_is_the_general_encoding() -> None:
    calls: list[list[Any]] = [["create_at", 1, b"n", 0o100644, 1, 2, 9, 5], ["unlink_at", 1, b"n", 9, 6]]
    payload = codec.made_payload([codec.call_payload(c[0], *c[1:]) for c in calls])
    assert payload == wire.encode(["made", calls])
    assert codec.decode_call(wire.decode(payload))[1] == [calls]


def test_symlink_target_arg() -> None:
    _, args = codec.decode_call(through_wire(codec.encode_call("mknod", 1, b"s", 0o120777, 0, 0, 0, b"t")))
    assert args[-1] == b"t"


def test_unknown_and_malformed_calls() -> None:
    for name in ("aclose", "destroy", "_get", "__class__", "inodes", ""):
        with pytest.raises(codec.UnknownMethod):
            codec.decode_call([name, 1])
    for value in (None, [], [1], [b"getattr", 1], "getattr", {"getattr": 1},
                  ["getattr"], ["getattr", 1, 2], ["getattr", True], ["getattr", b"1"],
                  ["lookup", 1, "name"], ["setattr", 1, [None] * 6], ["mknod", 1, b"n", 1, 2, 3, 4, 5]):
        with pytest.raises(WireError):
            codec.decode_call(value)


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.randrange(I64_MIN, I64_MAX)
    if kind == 3:
        return rng.random()
    if kind == 4:
        return rng.randbytes(rng.randrange(8))
    if kind == 5:
        return rng.choice(list(codec.METHODS) + ["x", "describe"])
    if kind == 6:
        return rng.randrange(-3, 10)
    if kind == 7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(8))]
    return {rng.randrange(5): _random_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def test_random_calls_raise_only_protocol_errors() -> None:
    rng = random.Random(99)
    for _ in range(5000):
        value = [rng.choice(list(codec.METHODS))] + [_random_value(rng) for _ in range(rng.randrange(8))]
        if rng.random() < 0.2:
            value = _random_value(rng)
        try:
            codec.decode_call(through_wire(value))
        except (WireError, codec.UnknownMethod):
            pass
