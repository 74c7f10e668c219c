"""The target's hidden states of the committed positions, for drafters that read them (DFlash
reads the residual stream after a few chosen layers, MTP the final-normed hidden state).

`FeatureCache` sits at the end of the target's cache list and follows the cache protocol
(engine/cache.py), so the passes treat it like a layer: a chain (prefill) appends its rows, a
verify defers the rows of every tree node, `commit(path)` keeps the accepted path's rows, and the
prefix cache snapshots and restores it with the layers. A drafter reads the rows it has not seen
yet with `read(start)`; what it reads therefore always belongs to committed tokens only.

Row p holds the features of the token at absolute position p, computed when that token was fed
to the target (so the root of a round, not yet fed, has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from engine.cache import AcceptedPath, LayerSnapshot, grown_capacity


@dataclass(frozen=True)
class FeatureTaps:
    """Which hidden states a drafter reads: the residual stream after each layer in `layers`
    (HF's hidden_states[l + 1]), then, with `final`, the final-normed hidden state."""

    layers: tuple[int, ...] = ()  # kept sorted: rows hold the taps in layer order
    final: bool = False

    def __post_init__(self) -> None:
        if len(set(self.layers)) != len(self.layers) or any(i < 0 for i in self.layers):
            raise ValueError(f"feature taps need distinct layer indices >= 0, got {self.layers}")
        object.__setattr__(self, "layers", tuple(sorted(int(i) for i in self.layers)))

    @property
    def count(self) -> int:
        return len(self.layers) + int(self.final)

    def covers(self, other: FeatureTaps) -> bool:
        return set(other.layers) <= set(self.layers) and (self.final or not other.final)

    def union(self, other: FeatureTaps) -> FeatureTaps:
        return FeatureTaps(tuple(sorted(set(self.layers) | set(other.layers))), self.final or other.final)

    def slots(self, layers: Sequence[int], final: bool) -> list[int]:
        """Where the given taps sit in a row of these taps, in units of the hidden size, in the
        order asked for (a DFlash checkpoint concatenates its layers in its own order)."""
        missing = set(layers) - set(self.layers)
        if missing or (final and not self.final):
            raise ValueError(f"feature taps {self} do not include layers {sorted(missing)} / final={final}")
        return [self.layers.index(i) for i in layers] + ([len(self.layers)] if final else [])


@dataclass(frozen=True)
class FeatureSnapshot:
    rows: mx.array  # [length, F], a copy
    taps: FeatureTaps

    @property
    def length(self) -> int:
        return self.rows.shape[0]

    def arrays(self) -> tuple[mx.array]:
        return (self.rows,)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes


class FeatureCache:
    """Rows [0, length) of concatenated hidden states, [F = taps.count * hidden]."""

    def __init__(self, taps: FeatureTaps) -> None:
        self.taps = taps
        self.rows: mx.array | None = None  # [cap, F], written in place like attention K/V
        self.length = 0
        self.pending: mx.array | None = None  # [N, F] of the last verify, until its commit

    def record(self, rows: mx.array, deferred: bool) -> None:
        """rows [T, F] of one forward pass: a chain is appended, a verify waits for its commit."""
        if deferred:
            self.pending = rows
        else:
            self._append(rows)

    def _append(self, rows: mx.array) -> None:
        end = self.length + rows.shape[0]
        if self.rows is None or end > self.rows.shape[0]:
            cap = grown_capacity(end, 0 if self.rows is None else self.rows.shape[0], headroom=True)
            grown = mx.zeros((cap, rows.shape[1]), rows.dtype)
            if self.rows is not None and self.length:
                grown[: self.length] = self.rows[: self.length]
            self.rows = grown
        self.rows[self.length : end] = rows
        self.length = end

    def read(self, start: int, stop: int | None = None) -> mx.array:
        """Rows [start, stop) of committed positions (stop defaults to the committed length)."""
        stop = self.length if stop is None else stop
        if not 0 <= start <= stop <= self.length or self.rows is None:
            raise ValueError(f"feature rows [{start}, {stop}) requested, {self.length} committed")
        return self.rows[start:stop]

    def commit(self, path: AcceptedPath) -> None:
        if self.pending is None:
            raise RuntimeError("commit without a pending verify")
        rows = self.pending[: len(path)] if path.is_prefix else self.pending[path.index]
        self.pending = None
        self._append(rows)

    def arrays(self) -> list[mx.array]:
        return [] if self.rows is None else [self.rows]

    def snapshot(self, length: int) -> FeatureSnapshot:
        if self.length != length:
            raise ValueError(f"feature cache holds {self.length} rows, the snapshot is for {length}")
        if self.rows is None:
            return FeatureSnapshot(mx.zeros((0, 0)), self.taps)
        return FeatureSnapshot(mx.contiguous(self.rows[:length]), self.taps)

    def restore(self, snap: LayerSnapshot | FeatureSnapshot, length: int) -> None:
        if not isinstance(snap, FeatureSnapshot) or snap.taps != self.taps or length > snap.length or self.length:
            raise ValueError(f"cannot restore {snap!r} into this feature cache at {length} rows")
        if length:
            self._append(snap.rows[:length])

    def mark(self) -> int:
        return self.length

    def rewind(self, mark: object) -> None:
        assert isinstance(mark, int) and mark <= self.length
        self.length = mark
        self.pending = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())
