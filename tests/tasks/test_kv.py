"""kv: JSON key-value retrieval."""

from __future__ import annotations

import json
import random

import pytest

from longstraw.tasks import KVTask, count_tokens


def _pairs(prompt: str) -> dict[str, str]:
    body = prompt.split("JSON data:\n", 1)[1].split("\n\nKey:", 1)[0]
    return json.loads(body)


def test_kv_n_pairs_and_depth() -> None:
    task = KVTask(n_pairs=9, depth=0.5)
    ex = task.sample(random.Random(0))
    pairs = _pairs(ex.prompt)
    assert len(pairs) == 9
    key = ex.meta["key"]
    assert pairs[key] == ex.answer and list(pairs).index(key) == 4 == ex.meta["index"]
    assert ex.prompt.endswith(f'Key: "{key}"\nCorresponding value:')
    assert ex.meta["prompt_tokens"] is None   # no tokenizer given


def test_kv_prompt_tokens(tiny_tokenizer) -> None:
    task = KVTask(tiny_tokenizer, prompt_tokens=1500)
    for ex in task.examples(3, seed=2):
        n = count_tokens(tiny_tokenizer, ex.prompt)
        assert n == ex.meta["prompt_tokens"] <= 1500
        one_pair = count_tokens(tiny_tokenizer, json.dumps({ex.meta["key"]: ex.answer}))
        assert n > 1500 - 2 * one_pair
        assert len(_pairs(ex.prompt)) == ex.meta["n_pairs"]
    assert task.examples(2, seed=2) == task.examples(2, seed=2)


def test_kv_reward_exact_and_partial() -> None:
    ex = KVTask(n_pairs=4).sample(random.Random(1))
    key, val = ex.meta["key"], ex.answer
    exact = KVTask(n_pairs=4)
    assert exact.reward(f'The value is "{val}".', ex) == 1.0
    assert exact.reward(f"{val.upper()}", ex) == 1.0
    assert exact.reward(f'The key "{key}" has the value "{val}"', ex) == 1.0   # an echoed key is skipped
    assert exact.reward("I don't know", ex) == 0.0
    wrong = val[:-1] + ("0" if val[-1] != "0" else "1")
    assert exact.reward(wrong, ex) == 0.0
    assert KVTask(n_pairs=4, partial=True).reward(wrong, ex) == pytest.approx(35 / 36)


def test_kv_rejects_bad_options(tiny_tokenizer) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        KVTask(tiny_tokenizer)
    with pytest.raises(ValueError, match="exactly one"):
        KVTask(tiny_tokenizer, prompt_tokens=100, n_pairs=3)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        KVTask(prompt_tokens=100)
    with pytest.raises(ValueError, match="too small"):
        KVTask(tiny_tokenizer, prompt_tokens=20).examples(1)
