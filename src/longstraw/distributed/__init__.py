"""Several processes (GPUs or CPU ranks) on top of `torch.distributed`: FSDP2 sharding, data parallelism over
prompt groups, launching with torchrun, and failure propagation.

- `fsdp.parallelize(model, mesh)`: `fully_shard` per decoder layer plus the root.
- `fsdp.sharded_compute(model)`: gather once, compute (different work per rank is fine), reduce once.
- `runtime.Parallel`: what the trainer needs (rank, data split, reductions of metrics), a no-op in one process.
- `launch.launch_train(argv, nproc)`: `longstraw train ... --nproc N` through torchrun's own launcher.

- `context.ContextParallel`: the prompt state split along the sequence over a group of ranks (`--cp`).
"""

from longstraw.distributed.fsdp import clip_grad_norm, full_tensor, parallelize, sharded_compute

__all__ = ["clip_grad_norm", "full_tensor", "parallelize", "sharded_compute"]
