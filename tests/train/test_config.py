"""TrainConfig: TOML + flag precedence, validation messages."""

import argparse

import pytest

from longstraw.engine.loss.config import LossConfig
from longstraw.plan import DETACH, EXACT
from longstraw.train.config import TrainConfig, add_arguments, from_args


def _parse(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)))


def test_toml_then_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[rollout]\ngroup_size = 16\ndynamic_sampling = true\n[plan]\nloss = "dapo"\n'
                    '[optimizer]\nlr = 3e-6\n')
    cfg = _parse(str(path), "--group-size", "4", "--no-dynamic-sampling")
    assert (cfg.rollout.group_size, cfg.plan.loss, cfg.optimizer.lr, cfg.rollout.dynamic_sampling) == (
        4, "dapo", 3e-6, False)
    assert TrainConfig().plan.plan is EXACT and TrainConfig.from_flat(plan="detach").plan.plan is DETACH


@pytest.mark.parametrize("text,match", [
    ("gruop_size = 4", "unknown option"),
    ("[rollout]\ngruop_size = 4", "unknown option"),
    ('[rollout]\ngroup_size = "four"', "group_size must be a int"),
    ("[optimizer]\nlr = true", "lr must be a float"),
    ("group_size = [", "not valid TOML"),
    ("lr = 1e-5", r"lr belongs in \[optimizer\]"),
    ("[plan]\nlr = 1e-5", r"lr belongs in \[optimizer\], not \[plan\]"),
    ("[optimiser]\nlr = 1e-5", r"unknown section \[optimiser\]"),
    ("plan = 3", r"plan belongs in \[plan\]"),
])
def test_bad_toml(tmp_path, text, match):
    path = tmp_path / "c.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=match):
        _parse(str(path))


@pytest.mark.parametrize("kwargs,match", [
    (dict(task="maze"), "task 'maze' is unknown"),
    (dict(plan="fast"), "unknown plan 'fast'"),
    (dict(group_size=1), "too small"),
    (dict(lr=float("nan")), "lr must be a finite"),
    (dict(top_p=0.0), "top_p"),
    (dict(task="jsonl"), "needs --data"),
    (dict(data="x.jsonl"), "only apply to --task jsonl"),
])
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flat(**kwargs)


@pytest.mark.parametrize("flags,match", [
    (["--epsilon-low", "nan"], "epsilon_low must be a finite number"),
    (["--epsilon-high", "nan"], "epsilon_high must be a finite number"),
    (["--epsilon-high", "inf"], "epsilon_high must be a finite number >= 0, or -1"),
    (["--epsilon-low", "-0.5"], "epsilon_low must be a finite number >= 0, or -1"),
    (["--epsilon-low", "5"], r"epsilon_low must be < 1 \(the ratio's lower clip is 1 - epsilon_low\)"),
    (["--beta", "inf"], "beta must be a finite number"),
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--temperature", "1e-45"], r"temperature must be >= 0.001, got 1e-45: .* for greedy sampling use --top-k 1"),
    (["--max-grad-norm", "-1"], "max_grad_norm must be a finite number >= 0"),
    (["--weight-decay", "nan"], "weight_decay must be a finite number"),
    (["--top-p", "inf"], "top_p must be a finite number"),
    (["--seed", "-1"], r"seed must be in \[0, 2\*\*63\)"),
    (["--dtype", "float16"], "float16 is not supported for training: AdamW's eps .* use --dtype bfloat16"),
    (["--dtype", "int8"], "dtype 'int8' is unknown: choose float32, bfloat16 or float64"),
    (["--device", "banana"], "device 'banana' is not a torch device: use cpu, cuda or cuda:N"),
])
def test_every_numeric_option_is_checked_at_parse_time(flags, match):
    """Refused while parsing, naming the option: before any model is loaded or any run dir is created."""
    with pytest.raises(ValueError, match=match):
        _parse(*flags)


def test_nan_and_inf_in_toml_are_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[plan]\nepsilon_high = nan\n")
    with pytest.raises(ValueError, match="epsilon_high must be a finite number"):
        _parse(str(path))
    path.write_text("[optimizer]\nlr = inf\n")
    with pytest.raises(ValueError, match="lr must be a finite number"):
        _parse(str(path))


def test_python_construction_checks_types():
    with pytest.raises(ValueError, match="group_size must be an integer, got 2.5"):
        TrainConfig.from_flat(group_size=2.5)
    with pytest.raises(ValueError, match="plot must be true or false"):
        TrainConfig.from_flat(plot="no")


def test_cuda_without_a_gpu_is_refused_at_parse_time():
    import torch

    if torch.cuda.is_available():  # the refusal is then about a device index that does not exist
        with pytest.raises(ValueError, match=r"has \d+ CUDA device\(s\)"):
            _parse("--device", f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ValueError, match="no CUDA GPU is available .* use --device cpu"):
            _parse("--device", "cuda")


def test_float16_help_and_error_agree():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    help_text = parser.format_help()
    assert "float16 is refused" in " ".join(help_text.split())
    assert TrainConfig.from_flat(dtype="bfloat16").model.dtype == "bfloat16"


def test_the_loss_uses_its_defaults_unless_set():
    assert TrainConfig().plan.loss_config() == LossConfig("grpo")
    assert TrainConfig.from_flat(epsilon_high=0.28, beta=0.1).plan.loss_config() == LossConfig(
        "grpo", epsilon_high=0.28, beta=0.1)


def test_shipped_examples_are_valid_configs():
    from pathlib import Path

    from longstraw.train.config import load_toml

    examples = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))
    assert examples
    for path in examples:
        TrainConfig.from_flat(**load_toml(path))


def test_toml_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b'[model]\nmodel = "caf\xe9"\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not UTF-8 \(byte 0xe9\)"):
        _parse(str(path))
    path.write_text("[optimizer]\nlr = \n")
    with pytest.raises(ValueError, match=rf"{path}: not valid TOML: .*\(at line 2, column 6\)"):
        _parse(str(path))


def test_overwrite_is_taken_from_the_command_line_only(tmp_path):
    """A file reused for a later run must not delete that run's directory: overwrite = true is refused."""
    path = tmp_path / "c.toml"
    path.write_text("[run]\noverwrite = true\n")
    with pytest.raises(ValueError, match="pass --overwrite on the command line"):
        _parse(str(path))
    path.write_text("[run]\noverwrite = false\n")
    assert _parse(str(path), "--overwrite").run.overwrite is True


def test_sections_hold_unique_options_and_flat_values_round_trip():
    """SECTIONS is derived from the section dataclasses; flags and flat dicts need each option in one section."""
    from longstraw.train.config import SECTION_OF, SECTIONS
    from longstraw.train.sections import RolloutSection

    assert len(SECTION_OF) == sum(len(names) for names in SECTIONS.values())
    assert SECTIONS["parallelism"] == ("cp", "tp") and SECTION_OF["lr"] == "optimizer"
    cfg = TrainConfig.from_flat({"plan": "detach", "bias_every": 2}, group_size=4)
    assert TrainConfig.from_flat(cfg.to_flat()) == cfg and cfg.to_flat()["plan"] == "detach"
    with pytest.raises(ValueError, match="unknown option.* group_szie .*did you mean group_size"):
        TrainConfig.from_flat(group_szie=4)
    with pytest.raises(ValueError, match="group_size must be >= 1"):  # a section checks its own fields alone
        RolloutSection(group_size=0)
