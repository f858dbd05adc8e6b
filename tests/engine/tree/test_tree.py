"""Prefix trees (`longstraw.engine.tree`): the trie, and `backward_tree`'s exact plan against the standard plan (every
trajectory a full sequence through transformers) in float64, on the layer kinds the group path supports."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    SAME_ORDER_F64,
    TokenRuns,
    agent_tree,
    assert_close,
    gradient_tolerance,
    grads,
    random_group,
    tiny_model,
    two_task_tree,
)

from longstraw import Trajectory, backward_group, backward_tree, build_tree
from longstraw.engine.loss.config import LossConfig

_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


def _run(model: torch.nn.Module, fn, *args, **kwargs):
    """fn(*args, **kwargs) from zero gradients: its result and the gradient it left."""
    for p in model.parameters():
        p.grad = None
    result = fn(*args, **kwargs)
    return result, grads(model).clone()


def test_the_trie_holds_each_shared_run_once():
    tree = build_tree(agent_tree())
    lengths = sorted(n.tokens.numel() for n in tree.nodes())
    assert lengths == [1, 2, 2, 3, 3, 4, 4, 6, 6, 7, 14, 17]  # `y` is a one-token node; `obs` a 4-token one
    assert tree.depth == 4
    assert tree.stats()["tokens_flattened"] == sum(t.length - 1 for t in tree.trajectories)
    assert tree.tokens_encoded == sum(n.tokens.numel() for n in tree.nodes()) - 1  # the root's first token: no input
    ending = {i for n in tree.nodes() for i in n.ending}
    assert ending == set(range(len(tree.trajectories)))  # every trajectory ends at exactly one node
    # min_shared: the one-token node goes into its two branches
    merged = build_tree(agent_tree(), min_shared=2)
    assert sorted(n.tokens.numel() for n in merged.nodes()) == [2, 3, 3, 4, 4, 4, 6, 6, 7, 14, 17]


def test_trajectories_are_checked():
    ids = torch.arange(10)
    with pytest.raises(ValueError, match="loss_start"):
        Trajectory(ids, 0, 1.0)
    with pytest.raises(ValueError, match="loss_start"):
        Trajectory(ids, 10, 1.0)
    with pytest.raises(ValueError, match="loss_mask masks every token"):
        Trajectory(ids, 5, 1.0, loss_mask=torch.zeros(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        Trajectory(ids, 5, 1.0, old_logprobs=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="advantage"):
        Trajectory(ids, 5, float("nan"))
    with pytest.raises(ValueError, match="min_shared"):
        build_tree([Trajectory(ids, 5, 1.0)], min_shared=0)


@pytest.mark.parametrize("family", ("llama", "mamba2"))
def test_depth_one_is_backward_group(family):
    """One prompt and its responses: every plan gives backward_group's loss and gradient."""
    model = _model(family)
    group = random_group(23, [5, 1, 7], seed=1)
    trajectories = [Trajectory(torch.cat([group.prompt, r]), group.prompt.numel(), float(a))
                    for r, a in zip(group.responses, group.advantages)]
    for plan in ("exact", "detach"):
        ref, g_ref = _run(model, backward_group, model, group, plan=plan, chunk_size=8)
        got, g_got = _run(model, backward_tree, model, trajectories, plan=plan, chunk_size=8)
        assert got.loss == pytest.approx(ref.loss, rel=1e-12)
        assert_close(f"{plan} gradient", g_ref, g_got, SAME_ORDER_F64)
        for lp_ref, lp_got in zip(ref.logprobs, got.logprobs):
            assert_close(f"{plan} log-probs", lp_ref, lp_got, SAME_ORDER_F64)


@pytest.mark.parametrize("shape", ("depth2", "agent"))
@pytest.mark.parametrize("family", ("llama", "qwen3_next-A", "mamba2", "deepseek_v3", "gemma3-A"))
def test_exact_equals_standard(family, shape):
    """Full attention, gated DeltaNet hybrid, Mamba-2, MLA and sliding window + full: the exact walk's loss,
    gradient and log-probs equal every trajectory's full forward (within the family's kernels' tolerance), and
    detach's differ (its states are constants)."""
    model = _model(family)
    trajectories = two_task_tree() if shape == "depth2" else agent_tree()
    ref, g_ref = _run(model, backward_tree, model, trajectories, plan="standard")
    got, g_got = _run(model, backward_tree, model, trajectories, plan="exact", chunk_size=6)
    tol = gradient_tolerance(family)
    assert got.loss == pytest.approx(ref.loss, rel=tol, abs=1e-12)
    assert_close("gradient", g_ref, g_got, tol)
    for lp_ref, lp_got in zip(ref.logprobs, got.logprobs):
        assert torch.equal(lp_ref.isnan(), lp_got.isnan())
        assert_close("log-probs", lp_ref.nan_to_num(), lp_got.nan_to_num(), tol)
    biased, g_biased = _run(model, backward_tree, model, trajectories, plan="detach", chunk_size=6)
    assert biased.loss == pytest.approx(ref.loss, rel=tol, abs=1e-12)  # the same forward
    assert float((g_biased - g_ref).norm() / g_ref.norm()) > 1e-3


@pytest.mark.parametrize("family", ("llama", "qwen3_next-A"))
def test_exact_options_regroup_the_same_sums(family):
    """Chunk size, one sibling leaf at a time, per-layer checkpointing and the offloaded state give the default's
    gradient in float64 (gated DeltaNet's float32 kernels round differently on other chunk boundaries)."""
    model = _model(family)
    trajectories = agent_tree()
    _, g_ref = _run(model, backward_tree, model, trajectories, plan="exact")
    for options in ({"chunk_size": 3, "micro_batch": 1}, {"checkpoint": "layers", "offload_state": True},
                    {"micro_batch": 8, "chunk_size": 64}):
        _, g_got = _run(model, backward_tree, model, trajectories, plan="exact", **options)
        assert_close(f"gradient with {options}", g_ref, g_got, 1e-11 if family == "llama" else
                     gradient_tolerance(family))


@pytest.mark.parametrize("loss", ("dapo", "dr_grpo", "cispo", "sapo", "grpo-kl-clipped"))
def test_losses_on_shared_response_tokens(loss):
    """Token-level losses with old and reference log-probs on a tree whose shared turn is in four trajectories'
    losses: exact equals standard."""
    model = _model("llama")
    gen = torch.Generator().manual_seed(5)
    trajectories = []
    for t in agent_tree():
        n = t.length - t.loss_start
        old = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
        ref = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
        trajectories.append(Trajectory(t.ids, t.loss_start, t.advantage, loss_mask=t.loss_mask, old_logprobs=old,
                                       ref_logprobs=ref, group=t.group))
    settings = {"loss": loss} if loss != "grpo-kl-clipped" else {"loss": LossConfig("grpo", beta=0.1, epsilon=0.1)}
    ref_result, g_ref = _run(model, backward_tree, model, trajectories, plan="standard", **settings)
    got, g_got = _run(model, backward_tree, model, trajectories, plan="exact", **settings)
    assert got.loss == pytest.approx(ref_result.loss, rel=1e-10)
    assert_close("gradient", g_ref, g_got, 1e-10)


def test_sequence_losses_run_on_shared_loss_tokens():
    """gspo reads a trajectory's whole loss: one pass (and exact) when every loss lies in a leaf; two passes (and
    exact) when a shared node holds loss tokens (tests/engine/tree/test_sequence_losses.py against a reference without
    a tree)."""
    model = _model("llama")
    for trajectories, first_pass in ((two_task_tree(), False), (agent_tree(), True)):
        ref, g_ref = _run(model, backward_tree, model, trajectories, plan="standard", loss="gspo")
        got, g_got = _run(model, backward_tree, model, trajectories, plan="exact", loss="gspo")
        assert got.loss == pytest.approx(ref.loss, rel=1e-10)
        assert_close("gspo gradient", g_ref, g_got, 1e-10)
        assert (got.stats["first_pass_s"] > 0) == first_pass


def test_refusals_come_first():
    model = _model("llama")
    for settings, match in (({"router_aux_coef": 0.01}, "router_aux_coef"),
                            ({"loss": LossConfig("grpo", beta=0.1)}, "ref_logprobs")):
        with pytest.raises(ValueError, match=match):
            backward_tree(model, two_task_tree(), **settings)
    big = [Trajectory(torch.tensor([1, 2, 600]), 1, 1.0)]
    with pytest.raises(ValueError, match="vocabulary"):
        backward_tree(model, big)
    skipped = backward_tree(model, [Trajectory(torch.arange(6), 3, 0.0)])
    assert skipped.skipped == "zero_advantage" and skipped.loss == 0.0


def test_the_path_state_does_not_grow_with_the_width():
    """Exact's largest state held along one root-to-leaf path stays the same when every node's leaves double; the
    tree encodes the new leaves' tokens only, while a flattened batch runs every trajectory's tokens twice over."""
    r = TokenRuns(7)
    system, turns = r(40), [r(6) for _ in range(2)]

    def tree(width: int) -> list[Trajectory]:
        out = []
        for t in turns:
            for _ in range(width):
                out.append(Trajectory(torch.cat([system, t, r(5)]), 40, float(torch.randn(1, generator=r.gen))))
        return out

    model = _model("llama")
    narrow = backward_tree(model, tree(2), plan="exact", chunk_size=16)
    wide = backward_tree(model, tree(4), plan="exact", chunk_size=16)
    assert wide.stats["peak_path_state_bytes"] == narrow.stats["peak_path_state_bytes"] > 0
    assert wide.stats["tokens_flattened"] == 2 * narrow.stats["tokens_flattened"]
    assert wide.stats["tokens_encoded"] - narrow.stats["tokens_encoded"] == 2 * 2 * 5  # the new leaves' tokens only
