"""FastAPI app: routes (OpenAI ones with and without /v1, llama.cpp's native ones), errors, and the
middlewares: Host check, CORS, API key, JSON Content-Type.

Every bad input is checked before a request is queued, so it leaves as a plain HTTP 400 with the
OpenAI error body; once an SSE stream has started, a failure is sent as an error event + [DONE].
A server fault is a 500 whose body says where to look (the server log), not what broke.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import native_routes as native
from server import openai_routes as oai
from server.auth import APIKeyMiddleware
from server.bridge import EngineBridge
from server.embeddings import EmbeddingsRequest, embeddings_answer, plan_embeddings
from server.errors import APIError, validation_error
from server.http_guards import HostGuard, JSONContentTypeGuard, JSONCORSMiddleware
from server.native_schemas import DetokenizeRequest, InfillRequest, NativeCompletionRequest, TokenizeRequest
from server.planning import ServerOptions
from server.responses import ResponsesRequest, chat_request, new_response_id, now, response_base
from server.responses_output import ResponseRun, response_answer, response_stream
from server.schemas import ChatCompletionRequest, CompletionRequest
from server.service import MemoryRelease, Server, json_response, sse
from server.streaming import ChunkContext

log = logging.getLogger("spruce.server")


# /v1/models/{id} answers to the served name and to this alias (the README's examples use it)
MODEL_ALIAS = "spruce"


def add_openai_routes(app: FastAPI, server: Server) -> None:
    model = server.model_name

    async def chat_completions(request: Request):
        body = await server.body(request, ChatCompletionRequest)
        plan = await server.off_loop(server.planner.chat, body)
        job = server.submit(plan.planned.requests)
        if body.stream:
            ctx = ChunkContext.new("chat.completion.chunk", model, "chatcmpl")
            return sse(job, oai.chat_events(job, plan, ctx, server.tokenizer, server.texts))
        ctx = ChunkContext.new("chat.completion", model, "chatcmpl")
        return await server.collect(job, request, oai.chat_answer(job, plan, ctx, server.tokenizer, server.texts))

    async def completions(request: Request):
        body = await server.body(request, CompletionRequest)
        planned = await server.off_loop(server.planner.completion, body)
        job = server.submit(planned.requests)
        ctx = ChunkContext.new("text_completion", model, "cmpl")
        if body.stream:
            return sse(job, oai.completion_events(job, planned, ctx, server.tokenizer, server.texts))
        return await server.collect(job, request,
                                    oai.completion_answer(job, planned, ctx, server.tokenizer, server.texts))

    async def embeddings(request: Request):
        body = await server.body(request, EmbeddingsRequest)
        requests = await server.off_loop(plan_embeddings, server.planner, body)
        job = server.submit(requests)
        return await server.collect(job, request, embeddings_answer(job, model, body.encoding_format))

    async def responses(request: Request):
        body = await server.body(request, ResponsesRequest)
        history = server.responses.get(body.previous_response_id) if body.previous_response_id else []
        chat, messages = await server.off_loop(chat_request, body, history)
        plan = await server.off_loop(server.planner.chat, chat)
        job = server.submit(plan.planned.requests)
        base = response_base(body, new_response_id(), model, now())
        run = ResponseRun(job, plan, base, messages, server.responses if body.store is not False else None,
                          server.texts, server.tokenizer, server.engine.prefix.enabled)
        if body.stream:
            return sse(job, response_stream(run))
        return await server.collect(job, request, response_answer(run))

    async def models():
        return {"object": "list", "data": [server.model_card()]}

    async def one_model(model_id: str):
        if model_id not in (model, MODEL_ALIAS):
            raise APIError(f"The model `{model_id}` does not exist.", status=404, param="model",
                           code="model_not_found")
        return server.model_card()

    async def health():
        status = server.bridge.status
        if status == "stopped":
            raise APIError("the engine is not running (it stopped after an internal error; see the server log)",
                           status=503, code="engine_stopped")
        if status == "shutting_down":
            raise APIError("the server is shutting down", status=503, code="server_shutting_down")
        return {"status": status, "queued": server.bridge.queued}

    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/embeddings", embeddings, methods=["POST"])
        app.add_api_route(f"{prefix}/responses", responses, methods=["POST"])
        app.add_api_route(f"{prefix}/models", models, methods=["GET", "HEAD"])
        app.add_api_route(f"{prefix}/models/{{model_id:path}}", one_model, methods=["GET", "HEAD"])
        app.add_api_route(f"{prefix}/health", health, methods=["GET", "HEAD"])


def add_native_routes(app: FastAPI, server: Server) -> None:
    model = server.model_name

    async def run(request: Request, plan: native.NativePlan, stream: bool | None):
        job = server.submit(plan.planned.requests)
        if stream:
            return sse(job, native.native_events(job, plan, model, server.tokenizer))
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
        return await server.off_loop(lambda: json_response(native.tokenize(server.planner, server.texts, body)))

    async def detokenize(request: Request):
        body = await server.body(request, DetokenizeRequest)
        return await server.off_loop(lambda: json_response(native.detokenize(server.planner, body)))

    async def props():
        return server.props()

    app.add_api_route("/infill", infill, methods=["POST"])
    app.add_api_route("/completion", completion, methods=["POST"])
    app.add_api_route("/props", props, methods=["GET", "HEAD"])
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
    # Added first = innermost. From the outside: Host check, CORS (preflights are answered before
    # the key check), API key, JSON Content-Type, memory release after large bodies.
    app.add_middleware(MemoryRelease, server=server)
    app.add_middleware(JSONContentTypeGuard)
    if options.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=options.api_key)
    if options.cors_origins:
        app.add_middleware(JSONCORSMiddleware, allow_origins=list(options.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], max_age=600)
    if options.check_host:
        app.add_middleware(HostGuard, allowed=options.allowed_hosts)
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
    async def crashed(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(APIError("internal server error; see the server log", status=500))
