"""Numbers from timed runs: percentiles, speeds, tokens per forward pass, output repetitiveness."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from server.bench.records import ClassSummary, PromptResult, RunRecord

NGRAM = 8
BURST_MS = 0.2  # per token: 5000 tok/s, beyond any engine at batch size 1; only a held-back stream is this fast


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distinct_ngram_share(text: str, n: int = NGRAM) -> float | None:
    """Distinct word n-grams / all word n-grams of a text (1.0: nothing repeats; a loop drives it
    toward 0). Words are whitespace-separated; None when the text has fewer than n words."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def held_back(run: RunRecord) -> bool:
    """The answer reached the client in one burst (faster than BURST_MS a token from first text to
    last): the server held the stream back, and no decode speed can be read from the arrivals."""
    if len(run.arrivals_ms) < 2 or run.completion_tokens < 2:
        return False
    return run.arrivals_ms[-1] - run.arrivals_ms[0] < BURST_MS * (run.completion_tokens - 1)


def decode_tps(run: RunRecord) -> float | None:
    """Client-side decode speed: tokens after the first over the time from first to last text."""
    if len(run.arrivals_ms) < 2 or run.completion_tokens < 2 or held_back(run):
        return None
    span_s = (run.arrivals_ms[-1] - run.arrivals_ms[0]) / 1000.0
    return (run.completion_tokens - 1) / span_s


def prefill_tps(run: RunRecord) -> tuple[float | None, str | None]:
    """Prompt tokens per second: the server's figure when it reports one, else uncached prompt
    tokens over the client's time to first token (which also holds one decode step and HTTP)."""
    t = run.timings or {}
    if t.get("prompt_per_second"):
        return float(t["prompt_per_second"]), "server"
    if run.prompt_tokens and run.ttft_ms:
        fresh = run.prompt_tokens - (run.cached_tokens or 0)
        return (fresh / (run.ttft_ms / 1000.0), "client") if fresh > 0 else (None, None)
    return None, None


def tokens_per_forward(run: RunRecord) -> float | None:
    """Generated tokens per target forward pass, where the server's timings tell: Spruce reports it;
    llama.cpp reports draft_n / draft_n_accepted (absent: no drafting, one token a forward)."""
    t = run.timings
    if not t:
        return None
    if t.get("tokens_per_forward") is not None:
        return float(t["tokens_per_forward"])
    n = t.get("predicted_n")
    if not n:
        return None
    accepted = t.get("draft_n_accepted") or 0
    return n / (n - accepted) if n > accepted else None


def _median(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def summarize_class(cls: str, prompts: list[PromptResult], reference: dict[str, str] | None) -> ClassSummary:
    """One class's row: medians over measured runs, pooled inter-token latency percentiles, and how
    many prompts' first measured answer equals the reference engine's (None: no reference)."""
    ok = [p for p in prompts if p.runs]
    runs = [r for p in ok for r in p.runs]
    errors = [p for p in prompts if p.error]
    notes = [f"{len(errors)} of {len(prompts)} prompts failed: {errors[0].error}"] if errors else []
    bursts = sum(1 for r in runs if held_back(r))
    if bursts:
        notes.append(f"{bursts} of {len(runs)} answers arrived in one burst (no decode speed read from them)")
    out = ClassSummary(cls=cls, prompts=len(ok), runs=len(runs), note="; ".join(notes) or None)
    if not runs:
        return out
    prefill = [prefill_tps(r) for r in runs]
    gaps = [g for r in runs for g in r.gaps_ms]
    chunks = sum(len(r.arrivals_ms) for r in runs)
    out.prompt_tokens = _median([r.prompt_tokens for r in runs])
    out.ttft_ms = _median([r.ttft_ms for r in runs])
    out.prefill_tps = _median([p[0] for p in prefill])
    out.prefill_source = next((p[1] for p in prefill if p[1]), None)
    out.decode_tps = _median([decode_tps(r) for r in runs])
    out.server_decode_tps = _median([(r.timings or {}).get("predicted_per_second") for r in runs])
    out.tokens_per_forward = _median([tokens_per_forward(r) for r in runs])
    out.distinct_8gram_share = _median([distinct_ngram_share(r.text) for r in runs])
    if gaps:
        out.itl_p50_ms, out.itl_p95_ms, out.itl_p99_ms = (percentile(gaps, q) for q in (50, 95, 99))
    out.itl_samples = len(gaps)
    out.tokens_per_chunk = sum(r.completion_tokens for r in runs) / chunks if chunks else None
    out.completion_tokens = _median([float(r.completion_tokens) for r in runs])
    out.stable = all(r.text == p.runs[0].text for p in ok for r in p.runs)
    ref = reference or {}
    compared = [p for p in ok if p.prompt_id in ref]
    if compared:
        same = sum(1 for p in compared if ref[p.prompt_id] == p.runs[0].text)
        out.same_as_reference = f"{same}/{len(compared)}"
    return out
