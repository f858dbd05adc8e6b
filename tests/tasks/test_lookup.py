"""The `lookup` agent task: directories sized in tokens, a deterministic environment, rewards."""

from __future__ import annotations

import random

import pytest

from longstraw.models.tokenizer import byte_tokenizer_hf
from longstraw.tasks import make_task


def _id_of(example, name: str) -> str:
    return next(line for line in example.prompt.splitlines() if line.startswith(name + " -> id")).split()[-1]


@pytest.mark.parametrize("hops", [1, 2])
def test_the_answer_needs_the_lookups_and_the_environment_gives_them(hops):
    """Following the task's own protocol (find the id in the directory, look it up, and for two hops look up the
    manager) reaches the answer, which is in no prompt line; the environment is a pure function of its input."""
    task = make_task("lookup", n_people=40, hops=hops)
    example = task.sample(random.Random(3))
    assert example.answer not in example.prompt.split("Question:")[0].split("Directory:")[1]
    response = f"<lookup>{_id_of(example, example.meta['asked'])}</lookup>"
    for _ in range(hops):
        result = task.observe(response, example)
        assert result == task.observe(response, example) and result.startswith("\n<result>phone: ")
        phone, manager = result.split("phone: ")[1].split("</result>")[0].split(", manager: ")
        response += result
        if _ < hops - 1:
            response += f"<lookup>{manager}</lookup>"
    assert phone == example.answer
    assert task.reward(response + f"<answer>{phone}</answer>", example) == 1.0
    assert task.observe(response + f"<answer>{phone}</answer>", example) is None  # answered: the episode ends


def test_bad_calls_and_rewards():
    task = make_task("lookup", n_people=10, format_reward=0.1)
    example = task.sample(random.Random(0))
    assert "no person has id 1" in task.observe("<lookup>1</lookup>", example)
    assert task.observe("no call here", example) is None
    assert task.observe("<lookup>12</lookup> and more text", example) is None  # a call must end the response
    good = f"<lookup>{_id_of(example, example.meta['asked'])}</lookup>"
    assert task.reward(good + "<answer>0</answer>", example) == pytest.approx(0.1)  # format only
    assert task.reward(good * 3, example) == pytest.approx(0.1)  # at most `hops` lookups count
    assert task.reward(f"<answer>{example.answer}</answer>", example) == 1.0


def test_prompt_tokens_sizes_the_directory():
    tok = byte_tokenizer_hf()
    for target in (800, 3000):
        example = make_task("lookup", tokenizer=tok, prompt_tokens=target).sample(random.Random(1))
        assert target * 0.9 <= example.meta["prompt_tokens"] <= target
    seeds = [make_task("lookup", n_people=20).sample(random.Random(s)).prompt for s in (0, 0, 1)]
    assert seeds[0] == seeds[1] != seeds[2]


@pytest.mark.parametrize("options,match", [
    (dict(n_people=1), "n_people must be >= 2"), (dict(n_people=5, hops=3), "hops must be 1 or 2"),
    (dict(), "give exactly one of"), (dict(prompt_tokens=100), "needs a tokenizer"),
    (dict(n_people=5, format_reward=2.0), "format_reward must be in"),
])
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        make_task("lookup", **options)


def test_directories_past_nine_thousand_people_get_longer_ids():
    """4-digit ids hold 9,000 people; one more person gives every id 5 digits, still distinct, and the environment
    answers them."""
    full = make_task("lookup", n_people=9000).sample(random.Random(0))
    assert sorted(full.meta["records"]) == list(range(1000, 10000))
    task = make_task("lookup", n_people=9001)
    example = task.sample(random.Random(0))
    ids = list(example.meta["records"])
    assert len(ids) == len(set(ids)) == 9001 and all(10000 <= i < 100000 for i in ids)
    names = [line.split(" -> id")[0] for line in example.prompt.splitlines() if " -> id " in line]
    assert len(names) == len(set(names)) == 9001
    pid = _id_of(example, example.meta["asked"])
    assert len(pid) == 5 and task.observe(f"<lookup>{pid}</lookup>", example).startswith("\n<result>phone: ")
    assert example.prompt == make_task("lookup", n_people=9001).sample(random.Random(0)).prompt


def test_a_directory_past_the_largest_is_refused_when_the_task_is_built():
    tok = byte_tokenizer_hf()
    refusal = (r"--prompt-tokens 1000000000 asks the lookup task for a directory of about [\d,]+ people, more than its "
               r"1,000,000: use --prompt-tokens \d+ or less")
    with pytest.raises(ValueError, match=refusal) as err:
        make_task("lookup", tokenizer=tok, prompt_tokens=10**9)
    largest = int(str(err.value).split("use --prompt-tokens ")[1].split()[0])
    make_task("lookup", tokenizer=tok, prompt_tokens=largest)  # built (not sampled: that prompt is 10^7 tokens)
    with pytest.raises(ValueError, match="more than its 1,000,000"):
        make_task("lookup", tokenizer=tok, prompt_tokens=largest + 1000)
    with pytest.raises(ValueError, match="n_people must be >= 2 .* and <= 1,000,000"):
        make_task("lookup", n_people=1_000_001)


def test_an_id_of_any_length_is_no_ones_and_scores_zero():
    task = make_task("lookup", n_people=10, format_reward=0.1)
    example = task.sample(random.Random(0))
    huge = "7" * 5000  # past Python's 4,300-digit limit on int(str)
    result = task.observe(f"<lookup>{huge}</lookup>", example)
    assert result == "\n<result>no person has id 777777777777... (5000 digits)</result>\n"
    assert task.reward(f"<lookup>{huge}</lookup><answer>{huge}</answer>", example) == 0.0
    pid = _id_of(example, example.meta["asked"])
    assert task.reward(f"<lookup>{'0' * 5000}{pid}</lookup>", example) == 0.0  # not read as the id it ends with
    assert task.reward(f"<lookup>0{pid}</lookup>", example) == pytest.approx(0.1)  # a leading zero is read as before
