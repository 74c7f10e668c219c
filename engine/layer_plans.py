"""A Gated DeltaNet decoder layer's decode step written with the engine's CUDA kernels only, so
that it can run launch by launch or be recorded into one launch plan (engine/launch_plan.py).

The step, one token, residual pending (the layer is handed the previous layer's input x and its
not yet added output delta, and hands on its own the same way): eight launches,

    h, n  = add_norm(x, delta)          the residual add and the input norm
    y     = in_proj(n)                  qkv | z | b | a, one fused 4-bit product
    o, conv_state, S = gdn_step(...)    the short conv, the gates and the recurrence
    g     = gated_norm(o, z)
    attn  = out_proj(g)
    h2, n2 = add_norm(h, attn)          the residual add and the post norm
    gu    = gate_up(n2)
    mlp   = down(silu(gate) * up)       SwiGLU in the product's prologue

-> (h2, mlp, conv_state, S). The same kernels and builds as the engine's opt-in pending-residual
wiring (engine/fused_norms.py, engine/models/fused_qmm.py), written out here with the weights as
plain arrays. Not yet the engine's decode path: the measurement of what a plan saves comes first
(scripts/bench_launch_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine import fused_norms
from engine.gdn.core import GDNShape, GDNWeights
from engine.kernels import KernelCore
from engine.launch_plan import columns
from engine.qmm import quantized_matmul_mma


@dataclass(frozen=True)
class Quantized:
    """An affine quantized weight [O, I] (MLX's packing)."""

    w: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int

    @staticmethod
    def of(dense: mx.array, group_size: int = 64, bits: int = 4) -> Quantized:
        w, scales, biases = mx.quantize(dense, group_size=group_size, bits=bits)
        return Quantized(w, scales, biases, group_size, bits)


@dataclass(frozen=True)
class GDNLayer:
    """A GDN decoder layer's weights, as its decode step reads them."""

    shape: GDNShape
    in_norm: mx.array  # [H]
    in_proj: Quantized  # [conv_dim + value_dim + 2 Hv, H]: qkv | z | b | a
    conv: mx.array  # [conv_dim, K]
    A_log: mx.array  # [Hv]
    dt_bias: mx.array  # [Hv]
    out_norm: mx.array  # [Dv]
    out_proj: Quantized  # [H, value_dim]
    post_norm: mx.array  # [H]
    gate_up: Quantized  # [2 I, H]
    down: Quantized  # [H, I]
    eps: float = 1e-6

    @staticmethod
    def random(shape: GDNShape, hidden: int, intermediate: int, dtype: mx.Dtype = mx.bfloat16, seed: int = 0,
               group_size: int = 64, bits: int = 4) -> GDNLayer:
        """Random weights of the given shape (benchmarks, tests), scaled so activations stay O(1)."""
        keys = iter(mx.random.split(mx.random.key(seed), 12))

        def normal(*dims: int, scale: float = 1.0) -> mx.array:
            return (mx.random.normal(dims, key=next(keys)) * scale).astype(dtype)

        s = shape
        width = s.conv_dim + s.value_dim + 2 * s.Hv
        layer = GDNLayer(
            shape=s, in_norm=normal(hidden, scale=0.1) + 1,
            in_proj=Quantized.of(normal(width, hidden, scale=hidden ** -0.5), group_size, bits),
            conv=normal(s.conv_dim, s.K, scale=0.5), A_log=normal(s.Hv, scale=0.5).astype(mx.float32),
            dt_bias=normal(s.Hv, scale=0.5).astype(mx.float32), out_norm=normal(s.Dv, scale=0.1) + 1,
            out_proj=Quantized.of(normal(hidden, s.value_dim, scale=s.value_dim ** -0.5), group_size, bits),
            post_norm=normal(hidden, scale=0.1) + 1,
            gate_up=Quantized.of(normal(2 * intermediate, hidden, scale=hidden ** -0.5), group_size, bits),
            down=Quantized.of(normal(hidden, intermediate, scale=intermediate ** -0.5), group_size, bits))
        mx.eval(*[v for v in vars(layer).values() if isinstance(v, mx.array)],
                *[a for v in vars(layer).values() if isinstance(v, Quantized) for a in (v.w, v.scales, v.biases)])
        return layer


def _product(x: Any, q: Quantized, swiglu: bool = False) -> Any:
    return quantized_matmul_mma(x, q.w, q.scales, q.biases, q.group_size, q.bits, swiglu=swiglu)


def gdn_decode_step(layer: GDNLayer, x: Any, delta: Any, conv_state: Any, S: Any) -> tuple[Any, Any, Any, Any]:
    """One token through the layer (see the module's doc): x, delta [1, 1, H], conv_state
    [K - 1, conv_dim], S [Hv, Dv, Dk] float32 -> (h2, mlp [1, 1, H], conv_state, S). Arrays or,
    while a plan records, its placeholders."""
    s = layer.shape
    hidden = x.shape[-1]
    h, n = fused_norms.add_norm(x, delta, layer.in_norm, layer.eps, backend="cuda")
    y = _product(n.reshape(1, hidden), layer.in_proj)
    c, v = s.conv_dim, s.value_dim
    qkv, z = columns(y, 0, c), columns(y, c, c + v)
    b, a = columns(y, c + v, c + v + s.Hv), columns(y, c + v + s.Hv, c + v + 2 * s.Hv)
    o, conv_state, S = KernelCore("cuda").step(s, GDNWeights(layer.conv, layer.A_log, layer.dt_bias), qkv, a, b,
                                               conv_state, S)
    g = fused_norms.gated_norm(o, z, layer.out_norm, layer.eps, backend="cuda")
    attn = _product(g.reshape(1, v), layer.out_proj).reshape(1, 1, hidden)
    h2, n2 = fused_norms.add_norm(h, attn, layer.post_norm, layer.eps, backend="cuda")
    gu = _product(n2.reshape(1, hidden), layer.gate_up)
    mlp = _product(gu, layer.down, swiglu=True).reshape(1, 1, hidden)
    return h2, mlp, conv_state, S
