"""glibc heap settings of a long-running server process (no-ops off glibc)."""

from __future__ import annotations

import ctypes
import sys

M_ARENA_MAX = -8  # glibc mallopt parameter


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...)
        return None


def limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives threads that allocate their own malloc arenas (up to 8 per core) and seldom hands
    their memory back, so a long-running server's RSS creeps up with its threads (event loop,
    planning, engine, BLAS). Two arenas keep it flat under load (scripts/load_test.py). Call before
    threads start."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_ARENA_MAX, arenas)


def release_memory() -> None:
    """Hand free heap pages back to the OS (after a large request: its parse and tokenization leave
    hundreds of MB free inside the heap, which glibc keeps otherwise). ctypes lets the GIL go."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
