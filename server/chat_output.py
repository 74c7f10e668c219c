"""Generated chat text -> reasoning, content and tool calls, incrementally.

Both parsers take text in arbitrary pieces and hold back what could still turn out to be markup
(a partial `</think>` or `<tool_call>`, whitespace that may precede a call), so the streamed
deltas concatenate to exactly the non-streamed message: a non-streamed answer is built from the
same deltas.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from server.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    FUNCTION_CLOSE,
    FUNCTION_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    ToolSet,
    convert_value,
    parse_json_call,
    strip_value,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ToolCallDelta:
    """One piece of one call: the first carries id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn = {"name": self.name, **fn}
        out["function"] = fn
        return out


@dataclass
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def held_marker_prefix(buf: str, marker: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """<think>...</think> -> reasoning; the rest -> content. The prompt may already have opened
    the block (Qwen3.5 ends its generation prompt with "<think>\\n" when thinking is on)."""

    def __init__(self, starts_inside: bool) -> None:
        self._mode = "think" if starts_inside else "start"
        self._held = ""
        self._fresh = True  # strip newlines at the start of the reasoning / of the content after it

    def feed(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        if self._mode == "start":
            return self._start(buf)
        if self._mode == "think":
            return self._think(buf)
        return "", self._content(buf)

    def finish(self) -> tuple[str, str]:
        buf, self._held = self._held, ""
        return (self._strip_fresh(buf), "") if self._mode == "think" else ("", buf)

    def _start(self, buf: str) -> tuple[str, str]:
        """Before any content: the model may open a think block itself."""
        stripped = buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._mode = "think"
            return self._think(stripped[len(THINK_OPEN):])
        if THINK_OPEN.startswith(stripped):
            self._held = buf
            return "", ""
        self._mode, self._fresh = "content", False
        return "", buf

    def _think(self, buf: str) -> tuple[str, str]:
        at = buf.find(THINK_CLOSE)
        if at >= 0:
            reasoning = self._strip_fresh(buf[:at].rstrip("\n"))
            self._mode, self._fresh = "content", True
            return reasoning, self._content(buf[at + len(THINK_CLOSE):])
        keep = held_marker_prefix(buf, THINK_CLOSE)
        while keep < len(buf) and buf[len(buf) - keep - 1] == "\n":
            keep += 1  # newlines right before </think> are not part of the reasoning
        self._held = buf[len(buf) - keep:]
        return self._strip_fresh(buf[: len(buf) - keep]), ""

    def _content(self, text: str) -> str:
        return self._strip_fresh(text)

    def _strip_fresh(self, text: str) -> str:
        if self._fresh:
            text = text.lstrip("\n")
            self._fresh = not text
        return text


class ToolCallParser:
    """Content with <tool_call> blocks -> content outside them + ToolCallDelta records.

    Arguments stream as JSON text: '{"k": v' at the first parameter, ', "k2": v2' per later one,
    '}' at </function>; their concatenation is always one JSON object.
    """

    def __init__(self, tools: ToolSet) -> None:
        self._tools = tools
        self._held = ""  # outside a call: a partial "<tool_call>" or trailing whitespace
        # the end of the content shown so far: text outside a call is searched joined to it, so
        # that a "<" shown just before a call and "tool_call>" after it open a call instead of
        # reading as a tag in the content (elsewhere a partial tag ending the text is held, not shown)
        self._shown = ""
        self._call = ""  # inside a call: its text not consumed yet
        self._inside = False
        self._name: str | None = None
        self._params = 0
        self._args_closed = False
        self._skip_space = False  # right after a call: whitespace is layout, not content
        self.started = 0  # calls that got an index (a name)
        self.completed = 0  # calls whose </tool_call> arrived
        self.truncated = False  # the text ended inside a call

    @property
    def done(self) -> bool:
        """parallel_tool_calls false: everything after the first call is ignored."""
        return not self._tools.parallel and self.completed >= 1

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.done:
            return "", []
        if self._inside:
            self._call += text
            return self._in_call()
        return self._outside(self._held + text)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._inside and not self.done:
            self.truncated = True
            return "", self._close_truncated()
        held, self._held = self._held, ""
        return ("" if self.started or self.done else held), []

    def _outside(self, buf: str) -> tuple[str, list[ToolCallDelta]]:
        if self._skip_space:
            buf = buf.lstrip()
            self._skip_space = not buf
        prefix = self._shown[len(self._shown) - held_marker_prefix(self._shown, CALL_OPEN):]
        joined = prefix + buf  # the prefix was shown already: only buf's part is content here
        at = joined.find(CALL_OPEN)
        if at >= 0:
            self._held = ""
            before = self._show(buf[: max(0, at - len(prefix))].rstrip())
            self._open_call(joined[at + len(CALL_OPEN):])
            content, deltas = self._in_call()
            return before + content, deltas
        keep = held_marker_prefix(joined, CALL_OPEN)
        while keep < len(joined) and joined[len(joined) - keep - 1].isspace():
            keep += 1  # may be the blank line before a call
        keep = min(keep, len(buf))  # what is held may complete a tag begun by what was shown
        self._held = buf[len(buf) - keep:]
        return self._show(buf[: len(buf) - keep]), []

    def _show(self, content: str) -> str:
        self._shown = (self._shown + content)[-(len(CALL_OPEN) - 1):]
        return content

    def _open_call(self, text: str) -> None:
        self._inside, self._call = True, text
        self._name, self._params, self._args_closed = None, 0, False

    def _in_call(self) -> tuple[str, list[ToolCallDelta]]:
        deltas: list[ToolCallDelta] = []
        if self._name is None:
            state = self._header(deltas)
            if state != "named":
                return self._after_close(deltas, counted=state == "parsed") if state != "wait" else ("", deltas)
        while True:
            step = self._parameter_or_end(deltas)
            if step == "wait":
                return "", deltas
            if step == "closed":
                return self._after_close(deltas, counted=True)

    def _after_close(self, deltas: list[ToolCallDelta], counted: bool) -> tuple[str, list[ToolCallDelta]]:
        """The call's </tool_call> arrived: go on with the text after it."""
        self._inside, self._skip_space = False, True
        self.completed += counted
        if self.done:
            return "", deltas
        content, more = self._outside(self._call)
        return content, deltas + more

    def _header(self, deltas: list[ToolCallDelta]) -> str:
        """Find <function=NAME> or a whole JSON call: -> "named" | "parsed" | "dropped" | "wait"."""
        if self._call.lstrip().startswith("{"):
            return self._json_call(deltas)
        end = self._call.find(CALL_CLOSE)
        m = FUNCTION_OPEN.search(self._call, 0, end if end >= 0 else len(self._call))
        if m is None:
            if end < 0:
                return "wait"
            self._call = self._call[end + len(CALL_CLOSE):]  # a call without a function is dropped
            return "dropped"
        self._name = m.group(1).strip()
        deltas.append(ToolCallDelta(self.started, f"call_{uuid.uuid4().hex[:24]}", self._name, ""))
        self.started += 1
        self._call = self._call[m.end():]
        return "named"

    def _json_call(self, deltas: list[ToolCallDelta]) -> str:
        end = self._call.find(CALL_CLOSE)
        if end < 0:
            return "wait"
        parsed = parse_json_call(self._call[:end])
        self._call = self._call[end + len(CALL_CLOSE):]
        if parsed is None:
            return "dropped"
        name, args = parsed
        deltas.append(ToolCallDelta(self.started, f"call_{uuid.uuid4().hex[:24]}", name,
                                    json.dumps(args, ensure_ascii=False)))
        self.started += 1
        return "parsed"

    def _parameter_or_end(self, deltas: list[ToolCallDelta]) -> str:
        """Consume one parameter, or the end of the call: -> "param" | "closed" | "wait"."""
        text = self._call
        ends = [i for i in (text.find(FUNCTION_CLOSE), text.find(CALL_CLOSE)) if i >= 0]
        end = min(ends) if ends else -1
        m = PARAMETER_OPEN.search(text)
        if m is not None and (end < 0 or m.start() < end):
            close = text.find(PARAMETER_CLOSE, m.end())
            if close < 0 and end < m.end():
                return "wait"
            value_end = close if close >= 0 else end  # an unclosed value ends at the function's end
            self._add_param(m.group(1).strip(), text[m.end():value_end], deltas)
            self._call = text[value_end + (len(PARAMETER_CLOSE) if close >= 0 else 0):]
            return "param"
        if end < 0:
            return "wait"
        self._close_args(deltas)
        call_end = text.find(CALL_CLOSE)
        if call_end < 0:
            self._call = text[end:]
            return "wait"
        self._call = text[call_end + len(CALL_CLOSE):]
        return "closed"

    def _add_param(self, key: str, raw: str, deltas: list[ToolCallDelta]) -> None:
        value = convert_value(strip_value(raw), self._tools.types_of(self._name or "", key))
        sep = "{" if self._params == 0 else ", "
        self._params += 1
        pair = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        deltas.append(ToolCallDelta(self.started - 1, arguments=sep + pair))

    def _close_args(self, deltas: list[ToolCallDelta]) -> None:
        if not self._args_closed:
            self._args_closed = True
            deltas.append(ToolCallDelta(self.started - 1, arguments="}" if self._params else "{}"))

    def _close_truncated(self) -> list[ToolCallDelta]:
        """The answer ended inside a call: close its arguments so they stay valid JSON."""
        deltas: list[ToolCallDelta] = []
        if self._name is not None:
            self._close_args(deltas)
        self._inside = False
        return deltas


class ChatOutputParser:
    """Reasoning split first, then tool calls in the content (when the request enables tools)."""

    def __init__(self, starts_in_think: bool, tools: ToolSet | None) -> None:
        self._reasoning = ReasoningSplitter(starts_in_think)
        self.calls = ToolCallParser(tools) if tools is not None else None

    def feed(self, text: str) -> ChatPiece:
        return self._piece(*self._reasoning.feed(text), final=False)

    def finish(self) -> ChatPiece:
        return self._piece(*self._reasoning.finish(), final=True)

    def _piece(self, reasoning: str, content: str, final: bool) -> ChatPiece:
        if self.calls is None:
            return ChatPiece(reasoning, content)
        text, deltas = self.calls.feed(content) if content else ("", [])
        if final:
            tail, more = self.calls.finish()
            text, deltas = text + tail, deltas + more
        return ChatPiece(reasoning, text, deltas)

    @property
    def tool_calls_done(self) -> bool:
        """No more output is wanted (parallel_tool_calls false and one call is complete)."""
        return self.calls is not None and self.calls.done

    @property
    def made_calls(self) -> bool:
        return self.calls is not None and self.calls.started > 0


def merge_tool_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """Streamed deltas -> the non-streamed message's tool_calls."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]
