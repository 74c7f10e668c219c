"""The attention kernels (metal/attn_rows.kernel, metal/attn_merge.kernel) against their twin.

On the CPU the CUDA text runs through tests/kernels/emulate.py (one-lane SIMD groups), against a
float64 NumPy attention: decode rows, tree rows, one chunk and many, the K/V read through a view
of a larger buffer as the cache hands it over, and a verify row bitwise equal to the decode step
of the same token; the MTP head's drafted row over its committed K/V and its scratch. On a GPU
the MLX calls (engine/attention_rows.py) run against attention_ops and the head's scratch_attention.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from engine import attention_rows as attention_kernel
from engine.attention_rows import ATTN_WPG, attention_draft_row, attention_rows, covers
from engine.kernels import ATTN_DRAFT, ATTN_MERGE, ATTN_ONE, ATTN_ROWS, gpu_backend
from engine.models.layers import attention_ops
from engine.models.mtp import scratch_attention
from engine.tree import DraftTree
from tests.kernels.emulate import SIMT_AVAILABLE, emulate, emulate_simt

H, HKV, D = 4, 2, 64


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, anc: np.ndarray) -> np.ndarray:
    """q [1, H, N, D], keys / values [1, Hkv, L, D] -> [N, H, D], in float64."""
    _, h_count, n_rows, d = q.shape
    L = keys.shape[2]
    P = L - n_rows
    out = np.zeros((n_rows, h_count, d))
    for n in range(n_rows):
        seen = list(range(P)) + [P + i for i in range(n_rows) if anc[n, i]]
        for h in range(h_count):
            kv = h // (h_count // keys.shape[1])
            scores = keys[0, kv, seen].astype(np.float64) @ q[0, h, n].astype(np.float64) / math.sqrt(d)
            p = np.exp(scores - scores.max())
            out[n, h] = (p / p.sum()) @ values[0, kv, seen].astype(np.float64)
    return out


def run(q: np.ndarray, buf_k: np.ndarray, buf_v: np.ndarray, L: int, anc: np.ndarray, chunk: int,
        tmp_path, one: bool = False, keys_batch: int = attention_kernel.ATTN_KEYS,
        merge_batch: int = attention_kernel.MERGE_CHUNKS, merge_groups: int = 1) -> np.ndarray:
    """The kernels as engine/attention_rows.py launches them, emulated: K/V are views of the first
    L rows of their buffers. A merge shared by SIMD groups (merge_groups > 1) runs in lockstep
    warps, whose barriers and shared memory the one-lane emulation does not have."""
    n_rows = q.shape[2]
    chunks = -(-L // chunk)
    view = (1, buf_k.shape[1], L, D)
    inputs = {"q": q, "keys": buf_k, "values": buf_v, "ancestors": anc}
    template: dict[str, int | str] = {"D": D, "CH": chunk, "KB": keys_batch, "OutT": "float32"}
    groups = -(-(n_rows * H * chunks) // ATTN_WPG)
    if one:
        assert chunks == 1
        got = emulate(ATTN_ONE, inputs, {"o": ((n_rows, H, D), np.float32)}, template, groups, ATTN_WPG,
                      tmp_path, views={"keys": view, "values": view})
        return got["o"]
    parts = emulate(ATTN_ROWS, inputs, {"part": ((n_rows, H, chunks, D), np.float32),
                                        "stats": ((n_rows, H, chunks, 2), np.float32)},
                    template, groups, ATTN_WPG, tmp_path, views={"keys": view, "values": view})
    template = {"D": D, "MB": merge_batch, "MS": merge_groups, "CPW": attention_kernel.MERGE_SPAN, "OutT": "float32"}
    if merge_groups > 1:
        return emulate_simt(ATTN_MERGE, parts, {"o": ((n_rows, H, D), np.float32)}, template, n_rows * H,
                            32 * merge_groups, tmp_path)["o"]
    merged = emulate(ATTN_MERGE, parts, {"o": ((n_rows, H, D), np.float32)}, template,
                     -(-(n_rows * H) // ATTN_WPG), ATTN_WPG, tmp_path)
    return merged["o"]


def random_case(rng: np.random.Generator, prefix: int, tree: DraftTree, capacity: int):
    n_rows = tree.size
    L = prefix + n_rows
    q = rng.normal(size=(1, H, n_rows, D)).astype(np.float32)
    buf_k = rng.normal(size=(1, HKV, capacity, D)).astype(np.float32)
    buf_v = rng.normal(size=(1, HKV, capacity, D)).astype(np.float32)
    anc = np.asarray(tree.ancestor_mask(), dtype=bool)
    return q, buf_k, buf_v, L, anc


def a_tree(rng: np.random.Generator, n: int) -> DraftTree:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    return DraftTree(tuple(range(n)), tuple(parents))


@pytest.mark.parametrize(("prefix", "nodes", "chunk"), [(20, 1, 32), (70, 1, 8), (9, 7, 32), (40, 12, 8), (3, 17, 4)])
def test_emulated_kernels_equal_twin(prefix, nodes, chunk, rng, tmp_path):
    tree = a_tree(rng, nodes)
    q, buf_k, buf_v, L, anc = random_case(rng, prefix, tree, capacity=prefix + nodes + 5)
    got = run(q, buf_k, buf_v, L, anc, chunk, tmp_path)
    want = reference(q, buf_k[:, :, :L], buf_v[:, :, :L], anc)
    assert np.abs(got - want).max() < 2e-5


def test_one_chunk_build_is_the_merged_result_bit_for_bit(rng, tmp_path):
    """SPR_ATTN_ONE writes acc / s; the chunked build joined over one chunk computes the same."""
    tree = a_tree(rng, 6)
    q, buf_k, buf_v, L, anc = random_case(rng, 10, tree, capacity=40)
    one = run(q, buf_k, buf_v, L, anc, 32, tmp_path, one=True)
    merged = run(q, buf_k, buf_v, L, anc, 32, tmp_path)
    np.testing.assert_array_equal(one, merged)
    np.testing.assert_allclose(one, reference(q, buf_k[:, :, :L], buf_v[:, :, :L], anc), atol=2e-5)


@pytest.mark.parametrize("chunk", [4, 32])
def test_verify_row_equals_the_decode_step_of_its_token(chunk, rng, tmp_path):
    """A tree row over the prefix and its ancestors-or-self, against one row whose cache holds the
    prefix and then that path's rows, committed: the same bits (the chunks follow each row's own
    keys, and empty chunks add exact zeros)."""
    tree = a_tree(rng, 9)
    prefix = 13
    q, buf_k, buf_v, L, anc = random_case(rng, prefix, tree, capacity=prefix + 9 + 3)
    verify = run(q, buf_k, buf_v, L, anc, chunk, tmp_path)
    for n in (0, 4, 8):
        path = [i for i in range(tree.size) if anc[n, i]]
        rows = list(range(prefix)) + [prefix + i for i in path]
        dec_k = np.ascontiguousarray(buf_k[:, :, rows])
        dec_v = np.ascontiguousarray(buf_v[:, :, rows])
        one = np.ones((1, 1), dtype=bool)
        decode = run(np.ascontiguousarray(q[:, :, n : n + 1]), dec_k, dec_v, len(rows), one, chunk, tmp_path)
        np.testing.assert_array_equal(decode[0], verify[n])


def test_keys_loaded_together_change_no_bit(rng, tmp_path):
    """KB (keys whose loads a group issues together) moves loads, not arithmetic: tree rows and
    an MTP head's drafted row (its garbage past the written rows unread) come out the same bits for
    every KB, whether or not it divides the chunk, as for the one-key-at-a-time walk (KB = 1)."""
    tree = a_tree(rng, 7)
    q, buf_k, buf_v, L, anc = random_case(rng, 19, tree, capacity=19 + 7 + 4)
    walk = run(q, buf_k, buf_v, L, anc, 8, tmp_path, keys_batch=1)
    for kb in (3, 4, 8):
        np.testing.assert_array_equal(run(q, buf_k, buf_v, L, anc, 8, tmp_path, keys_batch=kb), walk)
    cap, length, rows, srow = 40, 23, 6, 4
    q1 = rng.normal(size=(1, H, 1, D)).astype(np.float32)
    keys, values, skeys, svalues = (rng.normal(size=(1, HKV, n, D)).astype(np.float32) for n in (cap, cap, rows, rows))
    for a, lo in ((keys, length), (values, length), (skeys, srow + 1), (svalues, srow + 1)):
        a[:, :, lo:] = np.nan
    draft_walk = run_draft(q1, keys, values, length, skeys, svalues, srow, 8, tmp_path, keys_batch=1)
    assert np.isfinite(draft_walk).all()
    for kb in (3, 4):
        np.testing.assert_array_equal(
            run_draft(q1, keys, values, length, skeys, svalues, srow, 8, tmp_path, keys_batch=kb), draft_walk)


def test_merge_loading_chunks_together_changes_no_bit(rng, tmp_path):
    """MB (chunks whose loads the merge issues together) moves loads, not arithmetic: rows over
    many chunks, some of them empty for the shorter rows, come out the same bits for every MB."""
    tree = a_tree(rng, 9)
    q, buf_k, buf_v, L, anc = random_case(rng, 37, tree, capacity=37 + 9 + 2)
    walk = run(q, buf_k, buf_v, L, anc, 4, tmp_path, merge_batch=1)
    for mb in (3, 4, 8):
        np.testing.assert_array_equal(run(q, buf_k, buf_v, L, anc, 4, tmp_path, merge_batch=mb), walk)
    np.testing.assert_allclose(walk, reference(q, buf_k[:, :, :L], buf_v[:, :, :L], anc), atol=2e-5)


@pytest.mark.skipif(not SIMT_AVAILABLE, reason="the lockstep emulation needs g++ and glibc's ucontext")
@pytest.mark.parametrize("groups", [2, 4])
def test_merge_shared_by_simd_groups(groups, rng, tmp_path):
    """MS SIMD groups a (row, head), chunks dealt to them 4 at a time: the twin's result, close to
    the one-group walk; and a verify row still the decode step of its token bit for bit (empty
    chunks past a shorter row add exact zeros, whichever group they fall to)."""
    tree = a_tree(rng, 9)
    prefix = 101
    q, buf_k, buf_v, L, anc = random_case(rng, prefix, tree, capacity=prefix + 9 + 2)
    shared = run(q, buf_k, buf_v, L, anc, 4, tmp_path, merge_groups=groups)  # 28 chunks a row
    np.testing.assert_allclose(shared, reference(q, buf_k[:, :, :L], buf_v[:, :, :L], anc), atol=2e-5)
    np.testing.assert_allclose(shared, run(q, buf_k, buf_v, L, anc, 4, tmp_path), atol=1e-6)
    for n in (0, 8):
        path = [i for i in range(tree.size) if anc[n, i]]
        rows = list(range(prefix)) + [prefix + i for i in path]
        dec_k, dec_v = (np.ascontiguousarray(b[:, :, rows]) for b in (buf_k, buf_v))
        decode = run(np.ascontiguousarray(q[:, :, n : n + 1]), dec_k, dec_v, len(rows), np.ones((1, 1), dtype=bool), 4,
                     tmp_path, merge_groups=groups)
        np.testing.assert_array_equal(decode[0], shared[n])


def test_merge_groups_by_backend_and_chunks(monkeypatch):
    """The merge is shared by MERGE_GROUPS SIMD groups on CUDA past MERGE_SPAN chunks a row; a
    launch of fewer chunks, and Metal, keep the one-group walk."""
    span = attention_kernel.MERGE_SPAN
    assert attention_kernel.merge_groups_for(span + 1, "cuda") == attention_kernel.MERGE_GROUPS
    assert attention_kernel.merge_groups_for(span, "cuda") == 1
    assert attention_kernel.merge_groups_for(128, "metal") == 1
    monkeypatch.setattr(attention_kernel, "MERGE_GROUPS", 1)
    assert attention_kernel.merge_groups_for(128, "cuda") == 1


@pytest.mark.skipif(not SIMT_AVAILABLE, reason="the lockstep emulation needs g++ and glibc's ucontext")
def test_a_short_row_merged_by_many_groups_is_the_walk(rng, tmp_path):
    """Rows of at most MERGE_SPAN chunks are all group 0's: MS 8 gives the one-group walk's bits,
    so the launch's choice of MS (by its chunks) cannot part a verify row from its decode step."""
    tree = a_tree(rng, 5)
    q, buf_k, buf_v, L, anc = random_case(rng, 11, tree, capacity=11 + 5 + 2)  # 16 keys: 4 chunks of 4
    np.testing.assert_array_equal(run(q, buf_k, buf_v, L, anc, 4, tmp_path, merge_groups=8),
                                  run(q, buf_k, buf_v, L, anc, 4, tmp_path))


def test_keys_batch_by_the_launchs_size(monkeypatch):
    """Few SIMD groups walk ATTN_KEYS keys at a time, many one at a time; the variant's setting is
    read at every call."""
    assert attention_kernel.keys_batch_for(80) == attention_kernel.ATTN_KEYS
    assert attention_kernel.keys_batch_for(attention_kernel.ATTN_FEW_GROUPS) == attention_kernel.ATTN_KEYS
    assert attention_kernel.keys_batch_for(attention_kernel.ATTN_FEW_GROUPS + 1) == 1
    monkeypatch.setattr(attention_kernel, "ATTN_KEYS", 2)
    assert attention_kernel.keys_batch_for(1) == 2


def draft_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, length: int, skeys: np.ndarray,
                    svalues: np.ndarray, srow: int) -> np.ndarray:
    """One row over keys[:length] then skeys[:srow + 1], in float64 -> [1, H, D]."""
    k = np.concatenate([keys[:, :, :length], skeys[:, :, : srow + 1]], axis=2)
    v = np.concatenate([values[:, :, :length], svalues[:, :, : srow + 1]], axis=2)
    return reference(q, k, v, np.ones((1, 1), dtype=bool))


def run_draft(q, keys, values, length, skeys, svalues, srow, chunk, tmp_path,
              keys_batch: int = attention_kernel.DRAFT_KEYS) -> np.ndarray:
    """The draft build as attention_draft_row launches it (chunks of both buffers whole), emulated."""
    chunks = -(-(keys.shape[2] + skeys.shape[2]) // chunk)
    inputs = {"q": q, "keys": keys, "values": values, "skeys": skeys, "svalues": svalues,
              "length": np.array(length, dtype=np.int32), "srow": np.array(srow, dtype=np.int32)}
    parts = emulate(ATTN_DRAFT, inputs, {"part": ((1, H, chunks, D), np.float32),
                                         "stats": ((1, H, chunks, 2), np.float32)},
                    {"D": D, "CH": chunk, "KB": keys_batch, "OutT": "float32"}, -(-(H * chunks) // ATTN_WPG),
                    ATTN_WPG, tmp_path)
    return emulate(ATTN_MERGE, parts, {"o": ((1, H, D), np.float32)},
                   {"D": D, "MB": attention_kernel.MERGE_CHUNKS, "MS": 1, "CPW": 4, "OutT": "float32"},
                   -(-H // ATTN_WPG), ATTN_WPG, tmp_path)["o"]


@pytest.mark.parametrize(("cap", "length", "rows", "srow", "chunk"),
                         [(40, 23, 6, 0, 8), (40, 23, 6, 5, 8), (64, 64, 4, 2, 32), (16, 1, 9, 8, 4),
                          (96, 70, 7, 3, 32)])
def test_emulated_draft_row_equals_twin(cap, length, rows, srow, chunk, rng, tmp_path):
    """The committed rows past `length` and the scratch rows past `srow` hold garbage (NaN and
    huge values) that must not count: the head's buffers have capacity past what is written."""
    q = rng.normal(size=(1, H, 1, D)).astype(np.float32)
    keys, values, skeys, svalues = (rng.normal(size=(1, HKV, n, D)).astype(np.float32)
                                    for n in (cap, cap, rows, rows))
    for a, lo in ((keys, length), (values, length), (skeys, srow + 1), (svalues, srow + 1)):
        a[:, :, lo:] = np.nan
        a[:, :, lo::2] = 1e30
    got = run_draft(q, keys, values, length, skeys, svalues, srow, chunk, tmp_path)
    want = draft_reference(q, keys, values, length, skeys, svalues, srow)
    assert np.abs(got - want).max() < 2e-5


def test_emulated_draft_row_is_the_decode_row_over_the_same_keys(rng, tmp_path):
    """Split between the committed buffer and the scratch, a row sees its keys in the order a
    decode row over one buffer holding them would, so the chunks and the result are the same bits."""
    cap, length, rows, srow, chunk = 48, 21, 8, 5, 8
    q = rng.normal(size=(1, H, 1, D)).astype(np.float32)
    keys, values, skeys, svalues = (rng.normal(size=(1, HKV, n, D)).astype(np.float32)
                                    for n in (cap, cap, rows, rows))
    draft = run_draft(q, keys, values, length, skeys, svalues, srow, chunk, tmp_path)
    one_k = np.ascontiguousarray(np.concatenate([keys[:, :, :length], skeys[:, :, : srow + 1]], axis=2))
    one_v = np.ascontiguousarray(np.concatenate([values[:, :, :length], svalues[:, :, : srow + 1]], axis=2))
    decode = run(q, one_k, one_v, one_k.shape[2], np.ones((1, 1), dtype=bool), chunk, tmp_path)
    np.testing.assert_array_equal(draft, decode)


def test_covers_only_what_the_kernel_computes():
    q = mx.zeros((1, 8, 1, 256), dtype=mx.bfloat16)
    kv = mx.zeros((1, 2, 30, 256), dtype=mx.bfloat16)
    assert covers(q, kv, kv)
    assert not covers(q.astype(mx.float32), kv, kv)  # dtypes differ
    assert not covers(mx.zeros((1, 8, 1, 48)), mx.zeros((1, 2, 30, 48)), mx.zeros((1, 2, 30, 48)))  # 48 wide
    assert not covers(mx.zeros((1, 6, 1, 64)), mx.zeros((1, 4, 30, 64)), mx.zeros((1, 4, 30, 64)))  # 6 / 4 heads
    assert not covers(mx.zeros((1, 8, 1, 512)), mx.zeros((1, 2, 30, 512)), mx.zeros((1, 2, 30, 512)))  # > 256


@pytest.mark.parametrize(("name", "env"), [("SWITCH", "SPRUCE_ATTN_KERNEL"), ("DRAFT_SWITCH", "SPRUCE_ATTN_DRAFT")])
def test_on_by_default_on_cuda_only(name, env, monkeypatch):
    """On by default on CUDA, where they were measured; the environment variable or the switch
    overrides each, and nothing turns one on without a GPU backend."""
    import engine.kernels as kernels

    switch = getattr(attention_kernel, name)
    assert switch.value is None  # nothing in the package pins it
    monkeypatch.setattr(switch, "value", True)
    assert switch.enabled() == (gpu_backend() is not None)
    monkeypatch.setattr(switch, "value", False)
    assert not switch.enabled()
    monkeypatch.setattr(switch, "value", None)
    for backend, value, expected in ((None, None, False), ("cuda", None, True), ("metal", None, False),
                                     ("metal", "1", True), ("cuda", "0", False), (None, "1", False)):
        kernels._env_choice.cache_clear()
        monkeypatch.setattr(kernels, "gpu_backend", lambda backend=backend: backend)
        if value is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, value)
        assert switch.enabled() == expected, (backend, value)
    kernels._env_choice.cache_clear()


needs_gpu = pytest.mark.skipif(gpu_backend() is None, reason="the attention kernels run on a GPU backend")


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("prefix", "nodes", "d"), [(300, 1, 256), (300, 17, 256), (20, 5, 64), (4000, 1, 256)])
def test_gpu_kernel_equals_attention_ops(dtype, prefix, nodes, d, rng):
    """The MLX call against the engine's attention in ops, K/V as slices of a larger buffer."""
    tree = a_tree(rng, nodes)
    L = prefix + nodes
    q = mx.array(rng.normal(size=(1, 16, nodes, d)).astype(np.float32)).astype(dtype)
    buf = mx.array(rng.normal(size=(2, 1, 4, L + 64, d)).astype(np.float32)).astype(dtype)
    keys, values = buf[0][:, :, :L], buf[1][:, :, :L]
    anc = mx.array(np.asarray(tree.ancestor_mask(), dtype=bool)) if nodes > 1 else None
    assert covers(q, keys, values)
    got = attention_rows(q, keys, values, anc).astype(mx.float32)  # [N, H, D]
    mask = None if anc is None else mx.concatenate([mx.ones((nodes, prefix), dtype=mx.bool_), anc], axis=1)
    want = attention_ops(q, keys, values, d**-0.5, mask)[0].transpose(1, 0, 2).astype(mx.float32)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert float(mx.abs(got - want).max()) <= tol


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("cap", "length", "rows", "srow", "d"),
                         [(256, 100, 16, 0, 256), (256, 256, 16, 15, 256), (4096, 3000, 8, 5, 256), (64, 7, 6, 3, 64)])
def test_gpu_draft_row_equals_scratch_attention_ops(dtype, cap, length, rows, srow, d, rng, monkeypatch):
    """The MLX call against the MTP head's ops form (the switch off), garbage past what counts."""
    q = mx.array(rng.normal(size=(1, 16, 1, d)).astype(np.float32)).astype(dtype)
    buf = rng.normal(size=(2, 1, 4, cap, d)).astype(np.float32)
    buf[:, :, :, length:] = 1e4
    sbuf = rng.normal(size=(2, 1, 4, rows, d)).astype(np.float32)
    sbuf[:, :, :, srow + 1:] = 1e4
    keys, values = (mx.array(b).astype(dtype) for b in buf)
    skeys, svalues = (mx.array(b).astype(dtype) for b in sbuf)
    length_a, srow_a = mx.array(length, dtype=mx.int32), mx.array(srow, dtype=mx.int32)
    got = attention_draft_row(q, keys, values, skeys, svalues, length_a, srow_a).reshape(1, 1, 16 * d)
    monkeypatch.setattr(attention_kernel.DRAFT_SWITCH, "value", False)
    want = scratch_attention(q, keys, values, length_a, skeys, svalues, srow_a, d**-0.5)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()) <= tol


@needs_gpu
@pytest.mark.parametrize("chunk", [8, 16, 32])
@pytest.mark.parametrize(("prefix", "nodes"), [(300, 1), (4000, 1), (300, 17)])
def test_gpu_merge_batches_change_no_bit(chunk, prefix, nodes, rng, monkeypatch):
    """On the device, the merge's chunks loaded MB at a time give the one-at-a-time walk's bits."""
    monkeypatch.setattr(attention_kernel, "ATTN_CHUNK", chunk)
    tree = a_tree(rng, nodes)
    L = prefix + nodes
    q = mx.array(rng.normal(size=(1, 16, nodes, 256)).astype(np.float32)).astype(mx.bfloat16)
    buf = mx.array(rng.normal(size=(2, 1, 4, L, 256)).astype(np.float32)).astype(mx.bfloat16)
    anc = mx.array(np.asarray(tree.ancestor_mask(), dtype=bool)) if nodes > 1 else None
    outs = {}
    for mb in (1, 2, 4, 8):
        monkeypatch.setattr(attention_kernel, "MERGE_CHUNKS", mb)
        outs[mb] = np.asarray(attention_rows(q, buf[0], buf[1], anc).astype(mx.float32))
    for mb in (2, 4, 8):
        np.testing.assert_array_equal(outs[mb], outs[1])


@needs_gpu
@pytest.mark.parametrize("groups", [4, 8])
@pytest.mark.parametrize(("prefix", "nodes"), [(4000, 1), (300, 17), (20, 5)])
def test_gpu_merge_shared_by_simd_groups(groups, prefix, nodes, rng, monkeypatch):
    """On the device, the merge shared by MS SIMD groups a (row, head): against attention_ops, and a
    verify row against the decode step over the same keys, bit for bit."""
    monkeypatch.setattr(attention_kernel, "MERGE_GROUPS", groups)
    tree = a_tree(rng, nodes)
    L = prefix + nodes
    q = mx.array(rng.normal(size=(1, 16, nodes, 256)).astype(np.float32)).astype(mx.bfloat16)
    buf = mx.array(rng.normal(size=(2, 1, 4, L, 256)).astype(np.float32)).astype(mx.bfloat16)
    anc = np.asarray(tree.ancestor_mask(), dtype=bool)
    got = attention_rows(q, buf[0], buf[1], mx.array(anc) if nodes > 1 else None).astype(mx.float32)
    mask = None if nodes == 1 else mx.concatenate([mx.ones((nodes, prefix), dtype=mx.bool_), mx.array(anc)], axis=1)
    want = attention_ops(q, buf[0], buf[1], 256**-0.5, mask)[0].transpose(1, 0, 2).astype(mx.float32)
    assert float(mx.abs(got - want).max()) <= 2e-2
    n = nodes - 1
    rows = list(range(prefix)) + [prefix + i for i in range(nodes) if anc[n, i]]
    idx = mx.array(rows)
    decode = attention_rows(q[:, :, n : n + 1], buf[0][:, :, idx], buf[1][:, :, idx], None).astype(mx.float32)
    assert np.array_equal(np.array(decode[0]), np.array(got[n]))
