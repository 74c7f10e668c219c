"""Gated DeltaNet math on a chain of tokens, in plain MLX ops.

Layout (batch 1 squeezed): q, k [T, Hv, Dk] (L2-normalised, q scaled by Dk^-1/2, already
repeated from Hk to Hv heads), v [T, Hv, Dv], g [T, Hv] log-decay (<= 0), beta [T, Hv],
state S [Hv, Dv, Dk] float32 (element (v, k), as mlx-lm and uzu store it).

One step:  S = exp(g) S;  delta = beta (v - S k);  S = S + delta k^T;  o = S q.
The tree forms (verify without writing, commit fold, chunked prefill) live in gdn_tree.py.
"""

from __future__ import annotations

import mlx.core as mx

from engine import gdn_tree

L2_EPS = 1e-6


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


@mx.compile
def gdn_step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, S: mx.array):
    """One token. q, k [Hv, Dk]; v [Hv, Dv]; g, beta [Hv]; S [Hv, Dv, Dk] -> (o [Hv, Dv], S')."""
    S = mx.exp(g)[:, None, None] * S
    kv = (S @ k[:, :, None])[..., 0]  # [Hv, Dv]
    delta = beta[:, None] * (v - kv)
    S = S + delta[:, :, None] * k[:, None, :]
    o = (S @ q[:, :, None])[..., 0]
    return o, S


def causal_conv(x: mx.array, conv_state: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv + SiLU along a chain.

    x [T, C] pre-conv rows, conv_state [K-1, C] (the last K-1 pre-conv rows), weight [C, K]
    (tap K-1 is the token itself) -> (y [T, C], new conv_state [K-1, C]).
    """
    K = weight.shape[1]
    T = x.shape[0]
    window = mx.concatenate([conv_state.astype(x.dtype), x], axis=0)  # [K-1+T, C]
    y = window[0:T] * weight[:, 0]
    for j in range(1, K):
        y = y + window[j : j + T] * weight[:, j]
    return y * mx.sigmoid(y), window[T:]


PREFILL_CHUNK = 32  # rows per dense WY block; 32 measured a little faster than 64 on CPU


def gdn_chain(q, k, v, g, beta, S):
    """A chain of T tokens from state S -> (o [T, Hv, Dv], S_T). One token: a single step;
    more: the chunked dense form (its per-token twin is gdn_tree.gdn_sequential)."""
    if q.shape[0] == 1:
        o, S = gdn_step(q[0], k[0], v[0], g[0], beta[0], S)
        return o[None], S
    return gdn_tree.gdn_chunked(q, k, v, g, beta, S, chunk=PREFILL_CHUNK)
