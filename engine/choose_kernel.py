"""Each node's token chosen in one CUDA launch (metal/choose.kernel): the argmax, or the seeded draw
under a temperature and a top-k cut with top-p and min-p after it, and where asked the raw logits'
top-token probability.

Why: on a GPU a decode step is bound by the host encoding its launches (BENCHMARKS.md, issue 13),
and engine/device_sampler.py's operations are ~20 of them for a sampled choice (the exponentials,
a top-k over the vocabulary, the sort of its k, two running sums, the cuts), ~0.3 ms of a 9B-shaped
step's host time on an H100: sampled plain decoding ran at 0.90-0.92x greedy there.

The kernel is the choice's definition on CUDA, for plain decoding and every speculation round alike,
so their outputs stay identical to each other. Its draw is the operations' draw in exact
arithmetic; in float32 its sums run in other orders, so the two can differ where the uniform falls
within rounding of a CDF boundary, or a cut within rounding of a token's mass, as the operations
differ from the host's float64 sampler (tests/kernels/test_choose_kernel.py holds the kernel to
that sampler with the rules tests/unit/test_device_sampler.py holds the operations to).

A plain round's logit bias and penalties are applied inside the same launch (eight more operations
of the repetition penalty alone otherwise), with the operations' float32 steps: the same values.

It serves a draw with a top-k of 1 to MAX_TOP_K (the default sampling of Qwen3.5 checkpoints and
of the bundled model: 20), and greedy rows when their top-token probability is asked for (an argmax
alone is one launch already). Other settings, Metal and the CPU keep their paths.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from engine.config import SamplingParams
from engine.device_penalties import DevicePenalties
from engine.kernels import CHOOSE, CHOOSE_PEN, CHOOSE_TOP, CHOOSE_TOP_PEN, FastPath, compiled_kernel, gpu_backend

CAP = 2048  # tokens a row's block holds in shared memory (24 KiB with their probabilities)
MAX_TOP_K = CAP // 2  # leaves room for ties at the k-th logit
DTYPES = (mx.float32, mx.bfloat16, mx.float16)

# on by default on CUDA (SPRUCE_CHOOSE_KERNEL=0 turns it off); benchmarks set the value
# (scripts/variants.py's "-ck0")
KERNEL = FastPath("SPRUCE_CHOOSE_KERNEL", on=("cuda",))


def serves(logits: mx.array, params: SamplingParams, raw: mx.array | None) -> bool:
    """Whether the kernel chooses from these rows for these settings."""
    if not KERNEL.enabled() or gpu_backend() != "cuda":
        return False
    if logits.ndim != 2 or logits.dtype not in DTYPES or logits.shape[-1] >= 2**31:
        return False
    if raw is not None and (raw.shape != logits.shape or raw.dtype not in DTYPES):
        return False
    if params.greedy:
        return raw is not None
    return 1 <= params.top_k <= MAX_TOP_K and params.top_k < logits.shape[-1]


def choose(logits: mx.array, params: SamplingParams, uniforms: mx.array | None,
           raw: mx.array | None = None, penalties: DevicePenalties | None = None) -> tuple[mx.array, mx.array | None]:
    """logits [N, V] -> (int32 [N] tokens, float32 [N] top-token probabilities of `raw` or None);
    uniforms [N] float32 for a draw; `penalties`: a plain round's bias and penalties, applied in the
    launch (the same values as DevicePenalties.apply's). The caller checks serves()."""
    N, V = logits.shape
    greedy = params.greedy
    cuts = _no_cuts() if greedy else _cuts(params.temperature, params.top_p, params.min_p, params.top_k)
    if uniforms is None:
        assert greedy, "a draw needs its uniforms"
        uniforms = _unused_uniforms(N)
    if penalties is None:
        spec = CHOOSE if raw is None else CHOOSE_TOP
    else:
        spec = CHOOSE_PEN if raw is None else CHOOSE_TOP_PEN
    inputs = [logits, uniforms, cuts] + ([] if raw is None else [raw])
    inputs += [] if penalties is None else penalties.kernel_inputs()
    threads = block_threads(V)
    outs = compiled_kernel(spec, "cuda")(
        inputs=inputs, template=[("GREEDY", int(greedy)), ("CAP", CAP)], grid=(N * threads, 1, 1),
        threadgroup=(threads, 1, 1), output_shapes=[(N,)] * len(spec.outputs),
        output_dtypes=[mx.int32, mx.float32][: len(spec.outputs)])
    return outs[0], (outs[1] if raw is not None else None)


def block_threads(V: int) -> int:
    """Threads of a row's block: a power of two, about eight logits a thread, 32 to 1024. Set by the
    vocabulary alone, so a row's sums run in one order whatever the launch's row count."""
    threads = 32
    while threads < 1024 and threads * 8 < V:
        threads *= 2
    return threads


@functools.lru_cache(maxsize=64)
def _cuts(temperature: float, top_p: float, min_p: float, top_k: int) -> mx.array:
    """A request's settings as the kernel's float32 [4], made once (a kernel takes no scalars)."""
    return mx.array([temperature, top_p, min_p, float(top_k)], dtype=mx.float32)


@functools.cache
def _no_cuts() -> mx.array:
    return mx.array([1.0, 1.0, 0.0, 1.0], dtype=mx.float32)


@functools.lru_cache(maxsize=64)
def _unused_uniforms(n: int) -> mx.array:
    """A greedy launch's uniforms input (read by no thread), made once per row count."""
    return mx.array([0.0] * n, dtype=mx.float32)
