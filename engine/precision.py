"""Float32 products in full float32 on every backend, unless the user asks otherwise.

MLX runs float32 matmul-family operations (matmul, quantized matmul, attention) at TF32 precision
by default on hardware with matrix units: CUDA's tensor cores and Apple's M5 (MLX's
`MLX_ENABLE_TF32`, default 1; its docs, "Numerical Precision"). There a product of several rows (a
verify's tree, a prefill chunk) takes the reduced-precision path while a one-row step's
matrix-vector product stays float32, so a verify row's logits differ from the plain step's by
TF32's rounding (10 mantissa bits), far past float32's, and speculation may change a float32
model's tokens wherever two logits are that close. The GPU's lossless tests had always been run
with the variable at 0; run without it on an H100, the half-K/V-cache one (tiny float32 model,
greedy, fan-shaped trees) left plain decoding's tokens at the 8th (BENCHMARKS.md, issue 13,
fifty-sixth session).

The engine's promise is plain decoding's output, so importing the engine turns TF32 off, as MLX's
own test suite does. A user who sets MLX_ENABLE_TF32 keeps that choice (1: faster float32 GEMMs on
those GPUs, and speculation exact only up to TF32's near-ties, as for a bfloat16 model).
Half-precision compute (bfloat16, float16: the default for quantized checkpoints on a GPU) is not
affected either way.

MLX reads the variable at its first such operation, so it must be set before any runs: the engine
package sets it when it is imported (engine/__init__.py), before it imports mlx.
"""

from __future__ import annotations

import os

TF32 = "MLX_ENABLE_TF32"


def full_float32() -> None:
    """Default MLX_ENABLE_TF32 to 0 where the user has not set it."""
    os.environ.setdefault(TF32, "0")
