"""A grammar masks every token while decoding (engine/grammar.py): the tiny random model, which never
writes JSON by itself, writes JSON that matches the schema, and speculation (every drafter, right or
wrong) emits exactly what plain decoding with the same mask emits, up to and including the EOS the
grammar forces at the end."""

from __future__ import annotations

import json

import llguidance
import pytest

from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.generate import Engine
from tests.engine.test_lossless import OracleDrafter
from tests.helpers import generate

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 10, "maximum": 99},
        "flag": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["color", "n", "flag", "tags"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_pattern": "[ \\n]{0,4}"},
}
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
PROMPT = [17, 99, 4, 250, 31, 8, 77, 120] * 2


@pytest.fixture(scope="module")
def engine(tiny_qwen35):
    return Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16))


def check_answer(engine, tokens: list[int]) -> dict:
    value = json.loads(engine.tokenizer.decode(tokens))
    assert set(value) == {"color", "n", "flag", "tags"}
    assert value["color"] in ("red", "green", "blue") and isinstance(value["flag"], bool)
    assert isinstance(value["n"], int) and 10 <= value["n"] <= 99
    assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}
    return value


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=120, grammar=GRAMMAR),
    SamplingParams(max_tokens=120, temperature=0.9, seed=4, grammar=GRAMMAR),
    SamplingParams(max_tokens=120, temperature=0.9, seed=4, grammar=GRAMMAR, frequency_penalty=0.5),
], ids=["greedy", "seeded", "seeded+penalty"])
def test_grammar_output_matches_and_speculation_is_lossless(engine, sampling):
    plain = generate(engine, PROMPT, sampling)
    assert plain.finish_reason == "stop"  # the grammar ends with the end of the text: EOS is on
    check_answer(engine, plain.tokens)
    free = generate(engine, PROMPT, SamplingParams(max_tokens=len(plain.tokens), temperature=sampling.temperature,
                                                   seed=sampling.seed))
    with pytest.raises(ValueError):  # unconstrained, the model writes no JSON
        check_answer(engine, free.tokens)
    spec = SpecConfig(method="ngram", budget=8, max_depth=4, adaptive=False)
    drafters = {"right": OracleDrafter(plain.tokens, len(PROMPT)), "wrong": OracleDrafter(plain.tokens, len(PROMPT),
                                                                                           wrong=True),
                "fan": OracleDrafter(plain.tokens, len(PROMPT), fan=3)}
    for name, drafter in drafters.items():
        out = generate(engine, PROMPT, sampling, spec, drafter=drafter)
        assert (out.tokens, out.finish_reason) == (plain.tokens, "stop"), name
        if name != "wrong":
            assert out.stats.accepted > 0, name  # the drafts were taken: the mask ran per tree node
    ngram = generate(engine, PROMPT, sampling, spec)
    assert ngram.tokens == plain.tokens


def test_a_bad_grammar_is_a_request_error(engine):
    from engine.generate import RequestError

    bad = llguidance.LLMatcher.grammar_from_lark("start: x\n")  # x is not defined
    with pytest.raises(RequestError):
        generate(engine, PROMPT, SamplingParams(max_tokens=4, grammar=bad))


def test_without_llguidance_a_grammar_is_a_request_error_and_plain_requests_run(tiny_qwen35, monkeypatch):
    from engine.generate import RequestError

    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)  # as if it were not installed
    fresh = Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16))
    with pytest.raises(RequestError, match="llguidance"):
        generate(fresh, PROMPT, SamplingParams(max_tokens=4, grammar=GRAMMAR))
    assert len(generate(fresh, PROMPT, SamplingParams(max_tokens=4)).tokens) == 4
