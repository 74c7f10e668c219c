"""What a half or 8-bit K/V cache changes in the model's answers: greedy text with the cache in
float32 against each `--kv-dtype`, prompt by prompt.

    python scripts/check_kv_dtype.py [--model DIR] [--kv float16,bfloat16,int8] [--classes code,chat,...]
        [--max-tokens 128] [--long 4000]

A half (or 8-bit) cache rounds each K/V row once as it is written, so where two tokens' logits are within
that rounding of each other the greedy answer may take the other one, and go its own way from
there. For each of the benchmark's prompts (server/bench/prompts.json, rendered with the model's
chat template, thinking off; `--long N`: also a generated code file of ~N tokens and its question,
as the benchmark's long-context class builds it) this decodes greedily with the float32 cache and
with each other one, in one engine with the prefix cache off (its entries would carry the other
dtype's rows), and prints the first position where the tokens differ and, there, the gap between
the float32 run's top two log-probabilities. Exits 1 where a difference came at a gap wider than
`--tie` (default engine.dtypes.BF16_NEAR_TIE): a half cache that moved a clear winner.
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

from engine.config import EngineConfig  # noqa: E402
from engine.dtypes import BF16_NEAR_TIE, KV_DTYPES  # noqa: E402
from engine.generate import BUNDLED, Engine  # noqa: E402
from scripts.flip_check import run  # noqa: E402  (greedy, ignoring EOS, with the top two log-probabilities)
from server.bench.prompts import load_prompt_file, long_context_prompt  # noqa: E402
from server.chat import ChatRenderOptions, ChatTemplate  # noqa: E402


def prompts(engine: Engine, classes: list[str], long_tokens: int) -> list[tuple[str, list[int]]]:
    template = ChatTemplate.of(engine.tokenizer)
    file = load_prompt_file()
    texts = [(f"{cls}/{entry['id']}", entry["text"]) for cls, entries in file.items()
             if cls in classes for entry in entries if "text" in entry]
    if long_tokens:  # the long-context class's question and seed, over a module of this size
        entry = file["long-4k"][0]
        counter = lambda text: len(engine.tokenizer.encode(text))  # noqa: E731
        module = long_context_prompt(long_tokens, entry["seed"], entry["question"], counter)
        texts.append((f"long/{long_tokens}", module))
    options = ChatRenderOptions(enable_thinking=False)
    return [(name, engine.tokenizer.encode(template.render([{"role": "user", "content": text}], options)))
            for name, text in texts]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BUNDLED / "target"))
    ap.add_argument("--kv", default="float16,bfloat16")
    ap.add_argument("--classes", default="code,code-edit,math,chat")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long", type=int, default=4000, help="tokens of the generated long prompt (0: none)")
    ap.add_argument("--tie", type=float, default=BF16_NEAR_TIE)
    a = ap.parse_args(argv)
    context = max(EngineConfig(model_path=a.model).max_context, a.long + a.max_tokens + 512)
    engine = Engine(EngineConfig(model_path=a.model, prefix_cache=False, max_context=context))
    halves = a.kv.split(",")
    clear = 0
    same = dict.fromkeys(halves, 0)
    todo = prompts(engine, a.classes.split(","), a.long)
    for name, ids in todo:
        engine.kv_dtype = KV_DTYPES["float32"]
        base, base_lp = run(engine, ids, a.max_tokens, None)
        for half in halves:
            engine.kv_dtype = KV_DTYPES[half]
            got, _ = run(engine, ids, a.max_tokens, None)
            i = next((k for k, (x, y) in enumerate(zip(base, got)) if x != y), None)
            row: dict[str, object] = {"prompt": name, "prompt_tokens": len(ids), "kv": half, "first_difference": i}
            if i is None:
                same[half] += 1
            else:
                top = base_lp[i].top
                gap = top[0][1] - top[1][1]
                row.update(gap=round(gap, 4), near_tie=gap <= a.tie)
                clear += gap > a.tie
            print(json.dumps(row), flush=True)
    for half in halves:
        print(f"{half}: {same[half]} of {len(todo)} answers ({a.max_tokens} greedy tokens) equal float32's")
    print(f"differences at a gap wider than {a.tie}: {clear}")
    return 1 if clear else 0


if __name__ == "__main__":
    sys.exit(main())
