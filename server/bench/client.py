"""One streamed chat completion against any OpenAI-compatible server, timed on the client.

Times are taken when each SSE line is read, so they include HTTP and the server's own framing, as
a user's client sees them. What the server reports about itself (`usage`, llama.cpp-style
`timings`) is kept as given.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from server.bench.records import RunRecord


class RequestFailed(Exception):
    """The server answered with an error (HTTP status or an error event in the stream)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RequestSettings:
    max_tokens: int
    model: str | None = None  # None: leave the field out (each server uses its loaded model)
    extra_body: dict = field(default_factory=dict)  # merged into every request body


def chat_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"


def root_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def request_body(prompt: str, settings: RequestSettings) -> dict:
    """The seeds' discipline: greedy, thinking off, streamed, usage at the end."""
    body: dict = {
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": settings.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if settings.model is not None:
        body["model"] = settings.model
    body.update(settings.extra_body)
    return body


@dataclass
class _StreamState:
    t0: float
    arrivals_ms: list[float] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    text_chunks: int = 0
    finish_reason: str | None = None
    usage: dict | None = None
    timings: dict | None = None

    def feed(self, chunk: dict, now: float) -> None:
        if chunk.get("error"):
            err = chunk["error"]
            raise RequestFailed(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("timings"):
            self.timings = chunk["timings"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = delta.get("content") or ""
            thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
            if piece or thought or delta.get("tool_calls"):
                self.arrivals_ms.append((now - self.t0) * 1000.0)
                self.text_chunks += 1
                self.content.append(piece)
                self.reasoning.append(thought)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]


def stream_chat(client: httpx.Client, base_url: str, prompt: str, settings: RequestSettings) -> RunRecord:
    """Send one request and time every piece of text as it arrives."""
    state = _StreamState(t0=time.perf_counter())
    with client.stream("POST", chat_url(base_url), json=request_body(prompt, settings)) as response:
        if response.status_code != 200:
            raise RequestFailed(_error_message(response), response.status_code)
        for line in response.iter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue  # comments (keep-alives), event names, blank separators
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                break
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                raise RequestFailed(f"the server sent a line that is not JSON: {payload[:200]!r}") from None
            state.feed(chunk, now)
    if state.finish_reason is None:
        raise RequestFailed("the answer stream ended without a finish_reason (the server's log may say why)")
    total_ms = (time.perf_counter() - state.t0) * 1000.0
    return _record(state, total_ms)


def _error_message(response: httpx.Response) -> str:
    body = response.read().decode("utf-8", "replace")
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {response.status_code}: {err['message']}"
        if isinstance(err, str):
            return f"HTTP {response.status_code}: {err}"
    except (json.JSONDecodeError, AttributeError):
        pass
    return f"HTTP {response.status_code}: {body[:300]}"


def _record(state: _StreamState, total_ms: float) -> RunRecord:
    usage = state.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    timings = state.timings or {}
    cached = details.get("cached_tokens", timings.get("cache_n"))
    completion = usage.get("completion_tokens")
    return RunRecord(
        ttft_ms=state.arrivals_ms[0] if state.arrivals_ms else None,
        total_ms=total_ms,
        arrivals_ms=[round(t, 3) for t in state.arrivals_ms],
        text="".join(state.content),
        reasoning="".join(state.reasoning),
        finish_reason=state.finish_reason,
        prompt_tokens=usage.get("prompt_tokens", timings.get("prompt_n")),
        cached_tokens=cached,
        # Without usage, count streamed text chunks (one token each on llama.cpp and mlx_lm.server).
        completion_tokens=completion if completion is not None else state.text_chunks,
        tokens_counted="usage" if completion is not None else "chunks",
        timings=state.timings,
    )


def probe_server(client: httpx.Client, base_url: str) -> tuple[str | None, int | None]:
    """The served model's id and context length, where the server says (OpenAI /v1/models:
    vLLM's max_model_len, Spruce's context_length; llama.cpp's /props n_ctx). Raises when nothing
    answers at base_url at all."""
    root = root_url(base_url)
    models = _get_json(client, f"{root}/v1/models")
    # A server whose model list breaks (mlx_lm.server without a Hugging Face cache dir) may still serve.
    if models is None and _get_json(client, f"{root}/health") is None and not _answers(client, root):
        raise RequestFailed(f"cannot reach {base_url}: no answer at /v1/models, /health or /")
    data = (models or {}).get("data") or []
    card = data[0] if data and isinstance(data[0], dict) else {}
    context = card.get("max_model_len") or card.get("context_length")
    if context is None:
        props = _get_json(client, f"{root}/props") or {}
        context = (props.get("default_generation_settings") or {}).get("n_ctx")
    return card.get("id"), int(context) if isinstance(context, (int, float)) and context > 0 else None


def _get_json(client: httpx.Client, url: str) -> dict | None:
    """The JSON object at url, or None (unreachable, an error status, not a JSON object)."""
    try:
        r = client.get(url, timeout=30)
        out = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def _answers(client: httpx.Client, url: str) -> bool:
    try:
        client.get(url, timeout=30)
    except httpx.HTTPError:
        return False
    return True
