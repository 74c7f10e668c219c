"""Typed records of a benchmark: one request (RunRecord), one prompt (PromptResult), one prompt
class (ClassSummary), one engine (EngineResult); and their JSON form."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1


@dataclass
class RunRecord:
    """One streamed request, timed on the client. Times in ms from sending the request."""

    ttft_ms: float | None  # first piece of text; None when the answer was empty
    total_ms: float
    arrivals_ms: list[float]  # when each piece of text (an SSE chunk with text) arrived
    text: str
    reasoning: str
    finish_reason: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int
    tokens_counted: str  # "usage" (the server's count) or "chunks" (one per text chunk)
    timings: dict | None  # the server's llama.cpp-style timings, as sent

    @property
    def gaps_ms(self) -> list[float]:
        """Inter-token latency samples: the wait between successive pieces of text."""
        a = self.arrivals_ms
        return [a[i] - a[i - 1] for i in range(1, len(a))]


@dataclass
class PromptResult:
    prompt_id: str
    cls: str
    warmup: list[RunRecord] = field(default_factory=list)  # discarded runs (the seeds' discipline)
    runs: list[RunRecord] = field(default_factory=list)  # measured runs
    error: str | None = None  # the request failed: the server's message


@dataclass
class ClassSummary:
    """Medians over a class's measured runs; latency percentiles over all their gaps pooled."""

    cls: str
    prompts: int
    runs: int
    prompt_tokens: float | None = None
    ttft_ms: float | None = None
    prefill_tps: float | None = None
    prefill_source: str | None = None  # "server" (timings.prompt_per_second) or "client" (tokens / TTFT)
    decode_tps: float | None = None  # client: (completion tokens - 1) / (last text - first text)
    server_decode_tps: float | None = None  # timings.predicted_per_second, where reported
    tokens_per_forward: float | None = None
    distinct_8gram_share: float | None = None  # over whitespace-separated words of the answer
    itl_p50_ms: float | None = None
    itl_p95_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_samples: int = 0
    tokens_per_chunk: float | None = None  # completion tokens / text chunks (>1: several tokens a chunk)
    completion_tokens: float | None = None  # median per request
    same_as_reference: str | None = None  # "k/n" prompts whose text equals the reference engine's
    stable: bool | None = None  # every measured run of every prompt gave the same text
    note: str | None = None  # why the class was skipped, or what failed


@dataclass
class EngineResult:
    label: str
    base_url: str
    model: str | None
    date: str  # ISO 8601, UTC
    machine: str
    settings: dict  # max_tokens, warmup, runs, classes, prompts per class, tokenizer, context
    engine_info: dict = field(default_factory=dict)  # set by whoever started the server: command, weights
    reference: str | None = None  # label of the engine whose text "same" compares against
    prompts: list[PromptResult] = field(default_factory=list)
    classes: list[ClassSummary] = field(default_factory=list)
    skipped: str | None = None  # the engine was not run at all: why
    version: int = FORMAT_VERSION

    def summary(self, cls: str) -> ClassSummary | None:
        return next((c for c in self.classes if c.cls == cls), None)

    def class_gaps(self, cls: str) -> list[float]:
        return [g for p in self.prompts if p.cls == cls for r in p.runs for g in r.gaps_ms]

    def texts(self) -> dict[str, str]:
        """The first measured answer of each prompt (what `same_as_reference` compares)."""
        return {p.prompt_id: p.runs[0].text for p in self.prompts if p.runs}


def save(result: EngineResult, path: Path) -> None:
    path.write_text(json.dumps(asdict(result), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


class ResultFileError(ValueError):
    pass


def load(path: str | Path) -> EngineResult:
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
        if raw.get("version") != FORMAT_VERSION:
            raise ResultFileError(f"{p}: not a spruce bench result (format {raw.get('version')!r})")
        prompts = [PromptResult(warmup=[RunRecord(**r) for r in d.pop("warmup")],
                                runs=[RunRecord(**r) for r in d.pop("runs")], **d) for d in raw.pop("prompts")]
        classes = [ClassSummary(**c) for c in raw.pop("classes")]
        return EngineResult(prompts=prompts, classes=classes, **raw)
    except (OSError, json.JSONDecodeError, TypeError, KeyError, AttributeError) as e:
        raise ResultFileError(f"{p}: cannot read a spruce bench result: {e}") from None
