"""Context parallelism (C ranks share one prompt's state): log-probs and gradients equal one process, every
rank ends with the full gradient, and each rank holds ~1/C of the attention state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import FP32_RANKS, assert_close, masked, random_group, tiny_model
from helpers import grads as all_grads

from longstraw import backward_group

HERE = Path(__file__).resolve().parent
PROMPT, RESPONSES, CHUNK = 61, [5, 1, 9], 8  # as in cp_worker: 60 encoded positions in 8 chunks
# (family, plan, checkpoint): full attention; a hybrid with recurrent layers; both with per-layer checkpointing
CASES = [("llama", "exact", "none"), ("llama", "detach", "none"), ("qwen3_5_text", "exact", "none"),
         ("llama", "exact", "layers"), ("qwen3_5_text", "exact", "layers")]
MASKED_CASES = [("llama", "exact"), ("llama", "detach"), ("qwen3_5_text", "exact")]  # as in cp_worker


def _single(family: str, plan: str):
    model = tiny_model(family, torch.float32)
    group = random_group(PROMPT, RESPONSES, seed=3, dtype=torch.float32)
    result = backward_group(model, group, plan=plan, chunk_size=CHUNK, micro_batch=2)
    return all_grads(model), result.logprobs, result.stats["prompt_state_bytes"]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_context_parallel_equals_one_process(spawn, tmp_path, world):
    """C = 2 and C = 3 (8 chunks over 3 ranks: slices of 3, 3, 2), float32, for a full-attention model (exact
    and detach) and a hybrid with gated-DeltaNet recurrent layers (exact), the exact cases also with per-layer
    activation checkpointing (its recompute re-runs the collectives in the backward, in the same order on
    every rank)."""
    out = tmp_path / "cp"
    results = spawn([str(HERE / "cp_worker.py"), str(out)], world, timeout=300)
    for code, text in results:
        assert code == 0, text
    saved = [torch.load(f"{out}.rank{r}") for r in range(world)]
    for family, plan, checkpoint in CASES:  # the reference runs without checkpointing
        _check(family, plan, world, [s[(family, plan, checkpoint)] for s in saved])


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_context_parallel_with_masks_equals_one_process(spawn, tmp_path, world):
    """With loss masks, C = 2 and 3, float32: full attention (exact and detach) and the hybrid with gated-DeltaNet
    recurrent layers (exact)."""
    out = tmp_path / "cp"
    results = spawn([str(HERE / "cp_worker.py"), str(out), "masked"], world, timeout=300)
    for code, text in results:
        assert code == 0, text
    saved = [torch.load(f"{out}.rank{r}") for r in range(world)]
    # Each rank's gradient and loss tokens' log-probs equal one process's with the same masks (masked tokens'
    # log-probs are not computed: NaN).
    for family, plan in MASKED_CASES:
        model = tiny_model(family, torch.float32)
        group = masked(random_group(PROMPT, RESPONSES, seed=3, dtype=torch.float32))
        result = backward_group(model, group, plan=plan, chunk_size=CHUNK, micro_batch=2)
        for s in saved:
            got = s[("masked", family, plan)]
            assert_close(f"masked {family} {plan} gradient on C = {world}", all_grads(model), got["grads"],
                         FP32_RANKS)
            for a, b, m in zip(got["logprobs"], result.logprobs, group.loss_masks):
                assert bool(a[~m].isnan().all()) and float((a[m] - b[m]).abs().max()) <= 1e-5


def _check(family: str, plan: str, world: int, per_rank: list[dict]) -> None:
    grads, logprobs, state_bytes = _single(family, plan)
    for r in per_rank:
        assert_close(f"{family} {plan} gradient on C = {world}", grads, r["grads"], FP32_RANKS)
        for a, b in zip(r["logprobs"], logprobs):
            assert float((a - b).abs().max()) <= 1e-5
    # Attention state is split (recurrent state, constant in P, is replicated): the ranks together hold it once.
    shards = [r["state_bytes"] for r in per_rank]
    if family == "llama":
        assert sum(shards) == state_bytes
        assert max(shards) <= state_bytes / world * 1.5  # 8 chunks over C ranks: slices of 3 and 2 (or 4 and 4)
    else:
        assert max(shards) < state_bytes


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma3-A", "llama4-A", "zamba2-A", "minimax"])
def test_context_parallel_refuses_latent_and_windowed_attention(family):
    from longstraw.distributed.context import check_supported

    with pytest.raises(ValueError, match="without --cp"):
        check_supported(tiny_model(family, torch.float32))
