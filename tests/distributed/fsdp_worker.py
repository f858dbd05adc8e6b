"""One rank of the FSDP2 test: two AdamW steps of `backward_group` on this rank's share of a global batch.

argv: OUT_PATH. Every rank runs the same code; rank 0 saves, per (family, plan), the full gradient of each
step, the full weights after the two steps and how many reduce-scatters each step issued.
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw import backward_group
from longstraw.distributed import full_tensor, parallelize, sharded_compute
from longstraw.distributed.runtime import Parallel

_spec = importlib.util.spec_from_file_location("tests_helpers", Path(__file__).parent.parent / "helpers.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)

# (family, plan, checkpoint). qwen3: tied lm_head / embeddings; "layers": per-layer activation checkpointing,
# whose recomputes run while FSDP2's pre-backward hook holds the layer gathered.
CASES = [("llama", "detach", "none"), ("llama", "exact", "none"), ("qwen3", "exact", "none"),
         ("llama", "exact", "layers"), ("qwen3", "detach", "layers")]
STEPS, GROUPS_PER_RANK, LR, EPS = 2, 2, 1e-2, 1e-6
# EPS: AdamW divides by sqrt(v) + eps; with the default 1e-8, entries whose gradient is ~0 move by +-lr on
# float32 noise alone, which would measure the rounding of near-zero gradients, not the reduction.


def global_batch(step: int, world: int) -> list:
    """GROUPS_PER_RANK groups per rank, of different prompt lengths (ranks do different amounts of work, in
    different numbers of prompt chunks) and response lengths."""
    return [helpers.random_group(20 + 7 * i + step, [4 + i, 6, 3], seed=100 * step + i, dtype=torch.float32)
            for i in range(GROUPS_PER_RANK * world)]


def main() -> None:
    out_path = sys.argv[1]
    par = Parallel.start("cpu")
    rank, world = par.rank, par.world_size
    calls = []
    original = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counting  # FSDP2 reduces through this function
    results = {}
    for family, plan, checkpoint in CASES:
        model = parallelize(helpers.tiny_model(family, torch.float32), par.mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        record = {"grads": [], "reduce_calls": []}
        for step in range(STEPS):
            groups = global_batch(step, world)
            mine = [groups[i] for i in par.share(len(groups), "groups")]
            opt.zero_grad(set_to_none=True)
            calls.clear()
            with sharded_compute(model):
                for g in mine:
                    backward_group(model, g, plan=plan, chunk_size=8, micro_batch=2, checkpoint=checkpoint)
            record["reduce_calls"].append(len(calls))
            for p in model.parameters():  # FSDP averaged the ranks' sums: make it the mean over all groups
                p.grad.div_(len(groups) / world)
            record["grads"].append({n: full_tensor(p.grad) for n, p in model.named_parameters()})
            opt.step()
        record["weights"] = {n: full_tensor(p.detach()) for n, p in model.named_parameters()}
        record["units"] = 1 + model.config.num_hidden_layers
        results[f"{family}/{plan}/{checkpoint}"] = record
    if rank == 0:
        torch.save(results, out_path)
    par.close()


if __name__ == "__main__":
    main()
