"""Sampling from one prompt prefill: log-probs equal a full forward, seeds reproduce, one capture only."""

import pytest
import torch
from helpers import tiny_model

import longstraw.engine.sampling as rollout
from longstraw import Group, backward_group
from longstraw.engine.sampling import SamplingConfig, _filter_logits, sample_group


def _full_logprobs(model, prompt, response):
    ids = torch.cat([prompt, response])[None]
    logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, response[:, None]).squeeze(1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sampled_logprobs_equal_full_forward(family):
    model = tiny_model(family)
    prompt = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(0))
    out = sample_group(model, prompt, 3, SamplingConfig(max_new_tokens=12), seed=1, chunk_size=16)
    assert len(out.responses) == 3
    for resp, lp in zip(out.responses, out.logprobs):
        assert resp.numel() == 12 and lp.shape == resp.shape
        with torch.no_grad():
            assert (lp - _full_logprobs(model, prompt, resp)).abs().max() < 1e-10


def test_seed_reproduces_and_changes_samples():
    model = tiny_model("llama", dtype=torch.float32)
    prompt = torch.arange(20)
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.5, top_k=50, top_p=0.9)
    a = sample_group(model, prompt, 4, cfg, seed=3)
    b = sample_group(model, prompt, 4, cfg, seed=3)
    c = sample_group(model, prompt, 4, cfg, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.responses, b.responses))
    assert not all(torch.equal(x, y) for x, y in zip(a.responses, c.responses))


def test_stop_ids_end_responses_and_prompt_is_captured_once(monkeypatch):
    model = tiny_model("llama", dtype=torch.float32)
    calls = []
    real = rollout.capture_prompt
    monkeypatch.setattr(rollout, "capture_prompt", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt = torch.arange(30)
    # Every token is a stop token: each response is exactly one token long.
    out = sample_group(model, prompt, 5, SamplingConfig(max_new_tokens=6, stop_ids=tuple(range(512))), seed=0)
    assert calls == [1]
    assert all(r.numel() == 1 for r in out.responses)


def test_rollout_state_feeds_the_training_step():
    """The sampler's captured state can be reused by backward_group: same gradient as capturing again."""
    model = tiny_model("llama")
    prompt = torch.randint(0, 512, (33,), generator=torch.Generator().manual_seed(5))
    out = sample_group(model, prompt, 3, SamplingConfig(max_new_tokens=5), seed=0, chunk_size=8)
    group = Group(prompt, out.responses, torch.tensor([1.0, -0.5, 0.2], dtype=torch.float64),
                  old_logprobs=out.logprobs)
    model.zero_grad(set_to_none=True)
    backward_group(model, group, plan="exact", chunk_size=8)
    fresh = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    backward_group(model, group, plan="exact", chunk_size=8, prompt_state=out.state)
    for a, p in zip(fresh, model.parameters()):
        assert (a - p.grad).abs().max() < 1e-12
    model.zero_grad(set_to_none=True)


def test_filters_and_bad_config():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(_filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    probs = torch.softmax(logits, -1)[0]
    keep = _filter_logits(logits, 0, float(probs[0]) + 1e-6)  # needs the top two to reach top_p
    assert torch.isinf(keep).tolist() == [[False, False, True, True]]
    for bad in (dict(max_new_tokens=0), dict(temperature=0.0), dict(top_p=0.0), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def test_score_responses_equals_full_forward():
    model = tiny_model("qwen3")
    prompt = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(2))
    responses = [torch.tensor([5, 6, 7]), torch.tensor([9])]
    scored = rollout.score_responses(model, prompt, responses, chunk_size=8, micro_batch=2)
    with torch.no_grad():
        for lp, r in zip(scored, responses):
            assert (lp - _full_logprobs(model, prompt, r)).abs().max() < 1e-10
