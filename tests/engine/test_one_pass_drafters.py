"""The one-pass drafters (MTP head, DFlash) with the chain and DDTree builders (their networks
against PyTorch: test_one_pass_parity.py).

- Generation with them is lossless (greedy and seeded sampling). With random weights they rarely
  get a draft accepted, so one test adds the true continuation as one more branch of their trees:
  rounds then accept several tokens, and the drafters' state (DFlash context K/V, MTP cache)
  must equal what a replay of the committed tokens gives.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from engine import forward
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.drafters import BUILDERS
from engine.drafters.dflash import DFlashDrafter
from engine.drafters.mtp import MTPDrafter
from engine.feature_cache import FeatureCache, FeatureTaps
from engine.generate import Engine, RequestError
from engine.loader import CheckpointError, load_dflash
from engine.tree import DraftTree
from tests.helpers import generate

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
PROMPTS = [[int(t) for t in np.random.RandomState(s).randint(0, 500, size=n)] for s, n in ((11, 25), (12, 3))]


@pytest.fixture(scope="module")
def engine(tiny_qwen35_mtp, tiny_dflash):
    return Engine(EngineConfig(model_path=str(tiny_qwen35_mtp), prefill_chunk=16,
                               spec=SpecConfig(dflash_model=str(tiny_dflash))))


PAIRS = [("mtp", "chain"), ("mtp", "ddtree"), ("dflash", "chain"), ("dflash", "ddtree"), ("dflash", "weaver")]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method,tree", PAIRS)
def test_lossless(engine, method, tree, sampling):
    for prompt in PROMPTS:
        plain = generate(engine, prompt, sampling).tokens
        out = generate(engine, prompt, sampling, SpecConfig(method=method, tree=tree, budget=10, max_depth=6))
        assert out.tokens == plain
        assert out.stats.drafted > 0


class Wrapped:
    """A drafter passed through, counting the emitted tokens it has been told of (pos)."""

    def __init__(self, inner, reference: list[int]) -> None:
        self.inner, self.ref, self.taps = inner, reference, inner.taps
        self.pos = 0

    def attach(self, features: FeatureCache) -> None:
        self.inner.attach(features)

    def begin(self, prompt_ids: list[int]) -> None:
        self.inner.begin(prompt_ids)
        self.pos = 0

    def observe(self, emitted: list[int]) -> None:
        self.inner.observe(emitted)
        self.pos += len(emitted)


class Assisted(Wrapped):
    """Wraps a drafter: its tree plus the true continuation (of random length) as one more branch."""

    def __init__(self, inner, reference: list[int], seed: int) -> None:
        super().__init__(inner, reference)
        self.rng = np.random.default_rng(seed)

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        tree = self.inner.propose(root, budget, max_depth)
        tokens, parents, node = list(tree.tokens), list(tree.parents), 0
        for t in self.ref[self.pos : self.pos + int(self.rng.integers(0, max_depth + 1))]:
            child = next((i for i in range(len(tokens)) if parents[i] == node and tokens[i] == t), None)
            if child is None:
                tokens.append(t)
                parents.append(node)
                child = len(tokens) - 1
            node = child
        return DraftTree(tuple(tokens), tuple(parents))


def replay_features(engine: Engine, tokens: list[int]) -> mx.array:
    """The target's feature rows of `tokens`, from one chain pass."""
    cache = engine.model.make_cache() + [FeatureCache(engine.feature_taps)]
    forward.extend(engine.model, cache, tokens)
    return cache[-1].read(0)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_accepted_rounds_keep_the_drafters_in_step(engine, sampling):
    prompt = PROMPTS[0]
    plain = generate(engine, prompt, sampling).tokens
    # every round gets the full budget: with the controller sizing trees by measured time, how
    # many rounds carried the true branch depended on the machine's timing (CI: 1.48 tokens a forward)
    spec = SpecConfig(method="none", budget=10, max_depth=6, adaptive=False)
    for make in (lambda: DFlashDrafter(engine.model, engine.dflash_model(None), BUILDERS["ddtree"]),
                 lambda: MTPDrafter(engine.model, engine.mtp_head(), BUILDERS["ddtree"])):
        drafter = make()
        out = generate(engine, prompt, sampling, spec, Assisted(drafter, plain, 5))
        assert out.tokens == plain
        assert out.stats.accepted >= 10 and out.stats.tokens_per_forward > 1.5
        seq = prompt + out.tokens
        # positions the drafter has taken in so far (all but the last round's)
        assert drafter.cache[0].offset >= len(seq) - 8
        assert_drafter_equals_replay(engine, drafter, seq)


def assert_drafter_equals_replay(engine: Engine, drafter, seq: list[int]) -> None:
    """The drafter's cache (DFlash context K/V, MTP head K/V) over the positions it has taken in
    equals what a replay of those tokens gives."""
    n = drafter.cache[0].offset
    features = replay_features(engine, seq[:n])
    H = engine.model.args.hidden_size
    if isinstance(drafter, DFlashDrafter):
        fresh = drafter.model.make_cache()
        slots = engine.feature_taps.slots(drafter.model.config.target_layer_ids, final=False)
        drafter.model.append_context(features.reshape(n, -1, H)[:, mx.array(slots)].reshape(n, -1), fresh)
    else:
        fresh = drafter.head.make_cache()
        slot = engine.feature_taps.slots((), final=True)[0]
        drafter.head(drafter.embed(mx.array([seq[1 : n + 1]])), features[None, :, slot * H : (slot + 1) * H], fresh)
    for live, want in zip(drafter.cache, fresh, strict=True):
        for a, b in zip(live.snapshot(n).arrays(), want.snapshot(n).arrays(), strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("behind", [0, 1, 6])
def test_mtp_head_catches_up_after_rounds_without_a_tree(engine, monkeypatch, sampling, behind):
    """Plain rounds (the controller gives the drafter no budget: pipelined, `skip`) leave the MTP
    head behind. With SKIP_CATCH_UP 0 it catches up at the next propose (MTPHead.append: the last
    layer's attention and MLP for the last row only); from SKIP_CATCH_UP rows behind, `skip` queues
    the catch-up itself (a pipelined round's root row waits for its token), so the first propose
    after 20 plain rounds owes fewer than SKIP_CATCH_UP + 2 rows. Either way the output stays the
    target's, and the head's cache equals a replay of the committed tokens."""
    from engine import spec_control
    from engine.drafters import mtp

    monkeypatch.setattr(mtp, "SKIP_CATCH_UP", behind)
    # 20 plain rounds, then the full budget
    monkeypatch.setattr(spec_control.SpecController, "budget", lambda self: 0 if self.rounds < 20 else 10)
    prompt = PROMPTS[0]
    plain = generate(engine, prompt, sampling).tokens
    drafter = MTPDrafter(engine.model, engine.mtp_head(), BUILDERS["ddtree"])
    owed: list[int] = []  # rows the head had still to take in at each propose
    propose = drafter.propose

    def watched(root, budget, max_depth):
        assert drafter.features is not None
        owed.append(drafter.features.length - drafter.cache[0].offset)
        return propose(root, budget, max_depth)

    drafter.propose = watched  # type: ignore[method-assign]
    out = generate(engine, prompt, sampling, SpecConfig(method="none", budget=10, max_depth=6), drafter)
    assert out.tokens == plain
    assert owed and (owed[0] < behind + 2 if behind else owed[0] >= 15)  # the 20 plain rounds' rows
    assert_drafter_equals_replay(engine, drafter, prompt + out.tokens)


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_mtp_head_append_equals_its_full_pass(engine, rows):
    """append (a catch-up: K/V of every row, the output of the last only) writes the same cache and
    gives the same last row as the full pass, also after rows already in the cache."""
    head = engine.mtp_head()
    H = engine.model.args.hidden_size
    rng = np.random.default_rng(rows)
    full, part = head.make_cache(), head.make_cache()
    for n in (5, rows):  # rows already in the cache, then the catch-up under test
        emb = mx.array(rng.standard_normal((1, n, H)).astype(np.float32))
        hid = mx.array(rng.standard_normal((1, n, H)).astype(np.float32))
        want = head(emb, hid, full)[:, -1:]
        got = head.append(emb, hid, part)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
    for a, b in zip(part, full, strict=True):
        assert a.offset == b.offset
        for x, y in zip(a.snapshot(a.offset).arrays(), b.snapshot(b.offset).arrays(), strict=True):
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)


def test_feature_cache_commit_equals_replay(engine):
    """The target's feature rows after speculative rounds equal those of a chain replay."""
    prompt = PROMPTS[0]
    plain = generate(engine, prompt, GREEDY).tokens
    inner = DFlashDrafter(engine.model, engine.dflash_model(None), BUILDERS["chain"])
    drafter = Assisted(inner, plain, 9)
    generate(engine, prompt, GREEDY, SpecConfig(method="none", budget=8, max_depth=5), drafter)
    live = inner.features
    assert live is not None and live.taps == FeatureTaps((1, 2), final=True)
    n = live.length
    np.testing.assert_allclose(np.array(live.read(0)), np.array(replay_features(engine, (prompt + plain)[:n])),
                               atol=1e-4)


def test_clear_errors(engine, tiny_qwen35, tiny_dflash, tmp_path):
    plain_engine = Engine(EngineConfig(model_path=str(tiny_qwen35)))
    with pytest.raises(RequestError, match="MTP tensors"):
        generate(plain_engine, [1, 2, 3], GREEDY, SpecConfig(method="mtp"))
    with pytest.raises(RequestError, match="DFlash checkpoint"):
        generate(plain_engine, [1, 2, 3], GREEDY, SpecConfig(method="dflash"))
    assert "use it with spec method 'dflash'" in engine.missing_drafter("mtp", "weaver")
    assert engine.missing_drafter("dflash", "weaver") is None
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dflash, broken)
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        load_dflash(broken)
    cfg["architectures"] = ["DFlash2DraftModel"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="DFlash2DraftModel"):
        load_dflash(broken)


def test_hidden_states_are_recorded_only_once_a_drafter_reads_them(tiny_qwen35_mtp, tiny_dflash):
    """Recording costs every pass, so an engine whose default is plain decoding records nothing; the
    first request of a drafter that reads the target widens what is recorded, dropping the prefix
    snapshots that lack it, and the output stays plain decoding's."""
    e = Engine(EngineConfig(model_path=str(tiny_qwen35_mtp), prefill_chunk=16))
    assert e.feature_taps.count == 0 and len(e.make_cache()) == len(e.model.make_cache())
    plain = generate(e, PROMPTS[0], GREEDY).tokens
    assert generate(e, PROMPTS[0], GREEDY).stats.cached_tokens > 0  # a snapshot of the plain layout
    first = generate(e, PROMPTS[0], GREEDY, SpecConfig(method="mtp", adaptive=False))
    assert e.feature_taps == FeatureTaps(final=True)
    assert first.tokens == plain and first.stats.cached_tokens == 0  # prefilled anew, with the rows
    again = generate(e, PROMPTS[0], GREEDY, SpecConfig(method="mtp", adaptive=False))
    assert again.tokens == plain and again.stats.cached_tokens > 0 and again.stats.drafted > 0
    dflash = generate(e, PROMPTS[0], GREEDY, SpecConfig(method="dflash", dflash_model=str(tiny_dflash),
                                                        tree="chain", adaptive=False))
    assert dflash.tokens == plain and e.feature_taps.final and e.feature_taps.layers
    started_for_it = Engine(EngineConfig(model_path=str(tiny_qwen35_mtp), spec=SpecConfig(method="mtp")))
    assert started_for_it.feature_taps == FeatureTaps(final=True)


def one_pass_drafter(engine: Engine, method: str, tree: str, vocab=None):
    if method == "mtp":
        return MTPDrafter(engine.model, engine.mtp_head(), BUILDERS[tree], vocab=vocab)
    return DFlashDrafter(engine.model, engine.dflash_model(None), BUILDERS[tree], vocab=vocab)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_guess_after_is_the_guess_a_one_guess_propose_makes(engine, method):
    """guess_after (the drafter's guess while the round before is still on the device) gives the
    token a one-guess propose after that round's landing puts in its tree, round after round."""
    check_guess_after(engine, method)


def check_guess_after(engine: Engine, method: str, vocab=None) -> None:
    engine.widen_taps(FeatureTaps(final=True))
    prompt = PROMPTS[0]
    cache = engine.make_cache()
    forward.extend(engine.model, cache, prompt[:-1])
    landed, ahead = (one_pass_drafter(engine, method, b, vocab) for b in ("chain", "ddtree"))
    for drafter in (landed, ahead):
        drafter.attach(cache[-1])
        drafter.begin(prompt)
    root = prompt[-1]
    for committed in range(len(prompt) - 1, len(prompt) + 5):
        # a plain round at `root`, committed at once, its token still on the device
        logits = forward.verify(engine.model, cache, DraftTree.single(root), committed)
        forward.commit(cache, [0])
        choice = mx.argmax(logits, axis=-1).astype(mx.int32).reshape(1, 1)
        guess = ahead.guess_after(choice)
        assert guess is not None
        token = int(choice.item())
        ahead.skip(root, [token])
        landed.observe([token])
        tree = landed.propose(token, 1, 6)
        assert tree.size == 2 and tree.tokens[1] == int(guess.item())
        root = token
    assert ahead.cache[0].offset == landed.cache[0].offset == len(prompt) + 5


class GuessesRight(Wrapped):
    """Wraps a one-pass drafter: every other guess made on the device is replaced by the true next
    token, so that pipelined one-guess rounds accept too (random weights rarely guess right)."""

    def __init__(self, inner, reference: list[int]) -> None:
        super().__init__(inner, reference)
        self.calls, self.tries = 0, 0

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        return self.inner.propose(root, budget, max_depth)

    def guess_after(self, root: mx.array) -> mx.array | None:
        guess = self.inner.guess_after(root)  # keeps the head in step whatever is returned
        self.calls += 1
        if guess is None:
            return None
        self.tries += 1
        # the host is one token behind: ref[pos] is `root`, ref[pos + 1] the token after it
        right = self.calls % 2 == 0 and self.pos + 1 < len(self.ref)
        return mx.array([[self.ref[self.pos + 1]]]) if right else guess

    def skip(self, root: int, emitted: list[int]) -> None:
        self.inner.skip(root, emitted)
        self.pos += len(emitted)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_one_guess_rounds_are_queued_before_the_round_before_lands(engine, monkeypatch, method, sampling):
    """Where the controller asks for the one-guess tree after a plain round, a one-pass drafter
    guesses on the device and the two-node verify is queued before the plain round lands
    (launch_after). The output is plain decoding's, rounds whose guess was right accept it, and the
    drafter's cache equals a replay of the committed tokens."""
    from engine import spec_control
    from engine.round import Rounds

    monkeypatch.setattr(spec_control.SpecController, "budget", lambda self: 1 if self.rounds % 3 == 2 else 0)
    queued: list[int] = []
    real = Rounds.launch_after
    monkeypatch.setattr(Rounds, "launch_after", lambda self, f: queued.append(1) or real(self, f))
    prompt = PROMPTS[0]
    plain = generate(engine, prompt, sampling).tokens
    drafter = GuessesRight(one_pass_drafter(engine, method, "ddtree"), plain)
    out = generate(engine, prompt, sampling, SpecConfig(method="none", budget=10, max_depth=6), drafter)
    assert out.tokens == plain
    assert drafter.tries >= 5 and len(queued) >= 20, (drafter.tries, len(queued))
    assert out.stats.accepted >= 2 and out.stats.drafted >= drafter.tries
    assert_drafter_equals_replay(engine, drafter.inner, prompt + out.tokens)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(("ahead", "ramp"), [(0, 0), (2, 0), (99, 0), (2, 2), (1, 3)])
def test_layers_handed_over_ahead_change_no_token(engine, monkeypatch, ahead, ramp, sampling):
    """On the CPU with a drafter on, a pipelined plain round starts late but its first
    START_AHEAD_LAYERS layers are evaluated before the previous round lands (99: all of them), and
    AHEAD_RAMP more from one such round to the next until it starts at once. The output is plain
    decoding's whatever the setting, through plain rounds and the one-guess tries queued between
    them."""
    from engine import round as round_mod
    from engine import spec_control
    from engine.round import Rounds

    monkeypatch.setattr(round_mod, "START_AHEAD_LAYERS", ahead)
    monkeypatch.setattr(round_mod, "AHEAD_RAMP", ramp)
    monkeypatch.setattr(spec_control.SpecController, "budget", lambda self: 1 if self.rounds % 5 == 4 else 0)
    late: list[bool] = []
    real = Rounds.launch_after
    monkeypatch.setattr(Rounds, "launch_after", lambda self, f: late.append(self.start_late) or real(self, f))
    prompt = PROMPTS[1]
    plain = generate(engine, prompt, sampling).tokens
    late.clear()  # plain decoding's own pipelined rounds start at once
    out = generate(engine, prompt, sampling, SpecConfig(method="mtp", tree="ddtree", budget=10, max_depth=6))
    assert out.tokens == plain
    assert len(late) >= 10 and all(late) == (mx.default_device() == mx.cpu)


def test_the_layers_handed_over_ahead_ramp_up_after_a_tree(engine, monkeypatch):
    """AHEAD_RAMP: after a round that was not queued ahead (the first one, a tree, a one-guess
    try), each pipelined plain round hands over AHEAD_RAMP layers more than the one before, from
    START_AHEAD_LAYERS up to all of them."""
    from engine import round as round_mod
    from engine import spec_control
    from engine.round import Rounds

    monkeypatch.setattr(round_mod, "START_AHEAD_LAYERS", 2)
    monkeypatch.setattr(round_mod, "AHEAD_RAMP", 2)
    monkeypatch.setattr(spec_control.SpecController, "budget", lambda self: 1 if self.rounds % 9 == 8 else 0)
    seen: list[int] = []
    real = Rounds.launch_after
    monkeypatch.setattr(Rounds, "launch_after", lambda self, f: seen.append(self._ahead_layers) or real(self, f))
    generate(engine, PROMPTS[1], SAMPLED, SpecConfig(method="mtp", tree="ddtree", budget=10, max_depth=6))
    layers = len(engine.make_cache())
    ramp = [min(n, layers) for n in range(2, layers + 2, 2)]
    assert layers > 2 and seen[: len(ramp)] == ramp
    assert all(b == min(a + 2, layers) or b == 2 for a, b in zip(seen, seen[1:], strict=False))
    assert max(seen) == layers and seen.count(2) >= 2  # the ramp reached the top and started again


def test_mtp_depth_is_the_specs(engine):
    """The MTP head drafts as deep as the spec asks (it stopped at 6 whatever --spec-depth said);
    without a depth it keeps its own default of 6, the other methods 8. Output unchanged."""
    from engine.drafters import make_drafter

    assert SpecConfig(method="mtp").max_depth == 6 and SpecConfig(method="ngram").max_depth == 8
    assert SpecConfig(method="mtp", max_depth=10).max_depth == 10
    deep = SpecConfig(method="mtp", tree="chain", budget=16, max_depth=10, adaptive=False)
    drafter = make_drafter(engine, deep)
    assert isinstance(drafter, MTPDrafter) and drafter.config.max_steps == 10
    drafter.log_min_path = -float("inf")  # no early stop: the depth is the limit
    depths: list[int] = []
    propose = drafter.propose

    def watched(root, budget, max_depth):
        tree = propose(root, budget, max_depth)
        depths.append(tree.max_depth)
        return tree

    drafter.propose = watched  # type: ignore[method-assign]
    prompt = PROMPTS[0]
    assert generate(engine, prompt, GREEDY, deep, drafter).tokens == generate(engine, prompt, GREEDY).tokens
    assert max(depths) == 10


@pytest.mark.parametrize("method,tree", PAIRS)
def test_chain_trees_tell_the_controller_their_depth(engine, method, tree, monkeypatch):
    """A chain builder's tree has at most its depth's nodes whatever the budget: the round gives
    the controller that cap (it predicts an untried tree's time by rows) and each round's rows,
    which never pass it; other builders fill their budget (no cap)."""
    from engine import spec_control

    seen: list[tuple[int | None, int, int | None]] = []
    record = spec_control.SpecController.record

    def watched(self, budget, tokens, ms, rows=None):
        seen.append((self.row_cap, budget, rows))
        return record(self, budget, tokens, ms, rows)

    monkeypatch.setattr(spec_control.SpecController, "record", watched)
    spec = SpecConfig(method=method, tree=tree, budget=16, max_depth=3, dflash_model=engine.config.spec.dflash_model)
    generate(engine, PROMPTS[0], GREEDY, spec)
    caps = {cap for cap, _, _ in seen}
    assert caps == ({4} if tree == "chain" else {None})
    # what trees cost is remembered per setting, whatever budget or stall cap a request asks
    assert all(k.budget == 1 and k.max_stall is None for k in engine.round_costs)
    assert replace(spec, budget=1) in engine.round_costs
    assert all(rows is not None and 1 <= rows <= min(budget + 1, cap or budget + 1) for cap, budget, rows in seen)
