"""The MoE router load-balancing term (`BackwardOptions.router_aux_coef`, engine/router.py) against transformers'
own: the group's policy loss (the standard plan without the term) plus router_aux_coef times the `aux_loss` that
transformers' causal LM returns with output_router_logits=True on the group's G right-padded sequences
[prompt ; o_i] (the attention mask weighing each token), backpropagated by autograd: gradient and value.

float64. Qwen3-MoE's, Mixtral's, Qwen2-MoE's and OLMoE's routers compute their softmax in float32 inside the float64
model, and its backward casts the gradient reaching it to float32: one backward of policy + term (ours) rounds there
what transformers' two backwards (policy, then aux) round separately, ~1e-6 of the term's share (FP32_INSIDE tolerance,
1e-6). With the routers' softmax in float64 (`router_helpers`, as `faithful_float64` does for the norms) the same
comparisons hold to 1e-12: the term itself (the counts and transformers' float32 weight vector) is exact.
"""

from __future__ import annotations

import pytest
import torch
from helpers import EXACT_F64, assert_close, gradient_tolerance, grads, random_group, rel_err, tiny_model
from router_helpers import patch_routers

from longstraw import backward_group
from longstraw.api.group import RouterBatch, router_counts
from longstraw.engine.options import BackwardOptions
from longstraw.engine.pad import pad
from longstraw.engine.router import aux_value

# the released configs' values (gpt-oss-20b: 0.9)
COEF = {"qwen3_moe": 0.001, "mixtral": 0.02, "qwen2_moe": 0.001, "olmoe": 0.01, "gpt_oss": 0.9}
_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture
def faithful_routers(monkeypatch):
    patch_routers(monkeypatch)


def _model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


def _transformers_aux(model, group) -> torch.Tensor:
    """transformers' aux_loss over the group's G sequences, right-padded, with their attention mask."""
    targets, mask = pad(group.responses)
    p = group.prompt.numel()
    ids = torch.cat([group.prompt.expand(group.size, p), targets], dim=1)
    attention = torch.cat([torch.ones(group.size, p, dtype=torch.long), mask.long()], dim=1)
    return model(input_ids=ids, attention_mask=attention, output_router_logits=True, use_cache=False).aux_loss


def _reference(model, group, coef):
    """(gradient, aux value): the standard plan's policy gradient plus autograd through coef * transformers' aux."""
    model.zero_grad()
    backward_group(model, group, plan="standard")
    aux = _transformers_aux(model, group)
    (coef * aux).backward()
    return grads(model), float(aux.detach())


CASES = {  # plan, chunk_size, micro_batch, checkpoint
    "standard": ("standard", 2048, 1, "none"),
    "exact-chunked": ("exact", 16, 1, "none"),
    "exact-micro-batch-checkpointed": ("exact", 2048, 2, "layers"),
}


@pytest.mark.parametrize("family,routers,case", [
    ("qwen3_moe", "float64", "standard"), ("qwen3_moe", "float64", "exact-chunked"),
    ("qwen3_moe", "float64", "exact-micro-batch-checkpointed"), ("mixtral", "float64", "exact-chunked"),
    ("qwen3_moe", "transformers", "exact-chunked"), ("mixtral", "transformers", "exact-micro-batch-checkpointed"),
    ("gpt_oss", "transformers", "exact-chunked"),
])
def test_router_term_equals_transformers_aux_loss(request, family, routers, case):
    plan, chunk, micro_batch, checkpoint = CASES[case]
    if routers == "float64":
        request.getfixturevalue("faithful_routers")
    model = _model(family)
    group = random_group(37, [5, 9, 3, 7], seed=1)
    ref, aux = _reference(model, group, COEF[family])
    model.zero_grad()
    result = backward_group(model, group, plan=plan, chunk_size=chunk, micro_batch=micro_batch,
                            checkpoint=checkpoint, router_aux_coef=COEF[family])
    # gpt-oss's router has no float32 softmax (top-k of the logits, then a softmax in their dtype)
    tol = EXACT_F64 / 100 if routers == "float64" or family == "gpt_oss" else gradient_tolerance(family)
    err = assert_close("gradient", ref, grads(model), tol)
    value = result.stats["router_aux_loss"]
    print(f"{family} {plan} {routers} routers: gradient {err:.2g}, aux {value} vs transformers {aux} "
          f"({abs(value - aux) / aux:.2g})")
    assert abs(value - aux) <= 1e-6 * aux  # float32 sums in another order
    model.zero_grad()
    backward_group(model, group, plan=plan, chunk_size=chunk, micro_batch=micro_batch, checkpoint=checkpoint)
    assert rel_err(ref, grads(model)) > 1e2 * gradient_tolerance(family)  # the term is not negligible here


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_router_term_other_families(family):
    model = _model(family)
    group = random_group(21, [4, 6, 2], seed=2)
    ref, _ = _reference(model, group, COEF[family])
    model.zero_grad()
    backward_group(model, group, plan="exact", chunk_size=8, router_aux_coef=COEF[family])
    print(f"{family}: gradient {assert_close('gradient', ref, grads(model), gradient_tolerance(family)):.2g}")


def test_a_batch_of_two_groups_with_a_dropped_completion(faithful_routers):
    """Two groups taken as one batch (`RouterBatch`: counts summed over both), the first holding its prompt in one
    more sequence than it replays (a completion masked out of the loss and of the attention, as TRL's
    mask_truncated_completions does: its prompt still runs); float64 routers, so 1e-12."""
    family = "qwen3_moe"
    model, coef = _model(family), COEF[family]
    a, b = random_group(19, [5, 3, 6], seed=3), random_group(19, [4, 7, 2, 5], seed=4)
    dropped = torch.zeros(0, dtype=torch.long)  # a 4th sequence of a's prompt, its completion masked out
    model.zero_grad()
    backward_group(model, a, plan="standard")
    backward_group(model, b, plan="standard")
    rows = [(a.prompt, r) for r in [*a.responses, dropped]] + [(b.prompt, r) for r in b.responses]
    ids, mask = pad([torch.cat([p, r]) for p, r in rows])
    aux = model(input_ids=ids, attention_mask=mask.long(), output_router_logits=True, use_cache=False).aux_loss
    (coef * aux).backward()
    ref = grads(model)
    options = BackwardOptions(plan="exact", chunk_size=8, router_aux_coef=coef)
    counts = router_counts(model, a, options, prompt_copies=4) + router_counts(model, b, options)
    model.zero_grad()
    ra = backward_group(model, a, options, router_batch=RouterBatch(counts, prompt_copies=4))
    rb = backward_group(model, b, options, router_batch=RouterBatch(counts))
    print(f"two groups: gradient {assert_close('gradient', ref, grads(model), EXACT_F64 / 100):.2g}")
    assert ra.router_probs is not None and rb.router_probs is not None
    value = aux_value(counts, ra.router_probs + rb.router_probs)
    assert abs(value - float(aux)) <= 1e-6 * float(aux)


def test_detach_leaves_the_prompt_share_out():
    model = _model("qwen3_moe")
    group = random_group(37, [5, 9, 3, 7], seed=1)
    ref, _ = _reference(model, group, 1.0)
    model.zero_grad()
    backward_group(model, group, plan="detach", router_aux_coef=1.0)
    assert rel_err(ref, grads(model)) > 1e-3


def test_refusals():
    with pytest.raises(ValueError, match="router_aux_coef must be a finite number >= 0"):
        BackwardOptions(router_aux_coef=-1.0)
    with pytest.raises(ValueError, match="pass keep_prompt_graph=0"):
        BackwardOptions(router_aux_coef=0.01, keep_prompt_graph=1)
    llama = tiny_model("llama")
    with pytest.raises(ValueError, match="llama has none: set router_aux_coef=0"):
        backward_group(llama, random_group(9, [3, 4]), router_aux_coef=0.01)
    with pytest.raises(ValueError, match="router_batch is the batch of the router load-balancing loss, which is off"):
        model = _model("qwen3_moe")
        group = random_group(9, [3, 4])
        backward_group(model, group, router_batch=RouterBatch(router_counts(model, group)))
