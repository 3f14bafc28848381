"""``memfs status MNT [--json]``: capacity, dirty data, write-back and stage-in progress."""

from __future__ import annotations

import argparse
import json
import time

from memfs.backing.status import BackingStatus
from memfs.cli.client import connect, request
from memfs.cli.common import format_bytes
from memfs.cli.mounts import memfs_mountpoint


def run(args: argparse.Namespace) -> int:
    mnt = memfs_mountpoint(args.mountpoint, draining=True)
    with connect(mnt) as client:
        reply = request(client, "status")
    if args.json:
        # The daemon's own words: fields a newer daemon adds are not lost.
        print(json.dumps(reply, indent=2, sort_keys=True))
    else:
        print(format_status(mnt, BackingStatus.from_json(reply)))
    return 0


def format_status(mnt: str, st: BackingStatus) -> str:
    """The status for people."""
    pct = f" ({100 * st.used / st.capacity:.0f}%)" if st.capacity else ""
    lines = [
        f"mount:      {mnt}" + ("  (draining: writing everything back before exit)"
                                if st.draining else ""),
        f"backing:    {st.backing}",
        f"pool:       {format_bytes(st.used)} used of {format_bytes(st.capacity)}{pct}",
        f"dirty:      {format_bytes(st.dirty_bytes)} in {st.dirty_files} files "
        f"(cap {format_bytes(st.dirty_max)}); {format_bytes(st.pinned_bytes)} pinned "
        "(excluded from write-back)",
        f"write-back: {st.queued_files} files queued, {st.flushing_files} in flight, "
        f"{st.namespace_ops} namespace changes pending; {format_bytes(st.flush_rate)}/s",
        f"            {format_bytes(st.flushed_bytes)} in {st.flushed_files} files since "
        f"mount (delay {st.flush_delay} s, {st.workers} workers)",
        f"files:      {st.resident_files} in memory, {st.evicted_files} only in the backing "
        f"directory ({format_bytes(st.evicted_bytes_total)} evicted, "
        f"{format_bytes(st.fetched_bytes)} fetched since mount)",
        "stage-in:   " + (f"{st.staging_files} files, {format_bytes(st.staging_bytes)} to go"
                           if st.staging_files or st.staging_bytes else "idle"),
        f"writers waiting on the dirty cap: {st.writers_waiting}",
    ]
    if st.errors:
        lines.append(f"errors ({len(st.errors)}, newest last):")
        for e in st.errors:
            # 0: not said (a daemon of another version)
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last)) if e.last else "?"
            times = f" (x{e.count})" if e.count > 1 else ""
            lines.append(f"  {when}  {e.path or '/'}: {e.error}{times}")
    else:
        lines.append("errors:     none")
    return "\n".join(lines)
