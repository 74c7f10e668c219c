"""FastAPI app: routes (OpenAI ones with and without /v1, llama.cpp's native ones), errors, auth, CORS.

Every bad input is checked before a request is queued, so it leaves as a plain HTTP 400 with the
OpenAI error body; once an SSE stream has started, a failure is sent as an error event + [DONE].
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from engine.types import GenerationRequest
from server import native_routes as native
from server import openai_routes as oai
from server.auth import APIKeyMiddleware
from server.bridge import EngineBridge, EngineFailure, Job, QueueFullError
from server.errors import APIError, parse_request, validation_error
from server.logprobs import TokenTexts
from server.native_schemas import DetokenizeRequest, InfillRequest, NativeCompletionRequest, TokenizeRequest
from server.planning import Planner, ServerOptions
from server.schemas import ChatCompletionRequest, CompletionRequest
from server.streaming import ChunkContext

log = logging.getLogger("spruce.server")
DISCONNECT_POLL_S = 0.25
SSE_PING_S = 15


class Server:
    """Route handlers around one EngineBridge (already started).

    Planning (chat template, tokenization) runs in a worker thread: a prompt of megabytes takes
    a second to tokenize, and the event loop keeps streaming other answers meanwhile.
    """

    def __init__(self, bridge: EngineBridge, options: ServerOptions):
        self.bridge = bridge
        self.engine = bridge.engine
        self.tokenizer = self.engine.tokenizer
        self.options = options
        self.planner = Planner(self.engine, options)
        self.texts = TokenTexts(self.tokenizer)
        self.created = int(time.time())
        # One planning thread: enough for one generation slot, and every extra thread that
        # allocates costs the process a malloc arena.
        self._planning = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spruce-plan")

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._planning, fn, *args)

    async def body(self, request: Request, model):
        """The request body, size-capped (413), parsed and validated (400)."""
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return parse_request(b"".join(chunks), model)

    def submit(self, requests: list[GenerationRequest]) -> Job:
        if not self.bridge.alive:
            raise APIError("the engine is not running", status=503)
        try:
            return self.bridge.submit(requests)
        except QueueFullError as e:
            raise APIError(f"server busy: {e}; retry later", status=429, code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None

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
        return {"id": self.engine.model_id, "object": "model", "created": self.created, "owned_by": "spruce",
                "max_model_len": context, "context_length": context}

    def props(self) -> dict:
        """llama.cpp's /props, the part editors read (llama.vscode takes n_ctx from it)."""
        return {"default_generation_settings": {"n_ctx": self.engine.config.max_context,
                                                "params": {"n_predict": self.options.max_tokens_cap or -1}},
                "total_slots": 1, "model_path": self.engine.config.model_path,
                "chat_template": self.tokenizer.chat_template or "", "modalities": {"vision": False},
                "memory": self.engine.memory().as_dict()}  # Spruce: weights' and caches' bytes


def _too_large(limit: int) -> APIError:
    return APIError(f"request body is larger than {limit} bytes", status=413, code="request_too_large")


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Non-streamed requests get no disconnect signal from Starlette: poll for it."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancel()


def _sse(job: Job, events: AsyncIterator[str]) -> EventSourceResponse:
    """SSE with LF line separators as OpenAI sends (not CRLF), and a neutral keep-alive comment
    (Continue treats ": ping" specially).

    The generator's own `finally` cancels the job, but it never runs if the client leaves before the
    first event is pulled: the close handler covers that case.
    """

    async def on_client_close(_message) -> None:
        job.cancel()

    return EventSourceResponse(events, sep="\n", ping=SSE_PING_S, client_close_handler_callable=on_client_close,
                               ping_message_factory=lambda: ServerSentEvent(comment="keep-alive"))


def add_openai_routes(app: FastAPI, server: Server) -> None:
    model = server.engine.model_id

    async def chat_completions(request: Request):
        body = await server.body(request, ChatCompletionRequest)
        plan = await server.off_loop(server.planner.chat, body)
        job = server.submit(plan.planned.requests)
        if body.stream:
            ctx = ChunkContext.new("chat.completion.chunk", model, "chatcmpl")
            return _sse(job, oai.chat_events(job, plan, ctx, server.tokenizer, server.texts))
        ctx = ChunkContext.new("chat.completion", model, "chatcmpl")
        return await server.collect(job, request, oai.chat_answer(job, plan, ctx, server.tokenizer, server.texts))

    async def completions(request: Request):
        body = await server.body(request, CompletionRequest)
        planned = await server.off_loop(server.planner.completion, body)
        job = server.submit(planned.requests)
        ctx = ChunkContext.new("text_completion", model, "cmpl")
        if body.stream:
            return _sse(job, oai.completion_events(job, planned, ctx, server.tokenizer, server.texts))
        return await server.collect(job, request,
                                    oai.completion_answer(job, planned, ctx, server.tokenizer, server.texts))

    async def models():
        return {"object": "list", "data": [server.model_card()]}

    async def one_model(model_id: str):
        if model_id != model:
            raise APIError(f"The model `{model_id}` does not exist.", status=404, param="model",
                           code="model_not_found")
        return server.model_card()

    async def health():
        if not server.bridge.alive:
            raise APIError("the engine is not running", status=503)
        return {"status": "ok", "queued": server.bridge.queued}

    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/models", models, methods=["GET"])
        app.add_api_route(f"{prefix}/models/{{model_id:path}}", one_model, methods=["GET"])
        app.add_api_route(f"{prefix}/health", health, methods=["GET"])


def add_native_routes(app: FastAPI, server: Server) -> None:
    model = server.engine.model_id

    async def run(request: Request, plan: native.NativePlan, stream: bool | None):
        job = server.submit(plan.planned.requests)
        if stream:
            return _sse(job, native.native_events(job, plan, model, server.tokenizer))
        return await server.collect(job, request, native.native_answer(job, plan, model, server.tokenizer))

    async def infill(request: Request):
        body = await server.body(request, InfillRequest)
        return await run(request, await server.off_loop(native.plan_infill, server.planner, body), body.stream)

    async def completion(request: Request):
        body = await server.body(request, NativeCompletionRequest)
        plan = await server.off_loop(native.plan_native_completion, server.planner, body)
        return await run(request, plan, body.stream)

    async def tokenize(request: Request):
        body = await server.body(request, TokenizeRequest)
        return await server.off_loop(native.tokenize, server.planner, server.texts, body)

    async def detokenize(request: Request):
        return native.detokenize(server.planner, await server.body(request, DetokenizeRequest))

    async def props():
        return server.props()

    app.add_api_route("/infill", infill, methods=["POST"])
    app.add_api_route("/completion", completion, methods=["POST"])
    app.add_api_route("/props", props, methods=["GET"])
    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"])
        app.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"])


def create_app(bridge: EngineBridge, options: ServerOptions | None = None) -> FastAPI:
    """The app over a started bridge."""
    options = options or ServerOptions()
    server = Server(bridge, options)
    app = FastAPI(title="Spruce", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    _add_error_handlers(app)
    add_openai_routes(app, server)
    add_native_routes(app, server)
    if options.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=options.api_key)
    if options.cors_origins:  # added last = outermost: preflights are answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(options.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], max_age=600)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    def respond(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        return respond(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return respond(APIError(message, status=exc.status_code))

    @app.exception_handler(Exception)
    async def crashed(_: Request, exc: Exception):
        log.exception("unhandled error")
        return respond(APIError(f"internal error: {type(exc).__name__}: {exc}", status=500))
