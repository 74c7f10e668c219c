"""Every node's token chosen on the device: argmax, or the position-seeded draw, as [N] ids.

The host sampler (engine/sampler.py, float64 NumPy) is the definition and the twin. On a real
vocabulary (248,320 tokens) it costs about 100 ms a token with top_p on this project's CPU, and it
needs the [N, vocab] logits copied to the host every round; here only N ids travel. The steps
mirror the host's: temperature (logits shifted by their max before dividing), top_k, top_p,
min_p, then the inverse CDF in vocabulary order at the uniform of the node's absolute position.
In float32 the chosen token can differ from the host's only where the uniform falls within
rounding of a CDF boundary, and where ties straddle a top_k / top_p / min_p cut (the device
keeps every tied token, the host keeps the lower ids; in float32 two slightly different logits can
tie after exp); tests/unit/test_device_sampler.py measures both.

Spec and plain decoding draw through the same function, so their outputs stay identical to each
other. On CUDA a draw with a top-k (and a greedy row whose top-token probability is asked for) is
one launch of engine/choose_kernel.py, whose sums run in their own order. On the CPU that function
is one operation of the engine's own (engine/cpu_ext.cpp choose_rows), the operations below its
twin, bit for bit (tests/engine/test_cpu_choose.py). Logit bias and penalties are applied before
it (engine/device_penalties.py; on CUDA a one-node round's inside the kernel's launch, with the
same float32 steps); logprobs and a grammar's mask stay on the host.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx
import numpy as np

from engine import choose_kernel, cpu_exp, cpu_ext
from engine.config import SamplingParams
from engine.device_penalties import DevicePenalties
from engine.sampler import position_uniform


def node_uniforms(seed: int, positions: Iterable[int]) -> mx.array:
    """float32 [N]: the uniform of each node's draw (position = the index its token will take)."""
    return mx.array([position_uniform(seed, int(p)) for p in positions], dtype=mx.float32)


def choose(logits: mx.array, params: SamplingParams, uniforms: mx.array | None) -> mx.array:
    """logits [N, V] -> int32 [N]: argmax when greedy, else the seeded draw at `uniforms` [N]."""
    return choose_and_top(logits, params, uniforms)[0]


def choose_and_top(logits: mx.array, params: SamplingParams, uniforms: mx.array | None,
                   raw: mx.array | None = None,
                   penalties: DevicePenalties | None = None) -> tuple[mx.array, mx.array | None]:
    """choose(), and where `raw` (the logits before bias and penalties; `logits` itself without
    them) is given its rows' top_probability, else None. `penalties`: a one-node round's bias and
    penalties, not yet applied to `logits` (in the CUDA kernel's launch where it serves, else by
    DevicePenalties.apply first). On the CPU, for float32 logits, both in one operation of the
    engine's own (engine/cpu_ext.cpp choose_rows: the same tokens, bit for bit, cuts included,
    without MLX's operations' scheduling; a sampled row of 8,192 logits evaluated alone on the dev
    CPU took 125-140 us against ~185, 150-170 against ~270 with the bundled model's default top-k
    and top-p, ~100 since a top-k draw computes 2^y only where it can reach the k-th largest value:
    eight rows 257 against 722 us)."""
    if penalties is not None:
        if choose_kernel.serves(logits, params, raw):
            return choose_kernel.choose(logits, params, uniforms, raw, penalties)
        logits = penalties.apply(logits)
    if _one_operation(logits, params, raw):
        if params.greedy:
            return cpu_ext.choose_rows(logits, None, 0.0, raw)
        top_k = min(params.top_k, logits.shape[-1])  # k >= V cuts nothing
        return cpu_ext.choose_rows(logits, uniforms, params.temperature, raw, top_k, params.top_p, params.min_p)
    if choose_kernel.serves(logits, params, raw):  # one CUDA launch instead of ~20 (engine/choose_kernel.py)
        return choose_kernel.choose(logits, params, uniforms, raw)
    return _choose_ops(logits, params, uniforms), None if raw is None else top_probability(raw)


def one_operation(logits: mx.array, params: SamplingParams) -> bool:
    """Whether the CPU's operations choose from these logits for these settings (choose_rows, and
    a node drawn at once: cpu_ext.draw_now)."""
    return _one_operation(logits, params, None)


def _one_operation(logits: mx.array, params: SamplingParams, raw: mx.array | None) -> bool:
    """Whether choose_rows serves this choice: float32 on the CPU with 2^ for exp (its arithmetic is
    that path's), and a temperature, top_p and min_p that float32 does not round across the edges
    the operations test in double (0; 1 and 0)."""
    f32 = np.float32
    drawable = params.greedy or (float(f32(params.temperature)) > 0.0
                                 and (float(f32(params.top_p)) < 1.0) == (params.top_p < 1.0)
                                 and (float(f32(params.min_p)) > 0.0) == (params.min_p > 0.0))
    arrays = (logits,) if raw is None else (logits, raw)
    return drawable and logits.ndim == 2 and cpu_exp.POW_EXP and cpu_ext.serves(cpu_ext.CHOOSE, *arrays)


def _choose_ops(logits: mx.array, params: SamplingParams, uniforms: mx.array | None) -> mx.array:
    """choose() in MLX's operations (the twin of choose_rows; every backend, every cut)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    assert uniforms is not None
    p = probabilities(logits, params)
    V = p.shape[-1]
    cdf = mx.cumsum(p, axis=-1)
    total = cdf[..., -1:]
    y = (cdf <= uniforms[:, None] * total).sum(axis=-1)  # the first token whose cdf passes u * total
    last = V - 1 - mx.argmax((p > 0)[..., ::-1], axis=-1)  # rounding past the end: the last live token
    return mx.where(y < V, y, last).astype(mx.int32)


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """[N, V] float32: the unnormalised probabilities after temperature, top_k, top_p and min_p
    (0 where cut), in vocabulary order."""
    x = logits.astype(mx.float32)
    p = cpu_exp.exp_shifted(x, x.max(axis=-1, keepdims=True), params.temperature)  # unnormalised, max 1
    V = p.shape[-1]
    top = None
    if 0 < params.top_k < V:
        top = mx.topk(p, params.top_k, axis=-1)
        p = mx.where(p >= top.min(axis=-1, keepdims=True), p, 0.0)
    if params.top_p < 1.0:
        # with top_k on, the cut lies among the top k values: sorting those k (not the whole
        # vocabulary: 17 rows of 8192 took ~10 ms to sort on the dev CPU) gives the same cut,
        # since tokens tied with the k-th value beyond it are kept or cut with it
        ranked = mx.sort(p if top is None else top, axis=-1)[..., ::-1]  # best first
        cum = mx.cumsum(ranked, axis=-1)
        # the smallest best-first prefix reaching top_p of the mass: a rank is kept while the mass
        # before it is short of the target; the last kept value is the cut
        total = cum[..., -1:] if top is None else _total(p)  # ties past k count
        kept = (cum - ranked) < params.top_p * total
        cut = mx.where(kept, ranked, mx.inf).min(axis=-1, keepdims=True)
        p = mx.where(p >= cut, p, 0.0)
    if params.min_p > 0.0:
        p = mx.where(p >= params.min_p * p.max(axis=-1, keepdims=True), p, 0.0)
    return p


def _total(p: mx.array) -> mx.array:
    """p's sum over its last axis, kept: on the CPU in vocabulary order (the cumulative sum's last),
    as engine/cpu_ext.cpp choose_rows sums it, since MLX's reduction sums in lanes and a total one
    rounding apart moves the top-p cut where a value sits at it; elsewhere MLX's sum."""
    if mx.default_device() == mx.cpu:
        return mx.cumsum(p, axis=-1)[..., -1:]
    return p.sum(axis=-1, keepdims=True)


def top_probability(logits: mx.array) -> mx.array:
    """logits [N, V] -> float32 [N]: the probability of each row's most likely token under the raw
    distribution (no temperature, no penalties); engine/spec_gate.py's confidence. Twin:
    engine/logits_extras.py top_probabilities."""
    x = logits.astype(mx.float32)
    return 1.0 / cpu_exp.exp_shifted(x, x.max(axis=-1, keepdims=True)).sum(axis=-1)

