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
