"""One rank of a two-process run of `LongStrawAsyncGRPOTrainer` (torchrun's environment, gloo, ACCELERATE_USE_CPU=1:
accelerate's MULTI_CPU). argv: MODEL_DIR OUT_DIR CONFIG_JSON (LongStrawAsyncGRPOConfig overrides). Trains on
trl_async_setup's scripted samples (rank 0 holds the queue, as TRL's trainer has it); rank 0 saves each optimizer
step's gradient and the parameters after to OUT_DIR/steps.pt, every rank its final parameters to
OUT_DIR/params-RANK.pt."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from trl_async_setup import SETTINGS, samples, train_ours

from longstraw.distributed import end_process_group


def main() -> None:
    model_dir, out, config = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    count = SETTINGS["per_device_train_batch_size"] * 2 * (SETTINGS["gradient_accumulation_steps"] *
                                                           SETTINGS["max_steps"] + 1)
    steps, params = train_ours(model_dir, samples(count), str(out / "run"), **config)
    torch.save(params, out / f"params-{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        torch.save({"steps": steps, "params": params, "world": dist.get_world_size()}, out / "steps.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
    end_process_group()
