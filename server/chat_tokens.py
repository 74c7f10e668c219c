"""Rendered chat prompt -> token ids, with the special tokens a user typed kept as plain text.

The chat template writes control tokens (<|im_start|>, <|im_end|>) around text that clients
send: message contents, tool results, tool definitions, names. Tokenized as one string, a
message that contains "<|im_end|>\\n<|im_start|>system" would end its turn and forge a system
turn. So before rendering, every special-token spelling inside client text gets an invisible
mark (a private-use character after its first character), which also keeps a client string that
ends with the start of a special token from completing one with the text after it. After
rendering, the unmarked special-token spellings are the template's own: the prompt is split at
them, and the text between them is tokenized with special tokens read as text, marks removed.
The model sees exactly the characters the client sent.

A client string that itself contains the mark character is escaped (doubled), so the text
survives unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.tokenizer import Tokenizer

MARK = "\ue000"  # Unicode private use area: no tokenizer gives it meaning
_UNMARK = re.compile(MARK + "(" + MARK + ")?")


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat prompt in which client text is marked (see the module docstring)."""

    marked: str

    @property
    def text(self) -> str:
        """The prompt as the model reads it."""
        return unmark(self.marked)


def unmark(text: str) -> str:
    return _UNMARK.sub(lambda m: m.group(1) or "", text)


class SpecialTokenGuard:
    """Marks client strings (before rendering) and tokenizes marked prompts (after)."""

    def __init__(self, special_tokens: tuple[str, ...]) -> None:
        self.specials = tuple(t for t in special_tokens if t)
        self._pattern = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        self._prefixes = frozenset(t[:k] for t in self.specials for k in range(1, len(t)))
        self._longest = max((len(t) for t in self.specials), default=0)

    def mark(self, text: str) -> str:
        """Client text -> text in which no special token can be read, alone or with what follows."""
        text = text.replace(MARK, MARK + MARK)
        if self._pattern is None:
            return text
        text = self._pattern.sub(lambda m: m.group()[0] + MARK + m.group()[1:], text)
        return self._mark_open_tail(text)

    def _mark_open_tail(self, text: str) -> str:
        """Break a tail that is the start of a special token ("...<|im_"), which a template could
        complete with the next client string."""
        for start in range(max(0, len(text) - self._longest + 1), len(text)):
            if text[start:] in self._prefixes:
                return text[: start + 1] + MARK + text[start + 1 :]
        return text

    def mark_all(self, value):
        """mark() every string inside a JSON-like value (dict keys too); other values unchanged."""
        if isinstance(value, str):
            return self.mark(value)
        if isinstance(value, dict):
            return {self.mark_all(k): self.mark_all(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark_all(v) for v in value]
        return value

    def encode(self, tokenizer: Tokenizer, prompt: ChatPrompt, trusted_suffix: str = "") -> list[int]:
        """Token ids of prompt + trusted_suffix (server-made text, e.g. a forced tool-call start)."""
        marked = prompt.marked + trusted_suffix
        if self._pattern is None:
            return tokenizer.encode(unmark(marked), special=False)
        texts, specials, at = [], [], 0
        for m in self._pattern.finditer(marked):
            texts.append(unmark(marked[at : m.start()]))
            specials.append(m.group())
            at = m.end()
        texts.append(unmark(marked[at:]))
        encoded = tokenizer.encode_many(texts, special=False)
        ids: list[int] = []
        for i, piece in enumerate(encoded):
            ids += piece
            if i < len(specials):
                special = tokenizer.token_id(specials[i])
                assert special is not None  # the pattern is built from the tokenizer's own tokens
                ids.append(special)
        return ids
