"""Multi-turn rollouts under context parallelism: the ranks that share a prompt compare their environments'
observations at every step, so an environment that differs by rank, or ends an episode or raises on one rank only,
is one clear error on every rank instead of rollouts that diverge or a collective that waits out its timeout."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def test_ranks_whose_environments_disagree_all_stop_with_one_error(spawn, tmp_path):
    out = tmp_path / "env"
    start = time.perf_counter()
    results = spawn([str(HERE / "cp_env_worker.py"), str(out)], 2, timeout=120)
    elapsed = time.perf_counter() - start
    for code, text in results:
        assert code == 0, text
    saved = [torch.load(f"{out}.rank{r}") for r in range(2)]
    same = [s["same"] for s in saved]
    assert all("error" not in s for s in same), same
    assert sum(same[0]["tool_calls"]) >= 1, "no tool call happened: the test needs one"
    assert all(torch.equal(a, b) for a, b in zip(same[0]["responses"], same[1]["responses"]))
    for case, shown in (("differ", r"rank 0: 2 token ids, hash [0-9a-f]{16}; rank 1: 2 token ids, hash [0-9a-f]{16}\)"),
                        ("ended", r"rank 0: 2 token ids, hash [0-9a-f]{16}; rank 1: None \(the episode ends\)\)")):
        errors = [s[case] for s in saved]
        assert errors[0]["error"] == errors[1]["error"] == "RuntimeError", errors
        messages = [re.sub(r" at 0x[0-9a-f]+", "", e["message"]) for e in errors]  # the repr's address differs
        assert messages[0] == messages[1]
        message = messages[0]
        assert "returned different observations on the ranks of the context-parallel group for sequence" in message
        assert re.search(shown, message), message
    raised = [s["raised"] for s in saved]
    assert raised[1] == {"error": "KeyError", "message": "'no record on this rank'"}
    assert raised[0]["error"] == "RuntimeError" and "raised on rank(s) [1]" in raised[0]["message"]
    assert elapsed < 60, f"{elapsed:.0f} s: the ranks waited in a collective"
