"""One rank of a gloo group (one process by default; torch.distributed's environment for more): each case's actor
update through verl's TrainingWorker with verl's engine and with LongStraw's (`verl_setup.run_update`), saved by
rank 0 for test_verl.py. argv: OUT.pt, JSON {case: spec}; a spec holds the model family, verl's actor settings, the
batch options, and `refused` for a case LongStraw must refuse (then only its error message and whether any
gradient was left behind are saved). Each rank makes its own share of the batch (another seed)."""

from __future__ import annotations

import json
import os
import sys
import tempfile

from verl_setup import make_batch, run_update, save_tiny_model  # first: it puts verl on the CPU

# isort: split
import torch
import torch.distributed as dist
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from longstraw.integrations.verl import LongStrawFSDPEngine


def main() -> None:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    models: dict[str, str] = {}
    results: dict[str, dict] = {}
    for name, spec in cases.items():
        family = spec["family"]
        if family not in models:
            models[family] = tempfile.mkdtemp(prefix=f"verl-{family}-")
            save_tiny_model(family, models[family])  # seeded: every rank saves the same weights
        options = spec.get("batch", {})
        batch = make_batch(**options | {"seed": options.get("seed", 0) + 1000 * rank})  # this rank's share
        if spec.get("refused"):
            left: list[bool] = []
            try:
                run_update(_Watched.of(left), models[family], batch, spec["actor"])
                results[name] = {"error": None}
            except ValueError as err:
                results[name] = {"error": str(err), "gradients_left": any(left)}
            continue
        results[name] = {who: run_update(engine, models[family], batch, spec["actor"], **spec.get("update", {}))
                         for who, engine in (("verl", FSDPEngineWithLMHead), ("longstraw", LongStrawFSDPEngine))}
        print(f"{name}: done", flush=True)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


class _Watched(LongStrawFSDPEngine):
    """LongStraw's engine recording, when its update raises, whether any parameter holds a gradient."""

    left: list[bool]

    @classmethod
    def of(cls, left: list[bool]) -> type:
        return type("Watched", (cls,), {"left": left})

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        try:
            return super().forward_backward_batch(data, loss_function, forward_only)
        except ValueError:
            self.left.append(any(p.grad is not None for p in self.module.parameters()))
            raise


if __name__ == "__main__":
    main()
