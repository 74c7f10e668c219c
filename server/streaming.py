"""Engine steps -> text deltas (UTF-8 safe, stop strings cut), and OpenAI chunk assembly.

TextAssembler is synchronous and shared by the HTTP server and the CLI, so streamed text,
non-streamed text and `spruce run` output are the same function of the token stream.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from engine.tokenizer import Tokenizer
from engine.types import Stats, Step


class StopMatcher:
    """Cuts text at the first stop string. Text that could be the start of a stop string is held
    back until it is ruled out, so no prefix of a stop string ever leaks into the output."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was found)."""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self._stops), default=1) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


@dataclass
class TextDelta:
    text: str
    finish_reason: str | None = None  # "stop" | "length" on the last delta
    stats: Stats | None = None  # on the last delta


class TextAssembler:
    """Feeds engine Steps through the incremental detokenizer and the stop matcher.

    After `stop_hit` turns true the caller must cancel the engine request; later tokens are
    dropped and the engine's final step ("cancelled") is reported as "stop".
    """

    def __init__(self, tokenizer: Tokenizer, stops: list[str], stop_token_ids: tuple[int, ...] = ()):
        self._detok = tokenizer.detokenizer()
        self._matcher = StopMatcher(stops)
        self._stop_ids = frozenset(stop_token_ids)
        self.stop_hit = False

    def feed(self, step: Step) -> TextDelta:
        text = "" if self.stop_hit else self._text_of(step.token_ids)
        if step.finish_reason is None:
            return TextDelta(text)
        if not self.stop_hit:
            text += self._tail()
        reason = "length" if step.finish_reason == "length" and not self.stop_hit else "stop"
        return TextDelta(text, reason, step.stats)

    def _text_of(self, token_ids: list[int]) -> str:
        out = []
        for tid in token_ids:
            if tid in self._stop_ids:
                continue  # an EOS token ends the text; it is never shown, special-flagged or not
            safe, stopped = self._matcher.feed(self._detok.add(tid))
            out.append(safe)
            if stopped:
                self.stop_hit = True
                break
        return "".join(out)

    def _tail(self) -> str:
        safe, stopped = self._matcher.feed(self._detok.flush())
        self.stop_hit = self.stop_hit or stopped
        return safe if stopped else safe + self._matcher.flush()


@dataclass
class ChunkContext:
    """What every chunk of one response shares (OpenAI clients check id and created are stable)."""

    object: str  # "chat.completion.chunk" | "text_completion"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, object: str, model: str, prefix: str) -> ChunkContext:
        return cls(object, model, f"{prefix}-{uuid.uuid4().hex[:24]}")

    def base(self) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}


def chat_chunk(ctx: ChunkContext, delta: dict, finish_reason: str | None = None, timings: dict | None = None) -> dict:
    chunk = ctx.base()
    chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    if timings is not None:
        chunk["timings"] = timings
    return chunk


def completion_chunk(ctx: ChunkContext, text: str, finish_reason: str | None = None,
                     timings: dict | None = None) -> dict:
    chunk = ctx.base()
    chunk["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    if timings is not None:
        chunk["timings"] = timings
    return chunk


def usage_chunk(ctx: ChunkContext, usage: dict, timings: dict) -> dict:
    """The extra last chunk of stream_options.include_usage: empty choices, usage (+ timings)."""
    chunk = ctx.base()
    chunk.update(choices=[], usage=usage, timings=timings)
    return chunk


def sse_data(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


SSE_DONE = "[DONE]"
