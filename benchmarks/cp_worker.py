"""One rank of `python -m benchmarks cp`: `python -m benchmarks.cp_worker '<json config>' OUT_PATH`.

Launched C x T times with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) by `benchmarks/cp.py`.
Every rank loads the same model and group, splits it by heads over T ranks with transformers' tensor-parallel plan
when T > 1 (`distributed/tp.py`), runs one `backward_group` with the prompt state sharded over the C ranks of its
context-parallel group (C = 1: no context parallelism), and writes its own measurement — peak memory as in
docs/design.md §5 (VmHWM minus VmRSS before the step), step time, prompt-state bytes held — to OUT_PATH.rank<r> as
JSON.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import torch.distributed as dist

from benchmarks.common import load_bench_model
from benchmarks.launch import worker_args
from benchmarks.worker import make_group
from longstraw import backward_group
from longstraw.distributed.context import ContextParallel
from longstraw.distributed.tp import tensor_parallel, tensor_parallel_layout
from longstraw.peak import PeakMemory


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "python -m benchmarks.cp_worker '<json config>' OUT_PATH", 2)
    if args is None:
        return 2
    config, out_path = json.loads(args[0]), args[1]
    cp, tp = int(config["cp"]), int(config.get("tp", 1))
    world = cp * tp
    if world > 1:
        dist.init_process_group("gloo")
    model = load_bench_model(config["model"], config["dtype"])
    context = ContextParallel() if world > 1 else None
    if tp > 1:  # rank = c * T + t: a tensor-parallel group of T consecutive ranks, context parallelism across them
        tp_mesh, _, context = tensor_parallel_layout("cpu", tp, cp)
        model = tensor_parallel(model, tp_mesh)
    group = make_group(model.config.vocab_size, config["prompt_tokens"], config["response_tokens"],
                       config["group_size"], config["seed"])
    gc.collect()
    meter = PeakMemory("cpu")
    meter.start()
    t0 = time.perf_counter()
    result = backward_group(model, group, plan=config["plan"], chunk_size=config["chunk_size"],
                            context_shards=context)
    step_s = time.perf_counter() - t0
    rank = dist.get_rank() if world > 1 else 0
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"rank": rank, "peak_bytes": meter.peak_bytes(), "time_s": step_s,
                   "prompt_state_bytes": result.stats["prompt_state_bytes"]}, f)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
