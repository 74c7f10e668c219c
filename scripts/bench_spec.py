"""Speculation benchmark: none / ngram / draft / draft-tree side by side in one run, per prompt kind.

    LD_PRELOAD=<openblas libblas.so.3> python scripts/bench_spec.py [--model DIR] [--draft-model DIR]
        [--tokens 128] [--runs 3] [--budget 16] [--depth 8] [--methods none,ngram,draft,draft-tree]
        [--temperature 0 --seed 0] [--defaults]

Defaults to the bundled target and draft. Greedy decoding (or sampling with --temperature and a
fixed seed: position-keyed noise makes every method emit the same tokens; --defaults samples with
the checkpoint's generation_config.json, as a request that sets nothing does), chat template with
thinking off. Reports medians of decode tok/s (first token excluded) and tokens per forward pass,
the ratio to plain decoding measured in the same run, and the share of distinct 8-grams of the
output: prompt lookup thrives on output that repeats itself, so a speed-up measured on looping
output (share well below 1) says little about real use. Outputs are checked identical across methods.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.generate import BUNDLED, Engine
from engine.types import GenerationRequest

PROMPTS = {
    "code": "Write a python function to merge two sorted lists",
    "code-edit": "Rename the variable `total` to `acc` in this function:\n```python\ndef add_all(xs):\n"
                 "    total = 0\n    for x in xs:\n        total = total + x\n    return total\n```",
    "math": "Compute 12 * 13 step by step, then 14 * 15, then 16 * 17.",
    "chat": "Tell me about your favourite season and why you like it.",
}


def render(engine: Engine, text: str) -> list[int]:
    from server.chat import ChatRenderOptions, ChatTemplate

    template = ChatTemplate(engine.tokenizer.chat_template)
    text = template.render([{"role": "user", "content": text}], ChatRenderOptions(enable_thinking=False))
    return engine.tokenizer.encode(text)


def distinct_ngram_share(tokens: list[int], n: int = 8) -> float:
    """Distinct n-grams / all n-grams of the output: 1.0 = never repeats an n-gram, low = loops."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def one(engine: Engine, prompt: list[int], spec: SpecConfig, n: int, base: SamplingParams):
    sampling = dataclasses.replace(base, max_tokens=n)
    req = GenerationRequest(prompt_ids=prompt, sampling=sampling, spec=spec)
    tokens, t_first = [], None
    for step in engine.generate(req):
        if t_first is None and step.token_ids:
            t_first, first_n = time.perf_counter(), len(step.token_ids)
        tokens += step.token_ids
    dt = time.perf_counter() - t_first
    return (len(tokens) - first_n) / dt if dt > 0 else 0.0, step.stats.tokens_per_forward, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED / "target"))
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--methods", default="none,ngram,draft,draft-tree", help="comma-separated; none is always run")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--defaults", action="store_true",
                    help="sample with the checkpoint's generation_config.json (temperature, top_p, top_k, "
                         "repetition_penalty) and --seed")
    a = ap.parse_args()
    engine = Engine(EngineConfig(model_path=a.model, dtype="float32"))
    methods = ["none", *[m for m in a.methods.split(",") if m and m != "none"]]
    specs = {m: SpecConfig(method=m, budget=a.budget, max_depth=a.depth, draft_model=a.draft_model) for m in methods}
    base = SamplingParams(temperature=a.temperature, seed=a.seed)
    if a.defaults:
        d = engine.sampling_defaults
        base = SamplingParams(temperature=d.temperature or 0.0, top_p=d.top_p or 1.0, top_k=d.top_k or 0,
                              min_p=d.min_p or 0.0, repetition_penalty=d.repetition_penalty or 1.0, seed=a.seed)
    decoding = "greedy" if base.temperature == 0 else \
        f"temperature {base.temperature}, top_p {base.top_p}, top_k {base.top_k}, repetition penalty " \
        f"{base.repetition_penalty}, seed {a.seed}"
    print(f"model {Path(a.model).name}, {a.tokens} tokens ({decoding}), budget {a.budget}, depth {a.depth}, "
          f"median of {a.runs} runs")
    print(f"{'prompt':10} {'method':10} {'tok/s':>7} {'tok/fwd':>8} {'vs none':>8} {'8-gram':>7}  same")
    for kind, text in PROMPTS.items():
        prompt = render(engine, text)
        for spec in specs.values():
            one(engine, prompt, spec, 8, base)  # warm-up (compiles, loads the draft model)
        results: dict[str, list] = {m: [] for m in specs}
        for _ in range(a.runs):
            for m, spec in specs.items():  # interleaved: noise hits all methods alike
                results[m].append(one(engine, prompt, spec, a.tokens, base))
        plain_tps = statistics.median(r[0] for r in results["none"])
        ref_tokens = results["none"][0][2]
        for m, rs in results.items():
            tps = statistics.median(r[0] for r in rs)
            tpf = statistics.median(r[1] for r in rs)
            same = all(r[2] == ref_tokens for r in rs)
            share = distinct_ngram_share(rs[0][2])
            ratio = tps / plain_tps
            print(f"{kind:10} {m:10} {tps:7.1f} {tpf:8.2f} {ratio:7.2f}x {share:7.2f}  {'yes' if same else 'NO'}",
                  flush=True)


if __name__ == "__main__":
    main()
