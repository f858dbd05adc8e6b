"""A reward for the trainer tests: varies across random responses, so gradients are non-zero."""


def even_byte_fraction(completion: str, answer: str) -> float:
    data = completion.encode("utf-8", errors="replace")
    return sum(b % 2 == 0 for b in data) / len(data) if data else 0.0
