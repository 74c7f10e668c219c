"""The options of `spruce bench` (kept apart from the client so that `spruce serve` does not load it)."""

from __future__ import annotations

import argparse

from server.bench.prompts import class_names


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (TTFT, tok/s, latency tail)",
                       description="Drive an OpenAI-compatible server with the bundled prompt set (greedy, thinking "
                                   "off, streamed; each prompt sent --warmup times unmeasured, then --runs times) "
                                   "and write results.json, results.md and PNG plots to --out.")
    p.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--out", required=True, help="directory for the JSON, markdown and plots (created)")
    p.add_argument("--max-tokens", type=int, default=1024, help="most new tokens per answer (default 1024)")
    p.add_argument("--runs", type=int, default=1, help="measured runs per prompt (default 1)")
    p.add_argument("--warmup", type=int, default=1, help="discarded runs per prompt before those (default 1)")
    p.add_argument("--classes", nargs="+", default=None, metavar="CLASS",
                   help=f"prompt classes (default: all): {', '.join(class_names())}")
    p.add_argument("--prompts-per-class", type=int, default=None, help="first N prompts of each class (default all)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or checkpoint dir, to cut long-context prompts to their token targets "
                        "(default: estimate from characters)")
    p.add_argument("--max-context", type=int, default=None,
                   help="skip classes that do not fit N tokens (servers that report a context are held to it anyway)")
    p.add_argument("--model", default=None, help="model field of the requests (default: left out)")
    p.add_argument("--label", default=None, help="engine name in the results (default: the served model id)")
    p.add_argument("--extra-body", default=None, metavar="JSON",
                   help="JSON object merged into every request, e.g. '{\"cache_prompt\": false}'")
    p.add_argument("--reference", default=None, metavar="RESULTS_JSON",
                   help="an earlier results.json: report whether the greedy text equals that engine's")
    p.add_argument("--merge", nargs="+", default=[], metavar="RESULTS_JSON",
                   help="earlier results drawn into the same table and plots (alone: only redraw them)")
    p.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    return p
