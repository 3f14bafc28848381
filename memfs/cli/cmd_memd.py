"""``memfs memd``: serve memory volumes to memfs clients over TCP, in the foreground."""

from __future__ import annotations

import argparse

from memfs.cli.common import setup_logging
from memfs.config import format_size, parse_hostport, parse_size
from memfs.errors import UsageError


def memd_volume_size(size: str | None, volume_size: str | None, volumes: int) -> int:
    """Bytes per volume from ``--size`` (the whole, as for ``memfs mount``) and/or
    ``--volume-size`` (each, as for ``memfs mds``); both given, they must agree."""
    if size is None and volume_size is None:
        raise UsageError("memd needs --size (all volumes together) or --volume-size (each)")
    each = parse_size(volume_size, "--volume-size") if volume_size is not None else None
    if size is None:
        assert each is not None
        return each
    total = parse_size(size, "--size")
    if each is None:
        if total % volumes:
            raise UsageError(f"--size {size} does not split evenly over {volumes} volumes")
        return total // volumes
    if total != each * volumes:
        raise UsageError(
            f"--size {size} disagrees with --volumes {volumes} x --volume-size {volume_size} "
            f"= {format_size(each * volumes)}: give one of them, or both agreeing"
        )
    return each


def run(args: argparse.Namespace) -> int:
    from memfs import wire
    from memfs.transport import memd  # trio is only needed here

    host, port = parse_hostport(args.listen, "--listen")
    try:
        volumes = int(args.volumes)
    except ValueError:
        raise UsageError(f"bad --volumes {args.volumes!r}: expected a whole number") from None
    if not 1 <= volumes <= 1024:
        raise UsageError(f"--volumes must be between 1 and 1024, not {volumes}")
    size = memd_volume_size(args.size, args.volume_size, volumes)
    secret = wire.load_secret(args.secret_file) if args.secret_file else b""
    setup_logging(args.debug)
    metrics = parse_hostport(args.metrics, "--metrics") if args.metrics else None
    return memd.run(volumes, size, host, port, secret, rdma_device=args.rdma_device,
                    metrics=metrics)
