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
from longstraw.api.tree import backward_tree
from longstraw.engine.options import BackwardOptions
from longstraw.engine.pad import pad
from longstraw.engine.tree.build import Trajectory

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


def _trajectories() -> list[Trajectory]:
    """A two-level tree: two tasks after one shared system prompt (12 tokens), each with 2–3 responses; one response
    is a prefix of another (it ends inside the tree, at a node with a child), and two trajectories share a first
    response token; each trajectory its own group."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, 64, (12,), generator=g)
    tasks = [torch.randint(0, 64, (n,), generator=g) for n in (7, 5)]
    responses = [[torch.randint(0, 64, (n,), generator=g) for n in (4, 6, 3)],
                 [torch.randint(0, 64, (n,), generator=g) for n in (5, 2)]]
    responses[0][1][0] = responses[0][0][0]  # a shared first response token
    responses[1].append(torch.cat([responses[1][0], torch.randint(0, 64, (3,), generator=g)]))  # continues row 0
    out = []
    for task, rows in zip(tasks, responses):
        for r in rows:
            prompt = torch.cat([system, task])
            out.append(Trajectory(ids=torch.cat([prompt, r]), loss_start=prompt.numel(),
                                  advantage=float(torch.randn((), generator=g)), group=len(out)))
    return out


@pytest.mark.parametrize("plan", ["standard", "exact"])
def test_a_tree_of_two_tasks_equals_transformers_over_its_rows(faithful_routers, plan):
    """backward_tree with the router term on a two-level tree (float64 routers): the gradient is the standard plan's
    policy gradient plus autograd through transformers' aux loss over the tree's trajectories as right-padded rows
    (every token counted once per row holding it), ≤ 1e-12; its value within float32 sums' reassociation."""
    family = "qwen3_moe"
    model, coef = _model(family), COEF[family]
    trajectories = _trajectories()
    model.zero_grad()
    backward_tree(model, trajectories, plan="standard")
    ids, mask = pad([t.ids for t in trajectories])
    aux = model(input_ids=ids, attention_mask=mask.long(), output_router_logits=True, use_cache=False).aux_loss
    (coef * aux).backward()
    ref = grads(model)
    model.zero_grad()
    result = backward_tree(model, trajectories, plan=plan, chunk_size=4, micro_batch=2, router_aux_coef=coef)
    print(f"{plan} tree: gradient {assert_close('gradient', ref, grads(model), EXACT_F64 / 100):.2g}; "
          f"{result.stats['tree_depth']} levels")
    assert result.stats["tree_depth"] >= 3
    assert abs(result.stats["router_aux_loss"] - float(aux.detach())) <= 1e-6 * float(aux.detach())


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
    with pytest.raises(ValueError, match="all the same sequence"):
        model = _model("qwen3_moe")
        twice = [Trajectory(ids=torch.arange(9), loss_start=4, advantage=1.0, group=k) for k in range(2)]
        backward_tree(model, twice, router_aux_coef=0.01)


def _packed_aux(model, trajectories) -> torch.Tensor:
    """transformers' aux loss over one forward of the trajectories' prefix trie, a trie position being a token with
    its prefix and its next token (or the end), as TRL's packed rows key it: each trajectory run on its own, and the
    router logits of each trie position taken once (a position's logits depend on its prefix only)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    seen: set[tuple[tuple[int, ...], int | None]] = set()
    layers: list[list[torch.Tensor]] = []
    for t in trajectories:
        ids = t.ids.tolist()
        out = model(input_ids=t.ids[None], output_router_logits=True, use_cache=False)
        keep = []
        for d in range(len(ids)):
            key = (tuple(ids[:d + 1]), ids[d + 1] if d + 1 < len(ids) else None)
            if key not in seen:
                seen.add(key)
                keep.append(d)
        layers = layers or [[] for _ in out.router_logits]
        for parts, logits in zip(layers, out.router_logits):
            parts.append(logits.reshape(len(ids), -1)[keep])
    config = model.config
    return load_balancing_loss_func(tuple(torch.cat(p) for p in layers), config.num_experts,
                                    config.num_experts_per_tok, None)


@pytest.mark.parametrize("min_shared", [1, 3])
def test_packed_count_equals_transformers_over_the_trie(faithful_routers, min_shared):
    """router_count='packed' (TRL's asynchronous trainer: one packed forward of the trie): the gradient is the policy
    gradient plus autograd through transformers' aux loss over the trie's positions, each once, ≤ 1e-12, on a tree
    with a trajectory ending inside it and a shared first response token; min_shared 3 runs the shorter shared runs
    once per branch, whose weights split the position's one count."""
    family = "qwen3_moe"
    model, coef = _model(family), COEF[family]
    trajectories = _trajectories()
    model.zero_grad()
    backward_tree(model, trajectories, plan="standard")
    aux = _packed_aux(model, trajectories)
    (coef * aux).backward()
    ref = grads(model)
    model.zero_grad()
    result = backward_tree(model, trajectories, plan="exact", chunk_size=4, micro_batch=2, router_aux_coef=coef,
                           router_count="packed", min_shared=min_shared)
    print(f"min_shared {min_shared}: gradient {assert_close('gradient', ref, grads(model), EXACT_F64 / 100):.2g}")
    assert abs(result.stats["router_aux_loss"] - float(aux.detach())) <= 1e-6 * float(aux.detach())
    model.zero_grad()  # the count per sequence is another loss: the comparison tells them apart
    backward_tree(model, trajectories, plan="exact", router_aux_coef=coef, min_shared=min_shared)
    assert rel_err(ref, grads(model)) > 1e-6
    with pytest.raises(ValueError, match="router_count='packed' weighs the runs of the tree walk"):
        BackwardOptions(plan="standard", router_count="packed")
