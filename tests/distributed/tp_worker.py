"""One rank of the tensor-parallel tests: `backward_group` and sampling on a model split by heads with transformers'
plan (`distributed.tp.tensor_parallel`), alone or combined with context parallelism or FSDP2.

argv: OUT_PATH MODE. MODE "quick": every rank in one tensor-parallel group, the vocabulary-parallel log-prob on
LOGPROB_SETTINGS, QUICK_CASES, sampling, and qwen3 loaded by transformers itself with `DistributedConfig(tp_size=2)`
(refused until `tp.adopt`, then the exact plan). MODE "tp": the same group, the other families' CASES. MODE
"tp_cp": 4 ranks, TP = 2 x cp = 2, CP_CASES. MODE "tp_fsdp": 4 ranks, FSDP2 over 2 data-parallel ranks x TP = 2, each
data-parallel rank backpropagating its own group (FSDP_GROUP_SEEDS[dp]). Each rank saves its gathered (full-shape)
gradients, log-probs and prompt-state bytes to OUT_PATH.rank<r>.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from longstraw import backward_group
from longstraw.distributed.tp import adopt, tensor_parallel, tensor_parallel_layout
from longstraw.engine.sampling import SamplingConfig, sample_group

_spec = importlib.util.spec_from_file_location("tests_helpers", Path(__file__).parent.parent / "helpers.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)

PROMPT, RESPONSES, CHUNK = 61, [5, 1, 9], 8  # 60 encoded positions in 8 chunks
# (family, plan): full attention with and without tied embeddings, per-head q/k norms, routed experts, sliding windows
QUICK_CASES = [("llama", "standard"), ("llama", "detach"), ("llama", "exact"), ("qwen3", "exact")]
CASES = [(family, plan) for family in ("qwen3", "mistral", "qwen2", "qwen3_moe", "gemma3-A")
         for plan in ("standard", "detach", "exact") if (family, plan) not in QUICK_CASES]
CASES.append(("llama", "standard_batched"))
# llama's exact plan with each memory lever (per-layer checkpointing re-runs the collectives in the backward)
LEVERS = [("checkpoint", "layers"), ("offload_state", True), ("keep_prompt_graph", 2)]
CP_CASES = [("llama", "exact"), ("llama", "detach"), ("qwen3", "exact")]
FSDP_CASES = [("llama", "exact"), ("qwen3", "detach")]
FSDP_GROUP_SEEDS = (3, 4)
SAMPLING = dict(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0, stop_ids=())
# The vocabulary-parallel log-prob: V = 51 rows (26 + 25 on two ranks), N = 37 tokens in chunks of 8, and each of
# (temperature, logit_scale, softcap, bias)
LOGPROB_SHAPE = (37, 16, 51)
LOGPROB_SETTINGS = [(1.0, 1.0, None, False), (0.7, 0.5, 3.0, True), (1.3, 2.0, None, True)]


def full_gradients(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, gathered to its full shape and flattened in `model.parameters()` order (zeros
    where none): the single-process layout, for comparisons. A collective: every rank calls it."""
    parts = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append((g.full_tensor() if isinstance(g, DTensor) else g).flatten())
    return torch.cat(parts)


def logprob_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """hidden (N, d), weight (V, d), bias (V,), targets (N,) (every vocabulary row's owner hit), loss weights (N,)."""
    n, d, v = LOGPROB_SHAPE
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64)
    bias = torch.randn(v, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[:2] = torch.tensor([0, v - 1])
    return hidden, weight, bias, targets, torch.randn(n, generator=gen, dtype=torch.float64)


def run_logprobs(mesh) -> dict:
    """Each setting's log-probs and gradients (hidden, full weight, full bias) through a weight split by vocabulary."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from longstraw.engine.logprobs import chunked_logprobs

    out = {}
    for temperature, scale, softcap, with_bias in LOGPROB_SETTINGS:
        hidden, weight, bias, targets, w = logprob_inputs()
        hidden.requires_grad_(True)
        weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
        bias = torch.nn.Parameter(distribute_tensor(bias, mesh, [Shard(0)])) if with_bias else None
        logp = chunked_logprobs(hidden, weight, targets, 8, temperature, scale, softcap, bias)
        (logp * w).sum().backward()
        out[(temperature, scale, softcap, with_bias)] = {
            "logp": logp.detach(), "hidden": hidden.grad, "weight": weight.grad.full_tensor(),
            "bias": bias.grad.full_tensor() if bias is not None else None}
    return out


def tp_model(family: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """`helpers.tiny_model(family)` with at least 2 key/value heads (a rank of TP = 2 holds whole heads)."""
    config = helpers.tiny_config(family)
    if config.num_key_value_heads < 2:
        config.num_key_value_heads = 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    model = model.to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return helpers.faithful_float64(model) if dtype == torch.float64 else model


def _result(model, result) -> dict:
    return {"grads": full_gradients(model), "logprobs": result.logprobs, "loss": result.loss,
            "state_bytes": result.stats["prompt_state_bytes"]}


def run_tp(quick: bool) -> dict:
    mesh = tensor_parallel_layout("cpu", dist.get_world_size())[0]
    results = {}
    group = helpers.random_group(PROMPT, RESPONSES, seed=3)
    for family, plan in QUICK_CASES if quick else CASES:
        model = tensor_parallel(tp_model(family), mesh)
        result = backward_group(model, group, plan=plan, chunk_size=CHUNK, micro_batch=2)
        results[(family, plan)] = _result(model, result)
    if quick:
        results["loaded"] = run_loaded(group)
    if not quick:
        for name, value in LEVERS:
            model = tensor_parallel(tp_model("llama"), mesh)
            result = backward_group(model, group, plan="exact", chunk_size=CHUNK, micro_batch=2, **{name: value})
            results[name] = _result(model, result)
        model = tensor_parallel(tp_model("llama"), mesh)  # loss masks: the log-prob of the kept rows only
        result = backward_group(model, helpers.masked(group), plan="exact", chunk_size=CHUNK, micro_batch=2)
        results["masked"] = _result(model, result)
        return results
    results["logprobs"] = run_logprobs(mesh)
    model = tensor_parallel(tp_model("llama"), mesh)
    rollout = sample_group(model, group.prompt, 3, SamplingConfig(**SAMPLING), seed=5, chunk_size=CHUNK)
    results["sample"] = {"responses": rollout.responses, "logprobs": rollout.logprobs,
                         "state_bytes": rollout.state.nbytes()}
    from longstraw.integrations.trl_shared import tensor_parallel_refusals  # the drop-in's refusal of a split model

    results["trl_refusals"] = (tensor_parallel_refusals(model), tensor_parallel_refusals(tp_model("llama")))
    return results


def run_loaded(group) -> dict:
    """qwen3 saved by rank 0 and loaded by every rank with transformers' own tensor-parallel loading: backward_group
    refuses it (transformers' q/k-norm gradient hook) before touching a gradient; after `adopt`, the exact plan."""
    from transformers.distributed import DistributedConfig

    folder = Path(sys.argv[1] + ".qwen3")
    if dist.get_rank() == 0:
        tp_model("qwen3").save_pretrained(folder)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_size=2),
                                                 dtype=torch.float64, attn_implementation="sdpa").eval()
    for p in model.parameters():
        p.requires_grad_(True)
    try:
        backward_group(model, group, plan="exact", chunk_size=CHUNK, micro_batch=2)
        refusal = ""
    except ValueError as err:
        refusal = str(err)
    untouched = all(p.grad is None for p in model.parameters())
    helpers.faithful_float64(adopt(model))  # after adopt: both replace the norms' forward; its hook stays
    result = backward_group(model, group, plan="exact", chunk_size=CHUNK, micro_batch=2)
    return _result(model, result) | {"refusal": refusal, "untouched": untouched}


def run_tp_cp() -> dict:
    mesh, fsdp_mesh, context = tensor_parallel_layout("cpu", 2, cp=2)
    assert fsdp_mesh is not None and context is not None
    group = helpers.random_group(PROMPT, RESPONSES, seed=3)
    results = {}
    for family, plan in CP_CASES:
        model = tensor_parallel(tp_model(family), mesh)
        result = backward_group(model, group, plan=plan, chunk_size=CHUNK, micro_batch=2, context_shards=context)
        results[(family, plan)] = _result(model, result)
    return results


def run_tp_fsdp() -> dict:
    from longstraw.distributed.fsdp import parallelize, sharded_compute

    mesh, fsdp_mesh, _ = tensor_parallel_layout("cpu", 2)
    assert fsdp_mesh is not None
    group = helpers.random_group(PROMPT, RESPONSES, seed=FSDP_GROUP_SEEDS[fsdp_mesh.get_local_rank()])
    results = {}
    for family, plan in FSDP_CASES:
        model = parallelize(tensor_parallel(tp_model(family), mesh), fsdp_mesh)
        with sharded_compute(model):
            result = backward_group(model, group, plan=plan, chunk_size=CHUNK, micro_batch=2)
        results[(family, plan)] = _result(model, result)
    return results


def main() -> None:
    out_path, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    runs = {"quick": lambda: run_tp(True), "tp": lambda: run_tp(False), "tp_cp": run_tp_cp, "tp_fsdp": run_tp_fsdp}
    results = runs[mode]()
    torch.save(results, f"{out_path}.rank{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
