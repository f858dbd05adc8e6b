"""The supervised loss `loss="nll"`: the mean negative log-likelihood of the loss tokens (observations masked,
advantages ignored), in every plan. The reference is a plain restatement over transformers' full-sequence forward
(float64)."""

from __future__ import annotations

import pytest
import torch
from helpers import EXACT_F64, assert_close, gradient_tolerance, grads, random_group, tiny_model

from longstraw import Group, backward_group
from longstraw.engine.loss.config import LossConfig

LENGTHS = [6, 9, 4]


def _masks() -> list[torch.Tensor]:
    out = []
    for i, n in enumerate(LENGTHS):
        m = torch.ones(n, dtype=torch.bool)
        m[1 + i % 2: 1 + i % 2 + n // 3] = False  # a tool output's stretch
        out.append(m)
    return out


def _group(prompt_len: int = 20, advantages: torch.Tensor | None = None, masks: bool = True) -> Group:
    g = random_group(prompt_len, LENGTHS, seed=3)
    return Group(prompt=g.prompt, responses=g.responses,
                 advantages=g.advantages if advantages is None else advantages,
                 loss_masks=_masks() if masks else None)


def _reference_nll(model, group: Group, detach_prompt: bool = False) -> torch.Tensor:
    """Σ over loss tokens of −log p / their count, each response with its prompt in one forward. detach_prompt:
    the prompt's keys and values are constants (the detach plan's definition): its positions run without grad."""
    total, count = 0.0, 0
    for i, r in enumerate(group.responses):
        if detach_prompt:
            with torch.no_grad():
                cache = model(group.prompt[None, :-1], use_cache=True).past_key_values
            logits = model(torch.cat([group.prompt[-1:], r[:-1]])[None], cache=cache).logits[0]
        else:
            logits = model(torch.cat([group.prompt, r])[None]).logits[0, group.prompt.numel() - 1: -1]
        logp = torch.log_softmax(logits, -1).gather(-1, r[:, None]).squeeze(-1)
        m = group.loss_masks[i] if group.loss_masks is not None else torch.ones_like(r, dtype=torch.bool)
        total = total - (logp * m).sum()
        count += int(m.sum())
    return total / count


@pytest.mark.parametrize("plan", ["standard", "standard_batched", "exact"])
def test_nll_equals_the_plain_mean_negative_log_likelihood(plan):
    group = _group()
    reference = tiny_model("llama")
    expected = _reference_nll(reference, group)
    expected.backward()
    model = tiny_model("llama")
    result = backward_group(model, group, plan=plan, loss="nll", chunk_size=8)
    assert abs(result.loss - expected.item()) <= 1e-12 * abs(expected.item())
    assert_close(f"nll {plan}", grads(reference), grads(model), EXACT_F64)


def test_nll_exact_equals_standard_and_detach_drops_the_prompt_path():
    """exact == standard (float64); detach is the gradient with the prompt's keys and values held constant: it
    equals the plain restatement with the prompt run without grad, and differs from standard."""
    group = _group()
    out = {}
    for plan in ("standard", "exact", "detach"):
        model = tiny_model("llama")
        backward_group(model, group, plan=plan, loss="nll", chunk_size=8)
        out[plan] = grads(model)
    assert_close("nll exact", out["standard"], out["exact"], EXACT_F64)
    reference = tiny_model("llama")
    _reference_nll(reference, group, detach_prompt=True).backward()
    assert_close("nll detach", grads(reference), out["detach"], EXACT_F64)
    assert (out["detach"] - out["standard"]).norm() > 1e-6 * out["standard"].norm()


@pytest.mark.parametrize("family", ["qwen3_next-A", "mamba2"])
def test_nll_exact_equals_standard_on_recurrent_families(family):
    group = _group()
    out = {}
    for plan in ("standard", "exact"):
        model = tiny_model(family)
        backward_group(model, group, plan=plan, loss="nll", chunk_size=8)
        out[plan] = grads(model)
    assert_close(f"{family} nll exact", out["standard"], out["exact"], gradient_tolerance(family))


def test_nll_ignores_advantages_and_masks_matter():
    """Advantages of any values (all zero included: no group is skipped) give the same gradient; masking the
    observations changes it."""
    out = []
    for adv in (torch.zeros(3, dtype=torch.float64), torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)):
        model = tiny_model("llama")
        result = backward_group(model, _group(advantages=adv), plan="exact", loss="nll", chunk_size=8)
        assert result.skipped is None
        out.append(grads(model))
    assert torch.equal(out[0], out[1]) and out[0].norm() > 0
    model = tiny_model("llama")
    backward_group(model, _group(masks=False), plan="exact", loss="nll", chunk_size=8)
    assert (grads(model) - out[0]).norm() > 1e-3 * out[0].norm()


@pytest.mark.parametrize("options,match", [
    (dict(beta=0.1), "nll"), (dict(epsilon=0.2), "nll"), (dict(delta=2.0), "nll"),
])
def test_nll_refuses_the_policy_losses_options(options, match):
    with pytest.raises(ValueError, match=match):
        backward_group(tiny_model("llama"), _group(), plan="exact", loss=LossConfig("nll", **options))
