"""Structured output enforced while decoding: an llguidance grammar masks the tokens that may come next.

Why llguidance (over xgrammar and outlines-core): it is a Rust library with abi3 wheels for Linux
x86_64 / aarch64 and macOS arm64 and no Python dependencies (xgrammar pulls in torch and
transformers; outlines-core compiles JSON schemas to one regular expression, which cannot express
recursive schemas, and its vocabulary needs building by hand); it reads a `tokenizers` byte-level
BPE `tokenizer.json` as it is (no transformers), computes a mask in about 0.1-1 ms on the CPU, and
takes JSON schemas and Lark grammars that can match single tokens by id (a reasoning block ended by
the `</think>` token, then JSON). Masks are plain bits, applied on the host (engine/sampler.py).

One GrammarState per request. The accept walk asks it for the mask at each node it visits and
advances it by the token chosen there, so it walks the accepted path exactly as plain decoding
would walk the same tokens: a drafted token the grammar forbids can never be chosen, and so is never
accepted. The state is never rolled back: every token chosen in the walk is emitted.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import llguidance


class GrammarError(ValueError):
    """A grammar that does not compile (the server checks schemas before they get here)."""


class GrammarTokenizer:
    """llguidance's view of the model's tokenizer, built once per engine (it indexes the vocabulary)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        # imported here: the engine runs without it (a GPU image may lack it) until a request
        # asks for structured output
        try:
            import llguidance
        except ImportError as e:
            raise GrammarError(f"structured output needs the llguidance package ({e})") from None
        self._lib = llguidance
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._tok = llguidance.LLTokenizer(tokenizer_json.read_text(encoding="utf-8"), n_vocab=vocab_size,
                                           eos_token=list(eos_ids) or None)

    def state(self, grammar: str) -> GrammarState:
        matcher = self._lib.LLMatcher(self._tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {matcher.get_error()}")
        return GrammarState(matcher, self.vocab_size, self.eos_ids)


class GrammarState:
    """Where one generation stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._eos = np.array(eos_ids, dtype=np.int64)
        self._words = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next. A finished grammar allows only the end of
        the text; a matcher in an error state (it cannot happen through this class: only allowed
        tokens are consumed) also ends it, rather than leaving no token to choose."""
        if self._matcher.is_error():
            return self._only_eos()
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self._vocab].astype(bool)
        return bits if bits.any() else self._only_eos()

    def advance(self, token: int) -> None:
        """The token chosen at the current position."""
        if not self._matcher.is_error():
            self._matcher.consume_token(int(token))

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end of the text."""
        return self._matcher.is_stopped()

    def _only_eos(self) -> np.ndarray:
        mask = np.zeros(self._vocab, dtype=bool)
        mask[self._eos[self._eos < self._vocab]] = True
        return mask
