"""The command line's front door: `--version` and `--help` must not import torch or transformers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src"

# Runs the CLI's main() in a fresh interpreter, then reports which heavy modules that imported.
PROBE = """
import sys
from longstraw.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
print("HEAVY=" + ",".join(m for m in ("torch", "transformers", "numpy", "matplotlib") if m in sys.modules))
print("EXIT=" + str(code))
"""


@pytest.mark.parametrize("argv", [
    ["--version"], ["--help"], ["train", "--help"], ["plan", "--help"], ["bench", "memory", "--help"],
    ["bench", "prompt", "--help"], ["bench", "cp", "--help"], ["bench", "peers", "--help"], ["compare", "--help"],
    ["check", "--help"],
])
def test_version_and_help_import_no_torch(argv):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=60)
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
