"""A decoder layer's decode step written with the engine's CUDA kernels only, so that it can run
launch by launch or be recorded into launch plans (engine/launch_plan.py): a Gated DeltaNet layer's
whole step as one plan, a gated-attention layer's as two around its KV cache (below).

The step, one token x [1, 1, H], nine launches (eight with kernels.GATED_STEP on: gdn_step and
gated_norm in one):

    n     = rms_norm(x)                 the input norm (the engine's kernel, not MLX's)
    y     = in_proj(n)                  qkv | z | b | a, one fused 4-bit product
    o, conv_state, S = gdn_step(...)    the short conv, the gates and the recurrence
    g     = gated_norm(o, z)            (with GATED_STEP, in gdn_step's SPR_GATED_OUT build)
    h     = x + out_proj(g)             the residual add in the product's launch
    n2    = rms_norm(h)
    gu    = gate_up(n2)
    a     = silu(gate) * up             the engine's SwiGLU kernel
    out   = h + down(a)

-> (out, conv_state, S). The launches the model's GDN layers make in the launch-plan wiring
(engine/models/qwen3_5.py with engine/launch_plan.py's switch on: the residual builds, the gated
norm kernel, fused_qmm.KernelNorm and the SwiGLU kernel), with the same shapes, written out here
with the weights as plain arrays (`of_decoder`): so a verify's rows, launched one by one by the
model, compute what the decode step's plan computes, and the plan's decode equals the wiring's
launch by launch bit for bit (tests/engine/test_qlinear.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine import fused_norms
from engine.gdn.core import GDNShape, GDNWeights
from engine.kernels import FastPath, KernelCore, gated_step_applies
from engine.launch_plan import Buf, LaunchPlan, columns, record
from engine.models import fused_qmm
from engine.qmm import mma_covers, quantized_matmul_mma


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
        normal = _normals(seed, dtype)
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
        return _evaluated(layer)


def _normals(seed: int, dtype: mx.Dtype) -> Callable[..., mx.array]:
    """normal(*dims, scale=1.0): random weights of `dtype`, each call from the next key of `seed`."""
    key = mx.random.key(seed)

    def normal(*dims: int, scale: float = 1.0) -> mx.array:
        nonlocal key
        key, this = mx.random.split(key)
        return (mx.random.normal(dims, key=this) * scale).astype(dtype)

    return normal


def _evaluated(layer: Any) -> Any:
    """A random layer's weights evaluated, then the layer."""
    fields = vars(layer).values()
    mx.eval(*[v for v in fields if isinstance(v, mx.array)],
            *[a for v in fields if isinstance(v, Quantized) for a in (v.w, v.scales, v.biases)])
    return layer


def _product(x: Any, q: Quantized, res: Any = None) -> Any:
    return quantized_matmul_mma(x, q.w, q.scales, q.biases, q.group_size, q.bits, res=res)


def gdn_decode_step(layer: GDNLayer, x: Any, conv_state: Any, S: Any) -> tuple[Any, Any, Any]:
    """One token through the layer (see the module's doc): x [1, 1, H], conv_state [K - 1,
    conv_dim], S [Hv, Dv, Dk] float32 -> (out [1, 1, H], conv_state, S). Arrays or, while a plan
    records, its placeholders."""
    s = layer.shape
    hidden = x.shape[-1]
    rows = x.reshape(1, hidden)
    y = _product(fused_norms.rms_rows(rows, layer.in_norm, layer.eps, backend="cuda"), layer.in_proj)
    c, v = s.conv_dim, s.value_dim
    qkv, z = columns(y, 0, c), columns(y, c, c + v)
    b, a = columns(y, c + v, c + v + s.Hv), columns(y, c + v + s.Hv, c + v + 2 * s.Hv)
    core, w = KernelCore("cuda"), GDNWeights(layer.conv, layer.A_log, layer.dt_bias)
    if gated_step_applies(core, s, qkv, conv_state, z, layer.out_norm):
        g, conv_state, S = core.step_gated(s, w, qkv, a, b, conv_state, S, z, layer.out_norm, layer.eps)
    else:
        o, conv_state, S = core.step(s, w, qkv, a, b, conv_state, S)
        g = fused_norms.gated_norm(o, z, layer.out_norm, layer.eps, backend="cuda")
    h = _product(g.reshape(1, v), layer.out_proj, res=rows)
    out = mlp_rows(h, layer.post_norm, layer.gate_up, layer.down, layer.eps)
    return out.reshape(1, 1, hidden), conv_state, S


def mlp_rows(h: Any, norm: mx.array, gate_up: Quantized, down: Quantized, eps: float) -> Any:
    """h + down(silu(gate) * up) of norm(h) for rows h [M, H]: a layer's second half, four launches
    (the norm, gate|up, the SwiGLU, down with the residual add)."""
    gu = _product(fused_norms.rms_rows(h, norm, eps, backend="cuda"), gate_up)
    return _product(fused_norms.swiglu(gu, backend="cuda"), down, res=h)


def of_decoder(layer: Any) -> GDNLayer | None:
    """A GDN DecoderLayer's weights (engine/models/qwen3_5.py) as its decode step's plan reads them,
    or None where the plan's products do not apply: the input projections and gate|up fused, every
    projection a routed affine quantized one, the three norms with one epsilon."""
    gdn, mlp = layer.linear_attn, layer.mlp
    if "fused" not in gdn or "fused" not in mlp:
        return None
    parts = [fused_qmm.quantized_weights(p) for p in (gdn["fused"], gdn.out_proj, mlp["fused"], mlp.down_proj)]
    eps = {layer.input_layernorm.eps, gdn.norm.eps, layer.post_attention_layernorm.eps}
    if any(p is None for p in parts) or len(eps) != 1:
        return None
    in_proj, out_proj, gate_up, down = (Quantized(*p) for p in parts if p is not None)
    return GDNLayer(shape=gdn.shape, in_norm=layer.input_layernorm.weight, in_proj=in_proj, conv=gdn.conv1d.weight,
                    A_log=gdn.A_log, dt_bias=gdn.dt_bias, out_norm=gdn.norm.weight, out_proj=out_proj,
                    post_norm=layer.post_attention_layernorm.weight, gate_up=gate_up, down=down, eps=eps.pop())


def covers(layer: GDNLayer, hidden: int, dtype: mx.Dtype) -> bool:
    """Whether every launch of the step applies to rows of `dtype` (and a conv state of it, which
    the plan's call checks): the checks each wrapper's caller makes before launching it."""
    s = layer.shape
    # placeholders stand for the rows: the checks read shapes and dtypes only
    row: Any = Buf(-1, 0, (1, hidden), dtype)
    o: Any = Buf(-1, 0, (1, s.Hv, s.Dv), mx.float32)
    z: Any = Buf(-1, 0, (1, s.value_dim), dtype)

    def mma(width: int, q: Quantized) -> bool:
        rows: Any = Buf(-1, 0, (1, width), dtype)
        return mma_covers(rows, q.w, q.scales, q.biases, q.group_size, q.bits)

    return (KernelCore.covers(s)
            and fused_norms.rows_cover(row, layer.in_norm) and fused_norms.rows_cover(row, layer.post_norm)
            and fused_norms.gated_covers(o, z, layer.out_norm)
            and mma(hidden, layer.in_proj) and mma(s.value_dim, layer.out_proj) and mma(hidden, layer.gate_up)
            and mma(layer.down.w.shape[1] * 32 // layer.down.bits, layer.down))


def make_plan(layer: GDNLayer, hidden: int, dtype: mx.Dtype) -> LaunchPlan:
    """The step's launch plan for rows of `dtype` (conv state the same dtype, state float32)."""
    s = layer.shape
    with record("gdn-decode-step") as rec:
        results = gdn_decode_step(layer, rec.arg((1, 1, hidden), dtype), rec.arg((s.K - 1, s.conv_dim), dtype),
                                  rec.arg((s.Hv, s.Dv, s.Dk), mx.float32))
    return rec.build(list(results))


# -- the gated-attention layers: two plans around the KV cache ------------------------------------

# The attention layers' plans and their wiring, with the launch plans (engine/launch_plan.py's
# SWITCH) on: opt-in (SPRUCE_ATTENTION_PLANS=1, variant "-ap1"). On an H100 they pass their tests
# and cut the host's share of a 9B-shaped step by 0.33 ms, but the step is bound by the device
# and plain decoding read 254.8 against 253.4 tok/s without them (BENCHMARKS.md, issue 13,
# forty-seventh session). Off, the attention layers keep the wiring before them while the GDN
# layers keep their plans.
ATTENTION = FastPath("SPRUCE_ATTENTION_PLANS")


@dataclass(frozen=True)
class AttentionLayer:
    """A gated-attention decoder layer's weights (Qwen3.5: q_proj emits per head [query | gate]),
    as its launch-plan steps read them."""

    heads: int
    kv_heads: int
    head_dim: int
    in_norm: mx.array  # [H]
    qkv: Quantized  # [heads * 2 D + 2 kv_heads * D, H]: q|gate per head, k, v
    q_norm: mx.array  # [D]
    k_norm: mx.array  # [D]
    o_proj: Quantized  # [H, heads * D]
    post_norm: mx.array  # [H]
    gate_up: Quantized  # [2 I, H]
    down: Quantized  # [H, I]
    eps: float = 1e-6
    head_eps: float = 1e-6

    @staticmethod
    def random(heads: int, kv_heads: int, head_dim: int, hidden: int, intermediate: int,
               dtype: mx.Dtype = mx.bfloat16, seed: int = 0, group_size: int = 64, bits: int = 4) -> AttentionLayer:
        """Random weights of the given shape (benchmarks, tests), scaled so activations stay O(1)."""
        normal = _normals(seed, dtype)
        width = heads * head_dim
        layer = AttentionLayer(
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, in_norm=normal(hidden, scale=0.1) + 1,
            qkv=Quantized.of(normal(2 * width + 2 * kv_heads * head_dim, hidden, scale=hidden ** -0.5), group_size,
                             bits),
            q_norm=normal(head_dim, scale=0.1) + 1, k_norm=normal(head_dim, scale=0.1) + 1,
            o_proj=Quantized.of(normal(hidden, width, scale=width ** -0.5), group_size, bits),
            post_norm=normal(hidden, scale=0.1) + 1,
            gate_up=Quantized.of(normal(2 * intermediate, hidden, scale=hidden ** -0.5), group_size, bits),
            down=Quantized.of(normal(hidden, intermediate, scale=intermediate ** -0.5), group_size, bits))
        return _evaluated(layer)


def attention_project_rows(layer: AttentionLayer, x: Any) -> tuple[Any, Any, Any, Any]:
    """The layer's first half up to the KV cache, three launches (the input norm, the fused
    q|gate, k, v projection, the head norms): x [1, T, H] -> (q [1, heads, T, D], k, v
    [1, kv_heads, T, D] before RoPE, gate [1, T, heads * D]). Arrays or, while a plan records, its
    placeholders."""
    T, hidden = x.shape[1], x.shape[2]
    y = _product(fused_norms.rms_rows(x.reshape(T, hidden), layer.in_norm, layer.eps, backend="cuda"), layer.qkv)
    return fused_norms.head_norms(y, layer.q_norm, layer.k_norm, layer.head_eps, layer.heads, layer.kv_heads,
                                  backend="cuda")


def attention_output_rows(layer: AttentionLayer, x: Any, attended: Any, gate: Any) -> Any:
    """The layer's second half after the attention, six launches (the output gate, o_proj with
    the residual add, then the MLP as mlp_rows): x [1, T, H], attended and gate [1, T, heads * D]
    -> the stream after the layer [1, T, H]."""
    T, hidden = x.shape[1], x.shape[2]
    width = layer.heads * layer.head_dim
    rows = x.reshape(T, hidden)
    g = fused_norms.sigmoid_gate(attended.reshape(T, width), gate.reshape(T, width), backend="cuda")
    h = _product(g, layer.o_proj, res=rows)
    return mlp_rows(h, layer.post_norm, layer.gate_up, layer.down, layer.eps).reshape(1, T, hidden)


def of_attention_decoder(layer: Any) -> AttentionLayer | None:
    """An attention DecoderLayer's weights as its plans read them, or None where they do not
    apply: an output gate, q|k|v and gate|up fused, every projection a routed affine quantized
    one, the layer's two norms with one epsilon and the head norms with one."""
    attn, mlp = layer.self_attn, layer.mlp
    if not attn.output_gate or "fused" not in attn or "fused" not in mlp:
        return None
    parts = [fused_qmm.quantized_weights(p) for p in (attn["fused"], attn.o_proj, mlp["fused"], mlp.down_proj)]
    eps = {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
    head_eps = {attn.q_norm.eps, attn.k_norm.eps}
    if any(p is None for p in parts) or len(eps) != 1 or len(head_eps) != 1:
        return None
    qkv, o_proj, gate_up, down = (Quantized(*p) for p in parts if p is not None)
    return AttentionLayer(heads=attn.heads, kv_heads=attn.kv_heads, head_dim=attn.head_dim,
                          in_norm=layer.input_layernorm.weight, qkv=qkv, q_norm=attn.q_norm.weight,
                          k_norm=attn.k_norm.weight, o_proj=o_proj, post_norm=layer.post_attention_layernorm.weight,
                          gate_up=gate_up, down=down, eps=eps.pop(), head_eps=head_eps.pop())


def attention_covers(layer: AttentionLayer, rows: int, hidden: int, dtype: mx.Dtype) -> bool:
    """Whether every launch of both halves applies to `rows` rows of `dtype`."""
    width = layer.heads * layer.head_dim
    row: Any = Buf(-1, 0, (rows, hidden), dtype)
    y: Any = Buf(-1, 0, (rows, layer.qkv.w.shape[0]), dtype)

    def mma(inputs: int, q: Quantized) -> bool:
        x: Any = Buf(-1, 0, (rows, inputs), dtype)
        return mma_covers(x, q.w, q.scales, q.biases, q.group_size, q.bits)

    return (fused_norms.rows_cover(row, layer.in_norm) and fused_norms.rows_cover(row, layer.post_norm)
            and fused_norms.heads_cover(y, layer.q_norm, layer.k_norm, layer.heads, layer.kv_heads)
            and mma(hidden, layer.qkv) and mma(width, layer.o_proj) and mma(hidden, layer.gate_up)
            and mma(layer.down.w.shape[1] * 32 // layer.down.bits, layer.down))


@dataclass(frozen=True)
class AttentionPlans:
    """An attention layer's decode step as two plans: up to the KV cache (x -> q, k, v, gate) and
    after the attention ((x, attended, gate) -> the stream). The cache write, RoPE (whose position
    changes every step) and the attention itself run between them as MLX operations."""

    project: LaunchPlan
    output: LaunchPlan


def make_attention_plans(layer: AttentionLayer, hidden: int, dtype: mx.Dtype) -> AttentionPlans:
    width = layer.heads * layer.head_dim
    with record("attention-project") as rec:
        results = attention_project_rows(layer, rec.arg((1, 1, hidden), dtype))
    project = rec.build(list(results))
    with record("attention-output") as rec:
        out = attention_output_rows(layer, rec.arg((1, 1, hidden), dtype), rec.arg((1, 1, width), dtype),
                                    rec.arg((1, 1, width), dtype))
    return AttentionPlans(project, rec.build([out]))


def plan_for(decoder: Any, dtype: mx.Dtype) -> LaunchPlan | AttentionPlans | None:
    """A DecoderLayer's decode-step plans for rows of `dtype` (a GDN layer's one, an attention
    layer's two), or None where they do not apply."""
    hidden = decoder.input_layernorm.weight.shape[0]
    if decoder.is_attention:
        attention = of_attention_decoder(decoder)
        if attention is None or not attention_covers(attention, 1, hidden, dtype):
            return None
        return make_attention_plans(attention, hidden, dtype)
    layer = of_decoder(decoder)
    return make_plan(layer, hidden, dtype) if layer is not None and covers(layer, hidden, dtype) else None
