"""Trees of any depth: `build_tree`, the tree's statistics and the exact, detach and standard walks use explicit
stacks, so a chain of trajectories (each the previous one plus a token or two: successive turns of one conversation)
runs at a depth far beyond Python's recursion limit."""

from __future__ import annotations

import inspect
import sys
import time

import numpy as np
import pytest
import torch
from helpers import TokenRuns, assert_close, grads, tiny_model

from longstraw import Trajectory, backward_tree, build_tree
from longstraw.engine.tree.routes import router_weights


def _chain(levels: int, prompt: int = 4, step: int = 1, loss_start: int | None = None) -> list[Trajectory]:
    """`levels` trajectories, the k-th the first prompt + k·step tokens (views of one tensor); each scores its tokens
    from `loss_start` (default: its last token only)."""
    ids = TokenRuns(5)(prompt + levels * step)
    return [Trajectory(ids[: prompt + k * step], prompt + k * step - 1 if loss_start is None else loss_start,
                       0.5 - (k % 3) * 0.4) for k in range(1, levels + 1)]


def test_a_10000_level_chain_is_built_and_counted():
    t0 = time.perf_counter()
    tree = build_tree(_chain(10_000))
    nodes = tree.nodes()
    assert tree.stats() == {"tree_nodes": 10_000, "tree_leaves": 1, "tree_depth": 10_000, "trajectories": 10_000,
                            "tokens_encoded": 10_003, "tokens_flattened": sum(4 + k - 1 for k in range(1, 10_001))}
    assert [n.start for n in nodes] == [0] + list(range(5, 10_004))  # depth first: the chain in order
    assert all(n.ending == [k] for k, n in enumerate(nodes))
    assert len(router_weights(tree).weights) == 10_000
    assert time.perf_counter() - t0 < 60


def test_min_shared_merges_a_deep_chain():
    """One-token nodes pushed into their branches at any depth: every other node goes into the next one."""
    merged = build_tree(_chain(3_000), min_shared=2)
    assert merged.depth == 1_501
    assert sorted({n.tokens.numel() for n in merged.nodes()}) == [1, 2, 5]  # the ends kept, the prompt + a token


@pytest.fixture
def shallow_stack():
    """Python's recursion limit 150 frames above the test's: a walk that recursed per level fails at 80 levels."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + 150)
    yield
    sys.setrecursionlimit(limit)


@pytest.mark.parametrize("loss", ("grpo", "gspo"))
def test_deep_chains_walk_without_recursion(shallow_stack, loss):
    """80 levels of one or two tokens, every trajectory scoring every token after the prompt (shared loss tokens:
    gspo takes the first pass): exact equals standard and detach runs, in float64."""
    model = tiny_model("llama")
    trajectories = [t for step in (1, 2) for t in _chain(40, step=step, loss_start=4)]
    for t in trajectories[40:]:
        t.group = np.int64(1)  # a NumPy integer is a group
    tree = build_tree(trajectories)
    assert tree.depth == 60 and "Node(start=0" in repr(tree)  # the chains share their first 20 levels
    chain = _chain(80, loss_start=4)
    out = {}
    for name, batch in (("two chains", trajectories), ("chain", chain)):
        for plan in ("standard", "exact", "detach"):
            for p in model.parameters():
                p.grad = None
            result = backward_tree(model, batch, plan=plan, loss=loss, chunk_size=3)
            out[name, plan] = result, grads(model).clone()
        (ref, g_ref), (got, g_got) = out[name, "standard"], out[name, "exact"]
        assert got.loss == pytest.approx(ref.loss, rel=1e-12, abs=1e-14)
        assert_close(f"{name} {loss} exact gradient", g_ref, g_got, 1e-12)
        for a, b in zip(ref.logprobs, got.logprobs):
            assert_close(f"{name} {loss} log-probs", a, b, 1e-12)
        assert torch.isfinite(out[name, "detach"][1]).all()


@pytest.mark.parametrize("plan", ("exact", "detach"))
def test_a_walk_reads_its_path_as_one_view(monkeypatch, plan):
    """Past the root, a node reads its path's K/V as one tensor per layer (one kernel input however deep), and the
    walk keeps one state: at depth 300 every attention read has at most the root's chunks + 1 inputs."""
    from longstraw.engine.kernels import attention

    inputs: list[int] = []
    real = attention.ChunkAttention.apply

    def counted(q, scale, causal, n, *kv):
        inputs.append(n)
        return real(q, scale, causal, n, *kv)

    monkeypatch.setattr(attention.ChunkAttention, "apply", counted)
    model = tiny_model("llama")
    backward_tree(model, _chain(300), plan=plan, chunk_size=3)
    assert len(inputs) > 300 * 2 and max(inputs) <= 2 + 1  # the root (prompt 4 in chunks of 3: 2 chunks) and the path


@pytest.mark.parametrize("plan", (pytest.param("exact", marks=pytest.mark.slow),
                                  pytest.param("detach", marks=pytest.mark.long)))
def test_a_10000_level_chain_runs(plan):
    """10,000 levels of one token each, every trajectory scoring its last token: the walk runs, in time linear in the
    depth but for attention's own work, with a finite loss and gradient (on 2 quiet cores: exact 280 s, in
    test-slow; detach 209 s, in test-long)."""
    model = tiny_model("llama")
    model.config.max_position_embeddings = 10_004  # the chain's length (its RoPE is computed per position)
    t0 = time.perf_counter()
    result = backward_tree(model, _chain(10_000), plan=plan, chunk_size=3)
    seconds = time.perf_counter() - t0
    assert result.stats["tree_depth"] == 10_000 and torch.isfinite(grads(model)).all()
    assert seconds < 1200, seconds


@pytest.mark.parametrize("value", (np.float32(0.25), np.float64(-1.5), np.int64(2), torch.tensor(0.75),
                                   torch.tensor(3)))
def test_numpy_and_0d_tensor_advantages(value):
    t = Trajectory(torch.arange(6), 3, value, group=torch.tensor(2))
    assert type(t.advantage) is float and t.advantage == float(value)
    assert type(t.group) is int and t.group == 2


@pytest.mark.parametrize(("field", "value", "match"), (
    ("advantage", torch.tensor([0.5]), "0-d tensor"), ("advantage", "0.5", "real number"),
    ("advantage", True, "real number"), ("advantage", torch.tensor(1 + 1j), "real number"),
    ("group", 1.0, "integer"), ("group", torch.tensor(1.0), "integer"), ("group", torch.tensor([1]), "integer"),
    ("group", np.float64(1), "integer"), ("group", "1", "integer"), ("group", np.bool_(True), "integer")))
def test_other_advantages_and_groups_are_refused(field, value, match):
    kwargs = {"advantage": 0.5, field: value}
    with pytest.raises(TypeError, match=match):
        Trajectory(torch.arange(6), 3, **kwargs)
    with pytest.raises(ValueError, match="finite"):
        Trajectory(torch.arange(6), 3, np.float64("nan"))
    with pytest.raises(ValueError, match=">= 0"):
        Trajectory(torch.arange(6), 3, 0.5, group=np.int32(-1))
