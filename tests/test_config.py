"""TrainConfig: TOML + flag precedence, validation messages."""

import argparse

import pytest

from longstraw.config import TrainConfig, add_arguments, from_args


def _parse(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)))


def test_toml_then_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('group_size = 16\nloss = "dapo"\nlr = 3e-6\ndynamic_sampling = true\n')
    cfg = _parse(str(path), "--group-size", "4", "--no-dynamic-sampling")
    assert (cfg.group_size, cfg.loss, cfg.lr, cfg.dynamic_sampling) == (4, "dapo", 3e-6, False)
    assert TrainConfig().plan == "exact"


@pytest.mark.parametrize("text,match", [
    ("gruop_size = 4", "unknown option"),
    ('group_size = "four"', "group_size must be a int"),
    ("lr = true", "lr must be a float"),
    ("group_size = [", "not valid TOML"),
])
def test_bad_toml(tmp_path, text, match):
    path = tmp_path / "c.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=match):
        _parse(str(path))


@pytest.mark.parametrize("kwargs,match", [
    (dict(task="maze"), "task 'maze' is unknown"),
    (dict(plan="fast"), "plan 'fast' is unknown"),
    (dict(group_size=1), "too small"),
    (dict(lr=float("nan")), "lr must be a finite"),
    (dict(top_p=0.0), "top_p"),
    (dict(task="jsonl"), "needs --data"),
    (dict(data="x.jsonl"), "only apply to --task jsonl"),
])
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_loss_options_use_defaults_unless_set():
    assert TrainConfig().loss_options() == {"beta": 0.0}
    assert TrainConfig(epsilon_high=0.28, beta=0.1).loss_options() == {"beta": 0.1, "epsilon_high": 0.28}


def test_shipped_examples_are_valid_configs():
    from pathlib import Path

    from longstraw.config import load_toml

    examples = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))
    assert examples
    for path in examples:
        TrainConfig(**load_toml(path))
