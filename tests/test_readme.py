"""The README's "Use it" snippet runs as written (a front-door example that fails is worse than none)."""

from __future__ import annotations

import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_use_it_snippet_runs_as_written(capsys):
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Use it"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md (Use it)", "exec"), namespace)
    result, model = namespace["result"], namespace["model"]
    assert torch.isfinite(torch.tensor(result.loss))
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert "prompt_state_bytes" in capsys.readouterr().out
