"""Size parsing and pool geometry: the first thing a user types must fail clearly.

Every bad value has to surface as :class:`UsageError` (one line from the CLI),
never as a traceback from deep inside pool allocation.
"""

from __future__ import annotations

import pytest

from memfs.config import PoolConfig, format_size, parse_size
from memfs.errors import UsageError

K, M, G, T = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("4096", 4096),
        ("64K", 64 * K),
        ("64k", 64 * K),
        ("64KiB", 64 * K),
        ("64kib", 64 * K),
        ("64KB", 64 * K),
        ("512M", 512 * M),
        ("4G", 4 * G),
        ("4 GiB", 4 * G),
        ("  2T  ", 2 * T),
        ("3B", 3),
    ],
)
def test_parse_size_accepts(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", " ", "0", "0K", "-1", "-4G", "1.5G", "4X", "G", "K4", "4 G B", "4Ki", "0x10", "4GG"]
)
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(UsageError):
        parse_size(text)


def test_parse_size_names_the_option() -> None:
    """The message names what was being parsed, so the user knows which flag is wrong."""
    with pytest.raises(UsageError, match="stripe_size"):
        parse_size("lots", "stripe_size")


def test_usage_error_is_a_value_error() -> None:
    """Callers that only know about ValueError (argparse type= hooks) still catch it."""
    with pytest.raises(ValueError):
        parse_size("nope")


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (1, "1"),
        (1000, "1000"),
        (1536, "1536"),
        (K, "1K"),
        (64 * K, "64K"),
        (M, "1M"),
        (M + K, "1025K"),
        (3 * G, "3G"),
        (T, "1T"),
        (1024 * T, "1024T"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text
    assert parse_size(text) == n


def test_pool_defaults_and_volume_size() -> None:
    p = PoolConfig()
    assert (p.size, p.volumes, p.stripe_size, p.chunk_size) == (4 * G, 4, M, 64 * K)
    assert p.volume_size == G


def test_volume_size_rounds_down_to_whole_chunks() -> None:
    """A pool that does not divide evenly loses the remainder instead of a partial chunk."""
    p = PoolConfig(size=64 * M + 5, volumes=3, stripe_size=64 * K, chunk_size=64 * K)
    assert p.volume_size % p.chunk_size == 0
    assert p.volume_size * p.volumes <= p.size
    assert p.size - p.volume_size * p.volumes < p.volumes * p.chunk_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"volumes": 0}, "--volumes"),
        ({"volumes": -1}, "--volumes"),
        ({"volumes": 1025}, "--volumes"),
        ({"chunk_size": 2048}, "--chunk-size"),
        ({"chunk_size": 3 * 4096}, "--chunk-size"),
        ({"chunk_size": 0}, "--chunk-size"),
        ({"stripe_size": 32 * K}, "--stripe-size"),
        ({"stripe_size": 96 * K}, "--stripe-size"),
        ({"size": 64 * K, "volumes": 2}, "--size"),
    ],
)
def test_pool_config_rejects(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        PoolConfig(**kwargs)


def test_pool_config_edge_values_accepted() -> None:
    """The limits themselves are valid: 1 and 1024 volumes, one chunk per volume, 4K chunks."""
    assert PoolConfig(size=64 * K, volumes=1, stripe_size=64 * K).volume_size == 64 * K
    assert PoolConfig(size=1024 * 4 * K, volumes=1024, stripe_size=4 * K, chunk_size=4 * K).volume_size == 4 * K
    assert PoolConfig(stripe_size=192 * K).stripe_size == 192 * K
