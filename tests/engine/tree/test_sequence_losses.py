"""Sequence-level losses (the sequence ratio, vespo's weight) on trees whose trajectories share loss tokens
(`engine/tree/sequence.py`: a first no-grad walk, then the plan's walk with linear surrogates), in float64, against a
reference that needs no tree: each trajectory one full sequence through the plain transformers model, the loss
`response_loss` per group."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    EXACT_F64,
    SAME_ORDER_F64,
    agent_tree,
    assert_close,
    gradient_tolerance,
    grads,
    tiny_model,
    with_loss,
)

from longstraw import Trajectory, backward_tree, build_tree
from longstraw.engine.loss.config import LossConfig
from longstraw.engine.loss.terms import GroupTotals, response_loss
from longstraw.engine.options import BackwardOptions
from longstraw.engine.tree.loss import pieced_sequence_losses

_MODELS: dict[str, torch.nn.Module] = {}

# name -> (loss settings, with old log-probs, with ref log-probs)
CASES: dict[str, tuple[dict, bool, bool]] = {
    "gspo": ({"loss": "gspo"}, False, False),
    "gspo-off-policy-kl": ({"loss": "gspo", "epsilon": 0.02, "beta": 0.1}, True, True),
    "luspo-off-policy": ({"loss": "luspo", "epsilon": 0.02}, True, False),
    "vespo-off-policy-kl": ({"loss": "vespo", "beta": 0.05}, True, True),
    "dapo-sequence-ratio-kl-ratio": ({"loss": "dapo", "sequence_ratio": True, "beta": 0.1, "kl_ratio": True},
                                     True, True),
}


def _model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


def _full_logprobs(model: torch.nn.Module, t: Trajectory) -> torch.Tensor:
    """(N − loss_start,): the trajectory's log-probs from one plain forward of its whole sequence."""
    logits = model(input_ids=t.ids[None, :-1], use_cache=False).logits[0]  # (N − 1, V)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, t.ids[1:, None]).squeeze(-1)
    return logp[t.loss_start - 1:]


def _trajectories(model: torch.nn.Module, old: bool, ref: bool) -> list[Trajectory]:
    """`agent_tree` (a first turn in four trajectories' losses, a masked observation, a trajectory that is a prefix
    of others, two groups) with old log-probs near the policy's (off-policy) and reference log-probs."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for t in agent_tree():
        n = t.length - t.loss_start
        with torch.no_grad():
            now = _full_logprobs(model, t)
        old_lp = (now + 0.05 * torch.randn(n, generator=gen, dtype=torch.float64)).clamp(max=0.0) if old else None
        ref_lp = -torch.rand(n, generator=gen, dtype=torch.float64) * 3 if ref else None
        out.append(Trajectory(t.ids, t.loss_start, t.advantage, loss_mask=t.loss_mask, old_logprobs=old_lp,
                              ref_logprobs=ref_lp, group=t.group))
    return out


def padded(values: list[torch.Tensor], fill: float | bool) -> torch.Tensor:
    """(B, T_max), right-padded with `fill`."""
    width = max(v.numel() for v in values)
    return torch.stack([torch.nn.functional.pad(v, (0, width - v.numel()), value=fill) for v in values])


def _reference(model: torch.nn.Module, trajectories: list[Trajectory], cfg: LossConfig) -> tuple[float, torch.Tensor]:
    """The loss and gradient of every trajectory as a full sequence, `response_loss` per group (no tree)."""
    for p in model.parameters():
        p.grad = None
    total = torch.zeros((), dtype=torch.float64)
    for g in sorted({t.group for t in trajectories}):
        members = [t for t in trajectories if t.group == g]
        logp = padded([_full_logprobs(model, t) for t in members], 0.0)
        mask = padded([t.in_loss() for t in members], False)
        old = padded([t.old_logprobs for t in members], 0.0) if members[0].old_logprobs is not None else None
        ref = padded([t.ref_logprobs for t in members], 0.0) if members[0].ref_logprobs is not None else None
        adv = torch.tensor([t.advantage for t in members], dtype=torch.float64)
        totals = GroupTotals.of([t.loss_tokens for t in members], cfg)
        total = total + response_loss(logp, mask, adv, totals, cfg, old, ref)
    total.backward()
    return float(total.detach()), grads(model).clone()


def _tree(model: torch.nn.Module, trajectories: list[Trajectory], **settings):
    for p in model.parameters():
        p.grad = None
    result = backward_tree(model, trajectories, **with_loss(settings))
    return result, grads(model).clone()


def test_the_agent_tree_needs_the_first_pass():
    """The shared turn's loss tokens are in four trajectories' losses, the prefix trajectory's in an inner node; the
    second group's lie in leaves of their own. Token-level losses never need it."""
    tree = build_tree(agent_tree())
    assert pieced_sequence_losses(tree, LossConfig("gspo")) == [0, 1, 2, 3, 4, 5]
    assert pieced_sequence_losses(tree, LossConfig("vespo")) == [0, 1, 2, 3, 4, 5]
    assert pieced_sequence_losses(tree, LossConfig("grpo")) == []


@pytest.mark.parametrize("case", tuple(CASES))
def test_sequence_losses_on_shared_loss_tokens(case):
    """exact and standard equal the reference (loss and gradient); detach runs, reports the same loss and log-probs
    as exact, and its gradient differs from exact's only by the paths through the prompt state."""
    model = _model("llama")
    settings, old, ref = CASES[case]
    trajectories = _trajectories(model, old, ref)
    cfg = BackwardOptions(**with_loss(settings)).loss
    want_loss, want = _reference(model, trajectories, cfg)
    results = {}
    for plan in ("exact", "standard", "detach"):
        results[plan], got = _tree(model, trajectories, plan=plan, chunk_size=8, **settings)
        if plan != "detach":
            assert results[plan].loss == pytest.approx(want_loss, rel=SAME_ORDER_F64, abs=1e-15)
            assert_close(f"{case} {plan} gradient", want, got, SAME_ORDER_F64)
        else:
            assert torch.isfinite(got).all() and got.norm() > 0
    exact, detach = results["exact"], results["detach"]
    assert detach.loss == pytest.approx(exact.loss, rel=SAME_ORDER_F64, abs=1e-15)
    for a, b in zip(exact.logprobs, detach.logprobs):
        assert torch.allclose(a, b, rtol=1e-12, atol=0, equal_nan=True)
    assert exact.stats["first_pass_s"] > 0 and results["standard"].stats["first_pass_s"] == 0


@pytest.mark.parametrize(("family", "case"), (("qwen3", "gspo-off-policy-kl"), ("qwen3", "vespo-off-policy-kl"),
                                              ("qwen3_next-A", "gspo-off-policy-kl"),
                                              ("qwen3_next-A", "vespo-off-policy-kl")))
def test_other_families(family, case):
    """The same on qwen3 and on a hybrid of linear attention and full attention (its kernels in float32)."""
    model = _model(family)
    settings, old, ref = CASES[case]
    trajectories = _trajectories(model, old, ref)
    want_loss, want = _reference(model, trajectories, BackwardOptions(**with_loss(settings)).loss)
    tol = max(gradient_tolerance(family), SAME_ORDER_F64)
    got, g_got = _tree(model, trajectories, plan="exact", chunk_size=8, **settings)
    assert got.loss == pytest.approx(want_loss, rel=tol)
    assert_close(f"{family} {case} exact gradient", want, g_got, tol)


def test_detach_without_prompt_state_paths_equals_exact():
    """Where no loss token has a path through a prompt state (every loss token in the root's one chunk, which starts
    from no state; the leaves outside the losses), detach's gradient is exact's. The shared root holds loss tokens
    of four trajectories of two groups, so both run the first pass."""
    model = _model("llama")
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 512, (18,), generator=gen)
    trajectories = []
    for g, adv in ((0, 1.0), (0, -0.6), (1, 0.4), (1, -0.9)):
        ids = torch.cat([shared, torch.randint(0, 512, (3,), generator=gen)])
        mask = torch.zeros(ids.numel() - 4, dtype=torch.bool)
        mask[:14] = True  # positions 4 … 17: the shared root only
        trajectories.append(Trajectory(ids, 4, adv, loss_mask=mask, group=g))
    assert pieced_sequence_losses(build_tree(trajectories), LossConfig("gspo")) == [0, 1, 2, 3]
    exact, g_exact = _tree(model, trajectories, plan="exact", chunk_size=32, loss="gspo")
    detach, g_detach = _tree(model, trajectories, plan="detach", chunk_size=32, loss="gspo")
    want_loss, want = _reference(model, trajectories, LossConfig("gspo"))
    assert exact.loss == pytest.approx(want_loss, rel=SAME_ORDER_F64)
    assert_close("exact gradient", want, g_exact, SAME_ORDER_F64)
    assert detach.loss == pytest.approx(exact.loss, rel=SAME_ORDER_F64)
    assert_close("detach gradient", g_exact, g_detach, EXACT_F64)


def test_one_trajectory_scored_in_chunks():
    """A tree of one trajectory is its root alone, scored a chunk at a time: gspo still equals the reference."""
    model = _model("llama")
    gen = torch.Generator().manual_seed(2)
    t = Trajectory(torch.randint(0, 512, (30,), generator=gen), 10, 0.7)
    assert pieced_sequence_losses(build_tree([t]), LossConfig("gspo")) == [0]
    got, g_got = _tree(model, [t], plan="exact", chunk_size=4, loss="gspo")
    want_loss, want = _reference(model, [t], LossConfig("gspo"))
    assert got.loss == pytest.approx(want_loss, rel=SAME_ORDER_F64, abs=1e-15)
    assert_close("gradient", want, g_got, SAME_ORDER_F64)
