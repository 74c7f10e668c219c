"""Decode speed against context length, plain and with speculation, side by side.

    python scripts/bench_context.py [--model DIR] [--lengths 64,2048,4000,8000] [--tokens 96] [--runs 3]
                                    [--temperature 1.0 --seed 0] [--top-k 20 --top-p 0.8 --repetition-penalty 1.1]
                                    [--text long] [--max-stall X]
                                    [--methods none,ngram,ngram-fixed]   (also: draft, mtp, dflash, each -fixed;
                                                                          mtp-v0, dflash-v0: no draft vocabulary)

The engine is called directly (no server), greedy, after a prompt of random token ids (guesses
mostly miss there: the honest case for speculation). Runs interleave methods and lengths (the
methods' order turned by one each repetition: `rotated`); medians.
Without --model it uses the bundled target; lengths past a checkpoint's context need a checkpoint
with a longer one (e.g. `scripts/make_tiny_checkpoint.py` with the bundled shape), since the
bundled model was trained on 4096 tokens. Prints decode tok/s, its ratio to the shortest length,
the ratio to plain decoding (of the medians, and the median of each run's ratio to the plain run
on the same prompt, next to it in the interleaving: requests on a busy machine drift by 10-20 %
from one to the next, and pairing cancels what the two share), tokens per forward, and p50 / p99
inter-token latency (the gap between the token batches the loop emits, spread over their tokens).
`--text KIND` uses bench_spec.py's prompt of that kind (e.g. `long`: 1.8k tokens of Python source
and a question) in place of random ids, at its own length: real text, where the drafters find
matches, propose and miss. "vs shortest, paired" is the median of each run's ratio to the same
method's run on the shortest prompt in the same repetition. `--variants engine,pw0` runs each
method under each engine variant too (scripts/variants.py's suffixes, e.g. pw0: the CPU's powf
left to libm; kv32 / kv16 / kvbf / kv8: the target's K/V cache as computed / in float16 / in bfloat16 / in 8 bits,
where the engine's own is --kv-dtype auto's), interleaved, each with
its paired ratio to the engine as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402

from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402
from scripts.variants import variant_setting  # noqa: E402

METHODS = {"none": SpecConfig(), "ngram": SpecConfig(method="ngram"),
           "ngram-fixed": SpecConfig(method="ngram", adaptive=False),
           "draft": SpecConfig(method="draft"), "draft-fixed": SpecConfig(method="draft", adaptive=False),
           "mtp": SpecConfig(method="mtp", tree="ddtree"),
           "mtp-fixed": SpecConfig(method="mtp", tree="ddtree", adaptive=False),
           "dflash": SpecConfig(method="dflash", tree="ddtree"),
           "dflash-fixed": SpecConfig(method="dflash", tree="ddtree", adaptive=False),
           # the one-pass drafters over the whole vocabulary (the others: the checkpoint's draft vocabulary)
           "mtp-v0": SpecConfig(method="mtp", tree="ddtree", draft_vocab=0),
           "dflash-v0": SpecConfig(method="dflash", tree="ddtree", draft_vocab=0)}


def distinct_8grams(tokens: list[int]) -> float:
    """Distinct 8-grams / all 8-grams of the output: speculation figures are honest only near 1."""
    grams = [tuple(tokens[i : i + 8]) for i in range(len(tokens) - 7)]
    return len(set(grams)) / len(grams) if grams else 1.0


def run(engine: Engine, prompt: list[int], spec: SpecConfig, tokens: int, base: SamplingParams) -> dict[str, float]:
    sampling = dataclasses.replace(base, max_tokens=tokens, ignore_eos=True)
    req = GenerationRequest(prompt_ids=prompt, sampling=sampling, spec=spec)
    gaps: list[float] = []
    out: list[int] = []
    last = None
    for step in engine.generate(req):
        out += step.token_ids
        now = time.perf_counter()
        if step.token_ids and last is not None:  # a batch of n tokens after a gap: n gaps of gap / n
            gaps += [(now - last) / len(step.token_ids) * 1e3] * len(step.token_ids)
        if step.token_ids:
            last = now
        if step.stats is not None:
            stats = step.stats
    GAPS.append(list(gaps))
    gaps.sort()
    return {"tps": stats.decode_tps, "tpf": stats.tokens_per_forward, "grams": distinct_8grams(out),
            "p50": gaps[len(gaps) // 2] if gaps else 0.0, "p99": gaps[int(len(gaps) * 0.99)] if gaps else 0.0}


GAPS: list[list[float]] = []  # every run's inter-token gaps, for the p99 over all runs pooled


def pooled_p99(runs: list[list[float]]) -> float:
    """p99 over the gaps of all runs together: one run of ~100 tokens has ~100 gaps, so its own
    p99 is its largest gap; pooled, it is the gap 1 % of all tokens wait at least."""
    gaps = sorted(g for run in runs for g in run)
    return gaps[int(len(gaps) * 0.99)] if gaps else 0.0


def paired_ratio(runs: list[dict[str, float]], plain: list[dict[str, float]]) -> float:
    """The median over runs of a method's tok/s against plain decoding's run on the same prompt
    (the runs of both are in the same order, one of each per prompt)."""
    return statistics.median(r["tps"] / p["tps"] for r, p in zip(runs, plain, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=BUNDLED / "target")
    ap.add_argument("--lengths", default="64,2048,4000")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--methods", default="none,ngram,ngram-fixed")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled with --seed: every method emits "
                    "the same tokens (greedy output after random ids tends to loop)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--max-stall", type=float, default=None,
                    help="the controller's stall cap for every adaptive method (--spec-max-stall)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default="", help="a prompt kind of bench_spec.py instead of random ids")
    ap.add_argument("--variants", default="engine", help="engine variants (scripts/variants.py), e.g. engine,pw0; "
                    "kv32 / kv16 / kvbf / kv8: the target's K/V cache as computed / float16 / bfloat16 / int8 "
                    "(--kv-dtype)")
    a = ap.parse_args()
    variants = list(dict.fromkeys(a.variants.split(",")))
    lengths = [int(n) for n in a.lengths.split(",")]
    methods = list(dict.fromkeys(a.methods.split(",")))  # each once: runs pair by position
    context = {} if a.text else {"max_context": max(lengths) + a.tokens + 1}  # a text: the default
    engine = Engine(EngineConfig(model_path=str(a.model), prefix_cache=False, dtype="float32", **context))
    vocab = engine.vocab_size
    text: list[int] = []
    if a.text:
        from scripts.bench_spec import PROMPTS, render

        text = render(engine, PROMPTS[a.text][0])
        lengths = [len(text)]
    base = SamplingParams(temperature=a.temperature, seed=a.seed, top_k=a.top_k, top_p=a.top_p,
                          repetition_penalty=a.repetition_penalty)
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    gaps: dict[tuple[str, int], list[list[float]]] = {}
    own_kv = engine.kv_dtype  # --kv-dtype auto's choice for this model here
    for r in range(a.runs + 1):  # the first round warms up (compiles) and is dropped
        for n in lengths:
            prompt = text or [int(t) for t in np.random.RandomState(r * 1000 + n).randint(0, vocab, size=n)]
            for m, v in rotated([(m, v) for m in methods for v in variants], r):
                # "kv32" / "kv16" / "kvbf" / "kv8": the target's K/V stored as computed (float32 on the
                # CPU) / float16 / bfloat16 / int8 (EngineConfig.kv_dtype); every other variant the engine's own
                engine.kv_dtype = KV_VARIANTS[v] if v in KV_VARIANTS else own_kv
                with variant_setting(f"x-{v}" if v != "engine" else "x"):
                    spec = METHODS[m]
                    if a.max_stall is not None and spec.method != "none" and spec.adaptive:
                        spec = dataclasses.replace(spec, max_stall=a.max_stall)
                    out = run(engine, prompt, spec, a.tokens, base)
                if r:
                    results.setdefault((label(m, v), n), []).append(out)
                    gaps.setdefault((label(m, v), n), []).append(GAPS[-1])
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in results.items()}
    decoding = "greedy" if a.temperature == 0 else f"temperature {a.temperature}, seed {a.seed}"
    cuts = [f"{n} {v}" for n, v, off in (("top_k", a.top_k, 0), ("top_p", a.top_p, 1.0),
                                         ("repetition penalty", a.repetition_penalty, 1.0)) if v != off]
    decoding += "".join(f", {c}" for c in cuts)
    prompts = f"the {a.text} prompt" if a.text else "random-id prompts"
    print(f"model {a.model.name}, {a.tokens} new tokens ({decoding}) after {prompts}, medians of {a.runs}")
    several = len(variants) > 1
    print("| method | prompt tokens | decode tok/s | vs shortest | vs shortest, paired | vs plain | vs plain, paired "
          "| tokens/forward | ITL p50 / p99 ms | p99 pooled ms (vs plain) | distinct 8-grams |"
          + (" vs engine, paired |" if several else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if several else ""))
    for m in methods:
        for v in variants:
            k = label(m, v)
            for n in lengths:
                x = med[(k, n)]
                plain_key = (label("none", v), n)
                plain = med.get(plain_key, x)["tps"]
                p99 = pooled_p99(gaps[(k, n)])
                p99_plain = pooled_p99(gaps.get(plain_key, gaps[(k, n)]))
                paired = paired_ratio(results[(k, n)], results.get(plain_key, results[(k, n)]))
                shortest = paired_ratio(results[(k, n)], results[(k, lengths[0])])
                engine_paired = f" {paired_ratio(results[(k, n)], results[(m, n)]):.3f} |" if several else ""
                print(f"| {k} | {n} | {x['tps']:.1f} | {x['tps'] / med[(k, lengths[0])]['tps']:.2f} | {shortest:.2f} | "
                      f"{x['tps'] / plain:.2f} | {paired:.2f} | {x['tpf']:.2f} | {x['p50']:.1f} / {x['p99']:.1f} | "
                      f"{p99:.1f} ({p99 / p99_plain:.2f}x) | {x['grams']:.2f} |{engine_paired}")


KV_VARIANTS = {"kv32": None, "kv16": mx.float16, "kvbf": mx.bfloat16, "kv8": mx.int8}


def rotated(settings: list, rep: int) -> list:
    """The settings of one repetition, the order turned by one each repetition: a run's place in the
    order moved its speed by 1-2 % on the dev CPU (plain decoding run twice in a row, paired: 0.98-0.99x
    for the second), and in a fixed order that bias went to every ratio against the first."""
    k = rep % len(settings)
    return settings[k:] + settings[:k]


def label(method: str, variant: str) -> str:
    """A method's name in the table: alone for the engine as it is, else with its variant."""
    return method if variant == "engine" else f"{method}/{variant}"


if __name__ == "__main__":
    main()
