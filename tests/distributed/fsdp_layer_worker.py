"""One rank of the layer-wise FSDP2 test: `backward_group` under `sharded_compute(gather="layer")`, every rank in one
context-parallel group (so every rank runs the same forwards and backwards, as layer-wise gathering requires).

argv: OUT_PATH. Rank 0 saves, per case, the full gradient (float64), the most decoder layers gathered at once, how
many times layers were gathered and gradients reduce-scattered; then what the two refusals raised on this rank.
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from longstraw import backward_group
from longstraw.distributed import full_tensor, parallelize, sharded_compute
from longstraw.distributed.context import ContextParallel
from longstraw.distributed.fsdp import check_same_work
from longstraw.distributed.runtime import Parallel

_spec = importlib.util.spec_from_file_location("tests_helpers", Path(__file__).parent.parent / "helpers.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)

# (family, plan, checkpoint): full attention with both replay plans; qwen3's tied output projection with per-layer
# activation checkpointing (recomputes inside backward); a hybrid with recurrent layers.
CASES = [("llama", "exact", "none"), ("llama", "detach", "none"), ("qwen3", "exact", "layers"),
         ("qwen3_5_text", "exact", "none")]


def groups() -> list:
    """Two groups, prompts of 61 and 30 tokens (8-token capture chunks, not divisible by 2 ranks)."""
    return [helpers.random_group(61, [5, 1, 9], seed=3, dtype=torch.float64),
            helpers.random_group(30, [4, 7], seed=4, dtype=torch.float64)]


def main() -> None:
    out_path = sys.argv[1]
    par = Parallel.start("cpu")
    gathered: list[int] = []
    layer_groups: list[FSDPParamGroup] = []
    unshard = FSDPParamGroup.unshard

    def counting_unshard(self, *args, **kwargs):
        if self in layer_groups and not self.is_unsharded and self._all_gather_result is None:
            gathered.append(1 + sum(g.is_unsharded for g in layer_groups))  # layers held once this one arrives
        return unshard(self, *args, **kwargs)

    FSDPParamGroup.unshard = counting_unshard
    reduced: list[int] = []
    reduce_scatter = dist.reduce_scatter_single

    def counting_reduce_scatter(*args, **kwargs):
        reduced.append(1)
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counting_reduce_scatter  # FSDP2 reduces through this function
    results: dict = {}
    for family, plan, checkpoint in CASES:
        model = parallelize(helpers.tiny_model(family, torch.float64), par.mesh)
        states = model._get_fsdp_state()._state_ctx.all_states
        layer_groups[:] = [g for s in states if s is not model._get_fsdp_state() for g in s._fsdp_param_groups]
        gathered.clear()
        reduced.clear()
        with sharded_compute(model, gather="layer"):
            for g in groups():
                backward_group(model, g, plan=plan, chunk_size=8, micro_batch=2, context_shards=ContextParallel(),
                               checkpoint=checkpoint)
        results[(family, plan, checkpoint)] = {
            "grads": {n: full_tensor(p.grad) for n, p in model.named_parameters()},
            "most_layers_gathered": max(gathered), "layer_gathers": len(gathered), "reduce_scatters": len(reduced),
            "layers": model.config.num_hidden_layers,
        }
    # Different work on the two ranks: refused on both, before any layer is gathered.
    try:
        check_same_work((par.rank, 7))
        results["different work"] = None
    except RuntimeError as err:
        results["different work"] = str(err)
    # accelerate's FSDP2 layout: the embeddings in a unit of their own and [final norm, output projection] grouped in
    # another, beside the layers' and the root's.
    model = helpers.tiny_model("llama", torch.float64)
    for layer in model.model.layers:
        fully_shard(layer, mesh=par.mesh)
    fully_shard(model.model.embed_tokens, mesh=par.mesh)
    fully_shard([model.model.norm, model.lm_head], mesh=par.mesh, reshard_after_forward=False)
    fully_shard(model, mesh=par.mesh)
    with sharded_compute(model, gather="layer"):
        for g in groups():
            backward_group(model, g, plan="exact", chunk_size=8, micro_batch=2, context_shards=ContextParallel())
    results["accelerate layout"] = {n: full_tensor(p.grad) for n, p in model.named_parameters()}
    # Decoder layers that are not FSDP units: refused.
    model = helpers.tiny_model("llama", torch.float64)
    fully_shard(model, mesh=par.mesh)
    try:
        with sharded_compute(model, gather="layer"):
            pass
        results["unsharded layers"] = None
    except ValueError as err:
        results["unsharded layers"] = str(err)
    if par.rank == 0:
        torch.save(results, out_path)
    par.close()


if __name__ == "__main__":
    main()
