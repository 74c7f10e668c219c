"""Exponentials on the CPU: softmax, log-sum-exp, sigmoid and SiLU through a power of two.

MLX's CPU `exp` costs ~15-18 ns an element on the dev CPU (AMD EPYC, MLX 0.32.4), and so do
`sigmoid` and `tanh` (one scalar libm call an element), while its `power` costs ~7 ns and a
multiply 0.3 ns. Where a pass takes many exponentials (a tree's attention over a long context, the
full-vocabulary log-softmax of a drafter's marginals, the sampler's probabilities over the
vocabulary for every node, and the SiLU / sigmoid gates every verified row pays in each layer's
MLP, GDN convolution and output gates) exp(x) = 2^(x log2 e) is the faster spelling. Results
differ from MLX's functions by float32 rounding (max |difference| 2e-9 on attention
probabilities; SiLU within 3e-7 relative). On other backends, for other dtypes than float32 in
the gates, and with POW_EXP off, the MLX functions run.

MLX's `power` is libm's powf an element. Where the engine's shim is preloaded (engine/blas.py),
engine/exp2_shim.c answers powf(2, y) with exp2f(y), the same float at ~1.5 ns against ~4 (dev
CPU, Xeon, glibc 2.36): a softmax over 24,000 scores took 115 µs against 168.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from engine import cpu_ext

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
POW_EXP = True  # module switch: False = MLX's exp on the CPU too (scripts/bench_tree_attention.py)
POW_GATES = True  # module switch for sigmoid / silu alone, read when a function is traced


def _pow_exp() -> bool:
    return POW_EXP and mx.default_device() == mx.cpu


def _exp2(x: mx.array) -> mx.array:
    return mx.power(2.0, x * LOG2E)


@partial(mx.compile, shapeless=True)
def _exp2_shifted(x: mx.array, m: mx.array) -> mx.array:
    """2^((x - m) log2 e) as one compiled pass: the softmaxes here run outside compiled layers
    (an attention's scores), where the subtraction, the product and the power were three passes
    and three operations to schedule. Same operations in the same order, so the same bits; a
    softmax over 6 x 4,000 scores took 154.5 us against 163.5 on the dev CPU (medians of 100)."""
    return mx.power(2.0, (x - m) * LOG2E)


@partial(mx.compile, shapeless=True)
def _exp2_shifted_over(x: mx.array, m: mx.array, t: mx.array) -> mx.array:
    """2^(((x - m) / t) log2 e) as one compiled pass, as _exp2_shifted."""
    return mx.power(2.0, ((x - m) / t) * LOG2E)


def exp(x: mx.array) -> mx.array:
    """exp(x), through 2^(x log2 e) on the CPU."""
    return _exp2(x) if _pow_exp() else mx.exp(x)


def exp_shifted(x: mx.array, m: mx.array, temperature: float = 1.0) -> mx.array:
    """exp((x - m) / temperature): a sampler's unnormalised probabilities (m the row's max). The
    same bits as exp() of the same expression, in one compiled pass on the CPU instead of three or
    four (a row of 8,192 logits: ~7 µs less a round on the dev CPU)."""
    if not _pow_exp():
        return mx.exp(x - m if temperature == 1.0 else (x - m) / temperature)
    if temperature == 1.0:
        return _exp2_shifted(x, m)
    return _exp2_shifted_over(x, m, mx.array(temperature, dtype=x.dtype))


def softmax_rows(scores: mx.array, mask: mx.array | None = None) -> mx.array:
    """Softmax over the last axis (entries of -inf weigh 0; every row must see one entry). mask:
    bool [N, L] over the last two axes (False weighs 0), or None. On the CPU in float32 one
    operation of the engine's own where it is built (engine/cpu_ext.cpp softmax_rows: over a DFlash
    block's 96 rows of 4,112 scores, 0.25 ms against 1.8 ms in the operations below on the dev
    CPU); else MLX's operations, through 2^ on the CPU."""
    fits = mask is None or (mask.dtype == mx.bool_ and mask.shape == scores.shape[-2:])
    if fits and scores.size and cpu_ext.serves(cpu_ext.SOFTMAX, scores):
        return cpu_ext.softmax_rows(scores, mask)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    if not _pow_exp():
        return mx.softmax(scores, axis=-1)
    e = _exp2_shifted(scores, mx.max(scores, axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def logsumexp_rows(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis, kept as a size-1 axis."""
    if not _pow_exp():
        return mx.logsumexp(x, axis=-1, keepdims=True)
    m = mx.max(x, axis=-1, keepdims=True)
    return m + mx.log2(_exp2_shifted(x, m).sum(axis=-1, keepdims=True)) * LN2


def _pow_gate(x: mx.array) -> bool:
    """The gates go through 2^ for float32 only: in half precision x log2 e would round first."""
    return POW_GATES and _pow_exp() and x.dtype == mx.float32


def sigmoid(x: mx.array) -> mx.array:
    """1 / (1 + exp(-x)), through 2^(-x log2 e) on the CPU (float32). Saturates to 0 and 1 as
    the MLX function does: 2^(large) is inf, and 1 / inf is 0."""
    return 1.0 / (1.0 + _exp2(-x)) if _pow_gate(x) else mx.sigmoid(x)


def silu(x: mx.array) -> mx.array:
    """x sigmoid(x), as x / (1 + 2^(-x log2 e)) on the CPU (float32): one division, no product."""
    return x / (1.0 + _exp2(-x)) if _pow_gate(x) else x * mx.sigmoid(x)
