"""Quantized projections that take in the norm before them, the SwiGLU before them or the residual
add after them, one CUDA launch each (metal/qmm_mma.kernel's SPR_NORM_IN, SPR_SWIGLU_IN and
SPR_RES_OUT builds, engine.qmm.quantized_matmul_mma).

Why: on the H200 a 9B-shaped step waits for the host encoding its ~420 launching operations
(~10 µs each: BENCHMARKS.md, issue 13, twenty-fourth session). A decoder layer runs its input norm,
the input projection, the output projection, the residual add, the post-attention norm, gate|up,
the SwiGLU, down and a second residual add as nine launches; with these builds they are four
(norm + in-proj, out-proj + add, norm + gate|up, SwiGLU + down + add), ~5 fewer a layer, ~160 a
9B step.

`project`, `linear_res` and `mlp_residual` run the fused build where the projection is a routed
affine quantized one the kernel covers (CUDA, bf16 / fp16 rows, at most 32 of them), and otherwise
the same ops unfused. The switch is read once, where a decoder layer picks its wiring
(engine/models/qwen3_5.py); only that wiring hands norms and residuals to these functions. Each build keeps qmm_mma's
batch invariance (a verify row equals the one-row step bitwise); the norm build rounds differently
from `mx.fast.rms_norm` followed by the product (x * w rounded to the row type, 1 / rms applied to
the fp32 sums), like the fused add + norm before it.

The residual builds alone are on by default on CUDA (SPRUCE_QMM_RES=0 turns them off); all builds
are opt-in (SPRUCE_QMM_FUSE=1). With launch plans (engine/launch_plan.py, on by default on CUDA) the
GDN layers' norms run through `KernelNorm` and their MLP's SwiGLU through engine/fused_norms.py's
kernel (`mlp_residual(..., swiglu_kernel=True)`): the kernels the plans record. Emulated on the CPU
against the op twins (tests/kernels/test_qmm_mma_emulated.py), run on the H200 in the thirty-third and thirty-fourth
sessions (BENCHMARKS.md, issue 13).
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from engine import fused_norms, launch_plan
from engine.cpu_exp import silu
from engine.kernels import FastPath, gpu_backend
from engine.models.fused import FusedProjection
from engine.models.qlinear import RowsQuantizedLinear
from engine.qmm import as_rows, mma_covers, quantized_matmul_mma

# on with SPRUCE_QMM_FUSE=1 on CUDA; benchmarks set the value (scripts/variants.py's "-qf1"). Read
# when a layer's compiled functions are traced: a layer keeps one trace per setting.
SWITCH = FastPath("SPRUCE_QMM_FUSE")
# The residual builds alone ("-qr1"; SPRUCE_QMM_RES=0 turns them off): out-projection + add and
# down + add, the norms and the SwiGLU as their own launches, 7 launches a layer instead of 9. Why
# apart: on the H200 the norm and SwiGLU builds cost 1.5-2.3x the plain build on the device at one
# row (thirty-third and thirty-fourth sessions: at one row the plain build is already bound by the
# instructions it issues, and the prologue adds to them), while the residual build costs what the
# plain one costs. On by default on CUDA since the thirty-fourth session: its verify logits are
# the default's bit for bit on the H200 (tests/engine/test_qlinear.py), and end to end it was
# 2.17x mlx-lm against the unfused wiring's 2.12x (run-by-run medians, one process; BENCHMARKS.md).
RES = FastPath("SPRUCE_QMM_RES", on=("cuda",))


def wiring() -> tuple[bool, bool]:
    """(the residual builds, the norm and SwiGLU builds) a decoder layer is wired for: both with
    SWITCH, the first alone with RES or where launch plans are (engine/launch_plan.py)."""
    if launch_plan.enabled():
        return True, False
    prologues = SWITCH.enabled()
    return prologues or RES.enabled(), prologues


class Norm(Protocol):  # engine.models.layers.RMSNorm
    weight: mx.array
    eps: float

    def __call__(self, x: mx.array) -> mx.array: ...


def quantized_weights(proj: nn.Module) -> tuple[mx.array, mx.array, mx.array, int, int] | None:
    """(weight, scales, biases, group size, bits) of a routed affine quantized projection."""
    if isinstance(proj, RowsQuantizedLinear):
        ok = proj.mode == "affine" and "bias" not in proj
    elif isinstance(proj, FusedProjection):
        ok = proj.quantized and proj.routed and proj.mode == "affine"
    else:
        return None
    if not ok or "biases" not in proj:
        return None
    return proj["weight"], proj["scales"], proj["biases"], proj.group_size, proj.bits


def covers(proj: nn.Module, x: mx.array, swiglu: bool = False) -> bool:
    """Whether a fused build computes proj on rows x [..., I] ([..., 2 I] with swiglu): CUDA, a
    routed affine quantized projection qmm_mma covers."""
    q = quantized_weights(proj)
    if q is None or gpu_backend() != "cuda":
        return False
    rows = as_rows(x)
    return mma_covers(rows[:, : rows.shape[1] // 2] if swiglu else rows, *q)


def fused(proj: nn.Module, x: mx.array, *, norm: Norm | None = None, swiglu: bool = False,
          res: mx.array | None = None) -> mx.array:
    """The fused build, one launch, where covers(proj, x, swiglu): proj(norm(x)), proj(silu(gate)
    * up) with x = gate | up along the last axis, or proj(x), plus res where given -> [..., O],
    unsplit."""
    q = quantized_weights(proj)
    assert q is not None
    w, scales, biases, group_size, bits = q
    y = quantized_matmul_mma(as_rows(x), w, scales, biases, group_size, bits,
                             norm=None if norm is None else (norm.weight, norm.eps), swiglu=swiglu,
                             res=None if res is None else as_rows(res))
    return y.reshape(*x.shape[:-1], w.shape[0])


def project(proj: nn.Module, x: mx.array, norm: Norm | None = None) -> mx.array | list[mx.array]:
    """proj(norm(x)), or proj(x) without a norm: the fused build where it covers and the norm
    builds are on (SWITCH), else the same ops unfused. A FusedProjection's outputs come back split,
    as it returns them."""
    if norm is not None and SWITCH.enabled() and covers(proj, x):
        y = fused(proj, x, norm=norm)
        return list(mx.split(y, list(proj.split_at), axis=-1)) if isinstance(proj, FusedProjection) else y
    return proj(norm(x) if norm is not None else x)


def linear_res(proj: nn.Module, x: mx.array, res: mx.array) -> mx.array:
    """res + proj(x) for one projection: the fused build where it covers, else the same ops."""
    if covers(proj, x) and res.dtype == x.dtype and not isinstance(proj, FusedProjection):
        return fused(proj, x, res=res)
    return res + proj(x)


def mlp_residual(mlp: nn.Module, h: mx.array, norm: Norm, swiglu_kernel: bool = False) -> mx.array:
    """h + mlp(norm(h)): two launches (norm + gate|up, SwiGLU + down + add) where the builds cover
    the MLP's fused gate|up and its down projection and SWITCH is on; else norm, gate|up, SwiGLU
    (the MLP's own, or with `swiglu_kernel` engine/fused_norms.py's one launch where the fused
    gate|up is a covered build) and down + add (one launch where the residual build covers it)."""
    gate_up = mlp["fused"] if "fused" in mlp else None
    if swiglu_kernel:
        rows = as_rows(norm(h))
        if gate_up is not None and covers(gate_up, rows):
            hidden = fused_norms.swiglu(fused(gate_up, rows))
        else:
            hidden = mlp.hidden(rows)
        return linear_res(mlp.down_proj, hidden.reshape(*h.shape[:-1], -1), h)
    if SWITCH.enabled() and gate_up is not None and covers(gate_up, h):
        y = fused(gate_up, h, norm=norm)
        if covers(mlp.down_proj, y, swiglu=True):
            return fused(mlp.down_proj, y, swiglu=True, res=h)
        gate, up = mx.split(y, 2, axis=-1)
        return h + mlp.down_proj(silu(gate) * up)
    return linear_res(mlp.down_proj, mlp.hidden(as_rows(norm(h))).reshape(*h.shape[:-1], -1), h)


class KernelNorm:
    """An RMSNorm module's weight and epsilon through engine/fused_norms.py's own kernel: the
    launch-plan wiring's norm for the GDN layers (a plan holds the engine's kernels only, and a
    verify's rows must run what the plan runs). Rows of any rank: the kernel sees them 2-D."""

    def __init__(self, norm: Norm) -> None:
        self.weight, self.eps = norm.weight, norm.eps

    def __call__(self, x: mx.array) -> mx.array:
        rows = as_rows(x)
        out = fused_norms.rms_rows(rows, self.weight, self.eps)
        return out if x.ndim == 2 else out.reshape(x.shape)
