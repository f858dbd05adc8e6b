"""`python -m benchmarks compare`: one run per plan and seed, the table, the plot, resuming, the lock on --out, and
exact == standard in float64."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import faithful_float64, held_run_lock, jsonl_dataset

import longstraw.train.trainer
from benchmarks.__main__ import main as bench
from longstraw import cli
from longstraw.admission.loading import load_model
from longstraw.train.checkpoints import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def _jsonl(tmp_path: Path) -> Path:
    return jsonl_dataset(tmp_path)


def _common(tmp_path: Path) -> list[str]:
    # A reward that varies across random responses, so every step has a non-zero gradient.
    return ["--model", "tiny-llama", "--task", "jsonl", "--data", str(_jsonl(tmp_path)),
            "--reward-fn", "rewards_for_tests:even_byte_fraction", "--group-size", "4", "--max-new-tokens", "6",
            "--lr", "1e-3", "--eval-prompts", "2", "--chunk-size", "8", "--steps", "2"]


def test_compare_writes_table_and_plot_and_does_not_redo_finished_runs(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cmp"
    argv = ["compare", *_common(tmp_path), "--plans", "standard,detach", "--seeds", "2", "--bias-every", "1",
            "--out", str(out)]
    assert bench(argv) == 0
    progress = capsys.readouterr().out
    for f in ("compare.png", "compare.md", "compare.json"):
        assert (out / f).is_file(), f
    assert progress.count(": started (") == 4 and progress.count(": finished in ") == 4

    result = json.loads((out / "compare.json").read_text())
    assert result["plans"] == ["standard", "detach"] and result["seeds"] == [0, 1] and result["steps"] == 2
    assert sorted((r["plan"], r["seed"]) for r in result["runs"]) == [
        ("detach", 0), ("detach", 1), ("standard", 0), ("standard", 1)]
    for plan in ("standard", "detach"):  # the table's numbers are the runs' own summaries
        afters = [json.loads((out / f"{plan}-seed{s}" / "summary.json").read_text())["eval_after"] for s in (0, 1)]
        h = result["held_out"][plan]
        assert h["per_seed"] == afters and h["n"] == 2
        assert h["mean"] == pytest.approx(sum(afters) / 2) and h["min"] == min(afters) and h["max"] == max(afters)
        assert h["std"] == pytest.approx(abs(afters[0] - afters[1]) / math.sqrt(2))
    v = result["vs_standard"]["detach"]
    assert v["diff"] == pytest.approx(result["held_out"]["detach"]["mean"] - result["held_out"]["standard"]["mean"])
    if v["rel_diff"] is not None:
        assert v["within_criterion"] == (abs(v["rel_diff"]) <= 0.05)
    assert "standard" not in result["vs_standard"] and result["standard_spread"]["std"] == result["held_out"][
        "standard"]["std"]
    # Weight divergence: detach trained a different trajectory from the same initial weights.
    rows = result["weight_divergence"]["detach"]
    assert [r["seed"] for r in rows] == [0, 1]
    for r in rows:
        assert r["standard_update_norm"] > 0 and 1e-6 < r["rel_to_update"] < 10 and 0 < r["rel_to_weights"] < 1
    md = (out / "compare.md").read_text()
    assert "| standard | " in md and "| detach | " in md and "within 5%" in md and "| detach | 1 | " in md
    assert "Bias meter" in md  # the detach runs were metered; the standard runs were not
    assert "bias_cosine" in (out / "detach-seed0" / "metrics.jsonl").read_text()
    assert "bias_cosine" not in (out / "standard-seed0" / "metrics.jsonl").read_text()

    # Rerun: nothing is trained again (train() would raise), the outputs are rewritten from the finished runs.
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("*/checkpoint.pt")}

    def no_training(cfg):
        raise AssertionError(f"{cfg.run.run_dir} was trained again")

    monkeypatch.setattr(longstraw.train.trainer, "train", no_training)
    (out / "compare.md").unlink()
    assert bench(argv) == 0
    out_text = capsys.readouterr().out
    assert out_text.count("already finished") == 4 and "not rerun" in out_text
    assert (out / "compare.md").read_text() == md
    assert mtimes == {p: p.stat().st_mtime_ns for p in out.glob("*/checkpoint.pt")}

    # Other settings in the same directory would mix two experiments: refused before anything runs.
    assert bench([*argv[:-2], "--lr", "2e-3", "--out", str(out)]) == 1
    assert "holds a comparison of other settings (lr: 0.001 -> 0.002)" in capsys.readouterr().err


def test_compare_resumes_an_interrupted_run(tmp_path, capsys):
    """A run that stopped with a checkpoint (here: --stop-after through `train`) is resumed, not restarted."""
    out = tmp_path / "cmp"
    common = _common(tmp_path)
    assert cli.main(["train", *common, "--plan", "detach", "--seed", "0", "--stop-after", "1",
                     "--run-dir", str(out / "detach-seed0")]) == 0
    capsys.readouterr()
    assert bench(["compare", *common, "--plans", "standard,detach", "--seeds", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "detach seed 0: resuming from its checkpoint" in captured.out and "resumed from" in captured.out
    rows = [json.loads(x) for x in (out / "detach-seed0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_a_second_compare_on_the_same_out_is_refused_with_the_first_ones_pid(tmp_path, capsys):
    """compare locks its --out like `train` locks its --run-dir: a second comparison writing the same directory is
    refused at once, naming the first's PID, before anything in it is touched."""
    out = tmp_path / "cmp"
    out.mkdir()
    with held_run_lock(out) as holder:
        argv = ["compare", "--model", "tiny-llama", "--task", "jsonl", "--data", str(jsonl_dataset(tmp_path)),
                "--group-size", "2", "--max-new-tokens", "2", "--eval-prompts", "1", "--steps", "1", "--plans",
                "standard,detach", "--out", str(out)]
        assert bench(argv) == 1
        err = capsys.readouterr().err
        assert f"--out {out} is in use by another longstraw process (PID {holder.pid} on host" in err, err
        assert sorted(p.name for p in out.iterdir()) == [".longstraw.lock"]  # nothing written or trained


@pytest.mark.parametrize("flags, message", [
    (["--plans", "exact,detach"], "include it"),
    (["--plans", "standard,bogus"], "unknown plan(s) bogus"),
    (["--plans", "standard,exact,standard"], "names a plan twice"),
    (["--plan", "detach"], "--plan does not apply to compare"),
    (["--run-dir", "x"], "the runs go under --out"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--seeds", "3-"], "a range is not accepted, set the first seed with --seed"),
    (["--seeds", "100000000000"], "--seeds must be <= 100, got 100000000000"),
    (["--eval-prompts", "0"], "eval_prompts must be >= 1"),
    (["--model", "/nonexistent"], "--model: model '/nonexistent' is not a preset"),
])
def test_compare_bad_options_are_usage_errors(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        bench(["compare", *_common(tmp_path), *flags, "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before any run


def test_a_prompt_beyond_the_models_positions_is_refused_before_anything_is_written(tmp_path, capsys):
    """--prompt-tokens + --max-new-tokens beyond the positions tiny-llama's config declares (2048): a usage error,
    not a refusal after "started" with a compare-config.json and a run folder left behind."""
    with pytest.raises(SystemExit) as exit_info:
        bench(["compare", "--model", "tiny-llama", "--task", "passkey", "--prompt-tokens", "999999", "--seeds", "1",
                  "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert ("--prompt-tokens 999999 + --max-new-tokens 16 exceed the 2048 positions of model 'tiny-llama': lower "
            "--prompt-tokens or --max-new-tokens") in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_exact_and_standard_end_with_the_same_weights_in_float64(tmp_path, monkeypatch, capsys):
    """Three AdamW steps of `exact` and of `standard` from the same seed, in float64, through compare.

    Measured as compare reports it: ||w_exact - w_standard|| / ||w_standard - w_initial|| over all trainable
    parameters (the difference relative to how far training moved the weights, the stricter of the two ratios),
    required <= 1e-10; each tensor is also checked on its own. transformers' RMSNorm computes in float32 even in
    a float64 model, which alone would leave ~1e-8 of rounding noise between the two plans' different
    computation orders; the trainer's models are patched to compute it in float64 (helpers.faithful_float64).
    """
    monkeypatch.setattr(longstraw.train.trainer, "load_model", lambda *a, **k: faithful_float64(load_model(*a, **k)))
    out = tmp_path / "cmp"
    assert bench(["compare", *_common(tmp_path), "--dtype", "float64", "--steps", "3", "--plans",
                     "standard,exact", "--seeds", "1", "--no-plot", "--out", str(out)]) == 0
    capsys.readouterr()
    result = json.loads((out / "compare.json").read_text())
    (row,) = result["weight_divergence"]["exact"]
    metrics = [json.loads(x) for x in (out / "standard-seed0" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["grad_norm"] > 0 for m in metrics)  # every step really trained
    assert row["standard_update_norm"] > 1e-3 * row["standard_weight_norm"]
    assert row["rel_to_update"] <= 1e-10, row
    a, b = load_checkpoint(out / "standard-seed0")["model"], load_checkpoint(out / "exact-seed0")["model"]
    assert a.keys() == b.keys() and a[next(iter(a))].dtype == torch.float64
    for k in a:
        assert float((a[k] - b[k]).norm()) <= 1e-12 * max(1.0, float(a[k].norm())), k
    assert result["held_out"]["exact"]["per_seed"] == result["held_out"]["standard"]["per_seed"]


def test_out_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        bench(["compare", *_common(tmp_path), "--out", str(tmp_path / "f")])
    assert exit_info.value.code == 2 and f"--out {tmp_path / 'f'} is a file, not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("lines, message", [
    ("[run]\nresume = true\nstop_after = 1\n", "compare does not use resume, stop_after (resume: compare resumes"),
    ("[run]\nforce = true\n", "compare does not use force"),
    ("[run]\noverwrite = true\n", "pass --overwrite on the command line"),
])
def test_toml_keys_compare_does_not_use_are_refused(tmp_path, capsys, lines, message):
    """Dropping them in silence would run something else than the file says; a destructive option is taken from the
    command line only (a file reused later must not delete runs)."""
    toml = tmp_path / "c.toml"
    toml.write_text(lines)
    with pytest.raises(SystemExit) as exit_info:
        bench(["compare", str(toml), *_common(tmp_path), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished comparison (standard, detach; 2 seeds; 1 step) from a train TOML that sets plan and run_dir,
    with --no-plot and the jsonl task's exact-match reward, which a random tiny model never earns (reward 0)."""
    root = tmp_path_factory.mktemp("finished")
    data = jsonl_dataset(root)
    toml = root / "train.toml"
    train_run = root / "train-run"
    toml.write_text(f'[model]\nmodel = "tiny-llama"\n[task]\ntask = "jsonl"\ndata = "{data}"\n'
                    '[rollout]\ngroup_size = 2\nmax_new_tokens = 4\n[plan]\nplan = "exact"\nchunk_size = 8\n'
                    f'[run]\nrun_dir = "{train_run}"\neval_prompts = 1\n')
    out = root / "cmp"
    argv = ["compare", str(toml), "--plans", "standard,detach", "--seeds", "2", "--steps", "1", "--no-plot"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = bench([*argv, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return {"argv": argv, "out": out, "code": code, "err": err.getvalue(), "root": root, "toml": toml}


def _copy(finished, tmp_path: Path) -> tuple[list[str], Path]:
    out = tmp_path / "cmp"
    shutil.copytree(finished["out"], out)
    return [*finished["argv"], "--out", str(out)], out


def _no_training(monkeypatch) -> list:
    """trainer.train records its config and stops the comparison (exit 1) instead of training."""
    calls = []

    def record(cfg):
        calls.append(cfg)
        raise ValueError("stopped by the test")

    monkeypatch.setattr(longstraw.train.trainer, "train", record)
    return calls


def test_a_train_toml_no_plot_and_a_zero_baseline(finished):
    """plan and run_dir of a train TOML are not used, with a note; --no-plot stops compare's plot too; against a
    standard reward of 0 the 5% verdict is "not measurable", never "yes"."""
    assert finished["code"] == 0, finished["err"]
    out = finished["out"]
    assert "train.toml's plan and run_dir not used: the runs go under" in finished["err"]
    assert not (finished["root"] / "train-run").exists()
    assert not list(out.rglob("*.png"))  # neither compare.png nor any run's progress.png
    result = json.loads((out / "compare.json").read_text())
    assert result["held_out"]["standard"]["mean"] == 0.0  # the premise: exact match is never earned here
    v = result["vs_standard"]["detach"]
    assert v["rel_diff"] is None and v["within_criterion"] is None
    assert "| not measurable |" in (out / "compare.md").read_text()


def test_table_of_and_checks_of_read_compare_json(finished, capsys):
    """`--table-of` prints compare.md's table from compare.json; `--checks-of` the 5% verdict per plan, reported
    without a verdict against a baseline of 0 (not measurable), so the status is 0."""
    path = str(finished["out"] / "compare.json")
    assert bench(["compare", "--table-of", path]) == 0
    assert capsys.readouterr().out == (finished["out"] / "compare.md").read_text() + "\n"
    assert bench(["compare", "--checks-of", path]) == 0
    assert capsys.readouterr().out == "detach_within_criterion: reported (no verdict)\n"


def test_a_reused_run_trained_further_is_refused_and_rerun_only_with_overwrite(finished, tmp_path, capsys,
                                                                               monkeypatch):
    argv, out = _copy(finished, tmp_path)
    run = out / "standard-seed0"
    assert cli.main(["train", str(finished["toml"]), "--plan", "standard", "--seed", "0", "--steps", "2",
                     "--resume", "--no-plot", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in out.glob("compare*")}
    calls = _no_training(monkeypatch)
    assert bench(argv) == 1
    err = capsys.readouterr().err
    assert (f"{run} was trained further than this comparison: its checkpoint is at step 2, the comparison trains "
            f"--steps 1; delete {run} to train that run again") in err
    assert calls == [] and before == {p: p.read_bytes() for p in out.glob("compare*")}  # nothing written

    assert bench([*argv, "--overwrite"]) == 1 and "stopped by the test" in capsys.readouterr().err
    first = calls[0]
    assert (first.plan.plan.name, first.run.seed, first.run.overwrite) == ("standard", 0, True)


def test_a_reused_run_of_other_settings_is_refused_naming_them(finished, tmp_path, capsys, monkeypatch):
    argv, out = _copy(finished, tmp_path)
    run = out / "detach-seed1"
    ckpt = load_checkpoint(run)
    ckpt["config"]["lr"] = 0.5
    save_checkpoint(run, ckpt)
    calls = _no_training(monkeypatch)
    assert bench(argv) == 1
    assert (f"{run} holds a run of other settings than this comparison's detach seed 1 (lr: 0.5 -> 1e-05)"
            in capsys.readouterr().err)
    assert calls == []


def test_fewer_seeds_or_plans_never_drop_them_from_the_summary(finished, tmp_path, capsys, monkeypatch):
    argv, out = _copy(finished, tmp_path)
    summary = (out / "compare.json").read_bytes()
    calls = _no_training(monkeypatch)
    assert bench([*argv, "--seeds", "1"]) == 1
    assert ("summarises seed(s) 1 that this invocation leaves out, and rewriting it would drop them: pass --plans "
            "standard,detach --seeds 2") in capsys.readouterr().err
    assert bench([*argv, "--plans", "standard,exact"]) == 1
    assert "summarises plan(s) detach that this invocation leaves out" in capsys.readouterr().err
    assert calls == [] and (out / "compare.json").read_bytes() == summary


@pytest.mark.parametrize("damage, message", [
    (lambda run: (run / "summary.json").write_text(""), "summary.json is empty"),
    (lambda run: (run / "summary.json").write_text('{"eval_before": 0.0,\n "eval_af'),
     "summary.json:2: not valid JSON"),
    (lambda run: (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text()[:30]),
     "metrics.jsonl:1: not a metrics row, the file is cut short or damaged"),
    (lambda run: (run / "metrics.jsonl").write_text(""), "metrics.jsonl holds step rows none"),
])
def test_damaged_files_of_a_reused_run_are_one_line_errors(finished, tmp_path, capsys, monkeypatch, damage, message):
    argv, out = _copy(finished, tmp_path)
    damage(out / "standard-seed1")
    calls = _no_training(monkeypatch)
    assert bench(argv) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the note on the TOML's plan and run_dir
    assert last.startswith("python -m benchmarks compare: error: ") and message in last
    assert f"delete {out / 'standard-seed1'} to train that run again" in last
    assert "Traceback" not in err and calls == []


def test_a_value_refused_after_a_run_started_leaves_nothing_that_refuses_the_corrected_rerun(tmp_path, capsys,
                                                                                           monkeypatch):
    """--max-new-tokens 4000 is refused once the model is loaded (2048 positions); the corrected command is not
    refused as "other settings" by the record of the attempt, which trained nothing."""
    out = tmp_path / "o"
    argv = ["compare", *_common(tmp_path), "--plans", "standard,exact", "--seeds", "1", "--out", str(out)]
    assert bench([*argv, "--max-new-tokens", "4000"]) == 1
    assert "exceeds the 2048 positions" in capsys.readouterr().err
    calls = _no_training(monkeypatch)
    assert bench(argv) == 1
    err = capsys.readouterr().err
    assert "records other settings (max_new_tokens: 4000 -> 6), but no run has saved a step under them" in err
    assert "holds a comparison of other settings" not in err
    assert [(c.plan.plan.name, c.rollout.max_new_tokens) for c in calls] == [("standard", 6)]
