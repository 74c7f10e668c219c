"""engine/half_weights.py with the shim's panel kernel (engine/gemv_shim.c): products by a
registered weight read its bfloat16 copy and agree with float64 and with the float32 kernel to
rounding; a row's result does not depend on how many rows share the product (one row included,
every tile shape of the kernel); weights that are not
bfloat16 are refused; registrations end with their owner; and a model whose weights are bfloat16
values decodes with speculation exactly as without."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from engine import blas, half_weights
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.generate import Engine
from engine.loader import load_model
from tests.engine.test_lossless import PROMPTS, OracleDrafter, RandomTreeDrafter
from tests.helpers import checkpoint_maker, generate

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or blas.half_calls() is None,
    reason="the half-width copies are the CPU shim's (Linux, preloaded with OpenBLAS)")


class Owner:
    """Something for registrations to live as long as."""


def bf16_valued(rng: np.random.Generator, *shape: int) -> mx.array:
    """float32 values that are all bfloat16 (a bf16 checkpoint loaded in float32)."""
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16).astype(mx.float32)


@pytest.fixture
def half_on():
    saved = blas.HALF.value
    blas.HALF.value = 1
    yield
    blas.HALF.value = saved


def products(x: mx.array, w: mx.array, rows: list[int]) -> dict[int, np.ndarray]:
    return {m: np.array(x[:m] @ w.T) for m in rows}


# every tile shape of the panel kernel: one tile of 1-12 rows (panels taken 8 / 6 / 4 / 3 / 2 / 1
# at a time), then two or three tiles of 7-12
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 17, 24, 25, 33]


def close(got: np.ndarray, want: np.ndarray) -> bool:
    return bool(np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max())))


def test_copies_agree_with_float64_and_rows_do_not_depend_on_the_count(rng, half_on):
    w = bf16_valued(rng, 1031, 384)  # 1031 = 32 * 32 + 7: the last panel's rows past the end too
    x = mx.array(rng.standard_normal((33, 384)).astype(np.float32))
    owner = Owner()
    assert half_weights.register(owner, [w]) == 1
    calls = blas.half_calls()
    halves = products(x, w, ROWS)
    assert blas.half_calls() - calls == len(ROWS)  # every product, the one-row one included, read the copy
    blas.HALF.value = 0
    floats = products(x, w, ROWS)
    assert blas.half_calls() - calls == len(ROWS)
    want = np.array(x, dtype=np.float64) @ np.array(w, dtype=np.float64).T
    for m in ROWS:
        assert (halves[m] == halves[33][:m]).all(), m  # each row as in the 33-row product: batch invariant
        assert close(halves[m], want[:m]) and close(floats[m], want[:m]), m


def test_products_that_add_to_their_output_read_the_copy_too(rng, half_on):
    """A linear layer with a bias runs as C = x @ W.T + C (cblas beta 1), the tail panel included."""
    w = bf16_valued(rng, 200, 256)
    x = mx.array(rng.standard_normal((6, 256)).astype(np.float32))
    bias = mx.array(rng.standard_normal((200,)).astype(np.float32))
    owner = Owner()
    assert half_weights.register(owner, [w]) == 1
    calls = blas.half_calls()
    got = {m: np.array(mx.addmm(bias, x[:m], w.T, alpha=0.5, beta=2.0)) for m in (1, 6)}
    assert blas.half_calls() - calls == 2
    want = 0.5 * (np.array(x, dtype=np.float64) @ np.array(w, dtype=np.float64).T) + 2.0 * np.array(bias)
    for m, out in got.items():
        assert close(out, want[:m]), m
    assert (got[1] == got[6][:1]).all()


def test_a_view_of_leading_rows_reads_the_copy_and_other_views_do_not(rng, half_on):
    w = bf16_valued(rng, 600, 128)
    x = mx.array(rng.standard_normal((5, 128)).astype(np.float32))
    owner = Owner()
    assert half_weights.register(owner, [w]) == 1
    calls = blas.half_calls()
    lead = np.array(x @ w[:250].T)
    assert blas.half_calls() - calls == 1
    inner = np.array(x @ w[100:350].T)  # another address: the float32 kernel
    assert blas.half_calls() - calls == 1
    blas.HALF.value = 0
    assert close(lead, np.array(x @ w[:250].T))  # 250 rows: part of the copy's eighth panel
    assert (inner == np.array(x @ w[100:350].T)).all()


def test_weights_that_are_not_bfloat16_or_too_small_are_refused(rng, half_on, monkeypatch):
    owner = Owner()
    full = mx.array(rng.standard_normal((256, 128)).astype(np.float32))  # float32 values
    one_off = np.array(bf16_valued(rng, 256, 128))
    one_off[200, 77] = np.nextafter(one_off[200, 77], np.float32(np.inf))  # one value not a bfloat16
    assert half_weights.register(owner, [full, mx.array(one_off)]) == 0
    calls = blas.half_calls()
    x = mx.array(rng.standard_normal((3, 128)).astype(np.float32))
    mx.eval(x @ full.T, x @ mx.array(one_off).T)
    assert blas.half_calls() == calls
    assert half_weights.register(owner, [bf16_valued(rng, 8, 8)]) == 0  # too small to be worth a slot
    monkeypatch.setattr(half_weights, "MEMORY_SHARE", 0.0)  # no memory to spare for copies
    assert half_weights.register(owner, [bf16_valued(rng, 256, 128)]) == 0
    monkeypatch.undo()
    monkeypatch.setenv(half_weights.OPT_OUT, "0")
    assert half_weights.register(owner, [bf16_valued(rng, 256, 128)]) == 0


def test_registrations_end_with_their_owner(rng, half_on):
    gc.collect()  # earlier tests' models: their registrations end now, not in the count below
    before = half_weights.registered()
    owner = Owner()
    w = bf16_valued(rng, 512, 64)
    x = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    assert half_weights.register(owner, [w]) == 1
    assert half_weights.register(owner, [w]) == 1  # again: the same copy, counted once more
    assert half_weights.registered() == before + 1
    del owner
    gc.collect()
    assert half_weights.registered() == before
    calls = blas.half_calls()
    mx.eval(x @ w.T)
    assert blas.half_calls() == calls


def test_released_slots_are_taken_again(rng, monkeypatch):
    """Many more registrations over a process's life than the shim's table has slots: each released
    one's slot is reused (models loaded and dropped one after another keep getting their copies)."""
    monkeypatch.setattr(half_weights, "MIN_ELEMENTS", 1)
    kept = []  # alive, so that every matrix has an address of its own
    for _ in range(20000):  # the table takes 2,048 at once
        kept.append(mx.array(np.asarray(bf16_valued(rng, 4, 8))))
        owner = Owner()
        assert half_weights.register(owner, [kept[-1]]) == 1
        del owner  # its finalizer runs here: the registration ends
    assert len({np.asarray(w).ctypes.data for w in kept}) == len(kept)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """The tiny model's shape, wide enough that its matrices are worth registering, with every
    weight rounded to a bfloat16 value (as a bf16 checkpoint loaded in float32)."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path_factory.mktemp("tiny_bf16")
    checkpoint_maker().main([str(out), "--kind", "qwen3_5", "--hidden", "128", "--seed", "7"])
    for f in out.glob("*.safetensors"):
        tensors = {k: np.array(mx.array(v).astype(mx.bfloat16).astype(mx.float32)) if v.dtype == np.float32 else v
                   for k, v in load_file(f).items()}
        save_file(tensors, f)
    return out


@pytest.fixture(scope="module")
def bf16_engine(bf16_checkpoint):
    return Engine(EngineConfig(model_path=str(bf16_checkpoint), prefill_chunk=16, dtype="float32"))


def test_a_bfloat16_checkpoint_registers_its_matrices(bf16_checkpoint, bf16_engine):
    loaded = load_model(bf16_checkpoint, dtype="float32")
    assert loaded.half_weights == len(half_weights.candidates(loaded.model)) > 0
    copies = sum(2 * w.size for w in half_weights.candidates(loaded.model))
    assert bf16_engine.memory().weight_copies_bytes >= 2 * copies  # this model's and the engine's


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["fan", "random"])
def test_speculation_from_the_copies_equals_plain_decoding(bf16_engine, sampling, kind, half_on):
    spec = SpecConfig(method="none", budget=12, max_depth=6, adaptive=False)
    calls = blas.half_calls()
    for i, prompt in enumerate(PROMPTS):
        plain = generate(bf16_engine, prompt, sampling).tokens
        drafter = OracleDrafter(plain, len(prompt), fan=4) if kind == "fan" else RandomTreeDrafter(i, 512, plain)
        assert generate(bf16_engine, prompt, sampling, spec, drafter).tokens == plain
    assert blas.half_calls() > calls
