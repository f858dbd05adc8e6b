"""The rows of `python -m benchmarks verl`: `python -m benchmarks.verl_worker '<json job>' OUT_PATH`.

Launched by `benchmarks/verl_update.py` with RANK=0, WORLD_SIZE=1, MASTER_ADDR/PORT set. The job is the shape and a list
of rows: a real run gives each row a fresh process (a list of one), `--smoke` runs them all in one process. After
each row the process writes the JSON list of the measurements so far to OUT_PATH. LongStraw's rows set
LONGSTRAW_PLAN (the row's plan) and LONGSTRAW_CHUNK_SIZE (the shape's chunk) in the environment, which
`longstraw.integrations.verl` reads inside the update.

What runs: verl on CPU (`benchmarks.verl_cpu.use_cpu`), a 1-rank gloo group, verl's `TrainingWorker` with the
fsdp2 strategy on that rank (parameters are DTensors of a 1-rank mesh), float32 parameters and mixed precision all
float32, verl's defaults otherwise (per-layer activation checkpointing on, `use_remove_padding` as the row says),
sdpa attention, and the engine the row names registered for the "cpu" device: verl's `FSDPEngineWithLMHead` or
`LongStrawFSDPEngine`. Its optimizer is replaced by SGD without momentum (no optimizer state), as the verl tests do.
The model is the shape's preset (or local directory), built with seed 0 and checked to be a model type LongStraw
supports on this transformers, saved with `save_pretrained` to a temporary directory that verl loads.

The batch is one prompt of P random token ids (seed 0) with G responses of R random ids, in verl's layout after the
rollout (`left_right_2_no_padding`): advantages the standardized rewards of the group (nonzero), old log-probs near
the random-init policy's own (-ln V ± 0.5), no reference log-probs (no KL term), loss_agg_mode token-mean, entropy
off. One `train_mini_batch`: 1 epoch, 1 mini-batch of the G rows, micro-batches of `micro_batch` rows (verl's rows;
LongStraw's engine takes the whole mini-batch as one group whatever it is).

Measured (glibc's mmap threshold fixed by the parent so that peaks repeat):

* `update_peak_bytes`: VmHWM minus VmRSS just before `train_mini_batch` (after the worker, the model, the batch and
  the optimizer were built and everything was collected), the high-water mark reset there (`longstraw.peak`), read
  when it returns: the whole update, forward, backward, gradient reduction, clipping and the SGD step.
  `forward_backward_peak_bytes`: the same mark read when the engine's `forward_backward_batch` returns.
* `absolute_hwm_bytes`: the process's VmHWM at the end of the update (interpreter, libraries, model included).
* `prompt_state_bytes` (LongStraw's rows): the largest `result.stats["prompt_state_bytes"]` of the row's
  `backward_tree` calls (`peak_path_state_bytes`: the one-prompt tree's root state), recorded through a wrapper of
  `longstraw.integrations.verl.backward_tree`.
* `time_s` (the update, wall clock), `forward_backward_s`, `cpu_time_s`, `cpu_pressure` (the share of the update
  during which runnable tasks waited for a CPU, system-wide: other load inflates times, not peaks).
* `packed_attention_mask_bytes` (verl's packed rows of more than one sequence): 5 N^2, the N x N boolean mask
  transformers builds for sdpa over a packed sequence of N tokens (its block-diagonal causal mask, N^2 bytes, held
  from the forward to the end of the backward: checkpointing keeps it for the recompute) and the float32 copy torch's
  sdpa makes of it inside each attention call (4 N^2, transient): what `flash_attention_2`'s varlen kernel on a GPU
  would not hold.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import sys
import tempfile
import time
from functools import partial
from typing import Any

import torch

from benchmarks.launch import save_rows, worker_args
from benchmarks.worker import _cpu_stall_us, cpu_pressure
from longstraw.peak import PeakMemory, proc_status_bytes


def _module(name: str) -> Any:
    """A module of verl (or its tensordict), imported when a row runs and typed Any: the main venv, where mypy runs,
    has no verl (verl 0.9 pins transformers < 5.11)."""
    return importlib.import_module(name)


def save_model(name: str, folder: str, max_length: int) -> dict[str, Any]:
    """The row's model, built with seed 0 (a preset: random init), checked, saved to `folder` for verl to load."""
    from longstraw.admission.admission import check_architecture
    from longstraw.admission.loading import load_model
    from longstraw.models.architecture import hf

    model = load_model(name, dtype="float32", device="cpu", seed=0)
    check_architecture(model, max_length)  # a model type LongStraw supports on this transformers
    hf(model).save_pretrained(folder)
    info = {"model_type": hf(model).config.model_type, "vocab_size": int(hf(model).config.vocab_size),
            "parameters": sum(p.numel() for p in model.parameters()),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    del model
    gc.collect()
    return info


def make_batch(prompt_tokens: int, group_size: int, response_tokens: int, vocab: int, seed: int = 0) -> Any:
    """One prompt's group in verl's layout after the rollout (left-padded prompts, right-padded responses; here no
    padding: every response has R tokens), as `tests/integrations/verl_setup.make_batch` builds it."""
    import numpy as np

    tensordict, tu = _module("tensordict"), _module("verl.utils.tensordict_utils")
    gen = torch.Generator().manual_seed(seed)
    g, p, r = group_size, prompt_tokens, response_tokens
    prompt = torch.randint(1, vocab, (p,), generator=gen)
    prompts = prompt.expand(g, p).clone()
    responses = torch.randint(1, vocab, (g, r), generator=gen)
    attention_mask = torch.ones(g, p + r, dtype=torch.long)
    rewards = torch.randn(g, generator=gen)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # GRPO's: nonzero, one per response
    # The random-init policy's own log-probs are about -ln V; old log-probs near them keep the ratios plausible.
    old = -math.log(vocab) + (torch.rand(g, r, generator=gen) - 0.5)
    td = tensordict.TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": torch.ones(g, r), "old_log_probs": old,
        "advantages": advantages[:, None].expand(g, r).clone(),
    }, batch_size=[g])
    tu.assign_non_tensor(td, uid=np.array(["prompt-0"] * g, dtype=object))
    return td


def build_worker(row: dict[str, Any], model_dir: str, shape: dict[str, Any]) -> Any:
    """verl's TrainingWorker with the row's engine and settings (module docstring), its optimizer SGD."""
    c = _module("verl.workers.config")
    engine_cls: Any  # verl's engine class, or LongStraw's subclass of it
    if row["engine"] == "longstraw":
        from longstraw.integrations.verl import LongStrawFSDPEngine

        engine_cls = LongStrawFSDPEngine
        # one prompt's rows: a one-level tree, whose backward_tree call the row records
        os.environ.update(LONGSTRAW_PLAN=str(row["plan"]), LONGSTRAW_CHUNK_SIZE=str(shape["chunk_size"]))
    else:
        engine_cls = _module("verl.workers.engine.fsdp.transformer_impl").FSDPEngineWithLMHead
    registry = _module("verl.workers.engine.base").EngineRegistry
    for backend in ("fsdp", "fsdp2"):
        registry._engines["language_model"][backend]["cpu"] = engine_cls
    g, micro = int(shape["group_size"]), int(row["micro_batch"])
    precision = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    padding = bool(row["remove_padding"])  # verl's use_remove_padding: pack a micro-batch's rows into one sequence
    config = c.TrainingWorkerConfig(
        model_type="language_model",
        model_config=c.HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=padding,
                                     override_config={"attn_implementation": "sdpa"}),
        engine_config=c.FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", mixed_precision=precision,
                                         use_dynamic_bsz=False, micro_batch_size_per_gpu=micro,
                                         use_torch_compile=False),
        optimizer_config=c.FSDPOptimizerConfig(lr=1e-6),
        checkpoint_config=_module("verl.trainer.config.config").CheckpointConfig())
    worker = _module("verl.workers.engine_workers").TrainingWorker(config=config)
    worker.reset()
    params = [p for p in worker.engine.module.parameters() if p.requires_grad]
    worker.engine.optimizer = torch.optim.SGD(params, lr=1e-6)  # no momentum: no optimizer state
    actor = c.ActorConfig(strategy="fsdp2", rollout_n=g, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=micro,
                          use_dynamic_bsz=False, loss_agg_mode="token-mean", use_kl_loss=False, entropy_coeff=0.0)
    worker.set_loss_fn(partial(_module("verl.workers.utils.losses").ppo_loss, config=actor))
    return worker


def packed_mask_bytes(row: dict[str, Any], shape: dict[str, Any]) -> int:
    """The N x N bool mask and its float32 copy (inside each attention call) of a packed micro-batch of several
    sequences on CPU (module docstring)."""
    if row["engine"] != "verl" or not row["remove_padding"] or int(row["micro_batch"]) < 2:
        return 0
    n = min(int(row["micro_batch"]), int(shape["group_size"])) * (int(shape["prompt_tokens"])
                                                                   + int(shape["response_tokens"]))
    return n * n * (1 + 4)


def run_row(shape: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """Build the row's worker, run one `train_mini_batch`, return the measurement (module docstring)."""
    from benchmarks.verl_cpu import use_cpu

    use_cpu()
    import torch.distributed as dist

    tu = _module("verl.utils.tensordict_utils")
    left_right_2_no_padding = _module("verl.workers.utils.padding").left_right_2_no_padding
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    g, p, r = int(shape["group_size"]), int(shape["prompt_tokens"]), int(shape["response_tokens"])
    states: list[int] = []
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="longstraw-verl-bench-") as model_dir:
        record["model"] = save_model(str(shape["model"]), model_dir, p + r)
        worker = build_worker(row, model_dir, shape)
        engine = worker.engine
        module = engine.module
        from torch.distributed.tensor import DTensor

        params = list(module.parameters())
        record.update(
            sharded=bool(params) and all(isinstance(q, DTensor) for q in params),
            gradient_checkpointing=bool(getattr(module, "is_gradient_checkpointing", False)),
            engine_class=type(engine).__name__,
            attn_implementation=str(getattr(module.config, "_attn_implementation", None)),
        )
        data = left_right_2_no_padding(make_batch(p, g, r, record["model"]["vocab_size"]))
        tu.assign_non_tensor(data, temperature=1.0, calculate_entropy=False, global_batch_size=g,
                             mini_batch_size=g, epochs=1, seed=42, dataloader_kwargs={"shuffle": False},
                             compute_loss=True)
        if row["engine"] == "longstraw":
            import longstraw.integrations.verl as integration

            backward_tree = integration.backward_tree

            def recorded(*args: Any, **kwargs: Any) -> Any:
                result = backward_tree(*args, **kwargs)
                states.append(int(result.stats.get("peak_path_state_bytes", 0)))
                return result

            integration.backward_tree = recorded
        meter = PeakMemory("cpu")
        forward_backward = engine.forward_backward_batch
        clock: dict[str, float] = {}

        def measured(*args: Any, **kwargs: Any) -> Any:
            out = forward_backward(*args, **kwargs)
            if not kwargs.get("forward_only", False) and "forward_backward_s" not in record:
                record.update(forward_backward_peak_bytes=meter.peak_bytes(),
                              forward_backward_s=time.perf_counter() - clock["t0"])
            return out

        engine.forward_backward_batch = measured
        gc.collect()  # garbage from building the worker is neither in the baseline nor freed mid-update
        meter.start()
        stall0 = _cpu_stall_us()
        clock["t0"], c0 = time.perf_counter(), time.process_time()
        worker.train_mini_batch(data)
        step_s, cpu_s = time.perf_counter() - clock["t0"], time.process_time() - c0
        stall1 = _cpu_stall_us()
        record.update(
            id=row["id"], status="ok", update_peak_bytes=meter.peak_bytes(), baseline_rss_bytes=meter.base,
            absolute_hwm_bytes=meter.peak_absolute_bytes(), hwm_reset=meter.reset_ok,
            rss_after_bytes=proc_status_bytes("VmRSS"), time_s=step_s, cpu_time_s=cpu_s,
            cpu_pressure=cpu_pressure(stall0, stall1, step_s),
            prompt_state_bytes=max(states) if states else None, backward_tree_calls=len(states),
            packed_attention_mask_bytes=packed_mask_bytes(row, shape),
            longstraw_plan=os.environ.get("LONGSTRAW_PLAN") if row["engine"] == "longstraw" else None,
            longstraw_chunk_size=os.environ.get("LONGSTRAW_CHUNK_SIZE") if row["engine"] == "longstraw" else None,
            torch_threads=torch.get_num_threads(), malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            rows=g, prompt_tokens=p, response_tokens=r,
        )
        del worker, engine, module, params, data
        if row["engine"] == "longstraw":
            integration.backward_tree = backward_tree
    return record


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "python -m benchmarks.verl_worker '<json job>' OUT_PATH", 2)
    if args is None:
        return 2
    from longstraw.distributed import end_process_group

    save_rows(json.loads(args[0]), args[1], run_row)
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
