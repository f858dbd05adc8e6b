"""`planner.tree`: a prefix-tree step's forecast (tree exact and flattened) within 10% of `python -m benchmarks tree`'s
measured peaks (the committed results file; a row measured here, slow), the shape's refusals, and `longstraw plan
--tree`'s command line."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from longstraw import planner
from longstraw.cli import main
from longstraw.planner.tree import TreeShape, counts, forecast

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")
TOLERANCE = 0.10


def _results_files() -> list[str]:
    return sorted(f for f in glob.glob(str(ROOT / "bench" / "results" / "tree-*.json")))


def _base(dtype: str, chunk: int, micro_batch: int = 1) -> planner.PlanInputs:
    return planner.PlanInputs(prompt_tokens=2, response_tokens=1, group_size=1, dtype=dtype, chunk_size=chunk,
                              micro_batch=micro_batch, device="cpu", optimizer="none")


def _shape(cfg: dict, k: int, g: int) -> TreeShape:
    return TreeShape(system_tokens=cfg["system_tokens"], tasks=k, task_tokens=cfg["task_tokens"], group_size=g,
                     turns=cfg["turns"], response_tokens=cfg["response_tokens"],
                     observation_tokens=cfg["observation_tokens"], branching=cfg["branching"],
                     fork=cfg.get("fork", "last"))


def test_forecast_within_ten_percent_of_the_bench_results():
    files = _results_files()
    assert files, "no bench/results/tree-*.json: run `python -m benchmarks tree`"
    checked = 0
    for path in files:
        doc = json.loads(Path(path).read_text())
        cfg = doc["config"]
        spec = planner.spec_from_config(planner.load_config(cfg["model"]), cfg["model"])
        base = _base(cfg["dtype"], cfg["chunk_size"], cfg.get("micro_batch", 1))
        for r in doc["results"]:
            if r.get("status") != "ok" or r["row"] not in ("flattened", "tree_exact"):
                continue
            predicted = forecast(spec, _shape(cfg, r["tasks"], r["group_size"]), base)[r["row"]].step_bytes
            error = predicted / r["peak_bytes"] - 1
            assert abs(error) <= TOLERANCE, (path, r["row"], r["tasks"], r["group_size"], error)
            checked += 1
    assert checked >= 2


def test_tree_exact_is_one_path_flattened_one_trajectory():
    spec = planner.spec_from_config(planner.load_config("b1-llama"), "b1-llama")
    base = _base("float32", 256)
    shape = TreeShape(1024, 2, 128, 4, 4, 32, 96)
    plans = forecast(spec, shape, base)
    exact, flat = plans["tree_exact"].step_bytes, plans["flattened"].step_bytes
    assert exact < flat
    for wider in (replace(shape, group_size=8), replace(shape, tasks=4)):  # more leaves, more tasks: same path
        assert forecast(spec, wider, base)["tree_exact"].step_bytes == exact
        assert forecast(spec, wider, base)["flattened"].step_bytes == flat
    longer = forecast(spec, replace(shape, system_tokens=4096), base)
    assert longer["tree_exact"].step_bytes > exact and longer["flattened"].step_bytes > flat
    question = plans["tree_exact"].inputs
    c = counts(shape)
    assert (question.prompt_tokens, question.response_tokens) == (c.path_prefix, c.leaf_tokens)
    # sibling leaves two at a time: one more leaf's activations; at most a node's B leaves; flattened unchanged
    pairs = forecast(spec, shape, replace(base, micro_batch=2))
    assert pairs["tree_exact"].step_bytes > exact and pairs["tree_exact"].inputs.micro_batch == 2
    assert pairs["flattened"].step_bytes == flat
    eight = forecast(spec, shape, replace(base, micro_batch=8))["tree_exact"]
    assert eight.step_bytes == pairs["tree_exact"].step_bytes


def test_a_first_turn_fork_is_one_prompt_then_whole_conversations():
    """fork "first" (TRL's G completions per prompt): a leaf is a whole conversation after its prompt, so tree exact
    is the exact plan of prompt S + C and responses of T turns, flat as G doubles; flattened is the same question
    whatever the fork."""
    spec = planner.spec_from_config(planner.load_config("b1-llama"), "b1-llama")
    base = _base("float32", 256, micro_batch=2)
    shape = TreeShape(1024, 2, 128, 2, 3, 32, 32, fork="first")
    assert shape.levels == ((2, 3),) and (shape.branch_turns, shape.trunk_turns) == (1, 0)
    c = counts(shape)
    assert (c.nodes, c.depth, c.leaf_tokens, c.path_prefix, c.inner_loss_inputs) == (7, 3, 192, 1152, 0)
    plans = forecast(spec, shape, base)
    question = plans["tree_exact"].inputs
    assert (question.prompt_tokens, question.response_tokens, question.observation_tokens) == (1152, 192, 96)
    assert question.prompt_loss_tokens == 0 and question.micro_batch == 2
    assert plans["tree_exact"].step_bytes < plans["flattened"].step_bytes
    for g in (4, 8, 16, 6):
        wider = forecast(spec, replace(shape, group_size=g), base)
        assert wider["tree_exact"].step_bytes == plans["tree_exact"].step_bytes
        assert wider["flattened"].step_bytes == plans["flattened"].step_bytes
    # siblings replayed at once: up to G of them (a last-turn fork's B = 2 caps it at 2)
    four = forecast(spec, replace(shape, group_size=8), replace(base, micro_batch=4))["tree_exact"]
    assert four.inputs.micro_batch == 4 and four.step_bytes > plans["tree_exact"].step_bytes
    last = replace(shape, fork="last", group_size=8)  # the same sizes branching at the last turns: a longer path
    assert forecast(spec, last, base)["flattened"].step_bytes == plans["flattened"].step_bytes
    assert counts(last).path_prefix > c.path_prefix


@pytest.mark.parametrize("kwargs, message", [
    ({"group_size": 6}, "not a power of branching 2"),
    ({"group_size": 8, "turns": 2}, "raise --turns to 3"),
    ({"observation_tokens": -1}, "observation_tokens must be an integer >= 0"),
    ({"branching": 1}, "branching must be an integer >= 2"),
    ({"fork": "middle"}, "fork must be one of last, first"),
])
def test_bad_shapes_say_what_to_change(kwargs, message):
    fields = dict(system_tokens=8, tasks=1, task_tokens=2, group_size=2, turns=2, response_tokens=2)
    with pytest.raises(ValueError, match=message):
        TreeShape(**{**fields, **kwargs})
    if "group_size" in kwargs:  # G ways at the first turn: any G, whatever T
        assert TreeShape(**{**fields, **kwargs, "fork": "first"}).levels == ((kwargs["group_size"], 2),)


TREE = ["plan", "--model", "b1-llama", "--tree", "--prompt-tokens", "1024", "--tasks", "2", "--task-tokens", "128",
        "--group-size", "4", "--turns", "4", "--response-tokens", "32", "--observation-tokens", "96", "--dtype",
        "float32", "--device", "cpu", "--optimizer", "none", "--chunk-size", "256"]


def test_plan_tree_prints_both_forecasts(capsys):
    assert main(TREE) == 0
    out = capsys.readouterr().out
    assert "tree S=1024 K=2 C=128 G=4 T=4 r=32 o=96 B=2" in out and "3,327 tokens encoded of 13,304" in out
    assert "flattened" in out and "tree_exact" in out
    assert main([*TREE, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["counts"]["tokens_encoded"] == 3327 and doc["token_passes"]["tree_exact"] == 12284
    assert doc["plans"]["tree_exact"]["step_bytes"] < doc["plans"]["flattened"]["step_bytes"]
    assert main([*TREE, "--json", "--micro-batch", "2"]) == 0  # sibling leaves two at a time
    pairs = json.loads(capsys.readouterr().out)["plans"]
    assert pairs["tree_exact"]["as_group"]["micro_batch"] == 2
    assert pairs["tree_exact"]["step_bytes"] > doc["plans"]["tree_exact"]["step_bytes"]
    assert main([*TREE, "--fork", "first"]) == 0  # G conversations per task: one node of T turns each
    out = capsys.readouterr().out
    assert "G=4 T=4 r=32 o=96 fork=first" in out and "11 nodes, depth 3" in out


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "2"], "--tasks describe a prefix tree: add --tree"),
    (["--tree"], "--tree needs --task-tokens and --turns"),
    (["--tree", "--task-tokens", "4", "--turns", "2", "--cp", "2", "--gpus", "2"], "drop --gpus, --cp"),
    (["--tree", "--task-tokens", "4", "--turns", "1", "--group-size", "4"], "raise --turns to 2"),
    (["--fork", "first"], "--fork describe a prefix tree: add --tree"),
])
def test_plan_tree_refusals(argv, message, capsys):
    base = ["plan", "--model", "b1-llama", "--prompt-tokens", "64", "--response-tokens", "8", "--group-size", "2"]
    with pytest.raises(SystemExit):
        main([*base[:-2], *argv] if "--group-size" in argv else [*base, *argv])
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_forecast_within_ten_percent_of_a_row_measured_here(monkeypatch):
    """A small b1-llama tree measured in a fresh worker, both rows."""
    from benchmarks.tree import TreeBenchConfig, run_row

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    config = TreeBenchConfig(system_tokens=512, task_tokens=64, turns=3, response_tokens=32, observation_tokens=64,
                             chunk_size=256, threads=1, warm_steps=0, timing_run=False)
    spec = planner.spec_from_config(planner.load_config(config.model), config.model)
    shape = _shape({**vars(config)}, 2, 4)
    for row in ("tree_exact", "flattened"):
        entry = run_row(config, row, 2, 4)
        assert entry["status"] == "ok", entry
        predicted = forecast(spec, shape, _base(config.dtype, config.chunk_size, config.micro_batch))[row].step_bytes
        assert abs(predicted / entry["peak_bytes"] - 1) <= TOLERANCE, (row, predicted, entry["peak_bytes"])


def test_inner_loss_rows_count_one_chunk_of_an_inner_node():
    """The trunk (C task tokens, then the shared turns) chunked from its own start: a 256-token chunk holds the task's
    128 tokens and one turn (32 loss tokens), a 512-token chunk both shared turns; a one-turn branching node its r
    tokens; no inner node scores anything when every task is a leaf."""
    from longstraw.planner.tree import inner_loss_rows

    shape = TreeShape(1024, 2, 128, 4, 4, 32, 96)  # m = 2: trunk of 2 turns, one inner branching turn
    assert inner_loss_rows(shape, 256) == 32 and inner_loss_rows(shape, 512) == 64
    assert inner_loss_rows(replace(shape, group_size=2), 1024) == 96  # m = 1: a trunk of 3 turns
    assert inner_loss_rows(replace(shape, group_size=1), 256) == 0
    assert inner_loss_rows(replace(shape, fork="first"), 256) == 0  # the trunk is the task's C tokens: no loss
    assert inner_loss_rows(replace(shape, fork="first", group_size=1), 256) == 0
