"""Gated DeltaNet math in plain MLX ops (shapes and conventions: engine/gdn/__init__.py).

These are the twins of the GPU kernels and the implementation that runs on the CPU:
- the front of a layer: gates, the depthwise causal conv along a chain or a tree's ancestor chains,
  L2 normalisation;
- the recurrence: one token, a chunked chain (prefill), the dense tree verify (every node's output
  from the committed state S0, which is never written), and the fold of an accepted path.
docs/gdn_tree.md derives the dense forms. Inputs are cast to float32.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.cpu_exp import exp, silu
from engine.gdn.triangular import solve_unit_lower

L2_EPS = 1e-6
PREFILL_CHUNK = 32  # rows per dense block of a chain; 32 measured a little faster than 64 on CPU


def f32(x: Any) -> mx.array:
    """x as float32. An array that already is one comes back as it is: `mx.array(x)` of an array
    is a copy in the graph (an AsType node), and a verify and its commit cast ~80 float32 arrays
    here, each a node the CPU evaluates at a few microseconds."""
    return x.astype(mx.float32) if isinstance(x, mx.array) else mx.array(x, dtype=mx.float32)


# ---------------------------------------------------------------- the front of a layer


def l2norm(x: mx.array) -> mx.array:
    """x / sqrt(sum x^2 + eps) over the last axis, in fp32 (HF's l2norm)."""
    x = x.astype(mx.float32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + L2_EPS)


def gates(a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """Log-decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), both fp32."""
    a = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    softplus = mx.logaddexp(a, mx.zeros_like(a))
    g = -mx.exp(A_log.astype(mx.float32)) * softplus
    return g, mx.sigmoid(b.astype(mx.float32))


@dataclass(frozen=True)
class ConvViews:
    """Views of a float32 conv weight [C, K] that the convolutions below would otherwise build in
    every graph, made and evaluated once (engine/models/gated_deltanet.py holds them after loading): its
    columns for the chain conv, its transpose for the tree conv. On the CPU every graph node costs
    a few microseconds whatever its size, and the columns alone were 48 of a decode step's 734
    nodes (a slice and a squeeze for each of 4 taps in 6 layers). Evaluated views share the
    weight's buffer and read the same values, so the results are bitwise the same."""

    weight: mx.array  # the array they are views of (a weight replaced later no longer matches)
    columns: tuple[mx.array, ...]  # weight[:, j], [C] each
    by_tap: mx.array  # weight.T[None], [1, K, C]

    @staticmethod
    def of(weight: mx.array) -> ConvViews | None:
        """The views of `weight`, evaluated; None unless it is float32 (the convolutions cast to
        float32 first, and a cast of a view is not a view of the cast)."""
        if weight.dtype != mx.float32 or weight.ndim != 2:
            return None
        views = ConvViews(weight, tuple(weight[:, j] for j in range(weight.shape[1])), weight.T[None])
        mx.eval(views.columns, views.by_tap)
        return views


def causal_conv(x: mx.array, conv_state: mx.array, weight: mx.array,
                views: ConvViews | None = None) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv + SiLU along a chain, computed in fp32 like the tree conv.

    x [T, C] pre-conv rows, conv_state [K-1, C] (the last K-1 pre-conv rows), weight [C, K]
    (tap K-1 is the token itself), views: `weight`'s held views, if any -> (y [T, C] fp32, new
    conv_state [K-1, C] in x's dtype).
    """
    K = weight.shape[1]
    T = x.shape[0]
    window = mx.concatenate([conv_state.astype(x.dtype), x], axis=0)  # [K-1+T, C]
    if views is not None and views.weight is weight:
        columns = views.columns
    else:
        w = f32(weight)
        columns = tuple(w[:, j] for j in range(K))
    rows = f32(window)
    y = rows[0:T] * columns[0]
    for j in range(1, K):
        y = y + rows[j : j + T] * columns[j]
    return silu(y), window[T:]


def tree_conv_taps(parents: Sequence[int], kernel_size: int) -> np.ndarray:
    """int32 [N, K] row indices into concat(conv_state [K-1], x [N]) for each node's conv window
    (read-only: shared by every verify of a tree of this shape).

    Tap K-1 is the node itself, tap K-1-m its m-th ancestor; once the walk
    passes the root it reads the committed conv state from its last row back.
    """
    if kernel_size < 2:
        raise ValueError(f"conv kernel size must be >= 2, got {kernel_size}")
    return _conv_taps(tuple(int(i) for i in parents), kernel_size)


# a drafter's trees repeat their shapes (a chain of its depth, its usual fan-out), and computing
# the taps on the host cost ~0.25 ms a verify on the dev CPU: once per shape instead
@functools.lru_cache(maxsize=4096)
def _conv_taps(parents: tuple[int, ...], kernel_size: int) -> np.ndarray:
    p = check_parents(parents, len(parents))
    n, K = p.shape[0], kernel_size
    depth = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        depth[i] = depth[p[i]] + 1
    taps = np.empty((n, K), dtype=np.int32)
    node = np.arange(n)
    for m in range(K):
        taps[:, K - 1 - m] = np.where(m <= depth, K - 1 + node, K - 1 - (m - depth))
        node = np.where(node > 0, p[np.maximum(node, 0)], -1)
    taps.flags.writeable = False
    return taps


def tree_conv(x: mx.array, conv_state: mx.array, weight: mx.array, taps: mx.array,
              views: ConvViews | None = None) -> mx.array:
    """silu(depthwise causal conv along each node's ancestor chain). x [N, C] pre-conv rows,
    conv_state [K-1, C], weight [C, K] (tap K-1 = the node), taps [N, K] from tree_conv_taps,
    views: `weight`'s held views, if any."""
    by_tap = views.by_tap if views is not None and views.weight is weight else None
    x, conv_state, weight = f32(x), f32(conv_state), f32(weight)
    if weight.ndim != 2 or x.ndim != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"need x [N, C] and weight [C, K], got {x.shape} and {weight.shape}")
    K = weight.shape[1]
    if tuple(conv_state.shape) != (K - 1, x.shape[1]):
        raise ValueError(f"conv_state must be [{K - 1}, {x.shape[1]}], got {conv_state.shape}")
    windows = mx.concatenate([conv_state, x])[taps]  # [N, K, C]
    y = (windows * (weight.T[None] if by_tap is None else by_tap)).sum(axis=1)
    return silu(y)


def conv_state_after(x: mx.array, path: mx.array, conv_state: mx.array) -> mx.array:
    """[K-1, C]: the last K-1 pre-conv rows along the accepted path (node indices, int32 array,
    root first), preceded by the old state."""
    rows = mx.concatenate([f32(conv_state), f32(x)[path]])
    return rows[rows.shape[0] - conv_state.shape[0] :]


def conv_state_after_padded(x: mx.array, path: mx.array, conv_state: mx.array) -> mx.array:
    """conv_state_after for a path padded with -1 (its length is counted on the device)."""
    valid = path >= 0
    rows = mx.concatenate([f32(conv_state), f32(x)[mx.maximum(path, 0)]])
    length = valid.astype(mx.int32).sum()
    return mx.take(rows, length + mx.arange(conv_state.shape[0]), axis=0)


# ---------------------------------------------------------------- the recurrence


@mx.compile
def step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, S: mx.array):
    """One token, its rows as split_heads gives them. q, k [1, Hv, Dk]; v [1, Hv, Dv]; g, beta
    [1, Hv]; S [Hv, Dv, Dk] -> (o [1, Hv, Dv], S'). Each operand is shaped for its product or
    broadcast by one reshape (squeezing the row away and indexing the head axes apart was twice the
    views, graph nodes the CPU evaluates at a few µs each; the arithmetic is the same)."""
    Hv, Dk = q.shape[1], q.shape[2]
    S = mx.exp(g).reshape(Hv, 1, 1) * S
    kv = (S @ k.reshape(Hv, Dk, 1)).reshape(Hv, -1)  # [Hv, Dv]
    delta = beta.reshape(Hv, 1) * (v.reshape(Hv, -1) - kv)
    S = S + delta.reshape(Hv, -1, 1) * k.reshape(Hv, 1, Dk)
    o = (S @ q.reshape(Hv, Dk, 1)).reshape(1, Hv, -1)
    return o, S


@dataclass(frozen=True)
class TreeMasks:
    """Device-side masks of one tree, built once per verify and shared by every GDN layer."""

    incl: mx.array  # bool [N, N]: j is an ancestor-or-self of i
    strict: mx.array  # bool [N, N]: proper ancestors
    incl_f32: mx.array  # float32 [N, N], for the path sums prefix = g @ incl^T


def device_tree_masks(incl: mx.array) -> TreeMasks:
    """The masks from an inclusive ancestor mask already on the device (a DraftTree's, valid by
    construction): no host work, and lazy, so a core that never reads them never computes them."""
    return TreeMasks(incl, mx.tril(incl, -1), incl.astype(mx.float32))


def tree_masks(ancestor_mask: np.ndarray) -> TreeMasks:
    """The masks from a host ancestor mask, checked first."""
    return device_tree_masks(mx.array(check_mask(ancestor_mask)))


@functools.lru_cache(maxsize=8)
def chain_masks(n: int) -> TreeMasks:
    return tree_masks(np.tri(n, dtype=bool))


def tree_dense(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, masks: TreeMasks | np.ndarray,
               S0: mx.array, solver: str | None = None) -> tuple[mx.array, mx.array]:
    """Dense ancestor-masked tree verify -> o, u [N, Hv, Dv]; S0 is read, never written.

    masks: the tree's TreeMasks (built once per verify), or its inclusive ancestor mask [N, N].
    prefix_i = sum of g over ancestors-or-self of i; decays only appear as ratios
    exp(prefix_i - prefix_j), masked to -inf before exp (docs/gdn_tree.md, "dense form").
    """
    q, k, v, g, beta, S0 = check_gdn(q, k, v, g, beta, S0)
    if not isinstance(masks, TreeMasks):
        masks = tree_masks(masks)
    if tuple(masks.incl.shape) != (q.shape[0],) * 2:
        raise ValueError(f"tree masks are for {masks.incl.shape[0]} nodes, q has {q.shape[0]}")
    Q, K, V = (a.transpose(1, 0, 2) for a in (q, k, v))  # head-major [Hv, N, D]
    G, B = g.T, beta.T  # [Hv, N]
    prefix = G @ masks.incl_f32.T  # [Hv, N]
    diff = prefix[:, :, None] - prefix[:, None, :]  # [Hv, N, N]: prefix_i - prefix_j
    decay_incl = exp(mx.where(masks.incl, diff, -mx.inf))  # [Hv, N, N] of them: the CPU's 2^ (engine/cpu_exp.py)
    decay_strict = mx.where(masks.strict, decay_incl, 0.0)
    A = B[:, :, None] * decay_strict * (K @ K.transpose(0, 2, 1))
    S0T = S0.transpose(0, 2, 1)  # [Hv, Dk, Dv]
    decay0 = exp(prefix)[:, :, None]  # [Hv, N, 1]
    rhs = B[:, :, None] * (V - decay0 * (K @ S0T))
    U = solve_unit_lower(A, rhs, solver)
    O = decay0 * (Q @ S0T) + ((Q @ K.transpose(0, 2, 1)) * decay_incl) @ U
    return O.transpose(1, 0, 2), U.transpose(1, 0, 2)


def fold(k: mx.array, u: mx.array, g: mx.array, S0: mx.array) -> mx.array:
    """State after a chain of rows k [L, Hv, Dk], u [L, Hv, Dv], g [L, Hv], from S0:
    S_L = exp(sum g) S0 + sum_j exp(sum_{i>j} g_i) u_j k_j^T."""
    cum = mx.cumsum(g, axis=0)  # [L, Hv] path prefix sums
    total = cum[-1]  # [Hv]
    w = mx.exp(total[None, :] - cum).T  # [Hv, L] ratio decays
    weighted_u = u.transpose(1, 2, 0) * w[:, None, :]  # [Hv, Dv, L]
    return mx.exp(total)[:, None, None] * S0 + weighted_u @ k.transpose(1, 0, 2)


def commit_fold(k: mx.array, u: mx.array, g: mx.array, path: mx.array | Sequence[int], S0: mx.array) -> mx.array:
    """S after the accepted path (node indices root..leaf, every ancestor listed; an int32 array
    or a list) from the verify's innovations u."""
    if not isinstance(path, mx.array):
        path = mx.array(check_path(path, k.shape[0]))
    return fold(f32(k)[path], f32(u)[path], f32(g)[path], f32(S0))


def commit_fold_padded(k: mx.array, u: mx.array, g: mx.array, path: mx.array, S0: mx.array) -> mx.array:
    """commit_fold for a path padded with -1: a padding entry is a step with decay 1 and no
    innovation, which leaves the state exactly as it is."""
    valid = path >= 0
    rows = mx.maximum(path, 0)
    g_p = mx.where(valid[:, None], f32(g)[rows], 0.0)
    u_p = mx.where(valid[:, None, None], f32(u)[rows], 0.0)
    return fold(f32(k)[rows], u_p, g_p, f32(S0))


def chunked(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, S0: mx.array,
            chunk: int = PREFILL_CHUNK, solver: str | None = None) -> tuple[mx.array, mx.array]:
    """A chain of T tokens: the dense form on causal masks of `chunk` rows, state folded between
    chunks. Returns o [T, Hv, Dv] and S_T."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    q, k, v, g, beta, S = check_gdn(q, k, v, g, beta, S0)
    outs = []
    for start in range(0, q.shape[0], chunk):
        rows = slice(start, min(start + chunk, q.shape[0]))
        n = rows.stop - start
        o, u = tree_dense(q[rows], k[rows], v[rows], g[rows], beta[rows], chain_masks(n), S, solver)
        S = fold(k[rows], u, g[rows], S)
        outs.append(o)
    return mx.concatenate(outs), S


def chain(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
          S: mx.array) -> tuple[mx.array, mx.array]:
    """A chain of T tokens from state S -> (o [T, Hv, Dv], S_T): one step or the chunked form."""
    if q.shape[0] == 1:  # step takes the one row as it is (squeezed, its reshapes failed)
        return step(q, k, v, g, beta, S)
    return chunked(q, k, v, g, beta, S)


# ---------------------------------------------------------------- checks of host-side structure


def check_gdn(*arrays: Any) -> tuple[mx.array, ...]:
    """(q, k, v, g, beta, S0) as float32, with their shapes checked against each other."""
    q, k, v, g, beta, S0 = (f32(a) for a in arrays)
    if q.ndim != 3 or q.shape[0] == 0:
        raise ValueError(f"q must be [N >= 1, Hv, Dk], got {q.shape}")
    n, hv, dk = q.shape
    dv = v.shape[-1] if v.ndim == 3 else -1
    expected = {"k": (k, (n, hv, dk)), "v": (v, (n, hv, dv)), "g": (g, (n, hv)),
                "beta": (beta, (n, hv)), "S0": (S0, (hv, dv, dk))}
    for name, (arr, shape) in expected.items():
        if tuple(arr.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (from q {q.shape}, v {v.shape}), got {arr.shape}")
    return q, k, v, g, beta, S0


def check_parents(parents: Sequence[int], n: int) -> np.ndarray:
    p = np.asarray(parents, dtype=np.int64).reshape(-1)
    if p.shape[0] != n or n == 0:
        raise ValueError(f"parents has {p.shape[0]} entries for {n} nodes (need >= 1)")
    if p[0] != -1 or not all(0 <= p[i] < i for i in range(1, n)):
        raise ValueError("parents must be topological: parents[0] == -1 and 0 <= parents[i] < i")
    return p


def check_mask(ancestor_mask: np.ndarray) -> np.ndarray:
    m = np.asarray(ancestor_mask, dtype=bool)
    n = m.shape[0] if m.ndim == 2 else -1
    if m.shape != (n, n) or n == 0:
        raise ValueError(f"ancestor_mask must be a square [N, N] matrix, got {m.shape}")
    if not m.diagonal().all() or np.triu(m, 1).any():
        raise ValueError("ancestor_mask must be inclusive (True diagonal) and lower-triangular (topological order)")
    strict = np.tril(m, -1)
    parent = n - 1 - np.argmax(strict[:, ::-1], axis=1)  # nearest proper ancestor = the parent
    if not strict[1:].any(axis=1).all() or not np.array_equal(strict[1:], m[parent[1:]]):
        raise ValueError("ancestor_mask is not the ancestor mask of a single-rooted tree")
    return m


def check_path(path: Sequence[int], n: int) -> list[int]:
    out = [int(i) for i in path]
    if not out or out[0] != 0:
        raise ValueError(f"path must start at the root (node 0), got {out}")
    if any(b <= a for a, b in zip(out, out[1:])) or out[-1] >= n:
        raise ValueError(f"path must be increasing node indices below {n}, got {out}")
    return out
