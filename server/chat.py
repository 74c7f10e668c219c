"""Chat messages -> prompt text with the checkpoint's own jinja2 chat template.

The template is untrusted checkpoint data, so it runs in jinja2's immutable sandbox with the
same helpers HF transformers offers templates (tojson without HTML escaping, raise_exception,
strftime_now, loop controls). Client text goes in marked (server/chat_tokens.py), so that special
tokens spelled out in it stay text when the prompt is tokenized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from server.chat_tokens import ChatPrompt, SpecialTokenGuard

# Roles the Qwen/ChatML templates know; OpenAI's newer "developer" role means "system".
ROLE_ALIASES = {"developer": "system"}


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (missing template, template error, raise_exception)."""


@dataclass(frozen=True)
class ChatRenderOptions:
    tools: list[dict] | None = None
    enable_thinking: bool | None = None  # None: the template's default
    extra: dict = field(default_factory=dict)  # other chat_template_kwargs, passed through


class ChatTemplate:
    """One compiled chat template; render() is thread-safe (the template is immutable)."""

    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None,
                 special_tokens: tuple[str, ...] = ()) -> None:
        self._special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._template = _compile(source) if source else None
        self.guard = SpecialTokenGuard(special_tokens)

    @classmethod
    def of(cls, tokenizer) -> ChatTemplate:
        """The template of an engine.tokenizer.Tokenizer, guarding its special tokens."""
        return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token, tokenizer.special_tokens)

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: list[dict], options: ChatRenderOptions = ChatRenderOptions()) -> str:
        """The prompt text."""
        return self.render_prompt(messages, options).text

    def render_prompt(self, messages: list[dict], options: ChatRenderOptions = ChatRenderOptions()) -> ChatPrompt:
        """The prompt with client text marked, for SpecialTokenGuard.encode."""
        if self._template is None:
            raise ChatTemplateError(
                "this model has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); use /v1/completions with a raw prompt instead"
            )
        mark = self.guard.mark_all
        variables = {**{k: mark(v) for k, v in options.extra.items()}, **self._special}
        if options.enable_thinking is not None:
            variables["enable_thinking"] = options.enable_thinking
        try:
            return ChatPrompt(self._template.render(
                messages=[mark(prepare_message(m)) for m in messages],  # marked after JSON arguments are parsed
                tools=mark(options.tools) if options.tools else None,
                add_generation_prompt=True,
                **variables,
            ))
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, LookupError, AttributeError, RecursionError) as e:
            # the checkpoint's template met input it does not expect (e.g. a value of another type)
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e


def prepare_message(message: dict) -> dict:
    """OpenAI message -> what templates expect: role aliases, tool-call arguments as dicts."""
    out = dict(message)
    out["role"] = ROLE_ALIASES.get(out["role"], out["role"])
    if out.get("tool_calls"):
        out["tool_calls"] = [_prepare_tool_call(tc) for tc in out["tool_calls"]]
    return out


def _prepare_tool_call(call: dict) -> dict:
    """Clients send arguments as a JSON string; templates iterate them as a mapping."""
    call = dict(call)
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = args  # not JSON: the template prints the raw string
        function["arguments"] = parsed if isinstance(parsed, dict) else args
    call["function"] = function
    return call


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    # jinja2's own tojson HTML-escapes <, >, & and ', which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)
