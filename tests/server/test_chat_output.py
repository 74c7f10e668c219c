"""server.chat_output / server.tools: reasoning and Qwen3.5 XML tool calls out of generated text.

The tool-call text is what the repository's own chat template writes for an assistant turn, so
parsing it back must give the original calls; any split of the text into streamed pieces must give
the same message as the whole text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from server.chat import ChatTemplate
from server.chat_output import ChatOutputParser, ChatPiece, ToolCallDelta, merge_tool_calls
from server.tools import ToolSet, convert_value

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = ChatTemplate((REPO / "scripts" / "qwen35_chat_template.jinja").read_text())
JSON_TYPE = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null", list: "array",
             dict: "object"}


def run(pieces: list[str], tools: ToolSet | None,
        inside: bool = False) -> tuple[str, str, list[dict], ChatOutputParser]:
    parser = ChatOutputParser(inside, tools)
    out: list[ChatPiece] = [parser.feed(p) for p in pieces] + [parser.finish()]
    calls = merge_tool_calls([d for o in out for d in o.tool_calls])
    return "".join(o.reasoning for o in out), "".join(o.content for o in out), calls, parser


def split(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def assistant_turn(reasoning: str, content: str, calls: list[dict]) -> str:
    """What the template writes for the model's turn after `<|im_start|>assistant\\n`."""
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls or None}]
    out = TEMPLATE.render(msgs).split("<|im_start|>assistant\n")[1]
    return out[: out.index("<|im_end|>")]


scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=False, allow_infinity=False, width=32),
                    st.text(st.characters(codec="utf-8", exclude_characters="<"), max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text("abc", max_size=3), inner, max_size=3)),
                      max_leaves=6)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
arguments = st.dictionaries(names, values, max_size=4)


def toolset_for(calls: list[tuple[str, dict]]) -> ToolSet:
    return ToolSet({name: {k: (JSON_TYPE[type(v)],) for k, v in args.items()} for name, args in calls})


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3, unique_by=lambda call: call[0]),
       st.text(st.characters(codec="utf-8", exclude_characters="<"), max_size=20),
       st.text(st.characters(codec="utf-8", exclude_characters="<"), max_size=20),
       st.lists(st.integers(0, 10**6), max_size=25))
def test_template_written_calls_parse_back_in_any_split(calls, reasoning, content, cuts):
    reasoning, content = reasoning.strip("\n"), content.strip()
    openai_calls = [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls]
    text = assistant_turn(reasoning, content, openai_calls)
    assert text.startswith("<think>\n")
    tools = toolset_for(calls)
    whole = run([text], tools)
    got_reasoning, got_content, got_calls, parser = whole
    assert got_reasoning == reasoning and got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    assert parser.calls.completed == len(calls) and not parser.calls.truncated
    # The prompt may already have opened the block: the model's text then starts inside it.
    inside = run(split(text[len("<think>\n"):], cuts), tools, inside=True)
    assert inside[:2] == whole[:2] and _strip_ids(inside[2]) == _strip_ids(got_calls)


def _strip_ids(calls: list[dict]) -> list:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@settings(max_examples=100, deadline=None)
@example("<<tool_call></tool_call>tool_call>", [], False, False)  # a tag spanning a dropped call
@example("<<tool_call></tool_call> ", [2], False, False)
@example("x<<tool_call><function=f></function></tool_call>tool_call><function=f></function></tool_call>", [9, 40],
         False, True)  # ... and a kept one
@given(st.lists(st.sampled_from(["a", " ", "\n", "<", "/", "think>", "<think>", "</think>", "tool_call>",
                                 "<tool_call>", "</tool_call>", "<function=f>", "<parameter=x>", "1",
                                 "</parameter>", "</function>", "{", '"name": "f"}']), max_size=40).map("".join),
       st.lists(st.integers(0, 400), max_size=12), st.booleans(), st.booleans())
def test_any_text_streams_exactly_like_the_whole(text, cuts, inside, parallel):
    """Arbitrary markup soup: the split never changes the message, and arguments stay valid JSON."""
    tools = ToolSet({"f": {}}, parallel=parallel)
    whole = run([text], tools, inside)
    pieces = run(split(text, cuts), tools, inside)
    assert pieces[:2] == whole[:2] and _strip_ids(pieces[2]) == _strip_ids(whole[2])
    for call in whole[2]:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert "<tool_call>" not in whole[1]


def test_a_tag_split_by_a_call_opens_a_call():
    """"<" shown before a call and "tool_call>" after it would read as a tag in the content: they
    open a call instead (here one without a function, dropped), whole or streamed."""
    tools = ToolSet({"f": {}}, parallel=True)
    text = "x<<tool_call><function=f></function></tool_call>tool_call><function=f></function></tool_call>y"
    for pieces in ([text], [text[:2], text[2:30], text[30:52], text[52:]]):
        _, content, calls, _ = run(pieces, tools)
        assert content == "x<y" and [c["function"]["name"] for c in calls] == ["f", "f"]
    assert run(["<<tool_call></tool_call>tool_call>"], tools)[1] == "<"


def test_reasoning_then_content_without_tools():
    reasoning, content, calls, _ = run(["I think", " so.\n", "\n</thi", "nk>\n\nAnswer", " here"], None, inside=True)
    assert (reasoning, content, calls) == ("I think so.", "Answer here", [])
    # thinking off: the prompt closed the block, everything is content (markup included when tools are off)
    assert run(["x <tool_call>y"], None)[1] == "x <tool_call>y"
    # the model may open the block itself
    assert run(["  <thi", "nk>\nr</think>\n\nc"], None)[:2] == ("r", "c")
    # cut off while thinking: all of it is reasoning
    assert run(["still thinking\n"], None, inside=True)[:2] == ("still thinking\n", "")


def test_streamed_arguments_are_fragments_of_one_object():
    parser = ChatOutputParser(False, ToolSet({"get": {"n": ("integer",)}}))
    deltas = []
    for piece in ["Sure.\n\n<tool_call>\n<function=get>\n", "<parameter=n>\n4", "2\n</parameter>\n",
                  "<parameter=s>\nhi\n</parameter>\n</function>\n</tool_call>"]:
        deltas += parser.feed(piece).tool_calls
    first, *rest = deltas
    assert first.openai() == {"index": 0, "id": first.id, "type": "function",
                              "function": {"name": "get", "arguments": ""}}
    assert [d.arguments for d in rest] == ['{"n": 42', ', "s": "hi"', "}"]
    assert all(d.id is None and d.name is None and d.openai()["index"] == 0 for d in rest)


def test_parallel_calls_off_stops_after_the_first():
    text = "<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n</function>\n</tool_call>"
    _, _, calls, parser = run([text], ToolSet({}, parallel=False))
    assert [c["function"]["name"] for c in calls] == ["a"] and parser.tool_calls_done
    assert [c["function"]["arguments"] for c in calls] == ["{}"]


def test_truncated_call_keeps_valid_json_and_is_flagged():
    _, content, calls, parser = run(["Hi\n\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<param"],
                                    ToolSet({}))
    assert content == "Hi" and json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert parser.calls.truncated and parser.calls.completed == 0


def test_json_body_calls_and_malformed_calls():
    text = '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>\n<tool_call>junk</tool_call>tail'
    _, content, calls, _ = run([text], ToolSet({}))
    assert _strip_ids(calls) == [("f", '{"x": [1, 2]}')] and content == "tail"


@pytest.mark.parametrize("raw,types,want", [
    ("007", ("string",), "007"),
    ("007", (), "007"),
    ("42", (), 42),
    ("42", ("integer",), 42),
    ("4.5", ("number",), 4.5),
    ("True", ("boolean",), True),
    ("null", ("string", "null"), None),
    ("7", ("string", "null"), "7"),
    ('{"a": 1}', ("object",), {"a": 1}),
    ("[1, 2]", (), [1, 2]),
    ("hello world", ("integer",), "hello world"),
    ("NaN", (), "NaN"),
    ('"quoted"', ("enum",), "quoted"),
])
def test_parameter_values_follow_the_schema(raw, types, want):
    assert convert_value(raw, types) == want


def test_tool_call_delta_shape():
    assert ToolCallDelta(1, arguments="x").openai() == {"index": 1, "function": {"arguments": "x"}}
