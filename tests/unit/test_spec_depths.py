"""engine/spec_depths.py: a chain drafter's acceptance, depth by depth."""

from __future__ import annotations

import pytest

from engine.spec_depths import DEPTH_PRIOR, DepthAcceptance


def test_depth_acceptance_reads_a_chain_depth_by_depth():
    d = DepthAcceptance(6)
    # nothing seen: every depth at the prior
    assert d.tokens(2) == pytest.approx(1 + DEPTH_PRIOR + DEPTH_PRIOR ** 2)
    d.record(drafted=4, accepted=4)  # every guess right: depths 1-4 reached and right
    d.record(drafted=4, accepted=1)  # the second guess missed: depths 1-2 reached, 1 right
    # depth 1 reached twice, right twice; depth 2 reached twice, right once (the older round
    # weighs DEPTH_DECAY); depths 3-4 reached and right once. Each estimate counts the depth
    # above's as one round more
    p1 = (1.8 + DEPTH_PRIOR) / (1.8 + 1)
    p2 = (0.8 + p1) / (1.8 + 1)
    p3 = (1 + p2) / (1 + 1)
    p4 = (1 + p3) / (1 + 1)
    assert d.tokens(1) == pytest.approx(1 + p1)
    assert d.tokens(3) == pytest.approx(1 + p1 + p1 * p2 + p1 * p2 * p3)
    # a depth never reached takes the depth above's estimate
    assert d.tokens(5) - d.tokens(4) == pytest.approx(p1 * p2 * p3 * p4 * p4)
    # a budget past the chain's depth drafts no more guesses
    assert d.tokens(16) == d.tokens(6)
