"""One rank of the tensor-parallel tests: `backward_group` and sampling on a model split by heads with transformers'
plan (`distributed.tp.tensor_parallel`), alone or combined with context parallelism or FSDP2.

argv: OUT_PATH MODE. MODE "tp": every rank in one tensor-parallel group, every case of CASES plus sampling. MODE
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
from transformers import AutoModelForCausalLM

from longstraw import backward_group
from longstraw.engine.sampling import SamplingConfig, sample_group
from longstraw.distributed.tp import full_gradients, tensor_parallel, tensor_parallel_layout

_spec = importlib.util.spec_from_file_location("tests_helpers", Path(__file__).parent.parent / "helpers.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)

PROMPT, RESPONSES, CHUNK = 61, [5, 1, 9], 8  # 60 encoded positions in 8 chunks
# (family, plan): full attention with and without tied embeddings, per-head q/k norms, routed experts, sliding windows
CASES = [(family, plan) for family in ("llama", "qwen3", "mistral", "qwen3_moe", "gemma3-A")
         for plan in ("standard", "detach", "exact")]
CP_CASES = [("llama", "exact"), ("llama", "detach"), ("qwen3", "exact")]
FSDP_CASES = [("llama", "exact"), ("qwen3", "detach")]
FSDP_GROUP_SEEDS = (3, 4)
SAMPLING = dict(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0, stop_ids=())


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


def run_tp() -> dict:
    mesh = tensor_parallel_layout("cpu", dist.get_world_size())[0]
    results = {}
    group = helpers.random_group(PROMPT, RESPONSES, seed=3)
    for family, plan in CASES:
        model = tensor_parallel(tp_model(family), mesh)
        result = backward_group(model, group, plan=plan, chunk_size=CHUNK, micro_batch=2)
        results[(family, plan)] = _result(model, result)
    model = tensor_parallel(tp_model("llama"), mesh)
    rollout = sample_group(model, group.prompt, 3, SamplingConfig(**SAMPLING), seed=5, chunk_size=CHUNK)
    results["sample"] = {"responses": rollout.responses, "logprobs": rollout.logprobs,
                         "state_bytes": rollout.state.nbytes()}
    return results


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
    results = {"tp": run_tp, "tp_cp": run_tp_cp, "tp_fsdp": run_tp_fsdp}[mode]()
    torch.save(results, f"{out_path}.rank{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
