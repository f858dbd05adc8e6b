"""``kv``: key-value retrieval from a JSON object of random UUIDs (Liu et al. 2023, "Lost in the Middle").

The prompt is a JSON object ``{"<uuid>": "<uuid>", ...}`` and asks for the value of one key. Length is set either by
``n_pairs`` or by ``prompt_tokens`` (the largest number of pairs whose prompt fits; one pair is ~40-50 BPE tokens, so
the prompt lands within one pair's worth under the target). ``depth`` places the asked pair (0: first, 1: last).

Reward: the completion's first UUID-shaped string, skipping any copy of the asked KEY (a model that restates the
question before answering should not be scored on the key). ``partial=False`` (default): exact match, 1 or 0 — a UUID
with a few right characters is still the wrong record, and chance agreement of hex characters (1/16 each) would add
noise to a partial score. ``partial=True``: ``positional_match`` over the 36 characters, a denser signal."""

from __future__ import annotations

import json
import random
import re
import uuid
from dataclasses import dataclass
from typing import Any

from longstraw.tasks.base import Example, Task, count_tokens, positional_match

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _prompt(pairs: list[tuple[str, str]], key: str) -> str:
    body = json.dumps(dict(pairs), indent=1)
    return ("Extract the value corresponding to the specified key in the JSON object below.\n\n"
            f"JSON data:\n{body}\n\n"
            f'Key: "{key}"\nCorresponding value:')


def _placed(pairs: list[tuple[str, str]], n: int, depth: float) -> tuple[str, int]:
    """(prompt, asked index): the first `n` pairs with the asked one, pairs[0], moved to index round(depth * (n-1))."""
    i = round(depth * (n - 1))
    shown = pairs[1:n]
    shown.insert(i, pairs[0])
    return _prompt(shown, pairs[0][0]), i


@dataclass
class KVTask(Task):
    """Retrieve one value from a JSON object of UUID pairs; give ``n_pairs`` or ``prompt_tokens`` (+ tokenizer)."""

    tokenizer: Any = None
    prompt_tokens: int | None = None
    n_pairs: int | None = None
    depth: float | None = None
    partial: bool = False

    def __post_init__(self) -> None:
        if (self.prompt_tokens is None) == (self.n_pairs is None):
            raise ValueError("give exactly one of prompt_tokens (with a tokenizer) or n_pairs")
        if self.prompt_tokens is not None and self.tokenizer is None:
            raise ValueError("prompt_tokens needs a tokenizer to count tokens with")
        if self.n_pairs is not None and self.n_pairs < 1:
            raise ValueError(f"n_pairs must be >= 1, got {self.n_pairs}")
        if self.depth is not None and not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"depth must be a fraction in [0, 1] or None (random), got {self.depth}")

    def _fit_pairs(self, pairs: list[tuple[str, str]], depth: float, rng: random.Random) -> tuple[str, int, int, int]:
        """(prompt, tokens, asked index, pair count) for the largest count of pairs that fits ``prompt_tokens``. Grows
        ``pairs`` in place from ``rng``; ``pairs[0]`` is the asked pair."""
        assert self.prompt_tokens is not None

        def build(n: int) -> tuple[str, int, int, int]:
            while len(pairs) < n:
                pairs.append((_uuid(rng), _uuid(rng)))
            text, i = _placed(pairs, n, depth)
            return text, count_tokens(self.tokenizer, text), i, n

        text, n_tok, _, _ = build(1)
        if n_tok > self.prompt_tokens:
            raise ValueError(f"prompt_tokens={self.prompt_tokens} is too small: one pair already takes {n_tok} tokens")
        per_pair = max(count_tokens(self.tokenizer, _prompt(pairs[:1] + [(_uuid(rng), _uuid(rng))], "x")) -
                       count_tokens(self.tokenizer, _prompt(pairs[:1], "x")), 1)
        n = max(1, 1 + (self.prompt_tokens - n_tok) // per_pair)
        best = build(n)
        for _ in range(4):  # proportional corrections first, so long prompts need few full re-encodes
            step = (self.prompt_tokens - best[1]) // per_pair
            if abs(step) <= 1:
                break
            n = max(1, n + step)
            best = build(n)
        while n > 1 and best[1] > self.prompt_tokens:
            n -= 1
            best = build(n)
        while True:
            nxt = build(n + 1)
            if nxt[1] > self.prompt_tokens:
                return best
            n, best = n + 1, nxt

    def sample(self, rng: random.Random) -> Example:
        depth = rng.random() if self.depth is None else self.depth
        pair_rng = random.Random(rng.getrandbits(64))  # pair count depends on the tokenizer; keep rng's stream fixed
        pairs = [(_uuid(pair_rng), _uuid(pair_rng))]
        if self.n_pairs is not None:
            pairs += [(_uuid(pair_rng), _uuid(pair_rng)) for _ in range(self.n_pairs - 1)]
            n = self.n_pairs
            prompt, i = _placed(pairs, n, depth)
            n_tok = count_tokens(self.tokenizer, prompt) if self.tokenizer is not None else None
        else:
            prompt, n_tok, i, n = self._fit_pairs(pairs, depth, pair_rng)
        meta = {"task": "kv", "depth": depth, "index": i, "n_pairs": n, "key": pairs[0][0], "prompt_tokens": n_tok}
        return Example(prompt, pairs[0][1], meta)

    def reward(self, completion: str, example: Example) -> float:
        key = example.meta.get("key", "").lower()
        found = next((m.group(0).lower() for m in _UUID.finditer(completion) if m.group(0).lower() != key), None)
        answer = example.answer.lower()
        if found is None:
            return 0.0
        return positional_match(found, answer) if self.partial else float(found == answer)
