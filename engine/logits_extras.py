"""Per-request logit adjustments and read-outs that sit beside sampling: OpenAI's logit bias,
presence and frequency penalties, and log-probabilities of emitted tokens."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from engine.config import SamplingParams
from engine.types import TokenLogprob


def adjust_logits(logits: np.ndarray, generated: Iterable[int], params: SamplingParams,
                  prompt_seen: frozenset[int] = frozenset()) -> np.ndarray:
    """logits + logit_bias - frequency_penalty * count(t) - presence_penalty * [count(t) > 0], the
    counts over the tokens generated so far in this completion; then the repetition penalty on the
    tokens generated or in `prompt_seen` (the prompt's tokens), whose sign test sees the adjusted
    logit. float64 copy; the input is unchanged."""
    out = np.array(logits, dtype=np.float64)
    for tok, bias in params.logit_bias:
        out[tok] += bias
    counts = Counter(generated)
    if counts and params.penalized:
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        n = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
        out[ids] -= params.frequency_penalty * n + params.presence_penalty
    if params.repetition_penalty != 1.0:
        seen = prompt_seen.union(counts)
        if seen:
            ids = np.fromiter(seen, dtype=np.int64, count=len(seen))
            x = out[ids]
            out[ids] = np.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    return out


def top_probabilities(rows: np.ndarray) -> np.ndarray:
    """rows [n, V] raw logits -> [n]: the probability of each row's most likely token."""
    x = np.asarray(rows, dtype=np.float64)
    return 1.0 / np.exp(x - x.max(axis=-1, keepdims=True)).sum(axis=-1)


def token_logprobs(rows: np.ndarray, tokens: list[int], k: int) -> list[TokenLogprob]:
    """rows [n, V] raw logits that produced tokens [n] -> one TokenLogprob per token."""
    out = []
    for row, tok in zip(rows, tokens):
        x = np.asarray(row, dtype=np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        top = np.argsort(-lp, kind="stable")[:k]
        out.append(TokenLogprob(int(tok), float(lp[tok]), [(int(t), float(lp[t])) for t in top]))
    return out
