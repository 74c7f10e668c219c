"""server.streaming.StopMatcher: streamed output with stop strings equals the non-streamed cut."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from server.streaming import StopMatcher, sse_data

ALPHABET = "abc\n"


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s and s in text]  # the earliest start wins
    return (text[: min(hits)], True) if hits else (text, False)


def stream(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        safe, stopped = m.feed(p)
        out.append(safe)
        if stopped:
            return out, True
    rest, stopped = m.flush()
    return out + [rest], stopped


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(ALPHABET, max_size=4), max_size=12),
       st.lists(st.text(ALPHABET, min_size=0, max_size=4), max_size=6))
def test_streamed_cut_equals_reference(pieces, stops):
    out, stopped = stream(pieces, stops)
    want, want_stopped = reference_cut("".join(pieces), stops)
    assert "".join(out) == want
    assert stopped == want_stopped


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(ALPHABET, max_size=4), max_size=12), st.lists(st.text(ALPHABET, min_size=1, max_size=4),
                                                                       min_size=1, max_size=6))
def test_no_prefix_of_a_stop_string_leaks_before_the_stop(pieces, stops):
    """Every emitted prefix of the output is a prefix of the reference cut: nothing is taken back."""
    out, _ = stream(pieces, stops)
    want, _ = reference_cut("".join(pieces), stops)
    emitted = ""
    for p in out:
        emitted += p
        assert want.startswith(emitted)


def test_holds_back_a_possible_start_then_releases_it():
    m = StopMatcher(["</end>"])
    assert m.feed("hello </e") == ("hello ", False)
    assert m.feed("x") == ("</ex", False)
    assert m.feed("</en") == ("", False)
    assert m.feed("d> tail") == ("", True)


def test_earliest_of_many_stops_wins():
    m = StopMatcher([f"s{i}" for i in range(20)] + ["b", "ab"])
    assert m.feed("xxa") == ("xx", False)
    assert m.feed("b") == ("", True)  # "ab" starts before "b"


def test_a_longer_stop_that_started_earlier_wins():
    """'a' is complete at index 1, but '\\naa' started at 0 and may still complete: wait and see."""
    m = StopMatcher(["a", "\naa"])
    assert m.feed("\n") == ("", False)
    assert m.feed("a") == ("", False)
    assert m.feed("a") == ("", True) and m.matched == "\naa"
    m = StopMatcher(["a", "\naa"])
    assert m.feed("\na") == ("", False)
    assert m.feed("b") == ("\n", True) and m.matched == "a"  # ruled out: the earlier 'a' stands
    m = StopMatcher(["a", "\naa"])
    assert m.feed("\na") == ("", False)
    assert m.flush() == ("\n", True)  # the text ended: 'a' stands


def test_sse_payloads_survive_splitlines():
    """httpx's aiter_lines and many Python clients split on every str.splitlines() break."""
    text = "a\x85b\u2028c\u2029d\x1ce\x0bf\x0cg\rh\ni é"
    line = sse_data({"content": text})
    assert line.splitlines() == [line]
    assert json.loads(line)["content"] == text and "é" in line
