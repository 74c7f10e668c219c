"""The markdown report: one table row per (prompt class, engine), then notes and definitions."""

from __future__ import annotations

from server.bench.records import ClassSummary, EngineResult

DEFINITIONS = """\
- TTFT: time from sending the request to the first piece of answer text, on the client.
- prefill tok/s: the server's own figure (`timings.prompt_per_second`) where it reports one (marked s),
  else uncached prompt tokens / TTFT on the client (marked c; it includes one decode step and HTTP).
- decode tok/s: on the client, (completion tokens - 1) / (time of the last text - time of the first).
  "x" is its ratio to the baseline engine in the same class.
- tok/fwd: generated tokens per target forward pass, as the server reports it (Spruce: `timings.tokens_per_forward`;
  llama.cpp: from `draft_n_accepted`); "-" where the server does not say.
- distinct 8-grams: distinct word 8-grams / all word 8-grams of the answer (whitespace-separated words); low
  values mean the text loops, where speculation figures flatter.
- ITL: inter-token latency, the wait between successive streamed text chunks, pooled over the measured runs of
  the class. A chunk holds one token on llama.cpp and mlx_lm.server and every token of one decoding round on
  Spruce ("tok/chunk"), so with speculation ITL is the wait per round: the stall a reader sees.
- same text: prompts whose greedy answer equals the reference engine's, character for character.
- Medians over prompts x measured runs; each prompt was sent `warmup` times first and those runs discarded."""


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(x: float | None, base: float | None) -> str:
    return f"{x / base:.2f}x" if x and base else "-"


def render_markdown(results: list[EngineResult], baseline: str | None = None, title: str = "spruce bench") -> str:
    """A table over all engines' results. `baseline` names the engine the x column divides by
    (default: the first one that ran)."""
    ran = [r for r in results if not r.skipped]
    base = next((r for r in ran if r.label == baseline), ran[0] if ran else None)
    lines = [f"# {title}", ""]
    lines += _header(results, base)
    lines += ["", "| class | engine | weights | prompt tok | TTFT ms | prefill tok/s | decode tok/s | x | tok/fwd "
              "| distinct 8-grams | ITL p50 / p95 / p99 ms | tok/chunk | new tok | same text |",
              "|" + "---|" * 14]
    notes = []
    for cls in _classes(results):
        base_row = base.summary(cls) if base else None
        for r in ran:
            row = r.summary(cls)
            if row is None:
                continue
            if row.runs == 0:
                notes.append(f"- {r.label} / {cls}: {row.note or 'no measured runs'}")
                continue
            lines.append(_row(cls, r, row, base_row))
            if row.note:
                notes.append(f"- {r.label} / {cls}: {row.note}")
    notes += [f"- {r.label}: not run: {r.skipped}" for r in results if r.skipped]
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += ["", DEFINITIONS, ""]
    return "\n".join(lines)


def _header(results: list[EngineResult], base: EngineResult | None) -> list[str]:
    first = next((r for r in results if not r.skipped), results[0] if results else None)
    if first is None:
        return ["No results."]
    s = first.settings
    out = [f"- date: {first.date}; machine: {first.machine}",
           f"- greedy (temperature 0), thinking off, streamed; up to {s.get('max_tokens')} new tokens; "
           f"{s.get('warmup')} discarded + {s.get('runs')} measured run(s) per prompt"]
    reference = next((r.reference for r in results if r.reference), None)
    if base is not None:
        out.append(f"- baseline for x: {base.label}; reference for same text: {reference or 'none'}")
    for r in results:
        info = "; ".join(f"{k}: {v}" for k, v in r.engine_info.items() if k != "weights")
        out.append(f"- {r.label}: {r.base_url}" + (f" ({info})" if info else ""))
    return out


def _classes(results: list[EngineResult]) -> list[str]:
    seen: list[str] = []
    for r in results:
        seen += [c.cls for c in r.classes if c.cls not in seen]
    return seen


def _row(cls: str, r: EngineResult, row: ClassSummary, base_row: ClassSummary | None) -> str:
    prefill = _num(row.prefill_tps, 0) + (f" {row.prefill_source[0]}" if row.prefill_source else "")
    itl = f"{_num(row.itl_p50_ms)} / {_num(row.itl_p95_ms)} / {_num(row.itl_p99_ms)}"
    same = row.same_as_reference or "-"
    if row.stable is False:
        same += " (runs differ)"
    cells = [cls, r.label, str(r.engine_info.get("weights", "-")), _num(row.prompt_tokens, 0), _num(row.ttft_ms, 0),
             prefill, _num(row.decode_tps), _ratio(row.decode_tps, base_row.decode_tps if base_row else None),
             _num(row.tokens_per_forward, 2), _num(row.distinct_8gram_share, 2), itl,
             _num(row.tokens_per_chunk, 2), _num(row.completion_tokens, 0), same]
    return "| " + " | ".join(cells) + " |"
