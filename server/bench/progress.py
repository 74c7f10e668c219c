"""A one-line progress bar on stderr (redrawn in place on a terminal, one line per step otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 24):
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.t0 = time.monotonic()
        self.tty = self.stream.isatty()

    def step(self, what: str) -> None:
        """Count one finished request, `what` naming it."""
        self.done += 1
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self.t0
        line = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.0f}s {what}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line[:160])
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
