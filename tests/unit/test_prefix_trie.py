"""The prefix cache's trie and eviction, on real layer caches filled with known values (no model)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.cache import GDNCache, KVCache
from engine.gdn.core import GDNShape, OpsCore
from engine.prefix_cache import PrefixCache

SHAPE = GDNShape(Hk=1, Hv=1, Dk=2, Dv=2, K=2)


def kv_cache(tokens: list[int]) -> list:
    """One attention layer whose row i holds token i's id: restored rows show what was kept."""
    c = KVCache()
    rows = mx.array(np.array(tokens, dtype=np.float32)).reshape(1, 1, -1, 1)
    c.write(rows, rows)
    c.advance(len(tokens))
    return [c]


def hybrid_cache(tokens: list[int]) -> list:
    c = GDNCache(OpsCore(), SHAPE)
    conv, S = c.states(mx.float32)
    c.write(conv + len(tokens), S + sum(tokens), len(tokens))
    return [c]


def restored_rows(prefix: PrefixCache, prompt: list[int]) -> list[int]:
    fresh = [KVCache()]
    n = prefix.restore_longest(prompt, fresh)
    return [] if n == 0 else [int(x) for x in np.array(fresh[0].snapshot(n).keys).reshape(-1)]


def test_hybrid_resumes_only_from_a_stored_prefix():
    p = PrefixCache(1 << 20)
    p.store(hybrid_cache([1, 2, 3]), [1, 2, 3])
    p.store(hybrid_cache([1, 2, 3, 4, 5]), [1, 2, 3, 4, 5])
    assert p.lookup([1, 2, 3, 4, 5, 6])[1] == 5
    assert p.lookup([1, 2, 3, 4, 9])[1] == 3  # diverges inside the longer key: the shorter one
    assert p.lookup([1, 2])[0] is None  # a longer key cannot be cut for a recurrent state
    fresh = [GDNCache(OpsCore(), SHAPE)]
    assert p.restore_longest([1, 2, 3, 7], fresh) == 3
    assert float(fresh[0].snapshot(3).state.sum()) == 6 * SHAPE.Dk * SHAPE.Dv


def test_attention_only_resumes_from_any_common_prefix():
    p = PrefixCache(1 << 20, trimmable=True)
    p.store(kv_cache([1, 2, 3, 4, 5]), [1, 2, 3, 4, 5])
    assert restored_rows(p, [1, 2, 3, 9]) == [1, 2, 3]  # cut to the common prefix
    assert restored_rows(p, [1, 2, 3, 4, 5, 6]) == [1, 2, 3, 4, 5]
    assert restored_rows(p, [7, 8]) == []


def test_generation_end_snapshots_are_evicted_first_but_never_the_newest():
    one = kv_cache([0])[0].snapshot(1).nbytes
    p = PrefixCache(budget_bytes=3 * one, trimmable=True)
    p.store(kv_cache([1]), [1], "prompt")
    p.store(kv_cache([2]), [2], "generation")
    p.store(kv_cache([3]), [3], "boundary")
    p.store(kv_cache([4]), [4], "prompt")  # over budget: the generation snapshot goes, not the oldest
    assert list(p.entries) == [(1,), (3,), (4,)]
    p.store(kv_cache([5]), [5], "generation")  # over again: no older generation one, so the LRU
    assert list(p.entries) == [(3,), (4,), (5,)]
    assert p.nbytes == sum(s.nbytes for s in p.entries.values()) == 3 * one
    assert p.lookup([2])[0] is None and p.lookup([1])[0] is None
    assert 2 not in p.root.children and 1 not in p.root.children  # evicted keys leave no trie nodes


def test_a_hit_refreshes_recency():
    one = kv_cache([0])[0].snapshot(1).nbytes
    p = PrefixCache(budget_bytes=2 * one, trimmable=True)
    p.store(kv_cache([1]), [1])
    p.store(kv_cache([2]), [2])
    assert p.lookup([1, 7])[1] == 1
    p.store(kv_cache([3]), [3])
    assert list(p.entries) == [(1,), (3,)]


def test_disabled_cache_stores_and_finds_nothing():
    p = PrefixCache(1 << 20, enabled=False)
    p.store(kv_cache([1, 2]), [1, 2])
    assert p.lookup([1, 2, 3]) == (None, 0) and p.nbytes == 0
