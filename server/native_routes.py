"""llama.cpp's native routes: /infill (editor FIM), /completion, /tokenize, /detokenize.

/infill builds llama.cpp's FIM prompt: project context from input_extra, then
<|fim_prefix|>{input_prefix}<|fim_suffix|>{input_suffix}<|fim_middle|>{prompt}; with repo-level
tokens (<|file_sep|>) each extra chunk is "<|file_sep|>{filename}\\n{text}", otherwise chunks are
joined with a plain "--- snippet ---" separator. When it does not fit the context the prefix loses
its start, the suffix its end and the extra context its oldest part (the prefix gets 3/4).

Answers have llama.cpp's shape: {content, stop, tokens_predicted, tokens_evaluated, timings, ...};
streamed, every event is one such object (stop false, then a last one with stop true), no [DONE].
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from server.bridge import EngineFailure, Job
from server.chat import ChatRenderOptions
from server.errors import APIError
from server.logprobs import TokenTexts
from server.native_schemas import (
    DetokenizeRequest,
    InfillRequest,
    NativeCompletionRequest,
    NativeFields,
    TokenizeRequest,
)
from server.openai_routes import choice_deltas, engine_error
from server.planning import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, Planned, Planner
from server.schemas import timings_block
from server.streaming import TextDelta, sse_data

REPO_NAME, FILE_SEP = "<|repo_name|>", "<|file_sep|>"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass
class NativePlan:
    planned: Planned
    body: NativeFields
    truncated: bool


def plan_infill(planner: Planner, body: InfillRequest) -> NativePlan:
    """The editor's text is tokenized with special tokens read as text (as llama.cpp does): a file that
    spells out "<|fim_middle|>" must not end the prefix. Text far beyond what the context can hold
    is cut (by characters) before tokenizing; the token-level cut below decides what stays."""
    planner.require_fim("input_prefix")
    tok = planner.tokenizer
    context = planner.engine.config.max_context
    # characters: at least `context` tokens of text, and some more so that the cut is never in the part kept
    keep = tok.max_text_bytes(context) + 4096
    special = {t: tok.token_id(t) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, REPO_NAME, FILE_SEP)}
    extra = _extra_context(planner, body, special, keep)
    planner.check_text_fits(body.prompt, "prompt")
    prefix, suffix, prompt = tok.encode_many([body.input_prefix[-keep:], body.input_suffix[:keep], body.prompt],
                                             special=False)
    wanted = body.requested_max_tokens
    reserve = min(wanted if wanted is not None else context // 4, context // 2)
    room = context - 1 - reserve - 3 - len(prompt)  # the engine needs the prompt shorter than the context
    if room < 0:
        raise APIError(f"the infill prompt does not fit the context of {context} tokens", param="prompt",
                       code="context_length_exceeded")
    take_prefix = min(len(prefix), max(room * 3 // 4, room - len(suffix)))
    take_suffix = min(len(suffix), room - take_prefix)
    take_extra = min(len(extra), room - take_prefix - take_suffix)
    ids = (extra[len(extra) - take_extra:] + [special[FIM_PREFIX]] + prefix[len(prefix) - take_prefix:]
           + [special[FIM_SUFFIX]] + suffix[:take_suffix] + [special[FIM_MIDDLE]] + prompt)
    truncated = (take_prefix, take_suffix, take_extra) != (len(prefix), len(suffix), len(extra))
    return NativePlan(planner.plan([ids], body, wanted, "prompt"), body, truncated)


def _extra_context(planner: Planner, body: InfillRequest, special: dict, keep: int) -> list[int]:
    """The project context; only its newest `keep` characters are tokenized (the oldest go first)."""
    tok = planner.tokenizer
    chunks: list[tuple[str, str]] = []  # (filename, text), oldest first
    room = keep
    for chunk in reversed(body.input_extra):
        if room <= 0:
            break
        text = chunk.text[-room:]
        chunks.insert(0, (chunk.filename[:room], text))
        room -= len(text) + len(chunk.filename)
    out: list[int] = []
    if special[FILE_SEP] is None:
        for text in tok.encode_many([text for _, text in chunks], special=False):
            out += tok.encode(SNIPPET_SEPARATOR) + text
        return out
    if special[REPO_NAME] is not None:
        out += [special[REPO_NAME]] + tok.encode("myproject\n")
    pieces = tok.encode_many([t for name, text in chunks for t in (f"{name}\n", text)], special=False)
    for name, text in zip(pieces[::2], pieces[1::2]):
        out += [special[FILE_SEP]] + name + text
    return out + [special[FILE_SEP]] + tok.encode("filename\n")


def plan_native_completion(planner: Planner, body: NativeCompletionRequest) -> NativePlan:
    p = body.prompt
    ids = planner.text_ids(p, "prompt") if isinstance(p, str) else planner.checked_ids(p, "prompt")
    return NativePlan(planner.plan([ids], body, body.requested_max_tokens, "prompt"), body, False)


class EditorLimits:
    """llama.cpp's FIM stopping rules: n_indent (a new line indented less than the cursor ends the
    answer, cut before that line's text) and t_max_predict_ms (once a newline is out, stop when
    the time budget is spent)."""

    def __init__(self, body: NativeFields) -> None:
        self.n_indent = body.n_indent or 0
        self.t_max_s = (body.t_max_predict_ms or 0) / 1e3
        self.text = ""
        self.started = time.monotonic()
        self.hit = False
        self._scan = 0  # where to look for the next newline
        self._line: int | None = None  # start of the line whose indentation is not decided yet

    def feed(self, text: str) -> str:
        if self.n_indent:
            text = self._indent_cut(text)
        self.text += text
        if self.t_max_s and "\n" in self.text and time.monotonic() - self.started > self.t_max_s:
            self.hit = True
        return text

    def _indent_cut(self, text: str) -> str:
        """The new text, cut where a line (after the first) starts less indented than n_indent."""
        whole, start = self.text + text, len(self.text)
        while True:
            if self._line is None:
                nl = whole.find("\n", self._scan)
                if nl < 0:
                    self._scan = len(whole)
                    return text
                self._line = nl + 1
            i = self._line
            while i < len(whole) and whole[i] in " \t":
                i += 1
            if i == len(whole):
                return text  # only indentation so far: undecided
            if whole[i] != "\n" and i - self._line < self.n_indent:
                self.hit = True
                return whole[start:i]
            self._scan, self._line = self._line, None


def native_result(plan: NativePlan, model: str, index: int, text: str, delta: TextDelta, limits: EditorLimits,
                  prompt_text: str) -> dict:
    """The final object of one llama.cpp completion (non-streamed answer or last streamed event)."""
    stats = delta.final_stats
    stop_type = "limit" if limits.hit else delta.stop_kind or "none"
    req = plan.planned.requests[index]
    out: dict = {
        "index": index, "content": text, "tokens": [], "id_slot": 0, "stop": True, "model": model,
        "tokens_predicted": stats.generated_tokens, "tokens_evaluated": stats.prompt_tokens,
        "generation_settings": {"n_predict": req.sampling.max_tokens, "seed": req.sampling.seed,
                                "temperature": req.sampling.temperature, "top_k": req.sampling.top_k,
                                "top_p": req.sampling.top_p, "min_p": req.sampling.min_p,
                                "n_indent": limits.n_indent},
        "prompt": prompt_text, "has_new_line": "\n" in text, "truncated": plan.truncated,
        "stop_type": stop_type, "stopping_word": delta.stop_word if stop_type == "word" else "",
        "tokens_cached": stats.prompt_tokens + stats.generated_tokens, "timings": timings_block(stats),
    }
    return project(out, plan.body.response_fields)


def project(result: dict, fields: list[str] | None) -> dict:
    """llama.cpp's response_fields: keep only these, named by their path ("timings/prompt_n")."""
    if fields is None:
        return result
    out = {}
    for path in fields:
        node = result
        for key in path.split("/"):
            node = node.get(key, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            out[path] = node
    return out


_MISSING = object()


async def native_runs(job: Job, plan: NativePlan, tokenizer) -> AsyncIterator[tuple[int, str, TextDelta, EditorLimits]]:
    """(choice, text delta, TextDelta, limits) with the editor stopping rules applied."""
    limits: dict[int, EditorLimits] = {}
    async for index, delta in choice_deltas(job, plan.planned, tokenizer):
        lim = limits.setdefault(index, EditorLimits(plan.body))
        text = lim.feed(delta.text) if not lim.hit else ""
        if lim.hit:
            job.requests[index].cancel.set()
        yield index, text, delta, lim


async def native_answer(job: Job, plan: NativePlan, model: str, tokenizer) -> dict | list[dict]:
    results, parts = [], []
    async for index, text, delta, lim in native_runs(job, plan, tokenizer):
        parts.append(text)
        if delta.finish_reason is not None:
            prompt = tokenizer.decode(plan.planned.requests[index].prompt_ids, skip_special=False)
            results.append(native_result(plan, model, index, "".join(parts), delta, lim, prompt))
            parts = []
    return results[0] if len(results) == 1 else results


async def native_events(job: Job, plan: NativePlan, model: str, tokenizer) -> AsyncIterator[str]:
    try:
        async for index, text, delta, lim in native_runs(job, plan, tokenizer):
            if delta.finish_reason is None:
                if text:
                    yield sse_data(_partial(index, text, job))
                continue
            prompt = tokenizer.decode(plan.planned.requests[index].prompt_ids, skip_special=False)
            if text:
                yield sse_data(_partial(index, text, job))
            yield sse_data(native_result(plan, model, index, "", delta, lim, prompt))
    except EngineFailure as e:
        err = engine_error(e)
        yield sse_data({"error": {"message": err.message, "type": err.type, "code": err.status}})
    finally:
        job.cancel()


def _partial(index: int, text: str, job: Job) -> dict:
    return {"index": index, "content": text, "tokens": [], "stop": False, "id_slot": 0,
            "tokens_evaluated": len(job.requests[index].prompt_ids)}


def tokenize(planner: Planner, texts: TokenTexts, body: TokenizeRequest) -> dict:
    """Text that cannot fit the context is refused, as it would be as a prompt (the count is the point
    of /tokenize, and it would be more than the context either way)."""
    tok = planner.tokenizer
    if body.messages is not None:
        prompt = planner.render(body.messages, ChatRenderOptions(extra=dict(body.chat_template_kwargs or {})))
        planner.check_text_fits(prompt.text, "messages")
        ids = planner.encode_chat(prompt)
    else:
        param = "content" if body.content is not None else "prompt"
        ids = planner.text_ids(getattr(body, param), param, special=body.parse_special is not False)
    if body.add_special and tok.bos_token and (bos := tok.token_id(tok.bos_token)) is not None:
        ids = [bos] + ids
    if body.content is None:  # vLLM's shape
        return {"count": len(ids), "max_model_len": planner.engine.config.max_context, "tokens": ids}
    if not body.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": _piece(texts, i)} for i in ids]}


def _piece(texts: TokenTexts, token_id: int):
    """llama.cpp: the piece as a string, or as its byte values when it is not valid UTF-8 alone."""
    raw = texts.bytes_of(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def detokenize(planner: Planner, body: DetokenizeRequest) -> dict:
    context = planner.engine.config.max_context
    if len(body.tokens) > context:
        raise APIError(f"at most {context} token ids (the context length) can be detokenized at once, got "
                       f"{len(body.tokens)}", param="tokens")
    ids = planner.checked_ids(body.tokens, "tokens")
    text = planner.tokenizer.decode(ids, skip_special=False)
    return {"content": text, "prompt": text}
