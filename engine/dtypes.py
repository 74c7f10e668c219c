"""The compute dtype: what `--dtype auto` means on this machine.

On a GPU (Metal or CUDA) matmuls are memory-bound at batch size 1 and bf16 halves the bytes read
per token, so `auto` is bfloat16 there; a bf16 checkpoint is then loaded as it is stored, never
upcast. On the CPU MLX has no bf16 SIMD path (bf16 and fp16 matmuls, quantized ones above all,
run several times slower than fp32), so `auto` is float32 there.
"""

from __future__ import annotations

import mlx.core as mx

from engine.config import DTYPE_NAMES, KV_DTYPE_NAMES

# Verifying many rows may round differently from a one-row step, so in bf16 speculation may pick
# the other of two tokens whose logits are this close (the tests' and flip_check's rule). bf16
# keeps 8 significant bits: logits of magnitude ~4-8 round in steps of 1/32-1/16, and a forward
# pass accumulates a few such steps.
BF16_NEAR_TIE = 0.125

DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# what a K/V cache may store: the float dtypes, or int8 rows with their scales (engine/kv_int8.py)
KV_DTYPES: dict[str, mx.Dtype] = {**DTYPES, "int8": mx.int8}
assert set(DTYPES) | {"auto"} == set(DTYPE_NAMES)


def resolve_dtype(name: str, device: mx.Device | None = None) -> str:
    """'auto' -> 'bfloat16' on a GPU, 'float32' on the CPU; any other name is returned checked."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    if name != "auto":
        return name
    device = device or mx.default_device()
    return "bfloat16" if device.type == mx.DeviceType.gpu else "float32"


def resolve_kv_dtype(name: str, compute: str, stored: str | None, device: mx.Device | None = None) -> str:
    """What the attention K/V cache stores: 'auto' -> float16 on the CPU where a checkpoint stored
    in 16-bit floats computes in float32, else the compute dtype; any other name is returned.

    Why: a CPU decode step reads every weight and the whole K/V cache once, and it waits for those
    bytes (the dev CPU's step read ~26 GB/s at 64 and at 4,000 tokens alike). The bundled target's
    weights are read as their exact bfloat16 values (engine/half_weights.py, ~30 MB), while float32
    K/V of its two attention layers add 8.2 MB at 4,000 tokens: that alone holds a 4k step at ~0.79x
    of a short one. float16 K/V halve that read. Each row is rounded once as it is written, so a
    decode step and a verify read the same values (speculation stays lossless), the model's own
    stored precision was 16 bits already, and float16 keeps 3 more mantissa bits than bfloat16 (the
    benchmark's 13 prompts, 128 greedy tokens each: float16 K/V gave float32's answer on all, and
    bfloat16 on 12; scripts/check_kv_dtype.py). As llama.cpp's default f16 cache, and mlx-lm's cache
    in the model's dtype. On a GPU the compute dtype is already 16-bit by default, and the half cache
    is read in place only by the CPU's attention, so 'auto' keeps the compute dtype there."""
    if name not in KV_DTYPE_NAMES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {name!r}")
    device = device or mx.default_device()
    if name == "int8" and device.type != mx.DeviceType.cpu:
        # only the CPU's attention reads packed rows in place: elsewhere every step would widen
        # the whole context first, slower than the cache it saves
        raise ValueError("kv_dtype int8 is for the CPU backend; on a GPU use float16 or bfloat16")
    if name != "auto":
        return name
    if device.type == mx.DeviceType.cpu and compute == "float32" and stored in ("bfloat16", "float16"):
        return "float16"
    return compute
