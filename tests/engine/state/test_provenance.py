"""A reused prompt state belongs to exactly these weights, buffers, module attributes, adapter state and config
(`engine/state/provenance.py`): each change a cheaper digest missed (a LoRA adapter disabled at capture, a sparse
embedding update, an edited embedding row, a rescaled RoPE buffer, a changed norm epsilon) is refused by name, and
the unchanged model (or the same values in new storage, as an FSDP re-gather gives) accepts its state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import _configs, faithful_float64, random_group, run_ranks
from transformers import AutoModelForCausalLM

from longstraw import backward_group
from longstraw.engine.sampling import SamplingConfig, sample_group, score_responses
from longstraw.engine.state.capture import capture_prompt
from longstraw.engine.state.provenance import mismatch, provenance

REFUSED = "prompt_state does not belong to this model"


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_configs()["llama"], attn_implementation="sdpa")
    return faithful_float64(model.to(torch.float64).eval())


def _refused(model: torch.nn.Module, state, match: str) -> None:
    """`backward_group` refuses `state` with a message matching `match`, before any gradient."""
    group = random_group(20, [3, 2])
    for p in model.parameters():
        p.grad = None
    with pytest.raises(ValueError, match=f"{REFUSED}.*{match}"):
        backward_group(model, group, plan="exact", chunk_size=8, prompt_state=state)
    assert all(p.grad is None for p in model.parameters())


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with a LoRA adapter on q and v whose B is not zero (so that the adapter changes the outputs)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                        init_lora_weights=False)
    return get_peft_model(model, config).to(torch.float64).eval()


def test_the_state_sample_group_captured_is_accepted_by_every_entry_point():
    """No false refusal: the unchanged model accepts the state sample_group captured, for scoring, sampling again and
    both replay plans' backward, and its provenance read twice is the same."""
    model, group = _llama(), random_group(20, [3, 2])
    rollout = sample_group(model, group.prompt, 2, SamplingConfig(max_new_tokens=3), chunk_size=8)
    assert mismatch(rollout.state.provenance, provenance(model)) is None
    scored = score_responses(model, group.prompt, rollout.responses, chunk_size=8, state=rollout.state)
    fresh = score_responses(model, group.prompt, rollout.responses, chunk_size=8)
    assert all(torch.equal(a, b) for a, b in zip(scored, fresh, strict=True))
    sample_group(model, group.prompt, 2, SamplingConfig(max_new_tokens=3), chunk_size=8, state=rollout.state)
    for plan in ("detach", "exact"):
        backward_group(model, group, plan=plan, chunk_size=8, prompt_state=rollout.state)
    assert mismatch(rollout.state.provenance, provenance(model)) is None


def test_the_same_values_in_new_storage_are_accepted():
    """What an FSDP re-gather or a reload of the same checkpoint does (new storage, moved version counters, the same
    values) is not a change: the state is accepted."""
    model = _llama()
    state = capture_prompt(model, random_group(20, [3, 2]).prompt[:-1], chunk_size=8)
    for param in model.parameters():
        param.data = param.data.clone()  # new storage, same values
    model.load_state_dict(model.state_dict())  # every version counter moves
    assert mismatch(state.provenance, provenance(model)) is None


def test_a_state_captured_with_the_adapter_disabled_is_refused_with_it_enabled():
    """A state captured under `disable_adapter()` (the reference model's) given to the policy (adapter enabled):
    refused, naming the adapter state; captured with the adapter enabled, accepted."""
    peft = _lora(_llama())
    policy, group = peft.get_base_model(), random_group(20, [3, 2])
    with peft.disable_adapter():
        reference_state = capture_prompt(policy, group.prompt[:-1], chunk_size=8)
    _refused(policy, reference_state, "captured in another adapter state.*disabled, active \\['default'\\].* vs "
                                      "enabled, active \\['default'\\]")
    backward_group(policy, group, plan="exact", chunk_size=8,
                   prompt_state=capture_prompt(policy, group.prompt[:-1], chunk_size=8))


def test_reference_logprobs_under_disable_adapter_refuse_the_policys_state():
    """Reference log-probs are scored under `disable_adapter()`: with the state captured there, accepted (and equal
    to scoring without a state); with the policy's state (adapter enabled), refused naming the adapter state."""
    peft = _lora(_llama())
    policy, group = peft.get_base_model(), random_group(20, [3, 2])
    rollout = sample_group(policy, group.prompt, 2, SamplingConfig(max_new_tokens=3), chunk_size=8)
    with peft.disable_adapter():
        reference_state = capture_prompt(policy, group.prompt[:-1], chunk_size=8)
        scored = score_responses(policy, group.prompt, rollout.responses, chunk_size=8, state=reference_state)
        fresh = score_responses(policy, group.prompt, rollout.responses, chunk_size=8)
        assert all(torch.equal(a, b) for a, b in zip(scored, fresh, strict=True))
        with pytest.raises(ValueError, match=f"{REFUSED}.*another adapter state"):
            score_responses(policy, group.prompt, rollout.responses, chunk_size=8, state=rollout.state)
    policy_logprobs = score_responses(policy, group.prompt, rollout.responses, chunk_size=8, state=rollout.state)
    assert max(float((a - b).abs().max()) for a, b in zip(policy_logprobs, fresh, strict=True)) > 1e-3  # it matters


def _sgd(params: list[torch.nn.Parameter]) -> None:
    torch.optim.SGD(params, lr=0.1).step()


def _adamw(params: list[torch.nn.Parameter]) -> None:
    torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0).step()


def _fused_adamw(params: list[torch.nn.Parameter]) -> None:
    torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=True).step()  # moves no version counter


@pytest.mark.parametrize("step", [_sgd, _adamw, _fused_adamw])
def test_a_sparse_embedding_update_is_refused(step):
    """Only the embeddings train: a step moves only the rows of the group's tokens (25 of 512), which 8 sampled values
    per tensor missed. Refused, naming the embedding."""
    model, group = _llama(), random_group(20, [3, 2])
    model.requires_grad_(False)
    embedding = model.get_input_embeddings().weight.requires_grad_(True)
    state = capture_prompt(model, group.prompt[:-1], chunk_size=8)
    backward_group(model, group, plan="exact", chunk_size=8, prompt_state=state)  # its own weights: accepted
    rows = int((embedding.grad.abs().sum(dim=1) > 0).sum())
    assert 0 < rows < embedding.shape[0] // 10  # sparse
    step([embedding])
    _refused(model, state, "captured with other weights.*parameter model.embed_tokens.weight differs")


@pytest.mark.parametrize("through_data", [False, True])
def test_an_edited_embedding_row_is_refused(through_data):
    """One embedding row edited in place, also through `.data` (which moves no version counter): refused."""
    model = _llama()
    state = capture_prompt(model, random_group(20, [3, 2]).prompt[:-1], chunk_size=8)
    weight = model.get_input_embeddings().weight
    if through_data:
        weight.data[7, 3] += 1e-12  # one value, one bit or so
    else:
        with torch.no_grad():
            weight[7] *= 1.5
    _refused(model, state, "captured with other weights.*parameter model.embed_tokens.weight differs")


def test_a_rescaled_rope_buffer_is_refused():
    model = _llama()
    state = capture_prompt(model, random_group(20, [3, 2]).prompt[:-1], chunk_size=8)
    model.model.rotary_emb.inv_freq.mul_(1.01)
    _refused(model, state, "captured with other buffer values.*buffer model.rotary_emb.inv_freq differs")


def test_a_changed_norm_epsilon_is_refused():
    """A module attribute the forward reads (RMSNorm's epsilon), not a tensor and not in the config: refused by name."""
    model = _llama()
    state = capture_prompt(model, random_group(20, [3, 2]).prompt[:-1], chunk_size=8)
    model.model.layers[0].input_layernorm.variance_epsilon = 1e-3
    _refused(model, state, "a module attribute differs: model.layers.0.input_layernorm.variance_epsilon 1e-06 "
                           "\\(state\\) vs 0.001 \\(model\\)")


def test_a_changed_config_entry_is_refused():
    model = _llama()
    state = capture_prompt(model, random_group(20, [3, 2]).prompt[:-1], chunk_size=8)
    model.config.rope_parameters["rope_theta"] = 20000.0
    _refused(model, state, "the model's config differs: rope_parameters.rope_theta 10000.0 \\(state\\) vs 20000.0")


def test_switches_that_change_no_value_are_not_refusals():
    """Training mode, gradient checkpointing, requires_grad and the config's output switches change no value the
    state holds: accepted."""
    model = _llama()
    state = capture_prompt(model, random_group(20, [3, 2]).prompt[:-1], chunk_size=8)
    model.train().eval()
    model.model.gradient_checkpointing = True
    model.config.use_cache = False
    model.get_input_embeddings().weight.requires_grad_(False)
    assert mismatch(state.provenance, provenance(model)) is None


class _Holder(torch.nn.Module):
    """One parameter and a config (what provenance reads)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.config = _configs()["llama"]
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 4), (6, 5), (7,)])
def test_the_checksum_sees_any_one_value_and_any_swap_but_not_where_the_tensor_lies(dtype, shape):
    """One value moved by one step of its dtype, two rows swapped, two values of a row swapped: each seen. The same
    values in a view at an unaligned offset of a flat buffer (as FSDP's gathered parameters are): the same checksum."""
    flat = torch.randn(1 + torch.Size(shape).numel(), dtype=torch.float64).to(dtype)
    values = flat[1:].view(shape)  # offset by one element: not 4-byte aligned for bfloat16
    base = provenance(_Holder(values.clone())).tensors
    assert provenance(_Holder(values)).tensors == base
    one = values.clone()
    one.view(-1)[3] = torch.nextafter(one.view(-1)[3], torch.tensor(float("inf"), dtype=dtype))
    assert provenance(_Holder(one)).tensors != base
    within = values.clone()
    within[..., [0, 1]] = within[..., [1, 0]]
    assert provenance(_Holder(within)).tensors != base
    if len(shape) > 1:
        rows = values.clone()
        rows[[0, 1]] = rows[[1, 0]]
        assert provenance(_Holder(rows)).tensors != base


# One FSDP2 rank (gloo): a state captured in one gathered block is reused in the next, after FSDP gathered the same
# weights again into new storage; then after a fused AdamW step on the sharded parameters. Prints JSON.
FSDP_CHILD = """
import json
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from helpers import random_group, tiny_model
from longstraw import backward_group
from longstraw.distributed.fsdp import parallelize, sharded_compute
from longstraw.engine.state.capture import capture_prompt

dist.init_process_group("gloo")
model = parallelize(tiny_model("llama"), init_device_mesh("cpu", (1,)))
group = random_group(20, [3, 2])
storages = lambda: [p.untyped_storage().data_ptr() for p in model.parameters()]
with sharded_compute(model, reduce=False):
    before = storages()
    state = capture_prompt(model, group.prompt[:-1], chunk_size=8)
seen = {}
with sharded_compute(model):
    seen["moved"] = sum(a != b for a, b in zip(before, storages()))
    backward_group(model, group, plan="exact", chunk_size=8, prompt_state=state)
    seen["regathered"] = "accepted"
torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True).step()
try:
    with sharded_compute(model):
        backward_group(model, group, plan="exact", chunk_size=8, prompt_state=state)
    seen["stepped"] = "accepted"
except ValueError as err:
    seen["stepped"] = str(err)
print(json.dumps(seen))
dist.destroy_process_group()
"""


def test_an_fsdp_regather_is_accepted_and_a_step_of_the_shards_refused(tmp_path):
    """FSDP2 gathers the same weights into new storage for each block: not a change, the state is accepted; a fused
    AdamW step of the sharded parameters is one: refused."""
    import longstraw

    child = tmp_path / "child.py"
    child.write_text(FSDP_CHILD)
    paths = [Path(__file__).resolve().parents[2], Path(longstraw.__file__).resolve().parents[1]]
    [(code, out)] = run_ranks([str(child)], world=1, timeout=120, paths=paths)
    assert code == 0, out[-2000:]
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["moved"] > 0  # the gathered parameters are in new storage: a storage-identity check would refuse
    assert seen["regathered"] == "accepted"
    assert REFUSED in seen["stepped"] and "captured with other weights" in seen["stepped"]
