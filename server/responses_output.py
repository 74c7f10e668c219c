"""A chat answer as Responses output items, and the stream events that build them one by one.

The chat output parser's pieces (reasoning, text, tool-call deltas: server/chat_output.py) open a
`reasoning` item, a `message` item (one output_text part) or a `function_call` item; an item is
done when the next one opens or the answer ends. Streamed and non-streamed answers are built by the
same OutputBuilder, so they agree item for item.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from server.bridge import EngineFailure, Job
from server.chat_output import ChatPiece
from server.logprobs import TokenTexts
from server.openai_routes import ChatChoice, Totals, choice_deltas, engine_error
from server.planning import ChatPlan
from server.responses import ResponseStore, assistant_message


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass
class _OpenItem:
    index: int  # output_index
    item: dict
    text: str = ""


@dataclass
class OutputBuilder:
    items: list[dict] = field(default_factory=list)
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)  # chat-style tool_calls, for the store
    _open: _OpenItem | None = None

    def feed(self, piece: ChatPiece) -> list[dict]:
        events: list[dict] = []
        if piece.reasoning:
            events += self._text("reasoning", piece.reasoning)
        if piece.content:
            events += self._text("message", piece.content)
        for delta in piece.tool_calls:
            if delta.id is not None:
                events += self._open_call(delta.id, delta.name or "")
            if delta.arguments and self._open is not None:
                self._open.text += delta.arguments
                self.calls[-1]["function"]["arguments"] += delta.arguments
                events.append({"type": "response.function_call_arguments.delta", "item_id": self._open.item["id"],
                               "output_index": self._open.index, "delta": delta.arguments})
        return events

    def close(self) -> list[dict]:
        """Finish the open item (at the end of the answer, or before the next item opens)."""
        open_, self._open = self._open, None
        if open_ is None:
            return []
        item, ref = open_.item, {"item_id": open_.item["id"], "output_index": open_.index}
        events: list[dict] = []
        part: dict
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": open_.text}
            item["content"] = [part]
            events += [{"type": "response.reasoning_text.done", **ref, "content_index": 0, "text": open_.text},
                       {"type": "response.content_part.done", **ref, "content_index": 0, "part": part}]
        elif item["type"] == "message":
            part = {"type": "output_text", "text": open_.text, "annotations": [], "logprobs": []}
            item["content"], item["status"] = [part], "completed"
            events += [{"type": "response.output_text.done", **ref, "content_index": 0, "text": open_.text,
                        "logprobs": []},
                       {"type": "response.content_part.done", **ref, "content_index": 0, "part": part}]
        else:
            item["arguments"], item["status"] = open_.text, "completed"
            events.append({"type": "response.function_call_arguments.done", **ref, "arguments": open_.text,
                           "name": item["name"]})
        events.append({"type": "response.output_item.done", "output_index": open_.index, "item": dict(item)})
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self._open is None or self._open.item["type"] != kind:
            events += self.close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": []}
                part: dict = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": _item_id("msg"), "status": "in_progress", "role": "assistant",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._add(item)
            assert self._open is not None
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index":
                           self._open.index, "content_index": 0, "part": part})
        assert self._open is not None
        self._open.text += text
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        event_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        event = {"type": event_type, "item_id": self._open.item["id"], "output_index": self._open.index,
                 "content_index": 0, "delta": text}
        if kind == "message":
            event["logprobs"] = []
        return [*events, event]

    def _open_call(self, call_id: str, name: str) -> list[dict]:
        events = self.close()
        item = {"type": "function_call", "id": _item_id("fc"), "call_id": call_id, "name": name, "arguments": "",
                "status": "in_progress"}
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        return events + self._add(item)

    def _add(self, item: dict) -> list[dict]:
        self._open = _OpenItem(len(self.items), item)
        self.items.append(item)
        return [{"type": "response.output_item.added", "output_index": self._open.index, "item": dict(item)}]


@dataclass
class ResponseRun:
    """One /v1/responses answer being produced."""

    job: Job
    plan: ChatPlan
    base: dict  # server.responses.response_base
    messages: list[dict]  # the conversation so far (stored with the answer)
    store: ResponseStore | None
    texts: TokenTexts
    tokenizer: Any
    cache_writes: bool = True  # the prefix cache stores the prompt's state (Spruce's "cache write")
    builder: OutputBuilder = field(default_factory=OutputBuilder)

    async def events(self) -> AsyncIterator[dict]:
        """Every stream event (without sequence numbers), the final response last."""
        yield {"type": "response.created", "response": dict(self.base)}
        yield {"type": "response.in_progress", "response": dict(self.base)}
        totals = Totals(self.plan.planned)
        choice = ChatChoice(0, self.plan, self.texts)
        finish = "stop"
        async for _, delta in choice_deltas(self.job, self.plan.planned, self.tokenizer):
            totals.dropped += delta.tokens if choice.wants_no_more else delta.dropped
            for event in self.builder.feed(choice.feed(delta)):
                yield event
            if choice.wants_no_more:
                self.job.requests[0].cancel.set()
            if delta.finish_reason is not None:
                totals.stats.append(delta.final_stats)
                finish = delta.finish_reason
        for event in self.builder.close():
            yield event
        response = self.final(totals, finish)
        yield {"type": "response.incomplete" if response["status"] == "incomplete" else "response.completed",
               "response": response}

    def final(self, totals: Totals, finish: str) -> dict:
        b = self.builder
        usage = totals.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        written = usage["prompt_tokens"] - cached if self.cache_writes else 0
        reasoning_tokens = len(self.tokenizer.encode(b.reasoning)) if b.reasoning else 0
        out = {**self.base, "status": "incomplete" if finish == "length" else "completed", "output": b.items,
               "usage": {"input_tokens": usage["prompt_tokens"],
                         "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
                         "output_tokens": usage["completion_tokens"],
                         "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens,
                                                                           usage["completion_tokens"])},
                         "total_tokens": usage["total_tokens"]},
               "timings": totals.timings()}
        if finish == "length":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.store is not None:
            self.store.put(self.base["id"], [*self.messages, assistant_message(b.reasoning, b.content, b.calls)])
        return out


async def response_answer(run: ResponseRun) -> dict:
    last: dict = {}
    async for event in run.events():
        last = event
    return last["response"]


async def response_stream(run: ResponseRun) -> AsyncIterator:
    """SSE events (`event:` named, as OpenAI sends them) with sequence numbers; an engine failure
    becomes a `response.failed` event."""
    from sse_starlette import ServerSentEvent

    from server.streaming import sse_data

    seq = 0
    try:
        async for event in run.events():
            yield ServerSentEvent(data=sse_data({**event, "sequence_number": seq}), event=event["type"])
            seq += 1
    except EngineFailure as e:
        err = engine_error(e)
        failed = {**run.base, "status": "failed", "error": {"code": err.code or "server_error", "message": err.message}}
        yield ServerSentEvent(data=sse_data({"type": "response.failed", "response": failed, "sequence_number": seq}),
                              event="response.failed")
    finally:
        run.job.cancel()
