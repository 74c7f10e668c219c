"""Projections that read the same input, fused into one matmul after loading.

A layer's input projections (GDN: qkv, z, b, a; attention: q, k, v; MLP: gate, up) all multiply
the same rows. One matmul over their stacked weights costs one launch instead of up to four, and
on the GPU the small ones stop falling to slow paths: measured on the H200 (scripts/profile_gpu.py,
9B layer shapes, 17 rows), MLX ran the 32-row a and b projections through its naive quantized
kernel (92 us each) and each small projection alone filled a fraction of the SMs.

Weights are stacked along the output axis, so each output column is the same dot product over
the same input as before; the split hands back views in the original order. Only projections
of one kind fuse: all plain float linear layers without bias (`nn.Linear`, or the engine's
`Linear`), or all `nn.QuantizedLinear` with the same group size, bits and mode (a
Hadamard-rotated one keeps its own module). The loader fuses on CUDA only unless SPRUCE_FUSE says
otherwise: on the CPU, OpenBLAS ran some stacked one-row products several times slower than the
parts, and Metal could not be measured here.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import mlx.core as mx
import mlx.nn as nn

from engine.models.linear import Linear
from engine.qmm import quantized_linear


class FusedProjection(nn.Module):
    """x [..., I] -> the projections' outputs, in the order they were fused."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        first = parts[0]
        self.quantized = isinstance(first, nn.QuantizedLinear)
        self.weight = mx.concatenate([p["weight"] for p in parts])
        if self.quantized:
            assert isinstance(first, nn.QuantizedLinear)
            self.group_size, self.bits, self.mode = first.group_size, first.bits, first.mode
            self.scales = mx.concatenate([p["scales"] for p in parts])
            if "biases" in first:
                self.biases = mx.concatenate([p["biases"] for p in parts])
        self.routed = False  # set by engine/models/qlinear.py where the engine's matmul is routed in
        sizes = [p["weight"].shape[0] for p in parts]
        self.split_at = tuple(accumulate(sizes))[:-1]

    def __call__(self, x: mx.array) -> list[mx.array]:
        if self.quantized:
            y = quantized_linear(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                                 self.mode, routed=self.routed)
        else:
            y = x @ self["weight"].T
        return list(mx.split(y, list(self.split_at), axis=-1))


def can_fuse(parts: Sequence[nn.Module]) -> bool:
    """Same kind, no bias, same input width, same quantization."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or kinds.pop() not in (nn.Linear, Linear, nn.QuantizedLinear) or any("bias" in p for p in parts):
        return False
    if isinstance(parts[0], nn.QuantizedLinear):
        settings = {(p.group_size, p.bits, p.mode, "biases" in p, p["weight"].shape[1]) for p in parts}
        return len(settings) == 1
    return len({p["weight"].shape[1] for p in parts}) == 1


def fuse_into(owner: nn.Module, names: Sequence[str], attr: str = "fused") -> bool:
    """Replace owner's projections `names` by one FusedProjection stored as `owner.<attr>`
    (the originals are dropped, so their memory goes). -> whether it fused."""
    parts = [owner[n] for n in names]
    if not can_fuse(parts):
        return False
    fused = FusedProjection(parts)
    mx.eval(fused.parameters())
    for n in names:
        del owner[n]
    owner[attr] = fused
    return True
