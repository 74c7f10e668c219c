"""Attention of decode and tree-verify rows over the KV cache in one or two GPU launches
(metal/attn_rows.kernel, metal/attn_merge.kernel).

Why: on a GPU a step is bound by the host encoding its launches (BENCHMARKS.md, issue 12,
twenty-fourth session: ~10 µs of host time a launching operation on the H200). Heads of 256
dimensions (Qwen3.5-9B, 0.8B) are outside MLX's fused decode kernels, so a decode step's attention
runs as four operations a layer, two of them cuBLAS matmuls, and a tree's as seven. Here it is one
launch when one chunk of ATTN_CHUNK keys covers every row, two otherwise.

A row's result is bitwise the same whatever the launch held (a verify row equals the decode step
of the same token after its path is committed, the chunks being cut along each row's own visible
keys). On by default on CUDA, where it was measured (BENCHMARKS.md, issue 12, twenty-fifth
session: plain, MTP chain and DDTree rounds 0.3-3 ms shorter in 17 of 20 cells on the 9B shape,
the same tokens); opt-in (SPRUCE_ATTN_KERNEL=1) on Metal, where it has not run;
SPRUCE_ATTN_KERNEL=0 turns it off.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from engine.kernels import ATTN_DRAFT, ATTN_MERGE, ATTN_ONE, ATTN_ROWS, FastPath, compiled_kernel, gpu_backend

# visible keys a SIMD group runs its online softmax over, read at every call of attention_rows
# (scripts/variants.py's "-acN" sets it: a decode step and a verify run one value, so their rows
# agree whatever it is). One 9B-shaped step under ncu with 8 keys loaded together, attn_rows +
# attn_merge a layer over ~130 keys: 27.5 + 6.5 us at 32, 18.3 + 9.0 at 16, 15.5 + 13.4 at 8 (the
# merge walks the chunks one after another), and plain decoding 298 against 291 tok/s at 16 (H100,
# forty-eighth session). Left at 32: at long contexts the merge's walk grows with the chunks, and
# there the kernel has not been timed one call at a time (scripts/bench_attention_rows.py times
# many calls together, where 32 was the fastest at every length).
ATTN_CHUNK = 32
DRAFT_CHUNK = 32  # the same for an MTP head's drafted row, fixed: the head's compiled step captures it
# keys of a chunk whose loads and dot products a SIMD group issues together before their softmax
# updates (KB in metal/attn_rows.kernel): the bits do not depend on it, only how many loads wait at
# once, and how many registers a group holds. So it is chosen per launch, by the launch's size:
# - a launch of at most ATTN_FEW_GROUPS groups is bound by each group's walk: one 9B-shaped decode
#   step under ncu (H100, BENCHMARKS.md, issue 13, forty-eighth session), attn_rows a layer over
#   ~130 keys (80 groups): 38.3 us one key at a time, 28.0 with 4, 27.5 with 8;
# - a larger launch has groups enough to hide the loads, and the extra registers cost it: 40 calls
#   evaluated together (scripts/bench_attention_rows.py, same lease), 4 keys at a time against 1,
#   chunks of 32: +3 % at 512 groups (1k keys, one row), +6 % at 16k keys, +5 % to +15 % for 17
#   tree rows over 128-4k keys.
# ATTN_KEYS is read at every call (scripts/variants.py's "-akN").
ATTN_KEYS = 8
ATTN_FEW_GROUPS = 256
DRAFT_KEYS = 1  # an MTP head's drafted row, fixed like DRAFT_CHUNK: its walk as before (not timed otherwise)
# chunks whose partial results the merge loads together before adding them in chunk order (MB in
# metal/attn_merge.kernel; no bit depends on it). 1, the walk before, until measured: written in
# the forty-eighth session, after that session's lease, because the merge grew with the chunks
# (6.5 us at 5 chunks, 13.4 at 17, a 9B layer under ncu). Read at every call (variant "-amN").
MERGE_CHUNKS = 1
# SIMD groups that share one (row, head)'s merge on CUDA (MS in metal/attn_merge.kernel): chunk c to
# group (c / MERGE_SPAN) % MS, the groups' sums added in group order. One SIMD group walking a row's
# chunks was 113 us a 9B layer over 4,096 keys (128 chunks of 32) under ncu on an H100, 18 % of a
# decode step there; with 8 groups 23.4 us, the step 4.96 -> 4.20 ms (fifty-first session). A launch
# of at most MERGE_SPAN chunks keeps the one-group walk: its rows' chunks are all group 0's either
# way (the same bits), so a verify row and the decode step over the same keys agree whichever
# launch each is in. Metal keeps 1 (not measured there). Read at every call (variant "-agN").
MERGE_GROUPS = 8
MERGE_SPAN = 4
ATTN_WPG = 4  # SIMD groups a threadgroup
DTYPES = (mx.float32, mx.bfloat16, mx.float16)


# benchmarks compare the two within one engine by setting SWITCH.value (scripts/variants.py's
# suffixes "-at1", "-at0")
SWITCH = FastPath("SPRUCE_ATTN_KERNEL", on=("cuda",))
# The MTP head's drafted row through attention_draft_row (scripts/variants.py's "-ad0", "-ad1"):
# read when the head's compiled step traces. On by default on CUDA: on the 4-bit 9B-shaped pair
# (H100, one host) MTP chain rounds were 1.4-2.5 ms shorter in one run of four prompts, and in 6 of
# 8 cells over two runs, with the same tokens (BENCHMARKS.md, thirty-fifth session); not run on Metal.
DRAFT_SWITCH = FastPath("SPRUCE_ATTN_DRAFT", on=("cuda",))


def covers(q: mx.array, keys: mx.array, values: mx.array) -> bool:
    """q [1, H, N, D] over keys / values [1, Hkv, L, D]: D a multiple of 32 up to 256, whole GQA
    groups, one sequence, a float dtype shared by all three."""
    B, H, _, D = q.shape
    return (B == 1 and keys.shape[0] == 1 and D % 32 == 0 and D <= 256 and keys.shape[-1] == D
            and values.shape == keys.shape and H % keys.shape[1] == 0 and q.dtype in DTYPES
            and keys.dtype == q.dtype and values.dtype == q.dtype)


@functools.cache
def root_only() -> mx.array:
    """The ancestor mask of a one-row pass ([[True]]), made once: a new one would be a host to
    device copy every step."""
    return mx.array([[True]])


def attention_rows(q: mx.array, keys: mx.array, values: mx.array, ancestors: mx.array | None,
                   backend: str | None = None, chunk: int | None = None, keys_batch: int | None = None) -> mx.array:
    """softmax(q k^T / sqrt(D)) v of every row over the keys it sees -> [N, H, D] in q's dtype.

    q [1, H, N, D] (the rows after RoPE), keys / values [1, Hkv, L, D] whose last N rows are the
    rows' own (written to the cache before the call), ancestors [N, N] bool (row n sees tree row i
    where it is True, and every key before the last N), None for one row that sees them all. The
    caller checks covers(). chunk: keys a SIMD group walks (default ATTN_CHUNK); keys_batch: keys it
    loads together (default: keys_batch_for the launch)."""
    backend = backend or gpu_backend()
    assert backend is not None, "a GPU kernel"
    chunk = chunk or ATTN_CHUNK
    _, H, N, D = q.shape
    L = keys.shape[2]
    mask = root_only() if ancestors is None else ancestors
    chunks = -(-L // chunk)
    keys_batch = keys_batch or keys_batch_for(N * H * chunks)
    groups = -(-(N * H * chunks) // ATTN_WPG)
    launch = dict(grid=(groups * ATTN_WPG * 32, 1, 1), threadgroup=(ATTN_WPG * 32, 1, 1))
    template = [("D", D), ("CH", chunk), ("KB", keys_batch), ("OutT", q.dtype)]
    if chunks == 1:
        return compiled_kernel(ATTN_ONE, backend)(
            inputs=[q, keys, values, mask], template=template, output_shapes=[(N, H, D)],
            output_dtypes=[q.dtype], **launch)[0]
    part, stats = compiled_kernel(ATTN_ROWS, backend)(
        inputs=[q, keys, values, mask], template=template,
        output_shapes=[(N, H, chunks, D), (N, H, chunks, 2)], output_dtypes=[mx.float32, mx.float32], **launch)
    return _merge(part, stats, q.dtype, backend)


def keys_batch_for(groups: int) -> int:
    """KB for a launch of `groups` SIMD groups: ATTN_KEYS where few groups leave each one's walk
    exposed, one key at a time where many hide it (ATTN_KEYS' comment). No bit depends on it."""
    return ATTN_KEYS if groups <= ATTN_FEW_GROUPS else 1


def attention_draft_row(q: mx.array, keys: mx.array, values: mx.array, skeys: mx.array, svalues: mx.array,
                        length: mx.array, srow: mx.array, backend: str | None = None,
                        chunk: int = DRAFT_CHUNK) -> mx.array:
    """An MTP head's drafted row (engine/models/mtp.py, scratch_attention) in two launches instead of
    the ~15 operations of its ops form: q [1, H, 1, D] over rows [0, length) of the committed
    keys / values [1, Hkv, cap, D] and rows [0, srow] of the draft's scratch skeys / svalues
    [1, Hkv, S, D], one softmax over both, scale 1 / sqrt(D) -> [1, H, D] in q's dtype. length,
    srow: int32 scalars. The launch depends on the buffers' shapes only, so a compiled draft step
    keeps one trace. The caller checks covers() for both buffers."""
    backend = backend or gpu_backend()
    assert backend is not None, "a GPU kernel"
    _, H, N, D = q.shape
    assert N == 1, "one drafted row"
    chunks = -(-(keys.shape[2] + skeys.shape[2]) // chunk)
    groups = -(-(H * chunks) // ATTN_WPG)
    part, stats = compiled_kernel(ATTN_DRAFT, backend)(
        inputs=[q, keys, values, skeys, svalues, length.astype(mx.int32), srow.astype(mx.int32)],
        template=[("D", D), ("CH", chunk), ("KB", DRAFT_KEYS), ("OutT", q.dtype)],
        output_shapes=[(1, H, chunks, D), (1, H, chunks, 2)], output_dtypes=[mx.float32, mx.float32],
        grid=(groups * ATTN_WPG * 32, 1, 1), threadgroup=(ATTN_WPG * 32, 1, 1))
    return _merge(part, stats, q.dtype, backend)


def merge_groups_for(chunks: int, backend: str) -> int:
    """SIMD groups a (row, head)'s merge takes in a launch of `chunks` chunks a row."""
    return MERGE_GROUPS if backend == "cuda" and chunks > MERGE_SPAN else 1


def _merge(part: mx.array, stats: mx.array, dtype: mx.Dtype, backend: str) -> mx.array:
    """attn_merge.kernel: the chunks' partial softmaxes [N, H, C, ...] joined -> [N, H, D]."""
    N, H, C, D = part.shape
    ms = merge_groups_for(C, backend)
    # MS == 1: WPG (row, head)s a threadgroup, one SIMD group each; else a threadgroup of MS per one
    per_group = ATTN_WPG if ms == 1 else ms
    groups = -(-(N * H) // ATTN_WPG) if ms == 1 else N * H
    return compiled_kernel(ATTN_MERGE, backend)(
        inputs=[part, stats],
        template=[("D", D), ("MB", MERGE_CHUNKS), ("MS", ms), ("CPW", MERGE_SPAN), ("OutT", dtype)],
        output_shapes=[(N, H, D)], output_dtypes=[dtype], grid=(groups * per_group * 32, 1, 1),
        threadgroup=(per_group * 32, 1, 1))[0]
