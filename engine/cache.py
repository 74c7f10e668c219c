"""Per-layer generation state behind one protocol, and the commit of an accepted path.

A forward pass either *extends* a cache along a chain (prefill, drafter catch-up: state written at
once) or *verifies* a draft tree: the tree's rows are computed from the committed state without
writing it, and the layer defers what `commit(path)` needs to keep only the accepted path.
Rejected branches never touch committed state, so nothing is rolled back.

Every cache offers the same operations, so the prefix cache, the drafters and the loop never look
inside one:
- `arrays()`             the live arrays (to evaluate after a pass);
- `snapshot(n)` / `restore(snap, n)`  an immutable copy of the state after the first n tokens;
- `mark()` / `rewind(mark)`  a cheap rollback point for a drafter that only appends after it;
- `commit(path)`         keep the accepted rows of the last verify;
- `nbytes`.

In place or not: attention K/V live in a preallocated buffer written in place (rows past the
committed length are scratch), so a snapshot copies its rows. GDN states are replaced by fresh
arrays on every write (the cores never write state in place, see engine/gdn/core.py), so marks
and snapshots hold references.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import mlx.core as mx

from engine import kv_int8
from engine.gdn.core import Fold, GDNCore, GDNShape, TreeRows

PADDED_PATH_MIN = 4  # the shortest padded path (AcceptedPath.padded_index)
KV_STEP = 256  # grow the KV buffer in steps, like mlx-lm, to avoid a copy per token
# ...and the target's buffers (its K/V, its recorded features) by at least a GROWTH-th of what
# they held (a first allocation: of its rows): a growth copies the whole context, which after a 32k-token
# prompt was a 12 ms stall every 256 tokens on the dev CPU (4.6x the median gap; a boundary cost two
# such gaps; BENCHMARKS.md, issue 17). Growing by a share makes the copies O(context) in all, and
# rare. A drafter's own cache (the MTP head's) keeps the KV_STEP steps: its compiled steps read its
# buffer whole under a length mask, so slack there would be work.
GROWTH = 4
HEADROOM = True  # a module switch: False grows every buffer KV_STEP rows at a time (variant "-gh0")


def grown_capacity(end: int, held: int, headroom: bool) -> int:
    """The rows a buffer holding `held` rows (0: none yet) is grown to so that `end` fit: `end`
    rounded up to KV_STEP, and with `headroom` at least held + held / GROWTH, or for a first
    allocation end + end / GROWTH (a restored prefix is followed by the rest of its request: left
    exact, its first decode step copied it all again)."""
    if not (headroom and HEADROOM):
        want = end
    elif held:
        want = max(end, held + held // GROWTH)
    else:
        want = end + end // GROWTH
    return (want + KV_STEP - 1) // KV_STEP * KV_STEP


@dataclass(frozen=True)
class AcceptedPath:
    """Node indices of the accepted path, root first (the rows of the last verify to keep)."""

    nodes: tuple[int, ...]

    @property
    def is_prefix(self) -> bool:
        """The rows are already contiguous (a chain accepted from its start, or a one-node tree)."""
        return self.nodes == tuple(range(len(self.nodes)))

    @cached_property
    def index(self) -> mx.array:
        return mx.array(self.nodes, dtype=mx.int32)

    @cached_property
    def padded_index(self) -> mx.array:
        """The nodes padded with -1 to a power of two of at least PADDED_PATH_MIN entries: what
        the folding kernels take (engine/kernels.py), so that the layers' compiled functions trace
        once per length class. Built once a commit, shared by every layer."""
        n = max(PADDED_PATH_MIN, 1 << (len(self.nodes) - 1).bit_length())
        return mx.array([*self.nodes, *([-1] * (n - len(self.nodes)))], dtype=mx.int32)

    def __len__(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True)
class KVSnapshot:
    keys: mx.array  # [1, n_kv, length, D], a copy
    values: mx.array

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def arrays(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass(frozen=True)
class GDNSnapshot:
    conv_state: mx.array  # references: GDN states are never written in place
    state: mx.array
    length: int

    def arrays(self) -> tuple[mx.array, mx.array]:
        return self.conv_state, self.state

    @property
    def nbytes(self) -> int:
        return self.conv_state.nbytes + self.state.nbytes


class LayerSnapshot(Protocol):
    """An immutable copy of one cache's state after `length` tokens (KV, GDN, a FeatureCache's rows)."""

    @property
    def length(self) -> int: ...

    def arrays(self) -> tuple[mx.array, ...]: ...

    @property
    def nbytes(self) -> int: ...


class LayerCache(Protocol):
    def arrays(self) -> list[mx.array]: ...

    def snapshot(self, length: int) -> LayerSnapshot: ...

    def restore(self, snap: LayerSnapshot, length: int) -> None: ...

    def mark(self) -> object: ...

    def rewind(self, mark: object) -> None: ...

    def commit(self, path: AcceptedPath) -> None: ...

    @property
    def nbytes(self) -> int: ...


class KVCache:
    """Attention K/V for positions [0, offset); slots past offset are scratch for a tree.

    dtype: what the rows are stored as; None = as written (the compute dtype). A half dtype
    (`--kv-dtype`) rounds each row once, as it is written, so a decode step and a verify read the
    same values and speculation stays lossless; the CPU's rows attention reads the halves in place
    (engine/cpu_ext.cpp), every other path widens the context first. int8: each row quantized
    once as it is written, its scale packed after it (engine/kv_int8.py), read the same ways."""

    def __init__(self, dtype: mx.Dtype | None = None, headroom: bool = False) -> None:
        self.dtype = dtype
        self.headroom = headroom  # grow by a share of the context (GROWTH): the target's caches
        self.keys: mx.array | None = None  # [1, n_kv, cap, D]
        self.values: mx.array | None = None
        self.offset = 0
        # the rows of the last write (its offset, K, V): a commit gathers the accepted ones from
        # these, not from the buffer, so the buffer's only reader is the update and MLX writes it
        # in place instead of copying the whole context (CPU, 16k keys: 1.6 ms a layer a commit)
        self._written: tuple[int, mx.array, mx.array] | None = None

    def write(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write T rows at [offset, offset+T) and return K/V for [0, offset+T). Does not advance."""
        end = self.offset + k.shape[2]
        packed = self.dtype is not None and self.dtype == mx.int8
        if packed and k.dtype != mx.int8:  # (a snapshot's packed rows go in as they are)
            k, v = kv_int8.pack_pair(k, v)
        elif not packed and (k.dtype == mx.int8 or self.dtype is not None and k.dtype != self.dtype):
            # rounded to this cache's dtype, or another cache's packed rows (a snapshot's) unpacked
            want = self.dtype if self.dtype is not None else mx.float32
            k, v = kv_int8.cast_rows(k, want), kv_int8.cast_rows(v, want)
        if self.keys is None or self.values is None or end > self.keys.shape[2]:
            self._grow(end, k)
        assert self.keys is not None and self.values is not None
        self.keys[:, :, self.offset : end] = k
        self.values[:, :, self.offset : end] = v
        self._written = (self.offset, k, v)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, end: int, like: mx.array) -> None:
        cap = grown_capacity(end, 0 if self.keys is None else self.keys.shape[2], self.headroom)
        B, H, _, D = like.shape
        k_new = mx.zeros((B, H, cap, D), like.dtype)
        v_new = mx.zeros((B, H, cap, D), like.dtype)
        if self.keys is not None and self.values is not None and self.offset > 0:
            k_new[:, :, : self.offset] = self.keys[:, :, : self.offset]
            v_new[:, :, : self.offset] = self.values[:, :, : self.offset]
        self.keys, self.values = k_new, v_new

    def advance(self, n: int) -> None:
        self.offset += n

    def commit(self, path: AcceptedPath) -> None:
        """Keep tree rows `path`: compact them to contiguous slots after the committed ones."""
        if not path.is_prefix:
            assert self.keys is not None and self.values is not None
            end = self.offset + len(path)
            written = self._written
            if written is not None and written[0] == self.offset and max(path.nodes) < written[1].shape[2]:
                _, k, v = written
                self.keys[:, :, self.offset : end] = k[:, :, path.index]
                self.values[:, :, self.offset : end] = v[:, :, path.index]
            else:
                rows = self.offset + path.index
                self.keys[:, :, self.offset : end] = self.keys[:, :, rows]
                self.values[:, :, self.offset : end] = self.values[:, :, rows]
        self._written = None
        self.advance(len(path))

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None or self.values is None else [self.keys, self.values]

    def snapshot(self, length: int) -> KVSnapshot:
        if self.offset != length or self.keys is None or self.values is None:
            raise ValueError(f"KV cache holds {self.offset} tokens, the snapshot is for {length}")
        # a copy of the first rows: the live buffer keeps being written in place
        return KVSnapshot(mx.contiguous(self.keys[:, :, :length]), mx.contiguous(self.values[:, :, :length]))

    def restore(self, snap: LayerSnapshot, length: int) -> None:
        """Into a fresh cache: the first `length` rows of the snapshot (any length up to its own)."""
        if not isinstance(snap, KVSnapshot) or length > snap.length or self.offset:
            raise ValueError(f"cannot restore {snap!r} into this KV cache at {length} tokens")
        self.write(snap.keys[:, :, :length], snap.values[:, :, :length])
        self.advance(length)

    def mark(self) -> int:
        return self.offset

    def rewind(self, mark: object) -> None:
        """Back to a mark: rows past it become scratch (valid while only appends happened since)."""
        assert isinstance(mark, int) and mark <= self.offset
        self.offset = mark
        self._written = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


_COMMITS: dict[tuple[GDNCore, bool], Callable[..., Any]] = {}


def commit_function(core: GDNCore, compiled: bool) -> Callable[..., Any]:
    """core.commit over flat arrays (x, k, u, g, path, conv_state, state) -> (conv state, state),
    compiled or not, one per core shared by its layers. Compiled, a commit replays one traced
    graph per (tree size, path length) instead of building its ops (or its kernel call, whose
    source MLX assembles on every eager call) layer after layer on the host: on the dev CPU
    (bundled model, 17-node tree, 9-node path) 2.17 ms a commit against 2.93 (medians of four
    interleaved runs of eight)."""
    key = (core, compiled)
    if key not in _COMMITS:

        def commit(x: mx.array, k: mx.array, u: mx.array, g: mx.array, path: mx.array, conv_state: mx.array,
                   state: mx.array) -> tuple[mx.array, mx.array]:
            return core.commit(TreeRows(x, k, u, g), path, conv_state, state)

        _COMMITS[key] = mx.compile(commit) if compiled else commit
    return _COMMITS[key]


class GDNCache:
    """Gated DeltaNet layer state: conv state [K-1, C] (the compute dtype) and recurrent state
    [Hv, Dv, Dk] (float32). A verify defers its result here until `commit(path)`.

    Where the core folds commits into the next verify (`folds_commit`: the GPU kernels), a
    multi-node commit only records the accepted path (`unfolded`): the next tree verify folds it
    in and hands back the states after it (`settle_with`); anything else that reads the states
    (a step, a chain, a snapshot, a mark) runs the commit first (`settle`)."""

    compile_commit = True  # class-wide switch: tests hold the compiled commit to the plain one
    fold_commits: bool | None = None  # class-wide: None = as the core says; tests force it either way

    def __init__(self, core: GDNCore, shape: GDNShape) -> None:
        self.core, self.shape = core, shape
        self.conv_state: mx.array | None = None
        self.state: mx.array | None = None
        # a verify's result: a one-node tree's states directly, a larger tree's rows to fold
        self.pending: tuple[mx.array, mx.array] | TreeRows | None = None
        # a commit recorded, not run: the last verify's rows and the path the next verify folds in
        self.unfolded: tuple[TreeRows, AcceptedPath] | None = None
        self.length = 0  # tokens the committed state has consumed (an unfolded path included)

    @property
    def folds(self) -> bool:
        fold = self.fold_commits
        return bool(getattr(self.core, "folds_commit", False)) if fold is None else fold

    def states(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """(conv state, state) to read; zeros before the first token."""
        self.settle()
        if self.conv_state is None or self.state is None:
            s = self.shape
            self.conv_state = mx.zeros((s.K - 1, s.conv_dim), dtype)
            self.state = mx.zeros((s.Hv, s.Dv, s.Dk), mx.float32)
        return self.conv_state, self.state

    def fold_states(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array, Fold | None]:
        """For a tree verify: the states before the unfolded commit, and that commit (or None)."""
        if self.unfolded is None:
            return (*self.states(dtype), None)
        assert self.conv_state is not None and self.state is not None
        rows, path = self.unfolded
        return self.conv_state, self.state, Fold(rows, path.padded_index)

    def settle_with(self, conv_state: mx.array, state: mx.array) -> None:
        """A verify folded the unfolded commit in: its states after it are the committed ones."""
        self.conv_state, self.state, self.unfolded = conv_state, state, None

    def settle(self) -> None:
        """Run the unfolded commit, if any (lazily, like every write)."""
        if self.unfolded is None:
            return
        r, path = self.unfolded
        assert self.conv_state is not None and self.state is not None
        self.conv_state, self.state = commit_function(self.core, self.compile_commit)(
            r.x, r.k, r.u, r.g, path.index, self.conv_state, self.state)
        self.unfolded = None

    def write(self, conv_state: mx.array, state: mx.array, tokens: int) -> None:
        """A chain of `tokens` tokens was consumed: its states replace the committed ones."""
        assert self.unfolded is None, "a chain read settled states"
        self.conv_state, self.state = conv_state, state
        self.length += tokens

    def defer(self, result: tuple[mx.array, mx.array] | TreeRows) -> None:
        self.pending = result

    def commits_together(self) -> bool:
        """Whether this layer's pending commit may run joined with other layers' (commit_all): a
        multi-node verify's rows committed at once (not folded) by a core whose commit is per head
        and per conv channel."""
        return (isinstance(self.pending, TreeRows) and not self.folds and self.unfolded is None
                and self.conv_state is not None and self.state is not None
                and bool(getattr(self.core, "commits_by_head", False)))

    def commit(self, path: AcceptedPath) -> None:
        if self.pending is None or self.conv_state is None or self.state is None:
            raise RuntimeError("commit without a pending verify")
        assert self.unfolded is None, "a verify read settled states"
        if isinstance(self.pending, TreeRows) and self.folds:
            self.unfolded = (self.pending, path)
            self.pending = None
            self.length += len(path)
            return
        if isinstance(self.pending, TreeRows):
            rows = self.pending
            conv, S = commit_function(self.core, self.compile_commit)(rows.x, rows.k, rows.u, rows.g, path.index,
                                                                      self.conv_state, self.state)
        else:
            if len(path) != 1:
                raise ValueError(f"a one-node verify commits a path of one node, got {path.nodes}")
            conv, S = self.pending
        self.pending = None
        self.write(conv, S, len(path))

    def arrays(self) -> list[mx.array]:
        unfolded = [] if self.unfolded is None else list(Fold(self.unfolded[0], self.unfolded[1].padded_index).arrays())
        return [a for a in (self.conv_state, self.state) if a is not None] + unfolded

    def snapshot(self, length: int) -> GDNSnapshot:
        self.settle()
        if self.length != length or self.conv_state is None or self.state is None:
            raise ValueError(f"GDN state has consumed {self.length} tokens, the snapshot is for {length}")
        return GDNSnapshot(self.conv_state, self.state, length)

    def restore(self, snap: LayerSnapshot, length: int) -> None:
        """Recurrent state cannot be cut: only the snapshot's own length restores."""
        if not isinstance(snap, GDNSnapshot) or snap.length != length:
            raise ValueError(f"cannot restore {snap!r} into a GDN cache at {length} tokens")
        self.conv_state, self.state, self.length = snap.conv_state, snap.state, length
        self.unfolded = None

    def mark(self) -> tuple[mx.array | None, mx.array | None, int]:
        self.settle()
        return self.conv_state, self.state, self.length

    def rewind(self, mark: object) -> None:
        assert isinstance(mark, tuple) and len(mark) == 3
        self.conv_state, self.state, self.length = mark
        self.pending = None
        self.unfolded = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


# The GDN layers' commits as one, their heads and conv channels side by side, where the core's
# commit is per head and per channel (`commits_by_head`: the plain core, the CPU's): a layer's
# commit is ~25 graph nodes (gathers, a cumulative sum, the fold's product) of a few hundred floats
# each, and on the CPU evaluating a node costs more than its arithmetic. Six layers committed
# together are ~45 nodes instead of ~150; the same arithmetic head by head, so the same bits (tests
# hold the two equal). Module switch: tests and benchmarks compare with it off.
COMMIT_TOGETHER = True


def commit_all(cache: Sequence[LayerCache], path: AcceptedPath) -> None:
    together = _commit_together(cache, path)
    for c in cache:
        if id(c) not in together:
            c.commit(path)


def _commit_together(cache: Sequence[LayerCache], path: AcceptedPath) -> set[int]:
    """Commit the GDN layers that can go together (GDNCache.commits_together, one core, one shape,
    one conv-state dtype) as one -> the ids of the caches committed."""
    if not COMMIT_TOGETHER:
        return set()
    layers = [c for c in cache if isinstance(c, GDNCache) and c.commits_together()]
    kind = [(c.core, c.shape, c.conv_state.dtype) for c in layers]  # type: ignore[union-attr]
    layers = [c for c, k in zip(layers, kind, strict=True) if k == kind[0]]
    if len(layers) < 2:
        return set()
    rows = [c.pending for c in layers]
    outs = together_function(layers[0].core, GDNCache.compile_commit)(
        [r.x for r in rows], [r.k for r in rows], [r.u for r in rows], [r.g for r in rows],  # type: ignore[union-attr]
        path.index, [c.conv_state for c in layers], [c.state for c in layers])
    for c, (conv, S) in zip(layers, outs, strict=True):
        c.pending = None
        c.write(conv, S, len(path))
    return {id(c) for c in layers}


_TOGETHER: dict[tuple[GDNCore, bool], Callable[..., Any]] = {}


def together_function(core: GDNCore, compiled: bool) -> Callable[..., Any]:
    """core.commit of several layers at once, over lists of their arrays (x, k, u, g per layer, the
    path, conv states, states) -> [(conv state, state)] per layer; compiled or not, one per core
    (a trace per layer count and shape). The layers' rows are joined along their head and channel
    axes, committed as one layer's, and the results split back: each layer's state is a view of
    the joint one."""
    key = (core, compiled)
    if key not in _TOGETHER:

        def together(xs: list[mx.array], ks: list[mx.array], us: list[mx.array], gs: list[mx.array],
                     path: mx.array, convs: list[mx.array], states: list[mx.array]) -> list[tuple[mx.array, mx.array]]:
            rows = TreeRows(*(mx.concatenate(a, axis=1) for a in (xs, ks, us, gs)))
            conv, S = core.commit(rows, path, mx.concatenate(convs, axis=1), mx.concatenate(states, axis=0))
            C, Hv = convs[0].shape[1], states[0].shape[0]
            return [(conv[:, i * C : (i + 1) * C], S[i * Hv : (i + 1) * Hv]) for i in range(len(xs))]

        _TOGETHER[key] = mx.compile(together) if compiled else together
    return _TOGETHER[key]


def snapshot_all(cache: Sequence[LayerCache], length: int) -> tuple[LayerSnapshot, ...]:
    snaps = tuple(c.snapshot(length) for c in cache)
    mx.eval([a for s in snaps for a in s.arrays()])
    return snaps


def restore_all(cache: Sequence[LayerCache], snaps: Sequence[LayerSnapshot], length: int) -> None:
    for c, s in zip(cache, snaps, strict=True):
        c.restore(s, length)
