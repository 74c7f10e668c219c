"""Frozen configuration records for the engine.

Everything a request or the server can tune lives here, validated once at
construction so later stages never re-check it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SPEC_METHODS = ("none", "ngram", "draft", "draft-tree", "mtp", "dflash")
# How the marginals of the one-pass drafters (mtp, dflash) become a tree: the top-1 chain, DDTree's
# best-first product of marginals, or the Weaver adapter's re-scored best-first search.
SPEC_TREES = ("chain", "ddtree", "weaver")
# "auto" = bfloat16 on a GPU, float32 on the CPU (engine/dtypes.py resolves it when the model loads)
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
KV_DTYPE_NAMES = (*DTYPE_NAMES, "int8")  # a K/V cache's: also 8-bit rows (engine/kv_int8.py)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks: do not stop at the tokenizer's end-of-sequence ids
    presence_penalty: float = 0.0  # OpenAI: subtracted once from logits of tokens already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    logprobs: int | None = None  # None = off; k = chosen token's logprob + top-k alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI: (token id, bias in [-100, 100]) added to logits
    # HF / vLLM: logits of tokens seen in the prompt or the output so far are divided by it (> 0) or
    # multiplied by it (<= 0); 1 = off
    repetition_penalty: float = 1.0
    # an llguidance grammar (engine/grammar.py) the output must follow, decided per token on the host
    grammar: str | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for tok, bias in self.logit_bias:
            if tok < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {tok}: {bias}")
        if len({tok for tok, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token more than once")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def reweights(self) -> bool:
        """Whether logits change token by token before sampling (bias, presence / frequency /
        repetition penalties): on the device or the host alike (engine/device_penalties.py)."""
        return self.penalized or bool(self.logit_bias) or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether logits change before sampling: reweighted, or masked by a grammar (on the host only)."""
        return self.reweights or self.grammar is not None


# A draft tree's depth where the settings leave it to the method (SpecConfig.max_depth 0): 8, and
# the MTP head's 6. Each head step past the first conditions on the head's own drafted states, so
# its guesses fade faster; 10 depths measured no faster than 6 on the dev CPU (BENCHMARKS.md, issue
# 12, twenty-fourth session). Asked for explicitly, the head drafts as deep as asked.
DEFAULT_DEPTH = 8
METHOD_DEPTHS = {"mtp": 6}


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings. method 'none' is plain decoding through the same loop."""

    method: str = "none"
    budget: int = 16  # max draft-tree nodes besides the root
    max_depth: int = 0  # 0: the method's default (METHOD_DEPTHS, else DEFAULT_DEPTH), set on creation
    draft_model: str | None = None  # checkpoint dir for methods 'draft' and 'draft-tree'
    tree: str = "ddtree"  # tree builder of methods 'mtp' and 'dflash' (SPEC_TREES)
    dflash_model: str | None = None  # DFlash checkpoint dir (default: the bundled one for the bundled target)
    weaver_model: str | None = None  # Weaver adapter dir (default: DFLASH_DIR/weaver)
    # tokens the one-pass drafters (mtp, dflash) may propose: the first N of the checkpoint's
    # frequency ranking (engine/drafters/draft_vocab.py); None: the checkpoint's default size where
    # it ships a ranking, else the whole vocabulary; 0: the whole vocabulary
    draft_vocab: int | None = None
    # size each round's tree by measured tokens per second, the root alone included
    # (engine/spec_control.py); False: every round gets the full budget
    adaptive: bool = True
    # with `adaptive`: the longest round the controller keeps, in plain rounds (a round's tokens
    # reach a streaming client together, so this bounds its gaps); None: no cap
    max_stall: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"spec method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.tree not in SPEC_TREES:
            raise ValueError(f"spec tree must be one of {SPEC_TREES}, got {self.tree!r}")
        if self.budget < 1:
            raise ValueError(f"spec budget must be >= 1, got {self.budget}")
        if self.max_depth == 0:
            object.__setattr__(self, "max_depth", METHOD_DEPTHS.get(self.method, DEFAULT_DEPTH))
        if self.max_depth < 1:
            raise ValueError(f"spec max_depth must be >= 1 (0: the method's default), got {self.max_depth}")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise ValueError(f"draft vocabulary size must be >= 0, got {self.draft_vocab}")
        if self.max_stall is not None and not self.max_stall > 1.0:
            raise ValueError(f"spec max stall must be > 1 (plain rounds), got {self.max_stall}")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    model_id: str | None = None  # the name clients see (a hub repo id); None = the directory's name
    max_context: int = 8192
    prefill_chunk: int = 0  # tokens a prefill pass; 0 = the backend's (engine/prefill.py, default_prefill_chunk)
    dtype: str = "auto"  # compute dtype for float weights (DTYPE_NAMES)
    spec: SpecConfig = field(default_factory=SpecConfig)
    prefix_cache: bool = True
    prefix_cache_bytes: int = 2 << 30
    snapshot_every: int = 1024  # prefill snapshots every this many prompt tokens (engine/prefill.py); 0 = off
    # what the target's attention K/V are stored as (KV_DTYPE_NAMES; auto: engine/dtypes.py resolve_kv_dtype): a
    # half dtype rounds each row once as it is written (engine/cache.py KVCache), halving the cache
    # and, on the CPU, what a decode step reads of it; int8 quantizes each row (engine/kv_int8.py)
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {self.max_context}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 1 (or 0: the backend's default), got {self.prefill_chunk}")
        if self.snapshot_every < 0:
            raise ValueError(f"snapshot_every must be >= 0, got {self.snapshot_every}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {self.kv_dtype!r}")
