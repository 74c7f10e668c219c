"""The model's quantized projections on the engine's matmul (engine/models/qlinear.py): the
loader routes them where asked, the model computes what it did (up to rounding where the CPU
dequantizes for many rows), and on CUDA (where the small-M kernel runs) speculation still only
flips tokens at near ties in bf16."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine import forward, qmm
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.convert import ConvertOptions, convert
from engine.dtypes import BF16_NEAR_TIE as NEAR_TIE
from engine.generate import Engine
from engine.kernels import gpu_backend
from engine.loader import load_model
from engine.models.qlinear import RowsQuantizedEmbedding, RowsQuantizedLinear
from engine.qmm import CPU_DEQUANT_ROWS
from engine.tree import DraftTree
from tests.helpers import check_backend_default_switch, checkpoint_maker, generate

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79]
TREE = DraftTree((7, 8, 9, 10, 11, 12), (-1, 0, 1, 0, 3, 1))


@pytest.fixture(autouse=True)
def quantized_on_the_cpu_too(monkeypatch):
    """These tests are about the quantized projections: the CPU keeps them (the loader would turn
    a small quantized checkpoint float32 there: tests/engine/test_cpu_dequant.py)."""
    monkeypatch.setenv("SPRUCE_CPU_DEQUANT", "0")


@pytest.fixture(scope="module")
def wide_q4(tmp_path_factory):
    """Hidden 256, so every projection's input is a multiple of 128 and the kernel covers it."""
    src = tmp_path_factory.mktemp("qlinear_src")
    checkpoint_maker().main([str(src), "--hidden", "256", "--linear-dim", "32", "--seed", "23"])
    out = tmp_path_factory.mktemp("qlinear_q4") / "model"
    convert(src, out, ConvertOptions(bits=4, group_size=64, hadamard=False), progress=False)
    return out


def outputs(path, dtype: str, routed: bool) -> tuple[np.ndarray, np.ndarray, int]:
    loaded = load_model(path, dtype, routed=routed)
    model = loaded.model
    chain = np.array(model(mx.array([PROMPT]), model.make_cache()).astype(mx.float32))[0]
    cache = model.make_cache()
    forward.extend(model, cache, PROMPT)
    tree = np.array(forward.verify(model, cache, TREE, len(PROMPT)).astype(mx.float32))
    return chain, tree, loaded.routed_projections


def test_swapped_projections_compute_what_they_did(wide_q4):
    """fp32 activations: CUDA's kernel does not cover them (the same model, bit for bit); the CPU
    dequantizes for the 16-row chain (a GEMM sums in another order), and the tree reads the state
    that chain left, so both agree to rounding."""
    chain, tree, swapped = outputs(wide_q4, "float32", True)
    chain_ref, tree_ref, none = outputs(wide_q4, "float32", False)
    assert none == 0 and swapped > 0
    assert len(PROMPT) >= CPU_DEQUANT_ROWS
    for ours, ref in ((chain, chain_ref), (tree, tree_ref)):
        if gpu_backend() is None:
            assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, float(np.abs(ref).max()))
        else:
            assert np.array_equal(ours, ref)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_dequantized_matmul_equals_mlx(bits, group_size, rows, monkeypatch):
    """The CPU's many-row path (dequantize in slices, then GEMM) against mx.quantized_matmul, with
    slices small enough that a weight takes several."""
    monkeypatch.setattr(qmm, "DEQUANT_BLOCK", 256 * 50)  # 50 output rows a slice
    rng = np.random.default_rng(bits * 1000 + group_size + rows)
    w = mx.array(rng.normal(size=(130, 256)).astype(np.float32) * 0.1)
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    x = mx.array(rng.normal(size=(1, rows, 256)).astype(np.float32))
    ours = qmm.dequantized_matmul(x, wq, scales, biases, group_size, bits)
    ref = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits)
    assert ours.shape == ref.shape == (1, rows, 130)
    assert np.abs(np.array(ours) - np.array(ref)).max() <= 1e-4


def test_every_quantized_projection_is_routed(wide_q4):
    model = load_model(wide_q4, "float32", routed=True, fuse=False).model
    kinds = {type(m) for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert kinds == {RowsQuantizedLinear}
    embeddings = {type(m) for _, m in model.named_modules() if isinstance(m, nn.QuantizedEmbedding)}
    assert embeddings == {RowsQuantizedEmbedding}


def test_on_by_default_on_cuda_and_the_cpu_and_can_be_chosen(wide_q4, monkeypatch):
    check_backend_default_switch(monkeypatch, "SPRUCE_QMM", lambda: load_model(wide_q4, "float32").routed_projections,
                                 on=("cuda", "cpu"))


needs_cuda = pytest.mark.skipif(gpu_backend() != "cuda", reason="the small-M kernel runs on CUDA")


@needs_cuda
def test_kernel_model_matches_mlx_matmuls_in_bf16(wide_q4):
    chain, tree, swapped = outputs(wide_q4, "bfloat16", True)
    chain_ref, tree_ref, _ = outputs(wide_q4, "bfloat16", False)
    assert swapped > 0
    scale = max(1.0, float(np.abs(chain_ref).max()))
    assert np.abs(chain - chain_ref).max() <= 0.1 * scale
    assert np.abs(tree - tree_ref).max() <= 0.1 * scale


@needs_cuda
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_with_the_kernel_flips_only_at_near_ties(wide_q4, method):
    engine = Engine(EngineConfig(model_path=str(wide_q4), dtype="bfloat16"))
    routed = [m for _, m in engine.model.named_modules()
              if isinstance(m, RowsQuantizedLinear) or getattr(m, "routed", False)]
    assert routed
    spec = SpecConfig(method=method, budget=8, max_depth=4, draft_model=str(wide_q4), tree="ddtree", adaptive=False)
    sampling = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=2)
    flips = 0
    for seed in range(5):
        rng = np.random.RandomState(seed)
        motif = list(rng.randint(0, 500, size=5))
        prompt = [int(t) for t in motif * 3 + list(rng.randint(0, 500, size=10))]
        plain = generate(engine, prompt, sampling)
        fast = generate(engine, prompt, sampling, spec)
        i = next((k for k, (a, b) in enumerate(zip(plain.tokens, fast.tokens)) if a != b), None)
        if i is not None:
            flips += 1
            top = plain.logprobs[i].top
            assert top[0][1] - top[1][1] <= NEAR_TIE, f"prompt {seed}: flip at {i} with a clear winner"
    print(f"{method}: {flips} of 5 prompts flipped (at near ties)")


@needs_cuda
def test_fused_builds_in_the_model(wide_q4, monkeypatch):
    """With the projections fused with their norms and residual adds (engine/models/fused_qmm.py):
    the builds run, the logits stay close to the unfused model's in bf16, and ngram speculation
    flips tokens only at near ties."""
    from engine import launch_plan
    from engine.models import fused_qmm

    monkeypatch.setattr(launch_plan.SWITCH, "value", False)  # the plans' wiring takes no norm builds
    chain_ref, tree_ref, _ = outputs(wide_q4, "bfloat16", True)
    calls: list[int] = []
    real = fused_qmm.fused
    monkeypatch.setattr(fused_qmm.SWITCH, "value", True)
    monkeypatch.setattr(fused_qmm, "fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    chain, tree, _ = outputs(wide_q4, "bfloat16", True)
    assert calls
    scale = max(1.0, float(np.abs(chain_ref).max()))
    assert np.abs(chain - chain_ref).max() <= 0.1 * scale
    assert np.abs(tree - tree_ref).max() <= 0.1 * scale
    engine = Engine(EngineConfig(model_path=str(wide_q4), dtype="bfloat16"))
    spec = SpecConfig(method="ngram", budget=8, max_depth=4, tree="ddtree", adaptive=False)
    sampling = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=2)
    for seed in range(3):
        rng = np.random.RandomState(seed)
        prompt = [int(t) for t in list(rng.randint(0, 500, size=5)) * 3 + list(rng.randint(0, 500, size=10))]
        plain, fast = generate(engine, prompt, sampling), generate(engine, prompt, sampling, spec)
        i = next((k for k, (a, b) in enumerate(zip(plain.tokens, fast.tokens)) if a != b), None)
        if i is not None:
            top = plain.logprobs[i].top
            assert top[0][1] - top[1][1] <= NEAR_TIE, f"prompt {seed}: flip at {i} with a clear winner"


@needs_cuda
def test_residual_builds_alone_change_no_bit(wide_q4, monkeypatch):
    """The residual builds alone (fused_qmm.RES: out-projection + add, down + add; the norms and
    the SwiGLU unfused) round the add as MLX's `res + y` does, so a verify's logits are the
    default model's bit for bit, and the builds ran."""
    from engine import launch_plan
    from engine.models import fused_qmm

    monkeypatch.setattr(launch_plan.SWITCH, "value", False)  # the plans' wiring always has the builds
    monkeypatch.setattr(fused_qmm.RES, "value", False)
    _, tree_ref, _ = outputs(wide_q4, "bfloat16", True)
    calls: list[bool] = []
    real = fused_qmm.fused
    monkeypatch.setattr(fused_qmm.RES, "value", True)
    monkeypatch.setattr(fused_qmm, "fused", lambda *a, **k: calls.append(k.get("res") is not None) or real(*a, **k))
    _, tree, _ = outputs(wide_q4, "bfloat16", True)
    assert calls and all(calls)
    np.testing.assert_array_equal(tree, tree_ref)


@needs_cuda
@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_rows_dequantize_on_cuda(bits):
    """From CUDA_DEQUANT_ROWS rows on (a prefill chunk) the routed projection is the dequantize +
    GEMM path, and that agrees with MLX's quantized matmul to bf16 rounding."""
    rng = np.random.default_rng(bits)
    w = mx.array(rng.normal(size=(384, 256)).astype(np.float32) * 0.1)
    wq, scales, biases = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=bits)
    for rows in (qmm.CUDA_DEQUANT_ROWS, 3 * qmm.CUDA_DEQUANT_ROWS + 1):
        x = mx.array(rng.normal(size=(1, rows, 256)).astype(np.float32)).astype(mx.bfloat16)
        got = qmm.quantized_linear(x, wq, scales, biases, 64, bits)
        assert mx.array_equal(got, qmm.dequantized_matmul(x, wq, scales, biases, 64, bits,
                                                          block=qmm.GPU_DEQUANT_BLOCK))
        ref = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=bits)
        scale = max(1.0, float(mx.abs(ref).max()))
        assert float(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max()) <= 0.02 * scale


def plans_available() -> bool:
    from engine import launch_plan

    return gpu_backend() == "cuda" and launch_plan.available()


@pytest.mark.skipif(not plans_available(), reason="launch plans run on CUDA with the engine's extension built")
def test_launch_plans_in_the_model(wide_q4, monkeypatch):
    """With launch plans on (engine/launch_plan.py), a decode step runs each GDN layer as its plan
    and each attention layer as its two; greedy decoding then emits, with the same logprobs to the
    bit, what the same wiring emits launch by launch, and speculation (whose verifies run the
    wiring launch by launch) flips tokens only at near ties."""
    from engine import launch_plan, layer_plans

    monkeypatch.setattr(launch_plan.SWITCH, "value", True)
    monkeypatch.setattr(layer_plans.ATTENTION, "value", True)
    calls: list[str] = []
    real = launch_plan.LaunchPlan.__call__
    monkeypatch.setattr(launch_plan.LaunchPlan, "__call__", lambda self, *a: calls.append(self.name) or real(self, *a))
    sampling = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = []
    for seed in range(3):
        rng = np.random.RandomState(seed)
        prompts.append([int(t) for t in list(rng.randint(0, 500, size=5)) * 3 + list(rng.randint(0, 500, size=10))])
    planned = Engine(EngineConfig(model_path=str(wide_q4), dtype="bfloat16"))
    outs = [generate(planned, p, sampling) for p in prompts]
    assert {"gdn-decode-step", "attention-project", "attention-output"} <= set(calls), set(calls)
    # the same wiring, launch by launch
    monkeypatch.setattr(layer_plans, "make_plan", lambda *a, **k: None)
    monkeypatch.setattr(layer_plans, "make_attention_plans", lambda *a, **k: None)
    calls.clear()
    one_by_one = Engine(EngineConfig(model_path=str(wide_q4), dtype="bfloat16"))
    for p, out in zip(prompts, outs, strict=True):
        ref = generate(one_by_one, p, sampling)
        assert out.tokens == ref.tokens
        assert [[lp for _, lp in o.top] for o in out.logprobs] == [[lp for _, lp in o.top] for o in ref.logprobs]
    assert not calls
    spec = SpecConfig(method="ngram", budget=8, max_depth=4, tree="ddtree", adaptive=False)
    for p, out in zip(prompts, outs, strict=True):
        fast = generate(planned, p, sampling, spec)
        i = next((k for k, (a, b) in enumerate(zip(out.tokens, fast.tokens)) if a != b), None)
        if i is not None:
            top = out.logprobs[i].top
            assert top[0][1] - top[1][1] <= NEAR_TIE, f"flip at {i} with a clear winner"


@pytest.mark.skipif(not plans_available(), reason="launch plans run on CUDA with the engine's extension built")
def test_the_gated_step_changes_no_bit(wide_q4, monkeypatch):
    """A GDN layer's step with its output norm and gate in one launch (engine.kernels.GATED_STEP,
    opt-in) against the two launches: greedy tokens and their logprobs to the bit."""
    from engine import kernels, launch_plan

    monkeypatch.setattr(launch_plan.SWITCH, "value", True)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    rng = np.random.RandomState(7)
    prompts = [[int(t) for t in rng.randint(0, 500, size=n)] for n in (9, 23)]
    calls: list[bool] = []
    real = kernels.KernelCore.step_gated
    monkeypatch.setattr(kernels.KernelCore, "step_gated", lambda self, *a: calls.append(True) or real(self, *a))
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(kernels.GATED_STEP, "value", on)
        calls.clear()
        engine = Engine(EngineConfig(model_path=str(wide_q4), dtype="bfloat16"))
        outs[on] = [generate(engine, p, sampling) for p in prompts]
        assert bool(calls) == on  # recorded into the plans, or run launch by launch
    for fused, apart in zip(outs[True], outs[False], strict=True):
        assert fused.tokens == apart.tokens
        assert [[lp for _, lp in o.top] for o in fused.logprobs] == [[lp for _, lp in o.top] for o in apart.logprobs]
