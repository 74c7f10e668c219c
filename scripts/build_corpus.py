"""Build the text corpus of the bundled model from the running interpreter's stdlib.

Deterministic and offline: the same Python version and --seed give byte-identical output.
Three kinds of example, written as JSON lines {"kind", "source", "text"}:
  file  a whole stdlib module;
  chat  "Write a python function to <docstring>" -> the function's source, rendered with the
        chat template (thinking off), from top-level functions and methods with docstrings;
  fim   <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>M (PSM order, as Qwen2.5-Coder).
Files whose path hashes into the held-out bucket go to heldout.jsonl with all their examples.

    python scripts/build_corpus.py OUT_DIR [--seed 0 --heldout-percent 3]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import sysconfig
import textwrap
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import jinja2
from corpus_prompts import requests_for

HERE = Path(__file__).resolve().parent
# Generated tables and data dumps teach nothing about code; site-packages is not the stdlib.
SKIP_DIRS = {"site-packages", "encodings", "pydoc_data", "__pycache__", "lib-dynload", "turtledemo"}
MAX_FILE_BYTES = 250_000
MAX_FUNC_LINES, MAX_FUNC_CHARS = 80, 3500
# FIM: one example per this many characters of a module, so that FIM is ~35 % of the tokens.
FIM_CHARS_PER_EXAMPLE, FIM_MAX_PER_FILE, FIM_MAX_MIDDLE_CHARS = 900, 80, 400
# Short functions are the answers users ask for most: they get more phrasings.
SHORT_FUNC_LINES = 15
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a helpful coding assistant.",
                  "You are an expert Python programmer."]


@dataclass(frozen=True)
class Example:
    kind: str  # "file" | "chat" | "fim"
    source: str  # path relative to the stdlib root
    text: str


@dataclass(frozen=True)
class Function:
    name: str
    docstring: str
    source: str  # dedented, decorators included
    is_method: bool


def stdlib_sources(root: Path) -> list[tuple[str, str]]:
    """(relative path, text) of every parseable UTF-8 .py file under root, sorted by path."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if SKIP_DIRS & set(rel.split("/")[:-1]) or rel.startswith(("_sysconfigdata", "config-")):
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
            ast.parse(text)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue  # deliberately broken files in test/ (bad encodings, bad syntax)
        out.append((rel, text))
    return out


def is_heldout(rel: str, percent: int) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 100 < percent


def is_test_code(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in {"test", "tests", "idle_test"} or p.startswith("test_") for p in parts)


def functions_in(text: str) -> list[Function]:
    """Top-level functions and methods of top-level classes that have docstrings."""
    lines = text.splitlines()
    tree = ast.parse(text)
    found = []
    for node in tree.body:
        members = [(node, False)]
        if isinstance(node, ast.ClassDef):
            members = [(m, True) for m in node.body]
        for fn, is_method in members:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(fn)
            if not doc or fn.name.startswith("test") or len(fn.body) < 2:
                continue  # no docstring, a test, or a body that is nothing but the docstring
            start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
            source = textwrap.dedent("\n".join(lines[start - 1:fn.end_lineno]))
            if fn.end_lineno - start < MAX_FUNC_LINES and len(source) < MAX_FUNC_CHARS:
                found.append(Function(fn.name, doc, source, is_method))
    return found


def chat_examples(rel: str, text: str, template: jinja2.Template, rng: random.Random) -> list[Example]:
    out = []
    for fn in functions_in(text):
        n = 4 if fn.source.count("\n") < SHORT_FUNC_LINES else 3
        for request in requests_for(fn.docstring, fn.name, fn.is_method, rng, n=n):
            messages = [{"role": "user", "content": request.text},
                        {"role": "assistant", "content": f"```python\n{fn.source}\n```"}]
            if rng.random() < 0.3:
                messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            out.append(Example("chat", rel, template.render(messages=messages, enable_thinking=False)))
    return out


def line_offsets(lines: list[str]) -> list[int]:
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    return offsets


def fim_middle_span(lines: list[str], rng: random.Random) -> tuple[int, int]:
    """Character span [a, b) of the middle, shaped like what editors ask for.

    Editors mostly want the rest of the current line or the next 1-3 lines at the indentation
    the cursor already sits on; the suffix then starts with that line's newline.
    """
    offsets = line_offsets(lines)
    i = rng.randrange(len(lines))
    line = lines[i].rstrip("\n")
    indent = len(line) - len(line.lstrip())
    last = min(len(lines) - 1, i + rng.randint(0, 2))

    def end_of(j: int) -> int:  # end of line j, before its newline
        return offsets[j] + len(lines[j].rstrip("\n"))

    mode = rng.random()
    if mode < 0.45:  # cursor mid-line: the rest of the line
        return offsets[i] + rng.randrange(indent, max(indent + 1, len(line))), end_of(i)
    if mode < 0.75:  # cursor after the indentation: 1-3 lines, without the last newline
        return offsets[i] + indent, end_of(last)
    if mode < 0.9:  # cursor at column 0: 1-3 whole lines
        return offsets[i], offsets[last + 1]
    return offsets[i] + rng.randrange(indent, max(indent + 1, len(line))), end_of(last)


def fim_examples(rel: str, text: str, rng: random.Random) -> list[Example]:
    lines = text.splitlines(keepends=True)
    if len(lines) < 5:
        return []
    out = []
    for _ in range(min(FIM_MAX_PER_FILE, 1 + len(text) // FIM_CHARS_PER_EXAMPLE)):
        a, b = fim_middle_span(lines, rng)
        if not text[a:b].strip() or b - a > FIM_MAX_MIDDLE_CHARS:
            continue
        prefix = text[max(0, a - rng.randint(100, 1200)):a]
        suffix = text[b:b + rng.randint(0, 400)]
        # Cut the context at line starts/ends so it looks like an editor's window, not noise.
        if len(prefix) < a and "\n" in prefix[:-1]:
            prefix = prefix[prefix.index("\n") + 1:]
        if "\n" in suffix and b + len(suffix) < len(text):
            suffix = suffix[:suffix.rindex("\n") + 1]
        body = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{text[a:b]}"
        out.append(Example("fim", rel, body))
    return out


def examples_for(rel: str, text: str, template: jinja2.Template, seed: int) -> list[Example]:
    rng = random.Random(seed * 1_000_003 + zlib.crc32(rel.encode()))
    out = [Example("file", rel, text)]
    if not is_test_code(rel):
        out += chat_examples(rel, text, template, rng)
    out += fim_examples(rel, text, rng)
    return out


def load_template() -> jinja2.Template:
    # The same jinja settings transformers uses for chat templates.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
    return env.from_string((HERE / "qwen35_chat_template.jinja").read_text())


def write_jsonl(path: Path, examples: list[Example]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(asdict(ex), ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-percent", type=int, default=3)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    template = load_template()
    splits: dict[str, list[Example]] = {"train": [], "heldout": []}
    for rel, text in stdlib_sources(root):
        split = "heldout" if is_heldout(rel, a.heldout_percent) else "train"
        splits[split] += examples_for(rel, text, template, a.seed)
    for split, examples in splits.items():
        write_jsonl(a.out / f"{split}.jsonl", examples)
        chars = Counter()
        for ex in examples:
            chars[ex.kind] += len(ex.text)
        counts = Counter(ex.kind for ex in examples)
        print(split, {k: f"{counts[k]} ex, {chars[k] / 1e6:.1f} MB" for k in sorted(counts)})


if __name__ == "__main__":
    main()
