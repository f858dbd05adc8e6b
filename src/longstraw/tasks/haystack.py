"""Needle-in-a-haystack tasks: ``passkey`` (one hidden number) and ``multikey`` (several named numbers, one asked).

The haystack is boring filler ("The grass is green. The river flows slowly. ...") whose length is set in TOKENS
of a given tokenizer: ``build_haystack`` searches the number of filler words until the whole prompt (head, filler,
needles, question; no special tokens, no chat template) is as long as possible without exceeding
``prompt_tokens``. Filler never contains digits, so the only numbers in a prompt are the keys.

Depth is a fraction of the filler: 0 puts a needle right after the task description, 1 right before the question.
Needles are snapped to the nearest sentence boundary so they never split a sentence; the filler itself may stop
mid-sentence before the question, which is what lets the length land within one word of the target.

The passkey prompt follows Mohtashami & Jaggi (2023, "Landmark Attention"); multikey is our variant with named
keys as distractors, which is what makes a 135M model fail at ~1k tokens (docs/design.md §7)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from longstraw.tasks.base import Example, Task, count_tokens, digit_reward

_SUBJECTS = (
    "The grass", "The sky", "The sun", "The river", "The old road", "The garden", "A small bird", "The wind",
    "The mountain", "The lake", "The forest", "The village", "The morning", "The evening", "The sea", "A quiet cat",
    "The field", "The bridge", "The harbor", "The meadow", "The orchard", "The valley", "A grey cloud", "The path",
)
_PREDICATES = (
    "is green", "is blue", "is yellow", "is calm", "is very quiet", "flows slowly", "shines brightly", "feels warm",
    "looks peaceful", "stays the same", "moves gently", "is far away", "is wide and open", "rests in the shade",
    "waits patiently", "sings softly", "glows at dusk", "turns golden", "smells of rain", "is bright today",
)
_INTERJECTIONS = ("Here we go.", "There and back again.", "Nothing changes here.", "Time passes slowly.")

# Names for multikey: distinct single words, so the question names exactly one key.
NAMES = (
    "Alice", "Bruno", "Chloe", "Daniel", "Elena", "Farid", "Greta", "Hiro", "Ingrid", "Jonas", "Keiko", "Liam",
    "Marta", "Nikos", "Olga", "Pavel", "Quinn", "Rosa", "Samir", "Tanya", "Umar", "Vera", "Wendy", "Xavier",
    "Yusuf", "Zara", "Anton", "Bianca", "Carlos", "Dina", "Emil", "Fiona",
)


def _filler_sentence(rng: random.Random) -> str:
    return rng.choice(_INTERJECTIONS) if rng.random() < 0.15 else f"{rng.choice(_SUBJECTS)} {rng.choice(_PREDICATES)}."


class _Filler:
    """An endless, seeded stream of filler words, with the word indices where sentences start."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.words: list[str] = []
        self.starts: list[int] = []

    def ensure(self, n_words: int) -> None:
        while len(self.words) < n_words:
            self.starts.append(len(self.words))
            self.words.extend(_filler_sentence(self.rng).split())

    def boundary_near(self, index: int, n_words: int) -> int:
        """The sentence boundary (a start index, or ``n_words`` itself) nearest to ``index`` within [0, n_words]."""
        candidates = [s for s in self.starts if s <= n_words] + [n_words]
        return min(candidates, key=lambda s: (abs(s - index), s))


def _assemble(head: str, filler: _Filler, n_words: int, needles: list[tuple[float, str]], question: str) -> str:
    """head + filler[:n_words] with each needle inserted at its depth's sentence boundary + question."""
    filler.ensure(n_words)
    at: dict[int, list[str]] = {}
    for depth, text in needles:  # needles sharing a boundary keep their given order
        at.setdefault(filler.boundary_near(round(depth * n_words), n_words), []).append(text)
    parts = [head]
    for i in range(n_words):
        parts.extend(at.get(i, ()))
        parts.append(filler.words[i])
    parts.extend(at.get(n_words, ()))
    return " ".join(parts) + "\n\n" + question


def build_haystack(tokenizer: Any, prompt_tokens: int, head: str, needles: list[tuple[float, str]], question: str,
                   rng: random.Random) -> tuple[str, int]:
    """The longest prompt ``head + filler-with-needles + question`` of at most ``prompt_tokens`` tokens.

    Returns ``(prompt, n_tokens)``. Tokenization is not additive (merges across word boundaries), so the length is
    measured on the whole text: secant steps on the filler word count get close, then single-word steps settle on
    the largest count that fits. The result lands a few tokens under the target (one word's worth at most).
    Raises ValueError when the fixed text alone exceeds ``prompt_tokens``."""
    filler = _Filler(rng)
    cache: dict[int, int] = {}

    def length(n: int) -> int:
        if n not in cache:
            cache[n] = count_tokens(tokenizer, _assemble(head, filler, n, needles, question))
        return cache[n]

    fixed = length(0)
    if fixed > prompt_tokens:
        raise ValueError(f"prompt_tokens={prompt_tokens} is too small: the task text without filler already takes "
                         f"{fixed} tokens")
    # Secant steps: tokens per filler word measured from the last probe (about 1.2-1.5 for BPE vocabularies).
    n, rate = 0, 1.3
    for _ in range(8):
        n = max(0, n + round((prompt_tokens - length(n)) / rate))
        if n > 0:
            rate = max((length(n) - fixed) / n, 0.25)
        if abs(prompt_tokens - length(n)) <= 2 * rate:
            break
    # Settle: the largest n with length(n) <= target. Steps are ~1 token each, so this is a short walk.
    while n > 0 and length(n) > prompt_tokens:
        n -= 1
    while length(n + 1) <= prompt_tokens:
        n += 1
    return _assemble(head, filler, n, needles, question), length(n)


def _random_key(rng: random.Random, digits: int) -> str:
    # No leading zero: "01234" and "1234" would read as the same number.
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(digits - 1))


def _check_common(prompt_tokens: int, digits: int, depth: float | None) -> None:
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a fraction in [0, 1] or None (random), got {depth}")


@dataclass
class PasskeyTask(Task):
    """One random ``digits``-digit pass key hidden at ``depth`` in ~``prompt_tokens`` tokens of filler. ``depth=None``
    draws a uniform depth per example. Reward: ``digit_reward`` on the completion's first number."""

    tokenizer: Any
    prompt_tokens: int = 1024
    digits: int = 5
    depth: float | None = None

    def __post_init__(self) -> None:
        _check_common(self.prompt_tokens, self.digits, self.depth)

    def sample(self, rng: random.Random) -> Example:
        key = _random_key(rng, self.digits)
        depth = rng.random() if self.depth is None else self.depth
        # A child rng for the filler: its length depends on the tokenizer, and the parent stream must not.
        filler_rng = random.Random(rng.getrandbits(64))
        head = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                "Find it and memorize it. I will quiz you about it.")
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        question = "What is the pass key? Answer with the number only."
        prompt, n = build_haystack(self.tokenizer, self.prompt_tokens, head, [(depth, needle)], question, filler_rng)
        return Example(prompt, key, {"task": "passkey", "depth": depth, "prompt_tokens": n})

    def reward(self, completion: str, example: Example) -> float:
        return digit_reward(completion, example.answer)


@dataclass
class MultikeyTask(Task):
    """``n_keys`` named pass keys ("The pass key for Rosa is 40213.") in the haystack; the question asks for one. The
    asked key sits at ``depth`` (``None``: uniform per example); the other ``n_keys - 1`` are distractors at uniform
    random depths. All keys are distinct. ``repeat=True`` states each key twice in its sentence (the passkey style),
    which makes retrieval easier. Reward: ``digit_reward`` on the completion's first number, so answering with a
    distractor's key earns only the digits it shares by chance with the asked one."""

    tokenizer: Any
    prompt_tokens: int = 1024
    n_keys: int = 4
    digits: int = 5
    depth: float | None = None
    repeat: bool = False

    def __post_init__(self) -> None:
        _check_common(self.prompt_tokens, self.digits, self.depth)
        if not 1 <= self.n_keys <= len(NAMES):
            raise ValueError(f"n_keys must be in [1, {len(NAMES)}], got {self.n_keys}")
        if self.n_keys > 9 * 10 ** (self.digits - 1):
            raise ValueError(f"n_keys={self.n_keys} distinct keys do not exist with digits={self.digits}")

    def sample(self, rng: random.Random) -> Example:
        names = rng.sample(NAMES, self.n_keys)
        keys: list[str] = []
        while len(keys) < self.n_keys:
            key = _random_key(rng, self.digits)
            if key not in keys:
                keys.append(key)
        depths = [rng.random() for _ in range(self.n_keys)]
        if self.depth is not None:
            depths[0] = self.depth
        filler_rng = random.Random(rng.getrandbits(64))
        # names[0]/keys[0] is the asked key; the needles go in by depth, so list order does not give it away.
        again = " Remember it. {k} is the pass key for {n}." if self.repeat else ""
        needles_by_depth = sorted(((d, f"The pass key for {n} is {k}." + again.format(k=k, n=n))
                                   for d, n, k in zip(depths, names, keys)), key=lambda t: t[0])
        head = ("There are several pass keys hidden inside a lot of irrelevant text. Each belongs to a person. "
                "Find them and memorize them. I will quiz you about one of them.")
        question = f"What is the pass key for {names[0]}? Answer with the number only."
        prompt, n = build_haystack(self.tokenizer, self.prompt_tokens, head, needles_by_depth, question, filler_rng)
        meta = {"task": "multikey", "depth": depths[0], "prompt_tokens": n, "name": names[0],
                "distractors": dict(zip(names[1:], keys[1:])), "depths": dict(zip(names, depths))}
        return Example(prompt, keys[0], meta)

    def reward(self, completion: str, example: Example) -> float:
        return digit_reward(completion, example.answer)
