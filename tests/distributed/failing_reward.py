"""Rewards for the distributed trainer tests (importable by the ranks through PYTHONPATH)."""

import os

_calls = 0


def fail_on_rank_1_in_step_2(completion: str, answer: str) -> float:
    """Like tests/rewards_for_tests.even_byte_fraction, but rank 1 raises on its 9th call: with 2 prompts per
    rank and 4 responses each, that is the first reward of step 2, after a full step 1."""
    global _calls
    _calls += 1
    if os.environ.get("RANK") == "1" and _calls == 9:
        raise RuntimeError("reward service unreachable (injected failure)")
    data = completion.encode("utf-8", errors="replace")
    return sum(b % 2 == 0 for b in data) / len(data) if data else 0.0
