"""The recurrent core of a GDN layer, behind one interface: what the layer computes between its
input projections and its gated output norm.

A core takes the layer's projected rows (pre-conv qkv [T, C], gate inputs a, b [T, Hv]) and the
committed conv state [K-1, C] and recurrent state S [Hv, Dv, Dk], and runs the short conv, the
gates, the q/k normalisation and the delta rule:
- `step`   one token; returns the new states.
- `chain`  T tokens of a prefill; returns the states after them.
- `tree`   every node of a draft tree from the committed states, which it never writes
           (rollback-free); returns what `commit` needs for any root-to-node path.
- `commit` the states after an accepted path.
- `tree_after` a tree verify from the states after the last verify's accepted path, which it
           returns as the new committed states: the commit folded into the next verify, so a round
           builds and launches no commit of its own (cores with `folds_commit`; see GDNCache).

State passed in is never written in place: every core returns fresh arrays. Cache marks and
prefix-cache snapshots hold references to old states and rely on that; a kernel that updated
state in place would have to copy first.

`OpsCore` is the plain-MLX implementation (and the twin the kernels are tested against);
engine/kernels.py adds the Metal / CUDA ones and picks one per backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from engine import cpu_ext
from engine.gdn import ops


@dataclass(frozen=True)
class GDNShape:
    """Head layout of one GDN layer (from the checkpoint's config)."""

    Hk: int  # key heads (q and k)
    Hv: int  # value heads; Hv is a multiple of Hk
    Dk: int
    Dv: int
    K: int  # short-conv taps

    @property
    def key_dim(self) -> int:
        return self.Hk * self.Dk

    @property
    def value_dim(self) -> int:
        return self.Hv * self.Dv

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class GDNWeights:
    """The layer parameters a core reads besides the projections."""

    conv: mx.array  # [C, K] depthwise conv taps (tap K-1 = the token itself)
    A_log: mx.array  # [Hv]
    dt_bias: mx.array  # [Hv]
    conv_views: ops.ConvViews | None = None  # `conv`'s views held since loading, if any (the ops core's)


@dataclass(frozen=True)
class TreeInputs:
    """Per-tree arrays shared by every GDN layer of one verify (built once on the host)."""

    conv_taps: mx.array  # int32 [N, K] rows of concat(conv_state, x) in each node's conv window
    masks: ops.TreeMasks  # for the dense form
    dfs_order: mx.array  # int32 [N] depth-first preorder, for node-by-node kernels
    depths: mx.array  # int32 [N]
    # states a node-by-node kernel keeps (max depth + 1), rounded up to a power of two so that
    # functions compiled per value retrace rarely
    levels: int

    def arrays(self) -> tuple[mx.array, ...]:
        """The arrays, flat, in the order from_arrays takes (what a compiled function can receive)."""
        m = self.masks
        return (self.conv_taps, m.incl, m.strict, m.incl_f32, self.dfs_order, self.depths)

    @classmethod
    def from_arrays(cls, arrays: tuple[mx.array, ...], levels: int) -> TreeInputs:
        taps, incl, strict, incl_f32, order, depths = arrays
        return cls(taps, ops.TreeMasks(incl, strict, incl_f32), order, depths, levels)


@dataclass(frozen=True)
class TreeRows:
    """What a tree verify leaves for the commit (all float32 but x)."""

    x: mx.array  # [N, C] pre-conv rows: the conv state is rebuilt along the accepted path
    k: mx.array  # [N, Hv, Dk] normalised keys
    u: mx.array  # [N, Hv, Dv] innovations
    g: mx.array  # [N, Hv] log-decays


@dataclass(frozen=True)
class Fold:
    """A commit not run yet: the last verify's rows and its accepted path, for the next verify to
    fold in before its own tree (GDNCore.tree_after)."""

    rows: TreeRows
    path: mx.array  # int32 [P]: node indices root..leaf, padded with -1 (AcceptedPath.padded_index)

    def arrays(self) -> tuple[mx.array, ...]:
        r = self.rows
        return (r.x, r.k, r.u, r.g, self.path)

    @classmethod
    def from_arrays(cls, arrays: tuple[mx.array, ...]) -> Fold:
        x, k, u, g, path = arrays
        return cls(TreeRows(x, k, u, g), path)


class GDNCore(Protocol):
    name: str
    folds_commit: bool  # tree_after is cheaper than commit + tree: the caches defer commits to it

    def step(self, shape: GDNShape, w: GDNWeights, qkv: mx.array, a: mx.array, b: mx.array,
             conv_state: mx.array, S: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """qkv [1, C], a, b [1, Hv] -> (o [1, Hv, Dv] fp32, conv state, S)."""
        ...

    def chain(self, shape: GDNShape, w: GDNWeights, qkv: mx.array, a: mx.array, b: mx.array,
              conv_state: mx.array, S: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """qkv [T, C], a, b [T, Hv] -> (o [T, Hv, Dv] fp32, conv state, S) after the T tokens."""
        ...

    def tree(self, shape: GDNShape, w: GDNWeights, qkv: mx.array, a: mx.array, b: mx.array,
             conv_state: mx.array, S0: mx.array, tree: TreeInputs) -> tuple[mx.array, TreeRows]:
        """qkv [N, C], a, b [N, Hv] for the nodes of a tree -> (o [N, Hv, Dv] fp32, rows to commit)."""
        ...

    def commit(self, rows: TreeRows, path: mx.array, conv_state: mx.array,
               S0: mx.array) -> tuple[mx.array, mx.array]:
        """path: int32 node indices root..leaf -> (conv state, S) after the path."""
        ...

    def tree_after(self, shape: GDNShape, w: GDNWeights, qkv: mx.array, a: mx.array, b: mx.array,
                   conv_state: mx.array, S0: mx.array, tree: TreeInputs,
                   fold: Fold) -> tuple[mx.array, TreeRows, mx.array, mx.array]:
        """`tree` from the states after `fold` (conv_state, S0: before it) -> (o, rows to commit,
        conv state, S after the fold: the new committed states)."""
        ...


def split_heads(shape: GDNShape, y: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Post-conv rows [T, C] -> q, k [T, Hv, Dk] (normalised, q scaled, repeated to Hv heads)
    and v [T, Hv, Dv] fp32."""
    T, kd = y.shape[0], shape.key_dim
    q, k, v = mx.split(y, [kd, 2 * kd], axis=1)  # one graph node for the three views, not three
    q = q.reshape(T, shape.Hk, shape.Dk)
    k = k.reshape(T, shape.Hk, shape.Dk)
    v = v.reshape(T, shape.Hv, shape.Dv).astype(mx.float32)
    q = ops.l2norm(q) * (shape.Dk**-0.5)
    k = ops.l2norm(k)
    if shape.Hv != shape.Hk:
        q = mx.repeat(q, shape.Hv // shape.Hk, axis=1)
        k = mx.repeat(k, shape.Hv // shape.Hk, axis=1)
    return q, k, v


class OpsCore:
    """The core in plain MLX ops: the CPU path and the kernels' twin."""

    name = "ops"
    # the fold costs the CPU the same ops whether it runs alone or inside the next verify, so the
    # caches commit at once here; tests turn it on to hold the deferred path to the direct one
    folds_commit = False
    # its commit treats every head and conv channel alike and apart, so the layers' commits can run
    # as one with their heads and channels side by side (engine/cache.py commit_all)
    commits_by_head = True

    def step(self, shape, w, qkv, a, b, conv_state, S):
        g, beta = ops.gates(a, b, w.A_log, w.dt_bias)
        y, conv_state = ops.causal_conv(qkv, conv_state, w.conv, w.conv_views)
        q, k, v = split_heads(shape, y)
        o, S = ops.step(q, k, v, g, beta, S)
        return o, conv_state, S

    def chain(self, shape, w, qkv, a, b, conv_state, S):
        g, beta = ops.gates(a, b, w.A_log, w.dt_bias)
        y, conv_state = ops.causal_conv(qkv, conv_state, w.conv, w.conv_views)
        q, k, v = split_heads(shape, y)
        o, S = ops.chain(q, k, v, g, beta, S)
        return o, conv_state, S

    def tree(self, shape, w, qkv, a, b, conv_state, S0, tree):
        g, beta = ops.gates(a, b, w.A_log, w.dt_bias)
        y = ops.tree_conv(qkv, conv_state, w.conv, tree.conv_taps, w.conv_views)
        q, k, v = split_heads(shape, y)
        o, u = ops.tree_dense(q, k, v, g, beta, tree.masks, S0)
        return o, TreeRows(x=qkv, k=k, u=u, g=g)

    def commit(self, rows, path, conv_state, S0):
        S = ops.commit_fold(rows.k, rows.u, rows.g, path, S0)
        conv = ops.conv_state_after(rows.x, path, conv_state).astype(conv_state.dtype)
        return conv, S

    def tree_after(self, shape, w, qkv, a, b, conv_state, S0, tree, fold):
        r = fold.rows
        S = ops.commit_fold_padded(r.k, r.u, r.g, fold.path, S0)
        conv = ops.conv_state_after_padded(r.x, fold.path, conv_state).astype(conv_state.dtype)
        o, rows = self.tree(shape, w, qkv, a, b, conv, S, tree)
        return o, rows, conv, S


class CpuCore(OpsCore):
    """OpsCore with a token's step, a prefill's chain, a tree's verify and its commit each in one
    operation of the engine's own on the CPU (engine/cpu_ext.cpp: ~30 MLX operations a GDN layer
    fewer a step, each a few microseconds of scheduling there), where it is built and the arrays
    are float32; OpsCore's otherwise. The four share one arithmetic, so a verify row and the state
    committed after it are plain decoding's, bit for bit, and so is the state a prefill leaves.
    """

    name = "cpu"

    def step(self, shape, w, qkv, a, b, conv_state, S):
        if not cpu_ext.serves(cpu_ext.GDN_STEP, qkv, a, b, conv_state, S, w.conv, w.A_log, w.dt_bias):
            return super().step(shape, w, qkv, a, b, conv_state, S)
        return cpu_ext.gdn_step(qkv, a, b, conv_state, S, w.conv, w.A_log, w.dt_bias, shape.Hk, shape.Dk)

    def chain(self, shape, w, qkv, a, b, conv_state, S):
        # token by token: at the bundled model's shape 512 tokens of a layer took ~9 ms in the
        # chunked dense form's operations (BENCHMARKS.md, issue 17, fiftieth session)
        if not cpu_ext.serves(cpu_ext.GDN_CHAIN, qkv, a, b, conv_state, S, w.conv, w.A_log, w.dt_bias):
            return super().chain(shape, w, qkv, a, b, conv_state, S)
        return cpu_ext.gdn_chain(qkv, a, b, conv_state, S, w.conv, w.A_log, w.dt_bias, shape.Hk, shape.Dk)

    def tree(self, shape, w, qkv, a, b, conv_state, S0, tree):
        if not cpu_ext.serves(cpu_ext.GDN_TREE, qkv, a, b, conv_state, S0, w.conv, w.A_log, w.dt_bias):
            return super().tree(shape, w, qkv, a, b, conv_state, S0, tree)
        o, k, u, g = cpu_ext.gdn_tree(qkv, a, b, tree.conv_taps, conv_state, S0, w.conv, w.A_log, w.dt_bias,
                                      shape.Hk, shape.Dk)
        return o, TreeRows(x=qkv, k=k, u=u, g=g)

    def commit(self, rows, path, conv_state, S0):
        if not cpu_ext.serves(cpu_ext.GDN_TREE, rows.k, rows.u, rows.g, S0):
            return super().commit(rows, path, conv_state, S0)
        path = path if isinstance(path, mx.array) else mx.array(ops.check_path(path, rows.k.shape[0]), dtype=mx.int32)
        S = cpu_ext.gdn_commit(rows.k, rows.u, rows.g, path.astype(mx.int32), S0)
        return ops.conv_state_after(rows.x, path, conv_state).astype(conv_state.dtype), S

    def tree_after(self, shape, w, qkv, a, b, conv_state, S0, tree, fold):
        r = fold.rows
        if not cpu_ext.serves(cpu_ext.GDN_TREE, r.k, r.u, r.g, S0):
            return super().tree_after(shape, w, qkv, a, b, conv_state, S0, tree, fold)
        S = cpu_ext.gdn_commit(r.k, r.u, r.g, fold.path.astype(mx.int32), S0)  # padding (-1) is skipped
        conv = ops.conv_state_after_padded(r.x, fold.path, conv_state).astype(conv_state.dtype)
        o, rows = self.tree(shape, w, qkv, a, b, conv, S, tree)
        return o, rows, conv, S
