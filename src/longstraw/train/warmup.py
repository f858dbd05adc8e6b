"""The supervised warm start: `warm_start_steps` steps of the nll loss on gold trajectories before GRPO.

A small model may never write a tool call (SmolLM2-135M-Instruct made none in 96 samples on `lookup`), so every group's
rewards are equal, every advantage 0: nothing to learn. The task writes the gold response itself (`TaskData.gold`: the
environment knows the ids and the answer): call -> observation -> answer, the observation's tokens masked out of the
loss as in a rollout. Each gold response is a group of one through `backward_group(loss="nll")` with the run's plan
(exact: the gradient through the shared prompt too), so the warm start uses GRPO's engine, prompt state and masks.

A warm-start step: `warm_start_batch` prompts from their own seed stream (never GRPO's or the held-out one's), one
gold response each, the mean of their gradients, the norm clipped at `max_grad_norm`, one AdamW step at
`warm_start_lr` (its own optimizer: GRPO's starts afresh after it). Runs on a fresh run only (a resumed run's
checkpoint already holds the warmed-up weights), in one process."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from longstraw.api.group import backward_group
from longstraw.engine.group import Group
from longstraw.engine.loss.config import LossConfig
from longstraw.train.data import derive_seed
from longstraw.train.optimizer import mean_gradient

if TYPE_CHECKING:
    from longstraw.engine.options import BackwardOptions
    from longstraw.train.config import TrainConfig
    from longstraw.train.data import TaskData

WARM_START_STREAM = 2_000_003  # the warm start's prompts: a seed stream GRPO's steps and the held-out set never use


def warm_start_examples(cfg: TrainConfig, data: TaskData, step: int) -> list[Any]:
    """The prompts of 0-based warm-start `step`, each from its own seed."""
    return [data.task.sample(random.Random(derive_seed(cfg.run.seed, WARM_START_STREAM, step, j)))
            for j in range(cfg.optimizer.warm_start_batch)]


def gold_group(data: TaskData, example: Any, stop_ids: tuple[int, ...]) -> Group:
    """One gold response to `example` as a group of one: its observation tokens masked, advantage 1 (nll ignores it)."""
    gold = data.gold(example, stop_ids)
    if gold is None:
        raise ValueError(f"task {data.cfg.task.task!r} writes no gold responses: the warm start (warm_start_steps) "
                         "needs an agent task that does (lookup)")
    ids, mask = gold
    return Group(data.encode(example), [ids], torch.ones(1, dtype=torch.float64), loss_masks=[mask])


def check_gold(cfg: TrainConfig, data: TaskData, stop_ids: tuple[int, ...]) -> None:
    """Before anything is trained: the first warm-start prompt's gold response fits --max-new-tokens (a longer one
    would teach responses the rollouts cut short)."""
    group = gold_group(data, warm_start_examples(cfg, data, 0)[0], stop_ids)
    n = group.responses[0].numel()
    if n > cfg.rollout.max_new_tokens:
        raise ValueError(f"the warm start's gold response has {n} tokens (calls, results and the answer), more than "
                         f"--max-new-tokens {cfg.rollout.max_new_tokens}: raise --max-new-tokens to at least {n}")


def warm_start(model: torch.nn.Module, cfg: TrainConfig, data: TaskData, options: BackwardOptions,
               stop_ids: tuple[int, ...], note: Any, stop: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run the warm start on `model` in place; returns its record for summary.json (losses per step, seconds).
    `note(text)`: the progress lines. `stop()`: called after each gold response's backward, raises to stop there (a
    held Ctrl-C/SIGTERM: nothing of a warm start is saved, so it need not reach the end of its step)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optimizer.warm_start_lr, weight_decay=cfg.optimizer.weight_decay)
    sft = replace(options, loss=LossConfig("nll"))  # the run's backward options with the nll loss (no KL, no clip)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(cfg.optimizer.warm_start_steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for example in warm_start_examples(cfg, data, step):
            result = backward_group(model, gold_group(data, example, stop_ids), sft)
            total += result.loss / cfg.optimizer.warm_start_batch
            stop()
        grads = mean_gradient(model, cfg.optimizer.warm_start_batch, none_computed=False)  # over the gold responses
        max_norm = cfg.optimizer.max_grad_norm if cfg.optimizer.max_grad_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
        if not math.isfinite(norm) or not math.isfinite(total):
            raise FloatingPointError(f"warm-start step {step + 1}: the nll loss is {total} and its gradient norm "
                                     f"{norm}; the weights are unchanged by it. Lower --warm-start-lr or use float32")
        optimizer.step()
        losses.append(total)
        note(f"warm start {step + 1}/{cfg.optimizer.warm_start_steps}: nll {total:.4f} | grad norm {norm:.3f} | "
             f"{time.perf_counter() - t0:.0f} s")
    optimizer.zero_grad(set_to_none=True)
    opt = cfg.optimizer
    return {"steps": opt.warm_start_steps, "batch": opt.warm_start_batch, "lr": opt.warm_start_lr, "nll": losses,
            "seconds": round(time.perf_counter() - t0, 1)}
