"""/v1/chat/completions and /v1/completions: run a planned job, answer as JSON or as SSE chunks.

The choices of one job run one after another; both the streamed and the non-streamed answer are
built from the same per-choice deltas, so they agree token for token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.types import Stats
from server.bridge import EngineFailure, Job
from server.chat_output import ChatOutputParser, ChatPiece, merge_tool_calls
from server.errors import APIError, error_body
from server.logprobs import TokenTexts, chat_entries, legacy_block
from server.planning import ChatPlan, Planned
from server.schemas import timings_block, usage_block
from server.streaming import SSE_DONE, ChunkContext, TextAssembler, TextDelta, sse_data


async def choice_deltas(job: Job, planned: Planned, tokenizer) -> AsyncIterator[tuple[int, TextDelta]]:
    """(choice index, TextDelta) for every choice in turn; a stop string cancels just its choice."""
    for index, req in enumerate(job.requests):
        assembler = TextAssembler(tokenizer, planned.stops, req.sampling.stop_token_ids, planned.reasoning_first)
        while True:
            delta = assembler.feed(await job.next_step())
            if assembler.stop_hit:
                req.cancel.set()
            yield index, delta
            if delta.finish_reason is not None:
                break


def engine_error(e: EngineFailure) -> APIError:
    """400 (the engine refused the request), 500 (it failed on it) or 503 (the server stopped)."""
    return APIError(str(e), status=e.status, code=e.code)


@dataclass
class Totals:
    """Usage and timings over all choices of one response."""

    planned: Planned
    stats: list[Stats] = field(default_factory=list)  # one per finished choice, in order
    # tokens generated after a stop string or a finished tool call, before the cancel landed: not
    # part of any answer, so not in usage (timings still count what the engine did)
    dropped: int = 0

    def usage(self) -> dict:
        generated = sum(s.generated_tokens for s in self.stats) - self.dropped
        # The first choice of each prompt shows what the cache held before this request.
        cached = sum(s.cached_tokens for s in self.stats[:: self.planned.choices_per_prompt])
        return usage_block(self.planned.prompt_tokens, generated, cached)

    def timings(self) -> dict:
        return timings_block(combine_stats(self.stats))

    def finish(self, stats: Stats, index: int, choices: int) -> dict | None:
        """Record a finished choice; the last one carries the timings unless a usage chunk follows."""
        self.stats.append(stats)
        return self.timings() if index == choices - 1 and not self.planned.include_usage else None


async def framed(job: Job, totals: Totals, ctx: ChunkContext, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """An answer's chunks, then the usage chunk if asked for; an engine failure becomes an error
    event; always [DONE] last, and the job is cancelled whatever ended the stream."""
    try:
        async for payload in events:
            yield payload
        if totals.planned.include_usage:
            yield sse_data({**ctx.chunk([], totals.timings()), "usage": totals.usage()})
    except EngineFailure as e:
        err = engine_error(e)
        yield sse_data(error_body(err.message, err.type, err.param, err.code))
    finally:
        job.cancel()
    yield SSE_DONE


def combine_stats(stats: list[Stats]) -> Stats:
    if len(stats) == 1:
        return stats[0]
    total = Stats()
    for s in stats:
        for f in dataclasses.fields(Stats):
            setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
    return total


# ---------------------------------------------------------------- chat


class ChatChoice:
    """One chat choice being generated: output parsing, logprobs and the finish reason."""

    def __init__(self, index: int, plan: ChatPlan, texts: TokenTexts) -> None:
        self.index = index
        self.plan = plan
        self.texts = texts
        self.parser = ChatOutputParser(plan.starts_in_think, plan.tools)
        self.pending: list = []  # logprob records not sent yet

    def opening(self, ctx: ChunkContext) -> list[str]:
        """SSE payloads that open this choice: the role."""
        return [sse_data(ctx.chunk([_chat_choice(self.index, {"role": "assistant", "content": ""})]))]

    def feed(self, delta: TextDelta) -> ChatPiece:
        self.pending += delta.logprobs
        piece = self.parser.feed(delta.text)
        return join_pieces(piece, self.parser.finish()) if delta.finish_reason is not None else piece

    def take_logprobs(self) -> dict | None:
        if self.plan.planned.logprobs is None:
            return None
        records, self.pending = self.pending, []
        return {"content": chat_entries(records, self.texts)}

    def finish_reason(self, delta: TextDelta) -> str:
        """An EOS inside a call (no closing tags) still ends the answer with that call."""
        reason = delta.finish_reason or "stop"
        if self.parser.made_calls and reason == "stop":
            return "function_call" if self.plan.legacy_functions else "tool_calls"
        return reason

    @property
    def wants_no_more(self) -> bool:
        return self.parser.tool_calls_done


def delta_dict(piece: ChatPiece, legacy_functions: bool = False) -> dict:
    out: dict = {}
    if piece.reasoning:
        out["reasoning_content"] = piece.reasoning
    if piece.content:
        out["content"] = piece.content
    if piece.tool_calls and legacy_functions:  # the legacy API's one call per answer
        fn = piece.tool_calls[0].openai()["function"]
        out["function_call"] = fn
    elif piece.tool_calls:
        out["tool_calls"] = [d.openai() for d in piece.tool_calls]
    return out


def chat_events(job: Job, plan: ChatPlan, ctx: ChunkContext, tokenizer, texts: TokenTexts) -> AsyncIterator[str]:
    """SSE payloads of a streamed chat answer; an engine failure becomes an error event."""
    totals = Totals(plan.planned)
    return framed(job, totals, ctx, _chat_chunks(job, plan, ctx, tokenizer, texts, totals))


async def _chat_chunks(job, plan: ChatPlan, ctx: ChunkContext, tokenizer, texts, totals: Totals):
    # Choice 0's role chunk goes out at once, before the job leaves the queue.
    choice = ChatChoice(0, plan, texts)
    for chunk in choice.opening(ctx):
        yield chunk
    async for index, delta in choice_deltas(job, plan.planned, tokenizer):
        if index != choice.index:
            choice = ChatChoice(index, plan, texts)
            for chunk in choice.opening(ctx):
                yield chunk
        totals.dropped += delta.tokens if choice.wants_no_more else delta.dropped
        piece = choice.feed(delta)
        if choice.wants_no_more:
            job.requests[index].cancel.set()
        if piece:
            delta_body = delta_dict(piece, plan.legacy_functions)
            yield sse_data(ctx.chunk([_chat_choice(index, delta_body, choice.take_logprobs())]))
        if delta.finish_reason is not None:
            timings = totals.finish(delta.final_stats, index, len(job.requests))
            yield sse_data(ctx.chunk([_chat_choice(index, {}, choice.take_logprobs(),
                                                   choice.finish_reason(delta))], timings))


def join_pieces(a: ChatPiece, b: ChatPiece) -> ChatPiece:
    return ChatPiece(a.reasoning + b.reasoning, a.content + b.content, a.tool_calls + b.tool_calls)


def _chat_choice(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


async def chat_answer(job: Job, plan: ChatPlan, ctx: ChunkContext, tokenizer, texts: TokenTexts) -> dict:
    """The non-streamed chat.completion."""
    totals = Totals(plan.planned)
    out: list[dict] = []
    pieces: list[ChatPiece] = []
    records: list = []
    choice = None
    async for index, delta in choice_deltas(job, plan.planned, tokenizer):
        if choice is None or choice.index != index:
            choice, pieces, records = ChatChoice(index, plan, texts), [], []
        totals.dropped += delta.tokens if choice.wants_no_more else delta.dropped
        pieces.append(choice.feed(delta))
        records += delta.logprobs
        if choice.wants_no_more:
            job.requests[index].cancel.set()
        if delta.finish_reason is not None:
            totals.stats.append(delta.final_stats)
            out.append(_chat_message(index, pieces, choice, delta, records))
            choice = None
    body = ctx.base()
    body.update(choices=out, usage=totals.usage(), timings=totals.timings())
    return body


def _chat_message(index: int, pieces: list[ChatPiece], choice: ChatChoice, delta: TextDelta, records) -> dict:
    content = "".join(p.content for p in pieces)
    reasoning = "".join(p.reasoning for p in pieces)
    calls = merge_tool_calls([d for p in pieces for d in p.tool_calls])
    message: dict = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls and choice.plan.legacy_functions:
        message["function_call"] = calls[0]["function"]
    elif calls:
        message["tool_calls"] = calls
    finish = choice.finish_reason(delta)
    logprobs = None if choice.plan.planned.logprobs is None else {"content": chat_entries(records, choice.texts)}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


# ---------------------------------------------------------------- legacy completions


class CompletionChoice:
    """Text and legacy logprobs of one completion choice (echo puts the prompt first)."""

    def __init__(self, index: int, planned: Planned, texts: TokenTexts) -> None:
        self.index = index
        self.planned = planned
        self.texts = texts
        self.echo = planned.echo[index] if planned.echo else ""
        self.offset = 0  # characters of this choice's text sent so far

    def start(self) -> tuple[str, dict | None]:
        prompt_ids = self.planned.requests[self.index].prompt_ids if self.echo else []
        return self.echo, self.logprobs([], self.echo, prompt_ids)

    def logprobs(self, records, text: str, prompt_ids=()) -> dict | None:
        if self.planned.logprobs is None:
            self.offset += len(text)
            return None
        block = legacy_block(records, self.texts, self.offset, list(prompt_ids))
        self.offset += len(text)
        return block


def completion_events(job: Job, planned: Planned, ctx: ChunkContext, tokenizer,
                      texts: TokenTexts) -> AsyncIterator[str]:
    totals = Totals(planned)
    return framed(job, totals, ctx, _completion_chunks(job, planned, ctx, tokenizer, texts, totals))


async def _completion_chunks(job, planned: Planned, ctx: ChunkContext, tokenizer, texts, totals: Totals):
    choice = None
    async for index, delta in choice_deltas(job, planned, tokenizer):
        if choice is None or choice.index != index:
            choice = CompletionChoice(index, planned, texts)
            text, lp = choice.start()
            if text:
                yield sse_data(ctx.chunk([_text_choice(index, text, lp)]))
        totals.dropped += delta.dropped
        if delta.text or delta.logprobs:
            yield sse_data(ctx.chunk([_text_choice(index, delta.text, choice.logprobs(delta.logprobs,
                                                                                       delta.text))]))
        if delta.finish_reason is not None:
            timings = totals.finish(delta.final_stats, index, len(job.requests))
            yield sse_data(ctx.chunk([_text_choice(index, "", None, delta.finish_reason)], timings))


def _text_choice(index: int, text: str, logprobs: dict | None, finish: str | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


async def completion_answer(job: Job, planned: Planned, ctx: ChunkContext, tokenizer, texts: TokenTexts) -> dict:
    totals = Totals(planned)
    out, parts, records = [], [], []
    async for index, delta in choice_deltas(job, planned, tokenizer):
        totals.dropped += delta.dropped
        parts.append(delta.text)
        records += delta.logprobs
        if delta.finish_reason is None:
            continue
        totals.stats.append(delta.final_stats)
        choice = CompletionChoice(index, planned, texts)
        text = "".join(parts)
        lp = None
        if planned.logprobs is not None:
            prompt_ids = planned.requests[index].prompt_ids if choice.echo else []
            lp = legacy_block(records, texts, 0, list(prompt_ids))
        out.append(_text_choice(index, choice.echo + text, lp, delta.finish_reason))
        parts, records = [], []
    body = ctx.base()
    body.update(choices=out, usage=totals.usage(), timings=totals.timings())
    return body
