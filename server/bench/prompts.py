"""The prompt set of `spruce bench`: short prompts from prompts.json, long-context prompts built here.

A long-context prompt is a generated Python module (deterministic: a seeded generator, so every
engine and every run gets the same text) followed by a question about one of its functions. It is
cut at a function boundary to about `target_tokens` tokens of user message, counted with the
checkpoint's tokenizer when one is given (`--tokenizer`), else estimated from its length in
characters (CHARS_PER_TOKEN; the prompt_tokens the server reports are in the results either way).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("prompts.json")
CHARS_PER_TOKEN = 2.5  # low on purpose: code runs 2.8 (8k-vocab BPE) to ~4 chars a token, so estimates undershoot

TokenCounter = Callable[[str], int]


class PromptSetError(ValueError):
    """The prompt selection cannot be made (unknown class, bad tokenizer path)."""


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    cls: str  # prompt class: code, code-edit, math, chat, long-4k, long-16k
    text: str  # the user message
    target_tokens: int | None = None  # long-context classes: the intended prompt size


def load_prompt_file(path: Path = PROMPTS_FILE) -> dict[str, list[dict]]:
    return json.loads(path.read_text(encoding="utf-8"))["classes"]


def class_names(path: Path = PROMPTS_FILE) -> list[str]:
    return list(load_prompt_file(path))


def class_target_tokens(cls: str, path: Path = PROMPTS_FILE) -> int:
    """The largest prompt (in tokens) a class asks for; short classes count as 0."""
    return max((int(p.get("target_tokens", 0)) for p in load_prompt_file(path)[cls]), default=0)


def select_prompts(classes: list[str], per_class: int | None, counter: TokenCounter | None,
                   path: Path = PROMPTS_FILE) -> list[BenchPrompt]:
    table = load_prompt_file(path)
    unknown = [c for c in classes if c not in table]
    if unknown:
        raise PromptSetError(f"unknown prompt class {', '.join(unknown)} (known: {', '.join(table)})")
    out = []
    for cls in classes:
        for entry in table[cls][:per_class]:
            out.append(_build(cls, entry, counter))
    return out


def _build(cls: str, entry: dict, counter: TokenCounter | None) -> BenchPrompt:
    if "text" in entry:
        return BenchPrompt(entry["id"], cls, entry["text"])
    target = int(entry["target_tokens"])
    text = long_context_prompt(target, int(entry["seed"]), entry["question"], counter)
    return BenchPrompt(entry["id"], cls, text, target)


def make_token_counter(path: str | Path) -> TokenCounter:
    """Token count of a text with a checkpoint's tokenizer.json (a file or a checkpoint directory)."""
    from tokenizers import Tokenizer

    p = Path(path).expanduser()
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise PromptSetError(f"--tokenizer {path}: no tokenizer.json there")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # a corrupt or foreign file: name it, no traceback
        raise PromptSetError(f"--tokenizer {path}: cannot read {file.name}: {e}") from None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def long_context_prompt(target_tokens: int, seed: int, question: str, counter: TokenCounter | None) -> str:
    """A generated module of about target_tokens tokens (with the question), then the question."""
    units = ModuleWriter(seed).units(target_tokens)
    count = counter or (lambda text: round(len(text) / CHARS_PER_TOKEN))
    # The question names a function near the start, so the answer needs the whole context read.
    name = units[1].name if len(units) > 1 else units[0].name
    ask = question.format(function=name)

    def render(n: int) -> str:
        body = "\n\n".join(u.code for u in units[:n])
        return f"```python\n{body}\n```\n\n{ask}"

    lo, hi = 1, len(units)  # largest n whose prompt fits the target (binary search: counting is O(text))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(render(mid)) <= target_tokens:
            lo = mid
        else:
            hi = mid - 1
    return render(lo)


@dataclass(frozen=True)
class CodeUnit:
    name: str
    code: str


NOUNS = ("order", "invoice", "customer", "shipment", "parcel", "route", "ledger", "account", "batch", "item",
         "warehouse", "supplier", "payment", "refund", "coupon", "basket", "report", "schedule", "vehicle", "zone")
VERBS = ("load", "check", "merge", "split", "price", "count", "filter", "group", "rank", "score", "clean",
         "export", "match", "assign", "summarise", "validate", "estimate", "archive", "notify", "reconcile")
FIELDS = ("weight", "total", "quantity", "distance", "discount", "tax", "priority", "balance", "age", "rate")


class ModuleWriter:
    """Writes plausible, varied Python functions from a seed: enough structure to read like code,
    enough variety that a prompt-lookup drafter cannot copy whole pages from earlier in the prompt."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.used: set[str] = set()

    def units(self, target_tokens: int) -> list[CodeUnit]:
        # About 60 tokens a function at the least: this always over-provides, and the caller cuts.
        return [self.unit() for _ in range(max(4, target_tokens // 40))]

    def unit(self) -> CodeUnit:
        name = self._name()
        noun, field = self.rng.choice(NOUNS), self.rng.choice(FIELDS)
        limit = self.rng.randint(2, 500)
        kind = self.rng.randrange(4)
        if kind == 0:
            code = (f"def {name}({noun}s, threshold={limit}):\n"
                    f"    \"\"\"Return the {noun}s whose {field} is at least `threshold`, largest first.\"\"\"\n"
                    f"    kept = [x for x in {noun}s if x.{field} >= threshold]\n"
                    f"    kept.sort(key=lambda x: x.{field}, reverse=True)\n"
                    f"    return kept")
        elif kind == 1:
            other = self.rng.choice(FIELDS)
            code = (f"def {name}({noun}):\n"
                    f"    \"\"\"Weighted {field} of one {noun}; {other} counts {limit % 7 + 2} times.\"\"\"\n"
                    f"    if {noun}.{field} is None:\n"
                    f"        raise ValueError(\"{noun} has no {field}\")\n"
                    f"    return ({noun}.{field} + {limit % 7 + 2} * {noun}.{other}) / {limit % 7 + 3}")
        elif kind == 2:
            code = (f"def {name}(rows):\n"
                    f"    \"\"\"Group rows by {noun} id and sum their {field}.\"\"\"\n"
                    f"    totals = {{}}\n"
                    f"    for row in rows:\n"
                    f"        key = row[\"{noun}_id\"]\n"
                    f"        totals[key] = totals.get(key, 0) + row.get(\"{field}\", 0)\n"
                    f"    return {{k: v for k, v in totals.items() if v > {limit}}}")
        else:
            step = self.rng.randint(2, 9)
            code = (f"def {name}(values, window={step}):\n"
                    f"    \"\"\"Moving average of {noun} {field}s over `window` entries, capped at {limit}.\"\"\"\n"
                    f"    out = []\n"
                    f"    for i in range(len(values) - window + 1):\n"
                    f"        chunk = values[i:i + window]\n"
                    f"        out.append(min({limit}, sum(chunk) / window))\n"
                    f"    return out")
        return CodeUnit(name, code)

    def _name(self) -> str:
        while True:
            name = f"{self.rng.choice(VERBS)}_{self.rng.choice(NOUNS)}_{self.rng.choice(FIELDS)}"
            if name not in self.used:
                self.used.add(name)
                return name
