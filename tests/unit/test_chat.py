"""server.chat: rendering with the Qwen3.5-style template shipped in scripts/, in jinja2's sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.chat import ChatRenderOptions, ChatTemplate, ChatTemplateError, prepare_message

REPO = Path(__file__).resolve().parents[2]
QWEN35 = (REPO / "scripts" / "qwen35_chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def qwen() -> ChatTemplate:
    return ChatTemplate(QWEN35)


def test_user_turn_and_thinking_generation_prompt(qwen):
    out = qwen.render([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_thinking_off_gives_an_empty_think_block(qwen):
    out = qwen.render([{"role": "user", "content": "hi"}], ChatRenderOptions(enable_thinking=False))
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_developer_role_is_system_and_content_parts_are_joined(qwen):
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    out = qwen.render(msgs)
    assert out.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nab<|im_end|>\n")


def test_tools_are_rendered_with_unescaped_json(qwen):
    tool = {"type": "function", "function": {"name": "f", "description": "<b> & 'x'", "parameters": {}}}
    out = qwen.render([{"role": "user", "content": "hi"}], ChatRenderOptions(tools=[tool]))
    assert '"description": "<b> & \'x\'"' in out
    assert out.startswith("<|im_start|>system\n# Tools")


def test_tool_call_arguments_json_string_becomes_parameters(qwen):
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo", "n": 2}'}}
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny"}]
    out = qwen.render(msgs)
    assert "<function=get>" in out
    assert "<parameter=city>\nOslo\n</parameter>" in out and "<parameter=n>\n2\n</parameter>" in out
    assert "<tool_response>\nsunny\n</tool_response><|im_end|>" in out


def test_prepare_message_keeps_non_json_arguments_and_does_not_mutate():
    msg = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}
    out = prepare_message(msg)
    assert out["tool_calls"][0]["function"]["arguments"] == "not json"
    ok = prepare_message({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]})
    assert ok["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msg["tool_calls"][0]["function"]["arguments"] == "not json"


def test_extra_template_kwargs_reach_the_template():
    t = ChatTemplate("{{ greeting }} {{ messages[0].content }}{{ eos_token }}", eos_token="</s>")
    assert t.render([{"role": "user", "content": "x"}], ChatRenderOptions(extra={"greeting": "hello"})) == "hello x</s>"


def test_raise_exception_becomes_a_clear_error():
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render([{"role": "user", "content": "x"}])


def test_missing_template_is_a_clear_error():
    t = ChatTemplate(None)
    assert not t.available
    with pytest.raises(ChatTemplateError, match="no chat template"):
        t.render([{"role": "user", "content": "x"}])


def test_template_that_does_not_compile():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_sandbox_blocks_attribute_escapes():
    t = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])


CONVERSATIONS = [
    ([{"role": "user", "content": "hi"}], {}),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
      {"role": "user", "content": "q2"}], {"enable_thinking": False}),
    ([{"role": "user", "content": "w?"},
      {"role": "assistant", "content": "ok", "reasoning_content": "think",
       "tool_calls": [{"type": "function", "function": {"name": "g", "arguments": {"x": [1, 2], "y": "s"}}}]},
      {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}],
     {"tools": [{"type": "function", "function": {"name": "g", "description": "<&>", "parameters": {}}}]}),
]


@pytest.mark.parametrize("messages,kwargs", CONVERSATIONS)
def test_matches_hf_transformers_rendering(tmp_path, messages, kwargs):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}')
    (tmp_path / "chat_template.jinja").write_text(QWEN35)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    options = ChatRenderOptions(tools=tools, enable_thinking=kwargs.get("enable_thinking"))
    assert ChatTemplate(QWEN35, eos_token="<|im_end|>").render(messages, options) == want
