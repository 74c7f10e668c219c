"""spruce bench without a server: percentiles, speeds, repetitiveness, long prompts, records, report, plots."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest

from server.bench.prompts import (
    PromptSetError,
    class_names,
    long_context_prompt,
    make_token_counter,
    select_prompts,
)
from server.bench.records import ClassSummary, EngineResult, PromptResult, RunRecord, load, save
from server.bench.report import render_markdown
from server.bench.stats import (
    decode_tps,
    distinct_ngram_share,
    held_back,
    percentile,
    prefill_tps,
    summarize_class,
    tokens_per_forward,
)

BUNDLED_TOKENIZER = Path(__file__).resolve().parents[2] / "engine" / "bundled" / "target"


def run(arrivals, tokens, text="a b c", timings=None, prompt_tokens=20, cached=0) -> RunRecord:
    return RunRecord(ttft_ms=arrivals[0] if arrivals else None, total_ms=(arrivals or [0])[-1] + 1.0,
                     arrivals_ms=list(arrivals), text=text, reasoning="", finish_reason="length",
                     prompt_tokens=prompt_tokens, cached_tokens=cached, completion_tokens=tokens,
                     tokens_counted="usage", timings=timings)


def test_percentile_hand_values():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99
    assert percentile([7.0], 99) == 7.0
    assert percentile([5, 1, 3], 0) == 1 and percentile([5, 1, 3], 100) == 5
    assert percentile([0, 10], 95) == pytest.approx(9.5)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


@pytest.mark.parametrize("seed", range(5))
def test_percentile_matches_numpy(seed):
    rng = random.Random(seed)
    xs = [rng.expovariate(0.1) for _ in range(rng.randint(1, 300))]
    for q in (0, 1, 50, 90, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)


def test_distinct_ngram_share():
    assert distinct_ngram_share("one two three") is None  # fewer than 8 words
    assert distinct_ngram_share("a b c d e f g h") == 1.0
    loop = " ".join(["x"] * 20)  # 13 eight-grams, all the same
    assert distinct_ngram_share(loop) == pytest.approx(1 / 13)
    assert distinct_ngram_share("a b c d e f g h a b c d e f g h") == pytest.approx(8 / 9)


def test_decode_speed_from_arrivals_and_burst():
    r = run([100.0 + 10 * i for i in range(11)], tokens=11)
    assert decode_tps(r) == pytest.approx(100.0)  # 10 tokens after the first in 100 ms
    assert not held_back(r)
    r2 = run([100.0, 150.0], tokens=5)  # several tokens per chunk: counted from usage
    assert decode_tps(r2) == pytest.approx(80.0)
    burst = run([800.0 + 0.01 * i for i in range(25)], tokens=32)
    assert held_back(burst) and decode_tps(burst) is None
    assert decode_tps(run([5.0], tokens=1)) is None


def test_prefill_and_tokens_per_forward_sources():
    spruce = {"prompt_per_second": 250.0, "tokens_per_forward": 2.5, "predicted_n": 10, "draft_n": 8,
              "draft_n_accepted": 6}
    assert prefill_tps(run([100.0, 110.0], 2, timings=spruce)) == (250.0, "server")
    assert prefill_tps(run([200.0, 210.0], 2, prompt_tokens=120, cached=20)) == (pytest.approx(500.0), "client")
    assert prefill_tps(run([200.0, 210.0], 2, prompt_tokens=20, cached=20)) == (None, None)
    assert tokens_per_forward(run([1.0, 2.0], 2, timings=spruce)) == 2.5
    llama = {"predicted_n": 30, "draft_n": 20, "draft_n_accepted": 15}  # 15 forwards for 30 tokens
    assert tokens_per_forward(run([1.0, 2.0], 2, timings=llama)) == 2.0
    assert tokens_per_forward(run([1.0, 2.0], 2, timings={"predicted_n": 30})) == 1.0  # no drafting
    assert tokens_per_forward(run([1.0, 2.0], 2)) is None  # the server says nothing


def test_summarize_class_pools_gaps_and_compares_texts():
    words = "def merge(a, b): return sorted(a + b) # merged lists here and now"
    p1 = PromptResult("p1", "code", runs=[run([10.0, 20.0, 40.0], 3, text=words), run([10.0, 15.0], 2, text=words)])
    p2 = PromptResult("p2", "code", runs=[run([30.0, 90.0], 2, text="other")])
    failed = PromptResult("p3", "code", error="HTTP 500: boom")
    row = summarize_class("code", [p1, p2, failed], reference={"p1": words, "p2": "different"})
    gaps = [10.0, 20.0, 5.0, 60.0]
    assert row.itl_samples == 4
    assert row.itl_p50_ms == percentile(gaps, 50) and row.itl_p99_ms == percentile(gaps, 99)
    assert row.same_as_reference == "1/2" and row.stable is True
    assert row.runs == 3 and row.prompts == 2 and "1 of 3 prompts failed: HTTP 500: boom" in row.note
    assert row.tokens_per_chunk == pytest.approx(7 / 7)
    assert summarize_class("code", [p1], reference=None).same_as_reference is None
    unstable = PromptResult("p1", "code", runs=[run([1.0, 2.0], 2, text="a"), run([1.0, 2.0], 2, text="b")])
    assert summarize_class("code", [unstable], None).stable is False


def test_prompt_selection():
    assert class_names()[:4] == ["code", "code-edit", "math", "chat"]
    ps = select_prompts(["code", "chat"], 1, None)
    assert [(p.cls, p.id) for p in ps] == [("code", "merge-sorted"), ("chat", "season")]
    assert ps[0].text == "Write a python function to merge two sorted lists"  # the seeds' prompt
    with pytest.raises(PromptSetError, match="unknown prompt class nope"):
        select_prompts(["nope"], None, None)
    with pytest.raises(PromptSetError, match="no tokenizer.json"):
        make_token_counter("/nonexistent/dir")


@pytest.mark.parametrize("target", [300, 1000, 3800])
def test_long_context_prompt_fits_its_token_target(target):
    count = make_token_counter(BUNDLED_TOKENIZER)
    text = long_context_prompt(target, 4, "Explain `{function}`.", count)
    n = count(text)
    assert target - 150 < n <= target  # cut at a function boundary (one function is < 150 tokens)
    assert text == long_context_prompt(target, 4, "Explain `{function}`.", count)  # same text every time
    name = text.rsplit("`", 2)[1]
    assert f"def {name}(" in text
    assert long_context_prompt(target, 5, "Explain `{function}`.", count) != text


def test_long_context_estimate_without_tokenizer_stays_under_target():
    count = make_token_counter(BUNDLED_TOKENIZER)
    text = long_context_prompt(3800, 4, "Explain `{function}`.", None)
    assert 0.6 * 3800 < count(text) <= 3800


def engine_result(label: str, decode: float, gaps_base: float) -> EngineResult:
    words = "one two three four five six seven eight nine"
    p = PromptResult("merge-sorted", "code", warmup=[run([1.0, 2.0], 2)],
                     runs=[run([gaps_base * i + 100.0 for i in range(10)], 10, text=words)])
    row = summarize_class("code", [p], None)
    row.decode_tps = decode
    skipped = ClassSummary("long-16k", 0, 0, note="skipped: about 15800 prompt + 8 new tokens do not fit")
    return EngineResult(label=label, base_url="http://127.0.0.1:1", model="m", date="2026-12-01T00:00:00+00:00",
                        machine="test box", settings={"max_tokens": 8, "warmup": 1, "runs": 1},
                        engine_info={"weights": "f32", "command": "x serve"}, prompts=[p], classes=[row, skipped])


def test_records_round_trip(tmp_path):
    r = engine_result("spruce-none", 50.0, 20.0)
    save(r, tmp_path / "r.json")
    back = load(tmp_path / "r.json")
    assert back == r and back.class_gaps("code") == r.class_gaps("code") and len(back.class_gaps("code")) == 9
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a spruce bench result"):
        load(tmp_path / "bad.json")


def test_markdown_table_rows_ratios_and_notes():
    a, b = engine_result("spruce-none", 50.0, 20.0), engine_result("mlx-lm", 40.0, 25.0)
    gone = EngineResult(label="llama.cpp", base_url="", model=None, date="", machine="", settings={},
                        skipped="no llama-server binary")
    md = render_markdown([a, b, gone], baseline="mlx-lm")
    rows = [line for line in md.splitlines() if line.startswith("| code |")]
    assert len(rows) == 2
    assert "| spruce-none | f32 |" in rows[0] and "| 50.0 | 1.25x |" in rows[0]
    assert "| 40.0 | 1.00x |" in rows[1]
    assert "- llama.cpp: not run: no llama-server binary" in md
    assert "- spruce-none / long-16k: skipped: about 15800 prompt" in md
    assert "ITL: inter-token latency" in md and "baseline for x: mlx-lm" in md


def test_plots_are_png(tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed (the optional extra spruce[bench])")
    from server.bench.plots import draw_plots

    paths = draw_plots([engine_result("spruce-none", 50.0, 20.0), engine_result("mlx-lm", 40.0, 25.0)], tmp_path)
    assert [p.name for p in paths] == ["decode_tps.png", "itl.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 200_000


def sse(*events: dict | str) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def peer_stream(body: bytes, status: int = 200) -> RunRecord:
    """The client's parsing of what another server sends (llama.cpp, mlx_lm.server shapes), through
    httpx's in-memory transport: these servers are not part of the test suite."""
    import httpx

    from server.bench.client import RequestSettings, stream_chat

    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    with httpx.Client(transport=transport) as client:
        return stream_chat(client, "http://peer", "hi", RequestSettings(max_tokens=8))


def test_client_reads_llama_cpp_style_streams():
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "timings": {"prompt_n": 12, "prompt_per_second": 300.0, "predicted_n": 3, "draft_n": 4,
                        "draft_n_accepted": 1}}
    r = peer_stream(sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}, chunk, chunk, chunk, last,
                        "[DONE]"))
    assert r.text == "xxx" and r.completion_tokens == 3 and r.tokens_counted == "chunks"  # no usage sent
    assert r.prompt_tokens == 12 and tokens_per_forward(r) == 1.5 and prefill_tps(r) == (300.0, "server")
    assert len(r.arrivals_ms) == 3 and r.finish_reason == "length"


def test_client_turns_broken_streams_into_failures():
    from server.bench.client import RequestFailed

    with pytest.raises(RequestFailed, match="ended without a finish_reason"):
        peer_stream(b"")  # mlx_lm.server when its generation thread raises
    with pytest.raises(RequestFailed, match="boom"):
        peer_stream(sse({"error": {"message": "boom", "type": "server_error"}}))
    with pytest.raises(RequestFailed, match="HTTP 400: too long"):
        peer_stream(json.dumps({"error": {"message": "too long"}}).encode(), status=400)
    with pytest.raises(RequestFailed, match="not JSON"):
        peer_stream(b"data: {oops\n\n")
