"""One rank of a multi-process TRL run (torchrun, gloo, ACCELERATE_USE_CPU=1: accelerate's MULTI_CPU; a case with
`fsdp=True` shards the model with FSDP2; cases with `zero_stage` run DeepSpeed, launched without ACCELERATE_USE_CPU).

argv: MODEL_DIR OUT_DIR CASES_JSON. For every case (a name and GRPOConfig overrides), `trl.GRPOTrainer` and
`LongStrawGRPOTrainer` each train from the saved float64 model on the same fixed completions (trl_setup.py); rank 0
saves each optimizer step's gradient and the parameters after (whole tensors), and whether the run was sharded, per
case and trainer, to OUT_DIR/<case>-<trainer>.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import trl.trainer.utils
from trl import GRPOConfig, GRPOTrainer
from trl_setup import Float64LogProbs, accelerate_deepspeed_on_cpu, accelerate_fsdp_on_cpu, deepspeed_config, train

import longstraw.integrations.trl as longstraw_trl
from longstraw.distributed import end_process_group
from longstraw.distributed.fsdp import full_tensor
from longstraw.integrations.trl import LongStrawGRPOConfig, LongStrawGRPOTrainer


def main() -> None:
    model_dir, out, cases = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    trl_kernel = trl.trainer.utils._ChunkedLogProbFunction
    accelerate_fsdp_on_cpu()
    if any("zero_stage" in case for case in cases.values()):
        accelerate_deepspeed_on_cpu()
    gathers: list[str] = []  # the drop-in's FSDP gathering mode of each micro-batch, to show which one ran
    sharded_compute = longstraw_trl.sharded_compute

    def recording(model, reduce=True, gather="all"):
        gathers.append(gather)
        return sharded_compute(model, reduce, gather)

    longstraw_trl.sharded_compute = recording
    for name, overrides in cases.items():
        overrides = dict(overrides)
        if "zero_stage" in overrides:
            overrides["deepspeed"] = deepspeed_config(overrides.pop("zero_stage"))
        peft = overrides.pop("lora", None)
        dtype = getattr(torch, overrides.pop("dtype", "float64"))
        # float64: TRL's log-prob kernel (which accumulates in float32) swapped for a plain one, as in one process
        trl.trainer.utils._ChunkedLogProbFunction = Float64LogProbs if dtype == torch.float64 else trl_kernel
        for label, trainer, config in (("trl", GRPOTrainer, GRPOConfig),
                                       ("longstraw", LongStrawGRPOTrainer, LongStrawGRPOConfig)):
            peft_config = None
            if peft:
                from peft import LoraConfig

                peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                         init_lora_weights=False, task_type="CAUSAL_LM")
            if label == "trl":  # LongStraw's own options are not TRL's
                settings = {k: v for k, v in overrides.items() if not k.startswith("longstraw_")}
            else:
                settings = dict(overrides)
            info: dict[str, object] = {}
            gathers.clear()
            steps, params = train(trainer, config, model_dir, out / f"{name}-{label}", peft_config=peft_config,
                                  info=info, dtype=dtype, **settings)
            steps, params = [full_tensor(s) for s in steps], full_tensor(params)
            if dist.get_rank() == 0:
                torch.save({"steps": steps, "params": params, "world": dist.get_world_size(),
                            "gathers": sorted(set(gathers)), **info},
                           out / f"{name}-{label}.pt")
            dist.barrier()


if __name__ == "__main__":
    main()
    end_process_group()
