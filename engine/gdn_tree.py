"""Gated DeltaNet over a draft tree, in plain MLX ops (fp32).

Per layer, batch 1 squeezed. Shapes:
  q, k  [N, Hv, Dk]  L2-normalised, q also scaled by Dk^-1/2, already repeated to Hv heads
  v     [N, Hv, Dv]
  g     [N, Hv]      log-decay (<= 0)
  beta  [N, Hv]      already sigmoided
  S0    [Hv, Dv, Dk] committed state, mlx layout (element (v, k))
Recurrence of node i with parent state S_p (S_p = S0 for the root):
  S = exp(g_i) S_p;  delta_i = beta_i (v_i - S k_i);  S_i = S + delta_i k_i^T;  o_i = S_i q_i
delta_i (called u) is node i's innovation; commit folds the accepted path's
innovations into S0 without re-solving anything.

Two forms of the tree verify: a per-node loop (the plain twin) and the dense
ancestor-masked form (reference/dflash_weaver_tree.md §3.3) built from
matmuls. The dense form on a chain mask is the chunked prefill (§5.3).
Inputs are cast to float32; no function writes S0.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

SOLVERS = ("neumann", "substitution")


def _f32(x) -> mx.array:
    return mx.array(x).astype(mx.float32)


def _check_gdn(q, k, v, g, beta, S0) -> tuple[mx.array, ...]:
    q, k, v, g, beta, S0 = (_f32(a) for a in (q, k, v, g, beta, S0))
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


def _check_parents(parents: Sequence[int], n: int) -> np.ndarray:
    p = np.asarray(parents, dtype=np.int64).reshape(-1)
    if p.shape[0] != n or n == 0:
        raise ValueError(f"parents has {p.shape[0]} entries for {n} nodes (need >= 1)")
    if p[0] != -1 or not all(0 <= p[i] < i for i in range(1, n)):
        raise ValueError("parents must be topological: parents[0] == -1 and 0 <= parents[i] < i")
    return p


def _check_path(path: Sequence[int], n: int) -> list[int]:
    path = [int(i) for i in path]
    if not path or path[0] != 0:
        raise ValueError(f"path must start at the root (node 0), got {path}")
    if any(b <= a for a, b in zip(path, path[1:])) or path[-1] >= n:
        raise ValueError(f"path must be increasing node indices below {n}, got {path}")
    return path


def _advance(S: mx.array, k, v, g, beta) -> tuple[mx.array, mx.array]:
    """One delta-rule step for all heads: S [Hv, Dv, Dk], k [Hv, Dk], v [Hv, Dv], g/beta [Hv]."""
    S = mx.exp(g)[:, None, None] * S
    kv = (S @ k[:, :, None])[..., 0]  # [Hv, Dv]
    u = beta[:, None] * (v - kv)
    return S + u[:, :, None] * k[:, None, :], u


def _read(S: mx.array, q: mx.array) -> mx.array:
    return (S @ q[:, :, None])[..., 0]  # [Hv, Dv]


def gdn_tree_sequential(q, k, v, g, beta, parents: Sequence[int], S0) -> tuple[mx.array, mx.array]:
    """Per-node loop: node i starts from its parent's state. Returns o, u [N, Hv, Dv]."""
    q, k, v, g, beta, S0 = _check_gdn(q, k, v, g, beta, S0)
    parents = _check_parents(parents, q.shape[0])
    states, outs, innovations = [], [], []
    for i, p in enumerate(parents):
        S, u = _advance(S0 if p < 0 else states[p], k[i], v[i], g[i], beta[i])
        states.append(S)
        outs.append(_read(S, q[i]))
        innovations.append(u)
    return mx.stack(outs), mx.stack(innovations)


def gdn_sequential(q, k, v, g, beta, S0) -> tuple[mx.array, mx.array]:
    """Plain per-token recurrence over a sequence. Returns o [T, Hv, Dv] and the final state S_T."""
    q, k, v, g, beta, S = _check_gdn(q, k, v, g, beta, S0)
    outs = []
    for t in range(q.shape[0]):
        S, _ = _advance(S, k[t], v[t], g[t], beta[t])
        outs.append(_read(S, q[t]))
    return mx.stack(outs), S


def _check_mask(ancestor_mask, n: int) -> np.ndarray:
    m = np.asarray(ancestor_mask, dtype=bool)
    if m.shape != (n, n):
        raise ValueError(f"ancestor_mask must be [{n}, {n}], got {m.shape}")
    if not m.diagonal().all() or np.triu(m, 1).any():
        raise ValueError("ancestor_mask must be inclusive (True diagonal) and lower-triangular (topological order)")
    strict = np.tril(m, -1)
    parent = n - 1 - np.argmax(strict[:, ::-1], axis=1)  # nearest proper ancestor = the parent
    if not strict[1:].any(axis=1).all() or not np.array_equal(strict[1:], m[parent[1:]]):
        raise ValueError("ancestor_mask is not the ancestor mask of a single-rooted tree")
    return m


def _neumann_repeats(max_depth: int) -> int:
    """Squarings so that sum_{n < 2^(r+1)} (-A)^n is exact: A^(D+1) = 0 needs 2^(r+1) > D."""
    return max(0, max_depth.bit_length() - 1)  # = max(0, ceil(log2(D + 1)) - 1)


def _solve_unit_lower(A: mx.array, rhs: mx.array, max_depth: int, solver: str) -> mx.array:
    """U = (I + A)^-1 rhs for strictly lower A [Hv, N, N] with A^(max_depth + 1) = 0."""
    if solver == "substitution":
        eye = mx.eye(A.shape[-1], dtype=A.dtype)
        # LAPACK trsm (forward substitution); MLX only has it on the CPU stream.
        return mx.linalg.solve_triangular(eye + A, rhs, upper=False, stream=mx.cpu)
    if solver != "neumann":
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    U = rhs - A @ rhs
    repeats = _neumann_repeats(max_depth)
    P2 = A @ A if repeats else None
    for r in range(repeats):
        U = U + P2 @ U
        if r < repeats - 1:
            P2 = P2 @ P2
    return U


def default_solver() -> str:
    """LAPACK substitution on the CPU (as fast or faster there); matmul-only Neumann elsewhere."""
    return "substitution" if mx.default_device() == mx.cpu else "neumann"


@dataclass(frozen=True)
class TreeMasks:
    """Device-side masks of one tree, built once per verify and shared by every GDN layer."""

    incl: mx.array  # bool [N, N]: j is an ancestor-or-self of i
    strict: mx.array  # bool [N, N]: proper ancestors
    incl_f32: mx.array  # float32 [N, N], for the path sums prefix = g @ incl^T
    max_depth: int


def tree_masks(ancestor_mask) -> TreeMasks:
    m = _check_mask(ancestor_mask, np.asarray(ancestor_mask).shape[0])
    return TreeMasks(mx.array(m), mx.array(np.tril(m, -1)), mx.array(m.astype(np.float32)),
                     int(m.sum(axis=1).max()) - 1)


@functools.lru_cache(maxsize=8)
def chain_masks(n: int) -> TreeMasks:
    return tree_masks(np.tri(n, dtype=bool))


def gdn_tree_dense(
    q, k, v, g, beta, ancestor_mask, S0, solver: str | None = None
) -> tuple[mx.array, mx.array]:
    """Dense ancestor-masked tree verify. ancestor_mask: bool [N, N] inclusive (DraftTree.ancestor_mask()),
    or its TreeMasks (built once per tree and shared by the layers).

    prefix_i = sum of g over ancestors-or-self of i; decays only as ratios
    exp(prefix_i - prefix_j), masked to -inf before exp. solver: one of
    SOLVERS, None = default_solver(). Returns o, u [N, Hv, Dv].
    """
    q, k, v, g, beta, S0 = _check_gdn(q, k, v, g, beta, S0)
    masks = ancestor_mask if isinstance(ancestor_mask, TreeMasks) else tree_masks(ancestor_mask)
    if tuple(masks.incl.shape) != (q.shape[0],) * 2:
        raise ValueError(f"tree masks are for {masks.incl.shape[0]} nodes, q has {q.shape[0]}")
    Q, K, V = (a.transpose(1, 0, 2) for a in (q, k, v))  # head-major [Hv, N, D]
    G, B = g.T, beta.T  # [Hv, N]
    prefix = G @ masks.incl_f32.T  # [Hv, N]
    diff = prefix[:, :, None] - prefix[:, None, :]  # [Hv, N, N]: prefix_i - prefix_j
    decay_incl = mx.exp(mx.where(masks.incl, diff, -mx.inf))
    decay_strict = mx.where(masks.strict, decay_incl, 0.0)
    A = B[:, :, None] * decay_strict * (K @ K.transpose(0, 2, 1))
    S0T = S0.transpose(0, 2, 1)  # [Hv, Dk, Dv]
    decay0 = mx.exp(prefix)[:, :, None]  # [Hv, N, 1]
    rhs = B[:, :, None] * (V - decay0 * (K @ S0T))
    U = _solve_unit_lower(A, rhs, masks.max_depth, solver or default_solver())
    O = decay0 * (Q @ S0T) + ((Q @ K.transpose(0, 2, 1)) * decay_incl) @ U
    return O.transpose(1, 0, 2), U.transpose(1, 0, 2)


def _fold(k: mx.array, u: mx.array, g: mx.array, S0: mx.array) -> mx.array:
    """State after a chain of rows k [L, Hv, Dk], u [L, Hv, Dv], g [L, Hv], from S0 (§5.5)."""
    cum = mx.cumsum(g, axis=0)  # [L, Hv] path prefix sums
    total = cum[-1]  # [Hv]
    w = mx.exp(total[None, :] - cum).T  # [Hv, L] ratio decays
    weighted_u = u.transpose(1, 2, 0) * w[:, None, :]  # [Hv, Dv, L]
    return mx.exp(total)[:, None, None] * S0 + weighted_u @ k.transpose(1, 0, 2)


def gdn_commit_fold(k, u, g, path: Sequence[int], S0) -> mx.array:
    """S after the accepted path (node indices root..leaf, root included) from verify innovations u.

    `path` must be a root-to-node chain of the tree (every ancestor listed).
    """
    k, g, S0 = _f32(k), _f32(g), _f32(S0)
    idx = mx.array(_check_path(path, k.shape[0]))
    return _fold(k[idx], _f32(u)[idx], g[idx], S0)


def gdn_commit_replay(k, v, g, beta, path: Sequence[int], S0) -> mx.array:
    """S after the accepted path by re-running the recurrence on its rows (equal to the fold)."""
    k, v, g, beta, S = (_f32(a) for a in (k, v, g, beta, S0))
    for i in _check_path(path, k.shape[0]):
        S, _ = _advance(S, k[i], v[i], g[i], beta[i])
    return S


def gdn_chunked(q, k, v, g, beta, S0, chunk: int = 64, solver: str | None = None) -> tuple[mx.array, mx.array]:
    """Chunked prefill: the dense form on chain masks of `chunk` rows. Returns o [T, Hv, Dv] and S_T."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    q, k, v, g, beta, S = _check_gdn(q, k, v, g, beta, S0)
    outs = []
    for start in range(0, q.shape[0], chunk):
        rows = slice(start, min(start + chunk, q.shape[0]))
        n = rows.stop - start
        o, u = gdn_tree_dense(q[rows], k[rows], v[rows], g[rows], beta[rows], chain_masks(n), S, solver)
        S = _fold(k[rows], u, g[rows], S)
        outs.append(o)
    return mx.concatenate(outs), S


def tree_conv_taps(parents: Sequence[int], kernel_size: int) -> np.ndarray:
    """int32 [N, K] row indices into concat(conv_state [K-1], x [N]) for each node's conv window.

    Tap K-1 is the node itself, tap K-1-m its m-th ancestor; once the walk
    passes the root it reads the committed conv state from its last row back.
    """
    if kernel_size < 2:
        raise ValueError(f"conv kernel size must be >= 2, got {kernel_size}")
    p = _check_parents(parents, len(parents))
    n, K = p.shape[0], kernel_size
    depth = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        depth[i] = depth[p[i]] + 1
    taps = np.empty((n, K), dtype=np.int32)
    node = np.arange(n)
    for m in range(K):
        taps[:, K - 1 - m] = np.where(m <= depth, K - 1 + node, K - 1 - (m - depth))
        node = np.where(node > 0, p[np.maximum(node, 0)], -1)
    return taps


def tree_conv(x, parents: Sequence[int] | None, conv_state, weight, taps: mx.array | None = None) -> mx.array:
    """silu(depthwise causal conv along each node's ancestor chain). x [N, C] pre-conv rows,
    conv_state [K-1, C], weight [C, K] (HF conv1d weight [C, 1, K] squeezed; tap K-1 = the node).
    taps: tree_conv_taps(parents, K) as an mx array, when the caller has it already."""
    x, conv_state, weight = _f32(x), _f32(conv_state), _f32(weight)
    if taps is None and parents is None:
        raise ValueError("tree_conv needs the parents or the precomputed taps")
    if weight.ndim != 2 or x.ndim != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"need x [N, C] and weight [C, K], got {x.shape} and {weight.shape}")
    K = weight.shape[1]
    if tuple(conv_state.shape) != (K - 1, x.shape[1]):
        raise ValueError(f"conv_state must be [{K - 1}, {x.shape[1]}], got {conv_state.shape}")
    taps = mx.array(tree_conv_taps(parents, K)) if taps is None else taps
    windows = mx.concatenate([conv_state, x])[taps]  # [N, K, C]
    y = (windows * weight.T[None]).sum(axis=1)
    return y * mx.sigmoid(y)


def conv_state_after(x, path: Sequence[int], conv_state) -> mx.array:
    """[K-1, C]: the last K-1 pre-conv rows along the accepted path, preceded by the old state."""
    x, conv_state = _f32(x), _f32(conv_state)
    rows = mx.concatenate([conv_state, x[mx.array(_check_path(path, x.shape[0]))]])
    return rows[rows.shape[0] - conv_state.shape[0]:]
