"""The cost of one speculation round on fixed draft trees, for the GPU benchmarks.

Random weights make acceptance meaningless, so rounds are timed on a fixed tree shape (a chain of
up to 8 under the root, the rest siblings along it) whose whole chain is accepted: each phase
synchronised (verify / accept / commit), and back to back as the engine runs them (the commit
queued behind the next verify). Used by scripts/bench_gpu.py; the tree by the profiling scripts.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np


def chain_with_siblings(n: int, root: int = 1) -> Any:
    """The benchmarks' fixed tree of n nodes: a chain of up to 8 under the root, the rest siblings
    along it (engine/warmup.py's shape; ids below 8192, inside every vocabulary used here)."""
    from engine import warmup

    return warmup.chain_with_siblings(root, n, min(n - 1, 8), 8192)


def round_costs(engine: Any, prompt: list[int], sizes: tuple[int, ...],
                rounds: int = 6) -> dict[str, dict[str, float]]:
    """Median ms of verify / accept / commit for trees of N nodes (each phase synchronised)."""
    from engine import forward, sampler

    model = engine.model
    cache = model.make_cache()
    forward.extend(model, cache, prompt[:-1])
    committed = len(prompt) - 1
    out = {}
    for n in sizes:
        tree = chain_with_siblings(n, prompt[-1])
        path = tree.path_to(min(n - 1, 8))  # the whole chain is accepted
        times: dict[str, list[float]] = {"verify": [], "accept": [], "commit": []}
        for r in range(rounds + 2):
            t0 = time.perf_counter()
            logits = forward.verify(model, cache, tree, committed)
            choices = mx.argmax(logits, axis=-1)
            mx.eval(choices)
            t1 = time.perf_counter()
            sampler.accept_walk(tree, np.array(choices).__getitem__)
            t2 = time.perf_counter()
            forward.commit(cache, path)
            t3 = time.perf_counter()
            committed += len(path)
            if r >= 2:
                for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                    times[k].append(v * 1e3)
        out[str(n)] = {k: statistics.median(v) for k, v in times.items()}
        out[str(n)]["round"] = sum(out[str(n)].values())
        queued, committed = queued_rounds(model, cache, tree, path, committed, rounds)
        out[str(n)].update(queued)
    for v in out.values():
        v["vs_1_node"] = v["round"] / out["1"]["round"]
    return out


def queued_rounds(model: Any, cache: list, tree: Any, path: list[int], committed: int,
                  rounds: int) -> tuple[dict[str, float], int]:
    """Rounds as the engine runs them: the commit queued, not waited for (the next verify waits
    for it). Median ms a round over `rounds` back-to-back rounds, with the commit ("queued_round")
    and without it, each verify from the same state ("queued_no_commit"); their difference, taken
    cycle by cycle ("commit_queued", the median of the paired differences), is what the commit adds
    to a round, host and device. "commit_host" is the host's part: building it
    ("commit_build": the layers' commit calls) and handing it to the device (the rest: MLX's
    evaluation call, which encodes the launches). Where the GDN caches fold commits into the next
    verify (engine/cache.py, the GPU kernels), a third kind of round runs interleaved with the
    other two: each commit run on its own ("queued_round_unfolded", "commit_unfolded"), so the two
    ways are compared round by round on one lease."""
    from engine import forward, sampler
    from engine.cache import GDNCache

    folding = any(isinstance(c, GDNCache) and c.folds for c in cache)
    kinds = ("commit", "unfolded", "none") if folding else ("commit", "none")

    def one(kind: str) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        marks = None if kind != "none" else [c.mark() for c in cache]
        choices = mx.argmax(forward.verify(model, cache, tree, committed), axis=-1)
        sampler.accept_walk(tree, np.array(choices).__getitem__)
        t1 = time.perf_counter()
        built = t1
        if kind != "none":
            saved = GDNCache.fold_commits
            GDNCache.fold_commits = False if kind == "unfolded" else saved
            try:
                forward.commit(cache, path, evaluate=False)
            finally:
                GDNCache.fold_commits = saved
            built = time.perf_counter()
            mx.async_eval(forward.state_arrays(cache))
        else:
            for c, m in zip(cache, marks, strict=True):
                c.rewind(m)
        end = time.perf_counter()
        return end - t0, end - t1, built - t1

    names = {"commit": "queued_round", "unfolded": "queued_round_unfolded", "none": "queued_no_commit"}
    got: dict[str, list[float]] = {k: [] for k in (*names.values(), "commit_host", "commit_build",
                                                   "commit_host_unfolded")}
    # each kind runs two rounds in turn and the second is kept: it follows one of its own kind
    for r in range(len(kinds) * (rounds + 2)):
        kind = kinds[(r // 2) % len(kinds)]
        ms, host, build = one(kind)
        if kind != "none":
            committed += len(path)
        if r >= 2 * len(kinds) and r % 2 == 1:
            got[names[kind]].append(ms * 1e3)
            if kind == "commit":
                got["commit_host"].append(host * 1e3)
                got["commit_build"].append(build * 1e3)
            elif kind == "unfolded":
                got["commit_host_unfolded"].append(host * 1e3)
    mx.eval(forward.state_arrays(cache))
    out = {k: statistics.median(v) for k, v in got.items() if v}
    # what a commit adds: the median of the differences cycle by cycle (one round of each kind a
    # cycle), not the difference of the medians, which a lease whose speed drifts during the
    # measurement made negative (an H200 call: 8.00 ms with the commit, 8.83 without)
    out["commit_queued"] = paired_median(got["queued_round"], got["queued_no_commit"])
    if folding:
        out["commit_unfolded"] = paired_median(got["queued_round_unfolded"], got["queued_no_commit"])
    return out, committed


def paired_median(a: list[float], b: list[float]) -> float:
    """Median of a[i] - b[i] over the cycles both ran."""
    return statistics.median(x - y for x, y in zip(a, b, strict=True))
