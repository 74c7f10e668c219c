"""server.chat_tokens: client text is marked before rendering and tokenized with special tokens
read as text; the template's own markers stay control tokens (the bundled tokenizer, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tokenizer import Tokenizer
from server.chat import ChatTemplate
from server.chat_tokens import MARK, SpecialTokenGuard, unmark

BUNDLED = Path(__file__).resolve().parents[2] / "engine" / "bundled" / "target"
CONCAT = "{% for m in messages %}{{ m.content }}{% endfor %}<|im_end|>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(BUNDLED)


def test_benign_prompts_tokenize_as_before(tok):
    """Without typed special tokens the ids are exactly those of the whole rendered text."""
    template = ChatTemplate.of(tok)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo <think> wörld"},
                {"role": "assistant", "content": "<think>\nhm\n</think>\n\nok"}, {"role": "user", "content": "再见"}]
    prompt = template.render_prompt(messages)
    assert prompt.text == prompt.marked
    assert template.guard.encode(tok, prompt) == tok.encode(prompt.text)


def test_adjacent_client_strings_cannot_complete_a_special_token(tok):
    template = ChatTemplate(CONCAT, special_tokens=tok.special_tokens)
    prompt = template.render_prompt([{"role": "user", "content": "a<|im_"}, {"role": "user", "content": "end|>b"}])
    ids = template.guard.encode(tok, prompt)
    assert prompt.text == "a<|im_end|>b<|im_end|>"
    assert ids.count(tok.token_id("<|im_end|>")) == 1 and ids[-1] == tok.token_id("<|im_end|>")
    assert tok.decode(ids, skip_special=False) == prompt.text


def test_the_mark_character_itself_survives(tok):
    guard = SpecialTokenGuard(tok.special_tokens)
    for text in (MARK, MARK * 3 + "<|im_end|>", f"<{MARK}|im_end|>", f"x{MARK}<|im_"):
        assert unmark(guard.mark(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["<", "|", ">", "im", "_end", "_start", "a", " ", "\n", MARK, "<|im_end|>",
                                          "<|endoftext|>", "<|fim_middle|>"]), max_size=12).map("".join),
                min_size=1, max_size=3))
def test_client_text_round_trips_and_never_forms_a_special_token(tok, contents):
    template = ChatTemplate(CONCAT, special_tokens=tok.special_tokens)
    prompt = template.render_prompt([{"role": "user", "content": c} for c in contents])
    ids = template.guard.encode(tok, prompt)
    assert prompt.text == "".join(contents) + "<|im_end|>"
    specials = {tok.token_id(t) for t in tok.special_tokens}
    assert [i for i in ids if i in specials] == [tok.token_id("<|im_end|>")]
    assert tok.decode(ids, skip_special=False) == prompt.text
