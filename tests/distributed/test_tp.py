"""Tensor parallelism (a model split by heads with transformers' plan): gradients and log-probs equal one process in
float64, alone (TP = 2, every plan, five families), with context parallelism (TP = 2 x cp = 2) and with FSDP2 (2
data-parallel ranks x TP = 2); each rank holds half of the prompt state's K/V (a quarter with cp = 2); sampling draws
the same responses; the vocabulary-parallel log-prob equals the plain one, gradients included; families and head
counts it cannot split are refused.

The quick cases (llama's three plans, qwen3's exact plan, sampling, the log-prob) share one launch of 2 ranks; the
other families and the 4-rank combinations run under `make test-slow` (each over a minute of wall time on 2 cores)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import SAME_ORDER_F64, assert_close, masked, random_group, tiny_model
from helpers import grads as all_grads

from longstraw import backward_group
from longstraw.engine.sampling import SamplingConfig, sample_group

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("tp_worker", HERE / "tp_worker.py")
assert _spec is not None and _spec.loader is not None
tp_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tp_worker)  # the cases and the model both sides build
CASES, CP_CASES, FSDP_CASES, FSDP_GROUP_SEEDS = (tp_worker.CASES, tp_worker.CP_CASES, tp_worker.FSDP_CASES,
                                                 tp_worker.FSDP_GROUP_SEEDS)
QUICK_CASES, LOGPROB_SETTINGS = tp_worker.QUICK_CASES, tp_worker.LOGPROB_SETTINGS
PROMPT, RESPONSES, CHUNK, SAMPLING, tp_model = (tp_worker.PROMPT, tp_worker.RESPONSES, tp_worker.CHUNK,
                                                tp_worker.SAMPLING, tp_worker.tp_model)


def _launch(spawn, tmp_path, mode: str, world: int) -> list[dict]:
    out = tmp_path / mode
    for code, text in spawn([str(HERE / "tp_worker.py"), str(out), mode], world, timeout=600):
        assert code == 0, text
    return [torch.load(f"{out}.rank{r}") for r in range(world)]


def _single(family: str, plan: str, seed: int = 3):
    model = tp_model(family)
    result = backward_group(model, random_group(PROMPT, RESPONSES, seed=seed), plan=plan, chunk_size=CHUNK,
                            micro_batch=2)
    return all_grads(model), result


def _check(name: str, ref_grads, ref, got: dict) -> None:
    assert_close(f"{name} gradient", ref_grads, got["grads"], SAME_ORDER_F64)
    assert abs(got["loss"] - ref.loss) <= 1e-12 * max(1.0, abs(ref.loss))
    for a, b in zip(got["logprobs"], ref.logprobs):
        assert float((a - b).abs().max()) <= 1e-12


@pytest.fixture(scope="module")
def quick(spawn, tmp_path_factory) -> list[dict]:
    return _launch(spawn, tmp_path_factory.mktemp("tp"), "quick", 2)


def _check_cases(cases, saved: list[dict]) -> None:
    for family, plan in cases:
        ref_grads, ref = _single(family, plan)
        for rank, s in enumerate(saved):
            _check(f"{family} {plan} TP = 2 rank {rank}", ref_grads, ref, s[(family, plan)])
            if plan != "standard":
                assert s[(family, plan)]["state_bytes"] * 2 == ref.stats["prompt_state_bytes"]


def test_tensor_parallel_equals_one_process(quick):
    """TP = 2, float64: standard, detach and exact on llama (untied), exact on qwen3 (tied embeddings, per-head q/k
    norms); each rank's prompt state is half of one process's; sampling draws the same responses with the same
    log-probs on both ranks. qwen3 loaded by transformers with `DistributedConfig(tp_size=2)`: refused before any
    gradient is touched (transformers' q/k-norm hook would all-reduce the accumulated gradient after every backward),
    then equal to one process after `tp.adopt`."""
    _check_cases(QUICK_CASES, quick)
    ref_grads, ref = _single("qwen3", "exact")
    for rank, s in enumerate(quick):
        loaded = s["loaded"]
        assert "tp.adopt(model)" in loaded["refusal"] and loaded["untouched"]
        _check(f"qwen3 loaded with tp_size=2, adopted, rank {rank}", ref_grads, ref, loaded)
    saved = quick
    prompt = random_group(PROMPT, RESPONSES, seed=3).prompt
    rollout = sample_group(tp_model("llama"), prompt, 3, SamplingConfig(**SAMPLING), seed=5, chunk_size=CHUNK)
    for s in saved:
        assert all(torch.equal(a, b) for a, b in zip(s["sample"]["responses"], rollout.responses))
        for a, b in zip(s["sample"]["logprobs"], rollout.logprobs):
            assert float((a - b).abs().max()) <= 1e-12
        assert s["sample"]["state_bytes"] * 2 == rollout.state.nbytes()
        split, whole = s["trl_refusals"]  # the TRL drop-in refuses the split model, saying what to use instead
        assert len(split) == 1 and "longstraw train --tp" in split[0] and whole == []


@pytest.mark.slow
def test_tensor_parallel_other_families_equal_one_process(spawn, tmp_path):
    """TP = 2, float64, every plan: qwen3, mistral, qwen2 (q/k/v biases), qwen3_moe (routed experts) and gemma3
    (sliding windows), llama's standard_batched; llama's exact plan with per-layer checkpointing, the state offloaded,
    kept capture graphs, and loss masks."""
    saved = _launch(spawn, tmp_path, "tp", 2)
    _check_cases(CASES, saved)
    ref_grads, ref = _single("llama", "exact")  # every lever computes the same gradient as the plain exact plan
    for name, _ in tp_worker.LEVERS:
        for rank, s in enumerate(saved):
            _check(f"llama exact {name} TP = 2 rank {rank}", ref_grads, ref, s[name])
    model = tp_model("llama")
    group = masked(random_group(PROMPT, RESPONSES, seed=3))
    ref = backward_group(model, group, plan="exact", chunk_size=CHUNK, micro_batch=2)
    for rank, s in enumerate(saved):
        assert_close(f"llama exact masked TP = 2 rank {rank}", all_grads(model), s["masked"]["grads"], SAME_ORDER_F64)
        for a, b, m in zip(s["masked"]["logprobs"], ref.logprobs, group.loss_masks):
            assert bool(a[~m].isnan().all()) and float((a[m] - b[m]).abs().max()) <= 1e-12


def test_vocab_parallel_logprobs_equal_plain(quick):
    """The output projection split by vocabulary (51 rows as 26 + 25) against `naive_logprobs` on the whole weight,
    float64: log-probs and the gradients of the hidden states, the weight and the bias, with temperature, logit scale
    and soft-cap."""
    from longstraw.engine.logprobs import naive_logprobs

    for settings in LOGPROB_SETTINGS:
        temperature, scale, softcap, with_bias = settings
        hidden, weight, bias, targets, w = tp_worker.logprob_inputs()
        leaves = [t.requires_grad_(True) for t in (hidden, weight, bias)]
        logp = naive_logprobs(hidden, weight, targets, temperature, scale, softcap, bias if with_bias else None)
        (logp * w).sum().backward()
        for rank, s in enumerate(quick):
            got = s["logprobs"][settings]
            assert float((got["logp"] - logp.detach()).abs().max()) <= 1e-12, (settings, rank)
            assert_close(f"{settings} hidden gradient", leaves[0].grad, got["hidden"], SAME_ORDER_F64)
            assert_close(f"{settings} weight gradient", leaves[1].grad, got["weight"], SAME_ORDER_F64)
            if with_bias:
                assert_close(f"{settings} bias gradient", leaves[2].grad, got["bias"], SAME_ORDER_F64)


@pytest.mark.slow
def test_tensor_parallel_with_context_parallel_equals_one_process(spawn, tmp_path):
    """4 ranks: TP = 2 x cp = 2, float64, exact and detach; each rank holds a quarter of the K/V."""
    saved = _launch(spawn, tmp_path, "tp_cp", 4)
    for family, plan in CP_CASES:
        ref_grads, ref = _single(family, plan)
        for rank, s in enumerate(saved):
            _check(f"{family} {plan} TP = 2 x cp = 2 rank {rank}", ref_grads, ref, s[(family, plan)])
        # rank = c * 2 + t: a tensor-parallel rank t's context-parallel pair (t, t + 2) holds its heads once, split
        # 32 + 28 positions (8 chunks of 8, the last of 4, as 4 + 4 chunks)
        full = ref.stats["prompt_state_bytes"]
        for t in (0, 1):
            pair = [saved[t][(family, plan)]["state_bytes"], saved[t + 2][(family, plan)]["state_bytes"]]
            assert sum(pair) * 2 == full and pair[0] * 60 == full // 2 * 32


@pytest.mark.slow
def test_tensor_parallel_with_fsdp_equals_one_process(spawn, tmp_path):
    """4 ranks: FSDP2 over 2 data-parallel ranks x TP = 2 (a 2-D mesh), float64; data-parallel rank b backpropagates
    its own group, and the reduced gradient is the mean of one process's gradients of the two groups."""
    saved = _launch(spawn, tmp_path, "tp_fsdp", 4)
    for family, plan in FSDP_CASES:
        refs = [_single(family, plan, seed) for seed in FSDP_GROUP_SEEDS]
        mean = (refs[0][0] + refs[1][0]) / 2
        for rank, s in enumerate(saved):
            got = s[(family, plan)]
            assert_close(f"{family} {plan} FSDP2 x TP rank {rank} gradient", mean, got["grads"], SAME_ORDER_F64)
            ref = refs[rank // 2][1]  # ranks 2b and 2b + 1 are data-parallel rank b's tensor-parallel pair
            assert abs(got["loss"] - ref.loss) <= 1e-12 * max(1.0, abs(ref.loss))
            assert got["state_bytes"] * 2 == ref.stats["prompt_state_bytes"]


@pytest.mark.parametrize("family", ["qwen3_5_text", "deepseek_v3", "falcon_h1", "gemma3_mm"])
def test_tensor_parallel_refuses_unverified_families(family):
    from longstraw.distributed.tp import check_tensor_parallel

    with pytest.raises(ValueError, match="run it without --tp"):
        check_tensor_parallel(tiny_model(family, torch.float32), 2)


def test_tensor_parallel_refuses_split_heads():
    from longstraw.distributed.tp import check_tensor_parallel

    with pytest.raises(ValueError, match="1 key/value heads"):
        check_tensor_parallel(tiny_model("qwen3", torch.float32), 2)  # one key/value head cannot be split
    check_tensor_parallel(tiny_model("llama", torch.float32), 2)


def test_backward_group_refuses_a_tensor_parallel_model_of_an_unverified_family():
    """A model of a family LongStraw has not verified under tensor parallelism, hooked by transformers' plan, is
    refused before any gradient exists."""
    model = tiny_model("olmoe", torch.float32)
    model.model.layers[0].self_attn.q_proj._is_hooked = True  # the mark transformers' apply_tensor_parallelism sets
    with pytest.raises(ValueError, match="has not verified its tensor-parallel plan"):
        backward_group(model, random_group(PROMPT, RESPONSES, seed=3, dtype=torch.float32), plan="exact",
                       chunk_size=CHUNK)
    assert all(p.grad is None for p in model.parameters())
