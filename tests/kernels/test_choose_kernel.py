"""metal/choose.kernel (CUDA only): each row's token in one launch, held to the host's float64
sampler (engine/sampler.py) with the rules the device's operations are held to
(tests/unit/test_device_sampler.py: the same token except where the uniform falls within float32
rounding of a CDF boundary, or a cut within rounding of a token's mass). Executed on the CPU by the
lockstep SIMT emulation (every CI run: warps, shuffles, barriers, shared memory and the narrowing
paths), and on CUDA through MLX where a GPU is (the hardware's expf and scheduling)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from engine import choose_kernel, device_sampler
from engine.config import SamplingParams
from engine.device_penalties import DevicePenalties
from engine.device_sampler import node_uniforms
from engine.kernels import CHOOSE, CHOOSE_PEN, CHOOSE_TOP, CHOOSE_TOP_PEN, gpu_backend
from engine.sampler import position_uniform, process_logits, sample_token
from tests.kernels.emulate import SIMT_AVAILABLE, emulate_simt, from_bf16_bits, to_bf16_bits
from tests.unit.test_device_sampler import straddles_a_cut

emulated = pytest.mark.skipif(not SIMT_AVAILABLE, reason="the lockstep emulation needs g++ and Linux's ucontext")
on_cuda = pytest.mark.skipif(gpu_backend() != "cuda", reason="needs MLX's CUDA backend")

PARAMS = [
    SamplingParams(temperature=0.7, top_k=20, seed=1),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.8, seed=1),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05, seed=1),
    SamplingParams(temperature=1.3, top_k=5, seed=1),
    SamplingParams(temperature=0.8, top_k=200, top_p=0.9, seed=1),
    SamplingParams(temperature=1.0, top_k=1, seed=1),
]


def cuts_of(params: SamplingParams) -> np.ndarray:
    return np.array([params.temperature, params.top_p, params.min_p, params.top_k], dtype=np.float32)


def emulated_choice(logits: np.ndarray, params: SamplingParams, positions: list[int], tmp, *, cap: int = 2048,
                    threads: int | None = None, bf16: bool = False, top: bool = False):
    """The emulated kernel on float32 logits [N, V] (bf16: handed over as bfloat16) -> tokens, and
    the top-token probabilities where `top`."""
    N, V = logits.shape
    greedy = params.greedy
    u = np.zeros(N, np.float32) if greedy else np.array(node_uniforms(params.seed, positions))
    rows = to_bf16_bits(logits) if bf16 else logits
    inputs = {"logits": rows, "uniforms": u, "cuts": cuts_of(params) if not greedy else np.ones(4, np.float32)}
    outputs = {"tokens": ((N,), np.int32)}
    if top:
        inputs["raw"] = rows
        outputs["top"] = ((N,), np.float32)
    out = emulate_simt(CHOOSE_TOP if top else CHOOSE, inputs, outputs, {"GREEDY": int(greedy), "CAP": cap},
                       groups=N, threads=threads or choose_kernel.block_threads(V), tmp=tmp,
                       halves={"logits": "bfloat16", "raw": "bfloat16"} if bf16 else None)
    return (out["tokens"], out["top"]) if top else out["tokens"]


def assert_host_draws(got: np.ndarray, logits: np.ndarray, params: SamplingParams, positions: list[int],
                      least: float, guarded: int | None = None) -> None:
    """Every token the host's float64 sampler would draw, but where rounding explains the difference;
    `least`: the share of equal draws among the rows without a tie at a cut (a guard against a
    systematic difference), of which there must be `guarded` (default a quarter of the rows)."""
    host = np.array([sample_token(logits[i], params, params.seed, p) for i, p in enumerate(positions)])
    tol = logits.shape[1] * float(np.finfo(np.float32).eps)
    at_cut = np.array([straddles_a_cut(r, params) or tie_at_top_k(r, params.top_k) for r in logits])
    for i in np.flatnonzero((got != host) & ~at_cut):
        probs = process_logits(logits[i], params)
        cdf = np.cumsum(probs)
        u = position_uniform(params.seed, positions[i])
        lo, hi = sorted((int(got[i]), int(host[i])))
        assert abs(cdf[lo] - u) < tol or np.isclose(probs[lo], probs[hi]), (i, got[i], host[i], u)
    assert (~at_cut).sum() >= (len(got) // 4 if guarded is None else guarded)
    if (~at_cut).any():
        assert (got == host)[~at_cut].mean() >= least


def tie_at_top_k(row: np.ndarray, k: int) -> bool:
    """Whether tokens tie with the k-th largest logit past k: the kernel keeps them all (as the
    operations do), the host the lower ids, so top-p's total and cut move (bf16 rows tie often)."""
    return 0 < k < row.size and int((row >= np.sort(row)[::-1][k - 1]).sum()) > k


def random_rows(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    return (rng.normal(size=(rows, vocab)) * rng.uniform(0.5, 4.0, size=(rows, 1))).astype(np.float32)


@emulated
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("vocab", [512, 3000])
def test_emulated_draw_equals_host_draw_but_at_boundaries(params, vocab, rng, tmp_path):
    params = dataclasses.replace(params, seed=int(rng.integers(1 << 31)))
    logits = random_rows(rng, 24, vocab)
    positions = list(range(50, 74))
    assert_host_draws(emulated_choice(logits, params, positions, tmp_path), logits, params, positions, 0.95)


def per_thread_bound_overflows(row: np.ndarray, k: int, threads: int, cap: int) -> bool:
    """Whether the tokens at or above the k-th largest of the threads' maxima (thread t holds tokens
    t, t + threads, ...; no bound where k > threads) are more than `cap`: the kernel then narrows its
    threshold by bisection."""
    maxima = np.sort(np.array([row[t::threads].max() for t in range(threads)]))[::-1]
    bound = maxima[k - 1] if k <= threads else -np.inf
    return int((row >= bound).sum()) > cap


@emulated
@pytest.mark.parametrize("params", [PARAMS[1], PARAMS[2]], ids=["k40-p0.8", "k20-p0.95-m0.05"])
def test_emulated_bisection_gives_the_same_draws(params, rng, tmp_path):
    """With room for 64 tokens and 32 threads over 2,048 logits, rows whose largest logits crowd into
    one thread's tokens (every 32nd raised) gather too many at the threads' bound; the narrowed
    threshold must give the host's draws all the same."""
    params = dataclasses.replace(params, seed=int(rng.integers(1 << 31)))
    logits = random_rows(rng, 16, 2048)
    logits[:, 5::32] += 6.0 * np.abs(logits).mean(axis=1, keepdims=True)
    assert sum(per_thread_bound_overflows(r, params.top_k, 32, 64) for r in logits) >= 12  # the path runs
    positions = list(range(7, 23))
    got = emulated_choice(logits, params, positions, tmp_path, cap=64, threads=32)
    assert_host_draws(got, logits, params, positions, 0.9)


@emulated
def test_emulated_ties_wider_than_the_room_are_defined(tmp_path):
    """More than CAP tokens tied at the largest logit draw the argmax; a tie at the cut wider than
    CAP - k keeps the tokens above it. Never a token outside the row, never a hang."""
    params = SamplingParams(temperature=1.0, top_k=20, seed=3)
    flat = np.zeros((1, 512), np.float32)
    tie = np.full((1, 512), -5.0, np.float32)
    tie[0, 100:300] = 1.0  # 200 tokens tied where the 20th largest falls
    tie[0, [7, 400, 401]] = [3.0, 2.5, 2.0]
    got = emulated_choice(np.concatenate([flat, tie]), params, [0, 1], tmp_path, cap=64, threads=32)
    assert got[0] == 0
    assert got[1] in (7, 400, 401)


@emulated
def test_emulated_masked_tokens_are_never_drawn(rng, tmp_path):
    params = SamplingParams(temperature=2.0, top_k=20, seed=5)
    logits = rng.normal(size=(12, 700)).astype(np.float32)
    logits[:, ::2] = -np.inf
    logits[:6, :690] = -np.inf  # fewer live tokens than k in half the rows
    got = emulated_choice(logits, params, list(range(12)), tmp_path)
    assert (got % 2 == 1).all() and (got[:6] >= 690).all()


@emulated
def test_emulated_greedy_is_the_first_argmax_and_top_is_the_raw_probability(rng, tmp_path):
    logits = rng.normal(size=(9, 1000)).astype(np.float32)
    logits[3, [10, 500]] = 9.0  # a tie: the first index, as MLX's argmax
    tokens, top = emulated_choice(logits, SamplingParams(), [0] * 9, tmp_path, top=True)
    assert np.array_equal(tokens, logits.argmax(axis=1))
    x = logits.astype(np.float64)
    want = 1.0 / np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1)
    assert np.allclose(top, want, rtol=2e-6, atol=0)


@emulated
def test_emulated_bfloat16_rows(rng, tmp_path):
    """bf16 logits (a GPU model's): many exact ties at every cut, read through the kernel's own
    conversion; held to the host's draw on the same values (about 40 % of these rows tie at a cut)."""
    params = dataclasses.replace(PARAMS[2], seed=int(rng.integers(1 << 31)))
    logits = from_bf16_bits(to_bf16_bits(random_rows(rng, 48, 4096)))
    positions = list(range(300, 348))
    got = emulated_choice(logits, params, positions, tmp_path, bf16=True)
    assert_host_draws(got, logits, params, positions, 0.85)


def test_serves_only_what_it_computes():
    """The settings the kernel takes; everything else keeps the operations (also off the GPU)."""
    x = mx.zeros((2, 100), dtype=mx.bfloat16)
    cases = [(SamplingParams(temperature=0.7, top_k=20), None, True),
             (SamplingParams(temperature=0.7, top_k=0, top_p=0.9), None, False),  # no top-k
             (SamplingParams(temperature=0.7, top_k=choose_kernel.MAX_TOP_K + 1), None, False),
             (SamplingParams(temperature=0.7, top_k=100), None, False),  # k >= V cuts nothing
             (SamplingParams(), None, False),  # an argmax alone is one launch already
             (SamplingParams(), x, True)]
    for params, raw, want in cases:
        assert choose_kernel.serves(x, params, raw) == (want and gpu_backend() == "cuda"), params


# ---- on CUDA ----

@on_cuda
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize(("vocab", "dtype"), [(8192, mx.float32), (248320, mx.float32), (8192, mx.bfloat16)])
def test_gpu_draw_equals_host_draw_but_at_boundaries(params, vocab, dtype, rng):
    params = dataclasses.replace(params, seed=int(rng.integers(1 << 31)))
    rows = 40
    x = mx.array(random_rows(rng, rows, vocab)).astype(dtype)
    logits = np.array(x.astype(mx.float32))
    positions = list(range(1000, 1000 + rows))
    got, _ = choose_kernel.choose(x, params, node_uniforms(params.seed, positions))
    # straddles_a_cut's mass rule scales with the vocabulary (248,320 float32 steps: 0.03 of the
    # mass), so with top-p, or ties at a bf16 row's k-th logit, most rows count as at a cut: there
    # the guard against a systematic difference is the operations' draws below
    assert_host_draws(np.array(got), logits, params, positions, 0.85, guarded=0)
    # and the operations it replaces: the same draws, but where rounding explains a difference
    ops = np.array(device_sampler._choose_ops(x, params, node_uniforms(params.seed, positions)))
    assert (ops == np.array(got)).mean() >= 0.9


@on_cuda
def test_gpu_rows_do_not_depend_on_the_launch(rng):
    """A row's token and top probability are the same whatever the launch's other rows: a verify
    row and a decode step choose alike."""
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=2)
    x = mx.array(random_rows(rng, 17, 248320)).astype(mx.bfloat16)
    u = node_uniforms(2, range(17))
    full, full_top = choose_kernel.choose(x, params, u, x)
    for n in (1, 5):
        part, part_top = choose_kernel.choose(x[:n], params, u[:n], x[:n])
        assert np.array_equal(np.array(part), np.array(full)[:n])
        assert np.array_equal(np.array(part_top), np.array(full_top)[:n])


@on_cuda
def test_gpu_greedy_and_top(rng):
    x = mx.array(rng.normal(size=(17, 248320)).astype(np.float32)).astype(mx.bfloat16)
    tokens, top = choose_kernel.choose(x, SamplingParams(), None, x)
    assert np.array_equal(np.array(tokens), np.array(mx.argmax(x, axis=-1)))
    want = np.array(device_sampler.top_probability(x))
    assert np.allclose(np.array(top), want, rtol=1e-4, atol=0)


# ---- a plain round's bias and penalties inside the launch ----

PENALTIES = [{"repetition_penalty": 1.3},
             {"repetition_penalty": 0.8, "frequency_penalty": 0.4, "presence_penalty": -0.3},
             {"logit_bias": ((3, 5.0), (7, -100.0), (650, 2.5))},
             {"frequency_penalty": 1.2, "presence_penalty": 0.4, "repetition_penalty": 1.1,
              "logit_bias": ((1, 2.5),)}]


def penalised(rng: np.random.Generator, vocab: int, settings: dict, greedy: bool = False):
    """A request's DevicePenalties over a random prompt and completion, and its params."""
    params = SamplingParams(temperature=0.0 if greedy else 0.8, top_k=20, top_p=0.9, seed=int(rng.integers(1 << 31)),
                            **settings)
    prompt = [int(t) for t in rng.integers(0, vocab, size=40)]
    generated = [int(t) for t in rng.integers(0, vocab, size=30)] + prompt[:5]
    return params, DevicePenalties(params, vocab, prompt, generated)


@emulated
@pytest.mark.parametrize("settings", PENALTIES, ids=["rep", "rep-freq-pres", "bias", "all"])
def test_emulated_penalties_in_the_launch_are_the_operations_values(settings, rng, tmp_path):
    """The launch with the penalties draws exactly what the plain launch draws from the rows the
    operations adjusted (DevicePenalties.apply): the same float32 values, so the same tokens, ties
    and boundaries included; greedy with the raw rows' top probability too."""
    logits = random_rows(rng, 16, 700)
    for greedy in (False, True):
        params, pen = penalised(rng, 700, settings, greedy)
        adjusted = np.array(pen.apply(mx.array(logits)))
        assert not np.array_equal(adjusted, logits)
        u = np.zeros(16, np.float32) if greedy else np.array(node_uniforms(params.seed, range(16)))
        cuts = np.ones(4, np.float32) if greedy else cuts_of(params)
        counts, bias, in_prompt, pens = (np.array(a) for a in pen.kernel_inputs())
        spec = CHOOSE_TOP_PEN if greedy else CHOOSE_PEN
        inputs = {"logits": logits, "uniforms": u, "cuts": cuts, "counts": counts, "bias": bias,
                  "in_prompt": in_prompt, "pens": pens}
        outputs = {"tokens": ((16,), np.int32)}
        if greedy:
            inputs["raw"] = logits
            outputs["top"] = ((16,), np.float32)
        got = emulate_simt(spec, inputs, outputs, {"GREEDY": int(greedy), "CAP": 2048}, groups=16,
                           threads=choose_kernel.block_threads(700), tmp=tmp_path)
        if greedy:
            assert np.array_equal(got["tokens"], adjusted.argmax(axis=1))
            x = logits.astype(np.float64)
            assert np.allclose(got["top"], 1.0 / np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1), rtol=2e-6)
        else:
            want = emulated_choice(adjusted, params, list(range(16)), tmp_path)
            assert np.array_equal(got["tokens"], want)


@on_cuda
@pytest.mark.parametrize("settings", PENALTIES, ids=["rep", "rep-freq-pres", "bias", "all"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gpu_penalties_in_the_launch_are_the_operations_values(settings, dtype, rng):
    """On CUDA, against MLX's own operations on the device: the same draws exactly (an FMA that
    contracted a step the operations round twice would move values by an ulp and show here)."""
    vocab = 248320
    x = mx.array(random_rows(rng, 24, vocab)).astype(dtype)
    params, pen = penalised(rng, vocab, settings)
    u = node_uniforms(params.seed, range(24))
    got, _ = choose_kernel.choose(x, params, u, None, pen)
    want, _ = choose_kernel.choose(pen.apply(x), params, u)
    assert np.array_equal(np.array(got), np.array(want))



def tie_probes(settings: dict, vocab: int, rows: int, rng: np.random.Generator):
    """Rows whose two largest adjusted logits tie exactly under the operations' float32 steps and not
    under a step rounded otherwise (x * (1 / r) for x / r; an FMA for frequency * count + presence).
    Row r has tokens 2r + 100 and 2r + 101: one penalised (a), the other (b) never penalised, with
    b's logit the operations' value of a's. A tie's argmax is the lower id; a takes the id that
    moves the argmax under the other rounding. -> (logits, generated tokens, the argmax of each row)."""
    f32 = np.float32
    rep, freq, pres = (f32(settings.get(k, d)) for k, d in
                       (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)))
    logits = np.full((rows, vocab), -1e4, dtype=np.float32)  # far below any probe, however penalised
    generated, want = [], []
    # counts whose frequency * count + presence rounds apart with one rounding and with two (the
    # repetition probes take any)
    counts = [c for c in range(1, 60) if rep != 1.0 or freq * f32(c) + pres != f32(np.float64(freq) * c + pres)]
    for r in range(rows):
        lo, hi = 2 * r + 100, 2 * r + 101
        count = counts[r % len(counts)]
        for _ in range(10_000):
            x = f32(rng.uniform(1.0, 9.0))
            if rep != 1.0:
                right, other = x / rep, x * (f32(1.0) / rep)
            else:
                right = x - (freq * f32(count) + pres)
                other = x - f32(np.float64(freq) * count + np.float64(pres))  # one rounding: an FMA's
            if right != other:
                break
        else:
            raise AssertionError(f"no probe for {settings}")
        a, b = (hi, lo) if other > right else (lo, hi)
        logits[r, a], logits[r, b] = x, right
        generated += [a] * count
        want.append(lo)
    return logits, generated, np.array(want)


PROBES = [{"repetition_penalty": 1.3}, {"repetition_penalty": 0.7},
          {"frequency_penalty": 0.4, "presence_penalty": 0.6}, {"frequency_penalty": 1.1, "presence_penalty": -0.35}]


def probe_case(settings: dict, rng: np.random.Generator, vocab: int):
    logits, generated, want = tie_probes(settings, vocab, 16, rng)
    params = SamplingParams(**settings)
    pen = DevicePenalties(params, vocab, [5, 6, 7], generated)
    return logits, params, pen, want


@emulated
@pytest.mark.parametrize("settings", PROBES, ids=["rep1.3", "rep0.7", "freq-pres", "freq-pres-neg"])
def test_emulated_penalties_round_each_step_as_the_operations(settings, rng, tmp_path):
    """Ties that hold only under the operations' roundings: the operations' argmax and the launch's
    are the lower id of each (x * (1 / r) for x / r fails this, so would an FMA)."""
    logits, params, pen, want = probe_case(settings, rng, 512)
    assert np.array_equal(np.array(pen.apply(mx.array(logits))).argmax(axis=1), want)  # the probes hold
    counts, bias, in_prompt, pens = (np.array(a) for a in pen.kernel_inputs())
    got = emulate_simt(CHOOSE_TOP_PEN, {"logits": logits, "uniforms": np.zeros(16, np.float32),
                                        "cuts": np.ones(4, np.float32), "raw": logits, "counts": counts,
                                        "bias": bias, "in_prompt": in_prompt, "pens": pens},
                       {"tokens": ((16,), np.int32), "top": ((16,), np.float32)}, {"GREEDY": 1, "CAP": 2048},
                       groups=16, threads=choose_kernel.block_threads(512), tmp=tmp_path)
    assert np.array_equal(got["tokens"], want)


@on_cuda
@pytest.mark.parametrize("settings", PROBES, ids=["rep1.3", "rep0.7", "freq-pres", "freq-pres-neg"])
def test_gpu_penalties_round_each_step_as_the_operations(settings, rng):
    logits, params, pen, want = probe_case(settings, rng, 248320)
    x = mx.array(logits)
    assert np.array_equal(np.array(mx.argmax(pen.apply(x), axis=-1)), want)  # MLX's operations on the device
    got, _ = choose_kernel.choose(x, params, None, x, pen)
    assert np.array_equal(np.array(got), want)
