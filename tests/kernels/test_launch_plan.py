"""Launch plans (engine/launch_plan.py, engine/cuda_ext.cpp): recording and layout everywhere; on
CUDA, a plan's results equal, bit for bit, the same kernels launched one by one through MLX."""

from __future__ import annotations

import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from engine import kernels
from engine.gdn.core import GDNShape
from engine.kernels import ADD_NORM, GDN_STEP, QMM_MMA, gpu_backend
from engine.launch_plan import ALIGN, MAX_NDIM, SHAPE_TYPES, Buf, columns, kernel_source, record
from engine.layer_plans import (
    AttentionLayer,
    GDNLayer,
    attention_output_rows,
    attention_project_rows,
    gdn_decode_step,
    make_attention_plans,
)

SMALL = GDNShape(Hk=2, Hv=4, Dk=64, Dv=64, K=4)
HIDDEN, INTERMEDIATE = 256, 512


def record_step(layer: GDNLayer, hidden: int = HIDDEN) -> tuple[Any, tuple[Buf, ...]]:
    s = layer.shape
    with record("gdn-step") as rec:
        args = (rec.arg((1, 1, hidden), mx.bfloat16), rec.arg((s.K - 1, s.conv_dim), mx.bfloat16),
                rec.arg((s.Hv, s.Dv, s.Dk), mx.float32))
        results = gdn_decode_step(layer, *args)
    return rec, results


def test_a_gdn_step_records_its_nine_launches_in_order():
    layer = GDNLayer.random(SMALL, HIDDEN, INTERMEDIATE)
    rec, results = record_step(layer)
    names = [launch.spec.name for launch in rec.launches]
    assert names == ["spruce_rms_norm", "spruce_qmm_mma", "spruce_gdn_step", "spruce_gated_norm", "spruce_qmm_mma_res",
                     "spruce_rms_norm", "spruce_qmm_mma", "spruce_swiglu", "spruce_qmm_mma_res"]
    assert not kernels.RECORDERS  # the recorder is gone after the block
    # the step kernel reads qkv, a and b where the fused projection wrote them: byte offsets of
    # columns 0, conv_dim + value_dim + Hv and conv_dim + value_dim in bf16
    project, step = rec.launches[1], rec.launches[2]
    y_region = project.args[-1][0]
    s = SMALL
    qkv, a, b = step.args[0], step.args[1], step.args[2]
    assert (qkv[0], qkv[1]) == (y_region, 0)
    assert (a[0], a[1]) == (y_region, 2 * (s.conv_dim + s.value_dim + s.Hv))
    assert (b[0], b[1]) == (y_region, 2 * (s.conv_dim + s.value_dim))
    # the weights are captured once each, as constants
    consts = [r for r in rec.regions if r.kind == "const"]
    assert len({id(r.array) for r in consts}) == len(consts)
    assert [r.shape for r in results] == [(1, 1, HIDDEN), (s.K - 1, s.conv_dim), (s.Hv, s.Dv, s.Dk)]
    # the residual adds read the layer's input (the plan's first array) and the attention's output
    assert rec.launches[4].args[-2][0] == 0


def test_with_the_gated_step_a_gdn_step_records_eight_launches(monkeypatch):
    """kernels.GATED_STEP on (opt-in): the step and the gated norm are one launch, which reads
    qkv, a and b where the projection wrote them and z from column conv_dim on."""
    monkeypatch.setattr(kernels.GATED_STEP, "value", True)
    monkeypatch.setattr(kernels, "gpu_backend", lambda: "cuda")  # FastPath asks for a GPU backend
    rec, results = record_step(GDNLayer.random(SMALL, HIDDEN, INTERMEDIATE))
    names = [launch.spec.name for launch in rec.launches]
    assert names == ["spruce_rms_norm", "spruce_qmm_mma", "spruce_gdn_step_gated", "spruce_qmm_mma_res",
                     "spruce_rms_norm", "spruce_qmm_mma", "spruce_swiglu", "spruce_qmm_mma_res"]
    project, step = rec.launches[1], rec.launches[2]
    y_region, s = project.args[-1][0], SMALL
    assert (step.args[0][0], step.args[0][1]) == (y_region, 0)
    assert (step.args[8][0], step.args[8][1]) == (y_region, 2 * s.conv_dim)  # z
    assert [r.shape for r in results] == [(1, 1, HIDDEN), (s.K - 1, s.conv_dim), (s.Hv, s.Dv, s.Dk)]
    # the output projection reads the step's first output
    assert rec.launches[3].args[0][0] == step.args[-3][0]


def test_shapes_a_body_reads_are_passed_as_mlx_passes_them():
    layer = GDNLayer.random(SMALL, HIDDEN, INTERMEDIATE)
    rec, _ = record_step(layer)
    norm = rec.launches[0]
    # the norm's body reads x_shape: after x's pointer comes its Shape, MAX_NDIM int32 by value
    assert "const __grid_constant__ Shape x_shape" in norm.source.text
    blob = norm.args[1][3]
    assert norm.args[1][0] == -1 and struct.unpack(f"<{MAX_NDIM}i", blob)[:3] == (1, HIDDEN, 0)
    # gated_norm reads o's strides: int64, dense
    gated = rec.launches[3]
    strides = [a[3] for a in gated.args if a[0] == -1 and len(a[3]) == 8 * MAX_NDIM]
    assert struct.unpack(f"<{MAX_NDIM}q", strides[0])[:3] == (SMALL.Dv * SMALL.Hv, SMALL.Dv, 1)


def test_kernel_source_is_mlx_build_kernel_layout():
    src = kernel_source(QMM_MMA, [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16], [2, 2, 2, 2], [mx.bfloat16],
                        [("OutT", mx.bfloat16), ("GS", 64), ("DQ", True)])
    text = src.text
    assert src.kernel == f"mlx::core::cu::{src.module}"
    head = text[text.index(f"__global__ void {src.module}("):]
    assert head.index("const __nv_bfloat16* x") < head.index("const unsigned int* w") < head.index("__nv_bfloat16* y")
    assert "  using OutT = __nv_bfloat16;\n  constexpr int GS = 64;\n  constexpr bool DQ = true;\n" in text
    assert text.rstrip().endswith("} // namespace mlx::core::cu")
    # another template or dtype is another kernel
    other = kernel_source(QMM_MMA, [mx.float16, mx.uint32, mx.float16, mx.float16], [2, 2, 2, 2], [mx.float16],
                          [("OutT", mx.float16), ("GS", 64), ("DQ", True)])
    assert other.module != src.module


STUB = Path(__file__).resolve().parents[2] / "metal" / "stub"


HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def record_attention(layer: AttentionLayer, hidden: int = HIDDEN) -> tuple[Any, tuple[Buf, ...], Any, Buf]:
    """The attention layer's two halves recorded: (recorder, (q, k, v, gate), recorder, out)."""
    width = layer.heads * layer.head_dim
    with record("attention-project") as rec:
        front = attention_project_rows(layer, rec.arg((1, 1, hidden), mx.bfloat16))
    with record("attention-output") as rec2:
        out = attention_output_rows(layer, rec2.arg((1, 1, hidden), mx.bfloat16), rec2.arg((1, 1, width), mx.bfloat16),
                                    rec2.arg((1, 1, width), mx.bfloat16))
    return rec, front, rec2, out


def test_an_attention_layer_records_its_two_halves():
    layer = AttentionLayer.random(HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE)
    rec, (q, k, v, gate), rec2, out = record_attention(layer)
    assert [launch.spec.name for launch in rec.launches] == ["spruce_rms_norm", "spruce_qmm_mma", "spruce_head_norms"]
    assert [launch.spec.name for launch in rec2.launches] == [
        "spruce_sigmoid_gate", "spruce_qmm_mma_res", "spruce_rms_norm", "spruce_qmm_mma", "spruce_swiglu",
        "spruce_qmm_mma_res"]
    assert [b.shape for b in (q, k, v, gate)] == [(1, HEADS, 1, HEAD_DIM), (1, KV_HEADS, 1, HEAD_DIM),
                                                  (1, KV_HEADS, 1, HEAD_DIM), (1, 1, HEADS * HEAD_DIM)]
    assert out.shape == (1, 1, HIDDEN)
    # the gate reads the attention's output (the plan's second array) and the gate (its third);
    # o_proj's residual is the layer's input (its first)
    gate_launch, o_proj = rec2.launches[0], rec2.launches[1]
    assert [a[0] for a in gate_launch.args if a[0] >= 0][:2] == [1, 2]
    assert o_proj.args[-2][0] == 0
    plans = make_attention_plans(layer, HIDDEN, mx.bfloat16) if cuda_plans() else None
    native = NativeDouble()
    project, output = rec.build([q, k, v, gate], ext=native), rec2.build([out], ext=native)
    assert project.launches == 3 and output.launches == 6
    assert [r for r, _ in project.results] == [(1, HEADS, 1, HEAD_DIM), (1, KV_HEADS, 1, HEAD_DIM),
                                              (1, KV_HEADS, 1, HEAD_DIM), (1, 1, HEADS * HEAD_DIM)]
    assert plans is None or plans.project.results == project.results


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_a_gdn_steps_plan_sources_compile_against_the_stub(tmp_path):
    """Every launch's whole source, as the plan hands it to NVRTC, is valid C++ for g++ with the
    CUDA stub of metal/stub (which brings its own Shape and Strides): a GDN step's and both halves
    of an attention layer's."""
    rec, _ = record_step(GDNLayer.random(SMALL, HIDDEN, INTERMEDIATE))
    front, _, back, _ = record_attention(AttentionLayer.random(HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE))
    for launch in [*rec.launches, *front.launches, *back.launches]:
        assert SHAPE_TYPES in launch.source.text
        src = tmp_path / f"{launch.source.module}.cpp"
        src.write_text('#include "cuda_stub.h"\n' + launch.source.text.replace(SHAPE_TYPES, ""))
        p = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wno-attributes", f"-I{STUB}", f"-I{STUB / 'cuda'}",
                            str(src)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]


def test_placeholders_reshape_and_take_columns_of_one_row_only():
    b = Buf(3, 0, (1, 12), mx.bfloat16)
    assert b.reshape(3, -1).shape == (3, 4) and b.reshape((12,)).shape == (12,)
    with pytest.raises(ValueError):
        b.reshape(5, -1)
    c = columns(b, 4, 10)
    assert (c.region, c.offset, c.shape) == (3, 8, (1, 6))
    with pytest.raises(ValueError):
        columns(Buf(3, 0, (2, 12), mx.bfloat16), 0, 4)
    with pytest.raises(ValueError):
        columns(b, 4, 13)


def test_recording_takes_placeholders_and_arrays_only():
    with record("bad") as rec, pytest.raises(TypeError):
        kernels.compiled_kernel(ADD_NORM, "cuda")(
            inputs=[[1.0], rec.arg((1, 1, 64), mx.bfloat16)], template=[], grid=(64, 1, 1), threadgroup=(64, 1, 1),
            output_shapes=[(1, 1, 64)], output_dtypes=[mx.bfloat16])
    with record("metal") as rec, pytest.raises(ValueError):
        kernels.compiled_kernel(GDN_STEP, "metal")(
            inputs=[], template=[], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[], output_dtypes=[])


@dataclass(eq=False)  # hashed by identity, as a module is (kernels are cached per extension)
class NativeDouble:
    """What Recorder.build hands the native module, kept for inspection (the layout is Python's; the
    native side is exercised on CUDA below)."""

    plans: list[tuple[Any, ...]] = field(default_factory=list)

    def compute_capability(self) -> tuple[int, int]:
        return 9, 0

    def compile_kernel(self, module: str, text: str, name: str, arch: str, options: list[str]) -> str:
        assert arch == "sm_90a" and name.endswith(module)
        return module

    def make_plan(self, name: str, launches: list[Any], input_bytes: list[int], outputs: list[int]) -> tuple[Any, ...]:
        self.plans.append((name, launches, input_bytes, outputs))
        return self.plans[-1]


def test_a_plan_keeps_scratch_apart_and_returns_fresh_results():
    layer = GDNLayer.random(SMALL, HIDDEN, INTERMEDIATE)
    rec, results = record_step(layer)
    native = NativeDouble()
    plan = rec.build(list(results), ext=native)
    _, launches, input_bytes, outputs = native.plans[0]
    n_consts = len(plan.constants)
    n_args = 3
    workspace = n_args + n_consts
    assert outputs == list(range(workspace + 1, workspace + 4))  # three fresh arrays after the workspace
    assert plan.workspace.nbytes >= input_bytes[workspace] > 0
    # scratch: each launch result outside the fresh arrays starts on an ALIGN boundary of the
    # workspace, after the one before it ends; every launch touching the workspace declares it
    # written (so MLX orders them)
    starts = sorted({launch[4][-1][1] for launch in launches if launch[4][-1][0] == workspace})
    assert starts and all(o % ALIGN == 0 for o in starts) and len(starts) == len(set(starts))
    for launch in launches:
        for index, offset, written, value in launch[4]:
            if index == workspace:
                assert written and 0 <= offset < input_bytes[workspace]
            if index == -1:
                assert value
    # the results are written straight into the fresh arrays
    written_slots = {a[0] for launch in launches for a in launch[4] if a[2]}
    assert set(outputs) <= written_slots
    assert plan.launches == 9 and plan.results[0] == ((1, 1, HIDDEN), mx.bfloat16)


def test_a_plan_result_must_be_a_whole_launch_result():
    layer = GDNLayer.random(SMALL, HIDDEN, INTERMEDIATE)
    rec, results = record_step(layer)
    part = Buf(results[0].region, 2, (1, 1, HIDDEN - 1), mx.bfloat16)
    with pytest.raises(ValueError):
        rec.build([part], ext=NativeDouble())
    rec2, results2 = record_step(layer)
    with pytest.raises(ValueError):
        rec2.build([results2[0], results2[0]], ext=NativeDouble())


def test_plans_are_on_by_default_on_cuda_only_and_never_without_the_extension(monkeypatch):
    from engine import cuda_ext, launch_plan

    assert launch_plan.SWITCH.on == ("cuda",)
    monkeypatch.setattr(launch_plan.SWITCH, "value", True)
    assert launch_plan.enabled() == (cuda_ext.module() is not None)
    if gpu_backend() != "cuda":
        assert cuda_ext.module() is None and not launch_plan.enabled()
    monkeypatch.setattr(launch_plan.SWITCH, "value", False)
    assert not launch_plan.enabled()


def cuda_plans() -> bool:
    if gpu_backend() != "cuda":
        return False
    from engine import cuda_ext

    return cuda_ext.module() is not None


needs_plans = pytest.mark.skipif(not cuda_plans(), reason="launch plans run on CUDA with the engine's extension built")


@needs_plans
@pytest.mark.parametrize("shape,hidden,intermediate", [
    (SMALL, HIDDEN, INTERMEDIATE),
    (GDNShape(Hk=4, Hv=8, Dk=128, Dv=128, K=4), 1024, 3072),
])
def test_plan_equals_its_launches_one_by_one_bitwise(shape, hidden, intermediate):
    layer = GDNLayer.random(shape, hidden, intermediate, seed=3)
    rec, results = record_step(layer, hidden)
    plan = rec.build(list(results))
    keys = mx.random.split(mx.random.key(7), 4)
    x = mx.random.normal((1, 1, hidden), key=keys[0]).astype(mx.bfloat16)
    conv = (mx.random.normal((shape.K - 1, shape.conv_dim), key=keys[2]) * 0.5).astype(mx.bfloat16)
    S = mx.random.normal((shape.Hv, shape.Dv, shape.Dk), key=keys[3]) * 0.1
    direct, planned = (x, conv, S), (x, conv, S)
    for _ in range(3):  # chained: each step's results are the next step's inputs
        direct = gdn_decode_step(layer, *direct)
        planned = tuple(plan(*planned))
        mx.eval(*direct, *planned)
        for got, want in zip(planned, direct, strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert bool(mx.array_equal(got, want)), "a plan's result differs from its launches'"


@needs_plans
def test_plan_refuses_arrays_it_was_not_recorded_for():
    layer = GDNLayer.random(SMALL, HIDDEN, INTERMEDIATE)
    rec, results = record_step(layer)
    plan = rec.build(list(results))
    s = SMALL
    good = [mx.zeros((1, 1, HIDDEN), mx.bfloat16), mx.zeros((s.K - 1, s.conv_dim), mx.bfloat16),
            mx.zeros((s.Hv, s.Dv, s.Dk))]
    assert plan.accepts(*good) and not plan.accepts(*good[:2])
    with pytest.raises(ValueError):
        plan(*good[:2])
    with pytest.raises(ValueError):
        plan(good[0].astype(mx.float32), *good[1:])


@needs_plans
@pytest.mark.parametrize("heads,kv_heads,head_dim,hidden,intermediate", [
    (HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE),
    (16, 4, 256, 1024, 3072),
])
def test_attention_plans_equal_their_launches_one_by_one_bitwise(heads, kv_heads, head_dim, hidden, intermediate):
    layer = AttentionLayer.random(heads, kv_heads, head_dim, hidden, intermediate, seed=5)
    plans = make_attention_plans(layer, hidden, mx.bfloat16)
    keys = mx.random.split(mx.random.key(9), 2)
    x = mx.random.normal((1, 1, hidden), key=keys[0]).astype(mx.bfloat16)
    attended = mx.random.normal((1, 1, heads * head_dim), key=keys[1]).astype(mx.bfloat16)
    for _ in range(3):  # chained: the stream after each layer is the next one's input
        front, planned_front = attention_project_rows(layer, x), plans.project(x)
        out, planned_out = attention_output_rows(layer, x, attended, front[3]), plans.output(x, attended, front[3])
        mx.eval(*front, *planned_front, out, *planned_out)
        for got, want in zip([*planned_front, *planned_out], [*front, out], strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert bool(mx.array_equal(got, want)), "a plan's result differs from its launches'"
        x, attended = out, front[0].reshape(1, 1, -1)
