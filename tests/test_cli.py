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
    ["bench", "prompt", "--help"], ["bench", "cp", "--help"],
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
