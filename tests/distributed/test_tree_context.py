"""A prefix tree under context parallelism: every node's chunks (the long shared root's above all) split over the
ranks, the gradient and log-probs of every rank equal to one process's, float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import agent_tree, assert_close, gradient_tolerance, grads, tiny_model

from longstraw import backward_tree

HERE = Path(__file__).resolve().parent
CHUNK = 4  # as in tree_cp_worker
CASES = [("llama", "exact"), ("llama", "detach"), ("qwen3_5_text", "exact")]


def test_tree_context_parallel_equals_one_process(spawn, tmp_path):
    """C = 2, full attention (exact and detach) and a hybrid with gated-DeltaNet recurrent layers (exact): each rank's
    gradient and log-probs equal one process's, and each holds less of the path's state than one process."""
    out = tmp_path / "tree-cp"
    results = spawn([str(HERE / "tree_cp_worker.py"), str(out)], 2, timeout=300)
    for code, text in results:
        assert code == 0, text
    saved = [torch.load(f"{out}.rank{r}") for r in range(2)]
    for family, plan in CASES:
        model = tiny_model(family)
        result = backward_tree(model, agent_tree(), plan=plan, chunk_size=CHUNK, micro_batch=2)
        reference = grads(model)
        tol = max(gradient_tolerance(family), 1e-12)
        for rank, s in enumerate(saved):
            got = s[(family, plan)]
            assert_close(f"{family} {plan} rank {rank} gradient", reference, got["grads"], tol)
            for lp_ref, lp_got in zip(result.logprobs, got["logprobs"]):
                assert torch.equal(lp_ref.isnan(), lp_got.isnan())
                assert_close(f"{family} {plan} log-probs", lp_ref.nan_to_num(), lp_got.nan_to_num(), tol)
            assert got["state_bytes"] < result.stats["peak_path_state_bytes"], (family, plan, rank)


def test_tree_context_parallel_refuses_what_it_does_not_cover():
    """A model whose layers the sharded state does not cover is refused by backward_tree, before any gradient, as by
    backward_group."""

    class Shards:  # only check_supported runs before the refusal
        def check_supported(self, model: torch.nn.Module) -> None:
            from longstraw.distributed.context import check_supported

            check_supported(model)

    model = tiny_model("gemma3-A")
    with pytest.raises(ValueError, match="without --cp"):
        backward_tree(model, agent_tree(), context_shards=Shards())
    assert all(p.grad is None for p in model.parameters())
