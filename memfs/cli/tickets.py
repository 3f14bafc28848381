"""``flush`` and ``stage_in`` requests: send them in batches, poll their progress.

The daemon answers each request with a ticket; "progress" on a ticket says how
far it has got (:class:`~memfs.backing.status.TicketProgress`).
"""

from __future__ import annotations

import errno
import json
import time
from typing import TYPE_CHECKING, Any

from memfs.backing.status import TicketProgress
from memfs.cli.client import request
from memfs.cli.progress import ProgressLine, error_note, progress_text
from memfs.errors import ControlError, UsageError

if TYPE_CHECKING:
    from memfs.control import ControlClient

#: how often ``--wait`` asks for progress
POLL_INTERVAL = 0.2
#: bytes of paths per flush/stage-in request (the daemon refuses lines above 1 MiB)
REQUEST_BUDGET = 512 << 10


def path_batches(paths: list[str]) -> list[list[str]]:
    """*paths* cut into requests that fit the daemon's line limit (one empty batch: all)."""
    batches: list[list[str]] = []
    current: list[str] = []
    size = 0
    for p in paths:
        n = len(json.dumps(p)) + 2
        if current and size + n > REQUEST_BUDGET:
            batches.append(current)
            current, size = [], 0
        current.append(p)
        size += n
    return [*batches, current]


def _ticket(reply: dict[str, Any]) -> int:
    ticket = reply.get("ticket")
    if not isinstance(ticket, int):
        raise ControlError(errno.EPROTO, f"the daemon sent no ticket: {reply!r:.200}")
    return ticket


def start_tickets(client: ControlClient, op: str, paths: list[str]) -> list[int]:
    """Send *op* for *paths* (each once, in as many requests as needed): the tickets."""
    tickets = []
    for batch in path_batches(list(dict.fromkeys(paths))):
        try:
            tickets.append(_ticket(request(client, op, {"paths": batch})))
        except ControlError as exc:
            if exc.errno == errno.ENOENT:  # a name (from a manifest) not in the mount
                raise UsageError(f"in {client.name}: {exc.message}") from None
            raise
    return tickets


def ticket_progress(client: ControlClient, ticket: int) -> TicketProgress:
    return TicketProgress.from_json(request(client, "progress", {"ticket": ticket}))


def wait_tickets(client: ControlClient, tickets: list[int], verb: str, what: str,
                 show: bool) -> list[TicketProgress]:
    """Poll "progress" until every ticket is done; a progress line (and the
    latest error, once) on the terminal when *show*.  The tickets' last progress."""
    start = time.monotonic()
    finished: dict[int, TicketProgress] = {}
    shown: tuple[str, str, float] | None = None
    with ProgressLine(show) as line:
        while True:
            now: list[TicketProgress] = []
            for t in tickets:
                p = finished.get(t) or ticket_progress(client, t)
                if p.done:
                    finished[t] = p
                now.append(p)
            errors = [e for p in now for e in p.errors]
            if errors:
                latest = max(errors, key=lambda e: e.last)
                key = (latest.path, latest.error, latest.last)
                if key != shown:
                    line.note(error_note(what, latest))
                    shown = key
            if len(finished) == len(tickets):
                return [finished[t] for t in tickets]
            total = TicketProgress(
                files=sum(p.files for p in now), bytes=sum(p.bytes for p in now),
                total_files=sum(p.total_files for p in now),
                total_bytes=sum(p.total_bytes for p in now),
            )
            line.update(progress_text(verb, total, time.monotonic() - start))
            time.sleep(POLL_INTERVAL)
