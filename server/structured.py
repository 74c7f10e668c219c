"""Structured output: response_format and tool calls as llguidance grammars, enforced while decoding.

The engine masks every token the grammar forbids (engine/grammar.py), so a `json_schema` answer is
JSON matching its schema, and a tool call names a declared tool and carries arguments that match
its parameters' schema. Schemas are checked here, on the planning thread: one that llguidance
cannot compile is a 400 before anything is queued.

Grammars are Lark text (llguidance's dialect):
- A reasoning block comes first when the prompt leaves one open (thinking on): any tokens but the
  end of the text and `</think>` (matched as the single token it is in Qwen vocabularies), then
  `</think>`. The reasoning itself is not constrained, as in vLLM.
- JSON: `%json{schema}`, with whitespace between items bounded (an unbounded run of newlines is
  the classic way a constrained model loops).
- Tool calls, in the format of the model's chat template: Qwen3.5's XML
  (`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`,
  string values as raw text (their enum, const, minLength and maxLength enforced; a pattern or
  format is not), others as JSON) or the JSON body of Qwen3 / Hermes templates
  (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`). Parameters come in the
  schema's order, required ones always, optional ones optionally.
- tool_choice "auto": free text (any tokens but the `<tool_call>` token), then optionally calls;
  "required" and a named tool: calls only. parallel_tool_calls false: exactly one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from server.errors import APIError
from server.schemas import NamedToolChoice, ResponseFormat, ToolDef

# Whitespace JSON may put between tokens: pretty-printing fits, an endless run does not.
JSON_WHITESPACE = r"[\n\t ]{0,24}"


@dataclass(frozen=True)
class GrammarVocab:
    """The token ids a grammar refers to (None: not a single token in this vocabulary)."""

    eos_ids: tuple[int, ...]
    think_end: int | None  # </think>
    call_open: int | None  # <tool_call>
    call_close: int | None  # </tool_call>
    xml_calls: bool  # the chat template writes Qwen3.5's <function=...> calls (else JSON bodies)

    @classmethod
    def of(cls, tokenizer, chat_template: str | None) -> GrammarVocab:
        def single(text: str) -> int | None:
            tid = tokenizer.token_id(text)
            return tid if tid is not None and tokenizer.decode([tid], skip_special=False) == text else None

        return cls(tuple(tokenizer.eos_token_ids), single("</think>"), single("<tool_call>"),
                   single("</tool_call>"), "<function=" in (chat_template or ""))


def response_format_grammar(fmt: ResponseFormat, vocab: GrammarVocab, in_think: bool) -> str | None:
    """The grammar of a response_format (None for "text")."""
    if fmt.type == "text":
        return None
    schema = fmt.output_schema
    strict = fmt.json_schema.strict if fmt.json_schema is not None else None
    if schema is None:
        schema = {"type": "object"}
    body = json_rule(schema, "response_format.json_schema.schema" if fmt.type == "json_schema"
                     else "response_format.schema", lenient=strict is not True)
    return _checked(_lark(vocab, in_think, f"body: {body}"), "response_format")


def tool_grammar(tools: list[ToolDef], choice: Any, parallel: bool, vocab: GrammarVocab,
                 in_think: bool, answer: str | None = None) -> str:
    """The grammar of an answer that may (auto) or must (required, named) call the given tools;
    `answer` (a json_rule) is what an answer without calls must be (response_format), else free text."""
    if isinstance(choice, NamedToolChoice):
        names = [choice.function.name]
    else:
        names = [t.function.name for t in tools]
    by_name = {t.function.name: t for t in tools}
    rules = []
    calls = []
    for i, tool in enumerate(tools):  # every schema is checked, called or not
        json_rule(tool.function.parameters or {"type": "object"}, f"tools[{i}].function.parameters")
    for i, name in enumerate(names):
        params = by_name[name].function.parameters or {}
        param = f"tools[{i}].function.parameters"
        rules += (_xml_function(f"fn{i}", name, params, param) if vocab.xml_calls
                  else [f"fn{i}: {_json_call(name, params, param)}"])
        calls.append(f"fn{i}")
    opening = _alt('"<tool_call>"', vocab.call_open)
    closing = _alt('"</tool_call>"', vocab.call_close)
    if vocab.xml_calls:
        rules.append(f'call: {opening} "\\n<function=" ({" | ".join(calls)}) "</function>\\n" {closing}')
    else:
        rules.append(f'call: {opening} "\\n" ({" | ".join(calls)}) "\\n" {closing}')
    rules.append('calls: call ("\\n" call)*' if parallel else "calls: call")
    if (choice == "auto" or choice is None) and answer is not None:
        rules.append(f"body: {answer} | calls")
    elif choice == "auto" or choice is None:
        free = _tokens_except([*vocab.eos_ids, *([vocab.call_open] if vocab.call_open is not None else [])])
        rules.append(f"body: {free}* calls?")
    else:
        rules.append("body: calls")
    return _checked(_lark(vocab, in_think, "\n".join(rules)), "tools")


def json_rule(schema: Any, param: str, lenient: bool = False) -> str:
    """`%json{...}` for a schema, with bounded whitespace; 400 when it is not a JSON schema at all."""
    if not isinstance(schema, (dict, bool)):
        raise APIError(f"{param}: a JSON schema must be an object or a boolean", param=param)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    options = {"whitespace_pattern": JSON_WHITESPACE, "lenient": lenient}
    text = json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(f"start: %json{text}"))
    if error and not error.startswith("WARNING"):
        raise APIError(f"{param}: this JSON schema cannot be used: {error}", param=param)
    return f"%json{text}"


def _xml_function(rule: str, name: str, params: Any, param: str) -> list[str]:
    """<function=NAME>\\n then each parameter: <parameter=KEY>\\nVALUE\\n</parameter>\\n."""
    if not isinstance(params, dict):
        raise APIError(f"{param}: a JSON schema must be an object", param=param)
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise APIError(f"{param}.properties must be an object", param=f"{param}.properties")
    required = params.get("required") or []
    rules: list[str] = []
    parts: list[str] = []
    for j, (key, sub) in enumerate(props.items()):
        prule = f"{rule}_p{j}"
        value = _xml_value(f"{prule}_v", sub, f"{param}.properties.{key}", rules)
        rules.append(f'{prule}: {_lit(f"<parameter={key}>" + chr(10))} {value}')
        parts.append(prule if key in required else f"{prule}?")
    rules.insert(0, f'{rule}: {_lit(name + ">" + chr(10))} {" ".join(parts)}'.rstrip())
    return rules


def _xml_value(rule: str, schema: Any, param: str, rules: list[str]) -> str:
    """A parameter's value and its closing tag: raw text for a string, JSON for the rest (as the
    chat template writes them)."""
    closing = "\n</parameter>\n"
    if isinstance(schema, dict) and schema.get("type") == "string":
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
            return "(" + " | ".join(_lit(c + closing) for c in choices) + ")"
        json_rule(schema, param)  # still a schema llguidance can read
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        count = f"{{{int(low)},{int(high)}}}" if isinstance(high, int) else f"{{{int(low)},}}" if low else "*"
        # lazy: the value ends at the first closing tag. A pattern or format is not enforced on raw
        # text (the module docstring says so).
        rules.append(f"{rule}[lazy]: /(.|\\n){count}\\n<\\/parameter>\\n/")
        return rule
    return f"{json_rule(schema, param)} {_lit(closing)}"


def _json_call(name: str, params: Any, param: str) -> str:
    schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": params or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
    return json_rule(schema, param)


def _lark(vocab: GrammarVocab, in_think: bool, rules: str) -> str:
    if not in_think:
        return f"start: body\n{rules}\n"
    if vocab.think_end is not None:
        think = f"think: {_tokens_except([*vocab.eos_ids, vocab.think_end])}* <[{vocab.think_end}]>"
    else:  # </think> is not one token here: reasoning is any text up to its first </think>
        think = 'think: THINK_TEXT "</think>"\nTHINK_TEXT: /(.|\\n)*/ & ~/(.|\\n)*<\\/think>(.|\\n)*/'
    return f"start: think /\\n{{0,3}}/ body\n{think}\n{rules}\n"


def _tokens_except(ids: list[int]) -> str:
    return "<[^" + ",".join(str(i) for i in sorted(set(ids))) + "]>"


def _alt(literal: str, token: int | None) -> str:
    """A marker as text, or as its single token (Qwen's <tool_call> is one token, not special)."""
    return literal if token is None else f"({literal} | <[{token}]>)"


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _checked(lark: str, param: str) -> str:
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise APIError(f"{param}: cannot build the grammar that enforces it: {error}", param=param)
    return grammar
