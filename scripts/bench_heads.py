"""Two or more MTP heads for one target side by side: tok/s against plain decoding and tokens per
forward, each head in its own engine, all in one process, run by run.

    python scripts/bench_heads.py --heads old=engine/bundled/target,new=DIR [--variants engine,mp0]
        [--kinds code,chat,long] [--runs 5] [--tokens 128] [--tree chain] [--adaptive]
        [--defaults --seed 3]

Each DIR is a target checkpoint directory; to compare a head alone, make DIR a copy of the target
(links to its files) with another mtp.safetensors. Every head drafts with the same settings (MTP,
--tree, the method's depth, budget 16; every round the full budget unless --adaptive), under each
engine variant of --variants (scripts/variants.py: "mp0" is the stop rule off). The first head's
engine also decodes plainly beside every run, and each cell is the median of the runs' tok/s
ratios to that plain run, then tokens per forward. Outputs must equal plain decoding's (a verify
row is bitwise the plain step on the CPU; the script stops where one differs). The 8-gram column
is the distinct share of plain decoding's output (below ~0.7 the answer loops).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from bench_context import distinct_8grams  # noqa: E402
from bench_spec import PROMPTS, checkpoint_defaults, render  # noqa: E402
from variants import variant_setting  # noqa: E402

from engine.config import SPEC_TREES, EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402


def run(engine: Engine, prompt: list[int], params: SamplingParams, spec: SpecConfig) -> tuple[list[int], float, float]:
    """(tokens, decode tok/s, tokens per forward) of one generation."""
    tokens: list[int] = []
    for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=params, spec=spec)):
        tokens += step.token_ids
        if step.stats is not None:
            stats = step.stats
    return tokens, stats.decode_tps, stats.tokens_per_forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", required=True, help="NAME=DIR,NAME=DIR,...: target checkpoints, one head each")
    ap.add_argument("--variants", default="engine", help="engine variants (scripts/variants.py), e.g. engine,mp0")
    ap.add_argument("--kinds", default="code,chat,long",
                    help=f"prompt kinds of scripts/bench_spec.py: {', '.join(PROMPTS)}")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--tree", default="chain", choices=SPEC_TREES)
    ap.add_argument("--adaptive", action="store_true", help="the controller sizes each tree (the engine's default)")
    ap.add_argument("--defaults", action="store_true", help="sample with the checkpoint's defaults and --seed")
    ap.add_argument("--seed", type=int, default=3)
    a = ap.parse_args()
    heads = dict(item.split("=", 1) for item in a.heads.split(",") if item)
    kinds = [k for k in a.kinds.split(",") if k]
    if not heads or any(k not in PROMPTS for k in kinds):
        ap.error("--heads NAME=DIR,... and --kinds of " + ", ".join(PROMPTS))
    engines = {name: Engine(EngineConfig(model_path=path, prefix_cache=False)) for name, path in heads.items()}
    arms = [(name, v) for v in a.variants.split(",") for name in heads]
    spec = SpecConfig(method="mtp", tree=a.tree, adaptive=a.adaptive)
    first = next(iter(engines.values()))
    sampling = f"sampled (checkpoint defaults, seed {a.seed})" if a.defaults else "greedy"
    print(f"MTP {a.tree}, {'controller' if a.adaptive else 'budget 16 every round'}, {sampling}, "
          f"{a.runs} runs x {a.tokens} tokens; cells: tok/s vs plain (median of paired ratios), tokens per forward")
    print("| prompt | 8-grams | " + " | ".join(f"{n} {v}" for n, v in arms) + " |")
    print("|---|---|" + "---|" * len(arms))
    for kind in kinds:
        for p, text in enumerate(PROMPTS[kind]):
            prompt = render(first, text)
            params = checkpoint_defaults(first, a.seed, a.tokens) if a.defaults else SamplingParams(max_tokens=a.tokens)
            ratios: dict[tuple[str, str], list[float]] = {arm: [] for arm in arms}
            per_forward: dict[tuple[str, str], float] = {}
            for r in range(a.runs + 1):  # the first is a warm-up
                plain, plain_tps, _ = run(first, prompt, params, SpecConfig())
                for name, v in arms:
                    with variant_setting(f"x-{v}" if v != "engine" else "x"):
                        out, tps, tpf = run(engines[name], prompt, params, spec)
                    if out != plain:
                        sys.exit(f"{name} {v} on {kind}{p + 1}: the output differs from plain decoding's")
                    if r:
                        ratios[(name, v)].append(tps / plain_tps)
                        per_forward[(name, v)] = tpf
            label = kind if len(PROMPTS[kind]) == 1 else f"{kind}{p + 1}"
            cells = [f"{statistics.median(ratios[arm]):.2f}x, {per_forward[arm]:.2f}" for arm in arms]
            print(f"| {label} | {distinct_8grams(plain):.2f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
