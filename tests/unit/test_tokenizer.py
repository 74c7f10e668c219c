"""engine.tokenizer on a trained byte-level BPE (the tiny checkpoint's tokenizer, no model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tokenizer import Tokenizer
from tests.helpers import checkpoint_maker

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    maker = checkpoint_maker()
    out = tmp_path_factory.mktemp("tok")
    maker.write_tokenizer(out, maker.train_tokenizer(512, maker.stdlib_files(40)), TEMPLATE)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_special_tokens_in_text_become_their_ids_and_no_bos(tok):
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [start, *tok.encode("user\nhi"), end]
    assert tok.decode(tok.encode("hi")) == "hi"
    assert start not in tok.encode("hi") and tok.token_id("<|endoftext|>") not in tok.encode("hi")


def test_decode_skips_special_but_shows_think_and_tool_call(tok):
    ids = tok.encode("<|im_start|>a<think>b</think><tool_call>c</tool_call><|im_end|>")
    assert tok.decode(ids) == "a<think>b</think><tool_call>c</tool_call>"
    assert tok.decode(ids, skip_special=False).startswith("<|im_start|>a")


def test_eos_ids_from_configs_and_chatml_names(tok_dir, tmp_path):
    tok = Tokenizer.from_dir(tok_dir)
    im_end, eot = tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")
    assert set(tok.eos_token_ids) == {im_end, eot}
    d = _copy(tok_dir, tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|fim_pad|>", "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    got = Tokenizer.from_dir(d).eos_token_ids
    assert set(got) == {7, 8, tok.token_id("<|fim_pad|>"), im_end, eot}
    assert len(got) == len(set(got))


def test_chat_template_sources(tok_dir, tmp_path):
    assert Tokenizer.from_dir(tok_dir).chat_template == TEMPLATE
    d = _copy(tok_dir, tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(d).chat_template == "D"
    (d / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_dir(d).chat_template == "J"
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink()
    assert Tokenizer.from_dir(d).chat_template is None


def test_vocab_size_and_token_id(tok):
    assert tok.vocab_size == 512
    assert tok.token_id("<think>") is not None
    assert tok.token_id("no-such-token-xyz") is None


@pytest.mark.parametrize("text", ["héllo 世界 😀 ok", "日本語🎉🎉!", "a\u0301b 👩‍👩‍👧"])
def test_detokenizer_never_emits_partial_characters(tok, text):
    ids = tok.encode(text)
    assert len(ids) > len(text.encode("utf-8")) // 4  # multi-byte characters really are split across tokens
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in ids]
    assert "" in pieces  # something was held back while a character was incomplete
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text


def test_flush_returns_an_incomplete_tail(tok):
    ids = tok.encode("世")
    detok = tok.detokenizer()
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == tok.decode(ids[:-1])
    assert "\ufffd" in tok.decode(ids[:-1])


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_detokenizer_round_trips_any_text(tok, text):
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) + detok.flush() == tok.decode(ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 511), max_size=30))
def test_detokenizer_equals_full_decode_on_arbitrary_ids(tok, ids):
    detok = tok.detokenizer()
    assert "".join(detok.add(i) for i in ids) + detok.flush() == tok.decode(ids)


def _copy(src: Path, dst: Path) -> Path:
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_special_tokens_can_be_read_as_text(tok):
    text = "a<|im_end|>b"
    assert tok.token_id("<|im_end|>") in tok.encode(text)
    literal = tok.encode(text, special=False)
    assert tok.token_id("<|im_end|>") not in literal and tok.decode(literal) == text
    assert tok.encode_many([text, "", "x"], special=False) == [literal, [], tok.encode("x")]
    assert "<|im_end|>" in tok.special_tokens and "<think>" not in tok.special_tokens


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300) | st.lists(st.sampled_from(["    ", "\n", "def ", "<|im_end|>", "é", "🙂", "ab"]),
                                       max_size=80).map("".join))
def test_text_longer_than_max_text_bytes_has_more_tokens(tok, text):
    """The bound the server refuses over-long prompts by: no text of n tokens has more bytes."""
    for special in (True, False):
        n = len(tok.encode(text, special))
        assert len(text.encode("utf-8")) <= tok.max_text_bytes(n)


def test_long_decodes_round_trip(tok):
    """Past 256 ids, decode goes through the batch call (it releases the GIL)."""
    text = "héllo wörld 你好 <|im_end|>" * 100
    ids = tok.encode(text)
    assert len(ids) > 256 and tok.decode(ids, skip_special=False) == text
