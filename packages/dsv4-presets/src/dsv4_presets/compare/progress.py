"""Progress display for long comparison campaigns.

Every event is one line on the stream (so logs of a TP8 node read well); on a
terminal a live status line (run, phase, elapsed, campaign ETA) is redrawn
in place while waiting for a server or a benchmark.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``'1m15s'``; ``3725`` -> ``'1h02m'``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Progress:
    """Campaign progress: which run of how many, its phase, elapsed time and ETA."""

    def __init__(self, total: int, *, stream: TextIO | None = None, live: bool | None = None):
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.start = time.monotonic()
        self.run_durations: list[float] = []
        self.done = 0
        self._current = ""
        self._run_start = 0.0
        self._line_open = False

    def _clear(self) -> None:
        if self._line_open:
            self.stream.write("\r\033[K")
            self._line_open = False

    def event(self, message: str) -> None:
        """Print one event line."""
        self._clear()
        stamp = time.strftime("%H:%M:%S")
        self.stream.write(f"[{stamp}] {message}\n")
        self.stream.flush()

    def eta(self) -> float | None:
        """Seconds left, from the mean duration of the runs executed so far."""
        if not self.run_durations:
            return None
        per_run = sum(self.run_durations) / len(self.run_durations)
        remaining = self.total - self.done
        running = time.monotonic() - self._run_start if self._current else 0.0
        return max(0.0, remaining * per_run - running)

    def run_started(self, position: int, label: str, description: str) -> None:
        """A run begins (``position`` counts from 1)."""
        self._current = label
        self._run_start = time.monotonic()
        eta = self.eta()
        eta_text = f", campaign ETA {format_duration(eta)}" if eta is not None else ""
        self.event(f"run {position}/{self.total} {label}: {description}{eta_text}")

    def phase(self, text: str) -> None:
        """Redraw the live status line (terminals only)."""
        if not self.live:
            return
        elapsed = time.monotonic() - self._run_start
        total = time.monotonic() - self.start
        line = (
            f"  {self._current}: {text} ({format_duration(elapsed)} in run, "
            f"{format_duration(total)} in campaign)"
        )
        self.stream.write("\r\033[K" + line)
        self.stream.flush()
        self._line_open = True

    def run_skipped(self, label: str, why: str) -> None:
        """A run already completed on an earlier invocation (resume)."""
        self.done += 1
        self.event(f"{label}: {why}")

    def run_finished(self, label: str, summary: str) -> None:
        """A run this invocation executed ends (ok or failed); resumed runs use run_skipped."""
        if self._current:
            self.run_durations.append(time.monotonic() - self._run_start)
        self.done += 1
        self._current = ""
        self.event(
            f"{label}: {summary} [{self.done}/{self.total} done, "
            f"{format_duration(time.monotonic() - self.start)} elapsed]"
        )
