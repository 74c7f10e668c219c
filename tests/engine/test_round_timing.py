"""The controller's round times: a pipelined round is charged its own queueing, not the queueing of
the round after it (engine/round.py `_count`). Queueing is slowed by a fixed sleep so that the
charge is visible above the tiny model's compute."""

from __future__ import annotations

import time

import numpy as np

import engine.round as rounds
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.generate import Engine
from engine.types import GenerationRequest

# long beside a round's compute, so that the compute's jitter on a busy machine stays within the
# margins below (at 30 ms a clean-clone CI run saw one round of 51 ms: 30 queued + 21 computing; at
# 50 ms, with two test runs sharing the dev machine's two cores, one of 108 ms: 50 + 58). Charged
# twice, a round costs two of these whatever the compute, so 1.7x still tells the two apart.
QUEUE_MS = 100.0


def test_pipelined_rounds_are_charged_their_own_queueing(tiny_qwen35, monkeypatch):
    records: list[tuple[int, int, float]] = []
    real_queue, real_record = rounds.Rounds._queue, rounds.SpecController.record

    def slow_queue(self, *args, **kwargs):
        flight = real_queue(self, *args, **kwargs)
        time.sleep(QUEUE_MS / 1e3)
        return flight

    def record(self, budget, tokens, ms, rows=None):
        records.append((budget, tokens, ms))
        real_record(self, budget, tokens, ms, rows)

    monkeypatch.setattr(rounds.Rounds, "_queue", slow_queue)
    monkeypatch.setattr(rounds.SpecController, "record", record)
    engine = Engine(EngineConfig(model_path=str(tiny_qwen35), prefix_cache=False))
    prompt = [int(t) for t in np.random.RandomState(3).randint(0, 500, size=24)]  # ngram finds little
    req = GenerationRequest(prompt_ids=prompt, spec=SpecConfig(method="ngram"),
                            sampling=SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=5))
    list(engine.generate(req))
    plain = [ms for budget, _, ms in records if budget == 0]
    assert len(plain) >= 5, records  # the controller settles on plain rounds here
    # each is one queueing plus a little compute; charging the next round's queueing too made the
    # first of a pipelined run cost two
    assert max(plain) < 1.7 * QUEUE_MS, plain
    assert min(plain) > 0.8 * QUEUE_MS, plain
