"""`SamplingConfig.call_end` as a callable (the response so far -> bool): a task decides on the decoded text when a
tool call has ended, with no tokenizer in the engine. The same rule as a callable and as closing ids gives the same
rollout; the callable sees every response so far (its observations included) at each of its model's own tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from longstraw.engine.sampling import SamplingConfig, sample_group

PROMPT = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(4))


def _frequent(model) -> int:
    free = sample_group(model, PROMPT, 6, SamplingConfig(max_new_tokens=40, top_k=3), seed=2, chunk_size=8)
    return int(torch.cat(free.responses).bincount().argmax())


def _env(i: int, response: torch.Tensor) -> torch.Tensor:
    return torch.tensor([(5 * i + response.numel() + t) % 500 for t in range(4)])


def test_a_callable_call_end_gives_the_rollout_of_the_same_rule_as_ids():
    model = tiny_model("llama")
    call = _frequent(model)
    seen: list[tuple[int, bool]] = []

    def ends(ids: torch.Tensor) -> bool:
        seen.append((ids.numel(), int(ids[-1]) == call))
        return int(ids[-1]) == call

    as_ids = sample_group(model, PROMPT, 4, SamplingConfig(max_new_tokens=40, top_k=3, call_end=(call,), max_turns=3),
                          seed=1, chunk_size=8, environment=_env)
    as_callable = sample_group(model, PROMPT, 4, SamplingConfig(max_new_tokens=40, top_k=3, call_end=ends,
                                                                max_turns=3), seed=1, chunk_size=8, environment=_env)
    assert sum(as_ids.tool_calls) >= 1, "the test needs a tool call"
    for a, b, ma, mb in zip(as_ids.responses, as_callable.responses, as_ids.loss_masks, as_callable.loss_masks):
        assert torch.equal(a, b) and torch.equal(ma, mb)
    assert as_ids.tool_calls == as_callable.tool_calls and as_ids.turns == as_callable.turns
    # Called only at the model's own tokens of live sequences: never more often than tokens were sampled.
    own = sum(int(m.sum()) for m in as_callable.loss_masks)
    assert 0 < len(seen) <= own + 4 * 40 and any(hit for _, hit in seen)


def test_a_callable_that_sees_text_can_end_a_call_after_observations():
    """A rule over the whole response (here: the model's token count since the last observation reaches 3) sees
    the observation tokens in the response it is given."""
    model = tiny_model("llama")
    lengths: list[int] = []

    def every_third(ids: torch.Tensor) -> bool:
        lengths.append(ids.numel())
        return ids.numel() % 7 == 3

    out = sample_group(model, PROMPT, 2, SamplingConfig(max_new_tokens=30, top_k=3, call_end=every_third,
                                                        max_turns=3), seed=1, chunk_size=8, environment=_env)
    assert out.tool_calls == [2, 2] and out.turns == [3, 3]
    for resp, mask in zip(out.responses, out.loss_masks):
        assert resp.numel() > 3 + 4 and not bool(mask[3:7].any()) and bool(mask[:3].all())
    assert max(lengths) > 7  # it was called with responses holding observations


def test_a_callable_must_say_true_or_false():
    model = tiny_model("llama", dtype=torch.float32)
    cfg = SamplingConfig(max_new_tokens=4, top_k=1, call_end=lambda ids: torch.tensor(True), max_turns=2)
    with pytest.raises(ValueError, match=r"call_end <function .*> returned tensor\(True\) \(Tensor\) for sequence 0: "
                                         r"it must return True .* or False"):
        sample_group(model, PROMPT, 2, cfg, environment=_env)
    with pytest.raises(ValueError, match="call_end must be a tuple of non-negative int token ids or a callable"):
        SamplingConfig(call_end="</lookup>")  # type: ignore[arg-type]
