"""Several processes (GPUs or CPU ranks) on top of `torch.distributed`: FSDP2 sharding, data parallelism over
prompt groups, launching with torchrun, and failure propagation.

- `fsdp.parallelize(model, mesh)`: `fully_shard` per decoder layer plus the root.
- `fsdp.sharded_compute(model)`: gather once, compute (different work per rank is fine), reduce once.
- `runtime.Parallel`: what the trainer needs (rank, data split, reductions of metrics), a no-op in one process.
- `runtime.end_process_group()`: leave the process group cleanly at the end of a script (after the trainer is gone).
- `launch.launch_train(argv, nproc)`: `longstraw train ... --nproc N` through torchrun's own launcher.

- `context.ContextParallel`: the prompt state split along the sequence over a group of ranks (`--cp`).
"""

from longstraw.distributed.fsdp import clip_grad_norm, full_tensor, parallelize, sharded_compute
from longstraw.distributed.runtime import end_process_group

__all__ = ["clip_grad_norm", "end_process_group", "full_tensor", "parallelize", "sharded_compute"]
