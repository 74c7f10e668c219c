"""Turn a function's docstring into user requests ("Write a python function to ...").

Used by build_corpus.py. The stdlib mostly follows PEP 257 ("Return the ...", imperative
mood), so the first sentence of a docstring reads as the thing a user would ask for.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

# First words that start a noun phrase, not a verb: "The number of ...", "Helper for ...".
NOUN_STARTS = {
    "the", "a", "an", "this", "that", "these", "those", "helper", "internal", "private",
    "utility", "deprecated", "used", "called", "similar", "like", "same", "decorator",
    "wrapper", "function", "method", "constructor", "class", "alias", "default", "abstract",
    "implementation", "override", "overrides", "overridden", "hook", "subclasses", "for",
    "if", "when", "in", "on", "as", "with", "it", "is", "see", "note", "xxx", "todo", "our",
    "standard", "simple", "convenience", "return:", "returns:", "new", "main", "test", "true",
    "false", "none", "whether", "all", "some", "each", "one", "two", "how", "what", "why",
}
# Verbs that end in "s" in the imperative ("Process the ...") and so are not third person.
S_IMPERATIVES = {"process", "access", "address", "bypass", "compress", "decompress", "express",
                 "pass", "press", "toss", "discuss", "guess", "focus", "alias", "parse"}
BAD_TEXT = re.compile(r">>>|::|\{|\}|`|\$|\bXXX\b|\bTODO\b|\bself\b|^\W")


@dataclass(frozen=True)
class Request:
    """One way of asking for a function: the sentence the user types."""

    text: str
    style: str  # "to" | "that" | "doc": which grammatical slot the docstring filled


def first_sentence(docstring: str) -> str | None:
    """First sentence of the docstring's first paragraph, without its final period."""
    paragraph = docstring.strip().split("\n\n")[0]
    line = " ".join(part.strip() for part in paragraph.splitlines())
    sentence = re.split(r"(?<=[a-z0-9)])\.\s", line + " ")[0].strip().rstrip(".").strip()
    words = sentence.split()
    if not 3 <= len(words) <= 24 or len(sentence) > 160 or BAD_TEXT.search(sentence):
        return None
    return sentence


def lower_first(sentence: str) -> str:
    """Lowercase the first letter unless the first word is an acronym or identifier."""
    word = sentence.split()[0]
    if word[1:] != word[1:].lower() or "_" in word or "(" in word:
        return sentence
    return sentence[0].lower() + sentence[1:]


def to_third_person(verb: str) -> str:
    if verb.endswith("y") and len(verb) > 2 and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    return verb + "s"


def to_imperative(verb: str) -> str:
    if verb.endswith("ies"):
        return verb[:-3] + "y"
    if verb.endswith(("sses", "shes", "ches", "xes", "zes", "oes")):
        return verb[:-2]
    return verb[:-1]


def verb_forms(sentence: str) -> tuple[str, str] | None:
    """(imperative clause, third-person clause) for a verb-first sentence, else None."""
    first, _, rest = lower_first(sentence).partition(" ")
    if first.lower() in NOUN_STARTS or not first.isalpha() or not first.islower():
        return None
    third_person = first.endswith("s") and not first.endswith("ss") and first not in S_IMPERATIVES
    imperative = to_imperative(first) if third_person else first
    third = first if third_person else to_third_person(first)
    return f"{imperative} {rest}", f"{third} {rest}"


def requests_for(docstring: str, name: str, is_method: bool, rng: random.Random, n: int) -> list[Request]:
    """Up to n distinct phrasings of a request for the function with this docstring."""
    sentence = first_sentence(docstring)
    if sentence is None:
        return []
    forms = verb_forms(sentence)
    kind = "method" if is_method and rng.random() < 0.5 else "function"
    if forms is None:
        options = [
            Request(f"Write a python {kind} for this description: {sentence}.", "doc"),
            Request(f"Write a Python {kind} `{name}`. {sentence}.", "doc"),
        ]
    else:
        imp, third = forms
        options = [
            Request(f"Write a python {kind} to {imp}", "to"),
            Request(f"Write a python {kind} to {imp}.", "to"),
            Request(f"Write a Python {kind} that {third}.", "that"),
            Request(f"write a python {kind} that {third}", "that"),
            Request(f"Write a {kind} in Python to {imp}.", "to"),
            Request(f"Implement a Python {kind} `{name}` that {third}.", "that"),
            Request(f"Can you write a python {kind} to {imp}?", "to"),
            Request(f"How do I {imp} in Python? Write a {kind}.", "to"),
        ]
    # The bare "Write a python function to ..." form is the one users type most: always keep it.
    head, tail = options[:1], options[1:]
    rng.shuffle(tail)
    return (head + tail)[:n]
