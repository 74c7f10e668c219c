"""FastAPI app: OpenAI routes (with and without /v1), validation -> GenerationRequest, responses.

Every bad input is checked before a request is queued, so it leaves as a plain HTTP 400 with the
OpenAI error body; once an SSE stream has started, a failure is sent as an error event + [DONE].
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import SamplingParams, SpecConfig
from engine.types import GenerationRequest
from server.bridge import EngineBridge, EngineFailure, Job, QueueFullError
from server.chat import ChatRenderOptions, ChatTemplate, ChatTemplateError
from server.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
    error_body,
    parse_request,
    timings_block,
    usage_block,
    validation_error,
)
from server.streaming import (
    SSE_DONE,
    ChunkContext,
    TextAssembler,
    chat_chunk,
    completion_chunk,
    sse_data,
    usage_chunk,
)

log = logging.getLogger("spruce.server")
DISCONNECT_POLL_S = 0.25
SSE_PING_S = 15


@dataclass
class Planned:
    """A validated request, ready for the engine."""

    request: GenerationRequest
    stops: list[str]
    include_usage: bool


@dataclass
class Outcome:
    text: str
    finish_reason: str
    usage: dict
    timings: dict


class Server:
    """Route handlers around one EngineBridge (already started)."""

    def __init__(self, bridge: EngineBridge):
        self.bridge = bridge
        self.engine = bridge.engine
        tok = self.engine.tokenizer
        self.tokenizer = tok
        self.template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
        self.created = int(time.time())

    # ---- planning: request -> prompt ids + engine records ----

    def plan_chat(self, body: ChatCompletionRequest) -> Planned:
        kwargs = dict(body.chat_template_kwargs or {})
        thinking = kwargs.pop("enable_thinking", None)
        if thinking is not None and not isinstance(thinking, bool):
            raise APIError("chat_template_kwargs.enable_thinking must be a boolean",
                           param="chat_template_kwargs.enable_thinking")
        options = ChatRenderOptions(tools=body.tools, enable_thinking=thinking, extra=kwargs)
        try:
            prompt = self.template.render([m.template_dict() for m in body.messages], options)
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from None
        return self._plan(body, self.tokenizer.encode(prompt), body.requested_max_tokens, "messages")

    def plan_completion(self, body: CompletionRequest) -> Planned:
        if body.echo:
            raise APIError("echo is not supported", param="echo")
        if body.suffix is not None:
            raise APIError("suffix (fill-in-the-middle) is not supported yet", param="suffix")
        prompt = body.single_prompt()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self._checked_ids(prompt)
        return self._plan(body, ids, body.requested_max_tokens, "prompt")

    def _checked_ids(self, ids: list[int]) -> list[int]:
        vocab = self.tokenizer.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise APIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        return ids

    def _plan(self, body: GenerationFields, prompt_ids: list[int], max_tokens: int | None, param: str) -> Planned:
        if body.n not in (None, 1):
            raise APIError(f"only n=1 is supported, got n={body.n}", param="n")
        room = self.engine.config.max_context - len(prompt_ids)
        if room <= 0:
            raise APIError(
                f"This model's maximum context length is {self.engine.config.max_context} tokens. However, your "
                f"prompt is {len(prompt_ids)} tokens long; shorten it or start the server with a larger --max-context.",
                param=param, code="context_length_exceeded")
        limit = min(room, max_tokens) if max_tokens is not None else room
        sampling = self._sampling(body, limit, () if body.ignore_eos else self.tokenizer.eos_token_ids)
        request = GenerationRequest(prompt_ids=prompt_ids, sampling=sampling, spec=self._spec(body),
                                    request_id=uuid.uuid4().hex)
        return Planned(request, body.stop_strings, body.include_usage)

    @staticmethod
    def _sampling(body: GenerationFields, max_tokens: int, stop_ids: tuple[int, ...]) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        # Sampling is keyed on (seed, position): an unseeded request gets a fresh random seed.
        seed = body.seed if body.seed is not None else random.getrandbits(63)
        return SamplingParams(
            temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0), min_p=body.min_p or 0.0, seed=seed,
            max_tokens=max_tokens, stop_token_ids=tuple(stop_ids), ignore_eos=bool(body.ignore_eos),
        )

    def _spec(self, body: GenerationFields) -> SpecConfig | None:
        if body.spec is None:
            return None
        default = self.engine.config.spec
        if body.spec.method == "draft" and not self._draft_available():
            raise APIError("spec method 'draft' needs a server started with --draft-model", param="spec.method")
        return SpecConfig(method=body.spec.method, budget=body.spec.budget or default.budget,
                          max_depth=body.spec.max_depth or default.max_depth, draft_model=default.draft_model)

    def _draft_available(self) -> bool:
        """Checked here, not on the engine thread, so that a streamed request gets a plain 400."""
        from engine.generate import default_draft_for

        return bool(self.engine.config.spec.draft_model or default_draft_for(self.engine.config.model_path))

    # ---- running ----

    def submit(self, planned: Planned) -> Job:
        if not self.bridge.alive:
            raise APIError("the engine is not running", status=503, type="unavailable_error")
        try:
            return self.bridge.submit(planned.request)
        except QueueFullError as e:
            raise APIError(f"server busy: {e}; retry later", status=429, type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None

    async def deltas(self, job: Job, planned: Planned) -> AsyncIterator:
        """TextDeltas of one job; cancels the engine request as soon as a stop string is seen."""
        assembler = TextAssembler(self.tokenizer, planned.stops, planned.request.sampling.stop_token_ids)
        while True:
            delta = assembler.feed(await job.next_step())
            if assembler.stop_hit:
                job.cancel()
            yield delta
            if delta.finish_reason is not None:
                return

    async def collect(self, job: Job, planned: Planned, request: Request) -> Outcome:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        parts = []
        try:
            async for delta in self.deltas(job, planned):
                parts.append(delta.text)
                last = delta
        except EngineFailure as e:
            raise _engine_error(e) from None
        finally:
            watcher.cancel()
            job.cancel()
        return Outcome("".join(parts), last.finish_reason, self._usage(planned, last.stats), timings_block(last.stats))

    def _usage(self, planned: Planned, stats) -> dict:
        return usage_block(len(planned.request.prompt_ids), stats)

    async def events(self, job: Job, planned: Planned, ctx: ChunkContext, chat: bool) -> AsyncIterator[str]:
        """SSE data payloads of one streamed response; cancels the job when the client goes away."""
        try:
            if chat:
                yield sse_data(chat_chunk(ctx, {"role": "assistant", "content": ""}))
            async for d in self.deltas(job, planned):
                if d.text:
                    yield sse_data(chat_chunk(ctx, {"content": d.text}) if chat else completion_chunk(ctx, d.text))
                if d.finish_reason is not None:
                    timings = timings_block(d.stats)
                    yield sse_data(chat_chunk(ctx, {}, d.finish_reason, timings) if chat
                                   else completion_chunk(ctx, "", d.finish_reason, timings))
                    if planned.include_usage:
                        yield sse_data(usage_chunk(ctx, self._usage(planned, d.stats), timings))
        except EngineFailure as e:
            err = _engine_error(e)
            yield sse_data(error_body(err.message, err.type, err.param, err.code))
        finally:
            job.cancel()
        yield SSE_DONE

    # ---- responses ----

    def chat_response(self, ctx: ChunkContext, out: Outcome) -> dict:
        body = ctx.base()
        body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": out.text},
                            "logprobs": None, "finish_reason": out.finish_reason}]
        body.update(usage=out.usage, timings=out.timings)
        return body

    def completion_response(self, ctx: ChunkContext, out: Outcome) -> dict:
        body = ctx.base()
        body["choices"] = [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}]
        body.update(usage=out.usage, timings=out.timings)
        return body

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.engine.model_id, "object": "model", "created": self.created, "owned_by": "spruce",
                "max_model_len": self.engine.config.max_context}


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Non-streamed requests get no disconnect signal from Starlette: poll for it."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancel()


def _engine_error(e: EngineFailure) -> APIError:
    if e.bad_request:
        return APIError(str(e))
    return APIError(str(e), status=500, type="server_error")


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


def create_app(bridge: EngineBridge) -> FastAPI:
    """The app over a started bridge. Routes exist both under /v1 and at the root."""
    server = Server(bridge)
    app = FastAPI(title="Spruce", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    _add_error_handlers(app)

    async def chat_completions(request: Request):
        body = parse_request(await request.body(), ChatCompletionRequest)
        planned = server.plan_chat(body)
        job = server.submit(planned)
        if body.stream:
            ctx = ChunkContext.new("chat.completion.chunk", server.engine.model_id, "chatcmpl")
            return _sse(job, server.events(job, planned, ctx, chat=True))
        ctx = ChunkContext.new("chat.completion", server.engine.model_id, "chatcmpl")
        return server.chat_response(ctx, await server.collect(job, planned, request))

    async def completions(request: Request):
        body = parse_request(await request.body(), CompletionRequest)
        planned = server.plan_completion(body)
        job = server.submit(planned)
        ctx = ChunkContext.new("text_completion", server.engine.model_id, "cmpl")
        if body.stream:
            return _sse(job, server.events(job, planned, ctx, chat=False))
        return server.completion_response(ctx, await server.collect(job, planned, request))

    async def models():
        return server.models()

    async def model(model_id: str):
        if model_id != server.engine.model_id:
            raise APIError(f"The model `{model_id}` does not exist.", status=404, param="model",
                           code="model_not_found")
        return server.model_card()

    async def health():
        if not bridge.alive:
            raise APIError("the engine is not running", status=503, type="unavailable_error")
        return {"status": "ok", "queued": bridge.queued}

    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/models", models, methods=["GET"])
        app.add_api_route(f"{prefix}/models/{{model_id:path}}", model, methods=["GET"])
        app.add_api_route(f"{prefix}/health", health, methods=["GET"])
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
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return respond(APIError(message, status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def crashed(_: Request, exc: Exception):
        log.exception("unhandled error")
        return respond(APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error"))
