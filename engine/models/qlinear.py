"""The model's quantized projections through the engine's own choice of matmul per backend
(engine.qmm.quantized_linear), where the loader routes them (SPRUCE_QMM=0|1 overrides:
engine/loader.py; on by default on CUDA and the CPU, where each was measured). On the CPU the
loader first turns them into float32 projections where that fits in memory (`dequantize_projections`).

- CUDA: the small-M tensor-core kernel (metal/qmm_mma.kernel). MLX's CUDA quantized matmul
  streams the weights once per activation row below 8 rows and, from 8 rows on, launches one block
  per 128 output rows without splitting the reduction (scripts/profile_gpu.py: the 9B down_proj
  took 342 us at 17 rows against 43 at one, on 32 of 132 SMs). qmm_mma reads each weight once for
  up to 32 rows, splits the reduction over the warps of a block, and gives a row the same result
  whatever the number of rows, so a verify row equals the one-row step. Calls it does not cover
  (more than 32 rows: prefill; fp32 activations; other bit widths) run mx.quantized_matmul.
- CPU: MLX's quantized matmul costs every row about what one row costs, so from a few rows on
  (a 17-node verify, a prefill chunk) the weight is dequantized and a BLAS GEMM runs instead.
"""

from __future__ import annotations

from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from engine.models.fused import FusedProjection
from engine.models.linear import Linear
from engine.qmm import quantized_linear

M = TypeVar("M", bound=nn.Module)


def same_weights(cls: type[M], q: nn.Module, attributes: tuple[str, ...]) -> M:
    """A module of class `cls` holding q's arrays (not copied) and `attributes`, frozen; the
    quantized modules' own constructors would quantize a random matrix of the full size first."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for attribute in attributes:
        setattr(new, attribute, getattr(q, attribute))
    for name in ("weight", "scales", "biases", "bias"):
        if name in q:
            new[name] = q[name]
    new.freeze()
    return new


class RowsQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose matmul goes through engine.qmm.quantized_linear."""

    @classmethod
    def of(cls, q: nn.QuantizedLinear) -> RowsQuantizedLinear:
        return same_weights(cls, q, ("group_size", "bits", "mode"))

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_linear(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                             self.mode)
        return y + self["bias"] if "bias" in self else y


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose `as_linear` (the output projection of a model with tied
    embeddings: a verify's or a prefill's last rows times the whole vocabulary) goes through
    engine.qmm.quantized_linear; the lookup is unchanged."""

    @classmethod
    def of(cls, q: nn.QuantizedEmbedding) -> RowsQuantizedEmbedding:
        return same_weights(cls, q, ("group_size", "bits", "mode", "num_embeddings", "dims"))

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_linear(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                                self.mode)


def float32_bytes(model: nn.Module) -> int:
    """What the model's affine quantized projections and embedding would take in float32."""
    total = 0
    for _, module in model.named_modules():
        if _dequantizable(module):
            out, packed = module["weight"].shape
            total += 4 * out * packed * (32 // module.bits)
    return total


def _dequantizable(module: nn.Module) -> bool:
    """MLX's affine 4/8-bit projection or embedding, routed or not (not a subclass with its own
    behaviour, such as the Hadamard-rotated projection)."""
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, RowsQuantizedLinear, RowsQuantizedEmbedding)
    return type(module) in kinds and module.mode == "affine" and module.bits in (4, 8)


def dequantize_projections(model: nn.Module) -> int:
    """Replace the model's affine 4/8-bit projections and quantized embedding by float32 ones holding
    the dequantized weights (scale * q + bias, as the quantized matmul computes them: the same
    model, summed in another order) -> how many were replaced. Each is evaluated as it is made, and
    the quantized arrays go with the swap. Subclasses (the Hadamard-rotated projection) keep theirs.

    Why: MLX's CPU quantized matmul takes ~0.9 ns a weight at one row (8192 x 384 at 4 bits: 2.7 ms,
    the same product in float32 through the GEMV shim 0.1 ms) and its dequantize ~1.1-5.5 ns a weight
    (scripts/bench_cpu_dequant.py), so on the CPU a quantized checkpoint decodes fastest from
    float32 weights where memory allows (engine/loader.py decides)."""
    swaps: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not _dequantizable(module):
            continue
        w = mx.dequantize(module["weight"], module["scales"], module.get("biases"), group_size=module.group_size,
                          bits=module.bits, mode=module.mode).astype(mx.float32)
        mx.eval(w)
        dense: nn.Module
        if isinstance(module, nn.QuantizedEmbedding):
            dense = nn.Embedding.__new__(nn.Embedding)
        else:
            dense = Linear.__new__(Linear)
        nn.Module.__init__(dense)
        dense.weight = w
        if "bias" in module:
            dense.bias = module["bias"].astype(mx.float32)
        swaps.append((name, dense))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)


def route_quantized_projections(model: nn.Module) -> int:
    """Route the model's affine 4/8-bit projections (fused ones and a tied embedding's output
    projection included) through engine.qmm.quantized_linear; -> how many modules now do.
    Subclasses (the Hadamard-rotated projection) keep theirs."""
    swaps: list[tuple[str, nn.Module]] = []
    count = 0
    for name, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and module.mode == "affine" and module.bits in (4, 8):
            swaps.append((name, RowsQuantizedLinear.of(module)))
        elif type(module) is nn.QuantizedEmbedding and module.mode == "affine" and module.bits in (4, 8):
            swaps.append((name, RowsQuantizedEmbedding.of(module)))
        elif isinstance(module, FusedProjection) and module.quantized and module.mode == "affine":
            module.routed = True
            count += 1
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return count + len(swaps)
