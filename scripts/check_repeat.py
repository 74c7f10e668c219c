"""Does the same seeded request give the same tokens every time? Each prompt runs several times
through one engine with the prefix cache on and through one with it off, for plain decoding and
the given speculation methods, on this machine's default device.

    python scripts/check_repeat.py [--model DIR] [--dtype bfloat16] [--runs 3] [--tokens 128]
        [--lengths 64,2048] [--kinds long,code] [--methods none,mtp] [--defaults | --temperature 0.7 ...]

Prompts: random ids of each length in --lengths (any checkpoint), and bench_spec.py's prompts of
each kind in --kinds rendered with the chat template. Prints, per prompt, method and prefix-cache
setting, how many runs equal the first and where the first difference is; then whether the first
runs agree across the two settings and with plain decoding. In float32 every cell must be equal;
in bfloat16 a difference between settings or methods can be a near-tie that rounds the other way
(a tree's rows, or a prompt restored from the cache and then extended, are summed in another
order), but runs of one setting repeat the same computation and must agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from bench_spec import PROMPTS, parse_methods, render  # noqa: E402

from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (the shorter one's length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED / "target"))
    ap.add_argument("--dtype", default="auto", help="compute dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--lengths", default="64,2048", help="random-id prompts of these lengths ('' = none)")
    ap.add_argument("--kinds", default="", help="bench_spec.py prompt kinds, e.g. long,code ('' = none)")
    ap.add_argument("--methods", default="none",
                    help="as bench_spec.py's (none, METHOD[:TREE]; the engine's default budget and depth)")
    ap.add_argument("--defaults", action="store_true", help="sample with the checkpoint's generation_config.json")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    lengths = [int(n) for n in a.lengths.split(",") if n]
    kinds = [k for k in a.kinds.split(",") if k]
    defaults = SpecConfig()  # the engine's budget and depth; adaptive trees, as a request gets them
    specs = parse_methods(a.methods, [defaults.budget], 0,  # 0: each method's default depth
                          argparse.Namespace(draft_model=None, dflash_model=None, adaptive=defaults.adaptive))
    methods = list(specs)
    engines = {cache: Engine(EngineConfig(model_path=a.model, dtype=a.dtype, prefix_cache=cache,
                                          max_context=max([*lengths, 4096]) + a.tokens + 1))
               for cache in (True, False)}
    probe = engines[False]
    params = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, repetition_penalty=a.repetition_penalty, seed=a.seed)
    if a.defaults:
        d = probe.sampling_defaults
        params = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=d.temperature or 0.0,
                                top_p=d.top_p or 1.0, top_k=d.top_k or 0, min_p=d.min_p or 0.0,
                                repetition_penalty=d.repetition_penalty or 1.0, seed=a.seed)
    prompts = {f"{n} random ids": [int(t) for t in np.random.RandomState(n).randint(0, probe.vocab_size, size=n)]
               for n in lengths}
    for kind in kinds:
        for i, text in enumerate(PROMPTS[kind]):
            prompts[kind if len(PROMPTS[kind]) == 1 else f"{kind}{i + 1}"] = render(probe, text)
    print(f"model {Path(a.model).name}, dtype {a.dtype}, {a.tokens} tokens, {params}")
    print("| prompt | method | prefix cache | runs equal to the first | first difference |")
    print("|---|---|---|---|---|")
    bad = 0
    for label, prompt in prompts.items():
        firsts: dict[tuple[str, bool], list[int]] = {}
        for method in methods:
            spec = specs[method]
            for cache, engine in engines.items():
                if (why := engine.missing_drafter(spec.method, spec.tree)) is not None:
                    print(f"| {label} | {method} | - | skipped: {why} | |")
                    break
                runs = []
                for _ in range(a.runs):
                    req = GenerationRequest(prompt_ids=prompt, sampling=params, spec=spec)
                    runs.append([t for step in engine.generate(req) for t in step.token_ids])
                diffs = [first_difference(runs[0], r) for r in runs[1:]]
                equal = sum(d is None for d in diffs) + 1
                where = min((d for d in diffs if d is not None), default=None)
                bad += equal != len(runs)
                print(f"| {label} | {method} | {'on' if cache else 'off'} | {equal} / {len(runs)} | "
                      f"{'-' if where is None else f'token {where}'} |", flush=True)
                firsts[(method, cache)] = runs[0]
        for (method, cache), tokens in firsts.items():
            if (method, cache) == (methods[0], False):
                continue
            d = first_difference(firsts[(methods[0], False)], tokens)
            print(f"| {label} | {method} vs {methods[0]} | {'on' if cache else 'off'} vs off | "
                  f"{'equal' if d is None else 'differ'} | {'-' if d is None else f'token {d}'} |", flush=True)
    print(f"settings whose runs did not all repeat: {bad}")


if __name__ == "__main__":
    main()
