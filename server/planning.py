"""Validated requests -> prompt token ids and engine GenerationRequests (one per choice).

Everything that can be wrong with a request is found here, before it is queued, so it leaves as
a plain HTTP 400 even when the client asked for a stream.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field, replace

from engine.config import SamplingParams, SpecConfig
from engine.types import GenerationRequest
from server.chat import ChatRenderOptions, ChatTemplate, ChatTemplateError
from server.errors import APIError
from server.json_format import check_schema
from server.schemas import INT64_MAX, INT64_MIN, ChatCompletionRequest, CompletionRequest, ResponseFormat
from server.tools import ToolSet, tool_set

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


@dataclass(frozen=True)
class ServerOptions:
    """Server-wide settings (spruce serve flags)."""

    max_tokens_cap: int | None = None  # most tokens one choice may generate (None: the context decides)
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 16 << 20


@dataclass
class Planned:
    """A validated request, ready for the engine: requests[i] is choice i."""

    requests: list[GenerationRequest]
    stops: list[str]
    prompt_tokens: int  # each distinct prompt counted once (n > 1 shares its prompt)
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token; None = no logprobs
    choices_per_prompt: int = 1  # n
    echo: list[str] = field(default_factory=list)  # per choice: prompt text to put before the answer


@dataclass
class ChatPlan:
    planned: Planned
    starts_in_think: bool  # the prompt ends inside an open <think> block
    tools: ToolSet | None
    response_format: ResponseFormat | None


class Planner:
    def __init__(self, engine, options: ServerOptions) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.options = options
        tok = self.tokenizer
        self.template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)

    # ---- chat ----

    def chat(self, body: ChatCompletionRequest) -> ChatPlan:
        kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items() if k != "enable_thinking"}
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
        if reserved:
            raise APIError(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
        thinking = body.thinking()
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        if body.tool_choice == "none":
            tools = None  # the model is not told about tools it may not call
        options = ChatRenderOptions(tools=tools, enable_thinking=thinking, extra=kwargs)
        try:
            prompt = self.template.render([m.template_dict() for m in body.messages], options)
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from None
        in_think = prompt_in_think(prompt)
        toolset = tool_set(body, in_think)
        if body.response_format is not None and body.response_format.output_schema is not None:
            check_schema(body.response_format.output_schema, "response_format.schema")
        prompt += toolset.forced_prefix if toolset else ""
        ids = self.tokenizer.encode(prompt)
        planned = self.plan([ids], body, body.requested_max_tokens, "messages", body.engine_logprobs)
        return ChatPlan(planned, in_think, toolset, body.response_format)

    # ---- legacy completions ----

    def completion(self, body: CompletionRequest) -> Planned:
        prompts = body.prompts()
        if body.suffix is not None and body.echo:
            raise APIError("echo cannot be combined with suffix (fill-in-the-middle)", param="echo")
        if body.suffix is not None:
            prompts = [self.fim_prompt(p, body.suffix) for p in prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else self.checked_ids(p, "prompt") for p in prompts]
        planned = self.plan(ids, body, body.requested_max_tokens, "prompt", body.logprobs)
        if body.echo:
            texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in body.prompts()]
            planned.echo = [t for t in texts for _ in range(body.choices)]
        return planned

    def fim_prompt(self, prompt: str | list[int], suffix: str) -> str:
        """Fill in the middle: the model writes what goes between `prompt` and `suffix`."""
        if not isinstance(prompt, str):
            raise APIError("suffix needs a text prompt, not token ids", param="prompt")
        self.require_fim("suffix")
        return f"{FIM_PREFIX}{prompt}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"

    def require_fim(self, param: str) -> None:
        missing = [t for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE) if self.tokenizer.token_id(t) is None]
        if missing:
            raise APIError(f"this model's tokenizer has no fill-in-the-middle tokens ({', '.join(missing)}), "
                           "so suffix / infill cannot be used", param=param)

    def checked_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.engine.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise APIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)
        return ids

    # ---- shared ----

    def plan(self, prompts: list[list[int]], body, max_tokens: int | None, param: str,
             logprobs: int | None = None, choices: int | None = None) -> Planned:
        """One GenerationRequest per (prompt, choice); `body` has the sampling fields (duck-typed)."""
        n = choices or body.choices
        spec = self.spec(body)
        requests = []
        for ids in prompts:
            limit = self.token_limit(ids, max_tokens, param)
            for i in range(n):
                sampling = self.sampling(body, limit, i, logprobs)
                requests.append(GenerationRequest(prompt_ids=ids, sampling=sampling, spec=spec,
                                                  request_id=uuid.uuid4().hex))
        return Planned(requests, body.stop_strings, sum(len(p) for p in prompts), body.include_usage, logprobs, n)

    def token_limit(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        context = self.engine.config.max_context
        room = context - len(ids)
        if room <= 0:
            raise APIError(
                f"This model's maximum context length is {context} tokens. However, your prompt is {len(ids)} "
                "tokens long; shorten it or start the server with a larger --max-context.",
                param=param, code="context_length_exceeded")
        limits = [room] + [x for x in (max_tokens, self.options.max_tokens_cap) if x is not None]
        return min(limits)

    def sampling(self, body, max_tokens: int, choice: int, logprobs: int | None) -> SamplingParams:
        temperature = body.default_temperature if body.temperature is None else body.temperature
        return SamplingParams(
            temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0), min_p=body.min_p or 0.0, seed=choice_seed(body.seed, choice),
            max_tokens=max_tokens, stop_token_ids=() if body.ignore_eos else self.tokenizer.eos_token_ids,
            ignore_eos=bool(body.ignore_eos), presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, logprobs=logprobs,
            logit_bias=self._logit_bias(body),
        )

    def _logit_bias(self, body) -> tuple[tuple[int, float], ...]:
        pairs = getattr(body, "logit_bias_pairs", ())  # the llama.cpp-style routes take no bias
        vocab = self.engine.vocab_size
        bad = [t for t, _ in pairs if t >= vocab]
        if bad:
            raise APIError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})", param="logit_bias")
        return pairs

    def spec(self, body) -> SpecConfig | None:
        if body.spec is None:
            return None
        default = self.engine.config.spec
        if body.spec.method in ("draft", "draft-tree") and not self._draft_available():
            raise APIError("spec method 'draft' needs a server started with --draft-model", param="spec.method")
        missing = self.engine.missing_drafter(body.spec.method, body.spec.tree or default.tree)
        if missing:
            raise APIError(missing, param="spec")
        return replace(default, method=body.spec.method, budget=body.spec.budget or default.budget,
                       max_depth=body.spec.max_depth or default.max_depth, tree=body.spec.tree or default.tree)

    def _draft_available(self) -> bool:
        """Checked here, not on the engine thread, so that a streamed request gets a plain 400."""
        from engine.generate import default_draft_for

        return bool(self.engine.config.spec.draft_model or default_draft_for(self.engine.config.model_path))


def choice_seed(seed: int | None, choice: int) -> int:
    """Choice i of a seeded request uses seed + i (wrapped into int64); unseeded ones a fresh seed,
    since sampling is keyed on (seed, position)."""
    if seed is None:
        return random.getrandbits(63)
    return (seed + choice - INT64_MIN) % 2**64 + INT64_MIN if seed + choice > INT64_MAX else seed + choice


def prompt_in_think(prompt: str) -> bool:
    """Does the rendered prompt end inside an open <think> block (in its last turn)?"""
    turn = prompt[prompt.rfind("<|im_start|>"):] if "<|im_start|>" in prompt else prompt
    return turn.rfind("<think>") > turn.rfind("</think>")
