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
    and without it, each verify from the same state ("queued_no_commit"); their difference is what
    the commit adds to a round, host and device. "commit_host" is the host's part: building it
    ("commit_build": the layers' commit calls) and handing it to the device (the rest: MLX's
    evaluation call, which encodes the launches)."""
    from engine import forward, sampler

    def one(commit: bool) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        marks = None if commit else [c.mark() for c in cache]
        choices = mx.argmax(forward.verify(model, cache, tree, committed), axis=-1)
        sampler.accept_walk(tree, np.array(choices).__getitem__)
        t1 = time.perf_counter()
        built = t1
        if commit:
            forward.commit(cache, path, evaluate=False)
            built = time.perf_counter()
            mx.async_eval(forward.state_arrays(cache))
        else:
            for c, m in zip(cache, marks, strict=True):
                c.rewind(m)
        end = time.perf_counter()
        return end - t0, end - t1, built - t1

    got: dict[str, list[float]] = {"queued_round": [], "queued_no_commit": [], "commit_host": [], "commit_build": []}
    for r in range(2 * rounds + 4):  # the two kinds alternate, each after one of its own kind
        commit = r % 4 < 2
        ms, host, build = one(commit)
        if commit:
            committed += len(path)
        if r >= 4 and r % 2 == 1:
            got["queued_round" if commit else "queued_no_commit"].append(ms * 1e3)
            if commit:
                got["commit_host"].append(host * 1e3)
                got["commit_build"].append(build * 1e3)
    mx.eval(forward.state_arrays(cache))
    out = {k: statistics.median(v) for k, v in got.items()}
    out["commit_queued"] = out["queued_round"] - out["queued_no_commit"]
    return out, committed
