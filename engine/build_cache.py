"""Native code the engine compiles on first use, cached per user: engine/blas.py's GEMV shim and
engine/native_build.py's MLX extensions.

A build lands under a name that hashes everything that goes into it, in the user's cache directory
or, where that cannot be written, the temporary one. It is written to a partial file and renamed
into place whole, so concurrent builds may race. Standard library only: the shim is built before
MLX is imported (scripts re-exec themselves with it preloaded).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("spruce")


def homes() -> list[Path]:
    """Where builds are cached, in the order they are looked for and made."""
    return [Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spruce",
            Path(tempfile.gettempdir()) / f"spruce-{os.getuid()}"]


def cached(filename: str) -> Path | None:
    """A build of that name already in one of the homes."""
    return next((home / filename for home in homes() if (home / filename).is_file()), None)


def compiler(env: str, names: tuple[str, ...]) -> str | None:
    """The compiler `$env` names, else the first of `names` on the PATH."""
    return next(filter(None, (shutil.which(c) for c in (os.environ.get(env, ""), *names) if c)), None)


def build(filename: str, command: Callable[[Path], list[str]], timeout: float) -> Path | None:
    """Runs `command(output)` to build `filename` into the first home that takes it -> its path;
    None where it fails. A compiler that refuses the source or runs out of time is not tried again in
    the next home: that would not change the outcome, only double the wait."""
    for home in homes():
        partial = home / f"{filename}.{os.getpid()}.part"
        try:
            home.mkdir(parents=True, exist_ok=True)
            subprocess.run(command(partial), check=True, capture_output=True, timeout=timeout)
            os.replace(partial, home / filename)
            return home / filename
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.debug("%s did not build in %s: %s %s", filename, home, e, detail[-2000:].decode(errors="replace"))
            with contextlib.suppress(OSError):  # nothing to remove, or no directory to remove it from
                partial.unlink(missing_ok=True)
            if isinstance(e, subprocess.SubprocessError):
                break
    return None
