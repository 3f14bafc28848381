"""Stripe math and the ``user.memfs.layout`` text format.

Placement is recomputed from the layout on every I/O (no per-chunk volume is
stored), so a wrong answer here silently reads another file's bytes.
"""

from __future__ import annotations

import pytest

from memfs.errors import UsageError
from memfs.layout import Layout, LayoutSpec

K, M = 1 << 10, 1 << 20
CS = 64 * K


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("stripe_count=2 stripe_size=1M", LayoutSpec(2, M, None)),
        ("stripe_count=2,stripe_size=1M,stripe_offset=0", LayoutSpec(2, M, 0)),
        ("c=3 s=256K i=1", LayoutSpec(3, 256 * K, 1)),
        ("count=-1", LayoutSpec(-1, None, None)),
        ("size=128K", LayoutSpec(None, 128 * K, None)),
        ("offset=-1", LayoutSpec(None, None, -1)),
        ("STRIPE_COUNT=4", LayoutSpec(4, None, None)),
        ("  stripe_size=64KiB  ", LayoutSpec(None, 64 * K, None)),
        ("c=2,volumes=1,2,s=1M", LayoutSpec(2, M, None)),
        ("volumes=3 stripe_offset=3", LayoutSpec(None, None, 3)),
    ],
)
def test_spec_parse(text: str, spec: LayoutSpec) -> None:
    assert LayoutSpec.parse(text) == spec


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "stripe_count",
        "stripe_count=",
        "stripe_count=two",
        "stripe_count=0",
        "stripe_count=-2",
        "stripe_offset=-2",
        "stripe_size=0",
        "stripe_size=1X",
        "colour=blue",
        "stripe_count=2 bogus",
    ],
)
def test_spec_parse_rejects(text: str) -> None:
    with pytest.raises(UsageError):
        LayoutSpec.parse(text)


@pytest.mark.parametrize(
    "spec",
    [
        LayoutSpec(2, M, None),
        LayoutSpec(-1, 192 * K, 3),
        LayoutSpec(None, None, 0),
        LayoutSpec(1, None, -1),
    ],
)
def test_spec_format_round_trip(spec: LayoutSpec) -> None:
    assert LayoutSpec.parse(spec.format()) == spec


def test_spec_merged_falls_back_field_by_field() -> None:
    base = LayoutSpec(-1, M, -1)
    assert LayoutSpec(2, None, None).merged(base) == LayoutSpec(2, M, -1)
    assert LayoutSpec(None, 128 * K, 1).merged(base) == LayoutSpec(-1, 128 * K, 1)
    assert LayoutSpec().merged(base) == base


def test_layout_format_parses_back_to_the_same_layout() -> None:
    """``getfattr`` output of one file must be accepted by ``setfattr`` on another
    (the ``lfs getstripe | lfs setstripe`` workflow), including the ``volumes=`` list."""
    layout = Layout.resolve(LayoutSpec(3, 256 * K, 2), 4, CS, seed=0)
    text = layout.format()
    assert text == "stripe_count=3 stripe_size=256K stripe_offset=2 volumes=2,3,0"
    spec = LayoutSpec.parse(text)
    assert spec == LayoutSpec(3, 256 * K, 2)
    assert Layout.resolve(spec, 4, CS, seed=99) == layout


def test_resolve_all_volumes() -> None:
    """``stripe_count=-1`` and an unset count both mean every volume of the pool."""
    for count in (-1, None):
        layout = Layout.resolve(LayoutSpec(count, M, 0), 5, CS, seed=0)
        assert layout.volumes == (0, 1, 2, 3, 4)
        assert layout.stripe_size == M


def test_resolve_offset_wraps_round_robin() -> None:
    assert Layout.resolve(LayoutSpec(3, M, 2), 4, CS, seed=0).volumes == (2, 3, 0)
    assert Layout.resolve(LayoutSpec(4, M, 3), 4, CS, seed=0).volumes == (3, 0, 1, 2)
    assert Layout.resolve(LayoutSpec(1, M, 1), 4, CS, seed=7).volumes == (1,)


def test_resolve_default_stripe_size_is_the_chunk() -> None:
    assert Layout.resolve(LayoutSpec(2, None, 0), 4, CS, seed=0).stripe_size == CS


def test_resolve_seed_spreads_first_volume() -> None:
    """Without an offset, consecutive files start on different volumes (no hot volume 0)."""
    for offset in (None, -1):
        firsts = [Layout.resolve(LayoutSpec(1, M, offset), 4, CS, seed).volumes[0] for seed in range(8)]
        assert firsts == [0, 1, 2, 3, 0, 1, 2, 3]
    assert Layout.resolve(LayoutSpec(2, M, None), 4, CS, seed=10**12 + 3).volumes == (3, 0)


def test_resolve_shares_equal_layouts_and_never_an_error() -> None:
    """Every new file asks: equal answers are one object (layouts are immutable), and
    a spec refused once is refused again."""
    a = Layout.resolve(LayoutSpec(2, M, None), 4, CS, seed=1)
    assert Layout.resolve(LayoutSpec(2, M, None), 4, CS, seed=5) is a
    assert Layout.resolve(LayoutSpec(2, M, None), 4, CS, seed=2).volumes == (2, 3)
    assert Layout.resolve(LayoutSpec(2, M, None), 5, CS, seed=5).volumes == (0, 1)
    for _ in range(2):
        with pytest.raises(UsageError, match="exceeds"):
            Layout.resolve(LayoutSpec(5, M, 0), 4, CS, seed=0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (LayoutSpec(5, M, 0), "exceeds"),
        (LayoutSpec(2, M, 4), "stripe_offset"),
        (LayoutSpec(2, 96 * K, 0), "multiple"),
        (LayoutSpec(2, 32 * K, 0), "multiple"),
        (LayoutSpec(2, -CS, 0), "multiple"),
        (LayoutSpec(0, M, 0), "stripe_count"),
        (LayoutSpec(-2, M, 0), "stripe_count"),
        (LayoutSpec(2, M, -2), "stripe_offset"),
    ],
)
def test_resolve_rejects(spec: LayoutSpec, message: str) -> None:
    """Specs can be built directly (a remote client, a future API), not only parsed,
    so resolve itself must refuse values that would give an empty or bogus layout."""
    with pytest.raises(UsageError, match=message):
        Layout.resolve(spec, 4, CS, seed=0)


def test_volume_of_chunk_follows_stripe_units() -> None:
    layout = Layout.resolve(LayoutSpec(3, 4 * CS, 2), 4, CS, seed=0)  # volumes 2, 3, 0
    got = [layout.volume_of_chunk(k, CS) for k in range(14)]
    assert got == [2] * 4 + [3] * 4 + [0] * 4 + [2] * 2


def test_volume_of_chunk_stripe_equals_chunk() -> None:
    layout = Layout(CS, (1, 3))
    assert [layout.volume_of_chunk(k, CS) for k in range(5)] == [1, 3, 1, 3, 1]
