"""The gpu-marked tests skip cleanly without CUDA, and their logic holds: a subset of them runs on CPU here
(`LONGSTRAW_GPU_TESTS_DEVICE=cpu`, the fused kernel then being the CPU flash op), so they cannot rot unseen
between GPU runs. The full dry run (24 tests, ~50 s) is `LONGSTRAW_GPU_TESTS_DEVICE=cpu pytest -m gpu tests/gpu`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pytest(*args: str, env: dict[str, str]) -> tuple[int, dict[str, int], str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    return proc.returncode, {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a host without CUDA")
def test_gpu_tests_are_collected_and_skip_without_cuda():
    env = {k: v for k, v in os.environ.items() if k != "LONGSTRAW_GPU_TESTS_DEVICE"}
    rc, counts, out = _pytest("-m", "gpu", "tests/gpu", "-rs", env=env)
    assert rc == 0 and counts.get("skipped", 0) >= 20 and "passed" not in counts and "failed" not in counts, out
    assert "needs a CUDA device" in out


def test_gpu_test_logic_on_cpu():
    env = dict(os.environ, LONGSTRAW_GPU_TESTS_DEVICE="cpu")
    subset = "(fused_kernel and 64) or sampled or end_to_end or (exact_equals and llama)"
    rc, counts, out = _pytest("-m", "gpu", "tests/gpu", "-k", subset, env=env)
    assert rc == 0 and counts.get("passed", 0) >= 9 and "failed" not in counts, out[-3000:]
