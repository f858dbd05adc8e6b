"""`make demo-agent`'s pipeline on a tiny preset: examples/agent-demo.toml (warm start, then GRPO) with a random-init
model and the byte tokenizer, then `python -m benchmarks agent-results` (the results file and the plot). The real run
is `make demo-agent` (docs/agents.md)."""

from __future__ import annotations

import json
import os
import subprocess

from benchmarks import agent_results
from benchmarks.__main__ import main as bench
from longstraw.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "tiny-llama", "--prompt-tokens", "600", "--max-new-tokens", "128", "--chunk-size", "256",
        "--warm-start-steps", "2", "--warm-start-batch", "1", "--steps", "1", "--eval-prompts", "1",
        "--group-size", "2", "--micro-batch", "2"]


def test_the_agent_demo_runs_on_a_tiny_preset(tmp_path, capsys):
    run = tmp_path / "seed0"
    assert main(["train", os.path.join(ROOT, "examples", "agent-demo.toml"), *TINY, "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out  # the run's progress is on stdout
    assert "warm start 2/2: nll" in out and "held-out greedy reward after the warm start" in out
    assert bench(["agent-results", str(tmp_path / "out"), str(run), "--wall-s", "12"]) == 0
    record = json.loads((tmp_path / "out" / "agent-results.json").read_text())
    (r,) = record["runs"]
    assert set(r["held_out_reward"]) == set(r["held_out_tool_call_rate"]) == set(agent_results.POINTS)
    assert len(r["warm_start"]["nll"]) == 2 and len(r["grpo_sampled_reward"]) == 1 and record["wall_s"] == 12
    assert (tmp_path / "out" / "agent-results.png").is_file()


def test_agent_results_refuses_a_run_without_a_warm_start(tmp_path, capsys):
    run = tmp_path / "plain"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"eval_before": 0.0, "eval_after": 0.0, "tool_call_rate_before": 0.0,
                                                  "tool_call_rate_after": 0.0, "steps": 1}))
    assert bench(["agent-results", str(tmp_path / "out"), str(run)]) == 2
    assert "lacks eval_after_warm_start, tool_call_rate_after_warm_start" in capsys.readouterr().err
    assert bench(["agent-results", str(tmp_path / "out"), str(tmp_path / "none")]) == 2
    assert "holds no summary.json" in capsys.readouterr().err
    assert not (tmp_path / "out" / "agent-results.json").exists()


def test_make_demo_agent_runs_the_example_and_the_results():
    dry = subprocess.run(["make", "-n", "demo-agent"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "examples/agent-demo.toml" in dry.stdout and "benchmarks agent-results runs/agent-demo" in dry.stdout
