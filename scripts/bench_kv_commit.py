"""In-process A/B: a 17-node round (verify + commit of a path whose rows must move) at a long
context, KVCache.commit gathering the accepted rows from the verify's own K/V (the engine's)
against gathering them from the cache buffer (before 2026-12-02: MLX then copied the whole
buffer on every commit, since the buffer had a second reader).

    python scripts/bench_kv_commit.py --model DIR --context 16000 [--rounds 24]

DIR needs a context of at least --context tokens (the bundled target with max_position_embeddings
raised will do: random-id prompts, speed only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine import forward  # noqa: E402
from engine.cache import AcceptedPath, KVCache  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.generate import Engine  # noqa: E402
from engine.warmup import chain_with_siblings  # noqa: E402

ENGINE_COMMIT = KVCache.commit


def buffer_commit(self: KVCache, path: AcceptedPath) -> None:
    """The commit before the change: the accepted rows read back from the buffer itself."""
    if not path.is_prefix:
        assert self.keys is not None and self.values is not None
        rows = self.offset + path.index
        end = self.offset + len(path)
        self.keys[:, :, self.offset : end] = self.keys[:, :, rows]
        self.values[:, :, self.offset : end] = self.values[:, :, rows]
    self.rewind(self.offset)  # drops the record of the last write, as the engine's commit does
    self.advance(len(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=16000)
    ap.add_argument("--rounds", type=int, default=24)
    a = ap.parse_args()
    e = Engine(EngineConfig(model_path=a.model, prefix_cache=False, dtype="float32", max_context=a.context + 200))
    ids = [int(t) for t in np.random.RandomState(0).randint(0, e.vocab_size, size=a.context)]
    cache = e.make_cache()
    t = time.perf_counter()
    forward.extend(e.model, cache, ids[:-1], e.prefill_chunk)
    print(f"prefill of {a.context - 1} tokens: {time.perf_counter() - t:.1f} s")
    tree = chain_with_siblings(ids[-1], 17, 8, e.vocab_size)
    path = [0, 1, 10]  # node 10 is a sibling under node 1: its K/V row moves
    times: dict[str, list[float]] = {"from the verify's rows": [], "from the buffer": []}
    for r in range(a.rounds + 4):  # the first four warm up; then the two alternate
        which = list(times)[r % 2]
        KVCache.commit = ENGINE_COMMIT if r % 2 == 0 else buffer_commit  # type: ignore[method-assign]
        marks = [c.mark() for c in cache]
        t0 = time.perf_counter()
        mx.eval(forward.verify(e.model, cache, tree, a.context - 1))
        forward.commit(cache, path)
        dt = time.perf_counter() - t0
        for c, m in zip(cache, marks, strict=True):
            c.rewind(m)
        if r >= 4:
            times[which].append(dt * 1e3)
    KVCache.commit = ENGINE_COMMIT  # type: ignore[method-assign]
    for k, v in times.items():
        print(f"round (17-node verify + commit) at {a.context} tokens, K/V rows {k}: median "
              f"{statistics.median(v):.2f} ms over {len(v)}")


if __name__ == "__main__":
    main()
