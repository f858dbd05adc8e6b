"""`python -m benchmarks tree`: the synthetic agent batch's structure (its prefix tree is the shape's), the packed
tree's ancestor-mask log-probs and gradient against every trajectory run flattened (float64), the token-pass floors
counted on the built tree, the checks on synthetic rows, bad options, and a one-row smoke run writing its JSON."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from benchmarks.__main__ import build_parser, main
from benchmarks.tree import TreeBenchConfig, checks, config_from_args, pairs, shape_of
from benchmarks.tree_baselines import flattened_logprobs, flattened_step, pack_tree, packed_logprobs, packed_step
from benchmarks.tree_batch import make_trajectories, task_groups
from longstraw.engine.tree import build_tree
from longstraw.planner import MIB
from longstraw.planner.tree import ROWS, TreeShape, counts, token_passes

IMPORT_PATH = os.pathsep.join(str(Path(__file__).resolve().parents[2] / d) for d in ("src", "."))
SHAPES = [TreeShape(16, 3, 8, 4, 3, 4, 5), TreeShape(16, 1, 8, 2, 2, 4, 0), TreeShape(12, 2, 5, 1, 2, 3, 2),
          TreeShape(10, 1, 4, 9, 2, 2, 3, branching=3)]
# TRL's batches: G conversations per prompt forking at the first response (any G, one task or several, G = 1)
FIRST = [TreeShape(16, 3, 8, 4, 3, 4, 5, fork="first"), TreeShape(16, 1, 8, 3, 2, 4, 0, fork="first"),
         TreeShape(12, 2, 5, 1, 2, 3, 2, fork="first")]


@pytest.mark.parametrize("shape", SHAPES + FIRST, ids=lambda s: s.describe())
def test_the_batch_is_the_shapes_tree(shape):
    trajectories = make_trajectories(shape, 512, seed=1)
    k, g = shape.tasks, shape.group_size
    assert len(trajectories) == k * g
    turn = [True] * shape.response_tokens + [False] * shape.observation_tokens
    for i, t in enumerate(trajectories):
        assert t.group == i // g and t.length == shape.trajectory_tokens and t.loss_start == shape.prompt_tokens
        assert t.loss_mask is not None and t.loss_mask.tolist() == turn * shape.turns
    shared = shape.prompt_tokens + shape.trunk_turns * shape.turn_tokens  # a task's tokens before its first branch
    if shape.fork == "first" and g > 1:  # a task's conversations share its prompt, then fork at their first response
        assert shared == shape.prompt_tokens
    for task in range(k):
        mine = trajectories[task * g:(task + 1) * g]
        for t in mine:  # one task: the same ids up to its first branch
            assert torch.equal(t.ids[:shared], mine[0].ids[:shared])
        at, below = shared, g
        for level in shape.levels:  # at each level's start, siblings (one parent, different branches) differ at once
            below //= level.fan_out
            branch = [i // below for i in range(g)]
            for a in range(g):
                for b in range(g):
                    if branch[a] // level.fan_out == branch[b] // level.fan_out and branch[a] != branch[b]:
                        assert mine[a].ids[at] != mine[b].ids[at]
            at += level.turns * shape.turn_tokens
        assert at == shape.trajectory_tokens
        if task:  # every task starts from the same system prompt and differs from the first task at once
            assert torch.equal(mine[0].ids[:shape.system_tokens], trajectories[0].ids[:shape.system_tokens])
            assert mine[0].ids[shape.system_tokens] != trajectories[0].ids[shape.system_tokens]
    stats, c = build_tree(trajectories).stats(), counts(shape)
    assert (stats["tree_nodes"], stats["tree_leaves"], stats["tree_depth"]) == (c.nodes, c.leaves, c.depth)
    assert (stats["tokens_encoded"], stats["tokens_flattened"]) == (c.tokens_encoded, c.tokens_flattened)
    groups = task_groups(trajectories)
    assert len(groups) == k
    for task, group in enumerate(groups):
        assert group.size == g and group.prompt.numel() == shape.prompt_tokens
        assert torch.equal(group.responses[0], trajectories[task * g].ids[shape.prompt_tokens:])


@pytest.mark.parametrize("shape", SHAPES + FIRST, ids=lambda s: s.describe())
def test_token_pass_floors_count_the_built_trees_nodes(shape):
    """The exact and detach floors from the built tree's own nodes, not from the shape's arithmetic."""
    tree = build_tree(make_trajectories(shape, 512))
    inner = leaf = inner_loss = 0
    for node in tree.nodes():
        inputs = node.tokens.numel() - (1 if node.start == 0 else 0)
        if node.is_leaf:
            leaf += inputs
        else:
            inner += inputs
            # inputs at positions >= S + C − 1 predict loss-region tokens
            inner_loss += max(0, node.end - 1 - max(node.input_start, shape.prompt_tokens - 1))
    assert token_passes(shape, "tree_exact") == 4 * inner + 3 * leaf
    assert token_passes(shape, "tree_detach") == (inner - inner_loss) + 3 * (inner_loss + leaf)
    assert token_passes(shape, "packed") == 3 * (inner + leaf)
    assert token_passes(shape, "flattened") == 3 * sum(t.length - 1 for t in tree.trajectories)
    prompt, responses = shape.prompt_tokens, shape.turns * shape.turn_tokens
    assert token_passes(shape, "group") == shape.tasks * (4 * (prompt - 1) + 3 * shape.group_size * responses)


@pytest.mark.parametrize("fork", ["last", "first"])
def test_packed_tree_equals_every_trajectory_flattened_in_float64(tiny_llama64, fork):
    """The ancestor mask, depth positions and deduplicated head give each trajectory's log-probs and the gradient of
    running every trajectory as its own sequence."""
    model = tiny_llama64
    trajectories = make_trajectories(TreeShape(16, 3, 8, 4, 3, 4, 5, fork=fork), model.config.vocab_size)
    packed = pack_tree(trajectories)
    assert packed.ids.numel() == build_tree(trajectories).tokens_encoded + 1
    with torch.no_grad():
        for t, logp in zip(trajectories, packed_logprobs(model, trajectories, packed)):
            flat = flattened_logprobs(model, t)[t.in_loss()]
            assert logp.dtype == torch.float64 and logp.shape == flat.shape
            torch.testing.assert_close(logp, flat, rtol=0, atol=1e-12)

    def gradient(step) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss = step()
        return loss, torch.cat([p.grad.flatten() for p in model.parameters()])

    loss_flat, grad_flat = gradient(lambda: flattened_step(model, trajectories))
    loss_packed, grad_packed = gradient(lambda: packed_step(model, trajectories, packed=packed))
    model.zero_grad(set_to_none=True)
    assert abs(loss_flat - loss_packed) < 1e-12
    assert grad_flat.abs().max() > 1e-4
    torch.testing.assert_close(grad_packed, grad_flat, rtol=0, atol=1e-10)


def test_a_token_sees_only_its_ancestors():
    trajectories = make_trajectories(TreeShape(4, 2, 2, 2, 1, 1, 1), 64)
    packed = pack_tree(trajectories)
    mask = packed.mask()
    for index in packed.index:  # along one trajectory's path: causal
        path = mask[index][:, index]
        assert torch.equal(path, torch.ones_like(path).tril())
    for a, b in ((0, 2), (0, 1)):  # another task / a sibling branch: their own tokens are never seen
        only_b = sorted(set(packed.index[b].tolist()) - set(packed.index[a].tolist()))
        assert only_b and not mask[packed.index[a]][:, only_b].any()


def _row(row: str, k: int, g: int, peak_mib: float, time_s: float, floor: float = 1.0) -> dict:
    return {"row": row, "tasks": k, "group_size": g, "status": "ok", "peak_bytes": peak_mib * MIB, "time_s": time_s,
            "floor_ratio": floor, "flop_floor_ratio": floor, "time_ratio": None}


def test_checks_pass_and_fail_on_synthetic_rows():
    config = TreeBenchConfig(tasks=(2,), groups=(2, 4))
    good = [_row("flattened", 2, 2, 400, 10), _row("packed", 2, 2, 300, 4), _row("tree_exact", 2, 2, 150, 4, 2.0),
            _row("flattened", 2, 4, 800, 20), _row("packed", 2, 4, 500, 6), _row("tree_exact", 2, 4, 155, 6, 3.0),
            _row("tree_detach", 2, 4, 140, 5)]
    for r in good:
        r["time_ratio"] = {2: 10, 4: 20}[r["group_size"]] / r["time_s"]
        r["time_ratio_fixed_threshold"] = r["time_ratio"] * 0.9  # 2.25x of 2.0, 3.0x of 3.0: both reach the floor
    result = checks(good, config)
    assert {name: c["ok"] for name, c in result.items()} == {
        "exact_lowest_peak": True, "detach_below_exact": None, "exact_flat_in_g": True, "exact_time_vs_floor": True,
        "exact_time_vs_flop_floor": True, "packed_peak_grows": True}
    slow = [dict(r, time_ratio_fixed_threshold=r["time_ratio"] * 0.8) if r["row"] == "tree_exact" else r for r in good]
    flop = checks(slow, config)["exact_time_vs_flop_floor"]  # G=4: 2.67x of a 3.0x floor under the fixed threshold
    assert flop["ok"] is False and [x["ok"] for x in flop["at"]] == [True, False]
    assert result["detach_below_exact"]["at"] == [
        {"tasks": 2, "group_size": 4, "tree_detach_mib": 140, "tree_exact_mib": 155, "below": True}]
    bad = [dict(r) for r in good if r["row"] != "tree_detach"]
    bad[5].update(peak_bytes=600 * MIB, time_ratio=1.0)  # G=4: above packed, +300%, 1.0x of a 3x floor
    bad[4].update(peak_bytes=200 * MIB)  # packed shrinks from G=2 to G=4
    result = checks(bad, config)
    assert not any(c["ok"] for c in result.values())
    assert result["exact_lowest_peak"]["at"][1]["next_lowest"] == "packed"
    assert checks([_row("flattened", 2, 2, 400, 10)], config)["exact_time_vs_floor"]["ok"] is None


def test_sweep_pairs_and_bad_options(capsys):
    assert pairs(TreeBenchConfig(tasks=(1, 2, 4), groups=(2, 4, 8))) == [(1, 4), (2, 4), (4, 4), (2, 2), (2, 8)]
    assert len(pairs(TreeBenchConfig(tasks=(1, 2), groups=(2, 4), grid="full"))) == 4
    parser = build_parser()
    for argv, message in ((["--groups", "3"], "not a power of branching 2"),
                          (["--groups", "16", "--turns", "3"], "raise --turns to 4"),
                          (["--rows", "nope"], "invalid choice"), (["--fork", "middle"], "invalid choice"),
                          (["--shape", "nope"], "invalid choice")):
        with pytest.raises(SystemExit):
            args = parser.parse_args(["tree", *argv])
            config_from_args(args)
        assert message in capsys.readouterr().err


def test_the_trl_async_shape():
    """--shape trl-async: conversations forking at the first response, packed against the tree as G doubles at one
    K; any G (no power of B), its options overridable; --fork first alone turns the tau shape's batch into TRL's."""
    parser = build_parser()
    config = config_from_args(parser.parse_args(["tree", "--shape", "trl-async"]))
    assert (config.name, config.fork, config.rows) == ("trl-async", "first", ("flattened", "packed", "tree_exact"))
    assert config.groups == (2, 4, 8, 16) and pairs(config) == [(2, 4), (2, 2), (2, 8), (2, 16)]
    assert not config.smoke and config.threads == 1 and config.model == "b1-llama"
    smoke = config_from_args(parser.parse_args(["tree", "--shape", "trl-async", "--smoke"]))
    assert smoke.smoke and smoke.fork == "first" and smoke.model == "tiny-llama" and len(smoke.groups) > 1
    odd = config_from_args(parser.parse_args(["tree", "--shape", "trl-async", "--groups", "3", "6", "--turns", "1"]))
    assert odd.groups == (3, 6) and odd.turns == 1  # G ways at one turn: any G, any T
    tau = config_from_args(parser.parse_args(["tree", "--fork", "first", "--groups", "3"]))
    assert (tau.name, tau.fork, tau.rows) == ("tau", "first", ROWS)
    assert config_from_args(parser.parse_args(["tree"])).fork == "last"
    shape = shape_of(config, 2, 16)
    c = counts(shape)  # a root of S, two prompts, 16 leaves of 3 turns each under each
    assert (c.nodes, c.depth, c.leaves, c.leaf_tokens, c.path_prefix) == (35, 3, 32, 3 * 64, 1024 + 128)
    assert c.tokens_encoded == 1023 + 2 * 128 + 32 * 3 * 64


def test_smoke_one_row_writes_its_json(tmp_path, capsys, monkeypatch):
    # the worker is a fresh interpreter: it imports this checkout's package (a worktree's, too)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (IMPORT_PATH, os.environ.get("PYTHONPATH")) if p))
    out = tmp_path / "tree.json"
    assert main(["tree", "--smoke", "--rows", "tree_exact", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "tree" and doc["config"]["model"] == "tiny-llama" and doc["machine"]["cpu_count"]
    (row,) = doc["results"]
    assert row["status"] == "ok" and row["row"] == "tree_exact", row
    shape = TreeShape(32, 2, 8, 2, 2, 4, 4)
    assert row["counts"]["tokens_encoded"] == row["stats"]["tokens_encoded"] == counts(shape).tokens_encoded
    assert row["token_passes"] == token_passes(shape, "tree_exact") and row["time_s"] > 0
    assert math.isfinite(row["loss"]) and "checks" in doc and "token_pass_formulas" in doc
    assert "1 of 1 configurations ran" in capsys.readouterr().out and not (tmp_path / "tree.json.tmp").exists()


def test_trl_async_smoke_writes_its_json(tmp_path, capsys, monkeypatch):
    """The trl-async shape's --smoke run, one row at one G (a worker each): the worker builds conversations forking
    at the first response, whose tree is the shape's."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (IMPORT_PATH, os.environ.get("PYTHONPATH")) if p))
    out = tmp_path / "tree.json"
    assert main(["tree", "--shape", "trl-async", "--smoke", "--rows", "tree_exact", "--groups", "4",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["name"] == "trl-async-smoke" and doc["config"]["fork"] == "first"
    (row,) = doc["results"]
    assert row["status"] == "ok" and (row["row"], row["tasks"], row["group_size"]) == ("tree_exact", 2, 4), row
    shape = TreeShape(32, 2, 8, 4, 2, 4, 4, fork="first")
    assert row["stats"]["tree_nodes"] == counts(shape).nodes == 1 + 2 + 2 * 4
    assert row["counts"]["tokens_encoded"] == row["stats"]["tokens_encoded"] == counts(shape).tokens_encoded
    assert row["token_passes"] == token_passes(shape, "tree_exact") and math.isfinite(row["loss"])
    assert "1 of 1 configurations ran" in capsys.readouterr().out
