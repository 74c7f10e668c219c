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
from server.chat_tokens import ChatPrompt
from server.errors import APIError
from server.schemas import INT64_MAX, INT64_MIN, ChatCompletionRequest, CompletionRequest, ResponseFormat
from server.structured import GrammarVocab, json_rule, response_format_grammar, tool_grammar
from server.tools import ToolSet, tool_set

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})
# Per-request speculation limits unless the server was started with larger --spec-budget / --spec-depth:
# verify memory grows with N^2 per GDN layer and the host copy of the logits with N x vocab.
SPEC_BUDGET_LIMIT, SPEC_DEPTH_LIMIT = 32, 16
# Tokens one choice may generate when the request sets no limit (Continue sends none) and the
# operator gave no --max-tokens; a request may ask for more (up to the context).
DEFAULT_MAX_TOKENS = 4096


@dataclass(frozen=True)
class ServerOptions:
    """Server-wide settings (spruce serve flags)."""

    # --max-tokens: the limit of a request that sets none, and the most any request may ask for
    # (None: requests that set none get DEFAULT_MAX_TOKENS, others what they ask, up to the context)
    max_tokens_cap: int | None = None
    served_model_name: str | None = None  # the id /v1/models shows (None: the checkpoint's name)
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 16 << 20
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides localhost and IP addresses
    check_host: bool = True  # False: any Host (--allow-any-host)
    show_model_path: bool = False  # /props shows the model's directory path (else only its name)
    read_timeout_s: float = 15.0  # a request body must arrive within this


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
    reasoning_first: bool = False  # the answer starts inside a think block (stop strings wait for its end)


@dataclass
class ChatPlan:
    planned: Planned
    starts_in_think: bool  # the prompt ends inside an open <think> block
    tools: ToolSet | None
    response_format: ResponseFormat | None
    legacy_functions: bool = False  # the request sent `functions`: answer with `function_call`


class Planner:
    def __init__(self, engine, options: ServerOptions) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.options = options
        self.template = ChatTemplate.of(self.tokenizer)
        self.grammar_vocab = GrammarVocab.of(self.tokenizer, self.tokenizer.chat_template)
        # generation_config.json's sampling defaults (engine/sampling_defaults.py)
        self.defaults = getattr(engine, "sampling_defaults", None)

    @property
    def default_max_tokens(self) -> int:
        """The limit of a request that sets none (/props reports it as n_predict)."""
        return self.options.max_tokens_cap if self.options.max_tokens_cap is not None else DEFAULT_MAX_TOKENS

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
        prompt = self.render(body.messages, options)
        text = prompt.text
        in_think = prompt_in_think(text)
        toolset = tool_set(body)
        grammar = self.chat_grammar(body, toolset, in_think)
        self.check_text_fits(text, "messages")
        ids = self.template.guard.encode(self.tokenizer, prompt)
        planned = self.plan([ids], body, body.requested_max_tokens, "messages", body.engine_logprobs,
                            grammar=grammar)
        planned.reasoning_first = in_think
        return ChatPlan(planned, in_think, toolset, body.response_format, body.legacy_functions)

    def chat_grammar(self, body: ChatCompletionRequest, toolset: ToolSet | None, in_think: bool) -> str | None:
        """The grammar that enforces tool calls and response_format while decoding (None: free text)."""
        fmt = body.response_format
        if toolset is not None and body.tools:
            answer = None
            if fmt is not None and fmt.type != "text":
                answer = json_rule(fmt.output_schema if fmt.output_schema is not None else {"type": "object"},
                                   "response_format", lenient=not (fmt.json_schema and fmt.json_schema.strict))
            return tool_grammar(body.tools, body.tool_choice, toolset.parallel, self.grammar_vocab, in_think, answer)
        if fmt is not None:
            return response_format_grammar(fmt, self.grammar_vocab, in_think)
        return None

    def render(self, messages, options: ChatRenderOptions) -> ChatPrompt:
        try:
            return self.template.render_prompt([m.template_dict() for m in messages], options)
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from None

    def encode_chat(self, prompt: ChatPrompt) -> list[int]:
        """Token ids of a rendered chat prompt; special tokens typed by the client stay text."""
        return self.template.guard.encode(self.tokenizer, prompt)

    # ---- legacy completions ----

    def completion(self, body: CompletionRequest) -> Planned:
        prompts = body.prompts()
        if body.suffix is not None and body.echo:
            raise APIError("echo cannot be combined with suffix (fill-in-the-middle)", param="echo")
        if body.suffix is not None:
            ids = [self.fim_ids(p, body.suffix) for p in prompts]
        else:
            ids = [self.text_ids(p, "prompt") if isinstance(p, str) else self.checked_ids(p, "prompt") for p in prompts]
        planned = self.plan(ids, body, body.requested_max_tokens, "prompt", body.logprobs)
        if body.echo:
            texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in body.prompts()]
            planned.echo = [t for t in texts for _ in range(body.choices)]
        return planned

    def fim_ids(self, prompt: str | list[int], suffix: str) -> list[int]:
        """Fill in the middle: the model writes what goes between `prompt` and `suffix`. Both are code
        the user is editing: FIM tokens spelled out in them stay text."""
        if not isinstance(prompt, str):
            raise APIError("suffix needs a text prompt, not token ids", param="prompt")
        self.require_fim("suffix")
        self.check_text_fits(prompt + suffix, "prompt")
        tok = self.tokenizer
        before, after = tok.encode_many([prompt, suffix], special=False)
        return [tok.token_id(FIM_PREFIX), *before, tok.token_id(FIM_SUFFIX), *after, tok.token_id(FIM_MIDDLE)]

    def text_ids(self, text: str, param: str, special: bool = True) -> list[int]:
        """Token ids of a text prompt, refused before tokenizing when it cannot fit the context."""
        self.check_text_fits(text, param)
        return self.tokenizer.encode(text, special)

    def check_text_fits(self, text: str, param: str) -> None:
        """400 for text too long to fit the context whatever its tokens: tokenizing megabytes costs
        seconds and memory for an answer that is known already."""
        context = self.engine.config.max_context
        limit = self.tokenizer.max_text_bytes(context - 1)
        if len(text) <= limit:  # every character is at least one byte
            return
        size = len(text.encode("utf-8"))
        if size > limit:
            raise APIError(
                f"This model's maximum context length is {context} tokens. However, your prompt has {size} bytes "
                f"of text, more than {context} tokens of this model can hold ({limit} bytes at most); shorten it "
                "or start the server with a larger --max-context.", param=param, code="context_length_exceeded")

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
             logprobs: int | None = None, choices: int | None = None, grammar: str | None = None) -> Planned:
        """One GenerationRequest per (prompt, choice); `body` has the sampling fields (duck-typed)."""
        n = choices or body.choices
        spec = self.spec(body)
        requests = []
        for ids in prompts:
            limit = self.token_limit(ids, max_tokens, param)
            for i in range(n):
                sampling = self.sampling(body, limit, i, logprobs, grammar)
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
        asked = max_tokens if max_tokens is not None else self.default_max_tokens
        limits = [room, asked] + ([self.options.max_tokens_cap] if self.options.max_tokens_cap is not None else [])
        return min(limits)

    def sampling(self, body, max_tokens: int, choice: int, logprobs: int | None,
                 grammar: str | None = None) -> SamplingParams:
        """The request's sampling fields; those it leaves unset come from the checkpoint's
        generation_config.json, then from the API's defaults (vLLM's order)."""
        d = self.defaults

        def pick(name: str, api_default):
            value = getattr(body, name, None)
            if value is None and d is not None:
                value = getattr(d, name)
            return api_default if value is None else value

        temperature, top_p = pick("temperature", body.default_temperature), pick("top_p", 1.0)
        if top_p == 0.0:  # vLLM: top_p 0 keeps only the best token
            temperature, top_p = 0.0, 1.0
        return SamplingParams(
            temperature=temperature, top_p=top_p, top_k=max(0, pick("top_k", 0)), min_p=pick("min_p", 0.0),
            seed=choice_seed(body.seed, choice),
            max_tokens=max_tokens, stop_token_ids=() if body.ignore_eos else self.tokenizer.eos_token_ids,
            ignore_eos=bool(body.ignore_eos), presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, logprobs=logprobs,
            logit_bias=self._logit_bias(body), repetition_penalty=pick("repetition_penalty", 1.0), grammar=grammar,
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
        budget = self._spec_limit(body.spec.budget, default.budget, SPEC_BUDGET_LIMIT, "budget", "--spec-budget")
        depth = self._spec_limit(body.spec.max_depth, default.max_depth, SPEC_DEPTH_LIMIT, "max_depth",
                                 "--spec-depth")
        if body.spec.max_depth is None and body.spec.method != default.method:
            depth = 0  # another method without a depth: that method's default (SpecConfig.max_depth)
        return replace(default, method=body.spec.method, budget=budget, max_depth=depth,
                       tree=body.spec.tree or default.tree)

    @staticmethod
    def _spec_limit(asked: int | None, default: int, floor: int, name: str, flag: str) -> int:
        """A request may ask up to max(floor, the server's own setting)."""
        if asked is None:
            return default
        limit = max(floor, default)
        if asked > limit:
            raise APIError(f"spec.{name} {asked} is more than this server allows ({limit}; the operator can raise "
                           f"it with spruce serve {flag})", param=f"spec.{name}")
        return asked

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
