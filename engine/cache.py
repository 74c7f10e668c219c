"""Per-layer generation state, and the commit of an accepted path.

A forward pass either *extends* the cache along a chain (prefill: state written at once), or
*verifies* a draft tree: the tree's rows are computed from the committed state without writing
it, and the layer keeps what `commit(path)` needs to fold only the accepted path in. There is
nothing to roll back: rejected branches never touch committed state.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine import gdn_tree

KV_STEP = 256  # grow the KV buffer in steps, like mlx-lm, to avoid a copy per token


class KVCache:
    """Attention K/V for positions [0, offset); slots past offset are scratch for a tree."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None  # [1, n_kv, cap, D]
        self.values: mx.array | None = None
        self.offset = 0

    def write(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write T rows at [offset, offset+T) and return K/V for [0, offset+T). Does not advance."""
        T = k.shape[2]
        end = self.offset + T
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(end, k)
        self.keys[:, :, self.offset : end] = k
        self.values[:, :, self.offset : end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, end: int, like: mx.array) -> None:
        cap = (end + KV_STEP - 1) // KV_STEP * KV_STEP
        B, H, _, D = like.shape
        shape = (B, H, cap, D)
        k_new = mx.zeros(shape, like.dtype)
        v_new = mx.zeros(shape, like.dtype)
        if self.keys is not None and self.offset > 0:
            k_new[:, :, : self.offset] = self.keys[:, :, : self.offset]
            v_new[:, :, : self.offset] = self.values[:, :, : self.offset]
        self.keys, self.values = k_new, v_new

    def advance(self, n: int) -> None:
        self.offset += n

    def commit(self, path: list[int]) -> None:
        """Keep tree rows `path` (node indices, root first): compact them to contiguous slots."""
        if path != list(range(len(path))):
            rows = mx.array([self.offset + i for i in path])
            end = self.offset + len(path)
            self.keys[:, :, self.offset : end] = self.keys[:, :, rows]
            self.values[:, :, self.offset : end] = self.values[:, :, rows]
        self.advance(len(path))

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


@dataclass
class GDNPending:
    """What a GDN layer's verify leaves for the commit (batch 1 squeezed, fp32).

    A tree of N > 1 nodes keeps per-node rows to fold the accepted path; a one-node tree
    keeps its (conv state, state) after the root directly.
    """

    x: mx.array | None = None  # [N, C] pre-conv rows (the conv state is rebuilt along the path)
    k: mx.array | None = None  # [N, Hv, Dk]
    u: mx.array | None = None  # [N, Hv, Dv] innovations delta_i
    g: mx.array | None = None  # [N, Hv] log-decays
    single: tuple[mx.array, mx.array] | None = None


class GDNCache:
    """Gated DeltaNet layer state: conv state [1, K-1, C] and recurrent state [1, Hv, Dv, Dk] fp32."""

    def __init__(self) -> None:
        self.conv_state: mx.array | None = None
        self.state: mx.array | None = None
        self.pending: GDNPending | None = None

    def commit(self, path: list[int]) -> None:
        p = self.pending
        if p is None:
            raise RuntimeError("commit without a pending verify")
        if p.single is not None:
            conv, S = p.single
        else:
            S = gdn_tree.gdn_commit_fold(p.k, p.u, p.g, path, self.state[0])
            conv = gdn_tree.conv_state_after(p.x, path, self.conv_state[0]).astype(self.conv_state.dtype)
        self.conv_state, self.state = conv[None], S[None]
        self.pending = None

    @property
    def nbytes(self) -> int:
        n = 0 if self.state is None else self.state.nbytes
        return n + (0 if self.conv_state is None else self.conv_state.nbytes)


LayerCache = KVCache | GDNCache


def commit_all(cache: list[LayerCache], path: list[int]) -> None:
    for c in cache:
        c.commit(path)


def cache_nbytes(cache: list[LayerCache]) -> int:
    return sum(c.nbytes for c in cache)
