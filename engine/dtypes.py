"""The compute dtype: what `--dtype auto` means on this machine.

On a GPU (Metal or CUDA) matmuls are memory-bound at batch size 1 and bf16 halves the bytes read
per token, so `auto` is bfloat16 there; a bf16 checkpoint is then loaded as it is stored, never
upcast. On the CPU MLX has no bf16 SIMD path (bf16 and fp16 matmuls, quantized ones above all,
run several times slower than fp32), so `auto` is float32 there.
"""

from __future__ import annotations

import mlx.core as mx

from engine.config import DTYPE_NAMES

# Verifying many rows may round differently from a one-row step, so in bf16 speculation may pick
# the other of two tokens whose logits are this close (the tests' and flip_check's rule). bf16
# keeps 8 significant bits: logits of magnitude ~4-8 round in steps of 1/32-1/16, and a forward
# pass accumulates a few such steps.
BF16_NEAR_TIE = 0.125

DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
assert set(DTYPES) | {"auto"} == set(DTYPE_NAMES)


def resolve_dtype(name: str, device: mx.Device | None = None) -> str:
    """'auto' -> 'bfloat16' on a GPU, 'float32' on the CPU; any other name is returned checked."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    if name != "auto":
        return name
    device = device or mx.default_device()
    return "bfloat16" if device.type == mx.DeviceType.gpu else "float32"
