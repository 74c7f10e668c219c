"""The 8-bit K/V cache's rows (`--kv-dtype int8`): each row of D values stored as D int8 values and
its float32 scale, packed into one int8 row of D + 4 (the scale's 4 bytes last).

Why: memory, and the bytes a CPU decode step reads over a long context (at 32k tokens the bundled
target's float16 K/V are 33 MB against 30 MB of weights). An 8-bit row is 68 bytes instead of 128
(float16, D = 64). As llama.cpp's q8_0 cache type it is opt-in: a row keeps ~2.5 significant
digits, so answers may differ from a float32 cache's (scripts/check_kv_dtype.py: 11 of 13 greedy
answers equal, the two others parted at near-ties). Speed on the dev CPU: 1.03-1.12x float16's at
4k-32k tokens, 0.94-0.98x at 64 (BENCHMARKS.md, issue 17): widening each element and scaling it
costs about what the bytes saved, so the attention waits on arithmetic there.

A row is quantized once, as it is written (engine/cache.py KVCache), with one scale for the row
(its largest magnitude / 127, rounded to nearest). Every reader then sees the same values: a decode
step, a verify's rows, a prefix restored from a snapshot. So speculation stays lossless against
plain decoding with the same cache. The value of an element is float(q) * scale, one rounded float32
product: the CPU's rows attention (engine/cpu_ext.cpp, q8_bits) reads the packed rows in place with
that arithmetic, and every other path widens them here first (`unpack`), to the same bits.
"""

from __future__ import annotations

import mlx.core as mx

SCALE_BYTES = 4  # a float32 scale after each row's values


def pack(x: mx.array) -> mx.array:
    """Rows x [..., D] (float) -> packed int8 rows [..., D + 4]."""
    return _packed(x)


def pack_pair(k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
    """pack of a write's keys and values, in one compiled call: as operations a step's two writes
    were ~20 graph nodes an attention layer, which cost the CPU's decode step more than the bytes
    they saved at short contexts."""
    return _pair(k, v)


def _pack_rows(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    top = mx.max(mx.abs(x), axis=-1, keepdims=True)
    scale = mx.where(top > 0, top / 127.0, mx.ones_like(top))
    q = mx.clip(mx.round(x / scale), -127, 127).astype(mx.int8)
    return mx.concatenate([q, mx.view(scale, mx.int8)], axis=-1)


_packed = mx.compile(_pack_rows)
_pair = mx.compile(lambda k, v: (_pack_rows(k), _pack_rows(v)))


def unpack(rows: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
    """Packed int8 rows [..., D + 4] -> their values [..., D] in `dtype` (float32: the CPU's bits)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = mx.view(mx.contiguous(rows[..., d:]), mx.float32)
    values = rows[..., :d].astype(mx.float32) * scale
    return values if dtype == mx.float32 else values.astype(dtype)


def cast_rows(rows: mx.array, dtype: mx.Dtype) -> mx.array:
    """A cache's rows as `dtype` values: packed rows unpacked, any others cast."""
    return unpack(rows, dtype) if rows.dtype == mx.int8 else rows.astype(dtype)
