"""What every route shares: reading and validating bodies, queueing jobs, waiting for answers.

The event loop must stay free while a big request is handled (/health, and other clients'
streams, run on it). So everything that costs time in proportion to a body runs on the planning
thread: JSON parsing and validation, the chat template, tokenization (whose `tokenizers` calls
release the GIL), and building large JSON answers. Parsing and validation are single C calls that
hold the GIL, so a body may hold only so many JSON items (about 1 us each to parse and validate as
chat messages); text inside strings is cheap.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse, ServerSentEvent

if TYPE_CHECKING:
    from engine.generate import Engine

from engine.types import GenerationRequest
from server import openai_routes as oai
from server.bridge import EngineBridge, EngineFailure, Job, QueueFullError, Unavailable
from server.errors import APIError, parse_request
from server.logprobs import TokenTexts
from server.memory import release_memory
from server.planning import Planner, ServerOptions
from server.responses import ResponseStore

DISCONNECT_POLL_S = 0.25
SSE_PING_S = 15
LARGE_BODY_BYTES = 1 << 20  # after a body this large, unused heap goes back to the OS
# Commas + colons a body may hold, plus 4 per context token (token-id prompts, long chats): about
# 30 ms of parsing and validation at most for a context of 4096, and more than fits in it anyway.
JSON_ITEMS_BASE = 16384
JSON_CHUNK = 32768  # list items serialized per call when building a large answer


class Server:
    """Route handlers' shared state around one EngineBridge (already started)."""

    def __init__(self, bridge: EngineBridge, options: ServerOptions):
        self.bridge = bridge
        if bridge.engine is None:
            raise RuntimeError("the bridge's engine is not loaded: start the bridge first")
        self.engine: Engine = bridge.engine
        self.tokenizer = self.engine.tokenizer
        self.options = options
        self.planner = Planner(self.engine, options)
        self.texts = TokenTexts(self.tokenizer)
        self.created = int(time.time())
        self.responses = ResponseStore()  # /v1/responses kept for previous_response_id
        # the id clients see; requests may name any model (one is served), as llama.cpp allows
        self.model_name = options.served_model_name or self.engine.model_id
        self.max_json_items = JSON_ITEMS_BASE + 4 * self.engine.config.max_context
        # One planning thread: enough for one generation slot, and every extra thread that
        # allocates costs the process a malloc arena.
        self._planning = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spruce-plan")

    async def off_loop(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._planning, fn, *args)

    async def body(self, request: Request, model):
        """The request body: size-capped (413), read within the read timeout (408), then parsed and
        validated (400) on the planning thread."""
        try:
            raw = await asyncio.wait_for(self._read(request), self.options.read_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(f"the request body did not arrive within {self.options.read_timeout_s:g} s", status=408,
                           code="request_timeout", headers={"Connection": "close"}) from None
        return await self.off_loop(self._parse, raw, model)

    async def _read(self, request: Request) -> bytes:
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(f"request body is larger than {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(f"request body is larger than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _parse(self, raw: bytes, model):
        items = raw.count(b",") + raw.count(b":")
        if items > self.max_json_items:
            raise _too_large(f"request body holds too many JSON items: {items} commas and colons (those inside "
                             f"strings count too), at most {self.max_json_items}")
        return parse_request(raw, model)


    def submit(self, requests: list[GenerationRequest]) -> Job:
        try:
            return self.bridge.submit(requests)
        except QueueFullError as e:
            raise APIError(f"server busy: {e}; retry later", status=429, code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except Unavailable as e:
            raise APIError(str(e), status=503, code="unavailable") from None

    async def collect(self, job: Job, request: Request, answer: Awaitable):
        """Await a non-streamed answer, cancelling the job if the client goes away first."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            return await answer
        except EngineFailure as e:
            raise oai.engine_error(e) from None
        finally:
            watcher.cancel()
            job.cancel()

    def model_card(self) -> dict:
        context = self.engine.config.max_context
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "spruce",
                "max_model_len": context, "context_length": context}

    def props(self) -> dict:
        """llama.cpp's /props, the part editors read (llama.vscode takes n_ctx from it). The model's
        directory path only when the operator asked for it (--show-model-path)."""
        path = self.engine.config.model_path if self.options.show_model_path else self.model_name
        params = {"n_predict": self.planner.default_max_tokens,  # what a request that sets no limit gets
                  **self.engine.sampling_defaults.as_dict()}  # generation_config.json's defaults
        return {"default_generation_settings": {"n_ctx": self.engine.config.max_context, "params": params},
                "total_slots": 1, "model_path": path,
                "chat_template": self.tokenizer.chat_template or "", "modalities": {"vision": False},
                "memory": self.engine.memory().as_dict()}  # Spruce: weights' and caches' bytes


class MemoryRelease:
    """ASGI middleware: once a request with a large body is answered, free heap goes back to the OS."""

    def __init__(self, app, server: Server) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http" and _declared_length(scope) >= LARGE_BODY_BYTES:
                await self.server.off_loop(release_memory)


def _declared_length(scope) -> int:
    value = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
    return int(value) if value.isdigit() else 0


def _too_large(message: str) -> APIError:
    return APIError(message, status=413, code="request_too_large")


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Non-streamed requests get no disconnect signal from Starlette: poll for it."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancel()


def sse(job: Job, events: AsyncIterator) -> EventSourceResponse:
    """SSE with LF line separators as OpenAI sends (not CRLF), and a neutral keep-alive comment
    (Continue treats ": ping" specially).

    The generator's own `finally` cancels the job, but it never runs if the client leaves before the
    first event is pulled: the close handler covers that case.
    """

    async def on_client_close(_message) -> None:
        job.cancel()

    return EventSourceResponse(events, sep="\n", ping=SSE_PING_S, client_close_handler_callable=on_client_close,
                               ping_message_factory=lambda: ServerSentEvent(comment="keep-alive"))


def json_response(payload: Any) -> Response:
    """A JSON answer serialized here (call it on the planning thread): long lists go in chunks, so
    the GIL is let go between them."""
    return Response(content=json_text(payload).encode("utf-8"), media_type="application/json")


def json_text(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list) and len(value) > JSON_CHUNK:
        parts = (json.dumps(value[i : i + JSON_CHUNK], ensure_ascii=False)[1:-1]
                 for i in range(0, len(value), JSON_CHUNK))
        return "[" + ",".join(parts) + "]"
    return json.dumps(value, ensure_ascii=False)
