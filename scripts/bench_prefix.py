"""Prefix cache benchmark: time to first token of a repeated ~2k-token prompt and of the second
turn of a conversation, cache on vs off, in one run.

    LD_PRELOAD=<openblas libblas.so.3> python scripts/bench_prefix.py [--model DIR] [--tokens 2048] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from engine.config import EngineConfig, SamplingParams
from engine.generate import BUNDLED, Engine
from engine.types import GenerationRequest


def ttft(engine: Engine, prompt: list[int], max_tokens: int = 1) -> tuple[float, int, list[int]]:
    req = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    out, stats = [], None
    for step in engine.generate(req):
        out += step.token_ids
        stats = step.stats or stats
    return stats.ttft_ms, stats.cached_tokens, out


def conversation(engine: Engine, rng) -> tuple[list[int], list[int]]:
    """Turn 1 prompt and turn 2 prompt (turn 1 + its answer + a new user message) as token ids."""
    from server.chat import ChatRenderOptions, ChatTemplate

    template, opts = ChatTemplate(engine.tokenizer.chat_template), ChatRenderOptions(enable_thinking=False)
    words = engine.tokenizer.decode([int(t) for t in rng.integers(300, engine.vocab_size, size=1500)])
    msgs = [{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": words}]
    turn1 = engine.tokenizer.encode(template.render(msgs, opts))
    _, _, answer = ttft(engine, turn1, max_tokens=32)
    msgs += [{"role": "assistant", "content": engine.tokenizer.decode(answer)},
             {"role": "user", "content": "Now summarise that in one line."}]
    return turn1, engine.tokenizer.encode(template.render(msgs, opts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED / "target"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    on = Engine(EngineConfig(model_path=a.model, prefix_cache=True))
    off = Engine(EngineConfig(model_path=a.model, prefix_cache=False))
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(300, on.vocab_size, size=a.tokens)]
    ttft(off, prompt[:64]), ttft(on, prompt[:64])  # warm-up
    cold, warm, cached = [], [], 0
    for r in range(a.runs):
        p = prompt[:-1] + [int(rng.integers(300, on.vocab_size))]  # same long prefix each run
        cold.append(ttft(off, p)[0])
        ms, cached, _ = ttft(on, p)
        if r > 0:  # the first run fills the cache
            warm.append(ms)
    turn1, turn2 = conversation(on, rng)
    off_t2 = statistics.median(ttft(off, turn2)[0] for _ in range(3))
    on_t2, cached_t2, _ = ttft(on, turn2)
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"model {Path(a.model).name}; medians of {a.runs} runs")
    print(f"repeated {len(prompt)}-token prompt: TTFT cache off {c:8.1f} ms, on {w:8.1f} ms "
          f"({cached} cached tokens) -> {100 * w / c:.1f}% of cold")
    print(f"second chat turn ({len(turn2)} tokens, turn 1 had {len(turn1)}): TTFT off {off_t2:8.1f} ms, "
          f"on {on_t2:8.1f} ms ({cached_t2} cached tokens) -> {100 * on_t2 / off_t2:.1f}% of cold")


if __name__ == "__main__":
    main()
