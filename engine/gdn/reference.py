"""The slow obvious twins of the GDN forms: one delta-rule step at a time.

Used by the tests and the benchmarks to hold the dense forms (engine/gdn/ops.py) and the kernels
(engine/kernels.py) to the definition; nothing on the serving path calls them.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.gdn.ops import check_gdn, check_parents, check_path, f32


def advance(S: mx.array, k, v, g, beta) -> tuple[mx.array, mx.array]:
    """One delta-rule step for all heads: S [Hv, Dv, Dk], k [Hv, Dk], v [Hv, Dv], g/beta [Hv]
    -> (S', innovation u [Hv, Dv])."""
    S = mx.exp(g)[:, None, None] * S
    kv = (S @ k[:, :, None])[..., 0]  # [Hv, Dv]
    u = beta[:, None] * (v - kv)
    return S + u[:, :, None] * k[:, None, :], u


def read(S: mx.array, q: mx.array) -> mx.array:
    return (S @ q[:, :, None])[..., 0]  # [Hv, Dv]


def tree_sequential(q, k, v, g, beta, parents: Sequence[int], S0) -> tuple[mx.array, mx.array]:
    """Per-node loop: node i starts from its parent's state. Returns o, u [N, Hv, Dv]."""
    q, k, v, g, beta, S0 = check_gdn(q, k, v, g, beta, S0)
    parents_arr = check_parents(parents, q.shape[0])
    states: list[mx.array] = []
    outs, innovations = [], []
    for i, p in enumerate(parents_arr):
        S, u = advance(S0 if p < 0 else states[p], k[i], v[i], g[i], beta[i])
        states.append(S)
        outs.append(read(S, q[i]))
        innovations.append(u)
    return mx.stack(outs), mx.stack(innovations)


def sequential(q, k, v, g, beta, S0) -> tuple[mx.array, mx.array]:
    """Plain per-token recurrence over a sequence. Returns o [T, Hv, Dv] and the final state S_T."""
    q, k, v, g, beta, S = check_gdn(q, k, v, g, beta, S0)
    outs = []
    for t in range(q.shape[0]):
        S, _ = advance(S, k[t], v[t], g[t], beta[t])
        outs.append(read(S, q[t]))
    return mx.stack(outs), S


def commit_replay(k, v, g, beta, path: Sequence[int], S0) -> mx.array:
    """S after the accepted path by re-running the recurrence on its rows (equal to the fold)."""
    k, v, g, beta, S = (f32(a) for a in (k, v, g, beta, S0))
    for i in check_path(path, k.shape[0]):
        S, _ = advance(S, k[i], v[i], g[i], beta[i])
    return S
