"""Block-diagonal Hadamard rotations with random signs (block 32), as `spruce convert --hadamard`
uses them to spread outliers before quantizing (uzu's recipe, QuaRot's folding).

R = D H: D a diagonal of +-1 signs (fixed per vector size, so every matrix of a size shares
them), H the orthonormal Walsh-Hadamard matrix of size 32 repeated along the diagonal. R is
orthogonal and H symmetric, so for a row vector x: rotate(x) = x R, unrotate(x R) = x.

Where the rotation sits in a model is in docs/hadamard.md: the residual stream's rotation is folded
into the weights (nothing happens at run time); the inputs of the projections that follow an
elementwise product (attention o_proj, GDN out_proj, MLP down_proj) are rotated at run time by the
modules below, whose `input_signs` the converted checkpoint stores.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

BLOCK = 32
SIGN_SEED = 42


def signs(n: int, seed: int = SIGN_SEED) -> mx.array:
    """The +-1 signs for vectors of size n (float32): the same for every matrix of that size."""
    if n % BLOCK:
        raise ValueError(f"a Hadamard rotation of block {BLOCK} needs a size divisible by {BLOCK}, got {n}")
    bits = np.random.default_rng([seed, n]).integers(0, 2, size=n)
    return mx.array(bits * 2.0 - 1.0, dtype=mx.float32)


def rotate(x: mx.array, input_signs: mx.array) -> mx.array:
    """x [..., n] -> x D H (blocks of 32 along the last axis).

    Blocks of a power of two only: mx.hadamard_transform mis-handles sizes like 12 * 5."""
    shape = x.shape
    y = (x * input_signs.astype(x.dtype)).reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    return mx.hadamard_transform(y, scale=BLOCK**-0.5).reshape(shape)


def unrotate(y: mx.array, input_signs: mx.array) -> mx.array:
    """The inverse of rotate: (y H) D, since H is symmetric and orthonormal."""
    shape = y.shape
    x = mx.hadamard_transform(y.reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK), scale=BLOCK**-0.5)
    return x.reshape(shape) * input_signs.astype(y.dtype)


class RotatedLinear(nn.Linear):
    """A linear layer whose weight was stored as W R: y = rotate(x) (W R)^T = x W^T."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = False) -> None:
        super().__init__(input_dims, output_dims, bias=bias)
        self.input_signs = mx.ones((input_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(rotate(x, self.input_signs))

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine",
                     quantize_input: bool = False):
        group_size, bits = group_size or 64, bits or 4
        if mode != "affine" or quantize_input:
            raise ValueError("rotated layers are quantized in affine mode only, weights only")
        out_dims, in_dims = self.weight.shape
        q = RotatedQuantizedLinear(in_dims, out_dims, "bias" in self, group_size, bits)
        q.weight, q.scales, q.biases = mx.quantize(self.weight, group_size=group_size, bits=bits)
        if "bias" in self:
            q.bias = self.bias
        q.input_signs = self.input_signs
        return q


class RotatedQuantizedLinear(nn.QuantizedLinear):
    def __init__(self, input_dims: int, output_dims: int, bias: bool, group_size: int, bits: int) -> None:
        super().__init__(input_dims, output_dims, bias=bias, group_size=group_size, bits=bits)
        self.input_signs = mx.ones((input_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(rotate(x, self.input_signs))


def rotate_inputs_of(model: nn.Module, paths: Iterable[str]) -> int:
    """Replace the nn.Linear at each dotted path by a RotatedLinear (before quantization and
    before the weights load). -> how many were replaced."""
    modules = dict(model.named_modules())
    count = 0
    for path in paths:
        old = modules.get(path)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{path} is not a linear layer, its inputs cannot be rotated")
        out_dims, in_dims = old.weight.shape
        parent_path, _, name = path.rpartition(".")
        parent = modules[parent_path] if parent_path else model
        setattr(parent, name, RotatedLinear(in_dims, out_dims, bias="bias" in old))
        count += 1
    return count
