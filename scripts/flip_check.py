"""Where speculation's greedy text differs from plain decoding's, was it a near tie?

    python scripts/flip_check.py --model DIR [--methods ngram mtp] [--classes code] [--max-tokens 256]

In bfloat16 a verify of many rows may round differently from a one-row step, so a speculative
run may pick the other of two tokens whose logits are within rounding of each other; from there
the texts go separate ways (both are the model's greedy text under its own rounding). This runs
the benchmark's prompts (server/bench/prompts.json, rendered with the model's chat template,
thinking off) greedily with each method and with plain decoding, in one engine, and prints per
prompt the first position where the tokens differ and the gap between plain decoding's top two
log-probabilities there. tests/engine/test_low_precision.py holds the rule (gap <=
engine.dtypes.BF16_NEAR_TIE); this script shows it on a real-sized checkpoint on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's engine, installed or not

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from engine.config import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from engine.dtypes import BF16_NEAR_TIE as NEAR_TIE  # noqa: E402
from engine.generate import Engine  # noqa: E402
from engine.types import GenerationRequest  # noqa: E402
from server.bench.prompts import load_prompt_file  # noqa: E402
from server.chat import ChatRenderOptions, ChatTemplate  # noqa: E402


def run(engine: Engine, prompt: list[int], max_tokens: int, spec: SpecConfig | None):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    tokens, logprobs = [], []
    for step in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=sampling, spec=spec)):
        tokens += step.token_ids
        logprobs += step.logprobs or []
    return tokens, logprobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--methods", nargs="+", default=["ngram"])
    ap.add_argument("--classes", nargs="+", default=["code"])
    ap.add_argument("--max-tokens", type=int, default=256)
    a = ap.parse_args(argv)
    engine = Engine(EngineConfig(model_path=a.model, dtype=a.dtype))
    template = ChatTemplate.of(engine.tokenizer)
    prompts = load_prompt_file()
    report = []
    for cls in a.classes:
        for entry in prompts[cls]:
            if "text" not in entry:
                continue
            messages = [{"role": "user", "content": entry["text"]}]
            text = template.render(messages, ChatRenderOptions(enable_thinking=False))
            ids = engine.tokenizer.encode(text)
            plain, plain_lp = run(engine, ids, a.max_tokens, None)
            for method in a.methods:
                fast, _ = run(engine, ids, a.max_tokens, SpecConfig(method=method))
                i = next((k for k, (x, y) in enumerate(zip(plain, fast)) if x != y), None)
                row = {"class": cls, "prompt": entry["id"], "method": method, "tokens": len(plain),
                       "first_difference": i}
                if i is not None:
                    top = plain_lp[i].top
                    row.update(gap=round(top[0][1] - top[1][1], 4), near_tie=top[0][1] - top[1][1] <= NEAR_TIE,
                               plain_token=plain[i], spec_token=fast[i])
                report.append(row)
                print(json.dumps(row), flush=True)
    flips = [r for r in report if r["first_difference"] is not None]
    clear = [r for r in flips if not r["near_tie"]]
    print(f"{len(report)} runs, {len(flips)} differ, {len(clear)} of them at a clear winner")
    return 1 if clear else 0


if __name__ == "__main__":
    sys.exit(main())
