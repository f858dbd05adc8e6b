"""FSDP2 with 2 ranks equals one process on the same global batch: gradients of two steps and the weights
after two AdamW steps (float32, <= 1e-5 relative), for detach and exact, untied and tied output layers.
Each rank takes half of every step's groups (prompts of different lengths, so ranks do different work), so
summing the ranks' gradients instead of averaging them, or averaging twice, is off by 2x and fails here."""

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import FP32_RANKS, assert_close, rel_err, tiny_model

from longstraw import backward_group

WORKER = Path(__file__).parent / "fsdp_worker.py"
_spec = importlib.util.spec_from_file_location("fsdp_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([d[k].flatten() for k in sorted(d)])


def _single_process(family: str, plan: str, world: int) -> dict:
    """The reference: the worker's loop in this process, every group of each step, no sharding."""
    model = tiny_model(family, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=worker.LR, eps=worker.EPS)
    out: dict = {"grads": []}
    for step in range(worker.STEPS):
        groups = worker.global_batch(step, world)
        opt.zero_grad(set_to_none=True)
        for g in groups:
            backward_group(model, g, plan=plan, chunk_size=8, micro_batch=2)
        for p in model.parameters():
            p.grad.div_(len(groups))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


_RUNS: dict[int, dict] = {}


def _ranks(spawn, tmp_path_factory, world: int) -> dict:
    """Rank 0's results of the worker run with `world` ranks (run once per world size)."""
    if world not in _RUNS:
        out = tmp_path_factory.mktemp("fsdp") / "rank0.pt"
        for code, text in spawn([str(WORKER), str(out)], world=world, timeout=300):
            assert code == 0, text
        _RUNS[world] = torch.load(out, weights_only=False)
    return _RUNS[world]


@pytest.fixture
def two_ranks(spawn, tmp_path_factory):
    return _ranks(spawn, tmp_path_factory, 2)


def _check_equal_to_one_process(got: dict, family: str, plan: str, world: int) -> None:
    ref = _single_process(family, plan, world)
    for step in range(worker.STEPS):
        assert sorted(got["grads"][step]) == sorted(ref["grads"][step])
        assert_close(f"step {step + 1} gradient", _flat(ref["grads"][step]), _flat(got["grads"][step]), FP32_RANKS)
    start = _flat({n: p.detach() for n, p in tiny_model(family, torch.float32).named_parameters()})
    moved = rel_err(_flat(ref["weights"]), start)
    assert moved > 1e-3  # the two steps really changed the weights
    assert_close(f"weights after {worker.STEPS} steps", _flat(ref["weights"]), _flat(got["weights"]), FP32_RANKS)


@pytest.mark.parametrize("family,plan,checkpoint", worker.CASES)
def test_fsdp_two_ranks_equal_one_process(two_ranks, family, plan, checkpoint):
    """The one-process reference runs without checkpointing."""
    _check_equal_to_one_process(two_ranks[f"{family}/{plan}/{checkpoint}"], family, plan, world=2)


@pytest.mark.slow
@pytest.mark.parametrize("family,plan,checkpoint", worker.CASES)
def test_fsdp_three_ranks_equal_one_process(spawn, tmp_path_factory, family, plan, checkpoint):
    """3 ranks: parameters whose first dimension does not divide by 3 are sharded unevenly (FSDP pads)."""
    got = _ranks(spawn, tmp_path_factory, 3)[f"{family}/{plan}/{checkpoint}"]
    _check_equal_to_one_process(got, family, plan, world=3)
    assert got["reduce_calls"] == [got["units"]] * worker.STEPS


@pytest.mark.parametrize("family,plan,checkpoint", worker.CASES)
def test_gradients_are_reduced_once_per_step(two_ranks, family, plan, checkpoint):
    """One reduce-scatter per FSDP unit (each decoder layer + the root) per step, however many replays,
    micro-batches and prompt-backward chunks the step ran."""
    got = two_ranks[f"{family}/{plan}/{checkpoint}"]
    assert got["reduce_calls"] == [got["units"]] * worker.STEPS


LAYER_WORKER = Path(__file__).parent / "fsdp_layer_worker.py"
_layer_spec = importlib.util.spec_from_file_location("fsdp_layer_worker", LAYER_WORKER)
layer_worker = importlib.util.module_from_spec(_layer_spec)
_layer_spec.loader.exec_module(layer_worker)


@pytest.fixture(scope="module")
def layer_ranks(spawn, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-layer") / "rank0.pt"
    for code, text in spawn([str(LAYER_WORKER), str(out)], world=2, timeout=300):
        assert code == 0, text
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("family,plan,checkpoint", layer_worker.CASES)
def test_layer_wise_gathering_equals_one_process(layer_ranks, family, plan, checkpoint):
    """gather="layer" on 2 ranks forming one context-parallel group, float64: the reduced gradient equals one
    process's (<= 1e-12), with at most two decoder layers gathered at a time (the one computing and the one FSDP
    prefetches in backward) and the layers' gradients reduce-scattered after each backward (many more reductions
    than layers), where gather="all" reduces once per unit."""
    got = layer_ranks[(family, plan, checkpoint)]
    model = tiny_model(family, torch.float64)
    for g in layer_worker.groups():
        backward_group(model, g, plan=plan, chunk_size=8, micro_batch=2)
    ref = {n: p.grad for n, p in model.named_parameters()}
    assert sorted(got["grads"]) == sorted(ref)
    assert_close(f"{family}/{plan} gradient", _flat(ref), _flat(got["grads"]), 1e-12)
    assert got["layers"] >= 2 and got["most_layers_gathered"] <= 2
    assert got["layer_gathers"] > 2 * got["layers"]  # each layer gathered again for every forward and backward
    assert got["reduce_scatters"] > 2 * (got["layers"] + 1)


def test_layer_wise_gathering_in_accelerates_layout(layer_ranks):
    """accelerate's FSDP2 units (the embeddings alone; final norm and output projection grouped) besides the layers':
    the same gradient as one process."""
    model = tiny_model("llama", torch.float64)
    for g in layer_worker.groups():
        backward_group(model, g, plan="exact", chunk_size=8, micro_batch=2)
    assert_close("gradient", _flat({n: p.grad for n, p in model.named_parameters()}),
                 _flat(layer_ranks["accelerate layout"]), 1e-12)


def test_layer_wise_gathering_refusals(layer_ranks):
    """Ranks about to run different work are refused on every rank (their layers' all-gathers would pair up
    wrongly), and so are decoder layers that are not FSDP units."""
    assert "every process to run the same forwards and backwards" in layer_ranks["different work"]
    assert "no decoder layer is one: apply fully_shard to each decoder layer" in layer_ranks["unsharded layers"]
