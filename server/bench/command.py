"""`spruce bench`: run the benchmark, then write JSON, markdown and plots to --out.

An HTTP client only: it never imports mlx or the engine, so it can measure any server from any
machine (or from the same one, as the seeds' discipline has it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from server.bench.plots import PlotsUnavailable, draw_plots
from server.bench.prompts import PromptSetError, class_names
from server.bench.records import EngineResult, ResultFileError, load, save
from server.bench.report import render_markdown
from server.bench.runner import BenchConfig, BenchError, run_bench


def bench_command(a: argparse.Namespace) -> int:
    out = Path(a.out)
    merged = [_load(p) for p in a.merge]
    reference = _load(a.reference) if a.reference else None
    results = list(merged)
    if a.base_url:
        config = _config(a)
        if reference is not None and reference.settings.get("max_tokens") != config.max_tokens:
            raise BenchError(f"--reference {a.reference} was run with --max-tokens "
                             f"{reference.settings.get('max_tokens')}, this run {config.max_tokens}: texts differ")
        try:
            result = run_bench(config, reference)
        except PromptSetError as e:
            raise BenchError(str(e)) from None
        results.insert(0, result)
    elif not merged:
        raise BenchError("pass --base-url URL (or --merge RESULTS_JSON... to redraw earlier results)")
    paths = write_outputs(results, out, plots=not a.no_plots, fresh=results[0] if a.base_url else None)
    print((out / "results.md").read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    if a.base_url and not any(c.runs for c in results[0].classes):
        print("spruce bench: no request succeeded", file=sys.stderr)
        return 1
    return 0


def write_outputs(results: list[EngineResult], out: Path, plots: bool = True, fresh: EngineResult | None = None,
                  baseline: str | None = None, title: str = "spruce bench") -> list[Path]:
    """results.json (the fresh run, if any), results.md over all results, and the PNG plots."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if fresh is not None:
        save(fresh, out / "results.json")
        paths.append(out / "results.json")
    (out / "results.md").write_text(render_markdown(results, baseline, title), encoding="utf-8")
    paths.append(out / "results.md")
    if plots:
        try:
            paths += draw_plots(results, out)
        except PlotsUnavailable as e:
            print(f"spruce bench: {e}", file=sys.stderr)
    return paths


def _config(a: argparse.Namespace) -> BenchConfig:
    classes = [c for item in (a.classes or class_names()) for c in item.split(",") if c]
    known = class_names()
    unknown = [c for c in classes if c not in known]
    if unknown:
        raise BenchError(f"unknown prompt class {', '.join(unknown)} (known: {', '.join(known)})")
    return BenchConfig(base_url=a.base_url, classes=tuple(dict.fromkeys(classes)), max_tokens=a.max_tokens,
                       runs=a.runs, warmup=a.warmup, prompts_per_class=a.prompts_per_class, tokenizer=a.tokenizer,
                       max_context=a.max_context, model=a.model, label=a.label,
                       extra_body=_extra_body(a.extra_body), timeout_s=a.timeout)


def _extra_body(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchError(f"--extra-body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BenchError("--extra-body must be a JSON object")
    return body


def _load(path: str) -> EngineResult:
    try:
        return load(path)
    except ResultFileError as e:
        raise BenchError(str(e)) from None


def slug(label: str) -> str:
    """A file name for an engine label."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "engine"
