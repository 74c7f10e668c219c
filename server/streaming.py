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
        self._firsts = {s[0] for s in self._stops}
        self._longest = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None  # the stop string that was found

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was found)."""
        buf = self._held + text
        keep = self._partial_suffix(buf)
        hit = self._first_hit(buf)
        if hit is not None and len(buf) - keep >= hit:
            self._held = ""
            return buf[:hit], True
        # No hit yet, or a longer stop string that starts earlier may still complete: wait for it.
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> tuple[str, bool]:
        """At the end of the text: what was held back, cut at a stop string found in it."""
        buf, self._held = self._held, ""
        hit = self._first_hit(buf)
        return (buf, False) if hit is None else (buf[:hit], True)

    def _first_hit(self, buf: str) -> int | None:
        hits = [(i, s) for s, i in ((s, buf.find(s)) for s in self._stops) if i >= 0]
        if not hits:
            return None
        at, self.matched = min(hits, key=lambda h: (h[0], -len(h[1])))
        return at

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(self._longest, len(buf)), 0, -1):
            if buf[-k] not in self._firsts:
                continue
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


class ReasoningGate:
    """Stop strings apply to the answer, not to the reasoning before it: while the text is inside a
    think block the prompt left open, it passes by the stop matcher, up to and including the
    `</think>` that ends the block and the newlines after it (the answer starts after them)."""

    MARKER = "</think>"

    def __init__(self, open_at_start: bool) -> None:
        self.open = open_at_start
        self._layout = False  # the block has ended; the newlines that follow it are not the answer yet
        self._recent = ""  # the reasoning's last characters: the marker may span two pieces

    def split(self, piece: str) -> tuple[str, str]:
        """-> (reasoning text that bypasses the matcher, answer text for it)."""
        if self._layout:
            rest = piece.lstrip("\n")
            self._layout = not rest
            return piece[: len(piece) - len(rest)], rest
        if not self.open:
            return "", piece
        buf = self._recent + piece
        at = buf.find(self.MARKER)
        if at < 0:
            self._recent = buf[-(len(self.MARKER) - 1):]
            return piece, ""
        self.open, self._layout = False, True
        cut = at + len(self.MARKER) - len(self._recent)  # in piece's own characters
        head, tail = self.split(piece[cut:])
        return piece[:cut] + head, tail


@dataclass
class TextDelta:
    text: str
    logprobs: list = field(default_factory=list)  # engine TokenLogprob records whose text is out
    finish_reason: str | None = None  # "stop" | "length" on the last delta
    stats: Stats | None = None  # on the last delta
    stop_kind: str | None = None  # on the last delta: "eos" | "word" | "limit" (llama.cpp's stop_type)
    stop_word: str = ""
    tokens: int = 0  # the tokens of this delta's step
    dropped: int = 0  # of those, the ones after a stop string: generated, but not part of the answer

    @property
    def final_stats(self) -> Stats:
        """The statistics of a last delta (a last delta always carries them)."""
        if self.stats is None:
            raise RuntimeError("statistics asked of a delta that is not the last")
        return self.stats


@dataclass
class _Span:
    """Where one token's text sits in the decoded stream (character offsets), and its logprob."""

    start: int
    end: int
    record: object


class TextAssembler:
    """Feeds engine Steps through the incremental detokenizer and the stop matcher.

    After `stop_hit` turns true the caller must cancel the engine request; later tokens are
    dropped and the engine's final step ("cancelled") is reported as "stop".
    Logprob records are released once all of their token's text is out; a token that starts
    before a stop string's cut is kept, one that starts inside the stop string is not.
    """

    def __init__(self, tokenizer: Tokenizer, stops: list[str], stop_token_ids: tuple[int, ...] = (),
                 reasoning_first: bool = False):
        self._detok = tokenizer.detokenizer()
        self._matcher = StopMatcher(stops)
        self._gate = ReasoningGate(reasoning_first)
        self._stop_ids = frozenset(stop_token_ids)
        self._spans: list[_Span] = []
        self._decoded = 0  # characters the detokenizer has produced
        self._emitted = 0  # characters released to the caller
        self.stop_hit = False

    def feed(self, step: Step) -> TextDelta:
        count = len(step.token_ids)
        used = 0 if self.stop_hit else count
        text = ""
        if not self.stop_hit:
            text, used = self._text_of(step)
        dropped = count - used
        if step.finish_reason is None:
            return TextDelta(text, self._release(), tokens=count, dropped=dropped)
        if not self.stop_hit:
            text += self._tail()
        records = self._release(final=True)
        if self.stop_hit:
            return TextDelta(text, records, "stop", step.stats, "word", self._matcher.matched or "", count, dropped)
        reason = "length" if step.finish_reason == "length" else "stop"
        return TextDelta(text, records, reason, step.stats, "limit" if reason == "length" else "eos", "", count,
                         dropped)

    def _text_of(self, step: Step) -> tuple[str, int]:
        """-> (the text to release, how many of the step's tokens it used: all, or up to the one
        that completed a stop string)."""
        out = []
        records = step.logprobs
        for i, tid in enumerate(step.token_ids):
            if tid in self._stop_ids:
                continue  # an EOS token ends the text; it is never shown, special-flagged or not
            piece = self._detok.add(tid)
            if records is not None:
                self._spans.append(_Span(self._decoded, self._decoded + len(piece), records[i]))
            self._decoded += len(piece)
            reasoning, answer = self._gate.split(piece)
            if reasoning:  # nothing is held in the matcher while the reasoning runs
                out.append(reasoning)
                self._emitted += len(reasoning)
            safe, stopped = self._matcher.feed(answer) if answer else ("", False)
            out.append(safe)
            self._emitted += len(safe)
            if stopped:
                self.stop_hit = True
                return "".join(out), i + 1
        return "".join(out), len(step.token_ids)

    def _tail(self) -> str:
        safe, stopped = self._matcher.feed(self._detok.flush())
        if not stopped:
            rest, stopped = self._matcher.flush()
            safe += rest
        self.stop_hit = self.stop_hit or stopped
        self._emitted += len(safe)
        return safe

    def _release(self, final: bool = False) -> list:
        if final and not self.stop_hit:
            cut = len(self._spans)
        elif self.stop_hit:  # tokens that start inside the stop string are not part of the answer
            cut = next((i for i, s in enumerate(self._spans) if s.start >= self._emitted), len(self._spans))
        else:
            cut = next((i for i, s in enumerate(self._spans) if s.end > self._emitted), len(self._spans))
        out = [s.record for s in self._spans[:cut]]
        self._spans = [] if self.stop_hit else self._spans[cut:]
        return out


@dataclass
class ChunkContext:
    """What every chunk of one response shares (OpenAI clients check id and created are stable)."""

    object: str  # "chat.completion.chunk" | "text_completion" | "chat.completion"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, object: str, model: str, prefix: str) -> ChunkContext:
        return cls(object, model, f"{prefix}-{uuid.uuid4().hex[:24]}")

    def base(self) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}

    def chunk(self, choices: list[dict], timings: dict | None = None) -> dict:
        out = self.base()
        out["choices"] = choices
        if timings is not None:
            out["timings"] = timings
        return out


# Line breaks to str.splitlines() (httpx's aiter_lines, many Python clients) that JSON leaves raw;
# inside an SSE event they would split it. The other ones (< U+0020) JSON always escapes.
_SPLITLINES_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(payload: dict) -> str:
    """One compact JSON event payload; non-ASCII text stays readable, line breaks are escaped."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_SPLITLINES_BREAKS)


SSE_DONE = "[DONE]"
