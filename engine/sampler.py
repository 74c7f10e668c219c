"""Logits processing, position-seeded sampling and the tree accept walk.

Sampling is made reproducible per *absolute position*: the uniform used to
draw the token at sequence index p is a hash of (seed, p) only. Plain decoding
and speculative decoding therefore draw the same uniform for the same slot,
and the "target-only" accept walk (sample the target's token at a node, move
down if a child carries it, else emit it as the bonus) emits exactly the
tokens plain sampling would. Draw is by inverse CDF in vocabulary order, so
the result is a function of (probabilities, uniform) alone.

Position convention: the token that will sit at absolute index p of the
sequence (sampled from the logits at index p-1) uses position p. A tree node i
sits at committed_len + depth_i, so its logits draw with position
committed_len + depth_i + 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.config import SamplingParams
from engine.logits_extras import adjust_logits
from engine.tree import DraftTree

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_CANDIDATES = (256, 4096, 65536)  # top-p sorts only this many best tokens when their mass suffices


@dataclass(frozen=True)
class Acceptance:
    """Outcome of one accept walk. len(path) == len(tokens) always.

    tokens[:-1] are the tree tokens of path[1:] (the accepted drafts), and
    tokens[-1] is the bonus: the target's own choice after the last accepted
    node, not in the tree (or a stop token, where the walk stops even on a
    matching child). The rows `path` are the verify rows to commit; the bonus
    becomes the next root.
    """

    path: tuple[int, ...]  # node indices root..last accepted node (accepted input rows, root included)
    tokens: tuple[int, ...]  # emitted: accepted draft tokens + 1 bonus token

    @property
    def accepted_drafts(self) -> int:
        return len(self.path) - 1

    @property
    def bonus(self) -> int:
        return self.tokens[-1]

    def truncated(self, n: int) -> Acceptance:
        """Keep the first n >= 1 emitted tokens (e.g. max_tokens); the n-th becomes the bonus."""
        if n < 1:
            raise ValueError(f"must keep at least one token, got {n}")
        return Acceptance(self.path[:n], self.tokens[:n])


def process_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float64 [V] probabilities after the sampling filters (sums to 1).

    Order (as HF transformers' warpers): temperature, top_k, top_p, min_p, each
    filter acting on the distribution left by the previous one. Ties are broken
    by token id (lower id ranks higher), so the kept set is canonical. -inf
    logits mark banned tokens. Greedy params give the one-hot of the argmax.
    """
    x = _check_row(logits)
    if params.greedy:
        p = np.zeros(x.shape[0], dtype=np.float64)
        p[int(np.argmax(x))] = 1.0
        return p
    # Shift before dividing: (x - max) <= 0, so a tiny temperature sends the others to -inf (their
    # probability 0) instead of overflowing every logit to +-inf and the difference to NaN.
    with np.errstate(over="ignore"):
        p = np.exp((x - x.max()) / params.temperature)
    if params.top_k > 0:
        p = _top_k(p, params.top_k)
    if params.top_p < 1.0:
        p = _top_p(p, params.top_p)
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
    return p / p.sum()


def _check_row(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"logits must be a non-empty 1-D row, got shape {x.shape}")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("logits contain NaN or +inf")
    if np.isneginf(x).all():
        raise ValueError("every logit is -inf: no token can be sampled")
    return x


def _ranked(p: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids (ascending) sorted by descending p[ids]; the stable sort keeps ties in id order."""
    return ids[np.argsort(-p[ids], kind="stable")]


def _top_k(p: np.ndarray, k: int) -> np.ndarray:
    if k >= p.shape[0]:
        return p
    kth = np.partition(p, p.shape[0] - k)[p.shape[0] - k]  # k-th largest value
    ranked = _ranked(p, np.flatnonzero(p >= kth))  # includes every tie at the boundary
    out = np.zeros_like(p)
    out[ranked[:k]] = p[ranked[:k]]
    return out


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest best-first prefix whose mass reaches top_p of the total."""
    target = top_p * p.sum()
    ranked, cum = _ranked_prefix(p, target)
    keep = ranked[: int(np.searchsorted(cum, target, side="left")) + 1]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out


def _ranked_prefix(p: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray]:
    """A best-first prefix of the ranked ids that reaches `target` mass, and its cumulative sums.

    The ids with p >= (m-th largest p), ties included, are exactly the first
    ranks of the full order, and the sequential cumsum over them equals the
    full order's, so trying small m first sorts few tokens of a large vocabulary.
    """
    ids = np.flatnonzero(p > 0)
    for m in _CANDIDATES:
        if ids.shape[0] <= m:
            break
        cut = np.partition(p[ids], ids.shape[0] - m)[ids.shape[0] - m]
        ranked = _ranked(p, ids[p[ids] >= cut])
        cum = np.cumsum(p[ranked])
        if cum[-1] >= target:
            return ranked, cum
    ranked = _ranked(p, ids)
    return ranked, np.cumsum(p[ranked])


def _splitmix64(x: int) -> int:
    """The splitmix64 output function of state x (x already advanced by the golden gamma)."""
    z = x & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) fixed by (seed, absolute position).

    Counter-based: element `position` of the splitmix64 stream whose start is
    a hash of the seed. Pure 64-bit integer arithmetic, so identical on every
    platform and run; 53 random bits.
    """
    if not isinstance(position, (int, np.integer)) or position < 0:
        raise ValueError(f"position must be an int >= 0, got {position!r}")
    if not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")
    key = _splitmix64(int(seed) + _GOLDEN)
    h = _splitmix64(key + (int(position) + 1) * _GOLDEN)
    return (h >> 11) * 2.0**-53


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The first token y (vocabulary order) with u < cdf[y]; u in [0, 1).

    Strict `<` means a zero-probability token is never drawn, even at u = 0.
    u is scaled by the total so rounding in the sum cannot leave a gap at the
    top; if rounding still puts u past the end, the last token with p > 0 wins
    (a measure-zero event).
    """
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u}")
    cdf = np.cumsum(probs, dtype=np.float64)
    y = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if y >= cdf.shape[0]:
        y = int(np.flatnonzero(probs > 0)[-1])
    return y


def sample_token(logits_row: np.ndarray, params: SamplingParams, seed: int | None, position: int) -> int:
    """The token drawn at absolute `position` (see the module docstring). Greedy: argmax, lowest id on ties."""
    if params.greedy:
        return int(np.argmax(_check_row(logits_row)))
    if seed is None:
        raise ValueError("sampling (temperature > 0) needs an integer seed")
    return inverse_cdf(process_logits(logits_row, params), position_uniform(seed, position))


def accept_walk(tree: DraftTree, choose: Callable[[int], int], stop_token_ids: tuple[int, ...] = ()) -> Acceptance:
    """Target-only walk: choose(node) gives the target's token after `node`.

    From the root: if a child carries the chosen token, accept that child and
    continue from it; otherwise the token is the bonus and the walk stops. A
    chosen stop token always ends the walk as the bonus.
    """
    stops = frozenset(stop_token_ids)
    node, path, tokens = 0, [0], []
    while True:
        y = int(choose(node))
        tokens.append(y)
        child = None if y in stops else tree.child_with_token(node, y)
        if child is None:
            return Acceptance(tuple(path), tuple(tokens))
        path.append(child)
        node = child


class TokenConstraint(Protocol):
    """Which tokens may come next (a grammar, engine/grammar.py), advanced by each chosen token."""

    def allowed(self) -> np.ndarray:
        """bool [vocab] for the next position."""

    def advance(self, token: int) -> None:
        """The token chosen at that position."""


def accept(
    tree: DraftTree, logits: np.ndarray, params: SamplingParams, seed: int | None, committed_len: int,
    generated: Sequence[int] = (), constraint: TokenConstraint | None = None,
    prompt_seen: frozenset[int] = frozenset(),
) -> Acceptance:
    """One accept round over verify logits [N, V] (row i = target logits after node i).

    Greedy walks on the argmax; sampling draws node i's token with position
    committed_len + depth_i + 1, which makes the emitted tokens identical to
    plain seeded sampling of the same target. Logit bias applies to every node;
    presence/frequency penalties count `generated` (this completion's tokens so
    far) plus the tree tokens on the node's path, as plain decoding would (the
    repetition penalty also `prompt_seen`). A constraint masks every node the
    walk visits, in walk order, and advances by every chosen token: the walk
    visits exactly the nodes of the emitted path, so each node's mask is the
    one plain decoding would use after the same tokens.
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != tree.size:
        raise ValueError(f"logits must be [{tree.size}, V] for this tree, got shape {logits.shape}")
    if committed_len < 0:
        raise ValueError(f"committed_len must be >= 0, got {committed_len}")
    if not params.greedy and seed is None:
        raise ValueError("sampling (temperature > 0) needs an integer seed")
    depths = tree.depths

    def choose(node: int) -> int:
        row = logits[node]
        if params.adjusts_logits:
            path_tokens = [tree.tokens[j] for j in tree.path_to(node)[1:]]
            row = adjust_logits(row, [*generated, *path_tokens], params, prompt_seen)
        if constraint is not None:
            row = np.where(constraint.allowed()[: row.shape[0]], row, -np.inf)
        y = sample_token(row, params, seed, committed_len + int(depths[node]) + 1)
        if constraint is not None:
            constraint.advance(y)
        return y

    return accept_walk(tree, choose, params.stop_token_ids)
