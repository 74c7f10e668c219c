"""Typed records passed between the engine's stages and to the server."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from engine.config import SamplingParams, SpecConfig


@dataclass
class GenerationRequest:
    """One generation for the single slot. prompt_ids are already tokenized."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecConfig | None = None  # None = the engine's default
    request_id: str = ""
    cancel: threading.Event = field(default_factory=threading.Event)
    embed: bool = False  # no generation: one Step with the prompt's embedding (engine/embedding.py)


@dataclass
class Stats:
    """Counters of one generation. Times in milliseconds."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_ms: float = 0.0  # prefill of the prompt (all but its last token), the draft model's included
    ttft_ms: float = 0.0  # request start to the first emitted token
    generated_tokens: int = 0
    decode_ms: float = 0.0
    forward_passes: int = 0  # target forward passes during decode (verify calls)
    drafted: int = 0  # draft nodes proposed (root excluded)
    accepted: int = 0  # draft nodes the target agreed with
    # accepted_per_pos[i]: rounds whose accepted path reached depth i + 1 (vLLM's per-position counters)
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    commit_ms: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def prefill_tps(self) -> float:
        new = self.prompt_tokens - self.cached_tokens
        return new / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0


@dataclass
class TokenLogprob:
    """Natural-log probability of an emitted token under the model's raw distribution
    (log_softmax of the logits, before temperature and penalties), with the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class Step:
    """What one round of the loop emits: zero or more tokens, and maybe the end."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | None
    stats: Stats | None = None  # set on the final step
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids when requested
    embedding: list[float] | None = None  # an embed request's answer
