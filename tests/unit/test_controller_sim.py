"""scripts/controller_sim.py's replay: a controller's rounds over a table of accepted tokens and
round times, without the engine."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sim():
    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("controller_sim", REPO / "scripts" / "controller_sim.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table(length: int, tokens: dict[int, int]) -> dict[str, list[int]]:
    return {str(b): [tokens[b]] * length for b in (1, 4, 16)}


def times(plain_ms: float, tree_ms: float) -> dict[str, list[float]]:
    kinds = ("start", "plain", "tree")
    return {f"{b}:{kind}": [plain_ms if b == 0 else tree_ms] for b in (0, 1, 4, 16) for kind in kinds}


def test_a_fixed_budget_replays_every_round_as_a_tree(sim):
    # every tree emits 9 tokens (the last round's, cut by the room to 8 nodes, too): 9 rounds
    total, trees = sim.replay_one(sim.FixedBudget, table(81, {1: 9, 4: 9, 16: 9}), times(10.0, 30.0), 81,
                                  random.Random(0))
    assert (total, trees) == (270.0, 9)


def test_rounds_cut_by_the_room_left_take_the_tree_below(sim):
    # 9 tokens, then room for 11: a 10-node tree, replayed as the 4-node one (5 tokens), then room
    # for 6: again, then room for one token: a plain round
    total, trees = sim.replay_one(sim.FixedBudget, table(20, {1: 2, 4: 5, 16: 9}), times(10.0, 30.0), 20,
                                  random.Random(0))
    assert (total, trees) == (100.0, 3)


def test_the_controller_stops_drafting_where_every_guess_misses(sim):
    # a plain round 10 ms, a tree 20 ms, one token whatever the budget
    accepted = table(96, {1: 1, 4: 1, 16: 1})
    fixed, _ = sim.replay_one(sim.FixedBudget, accepted, times(10.0, 20.0), 96, random.Random(0))
    adaptive, trees = sim.replay_one(sim.controller_class("now"), accepted, times(10.0, 20.0), 96, random.Random(0))
    assert fixed == 95 * 20.0 + 10.0  # the last round has room for the root alone
    assert trees <= 6 and adaptive <= 96 * 10.0 * 1.07


def test_hindsight_is_replayed_for_the_drafters_that_have_it(sim):
    assert sim.hindsight("ngram") and not sim.hindsight("mtp") and not sim.hindsight("draft")

    class PlainWithHindsight:
        seen: list[list[tuple[int, int]]] = []

        def __init__(self, max_budget: int) -> None:
            pass

        def budget(self) -> int:
            return 0

        def record(self, budget: int, tokens: int, ms: float) -> None:
            pass

        def observe(self, outcomes: list[tuple[int, int]]) -> None:
            self.seen.append(outcomes)

    accepted = table(6, {1: 2, 4: 3, 16: 5})
    accepted["1"][2] = 1  # the one guess would have missed at the third position
    sim.replay_one(PlainWithHindsight, accepted, times(10.0, 20.0), 6, random.Random(0), hindsight=True)
    hit, miss = [(1, 2), (4, 3), (16, 5)], [(1, 1), (4, 3), (16, 5)]
    assert PlainWithHindsight.seen == [hit, hit, miss, hit, hit, hit]
    PlainWithHindsight.seen.clear()
    sim.replay_one(PlainWithHindsight, accepted, times(10.0, 20.0), 6, random.Random(0))
    assert PlainWithHindsight.seen == []


def test_the_confidence_is_replayed_at_the_tokens_each_round_emitted(sim):
    class FourNodesThenPlain:
        told: list[list[float]] = []

        def __init__(self, max_budget: int) -> None:
            self.rounds = 0

        def budget(self) -> int:
            return 4 if self.rounds == 0 else 0

        def record(self, budget: int, tokens: int, ms: float) -> None:
            self.rounds += 1

        def confide(self, probabilities: list[float]) -> None:
            self.told.append(list(probabilities))

    confidence = [0.1, 0.2, 0.3, 0.4, 0.5]
    sim.replay_one(FourNodesThenPlain, table(5, {1: 2, 4: 3, 16: 5}), times(10.0, 20.0), 5, random.Random(0),
                   confidence=confidence)
    assert FourNodesThenPlain.told == [[0.1, 0.2, 0.3], [0.4], [0.5]]  # the tree's three tokens, then one a round
    FourNodesThenPlain.told.clear()
    sim.replay_one(FourNodesThenPlain, table(5, {1: 2, 4: 3, 16: 5}), times(10.0, 20.0), 5, random.Random(0))
    assert FourNodesThenPlain.told == []


def test_the_summary_splits_misses_from_the_rest_and_compares_with_the_fixed_budget(sim):
    medians = {"fixed": {("misses 64", "mtp"): 0.5, ("code1", "mtp"): 1.2, ("chat", "mtp"): 0.8},
               "now": {("misses 64", "mtp"): 0.97, ("code1", "mtp"): 1.2, ("chat", "mtp"): 1.0}}
    rows = sim.summary(medians).splitlines()[2:]
    assert rows[0] == f"| mtp | fixed | 0.500 | {math.sqrt(1.2 * 0.8):.3f} | 1.000 |"
    assert rows[1] == f"| mtp | now | 0.970 | {math.sqrt(1.2):.3f} | {math.sqrt(1.25):.3f} |"


def test_tokens_are_tabled_by_the_confidence_before_the_position(sim, tmp_path):
    # the confidence along the output: low, low, high, high; the moving average before positions
    # 1-3 (KEEP 0.5): 0.1, 0.1, 0.5: so positions 1 and 2 fall in the low cell, 3 in the high one
    entry = {"length": 4, "confidence": [0.1, 0.1, 0.9, 0.9], "plain_ms": [10.0],
             "methods": {"mtp": {"accepted": {"1": [2, 1, 1, 2], "4": [3, 1, 3, 5], "16": [4, 1, 5, 9]}, "ms": {}}}}
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"tokens": 4, "requests": {"code1": entry}}))
    table = sim.by_confidence(path, 0.5, [0.0, 0.4, 1.01]).splitlines()
    assert table[2] == "| mtp | 0.0-0.4 | 2 | 1.00 | 2.00 | 3.00 |"
    assert table[3] == "| mtp | 0.4-1.0 | 1 | 2.00 | 5.00 | 9.00 |"


def test_a_remembering_replay_shares_what_the_trees_cost(sim):
    # guesses hit (16 nodes: 9 tokens) and a tree costs about two plain rounds whatever its size:
    # after one request the controller's memory (RoundCosts) holds every tree's cost, and the next
    # request's climb starts at the full budget, so it spends fewer rounds on smaller trees
    cls = sim.controller_class("now")
    memory = sim.remembers(cls)
    assert memory is not None and sim.remembers(sim.FixedBudget) is None
    accepted, ms = table(96, {1: 2, 4: 5, 16: 9}), times(10.0, 20.0)
    costs = memory()
    fresh, _ = sim.replay_one(cls, accepted, ms, 96, random.Random(0), costs=None)
    sim.replay_one(cls, accepted, ms, 96, random.Random(0), costs=costs)
    assert set(costs.ratios) == {1, 4, 16}
    remembered, _ = sim.replay_one(cls, accepted, ms, 96, random.Random(0), costs=costs)
    assert remembered < fresh


def test_a_chains_rows_and_row_cap_reach_the_controller(sim):
    # a chain's rounds are told with the rows the recording has (a stop rule cut it short), and the
    # controller gets the chain's row cap, as the engine hands both over
    told: list[tuple[int, int | None]] = []
    base = sim.controller_class("now")

    class Spy(base):  # type: ignore[misc, valid-type]
        def record(self, budget, tokens, ms, rows=None):  # noqa: ANN001
            told.append((budget, rows))
            super().record(budget, tokens, ms, rows)

    drafted = {"1": [2] * 30, "4": [3] * 30, "16": [4] * 30}
    sim.replay_one(Spy, table(30, {1: 2, 4: 3, 16: 4}), times(10.0, 12.0), 30, random.Random(0),
                   row_cap=7, drafted=drafted)
    trees = [(b, rows) for b, rows in told if b > 0]
    assert trees and all(rows == {1: 2, 4: 3, 16: 4}[b] for b, rows in trees)
    assert all(rows is None for b, rows in told if b == 0)
    assert sim.row_cap("mtp-chain") == 7 and sim.row_cap("mtp") is None


def test_a_chains_full_budget_rounds_are_read_as_the_biggest_budgets(sim):
    # the engine reports a chain's rounds by its rows: 6 guesses at the budget of 16
    recorded = {"0:plain": [4.0], "1:tree": [7.0], "4:tree": [8.0], "6:tree": [8.5], "6:start": [9.0], "5:tree": [9.9]}
    read = sim.by_budget(recorded)
    assert read["16:tree"] == [8.5] and read["16:start"] == [9.0] and read["5:tree"] == [9.9]
    assert sim.by_budget({"16:tree": [1.0], "6:tree": [2.0]}) == {"16:tree": [1.0], "6:tree": [2.0]}


def test_gaps_spread_each_round_over_its_tokens(sim):
    # every tree round emits 9 tokens in 30 ms: 9 gaps of 30 / 9 ms each; the last round's room is 8
    gaps: list[float] = []
    total, trees = sim.replay_one(sim.FixedBudget, table(81, {1: 9, 4: 9, 16: 9}), times(10.0, 30.0), 81,
                                  random.Random(0), gaps=gaps)
    assert len(gaps) == 81 and math.isclose(sum(gaps), total)
    assert sim.p99(gaps) == pytest.approx(30.0 / 9)
    assert sim.p99([1.0] * 99 + [50.0]) == 50.0 and sim.p99([1.0] * 200 + [50.0]) == 1.0


def test_stall_suffixes_cap_the_trees(sim):
    # a tree round costs 3 plain rounds and emits 3 tokens: within 1.5 plain rounds a token, not a round
    accepted = table(96, {1: 3, 4: 3, 16: 3})
    plain = sim.controller_class("now")
    capped = sim.controller_class("now+stall1.5")
    per_token = sim.controller_class("now+tokstall1.5")
    assert capped(16).max_stall == 1.5 and plain(16).max_stall is None
    runs = {name: sim.replay_one(cls, accepted, times(10.0, 30.0), 96, random.Random(0))
            for name, cls in (("plain", plain), ("capped", capped), ("per_token", per_token))}
    assert runs["capped"][1] <= 2  # only the one-guess tree's two tries
    assert runs["per_token"][1] >= 10 and runs["per_token"][1] >= runs["plain"][1] - 2
