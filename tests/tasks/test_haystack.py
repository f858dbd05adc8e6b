"""passkey and multikey: token-length targeting, depth placement, determinism, rewards."""

from __future__ import annotations

import random

import pytest

from longstraw.tasks import MultikeyTask, PasskeyTask, build_haystack, count_tokens, format_prompt


@pytest.mark.parametrize("target", [200, 300, 1000, 4000])
def test_passkey_hits_token_target(tiny_tokenizer, target: int) -> None:
    task = PasskeyTask(tiny_tokenizer, prompt_tokens=target)
    for ex in task.examples(3, seed=target):
        n = count_tokens(tiny_tokenizer, ex.prompt)
        assert n == ex.meta["prompt_tokens"]
        # Never over the target, and within a few tokens of it (one filler word at most).
        assert target - 6 <= n <= target


def test_multikey_hits_token_target(tiny_tokenizer) -> None:
    for ex in MultikeyTask(tiny_tokenizer, prompt_tokens=1500, n_keys=6).examples(3, seed=0):
        assert 1500 - 6 <= count_tokens(tiny_tokenizer, ex.prompt) <= 1500


def test_prompt_tokens_too_small_is_an_error(tiny_tokenizer) -> None:
    with pytest.raises(ValueError, match="too small"):
        PasskeyTask(tiny_tokenizer, prompt_tokens=10).examples(1)


@pytest.mark.parametrize("bad", [dict(depth=1.5), dict(depth=-0.1), dict(digits=0), dict(prompt_tokens=0)])
def test_passkey_rejects_bad_options(tiny_tokenizer, bad: dict) -> None:
    with pytest.raises(ValueError):
        PasskeyTask(tiny_tokenizer, **bad)


def test_multikey_rejects_bad_options(tiny_tokenizer) -> None:
    with pytest.raises(ValueError, match="n_keys"):
        MultikeyTask(tiny_tokenizer, n_keys=0)
    with pytest.raises(ValueError, match="distinct keys"):
        MultikeyTask(tiny_tokenizer, n_keys=10, digits=1)


def test_passkey_is_deterministic_and_independent_of_tokenizer(tiny_tokenizer, chat_tokenizer) -> None:
    task = PasskeyTask(tiny_tokenizer, prompt_tokens=600)
    a, b = task.examples(4, seed=1), task.examples(4, seed=1)
    assert [e.prompt for e in a] == [e.prompt for e in b]
    assert len({e.answer for e in a}) > 1
    # The keys and depths come from the parent rng, whose stream does not depend on how long the filler is.
    short = PasskeyTask(tiny_tokenizer, prompt_tokens=300).examples(4, seed=1)
    assert [e.answer for e in short] == [e.answer for e in a]
    assert [e.meta["depth"] for e in short] == [e.meta["depth"] for e in a]


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_passkey_answer_at_requested_depth(tiny_tokenizer, depth: float) -> None:
    task = PasskeyTask(tiny_tokenizer, prompt_tokens=1000, digits=6, depth=depth)
    ex = task.sample(random.Random(3))
    assert len(ex.answer) == 6 and ex.answer[0] != "0"
    needle = f"The pass key is {ex.answer}."
    assert ex.prompt.count(needle) == 1
    assert ex.prompt.rstrip().endswith("What is the pass key? Answer with the number only.")
    # Depth in tokens: the needle's token offset within the filler span (after the head, before the question).
    head = "Find it and memorize it. I will quiz you about it."
    start = count_tokens(tiny_tokenizer, ex.prompt[: ex.prompt.index(head) + len(head)])
    at = count_tokens(tiny_tokenizer, ex.prompt[: ex.prompt.index(needle)])
    end = count_tokens(tiny_tokenizer, ex.prompt.rsplit("\n\n", 1)[0])
    needle_tokens = count_tokens(tiny_tokenizer, f" {needle} Remember it. {ex.answer} is the pass key.")
    frac = (at - start) / (end - start - needle_tokens)
    assert frac == pytest.approx(depth, abs=0.03)
    # The only digits in the prompt are the key's (filler has none), so "first number" is unambiguous.
    assert {c for c in ex.prompt if c.isdigit()} <= set(ex.answer)


def test_passkey_random_depth_varies(tiny_tokenizer) -> None:
    depths = [e.meta["depth"] for e in PasskeyTask(tiny_tokenizer, prompt_tokens=300).examples(8, seed=0)]
    assert len(set(depths)) == 8 and all(0 <= d <= 1 for d in depths)


def test_passkey_reward(tiny_tokenizer) -> None:
    task = PasskeyTask(tiny_tokenizer, prompt_tokens=300, digits=5)
    ex = task.sample(random.Random(0))
    assert task.reward(f"The pass key is {ex.answer}.", ex) == 1.0
    assert task.reward("I cannot find it.", ex) == 0.0
    assert task.reward(ex.answer[:4], ex) == pytest.approx(0.8)


def test_multikey_structure(tiny_tokenizer) -> None:
    task = MultikeyTask(tiny_tokenizer, prompt_tokens=800, n_keys=5, digits=5, depth=0.75)
    ex = task.sample(random.Random(11))
    name, distractors = ex.meta["name"], ex.meta["distractors"]
    assert len(distractors) == 4 and name not in distractors
    keys = [ex.answer, *distractors.values()]
    assert len(set(keys)) == 5
    for n, k in [(name, ex.answer), *distractors.items()]:
        assert ex.prompt.count(f"The pass key for {n} is {k}.") == 1
    assert ex.prompt.endswith(f"What is the pass key for {name}? Answer with the number only.")
    pos = ex.prompt.index(f"for {name} is") / len(ex.prompt.rsplit("\n\n", 1)[0])
    assert pos == pytest.approx(0.75, abs=0.05)
    # Answering with a distractor's key earns only chance digit agreement.
    wrong = next(iter(distractors.values()))
    assert task.reward(wrong, ex) == sum(a == b for a, b in zip(wrong, ex.answer)) / 5
    assert task.reward(f"The pass key for {name} is {ex.answer}", ex) == 1.0


def test_multikey_repeat_and_determinism(tiny_tokenizer) -> None:
    task = MultikeyTask(tiny_tokenizer, prompt_tokens=500, n_keys=3, repeat=True)
    a, b = task.examples(2, seed=9), task.examples(2, seed=9)
    assert a == b
    assert f"Remember it. {a[0].answer} is the pass key for {a[0].meta['name']}." in a[0].prompt


def test_build_haystack_orders_needles_at_one_boundary(tiny_tokenizer) -> None:
    prompt, n = build_haystack(tiny_tokenizer, 200, "Head.", [(0.5, "FIRST."), (0.5, "SECOND.")], "Q?",
                               random.Random(0))
    assert prompt.index("FIRST.") < prompt.index("SECOND.")
    assert n == count_tokens(tiny_tokenizer, prompt) <= 200


def test_chat_formatted_passkey_prompt(chat_tokenizer) -> None:
    ex = PasskeyTask(chat_tokenizer, prompt_tokens=300).sample(random.Random(0))
    ids = format_prompt(chat_tokenizer, ex.prompt)
    text = chat_tokenizer.decode(ids)
    assert text.startswith("<|user|>") and text.endswith("<|assistant|>") and ex.answer in text
