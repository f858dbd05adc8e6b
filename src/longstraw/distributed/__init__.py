"""Several processes (GPUs or CPU ranks) on top of `torch.distributed` (docs/distributed.md).

- `fsdp`: `parallelize(model, mesh)` shards each decoder layer plus the root with FSDP2; `sharded_compute(model)`
  gathers once, computes (different work per rank is fine) and reduces once.
- `runtime.Parallel`: what the trainer needs (rank, data split, reductions of metrics), a no-op in one process;
  `runtime.end_process_group()` leaves the process group cleanly at the end of a script (after the trainer is gone).
- `launch.launch_train(argv, nproc)`: `longstraw train ... --nproc N` through torchrun's own launcher.
- `context.ContextParallel` (`--cp`) and `tp` (`--tp`): the prompt state split along the sequence, or by heads."""

from longstraw.distributed.fsdp import clip_grad_norm, full_tensor, parallelize, sharded_compute
from longstraw.distributed.runtime import end_process_group

__all__ = ["clip_grad_norm", "end_process_group", "full_tensor", "parallelize", "sharded_compute"]
