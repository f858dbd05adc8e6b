"""The command lines' front doors (`longstraw` and `python -m benchmarks`): `--version` and `--help` must not import
torch or transformers; every (sub)command's help and mistyped names."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SRC = ROOT / "src"
IMPORT_PATH = os.pathsep.join([str(ROOT), str(SRC), os.environ.get("PYTHONPATH", "")])

# Runs a command line's main() (module argv[1]: longstraw.cli or benchmarks.__main__) in a fresh interpreter, then
# reports which heavy modules that imported.
PROBE = """
import importlib
import sys
main = importlib.import_module(sys.argv[1]).main
try:
    main(sys.argv[2:])
except SystemExit as exit_:
    code = exit_.code
print("HEAVY=" + ",".join(m for m in ("torch", "transformers", "numpy", "matplotlib") if m in sys.modules))
print("EXIT=" + str(code))
"""


CLI, BENCH = "longstraw.cli", "benchmarks.__main__"


@pytest.mark.parametrize("module, argv", [
    (CLI, ["--version"]), (CLI, ["--help"]), (CLI, ["train", "--help"]), (CLI, ["plan", "--help"]),
    (BENCH, ["compare", "--help"]), (CLI, ["check", "--help"]), (BENCH, ["--help"]), (BENCH, ["memory", "--help"]),
    (BENCH, ["prompt", "--help"]), (BENCH, ["cp", "--help"]), (BENCH, ["peers", "--help"]),
    (BENCH, ["pareto", "--help"]), (BENCH, ["arch", "--help"]), (BENCH, ["trl-scale", "--help"]),
    (BENCH, ["verl", "--help"]), (BENCH, ["decode", "--help"]), (BENCH, ["provenance", "--help"]),
    (BENCH, ["tree", "--help"]), (BENCH, ["stress", "--help"]), (BENCH, ["gpu", "--help"]),
])
def test_version_and_help_import_no_torch(module, argv):
    env = dict(os.environ, PYTHONPATH=IMPORT_PATH)
    out = subprocess.run([sys.executable, "-c", PROBE, module, *argv], capture_output=True, text=True, env=env,
                         timeout=60)
    lines = out.stdout.splitlines()
    assert "EXIT=0" in lines, out.stdout + out.stderr
    assert "HEAVY=" in lines, f"{argv} imported {[x for x in lines if x.startswith('HEAVY=')]}"
    if argv == ["--version"]:
        assert lines[0].startswith("longstraw ")


def test_package_exports_are_lazy_but_complete():
    import longstraw

    for name in longstraw.__all__:
        assert getattr(longstraw, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        longstraw.nope  # noqa: B018


@pytest.mark.parametrize("flags,match", [
    (["--device", "banana"], "device 'banana' is not a torch device"),
    (["--epsilon-low", "5"], "epsilon_low must be < 1"),
    (["--epsilon-high", "nan"], "epsilon_high must be a finite number"),
    (["--dtype", "float16"], "float16 is not supported for training"),
])
def test_bad_train_options_fail_before_anything_is_created(tmp_path, capsys, flags, match):
    """An argparse error (exit 2, no traceback) before the run dir exists or a model is loaded."""
    from longstraw import cli

    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--model", "no-such-model", "--run-dir", str(run), *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and match in err and "Traceback" not in err
    assert not run.exists()


def test_passive_openmp_wait_is_set_only_when_unset_and_before_torch():
    from longstraw.cli import passive_openmp_wait

    environ: dict[str, str] = {}
    assert passive_openmp_wait(environ, {}) and environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    users = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert not passive_openmp_wait(users, {}) and users == {"OMP_WAIT_POLICY": "ACTIVE"}
    late: dict[str, str] = {}  # torch already loaded libgomp, which read the variable then: setting it is useless
    assert not passive_openmp_wait(late, {"torch": object()}) and late == {}


# main() in a fresh interpreter, then torch imported and run on two threads.
OMP_PROBE = """
import os, sys
from longstraw.cli import main
code = main(sys.argv[1:])
print("OMP_WAIT_POLICY=" + os.environ.get("OMP_WAIT_POLICY", "unset"))
import torch
torch.set_num_threads(2)
x = torch.ones(256, 256)
print("TORCH=" + str(float((x @ x).sum())))
print("EXIT=" + str(code))
"""


@pytest.mark.parametrize("users", [None, "ACTIVE"])
def test_cli_sets_passive_openmp_wait_before_torch_loads(users):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    if users:
        env["OMP_WAIT_POLICY"] = users
    argv = ["plan", "--model", "tiny-llama", "--prompt-tokens", "64", "--response-tokens", "8", "--group-size", "2"]
    out = subprocess.run([sys.executable, "-c", OMP_PROBE, *argv], capture_output=True, text=True, env=env,
                         timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and "EXIT=0" in lines, out.stdout + out.stderr
    assert f"OMP_WAIT_POLICY={users or 'PASSIVE'}" in lines
    assert f"TORCH={256.0 ** 3}" in lines


# ---------------------------------------------------------------- every subcommand's help and errors


def _subcommands(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """Every command path of `module`'s parser (`()`, `("train",)`, ...; `("memory",)`, ... of the benchmarks), found by
    walking it, so a new subcommand is covered without being named here."""
    import argparse
    import importlib

    build_parser = importlib.import_module(module).build_parser

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]):
        yield path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, (*path, name))

    return [(module, path) for path in walk(build_parser(), ())]


def _parser_of(module: str, path: tuple[str, ...]):
    import argparse
    import importlib

    parser = importlib.import_module(module).build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


SUBCOMMANDS = _subcommands(CLI) + _subcommands(BENCH)


def test_the_walk_finds_every_command():
    assert {(CLI, ("train",)), (CLI, ("plan",)), (CLI, ("check",)), (BENCH, ("compare",)), (BENCH, ("memory",)),
            (BENCH, ("verl",)), (BENCH, ("decode",)), (BENCH, ("provenance",))} <= set(SUBCOMMANDS)
    # the benchmarks, compare among them, live outside the library's command line
    assert (CLI, ("bench",)) not in SUBCOMMANDS and (CLI, ("compare",)) not in SUBCOMMANDS


@pytest.mark.parametrize("module, path", SUBCOMMANDS, ids=lambda p: " ".join(p) if isinstance(p, tuple) else p)
def test_every_help_runs_and_lists_every_choice(module, path, capsys):
    """`--help` of every (sub)command prints its help and exits 0 (a '%' in a help text once broke one), and every
    option with a fixed set of values names each value in its own help, also where a metavar hides them from
    argparse's usage; every --model option lists the presets."""
    import argparse
    import importlib
    import re

    from longstraw.choices import PRESET_NAMES

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main([*path, "--help"])
    out = capsys.readouterr().out
    prog = "longstraw" if module == CLI else "python -m benchmarks"
    assert exit_.value.code == 0 and f"usage: {prog}" in out and "%%" not in out  # argparse leaves %% in descriptions
    parser = _parser_of(module, path)
    formatter = parser._get_formatter()
    for action in parser._actions:
        block = " ".join(formatter._format_action(action).split())
        if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
            missing = [c for c in action.choices if not re.search(rf"(?<![\w-]){re.escape(str(c))}(?![\w-])", block)]
            assert not missing, f"{' '.join(path)} {action.option_strings}: help does not name {missing}"
        if "--model" in action.option_strings or (module, path) == (CLI, ("check",)) and action.dest == "model":
            assert all(name in block for name in PRESET_NAMES), f"{' '.join(path)} --model: {block}"


@pytest.mark.parametrize("field, values", [
    ("task", "TASKS"), ("plan", "PLANS"), ("loss", "LOSSES"), ("advantage", "ADVANTAGES"),
    ("lr_schedule", "LR_SCHEDULES"), ("dtype", "DTYPES"), ("model", "PRESET_NAMES"), ("model", "PACKAGED_MODELS"),
])
def test_train_help_lists_the_values_its_config_accepts(field, values, capsys):
    """The train options TrainConfig checks (not argparse: a TOML file sets them too) name every accepted value."""
    import re

    from longstraw import choices
    from longstraw.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    flag = "--" + field.replace("_", "-")
    own = help_text.split(f"{flag} {field.upper()} ", 1)[1].split(" --", 1)[0]
    for value in getattr(choices, values):
        assert re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", own), f"{flag}: {value} not in {own!r}"


def test_preset_names_for_help_match_the_presets():
    from longstraw.choices import PACKAGED_MODELS, PRESET_NAMES
    from longstraw.models.gguf_files import PACKAGED_GGUF
    from longstraw.models.presets import PRESETS

    assert PRESET_NAMES == tuple(PRESETS) and PACKAGED_MODELS == tuple(PACKAGED_GGUF)


@pytest.mark.parametrize("module, path", SUBCOMMANDS, ids=lambda p: " ".join(p) if isinstance(p, tuple) else p)
def test_every_usage_error_comes_first_in_one_line(module, path, capsys, tmp_path):
    """A mistake's one-line error is the first line on stderr, followed by at most one short usage line (not the
    whole usage text before it); status 2."""
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--no-such-option", "--out", str(tmp_path / "x.json"), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    root = "longstraw" if module == CLI else "python -m benchmarks"
    prog = " ".join((root, *path))
    assert exit_.value.code == 2 and len(err) == 2, err
    assert err[0].startswith(f"{prog}: error: ") or err[0].startswith(f"{prog} "), err
    assert err[1].startswith(f"usage: {root}"), err


@pytest.mark.parametrize("argv, message", [
    (["train", "--model", "tiny-qwen"], "model 'tiny-qwen' (did you mean tiny-qwen3?)"),
    (["train", "--task", "pasky"], "task 'pasky' is unknown (did you mean passkey?)"),
    (["train", "--plan", "exat"], "unknown plan 'exat' (did you mean exact?)"),
    (["train", "--loss", "cispoo"], "unknown loss 'cispoo' (did you mean cispo"),
    (["train", "--grop-size", "3"], "unrecognized arguments: --grop-size (--grop-size: did you mean --group-size"),
    (["plan", "--model", "tiny-qwen", "--prompt-tokens", "64", "--response-tokens", "8", "--group-size", "2"],
     "unknown model 'tiny-qwen' (did you mean tiny-qwen3?)"),
    (["plan", "--model", "tiny-llama", "--prompt-tokens", "64", "--response-tokens", "8", "--group-size", "2",
      "--fsdp-gather", "layers"], "invalid choice: 'layers' (choose from 'all', 'layer') (did you mean layer?)"),
    (["plan", "--promt-tokens", "64"],
     "required: --model, --prompt-tokens, --response-tokens, --group-size (--promt-tokens: did you mean "
     "--prompt-tokens"),
    (["bench", "memory"], "invalid choice: 'bench'"),
])
def test_did_you_mean(argv, message, capsys, tmp_path, monkeypatch):
    """A mistyped name (model preset, task, plan, loss, option, choice) is refused with the closest names."""
    from longstraw.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if argv[0] == "train":
        argv = [*argv, "--run-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    first = err.strip().splitlines()[0]
    assert exit_.value.code == 2 and message in first, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, message", [
    (["memroy"], "invalid choice: 'memroy'"),
    (["memory", "--plans", "exat"], "(did you mean exact?)"),
    (["memory", "--arch", "lama"], "no preset 'b1-lama' (did you mean llama?)"),
])
def test_did_you_mean_in_benchmarks(argv, message, capsys):
    """`python -m benchmarks`: a mistyped benchmark, choice or preset is refused with the closest names."""
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.strip().splitlines()[0], err


def test_did_you_mean_for_a_toml_key(tmp_path, capsys):
    from longstraw.cli import main

    config = tmp_path / "c.toml"
    config.write_text("[rollout]\ngroup_szie = 4\n")
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(config), "--run-dir", str(tmp_path / "run")])
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert exit_.value.code == 2 and "unknown option(s) group_szie (did you mean group_size?)" in first
