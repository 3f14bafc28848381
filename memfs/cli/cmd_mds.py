"""``memfs mds``: serve metadata to memfs mounts over TCP, in the foreground."""

from __future__ import annotations

import argparse
import sys

from memfs.cli.common import setup_logging
from memfs.cli.parser import flush_from_args
from memfs.config import parse_hostport, parse_size
from memfs.errors import UsageError


def run(args: argparse.Namespace) -> int:
    from memfs import mds, wire  # trio is only needed here
    from memfs.config import parse_pool_spec

    host, port = parse_hostport(args.listen, "--listen")
    opts = mds.MdsOptions(
        host=host, port=port, pool=parse_pool_spec(args.pool),
        secret=wire.load_secret(args.secret_file) if args.secret_file else b"",
        chunk_size=parse_size(args.chunk_size, "--chunk-size"),
        stripe_size=parse_size(args.stripe_size, "--stripe-size"),
        volume_size=parse_size(args.volume_size, "--volume-size") if args.volume_size else None,
        journal_dir=args.journal,
        grace=args.grace,
    )
    if not 0 <= opts.grace < float("inf"):
        raise UsageError(f"bad --grace {args.grace}: expected seconds, 0 or more")
    if not 0 <= args.lease_term <= 3600:
        raise UsageError(f"bad --lease-term {args.lease_term}: expected seconds, 0 to 3600")
    if not 0 < args.recall_timeout <= 600:
        raise UsageError(f"bad --recall-timeout {args.recall_timeout}: expected seconds, above 0")
    opts.lease_term, opts.recall_timeout = args.lease_term, args.recall_timeout
    opts.async_creates = not args.sync_creates
    opts.metrics = parse_hostport(args.metrics, "--metrics") if args.metrics else None
    opts.flush = flush_from_args(
        args, opts.volume_size * len(opts.pool) if opts.volume_size is not None else None
    )
    if args.backing_write_leases is not None and opts.flush is None:
        flag = "--backing-write-leases" if args.backing_write_leases else "--no-backing-write-leases"
        raise UsageError(f"{flag} goes with --backing")
    opts.backing_write_leases = args.backing_write_leases is not False
    setup_logging(args.debug)
    try:
        return mds.run(opts)
    except mds.StartupError as exc:
        print(f"memfs: error: {exc}", file=sys.stderr)
        return 1
