"""Does a sampling setting keep the bundled model from looping? Distinct word 8-grams of answers.

    LD_PRELOAD=<openblas libblas.so.3> python scripts/eval_sampling_defaults.py [--tokens 256] [--prompts 2] [--seeds 2]

For each setting, every prompt of the bench's code / code-edit / chat classes (thinking off) is
answered with each seed; reported: the median share of distinct word 8-grams (1.0 = no 8-gram
repeats; low = the text loops) and how many answers ended by themselves (EOS) before the limit.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

from engine.config import EngineConfig, SamplingParams
from engine.generate import BUNDLED, Engine
from engine.types import GenerationRequest
from server.bench.prompts import select_prompts
from server.bench.stats import distinct_ngram_share
from server.chat import ChatRenderOptions, ChatTemplate

SETTINGS = {
    "greedy": {},
    "T0.7 p0.8 k20": dict(temperature=0.7, top_p=0.8, top_k=20),
    "T0.7 p0.8 k20 rep1.1": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.1),
    "greedy rep1.1": dict(repetition_penalty=1.1),
    "T0.6 p0.95 k20 rep1.05": dict(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per class")
    ap.add_argument("--seeds", type=int, default=2)
    a = ap.parse_args()
    engine = Engine(EngineConfig(model_path=str(BUNDLED / "target"), prefix_cache=False))
    template = ChatTemplate.of(engine.tokenizer)
    prompts = select_prompts(["code", "code-edit", "chat"], a.prompts, None)
    for name, kw in SETTINGS.items():
        shares, ended = [], 0
        for prompt in prompts:
            text = template.render([{"role": "user", "content": prompt.text}], ChatRenderOptions(enable_thinking=False))
            ids = engine.tokenizer.encode(text, special=True)
            for seed in range(a.seeds if kw.get("temperature") else 1):
                sampling = SamplingParams(max_tokens=a.tokens, seed=seed, stop_token_ids=engine.tokenizer.eos_token_ids,
                                          **kw)
                steps = list(engine.generate(GenerationRequest(prompt_ids=ids, sampling=sampling)))
                out = [t for s in steps for t in s.token_ids]
                ended += steps[-1].finish_reason == "stop"
                share = distinct_ngram_share(engine.tokenizer.decode(out))
                if share is not None:
                    shares.append(share)
        print(f"{name:24s} distinct 8-grams median {statistics.median(shares):.2f} (min {min(shares):.2f}), "
              f"{ended}/{len(shares)} ended by EOS", flush=True)


if __name__ == "__main__":
    main()
