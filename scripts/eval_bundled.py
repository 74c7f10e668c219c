"""Evaluate the bundled models for the model card: held-out perplexity and greedy samples.

Perplexity is computed with HF transformers (PyTorch CPU, fp32) over non-overlapping 1024-token
windows of the held-out token arrays from encode_corpus.py. Samples are generated greedily by
Spruce's engine and checked token for token against transformers' greedy decoding. Infill is
scored on --fim-cases held-out FIM examples (evenly spaced through heldout.jsonl): greedy
middle, stopped at <|endoftext|>, compared with the true middle (exact, and first non-blank line).

    python scripts/eval_bundled.py [--data build/bundled_data] [--out eval.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])
KINDS = ("file", "chat", "fim")
CHAT_PROMPTS = (
    "Write a python function to merge two sorted lists",
    "Write a python function to check whether a string is a palindrome",
    "Write a python function to return the number of lines in a text file",
)
FIM_PREFIX = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
              '    a, b = 0, 1\n    for _ in range(n):\n        ')
FIM_SUFFIX = "\n    return a\n"


@dataclass(frozen=True)
class Perplexity:
    kind: str
    tokens: int
    loss: float  # mean next-token cross-entropy, nats
    ppl: float


@dataclass(frozen=True)
class FimScore:
    cases: int
    exact: int  # generated middle == true middle
    first_line: int  # first non-blank lines equal (trailing spaces ignored)
    examples: list[dict]  # the first few (middle, generated) pairs


@dataclass(frozen=True)
class Sample:
    prompt: str  # the user message, or "FIM" for the infill example
    rendered: str  # the exact text the model saw
    completion: str
    tokens: int
    matches_transformers: bool


def heldout_perplexity(model, data: Path, seq: int = 1024, batch: int = 8) -> list[Perplexity]:
    out, total_loss, total_tokens = [], 0.0, 0
    for kind in KINDS:
        tokens = torch.from_numpy(np.load(data / f"heldout_{kind}.npy").astype(np.int64))
        n = (tokens.numel() - 1) // seq
        windows = torch.stack([tokens[i * seq:(i + 1) * seq + 1] for i in range(n)])
        loss_sum = 0.0
        with torch.no_grad():
            for i in range(0, n, batch):
                w = windows[i:i + batch]
                logits = model(input_ids=w[:, :-1]).logits
                loss_sum += torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count = n * seq
        out.append(Perplexity(kind, count, loss_sum / count, math.exp(loss_sum / count)))
        total_loss, total_tokens = total_loss + loss_sum, total_tokens + count
    out.append(Perplexity("all", total_tokens, total_loss / total_tokens, math.exp(total_loss / total_tokens)))
    return out


def fim_cases(data: Path, n: int) -> list[tuple[str, str]]:
    """(prompt up to and including <|fim_middle|>, true middle) of n evenly spaced held-out FIM examples."""
    with (data / "heldout.jsonl").open(encoding="utf-8") as f:
        texts = [ex["text"] for ex in map(json.loads, f) if ex["kind"] == "fim"]
    picked = [texts[i * len(texts) // n] for i in range(min(n, len(texts)))]
    return [(prompt + "<|fim_middle|>", middle)
            for prompt, _, middle in (t.rpartition("<|fim_middle|>") for t in picked)]


def first_line(text: str) -> str:
    return next((line.rstrip() for line in text.split("\n") if line.strip()), "")


def fim_score(model, tok, cases: list[tuple[str, str]], eos: list[int]) -> FimScore:
    exact = first = 0
    examples = []
    for prompt, middle in cases:
        ids = tok.encode(prompt, add_special_tokens=False)
        budget = len(tok.encode(middle, add_special_tokens=False)) + 16
        got = tok.decode(hf_greedy(model, ids, budget, eos), skip_special_tokens=False)
        exact += got == middle
        first += first_line(got) == first_line(middle)
        if len(examples) < 8:
            examples.append({"middle": middle, "generated": got})
    return FimScore(len(cases), exact, first, examples)


def spruce_greedy(engine, ids: list[int], max_tokens: int) -> list[int]:
    from engine.config import SamplingParams
    from engine.types import GenerationRequest

    out: list[int] = []
    for step in engine.generate(GenerationRequest(prompt_ids=ids, sampling=SamplingParams(max_tokens=max_tokens))):
        out += step.token_ids
    return out


def hf_greedy(model, ids: list[int], n: int, eos: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[-1])
    return [t for t in out[0, len(ids):].tolist() if t not in eos]


def samples(target: Path, hf_model, max_tokens: int) -> list[Sample]:
    from transformers import AutoTokenizer

    from engine.config import EngineConfig
    from engine.generate import Engine

    engine = Engine(EngineConfig(model_path=str(target)))
    tok = AutoTokenizer.from_pretrained(target)
    eos = list(engine.tokenizer.eos_token_ids)
    prompts = [(q, tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False))
               for q in CHAT_PROMPTS]
    prompts.append(("FIM", f"<|fim_prefix|>{FIM_PREFIX}<|fim_suffix|>{FIM_SUFFIX}<|fim_middle|>"))
    out = []
    for prompt, rendered in prompts:
        ids = engine.tokenizer.encode(rendered)
        ours = [t for t in spruce_greedy(engine, ids, max_tokens) if t not in eos]
        ref = hf_greedy(hf_model, ids, max_tokens, eos)
        out.append(Sample(prompt, rendered, engine.tokenizer.decode(ours), len(ours), ours == ref[:len(ours)]))
    return out


def main(argv: list[str] | None = None) -> None:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=REPO / "build" / "bundled_data")
    ap.add_argument("--target", type=Path, default=REPO / "engine" / "bundled" / "target")
    ap.add_argument("--draft", type=Path, default=REPO / "engine" / "bundled" / "draft")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--fim-cases", type=int, default=40)
    ap.add_argument("--skip-samples", action="store_true", help="perplexity and infill only")
    ap.add_argument("--out", type=Path, default=Path("eval_bundled.json"))
    a = ap.parse_args(argv)
    report = {}
    for name, path in (("target", a.target), ("draft", a.draft)):
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        report[name] = {"params": sum(p.numel() for p in model.parameters()),
                        "perplexity": [asdict(p) for p in heldout_perplexity(model, a.data)]}
        print(name, json.dumps(report[name]), flush=True)
        if name == "target":
            from transformers import AutoTokenizer

            score = fim_score(model, AutoTokenizer.from_pretrained(path), fim_cases(a.data, a.fim_cases),
                              [model.config.pad_token_id, model.config.eos_token_id])
            report["fim"] = asdict(score)
            print(f"FIM: {score.exact}/{score.cases} exact, {score.first_line}/{score.cases} first line", flush=True)
        if name == "target" and not a.skip_samples:
            report["samples"] = [asdict(s) for s in samples(path, model, a.max_tokens)]
            for s in report["samples"]:
                print(f"### {s['prompt']} ({s['tokens']} tokens, same as transformers: "
                      f"{s['matches_transformers']})\n{s['completion']}\n", flush=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
