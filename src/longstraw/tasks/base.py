"""The task interface and the helpers every task shares: examples, token counting, chat formatting, rewards.

A task is a plain dataclass with two methods:

- ``sample(rng: random.Random) -> Example``: draw one prompt with its reference answer;
- ``reward(completion: str, example: Example) -> float``: score a decoded completion against it.

``Task.examples(n, seed)`` draws ``n`` examples from ``random.Random(seed)``, so a seed fixes a held-out set."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """One prompt and its reference answer. ``meta`` carries task-specific facts (depth, measured token count, ...)."""

    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task:
    """Base class: subclasses implement ``sample`` and ``reward``; ``examples`` is shared."""

    def sample(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def reward(self, completion: str, example: Example) -> float:
        raise NotImplementedError

    def examples(self, n: int, seed: int = 0) -> list[Example]:
        """``n`` examples drawn from ``random.Random(seed)``: the same seed gives the same list."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]


# ----------------------------------------------------------------------------------------------------- tokenizers
def _as_id_list(out: Any) -> list[int]:
    """Flatten what a tokenizer returned into a list of ints. Handles a list of ints, a batch of one (``[[...]]``), a
    dict/BatchEncoding with ``input_ids`` (transformers 5's ``apply_chat_template`` returns one by default), a
    ``tokenizers.Encoding`` (``.ids``) and tensors/arrays."""
    if isinstance(out, Mapping) or hasattr(out, "keys") and "input_ids" in out.keys():  # BatchEncoding is a UserDict
        out = out["input_ids"]
    if hasattr(out, "ids") and not isinstance(out, (list, tuple)):
        out = out.ids
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if len(out) == 1 and isinstance(out[0], (list, tuple)):
        out = list(out[0])
    if out and isinstance(out[0], (list, tuple)):
        raise ValueError(f"expected the token ids of one sequence, got a batch of {len(out)}")
    return [int(t) for t in out]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (no BOS/EOS), so lengths add up across pieces of a prompt. Works
    with transformers tokenizers (``encode(text, add_special_tokens=False)``), ``tokenizers.Tokenizer`` (``encode``
    returns an ``Encoding``), and any callable returning ``{"input_ids": ...}``."""
    if hasattr(tokenizer, "encode"):
        try:
            return _as_id_list(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:  # an encode() without that keyword
            return _as_id_list(tokenizer.encode(text))
    if callable(tokenizer):
        return _as_id_list(tokenizer(text))
    raise TypeError(f"tokenizer must have encode() or be callable, got {type(tokenizer).__name__}")


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens of ``text`` (no special tokens): the unit of every task's ``prompt_tokens``."""
    return len(encode(tokenizer, text))


def format_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as a single user turn, ready for generation or for a ``Group``'s prompt. With a chat
    template: ``apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)`` (the template
    itself decides BOS and any system preamble). Without one: ``tokenizer.encode(text)`` with the tokenizer's default
    special tokens. Always returns a flat ``list[int]``."""
    if getattr(tokenizer, "chat_template", None):
        return _as_id_list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                         add_generation_prompt=True, tokenize=True))
    return _as_id_list(tokenizer.encode(text)) if hasattr(tokenizer, "encode") else encode(tokenizer, text)


# ---------------------------------------------------------------------------------------------------------- rewards
# A run of digits, allowing thousands separators ("72,819") because models often write numbers that way.
_NUMBER = re.compile(r"\d(?:,?\d)*")


def first_number(text: str) -> str | None:
    """The first number in ``text`` as a digit string (thousands commas removed), or None if there is none."""
    m = _NUMBER.search(text)
    return m.group(0).replace(",", "") if m else None


def positional_match(found: str, answer: str) -> float:
    """Fraction of positions where ``found`` and ``answer`` agree, over ``max(len(found), len(answer))``.

    Dividing by the longer length makes a length mismatch cost: missing characters score 0 and extra characters
    add no credit but dilute it (answer "12345": "12345" -> 1.0, "1234" -> 0.8, "123456" -> 5/6, "12395" -> 0.8)."""
    if not found or not answer:
        return 0.0
    hits = sum(a == b for a, b in zip(found, answer))
    return hits / max(len(found), len(answer))


def digit_reward(completion: str, answer: str) -> float:
    """Partial-credit reward for a numeric answer: ``positional_match`` of the completion's FIRST number. Only the first
    number counts, so listing several guesses does not help; no number scores 0."""
    found = first_number(completion)
    return 0.0 if found is None else positional_match(found, answer)


def check_reward(value: Any, where: str) -> float:
    """``value`` as a float, or a ValueError naming ``where`` if it is not a finite real number."""
    # Strings would pass float("0.5"); refusing them catches a function that returns its text by mistake.
    # bool passes as 0/1 (a common shape for match functions); numpy/torch scalars pass through float().
    if value is None or isinstance(value, (str, bytes, complex)):
        raise ValueError(f"{where} returned {type(value).__name__} {value!r}; a reward must be a real number")
    try:
        out = float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where} returned {type(value).__name__} {value!r}; a reward must be a real number") from e
    if not math.isfinite(out):
        raise ValueError(f"{where} returned {out}; a reward must be finite")
    return out
