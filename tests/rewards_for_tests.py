"""A reward for the trainer tests: varies across random responses, so gradients are non-zero."""


def even_byte_fraction(completion: str, answer: str) -> float:
    data = completion.encode("utf-8", errors="replace")
    return sum(b % 2 == 0 for b in data) / len(data) if data else 0.0


_calls = 0


def _counted() -> int:
    global _calls
    _calls += 1
    return _calls


def raises_on_call_10(completion: str, answer: str) -> float:
    """even_byte_fraction, but the 10th call raises: with G = 3, the first reward of step 4 (steps 1-3 complete)."""
    if _counted() == 10:
        return 1 / 0
    return even_byte_fraction(completion, answer)


def nan_on_call_4(completion: str, answer: str) -> float:
    """even_byte_fraction, but the 4th call returns NaN: with G = 3, the first reward of step 2."""
    return float("nan") if _counted() == 4 else even_byte_fraction(completion, answer)


def huge_alternating(completion: str, answer: str) -> float:
    """+1e308 and -1e308 in turn: every reward is finite, but their spread overflows float64 (grpo's std)."""
    return 1e308 if _counted() % 2 else -1e308
