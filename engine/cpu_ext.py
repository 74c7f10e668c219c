"""The engine's own CPU operations (engine/cpu_ext.cpp), built on first use and loaded into MLX.

MLX's Python API registers kernels for Metal and CUDA only; on the CPU a computation is a graph of
MLX's operations, each a scalar loop with a few microseconds of scheduling. The C++ file defines
MLX primitives with their CPU evaluations and nanobind bindings in MLX's own nanobind domain, so
they take and return mx.array and join MLX's graphs (mx.compile included):
- `rows_attention`: a decode step's or a verify's attention (engine/models/layers.py);
- `draft_attention`: the MTP head's drafted row (engine/models/mtp.py);
- `causal_attention`: a prefill chunk's attention (engine/models/layers.py);
- `gdn_step`, `gdn_chain`, `gdn_tree`, `gdn_commit`: the GDN core (engine/gdn/core.py CpuCore);
- `softmax_rows`: a softmax over rows, masked or not (engine/cpu_exp.py softmax_rows: attention in
  MLX's operations);
- `rms_norm`: the RMS norms (engine/models/layers.py RMSNorm, gated_deltanet.py GatedRMSNorm);
- `rope`: the rotary embedding (engine/models/layers.py apply_rope);
- `mlp_block`: a decoder layer's residual add, norm and MLP (engine/models/qwen3_5.py);
- `norm_products`: a mixer's input norm and the products that read it (qwen3_5.py, layers.py);
- `mtp_chain`: an MTP head's chain draft, every depth in one operation (engine/drafters/mtp_steps.py
  CpuChain);
- `choose_rows`: each row's token, greedy or the seeded draw, and the target's top-token probability
  (engine/device_sampler.py);
- `penalize_rows`: a request's logit bias and penalties (engine/device_penalties.py).
Each has a module switch below (scripts/variants.py names them) and a twin in MLX's operations that
its tests hold it to (tests/engine/test_cpu_*.py).

Building (engine/native_build.py) needs a C++20 compiler, Python's headers, MLX's headers and
library (in its wheel) and nanobind's sources; a nanobind whose internals do not match MLX's shows
at the self-test below. It takes ~6-10 s once per user, cached like the GEMV shim. Linux only:
elsewhere the CPU is not where MLX runs the engine. Without any of it, or with SPRUCE_CPU_EXT=0,
`module()` is None and the callers keep MLX's operations.

Built with -march=native: the cache name carries the CPU's feature flags, so a cache shared by
different machines holds one build each. And with -ffp-contract=off: a product and a sum fused into
one rounding in one place and not in another would make the same key weigh differently in a
decode step and in a verify (engine/cpu_ext.cpp says why they must not).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np

from engine import native_build

SOURCE = Path(__file__).with_name("cpu_ext.cpp")
NAME = "spruce_cpu_ext"
OPT_OUT = "SPRUCE_CPU_EXT"  # "0": never built nor used
ATTENTION = True  # module switch, read per call: False = attention in MLX's operations (variant ca0)
# what rows_attention reads keys and values as: a float32 cache, or a half or 8-bit one (engine/cache.py
# KVCache.dtype; int8: packed rows, engine/kv_int8.py), each element widened in the load
KV_DTYPES = (mx.float32, mx.float16, mx.bfloat16, mx.int8)
# module switch, read when a layer's compiled functions trace (part of their key): False = a GDN
# layer's token step in MLX's operations (variant cg0)
GDN_STEP = True
# module switch, read when a layer's compiled functions trace (part of their key): False = a GDN
# layer's tree verify and commit in MLX's operations (OpsCore's dense form; variant ct0)
GDN_TREE = True
# module switch, read per call: False = a prefill's chain through a GDN layer's core in MLX's
# operations (OpsCore's chunked dense form; variant cc0)
GDN_CHAIN = True
# module switch, read when a layer's compiled functions trace (part of their key): False = RMS norms
# through mx.fast.rms_norm (on the CPU three operations; variant cn0)
NORMS = True
# module switch, read when a layer's compiled functions trace (part of their key): False = a
# decode step's or a verify's MLP block in MLX's operations (variant cf0)
MLP = True
# module switch, read when a layer's compiled functions trace (part of their key): False = a
# decode step's or a verify's mixer input norm and projections in MLX's operations (variant cp0)
PRODUCTS = True
# module switch, read per call (and when an MTP draft step traces): False = RoPE through MLX's
# rope, compiled (on the CPU ~15 graph nodes; variant cr0)
ROPE = True
# module switch, read when an MTP drafter is made: False = its chains drafted depth by depth in
# MLX's operations (engine/drafters/mtp_steps.py CompiledDepths; variant cm0)
MTP_CHAIN = True
# module switch, read per call: False = a half cache's attention scores loaded once a query head
# (scores16) instead of once for all the query heads of their K/V head (scores16_heads; the same
# bits; variant kh0)
KV_HEADS_TOGETHER = True
# module switch, read per call: False = the sampler's choice and top-token probability, and a
# request's bias and penalties, in MLX's operations (engine/device_sampler.py,
# engine/device_penalties.py; variant cs0)
CHOOSE = True
# module switch, read per call: False = a top-k draw computes 2^y of every logit (choose_rows' full
# pass, its twin) instead of only those that can reach the k-th largest (variant cw0)
NARROW_TOP_K = True
# module switch, read per call: False = a sampled tree's node drawn as the accept walk visits it in a
# graph of its own (penalize_rows, choose_rows) instead of at once on the host (draw_now), and a
# tree's accepted rows' top-token probability in NumPy instead of top_rows_now (variant dn0)
DRAW_NOW = True
# module switch, read per call (and when a compiled function that calls it traces): False = a
# softmax over float32 rows in MLX's operations (engine/cpu_exp.py; variant cx0) instead of
# softmax_rows: attention in operations (a DFlash block's, a prefill chunk's, the MTP head's
# scratch rows)
SOFTMAX = True
# module switch, read per call: False = a prefill chunk's attention in MLX's operations (two GEMMs
# around softmax_rows) or, past CHUNK_OPS_SCORES, MLX's fused kernel (variant cq0)
CAUSAL = True


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _self_test(module: ModuleType) -> bool:
    """Whether the loaded extension takes MLX's arrays (nanobind's internals shared with MLX's) and
    agrees with a float64 reference on a small case: 6 heads over 2 K/V heads, 3 rows, a tree."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 6, 3, 64), (1, 2, 7, 64), (1, 2, 7, 64)))
    seen = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)
    with mx.stream(mx.cpu):
        out = np.array(module.rows_attention(mx.array(q), mx.array(k), mx.array(v), 0.125, 4, mx.array(seen)))
    mask = np.concatenate([np.ones((3, 4), dtype=bool), seen], axis=1)
    kk, vv = np.repeat(k, 3, axis=1).astype(np.float64), np.repeat(v, 3, axis=1).astype(np.float64)
    s = np.where(mask, q.astype(np.float64) @ kk.swapaxes(-1, -2) * 0.125, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vv
    return bool(np.allclose(out, want, rtol=1e-5, atol=1e-6))


def module() -> ModuleType | None:
    """The loaded extension, built on first use; None where switched off, not buildable, or its
    self-test fails (each said once in the log)."""
    return _once.get()


def _open() -> ModuleType | None:
    if os.environ.get(OPT_OUT, "1") == "0" or platform.system() != "Linux":
        return None
    return native_build.open_extension(SOURCE, NAME, ["-march=native", "-ffp-contract=off"], _self_test,
                                       "the engine's CPU operations", "MLX's operations run instead",
                                       key=_cpu_flags().encode())


_once = native_build.Once(_open)


def serves(switch: bool, *arrays: mx.array) -> bool:
    """Whether an operation of this module serves these arrays: its switch on (one of the module's
    flags above, read by the caller when it asks), float32 arrays on the CPU, the extension built."""
    return switch and all(a.dtype == mx.float32 for a in arrays) and mx.default_device() == mx.cpu \
        and module() is not None


@functools.cache
def supports(heads_per_kv: int, head_dim: int) -> bool:
    """Whether rows_attention is built for this many query heads a K/V head and this head size."""
    ext = module()
    return ext is not None and bool(ext.rows_attention_supports(heads_per_kv, head_dim))


@functools.cache
def supports_causal(head_dim: int) -> bool:
    """Whether causal_attention is built for this head size."""
    ext = module()
    return ext is not None and bool(ext.causal_attention_supports(head_dim))


def rows_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, prefix: int,
                   seen: mx.array | None = None) -> mx.array:
    """q [1, H, N, D] (float32) over keys / values [1, Hkv, L, D] (one of KV_DTYPES, both the same;
    int8: packed rows [1, Hkv, L, D + 4], engine/kv_int8.py):
    every row sees the first `prefix` keys and, of the L - prefix after them, those its row of
    `seen` [N, L - prefix] marks (all where None, with prefix = L) -> [1, H, N, D]. Half and 8-bit
    keys and values give their float32 copies' bits. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    return ext.rows_attention(q, keys, values, scale, prefix, seen, KV_HEADS_TOGETHER)


def causal_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """A prefill chunk's attention: q [1, H, T, D], keys / values [1, Hkv, L, D] with L >= T, the T
    rows being the last T positions of the L keys, each seeing the keys up to its own -> [1, H, T,
    D]. serves() first. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    return ext.causal_attention(q, keys, values, scale)


def gdn_step(qkv: mx.array, a: mx.array, b: mx.array, conv_state: mx.array, S: mx.array, conv_w: mx.array,
             A_log: mx.array, dt_bias: mx.array, Hk: int, Dk: int) -> tuple[mx.array, mx.array, mx.array]:
    """One token of a GDN layer's recurrent core (engine/gdn/core.py OpsCore.step's arithmetic):
    qkv [1, C], a, b [1, Hv], conv_state [K-1, C], S [Hv, Dv, Dk], conv_w [C, K], A_log, dt_bias
    [Hv] -> (o [1, Hv, Dv], conv state, S), float32. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    o, conv, state = ext.gdn_step(qkv, a, b, conv_state, S, conv_w, A_log, dt_bias, Hk, Dk)
    return o, conv, state


def gdn_chain(qkv: mx.array, a: mx.array, b: mx.array, conv_state: mx.array, S: mx.array, conv_w: mx.array,
              A_log: mx.array, dt_bias: mx.array, Hk: int, Dk: int) -> tuple[mx.array, mx.array, mx.array]:
    """A prefill's chain of T tokens through a GDN layer's core, token by token with gdn_step's
    arithmetic: qkv [T, C], a, b [T, Hv], conv_state [K-1, C], S [Hv, Dv, Dk] -> (o [T, Hv, Dv],
    conv state, S), float32. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    o, conv, state = ext.gdn_chain(qkv, a, b, conv_state, S, conv_w, A_log, dt_bias, Hk, Dk)
    return o, conv, state


def gdn_tree(x: mx.array, a: mx.array, b: mx.array, taps: mx.array, conv_state: mx.array, S0: mx.array,
             conv_w: mx.array, A_log: mx.array, dt_bias: mx.array, Hk: int,
             Dk: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A tree's verify through a GDN layer's core, node by node from the committed states (never
    written): x [N, C], a, b [N, Hv], taps [N, K] int32, conv_state [K-1, C], S0 [Hv, Dv, Dk] ->
    (o [N, Hv, Dv], k [N, Hv, Dk], u [N, Hv, Dv], g [N, Hv]). See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    o, k, u, g = ext.gdn_tree(x, a, b, taps, conv_state, S0, conv_w, A_log, dt_bias, Hk, Dk)
    return o, k, u, g


def gdn_commit(k: mx.array, u: mx.array, g: mx.array, path: mx.array, S0: mx.array) -> mx.array:
    """The state after an accepted path (int32 node indices root first; -1 entries skipped) of a
    verified tree's rows, by the update a token's step makes."""
    ext = module()
    assert ext is not None, "serves() first"
    return ext.gdn_commit(k, u, g, path, S0)


def draft_attention(q: mx.array, keys: mx.array, values: mx.array, length: mx.array, skeys: mx.array,
                    svalues: mx.array, j: mx.array, scale: float) -> mx.array:
    """A drafted row's attention (engine/models/mtp.py scratch_attention): q [1, H, N, D] over rows
    [0, length) of keys / values [1, Hkv, cap, D] and rows [0, j] of the scratch [1, Hkv, S, D]
    (length, j int32 scalars, read when it runs) -> [1, H, N, D]: the MTP head's drafted row (N = 1),
    a DFlash block's rows (the block as the scratch). See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    return ext.draft_attention(q, keys, values, length.astype(mx.int32), skeys, svalues, j.astype(mx.int32), scale)


def softmax_rows(x: mx.array, mask: mx.array | None = None) -> mx.array:
    """Softmax over x's last axis (float32; entries of -inf weigh 0); mask: bool [N, L], x's last
    two axes, False entries weigh 0 too. serves() first. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    return ext.softmax_rows(x, mask)


def rms_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """x / rms(x) * w over the last axis: the engine's own CPU operation for float32 rows (switched
    on and built), else mx.fast.rms_norm."""
    ext = module() if serves(NORMS, x, w) else None
    return mx.fast.rms_norm(x, w, eps) if ext is None else ext.rms_norm(x, w, eps)


def norm_products(x: mx.array, weights: list[mx.array], norm_w: mx.array | None = None,
                  eps: float = 0.0) -> list[mx.array]:
    """Rows x [M, K], RMS-normed by norm_w [K] (eps) where given, times each weight [N_i, K]
    transposed -> [M, N_i] each: bitwise the norm's and the matmuls' results. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    return list(ext.norm_products(x, norm_w, eps, weights))


def mlp_block(x: mx.array, out: mx.array, norm_w: mx.array, gate_w: mx.array, up_w: mx.array, down_w: mx.array,
              eps: float) -> mx.array:
    """h + down(SiLU(gate(n)) * up(n)) with h = x + out and n = h's RMS norm (norm_w, eps), rows
    [..., H], weights [I, H] / [I, H] / [H, I] -> [..., H]. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    return ext.mlp_block(x, out, norm_w, gate_w, up_w, down_w, eps)


def rope(x: mx.array, dims: int, base: float, offset: int | mx.array = 0,
         positions: mx.array | None = None) -> mx.array:
    """x [B, H, T, D] float32 rotated over its first `dims` (MLX's non-traditional RoPE, scale 1):
    row t at position offset + t (an int, or an int32 scalar array read when it runs), or at
    positions[t] (int32 [T]) -> [B, H, T, D]. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    off = offset.astype(mx.int32).reshape(1) if isinstance(offset, mx.array) else mx.array([offset], dtype=mx.int32)
    return ext.rope(x, dims, base, off, positions if positions is None else positions.astype(mx.int32))


def mtp_chain(y: mx.array, embed: mx.array, lm: mx.array, vocab_ids: mx.array | None, weights: list[mx.array],
              keys: mx.array, values: mx.array, length: int, *, heads: int, head_dim: int, rope_dims: int,
              rope_base: float, eps: float, scale: float, k: int, depth: int, log_min_path: float,
              rows: tuple[mx.array, mx.array] | None = None,
              draws: ChainDraws | None = None) -> tuple[mx.array, ...]:
    """An MTP head's chain draft in one operation: from the head's output y [H] of the last
    committed row, `depth` depths (fewer where the top-1 path's log-probability falls below
    log_min_path), each read through the lm_head rows `lm` [N, H] (token ids `vocab_ids` [N], or
    row i is token i) and drafted on from its argmax -> (ids int32 [depth, k], logp [depth, k], the
    depths reached int32 [1]). `weights`: the head's 15 (engine/drafters/mtp_steps.py CpuChain
    lists them); keys / values [1, Hkv, cap, D], rows [0, length) committed.
    With `rows` = (token ids int32 [T], hidden states [T, H]) of T positions committed from
    `length` on, the head's catch-up of them runs first and y is not read: three more outputs, their
    keys and values [1, Hkv, T, D] and the last one's output [1, 1, H]. With `draws`, each depth's
    chain token is the one a draw at its uniform takes from the head's distribution under the
    request's settings, not the argmax. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    ids, hidden = rows if rows is not None else (None, None)
    extra = () if draws is None else (draws.uniforms, draws.temperature, draws.top_k, draws.top_p)
    return tuple(ext.mtp_chain(y.reshape(-1), embed, lm, vocab_ids, weights, keys, values,
                               mx.array([length], dtype=mx.int32), ids, hidden, heads, head_dim, rope_dims,
                               rope_base, eps, scale, k, depth, log_min_path, *extra))


@dataclass(frozen=True)
class ChainDraws:
    """Where the target samples, how an MTP chain guesses each depth's token: by a draw at the
    uniform the target's own draw at that position will use (uniforms float32 [>= depth]), under the
    request's temperature, top-k and top-p (engine/cpu_ext.cpp coupled_row)."""

    uniforms: mx.array
    temperature: float
    top_k: int
    top_p: float


def choose_rows(logits: mx.array, uniforms: mx.array | None, temperature: float, raw: mx.array | None = None,
                top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> tuple[mx.array, mx.array | None]:
    """logits [N, V] float32 -> (int32 [N] each row's token: the argmax at temperature 0, else the
    draw at `uniforms` [N] after the top_k / top_p / min_p cuts, as engine/device_sampler.py's
    choose; and, where `raw` [N, V] is given, float32 [N] its rows' top-token probability, else
    None). See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    out = ext.choose_rows(logits, uniforms, float(temperature), raw, int(top_k), float(top_p), float(min_p),
                          NARROW_TOP_K)
    return out[0], (out[1] if raw is not None else None)


def top_rows_now(logits: mx.array, rows: list[int]) -> list[float]:
    """The top-token probability of rows `rows` of logits [N, V] float32, computed at once on this
    thread (1 / sum(2^((x - max) log2 e)) in 16 lanes: within ~2e-5 of engine/logits_extras.py
    top_probabilities, which it stands in for where only the controller reads it). See
    engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    return list(ext.top_rows_now(logits, [int(r) for r in rows]))


def draw_now(logits: mx.array, row: int, counts: mx.array | None, bias: mx.array | None, in_prompt: mx.array | None,
             cols: list[int], extra: list[float], frequency: float, presence: float, repetition: float,
             penalized: bool, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """Row `row` of the (evaluated or lazy) logits [N, V] float32: its sampled token, chosen at once on
    this thread, after the request's bias and penalties where `counts` [V] is given (the node's path
    tokens `cols` counted `extra` more times): what penalize_rows and choose_rows give that row in a
    graph. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    return int(ext.draw_now(logits, int(row), counts, bias, in_prompt, [int(c) for c in cols],
                            [float(e) for e in extra], float(frequency), float(presence), float(repetition),
                            bool(penalized), float(temperature), int(top_k), float(top_p), float(min_p), float(u),
                            NARROW_TOP_K))


def penalize_rows(x: mx.array, counts: mx.array, bias: mx.array | None, in_prompt: mx.array | None,
                  frequency: float, presence: float, repetition: float, penalized: bool) -> mx.array:
    """x [N, V] float32 with a request's bias [V] added, frequency and presence penalties by the
    completion's counts [V] taken off where `penalized`, and the repetition penalty applied on the
    tokens `in_prompt` [V] (float32 0 / 1) marks or counts holds, where in_prompt is given: as
    engine/device_penalties.py DevicePenalties._adjust. See engine/cpu_ext.cpp."""
    ext = module()
    assert ext is not None, "serves() first"
    return ext.penalize_rows(x, counts, bias, in_prompt, float(frequency), float(presence), float(repetition),
                             bool(penalized))
