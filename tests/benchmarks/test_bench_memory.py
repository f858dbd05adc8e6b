"""`python -m benchmarks memory`: the smoke run end to end (fresh worker per configuration, JSON written) and the
ratio/table summary on a synthetic results list."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from benchmarks.__main__ import build_parser, main
from benchmarks.launch import describe_exit
from benchmarks.memory import (
    SMOKE,
    compute_ratios,
    config_from_args,
    format_ratios,
    format_table,
    reference_group_size,
    run_memory_bench,
)
from longstraw.planner import MIB


@pytest.mark.slow
def test_smoke_bench_writes_every_configuration(tmp_path):
    out = tmp_path / "x.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "memory", "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(out) in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["bench"] == "memory"
    assert doc["config"]["model"] == "tiny-llama"
    for key in ("cpu_model", "cpu_count", "cpu_affinity", "memory_total_bytes", "torch", "transformers",
                "python", "device"):
        assert doc["machine"].get(key) is not None, key
    seen = {(r["plan"], r["group_size"]) for r in doc["results"]}
    assert seen == {(m, g) for m in SMOKE.plans for g in SMOKE.groups}
    for r in doc["results"]:
        assert r["status"] == "ok", r
        # --smoke runs every configuration in one worker: a later configuration may reuse heap pages freed by
        # an earlier one, so its peak can be ~0 (the kernel's RSS counters lag by up to a few hundred KiB).
        assert r["peak_bytes"] > -MIB and r["time_s"] > 0, r
        assert r["stats"]["plan"] == r["plan"] and r["stats"]["group_size"] == r["group_size"]
    # Same seed, same group: every plan computes the same loss.
    for g in SMOKE.groups:
        losses = [r["loss"] for r in doc["results"] if r["group_size"] == g]
        assert max(losses) - min(losses) < 1e-4 * max(1.0, abs(losses[0]))
    assert doc["ratios"]["group_size"] == 4
    assert not (tmp_path / "x.json.tmp").exists()
    # A smoke run says what it checks, and prints no numbers that mean nothing at its size.
    assert "smoke run: it checks only that every configuration runs" in proc.stdout
    assert "8 of 8 configurations ran" in proc.stdout
    assert "ratios at" not in proc.stdout and "planner vs measured" not in proc.stdout
    assert " -0." not in proc.stdout + proc.stderr


def test_peaks_under_the_resolution_give_no_ratio_and_no_negative_size():
    from benchmarks.memory import compute_ratios, default_out, peak_text

    assert peak_text(-0.2 * MIB).strip() == "< 1" and peak_text(0.5 * MIB).strip() == "< 1"
    assert peak_text(12.34 * MIB).strip() == "12.3"
    results = [_ok("standard_batched", 4, 2.8, 0.05), _ok("detach", 4, -0.2, 0.1), _ok("exact", 4, 0.0, 0.1),
               _ok("standard", 4, 3.0, 0.1), _ok("detach", 2, 0.7, 0.1)]
    ratios = compute_ratios(results)
    assert ratios["peak_standard_batched_over_detach"] is None  # not -14x
    assert ratios["peak_standard_batched_over_exact"] is None
    assert ratios["time_standard_over_detach"] == 1.0
    assert ratios["peak_growth"]["detach"] is None  # not -100%
    assert default_out("memory", smoke=True).startswith("bench/results/smoke/memory-")
    assert default_out("memory", smoke=False).startswith("bench/results/memory-")


@pytest.mark.slow
def test_failed_worker_is_recorded_not_raised(tmp_path):
    # tiny-llama allows 2048 positions: the worker raises, the bench records it in the partial file; no row
    # finished, so no results file is written.
    out = tmp_path / "fail.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "memory", "--smoke", "--prompt-tokens", "4000",
         "--groups", "2", "--plans", "detach", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "FAILED: exit status 1" in proc.stderr
    (result,) = json.loads((tmp_path / "fail.json.tmp").read_text())["results"]
    assert result["status"] == "failed" and "max_position_embeddings" in result["stderr_tail"]
    assert not out.exists() and f"see stderr_tail in {out}.tmp" in proc.stderr
    assert describe_exit(-9) == "killed by SIGKILL (likely out of memory)"
    assert describe_exit(3) == "exit status 3"


def _ok(plan: str, g: int, peak_mib: float, time_s: float) -> dict[str, object]:
    return {"plan": plan, "group_size": g, "status": "ok", "peak_bytes": int(peak_mib * MIB), "time_s": time_s}


def test_ratios_and_table_on_synthetic_results():
    results = [
        _ok("standard_batched", 2, 400, 2.0), _ok("standard", 2, 100, 3.0),
        _ok("detach", 2, 50, 1.0), _ok("exact", 2, 80, 1.5),
        _ok("standard_batched", 8, 1600, 8.0), _ok("standard", 8, 110, 12.0),
        _ok("detach", 8, 40, 2.0), _ok("exact", 8, 64, 3.0),
        {"plan": "standard_batched", "group_size": 16, "status": "failed", "error": "killed by SIGKILL"},
        _ok("standard", 16, 120, 24.0), _ok("detach", 16, 60, 4.0), _ok("exact", 16, 88, 6.0),
    ]
    ratios = compute_ratios(results)
    assert ratios["group_size"] == 8  # the largest G <= 8, not 16
    assert ratios["peak_standard_batched_over_detach"] == pytest.approx(40.0)
    assert ratios["peak_standard_batched_over_exact"] == pytest.approx(25.0)
    assert ratios["peak_standard_over_detach"] == pytest.approx(110 / 40)
    assert ratios["time_standard_over_detach"] == pytest.approx(6.0)
    assert ratios["time_standard_over_exact"] == pytest.approx(4.0)
    assert ratios["time_exact_over_detach"] == pytest.approx(1.5)
    assert ratios["peak_growth"]["detach"] == {"from_g": 2, "to_g": 16, "pct": pytest.approx(20.0)}
    assert ratios["peak_growth"]["exact"] == {"from_g": 2, "to_g": 16, "pct": pytest.approx(10.0)}

    table = format_table(results, [2, 8, 16], ["standard_batched", "standard", "detach", "exact"])
    lines = table.splitlines()
    assert "standard_batched" in lines[0] and "peak MiB" in lines[1]
    row16 = next(line for line in lines if line.startswith("  16 |"))
    assert "FAILED" in row16 and "120.0" in row16 and "24.00" in row16
    text = format_ratios(ratios)
    assert "ratios at G=8" in text and "40.00x" in text and "+20.0%" in text


def test_missing_or_failed_configurations_give_none():
    results = [_ok("detach", 4, 10, 1.0), {"plan": "exact", "group_size": 4, "status": "failed", "error": "x"}]
    ratios = compute_ratios(results)
    assert ratios["group_size"] == 4
    assert ratios["peak_standard_batched_over_detach"] is None
    assert ratios["time_exact_over_detach"] is None
    assert ratios["peak_growth"] == {"detach": None, "exact": None}
    assert "n/a" in format_ratios(ratios)
    assert reference_group_size([16, 32]) == 16
    assert reference_group_size([]) is None


def test_bad_arguments_are_argparse_errors(capsys):
    # In-process: argparse exits with status 2 and a usage message before any worker starts.
    for argv, message in [
        (["memory", "--groups", "0"], "must be >= 1"),
        (["memory", "--smoke", "--demo"], "not allowed with"),
        (["memory", "--plans", "fast"], "invalid choice"),
        (["memory", "--prompt-tokens", "1"], "--prompt-tokens must be >= 2"),
        ([], "required"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "memory" in capsys.readouterr().out


@pytest.mark.slow  # three fresh-process measurements (~10 s); the planner's recorded checks run by default
def test_checkpoint_dimension_side_by_side_with_planner_prediction(tmp_path, capsys):
    # In-process bench (one worker for all 8 configurations, as --smoke): every plan with and without
    # per-layer activation checkpointing, and the planner's forecast beside each measured peak.
    config = replace(SMOKE, plans=("detach", "exact"), checkpoints=("none", "layers"), smoke=False)  # full report
    doc = run_memory_bench(config, str(tmp_path / "ckpt.json"))
    printed = capsys.readouterr()
    seen = {(r["plan"], r["group_size"], r["checkpoint"]) for r in doc["results"]}
    assert seen == {(m, g, c) for m in config.plans for g in config.groups for c in config.checkpoints}
    for r in doc["results"]:
        assert r["status"] == "ok", r
        assert r["stats"]["checkpoint"] == r["checkpoint"], r
        assert isinstance(r["predicted_step_bytes"], int) and r["predicted_step_bytes"] > 0, r
        assert "prediction_error" in r, r
    # Checkpointing recomputes the same forward: the loss is unchanged.
    for g in config.groups:
        losses = [r["loss"] for r in doc["results"] if r["group_size"] == g]
        assert max(losses) - min(losses) < 1e-4 * max(1.0, abs(losses[0]))
    header = format_table(doc["results"], config.groups, config.plans, config.checkpoints).splitlines()[0]
    assert [c.strip() for c in header.split("|")[1:]] == ["detach", "detach+ckpt", "exact", "exact+ckpt"]
    assert "detach+ckpt" in printed.out and "exact+ckpt" in printed.out
    ratios = doc["ratios"]
    assert "peak_exact_ckpt_over_plain" in ratios and "peak_detach_ckpt_over_plain" in ratios
    assert "peak exact+ckpt / exact" in format_ratios(ratios)
    assert "planner vs measured" in printed.out
    assert "checkpoint none + layers" in printed.out
    assert json.loads((tmp_path / "ckpt.json").read_text())["config"]["checkpoints"] == ["none", "layers"]


def test_checkpoint_ratios_on_synthetic_results():
    results = [
        _ok("detach", 2, 50, 1.0), _ok("exact", 2, 80, 1.5),
        {**_ok("detach", 2, 20, 1.4), "checkpoint": "layers"},
        {"plan": "exact", "group_size": 2, "checkpoint": "layers", "status": "failed", "error": "x"},
    ]
    ratios = compute_ratios(results)
    assert ratios["peak_detach_ckpt_over_plain"] == pytest.approx(0.4)
    assert ratios["peak_exact_ckpt_over_plain"] is None
    # The plan ratios and growth see only the runs without checkpointing.
    assert ratios["time_exact_over_detach"] == pytest.approx(1.5)
    plain_only = compute_ratios(results[:2])
    assert not any(key.endswith("_ckpt_over_plain") for key in plain_only)
    row = format_table(results, [2], ["detach", "exact"], ["none", "layers"]).splitlines()[-1]
    assert "FAILED" in row and "20.0" in row and "50.0" in row


def test_plans_option_and_no_older_name():
    parser = build_parser()
    args = parser.parse_args(["memory", "--smoke", "--plans", "exact", "detach", "exact"])
    assert config_from_args(args, args.fail).plans == ("exact", "detach")
    with pytest.raises(SystemExit):
        parser.parse_args(["memory", "--smoke", "--modes", "exact"])  # the old name: refused


def test_checkpoint_arguments():
    parser = build_parser()

    def checkpoints(*extra: str) -> tuple[str, ...]:
        args = parser.parse_args(["memory", "--smoke", *extra])
        return config_from_args(args, args.fail).checkpoints

    assert checkpoints() == ("none",)
    assert checkpoints("--checkpoint", "none", "layers") == ("none", "layers")
    assert checkpoints("--checkpoint", "layers", "none", "layers") == ("layers", "none")
    assert checkpoints("--checkpoint-layers") == ("layers",)
    for argv in (["--checkpoint", "all"], ["--checkpoint", "none", "--checkpoint-layers"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["memory", *argv])


def test_bench_model_weights_are_resident_before_the_baseline(tmp_path):
    """A model loaded from safetensors may stay memory-mapped, its pages read in only when the step first touches
    them (the step's peak would then include the weights). `load_bench_model` reads every weight once: touching
    them again after loading adds (almost) nothing to the resident set."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.common import load_bench_model

    def rss_bytes() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path)  # 2 x 32000 x 256 fp32 embeddings: ~70 MB of weights
    weights = sum(p.numel() * p.element_size() for p in LlamaForCausalLM(config).parameters())
    model = load_bench_model(str(tmp_path), "float32")
    before = rss_bytes()
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    assert rss_bytes() - before < 0.1 * weights


def test_multi_turn_groups_mask_each_turns_observation():
    """`--turns 3 --observation-tokens 4` with R = 2: responses of 3 x (2 + 4) tokens whose loss masks are True on
    each turn's 2 generated tokens only; the worker runs such a group through backward_group."""
    from benchmarks.worker import make_group, run_config

    group = make_group(512, 16, 2, 3, seed=0, turns=3, observation_tokens=4)
    assert group.lengths == [18] * 3
    assert group.loss_masks is not None
    assert [m.tolist() for m in group.loss_masks] == [([True] * 2 + [False] * 4) * 3] * 3
    result = run_config({"model": "tiny-llama", "dtype": "float32", "device": "cpu", "prompt_tokens": 16,
                         "response_tokens": 2, "group_size": 2, "plan": "exact", "chunk_size": 8, "micro_batch": 1,
                         "seed": 0, "checkpoint": "none", "turns": 3, "observation_tokens": 4})
    # its peak can be 0 in this long-lived process (the step reuses memory freed by earlier tests), so no bound on it
    assert math.isfinite(result["loss"]) and result["peak_bytes"] >= 0 and result["stats"]["group_size"] == 2


def test_warm_steps_time_the_fastest_and_keep_the_cold_one():
    """--warm-steps 2: two more steps in the worker's process; the time is the fastest of them, the cold step's time
    is kept as first_step, and the peak is the cold step's."""
    from benchmarks.worker import run_config

    result = run_config({"model": "tiny-llama", "dtype": "float32", "device": "cpu", "prompt_tokens": 16,
                         "response_tokens": 2, "group_size": 2, "plan": "detach", "chunk_size": 8, "micro_batch": 1,
                         "seed": 0, "checkpoint": "none", "warm_steps": 2})
    assert len(result["warm_steps"]) == 2 and result["time_s"] == min(w[0] for w in result["warm_steps"])
    assert result["first_step"]["time_s"] > 0 and result["cpu_time_s"] == min(result["warm_steps"])[1]
    args = build_parser().parse_args(["memory", "--warm-steps", "3"])
    assert config_from_args(args, lambda m: (_ for _ in ()).throw(SystemExit(m))).warm_steps == 3
    zero = build_parser().parse_args(["memory", "--malloc-mmap-threshold", "0"])  # 0: glibc's own threshold
    assert config_from_args(zero, lambda m: (_ for _ in ()).throw(SystemExit(m))).malloc_mmap_threshold == 0
