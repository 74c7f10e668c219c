"""Token log-probabilities (engine TokenLogprob records) in OpenAI's two response shapes.

chat:    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
legacy:  {"tokens": [str], "token_logprobs": [float|null], "top_logprobs": [{str: float}|null],
          "text_offset": [int]}

A token's `bytes` are its raw UTF-8 bytes (a byte-level BPE token may hold part of a character);
its `token` text is those bytes decoded with U+FFFD for the incomplete parts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from engine.tokenizer import Tokenizer

# OpenAI reports probabilities too small for a float as this, never -Infinity (not valid JSON).
MIN_LOGPROB = -9999.0


class TokenTexts:
    """token id -> (text, bytes) as logprobs show them, for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._bytes = lru_cache(maxsize=65536)(tokenizer.token_bytes)

    def bytes_of(self, token_id: int) -> bytes:
        return self._bytes(token_id)

    def text_of(self, token_id: int) -> str:
        return self._bytes(token_id).decode("utf-8", errors="replace")


def clean(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


def chat_entries(records, texts: TokenTexts) -> list[dict]:
    """Engine TokenLogprob records -> chat logprobs `content` entries."""
    return [{**_chat_token(r.token_id, r.logprob, texts),
             "top_logprobs": [_chat_token(tid, lp, texts) for tid, lp in r.top]} for r in records]


def _chat_token(token_id: int, logprob: float, texts: TokenTexts) -> dict:
    return {"token": texts.text_of(token_id), "logprob": clean(logprob), "bytes": list(texts.bytes_of(token_id))}


def legacy_block(records, texts: TokenTexts, offset: int, prompt_ids: Sequence[int] = ()) -> dict:
    """Legacy completions logprobs. `prompt_ids` (echo) come first with null logprobs: the engine
    scores generated tokens only. `offset` is where the first token starts in the choice's text."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict | None] = []
    offsets: list[int] = []
    for tid in prompt_ids:
        offsets.append(offset)
        tokens.append(texts.text_of(tid))
        offset += len(tokens[-1])
        token_lps.append(None)
        tops.append(None)
    for r in records:
        offsets.append(offset)
        tokens.append(texts.text_of(r.token_id))
        offset += len(tokens[-1])
        token_lps.append(clean(r.logprob))
        top: dict[str, float] = {}
        for tid, lp in r.top:
            top.setdefault(texts.text_of(tid), clean(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
