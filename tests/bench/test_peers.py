"""`longstraw bench peers` (issue 12): the smoke run end to end, failures recorded rather than raised, the table's
strongest-peer ratios, and the Prefix Grouper path's gradient against LongStraw's on the same group."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from longstraw.bench.peers import (
    SHAPES,
    Configuration,
    configurations,
    format_table,
    run_peer,
    run_peers_bench,
    summarize,
)
from longstraw.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")
HAVE_PREFIX_GROUPER = importlib.util.find_spec("prefix_grouper") is not None


@pytest.fixture
def workers_see_this_checkout(monkeypatch):
    """Workers are fresh interpreters: make them import this checkout's package (a worktree's, too)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))


def test_smoke_run_writes_every_configuration_with_a_status(tmp_path, capsys, workers_see_this_checkout):
    out = tmp_path / "peers.json"
    assert main(["bench", "peers", "--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    shape = SHAPES["smoke"]
    assert doc["bench"] == "peers" and doc["smoke"] and doc["shape"]["model"] == shape.model
    assert doc["machine"]["cpu_count"]
    results = {r["id"]: r for r in doc["results"]}
    assert list(results) == [c.id for c in configurations(shape.group_size)]
    for r in results.values():
        if r["peer"] == "prefix_grouper":
            assert r["status"] == ("ok" if HAVE_PREFIX_GROUPER else "not installed"), r
        else:
            assert r["status"] == "ok", r
    ok = [r for r in results.values() if r["status"] == "ok"]
    for r in ok:
        assert r["peak_bytes"] >= 0 and r["time_s"] > 0 and r["hwm_reset"] is not None
    for r in results.values():
        if r["peer"] == "trl":  # TRL's own train loop ran the micro-steps, with checkpointing as configured
            assert r["micro_steps"] == r["accumulation"] == shape.group_size // r["batch"]
            assert r["gradient_checkpointing"] == r["checkpoint"]
            # TRL's head scored only the completions (as on CUDA), not the prompt positions as on CPU
            assert r["trl_compact_head"] and r["trl_head_rows"] == r["batch"] * shape.response_tokens, r
        if r["peer"] != "longstraw" and r["status"] == "ok":
            assert r["peer_version"], r
    # On-policy, every configuration's grpo loss is -mean(advantages) of the same group.
    losses = [r["loss"] for r in ok]
    assert max(losses) - min(losses) < 1e-5, losses
    printed = capsys.readouterr().out
    assert "TRL, 1 per batch x 4 accumulation + checkpointing: ok" in printed and str(out) in printed
    assert not os.path.exists(str(out) + ".tmp")


def test_a_failing_peer_is_recorded_not_raised(tmp_path, workers_see_this_checkout):
    shape = SHAPES["smoke"]
    bad = Configuration("trl-b3", "TRL, 3 per batch", "trl", batch=3)  # 3 does not divide G = 4: the worker fails
    doc = run_peers_bench(shape, str(tmp_path / "peers.json"), timeout_s=300, smoke=True, rows=[bad])
    (entry,) = doc["results"]
    assert entry["status"] == "failed" and "does not divide" in entry["error"], entry
    assert "Traceback" in entry["stderr_tail"]
    late = run_peer(shape, configurations(shape.group_size)[2], timeout_s=0.01, smoke=True)
    assert late["status"] == "failed" and "timed out" in late["error"]


def test_prefix_grouper_not_installed_is_a_status(monkeypatch):
    from longstraw.bench import peers_worker

    monkeypatch.setitem(sys.modules, "prefix_grouper", None)  # import prefix_grouper now raises ImportError
    monkeypatch.setitem(sys.modules, "prefix_grouper.utils.register_transformers", None)
    shape = SHAPES["smoke"]
    config = {"peer": "prefix_grouper", "model": shape.model, "dtype": "float32", "device": "cpu",
              "prompt_tokens": 16, "response_tokens": 4, "group_size": 2, "seed": 0, "batch": 2, "checkpoint": False}
    result = peers_worker.run_config(config)
    assert result["status"] == "not installed" and "prefix-grouper" in result["error"]


def _row(id_, peer, plan=None, peak=0.0, time_s=1.0, status="ok"):
    return {"id": id_, "label": id_, "peer": peer, "plan": plan, "status": status, "peak_bytes": peak * 2**20,
            "time_s": time_s, "cpu_pressure": 0.0}


def test_strongest_peer_ratios():
    results = [_row("longstraw-detach", "longstraw", "detach", 200, 4.0),
               _row("longstraw-exact", "longstraw", "exact", 250, 5.0),
               _row("trl-b8", "trl", peak=3000, time_s=15.0),
               _row("trl-b1x8-ckpt", "trl", peak=500, time_s=20.0),
               _row("prefix-grouper", "prefix_grouper", peak=1500, time_s=4.5),
               _row("prefix-grouper-ckpt", "prefix_grouper", status="not installed")]
    summary = summarize(results)
    assert summary["time_over_exact"]["trl-b8"] == pytest.approx(3.0)
    memory, time_ = summary["strongest_peer_memory"], summary["strongest_peer_time"]
    assert memory["id"] == "trl-b1x8-ckpt" and memory["peer_over_longstraw"] == {"detach": 2.5, "exact": 2.0}
    assert time_["id"] == "prefix-grouper" and time_["peer_over_longstraw"]["exact"] == pytest.approx(0.9)
    table = format_table({"results": results, "summary": summary})
    assert "lowest-memory peer configuration: trl-b1x8-ckpt (500.0 MiB); its peak / LongStraw's: detach 2.50, " \
           "exact 2.00" in table
    assert "fastest peer configuration: prefix-grouper (4.50 s); its time / LongStraw's: detach 1.12, exact 0.90" \
           in table
    assert "not installed" in table


@pytest.mark.skipif(not HAVE_PREFIX_GROUPER, reason="Prefix Grouper is optional: pip install prefix-grouper")
def test_prefix_grouper_path_gives_backward_groups_gradient():
    """The peer measures the same loss on the same group: float64, its gradient equals backward_group's."""
    from conftest import faithful_float64, rel_err

    from longstraw import backward_group, load_model
    from longstraw.bench.peers_worker import prefix_grouper_logprobs, prepare_prefix_grouper
    from longstraw.bench.worker import make_group
    from longstraw.loss import GroupTotals, make_loss_config, response_loss

    p, r, g = 40, 6, 3
    reference = faithful_float64(load_model("tiny-llama", dtype="float64"))
    group = make_group(reference.config.vocab_size, p, r, g, seed=1)
    backward_group(reference, group, plan="standard")
    model = faithful_float64(load_model("tiny-llama", dtype="float64"))
    prepare_prefix_grouper(model)
    logp = prefix_grouper_logprobs(model, group.prompt, torch.stack(group.responses), token_chunk=7)
    cfg = make_loss_config("grpo")
    response_loss(logp, torch.ones_like(logp, dtype=torch.bool), group.advantages, GroupTotals.of([r] * g, cfg),
                  cfg).backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(a.grad, b.grad) < 1e-10, name
