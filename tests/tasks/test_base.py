"""Rewards, token counting, chat formatting and make_task."""

from __future__ import annotations

import random

import pytest
import torch

from longstraw.tasks import (
    TASKS,
    Example,
    PasskeyTask,
    count_tokens,
    digit_reward,
    first_number,
    format_prompt,
    make_task,
    positional_match,
)
from longstraw.tasks.base import _as_id_list, check_reward


@pytest.mark.parametrize("text, expected", [
    ("The pass key is 12345.", "12345"),
    ("12345 or 67890", "12345"),
    ("It is 72,819.", "72819"),          # thousands separators are part of the number
    ("1, 2, 3", "1"),                     # ", " separates numbers, it is not a thousands comma
    ("no digits here", None),
    ("x-42y", "42"),
])
def test_first_number(text: str, expected: str | None) -> None:
    assert first_number(text) == expected


@pytest.mark.parametrize("completion, reward", [
    ("The pass key is 12345.", 1.0),
    ("12345 then 99999", 1.0),
    ("99999 then 12345", 0.0),            # only the FIRST number counts
    ("12395", 0.8),                      # one wrong digit
    ("1234", 0.8),                       # one missing digit
    ("123456", 5 / 6),                   # an extra digit dilutes: 5 right over max(5, 6)
    ("1", 0.2),
    ("I don't know", 0.0),
    ("", 0.0),
    ("12,345", 1.0),
])
def test_digit_reward_partial_credit(completion: str, reward: float) -> None:
    assert digit_reward(completion, "12345") == pytest.approx(reward)


def test_positional_match_is_positional_and_bounded() -> None:
    assert positional_match("54321", "12345") == pytest.approx(0.2)   # only the middle digit lines up
    assert positional_match("", "12345") == 0.0
    rng = random.Random(0)
    for _ in range(200):
        a = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8)))
        b = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8)))
        assert 0.0 <= positional_match(a, b) <= 1.0
        assert (positional_match(a, b) == 1.0) == (a == b)


def test_check_reward() -> None:
    assert check_reward(True, "f") == 1.0
    assert check_reward(torch.tensor(0.5), "f") == 0.5
    for bad in (float("nan"), float("inf"), "1.0", None, [1.0], 1j):
        with pytest.raises(ValueError, match="f returned"):
            check_reward(bad, "f")


def test_as_id_list_shapes() -> None:
    assert _as_id_list([1, 2]) == [1, 2]
    assert _as_id_list([[1, 2]]) == [1, 2]
    assert _as_id_list({"input_ids": [1, 2], "attention_mask": [1, 1]}) == [1, 2]
    assert _as_id_list(torch.tensor([[3, 4]])) == [3, 4]
    with pytest.raises(ValueError, match="batch"):
        _as_id_list([[1], [2]])


def test_count_tokens_ignores_special_tokens(tiny_tokenizer) -> None:
    text = "The grass is green."
    assert count_tokens(tiny_tokenizer, text) == len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    # A raw `tokenizers.Tokenizer` (encode returns an Encoding, no add_special_tokens keyword) works too.
    raw = tiny_tokenizer.backend_tokenizer
    assert count_tokens(raw, text) == count_tokens(tiny_tokenizer, text)


def test_format_prompt_with_chat_template(chat_tokenizer) -> None:
    ids = format_prompt(chat_tokenizer, "hello there")
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert chat_tokenizer.decode(ids) == "<|user|>hello there</s><|assistant|>"


def test_format_prompt_without_chat_template(tiny_tokenizer) -> None:
    ids = format_prompt(tiny_tokenizer, "hello there")
    assert ids == tiny_tokenizer.encode("hello there")
    assert all(type(t) is int for t in ids)


def test_make_task_names_and_errors(tiny_tokenizer) -> None:
    assert isinstance(make_task("passkey", tokenizer=tiny_tokenizer, prompt_tokens=200), PasskeyTask)
    with pytest.raises(ValueError, match="valid names: passkey, multikey, kv, jsonl, lookup"):
        make_task("needle")
    with pytest.raises(ValueError, match="unknown option.*prompt_len.*valid: tokenizer, prompt_tokens"):
        make_task("passkey", tokenizer=tiny_tokenizer, prompt_len=200)
    assert TASKS == ("passkey", "multikey", "kv", "jsonl", "lookup")


def test_examples_is_seeded(tiny_tokenizer) -> None:
    task = make_task("passkey", tokenizer=tiny_tokenizer, prompt_tokens=300)
    assert task.examples(3, seed=5) == task.examples(3, seed=5)
    assert task.examples(3, seed=5) != task.examples(3, seed=6)
    assert isinstance(task.examples(1)[0], Example)
