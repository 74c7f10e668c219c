"""What the engine holds in memory, in bytes: weights (as loaded: compute dtype, quantized ones
packed), the caches of the last request (attention K/V rows and GDN conv + recurrent states) and
the prefix cache's snapshots. `spruce run` prints it, `/props` returns it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from engine.cache import LayerCache


@dataclass(frozen=True)
class MemoryReport:
    dtype: str  # the compute dtype of the float weights
    weights_bytes: int
    draft_weights_bytes: int  # draft models loaded so far (0 = none)
    cache_bytes: int  # the last request's KV + GDN states (0 before the first request)
    prefix_cache_bytes: int
    weight_copies_bytes: int = 0  # bfloat16 copies of float32 weights for the CPU's products (engine/half_weights.py)

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


def cache_nbytes(cache: Sequence[LayerCache]) -> int:
    return sum(layer.nbytes for layer in cache)


def physical_memory() -> int:
    """The machine's memory in bytes (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
