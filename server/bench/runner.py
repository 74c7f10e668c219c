"""Drive one server through the prompt set under the seeds' discipline and summarise per class.

Each prompt is sent `warmup` times (discarded: compilation, caches, page-in) and then `runs` times
(measured), one request at a time. Classes whose prompts cannot fit the context (the server's,
where it says, or `max_context`) are skipped with a note instead of failing.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO
from urllib.parse import urlparse

import httpx

from server.bench.client import RequestFailed, RequestSettings, probe_server, stream_chat
from server.bench.progress import Progress
from server.bench.prompts import BenchPrompt, class_target_tokens, make_token_counter, select_prompts
from server.bench.records import ClassSummary, EngineResult, PromptResult
from server.bench.stats import summarize_class

CONTEXT_MARGIN = 64  # chat-template tokens around the user message, plus rounding of the cut


class BenchError(Exception):
    """A problem with the benchmark's setup (unreachable server, bad option): one line for the user."""


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    classes: tuple[str, ...]
    max_tokens: int = 1024
    runs: int = 1
    warmup: int = 1
    prompts_per_class: int | None = None
    tokenizer: str | None = None  # tokenizer.json (or checkpoint dir) to size long-context prompts
    max_context: int | None = None  # client-side context limit, for servers that do not say theirs
    model: str | None = None
    label: str | None = None
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("max_tokens", "runs"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise BenchError(f"--warmup must be >= 0, got {self.warmup}")
        if self.prompts_per_class is not None and self.prompts_per_class < 1:
            raise BenchError(f"--prompts-per-class must be >= 1, got {self.prompts_per_class}")
        if self.max_context is not None and self.max_context < 1:
            raise BenchError(f"--max-context must be >= 1, got {self.max_context}")
        scheme = urlparse(self.base_url).scheme
        if scheme not in ("http", "https"):
            raise BenchError(f"--base-url must start with http:// or https://, got {self.base_url!r}")


def run_bench(config: BenchConfig, reference: EngineResult | None = None, engine_info: dict | None = None,
              progress_stream: TextIO | None = None) -> EngineResult:
    counter = make_token_counter(config.tokenizer) if config.tokenizer else None
    prompts = select_prompts(list(config.classes), config.prompts_per_class, counter)
    settings = RequestSettings(max_tokens=config.max_tokens, model=config.model, extra_body=config.extra_body)
    with httpx.Client(timeout=httpx.Timeout(config.timeout_s, connect=30.0)) as client:
        try:
            model_id, server_context = probe_server(client, config.base_url)
        except RequestFailed as e:
            raise BenchError(str(e)) from None
        context = min((c for c in (config.max_context, server_context) if c), default=None)
        skipped = {cls: why for cls in config.classes if (why := _too_long(cls, config.max_tokens, context))}
        todo = [p for p in prompts if p.cls not in skipped]
        # llama-server's model id is the GGUF's path: name the engine by the file, not this machine's paths.
        label = config.label or (Path(model_id).name if model_id else urlparse(config.base_url).netloc)
        progress = Progress(len(todo) * (config.warmup + config.runs), label, progress_stream)
        results = [_run_prompt(client, config, settings, p, progress) for p in todo]
    reference_texts = reference.texts() if reference is not None else None
    classes = [ClassSummary(cls, 0, 0, note=skipped[cls]) if cls in skipped
               else summarize_class(cls, [r for r in results if r.cls == cls], reference_texts)
               for cls in config.classes]
    return EngineResult(
        label=label, base_url=config.base_url, model=model_id,
        date=dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        machine=describe_machine(),
        settings={"max_tokens": config.max_tokens, "warmup": config.warmup, "runs": config.runs,
                  "classes": list(config.classes), "prompts_per_class": config.prompts_per_class,
                  "tokenizer": Path(config.tokenizer).name if config.tokenizer else None,
                  "context": context, "extra_body": config.extra_body},
        engine_info=engine_info or {}, reference=reference.label if reference is not None else None,
        prompts=results, classes=classes,
    )


def _too_long(cls: str, max_tokens: int, context: int | None) -> str | None:
    target = class_target_tokens(cls)
    if not target or context is None or target + max_tokens + CONTEXT_MARGIN <= context:
        return None
    return (f"skipped: about {target} prompt + {max_tokens} new tokens do not fit the context "
            f"of {context} tokens")


def _run_prompt(client: httpx.Client, config: BenchConfig, settings: RequestSettings, prompt: BenchPrompt,
                progress: Progress) -> PromptResult:
    result = PromptResult(prompt.id, prompt.cls)
    for i in range(config.warmup + config.runs):
        measured = i >= config.warmup
        try:
            record = stream_chat(client, config.base_url, prompt.text, settings)
        except (RequestFailed, httpx.HTTPError) as e:
            result.error = str(e) or type(e).__name__
            # The rest of this prompt's runs would fail alike: count them done and move on.
            for _ in range(config.warmup + config.runs - i):
                progress.step(f"{prompt.cls}/{prompt.id} failed")
            return result
        (result.runs if measured else result.warmup).append(record)
        tag = f"run {i - config.warmup + 1}" if measured else "warm-up"
        progress.step(f"{prompt.cls}/{prompt.id} {tag}")
    return result


def describe_machine() -> str:
    """OS, architecture, CPU model and count: which machine the numbers belong to (the client's,
    which is the server's when both run locally, as the seeds' discipline has it)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
