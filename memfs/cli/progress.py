"""The progress display: one line on stderr redrawn in place, and what it says."""

from __future__ import annotations

import shutil
import sys

from memfs.backing.status import BackingError, TicketProgress
from memfs.cli.common import format_bytes

#: seconds between redraws of a progress line that changes often
REDRAW_INTERVAL = 0.2


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class ProgressLine:
    """One line on stderr redrawn in place (a terminal only; otherwise nothing)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.shown = False

    def update(self, text: str) -> None:
        if self.enabled:
            width = max(shutil.get_terminal_size().columns - 1, 20)
            sys.stderr.write(f"\r{text[:width]}\x1b[K")
            sys.stderr.flush()
            self.shown = True

    def note(self, text: str) -> None:
        """A line that stays (above the progress line)."""
        if self.enabled:
            sys.stderr.write(f"\r\x1b[K{text}\n")
            sys.stderr.flush()
            self.shown = False

    def say(self, text: str) -> None:
        """A message for stderr, terminal or not."""
        if self.enabled:
            self.note(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_text(verb: str, p: TicketProgress, elapsed: float) -> str:
    """``flushing: 12/340 files, 1.2 GiB/4.0 GiB left, 350.0 MiB/s``."""
    text = (f"{verb}: {max(p.total_files - p.files, 0)}/{p.total_files} files, "
            f"{format_bytes(p.bytes)}/{format_bytes(p.total_bytes)} left")
    if elapsed >= 1 and p.total_bytes > p.bytes:
        text += f", {format_bytes((p.total_bytes - p.bytes) / elapsed)}/s"
    return text


def error_note(what: str, err: BackingError) -> str:
    """``memfs: write-back of PATH: ERROR (retrying)``."""
    return f"memfs: {what} {err.path or '/'}: {err.error} (retrying)"
