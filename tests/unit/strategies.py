"""Hypothesis strategies shared by the unit tests."""

from __future__ import annotations

from hypothesis import strategies as st

from engine.tree import DraftTree


@st.composite
def draft_trees(draw, max_nodes: int = 24, vocab: int = 40) -> DraftTree:
    """Random topological trees with unique sibling tokens."""
    n = draw(st.integers(1, max_nodes))
    parents, tokens = [-1], [draw(st.integers(0, vocab - 1))]
    for i in range(1, n):
        open_nodes = [j for j in range(i) if parents.count(j) < vocab]  # node i - 1 is always open
        p = draw(st.sampled_from(open_nodes))
        used = {tokens[j] for j in range(1, i) if parents[j] == p}
        tokens.append(draw(st.sampled_from([t for t in range(vocab) if t not in used])))
        parents.append(p)
    return DraftTree(tuple(tokens), tuple(parents))
