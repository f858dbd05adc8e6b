"""One rank of `python -m benchmarks trl-scale`: `python -m benchmarks.trl_scale_worker '<json job>' OUT_PATH`.

Launched as 2 ranks with torchrun's environment and ACCELERATE_USE_CPU=1 (accelerate's MULTI_CPU over gloo) by
`benchmarks/trl_scale.py`. The job is a shape and a list of rows; each row builds a trainer, `trl.GRPOTrainer` or
`LongStrawGRPOTrainer`, on the preset (seed 0 on every rank) and trains it for one optimizer step; the rank writes a
JSON list, one measurement per row, to OUT_PATH.rank<r>. A real run gives each row its own pair of fresh processes;
`--smoke` runs every row in one pair, DDP rows first (accelerate sets ACCELERATE_USE_FSDP=true in the environment once
it sees an FSDP plugin: it is cleared before each row).

The step: per_device_train_batch_size = G = num_generations, so each rank trains one prompt's group of G completions
(a context-parallel row: its own group and its partner's, each with half of the prompt's state); generation is a fixed
function (`_generate_single_turn` returns G fixed completions of exactly R tokens), so it costs nothing; loss grpo,
beta 0 (no reference model), float32 without autocast, plain SGD without momentum (`optim="sgd"`: no optimizer state,
so this first step's peak is every step's), TRL's gradient clipping (max_grad_norm 1), and TRL's own default
activation checkpointing unless the job turns it off (LongStraw follows it: per-layer checkpointing). FSDP rows set
`fsdp=True, fsdp_config={"version": 2}` and enable accelerate's FSDP path on CPU (`benchmarks.accelerate_cpu`);
each checks that its parameters really are DTensors. TRL rows score only the completion positions in TRL's LM head,
as TRL does on CUDA (`peers_worker._compact_head_on_every_device`; on CPU TRL would project every prompt position).

Measured per rank (all from one step, glibc's mmap threshold fixed by the parent so that peaks repeat):

* `step_peak_bytes`: VmHWM minus VmRSS at the start of the first `training_step` (the baseline: after accelerate
  prepared the model, so an FSDP rank holds only its shards there, and after the optimizer was built), the
  high-water mark reset there, read at `on_step_end` (after the optimizer step and `zero_grad`): the whole step.
  `loss_backward_peak_bytes`: the same mark read when `training_step` returns (generation stand-in, loss, backward
  and, for the drop-in, the gradient reduction), before clipping and the optimizer step.
* `absolute_hwm_bytes`: VmHWM itself at the end of the step: everything the process held at its peak (interpreter,
  libraries, parameters, DDP buckets, ...), the number that shows what sharding the parameters at rest saves.
* `param_bytes`, `grad_bytes`, `optimizer_state_bytes`: bytes of the rank's local shards (a DTensor's `to_local()`)
  of the parameters, of their gradients before the optimizer step, and of the optimizer state after it;
  `at_rest_bytes`: what stays between steps (parameters, optimizer state, gradients `zero_grad` left).
* `prompt_state_bytes`: the largest `result.stats["peak_path_state_bytes"]` of the rank's `backward_tree` calls
  (LongStraw rows; the calls are recorded through a wrapper of `longstraw.integrations.trl.backward_tree`).
* `time_s` (the step, wall clock), `loss_backward_s`, `cpu_time_s`, `cpu_pressure` (the share of the step during
  which runnable tasks waited for a CPU, system-wide: other load on the host inflates times, not peaks).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from benchmarks.common import load_bench_model
from benchmarks.launch import save_rows, worker_args
from benchmarks.worker import _cpu_stall_us, cpu_pressure
from longstraw.distributed import end_process_group
from longstraw.peak import PeakMemory, proc_status_bytes


def local_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the tensors among `tensors` as this rank holds them: a DTensor's local shard, a tensor whole."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the rank's optimizer state (accelerate's wrapper unwrapped): every tensor of every parameter's state."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return local_bytes(value for state in inner.state.values() for value in state.values())


def parameter_layout(model: torch.nn.Module) -> dict[str, Any]:
    """How the rank holds its parameters: how many are DTensors (FSDP2 shards) out of how many, and their bytes."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    return {"parameters": len(params), "dtensor_parameters": sum(isinstance(p, DTensor) for p in params),
            "sharded": bool(params) and all(isinstance(p, DTensor) for p in params),
            "param_bytes": local_bytes(params), "full_param_bytes": sum(p.numel() * p.element_size() for p in params)}


def fixed_completions(response_tokens: int) -> Callable[..., tuple[list[list[int]], None]]:
    """Stands in for `GRPOTrainer._generate_single_turn`: the k-th completion is R lower-case letters that depend on
    k, so the rewards, hence the advantages, differ within a group; no EOS (mask_truncated_completions is off)."""

    def completions(prompt_ids: list[Any], images: Any, multimodal_fields: Any, num_generations: int,
                    has_tool_images: bool = False) -> tuple[list[list[int]], None]:
        return [[97 + (k * 7 + t) % 26 for t in range(response_tokens)] for k in range(len(prompt_ids))], None

    return completions


def first_letter_reward(completions: list[str], **kwargs: Any) -> list[float | None]:
    return [float(ord(c[0]) % 5) if c else 0.0 for c in completions]


class StepMeter:
    """The measured step: `begin` at the first `training_step`, `loss_backward_done` when it returns, the optimizer
    hooks (a TrainerCallback's, `callback`) up to `on_step_end`."""

    def __init__(self) -> None:
        self.record: dict[str, Any] = {}
        self.started = False

    def begin(self, model: torch.nn.Module, optimizer: Any) -> None:
        gc.collect()  # garbage from building the trainer is neither in the baseline nor freed mid-step
        self.record.update(parameter_layout(model))
        self.record["optimizer_state_bytes_before"] = optimizer_state_bytes(optimizer)
        self.meter = PeakMemory("cpu")
        self.meter.start()
        self.stall0 = _cpu_stall_us()
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.started = True

    def loss_backward_done(self) -> None:
        self.record.update(loss_backward_peak_bytes=self.meter.peak_bytes(),
                           loss_backward_s=time.perf_counter() - self.t0)

    def callback(self, model: torch.nn.Module) -> Any:
        from transformers import TrainerCallback

        meter = self

        class Hooks(TrainerCallback):
            def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if meter.started:
                    meter.record["grad_bytes"] = local_bytes(p.grad for p in model.parameters())

            def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if meter.started:
                    meter.record["optimizer_state_bytes"] = optimizer_state_bytes(kwargs["optimizer"])

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if meter.started and "time_s" not in meter.record:
                    meter.end(model)

        return Hooks()

    def end(self, model: torch.nn.Module) -> None:
        step_s, cpu_s = time.perf_counter() - self.t0, time.process_time() - self.c0
        stall1 = _cpu_stall_us()
        left_grads = local_bytes(p.grad for p in model.parameters())  # what zero_grad left (None: nothing)
        self.record.update(
            step_peak_bytes=self.meter.peak_bytes(), baseline_rss_bytes=self.meter.base,
            absolute_hwm_bytes=self.meter.peak_absolute_bytes(), hwm_reset=self.meter.reset_ok,
            rss_after_bytes=proc_status_bytes("VmRSS"), time_s=step_s, cpu_time_s=cpu_s,
            cpu_pressure=cpu_pressure(self.stall0, stall1, step_s), grads_left_bytes=left_grads,
            at_rest_bytes=self.record["param_bytes"] + self.record.get("optimizer_state_bytes", 0) + left_grads)


def trainer_settings(shape: dict[str, Any], row: dict[str, Any], ours: bool) -> dict[str, Any]:
    """The GRPOConfig arguments of a row: one group of G per rank, one SGD step, fixed completions of R tokens; FSDP2
    when the row asks; for ours, LongStraw's plan, chunk, context parallelism and gathering."""
    g, r = int(shape["group_size"]), int(shape["response_tokens"])
    settings: dict[str, Any] = dict(
        per_device_train_batch_size=g, num_generations=g, max_completion_length=r, max_steps=1, loss_type="grpo",
        beta=0.0, optim="sgd", learning_rate=1e-6, lr_scheduler_type="constant", bf16=False, fp16=False,
        use_cpu=True, gradient_checkpointing=bool(shape["gradient_checkpointing"]),
        mask_truncated_completions=False, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, seed=0, dataloader_num_workers=0)
    if row["fsdp"]:
        settings.update(fsdp=True, fsdp_config={"version": 2})
    if ours:
        # each rank's batch is one prompt's group: a one-level tree, whose backward_tree calls the row records
        settings.update(longstraw_plan="exact", longstraw_chunk_size=int(shape["chunk_size"]),
                        longstraw_cp=int(row["cp"]), longstraw_fsdp_gather=str(row.get("gather", "all")))
    return settings


def run_row(shape: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """Build the row's trainer, train one optimizer step, return this rank's measurement (module docstring)."""
    import torch.distributed as dist
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import longstraw.integrations.trl as drop_in
    from benchmarks.accelerate_cpu import accelerate_fsdp_on_cpu
    from benchmarks.peers_worker import _compact_head_on_every_device
    from longstraw.models.tokenizer import byte_tokenizer_hf

    os.environ.pop("ACCELERATE_USE_FSDP", None)  # an earlier FSDP row's, in a shared process (--smoke)
    if row["fsdp"]:
        accelerate_fsdp_on_cpu()
    ours = row["trainer"] == "longstraw"
    if not ours:
        _compact_head_on_every_device()
    p, r = int(shape["prompt_tokens"]), int(shape["response_tokens"])
    settings = trainer_settings(shape, row, ours)
    trainer_cls, config_cls = ((drop_in.LongStrawGRPOTrainer, drop_in.LongStrawGRPOConfig) if ours
                               else (GRPOTrainer, GRPOConfig))
    model = load_bench_model(str(shape["model"]), str(shape["dtype"]))
    states: list[int] = []
    backward_tree = drop_in.backward_tree

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = backward_tree(*args, **kwargs)
        states.append(int(result.stats.get("peak_path_state_bytes", 0)))
        return result

    meter = StepMeter()
    seen: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = trainer_cls(model, reward_funcs=first_letter_reward, args=config_cls(output_dir=out_dir, **settings),
                              train_dataset=Dataset.from_dict({"prompt": ["x" * p] * 4}),
                              processing_class=byte_tokenizer_hf())
        trainer._generate_single_turn = fixed_completions(r)  # type: ignore[method-assign]
        training_step, compute_loss = trainer.training_step, trainer.compute_loss

        def measured_step(model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not meter.started:
                meter.begin(model, trainer.optimizer)
            out = training_step(model, *args, **kwargs)
            if "loss_backward_s" not in meter.record:
                meter.loss_backward_done()
            return out

        def seen_loss(model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            seen.setdefault("rows", int(inputs["completion_ids"].size(0)))
            seen.setdefault("prompt_tokens", int(inputs["prompt_mask"][0].sum()))
            seen.setdefault("completion_tokens", int(inputs["completion_mask"][0].sum()))
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.training_step = measured_step  # type: ignore[method-assign]
        trainer.compute_loss = seen_loss  # type: ignore[method-assign]
        assert trainer.model is not None
        trainer.add_callback(meter.callback(trainer.model))
        drop_in.backward_tree = recorded
        try:
            trainer.train()
        finally:
            drop_in.backward_tree = backward_tree
        if "time_s" not in meter.record:
            raise RuntimeError("the train loop ended without completing an optimizer step")
        record = {
            "id": row["id"], "status": "ok", "rank": dist.get_rank(), "world": dist.get_world_size(),
            "distributed_type": str(trainer.accelerator.distributed_type.value),
            "fsdp_enabled": bool(trainer.is_fsdp_enabled), **seen, **meter.record,
            "prompt_state_bytes": max(states) if states else None, "backward_tree_calls": len(states),
            "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
            "torch_threads": torch.get_num_threads(),
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        }
    return record


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "python -m benchmarks.trl_scale_worker '<json job>' OUT_PATH", 2)
    if args is None:
        return 2
    save_rows(json.loads(args[0]), f"{args[1]}.rank{os.environ.get('RANK', '0')}", run_row)
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
